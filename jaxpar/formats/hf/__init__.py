"""Hugging Face checkpoints in and out: a directory as transformers' `save_pretrained` writes it (`config.json`,
`model.safetensors` or its shards with `model.safetensors.index.json`, `tokenizer.json`) for `GPT2LMHeadModel` and
`LlamaForCausalLM` (and its kin: `config.py`), and for the vision transformers `ViTForImageClassification` and
`ViTModel` (no tokenizer; `preprocessor_config.json` instead: the images' mean and std).

In: `settings(dir)` -> the run config's `model.*` keys and tokenizer; `check(dir, cfg)` reads only the headers and
refuses a missing, truncated or misshapen tensor; `load_params(dir, cfg, shardings, layer_order)` places every
tensor straight onto the run's shardings, each process reading only the slices its devices hold, one layer at a
time (host memory: about one HF tensor). `load(dir)` -> (Forward, params, tokenizer) on one device, for sampling.
A ViT's classifier is read when the checkpoint has one of the run's classes; else (ViTModel, or `model.num_classes`
set to other classes: fine-tuning) the head is the run's fresh one.
Out: `save(params, cfg, tokenizer, out, dtype, max_shard_bytes, classes, image_mean, image_std)`
(`python -m jaxpar.export --format hf`).
"""
from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar import data
from jaxpar.config import base_config
from jaxpar.data import BPETokenizer
from jaxpar.data import special
from jaxpar.data.chat import chat_files
from jaxpar.formats.hf import files, keys
from jaxpar.formats.hf.config import (PREPROCESSOR, arch_of, hf_config, image_settings, model_settings, moe_family,
                                      preprocessor_config, read_json, vit_classes)
from jaxpar.formats.hf.files import HFError
from jaxpar.model import (Forward, config_from, derived, family_of, init_params, param_items, router_bias,
                          split_adapters, unflatten)
from jaxpar.train.state import fresh_params
from jaxpar.validate import validate

PREFIX = "hf:"
TOKENIZER = "tokenizer.json"
RUN_WINS = ("model.num_classes", "data.image_mean", "data.image_std")  # the checkpoint's only where the run left them


def directory_of(init_from: str) -> str | None:
    """`hf:DIR` -> DIR (`hf:` alone -> ""); anything else -> None."""
    return init_from[len(PREFIX):] if isinstance(init_from, str) and init_from.startswith(PREFIX) else None


def settings(directory: str) -> dict:
    """{config key: value}: the `model.*` shape keys from config.json and `data.tokenizer` = DIR/tokenizer.json; a
    ViT's `data.image_mean` / `data.image_std` from DIR/preprocessor_config.json instead (`image_settings`).

    Raises:
      HFError: no config.json or tokenizer.json, an unsupported architecture or feature (another vision transformer
        than ViT, a ViT variant), a tokenizer with more symbols than the embedding has rows, an unreadable
        preprocessor_config.json.
    """
    where = os.path.join(directory, "config.json")
    out = {f"model.{k}": v for k, v in model_settings(read_json(directory), where).items()}
    if family_of(out["model.arch"]).data_kind == "images":
        return {**out, **image_settings(directory)}
    tok_path = os.path.join(directory, TOKENIZER)
    if not os.path.isfile(tok_path):
        raise HFError(f"{tok_path} not found; save the tokenizer with transformers (`AutoTokenizer.from_pretrained"
                      f"(DIR).save_pretrained(DIR)` writes it) or copy it next to config.json.")
    n = BPETokenizer.from_file(tok_path).vocab_size
    if n > out["model.vocab_size"]:
        raise HFError(f"{tok_path} has {n} symbols but the embedding has only vocab_size={out['model.vocab_size']} "
                      f"rows ({where}); use the tokenizer the model was trained with.")
    return {**out, "data.tokenizer": tok_path}


