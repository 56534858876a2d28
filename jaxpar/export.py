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
import ml_collections

from jaxpar.formats import hf, peft
from jaxpar.config import DTYPES, base_config
from jaxpar.errors import ConfigError
from jaxpar.data import load_tokenizer
from jaxpar.state.runs import load_run, read_classes
from jaxpar.model import LORA_FIELDS, merge_adapters, merge_trainable, split_adapters
from jaxpar.model import (SHAPE_FIELDS, ZERO_COUNTS, Forward, ModelConfig, flatten, init_params,  # noqa: F401
                          param_items, unflatten)  # flatten, unflatten: re-exported (canonical keys: the model spec's)
from jaxpar.validate import check_model

FORMAT = "jaxpar-gpt-v1"
FORMATS = ("jaxpar", "hf", "peft")  # --format
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "model_config.json"
TOKENIZER_DIR = "tokenizer"
# param dtypes -> safetensors dtype tags
_ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64"}


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
    if fmt not in FORMATS or (dtype is not None and dtype not in _ST_DTYPES):
        raise ValueError(f"--format {fmt!r} / --dtype {dtype!r}: pick one of {FORMATS}, and a dtype of "
                         f"{list(_ST_DTYPES)}.")
    if not os.path.isdir(workdir):
        raise FileNotFoundError(f"--workdir {workdir} does not exist or is not a directory.")
    if os.path.exists(out) and not os.path.isdir(out):
        raise FileExistsError(f"--out {out} exists and is not a directory.")
    if os.path.isdir(out) and os.listdir(out) and not force:
        raise FileExistsError(f"--out {out} exists and is not empty; pass --force to replace an export in it.")
    run = load_run(workdir, step, device=_host_device())
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


def _host_device():
    """The host CPU device (so exporting needs no accelerator memory), or the default one if JAX has no CPU backend."""
    try:
        return jax.local_devices(backend="cpu")[0]
    except RuntimeError:
        return jax.local_devices()[0]


# ------------------------------------------------------------------------------------------------- load

_FIELD_TYPES = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,)}


def _gpt_config(meta: dict, where: str):
    """ModelConfig from model_config.json's fields, type-checked; ValueError naming the first bad field."""

    kw = {}
    for f in dataclasses.fields(ModelConfig):
        if f.name in LORA_FIELDS:  # (an export is a model without adapters)
            continue
        if f.name not in meta:
            if f.default is dataclasses.MISSING:
                raise ValueError(f"{where}: missing field {f.name!r}.")
            continue
        v, types = meta[f.name], _FIELD_TYPES[str(f.type)]
        if not isinstance(v, types) or (bool not in types and isinstance(v, bool)):
            raise ValueError(f"{where}: field {f.name!r} is {v!r}; expected {str(f.type)}.")
        kw[f.name] = v
    cfg = ModelConfig(**kw)
    counts = [f for f in SHAPE_FIELDS if type(getattr(cfg, f)) is int]  # noqa: E721 (bool is an int subclass)
    for name in counts:
        if getattr(cfg, name) < (0 if name in ZERO_COUNTS else 1):
            raise ValueError(f"{where}: field {name!r} is {getattr(cfg, name)}; expected >= "
                             f"{0 if name in ZERO_COUNTS else 1}.")
    model = ml_collections.ConfigDict({k: getattr(cfg, k) for k in base_config().model if hasattr(cfg, k)})
    errs = check_model(model, 1, cfg.mlp)  # the model's rules, the ones `validate` applies to a run
    if errs:
        raise ValueError(f"{where}: {errs[0]}")
    if cfg.vocab_real > cfg.vocab_size:
        raise ValueError(f"{where}: vocab_real={cfg.vocab_real} > vocab_size={cfg.vocab_size}.")
    for name in ("param_dtype", "compute_dtype"):
        if getattr(cfg, name) not in DTYPES:
            raise ValueError(f"{where}: field {name!r} is {getattr(cfg, name)!r}; expected one of {DTYPES}.")
    return cfg


def read_export_config(directory: str):
    """The `ModelConfig` of an export, from DIRECTORY/model_config.json alone (no array is read).

    Raises:
      FileNotFoundError: DIRECTORY/model_config.json is missing.
      ValueError: not JSON, a wrong or missing format tag, or a bad config field.
    """
    cpath = os.path.join(os.fspath(directory), CONFIG_FILE)
    if not os.path.isfile(cpath):
        raise FileNotFoundError(f"{cpath} not found: {directory} is not an export written by jaxpar.export.")
    try:
        with open(cpath) as f:
            meta = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{cpath} is not JSON: {e}.") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise ValueError(f"{cpath}: format is {got!r}; expected {FORMAT!r}.")
    return _gpt_config(meta, cpath)


