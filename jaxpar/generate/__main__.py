"""Generate completions of a JSONL file of prompts: `python -m jaxpar.generate --model SRC --prompts IN.jsonl --out
OUT.jsonl [--max_new_tokens N] [--temperature T] [--top_k K] [--top_p P] [--min_p M] [--seed S] [--n N]
[--slots B] [--kv_block K] [--kv_cache_gib G] [--config.mesh.data=D --config.mesh.tensor=T ...]`.

SRC: a run directory, an export, `hf:DIR` or `hf:ORG/NAME` (`source.py`). Records: `records.py`; a string prompt is
encoded with the tokenizer's special tokens (BOS), a conversation by the chat template, and a completion ends at any
of the checkpoint's end ids (`jaxpar/data/special.py`), as transformers' `generate` ends it. A record's sample j
draws with seed S and stream (line number x n + j): the same tokens whatever the batch, slots or layout. An
interrupted run resumes: the records already in OUT are skipped. On several processes (the launcher, SLURM: as
`train.py`, docs/multihost.md) every process decodes its rows of each batch on the global mesh and process 0 writes
OUT, once, in input order. Guide: docs/generate.md.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from jaxpar.cluster import distributed
from jaxpar.data import special
from jaxpar.generate import cache as kv, records, source
from jaxpar.generate.engine import Engine, Request, check


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m jaxpar.generate", description=__doc__.split("\n\n")[0],
                                epilog="Guide: docs/generate.md")
    p.add_argument("--model", required=True, help="run directory, export, hf:DIR or hf:ORG/NAME")
    p.add_argument("--prompts", required=True, help="input JSONL: {prompt} or {messages} records")
    p.add_argument("--out", required=True, help="output JSONL (appended to; a rerun resumes)")
    p.add_argument("--max_new_tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top_k", type=int, default=0, help="0: all")
    p.add_argument("--top_p", type=float, default=1.0, help="in (0, 1]")
    p.add_argument("--min_p", type=float, default=0.0, help="in [0, 1]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n", type=int, default=1, help="samples per prompt")
    p.add_argument("--slots", type=int, default=16, help="rows decoded together")
    p.add_argument("--kv_block", type=int, default=16, help="KV cache blocks of this many positions (0: dense rows)")
    p.add_argument("--kv_cache_gib", type=float, default=0.0,
                   help="the paged KV cache's GiB on each device (0: a whole context per slot)")
    p.add_argument("--progress", type=int, default=1, help="0: no progress bar")
    args, rest = p.parse_known_args(argv)
    mesh = {}
    for a in rest:
        key, _, value = a.partition("=")
        if not key.startswith("--config.mesh.") or not value.lstrip("-").isdigit():
            p.error(f"unknown argument {a!r}: only --config.mesh.<axis>=<int> follow the flags above")
        mesh[key[len("--config.mesh."):]] = int(value)
    return args, mesh


RANGES = {"top_p": ("(0, 1]", lambda v: 0 < v <= 1), "min_p": ("[0, 1]", lambda v: 0 <= v <= 1),
          "top_k": (">= 0", lambda v: v >= 0), "n": (">= 1", lambda v: v >= 1), "slots": (">= 1", lambda v: v >= 1),
          "kv_block": (">= 0", lambda v: v >= 0), "kv_cache_gib": (">= 0", lambda v: v >= 0)}


def requests_of(lines, args, src, context: int):
    """The engine's requests of the records (n per record), each checked: one line naming the record's line."""
    out, ends = [], special.end_ids(src.tokenizer, src.chat)
    for n, rec in lines:
        if "messages" in rec and src.chat is None:
            raise ValueError(f"{args.prompts}:{n}: a messages record, but {args.model} has no chat template.")
        ids = special.encode_prompt(rec["messages"] if "messages" in rec else rec["prompt"], src.tokenizer, src.chat,
                                    f"{args.prompts}:{n}", rec.get("tools"))
        stop = rec.get("stop", [])
        knobs = dict(max_new_tokens=rec.get("max_new_tokens", args.max_new_tokens),
                     temperature=float(rec.get("temperature", args.temperature)), top_k=args.top_k,
                     top_p=args.top_p, min_p=args.min_p, seed=args.seed,
                     stop_ids=ends, stop=[stop] if isinstance(stop, str) else stop)
        for j in range(args.n):
            r = Request(ids, stream=n * args.n + j, **knobs)
            check(r, f"{args.prompts}:{n}", context, src.tokenizer)
            out.append(r)
    return out


def run(args, mesh) -> int:
    for name, (says, ok) in RANGES.items():
        if not ok(getattr(args, name)):
            raise ValueError(f"--{name}={getattr(args, name)} is outside {says}.")
    check(Request([1], temperature=args.temperature, max_new_tokens=args.max_new_tokens), "flags", 2)
    lines = records.read(args.prompts)
    skip = distributed.from_process_0(lambda: records.done_count(args.out), "jaxpar/generate/skip")
    todo = lines[skip:]
    src = source.load(args.model, mesh)
    context = src.fwd.cfg.max_positions
    reqs = requests_of(todo, args, src, context)
    engine = Engine.of_source(src, slots=args.slots, **kv.engine_options(args))
    return _write(engine, todo, reqs, args, skip, len(lines))


def _write(engine, todo, reqs, args, skip: int, total: int) -> int:
    """Generate the records in groups (written in order as each group ends), with a progress bar."""
    group = max(1, 4 * args.slots // args.n)
    made, t0, kv_use, main = [0], time.perf_counter(), None, jax.process_index() == 0
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  disable=not (args.progress and main), transient=False) as bar:
        task = bar.add_task("records", total=total, completed=skip)

        def tick(n):
            made[0] += n
            bar.update(task, description=f"{made[0] / (time.perf_counter() - t0):,.0f} tokens/s")

        with open(args.out if main else os.devnull, "a", encoding="utf-8") as f:  # (written once: process 0)
            for at in range(0, len(todo), group):
                done = engine.generate(reqs[at * args.n:(at + group) * args.n], tick)
                kv_use = _kv_use(engine.stats, kv_use)
                for i, (_, rec) in enumerate(todo[at:at + group]):
                    f.write(json.dumps(records.output(rec, done[i * args.n:(i + 1) * args.n], args.n)) + "\n")
                f.flush()
                bar.update(task, advance=len(todo[at:at + group]))
    if not main:
        return 0
    print(f"{len(todo)} records ({skip} already in {args.out}), {made[0]} tokens in "
          f"{time.perf_counter() - t0:.1f} s; written to {args.out}", file=sys.stderr)
    if kv_use:
        print(f"KV cache: at most {kv_use[0]} of {kv_use[1]} blocks of {engine.kv_block} positions in use; "
              f"{kv_use[2]} rows given back and recomputed", file=sys.stderr)
    return 0


def _kv_use(stats: dict, before):
    """(peak blocks, pool blocks, rows given back) of the paged cache over the calls so far (None: dense)."""
    if "kv_blocks" not in stats:
        return before
    peak, blocks, back = before or (0, 0, 0)
    return max(peak, stats["kv_peak_blocks"]), max(blocks, stats["kv_blocks"]), back + stats["preempted"]


def main(argv=None) -> int:
    args, mesh = parse(sys.argv[1:] if argv is None else argv)
    try:
        distributed.join()
        return run(args, mesh)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
