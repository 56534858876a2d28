"""bench/chaos.py's fault injection: the job's command line, its two processes, the faults (kill, freeze, stall) and
the moments they strike (start-up, mid-step, mid-save), how each run ended, and the commit markers removed. What the
runs left on disk is read back by bench/chaos_report.py."""
from __future__ import annotations

import os
import re
import signal
import time

import numpy as np

from chaos_report import MARKER, ROOT, complete_steps, logged, run_steps, save_dirs, start_step  # noqa: E402

HANG_S = 120.0  # a survivor still running this long after the fault is a hang (the bound the issue asks for)


def make_corpus(directory: str, seed: int = 0) -> str:
    """A small synthetic text corpus of 8 documents (one per file: the last is the validation split); its glob."""
    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(seed)
    words = ["to", "be", "or", "not", "that", "is", "the", "question", "whether", "tis", "nobler", "in", "mind"]
    for i in range(8):
        with open(os.path.join(directory, f"{i}.txt"), "w") as f:
            f.write(" ".join(rng.choice(words, 5000)) + "\n")
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


def start(cmd, root: str, i: int):
    """The 2 processes of run `i`; their logs root/run<i>.rank<r>.log."""
    from jaxpar import launch

    logs = [open(os.path.join(root, f"run{i}.rank{r}.log"), "w") for r in range(2)]
    return launch.spawn(cmd, 2, 4, stdout=lambda r: logs[r]), logs


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


