"""The analytic time model of one train step of jaxpar's program for a `Layout` on a `Cluster`.

Per microbatch and layer (b sequences of s tokens, width h, MLP width f, tensor t), one device runs
  matmuls  2·b·s·h·(q + k + v + o + f·n_mlp) / t FLOPs (n_mlp: 2 for GPT-2, 3 for SwiGLU) plus the attention core
           4·b·s²·h / t (halved for a fused causal kernel, which skips masked tiles),
  at `MATMUL_EFFICIENCY` of the device's peak; and memory-bound elementwise work: `ELEMENTWISE_TRAFFIC` x the
  layer's activation bytes (Korthikanti et al. 2022, Table 2: s·b·h·(10 + 24/t + 5·a·s/(h·t)) bytes at 2 bytes per
  value; with sequence parallelism 34/t; a fused attention kernel keeps no a·s² scores) at the HBM bandwidth.
  A backward pass is twice a forward pass; recompute adds forward passes (full layer or attention core only).
Tensor parallelism: 2 all-reduces of [b, s, h] per layer per forward pass, 2 per backward (Megatron-LM; sequence
  parallel: an all-gather + reduce-scatter pair each, the same bytes), ring time 2(t-1)/t·X / busbw, exposed.
Mixture of experts: a MoE layer computes its fixed-size buffers, E·C slots per sequence (C: `moe.capacity`), not k·s
(`model.moe_impl=buffers`), or its k·s choices (`ragged`; `expert_rows`), whose weight gradient XLA:GPU computes
  over every expert's masked copy of the rows (E·k·s: its `RaggedDotRewriter`, read from XLA's source;
  `weight_grad_rows`), and its forward and input gradient too where the grouped kernel is XLA's (`ragged_expanded`:
  off Hopper, in float32, ...); `auto` is priced both ways and runs the cheaper (`moe_prices`, as `plan.target`
  resolves it);
  expert parallelism adds 2 all-to-alls of the buffer [b, E, C, h] (ragged: its k·s rows, by `ragged_all_to_all` on
  GPUs, into a receive buffer of the worst case or `expert_buffer_factor`) per forward pass and 2 per backward over
  the expert group, time (e-1)/e·X / busbw, exposed (jaxpar's program does not overlap them).
Pipeline: the critical path of the schedule's own tick table (`Schedule.time` with per-microbatch stage costs f, b, w)
  plus the head on the last stage, and one [b, s, h] transfer per tick per direction over the stage link, exposed.
Data parallelism / ZeRO: the float32 gradient all-reduce (ZeRO 0, 1) or per-microbatch reduce-scatter (2) or the
  per-layer gathers + reduce-scatters (3), and the parameter all-gather after a sharded update (1, 2), over the
  data x expert group's link (the routed experts' over data's); what runs inside the microbatch loop overlaps with its compute (XLA's pipelined collectives,
  `runtime.GPU_FLAGS`), what runs after it is exposed.
The optimizer update streams 28 bytes per float32 parameter it updates (AdamW: read p, g, m, v; write p, m, v).
Host offload: what lives in host memory crosses the device's host link (PCIe) twice per step, exposed.
Context parallelism: a device's matmuls and activations are its seq / context tokens'; its queries attend to the
  whole sequence, the causal half computed (the balanced order makes that half equal on every device); per layer
  and forward pass an all-gather of K and V (this device's heads) over `context`, per backward pass their float32
  reduce-scatter, exposed.
"""
from __future__ import annotations

import dataclasses
import functools
import math

from jaxpar import model as gpt
from jaxpar.model import moe
from jaxpar.kernels import grouped
from jaxpar.kernels.attention import choose
from jaxpar.config import padded_vocab
from jaxpar.analysis.hlo_groups import axes_of
from jaxpar.parallel.pipeline import registry
from jaxpar.plan.hardware import HOST_LINKS, Cluster
from jaxpar.plan.space import Layout
from jaxpar.train import objectives
from jaxpar.train.state import OFFLOADED

# The model's two global constants, set once against Narayanan et al. 2021, Table 1 (bench/plan_published.py)
MATMUL_EFFICIENCY = 0.70  # fraction of the dense peak a large bf16 GEMM sustains
ELEMENTWISE_TRAFFIC = 3.0  # HBM bytes moved per activation byte stored, per forward pass


