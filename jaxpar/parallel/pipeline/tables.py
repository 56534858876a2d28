"""Pipeline schedules as tick tables: pure numpy, no JAX; the engines, the registry, the tests and the bench read them.

One table type, `Schedule`: for tick t and stage s, per lane, which microbatch (`mb`), which of the stage's local
chunks (`rep`) and whether there is work (`ok`). Forward tables (GPipe, circular) have the lane F only: their backward
pass is autodiff of the loop (`jaxpar/parallel/pipeline/autodiff.py`). Loop tables (1F1B, ZB-H1) have F (forward), B
(backward; with `split`, only the input gradient) and W (weight gradient, only with `split`), run in that order
within a tick (`jaxpar/parallel/pipeline/loop.py`). Activations go to the next chunk's stage and cotangents to the previous
one's at the end of a tick (`Schedule.sends`), usable from the next one.

Chunk placement (all schedules): with v chunks of Lc layers per stage, global chunk c = r·S + s is local chunk r of
stage s (`Schedule.chunk`), so stage s holds chunks s, s + S, ...; the layer order that gives each stage its chunks
as one contiguous block is `to_stage_major`.

- `gpipe(S, M)` (Huang et al. 2019): M + S - 1 ticks; `circular(S, v, M)` (interleaved virtual stages: Narayanan
  et al. 2021, sec. 2.2; GSPMD's "circular repeat", Xu et al. 2021, sec. 3.3): v·M + S - 1 ticks, so the bubble
  fraction falls from (S-1)/(M+S-1) to (S-1)/(v·M+S-1).
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
SEND = {"f": +1, "b": -1}  # lane -> the stage its output goes to: activations forward, cotangents backward


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Per lane (`f`; loop tables also `b`, `w`): `mb[lane]` (microbatch), `rep[lane]` (the stage's local chunk r:
    global chunk `chunk(r, s)`) and `ok[lane]` (work or bubble), int32/bool `[ticks, stages]`."""
    name: str
    stages: int
    virtual: int
    microbatches: int
    mb: dict
    rep: dict
    ok: dict
    split: bool = False  # True: B is the input gradient only and W the weight gradient; False: B does both

    @property
    def ticks(self) -> int:
        return self.ok["f"].shape[0]

    # ---- chunk placement, written once: global chunk c = r·S + s ----------------------------------------------
    def chunk(self, r, s):
        """Global chunk index of local chunk r on stage s (ints or traced int32)."""
        return chunk(r, s, self.stages)

    def local(self, c):
        """Local chunk index (on its stage `c mod S`) of global chunk c."""
        return c // self.stages

    def chunks_of(self, s: int) -> range:
        """The global chunks stage s holds, in local order."""
        return range(s, self.virtual * self.stages, self.stages)

    def sends(self, lane: str, ring: bool | None = None) -> list[tuple[int, int]]:
        """`ppermute` pairs (source stage, target stage) for what `lane` hands on at the end of a tick; round the ring
        of stages when there are virtual stages (`ring` None), else from stage to stage."""
        S, step = self.stages, SEND[lane]
        ring = self.virtual > 1 if ring is None else ring
        return [(j, (j + step) % S) for j in (range(S) if ring else (range(S - 1) if step > 0 else range(1, S)))]

    # ---- derived quantities ---------------------------------------------------------------------------------
    def bubble_fraction(self) -> float:
        """Idle forward slots / all slots: (S - 1) / (v·M + S - 1) for GPipe and circular."""
        return 1.0 - float(self.ok["f"].mean())

    def time(self, f: float = 1.0, b: float = 1.0, w: float = 1.0) -> float:
        """Critical path of the lockstep schedule: sum over ticks of the busiest stage's work (a fused B costs b + w;
        one chunk of v costs 1/v of it; a forward-only table's tick costs f + b + w). f, b, w: per microbatch on one
        stage's layers (e.g. seconds); the ideal is M·(f + b + w)."""
        if "b" not in self.ok:  # a forward table: its backward is the transposed loop, tick for tick
            return float(((f + b + w) * self.ok["f"]).max(axis=1).sum()) / self.virtual
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
        out = np.full((self.virtual * self.stages, self.microbatches), -1)
        for t, s in zip(*np.nonzero(self.ok[lane])):
            out[self.chunk(self.rep[lane][t, s], s), self.mb[lane][t, s]] = t
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
            if not any(self._stage_collides(s, write, read, live, R) for s in range(S)):
                return R
        raise AssertionError("unreachable: R = v·M never collides")

    def _stage_collides(self, s, write, read, live, R) -> bool:
        """On stage s, an entry written (end of tick write[c, i]) into a live entry's slot before it is read."""
        cells = [(c, i) for c in self.chunks_of(s) if live[c] for i in range(self.microbatches)]
        keys = [self.key(i, self.local(c)) for c, i in cells]
        return _collides(keys, [write[c] for c in cells], [read[c] for c in cells], R)


