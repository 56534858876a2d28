"""A MoE model's train step against a dense model of the same active FLOPs, and its all-to-all bytes against the
formula; prints JSON (and writes it with --out).

    python bench/moe.py [--experts 8] [--top_k 2] [--expert_mlp 512] [--capacity_factor 1.25] [--steps 5]
    python bench/moe.py --lower cuda --out DIR     # no GPU needed: DIR/moe_lowered.json

`--lower cuda` lowers the train step of each `model.moe_impl` (buffers, ragged, and ragged with
`model.grouped_matmul=mosaic`, the row `ragged+mosaic`) at capacity factor 0 (dropless) and `--capacity_factor` for
CUDA (`jax.export`, one device, bf16, no recompute) and writes rows `{impl, capacity_factor, expert_flops,
active_expert_flops}`: the routed experts' matmul FLOPs counted from the StableHLO module
(`analysis.hlo_flops.stablehlo_flops`: the `experts` scope's dot_generals, and each `chlo.ragged_dot` grouped matmul
and Mosaic GPU grouped kernel from its operand shapes, every row of its left operand counted, the group sizes'
bound), against the active count 3 x 2 x tokens x k x 3 x embed x expert_mlp (forward and backward of the layer
body, which the module holds once). With a GPU present the timed rows compare buffers, ragged with XLA's grouped
matmul and, on Hopper, ragged with the Mosaic kernel; the `moe` row runs `model.moe_impl=auto` as the trainer
resolves it on these devices, its `auto` field the cost model's two prices (`jaxpar/plan/target.py`), to set beside
the timed rows.

Both models are llama blocks of width `--embed` over `--layers` layers; the MoE one routes each token to k of E SwiGLU
experts of width F (expert parallel over `mesh.expert` = min(devices, E), the batch over data x expert), the dense
one has one SwiGLU MLP of width k x F: the same matmul FLOPs per token but the router's. On the devices present
(8 fake CPU devices: XLA_FLAGS=--xla_force_host_platform_device_count=8; on a GPU server its GPUs).

All-to-all bytes per step, per device, from the compiled HLO (`jaxpar.analysis.hlo`) against the formula: each MoE layer
sends its dispatch buffer `[sequences per device, E, C, embed]` out and its outputs back (2 all-to-alls forward), the
backward pass sends both cotangents (2 more), and full recompute repeats the forward's 2: per microbatch and MoE
layer 4 (6 with recompute) x micro_batch x E x C x embed x bytes of the compute dtype, C the per-sequence capacity
(`moe.capacity`).
"""
import json
import os
import sys

import jax
from absl import app, flags, logging

from jaxpar.kernels import grouped
from jaxpar.model import moe
from jaxpar.analysis.hlo_flops import stablehlo_flops
from jaxpar.compiled import abstract_batch, report_for, steps_for
from jaxpar.model.moe_dispatch import SCOPE
from jaxpar.config import base_config
from jaxpar.layout import Layout
from jaxpar.model import config_from, flops_per_token
from jaxpar.plan import target
from jaxpar.plan.measure import time_step
from jaxpar.validate import validate

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import write_results  # noqa: E402

_E = flags.DEFINE_integer("experts", 8, "routed experts")
_K = flags.DEFINE_integer("top_k", 2, "experts per token")
_F = flags.DEFINE_integer("expert_mlp", 512, "each expert's SwiGLU width")
_CF = flags.DEFINE_float("capacity_factor", 1.25, "capacity factor (0: dropless)")
_D = flags.DEFINE_integer("embed", 256, "model width")
_L = flags.DEFINE_integer("layers", 4, "layers")
_T = flags.DEFINE_integer("seq_len", 256, "sequence length")
_B = flags.DEFINE_integer("batch", 16, "global batch (sequences)")
_DTYPE = flags.DEFINE_string("dtype", "float32", "compute dtype (bfloat16 on GPU)")
_STEPS = flags.DEFINE_integer("steps", 5, "timed steps")
_OUT = flags.DEFINE_string("out", "", "directory for moe.json / moe.md (moe_lowered.json with --lower)")
_LOWER = flags.DEFINE_string("lower", "", "`cuda`: lower for CUDA and count the expert FLOPs instead of timing")
VOCAB = 256


