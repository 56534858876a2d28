"""GPT-2 (Radford et al. 2019) as a family: LayerNorm, a learned position table added at the embedding, fused QKV
with biases, a GELU MLP (`layers.GPT2Block`), heads = KV heads; Hugging Face stores its weights `[in, out]`
(Conv1D)."""
from __future__ import annotations

from jaxpar.model.families.base import Family
from jaxpar.model.layers import GPT2Block, LayerNorm


class GPT2(Family):
    name = "gpt2"
    block = GPT2Block
    norm = LayerNorm
    learned_positions = True
    fan_in_fan_out = True
    # PEFT's target names for GPT-2's modules, and the routed experts' (Mixtral's w1 / w3 / w2)
    lora_names = {"c_attn": ("wqkv",), "c_proj": ("wo", "w_out"), "c_fc": ("w_in",),
                  "w1": ("moe.experts.w_gate",), "w3": ("moe.experts.w_up",), "w2": ("moe.experts.w_down",)}
    lora_default = "c_attn"
