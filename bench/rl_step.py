"""A GRPO step's cost on GSM8K-shaped rounds, side by side in one run (prints JSON): 8 prompts of 192 tokens x
G = 8 completions of 16 tokens (a random tiny Llama, byte tokens, no end of turn: every completion runs to its
16), one CPU device, `model.seq_len` 256; the rows one completion each (`grpo.shared_prompt=False`) and the
shared-prompt rows (the default, `jaxpar/rl/rows.py`), and optionally another checkout (`--baseline DIR`, e.g. a
worktree of main 31bb3e2, before one prefill per group and the shared rows) running the same `train.py` command.

Per variant: CPU seconds and wall seconds per step (two runs of `--short` and `--long` steps, the difference
divided by the steps between: startup and compiling cancel), the seconds of sampling and of training per step and
the round's prefill and training positions as the run logs them (`time/*`, `tokens/*`: absent on older checkouts).

    python bench/rl_step.py [--baseline /path/to/checkout] [--short 3] [--long 9]

Results: docs/results/rl.md.
"""
import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
PROMPTS, G, PROMPT_LEN, NEW, SEQ = 8, 8, 200, 16, 256


def material(root: str) -> None:
    """The model (hf:ROOT/model: Llama, hidden 128, 4 layers, byte tokens), the prompt records, the reward."""
    import jax
    from jaxpar.data import ByteTokenizer
    from jaxpar.formats import hf
    from jaxpar.model import ModelConfig, init_params
    from jaxpar.config import padded_vocab

    tok = ByteTokenizer()
    cfg = ModelConfig(vocab_size=padded_vocab(tok.vocab_size, 1), vocab_real=tok.vocab_size, seq_len=SEQ, layers=4,
                      embed=128, heads=4, kv_heads=2, mlp=384, arch="llama", tie_embeddings=False)
    os.makedirs(f"{root}/model", exist_ok=True)
    hf.save(jax.device_get(init_params(cfg, jax.random.key(0))), cfg, tok, f"{root}/model",
            "float32", 10 ** 9)
    rng = np.random.default_rng(0)
    with open(f"{root}/prompts.jsonl", "w") as f:
        for _ in range(400):
            words = " ".join("".join(rng.choice(list("abcdefghij"), 4)) for _ in range(PROMPT_LEN // 5))
            f.write(json.dumps({"prompt": words[:PROMPT_LEN - 8], "solution": "x"}) + "\n")
    with open(f"{root}/reward.py", "w") as f:
        f.write("def odd(completion_ids, **kw):\n    return [sum(i % 2 for i in c) / len(c) for c in completion_ids]\n")


def run(checkout: str, root: str, steps: int, over: list) -> tuple[float, list]:
    """`train.py` in `checkout` for `steps` steps: (its CPU seconds, its metrics rows)."""
    work = tempfile.mkdtemp(dir=root)
    cmd = [sys.executable, "train.py", "--config", "configs/finetune_demo_grpo.py", f"--workdir={work}",
           f"--config.init_from=hf:{root}/model", f"--config.data.sources={root}/prompts.jsonl",
           "--config.data.val_source=", f"--config.data.cache_dir={root}/cache-{os.path.basename(checkout)}",
           f"--config.grpo.rewards={root}/reward.py:odd", "--config.mesh.data=1", "--config.mesh.tensor=1",
           f"--config.model.seq_len={SEQ}", f"--config.grpo.max_completion_length={NEW}",
           f"--config.grpo.num_generations={G}", f"--config.train.global_batch_size={PROMPTS}",
           f"--config.train.steps={steps}", "--config.log.every_steps=1", "--config.eval.every_steps=1000",
           "--config.checkpoint.every_steps=1000", "--config.log.progress=False", *over]
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1", "PYTHONPATH": checkout}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        raise SystemExit(f"{checkout}: train.py failed:\n{done.stderr[-3000:]}")
    with open(os.path.join(work, "metrics.jsonl")) as f:
        rows = [r for r in map(json.loads, f) if "loss" in r]
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, rows


def measure(checkout: str, root: str, short: int, long: int, over: list) -> dict:
    (cpu_a, _), (cpu_b, rows) = run(checkout, root, short, over), run(checkout, root, long, over)
    later = rows[short:]
    mean = lambda k: float(np.mean([r[k] for r in later])) if all(k in r for r in later) else None  # noqa: E731
    return {"cpu_s_per_step": (cpu_b - cpu_a) / (long - short), "step_time_s": mean("step_time_s"),
            "time/generate_s": mean("time/generate_s"), "time/train_s": mean("time/train_s"),
            "tokens/prefill": mean("tokens/prefill"), "tokens/train": mean("tokens/train"),
            "reward": mean("reward")}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", default="", help="another checkout to run the same command in (e.g. main 31bb3e2)")
    ap.add_argument("--short", type=int, default=3)
    ap.add_argument("--long", type=int, default=9)
    a = ap.parse_args()
    root = tempfile.mkdtemp(prefix="rl_step_")
    material(root)
    out = {"workload": {"prompts": PROMPTS, "num_generations": G, "prompt_tokens": PROMPT_LEN - 8, "new_tokens": NEW,
                        "seq_len": SEQ, "devices": 1}, "machine": f"{platform.machine()}, {os.cpu_count()} cores"}
    variants = ([("baseline", a.baseline, [])] if a.baseline else []) + [
        ("row_each", REPO, ["--config.grpo.shared_prompt=False"]), ("shared_prompt", REPO, [])]
    for name, checkout, over in variants:
        out[name] = measure(os.path.abspath(checkout), root, a.short, a.long, over)
        print(json.dumps({name: out[name]}), file=sys.stderr, flush=True)
    base = out.get("baseline", out["row_each"])["cpu_s_per_step"]
    against = "baseline" if a.baseline else "row_each"
    out[f"cpu_ratio_shared_to_{against}"] = out["shared_prompt"]["cpu_s_per_step"] / base
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
