"""LoRA adapters in and out in PEFT's format: a directory with `adapter_config.json` and `adapter_model.safetensors`,
as `PeftModel.save_pretrained` writes it and `PeftModel.from_pretrained` (the Hub, vLLM, TRL) reads it.

A tensor is `base_model.model.<the base module's name>.lora_A.weight` `[r, in_features]` or `.lora_B.weight`
`[out_features, r]`, the module named as in the Hugging Face checkpoint (`jaxpar/formats/hf/keys.py`: jaxpar's weight
`[inputs.., outputs..]` is the module's `[in, out]` matrix, so A's and B's rows and columns flatten the same axes).

In: `apply(config)` takes `r`, `lora_alpha`, `lora_dropout`, `use_rslora` and the adapted modules (from the tensors:
their last name, `q_proj`) into `lora.*` when `lora.adapter` is set; `load(dir, cfg, shardings, layer_order)` places
the adapters on the run's shardings after checking every shape. Options jaxpar does not compute (DoRA, biases,
`modules_to_save`, per-layer ranks or layers, adapters on parameters) are refused, each with one line.
Out: `save(params, cfg, out, base)` (`python -m jaxpar.export --format peft`); adapters on routed experts have no
module of their own in transformers 5's fused experts, so they are refused there (the merged export has them).
"""
from __future__ import annotations

import json
import os

import jax
import numpy as np

from jaxpar.errors import ConfigError
from jaxpar.model import init_params, lora, param_items, unflatten
from jaxpar.formats.hf import maps

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."
# adapter_config.json options jaxpar cannot compute, with the value that means "off"
UNSUPPORTED = {"use_dora": False, "lora_bias": False, "bias": "none", "modules_to_save": None, "rank_pattern": {},
               "alpha_pattern": {}, "layers_to_transform": None, "layers_pattern": None, "target_parameters": None,
               "layer_replication": None, "use_qalora": False}


class PeftError(ConfigError):
    """A PEFT adapter directory jaxpar cannot use; the message names the file and the fix."""


def read_config(directory: str) -> dict:
    """DIR/adapter_config.json, checked: a LoRA adapter with no option jaxpar does not compute."""
    path = os.path.join(directory, CONFIG)
    if not os.path.isfile(path) or not os.path.isfile(os.path.join(directory, WEIGHTS)):
        raise PeftError(f"--config.lora.adapter={directory}: no {CONFIG} and {WEIGHTS} there; give a directory "
                        f"PeftModel.save_pretrained (or python -m jaxpar.export --format peft) wrote.")
    with open(path) as f:
        c = json.load(f)
    if c.get("peft_type") != "LORA":
        raise PeftError(f"{path}: peft_type={c.get('peft_type')!r}; jaxpar loads LoRA adapters only.")
    for key, off in UNSUPPORTED.items():
        if c.get(key, off) not in (off, None, {}, [], False) or (key == "bias" and c.get(key, off) != off):
            raise PeftError(f"{path}: {key}={c[key]!r} is not supported by jaxpar (it computes plain LoRA: "
                            f"{key}={off!r}); merge such an adapter with PEFT first, or train without it.")
    return c


def _modules(cfg) -> dict[str, tuple]:
    """{block path of a weight ("wq"): (its HF weight name with `{i}`, e.g. model.layers.{i}.self_attn.q_proj.weight,
    whether it is one per routed expert)} of `cfg`'s family."""
    return {m.ours[len("blocks."):]: (m.hf, m.per_expert) for m in maps(cfg) if m.ours.startswith("blocks.")}


def _names(directory: str) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(os.path.join(directory, WEIGHTS))


def targets_of(tensors: dict, where: str) -> str:
    """The adapted modules' last names in an adapter's tensors ("q_proj,v_proj"), as `lora.targets`."""
    names = sorted({k.split(".lora_")[0].rsplit(".", 1)[-1] for k in tensors if ".lora_" in k})
    if not names:
        raise PeftError(f"{where}: no lora_A / lora_B tensors in it.")
    return ",".join(names)


def apply(config, say: bool = True):
    """A copy of `config` whose `lora.*` keys are the adapter's (`lora.adapter`); `config` itself never changes."""
    directory = config.lora.adapter
    if not directory:
        return config
    c = read_config(directory)
    config = config.copy_and_resolve_references()
    got = {"rank": int(c["r"]), "alpha": float(c["lora_alpha"]), "dropout": float(c.get("lora_dropout") or 0.0),
           "rslora": bool(c.get("use_rslora", False)),
           "targets": targets_of(_names(directory), os.path.join(directory, WEIGHTS))}
    changed = [f"lora.{k}={v!r}" for k, v in got.items() if config.lora[k] != v]
    config.lora.update(got)
    if say and changed and jax.process_index() == 0:
        print(f"jaxpar: from the adapter {directory}: " + ", ".join(changed))
    return config


