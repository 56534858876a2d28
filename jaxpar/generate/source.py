"""One loader of a model to generate from (or evaluate): SRC -> its model, params placed on a mesh, tokenizer and chat
template.

SRC is a run directory written by train.py (its latest checkpoint, on the run's own layout by default: its tensor,
stage, expert and ZeRO settings, data over the devices left), an export of `python -m jaxpar.export` (a directory
with model_config.json), `hf:DIR` (a Hugging Face directory) or `hf:ORG/NAME[@REVISION]` (fetched into the Hugging
Face cache once). `mesh` ({"data": 2, "tensor": 2, ...}, the `--config.mesh.*` overrides) lays any of them out on
that mesh; an export or a Hugging Face model without it is read onto one device in float32.
"""
from __future__ import annotations

import math
import os
from typing import NamedTuple

import jax
import numpy as np

from jaxpar import data
from jaxpar import model as gpt
from jaxpar.compiled import steps_for
from jaxpar.config import base_config
from jaxpar.config_keys import MESH_AXES
from jaxpar.data.chat import ChatFormat
from jaxpar.data.common import DataError
from jaxpar.export import CONFIG_FILE, load_export
from jaxpar.formats import hf, hub
from jaxpar.state import runs


class Source(NamedTuple):
    fwd: gpt.Forward
    params: dict  # placed: on one device (`steps` None) or in `steps`' state shardings and layer order
    tokenizer: data.Tokenizer
    chat: ChatFormat | None  # the checkpoint's chat template (its end-of-turn and end-of-sequence ids), if it has one
    steps: object | None  # `compiled.steps_for`'s Steps of the layout, or None (one device)
    config: object | None  # the run config of that layout


def _chat(tok, where: str) -> ChatFormat | None:
    try:
        return ChatFormat.from_dir(getattr(tok, "directory", None) or where)
    except DataError:
        return None


def _place(params, steps):
    """Canonical params (one device) -> `steps`' params shardings, the layer axis in its layer order."""
    order = np.asarray(steps.layer_order)
    shared, layers = gpt.split_params(params)
    params = gpt.join_params(shared, jax.tree.map(lambda a: a[order], layers))
    return jax.device_put(params, steps.state_shardings["params"])


def _on_mesh(config, mesh: dict, vocab: int):
    """`config`'s steps with the `mesh` sizes, on the first devices their product asks for (all with data -1)."""
    for k, v in mesh.items():
        config.mesh[k] = v
    n = math.prod(int(config.mesh[a]) for a in MESH_AXES)
    return steps_for(config, vocab, jax.devices()[:n] if 0 < n <= jax.device_count() else None)


def load(src: str, mesh: dict | None = None) -> Source:
    """SRC (see the module docstring) -> Source.

    Raises:
      FileNotFoundError, ValueError (hf.HFError, ConfigError): SRC is none of the kinds, or does not fit `mesh`."""
    name = hub.model_name(src)
    where = hf.directory_of("hf:" + hub.fetch(name)[0] if name else src)
    if where is not None:
        if not mesh or all(v == 1 for v in mesh.values()):
            fwd, params, tok = hf.load(where)
            return Source(fwd, params, tok, _chat(tok, where), None, None)
        config = base_config()
        config.init_from = hf.PREFIX + where
        config = hf.apply(config, say=False)
        config.model.seq_len = config.model.max_positions
        steps = _on_mesh(config, mesh, int(config.model.vocab_size))
        params = hf.load_params(where, steps.cfg, steps.state_shardings["params"], steps.layer_order)
        tok = data.load_tokenizer(config.data.tokenizer)
        return Source(steps.fwd, params, tok, _chat(tok, where), steps, config)
    if os.path.isfile(os.path.join(src, CONFIG_FILE)):
        fwd, params, tok = load_export(src)
        if not mesh or all(v == 1 for v in mesh.values()):
            return Source(fwd, params, tok, _chat(tok, src), None, None)
        raise ValueError(f"{src} is an export; generating on a mesh reads a run directory or hf:DIR (export it with "
                         f"--format hf), or leave out --config.mesh.*.")
    run = runs.load_run(src)
    steps = _on_mesh(run.config, {"data": -1, **(mesh or {})}, run.fwd.cfg.vocab_real)
    return Source(steps.fwd, _place(run.params, steps), run.tokenizer, _chat(run.tokenizer,
                                                                             os.path.join(src, "tokenizer")),
                  steps, run.config)
