"""Where a run starts (`init_from`): fresh weights (`""`), a Hugging Face directory (`hf:DIR`; `hf:ORG/NAME` is one
once fetched, `formats/hub.py`), a jaxpar export (`python -m jaxpar.export`, `formats/exported.py`) or a run
directory (a train.py WORKDIR, `state/runs.py`: its latest checkpoint, LoRA adapters folded in).

Every starting point brings its model: `apply(config)` sets the config's model shape (`model.*`: the fields that fix
the weights) and `data.tokenizer` (its tokenizer, with the chat template and special tokens beside it) to the
starting point's, as `hf.apply` does for `hf:DIR`. What stays the run's: `model.seq_len`, the dtypes, dropout, remat,
attention and the MoE execution choices (no starting point names them), a ViT's `RUN_WINS` keys when the run sets
them, and `data.chat_template` (a file given there is used over the tokenizer's). `check(init_from, cfg)` refuses a
start whose model is not `cfg`'s before anything is written; `load(init_from)` reads its weights onto the host,
`place` puts them in a layout's state, `initial_state` is a run's first state (resumed, or from its starting point;
DPO's frozen reference a copy of the starting weights, or of the starting `lora.adapter`).
"""
from __future__ import annotations

import os

import jax

from jaxpar import model as gpt
from jaxpar.data import ByteTokenizer
from jaxpar.errors import ConfigError
from jaxpar.formats import hf, peft
from jaxpar.formats.exported import CONFIG_FILE, START_FIELDS, is_export, load_export, read_export_config
from jaxpar.state.resume import samples_consumed
from jaxpar.state.runs import TOKENIZER_DIR, host_device, is_run, load_run, read_config, read_model
from jaxpar.model import IDENTITY_FIELDS, family_of, merge_adapters, merge_trainable, split_adapters

VIT_FIELDS = ("image_size", "patch_size", "channels", "num_classes")  # a language model's are 0 (no `model.*` key)
IMAGE_KEYS = ("image_mean", "image_std")  # a ViT run's preprocessing (`hf.RUN_WINS`: the run's when it sets them)


def kind(init_from: str, what: str = "--config.init_from=") -> str:
    """"" (fresh weights), "hf", "export" or "run". `what`: how the error names the value (a generator's SRC: "").

    Raises:
      ConfigError: `init_from` names no starting point (one line naming what was looked for).
    """
    if not init_from:
        return ""
    if hf.directory_of(init_from) is not None:
        return "hf"
    if is_export(init_from):
        return "export"
    if is_run(init_from):
        return "run"
    raise ConfigError(f"{what}{init_from}: neither a jaxpar export (no {CONFIG_FILE}) nor a run "
                      f"directory (no config.json and checkpoints/); give an export (`python -m jaxpar.export`), a "
                      f"train.py workdir with a checkpoint, or hf:DIR (a Hugging Face directory).")


def apply(config, say: bool = True):
    """A copy of `config` with its starting point's model shape and tokenizer (see the module's doc); `config` itself
    when it starts from fresh weights. `say`: print which keys changed (process 0)."""
    k = kind(config.init_from)
    if k == "hf":
        return hf.apply(config, say)
    return hf.adopt(config, settings(config.init_from, k), say) if k else config


def settings(init_from: str, k: str) -> dict:
    """{config key: value} of an export's or a run directory's model shape and tokenizer (`k`: its `kind`)."""
    cfg = model_of(init_from, k)
    out = {f"model.{f}": v for f, v in model_keys(cfg).items()}
    if _images(cfg):  # (only runs: an export of a ViT is a Hugging Face directory)
        run = read_config(init_from)
        return {**out, **{f"data.{n}": run.data[n] for n in IMAGE_KEYS if run.data[n]}}
    return {**out, "data.tokenizer": tokenizer_spec(os.path.join(init_from, TOKENIZER_DIR))}


