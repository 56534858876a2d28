"""Export a run's parameters as safetensors + JSON, and load such an export back.

    python -m jaxpar.export --workdir DIR --out OUT [--step N] [--force] [--format jaxpar|hf|peft] [--dtype D]
                            [--max_shard_size 5GB]

`--format hf` writes a Hugging Face directory (`jaxpar.formats.hf`: config.json, model.safetensors or shards with their
index, tokenizer.json; for a ViT, preprocessor_config.json and the class names of WORKDIR/classes.json) that
transformers' `from_pretrained` loads with no custom code; `--format peft` a LoRA run's
adapters as PEFT writes them (`jaxpar.formats.peft`), which the other two fold into the model (in float32). The default, `jaxpar`, writes,
from WORKDIR's latest (or given) checkpoint, whatever layout trained it:

  OUT/model.safetensors   every parameter under a flat dotted key (`wte`, `blocks.wqkv`, `ln_f.scale`, ...), the
                          canonical layout-free tree the checkpoints hold (block leaves stacked on a leading
                          `layers` axis in model order), each array in its param dtype (float32, bfloat16, float16).
  OUT/model_config.json   every field of `ModelConfig`, plus `format` ("jaxpar-gpt-v1"), `step`, `tokenizer_kind`
                          and `tokenizer_vocab_size`.
  OUT/tokenizer/          a copy of WORKDIR/tokenizer.

Nothing in an export is pickled or executable: `load_export` reads only the safetensors file (a JSON header and raw
little-endian arrays) and JSON, and checks every key, shape and dtype against the model the config describes.

Errors (missing workdir or checkpoint, an OUT that exists and is not empty without `--force`) exit with code 2 and
a one-line message, writing nothing. `--force` replaces the three entries above in OUT and leaves other files alone.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile

import jax

from jaxpar.formats import hf, peft
from jaxpar.formats.exported import (CONFIG_FILE, FORMAT, ST_DTYPES, TOKENIZER_DIR, WEIGHTS_FILE,  # noqa: F401
                                      load_export, read_export_config)  # (the read side, re-exported)
from jaxpar.state.runs import host_device, load_run, read_classes
from jaxpar.model import LORA_FIELDS, merge_adapters
from jaxpar.model import flatten, unflatten  # noqa: F401 (re-exported: canonical keys are the model spec's)

FORMATS = ("jaxpar", "hf", "peft")  # --format


# ----------------------------------------------------------------------------------------------- export

def export(workdir: str, out: str, step: int | None = None, force: bool = False, fmt: str = "jaxpar",
           dtype: str | None = None, max_shard_bytes: int = 5 * 10 ** 9) -> dict:
    """Write WORKDIR's latest (or `step`'s) checkpoint params as an export in OUT: jaxpar's layout above (`fmt`
    "jaxpar"), or a Hugging Face directory for the run's family (`fmt` "hf": `jaxpar.formats.hf.save`, weights in `dtype`,
    default the param dtype, in shards of at most `max_shard_bytes`).

    The params are restored onto the host CPU (no accelerator memory is used). Either everything is written or
    nothing is: the files are built in a temporary sibling of OUT, then moved in.

    Returns:
      the export's metadata (for "jaxpar": the dict written to OUT/model_config.json).

    Raises:
      FileNotFoundError: WORKDIR, its config.json, tokenizer or a complete checkpoint (for `step`) is missing.
      FileExistsError: OUT exists and is not an empty directory, and `force` is False (or OUT is a file).
      ValueError: the checkpoint does not match config.json's model; the tokenizer is unreadable; a bad `fmt`/`dtype`.
    """
    workdir, out = os.path.abspath(os.fspath(workdir)), os.path.abspath(os.fspath(out))
    if fmt not in FORMATS or (dtype is not None and dtype not in ST_DTYPES):
        raise ValueError(f"--format {fmt!r} / --dtype {dtype!r}: pick one of {FORMATS}, and a dtype of "
                         f"{list(ST_DTYPES)}.")
    if not os.path.isdir(workdir):
        raise FileNotFoundError(f"--workdir {workdir} does not exist or is not a directory.")
    if os.path.exists(out) and not os.path.isdir(out):
        raise FileExistsError(f"--out {out} exists and is not a directory.")
    if os.path.isdir(out) and os.listdir(out) and not force:
        raise FileExistsError(f"--out {out} exists and is not empty; pass --force to replace an export in it.")
    run = load_run(workdir, step, device=host_device())
    if fmt == "jaxpar" and run.tokenizer is None:
        raise ValueError(f"--format jaxpar: {workdir} is a ViT run (no tokenizer); export it as a Hugging Face "
                         f"directory with --format hf.")
    if fmt == "peft" and not run.fwd.cfg.lora_rank:
        raise ValueError(f"--format peft: {workdir} trained no LoRA adapters (lora.rank=0); use --format hf or jaxpar.")
    # a LoRA run's model is its base with the adapters folded in (float32), as PEFT's merge_and_unload
    params, cfg = merge_adapters(run.params, run.fwd.cfg) if fmt != "peft" else (run.params, run.fwd.cfg)
    fields = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in LORA_FIELDS}
    meta = {"format": {"jaxpar": FORMAT}.get(fmt, fmt), **fields, "step": int(run.step),
            **({} if run.tokenizer is None else {"tokenizer_kind": run.tokenizer.kind,
                                                 "tokenizer_vocab_size": int(run.tokenizer.vocab_size)})}
    if fmt == "hf":
        vision = {} if cfg.family.data_kind != "images" else {"classes": read_classes(workdir),
                                                "image_mean": run.config.data.image_mean,
                                                "image_std": run.config.data.image_std}
        fill = lambda tmp: hf.save(jax.device_get(params), cfg, run.tokenizer, tmp, dtype or cfg.param_dtype,
                                   max_shard_bytes, **vision)
    elif fmt == "peft":
        base = hf.directory_of(run.config.init_from) or run.config.init_from
        fill = lambda tmp: peft.save(jax.device_get(params), cfg, tmp, base)
    else:
        fill = lambda tmp: _write_jaxpar(tmp, params, run.step, workdir, meta)
    _write_atomically(out, fill)
    return meta


def _write_jaxpar(tmp: str, params, step: int, workdir: str, meta: dict) -> list[str]:
    from safetensors.numpy import save_file

    save_file(flatten(params), os.path.join(tmp, WEIGHTS_FILE),
              metadata={"jaxpar_format": FORMAT, "step": str(step)})
    with open(os.path.join(tmp, CONFIG_FILE), "w") as f:
        json.dump(meta, f, indent=2)
        f.write("\n")
    shutil.copytree(os.path.join(workdir, TOKENIZER_DIR), os.path.join(tmp, TOKENIZER_DIR))
    return [WEIGHTS_FILE, CONFIG_FILE, TOKENIZER_DIR]


def _write_atomically(out: str, fill) -> None:
    """`fill(tmp)` writes the export into a temporary sibling of OUT and returns the names it wrote; they then move
    into OUT (a new OUT, or an existing one whose entries of those names, and any older weight shards, are
    replaced; other files stay)."""
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.export-", dir=parent)
    try:
        names = fill(tmp)
        if not os.path.isdir(out):
            os.rename(tmp, out)
            return
        stale = [n for n in os.listdir(out) if n.startswith("model-") and n.endswith(".safetensors")]
        for name in sorted(set(names) | set(stale) | {WEIGHTS_FILE, "model.safetensors.index.json"}):
            dst = os.path.join(out, name)
            if os.path.isdir(dst) and not os.path.islink(dst):
                shutil.rmtree(dst)
            elif os.path.lexists(dst):
                os.remove(dst)
            if name in names:
                os.rename(os.path.join(tmp, name), dst)
        os.rmdir(tmp)
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


# -------------------------------------------------------------------------------------------------- CLI

def parse_size(text: str) -> int:
    """"5GB" -> 5·10⁹ bytes, "200MiB" -> 200·2²⁰ (transformers' `max_shard_size` spelling); else ValueError."""
    import re

    units = {"": 1, "B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "KIB": 2 ** 10, "MIB": 2 ** 20,
             "GIB": 2 ** 30}
    m = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).upper() not in units:
        raise ValueError(f"--max_shard_size {text!r}: give a size such as 5GB, 200MB or 1GiB.")
    return int(float(m.group(1)) * units[m.group(2).upper()])