def model_config(moe_layer: bool, impl: str = "auto", kernel: str = "auto"):
    c = base_config()
    n = jax.device_count()
    e = min(n, _E.value) if moe_layer else 1
    c.mesh.update(data=n // e, expert=e)
    c.model.update(arch="llama", embed=_D.value, layers=_L.value, heads=max(1, _D.value // 64), seq_len=_T.value,
                   vocab_size=VOCAB, remat="full", mlp=_K.value * _F.value)
    if moe_layer:
        c.model.update(experts=_E.value, experts_per_token=_K.value, expert_mlp=_F.value,
                       capacity_factor=_CF.value, aux_loss=0.01, moe_impl=impl, grouped_matmul=kernel)
    c.train.update(global_batch_size=_B.value, microbatches=1, compute_dtype=_DTYPE.value)
    c.log.progress = False
    return c


def all_to_all_formula(config) -> float:
    """Bytes per device per step the MoE layers' all-to-alls move (see the module docstring)."""
    lay = Layout.from_config(config, jax.device_count())
    cfg = config_from(config, VOCAB, lay.tensor)
    per_device = lay.micro_batch(int(config.train.global_batch_size))
    cap = moe.capacity(cfg, cfg.seq_len)
    buf = per_device * cfg.experts * cap * cfg.embed * jax.numpy.dtype(cfg.compute_dtype).itemsize
    n_moe = sum(bool(moe.is_moe_layer(cfg, i)) for i in range(cfg.layers))
    return buf * n_moe * lay.microbatches * (6 if cfg.remat == "full" else 4)


def one(moe_layer: bool, impl: str = "auto", kernel: str = "auto") -> dict:
    config = model_config(moe_layer, impl, kernel)
    devices = jax.devices()  # `auto` as the trainer resolves it here: the cost model's cheaper on these devices
    config, chosen = target.resolve(config, VOCAB, validate(config, len(devices)), devices)
    got = time_step(config, VOCAB, steps=_STEPS.value)
    cfg = got["steps"].cfg
    fpt = flops_per_token(cfg)
    kind = moe.implementation(cfg) + (f" {kernel}" if moe.implementation(cfg) == "ragged" else "")
    row = {"kind": f"moe {kind}" if moe_layer else "dense", "mesh": got["mesh"],
           "step_s": got["step_s"],
           "model_flops_per_token": fpt, "tokens_per_s": _B.value * _T.value / got["step_s"],
           "peak_bytes": got["memory"].get("peak"), **({"auto": chosen} if chosen else {})}
    if moe_layer and config.mesh.expert > 1 and moe.implementation(got["steps"].cfg) == "buffers":  # the formula's
        rep = report_for(config, VOCAB)
        row["all_to_all_bytes"] = rep["collectives_by_kind"].get("all-to-all", {}).get("bytes", 0)
        row["all_to_all_formula"] = all_to_all_formula(config)
    return row


def lowered_row(impl: str, capacity_factor: float, platform: str) -> dict:
    """The expert FLOPs of the train step lowered for `platform` on one device (see the module docstring)."""
    moe_impl, _, kernel = impl.partition("+")
    config = model_config(True, moe_impl, kernel or "xla")
    config.mesh.update(data=1, expert=1)
    config.model.update(capacity_factor=capacity_factor, remat="none")
    config.train.update(compute_dtype="bfloat16", global_batch_size=max(1, _B.value // jax.device_count()))
    steps = steps_for(config, VOCAB, jax.devices()[:1])
    unstable = [jax.export.DisabledSafetyCheck.custom_call("mosaic_gpu_v2")]  # the kernel's custom call
    with grouped.lowering_for(platform):
        text = jax.export.export(steps.train, platforms=[platform], disabled_checks=unstable)(
            steps.abstract_state(), abstract_batch(config, steps)).mlir_module()
    tokens = int(config.train.global_batch_size) * _T.value
    return {"impl": impl, "capacity_factor": capacity_factor, "expert_flops": stablehlo_flops(text, SCOPE)["total"],
            "active_expert_flops": 3 * 2 * tokens * _K.value * 3 * _D.value * _F.value}


def lower(platform: str) -> None:
    rows = [lowered_row(impl, cf, platform) for cf in (0.0, _CF.value) for impl in ("buffers", "ragged",
                                                                                  "ragged+mosaic")]
    for r in rows:
        r["over_active"] = r["expert_flops"] / r["active_expert_flops"]
    print(json.dumps(rows, indent=1))
    table = "| impl | capacity factor | expert FLOPs | active | ratio |\n|---|---|---|---|---|\n" + "\n".join(
        f"| {r['impl']} | {r['capacity_factor']} | {r['expert_flops']:.3g} | {r['active_expert_flops']:.3g} | "
        f"{r['over_active']:.2f} |" for r in rows)
    write_results(_OUT.value, "moe_lowered", rows, table)


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    if _LOWER.value:
        return lower(_LOWER.value)
    rows = [one(False), one(True)]
    if jax.default_backend() == "gpu":  # the implementations timed
        rows += [one(True, "buffers"), one(True, "ragged", "xla")]
        if grouped.hopper() and _DTYPE.value in ("bfloat16", "float16"):
            rows.append(one(True, "ragged", "mosaic"))
    out = {"devices": jax.device_count(), "device_kind": jax.devices()[0].device_kind, "experts": _E.value,
           "top_k": _K.value, "expert_mlp": _F.value, "capacity_factor": _CF.value, "rows": rows,
           "moe_over_dense_step": rows[1]["step_s"] / rows[0]["step_s"]}
    print(json.dumps(out, indent=1))
    table = "| kind | mesh | step s | tokens/s | all-to-all bytes (HLO / formula) |\n|---|---|---|---|---|\n" + \
        "\n".join(
        f"| {r['kind']} | {r['mesh']} | {r['step_s']:.4f} | {r['tokens_per_s']:.0f} | "
        f"{r.get('all_to_all_bytes', '-')} / {r.get('all_to_all_formula', '-')} |" for r in rows)
    write_results(_OUT.value, "moe", [out], table)


if __name__ == "__main__":
    app.run(main)
