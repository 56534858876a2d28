"""Llama (Touvron et al. 2023; Llama 3's RoPE scaling, Dubey et al. 2024) as a family, and its kin: Qwen3 (q/k norms,
a head size of its own), and with `model.experts` the mixtures of experts (Mixtral, Qwen3-MoE): RMSNorm, RoPE in the
blocks, grouped-query attention, SwiGLU (`layers.LlamaBlock`)."""
from __future__ import annotations

from jaxpar.model.families.base import Family
from jaxpar.model.layers import LlamaBlock, RMSNorm

# Hugging Face projection names (PEFT's `target_modules`) -> the weights they name, as paths within a block: the
# dense MLP's, the routed experts' (`moe.experts.`) and the shared experts' (`moe.shared.`). Qwen3-MoE's experts are
# named like the dense MLP's projections; Mixtral's w1 / w3 / w2.
_MLP = {"gate_proj": "w_gate", "up_proj": "w_up", "down_proj": "w_down"}


class Llama(Family):
    name = "llama"
    block = LlamaBlock
    norm = RMSNorm
    grouped_query = True
    qk_norm = True
    lora_names = {"q_proj": ("wq",), "k_proj": ("wk",), "v_proj": ("wv",), "o_proj": ("wo",),
                  **{hf: (w, f"moe.experts.{w}", f"moe.shared.{w}") for hf, w in _MLP.items()},
                  "w1": ("moe.experts.w_gate",), "w3": ("moe.experts.w_up",), "w2": ("moe.experts.w_down",)}
    lora_default = "q_proj,v_proj"
