"""Tick tables of the pipeline schedules that run the backward pass inside the loop: 1F1B and zero-bubble ZB-H1.

A `LoopSchedule` says, for tick t and stage s, which microbatch each of three lanes works on: F (forward), B
(backward; with `split`, only the input gradient) and W (weight gradient, only with `split`). Every stage runs its
lanes in that order within a tick; activations go to stage s + 1 and cotangents to stage s - 1 at the end of the tick,
usable from the next one. Pure numpy, no JAX: the engine (`jaxpar/pipeline_1f1b.py`), the tests and the bench read
the same tables.

- `one_f_one_b(S, M)`: the lockstep 1F1B of PipeDream-Flush / Megatron-LM (Narayanan et al. 2021, sec. 2.2):
  forward of microbatch i on stage s at tick i + s, its backward at tick i + 2S - 1 - s (the tick after the cotangent
  arrives), M + 2S - 1 ticks; with F and B·W costing f and b + w, the critical path is (M + S - 1)(f + b + w), the
  same as GPipe, (M + S - 1) / M of the ideal.
- `zb_h1(S, M)`: zero bubble H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", sec. 3): B is split from W and
  every W waits for a slot where nothing on the critical path (B first, then F) is ready, one op per stage per tick.
  Built by list scheduling with a cap on the microbatches a stage holds (forward done, W not yet): with the default
  cap 2S - 1 - s it takes 3M + S - 1 unit ticks for f = b = w, the paper's (M + (S - 1)/3) / M; with 1F1B's cap
  S - s it takes 3M + 2(S - 1).
"""
from __future__ import annotations

import dataclasses

import numpy as np

LANES = ("f", "b", "w")
NAMES = ("1f1b", "zb_h1")


@dataclasses.dataclass(frozen=True)
class LoopSchedule:
    """Per lane `mb[lane]` (int32 `[ticks, stages]`, microbatch) and `ok[lane]` (bool, work or idle)."""
    name: str
    stages: int
    microbatches: int
    mb: dict
    ok: dict
    split: bool  # True: B is the input gradient only and W the weight gradient; False: B does both, W idle

    @property
    def ticks(self) -> int:
        return self.ok["f"].shape[0]

    def time(self, f: float = 1.0, b: float = 1.0, w: float = 1.0) -> float:
        """Critical path of the lockstep schedule: sum over ticks of the busiest stage's work (a fused B costs b + w).

        Units of f, b, w (e.g. seconds per microbatch per stage)."""
        cb = b if self.split else b + w
        cost = f * self.ok["f"] + cb * self.ok["b"] + w * self.ok["w"]
        return float(cost.max(axis=1).sum())

    def in_flight(self) -> np.ndarray:
        """Per stage, the most microbatches held at once (forward done, last backward lane not yet): int `[stages]`."""
        last = "w" if self.split else "b"
        held = np.cumsum(self.ok["f"], 0) - np.cumsum(self.ok[last], 0)
        return held.max(axis=0)

    def ring(self, kind: str) -> int:
        """Slots of a ring buffer indexed by microbatch mod R that never overwrites an entry still to be read.

        kind: "act" (stage inputs: sent by stage s-1's F, read by s's F and B), "grad" (cotangents: sent by s+1's B,
        read by s's B), "res" (F's vjp residuals, read by the same stage's B), "wgrad" (B's saved tensors for W: written by B, read by W; split schedules only)."""
        S, M = self.stages, self.microbatches
        ticks = {lane: _tick_of(self.mb[lane], self.ok[lane], M) for lane in LANES}  # [S, M], -1 if never
        if kind == "act":
            write = np.vstack([np.full((1, M), -1), ticks["f"][:-1]])  # stage s-1's forward
            read = ticks["b"]
            live = np.arange(S)[:, None] >= 1
        elif kind == "grad":
            write = np.vstack([ticks["b"][1:], np.full((1, M), -1)])  # stage s+1's backward
            read = ticks["b"]
            live = np.arange(S)[:, None] <= S - 2
        elif kind == "res":  # written by the stage's own F, read by its B (not on the last stage)
            write, read, live = ticks["f"], ticks["b"], np.arange(S)[:, None] <= S - 2
        elif kind == "wgrad":
            write, read, live = ticks["b"], ticks["w"], np.ones((S, 1), bool)
            if not self.split:
                return 1
        else:
            raise ValueError(f"unknown buffer kind {kind!r}")
        for r in range(1, M + 1):
            if not any(_collides(write[s], read[s], r) for s in range(S) if live[s, 0]):
                return r
        raise AssertionError("unreachable: R = M never collides")


