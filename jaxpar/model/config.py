"""The model's config, part of the model spec (`jaxpar/model/spec.py`): `ModelConfig` from the run config
(`config_from`, the fields the model's family reads: `jaxpar/model/families/`), the fields that define a model
(`IDENTITY_FIELDS`: what a resume or an export must match) and the identity of models saved before some fields
existed (`identity_defaults`)."""
from __future__ import annotations

import dataclasses

from jaxpar.model import families, lora

ROPE_SCALINGS = ("none", "llama3")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """One model of a family (`arch`, `jaxpar/model/families/`); fields a family does not use keep their defaults."""
    vocab_size: int  # padded: a multiple of 128 and of the tensor size
    vocab_real: int  # symbols the tokenizer has; logits at ids >= vocab_real never count
    seq_len: int
    layers: int
    embed: int
    heads: int
    mlp: int
    dropout_embed: float = 0.0
    dropout_resid: float = 0.0
    tie_embeddings: bool = True
    remat: str = "none"
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    arch: str = "gpt2"  # gpt2 | llama | vit
    kv_heads: int = 0  # llama's grouped-query KV heads (0: = heads); gpt2 has heads
    head_dim: int = 0  # each head's size (0: embed / heads; Qwen3 sets it apart, e.g. 128 with embed 2048, 32 heads)
    qk_norm: bool = False  # llama: RMSNorm over each head of q and k before RoPE (Qwen3)
    max_positions: int = 0  # gpt2: rows of the position table; llama: longest context (0: = seq_len)
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0  # llama
    rope_scaling: str = "none"  # llama: none | llama3 (Llama 3.1's frequency scaling, the four fields below)
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    attention: str = "auto"  # auto | xla | cudnn | pallas (`jaxpar/kernels/attention.py`)
    loss_chunk: int = 1024  # positions per chunk of the LM head + cross-entropy (`jaxpar/kernels/cross_entropy.py`)
    # vit (`jaxpar/model/families/vit.py`): images `[image_size, image_size, channels]` cut into patches; the sequence
    # is the patches and a class token (`families.vit.seq_len`), the vocabulary the classes (`num_classes`, unpadded)
    image_size: int = 0
    patch_size: int = 0
    channels: int = 0
    num_classes: int = 0
    # mixture of experts (`jaxpar/model/moe.py`; config keys model.*, docs/moe.md); experts = 0: dense
    experts: int = 0
    experts_per_token: int = 2
    expert_mlp: int = 0  # 0: = mlp
    shared_experts: int = 0
    router: str = "softmax"  # softmax | sigmoid
    router_norm_topk: bool = True
    capacity_factor: float = 0.0  # 0: dropless
    aux_loss: float = 0.0
    router_z_loss: float = 0.0
    router_bias_rate: float = 0.0
    first_dense_layers: int = 0
    moe_every: int = 1
    moe_impl: str = "auto"  # buffers | ragged | auto (resolved by jaxpar/plan/target.py; unresolved: buffers)
    grouped_matmul: str = "auto"  # ragged's grouped matmul kernel: xla | mosaic | auto (mosaic on Hopper)
    expert_buffer_factor: float = 0.0  # ragged under expert parallelism: the rows per destination (0: worst case)
    # LoRA adapters (`jaxpar/model/lora.py`; config keys lora.*); lora_rank = 0: none
    lora_rank: int = 0
    lora_targets: tuple = ()  # the block paths of the adapted weights ("wq", "moe.experts.w_gate")
    lora_alpha: float = 16.0  # the adapters' output scale is alpha / r (alpha / sqrt(r) with rslora)
    lora_rslora: bool = False
    lora_dropout: float = 0.0
    base_dtype: str = ""  # the base weights' dtype under LoRA ("": param_dtype)

    def __post_init__(self):
        if self.kv_heads == 0 or not self.family.grouped_query:
            object.__setattr__(self, "kv_heads", self.heads)
        if self.max_positions == 0:
            object.__setattr__(self, "max_positions", self.seq_len)
        if self.expert_mlp == 0:
            object.__setattr__(self, "expert_mlp", self.mlp)
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.embed // self.heads)

    @property
    def family(self) -> families.Family:
        """The model's family (`jaxpar/model/families/`): what it is asked instead of its name."""
        return families.of(self.arch)

    @property
    def lora_scale(self) -> float:
        return lora.scale(self.lora_alpha, self.lora_rank, self.lora_rslora)

    @property
    def weight_dtype(self) -> str:
        """The dtype of every parameter but the adapters (`base_dtype` under LoRA, else `param_dtype`)."""
        return self.base_dtype if self.lora_rank and self.base_dtype else self.param_dtype

    @property
    def rope_scaling_dict(self) -> dict | None:
        if self.rope_scaling != "llama3":
            return None
        return {"factor": self.rope_factor, "low_freq_factor": self.rope_low_freq_factor,
                "high_freq_factor": self.rope_high_freq_factor, "original_max_len": self.rope_original_max_len}


