"""`python -m jaxpar.plan --config C --gpus N [--device a100-80g] ...`: ranked layouts for a model on a cluster.

Prints the table (predicted tokens/s, TFLOP/s per GPU and MFU by PaLM's model FLOPs, memory per device and where it
comes from, fits, why it loses) and the `--config.*` flags that train the best; `--json PATH` writes the candidates
best first; `--measure` runs the best layout's step on the devices present and prints predicted vs measured.

Guide: docs/planning.md.
"""
import json
import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "ml_collections config file (configs/*.py).")
_GPUS = flags.DEFINE_integer("gpus", None, "Devices in the job.")
_PER_NODE = flags.DEFINE_integer("gpus_per_node", 8, "Devices per server.")
_DEVICE = flags.DEFINE_string("device", "a100-80g", "a100-80g | a100-80g-pcie | h100 | h200 (jaxpar/plan/hardware.py).")
_INTER = flags.DEFINE_string("interconnect", "ib-hdr", "Link between servers: ib-hdr | ib-ndr | ethernet-100g.")
_NICS = flags.DEFINE_integer("nics_per_node", 0, "Network cards per server (0: one per device).")
_INTRA = flags.DEFINE_string("intra_node", "", "Link within a server (default: the device's: nvlink3/4, pcie4).")
_TENSOR = flags.DEFINE_list("tensor", None, "Tensor sizes to consider (default: powers of 2 up to 8).")
_STAGE = flags.DEFINE_list("stage", None, "Pipeline stages to consider (default: every divisor).")
_CONTEXT = flags.DEFINE_list("context", None, "Context-parallel sizes (default: every size whose 2 x size divides "
                             "seq_len, within a node with tensor and expert).")
_EXPERT = flags.DEFINE_list("expert", None, "Expert-parallel sizes (default: every size dividing model.experts).")
_SCHEDULE = flags.DEFINE_list("schedule", None, "Schedules (default: gpipe, 1f1b, zb_h1, circular).")
_ZERO = flags.DEFINE_list("zero", ["0", "1", "2", "3"], "ZeRO stages to consider.")
_OFFLOAD = flags.DEFINE_list("offload", None, "optim.offload modes to consider (default: none, optimizer, params).")
_REMAT = flags.DEFINE_list("remat", None, "model.remat values to consider (default: those the cost model prices, "
                           "plan.space.SEARCHED_REMAT).")
_SP = flags.DEFINE_list("sp", ["False", "True"], "model.sequence_parallel values to consider.")
_MAX_MB = flags.DEFINE_integer("max_micro_batch", 16, "Largest microbatch (sequences per data replica).")
_TOP = flags.DEFINE_integer("top", 10, "Rows to show; also how many fitting layouts get compiled memory.")
_COMPILE = flags.DEFINE_bool("compile", True, "Compile the best layouts for their memory (fake CPU devices).")
_MEM = flags.DEFINE_float("mem_fraction", 0.9, "Fraction of device memory a layout may use.")
_JSON = flags.DEFINE_string("json", None, "Write the candidates (best first) as JSON here.")
_MEASURE = flags.DEFINE_bool("measure", False, "Run the best layout's step on the devices present.")


