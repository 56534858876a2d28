"""Hugging Face `config.json` <-> jaxpar's model settings, for `GPT2LMHeadModel`, `LlamaForCausalLM`,
`Qwen3ForCausalLM` (llama with q/k norms and its own head size), the mixtures of experts `MixtralForCausalLM` and
`Qwen3MoeForCausalLM`, and the vision transformers `ViTForImageClassification` and `ViTModel` (model_type `vit`; with
`preprocessor_config.json` <-> the `data.image_mean` / `data.image_std` keys).

Read: the `model.*` config keys of the same model, refusing what jaxpar's blocks do not compute (another
architecture, biases in Llama's attention or MLP, a head size other than hidden / heads, a RoPE type other than
`default` and `llama3`, GPT-2's attention variants, ViT's relatives and variants). RoPE settings are read from
transformers 5's `rope_parameters` or from the older top-level `rope_theta` / `rope_scaling` (the published Llama 3.x
configs). Write: the config.json `from_pretrained` reads for a jaxpar model, both RoPE spellings included.
"""
from __future__ import annotations

import json
import os

from jaxpar.data.common import channel_values
from jaxpar.formats.hf.files import HFError
from jaxpar.model import family_of

PREPROCESSOR = "preprocessor_config.json"

ARCHITECTURES = {"GPT2LMHeadModel": "gpt2", "LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "llama",
                 "MixtralForCausalLM": "llama", "Qwen3MoeForCausalLM": "llama", "ViTForImageClassification": "vit",
                 "ViTModel": "vit"}
CONFIG_CLASSES = {"gpt2": "GPT2Config", "llama": "LlamaConfig", "vit": "ViTConfig"}  # transformers' (errors)
VIT_TYPE = "vit"  # ViT's model_type: the one vision transformer jaxpar reads
VIT_CLASSIFIER = "ViTForImageClassification"  # the ViT with a classifier (ViTModel's head is the run's, fresh)
QK_NORM = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
MOE = {"MixtralForCausalLM": "mixtral", "Qwen3MoeForCausalLM": "qwen3_moe"}  # -> their tensor names (`keys`)
# what jaxpar does not compute, named in the refusal
REFUSED = {"DeepseekV3ForCausalLM": "DeepSeek's multi-head latent attention (MLA) and routing groups",
           "DeepseekV2ForCausalLM": "DeepSeek's multi-head latent attention (MLA) and routing groups",
           "GptOssForCausalLM": "gpt-oss's attention sinks and sliding-window layers",
           "Qwen2MoeForCausalLM": "Qwen2-MoE's gated shared expert",
           "ViTForMaskedImageModeling": "a pixel decoder on its patches (encoder_stride), no classifier"}
# vision transformers that are not ViT (their model_type), and what jaxpar's ViT does not compute of them
VISION_REFUSED = {"deit": "DeiT's distillation token", "swin": "Swin's shifted windows and patch merging",
                  "swinv2": "Swin's shifted windows and patch merging", "dinov2": "DINOv2's layer scale",
                  "clip_vision_model": "CLIP's pre-LayerNorm and quick GELU", "siglip_vision_model": "SigLIP's "
                  "attention-pooling head", "beit": "BEiT's relative positions and layer scale",
                  "vit_mae": "MAE's masking and decoder", "vit_msn": "ViT-MSN's own heads",
                  "vit_hybrid": "a ResNet stem"}
VIT_READS = f"{VIT_CLASSIFIER} and ViTModel with model_type 'vit'"
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
    kind = hf.get("model_type")
    images = bool(known) and family_of(known[0]).data_kind == "images"
    if kind in VISION_REFUSED or (images and kind not in (VIT_TYPE, None)):
        raise HFError(f"{where}: model_type {kind!r} ({VISION_REFUSED.get(kind, 'not a ViT')}) is not a model jaxpar "
                      f"computes; of the vision transformers it reads {VIT_READS}.")
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
        return READERS[arch](hf, where)
    except HFError:  # a refusal names what is refused and why, once (HFError is a ValueError)
        raise
    except KeyError as e:
        raise HFError(f"{where}: no {e.args[0]!r}, which a {arch} config.json must have.") from e
    except (TypeError, ValueError) as e:
        raise HFError(f"{where}: a value of the wrong type ({e}); compare it with transformers' "
                      f"{CONFIG_CLASSES[arch]}.") from e


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


def _square(hf: dict, key: str, where: str) -> int:
    """ViT's `image_size` / `patch_size`: an int, or [height, width] when both are equal."""
    v = hf[key]
    if isinstance(v, (list, tuple)):
        if len(set(v)) != 1:
            raise HFError(f"{where}: {key}={list(v)} is not square; jaxpar's ViT cuts square images into square "
                          f"patches (one {key}).")
        v = v[0]
    return int(v)


def vit_classes(hf: dict) -> int | None:
    """The classes of a ViTForImageClassification's config.json (its `id2label`, else `num_labels`); None for a ViT
    without a classifier (ViTModel)."""
    if VIT_CLASSIFIER not in (hf.get("architectures") or []):
        return None
    return len(hf["id2label"]) if hf.get("id2label") else int(hf.get("num_labels", 2))