def chunk(r, s, stages: int):
    """The chunk placement: local chunk r of stage s is global chunk r·S + s (ints or traced int32)."""
    return r * stages + s


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


def one_f_one_b(stages: int, microbatches: int, virtual: int = 1) -> Schedule:
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
        return Schedule("1f1b", S, 1, M, *_table(S, ops))
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
                c = chunk(r, s, S)
                if c == 0 or done["f"][c - 1, i] < t:
                    chosen.append((s, "f", i, r))
            if nxt["b"][s] < v * M:
                i, r = order["b"][s][nxt["b"][s]]
                c = chunk(r, s, S)
                if done["f"][c, i] < t and (c == C - 1 or done["b"][c + 1, i] < t):
                    chosen.append((s, "b", i, r))
        for s, lane, i, r in chosen:
            done[lane][chunk(r, s, S), i] = t
            nxt[lane][s] += 1
            ops.append((t, s, lane, i, r))
        t += 1
        if t > 10 * v * (M + 2 * S):
            raise AssertionError(f"interleaved 1F1B made no progress (S={S}, M={M}, v={v})")
    return Schedule("1f1b", S, v, M, *_table(S, ops))


def zb_h1(stages: int, microbatches: int, cap=None) -> Schedule:
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
    return Schedule("zb_h1", S, 1, M, *_table(S, ops), split=True)


def circular(stages: int, virtual: int, microbatches: int, name: str = "circular") -> Schedule:
    """Stage s works at tick t on slot k = t - s: microbatch k mod M, pass (local chunk) k div M, valid while
    k < v·M.

    Microbatch i leaves the last stage after pass r at tick r·M + i + S - 1 and is needed back on stage 0 at
    tick (r+1)·M + i, so M >= S is required (validated in config).

    Raises:
      ValueError: M < S with v > 1.
    """
    S, v, M = stages, virtual, microbatches
    if v > 1 and M < S:
        raise ValueError(f"circular schedule needs microbatches >= stages; got M={M}, S={S}")
    t = np.arange(v * M + S - 1)[:, None]
    k = t - np.arange(S)[None, :]
    valid = (k >= 0) & (k < v * M)
    kc = np.clip(k, 0, v * M - 1)
    return Schedule(name, S, v, M, {"f": (kc % M).astype(np.int32)}, {"f": (kc // M).astype(np.int32)},
                    {"f": valid})


def gpipe(stages: int, microbatches: int) -> Schedule:
    return circular(stages, 1, microbatches, name="gpipe")


def to_stage_major(x, stages: int, virtual: int):
    """Layer axis 0 in canonical order -> the order whose contiguous split over `stages` gives stage s its chunks
    s, s + S, ..., s + (v-1)·S (the placement c = r·S + s). Identity for v = 1."""
    if virtual == 1:
        return x
    L = x.shape[0]
    c = x.reshape(virtual, stages, L // (virtual * stages), *x.shape[1:])  # [v, S, Lc, ...]: chunk r·S + s
    return c.swapaxes(0, 1).reshape(x.shape)


def from_stage_major(x, stages: int, virtual: int):
    """Inverse of `to_stage_major`."""
    if virtual == 1:
        return x
    L = x.shape[0]
    c = x.reshape(stages, virtual, L // (virtual * stages), *x.shape[1:])
    return c.swapaxes(0, 1).reshape(x.shape)
