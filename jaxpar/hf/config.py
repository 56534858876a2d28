"""Hugging Face `config.json` <-> jaxpar's model settings, for `GPT2LMHeadModel` and `LlamaForCausalLM`.

Read: the `model.*` config keys of the same model, refusing what jaxpar's blocks do not compute (another
architecture, biases in Llama's attention or MLP, a head size other than hidden / heads, a RoPE type other than
`default` and `llama3`, GPT-2's attention variants). RoPE settings are read from transformers 5's `rope_parameters`
or from the older top-level `rope_theta` / `rope_scaling` (the published Llama 3.x configs). Write: the config.json
`from_pretrained` reads for a jaxpar model, both RoPE spellings included.
"""
from __future__ import annotations

import json
import os

from jaxpar.hf.files import HFError

ARCHITECTURES = {"GPT2LMHeadModel": "gpt2", "LlamaForCausalLM": "llama"}
_ROPE_KEYS = {"factor": "rope_factor", "low_freq_factor": "rope_low_freq_factor",
              "high_freq_factor": "rope_high_freq_factor",
              "original_max_position_embeddings": "rope_original_max_len"}


def read_json(directory: str) -> dict:
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise HFError(f"{path} not found: {directory} is not a Hugging Face model directory (save_pretrained writes "
                      f"config.json).")
    try:
        with open(path) as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HFError(f"{path} is not JSON: {e}.") from e


def arch_of(hf: dict, where: str) -> str:
    names = hf.get("architectures") or []
    known = [ARCHITECTURES[n] for n in names if n in ARCHITECTURES]
    if not known:
        raise HFError(f"{where}: architectures {names} (model_type {hf.get('model_type')!r}); jaxpar reads "
                      f"{sorted(ARCHITECTURES)}.")
    return known[0]


def model_settings(hf: dict, where: str) -> dict:
    """config.json -> {`model.*` key: value} for jaxpar's config (the architecture's shape, norms, RoPE, tying).

    Raises:
      HFError: another architecture, a feature jaxpar's blocks do not compute, a missing key or a value of the wrong
        type (naming the key)."""
    if not isinstance(hf, dict):
        raise HFError(f"{where}: expected a JSON object, got {type(hf).__name__}.")
    arch = arch_of(hf, where)
    try:
        return _gpt2(hf, where) if arch == "gpt2" else _llama(hf, where)
    except HFError:  # a refusal names what is refused and why, once (HFError is a ValueError)
        raise
    except KeyError as e:
        raise HFError(f"{where}: no {e.args[0]!r}, which a {arch} config.json must have.") from e
    except (TypeError, ValueError) as e:
        raise HFError(f"{where}: a value of the wrong type ({e}); compare it with transformers' "
                      f"{'GPT2Config' if arch == 'gpt2' else 'LlamaConfig'}.") from e


def _gpt2(hf: dict, where: str) -> dict:
    for key, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                      ("reorder_and_upcast_attn", False), ("add_cross_attention", False)):
        if hf.get(key, want) != want:
            raise HFError(f"{where}: {key}={hf[key]!r}; jaxpar's gpt2 block computes {key}={want!r} only.")
    if hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise HFError(f"{where}: activation_function={hf['activation_function']!r}; jaxpar's gpt2 MLP is GELU with "
                      f"the tanh approximation (gelu_new).")
    d = int(hf["n_embd"])
    return {"arch": "gpt2", "layers": int(hf["n_layer"]), "embed": d, "heads": int(hf["n_head"]),
            "mlp": int(hf.get("n_inner") or 4 * d), "vocab_size": int(hf["vocab_size"]),
            "max_positions": int(hf["n_positions"]), "norm_eps": float(hf.get("layer_norm_epsilon", 1e-5)),
            "tie_embeddings": bool(hf.get("tie_word_embeddings", True))}


def _llama(hf: dict, where: str) -> dict:
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key, False):
            raise HFError(f"{where}: {key}=true; jaxpar's llama block has no biases.")
    if hf.get("hidden_act", "silu") != "silu":
        raise HFError(f"{where}: hidden_act={hf['hidden_act']!r}; jaxpar's llama MLP is SwiGLU (silu).")
    d, h = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    if h < 1 or hf.get("head_dim") not in (None, d // h) or d % h:
        raise HFError(f"{where}: head_dim={hf.get('head_dim')} with hidden_size={d}, num_attention_heads={h}; jaxpar "
                      f"needs head_dim = hidden_size / num_attention_heads = {d / max(h, 1):g}.")
    out = {"arch": "llama", "layers": int(hf["num_hidden_layers"]), "embed": d, "heads": h,
           "kv_heads": int(hf.get("num_key_value_heads") or h), "mlp": int(hf["intermediate_size"]),
           "vocab_size": int(hf["vocab_size"]), "max_positions": int(hf["max_position_embeddings"]),
           "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
           "tie_embeddings": bool(hf.get("tie_word_embeddings", False))}
    return {**out, **_rope(hf, where)}


def _rope(hf: dict, where: str) -> dict:
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "llama3"):
        raise HFError(f"{where}: RoPE type {kind!r}; jaxpar computes 'default' and 'llama3' only.")
    out = {"rope_theta": float(theta), "rope_scaling": "llama3" if kind == "llama3" else "none"}
    if kind == "llama3":
        missing = [k for k in _ROPE_KEYS if k not in rope]
        if missing:
            raise HFError(f"{where}: llama3 RoPE scaling without {missing}.")
        out.update({ours: int(rope[k]) if ours == "rope_original_max_len" else float(rope[k])
                    for k, ours in _ROPE_KEYS.items()})
    return out


def hf_config(cfg, dtype: str, tokenizer=None) -> dict:
    """The config.json of a jaxpar model (`ModelConfig`) saved in `dtype`, for transformers 4.x and 5."""
    common = {"vocab_size": cfg.vocab_real, "tie_word_embeddings": cfg.tie_embeddings, "dtype": dtype,
              "torch_dtype": dtype, "use_cache": True}
    # the end-of-text id, or explicit nulls (else transformers assumes GPT-2's / Llama's ids)
    eos = getattr(tokenizer, "eot_id", None)
    common.update(bos_token_id=eos, eos_token_id=eos, pad_token_id=None)
    if cfg.arch == "gpt2":
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": cfg.embed,
                "n_layer": cfg.layers, "n_head": cfg.heads, "n_inner": cfg.mlp, "n_positions": cfg.max_positions,
                "activation_function": "gelu_new", "layer_norm_epsilon": cfg.norm_eps, "resid_pdrop": 0.0,
                "embd_pdrop": 0.0, "attn_pdrop": 0.0, **common}
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling == "llama3":
        rope.update({"rope_type": "llama3", **{k: getattr(cfg, ours) for k, ours in _ROPE_KEYS.items()}})
    legacy = {k: v for k, v in rope.items() if k != "rope_theta"} if cfg.rope_scaling == "llama3" else None
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": cfg.embed,
            "intermediate_size": cfg.mlp, "num_hidden_layers": cfg.layers, "num_attention_heads": cfg.heads,
            "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
            "max_position_embeddings": cfg.max_positions, "rms_norm_eps": cfg.norm_eps, "attention_bias": False,
            "mlp_bias": False, "attention_dropout": 0.0, "rope_parameters": rope, "rope_theta": cfg.rope_theta,
            "rope_scaling": legacy, **common}
