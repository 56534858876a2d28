"""Reward functions, called as TRL calls them, and the built-in ones (`grpo.rewards`, `grpo.reward_weights`).

A reward function takes keywords, as TRL's `GRPOTrainer` passes them: `prompts`, `completions` (the completions'
text decoded without special tokens, TRL's `batch_decode(..., skip_special_tokens=True)`; after a conversational
prompt an assistant message list `[{"role": "assistant", "content": text}]`), `completion_ids` (lists of token ids),
every column of the records but `prompt`, `completion` and `completion_ids` (e.g. `solution`), one value per
completion; from the loop (`rl/rounds.py`) `trainer_state` (`TrainerState`: transformers' `TrainerState` names),
`log_extra(column, values)` (one value per completion: a column of the logged completions) and `log_metric(name,
value)` (a scalar logged with the metrics), both `RewardLog`'s; and `max_completion_length` (jaxpar's: the built-in
`soft_overlong` reads it). It returns one float or None (not applicable) per completion. `load` reads `grpo.rewards`
(comma-separated `MODULE:FUNCTION` or `FILE.py:FUNCTION`); `score` calls them, `[completions, functions]` float64
with None as NaN.

Built in (`jaxpar.rl.rewards:NAME`):
- `exact_answer`: 1.0 when the completion's answer (inside `<answer>...</answer>` if it has one, else the whole text)
  equals the record's `solution` under `math-verify` (parse, verify; TRL's `accuracy_reward`, except that a plain
  number counts as an answer, not only LaTeX), None when the solution does not parse;
- `exact_match`: 1.0 when the completion's answer (as above) equals the record's `solution` as a string, both
  stripped of surrounding white space, else 0.0 (words, code output: what math-verify would read as symbols);
- `think_format`: 1.0 for `<think>...</think>` then `<answer>...</answer>` and nothing else, else 0.0;
- `soft_overlong`: DAPO's soft overlong punishment: 0 up to `max_completion_length` - C tokens (C = a fifth of it),
  then falling linearly to -1 at `max_completion_length`.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re

import numpy as np

from jaxpar.cluster import exchange
from jaxpar.data.common import DataError, user_function


class RewardError(DataError):
    """A reward function that cannot be found or that answers wrongly: one line naming it."""


@dataclasses.dataclass
class TrainerState:
    """What TRL passes reward functions as `trainer_state` (transformers' `TrainerState`, its attribute names):
    `global_step` the optimizer steps done before the round's first update, `max_steps` `train.steps`, `epoch` the
    prompts consumed / the training prompts, `num_input_tokens_seen` the prompt and completion tokens sampled (this
    round's included, as TRL counts them before scoring), the log, eval and save intervals in steps."""
    global_step: int = 0
    max_steps: int = 0
    epoch: float = 0.0
    num_input_tokens_seen: int = 0
    logging_steps: int = 0
    eval_steps: int = 0
    save_steps: int = 0
    is_local_process_zero: bool = True
    is_world_process_zero: bool = True


def _plain(v):
    """A value as JSON holds it (completions.jsonl, the round file beside a checkpoint): numpy scalars as Python's,
    anything else JSON cannot write as its `str`."""
    v = v.item() if isinstance(v, np.generic) else v
    try:
        json.dumps(v)
        return v
    except (TypeError, ValueError):
        return str(v)


class RewardLog:
    """The `log_extra` and `log_metric` that reward functions get (TRL's `_log_completion_extra`, `_log_metric`) for
    one scoring of `n` completions, and the `trainer_state` they see: `extra` {column: a value per completion} (a
    column logged again is replaced), `metrics` {name: the values logged}. On several processes each process's calls
    see its share of the completions (`exchange.share`, in whole `unit`s: a group's completions together); `score`
    then merges what every process logged (`merge`)."""

    def __init__(self, n: int, trainer_state: TrainerState | None = None, unit: int = 1):
        self.n, self.state, self.extra, self.metrics = n, trainer_state, {}, {}
        self.lo, self.hi = exchange.share(n, unit)

    def log_extra(self, column: str, values) -> None:
        values = list(values)
        if len(values) != self.hi - self.lo:
            raise RewardError(f"log_extra({column!r}, ...) got {len(values)} values for {self.hi - self.lo} "
                              f"completions; give one per completion.")
        self.extra[str(column)] = [_plain(v) for v in values]

    def log_metric(self, name: str, value: float) -> None:
        self.metrics.setdefault(str(name), []).append(float(value))

    def kwargs(self) -> dict:
        """The keywords of TRL's calling convention that come from the loop."""
        return {"trainer_state": self.state, "log_extra": self.log_extra, "log_metric": self.log_metric}

    def merge(self, parts: list, sizes: list) -> None:
        """Every process's columns and metric values (`parts`: their `extra` and `metrics`, in process order; `sizes`
        the completions each scored), in completion order; None where a process logged no such column."""
        columns = dict.fromkeys(c for part in parts for c in part["extra"])
        self.extra = {c: [v for part, k in zip(parts, sizes) for v in part["extra"].get(c, [None] * k)]
                      for c in columns}
        self.metrics = {m: [v for part in parts for v in part["metrics"].get(m, [])]
                        for m in dict.fromkeys(m for part in parts for m in part["metrics"])}

    def means(self) -> dict:
        """Each metric's mean over this scoring's values (TRL: one value per metric per round and process)."""
        return {k: float(np.mean(v)) for k, v in self.metrics.items()}


def _text(completion) -> str:
    return completion[-1]["content"] if isinstance(completion, list) else completion


_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def exact_answer(completions, solution, **kwargs):
    from math_verify import parse, verify  # the `rl` extra
    out = []
    for c, sol in zip(completions, solution):
        gold = parse(str(sol))
        out.append(float(verify(gold, parse(_answer(c)))) if gold else None)
    return out


def _answer(completion) -> str:
    text = _text(completion)
    tagged = _ANSWER.search(text)  # the answer: inside <answer>...</answer> when the completion has one
    return tagged.group(1) if tagged else text


def exact_match(completions, solution, **kwargs):
    return [float(_answer(c).strip() == str(sol).strip()) for c, sol in zip(completions, solution)]


_FORMAT = re.compile(r"^<think>(?:(?!<think>).)*?</think>\s*<answer>.*?</answer>\s*$", re.DOTALL)


def think_format(completions, **kwargs):
    return [1.0 if _FORMAT.match(_text(c)) else 0.0 for c in completions]


def soft_overlong(completion_ids, max_completion_length, **kwargs):
    cache = max(max_completion_length // 5, 1)
    start = max_completion_length - cache
    return [0.0 if len(ids) <= start else max((start - len(ids)) / cache, -1.0) for ids in completion_ids]


def _one(spec: str):
    try:
        return user_function(spec, "grpo.rewards", "jaxpar.rl.rewards:exact_answer")
    except ValueError as e:
        raise RewardError(str(e)) from None


def load(rewards: str, weights: str = "") -> tuple[list, np.ndarray]:
    """`grpo.rewards` and `grpo.reward_weights` -> ([(name, function)], weights `[functions]`: 1 each if none)."""
    fns = [_one(s) for s in rewards.split(",") if s.strip()]
    if not fns:
        raise RewardError("grpo.rewards is empty: name at least one reward function, e.g. "
                          "--config.grpo.rewards=jaxpar.rl.rewards:exact_answer.")
    w = [float(x) for x in weights.split(",") if x.strip()] if weights.strip() else [1.0] * len(fns)
    if len(w) != len(fns):
        raise RewardError(f"grpo.reward_weights has {len(w)} weights for {len(fns)} reward functions; give one "
                          f"per function or none.")
    return fns, np.asarray(w, np.float64)


_NOT_COLUMNS = ("prompt", "completion", "completion_ids")  # (TRL passes every other column of the records)


def score(fns, prompts, completions, completion_ids, records, log: RewardLog | None = None, **extra) -> np.ndarray:
    """Every function on every completion (records[i]: completion i's record, its columns but `_NOT_COLUMNS` as
    keywords; `log`'s keywords (`RewardLog.kwargs`) and `extra` besides, over a column of the same name) -> `[N, F]`
    float64, None as NaN; a function that raises or returns another number of values is one line naming it. On
    several processes each scores its share (`log`'s, else `exchange.share`) and the scores are gathered."""
    lo, hi = (log.lo, log.hi) if log is not None else exchange.share(len(completions))
    mine = records[lo:hi]
    columns = {k: [r.get(k) for r in mine] for k in records[0] if k not in _NOT_COLUMNS} if records else {}
    kwargs = columns | extra | (log.kwargs() if log is not None else {})
    out = np.full((hi - lo, len(fns)), np.nan)
    for j, (name, fn) in enumerate(fns if hi > lo else ()):
        try:
            got = list(fn(prompts=prompts[lo:hi], completions=completions[lo:hi],
                          completion_ids=completion_ids[lo:hi], **kwargs))
        except RewardError as e:  # (log_extra's)
            raise RewardError(f"reward function {name!r}: {e}") from None
        except Exception as e:  # noqa: BLE001 - the user's function: said in one line with its record
            raise RewardError(f"reward function {name!r} raised {type(e).__name__}: {e} (on the round's first "
                              f"record {str(mine[0])[:120] if mine else ''}).") from None
        if len(got) != hi - lo:
            raise RewardError(f"reward function {name!r} returned {len(got)} values for {hi - lo} "
                              f"completions; return one float or None per completion.")
        out[:, j] = [np.nan if v is None or (isinstance(v, float) and math.isnan(v)) else float(v) for v in got]
    logged = {"extra": log.extra, "metrics": log.metrics} if log is not None else {}
    parts = exchange.gather_json({"scores": out.tolist(), **logged})  # (one exchange a scoring)
    if len(parts) == 1:
        return out
    if log is not None:
        log.merge(parts, [len(part["scores"]) for part in parts])
    return np.asarray([row for part in parts for row in part["scores"]], np.float64).reshape(len(completions), len(fns))