@dataclasses.dataclass(frozen=True)
class Model:
    """The numbers of a config's model the cost model reads; counts and FLOPs from the model spec (`jaxpar.model`)."""
    layers: int
    embed: int
    heads: int
    kv_heads: int
    mlp: int
    seq: int
    vocab: int  # real vocabulary (padded per layout)
    tied: bool
    positions: int  # rows of a learned position table (0: none)
    compute_bytes: int
    param_bytes: int
    fused_attention: bool
    global_batch: int  # a step's rows (`Objective.rows`: GRPO's prompts x completions)
    layer_total: int  # parameters of one block (the model spec's `param_counts`)
    layer_matmul: int  # its matmul weights
    shared_other: int  # parameters outside the blocks that are not a vocabulary table (positions, final norm)
    flops_per_token: float  # PaLM's 6N + 12·L·d·T of the model spec (`model.flops_per_token`)
    params: int  # every parameter, as the trainer builds them (tensor 1)
    experts: int = 0  # routed experts per MoE layer (0: dense)
    top_k: int = 0
    expert_mlp: int = 0
    capacity: int = 0  # slots per expert per sequence (`moe.capacity`)
    ragged: bool = False  # `model.moe_impl=ragged`: k·s rows, not E·C slots
    auto: bool = False  # `model.moe_impl=auto`: priced both ways, the cheaper taken (`step_time`)
    buffer_factor: float = 0.0  # `model.expert_buffer_factor` (0: the worst case)
    grouped_matmul: str = "auto"  # `ragged`'s kernel setting (`kernels.grouped.choose` per target)
    compute_dtype: str = "bfloat16"
    moe_layers: int = 0
    expert_params: int = 0  # the routed experts' weights, all layers
    trained: float = 1.0  # the fraction of the parameters that trains (LoRA: the adapters'; no gradient, no AdamW)
    base_bytes: int = 0  # bytes of a frozen parameter (LoRA's `lora.base_dtype`; 0: param_bytes)
    head_dim: int = 0  # (0: embed / heads)
    max_positions: int = 0  # the longest context (0: seq)

    @classmethod
    def from_config(cls, config, vocab: int):
        m, tr = config.model, config.train
        cfg = gpt.config_from(config, vocab, 1)
        counts = gpt.param_counts(cfg)
        kernel, _ = choose(m.attention, tr.compute_dtype, m.seq_len, cfg.head_dim, objectives.packing(config) != "concat",
                           backend="gpu")
        nbytes = {"float32": 4, "float64": 8}
        tables = cfg.vocab_size * cfg.embed * (1 if cfg.tie_embeddings else 2)
        moe_layers = sum(bool(moe.is_moe_layer(cfg, i)) for i in range(cfg.layers))
        experts = dict(experts=cfg.experts, top_k=cfg.experts_per_token, expert_mlp=cfg.expert_mlp,
                       capacity=moe.capacity(cfg, cfg.seq_len) if cfg.experts else 0, moe_layers=moe_layers,
                       expert_params=counts["experts"], ragged=cfg.moe_impl == "ragged", auto=cfg.moe_impl == "auto",
                       buffer_factor=cfg.expert_buffer_factor, grouped_matmul=cfg.grouped_matmul,
                       compute_dtype=tr.compute_dtype)
        return cls(**experts, layers=cfg.layers, embed=cfg.embed, heads=cfg.heads, kv_heads=cfg.kv_heads, mlp=cfg.mlp,
                   seq=cfg.seq_len, vocab=vocab, tied=cfg.tie_embeddings,
                   positions=cfg.max_positions if cfg.family.learned_positions else 0,
                   compute_bytes=nbytes.get(tr.compute_dtype, 2), param_bytes=nbytes.get(tr.param_dtype, 2),
                   fused_attention=kernel != "xla", global_batch=objectives.from_config(config).rows(config),
                   layer_total=counts["layer"], layer_matmul=counts["layer_matmul"],
                   shared_other=counts["shared"] - tables, flops_per_token=gpt.flops_per_token(cfg),
                   params=counts["total"], trained=counts["trainable"] / counts["total"],
                   base_bytes=nbytes.get(cfg.weight_dtype, 2), head_dim=cfg.head_dim,
                   max_positions=cfg.max_positions)

    def padded_vocab(self, t: int) -> int:
        return padded_vocab(self.vocab, t)

    def layer_params(self) -> int:
        """Matmul weights of one layer (the model spec's)."""
        return self.layer_matmul

    def params_per_device(self, lay: Layout) -> float:
        """Parameters one device holds before ZeRO: its stage's layers split over tensor (the routed experts also
        over expert), plus the embedding (and untied head) split over tensor and the rest held whole, by every stage
        (jaxpar's layout)."""
        return sum(p for p, _ in self.zero_groups(lay))

    def zero_groups(self, lay: Layout) -> list[tuple[float, int]]:
        """[(parameters per device, the data-parallel group ZeRO shards them over)]: the routed experts' over
        `data`, every other parameter's over data x expert."""
        h, t = self.embed, lay.tensor
        shared = self.padded_vocab(t) * h / t * (1 if self.tied else 2) + self.shared_other
        experts = self.expert_params / lay.stage / t / lay.expert
        dense = self.layers / lay.stage * (self.layer_total - self.expert_params / self.layers) / t + shared
        return [(dense, lay.data * lay.expert * lay.context), (experts, lay.data * lay.context)]

    def state_bytes(self, lay: Layout) -> dict:
        """Per-device bytes of the params, the float32 gradient buffer and AdamW's two moments (in the params' dtype,
        `train.param_dtype`) by ZeRO stage (the matmul weights: within 1 %), the routed experts' over `data`, the
        rest over data x expert."""
        z, f = lay.zero_stage, self.trained
        part = lambda nbytes, zmin: sum(P * nbytes / (d if z >= zmin else 1) for P, d in self.zero_groups(lay))  # noqa
        weights = f * self.param_bytes + (1 - f) * (self.base_bytes or self.param_bytes)
        return {"params": part(weights, 3), "grad_buffer": part(4 * f, 2), "opt_state": part(2 * self.param_bytes * f, 1)}

    def host_bytes(self, lay: Layout) -> float:
        """Per-device bytes in pinned host memory between steps (`optim.offload`: `train_state.OFFLOADED`)."""
        groups = self.state_bytes(lay)
        return sum(groups.get(g, 0.0) for g in OFFLOADED[lay.offload])  # no DPO reference here: 0


