"""SRC -> the model on a mesh: `load(src, overrides, rows)` reads a run directory (its latest checkpoint, or
`@STEP`), an export (`python -m jaxpar.export`), `hf:DIR` or `hf:ORG/NAME[@REV]` (fetched once into the Hugging
Face cache) and lays its params out as training does on the mesh that `--config.mesh.*` overrides give (default: a
run's own layout; for an export or a Hugging Face model, data parallel over every device), with the steps built for
that layout (`compiled.steps_for`: its `forward` runs evaluation heads on the layout's engine).

A run keeps its dtypes; an export or a Hugging Face model runs in float32 unless `--config.train.param_dtype` /
`compute_dtype` say otherwise.
"""
from __future__ import annotations

import ast
import dataclasses
import os
import re

import jax
import ml_collections

from jaxpar import data
from jaxpar.compiled import steps_for
from jaxpar.config import base_config, check_command_line, derived
from jaxpar.errors import ConfigError
from jaxpar.export import CONFIG_FILE, TOKENIZER_DIR, init_from_export, read_export_config
from jaxpar.interop import hf, hub
from jaxpar.interop.checkpoint import Checkpointer
from jaxpar.interop.runs import read_config
from jaxpar.layout import Layout
from jaxpar.train.step import Steps


@dataclasses.dataclass
class Source:
    """A model laid out on a mesh: the config it was laid out with, its steps, params (this layout's shardings and
    layer order), where its tokenizer is, the checkpoint step (a run) and the name it was given."""
    config: ml_collections.ConfigDict
    steps: Steps
    params: dict
    tokenizer_dir: str
    step: int | None
    name: str


def apply_overrides(config, overrides) -> ml_collections.ConfigDict:
    """`--config.KEY=VALUE` strings onto a copy of `config`, each value read as the key's type (bools as
    true/false, tuples as Python literals). Raises ConfigError naming the argument."""
    check_command_line(list(overrides))
    config = config.copy_and_resolve_references()
    for arg in overrides:
        m = re.fullmatch(r"--config\.([^=\s]+)=(.*)", arg)
        if not m:
            raise ConfigError(f"{arg!r}: write --config.KEY=VALUE (e.g. --config.mesh.tensor=2).")
        *path, name = m.group(1).split(".")
        node = config
        for p in path:
            node = node[p]
        node[name] = _typed(node[name], m.group(2), arg)
    return config


def _typed(old, text: str, arg: str):
    if isinstance(old, bool):
        if text.lower() not in ("true", "false", "1", "0"):
            raise ConfigError(f"{arg}: expected true or false.")
        return text.lower() in ("true", "1")
    if isinstance(old, (int, float, tuple, list)):
        try:
            v = ast.literal_eval(text)
            return type(old)(v) if not isinstance(old, (tuple, list)) else tuple(v)
        except (ValueError, SyntaxError, TypeError) as e:
            raise ConfigError(f"{arg}: expected a {type(old).__name__} ({e}).") from e
    return text


def _base(src: str) -> tuple[ml_collections.ConfigDict, str]:
    """(the config SRC describes, its kind: run | export | hf), before overrides."""
    name = hub.model_name(src)  # hf:ORG/NAME[@REV]: into the Hugging Face cache
    if name or hf.directory_of(src) is not None:
        config = base_config()
        config.init_from = "hf:" + hub.fetch(name)[0] if name else src
        config = hf.apply(config, say=False)
        config.model.seq_len = config.model.max_positions
        return config, "hf"
    if os.path.isfile(os.path.join(src, CONFIG_FILE)):
        cfg = read_export_config(src)
        config = base_config()
        config.model.update({k: getattr(cfg, k) for k in config.model if hasattr(cfg, k)})
        config.model.vocab_size = cfg.vocab_real
        config.train.update(param_dtype=cfg.param_dtype, compute_dtype=cfg.compute_dtype)
        config.data.tokenizer = os.path.join(src, TOKENIZER_DIR)
        config.init_from = src
        return config, "export"
    return read_config(src), "run"


def _tokenizer_dir(config, src: str, kind: str) -> str:
    if kind == "hf":
        return hf.directory_of(config.init_from)
    return os.path.join(src, TOKENIZER_DIR if kind == "export" else "tokenizer")


def load(src: str, overrides=(), rows: int = 8, devices=None) -> Source:
    """SRC (`DIR[@STEP]` for a run's checkpoint) on the layout the overrides give; the steps built for batches of
    `rows` rows (rounded up to a multiple of the data shards x microbatches).

    Raises:
      ConfigError: a bad override, or a layout that does not fit the model or the devices (one line each).
      FileNotFoundError / ValueError: SRC is none of the four, or its files are incomplete.
    """
    src, _, at = src.partition("@") if not src.startswith("hf:") else (src, "", "")
    config, kind = _base(src)
    config = apply_overrides(config, overrides)
    devices = list(jax.devices() if devices is None else devices)
    lay = Layout.from_config(config, len(devices))
    n = lay.batch_split * int(config.train.microbatches)
    config.train.global_batch_size = -(-max(rows, 1) // n) * n
    config = derived(config)
    tok_dir = _tokenizer_dir(config, src, kind)
    vocab = int(config.model.vocab_size) or data.load_tokenizer(tok_dir).vocab_size
    steps = steps_for(config, vocab, devices)
    if kind == "hf":
        params = hf.load_params(tok_dir, steps.cfg, steps.state_shardings["params"], steps.layer_order)
        return Source(config, steps, params, tok_dir, None, src)
    if kind == "export":
        params = init_from_export(src, steps, steps.init(0))["params"]
        return Source(config, steps, params, tok_dir, None, src)
    ckpt = Checkpointer(src, 1, 1, async_save=False, read_only=True)
    try:
        step = int(at) if at else ckpt.latest_step()
        if step is None:
            raise FileNotFoundError(f"no complete checkpoint in {ckpt.directory}.")
        state, _ = ckpt.restore(step, steps.abstract_state())
    finally:
        ckpt.close()
    return Source(config, steps, steps.from_canonical(state)["params"], tok_dir, step, src)
