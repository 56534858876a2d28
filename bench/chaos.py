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
Not a test (it takes minutes); the fault injection is bench/chaos_faults.py, the report bench/chaos_report.py. CI runs tests/test_multihost.py, tests/test_failures.py and tests/test_checkpoint.py.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

from chaos_faults import fault_plan, make_corpus, one_run, reference_run  # noqa: E402
from chaos_report import summary, table, verify  # noqa: E402


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




if __name__ == "__main__":
    sys.exit(main())
