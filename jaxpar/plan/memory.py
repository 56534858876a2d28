"""Memory per device of a layout: compiled (XLA's buffer assignment of the real train step, ahead of time on fake
CPU devices with abstract inputs) or, before that, an analytic estimate used only to order and prune compiles.

A compile needs data x tensor x stage devices. Where only the data-parallel size differs and the state is not
sharded over data (ZeRO 0), every device runs the same program on the same shapes, so the layout is compiled at
data = 2 with the batch per replica unchanged (the gradient all-reduce keeps its buffer; only its group shrinks):
`source` "derived (data 2)". ZeRO >= 1 shards the state over data: compiled at the layout's own data size.
Compiles are cached by the per-device program they build (`key`), so candidates that share one compile once.
"""
from __future__ import annotations

import dataclasses

from jaxpar.compiled import report_for, xla_cpu_aborts
from jaxpar.config import MESH_AXES
from jaxpar.generate.cache import dry_run_entry
from jaxpar.plan.cost import Model, activation_bytes, data_collectives, recompute_passes
from jaxpar.plan.rollout import Round
from jaxpar.plan.space import Layout, apply
from jaxpar.train.state import OFFLOADED


def compile_flags(flags_: str, devices: int, fast: bool) -> str:
    """XLA_FLAGS for compiling on `devices` fake CPU devices; `fast`: LLVM -O0 (XLA's buffer assignment, hence the
    memory figures, is the same at every backend level; measured: 145B on 64 devices 69.89 GiB both, 20 -> 13 s)."""
    out = flags_ + f" --xla_force_host_platform_device_count={devices}"
    if fast and "xla_backend_optimization_level" not in flags_:
        out += " --xla_backend_optimization_level=0"
    return out.strip()


def compile_data_size(lay: Layout) -> int:
    """The data-parallel size the layout is compiled at (see the module docstring)."""
    return min(lay.data, 2) if lay.zero_stage == 0 else lay.data