def expert_rows(model: Model, lay: Layout) -> tuple[float, float, float]:
    """(rows a MoE layer's experts compute, rows its buffers hold, rows its all-to-all sends) per sequence on one
    device (s = seq / context tokens of it): `buffers` E·min(C, s) slots for all three; `ragged` the k·s choices
    computed and sent (`ragged_all_to_all` moves the rows alone on GPUs), its receive buffer k·s per expert device
    (the worst case: every choice to one device) or `expert_buffer_factor` times that over them."""
    s = model.seq // lay.context
    if not model.ragged:
        return (model.experts * min(model.capacity, s),) * 3
    ep = lay.expert
    return model.top_k * s, model.top_k * s * (ep if not model.buffer_factor else min(ep, model.buffer_factor)), \
        model.top_k * s


def weight_grad_rows(model: Model, lay: Layout) -> float:
    """Rows the experts' weight gradient computes per sequence on one device: `buffers` its slots; `ragged` E·k·s,
    as XLA:GPU expands a ragged contraction over every expert (`RaggedDotRewriter`, from XLA's source; cuDNN's
    ragged-dot fusion takes only forward-shaped ragged dots)."""
    rows = expert_rows(model, lay)[0]
    return rows * model.experts if model.ragged else rows


def ragged_expanded(model: Model, cl: Cluster) -> bool:
    """Whether `ragged`'s forward and input-gradient matmuls run on XLA's ragged dot on the cluster's device (the
    kernel `grouped.choose` picks there: not the Mosaic kernel), which XLA:GPU expands over every expert as it does
    the weight gradient."""
    return model.ragged and grouped.choose(model.grouped_matmul, model.compute_dtype, model.embed, model.expert_mlp,
                                           on_hopper=cl.device.hopper) == "xla"


def activation_bytes(model: Model, lay: Layout) -> float:
    """One layer's activations for one microbatch (Korthikanti et al. 2022, Table 2, 2-byte values):
    s·b·h·(10 + 24/t + 5·a·s/(h·t)); with sequence parallelism 34/t for the first terms; no a·s² scores under a fused
    attention kernel (or the blockwise one of context parallelism); plus a MoE layer's buffers. s: a device's piece
    of the sequence (seq / context)."""
    b, s, h, t = lay.micro_batch(model.global_batch), model.seq // lay.context, model.embed, lay.tensor
    scores = 0 if model.fused_attention or lay.context > 1 else 5 * model.heads * s / (h * t)
    # a MoE layer also keeps its buffers: the dispatched tokens and the experts' output [b, rows, h], the gate, up and
    # product [b, rows, F / t] (2-byte values, as above), averaged over the layers (rows: `expert_rows`)
    moe = model.moe_layers / model.layers * b * expert_rows(model, lay)[1] * (4 * h + 6 * model.expert_mlp / t)
    return s * b * h * ((34 / t if lay.sequence_parallel else 10 + 24 / t) + scores) + moe


