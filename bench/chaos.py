"""Chaos test of crash safety: SIGKILL a training subprocess at random moments, restart it, compare the end bitwise.

    python bench/chaos.py [--kills 10] [--save_kills 5] [--startup_kills 2] [--steps 60] [--every 4] [--seed 0]

1. Trains a tiny GPT (`train.py`, 8 fake CPU devices, (data, tensor) = (4, 2), async checkpoints every `--every`
   steps, the last `--keep` kept) uninterrupted to `--steps` in one workdir.
2. In a second workdir, starts the same command and kills it with SIGKILL (no chance to clean up), `--kills` times,
   restarting it after each kill, then lets it finish. Each kill lands at a random moment (seeded), in random order:
     - "save" kills: when Orbax's temporary directory of an asynchronous save (`<step>.orbax-checkpoint-tmp*`)
       appears (the n-th new one of this process, n random in 1..2), after a random 0-20 ms: mid-save;
     - "startup" kills: uniform over the process's start-up (imports, compile, the resume check and restore),
       as long as the uninterrupted run's took;
     - "train" kills: uniform over the 2 x `--every` steps after this process's first logged step (which may be
       during the save of a checkpoint or the deletion of an old one).
   After each run, every checkpoint listed as complete (what a restart may pick up) is restored and compared with
   the uninterrupted run's checkpoint of the same step (that run keeps them all), bitwise.
3. Restores both runs' latest checkpoints read-only onto the host and compares every leaf of the train state
   (params, optimizer state, step, rng, loss scale, counters) byte for byte (dtype, shape and raw bytes).

Prints one JSON object: kills (by kind, and how many interrupted a save: its temporary folder was left), resumes,
steps redone (steps trained more than once, from metrics.jsonl: every step is logged), whether every logged loss
equals the uninterrupted run's, bytes lost (bytes of state leaves that differ; 0 when equal), the checkpoints
checked after kills and wall times. Exit code 0 when the final states and every checked checkpoint are bitwise
equal, else 1. Not a test (it takes minutes); CI runs tests/test_preemption.py and tests/test_checkpoint.py.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TMP_MARK = ".orbax-checkpoint-tmp"


def make_corpus(directory: str, seed: int = 0) -> str:
    """A small synthetic text corpus; returns its glob."""
    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(seed)
    words = ["to", "be", "or", "not", "that", "is", "the", "question", "whether", "tis", "nobler", "in", "mind"]
    with open(os.path.join(directory, "a.txt"), "w") as f:
        f.write(" ".join(rng.choice(words, 40000)) + "\n")
    return os.path.join(directory, "*.txt")


def command(args, workdir: str, corpus: str, cache: str, keep: int | None = None) -> list[str]:
    return [sys.executable, os.path.join(ROOT, "train.py"), "--config", os.path.join(ROOT, "configs/shakespeare.py"),
            "--workdir", workdir, f"--config.data.corpus={corpus}", f"--config.data.cache_dir={cache}",
            "--config.mesh.data=4", "--config.mesh.tensor=2", "--config.model.layers=2", "--config.model.embed=64",
            "--config.model.heads=4", "--config.model.mlp=256", "--config.model.seq_len=32",
            "--config.train.global_batch_size=8", f"--config.train.steps={args.steps}",
            "--config.optim.warmup_steps=10", "--config.optim.decay_steps=100",
            f"--config.checkpoint.every_steps={args.every}", f"--config.checkpoint.keep={keep or args.keep}",
            "--config.checkpoint.async_save=True", "--config.log.every_steps=1", "--config.log.progress=False",
            f"--config.eval.every_steps={10 * args.steps}", "--config.eval.batches=1"]


def env() -> dict:
    return dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")


def logged(workdir: str) -> list[dict]:
    """metrics.jsonl's records (a torn last line, if a kill ever made one, is counted apart)."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                out.append({"torn": line})
    return out


def save_dirs(workdir: str) -> list[str]:
    try:
        return [n for n in os.listdir(os.path.join(workdir, "checkpoints")) if TMP_MARK in n]
    except FileNotFoundError:
        return []


def run_steps(records) -> list[int]:
    return [r["step"] for r in records if "step" in r]


def start(cmd, log_path):
    log = open(log_path, "w")
    return subprocess.Popen(cmd, env=env(), stdout=log, stderr=subprocess.STDOUT, text=True), log


def start_step(log_path: str) -> int | None:
    with open(log_path) as f:
        for line in f:
            if "start step " in line:
                return int(line.split("start step ")[1].split(",")[0])
    return None


def complete_steps(workdir: str) -> list[int]:
    """The steps a restart could restore (complete checkpoints), as the trainer lists them."""
    from jaxpar.checkpoint import Checkpointer

    if not os.path.isdir(os.path.join(workdir, "checkpoints")):
        return []
    with Checkpointer(workdir, 1, 1, async_save=False, read_only=True) as ck:
        return ck.all_steps()


