"""Importance sampling between the sampler and the trainer (`grpo.importance_sampling`): TRL's correction for
completions whose sampling log-probs differ from the training forward's (its `vllm_importance_sampling_*`).

Per completion token, with `old` the training forward's log-prob under the params that sampled (at the sampling
temperature) and `sampled` the engine's under its sampling distribution, d = old - sampled on the completion's
tokens (0 elsewhere); the ratio is exp(d) per token (`token_*`) or exp of the completion's sum of d, one per
completion (`sequence_*`); `*_truncate` clips it to [min, max], `*_mask` sets it to 0 outside. Each token's policy
loss is multiplied by it (before the KL term is added), as TRL's `_compute_loss` does. jaxpar's engine decodes with
the training forward's own code, so in float32 the ratio is 1 to about 1e-6: the correction matters where decode
and training compute differently (a lower-precision KV cache or decode kernel).

Metrics (TRL's names): `sampling/sampling_logp_difference/mean|max` (|old - sampled| over completion tokens),
`sampling/importance_sampling_ratio/min|mean|max` (over completion tokens, or over completions for `sequence_*`).
"""
from __future__ import annotations

import numpy as np


def ratios(old, sampled, mask, mode: str, lo: float = 0.0, hi: float = 3.0, members=None,
           per_row: int = 1) -> tuple[np.ndarray, dict]:
    """old, sampled, mask `[rows, seq]` -> (each position's ratio `[rows, seq]` float64 (a completion's one ratio
    on all its positions for `sequence_*`), TRL's metrics of the round). `members` `[rows, seq]`: each position's
    completion within its row (`rows.members`; None: one per row), `per_row` of them a row."""
    old, sampled, mask = (np.asarray(a, np.float64) for a in (old, sampled, mask))
    d = np.nan_to_num((old - sampled) * mask, nan=0.0)
    per_sequence = mode.startswith("sequence")
    own = np.zeros(mask.shape, np.int64) if members is None else np.asarray(members)
    if per_sequence:  # a completion's sum of d, `[rows, per_row]`
        one_hot = own[..., None] == np.arange(per_row)
        r = np.exp(np.einsum("rt,rtk->rk", d, one_hot))
    else:
        r = np.exp(d)
    lo_, hi_ = (lo if lo > 0 else None), hi
    if mode.endswith("truncate"):
        r = np.clip(r, lo_, hi_)
    elif mode.endswith("mask"):
        r = np.where((r < (lo_ if lo_ is not None else -np.inf)) | (r > hi_), 0.0, r)
    else:
        raise ValueError(f"grpo.importance_sampling={mode!r}: choose token_truncate, token_mask, sequence_truncate "
                         f"or sequence_mask (or none).")
    on = mask.astype(bool)
    delta = np.abs(old - sampled)[on & ~np.isnan(old - sampled)]
    flat = r.ravel() if per_sequence else r[on]
    stat = lambda f, x: float(f(x)) if x.size else 0.0  # noqa: E731
    metrics = {"sampling/sampling_logp_difference/mean": stat(np.mean, delta),
               "sampling/sampling_logp_difference/max": stat(np.max, delta),
               "sampling/importance_sampling_ratio/min": stat(np.min, flat),
               "sampling/importance_sampling_ratio/mean": stat(np.mean, flat),
               "sampling/importance_sampling_ratio/max": stat(np.max, flat)}
    return (np.take_along_axis(r, own, axis=1) if per_sequence else r), metrics

