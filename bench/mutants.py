"""Do the equivalence tests catch real layout bugs? Each mutant is one plausible defect written into a copy of the
repository; the named test must fail on it, and its message shows by how much the float64 comparison misses
(`tests/helpers.py`: params within 1e-9 relative L2, float64 on both sides).

    python bench/mutants.py [--only NAME ...] [--out mutants.json]

Prints one JSON object per mutant ({name, test, failed, message}) and writes them all to --out. Needs the test
extras (pytest); ~2 minutes on 2 cores."""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name: (file, text, replacement, test id, the bug in words)
MUTANTS = {
    "accumulation_drops_last_microbatch": (
        "jaxpar/train/gradients.py", "(grads, lsum), _ = jax.lax.scan(body, (jax.tree.map(zeros, shapes), zeros(jnp.zeros(()))), xs)",
        "(grads, lsum), _ = jax.lax.scan(body, (jax.tree.map(zeros, shapes), zeros(jnp.zeros(()))), "
        "jax.tree.map(lambda a: a[:-1] if a.shape[0] > 1 else a, xs))",
        "tests/test_layouts.py::test_accumulation_equals_whole_batch_with_uneven_masks",
        "gradient accumulation skips its last microbatch (when there is more than one)"),
    "zero2_averages_instead_of_sums": (
        "jaxpar/parallel/zero.py", "return jax.lax.psum_scatter(g, AXIS, scatter_dimension=d, tiled=True)",
        "return jax.lax.psum_scatter(g, AXIS, scatter_dimension=d, tiled=True) / self.size",
        "tests/test_zero.py::test_zero_stage_equals_one_device[(8, 1, 1)-2]",
        "ZeRO-2's reduce-scatter averages the data-parallel gradients where the others sum them"),
    "stage_major_layers_left_in_place": (
        "jaxpar/train/step.py", "canonical = lambda tree: map_blocks(tree, lambda a: pipeline.from_stage_major(a, S, v))",
        "canonical = lambda tree: tree",
        "tests/test_pipeline.py::test_pipeline_equals_one_device[(1, 1, 4)-circular-2]",
        "the circular pipeline's layers are not put back in model order"),
    "interleaved_1f1b_grads_filed_under_the_forward_chunk": (
        "jaxpar/parallel/pipeline/loop.py", "dchunks = _add_at(dchunks, br[s], dc)", "dchunks = _add_at(dchunks, fr[s], dc)",
        "tests/test_1f1b.py::test_schedule_equals_one_device[(1, 1, 4)-1f1b-{'pipeline.virtual_stages': 2}]",
        "interleaved 1F1B adds a chunk's gradient to the chunk its forward lane runs"),
    "llama_interleaved_1f1b_same_bug": (
        "jaxpar/parallel/pipeline/loop.py", "dchunks = _add_at(dchunks, br[s], dc)", "dchunks = _add_at(dchunks, fr[s], dc)",
        "tests/test_llama.py::test_llama_layout_equals_one_device[(2, 2, 2)-1f1b-{'pipeline.virtual_stages': 2}]",
        "the same bug under the llama family at (2, 2, 2)"),
    "every_process_reads_the_first_rows": (
        "jaxpar/data/loader.py", "    return start, stop\n\n\ndef to_global", "    return 0, stop - start\n\n\ndef to_global",
        "tests/test_multihost.py::test_two_processes_train_like_one",
        "each process feeds the first rows of the global batch, not its own"),
    "export_keeps_stage_major_layers": (
        "jaxpar/train/step.py", "canonical = lambda tree: map_blocks(tree, lambda a: pipeline.from_stage_major(a, S, v))",
        "canonical = lambda tree: tree",
        "tests/test_export.py::test_exports_are_layout_free",
        "a circular-pipeline run's checkpoint and export keep the stage-major layer order"),
}


def run_mutant(name, spec, venv_python):
    path, old, new, test, what = spec
    with tempfile.TemporaryDirectory() as tmp:
        copy = os.path.join(tmp, "repo")
        shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(".venv", ".git", "runs", "__pycache__", ".cache"))
        src = os.path.join(copy, path)
        with open(src) as f:
            text = f.read()
        if text.count(old) != 1:
            return {"name": name, "test": test, "failed": None, "message": f"mutation site not found in {path}"}
        with open(src, "w") as f:
            f.write(text.replace(old, new))
        env = dict(os.environ, PYTHONPATH=copy)
        res = subprocess.run([venv_python, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", test], cwd=copy,
                             env=env, capture_output=True, text=True, timeout=1200)
    out = res.stdout + res.stderr
    msgs = re.findall(r"^E\s+(AssertionError: .*|.*relative L2.*|.*Mismatch.*|.*rtol.*)$", out, re.M)
    return {"name": name, "bug": what, "test": test, "failed": res.returncode != 0,
            "message": msgs[0].strip() if msgs else out.strip().splitlines()[-1]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=None, help="mutant names (default: all)")
    ap.add_argument("--out", default="", help="write the JSON list here too")
    args = ap.parse_args(argv)
    rows = []
    for name, spec in MUTANTS.items():
        if args.only and name not in args.only:
            continue
        row = run_mutant(name, spec, sys.executable)
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(r["failed"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