def ring(kind: str, n: int) -> float:
    """Bytes on the wire per byte of the collective's buffer (nccl-tests' bus bandwidth factors)."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n if kind == "all-reduce" else (n - 1) / n


def collective_time(kind: str, nbytes: float, n: int, bw: tuple[float, float]) -> float:
    """Seconds for one collective of `nbytes` (its buffer) over n ranks at (busbw, latency)."""
    return 0.0 if n <= 1 else ring(kind, n) * nbytes / bw[0] + bw[1]


@functools.lru_cache(maxsize=4096)
def _table(name: str, S: int, M: int, v: int):
    return registry.table(name, S, M, v)


def recompute_passes(lay: Layout) -> tuple[float, float]:
    """(extra full-layer forwards, extra attention-core forwards) per microbatch that jaxpar's program runs."""
    full = {"full": 1.0}.get(lay.remat, 0.0)
    core = 1.0 if lay.remat in ("selective", "dots", "attention") else 0.0
    if lay.stage > 1 and lay.pipeline_remat:
        full += 2.0 if lay.schedule == "zb_h1" else 1.0  # ZB-H1 recomputes in B and again in W
    return full, core


@dataclasses.dataclass(frozen=True)
class _Layer:
    """One layer's seconds per microbatch on one device (forward, backward, attention-core forward, one tensor
    collective, the forward matmuls alone) and its matmul FLOPs per forward pass; the head's forward seconds."""
    fwd: float
    bwd: float
    core: float
    tp: float
    mm_fwd: float
    flops_fwd: float
    flops_core: float
    head_fwd: float
    transfer: float  # bytes of one [b, s, h] activation
    ep: float = 0.0  # one expert all-to-all, averaged over the layers
    cp: float = 0.0  # a forward pass's K/V all-gather over context
    cp_bwd: float = 0.0  # the backward pass's dK/dV reduce-scatter (float32)


def _layer(model: Model, lay: Layout, cl: Cluster) -> _Layer:
    """Per device: s is its piece of the sequence (seq / context); its queries attend to all seq keys, the causal
    half computed (a fused kernel's or the blockwise kernel's skipped tiles)."""
    t, b, s, h, c = lay.tensor, lay.micro_batch(model.global_batch), model.seq // lay.context, model.embed, lay.context
    rate = cl.device.peak_flops * MATMUL_EFFICIENCY
    moe_share = model.moe_layers / model.layers
    rows, _, sent = expert_rows(model, lay)
    rows *= model.experts if ragged_expanded(model, cl) else 1  # the forward (and input gradient) over every expert
    slots = b * (rows - model.top_k * s)  # rows computed beyond the active k·s choices
    lin = 2 * b * s * model.layer_params() / t + moe_share * 2 * slots * 3 * h * model.expert_mlp / t
    core = 4 * b * s * (s * c) * h / t * (0.5 if model.fused_attention or c > 1 else 1.0)
    work = (lin + core) / rate + ELEMENTWISE_TRAFFIC * activation_bytes(model, lay) / cl.device.hbm_bw
    x = b * s * h * model.compute_bytes
    bw = cl.group_bw(t, 1)
    tp = collective_time("all-reduce", x, t, bw) + (bw[1] if lay.sequence_parallel else 0.0)  # SP: two collectives, one latency more
    buf = b * sent * h * model.compute_bytes
    ep = moe_share * collective_time("all-to-all", buf, lay.expert, cl.group_bw(lay.expert, t))
    kv = 2 * b * (s * c) * h * model.kv_heads / model.heads / t  # K and V of the whole sequence, this device's heads
    cp = collective_time("all-gather", kv * model.compute_bytes, c, cl.group_bw(c, t))
    cp_bwd = collective_time("reduce-scatter", kv * 4, c, cl.group_bw(c, t))
    dw = moe_share * 2 * b * (weight_grad_rows(model, lay) - rows) * 3 * h * model.expert_mlp / t / rate  # beyond
    return _Layer(fwd=work + 2 * tp + 2 * ep + cp, bwd=2 * work + dw + 2 * tp + 2 * ep + cp_bwd, core=core / rate,
                  tp=tp, mm_fwd=lin / rate, flops_fwd=lin + core, flops_core=core,
                  head_fwd=2 * b * s * h * model.padded_vocab(t) / t / rate, transfer=x, ep=ep, cp=cp, cp_bwd=cp_bwd)


