"""How a round's completions become the rows GRPO trains on (`objectives.GRPO`): one completion per row, or the
shared-prompt rows (`grpo.shared_prompt`, the default).

- **One per row** (TRL's): row i is completion i's prompt, then the completion, padded to `model.seq_len` + 1.
- **Shared prompt**: a row is a prompt once, then K of its completions (`GRPO.per_row`: all G of its group, or a part
  when the rows must split further over data shards and microbatches), each a segment that begins with a copy of the
  prompt's last token, so each has the position that predicts its first token: `p[:-1] | p[-1] c1 | p[-1] c2 | ...`.
  The prompt's segment id is 1, completion k's `segments.continuation(k, 1)`: a completion sees the prompt and
  itself, never its siblings (`jaxpar/kernels/segments.py`), and its tokens keep the positions of the unshared row
  (`positions`). The row is as long as its tokens, rounded up to a bucket (`length`, at most `GRPO.longest_row`),
  so a round trains on about P + G (R + 1) tokens per prompt instead of G (seq_len + 1). Each token's hidden state
  equals the unshared row's, so loss and gradients do (`tests/test_grpo.py`, `tests/test_grpo_trl.py`: float64).

Either way completion i's token j is predicted at input position `start[i] + j` of row `row[i]` (`Rows`); `place`
lays per-token values (log-probs, routes) out there. The batch: `tokens` `[rows, L + 1]`, `mask` `[rows, L]` (1 where
the target is a completion token; 0 for a completion masked as truncated), `advantages` `[rows, K]` (K = 1 one per
row), and for shared rows `segments`, `positions` `[rows, L + 1]`; `old`, `routes` when given.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from jaxpar.kernels import segments as seg_ids

PROMPT = 1  # the prompt's segment id in a shared row (padding: -1)


class Rows(NamedTuple):
    batch: dict
    row: np.ndarray  # [N] completion i's row
    start: np.ndarray  # [N] the input position that predicts its first token


def length(need: int, most: int) -> int:
    """A shared round's row length: `need` rounded up to 64, 96, 128, 192, 256, 384, ... (few shapes, few compiles),
    at most `most`."""
    size = 64
    while size < need:
        size = size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3
    return min(size, max(most, need))


def lay_out(prompts, completions, group: int, k: int, seq: int, shared: bool, truncated=None) -> Rows:
    """The rows (`Rows`) of a round: `prompts` one per group (token ids), `completions` `group` per prompt in order;
    shared: `k` completions a row, `seq` the most a row may be (`GRPO.longest_row`), the row length `length`-rounded;
    else one per row (`k` = 1) of `seq` + 1 tokens."""
    n = len(completions)
    k = k if shared else 1
    rows = n // k
    need = [len(prompts[r * k // group]) - 1 + sum(len(completions[i]) + 1 for i in range(r * k, r * k + k))
            for r in range(rows)]
    L = length(max(need) - 1, seq) if shared else seq
    tokens = np.zeros((rows, L + 1), np.int32)
    segs, pos = np.full((rows, L + 1), -1, np.int32), np.zeros((rows, L + 1), np.int32)
    mask = np.zeros((rows, L))
    row, start = np.zeros(n, np.int64), np.zeros(n, np.int64)
    for r in range(rows):
        p = np.asarray(prompts[r * k // group])
        if need[r] > L + 1 or len(p) < 1:
            raise ValueError(f"row {r}: a prompt of {len(p)} tokens and its completions need {need[r]} positions, "
                             f"more than the {L + 1} of a row (model.seq_len={seq}); shorten the prompt or lower "
                             f"grpo.max_completion_length.")
        P = len(p)
        tokens[r, :P - 1], segs[r, :P - 1], pos[r, :P - 1] = p[:-1], PROMPT, np.arange(P - 1)
        at = P - 1
        for j, i in enumerate(range(r * k, r * k + k)):
            c = np.asarray(completions[i], np.int32)
            m = len(c)
            tokens[r, at:at + m + 1] = np.r_[p[-1], c]
            segs[r, at:at + m + 1] = seg_ids.continuation(j + 1, PROMPT)
            pos[r, at:at + m + 1] = np.arange(P - 1, P + m)
            mask[r, at:at + m] = 0.0 if truncated is not None and truncated[i] else 1.0
            row[i], start[i] = r, at
            at += m + 1
    batch = {"tokens": tokens, "mask": mask}
    return Rows(batch | ({"segments": segs, "positions": pos} if shared else {}), row, start)


def training_batch(prompts, completions, group: int, k: int, seq: int, shared: bool, advantages, old=None,
                   ref=None, truncated=None, routes=None) -> Rows:
    """`lay_out`'s rows with the rest of the batch: `advantages` `[N]` as `[rows, K]`, `old` (and `ref`) each
    completion's per-token log-probs, `routes` (`prompt_routes`)."""
    rows = lay_out(prompts, completions, group, k, seq, shared, truncated)
    n = rows.batch["mask"].shape[0]
    rows.batch["advantages"] = np.asarray(advantages, np.float64).reshape(n, -1)
    for name, values in (("old", old), ("ref", ref)):
        if values is not None:
            rows.batch[name] = place(rows, values)
    if routes is not None:
        prompt_routes(rows, prompts, routes, group)
    return rows


def place(rows: Rows, values, fill=0.0, dtype=np.float64, tail=()) -> np.ndarray:
    """Per-completion sequences laid out as the rows' inputs `[rows, L] + tail`: values[i][j] at (row[i], start[i]
    + j); `fill` elsewhere."""
    out = np.full(rows.batch["mask"].shape + tuple(tail), fill, dtype)
    for i, v in enumerate(values):
        v = np.asarray(v)
        out[rows.row[i], rows.start[i]:rows.start[i] + len(v)] = v
    return out


def take(rows: Rows, array, lengths) -> list:
    """The inverse of `place`: each completion's `lengths[i]` values of `array` `[rows, L, ...]`."""
    return [np.asarray(array[rows.row[i], rows.start[i]:rows.start[i] + n]) for i, n in enumerate(lengths)]


def members(batch: dict) -> np.ndarray:
    """Each input position's completion within its row (0 .. K - 1; 0 where no completion is predicted) `[rows, L]`."""
    seg = batch.get("segments")
    if seg is None:
        return np.zeros(batch["mask"].shape, np.int32)
    return np.maximum(seg_ids.member(np.asarray(seg)[:, :-1]) - 1, 0)


def prompt_routes(rows: Rows, prompts, routes, group: int) -> None:
    """Add `routes` (per completion: the experts `[positions, layers, k]` of its prompt's positions then its own, as
    the engine routed them) to the batch: a shared row's prompt positions take the first completion's prompt part (a
    group's prompt is routed once), each segment the rest."""
    tail = np.shape(routes[0])[1:]
    out = np.full(rows.batch["mask"].shape + tail, -1, np.int32)
    for i, rt in enumerate(routes):
        P = len(prompts[i // group])
        out[rows.row[i], :P - 1] = rt[:P - 1]  # (the same for every completion of the prompt)
        out[rows.row[i], rows.start[i]:rows.start[i] + len(rt) - P + 1] = rt[P - 1:]
    rows.batch["routes"] = out
