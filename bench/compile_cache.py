"""Compile time of a run's second start with the persistent compilation cache, against its first.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python bench/compile_cache.py --config configs/gpt_small.py \
        [--config.KEY=VALUE ...] [--out bench/results]

Runs `train.py --dry_run` twice in fresh processes on an empty cache directory (xla.compile_cache_dir) and reads
each start's `compile_s` (lowering + compiling the train step) from its compile_report.json; the third column is
the same start with the cache off. Prints JSON.
"""
import json
import os
import subprocess
import sys
import tempfile

from common import write_results


def start(args, workdir, cache, on=True):
    cmd = [sys.executable, "train.py", *args, "--dry_run", "--workdir", workdir, f"--config.xla.compile_cache={on}",
           f"--config.xla.compile_cache_dir={cache}"]
    subprocess.run(cmd, check=True, capture_output=True, cwd=os.path.join(os.path.dirname(__file__), ".."))
    with open(os.path.join(workdir, "compile_report.json")) as f:
        return json.load(f)["compile_s"]


def main():
    out = ""
    args = [a for a in sys.argv[1:]]
    if "--out" in args:
        i = args.index("--out")
        out = args[i + 1]
        del args[i:i + 2]
    with tempfile.TemporaryDirectory() as tmp:
        cache, work = os.path.join(tmp, "xla"), os.path.join(tmp, "run")
        row = {"args": args, "first_s": start(args, work, cache), "second_s": start(args, work, cache),
               "off_s": start(args, work, cache, on=False)}
    row["speedup"] = row["first_s"] / row["second_s"]
    print(json.dumps(row))
    write_results(out, "compile_cache", [row], f"| first start | second start (cache) | cache off |\n|---|---|---|\n"
                  f"| {row['first_s']:.1f} s | {row['second_s']:.1f} s | {row['off_s']:.1f} s |")


if __name__ == "__main__":
    main()
