"""bench/chaos.py's report: the run directories read back (logged metrics, save folders, complete checkpoints, the
train state restored on the host), checkpoints compared bitwise with the uninterrupted run's, the summary and the
markdown table. The faults are bench/chaos_faults.py."""
from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
TMP_MARK = ".orbax-checkpoint-tmp"
MARKER = "commit_success.txt"


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


def start_step(log_path: str) -> int | None:
    """The step run 0's process 0 reports starting at."""
    with open(log_path) as f:
        for line in f:
            if "start step " in line:
                return int(line.split("start step ")[1].split(",")[0])
    return None


def complete_steps(workdir: str) -> list[int]:
    """The steps a restart could restore (complete checkpoints), as the trainer lists them."""
    from jaxpar.state.checkpoint import Checkpointer

    if not os.path.isdir(os.path.join(workdir, "checkpoints")):
        return []
    with Checkpointer(workdir, 1, 1, async_save=False, read_only=True) as ck:
        return ck.all_steps()


def read_state(workdir: str, step: int | None = None):
    """(step, {leaf path: numpy array}) of WORKDIR's checkpoint `step` (default: the latest complete one), read-only,
    on the host CPU."""
    import jax

    from jaxpar import data
    from jaxpar.state.checkpoint import Checkpointer
    from jaxpar.train.optim import make_optimizer
    from jaxpar.state.runs import read_config
    from jaxpar.train.step import init_state, model_config

    config = read_config(workdir)
    tok = data.load_tokenizer(os.path.join(workdir, "tokenizer"))
    cfg = model_config(config, data.model_vocab(config, tok.vocab_size), int(config.mesh.tensor))
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