# What defines a model: a resume must find these equal in the checkpoint, an export in its model_config.json (with
# `vocab_size`, the padded table, there); the rest of `ModelConfig` (dropout, remat, dtypes) may change between runs.
IDENTITY_FIELDS = ("arch", "vocab_real", "seq_len", "max_positions", "layers", "embed", "heads", "kv_heads", "head_dim",
                   "qk_norm", "mlp",
                   "tie_embeddings", "norm_eps", "rope_theta", "rope_scaling", "rope_factor", "rope_low_freq_factor",
                   "rope_high_freq_factor", "rope_original_max_len", "experts", "experts_per_token", "expert_mlp",
                   "shared_experts", "router", "router_norm_topk", "first_dense_layers", "moe_every", "image_size",
                   "patch_size", "channels", "num_classes")
MOE_FIELDS = families.base.MOE_KEYS  # the mixture-of-experts fields, written once (`families/base.py`)
SHAPE_FIELDS = ("vocab_size",) + IDENTITY_FIELDS  # what fixes every parameter's shape and value
# the adapters' fields: a LoRA run's state, never an export's model (exports fold the adapters in)
LORA_FIELDS = ("lora_rank", "lora_targets", "lora_alpha", "lora_rslora", "lora_dropout", "base_dtype")
ZERO_COUNTS = ("experts", "shared_experts", "first_dense_layers", "image_size", "patch_size", "channels",
               "num_classes")  # counts of the spec that may be 0 (a dense model; a language model)




def identity(cfg: ModelConfig) -> dict:
    return {f: getattr(cfg, f) for f in IDENTITY_FIELDS}


def identity_defaults(saved: dict) -> dict:
    """The identity fields a model saved before they existed had, given its saved `seq_len`, `heads` and `mlp` (a
    model saved without `arch` was a gpt2 with the defaults; one without `experts` was dense)."""
    d = {f.name: f.default for f in dataclasses.fields(ModelConfig) if f.name in IDENTITY_FIELDS
         and f.default is not dataclasses.MISSING}
    heads, embed = saved.get("heads"), saved.get("embed")
    return {**d, "kv_heads": heads, "max_positions": saved.get("seq_len"), "expert_mlp": saved.get("mlp"),
            "head_dim": embed // heads if heads and embed else None}


def config_from(config, vocab_real: int, tensor: int) -> ModelConfig:
    """The model of a run config (`config.model`, the dtypes of `config.train`, the adapters of `config.lora`): the
    fields its family reads (`Family.config_fields`: a language model's vocabulary padded to a multiple of 128 and
    of the tensor size; a ViT's `vocab_real` its classes, its sequence its patches and class token)."""
    family = families.of(config.model.arch)
    return ModelConfig(**family.config_fields(config, vocab_real, tensor), **lora_fields(config))


def lora_fields(config) -> dict:
    """The ModelConfig fields of `config.lora` (none when `lora.rank` is 0): the targets as every block path their
    names may stand for (`lora.candidates`; the model gives adapters to those it has)."""
    lo = config.lora
    if lo.rank == 0:
        return {}
    return {"lora_rank": lo.rank, "lora_targets": lora.candidates(families.of(config.model.arch), lo.targets),
            "lora_alpha": float(lo.alpha), "lora_rslora": bool(lo.rslora), "lora_dropout": lo.dropout,
            "base_dtype": lo.base_dtype}


def has_dropout(cfg: ModelConfig) -> bool:
    return cfg.dropout_embed > 0 or cfg.dropout_resid > 0 or (cfg.lora_rank > 0 and cfg.lora_dropout > 0)