def load_export(directory: str, device=None):
    """-> (Forward, params, tokenizer) from an export written by `export` / `python -m jaxpar.export`.

    Reads only DIRECTORY/model_config.json, DIRECTORY/model.safetensors and the tokenizer's JSON: no pickle, no
    code from disk. Every array is checked before any is read: each key the model expects (from `jax.eval_shape`
    of `init_params`) must be present with the expected shape and dtype, and no other key may be.

    Args:
      directory: the export directory.
      device: where the params go (default `jax.devices()[0]`).

    Returns:
      `Forward(cfg)`; params, the canonical nested dict `{wte, wpe, blocks: {...}, ln_f, [lm_head]}` of jax arrays
      on `device` in the param dtype (block leaves `[layers, ...]`); the tokenizer.

    Raises:
      FileNotFoundError: DIRECTORY, its model_config.json, model.safetensors or tokenizer/ is missing.
      ValueError: a wrong or missing format tag, a bad config field, an unreadable safetensors file or tokenizer,
        a missing, unexpected, wrong-shape or wrong-dtype array; the message names the first mismatch.
    """
    from safetensors import SafetensorError, safe_open


    directory = os.fspath(directory)
    cpath, wpath, tdir = (os.path.join(directory, n) for n in (CONFIG_FILE, WEIGHTS_FILE, TOKENIZER_DIR))
    for p, isit in ((cpath, os.path.isfile), (wpath, os.path.isfile), (tdir, os.path.isdir)):
        if not isit(p):
            raise FileNotFoundError(f"{p} not found: {directory} is not an export written by jaxpar.export.")
    cfg = read_export_config(directory)
    tok = load_tokenizer(tdir)  # DataError (a ValueError) if unreadable
    if tok.vocab_size > cfg.vocab_real:
        raise ValueError(f"{tdir}: the tokenizer has {tok.vocab_size} ids but the model only vocab_real="
                         f"{cfg.vocab_real}.")

    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    expected = dict(param_items(shapes))
    sharding = jax.sharding.SingleDeviceSharding(device or jax.devices()[0])
    try:
        with safe_open(wpath, framework="numpy") as f:
            present = set(f.keys())
            for k, s in expected.items():
                want = f"{_ST_DTYPES[str(s.dtype)]}{list(s.shape)}"
                if k not in present:
                    raise ValueError(f"{wpath}: missing array {k!r} (expected {want}).")
                sl = f.get_slice(k)
                got = f"{sl.get_dtype()}{list(sl.get_shape())}"
                if got != want:
                    raise ValueError(f"{wpath}: array {k!r} is {got}; expected {want}.")
            extra = sorted(present - expected.keys())
            if extra:
                raise ValueError(f"{wpath}: unexpected array {extra[0]!r} (the model has no such parameter).")
            flat = {k: jax.device_put(f.get_tensor(k), sharding) for k in expected}
    except SafetensorError as e:
        raise ValueError(f"{wpath} is not a readable safetensors file: {e}.") from e
    return Forward(cfg), unflatten(flat), tok


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


def check_export(directory: str, cfg) -> None:
    """Check that the export in `directory` holds the model `cfg` (a `ModelConfig`) describes, reading only its
    model_config.json; the trainer calls it before anything is written.

    Raises:
      ConfigError: the export is missing or unreadable, or its model differs from `cfg` (shape or vocabulary).
    """
    try:
        got = read_export_config(directory)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"--config.init_from={directory}: {e}") from e
    diffs = [f"{f}: export {getattr(got, f)!r} vs config {getattr(cfg, f)!r}"
             for f in SHAPE_FIELDS if getattr(got, f) != getattr(cfg, f)]
    if diffs:
        raise ConfigError(f"--config.init_from={directory} holds another model:\n  " + "\n  ".join(diffs))


def init_from_export(directory: str, steps, state) -> dict:
    """`state` with its params replaced by those of an export (`python -m jaxpar.export`), placed in this layout.

    Raises:
      ConfigError: the export's model differs from this config's (shape or vocabulary).
    """
    check_export(directory, steps.cfg)
    _, params, _ = load_export(directory)
    canon = steps.to_canonical(state)
    adapters, base = split_adapters(canon["params"])  # LoRA: the export is the base model; the adapters stay
    base = jax.tree.map(lambda p, q: p.astype(q.dtype), params, base)
    canon["params"] = merge_trainable(adapters, jax.device_put(base, split_adapters(steps.state_shardings["params"])[1]))
    return steps.from_canonical(canon)


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
    ap.add_argument("--dtype", default=None, choices=sorted(_ST_DTYPES), help="hf: weight dtype (default: param dtype)")
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
