"""Reading a finished or running WORKDIR back: its config, tokenizer and latest parameters, on any devices (the
params alone are read: no optimizer is built, no optimizer state read)."""
from __future__ import annotations

import json
import os
from typing import NamedTuple

import jax
import ml_collections

from jaxpar import data
from jaxpar.state.checkpoint import Checkpointer
from jaxpar.config import base_config
from jaxpar.model import Forward, family_of
from jaxpar.train.state import fresh_params
from jaxpar.train.step import model_config

CLASSES_FILE = "classes.json"  # a ViT run's class names, a JSON list (index = label), written by the trainer
TOKENIZER_DIR = "tokenizer"  # WORKDIR/tokenizer: the run's tokenizer (and chat template), written by the trainer


def read_config(workdir: str) -> ml_collections.ConfigDict:
    """The resolved config train.py wrote to WORKDIR/config.json; keys added since it was written take their
    defaults.

    Raises:
      FileNotFoundError: WORKDIR has no config.json (not a jaxpar run directory).
    """
    path = os.path.join(workdir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: --workdir must be a directory written by train.py.")
    with open(path) as f:
        raw = json.load(f)
    old = raw.get("data", {})
    if "corpus" in old:  # written before sources and documents: one corpus, val = its last tokens
        old.update(sources=old.pop("corpus"), val_split="tokens")
    config = ml_collections.ConfigDict(raw)
    defaults = base_config()
    _add_missing(config, defaults)
    named = {r[0] for r in config.rules}
    config.rules = tuple(tuple(r) for r in config.rules) + tuple(r for r in defaults.rules if r[0] not in named)
    return config


def _add_missing(config, defaults) -> None:
    """Give `config` every key of `defaults` it lacks (a run written before the key existed ran with its default)."""
    for k, v in defaults.items():
        if k not in config:
            config[k] = v
        elif isinstance(v, ml_collections.ConfigDict) and isinstance(config[k], ml_collections.ConfigDict):
            _add_missing(config[k], v)


def read_classes(workdir: str) -> list[str] | None:
    """WORKDIR/classes.json's class names (index = label), or None when the run has none.

    Raises:
      ValueError: the file is not a JSON list of names."""
    path = os.path.join(workdir, CLASSES_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            names = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not JSON: {e}.") from e
    if not isinstance(names, list) or not all(isinstance(n, (str, int)) for n in names):
        raise ValueError(f"{path}: expected a JSON list of class names (index = label), got {type(names).__name__}.")
    return [str(n) for n in names]


def read_model(workdir: str) -> tuple:
    """(WORKDIR's config, its `ModelConfig`, its tokenizer: None for a ViT), from config.json and WORKDIR/tokenizer
    alone (no array is read).

    Raises:
      FileNotFoundError: WORKDIR has no config.json.
      DataError: an unreadable tokenizer.
    """
    config = read_config(workdir)
    if family_of(config.model.arch).data_kind == "images":  # no tokenizer: the classes are the vocabulary
        tok, vocab = None, int(config.model.num_classes) or len(read_classes(workdir) or ())
    else:
        tok = data.load_tokenizer(os.path.join(workdir, TOKENIZER_DIR))
        vocab = data.model_vocab(config, tok.vocab_size)
    return config, model_config(config, vocab, int(config.mesh.tensor)), tok


def is_run(directory: str) -> bool:
    """Whether `directory` is a run directory train.py wrote (its config.json and checkpoints/)."""
    return os.path.isfile(os.path.join(directory, "config.json")) and os.path.isdir(os.path.join(directory,
                                                                                                  "checkpoints"))


def host_device():
    """The host CPU device (reading a model back needs no accelerator memory), or the default one if JAX has no CPU
    backend."""
    try:
        return jax.local_devices(backend="cpu")[0]
    except RuntimeError:
        return jax.local_devices()[0]


class Run(NamedTuple):
    """A run directory's model read back: its config, the model, params, tokenizer and the step they come from."""
    config: ml_collections.ConfigDict
    fwd: Forward
    params: dict  # the canonical (layout-free) params tree, each leaf a jax.Array on one device
    tokenizer: data.Tokenizer | None  # None for a ViT
    step: int


def load_run(workdir: str, step: int | None = None, device=None) -> Run:
    """WORKDIR's latest (or given) checkpoint, restored onto one device (`device`, default this process's first).

    The checkpoint may come from any layout: the params tree on disk is layout-free. Params keep their saved dtype
    (`train.param_dtype`). Creates nothing in WORKDIR.

    Raises:
      FileNotFoundError: no config, tokenizer or complete checkpoint (or none for `step`) in WORKDIR.
      ValueError: the checkpoint does not match the model that config.json describes; the tokenizer is unreadable.
    """
    config, cfg, tok = read_model(workdir)
    if not os.path.isdir(os.path.join(workdir, "checkpoints")):  # the Checkpointer would create it
        raise FileNotFoundError(f"no checkpoints in {workdir}: train.py has not saved one yet.")
    ckpt = Checkpointer(workdir, 1, 1, async_save=False, read_only=True)
    try:
        step = ckpt.latest_step() if step is None else int(step)
        if step is None:
            raise FileNotFoundError(f"no complete checkpoint in {ckpt.directory}.")
        dev = jax.sharding.SingleDeviceSharding(device or jax.local_devices()[0])
        shapes = jax.eval_shape(lambda: fresh_params(cfg, 0))  # the params alone: no optimizer built or read
        target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=dev), shapes)
        state = ckpt.restore_part(step, {"params": target})
    finally:
        ckpt.close()
    return Run(config, Forward(cfg), state["params"], tok, step)


def load_params(workdir: str, step: int | None = None, device=None):
    """-> (Forward, params on one device, tokenizer) from WORKDIR's latest (or given) checkpoint; see `load_run`.

    Raises:
      FileNotFoundError: no config, tokenizer or complete checkpoint in WORKDIR.
      ValueError: the checkpoint does not match config.json's model; the tokenizer is unreadable.
    """
    run = load_run(workdir, step, device)
    return run.fwd, run.params, run.tokenizer
