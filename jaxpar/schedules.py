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
    """Per lane (`f`, `b`, `w`): `mb[lane]` (microbatch), `rep[lane]` (the stage's local chunk r: global chunk
    r·S + s) and `ok[lane]` (work or idle), int32/bool `[ticks, stages]`."""
    name: str
    stages: int
    virtual: int
    microbatches: int
    mb: dict
    rep: dict
    ok: dict
    split: bool  # True: B is the input gradient only and W the weight gradient; False: B does both, W idle

    @property
    def ticks(self) -> int:
        return self.ok["f"].shape[0]

    def time(self, f: float = 1.0, b: float = 1.0, w: float = 1.0) -> float:
        """Critical path of the lockstep schedule: sum over ticks of the busiest stage's work (a fused B costs b + w;
        one chunk of v costs 1/v of it). f, b, w: per microbatch on one stage's layers (e.g. seconds); the ideal is
        M·(f + b + w)."""
        cb = b if self.split else b + w
        cost = f * self.ok["f"] + cb * self.ok["b"] + w * self.ok["w"]
        return float(cost.max(axis=1).sum()) / self.virtual

    def in_flight(self) -> np.ndarray:
        """Per stage, the most (microbatch, chunk) inputs held at once (forward done, last backward lane not yet),
        each one activation `[micro_batch, seq, embed]`: int `[stages]`."""
        last = "w" if self.split else "b"
        held = np.cumsum(self.ok["f"], 0) - np.cumsum(self.ok[last], 0)
        return held.max(axis=0)

    def chunk_ticks(self, lane: str) -> np.ndarray:
        """`[v·S, M]`: the tick at which global chunk c runs microbatch i in `lane` (-1 if never)."""
        S = self.stages
        out = np.full((self.virtual * S, self.microbatches), -1)
        for t, s in zip(*np.nonzero(self.ok[lane])):
            out[self.rep[lane][t, s] * S + s, self.mb[lane][t, s]] = t
        return out

    def key(self, i, r):
        """Position of (microbatch i, local chunk r) in a stage's forward order (Megatron-LM's interleaved order:
        groups of S microbatches through each chunk in turn; i for v = 1). Ring buffers use slot key mod R.
        Works on ints and on traced int32."""
        S, v = self.stages, self.virtual
        return (i // S) * (v * S) + r * S + i % S if v > 1 else i

    def ring(self, kind: str) -> int:
        """Slots R of a ring buffer indexed by `key(i, r)` mod R that never overwrites an entry still to be read.

        kind: "act" (chunk inputs: sent by the previous chunk's F, read by this chunk's F and B), "grad"
        (cotangents: sent by the next chunk's B, read by this chunk's B), "res" (F's vjp residuals, read by the same
        chunk's B), "wgrad" (B's saved tensors for W: written by B, read by W; split schedules only)."""
        S, v, M = self.stages, self.virtual, self.microbatches
        F, B, W = (self.chunk_ticks(k) for k in LANES)
        C = v * S
        none = np.full((1, M), -1)
        if kind == "act":
            write, read, live = np.vstack([none, F[:-1]]), B, np.arange(C) >= 1
        elif kind == "grad":
            write, read, live = np.vstack([B[1:], none]), B, np.arange(C) <= C - 2
        elif kind == "res":
            write, read, live = F, B, np.arange(C) <= C - 2
        elif kind == "wgrad":
            if not self.split:
                return 1
            write, read, live = B, W, np.ones(C, bool)
        else:
            raise ValueError(f"unknown buffer kind {kind!r}")
        for R in range(1, v * M + 1):
            ok = True
            for s in range(S):
                cs = [c for c in range(s, C, S) if live[c]]  # this stage's chunks, keys r·M + i
                keys = [self.key(i, c // S) for c in cs for i in range(M)]
                w = [write[c, i] for c in cs for i in range(M)]
                r = [read[c, i] for c in cs for i in range(M)]
                if _collides(keys, w, r, R):
                    ok = False
                    break
            if ok:
                return R
        raise AssertionError("unreachable: R = v·M never collides")


def _collides(keys, write, read, R) -> bool:
    """Entry b written (end of tick write[b]) into a's slot while a is still to be read (at tick read[a])."""
    k, w, r = (np.asarray(x)[:, None] for x in (keys, write, read))
    same = (k % R == k.T % R) & ~np.eye(len(k), dtype=bool)
    return bool((same & (w <= w.T) & (w.T < r)).any())


def _table(S, ops) -> tuple[dict, dict, dict]:
    """ops (tick, stage, lane, microbatch, local chunk) -> mb, rep, ok tables."""
    T = max(op[0] for op in ops) + 1
    mb = {k: np.zeros((T, S), np.int32) for k in LANES}
    rep = {k: np.zeros((T, S), np.int32) for k in LANES}
    ok = {k: np.zeros((T, S), bool) for k in LANES}
    for t, s, lane, i, r in ops:
        assert not ok[lane][t, s], (t, s, lane)
        mb[lane][t, s], rep[lane][t, s], ok[lane][t, s] = i, r, True
    return mb, rep, ok


def one_f_one_b(stages: int, microbatches: int, virtual: int = 1) -> LoopSchedule:
    """Lockstep 1F1B. v = 1: F(i, s) at tick i + s, B(i, s) (input and weight gradient) at tick i + 2S - 1 - s.

    v > 1, interleaved (Narayanan et al. 2021, sec. 2.2): stage s holds chunks s, s + S, ..., and runs its forwards
    in Megatron-LM's order (S microbatches through chunk r, then the same S through chunk r + 1, ...; backwards the
    chunks in reverse), each lane as soon as its input or cotangent has arrived, with at most (v + 1)·S chunk inputs
    held per stage. Critical path (v·M + S - 1) / (v·M) of the ideal.

    Raises:
      ValueError: v > 1 and M not a multiple of S (Megatron-LM's rule for the interleaved schedule).
    """
    S, M, v = stages, microbatches, virtual
    if v == 1:
        ops = [(i + s, s, "f", i, 0) for i in range(M) for s in range(S)]
        ops += [(i + 2 * S - 1 - s, s, "b", i, 0) for i in range(M) for s in range(S)]
        return LoopSchedule("1f1b", S, 1, M, *_table(S, ops), split=False)
    if M % S:
        raise ValueError(f"interleaved 1F1B needs microbatches divisible by stages; got M={M}, S={S}")
    C, cap = v * S, (v + 1) * S
    groups = range(0, M, S)
    order = {"f": [[(i, r) for k in groups for r in range(v) for i in range(k, k + S)] for _ in range(S)],
             "b": [[(i, r) for k in groups for r in reversed(range(v)) for i in range(k, k + S)] for _ in range(S)]}
    done = {lane: np.full((C, M), np.iinfo(np.int32).max) for lane in ("f", "b")}
    nxt = {lane: [0] * S for lane in ("f", "b")}
    ops, t = [], 0
    while min(nxt["b"]) < v * M:
        chosen = []
        for s in range(S):
            if nxt["f"][s] < v * M and nxt["f"][s] - nxt["b"][s] < cap:
                i, r = order["f"][s][nxt["f"][s]]
                c = r * S + s
                if c == 0 or done["f"][c - 1, i] < t:
                    chosen.append((s, "f", i, r))
            if nxt["b"][s] < v * M:
                i, r = order["b"][s][nxt["b"][s]]
                c = r * S + s
                if done["f"][c, i] < t and (c == C - 1 or done["b"][c + 1, i] < t):
                    chosen.append((s, "b", i, r))
        for s, lane, i, r in chosen:
            done[lane][r * S + s, i] = t
            nxt[lane][s] += 1
            ops.append((t, s, lane, i, r))
        t += 1
        if t > 10 * v * (M + 2 * S):
            raise AssertionError(f"interleaved 1F1B made no progress (S={S}, M={M}, v={v})")
    return LoopSchedule("1f1b", S, v, M, *_table(S, ops), split=False)


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
            ops.append((t, s, lane, i, 0))
        t += 1
        if t > 10 * (3 * M + 2 * S):
            raise ValueError(f"zb_h1: no progress with stages={S}, microbatches={M}; is cap(s) >= 1?")
    return LoopSchedule("zb_h1", S, 1, M, *_table(S, ops), split=True)


def make(name: str, stages: int, microbatches: int, virtual: int = 1) -> LoopSchedule:
    if name == "1f1b":
        return one_f_one_b(stages, microbatches, virtual)
    if name == "zb_h1" and virtual == 1:
        return zb_h1(stages, microbatches)
    raise ValueError(f"unknown backward-in-loop schedule {name!r}")