def apply(config, say: bool = True):
    """A copy of `config`, with `init_from = hf:DIR`, whose model shape and tokenizer are DIR's (`adopt`);
    `config` itself is never changed. `say`: print which keys it changed, and when a ViT's classifier is not DIR's
    (process 0)."""
    directory = directory_of(config.init_from)
    if directory is None:
        return config
    config = adopt(config, settings(directory), say)
    images = family_of(config.model.arch).data_kind == "images"
    if say and jax.process_index() == 0 and images and vit_classes(read_json(directory)) != config.model.num_classes:
        print(f"jaxpar: from {config.init_from}: {_fresh_head(directory, config.model.num_classes)}")
    return config


def adopt(config, found: dict, say: bool = True):
    """A copy of `config` with the keys of `found` ({config key: value}: a starting point's model shape and tokenizer)
    set to its values, but for `RUN_WINS` keys the run sets (model.seq_len, the dtypes, dropout and the rest stay the
    run's: `found` holds none of them). `say`: print the keys it changed (process 0)."""
    config, changed = config.copy_and_resolve_references(), []
    for key, v in found.items():
        sect, name = key.split(".")
        if key in RUN_WINS and config[sect][name]:
            continue
        if config[sect][name] != v:
            changed.append(f"{key}={v!r}")
        config[sect][name] = v
    if say and changed and jax.process_index() == 0:
        print(f"jaxpar: from {config.init_from}: " + ", ".join(changed))
    return config


def _fresh_head(directory: str, classes: int) -> str:
    """Why a ViT's classifier starts fresh (the run's classes, `classes`, 0: the data's, are not DIR's)."""
    theirs = vit_classes(read_json(directory))
    ours = f"model.num_classes={classes}" if classes else "the data's classes"
    if theirs is None:
        return f"{directory} has no classifier (ViTModel): the head is initialised fresh for {ours}."
    return (f"the checkpoint's classifier has {theirs} classes (config.json id2label), the run's {ours}: the head "
            f"is initialised fresh.")


def maps(cfg, have: dict | None = None, directory: str | None = None) -> list[keys.Map]:
    """The tensor maps of `cfg`'s family; `have` (the directory's `files.tensors`) tells GPT-2's key prefix and ViT's
    names, `directory` whether a ViT's classifier is read (its config.json's classes are `cfg`'s; else it is the
    run's, fresh)."""
    return _MAPS[cfg.arch](cfg, have, directory)


def _vit_maps(cfg, have, directory):
    head = directory is None or vit_classes(read_json(directory)) == cfg.num_classes
    return keys.vit_maps(*keys.vit_naming(have), head=head)


def _gpt2_maps(cfg, have, directory):
    prefix = "" if have is not None and "wte.weight" in have else "transformer."  # hub files have no prefix
    return keys.gpt2_maps(cfg.tie_embeddings, prefix)


# each family's tensor maps (by `model.arch`; Hugging Face's side of a family: `config.py` reads and writes its
# config.json)
_MAPS = {"gpt2": _gpt2_maps, "vit": _vit_maps,
         "llama": lambda cfg, have, directory: keys.llama_maps(cfg.tie_embeddings, moe_family(cfg), cfg.qk_norm)}


def _leaves(cfg, mapping) -> dict:
    """{dotted param path: (its ShapeDtypeStruct, one layer's shape)} for the params `mapping` names."""
    shapes = dict(param_items(jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))))
    return {m.ours: (shapes[m.ours], tuple(shapes[m.ours].shape[1 if m.per_layer else 0:])) for m in mapping}


def layer_names(m: keys.Map, layers: int):
    """The HF names of map `m`: one per layer for a per-layer map (a per-expert or parted map's still hold `{e}`,
    `{p}`)."""
    return [m.hf.replace("{i}", str(i)) for i in range(layers)] if m.per_layer else [m.hf]


def _part_shape(m: keys.Map, one: tuple) -> tuple:
    """One HF tensor's part of a layer's jaxpar leaf of shape `one`: without the axis several stack on."""
    return one if m.split is None else one[:m.split] + one[m.split + 1:]