def _tick_of(mb, ok, M) -> np.ndarray:
    """`[S, M]`: the tick at which each stage runs microbatch i in this lane (-1 if never)."""
    T, S = ok.shape
    out = np.full((S, M), -1)
    for t, s in zip(*np.nonzero(ok)):
        out[s, mb[t, s]] = t
    return out


def _collides(write, read, r) -> bool:
    """Entry j written (end of tick write[j]) while entry i of the same slot is still to be read (tick read[i])."""
    for i in range(len(write)):
        for j in range(len(write)):
            if i != j and i % r == j % r and write[i] <= write[j] < read[i]:
                return True
    return False


def _table(S, M, ops) -> tuple[dict, dict]:
    T = max(t for t, _, _, _ in ops) + 1
    mb = {k: np.zeros((T, S), np.int32) for k in LANES}
    ok = {k: np.zeros((T, S), bool) for k in LANES}
    for t, s, lane, i in ops:
        assert not ok[lane][t, s], (t, s, lane)
        mb[lane][t, s], ok[lane][t, s] = i, True
    return mb, ok


def one_f_one_b(stages: int, microbatches: int) -> LoopSchedule:
    """Lockstep 1F1B: F(i, s) at tick i + s, B(i, s) (input and weight gradient) at tick i + 2S - 1 - s."""
    S, M = stages, microbatches
    ops = [(i + s, s, "f", i) for i in range(M) for s in range(S)]
    ops += [(i + 2 * S - 1 - s, s, "b", i) for i in range(M) for s in range(S)]
    return LoopSchedule("1f1b", S, M, *_table(S, M, ops), split=False)


def zb_h1(stages: int, microbatches: int, cap=None) -> LoopSchedule:
    """ZB-H1 by list scheduling, one op per stage per tick: B when its cotangent has arrived, else F when its input
    has arrived and the stage holds fewer than `cap(s)` microbatches, else the oldest pending W.

    cap: callable stage -> int (default 2S - 1 - s; 1F1B's memory is `lambda s: S - s`)."""
    S, M = stages, microbatches
    cap = cap or (lambda s: 2 * S - 1 - s)
    done = {lane: np.full((S, M), np.iinfo(np.int32).max) for lane in LANES}
    nxt = {lane: [0] * S for lane in LANES}
    ops, t = [], 0
    while min(nxt["w"]) < M:
        chosen = []
        for s in range(S):
            i, j, k = nxt["b"][s], nxt["f"][s], nxt["w"][s]
            if i < M and done["f"][s, i] < t and (s == S - 1 or done["b"][s + 1, i] < t):
                chosen.append((s, "b", i))
            elif j < M and (s == 0 or done["f"][s - 1, j] < t) and j - k < cap(s):
                chosen.append((s, "f", j))
            elif k < i:
                chosen.append((s, "w", k))
        for s, lane, i in chosen:
            done[lane][s, i] = t
            nxt[lane][s] += 1
            ops.append((t, s, lane, i))
        t += 1
        if t > 10 * (3 * M + 2 * S):
            raise ValueError(f"zb_h1: no progress with stages={S}, microbatches={M}; is cap(s) >= 1?")
    return LoopSchedule("zb_h1", S, M, *_table(S, M, ops), split=True)


def make(name: str, stages: int, microbatches: int) -> LoopSchedule:
    if name == "1f1b":
        return one_f_one_b(stages, microbatches)
    if name == "zb_h1":
        return zb_h1(stages, microbatches)
    raise ValueError(f"unknown backward-in-loop schedule {name!r}")
