"""Chaos test of failure handling: kill, freeze or stall one of two training processes at random moments, remove
a commit marker now and then, restart after each fault, and compare the end with an uninterrupted run bitwise.

    python bench/chaos.py [--kills 6] [--save_kills 2] [--startup_kills 1] [--freezes 2] [--stalls 2]
                          [--unmarked 2] [--steps 60] [--every 4] [--seed 0] [--out bench/results/chaos.json]

1. Trains a tiny GPT with `train.py` in 2 processes x 4 fake CPU devices (`jaxpar.launch.spawn`, gloo collectives;
   (data, tensor) = (4, 2), so `data` spans the processes), async checkpoints every `--every` steps, uninterrupted
   to `--steps` in one workdir.
2. In a second workdir starts the same job again and again; each run gets one fault, in seeded random order, on a
   random process (rank 0 hosts the coordination service, rank 1 does not):
     - "kill": SIGKILL (no chance to clean up), during start-up, training, or an asynchronous save in progress
       (when the save's temporary folder `<step>.orbax-checkpoint-tmp*` appears, + 0-20 ms);
     - "freeze": SIGSTOP of the whole process (no heartbeat; its connections stay open), mid-step or mid-save;
     - "stall": the main thread blocks for good while its heartbeat threads run on (SIGUSR1 through
       bench/stuck_main.py: what blocked I/O or a deadlock leaves), mid-step or mid-save.
   `--unmarked` of the runs after a fault also lose the commit marker (`commit_success.txt`) of their newest complete
   checkpoint, as a crash between the arrays and the marker or an object store leaves it. The next start must set
   that folder aside and resume from the one before.
   For each run: how the job ended (each process's exit code, the seconds from the fault until the surviving
   process had exited, its message). As `python -m jaxpar.launch` does, a process still running 10 s after another
   failed is killed (a frozen one never exits by itself; reported as killed_after_grace); a survivor still running
   120 s after the fault is a hang (killed, reported, and the bench fails). Every checkpoint listed as complete is compared with the uninterrupted run's of the same step.
3. Restores both runs' latest checkpoints read-only onto the host and compares every leaf of the train state
   (params, optimizer state, step, rng, loss scale, counters) byte for byte.

The bench sets dist.heartbeat_timeout_s=5 and dist.step_timeout_min_s=10 (defaults 60 and 60) so that a fault costs
seconds, not minutes; what they bound is the same. Prints one JSON object (and writes a markdown table next to
`--out`); exit code 0 when nothing hung, the final states and every checked checkpoint are bitwise equal.
Not a test (it takes minutes); CI runs tests/test_multihost.py, tests/test_failures.py and tests/test_checkpoint.py.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
TMP_MARK = ".orbax-checkpoint-tmp"
MARKER = "commit_success.txt"
HANG_S = 120.0  # a survivor still running this long after the fault is a hang (the bound the issue asks for)


def make_corpus(directory: str, seed: int = 0) -> str:
    """A small synthetic text corpus; returns its glob."""
    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(seed)
    words = ["to", "be", "or", "not", "that", "is", "the", "question", "whether", "tis", "nobler", "in", "mind"]
    with open(os.path.join(directory, "a.txt"), "w") as f:
        f.write(" ".join(rng.choice(words, 40000)) + "\n")
    return os.path.join(directory, "*.txt")


def command(args, workdir: str, corpus: str, cache: str, keep: int | None = None) -> list[str]:
    """train.py's arguments (run through bench/stuck_main.py, so SIGUSR1 stalls the main thread)."""
    return [os.path.join(ROOT, "bench", "stuck_main.py"), os.path.join(ROOT, "train.py"),
            "--config", os.path.join(ROOT, "configs/shakespeare.py"),
            "--workdir", workdir, f"--config.data.sources={corpus}", f"--config.data.cache_dir={cache}",
            "--config.mesh.data=4", "--config.mesh.tensor=2", "--config.model.layers=2", "--config.model.embed=64",
            "--config.model.heads=4", "--config.model.mlp=256", "--config.model.seq_len=32",
            "--config.train.global_batch_size=8", f"--config.train.steps={args.steps}",
            "--config.optim.warmup_steps=10", "--config.optim.decay_steps=100",
            f"--config.checkpoint.every_steps={args.every}", f"--config.checkpoint.keep={keep or args.keep}",
            "--config.checkpoint.async_save=True", "--config.log.every_steps=1", "--config.log.progress=False",
            f"--config.eval.every_steps={10 * args.steps}", "--config.eval.batches=1",
            "--config.dist.heartbeat_timeout_s=5", "--config.dist.step_timeout_min_s=10"]


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