def _hf_pair(a: np.ndarray, b: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """One layer's (A `[inputs.., r]`, B `[r, outputs..]`) -> PEFT's (lora_A `[r, in]`, lora_B `[out, r]`)."""
    return np.ascontiguousarray(a.reshape(-1, rank).T), np.ascontiguousarray(b.reshape(rank, -1).T)


def save(params: dict, cfg, out: str, base: str) -> list[str]:
    """Write the adapters of host `params` (canonical layer order) of `cfg` as a PEFT adapter directory in `out`
    (which exists); `base`: `base_model_name_or_path`. Returns the names written."""
    from safetensors.numpy import save_file

    modules, flat, tensors = _modules(cfg), dict(param_items(params)), {}
    adapted = sorted(lora.adapted_paths(params))
    for path in adapted:
        hf, per_expert = modules.get(path, (None, False))
        if hf is None or per_expert:
            raise PeftError(f"the adapter of {path} has no PEFT module in transformers' {cfg.arch} model (routed "
                            f"experts are fused there); export the merged model with --format hf instead.")
        a, b = (np.asarray(flat[f"blocks.{lora.adapter_key(path, x)}"], np.float32) for x in ("a", "b"))
        for i in range(cfg.layers):
            name = PREFIX + hf.format(i=i)[:-len(".weight")]
            tensors[name + ".lora_A.weight"], tensors[name + ".lora_B.weight"] = _hf_pair(a[i], b[i], cfg.lora_rank)
    save_file(tensors, os.path.join(out, WEIGHTS), metadata={"format": "pt"})
    names = sorted({hf.format(i=0)[:-len(".weight")].rsplit(".", 1)[-1] for hf, _ in (modules[p] for p in adapted)})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": cfg.lora_rank,
              "lora_alpha": cfg.lora_alpha, "lora_dropout": cfg.lora_dropout, "target_modules": names,
              "use_rslora": cfg.lora_rslora, "fan_in_fan_out": cfg.family.fan_in_fan_out, "bias": "none",
              "use_dora": False, "init_lora_weights": True, "inference_mode": True, "modules_to_save": None}
    with open(os.path.join(out, CONFIG), "w") as f:
        json.dump(config, f, indent=2)
    return [CONFIG, WEIGHTS]


def _layers(directory: str, cfg, shapes: dict, order) -> dict:
    """{dotted adapter key under the params: the adapter stacked over the layers in `order`, numpy, float as saved}
    for the adapters `shapes` (params-shaped, leaves with `.shape`) holds, every tensor checked."""
    where = os.path.join(directory, WEIGHTS)
    tensors, modules = _names(directory), _modules(cfg)
    known = {PREFIX + hf.format(i=i)[:-len(".weight")] for hf, _ in modules.values() for i in range(cfg.layers)}
    for key in tensors:
        if key.split(".lora_")[0] not in known:
            raise PeftError(f"{where}: {key} adapts a module a {cfg.arch} model of {cfg.layers} layers does not have; "
                            f"the adapter was made for another base model.")
    leaves, flat = dict(param_items(shapes)), {}
    for path in sorted(lora.adapted_paths(shapes)):
        hf = modules[path][0]
        for x, suffix in (("a", "lora_A"), ("b", "lora_B")):
            key = f"blocks.{lora.adapter_key(path, x)}"
            one = tuple(leaves[key].shape[1:])
            want = (cfg.lora_rank, int(np.prod(one[:-1]))) if x == "a" else (int(np.prod(one[1:])), cfg.lora_rank)
            layers = []
            for i in order:
                name = f"{PREFIX}{hf.format(i=i)[:-len('.weight')]}.{suffix}.weight"
                if name not in tensors:
                    raise PeftError(f"{where}: {name} is missing (jaxpar adapts every layer of the modules named).")
                if tensors[name].shape != want:
                    raise PeftError(f"{where}: {name} has shape {list(tensors[name].shape)}, this model needs "
                                    f"{list(want)} (r={cfg.lora_rank}); the adapter was made for another base model.")
                layers.append(tensors[name].T.reshape(one))
            flat[key] = np.stack(layers)
    return flat


def check(directory: str, cfg) -> None:
    """Refuse an adapter that does not fit `cfg`'s model (`load`'s checks), before anything is prepared."""
    _layers(directory, cfg, jax.eval_shape(lambda: init_params(cfg, jax.random.key(0))), range(cfg.layers))


def load(directory: str, cfg, abstract: dict, layer_order=None) -> dict:
    """The adapters of DIR as the trainable part of `cfg`'s params (`model.trainable`), each leaf in the dtype and
    sharding of its `abstract` leaf (the params as `jax.ShapeDtypeStruct`s with shardings), the layer axis in
    `layer_order` (position -> canonical layer; default canonical).

    Raises:
      PeftError: a tensor missing, of another shape, or of a module this model does not have (another base model).
    """
    order = list(range(cfg.layers)) if layer_order is None else list(layer_order)
    leaves = dict(param_items(abstract))
    flat = {k: v.astype(leaves[k].dtype) for k, v in _layers(directory, cfg, abstract, order).items()}
    return unflatten({k: jax.make_array_from_callback(v.shape, leaves[k].sharding, lambda idx, v=v: v[idx])
                      for k, v in flat.items()})
