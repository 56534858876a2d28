"""What a model costs, from its spec alone (abstract: nothing allocated): parameter counts (`param_counts`) and
model FLOPs per trained token (`flops_per_token`, PaLM's formula `model_flops_per_token`; active parameters for a
mixture of experts; what a family's ends do not spend: `Family.head_flops_unspent`)."""
from __future__ import annotations

import dataclasses
import math

import jax

from jaxpar.model import moe
from jaxpar.model.config import ModelConfig
from jaxpar.model.spec import init_params, param_roles, split_params, trainable


def model_flops_per_token(n_params: int, layers: int, embed: int, seq_len: int) -> float:
    """Model FLOPs per trained token (forward + backward), PaLM's MFU numerator.

    Formula (Chowdhery et al. 2022, "PaLM: Scaling Language Modeling with Pathways", Appendix B, "Compute
    usage and model FLOPs utilization"): ``6 N + 12 L H Q T`` with H heads of size Q, so ``H Q = d_model``:

        flops_per_token = 6 * n_params + 12 * layers * embed * seq_len

    * ``6 N``: every parameter takes part in one multiply-add (2 FLOPs) per token in the forward pass and two in
      the backward pass (gradient w.r.t. activations and w.r.t. weights).
    * ``12 L d T``: the attention score and value matmuls (``Q K^T`` and ``P V``), which have no parameters:
      2 matmuls x 2 FLOPs x T x d per token per layer forward, x3 for forward + backward. As in PaLM, the full
      T x T attention matrix is counted (the causal mask's skipped half is not subtracted).
    * Rematerialisation (activation recompute) is excluded by definition: these are *model* FLOPs, so MFU does
      not go up when the trainer recomputes more (PaLM Appendix B contrasts this with hardware FLOPs utilisation).

    Args:
      n_params: N, the number of trained parameters with the tied token embedding counted once (its matmul is
        the output projection to the vocabulary; the input lookup is a gather with no FLOPs) and the learned
        position embedding left out (a lookup and an add, no matmul). The caller computes N from the params tree.
      layers: L, the number of transformer blocks.
      embed: heads x head size: d_model, the residual width, unless the model sets its head size apart (Qwen3).
      seq_len: T, the training sequence length in tokens.

    Returns:
      FLOPs per token (float).
    """
    for name, v in (("n_params", n_params), ("layers", layers), ("embed", embed), ("seq_len", seq_len)):
        if v < 0:
            raise ValueError(f"{name}={v} must be >= 0.")
    return 6.0 * float(n_params) + 12.0 * float(layers) * float(embed) * float(seq_len)


def flops_per_token(cfg: ModelConfig) -> float:
    """Model FLOPs per trained token, PaLM's 6N + 12·L·d·T (`model_flops_per_token`), N = the parameters a token's
    matmuls use: every weight, the token table only as the tied LM head (as an input table it is a lookup, as
    TorchTitan counts), no norm, bias or position table, and of a MoE layer the router, the shared experts and k of
    the routed experts (the active parameters). With LoRA the frozen weights take no weight gradient: 4 FLOPs per
    frozen weight and 6 per adapter parameter (as the compiled step runs them)."""
    counts = param_counts(cfg)
    full = model_flops_per_token(counts["matmul"], cfg.layers, cfg.heads * cfg.head_dim, cfg.seq_len)
    full -= cfg.family.head_flops_unspent(cfg)  # (a ViT's classifier runs on one token of each image's seq_len)
    return full - 2.0 * counts["matmul"] + 6.0 * counts["trainable"] if cfg.lora_rank else full


def _sizes(cfg: ModelConfig):
    """(parameter shapes, roles), abstract."""
    return jax.eval_shape(lambda: init_params(cfg, jax.random.key(0))), param_roles(cfg)


def _count(shapes, roles, keep) -> int:
    return sum(math.prod(a.shape) for a, r in zip(jax.tree.leaves(shapes), jax.tree.leaves(roles)) if keep(r))


def _layer_matmul(cfg: ModelConfig) -> float:
    """Active matmul parameters per layer, averaged over the layers (dense and MoE layers as the config mixes
    them)."""
    def per_layer(c, moe_layer: bool):
        shapes, roles = (split_params(t)[1] for t in _sizes(c))
        weights = _count(shapes, roles, lambda r: r in ("weight", "router"))
        experts = _count(shapes, roles, lambda r: r == "expert")
        return (weights + (experts * c.experts_per_token / c.experts if moe_layer else 0)) / c.layers

    if cfg.experts == 0:
        return per_layer(cfg, False)
    n_moe = sum(bool(moe.is_moe_layer(cfg, i)) for i in range(cfg.layers))
    sparse = per_layer(dataclasses.replace(cfg, first_dense_layers=0, moe_every=1), True)
    dense = per_layer(dataclasses.replace(cfg, experts=0), False)
    return (n_moe * sparse + (cfg.layers - n_moe) * dense) / cfg.layers


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    """The model's parameter counts (abstract: nothing allocated), what the planner and reports read: "total";
    "layer" (one block, every tensor) and "layer_matmul" (its active matmul weights, averaged over the layers);
    "shared" (outside the blocks: the tables, the final norm); "trainable" (all of them, or with LoRA the
    adapters: what has gradients and optimizer state); "experts" (the routed experts' weights, all layers);
    "matmul" (N of `flops_per_token`: the active matmul parameters)."""
    shapes, roles = _sizes(cfg)
    size = lambda tree: sum(math.prod(a.shape) for a in jax.tree.leaves(tree))  # noqa: E731
    (shared, layers), (shared_roles, _) = split_params(shapes), split_params(roles)
    head = _count(shared, shared_roles, lambda r: r == "weight" or (r == "embedding" and cfg.tie_embeddings))
    layer_mm = _layer_matmul(cfg)
    return {"total": size(shapes), "trainable": size(trainable(shapes, cfg)), "layer": size(layers) // cfg.layers,
            "layer_matmul": round(layer_mm),
            "shared": size(shared), "experts": _count(shapes, roles, lambda r: r == "expert"),
            "matmul": round(head + layer_mm * cfg.layers)}
