"""What a config key is (`Key`: default, type, range, meaning) and the value sets several keys and rooms share."""
from __future__ import annotations

import dataclasses
import numbers
from typing import Callable

# Logical axis -> mesh axis (None: replicated). Megatron's tensor-parallel pattern: heads and MLP width are split
# (column-parallel in, row-parallel out), the vocabulary is split (vocab-parallel embedding and logits); the batch is
# split over data (and over expert: every parameter but the experts treats those devices as data replicas); the
# stacked layers over stage (the pipeline); the routed experts of a MoE layer over expert.
DEFAULT_RULES = (
    ("batch", ("data", "expert")),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),  # llama's KV heads: split when tensor divides them, else replicated (see validate)
    ("mlp", "tensor"),
    ("kv", None),
    ("embed", None),
    ("qkv", None),
    ("seq", None),
    ("act_seq", None),  # the residual stream's sequence (norms, dropout, adds); "tensor" with model.sequence_parallel
    ("layers", "stage"),
    ("experts", "expert"),  # a MoE layer's routed experts (expert parallelism)
    ("router", None),  # the router's expert dimension (its weight is small: replicated)
    ("lora_rank", None),  # a LoRA adapter's rank axis (replicated: each adapter is sharded like its base matmul)
    ("patch", None),  # ViT: a patch's rows and columns, its channels, its classes (small: replicated)
    ("channels", None),
    ("classes", None),
)
# added after configs with their own `rules` were written: defaulted if absent
NEW_RULES = ("experts", "router", "lora_rank", "patch", "channels", "classes")

# order of the device grid: tensor last = neighbouring devices, then context (its K/V all-gathers) and expert (its
# all-to-all) within a node where they fit
MESH_AXES = ("data", "stage", "expert", "context", "tensor")
ROUTERS = ("softmax", "sigmoid")
GRPO_LOSSES, REWARD_SCALES = ("dapo", "grpo", "dr_grpo", "bnpo", "gspo", "cispo"), ("group", "batch", "none")
IMPORTANCE_SAMPLING = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")  # TRL's modes
REMAT_POLICIES = ("none", "selective", "full", "dots", "attention", "offload")
OFFLOAD = ("none", "optimizer", "params")
DTYPES = ("float32", "bfloat16", "float16", "float64")  # float64: reference runs (validate._check_float64)
_INF = float("inf")
_KINDS = {int: "an integer", float: "a number", str: "a string", bool: "True or False"}


@dataclasses.dataclass(frozen=True)
class Key:
    name: str  # dotted: section.key ("name" for a top-level key)
    default: object
    kind: type | None  # int, float (ints accepted), bool, str; None: checked in validate (rules, step lists)
    meaning: str  # one line, Markdown (the docs' table)
    test: Callable | None = None  # the allowed range, on a value of the right kind
    allowed: str = ""  # what `test` allows, in words (messages)
    choices: tuple | None = None  # the allowed values

    def error(self, v) -> str | None:
        """One line when `v` is not allowed, naming the key, the value, what is allowed and the fix; else None."""
        if self.choices is not None:
            return None if v in self.choices and type(v) is type(self.default) else \
                f"{self.name}={v!r}: pick one of {self.choices}."
        if self.kind is bool:
            return None if isinstance(v, bool) else (f"{self.name}={v!r} must be True or False; set "
                                                     f"--config.{self.name}=True or --config.{self.name}=False.")
        if self.kind is str and not self.test:
            return None if isinstance(v, str) else (f"{self.name}={v!r} must be a string; set "
                                                    f"--config.{self.name}='...' (default {self.default!r}).")
        kind = {int: numbers.Integral, float: numbers.Real, str: str}.get(self.kind)
        if kind is None or (isinstance(v, kind) and not isinstance(v, bool) and (self.test is None or self.test(v))):
            return None
        return (f"{self.name}={v!r} must be {self.allowed or _KINDS[self.kind]}; set --config.{self.name} to such a "
                f"value (default {self.default!r}).")


K = Key
_NONEMPTY = lambda v: bool(v.strip())