def read_state(workdir: str, step: int | None = None):
    """(step, {leaf path: numpy array}) of WORKDIR's checkpoint `step` (default: the latest complete one), read-only,
    on the host CPU."""
    import jax

    from jaxpar import data
    from jaxpar.checkpoint import Checkpointer
    from jaxpar.optim import make_optimizer
    from jaxpar.runs import read_config
    from jaxpar.step import init_state, model_config

    config = read_config(workdir)
    tok = data.load_tokenizer(os.path.join(workdir, "tokenizer"))
    cfg = model_config(config, max(int(config.model.vocab_size), tok.vocab_size), int(config.mesh.tensor))
    shapes = jax.eval_shape(lambda: init_state(cfg, make_optimizer(config), 0))
    dev = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=dev), shapes)
    with Checkpointer(workdir, 1, 1, async_save=False, read_only=True) as ck:
        step = ck.latest_step() if step is None else step
        state, _ = ck.restore(step, target)
    flat = jax.tree_util.tree_flatten_with_path(jax.device_get(state))[0]
    return step, {jax.tree_util.keystr(p): np.asarray(x) for p, x in flat}


def differing(a: dict, b: dict) -> list[str]:
    """Leaves of two flattened states that are not bitwise equal (dtype, shape, bytes), or in one only."""
    return [k for k in a if k not in b or a[k].dtype != b[k].dtype or a[k].shape != b[k].shape
            or a[k].tobytes() != b[k].tobytes()] + [k for k in b if k not in a]


