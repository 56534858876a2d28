"""One loader of a model to generate from (or evaluate): SRC -> its model, params placed on a mesh, tokenizer and chat
template.

SRC is a run directory written by train.py (its latest checkpoint, on the run's own layout by default: its tensor,
stage, expert and ZeRO settings, data over the devices left), an export of `python -m jaxpar.export` (a directory
with model_config.json), `hf:DIR` (a Hugging Face directory) or `hf:ORG/NAME[@REVISION]` (fetched into the Hugging
Face cache once). `mesh` ({"data": 2, "tensor": 2, ...}, the `--config.mesh.*` overrides) lays any of them out on
that mesh; an export or a Hugging Face model without it is read onto one device in float32.

`on_layout(src, overrides, rows)` (evaluation) always lays SRC out with its steps: any `--config.KEY=VALUE`
overrides (mesh, pipeline schedule and microbatches, ZeRO, dtypes), the steps built for batches of `rows` rows, a
run's checkpoint (`DIR@STEP` for another than the latest) restored straight onto that layout.

A pipelined layout (mesh.stage = S > 1) whose microbatches are not given (no `--config.train.microbatches`), and
whose config's do not fit it (fewer than S, or not what the schedule needs: interleaved 1F1B a multiple of S), runs
with S microbatches (`pick_microbatches`), in both.
"""
from __future__ import annotations

import ast
import math
import os
import re
from typing import NamedTuple

import jax
import ml_collections
import numpy as np

from jaxpar import data
from jaxpar import model as gpt
from jaxpar.compiled import steps_for
from jaxpar.config import base_config, check_command_line
from jaxpar.config_keys import MESH_AXES
from jaxpar.data import special
from jaxpar.data.chat import ChatFormat
from jaxpar.errors import ConfigError
from jaxpar.export import TOKENIZER_DIR, load_export
from jaxpar.formats import hf, hub, start
from jaxpar.state import runs
from jaxpar.state.checkpoint import Checkpointer
from jaxpar.layout import Layout
from jaxpar.parallel.pipeline import registry


class Source(NamedTuple):
    fwd: gpt.Forward
    params: dict  # placed: on one device (`steps` None) or in `steps`' state shardings and layer order
    tokenizer: data.Tokenizer
    chat: ChatFormat | None  # the checkpoint's chat template (its end-of-turn and end-of-sequence ids), if it has one
    steps: object | None  # `compiled.steps_for`'s Steps of the layout, or None (one device)
    config: object | None  # the run config of that layout


def _place(params, steps):
    """Canonical params (one device) -> `steps`' params shardings, the layer axis in its layer order (through the host:
    on several processes each places its devices' shards from its own copy)."""
    order = np.asarray(steps.layer_order)
    shared, layers = gpt.split_params(jax.device_get(params))
    params = gpt.join_params(shared, jax.tree.map(lambda a: a[order], layers))
    return jax.device_put(params, steps.state_shardings["params"])


def pick_microbatches(config, given: bool = False) -> None:
    """A pipelined layout's microbatches, where not `given`: mesh.stage when the config's do not fit it (fewer than
    one per stage, or not what the schedule needs, e.g. interleaved 1F1B's multiple of the stages)."""
    s, m = int(config.mesh.stage), int(config.train.microbatches)
    if given or s <= 1:
        return
    p = config.pipeline
    errors = lambda k: registry.errors(str(p.schedule), s, k, max(1, int(p.virtual_stages)),  # noqa: E731
                                       bool(p.remat))
    if m < s or len(errors(s)) < len(errors(m)):
        config.train.microbatches = s


def _on_mesh(config, mesh: dict, vocab: int):
    """`config`'s steps with the `mesh` sizes, on the first devices their product asks for (all with data -1); its
    microbatches `pick_microbatches`'."""
    for k, v in mesh.items():
        config.mesh[k] = v
    pick_microbatches(config)
    n = math.prod(int(config.mesh[a]) for a in MESH_AXES)
    return steps_for(config, vocab, jax.devices()[:n] if 0 < n <= jax.device_count() else None)


def kind(src: str) -> tuple[str, str]:
    """(SRC, a Hub name `hf:ORG/NAME[@REV]` fetched into the Hugging Face cache as `hf:DIR`; its kind: hf | export |
    run, as `formats.start.kind` decides for `init_from`).

    Raises:
      ConfigError: SRC is none of them (one line naming what was looked for)."""
    name = hub.model_name(src)
    src = hf.PREFIX + hub.fetch(name)[0] if name else src
    k = start.kind(src, what="")
    if not k:
        raise ConfigError("an empty SRC: give a run directory, an export or hf:DIR.")
    return src, k