def _pipeline(lay: Layout, cl: Cluster, ly: _Layer, Lc: float, head: float, r_full: float, r_core: float):
    """(critical path seconds, stage-transfer seconds) of the schedule's tick table with these stage costs."""
    sc = _table(lay.schedule, lay.stage, lay.microbatches, lay.virtual_stages)
    if lay.schedule == "zb_h1":  # B: input grads (+ recompute), W: weight grads (+ recompute again)
        f, b, w = Lc * ly.fwd, Lc * (ly.bwd - ly.mm_fwd + ly.fwd), Lc * (ly.mm_fwd + ly.fwd)
    else:
        f, b, w = Lc * ly.fwd, Lc * (ly.bwd + r_full * ly.fwd + r_core * ly.core), 0.0
    critical = sc.time(f, b, w) + lay.microbatches * head
    transfers = sc.ticks * (1 if "b" in sc.ok else 2)  # loop engine: both directions in one tick
    bw, lat = cl.p2p_bw(lay.stage * lay.tensor > cl.gpus_per_node)  # the slowest hop sets the lockstep tick
    return critical, transfers * (ly.transfer / bw + lat)


def step_time(model: Model, lay: Layout, cl: Cluster, compiled: list | None = None) -> dict:
    """Seconds per step, split into compute (incl. recompute), bubble, tensor / pipeline / data-parallel
    communication (exposed parts) and the optimizer update; the FLOPs each device runs. `compiled`: the step's
    collectives over `data` from its compile (`data_collectives`), used for the data-parallel / ZeRO term instead
    of the analytic one. A MoE model with `model.moe_impl=auto` is timed with the implementation `moe_prices` finds
    cheaper (analytically), named under "moe_impl" with both prices under "moe_prices"."""
    if model.experts and model.auto:
        prices = moe_prices(model, lay, cl)
        impl = min(prices, key=prices.get)  # a tie: buffers
        out = step_time(dataclasses.replace(model, auto=False, ragged=impl == "ragged"), lay, cl, compiled)
        return {**out, "moe_impl": impl, "moe_prices": prices}
    ly, (r_full, r_core) = _layer(model, lay, cl), recompute_passes(lay)
    M, Lc = lay.microbatches, model.layers / lay.stage
    head_passes = 6 if lay.stage > 1 and lay.schedule in ("gpipe", "circular") else 3  # checkpointed head: twice
    head = head_passes * ly.head_fwd + 2 * ly.tp
    recompute = r_full * ly.fwd + r_core * ly.core
    ideal = M * (Lc * (ly.fwd + ly.bwd + recompute) + head)
    critical, pp = (ideal, 0.0) if lay.stage == 1 else _pipeline(lay, cl, ly, Lc, head, r_full, r_core)
    dp = (_data_parallel(model, lay, cl, critical) if compiled is None
          else _overlap(compiled, lay, cl, critical, "compiled"))
    opt = 28 * model.trained * sum(p / (g if lay.zero_stage >= 1 else 1) for p, g in model.zero_groups(lay)) \
        / cl.device.hbm_bw
    off = offload_time(model, lay, cl)
    rate = cl.device.peak_flops * MATMUL_EFFICIENCY
    flops = M * (Lc * ((3 + r_full) * ly.flops_fwd + r_core * ly.flops_core) + head_passes * ly.head_fwd * rate)
    return {"step_s": critical + pp + dp["exposed"] + opt + off, "compute_s": ideal, "bubble_s": critical - ideal,
            "pp_comm_s": pp, "tp_comm_s": M * (Lc * (4 + 2 * r_full) + 2) * ly.tp,
            "ep_comm_s": M * Lc * (4 + 2 * r_full) * ly.ep,
            "cp_comm_s": M * Lc * ((1 + r_full) * ly.cp + ly.cp_bwd), "dp_comm_s": dp["exposed"],
            "dp_overlapped_s": dp["hidden"], "dp_bytes": dp["bytes"], "dp_source": dp["source"], "optimizer_s": opt,
            "recompute_s": M * Lc * recompute, "offload_s": off, "device_flops": flops}


