"""GRPO's advantages from a round's rewards, and the batch the objective trains on (`objectives.GRPO`).

`advantages`: each completion's reward (the weighted sum of its reward functions; NaN where every function returned
None) minus its group's mean, divided by the group's standard deviation (`group`), the round's (`batch`) or nothing
(`none`), plus 1e-4; the standard deviations unbiased and NaN-aware, an unscorable completion's advantage 0 (TRL's
rules). Rows are grouped in order: completions g * G .. g * G + G - 1 are prompt g's.
"""
from __future__ import annotations

import numpy as np

from jaxpar.config_keys import REWARD_SCALES as SCALES


def nanstd(x, axis=None):
    """The unbiased standard deviation of the non-NaN values (NaN with fewer than two), keeping the reduced axes."""
    n = np.sum(~np.isnan(x), axis=axis, keepdims=True)
    var = np.nanmean((x - np.nanmean(x, axis=axis, keepdims=True)) ** 2, axis=axis, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.sqrt(np.where(n > 1, var * n / (n - 1), np.nan))


def rewards_of(per_function, weights):
    """`[completions, functions]` rewards (NaN: None) -> `[completions]` their weighted sum, NaN where all are NaN."""
    per_function = np.asarray(per_function, np.float64)
    total = np.nansum(per_function * np.asarray(weights, np.float64)[None], axis=1)
    return np.where(np.isnan(per_function).all(axis=1), np.nan, total)


def advantages(rewards, group: int, scale: str = "group"):
    """`[completions]` rewards -> (advantages `[completions]`, whether each completion's std is zero)."""
    r = np.asarray(rewards, np.float64)
    if scale not in SCALES:
        raise ValueError(f"grpo.scale_rewards={scale!r}: choose one of {', '.join(SCALES)}.")
    grouped = r.reshape(-1, group)
    with np.errstate(invalid="ignore"):
        mean = np.repeat(np.nanmean(grouped, axis=1), group)
    std = np.repeat(nanstd(grouped, axis=1)[:, 0], group) if scale != "batch" else \
        np.broadcast_to(nanstd(r).ravel(), r.shape)
    adv = r - mean
    if scale != "none":
        adv = adv / (std + 1e-4)
    return np.nan_to_num(adv, nan=0.0), np.isclose(std, 0.0)


def completion_batch(prompts, completions, old, advantages_, seq: int, truncated=None, ref=None, routes=None):
    """The objective's batch: row i is prompts[i] then completions[i] (token ids), padded to `seq` + 1; `mask` 1 where
    the target is a completion token (all 0 for a `truncated` row: `grpo.mask_truncated_completions`); `old`
    (and `ref`) each completion's per-token log-probs (sequences of its length) at those positions; `routes[i]`, if
    given, the experts `[positions, layers, k]` of the row's input positions (all but its last token), -1 on the
    padding."""
    rows = len(completions)
    tokens = np.zeros((rows, seq + 1), np.int32)
    mask, lp_old, lp_ref = (np.zeros((rows, seq)) for _ in range(3))
    for i, (p, c) in enumerate(zip(prompts, completions)):
        n, k = len(p), len(c)
        if n + k > seq + 1 or n < 1:
            raise ValueError(f"completion {i}: prompt {n} + completion {k} tokens exceed model.seq_len + 1 = "
                             f"{seq + 1}; shorten the prompt or lower grpo.max_completion_length.")
        tokens[i, :n + k] = np.r_[p, c]
        at = slice(n - 1, n - 1 + k)  # position t predicts token t + 1
        mask[i, at] = 0.0 if truncated is not None and truncated[i] else 1.0
        lp_old[i, at] = old[i]
        if ref is not None:
            lp_ref[i, at] = ref[i]
    batch = {"tokens": tokens, "mask": mask, "old": lp_old, "advantages": np.asarray(advantages_, np.float64)}
    if routes is not None:
        batch["routes"] = np.full((rows, seq) + np.shape(routes[0])[1:], -1, np.int32)
        for i, r in enumerate(routes):
            batch["routes"][i, :len(r)] = r
    return batch | ({} if ref is None else {"ref": lp_ref})