def start(cmd, root: str, i: int):
    """The 2 processes of run `i`; their logs root/run<i>.rank<r>.log."""
    from jaxpar import launch

    logs = [open(os.path.join(root, f"run{i}.rank{r}.log"), "w") for r in range(2)]
    return launch.spawn(cmd, 2, 4, stdout=lambda r: logs[r]), logs


def start_step(log_path: str) -> int | None:
    """The step run 0's process 0 reports starting at."""
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


SIGNALS = {"kill": signal.SIGKILL, "freeze": signal.SIGSTOP, "stall": signal.SIGUSR1}
MESSAGES = (re.compile(r"jaxpar: process \d+: (error|stopping): .*|Terminating process because .*"),
            re.compile(r".*Error: .*"))


def fault_plan(args, rng) -> list[tuple[str, str]]:
    """[(fault, moment)] in seeded random order: kills at save/startup/train moments, freezes and stalls half
    mid-step, half mid-save."""
    plan = ([("kill", "save")] * args.save_kills + [("kill", "startup")] * args.startup_kills
            + [("kill", "train")] * (args.kills - args.save_kills - args.startup_kills))
    for fault, n in (("freeze", args.freezes), ("stall", args.stalls)):
        plan += [(fault, "train")] * (n - n // 2) + [(fault, "save")] * (n // 2)
    return [plan[k] for k in rng.permutation(len(plan))]


class Moment:
    """When to strike in a run: at a random time in start-up, after its first logged step, or when its n-th new save
    folder appears."""

    def __init__(self, moment, rng, workdir, startup_s, step_s, every):
        self.moment, self.workdir, self.at = moment, workdir, None
        self.lines, self.old, self.seen = len(logged(workdir)), set(save_dirs(workdir)), set()
        t = time.perf_counter()
        if moment == "startup":
            self.at = t + rng.uniform(0, startup_s)
        self.delay = rng.uniform(0, 0.02) if moment == "save" else rng.uniform(0, 2 * every * step_s)
        self.nth = int(rng.integers(1, 3))

    def reached(self) -> bool:
        now = time.perf_counter()
        if self.at is None and self.moment == "save":
            self.seen.update(set(save_dirs(self.workdir)) - self.old)
            if len(self.seen) >= self.nth:
                self.at = now + self.delay
        if self.at is None and self.moment == "train" and run_steps(logged(self.workdir)[self.lines:]):
            self.at = now + self.delay
        return self.at is not None and now >= self.at


def wait_all(procs, victim, timeout_s: float, grace_s: float = 10.0) -> dict:
    """Wait as `jaxpar.launch.supervise` does: once one process has failed, the rest get `grace_s`, then are killed
    (a frozen victim never exits by itself). A hang: no survivor exited within `timeout_s`. -> exit codes, seconds
    until every survivor had exited, whether the victim had to be killed, hung."""
    t0, ends = time.perf_counter(), [None] * len(procs)
    first_fail = None
    while any(e is None for e in ends) and time.perf_counter() - t0 < timeout_s:
        now = time.perf_counter()
        for r, p in enumerate(procs):
            if ends[r] is None and p.poll() is not None:
                ends[r] = now - t0
                if p.returncode and first_fail is None:
                    first_fail = now
        if first_fail is not None and now - first_fail > grace_s:
            break
        time.sleep(0.02)
    survivors = [r for r in range(len(procs)) if r != victim]
    hung = any(ends[r] is None for r in survivors)
    killed = [r for r, p in enumerate(procs) if p.poll() is None]
    for r in killed:
        procs[r].kill()
        procs[r].wait()
    secs = None if hung else round(max(ends[r] for r in survivors), 2)
    return {"exit_codes": [p.returncode for p in procs], "seconds_to_exit": secs, "killed_after_grace": killed,
            "hung": hung}


def message(root: str, i: int, victim: int) -> str:
    """The first failure message of run i's surviving process (else the victim's): jaxpar's own, else an error."""
    for pattern in MESSAGES:
        for r in (1 - victim, victim):
            with open(os.path.join(root, f"run{i}.rank{r}.log")) as f:
                for line in f:
                    m = pattern.search(line)
                    if m:
                        return m.group(0).strip()[:240]
    return ""


def unmark_newest(workdir: str) -> int | None:
    """Remove the commit marker of the newest complete checkpoint; its step, or None."""
    steps = complete_steps(workdir)
    if not steps:
        return None
    os.remove(os.path.join(workdir, "checkpoints", str(steps[-1]), MARKER))
    return steps[-1]


def reference_run(args, root, corpus, cache):
    """The uninterrupted run (it keeps every checkpoint): (seconds, start-up seconds, seconds per step)."""
    ref_dir = os.path.join(root, "uninterrupted")
    t0 = time.perf_counter()
    procs, logs = start(command(args, ref_dir, corpus, cache, keep=args.steps), root, "ref")
    first = None
    while any(p.poll() is None for p in procs):
        if first is None and logged(ref_dir):
            first = time.perf_counter() - t0
        time.sleep(0.01)
    t_ref = time.perf_counter() - t0
    if any(p.returncode for p in procs):
        raise SystemExit(f"the uninterrupted run failed: {[p.returncode for p in procs]}; see {root}/runref.rank*.log")
    first = first or t_ref
    return t_ref, first, (t_ref - first) / max(args.steps - 1, 1)


def one_run(args, i, plan, rng, root, corpus, cache, timing, unmark: bool) -> dict:
    """Run i with its fault (or none, to the end): what happened, as a dict."""
    chaos_dir = os.path.join(root, "chaos")
    fault, moment = plan[i] if i < len(plan) else ("none", "")
    victim = int(rng.integers(0, 2))
    t_start = time.perf_counter()
    procs, logs = start(command(args, chaos_dir, corpus, cache), root, i)
    when, struck, t_fault = Moment(moment, rng, chaos_dir, timing[1], timing[2], args.every), False, None
    while fault != "none" and all(p.poll() is None for p in procs) and time.perf_counter() - t_start < args.timeout:
        if when.reached():
            procs[victim].send_signal(SIGNALS[fault])
            struck, t_fault = True, time.perf_counter()
            break
        time.sleep(0.002 if moment == "save" else 0.005)
    left = set(save_dirs(chaos_dir)) - when.old
    lag = time.perf_counter() - t_fault if struck else 0.0  # the wait starts a moment after the fault
    ended = wait_all(procs, victim if struck else -1, HANG_S if struck else args.timeout)
    for f in logs:
        f.close()
    if ended["seconds_to_exit"] is not None:
        ended["seconds_to_exit"] = round(ended["seconds_to_exit"] + lag, 2) if struck else None
    run = {"fault": fault if struck else "none", "moment": moment if struck else "", "process": victim, **ended,
           "mid_save": struck and bool(left), "start_step": start_step(os.path.join(root, f"run{i}.rank0.log")),
           "steps_logged": (lambda s: [s[0], s[-1]] if s else [])(run_steps(logged(chaos_dir)[when.lines:])),
           "message": message(root, i, victim) if struck else "", "seconds": round(time.perf_counter() - t_start, 2)}
    if struck and unmark:
        run["unmarked_step"] = unmark_newest(chaos_dir)
    return run


def verify(root: str, reference: dict, i: int, bad: list) -> int:
    """Compare every complete checkpoint of the chaos run with the uninterrupted run's; returns how many."""
    chaos_dir, n = os.path.join(root, "chaos"), 0
    for step in complete_steps(chaos_dir):
        if step not in reference:
            reference[step] = read_state(os.path.join(root, "uninterrupted"), step)[1]
        n += 1
        if not same(reference[step], read_state(chaos_dir, step)[1]):
            bad.append({"after_run": i, "step": step})
    return n


def table(result: dict) -> str:
    """Markdown: one row per (fault, moment, process) with how each such job ended."""
    rows = {}
    for r in result["runs"]:
        if r["fault"] != "none":
            rows.setdefault((r["fault"], r["moment"], r["process"]), []).append(r)
    out = ["| fault | moment | process | runs | exit codes (rank 0, 1) | seconds to exit (max) | killed after grace "
           "| hung | mid-save | message |", "|---|---|---:|---:|---|---:|---|---:|---:|---|"]
    for (fault, moment, proc), rs in sorted(rows.items()):
        codes = ", ".join(sorted({str(tuple(r["exit_codes"])) for r in rs}))
        secs = max((r["seconds_to_exit"] or float("inf")) for r in rs)
        killed = sum(bool(r["killed_after_grace"]) for r in rs)
        out.append(f"| {fault} | {moment} | {proc} | {len(rs)} | {codes} | {secs:g} | {killed} | "
                   f"{sum(r['hung'] for r in rs)} | {sum(r['mid_save'] for r in rs)} | `{rs[0]['message'][:150]}` |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=6, help="SIGKILLs of one process")
    ap.add_argument("--save_kills", type=int, default=2, help="how many kills aim at an asynchronous save")
    ap.add_argument("--startup_kills", type=int, default=1, help="how many kills land in start-up (the rest: training)")
    ap.add_argument("--freezes", type=int, default=2, help="SIGSTOPs of one process (half mid-step, half mid-save)")
    ap.add_argument("--stalls", type=int, default=2, help="main-thread stalls of one process (half mid-save)")
    ap.add_argument("--unmarked", type=int, default=2, help="faults after which the newest checkpoint loses its marker")
    ap.add_argument("--steps", type=int, default=60, help="train.steps")
    ap.add_argument("--every", type=int, default=4, help="checkpoint.every_steps")
    ap.add_argument("--keep", type=int, default=2, help="checkpoint.keep")
    ap.add_argument("--seed", type=int, default=0, help="seeds the faults, their moments and processes")
    ap.add_argument("--dir", default="", help="working directory (default: a temporary one, removed at the end)")
    ap.add_argument("--out", default="", help="also write the JSON here (and the markdown table beside it)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds any one run may take")
    args = ap.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # this process only reads checkpoints back, on the host
    from absl import logging as absl_logging

    absl_logging.set_verbosity(absl_logging.ERROR)  # Orbax warns about every read-only manager
    if min(args.save_kills, args.startup_kills) < 0 or args.save_kills + args.startup_kills > args.kills:
        ap.error("need --save_kills, --startup_kills >= 0 and their sum <= --kills")
    t_begin, root = time.perf_counter(), args.dir or tempfile.mkdtemp(prefix="jaxpar-chaos-")
    os.makedirs(root, exist_ok=True)
    corpus, cache = make_corpus(os.path.join(root, "corpus")), os.path.join(root, "cache")
    for d in ("uninterrupted", "chaos"):
        shutil.rmtree(os.path.join(root, d), ignore_errors=True)
    say = lambda *a: print("chaos:", *a, file=sys.stderr, flush=True)  # noqa: E731
    timing = reference_run(args, root, corpus, cache)
    say(f"uninterrupted: {timing[0]:.1f} s (start-up {timing[1]:.1f} s, {timing[2] * 1e3:.0f} ms/step)")
    rng = np.random.default_rng(args.seed)
    plan = fault_plan(args, rng)
    unmark = set(rng.choice(len(plan), min(args.unmarked, len(plan)), replace=False).tolist())
    runs, bad, verified, t_chaos = [], [], 0, time.perf_counter()
    reference = {}
    for i in range(len(plan) + 1):
        run = one_run(args, i, plan, rng, root, corpus, cache, timing, i in unmark)
        runs.append(run)
        say(f"run {i}: {run}")
        verified += verify(root, reference, i, bad)
        if run["fault"] == "none":
            if any(run["exit_codes"]):
                raise SystemExit(f"run {i} failed without a fault: {run['exit_codes']}; see {root}/run{i}.rank*.log")
            break
    result = summary(args, root, runs, bad, verified, time.perf_counter() - t_chaos, timing[0], t_begin)
    text = json.dumps(result, indent=2)
    print(text)
    print(table(result))
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
        with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
            f.write(table(result))
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if result["bitwise_equal"] and not bad and not result["hangs"] else 1


def summary(args, root, runs, bad, verified, t_chaos, t_ref, t_begin) -> dict:
    step_a, a = read_state(os.path.join(root, "uninterrupted"))
    step_b, b = read_state(os.path.join(root, "chaos"))
    differ = differing(a, b)
    ref_loss = {r["step"]: r["loss"] for r in logged(os.path.join(root, "uninterrupted"))}
    chaos_logs, counts = logged(os.path.join(root, "chaos")), {}
    for r in chaos_logs:
        if "step" in r:
            counts[r["step"]] = counts.get(r["step"], 0) + 1
    faults = [r for r in runs if r["fault"] != "none"]
    return {
        "steps": args.steps, "checkpoint_every": args.every, "keep": args.keep, "seed": args.seed,
        "faults": len(faults), "hangs": sum(r["hung"] for r in runs),
        "faults_by_kind": {f"{r['fault']}:{r['moment']}": sum(q["fault"] == r["fault"] and q["moment"] == r["moment"]
                                                              for q in faults) for r in faults},
        "mid_save": sum(r["mid_save"] for r in faults),
        "unmarked_steps": [r["unmarked_step"] for r in faults if r.get("unmarked_step") is not None],
        "resumes": sum(1 for r in runs if (r["start_step"] or 0) > 0),
        "steps_redone": int(sum(c - 1 for c in counts.values())),
        "steps_missing_from_log": sorted(set(range(1, args.steps + 1)) - counts.keys()),
        "torn_log_lines": sum("torn" in r for r in chaos_logs),
        "every_logged_loss_equals_uninterrupted": all(r["loss"] == ref_loss.get(r["step"]) for r in chaos_logs
                                                      if "loss" in r),
        "final_step": [step_a, step_b], "state_leaves": len(a), "state_bytes": int(sum(x.nbytes for x in a.values())),
        "leaves_differing": differ, "bytes_lost": int(sum(a[k].nbytes if k in a else b[k].nbytes for k in differ)),
        "bitwise_equal": not differ and step_a == step_b,
        "checkpoints_checked_after_faults": verified, "checkpoints_differing": bad,
        "seconds": {"uninterrupted": round(t_ref, 1), "chaos": round(t_chaos, 1),
                    "total": round(time.perf_counter() - t_begin, 1)},
        "runs": runs,
    }


if __name__ == "__main__":
    sys.exit(main())
