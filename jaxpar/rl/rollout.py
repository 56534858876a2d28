"""One GRPO round's samples, as the loop (`rounds.py`) takes them: G completions of each prompt from the generation
engine on the training params (no copy), scored, their advantages, and the batch the objective trains on.

`sample`: prompt p's completions are requests of stream 0..G-1 with the seed `seed`, so a round's samples depend on
neither the batch nor the layout; `round_batch`: the round scored (`Round`), its batch with the sampling pass's model
log-probs as `old` (`Completion.model_logprobs`), a completion that ended by length truncated; `with_old_logps`: `old`
from the training step's own forward on the same params (`objectives.TokenLogps`, at the sampling temperature), as TRL
recomputes them: the engine's decode differs from the training forward in the last float32 bit on some tokens
(measured: up to 5e-7), which at epsilon 0 would count as clipping; the training forward's make the ratio of an
unchanged policy exactly 1.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np

from jaxpar.generate.engine import Request
from jaxpar.rl import advantages as adv
from jaxpar.rl import rewards
from jaxpar.rl import rows as rows_mod


def sample(engine, prompts, group: int, max_new_tokens: int, seed, stop_ids=(), **sampling) -> list:
    """`group` completions of every prompt (token ids), prompt p's at rows p * group .. p * group + group - 1, as the
    streams 0 .. group - 1 of its seed (`seed`: one for all, or one per prompt)."""
    if group < 2:
        raise ValueError(f"grpo.num_generations={group}: a group needs at least 2 completions to compare.")
    seeds = [seed] * len(prompts) if np.ndim(seed) == 0 else list(seed)
    reqs = [Request(prompt=list(p), max_new_tokens=max_new_tokens, seed=int(s), stream=g, stop_ids=tuple(stop_ids),
                    **sampling) for p, s in zip(prompts, seeds) for g in range(group)]
    return engine.generate(reqs)


class Round(NamedTuple):
    batch: dict  # the objective's batch (`rows.training_batch`)
    per_function: np.ndarray  # `[N, F]` each reward function's value (NaN: None)
    rewards: np.ndarray  # `[N]` their weighted sum (NaN: unscorable)
    advantages: np.ndarray  # `[N]`
    zero_std: np.ndarray  # `[N]` whether the completion's group (or batch) had rewards all alike
    rows: rows_mod.Rows  # where each completion's tokens sit in the batch


def round_batch(prompts, records, completions, fns, weights, group: int, scale: str, seq: int, texts=None,
                mask_truncated: bool = False, max_completion_length: int = 0, replay: bool = False,
                per_row: int = 1, shared: bool = False, log: rewards.RewardLog | None = None,
                **reward_kwargs) -> Round:
    """A round scored (`Round`): `records[p]` prompt p's record, `texts` each completion as the reward functions see
    it (default: its text, else its token ids written out), `log` what they log and their `trainer_state`
    (`rewards.RewardLog`; on several processes each scores its share), `reward_kwargs` more keywords for them; with
    `replay` (a mixture of experts) the batch's `routes`: the experts the engine routed each position to
    (`Completion.prompt_experts`, then `.experts`). Its rows: `shared` rows of `per_row` completions each, at most
    `seq` positions long (`GRPO.longest_row`), else one per row of `seq` + 1 tokens (`rows.py`)."""
    recs = [r for r in records for _ in range(group)]
    ids = [list(c.tokens) for c in completions]
    shown = texts if texts is not None else [c.text if c.text is not None else str(c.tokens) for c in completions]
    per_fn = rewards.score(fns, [r.get("prompt") for r in recs], shown, ids, recs,
                           log=log, max_completion_length=max_completion_length, **reward_kwargs)
    total = adv.rewards_of(per_fn, weights)
    a, zero_std = adv.advantages(total, group, scale)
    truncated = np.array([c.finish_reason == "length" for c in completions]) if mask_truncated else None
    old = [np.asarray(c.model_logprobs, np.float64) for c in completions]
    routes = [np.concatenate([c.prompt_experts, c.experts]) for c in completions] if replay else None
    laid = rows_mod.training_batch(prompts, ids, group, per_row, seq, shared, a, old, truncated=truncated,
                                   routes=routes)
    return Round(laid.batch, per_fn, total, a, zero_std, laid)


def with_old_logps(steps, params, batch):
    """`batch` with `old` the training forward's per-token log-probs under `params` (`steps`: `compiled.steps_for`;
    `batch` placed with `steps.batch_sharding`)."""
    rows = batch["tokens"].shape[0]
    old = steps.forward(params, batch, steps.objective.reference_head(rows))[1].astype(batch["mask"].dtype)
    return {**batch, "old": jax.device_put(old, steps.batch_sharding)}