def moe_prices(model: Model, lay: Layout, cl: Cluster) -> dict[str, float]:
    """{"buffers": s, "ragged": s}: the analytic step seconds of a MoE model's layout with each implementation."""
    return {impl: step_time(dataclasses.replace(model, auto=False, ragged=impl == "ragged"), lay, cl)["step_s"]
            for impl in ("buffers", "ragged")}


def offload_time(model: Model, lay: Layout, cl: Cluster) -> float:
    """Seconds per step on the host link (`optim.offload`): this device's shard of AdamW's two moments (and,
    offloading params, of the params) to the device and back, exposed (the update needs them whole). Activation
    offload (`model.remat="offload"`) is not priced: the search leaves it out (`space.SEARCHED_REMAT`)."""
    if lay.offload == "none":
        return 0.0
    link = HOST_LINKS[cl.device.host]
    return 2 * (model.host_bytes(lay) / link.busbw + link.latency)


def _data_parallel(model: Model, lay: Layout, cl: Cluster, window: float) -> dict:
    """Exposed and hidden seconds of the analytic data-parallel / ZeRO collectives (`_overlap`)."""
    ops = []
    for P, group in model.zero_groups(lay):
        ops += [(*op, group) for op in _zero_ops(model, lay, P)]
    return _overlap(ops, lay, cl, window, "analytic")


def _zero_ops(model: Model, lay: Layout, P: float) -> list:
    """(kind, bytes, executions) of the data-parallel / ZeRO collectives of P parameters per device."""
    grads, params = 4 * P * model.trained, model.param_bytes * P
    M, piped = lay.microbatches, lay.stage > 1
    ops = []  # a pipeline gathers / scatters a stage's whole params once per step
    if lay.zero_stage <= 1:
        ops.append(("all-reduce", grads, 1))
    if lay.zero_stage == 2:
        ops.append(("reduce-scatter", grads, 1 if piped else M))
    if lay.zero_stage == 3 and piped:
        ops += [("all-gather", params, 1), ("reduce-scatter", grads, 1)]
    elif lay.zero_stage == 3:  # per layer and microbatch: a gather in the forward (kept for the backward), again in a
        L = model.layers  # recompute, and a reduce-scatter of its gradient
        gathers = L * M * (1 + recompute_passes(lay)[0])
        ops += [("all-gather", params / L, gathers), ("reduce-scatter", grads / L, L * M)]
    if lay.zero_stage in (1, 2):
        ops.append(("all-gather", params, 1))
    return ops


def _overlap(ops, lay: Layout, cl: Cluster, window: float, source: str) -> dict:
    """(kind, bytes, executions[, group size]) over the data-parallel group (default `data`) -> exposed / hidden
    seconds. A collective run n times per step (in the microbatch or layer loop) can hide n - 1 of its runs behind up
    to `window` seconds of compute (one run, the last reduction or the first gather, has nothing left to overlap);
    one run once per step is exposed."""
    ops = [(*op, lay.data)[:4] for op in ops if op[2] > 0]
    time = lambda k, b, d: collective_time(k, b, d, cl.group_bw(d, lay.tensor * lay.stage))  # noqa: E731
    total = sum(n * time(k, b, d) for k, b, n, d in ops)
    hideable = sum((n - 1) * time(k, b, d) for k, b, n, d in ops)
    hidden = min(hideable, window)
    return {"exposed": total - hidden, "hidden": hidden, "source": source,
            "bytes": sum(n * b for k, b, n, d in ops if d > 1)}


def data_collectives(collectives: list, mesh_shape: dict) -> list:
    """The compile report's collectives (`hlo.hlo_collectives`) that run over the `data` axis: (kind, bytes of the
    whole buffer, executions per step)."""
    out = []
    for c in collectives:
        axes = axes_of(c["group"], mesh_shape)
        if "data" in axes and c["kind"] != "collective-permute":
            n = len(c["group"]) if c["group"] else math.prod(mesh_shape.values())  # no groups: every device
            full = c["bytes"] * (n if c["kind"] == "reduce-scatter" else 1)  # the report gives a scatter's shard
            out.append((c["kind"], full, c["executions"]))
    return out


def model_flops_per_step(model: Model) -> float:
    """PaLM's 6N + 12·L·h·s per token (the model spec's `flops_per_token`) times the global batch's tokens."""
    return model.flops_per_token * model.global_batch * model.seq


def narayanan_flops(model: Model) -> float:
    """Narayanan et al. 2021, eq. 3: 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) FLOPs per step (full recompute)."""
    B, s, l, h, V = model.global_batch, model.seq, model.layers, model.embed, model.vocab
    return 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