def same(a: dict, b: dict) -> bool:
    return not differing(a, b)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=10, help="SIGKILLs before the run may finish")
    ap.add_argument("--save_kills", type=int, default=5, help="how many of them aim at an asynchronous save")
    ap.add_argument("--startup_kills", type=int, default=2, help="how many land during start-up (the rest: training)")
    ap.add_argument("--steps", type=int, default=60, help="train.steps")
    ap.add_argument("--every", type=int, default=4, help="checkpoint.every_steps")
    ap.add_argument("--keep", type=int, default=2, help="checkpoint.keep")
    ap.add_argument("--seed", type=int, default=0, help="seeds the kill moments")
    ap.add_argument("--dir", default="", help="working directory (default: a temporary one, removed at the end)")
    ap.add_argument("--out", default="", help="also write the JSON here")
    ap.add_argument("--timeout", type=float, default=900, help="seconds any one process may run")
    args = ap.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # this process only reads checkpoints back, on the host
    from absl import logging as absl_logging

    absl_logging.set_verbosity(absl_logging.ERROR)  # Orbax warns about every read-only manager
    if min(args.save_kills, args.startup_kills) < 0 or args.save_kills + args.startup_kills > args.kills:
        ap.error("need --save_kills, --startup_kills >= 0 and their sum <= --kills")

    t_begin = time.perf_counter()
    root = args.dir or tempfile.mkdtemp(prefix="jaxpar-chaos-")
    os.makedirs(root, exist_ok=True)
    corpus, cache = make_corpus(os.path.join(root, "corpus")), os.path.join(root, "cache")
    ref_dir, chaos_dir = os.path.join(root, "uninterrupted"), os.path.join(root, "chaos")
    for d in (ref_dir, chaos_dir):
        shutil.rmtree(d, ignore_errors=True)
    say = lambda *a: print("chaos:", *a, file=sys.stderr, flush=True)  # noqa: E731

    # 1. the uninterrupted run: its start-up time and step time set the scale of the kill moments
    t0 = time.perf_counter()
    # (it keeps every checkpoint, to compare each one the chaos run leaves behind)
    proc, log = start(command(args, ref_dir, corpus, cache, keep=args.steps), os.path.join(root, "uninterrupted.log"))
    first_step_at = None
    while proc.poll() is None:
        if first_step_at is None and logged(ref_dir):
            first_step_at = time.perf_counter() - t0
        time.sleep(0.01)
    log.close()
    t_ref = time.perf_counter() - t0
    if proc.returncode != 0:
        say(open(os.path.join(root, "uninterrupted.log")).read())
        raise SystemExit(f"the uninterrupted run failed with exit code {proc.returncode}")
    first_step_at = first_step_at or t_ref
    t_step = (t_ref - first_step_at) / max(args.steps - 1, 1)
    say(f"uninterrupted: {t_ref:.1f} s (start-up {first_step_at:.1f} s, {t_step * 1e3:.0f} ms/step)")

    # 2. kill and restart
    rng = np.random.default_rng(args.seed)
    kinds = (["save"] * args.save_kills + ["startup"] * args.startup_kills
             + ["train"] * (args.kills - args.save_kills - args.startup_kills))
    rng.shuffle(kinds)
    runs, t_chaos, verified, bad = [], time.perf_counter(), 0, []
    reference = {}  # step -> the uninterrupted run's state at that step
    for i in range(args.kills + 1):
        kind = kinds[i] if i < args.kills else "none"
        log_path = os.path.join(root, f"chaos_{i}.log")
        t_start, lines_before = time.perf_counter(), len(logged(chaos_dir))
        proc, log = start(command(args, chaos_dir, corpus, cache), log_path)
        deadline, at, old = t_start + args.timeout, None, set(save_dirs(chaos_dir))  # old: a killed save's leftover
        if kind == "startup":
            at = t_start + rng.uniform(0, first_step_at)
        elif kind == "train":
            delay = rng.uniform(0, 2 * args.every * t_step)
        elif kind == "save":
            nth, delay, seen = int(rng.integers(1, 3)), rng.uniform(0, 0.02), set()
        killed = False
        while proc.poll() is None:
            now = time.perf_counter()
            if now > deadline:
                proc.kill()
                raise SystemExit(f"run {i} ran past --timeout; see {log_path}")
            if kind == "save" and at is None:
                seen.update(set(save_dirs(chaos_dir)) - old)
                if len(seen) >= nth:
                    at = now + delay
            if kind == "train" and at is None and run_steps(logged(chaos_dir)[lines_before:]):
                at = now + delay
            if kind != "none" and at is not None and now >= at:
                proc.send_signal(signal.SIGKILL)
                killed = True
                break
            time.sleep(0.002 if kind == "save" else 0.005)
        proc.wait()
        log.close()
        left = set(save_dirs(chaos_dir)) - old  # a save the kill interrupted (the next start removes it)
        mine = run_steps(logged(chaos_dir)[lines_before:])
        for step in complete_steps(chaos_dir):  # what a restart may pick up equals the uninterrupted run's, bitwise
            if step not in reference:
                reference[step] = read_state(ref_dir, step)[1]
            verified += 1
            if not same(reference[step], read_state(chaos_dir, step)[1]):
                bad.append({"after_run": i, "step": step})
        run = {"kind": kind, "killed": killed, "exit": proc.returncode, "start_step": start_step(log_path),
               "steps_logged": [mine[0], mine[-1]] if mine else [],
               "killed_mid_save": killed and bool(left), "seconds": round(time.perf_counter() - t_start, 2)}
        runs.append(run)
        say(f"run {i}: {run}")
        if not killed:
            if proc.returncode != 0:
                raise SystemExit(f"run {i} exited with {proc.returncode}; see {log_path}")
            break  # the run finished (before its kill moment, or the final one)
    t_chaos = time.perf_counter() - t_chaos

    # 3. compare
    step_a, a = read_state(ref_dir)
    step_b, b = read_state(chaos_dir)
    differ = differing(a, b)
    bytes_lost = int(sum(a[k].nbytes if k in a else b[k].nbytes for k in differ))
    ref_logs, chaos_logs = logged(ref_dir), logged(chaos_dir)
    ref_loss = {r["step"]: r["loss"] for r in ref_logs}
    counts = {}
    for r in chaos_logs:
        if "step" in r:
            counts[r["step"]] = counts.get(r["step"], 0) + 1
    kills = [r for r in runs if r["killed"]]
    result = {
        "steps": args.steps, "checkpoint_every": args.every, "keep": args.keep, "seed": args.seed,
        "kills": len(kills),
        "kills_by_kind": {k: sum(r["kind"] == k for r in kills) for k in ("save", "startup", "train")},
        "kills_mid_save": sum(r["killed_mid_save"] for r in kills),
        "kills_before_its_first_step": sum(not r["steps_logged"] for r in kills),
        "resumes": sum(1 for r in runs if (r["start_step"] or 0) > 0),
        "steps_redone": int(sum(c - 1 for c in counts.values())),
        "steps_missing_from_log": sorted(set(range(1, args.steps + 1)) - counts.keys()),
        "torn_log_lines": sum("torn" in r for r in chaos_logs),
        "every_logged_loss_equals_uninterrupted": all(r["loss"] == ref_loss.get(r["step"]) for r in chaos_logs
                                                      if "loss" in r),
        "final_step": [step_a, step_b], "state_leaves": len(a), "state_bytes": int(sum(x.nbytes for x in a.values())),
        "leaves_differing": differ, "bytes_lost": bytes_lost, "bitwise_equal": not differ and step_a == step_b,
        "checkpoints_checked_after_kills": verified, "checkpoints_differing": bad,
        "seconds": {"uninterrupted": round(t_ref, 1), "chaos": round(t_chaos, 1),
                    "total": round(time.perf_counter() - t_begin, 1)},
        "runs": runs,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if result["bitwise_equal"] and not bad else 1


if __name__ == "__main__":
    sys.exit(main())
