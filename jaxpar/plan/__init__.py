"""The layout planner: for a config's model and global batch on a cluster, every layout `validate` accepts, ranked
by an analytic step time (`cost`), with the memory per device of the best ones compiled (`memory`).

    python -m jaxpar.plan --config configs/gpt_large.py --gpus 8 --device a100-80g [--json plan.json]

Rooms: `hardware` (device and link constants with sources), `space` (the layouts), `cost` (the time model),
`memory` (compiled and estimated bytes), `measure` (a real step on the devices present), `table` (the output).
"""
from __future__ import annotations

import dataclasses

from jaxpar.compiled import model_vocab
from jaxpar.model import derived
from jaxpar.plan import cost, memory, rollout
from jaxpar.plan.hardware import GiB, Cluster
from jaxpar.plan.space import Layout, Space, apply, candidates
from jaxpar.train import objectives

__all__ = ["plan", "Plan", "Candidate", "vocab_of"]


@dataclasses.dataclass
class Candidate:
    layout: Layout
    time: dict  # cost.step_time
    estimate: tuple  # memory.estimate: (state, activation) bytes
    memory: dict | None = None  # memory.Compiler.memory (compiled or derived), None: not compiled
    generation: dict | None = None  # memory.generation: an objective that samples (GRPO), its round's bytes

    def config(self, config):
        """A copy of `config` that trains this candidate: its layout's keys, and the implementation a MoE model's
        `model.moe_impl=auto` runs on it (`cost.step_time`'s "moe_impl")."""
        out = apply(config, self.layout)
        with out.unlocked():
            out.model.moe_impl = self.time.get("moe_impl", out.model.moe_impl)
        return out

    def peak(self) -> float:
        """Device bytes (with `optim.offload`, less what lives in host memory)."""
        return self.memory["peak"] if self.memory else sum(self.estimate)

    def rank(self, capacity: float) -> tuple:
        """The plan's order: compiled and fitting, then unknown (not compiled), then not fitting; each by step time."""
        return {True: 0, None: 1, False: 2}[self.fits(capacity)], self.time["step_s"]

    def fits(self, capacity: float) -> bool | None:
        """True / False from the compiled bytes; uncompiled: False when the exact state bytes alone exceed
        `capacity`, else None (an estimate is no verdict). A round's generation (its KV pool and the params in the
        decode layout) that exceeds `capacity` does not fit either way."""
        if self.generation is not None and self.generation["peak"] > capacity:
            return False
        if self.memory is None:
            return False if self.estimate[0] > capacity else None
        return self.memory["peak"] <= capacity


@dataclasses.dataclass
class Plan:
    model: cost.Model
    cluster: Cluster
    capacity: float  # bytes a device may use
    ranked: list  # Candidate, best first: compiled and fitting, then unknown, then not fitting; each by step time
    considered: int  # layouts validate accepted
    compiles: int


def vocab_of(config) -> int:
    """The model's vocabulary by the trainer's rule (`compiled.model_vocab`: a ViT's classes)."""
    return model_vocab(config)