def model_keys(cfg) -> dict:
    """{`model.*` name: value} of a `ModelConfig`'s identity (its `model.seq_len` aside: the run's): its
    vocabulary's symbols as `vocab_size` (a ViT's classes as `num_classes`), a size that equals what 0 derives as 0."""
    images = _images(cfg)
    unused = ("seq_len", "vocab_real") + (() if images else VIT_FIELDS)
    out = {f: getattr(cfg, f) for f in IDENTITY_FIELDS if f not in unused}
    derived = {"kv_heads": cfg.heads, "head_dim": cfg.embed // cfg.heads, "expert_mlp": cfg.mlp}
    out.update({f: 0 for f, v in derived.items() if out[f] == v})
    return out if images else {**out, "vocab_size": cfg.vocab_real}


def _images(cfg) -> bool:
    """Whether the model's family reads images (its classes are its vocabulary; no tokenizer)."""
    return family_of(cfg.arch).data_kind == "images"


def tokenizer_spec(directory: str) -> str:
    """`data.tokenizer` for a saved tokenizer directory: `byte`, or its tokenizer.json (the chat template and the
    special tokens are read beside it)."""
    return "byte" if os.path.isfile(os.path.join(directory, ByteTokenizer.FILENAME)) else \
        os.path.join(directory, "tokenizer.json")


def model_of(init_from: str, k: str):
    """The `ModelConfig` of an export or a run directory, from its JSON alone (no array is read).

    Raises:
      ConfigError: unreadable or malformed (naming the file).
    """
    try:
        return read_export_config(init_from) if k == "export" else read_model(init_from)[1]
    except (FileNotFoundError, ValueError) as e:  # (a DataError is a ValueError)
        raise ConfigError(f"--config.init_from={init_from}: {e}") from e


def check(init_from: str, cfg) -> None:
    """Refuse (ConfigError, every difference named) a start from an export or a run directory whose model is not
    `cfg`'s (its shape or vocabulary; `model.seq_len` may differ); the trainer calls it before anything is written."""
    k = kind(init_from)
    if k not in ("export", "run"):
        return
    got = model_of(init_from, k)
    diffs = [f"{f}: {k} {getattr(got, f)!r} vs config {getattr(cfg, f)!r}"
             for f in START_FIELDS if getattr(got, f) != getattr(cfg, f)]
    if diffs:
        raise ConfigError(f"--config.init_from={init_from} holds another model:\n  " + "\n  ".join(diffs))


def load(init_from: str) -> dict:
    """The canonical params (on the host CPU) of an export or a run directory's latest checkpoint (a LoRA run's
    adapters folded into their base weights, as its export would hold them)."""
    if kind(init_from) == "export":
        return load_export(init_from, device=host_device())[1]
    run = load_run(init_from, device=host_device())
    return merge_adapters(run.params, run.fwd.cfg)[0]


def place(directory: str, steps, state) -> dict:
    """`state` with its params replaced by those of an export (`python -m jaxpar.export`) or a run directory's latest
    checkpoint (`load`), placed in this layout.

    Raises:
      ConfigError: the starting point's model differs from this config's (shape or vocabulary).
    """
    check(directory, steps.cfg)
    params = load(directory)
    canon = steps.to_canonical(state)
    adapters, base = split_adapters(canon["params"])  # LoRA: the start is the base model; the adapters stay
    base = jax.tree.map(lambda p, q: p.astype(q.dtype), params, base)
    canon["params"] = merge_trainable(adapters, jax.device_put(base, split_adapters(steps.state_shardings["params"])[1]))
    return steps.from_canonical(canon)


def initial_state(config, steps, ckpt, feed, abstract) -> tuple[dict, int]:
    """(state in this layout, first step): the latest checkpoint's, the feed's order continued (`train.feed.Feed`);
    else a fresh state (params from `init_from`'s export when fine-tuning)."""
    latest = ckpt.latest_step()
    if latest is not None:
        state, meta = ckpt.restore(latest, abstract)
        state = steps.from_canonical(state)
        start = int(state["step"])
        # continue the order, whatever the batch size
        feed.resume_at(start, samples_consumed(meta, start, int(config.train.global_batch_size)))
        return state, start
    hf_dir = hf.directory_of(config.init_from)
    if hf_dir is not None:  # weights straight onto this layout's shardings; fresh optimizer state, step 0
        params = hf.load_params(hf_dir, steps.cfg, steps.state_shardings["params"], steps.layer_order,
                                seed=int(config.train.seed))  # (what the checkpoint lacks: a ViT's new head)
        if steps.cfg.lora_rank:
            params = gpt.merge_trainable(start_adapters(config, steps, abstract), params)
        return steps.init_with(params, int(config.train.seed)), 0
    state = steps.init(int(config.train.seed))
    if not (config.init_from or config.lora.adapter):
        return state, 0
    if config.init_from:  # fine-tuning: params from an export or a run, fresh optimizer state, step 0
        state = place(config.init_from, steps, state)
    params = state["params"]
    if config.lora.adapter:
        params = gpt.merge_trainable(start_adapters(config, steps, abstract), gpt.split_trainable(params, steps.cfg)[1])
    # the state anew around the starting params: DPO's frozen reference is a copy of them, not of the random draw
    return steps.init_with(params, int(config.train.seed)), 0


def start_adapters(config, steps, abstract) -> dict:
    """The LoRA adapters a run starts from, in this layout: `lora.adapter`'s (PEFT), else freshly drawn."""
    if config.lora.adapter:
        return peft.load(config.lora.adapter, steps.cfg, gpt.trainable(abstract["params"], steps.cfg),
                         steps.layer_order)
    return steps.init_adapters(int(config.train.seed))