def main(argv: list[str] | None = None) -> int:
    """`python -m jaxpar.export ...`; returns the exit code: 0 done, 2 bad input (one line on stderr)."""
    ap = argparse.ArgumentParser(prog="python -m jaxpar.export",
                                 description="Export a run's checkpoint params as safetensors + JSON.",
                                 epilog="Guide: docs/models.md (Hugging Face) and docs/checkpoints.md.")
    ap.add_argument("--workdir", required=True, help="run directory written by train.py")
    ap.add_argument("--out", required=True, help="export directory to write (must not exist or be empty)")
    ap.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest complete one)")
    ap.add_argument("--force", action="store_true", help="replace an export already in --out")
    ap.add_argument("--format", default="jaxpar", choices=FORMATS,
                    help="jaxpar (model.safetensors + model_config.json), hf (a transformers directory) or peft "
                         "(a LoRA run's adapters as PEFT saves them; jaxpar and hf merge them into the model)")
    ap.add_argument("--dtype", default=None, choices=sorted(ST_DTYPES), help="hf: weight dtype (default: param dtype)")
    ap.add_argument("--max_shard_size", default="5GB", help="hf: largest weight file, e.g. 5GB, 200MB")
    args = ap.parse_args(argv)
    from absl import logging as absl_logging

    absl_logging.set_verbosity(absl_logging.WARNING)
    try:
        meta = export(args.workdir, args.out, args.step, args.force, args.format, args.dtype,
                      parse_size(args.max_shard_size))
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print(f"exported step {meta['step']} of {args.workdir} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
