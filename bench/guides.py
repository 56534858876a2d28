"""Follow the guides as a new user does: every CPU command of their ```bash blocks, in the guides' order, in a fresh
clone of this repository, training runs shortened; then check that no command failed (a refusal a guide shows must
happen), none was refused or found nothing to do because of another guide's run ("refusing to resume", "nothing to
run"), and `git status` in the clone is clean (everything the commands write is
ignored by git). Slow (about half an hour on 2 cores): not part of the test suite; its last run is on the results
page (docs/results/README.md).

    python bench/guides.py [--steps 30] [--keep DIR] [--only README.md,docs/data.md] [--out bench/results]

Skipped: installs (the running interpreter's environment is used), the test suite, GPU-only and cluster commands
(SLURM, a coordinator on other hosts, the GPU benchmark, training the 8B/30B configs), commands on the user's own
files (`/path/to/`, `data/corpus`), editors, viewers and ssh. Training runs without `--dry_run` and without their
own `train.steps` get `--config.train.steps=STEPS`. Prints one JSON object per command, then a summary.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# a new user's order: the landing page, the quickstart, then the guides
GUIDES = ("README.md", "docs/getting-started.md", "docs/checkpoints.md", "docs/models.md", "docs/layouts.md",
          "docs/pipeline.md", "docs/precision.md", "docs/moe.md", "docs/context.md", "docs/offload.md",
          "docs/planning.md", "docs/data.md", "docs/multihost.md", "docs/finetune.md", "docs/generate.md",
          "docs/evaluate.md", "docs/rl.md", "docs/vision.md", "docs/gpu.md", "docs/testing.md")
SKIP = (r"^pip install\b", r"^python3 -m venv\b", r"-m pytest\b", r"^python train\.py --config configs/llama3_8b\.py",
        r"\bsbatch\b", r"\$EDITOR", r"\btail -f\b", r"^tensorboard\b", r"^ssh\b", r"--coordinator\b",
        r"bench/gpu\.py", r"/path/to/", r"data/corpus", r"runs/llama3_8b\b", r"hf:meta-llama/",
        r"hf:google/", r"imagefolder:/data/",
        r"configs/(llama3_8b|qwen3_30b_a3b|gpt_small|sft_llama3_8b|vit_huge)\.py(?!.*--dry_run)")
EXPECT_ERROR = "#expect-error: "
SETUP = re.compile(r"^(python3 -m venv \.venv && \. \.venv/bin/activate && )?pip install [^&]+&& ")  # dropped


def commands(text: str) -> list[str]:
    """The commands of a guide's ```bash blocks: continuation lines joined, a heredoc kept whole, comments dropped.
    A block the guide follows with an output block starting `error:` shows a refusal: its last command is marked
    `EXPECT_ERROR` + the message's last line."""
    out = []
    for block, shown in re.findall(r"^```bash\n(.*?)^```\n+(?:```\n(error:.*?)^```)?", text, re.S | re.M):
        lines, i = block.splitlines(), 0
        while i < len(lines):
            cmd = lines[i]
            while cmd.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                cmd = cmd.rstrip()[:-1].rstrip() + " " + lines[i].strip()
            end = re.search(r"<<'?(\w+)'?", cmd)
            if end:  # a heredoc: every line up to its terminator
                while i + 1 < len(lines) and lines[i].strip() != end.group(1):
                    i += 1
                    cmd += "\n" + lines[i]
            i += 1
            cmd = re.sub(r"\s+#[^'\"\n]*$", "", cmd) if not end else cmd
            if cmd.strip():
                out.append(cmd.strip())
        if shown:
            out[-1] = EXPECT_ERROR + shown.strip().splitlines()[-1].strip() + "\n" + out[-1]
    return out


def prepared(cmd: str, steps: int) -> str | None:
    """The command as run here (None: skipped): setup prefixes dropped, training shortened."""
    cmd = SETUP.sub("", cmd)
    if any(re.search(p, cmd) for p in SKIP):
        return None
    if re.search(r"\btrain\.py\b", cmd) and "--dry_run" not in cmd and "train.steps" not in cmd:
        cmd += f" --config.train.steps={steps}"
    if cmd.startswith("T=") and "train.steps" not in cmd:
        cmd = cmd[:-1] + f" --config.train.steps={steps}" + cmd[-1]
    return cmd


