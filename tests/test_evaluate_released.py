"""lm-eval over jaxpar on checkpoints shaped like released ones (tests/released.py: a Qwen2.5-style and a Llama
3.1-style chat template, a generation_config.json declaring several end ids, Llama's BOS-adding tokenizer) against
lm-eval's own `hf` backend: greedy generations stop at every end id the checkpoint declares, as transformers'
`generate` stops them; and `python -m jaxpar.evaluate --apply_chat_template --num_fewshot 2` renders the prompts
(few-shot examples as chat turns, lm-eval's default there) and scores them as lm-eval's own CLI does with
`--model hf`. Each style is built once (torch)."""
import glob
import json
import os
import sys

import jax
import numpy as np
import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("torch")
pytest.importorskip("transformers")

from released import STYLES, build  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS = os.path.join(ROOT, "tests/fixtures/lm_eval")
REPLY = {"qwen": "<|im_start|>assistant", "llama": "<|start_header_id|>assistant"}  # where a template's turn begins


@pytest.fixture(scope="module", params=list(STYLES))
def checkpoint(request, tmp_path_factory):
    """(style, its directory, {end token: id})."""
    directory = tmp_path_factory.mktemp(request.param)
    _, ids = build(directory, request.param)
    os.chdir(ROOT)  # the tasks' data_files are relative to the repository root
    return request.param, str(directory), ids


@pytest.fixture(autouse=True)
def fixture_tasks_only(monkeypatch):
    """lm-eval's TaskManagers (ours, and each command line's own) index the fixtures' task YAMLs only, not lm-eval's
    thousands of built-in ones (10-15 s per TaskManager here; the tasks run are the same)."""
    from lm_eval.tasks import TaskManager

    init = TaskManager.__init__
    monkeypatch.setattr(TaskManager, "__init__", lambda self, *a, include_defaults=False, **kw: init(
        self, *a, include_defaults=include_defaults, **kw))


def samples_of(directory: str, task: str) -> list[dict]:
    (path,) = glob.glob(os.path.join(directory, "**", f"samples_{task}_*.jsonl"), recursive=True)
    with open(path) as f:
        return sorted(map(json.loads, f), key=lambda s: s["doc_id"])


def test_generations_stop_at_every_end_id_the_checkpoint_declares(checkpoint):
    """`generate_until` through JaxparLM equals the hf backend's (transformers' `generate`, which stops at
    generation_config.json's end ids); without the end id only generation_config.json declares, they would not."""
    from lm_eval import simple_evaluate
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from jaxpar.evaluate.lm import JaxparLM
    from jaxpar.generate.source import on_layout

    style, directory, ids = checkpoint
    evaluate = lambda lm: sorted(simple_evaluate(  # noqa: E731
        model=lm, tasks=["jaxpar_ends"], task_manager=TaskManager(include_path=TASKS),
        log_samples=True)["samples"]["jaxpar_ends"], key=lambda s: s["doc_id"])
    want = evaluate(HFLM(pretrained=directory, dtype="float32", batch_size=4, device="cpu"))
    lm = JaxparLM(source=on_layout("hf:" + directory, [], 8, devices=jax.devices()[:1]), batch_size=8)  # one wave
    assert set(ids.values()) <= set(lm.end_ids)
    got = evaluate(lm)
    assert [s["arguments"] for s in got] == [s["arguments"] for s in want]
    texts = [s["resps"][0][0] for s in want]
    assert [s["resps"][0][0] for s in got] == texts
    swap = ids[STYLES[style]["swap"]]  # declared by generation_config.json only (not the tokenizer's EOS)
    lm.end_ids = tuple(i for i in lm.end_ids if i != swap)
    requests = [Instance("generate_until", s["doc"], tuple(s["arguments"][0]), i)
                for i, s in enumerate(got)]
    longer = lm.generate_until(requests)
    assert longer != texts, texts


