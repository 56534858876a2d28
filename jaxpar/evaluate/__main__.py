"""`python -m jaxpar.evaluate --model SRC --tasks T1,T2 [--num_fewshot K] [--limit N] [--include_path DIR]
[--log_samples] [--output_path DIR] [--apply_chat_template [NAME]] [--system_instruction TEXT]
[--fewshot_as_multiturn [BOOL]] [--batch_size B] [--max_gen_toks N] [--config.mesh.* ...]`

lm-eval's tasks on a jaxpar model laid out on the mesh the `--config.*` overrides give: SRC is a run directory
(`DIR@STEP` for another checkpoint than the latest), an export, `hf:DIR` or `hf:ORG/NAME`. Runs through lm-eval's
own `simple_evaluate`; the results JSON and the samples (`--log_samples`) are written by lm-eval's
`EvaluationTracker` under `--output_path`, in its format; a table at the end. Tasks are loaded before the model:
a task whose dataset is neither local nor in the Hugging Face cache, where nothing can be fetched, is one line
naming the dataset and the `hf download` command. `--fewshot_as_multiturn` is lm-eval's CLI flag: true/1/yes
(bare: true), anything else false; unset, true with `--apply_chat_template` and false without (true without it is
an error). Guide: docs/evaluate.md.
"""
from __future__ import annotations

import argparse
import sys

import jax

from jaxpar.cluster import distributed
from jaxpar.errors import ConfigError
from jaxpar.evaluate.tasks import load_tasks, register


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(the flags, the `--config.KEY=VALUE` overrides); anything else is refused by argparse."""
    p = argparse.ArgumentParser(prog="python -m jaxpar.evaluate", description=__doc__.split("\n\n")[1])
    p.add_argument("--model", required=True, help="a run directory[@STEP], an export, hf:DIR or hf:ORG/NAME")
    p.add_argument("--tasks", required=True, help="lm-eval task (or group) names, comma-separated")
    p.add_argument("--num_fewshot", type=int, default=None)
    p.add_argument("--limit", type=float, default=None, help="documents per task (a fraction when < 1)")
    p.add_argument("--include_path", default=None, help="a folder of task YAMLs")
    p.add_argument("--log_samples", action="store_true", help="write each request and response (--output_path)")
    p.add_argument("--output_path", default=None, help="where lm-eval's results (and samples) JSON go")
    p.add_argument("--apply_chat_template", nargs="?", const=True, default=False,
                   help="render prompts with the model's chat template (optionally a template's name)")
    p.add_argument("--system_instruction", default=None)
    p.add_argument("--fewshot_as_multiturn", type=lambda x: x.lower() in ("true", "1", "yes"), nargs="?", const=True,
                   default=None, metavar="BOOL", help="few-shot examples as chat turns (default: with "
                                                      "--apply_chat_template)")
    p.add_argument("--batch_size", type=int, default=8, help="rows per forward pass")
    p.add_argument("--max_gen_toks", type=int, default=256, help="generation's default token budget")
    overrides = [a for a in argv if a.startswith("--config.")]
    return p.parse_args([a for a in argv if not a.startswith("--config.")]), overrides


def multiturn(args) -> bool:
    """`--fewshot_as_multiturn` as lm-eval's CLI resolves it (`EvaluatorConfig`): unset, whether a chat template is
    applied. Raises ConfigError: true without `--apply_chat_template`."""
    if args.fewshot_as_multiturn is None:
        return bool(args.apply_chat_template)
    if args.fewshot_as_multiturn and not args.apply_chat_template:
        raise ConfigError("--fewshot_as_multiturn renders the few-shot examples as chat turns: give "
                          "--apply_chat_template too (or leave it out).")
    return bool(args.fewshot_as_multiturn)


def run(args, overrides: list[str]) -> dict:
    """Load the tasks, then the model, evaluate (lm-eval's `simple_evaluate`), write lm-eval's files; -> results."""
    from lm_eval import simple_evaluate
    from lm_eval.loggers import EvaluationTracker

    chat_turns = multiturn(args)
    register()
    names = [t for t in args.tasks.split(",") if t]
    manager = load_tasks(names, args.include_path)
    model_args = {"model": args.model, "max_gen_toks": args.max_gen_toks} | {
        a[2:].split("=", 1)[0]: a.split("=", 1)[1] for a in overrides}
    tracker = EvaluationTracker(output_path=args.output_path) if args.output_path else None
    results = simple_evaluate(
        model="jaxpar", model_args=model_args, tasks=names, num_fewshot=args.num_fewshot, batch_size=args.batch_size,
        limit=int(args.limit) if args.limit and args.limit >= 1 else args.limit, log_samples=args.log_samples,
        evaluation_tracker=tracker, system_instruction=args.system_instruction,
        apply_chat_template=args.apply_chat_template, fewshot_as_multiturn=chat_turns,
        task_manager=manager)
    write(results, tracker, args.log_samples)
    return results


def write(results: dict, tracker, log_samples: bool) -> None:
    """lm-eval's results JSON (and with `log_samples` one JSONL of samples per task) through its tracker (process 0:
    every process computed the same results)."""
    if tracker is None or jax.process_index() != 0:
        return
    samples = results.pop("samples") if log_samples else None
    tracker.save_results_aggregated(results=results, samples=samples)
    for task in results["configs"] if samples else ():
        tracker.save_results_samples(task_name=task, samples=samples[task])
    if samples is not None:
        results["samples"] = samples


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse(sys.argv[1:] if argv is None else argv)
    try:
        distributed.join()  # (several processes: each evaluates every request on the global mesh; process 0 writes)
        results = run(args, overrides)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from lm_eval.utils import make_table

    if jax.process_index() != 0:
        return 0
    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
