"""What a model family is, as one object (`Family`): the rest of jaxpar asks it questions instead of testing its
name. A family answers: its block and final norm (`jaxpar/model/layers.py`), its ends (the input end: a token
table, or patches; the output end: an LM head, or a classifier), the `ModelConfig` fields it reads from a run config
and the keys other keys fix (`derived`), what its data is (`data_kind`: tokens or images), the FLOPs its ends do not
spend, its LoRA target names (PEFT's), and its own validation rules.

The defaults here are a decoder-only language model's (token embedding, tied or separate LM head, RoPE in the
blocks); a family overrides what differs. The registry (`jaxpar/model/families/__init__.py`) maps `model.arch` to
the family's object; adding a family is its module and one line there (docs/architecture.md).
"""
from __future__ import annotations

from jaxpar.config import mlp_width, padded_vocab
from jaxpar.model.base import param
from jaxpar.model.layers import lookup
from jaxpar.parallel.logical import constrain

ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor",
             "rope_original_max_len")
# the mixture-of-experts keys of `config.model` a language family reads (`ModelConfig`'s MoE fields)
MOE_KEYS = ("experts", "experts_per_token", "expert_mlp", "shared_experts", "router", "router_norm_topk",
            "capacity_factor", "aux_loss", "router_z_loss", "router_bias_rate", "first_dense_layers", "moe_every",
            "moe_impl", "grouped_matmul", "expert_buffer_factor")


class Family:
    """A decoder-only language model family; subclasses set their block and what differs."""
    name = ""  # `model.arch`
    block = None  # the block class, one per layer (`jaxpar/model/layers.py`)
    norm = None  # the final norm's class
    data_kind = "tokens"  # what the data pipeline feeds it: tokens | images
    learned_positions = False  # a position table (`wpe`) added at the embedding; else the blocks rotate q and k
    grouped_query = False  # its own `kv_heads` (grouped-query attention); else kv_heads = heads
    qk_norm = False  # may norm each head of q and k (`model.qk_norm`, Qwen3)
    context_parallel = True  # runs under mesh.context > 1 (`jaxpar/parallel/context.py`)
    lora_names: dict = {}  # PEFT's target names -> the block paths they name (`jaxpar/model/lora.py`); {}: no LoRA
    lora_default = ""  # what `lora.targets='auto'` names (PEFT's default for the family)
    fan_in_fan_out = False  # its Hugging Face weights are stored `[in, out]` (GPT-2's Conv1D; PEFT's flag)

    # ---- its config ------------------------------------------------------------------------------------------

    def config_fields(self, config, vocab_real: int, tensor: int) -> dict:
        """`ModelConfig`'s fields (but LoRA's) of a run config: the vocabulary padded to a multiple of 128 and of the
        tensor size (`config.padded_vocab`)."""
        m = config.model
        return dict(
            vocab_size=padded_vocab(vocab_real, tensor), vocab_real=vocab_real, seq_len=m.seq_len, layers=m.layers,
            embed=m.embed, heads=m.heads, mlp=mlp_width(config), dropout_embed=m.dropout_embed,
            dropout_resid=m.dropout_resid, tie_embeddings=m.tie_embeddings, remat=m.remat,
            param_dtype=config.train.param_dtype, compute_dtype=config.train.compute_dtype, arch=m.arch,
            kv_heads=m.kv_heads, head_dim=m.head_dim, qk_norm=m.qk_norm, max_positions=m.max_positions,
            norm_eps=m.norm_eps, attention=m.attention, loss_chunk=m.loss_chunk, **{k: m[k] for k in ROPE_KEYS},
            **{k: m[k] for k in MOE_KEYS})

    def derived(self, config):
        """`config` with the keys other keys fix (the same object when none is)."""
        return config

    def vocab(self, config, data_vocab: int) -> int:
        """The model's vocabulary (its `vocab_real`) given the data's."""
        return data_vocab

    def tokens_per_item(self, cfg) -> int:
        """Tokens the model computes per item the data counts (a token: 1)."""
        return 1

    # ---- its ends ----------------------------------------------------------------------------------------------

    def add_embedding(self, module, cfg, rngs, dt) -> None:
        """The input end's parameters on `module` (the GPT): the token table `[vocab, embed]`, and a position table
        `[max_positions, embed]` with learned positions."""
        module.wte = param(rngs.params(), (cfg.vocab_size, cfg.embed), 0.02, ("vocab", "embed"), dt, "embedding")
        if self.learned_positions:
            module.wpe = param(rngs.params(), (cfg.max_positions, cfg.embed), 0.02, ("seq", "embed"), dt, "position")

    def add_head(self, module, cfg, rngs, dt) -> None:
        """The output end's parameters after the final norm: the LM head `[embed, vocab]` unless tied to `wte`."""
        if not cfg.tie_embeddings:
            module.lm_head = param(rngs.params(), (cfg.embed, cfg.vocab_size), 0.02, ("embed", "vocab"), dt)

    def embed(self, params, tokens, cfg, dtype):
        """tokens `[batch, seq]` int32 -> `[batch, seq, embed]` in `dtype` (learned positions: `Forward.embed`)."""
        return lookup(params["wte"], constrain(tokens, ("batch", "seq")), dtype)

    def head_flops_unspent(self, cfg) -> float:
        """FLOPs per token that PaLM's formula counts for the head but the family does not spend (a classifier
        on one token of the sequence)."""
        return 0.0

    # ---- its rules -------------------------------------------------------------------------------------------

    def errors(self, config, lay) -> list[str]:
        """The family's own rules on a run config and its `Layout`, one line each (`jaxpar/validate.py` adds them)."""
        return []