def _space():
    """The search space from the flags; ValueError naming the flag when a value cannot be searched."""
    from jaxpar.config import OFFLOAD, REMAT_POLICIES
    from jaxpar.parallel.pipeline.registry import NAMES
    from jaxpar.plan.space import Space

    def ints(flag, lo, allowed=None):
        if not flag.value:
            return None
        try:
            vals = tuple(int(x) for x in flag.value)
        except ValueError:
            raise ValueError(f"--{flag.name}={','.join(flag.value)}: give integers") from None
        bad = [v for v in vals if v < lo or (allowed is not None and v not in allowed)]
        if bad:
            raise ValueError(f"--{flag.name}: {bad} cannot be searched (allowed: {allowed or f'integers >= {lo}'})")
        return vals

    def names(flag, allowed):
        bad = [v for v in flag.value or () if v not in allowed]
        if bad:
            raise ValueError(f"--{flag.name}: {bad} unknown; pick from {allowed}")
        return tuple(flag.value) if flag.value else None

    sp = names(_SP, ("False", "True", "false", "true"))
    if _MAX_MB.value < 1 or _TOP.value < 1:
        raise ValueError(f"--max_micro_batch={_MAX_MB.value}, --top={_TOP.value}: both must be >= 1")
    return Space(tensor=ints(_TENSOR, 1), stage=ints(_STAGE, 1), expert=ints(_EXPERT, 1), context=ints(_CONTEXT, 1),
                 schedule=names(_SCHEDULE, NAMES),
                 zero=ints(_ZERO, 0, (0, 1, 2, 3)), remat=names(_REMAT, REMAT_POLICIES),
                 offload=names(_OFFLOAD, OFFLOAD) or OFFLOAD,
                 sp=tuple(v.lower() == "true" for v in sp) if sp else (False, True), max_micro_batch=_MAX_MB.value)


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    from jaxpar.plan import memory  # imports jax, but no backend starts before the device count is set here
    if _COMPILE.value or _MEASURE.value:  # fake CPU devices to compile on
        os.environ["XLA_FLAGS"] = memory.compile_flags(os.environ.get("XLA_FLAGS", ""), _GPUS.value, not _MEASURE.value)
    import jax

    from jaxpar import plan as planner
    from jaxpar.plan import hardware, table, target

    try:
        cl = hardware.cluster(_DEVICE.value, _GPUS.value, _PER_NODE.value, _INTER.value, _NICS.value, _INTRA.value)
        space = _space()
    except ValueError as e:
        sys.exit(f"error: {e}")
    config = _CONFIG.value
    devices = jax.devices("cpu") if _COMPILE.value else None
    p = planner.plan(config, cl, space, compile_top=_TOP.value, devices=devices, mem_fraction=_MEM.value)
    if _JSON.value:  # written even when empty, so a script always finds the file
        best = p.ranked[0] if p.ranked else None
        with open(_JSON.value, "w") as f:
            json.dump([dict(planner.summary(p, c), why=table.why(p, c, best)) for c in p.ranked], f, indent=1)
    pinned = [f"--{n}={v}" for n, vals in (("tensor", space.tensor), ("stage", space.stage)) for v in vals or ()
              if cl.gpus % v]
    if not p.ranked and pinned:
        sys.exit(f"error: {', '.join(pinned)} does not divide the {cl.gpus} devices; pick divisors of {cl.gpus}.")
    if not p.ranked:
        sys.exit(f"error: no layout of {config.name} on {cl.gpus} devices in the searched space passes validate "
                 f"(global batch {config.train.global_batch_size}, heads {config.model.heads}, layers "
                 f"{config.model.layers}); `python train.py --config ... --dry_run` with a layout names the rule.")
    print(table.format_table(p, table.rows(p, _TOP.value)))
    best = p.ranked[0]
    if best.fits(p.capacity) is False:
        sys.exit(f"\nerror: no layout fits in {p.capacity / 2 ** 30:.1f} GiB per device; more devices, ZeRO, host "
                 f"offload (--offload), recompute or a smaller micro batch (--max_micro_batch) may.")
    print(f"\ntrain the best layout with:\n  python train.py --config {flags.FLAGS['config'].config_filename} "
          f"{best.layout.flags()}" + ("" if best.memory else "\n(its memory is an estimate: not compiled)"))
    if "moe_impl" in best.time:  # model.moe_impl=auto: what it runs on the best layout, and why
        print(target.explain(best.time["moe_prices"], f"this layout on {cl.gpus} x {cl.device.name} (--device)"))
    if _JSON.value:
        print(f"written to {_JSON.value}")
    if _MEASURE.value:
        _measure(config, p, best)


def _measure(config, p, best):
    import jax

    from jaxpar.plan.measure import time_step

    n = best.layout.data * best.layout.model_devices
    if n > len(jax.devices()):
        sys.exit(f"--measure: the best layout needs {n} devices, {len(jax.devices())} are present.")
    got = time_step(best.config(config), p.model.vocab, devices=jax.devices()[:n])
    print(json.dumps({"layout": best.layout.name(), "predicted_for": p.cluster.device.name,
                      "measured_on": got["device_kind"],
                      "predicted_step_s": best.time["step_s"], "measured_step_s": got["step_s"],
                      "ratio": got["step_s"] / best.time["step_s"], "loss": got["loss"],
                      "measured_peak_gib": got["memory"].get("peak", 0) / 2 ** 30}, indent=1))


if __name__ == "__main__":
    from jaxpar.config import ConfigError, check_command_line  # defaults only: no backend starts

    try:
        check_command_line(sys.argv[1:])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    flags.mark_flags_as_required(["config", "gpus"])
    app.run(main)