def run(guide: str, cmds: list[str], clone: str, env: dict, log) -> list[dict]:
    """One bash session per guide (its `export`s and variables carry over between its commands)."""
    script = []
    for k, cmd in enumerate(cmds):
        script += [f"echo '@@start {k}'; SECONDS=0", cmd, f"echo \"@@guides {k} rc=$? s=$SECONDS\""]
    p = subprocess.run(["bash", "-c", "\n".join(script)], cwd=clone, env=env, capture_output=True, text=True)
    log.write(f"===== {guide}\n{p.stdout}\n{p.stderr}\n")
    out, rows = p.stdout + "\n" + p.stderr, []
    for k, cmd in enumerate(cmds):
        m = re.search(rf"@@guides {k} rc=(\d+) s=(\d+)", p.stdout)
        part = p.stdout.split(f"@@start {k}\n")[-1].split(f"@@guides {k} ")[0]
        expect = cmd[len(EXPECT_ERROR):].split("\n")[0] if cmd.startswith(EXPECT_ERROR) else None
        rc = int(m.group(1)) if m else None
        # a refusal the guide shows must happen, with its message (printed on stderr)
        ok = rc == 0 if expect is None else (rc not in (0, None) and expect in out)
        rows.append({"guide": guide, "command": cmd.split("\n", 1)[-1][:160] if expect else cmd[:160], "rc": rc,
                     "ok": ok, "s": int(m.group(2)) if m else None, "refused": "refusing to resume" in part,
                     "nothing_to_run": "nothing to run" in part,
                     "last": part.strip().splitlines()[-1][:160] if part.strip() else ""})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--keep", default="", help="clone here and keep it (default: a temporary directory)")
    ap.add_argument("--only", default="", help="comma-separated guides (default: all, in order)")
    ap.add_argument("--out", default="", help="write guides.json here")
    ap.add_argument("--list", action="store_true", help="print the commands as they would run, run nothing")
    a = ap.parse_args(argv)
    if a.list:
        for g in (a.only.split(",") if a.only else GUIDES):
            for c in commands(open(os.path.join(ROOT, g)).read()):
                print(f"{g}: {'SKIP ' + c if prepared(c, a.steps) is None else prepared(c, a.steps)}")
        return 0
    clone = a.keep or tempfile.mkdtemp(prefix="jaxpar-guides-")
    if os.path.exists(clone):
        shutil.rmtree(clone)
    subprocess.run(["git", "clone", "-q", ROOT, clone], check=True)
    env = {**os.environ, "PYTHONPATH": clone, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    env.pop("XLA_FLAGS", None)
    rows, t0 = [], time.time()
    guides = a.only.split(",") if a.only else GUIDES
    with open(os.path.join(clone, "..", os.path.basename(clone) + ".log"), "w") as log:
        for g in guides:
            cmds = [c for c in (prepared(c, a.steps) for c in commands(open(os.path.join(clone, g)).read())) if c]
            if cmds:
                for r in run(g, cmds, clone, env, log):
                    print(json.dumps(r), flush=True)
                    rows.append(r)
    status = subprocess.run(["git", "status", "--porcelain"], cwd=clone, capture_output=True, text=True).stdout
    summary = {"commands": len(rows), "failed": [r["command"] for r in rows if not r["ok"]],
               "refused": [r["command"] for r in rows if r["refused"]],
               # a run that finds its work done, though no earlier guide gave the same command: another guide's run
               "nothing_to_run": [r["command"] for i, r in enumerate(rows) if r["nothing_to_run"] and
                                  r["command"] not in [q["command"] for q in rows[:i]]],
               "git_status": status.splitlines(),
               "minutes": round((time.time() - t0) / 60, 1), "steps": a.steps}
    print(json.dumps(summary, indent=1))
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "guides.json"), "w") as f:
            json.dump({"summary": summary, "commands": rows}, f, indent=1)
    if not a.keep:
        shutil.rmtree(clone, ignore_errors=True)
    return 0 if not (summary["failed"] or summary["refused"] or summary["nothing_to_run"] or
                     summary["git_status"]) else 1


if __name__ == "__main__":
    sys.exit(main())
