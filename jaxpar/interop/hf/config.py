"""Hugging Face `config.json` <-> jaxpar's model settings, for `GPT2LMHeadModel`, `LlamaForCausalLM`,
`Qwen3ForCausalLM` (llama with q/k norms and its own head size), and the mixtures of experts `MixtralForCausalLM` and
`Qwen3MoeForCausalLM`.

Read: the `model.*` config keys of the same model, refusing what jaxpar's blocks do not compute (another
architecture, biases in Llama's attention or MLP, a head size other than hidden / heads, a RoPE type other than
`default` and `llama3`, GPT-2's attention variants). RoPE settings are read from transformers 5's `rope_parameters`
or from the older top-level `rope_theta` / `rope_scaling` (the published Llama 3.x configs). Write: the config.json
`from_pretrained` reads for a jaxpar model, both RoPE spellings included.
"""
from __future__ import annotations

import json
import os

from jaxpar.interop.hf.files import HFError

ARCHITECTURES = {"GPT2LMHeadModel": "gpt2", "LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "llama",
                 "MixtralForCausalLM": "llama", "Qwen3MoeForCausalLM": "llama"}
QK_NORM = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
MOE = {"MixtralForCausalLM": "mixtral", "Qwen3MoeForCausalLM": "qwen3_moe"}  # -> their tensor names (`keys`)
# what jaxpar does not compute, named in the refusal
REFUSED = {"DeepseekV3ForCausalLM": "DeepSeek's multi-head latent attention (MLA) and routing groups",
           "DeepseekV2ForCausalLM": "DeepSeek's multi-head latent attention (MLA) and routing groups",
           "GptOssForCausalLM": "gpt-oss's attention sinks and sliding-window layers",
           "Qwen2MoeForCausalLM": "Qwen2-MoE's gated shared expert"}
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
    refused = [n for n in names if n in REFUSED]
    if refused and not known:
        raise HFError(f"{where}: {refused[0]} needs {REFUSED[refused[0]]}, which jaxpar does not compute; it reads "
                      f"{sorted(ARCHITECTURES)}.")
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
    names = hf.get("architectures") or []
    qk_norm = any(n in QK_NORM for n in names)
    hd = hf.get("head_dim")
    if h < 1 or (hd is None and d % h) or (hd is not None and hd != d // h and not qk_norm):
        raise HFError(f"{where}: head_dim={hd} with hidden_size={d}, num_attention_heads={h}; jaxpar "
                      f"needs head_dim = hidden_size / num_attention_heads = {d / max(h, 1):g} (Qwen3 sets its own).")
    if hf.get("use_sliding_window", False) or (hf.get("sliding_window") and "MixtralForCausalLM" not in names):
        raise HFError(f"{where}: sliding-window attention; jaxpar's attention is full causal.")
    out = {"arch": "llama", "layers": int(hf["num_hidden_layers"]), "embed": d, "heads": h,
           "head_dim": int(hd) if hd is not None else 0, "qk_norm": qk_norm,
           "kv_heads": int(hf.get("num_key_value_heads") or h), "mlp": int(hf["intermediate_size"]),
           "vocab_size": int(hf["vocab_size"]), "max_positions": int(hf["max_position_embeddings"]),
           "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
           "tie_embeddings": bool(hf.get("tie_word_embeddings", False))}
    moe = next((MOE[n] for n in names if n in MOE), None)
    return {**out, **_rope(hf, where), **(_experts(hf, where, moe) if moe else {})}


def _experts(hf: dict, where: str, family: str) -> dict:
    """The MoE keys of a Mixtral / Qwen3-MoE config.json (every layer a MoE layer: mixing dense layers in is
    refused)."""
    E = int(hf.get("num_local_experts") or hf.get("num_experts") or 0)
    if hf.get("mlp_only_layers") or int(hf.get("decoder_sparse_step", 1)) != 1:
        raise HFError(f"{where}: mlp_only_layers={hf.get('mlp_only_layers')}, decoder_sparse_step="
                      f"{hf.get('decoder_sparse_step')}: dense layers among the MoE ones are not read yet; jaxpar "
                      f"reads models whose every layer is a MoE layer.")
    if E < 1:
        raise HFError(f"{where}: no experts (num_local_experts / num_experts).")
    width = int(hf["intermediate_size"] if family == "mixtral" else hf["moe_intermediate_size"])
    return {"experts": E, "experts_per_token": int(hf["num_experts_per_tok"]), "expert_mlp": width,
            "shared_experts": 0, "router": "softmax",
            "router_norm_topk": True if family == "mixtral" else bool(hf.get("norm_topk_prob", False)),
            "aux_loss": float(hf.get("router_aux_loss_coef", 0.0)), "first_dense_layers": 0, "moe_every": 1}


def moe_family(cfg) -> str | None:
    """Which checkpoint family a jaxpar llama with experts exports as: Qwen3-MoE (with q/k norms) or Mixtral."""
    if not cfg.experts:
        return None
    return "qwen3_moe" if cfg.qk_norm else "mixtral"


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


def _exported(cfg) -> dict:
    """The architecture a jaxpar llama exports as, with its own keys; HFError for what no transformers class
    computes (shared experts, sigmoid routing, dense layers among MoE ones, Mixtral without renormalised top-k)."""
    family = moe_family(cfg)
    if family is None:
        return ({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"} if cfg.qk_norm else
                {"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    plain = (("shared_experts", 0), ("router", "softmax"), ("first_dense_layers", 0), ("moe_every", 1))
    bad = [f"{k}={getattr(cfg, k)!r}" for k, ok in plain if getattr(cfg, k) != ok]
    if family == "mixtral" and not cfg.router_norm_topk:
        bad.append("router_norm_topk=False (Mixtral always renormalises)")
    if bad:
        raise HFError(f"model.{', model.'.join(bad)}: no transformers MoE class computes this model (Mixtral, "
                      f"Qwen3-MoE); export with --format jaxpar.")
    moe = {"num_local_experts": cfg.experts, "num_experts": cfg.experts, "num_experts_per_tok": cfg.experts_per_token,
           "router_aux_loss_coef": cfg.aux_loss, "output_router_logits": False}
    if family == "mixtral":
        return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "router_jitter_noise": 0.0,
                "sliding_window": None, **moe, "intermediate_size": cfg.expert_mlp}
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            "moe_intermediate_size": cfg.expert_mlp, "norm_topk_prob": cfg.router_norm_topk, "decoder_sparse_step": 1,
            "mlp_only_layers": [], **moe}


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
    return {"hidden_size": cfg.embed,
            "intermediate_size": cfg.mlp, "num_hidden_layers": cfg.layers, "num_attention_heads": cfg.heads,
            "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
            "max_position_embeddings": cfg.max_positions, "rms_norm_eps": cfg.norm_eps, "attention_bias": False,
            "mlp_bias": False, "attention_dropout": 0.0, "rope_parameters": rope, "rope_theta": cfg.rope_theta,
            "rope_scaling": legacy, **common, **_exported(cfg)}  # the architecture's keys last (Mixtral's width)