def _expected(cfg, mapping) -> dict:
    """{HF name: (Map, the jaxpar shape of one layer's, or one expert's or part's, part)} for `cfg`."""
    leaves = _leaves(cfg, mapping)
    return {n: (m, _part_shape(m, leaves[m.ours][1])) for m in mapping
            for name in layer_names(m, cfg.layers) for n in keys.split_names(m, name, cfg.experts)}


def check(directory: str, cfg) -> dict:
    """Every tensor `cfg` needs is in DIR with the shape config.json implies, and DIR holds no other parameter.
    Reads headers only. Returns {HF name: `files.StoredTensor`}.

    Raises:
      HFError: naming the first missing, misshapen or unexpected tensor, or the missing or truncated file.
    """
    have = files.tensors(directory)
    mapping = maps(cfg, have, directory)
    want = _expected(cfg, mapping)
    for name, (m, one) in want.items():
        shape = keys.hf_shape(m, one, cfg.vocab_real)
        if name not in have:
            raise HFError(f"{directory}: tensor {name!r} {list(shape)} is missing; the checkpoint is incomplete or "
                          f"not a {arch_of(read_json(directory), directory)} of this shape.")
        if have[name].dtype not in files.DTYPES.values():
            raise HFError(f"{have[name].path}: tensor {name!r} has dtype {have[name].dtype}; jaxpar reads "
                          f"{sorted(files.DTYPES)}.")
        if have[name].shape != shape:
            raise HFError(f"{have[name].path}: tensor {name!r} is {list(have[name].shape)}, but config.json implies "
                          f"{list(shape)}; the weights and config.json disagree.")
    unread = _unread(cfg, mapping)
    extra = sorted(k for k in have if k not in want and k not in unread and not k.endswith(keys.IGNORED_SUFFIXES))
    if extra:
        raise HFError(f"{have[extra[0]].path}: unexpected tensor {extra[0]!r}: the model config.json describes has no "
                      f"such parameter.")
    return have


def _unread(cfg, mapping) -> set:
    """The HF tensors a checkpoint may hold that `mapping` leaves unread: a tied head saved anyway, a ViT's
    classifier of other classes."""
    if cfg.family.data_kind == "images":
        return set(keys.VIT_HEAD) - {m.hf for m in mapping}
    return {"lm_head.weight"} if cfg.tie_embeddings else set()


_set_layer = jax.jit(lambda buf, x, j: jax.lax.dynamic_update_index_in_dim(buf, x, j, 0), donate_argnums=0)


def _place(reader, m, one, shape, dtype, sharding, order, rows):
    """One jaxpar leaf of `shape` (with the layers axis for per-layer leaves) as a jax.Array with `sharding`, from
    the slices this process's devices hold; devices holding the same slice share one read."""
    per_device = sharding.addressable_devices_indices_map(shape)
    groups: dict = {}
    for dev, idx in per_device.items():
        key = tuple(s.indices(n)[:2] for s, n in zip(idx, shape))
        groups.setdefault(key, []).append(dev)
    out = {}
    for key, devs in groups.items():
        idx = tuple(slice(a, b) for a, b in key)
        if not m.per_layer:
            block = keys.block_of(m, one, idx, lambda box: reader.read(m.hf, box), rows).astype(dtype, copy=False)
            out.update({d: jax.device_put(block, d) for d in devs})
            continue
        bufs = {d: jnp.zeros(tuple(b - a for a, b in key), dtype, device=d) for d in devs}
        for j, pos in enumerate(range(*key[0])):
            part = _layer_part(reader, m, one, idx[1:], order[pos], rows).astype(dtype, copy=False)
            bufs = {d: _set_layer(b, jax.device_put(part[None], d), j) for d, b in bufs.items()}
        out.update(bufs)
    return jax.make_array_from_single_device_arrays(shape, sharding, [out[d] for d in per_device])