def test_chat_few_shot_command_line_equals_lm_eval_command_line(checkpoint, tmp_path, monkeypatch, capsys):
    """`python -m jaxpar.evaluate --apply_chat_template --num_fewshot 2` and `lm-eval --model hf` with the same flags
    (its CLI in-process): the same prompts (each few-shot example its own turn) and log-likelihoods (rel 1e-4),
    the same metrics."""
    import lm_eval.__main__

    from jaxpar.evaluate.__main__ import main

    style, directory, _ = checkpoint
    flags = ["--tasks", "jaxpar_mc_fewshot", "--include_path", TASKS, "--apply_chat_template", "--num_fewshot", "2",
             "--log_samples", "--batch_size", "4"]
    monkeypatch.setattr(lm_eval.__main__, "setup_logging", lambda: None)  # (its stderr handler would outlive the test)
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")  # (what the command line sets: undone after the test)
    monkeypatch.setattr(sys, "argv", ["lm-eval", "run", "--model", "hf", "--model_args",
                                      f"pretrained={directory},dtype=float32", "--device", "cpu", *flags,
                                      "--output_path", str(tmp_path / "hf")])
    lm_eval.__main__.cli_evaluate()
    assert main(["--model", "hf:" + directory, *flags, "--output_path", str(tmp_path / "jaxpar")]) == 0
    capsys.readouterr()
    want, got = samples_of(str(tmp_path / "hf"), "jaxpar_mc_fewshot"), samples_of(str(tmp_path / "jaxpar"),
                                                                                  "jaxpar_mc_fewshot")
    assert len(got) == len(want) > 0
    for a, b in zip(got, want):
        assert a["arguments"] == b["arguments"], (a["doc_id"], a["arguments"], b["arguments"])
        context = b["arguments"]["gen_args_0"]["arg_0"]
        assert context.count(REPLY[style]) == 3, context  # two examples' turns and the reply's
        np.testing.assert_allclose([float(r[0][0]) for r in a["resps"]], [float(r[0][0]) for r in b["resps"]],
                                   rtol=1e-4, err_msg=f"doc {a['doc_id']}")
        assert a["acc"] == b["acc"] and a["acc_norm"] == b["acc_norm"], a["doc_id"]


def test_fewshot_as_multiturn_follows_lm_eval_command_line(capsys):
    """Unset: on with --apply_chat_template, off without; true/1/yes or bare is on, anything else off; on without
    --apply_chat_template is one line (before any task or model is read)."""
    from jaxpar.evaluate.__main__ import main, multiturn, parse

    base = ["--model", "hf:none", "--tasks", "jaxpar_mc"]
    turns = lambda *flags: multiturn(parse(base + list(flags))[0])  # noqa: E731
    assert turns("--apply_chat_template") and not turns()
    assert turns("--apply_chat_template", "--fewshot_as_multiturn")
    assert turns("--apply_chat_template", "--fewshot_as_multiturn", "yes")
    assert not turns("--apply_chat_template", "--fewshot_as_multiturn", "false")
    assert not turns("--fewshot_as_multiturn", "0")
    assert main(base + ["--fewshot_as_multiturn"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --fewshot_as_multiturn") and "--apply_chat_template" in err[0]


def test_a_pipelined_layout_picks_its_microbatches(checkpoint):
    """mesh.stage microbatches where none are given and the config's do not fit the schedule (fewer than the stages;
    interleaved 1F1B: not a multiple of them), the config's where they fit or are given; `load`'s mesh path
    (`python -m jaxpar.generate --config.mesh.stage=2`) as `on_layout`'s (test_evaluate.py's 1F1B layout)."""
    from jaxpar.config import base_config
    from jaxpar.generate import source

    c = base_config()
    c.mesh.stage = 2

    def picked(microbatches, given=False, **pipeline):
        c.pipeline.update(pipeline)
        c.train.microbatches = microbatches
        source.pick_microbatches(c, given)
        return int(c.train.microbatches)

    assert picked(1) == 2 and picked(3) == 3 and picked(1, given=True) == 1
    assert picked(3, schedule="1f1b", virtual_stages=2) == 2 and picked(4) == 4
    got = source.load("hf:" + checkpoint[1], {"stage": 2})
    assert int(got.config.train.microbatches) == 2 and dict(got.steps.mesh.shape)["stage"] == 2
