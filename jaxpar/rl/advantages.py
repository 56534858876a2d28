"""GRPO's advantages from a round's rewards (the rows the objective trains on: `rows.py`).

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