def key(lay: Layout, global_batch: int) -> tuple:
    """What fixes the per-device program: the layout at its compile data size without offload (which changes
    only where the state lives, `placed`), and the batch per replica."""
    return (dataclasses.replace(lay, data=compile_data_size(lay), offload="none"), global_batch // lay.batch_split)


def placed(compiled: dict, offload: str) -> dict:
    """A compile without offload, as the same layout with `offload`: the groups `train_state.OFFLOADED` names leave
    the device bytes (`peak`) for the host (`host`); XLA's own figure stays under `xla_peak`. On XLA:CPU this is
    what compiling with offload reports (`compile_report.placement`: one memory, the transfers dropped)."""
    host = sum(compiled["state_bytes"].get(g, 0) for g in OFFLOADED[offload])
    return {**compiled, "xla_peak": compiled["peak"], "peak": compiled["peak"] - host, "host": host}


class Compiler:
    """Compiles layouts of one config, caching by `key`. `devices`: the fake CPU devices present."""

    def __init__(self, config, vocab: int, devices):
        self.config, self.vocab, self.devices = config, vocab, list(devices)
        self.cache: dict = {}
        self.compiles = 0

    def can_compile(self, lay: Layout) -> bool:
        """Enough fake devices, and a program XLA:CPU compiles (`compiled.xla_cpu_aborts`: else the estimate)."""
        return (compile_data_size(lay) * lay.model_devices <= len(self.devices)
                and not xla_cpu_aborts(self.devices[0].platform, self.config.train.param_dtype, lay.zero_stage))

    def memory(self, lay: Layout, moe_impl: str | None = None) -> dict:
        """{"peak": device bytes, "host": pinned host bytes, "xla_peak", "temp", "argument", ..., "source":
        "compiled" | "derived (data 2)", "compile_s",
        "collectives_by_kind", "data_collectives" (`cost.data_collectives`)} of the layout's train step; `moe_impl`:
        the implementation `auto` runs on this layout (`cost.step_time`'s "moe_impl")."""
        B = int(self.config.train.global_batch_size)
        k = key(lay, B) + (moe_impl,)
        if k not in self.cache:
            dc = compile_data_size(lay)
            c = apply(self.config, k[0])
            with c.unlocked():
                c.train.global_batch_size = B // lay.data * dc
                c.xla.compile_cache = False
                c.model.moe_impl = moe_impl or c.model.moe_impl
            n = dc * lay.model_devices
            rep = report_for(c, self.vocab, self.devices[:n])
            self.compiles += 1
            mesh = {a: rep["layout"][a] for a in MESH_AXES}
            self.cache[k] = {**rep["memory"], "compile_s": rep["compile_s"], "state_bytes": rep["state_bytes"],
                             "collectives_by_kind": rep["collectives_by_kind"], "hlo_flops": rep["hlo_flops"]["total"],
                             "data_collectives": data_collectives(rep["collectives"], mesh)}
        out = placed(self.cache[k], lay.offload)
        out["source"] = "compiled" if compile_data_size(lay) == lay.data else "derived (data 2)"
        return out


def estimate(model: Model, lay: Layout) -> tuple[float, float]:
    """Analytic (device state, activation) bytes per device, to prune and order compiles (never shown as compiled).
    state: `Model.state_bytes` less what `optim.offload` keeps in host memory (`Model.host_bytes`);
    activations: stored layer inputs (with recompute) or Korthikanti et al.'s s·b·h·(34 + 5·a·s/h) bytes per layer
    (without), for the microbatches a stage holds, and one loss chunk's float32 logits and their gradient."""
    state = sum(model.state_bytes(lay).values()) - model.host_bytes(lay)
    P = model.params_per_device(lay)
    b, s, h, t = lay.micro_batch(model.global_batch), model.seq // lay.context, model.embed, lay.tensor
    per_layer = activation_bytes(model, lay)
    if not model.fused_attention and lay.remat == "none":
        per_layer *= 2.1  # jaxpar keeps every elementwise residual: 2.11-2.17x the formula (bench/activations.py)
    stored = s * b * h * model.compute_bytes
    L = model.layers / lay.stage
    full, _ = recompute_passes(lay)
    if lay.stage == 1:
        act = L * (stored if full else per_layer) + per_layer
    else:
        held = lay.microbatches if lay.schedule in ("gpipe", "circular") else lay.stage
        v = lay.virtual_stages
        act = held * v * (stored if lay.pipeline_remat else L / v * per_layer) + L * per_layer
    logits = b * min(s, 1024) * model.padded_vocab(t) / t * 4 * 2
    if lay.stage > 1 and lay.zero_stage >= 2:  # a pipeline gathers its stage's params and grads whole (README, limits)
        act += P * (4 + (model.param_bytes if lay.zero_stage == 3 else 0))
    return state, act + logits



class Generation:
    """An objective that samples on the training mesh (GRPO, on its paged KV cache): the round's generation bytes a
    device holds on a layout, {"kv_blocks", "kv_bytes" (the pool `--dry_run` prints, `cache.dry_run_entry`),
    "params_bytes" (the params in the decode layout: gathered over `stage`, and under ZeRO-3 over its group unless
    `grpo.gather_zero3` is off: "zero3_gathered"), "peak" (their sum: the engine's
    temporaries, a decode step's activations, are not counted), "position_bytes" (one position's keys and values,
    every layer, on a device), "kv_context" (each row's KV split over context, not the rows)}; None for an
    objective that does not sample. The pool depends on the mesh alone:
    computed once per mesh shape."""

    def __init__(self, config):
        self.config, self.pools = config, {}
        self.round = Round.from_config(config)  # the round's shape (None: the objective does not sample)

    def __call__(self, lay: Layout, model: Model) -> dict | None:
        mesh = (lay.data, lay.tensor, lay.stage, lay.expert, lay.context)
        if mesh not in self.pools:
            self.pools[mesh] = dry_run_entry(apply(self.config, lay), lay.data * lay.model_devices).get("paged")
        paged = self.pools[mesh]
        if paged is None:
            return None
        gathered = lay.zero_stage == 3 and bool(self.config.grpo.gather_zero3)  # (ZeRO-3 gathered for the round)
        params = model.state_bytes(dataclasses.replace(lay, zero_stage=0) if gathered else lay)["params"] * lay.stage
        return {"kv_blocks": paged["kv_blocks"], "kv_bytes": paged["per_device"], "params_bytes": params,
                "peak": params + paged["per_device"], "kv_context": paged["kv_context"], "zero3_gathered": gathered,
                "position_bytes": paged["per_device"] * paged["parts"] / (paged["kv_blocks"] * paged["block"])}