def plan(config, cluster: Cluster, space: Space = Space(), *, compile_top: int = 10, devices=None,
         mem_fraction: float = 0.9) -> Plan:
    """Rank every layout of `space` by predicted step time; compile down the ranking (skipping layouts whose state
    bytes plus activation estimate, scaled by 0.8 x the smallest compiled/estimated ratio seen for their kind of
    recompute, cannot fit) until
    `compile_top` layouts fit or 2 x compile_top + 4 compiles ran; compiled layouts are re-timed with their compiled
    data-parallel collectives. `devices`: fake CPU devices to compile on (None: no compiles)."""
    # a ViT's sequence: its patches and the class token; `data.packing=auto` judged from the records once
    config = objectives.with_packing(derived(config))
    model = cost.Model.from_config(config, vocab_of(config))
    capacity = cluster.device.memory * mem_fraction
    space = dataclasses.replace(space, gpus_per_node=cluster.gpus_per_node)
    generation = memory.Generation(config)
    cands = [_candidate(model, lay, cluster, generation) for lay in candidates(config, cluster.gpus, space)]
    cands.sort(key=lambda c: c.time["step_s"])
    compiler = memory.Compiler(config, model.vocab, devices) if devices else None
    found, ratio = 0, {}  # per kind of recompute: the smallest (compiled - state) / activation estimate seen
    for c in cands:
        if compiler is None or found >= compile_top or compiler.compiles >= 2 * compile_top + 4:
            break
        # what decides how far the activation estimate is off: the recompute, and the attention kernel (XLA's on
        # the CPU compile; blockwise, with no score matrix, under context parallelism)
        kind = (c.layout.stage > 1, c.layout.pipeline_remat, c.layout.remat, c.layout.context > 1)
        state, act = c.estimate
        if state + act * 0.8 * ratio.get(kind, 0.5) > capacity or not compiler.can_compile(c.layout):
            continue
        c.memory = compiler.memory(c.layout, c.time.get("moe_impl"))  # what `auto` runs on this layout
        ratio[kind] = min(ratio.get(kind, float("inf")), max(c.memory["peak"] - state, 0.0) / max(act, 1.0))
        c.time = _with_round(cost.step_time(model, c.layout, cluster, c.memory["data_collectives"]), model, c,
                             cluster, generation)
        found += c.fits(capacity) is True
    cands.sort(key=lambda c: c.rank(capacity))
    return Plan(model, cluster, capacity, cands, len(cands), compiler.compiles if compiler else 0)


def _candidate(model: cost.Model, lay: Layout, cluster: Cluster, generation: memory.Generation) -> Candidate:
    """A layout timed, its memory estimated for the MoE implementation `auto` runs on it, and an objective that
    samples its round's generation bytes."""
    time = cost.step_time(model, lay, cluster)
    if "moe_impl" in time:
        model = dataclasses.replace(model, auto=False, ragged=time["moe_impl"] == "ragged")
    c = Candidate(lay, time, memory.estimate(model, lay), generation=generation(lay, model))
    c.time = _with_round(time, model, c, cluster, generation)
    return c


def _with_round(time: dict, model: cost.Model, c: Candidate, cluster: Cluster, generation: memory.Generation) -> dict:
    """A train step's `time` with an objective's round of sampling added (`rollout.round_time`): "train_s" the
    train step's, "round" the round's terms, "round_s", and "step_s" their sum."""
    if c.generation is None:
        return time
    g = c.generation
    rnd = rollout.round_time(model, generation.round, c.layout, cluster, g, time["compute_s"])
    return {**time, "train_s": time["step_s"], "round": rnd, "round_s": rnd["round_s"],
            "step_s": time["step_s"] + rnd["round_s"]}


def summary(p: Plan, c: Candidate) -> dict:
    """One candidate as the table and the JSON show it."""
    m, t = p.model, c.time
    tokens = m.global_batch * m.seq / t["step_s"]
    mf = cost.model_flops_per_step(m) / t["step_s"] / p.cluster.gpus
    return {"layout": c.layout.name(), "overrides": c.layout.overrides(), "flags": c.layout.flags(),
            "micro_batch": c.layout.micro_batch(m.global_batch), "tokens_per_s": tokens,
            "tflops_per_gpu": mf / 1e12, "mfu": mf / p.cluster.device.peak_flops,
            "hw_tflops_per_gpu": t["device_flops"] / t["step_s"] / 1e12,
            "memory_gib": c.peak() / GiB, "memory_source": c.memory["source"] if c.memory else "estimate",
            "host_gib": (c.memory["host"] if c.memory else m.host_bytes(c.layout)) / GiB,
            "fits": c.fits(p.capacity), "time": t, "generation": c.generation,
            "collectives_by_kind": c.memory.get("collectives_by_kind") if c.memory else None}
