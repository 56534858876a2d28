"""Reading a jaxpar export back (the format `python -m jaxpar.export` writes, `jaxpar/export.py`):
OUT/model_config.json (every `ModelConfig` field, `format`, `step`, the tokenizer's kind and size), OUT/model.safetensors
(the canonical flat parameter keys) and OUT/tokenizer/. `read_export_config` reads the model alone, `check_export`
compares it with a run's, `load_export` reads the arrays, checking every key, shape and dtype first."""
from __future__ import annotations

import dataclasses
import json
import os

import jax
import ml_collections

from jaxpar.config import DTYPES, base_config
from jaxpar.data import load_tokenizer
from jaxpar.model import LORA_FIELDS, SHAPE_FIELDS, ZERO_COUNTS, Forward, ModelConfig, init_params, param_items, \
    unflatten
from jaxpar.state.runs import TOKENIZER_DIR  # (an export's tokenizer/ is a copy of its run's)
from jaxpar.validate import check_model

FORMAT = "jaxpar-gpt-v1"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "model_config.json"
# param dtypes -> safetensors dtype tags
ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64"}
# what a start from an export must match (the run's `model.seq_len` may differ: the positions are `max_positions`)
START_FIELDS = tuple(f for f in SHAPE_FIELDS if f != "seq_len")


def is_export(directory: str) -> bool:
    return os.path.isfile(os.path.join(os.fspath(directory), CONFIG_FILE))


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
                want = f"{ST_DTYPES[str(s.dtype)]}{list(s.shape)}"
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