def _hf_config(src: str):
    """The run config of `hf:DIR` (`formats.start.apply`), its context as `model.seq_len`."""
    config = base_config()
    config.init_from = src
    config = start.apply(config, say=False)
    config.model.seq_len = config.model.max_positions
    return config


def load(src: str, mesh: dict | None = None) -> Source:
    """SRC (see the module docstring) -> Source.

    Raises:
      FileNotFoundError, ValueError (hf.HFError, ConfigError): SRC is none of the kinds, or does not fit `mesh`."""
    src, k = kind(src)
    if k == "hf":
        where = hf.directory_of(src)
        if not mesh or all(v == 1 for v in mesh.values()):
            fwd, params, tok = hf.load(where)
            return Source(fwd, params, tok, special.chat_format(tok), None, None)
        config = _hf_config(src)
        steps = _on_mesh(config, mesh, int(config.model.vocab_size))
        params = hf.load_params(where, steps.cfg, steps.state_shardings["params"], steps.layer_order)
        tok = data.load_tokenizer(config.data.tokenizer)
        return Source(steps.fwd, params, tok, special.chat_format(tok), steps, config)
    if k == "export":
        fwd, params, tok = load_export(src)
        if not mesh or all(v == 1 for v in mesh.values()):
            return Source(fwd, params, tok, special.chat_format(tok), None, None)
        raise ValueError(f"{src} is an export; generating on a mesh reads a run directory or hf:DIR (export it with "
                         f"--format hf), or leave out --config.mesh.*.")
    run = runs.load_run(src)
    steps = _on_mesh(run.config, {"data": -1, **(mesh or {})}, run.fwd.cfg.vocab_real)
    return Source(steps.fwd, _place(run.params, steps), run.tokenizer, special.chat_format(run.tokenizer),
                  steps, run.config)


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


def _base(src: str) -> tuple[ml_collections.ConfigDict, str, str]:
    """(the config SRC describes, SRC (a Hub name as `hf:DIR`), its kind: run | export | hf), before overrides."""
    src, k = kind(src)
    if k == "hf":
        return _hf_config(src), src, k
    if k == "export":  # its model and the export's own run choices (dtypes, seq_len, attention, remat, ...)
        cfg = start.model_of(src, k)
        config = base_config()
        config.model.update({f: getattr(cfg, f) for f in config.model if hasattr(cfg, f)})
        config.model.vocab_size = cfg.vocab_real
        config.train.update(param_dtype=cfg.param_dtype, compute_dtype=cfg.compute_dtype)
        config.data.tokenizer = os.path.join(src, TOKENIZER_DIR)
        config.init_from = src
        return config, src, k
    return runs.read_config(src), src, k


def on_layout(src: str, overrides=(), rows: int = 8, devices=None) -> Source:
    """SRC (`DIR[@STEP]` for a run's checkpoint) on the layout the overrides give (default: a run's own; data
    parallel over `devices`, default all, for the others); the steps built for batches of `rows` rows (rounded up to
    a multiple of the data shards x microbatches).

    Raises:
      ConfigError: a bad override, or a layout that does not fit the model or the devices (one line each).
      FileNotFoundError / ValueError: SRC is none of the four, or its files are incomplete.
    """
    src, _, at = src.partition("@") if not src.startswith("hf:") else (src, "", "")
    config, src, k = _base(src)
    config = apply_overrides(config, overrides)
    pick_microbatches(config, any(a.startswith("--config.train.microbatches=") for a in overrides))
    devices = list(jax.devices() if devices is None else devices)
    lay = Layout.from_config(config, len(devices))
    n = lay.batch_split * int(config.train.microbatches)
    config.train.global_batch_size = -(-max(rows, 1) // n) * n
    config = gpt.derived(config)
    tok_dir = hf.directory_of(src) if k == "hf" else os.path.join(src, TOKENIZER_DIR)
    tok = data.load_tokenizer(tok_dir)
    steps = steps_for(config, int(config.model.vocab_size) or tok.vocab_size, devices)
    placed = lambda params: Source(steps.fwd, params, tok, special.chat_format(tok), steps, config)  # noqa: E731
    if k == "hf":
        return placed(hf.load_params(tok_dir, steps.cfg, steps.state_shardings["params"], steps.layer_order))
    if k == "export":
        return placed(start.place(src, steps, steps.init(0))["params"])
    ckpt = Checkpointer(src, 1, 1, async_save=False, read_only=True)
    try:
        step = int(at) if at else ckpt.latest_step()
        if step is None:
            raise FileNotFoundError(f"no complete checkpoint in {ckpt.directory}.")
        state, _ = ckpt.restore(step, steps.abstract_state())
    finally:
        ckpt.close()
    return placed(steps.from_canonical(state)["params"])