def _vit(hf: dict, where: str) -> dict:
    """A ViT's shape; `num_classes` only with a classifier (`vit_classes`)."""
    if not hf.get("qkv_bias", True):
        raise HFError(f"{where}: qkv_bias=false; jaxpar's vit block has query, key and value biases (load the "
                      f"biases as zeros into a qkv_bias=true model with transformers and save it).")
    if hf.get("hidden_act", "gelu") != "gelu":
        raise HFError(f"{where}: hidden_act={hf['hidden_act']!r}; jaxpar's vit MLP is the exact (erf) GELU, "
                      f"hidden_act='gelu'.")
    size, patch = _square(hf, "image_size", where), _square(hf, "patch_size", where)
    if patch < 1 or size % patch:
        raise HFError(f"{where}: image_size={size} is no whole number of patch_size={patch} patches; jaxpar's vit "
                      f"reads models whose image_size is a multiple of patch_size.")
    d, h = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    if h < 1 or d % h:
        raise HFError(f"{where}: hidden_size={d} is not a multiple of num_attention_heads={h}.")
    out = {"arch": "vit", "layers": int(hf["num_hidden_layers"]), "embed": d, "heads": h,
           "mlp": int(hf["intermediate_size"]), "norm_eps": float(hf.get("layer_norm_eps", 1e-12)),
           "image_size": size, "patch_size": patch, "channels": int(hf.get("num_channels", 3))}
    classes = vit_classes(hf)
    return out if classes is None else {**out, "num_classes": classes}


def image_settings(directory: str) -> dict:
    """{`data.image_mean`, `data.image_std`}: DIR/preprocessor_config.json's, comma-separated ("0.5,0.5,0.5"; a
    processor that does not normalise: "0" and "1"); {} without the file."""
    path = os.path.join(directory, PREPROCESSOR)
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            pre = json.load(f)
        if not pre.get("do_normalize", True):
            return {"data.image_mean": "0", "data.image_std": "1"}
        return {f"data.image_{k}": ",".join(str(float(v)) for v in pre[f"image_{k}"]) for k in ("mean", "std")}
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as e:
        raise HFError(f"{path}: not an image processor's config with image_mean and image_std lists ({e}); "
                      f"save it with transformers' ViTImageProcessor or remove it.") from e


def preprocessor_config(cfg, image_mean: str = "", image_std: str = "") -> dict:
    """The preprocessor_config.json (ViTImageProcessor) of a jaxpar ViT: resize to its image size, rescale to [0,
    1], normalise with the run's `data.image_mean` / `data.image_std` ("": 0.5)."""
    # (the shortest decimals of the float32 values the data layer uses: 0.485, not 0.48500001430511475)
    values = {k: [float(str(x)) for x in channel_values(v, cfg.channels, f"data.image_{k}")]
              for k, v in (("mean", image_mean), ("std", image_std))}
    return {"image_processor_type": "ViTImageProcessor", "do_resize": True,
            "size": {"height": cfg.image_size, "width": cfg.image_size}, "resample": 2, "do_rescale": True,
            "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": values["mean"], "image_std": values["std"]}


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


def _vit_config(cfg, dtype: str, classes=None) -> dict:
    """A jaxpar ViT's config.json (ViTForImageClassification); `classes`: the class names (index = label; None:
    "LABEL_i")."""
    names = [str(c) for c in classes] if classes is not None else [f"LABEL_{i}" for i in range(cfg.num_classes)]
    return {"architectures": [VIT_CLASSIFIER], "model_type": VIT_TYPE, "hidden_size": cfg.embed,
            "num_hidden_layers": cfg.layers, "num_attention_heads": cfg.heads, "intermediate_size": cfg.mlp,
            "hidden_act": "gelu", "layer_norm_eps": cfg.norm_eps, "image_size": cfg.image_size,
            "patch_size": cfg.patch_size, "num_channels": cfg.channels, "qkv_bias": True,
            "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, "num_labels": cfg.num_classes,
            "id2label": {str(i): n for i, n in enumerate(names)}, "label2id": {n: i for i, n in enumerate(names)},
            "dtype": dtype, "torch_dtype": dtype}


def hf_config(cfg, dtype: str, tokenizer=None, classes=None) -> dict:
    """The config.json of a jaxpar model (`ModelConfig`) saved in `dtype`, for transformers 4.x and 5; a ViT's
    `classes` names (None: "LABEL_i")."""
    if cfg.family.data_kind == "images":
        return _vit_config(cfg, dtype, classes)
    common = {"vocab_size": cfg.vocab_real, "tie_word_embeddings": cfg.tie_embeddings, "dtype": dtype,
              "torch_dtype": dtype, "use_cache": True}
    # the end-of-text id, or explicit nulls (else transformers assumes GPT-2's / Llama's ids)
    eos = getattr(tokenizer, "eot_id", None)
    common.update(bos_token_id=eos, eos_token_id=eos, pad_token_id=None)
    return WRITERS[cfg.arch](cfg, common)


def _gpt2_config(cfg, common: dict) -> dict:
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": cfg.embed,
            "n_layer": cfg.layers, "n_head": cfg.heads, "n_inner": cfg.mlp, "n_positions": cfg.max_positions,
            "activation_function": "gelu_new", "layer_norm_epsilon": cfg.norm_eps, "resid_pdrop": 0.0,
            "embd_pdrop": 0.0, "attn_pdrop": 0.0, **common}


def _llama_config(cfg, common: dict) -> dict:
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


# each family's config.json reader and writer (by `model.arch`; its tensor maps: `jaxpar/formats/hf/__init__.py`)
READERS = {"gpt2": _gpt2, "llama": _llama, "vit": _vit}
WRITERS = {"gpt2": _gpt2_config, "llama": _llama_config}
