"""The model (no mesh): one object per family (`families/`: GPT-2, Llama and Qwen3 with their mixtures of experts,
ViT), its config (`config.py`: `ModelConfig`, `config_from`, `IDENTITY_FIELDS`), its spec (`spec.py`: the parameters
with their logical names and roles, LoRA's tree plumbing, the per-layer / shared split), what it costs (`flops.py`),
its forward pass (`forward.py`: `Forward`), and the canonical keys (`keys.py`).

This face gathers the names callers use (`from jaxpar import model as gpt`; `gpt.Forward`, `gpt.init_params`, ...).
"""
from __future__ import annotations

from jaxpar.model import lora, moe  # noqa: F401
from jaxpar.model.config import (IDENTITY_FIELDS, LORA_FIELDS, MOE_FIELDS, ROPE_SCALINGS, SHAPE_FIELDS,  # noqa: F401
                                 ZERO_COUNTS, ModelConfig, config_from, has_dropout, identity,
                                 identity_defaults)
from jaxpar.model.families import ARCHS, FAMILIES, Family, derived, of as family_of  # noqa: F401
from jaxpar.model.flops import flops_per_token, model_flops_per_token, param_counts  # noqa: F401
from jaxpar.model.forward import Forward  # noqa: F401
from jaxpar.model.keys import KEY_SEP, flatten, param_items, unflatten  # noqa: F401
from jaxpar.model.layers import LOGICAL, ROLE, KVCache, param, segment_positions  # noqa: F401
from jaxpar.model.spec import (GPT, adapter_specs, block_weights, decay_mask, init_params, join_params,  # noqa: F401
                               logical_axes, map_layers, merge_adapters, merge_trainable, param_roles, router_bias,
                               split_adapters, split_params, split_trainable, trainable, with_router_bias)