def _layer_part(reader, m, one, idx, layer: int, rows):
    """The part `idx` of layer `layer`'s leaf (shape `one`): one HF tensor's block, or, per expert or part, the
    blocks of those `idx` spans on the axis they stack on, stacked."""
    a = m.split
    names = keys.split_names(m, m.hf.replace("{i}", str(layer)), one[0])
    if a is None:
        return keys.block_of(m, one, idx, lambda box: reader.read(names[0], box), rows)
    rest = idx[:a] + idx[a + 1:]
    return np.stack([keys.block_of(m, _part_shape(m, one), rest, lambda box, n=names[k]: reader.read(n, box), rows)
                     for k in range(*idx[a].indices(one[a])[:2])], axis=a)


def _trim() -> None:
    """Hand the heap's freed pages back to the OS (glibc's `malloc_trim`; elsewhere nothing): the reads of one leaf,
    freed, would otherwise stay in the process's resident memory while the next leaf is read."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def load_params(directory: str, cfg, shardings, layer_order=None, seed: int = 0) -> dict:
    """DIR's weights as jaxpar's params tree (param dtype of `cfg`), each leaf placed with its `shardings` leaf and
    the layer axis in `layer_order` (position -> canonical layer; default canonical). Checks first (`check`). With
    LoRA (`cfg.lora_rank`), the base model's params only (`model.split_trainable`'s frozen part). A parameter DIR has
    no tensor for is the fresh one of a run of `seed` (`train.seed`): the expert choice bias (Mixtral and Qwen3-MoE
    have none), zeros; a ViT's classifier of other classes than DIR's (`maps`)."""
    have = check(directory, cfg)
    order = list(range(cfg.layers)) if layer_order is None else list(layer_order)
    mapping = maps(cfg, have, directory)
    sh, leaves = dict(param_items(shardings)), _leaves(cfg, mapping)
    reader, flat = files.Reader(have), {}
    try:
        for m in mapping:
            s, one = leaves[m.ours]
            flat[m.ours] = _place(reader, m, one, s.shape, s.dtype, sh[m.ours], order, cfg.vocab_real)
            _trim()
    finally:
        reader.close()
    base = split_adapters(jax.eval_shape(lambda: init_params(cfg, jax.random.key(0))))[1]
    # (LoRA's adapters are not the checkpoint's: the caller adds them)
    missing = [path for path, _ in param_items(base) if path not in flat]
    if missing:
        pick = lambda: {p: a for p, a in param_items(fresh_params(cfg, seed)) if p in missing}
        flat.update(jax.jit(pick, out_shardings={p: sh[p] for p in missing})())
    return unflatten(flat)


def load(directory: str, device=None, param_dtype: str = "float32"):
    """-> (Forward, params on one device, tokenizer) of DIR, for sampling or classifying (float32 params and
    compute); a ViT's tokenizer is None.

    Raises:
      HFError: as `settings` and `check`; a ViT without a classifier (ViTModel: fine-tune it with `init_from`)."""
    config = base_config()
    config.init_from = PREFIX + directory
    config.mesh.update(data=1, tensor=1, stage=1)
    config.train.update(param_dtype=param_dtype, compute_dtype=param_dtype)
    config = apply(config, say=False)
    config.model.seq_len = config.model.max_positions
    config = derived(config)  # a ViT's sequence: its patches and the class token
    vit = family_of(config.model.arch).data_kind == "images"
    if vit and not config.model.num_classes:
        raise HFError(f"{directory} has no classifier (ViTModel), so it classifies nothing; fine-tune one from it "
                      f"with --config.init_from=hf:{directory} (and model.num_classes).")
    validate(config, 1)  # the model's own rules (heads, kv_heads, RoPE, ...), as for a run
    cfg = config_from(config, config.model.vocab_size, 1)
    single = jax.sharding.SingleDeviceSharding(device or jax.devices()[0])
    shard = jax.tree.map(lambda _: single, jax.eval_shape(lambda: init_params(cfg, jax.random.key(0))))
    tok = None if vit else data.load_tokenizer(config.data.tokenizer)
    return Forward(cfg), load_params(directory, cfg, shard), tok


def hf_tensors(params, cfg):
    """(Hugging Face name, host array in HF's layout) of every tensor of a params-shaped tree (canonical layer order):
    what `save` writes; gradients map the same way."""
    flat = dict(param_items(params))
    for m in maps(cfg):
        a = np.asarray(flat[m.ours])
        for i, name in enumerate(layer_names(m, cfg.layers)):
            part = a[i] if m.per_layer else a
            for k, n in enumerate(keys.split_names(m, name, cfg.experts)):
                yield n, keys.to_hf(m, part if m.split is None else np.take(part, k, axis=m.split), cfg.vocab_real)


def save(params, cfg, tokenizer, out: str, dtype: str, max_shard_bytes: int, classes=None, image_mean: str = "",
         image_std: str = "") -> list[str]:
    """Write host params (canonical layer order) of `cfg` as an HF directory in `out` (which exists): config.json,
    the weights in `dtype`, tokenizer.json, tokenizer_config.json and generation_config.json (the end ids,
    `special.end_ids`, when the model has any); for a ViT (`tokenizer` unused), its `classes`
    names in config.json (None: "LABEL_i") and preprocessor_config.json with the run's `data.image_mean` /
    `data.image_std`. Returns the names written."""
    np_dtype = jnp.dtype(dtype)
    if cfg.experts and np.any(np.asarray(router_bias(params))):
        raise HFError("the model's expert choice bias (model.router_bias_rate) is not zero: Mixtral and Qwen3-MoE "
                      "checkpoints have none, so transformers would route differently; export with --format jaxpar.")
    if classes is not None and len(classes) != cfg.num_classes:
        raise HFError(f"{len(classes)} class names for a classifier of model.num_classes={cfg.num_classes}; give one "
                      f"name per class (index = label).")
    tensors = ((n, a.astype(np_dtype)) for n, a in hf_tensors(params, cfg))
    names = files.write(out, tensors, max_shard_bytes)
    if cfg.family.data_kind == "images":
        for name, content in (("config.json", hf_config(cfg, dtype, classes=classes)),
                              (PREPROCESSOR, preprocessor_config(cfg, image_mean, image_std))):
            with open(os.path.join(out, name), "w") as f:
                json.dump(content, f, indent=2)
        return names + ["config.json", PREPROCESSOR]
    hf_tok = tokenizer.to_hf()
    hf_tok.save(os.path.join(out, TOKENIZER))
    # the end-of-text token by name, as config.json's bos/eos ids say (AutoTokenizer then knows it; generate stops);
    # a chat tokenizer's template and special tokens as its checkpoint had them, its eos_token the end of a turn
    eot = {} if tokenizer.eot_id is None else dict.fromkeys(("bos_token", "eos_token"),
                                                              hf_tok.id_to_token(tokenizer.eot_id))
    tok_config = {**eot, **chat_files(getattr(tokenizer, "directory", None))}
    model_config = hf_config(cfg, dtype, tokenizer)
    for key in ("bos_token", "eos_token"):
        if tok_config.get(key) is not None and hf_tok.token_to_id(tok_config[key]) is not None:
            model_config[f"{key}_id"] = hf_tok.token_to_id(tok_config[key])
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(model_config, f, indent=2)
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.max_positions,
                   **tok_config}, f)
    generation = special.generation_config(tokenizer, model_config.get("bos_token_id"))
    if generation:  # every end id the checkpoint declared, as transformers' generate reads them
        with open(os.path.join(out, special.GENERATION_CONFIG), "w") as f:
            json.dump(generation, f, indent=2)
    return names + ["config.json", TOKENIZER, "tokenizer_config.json"] + [special.GENERATION_CONFIG] * bool(generation)


__all__ = ["HFError", "PREFIX", "apply", "check", "directory_of", "hf_tensors", "load", "load_params", "save",
           "settings"]
