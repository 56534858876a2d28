"""What a config's `auto` becomes on the hardware its run is for, once, before anything compiles, the same on every
host: `model.moe_impl=auto` becomes the implementation the cost model prices cheaper (`cost.moe_prices`) for this
model, this layout and a server of the target's devices.

The target is `mesh.device` when set (a device of `hardware.DEVICES`: a CPU host compiling what H100s would run,
`--dry_run --config.mesh.device=h100`), else the devices present, by their `device_kind` (`hardware.device_named`).
The priced cluster is the layout's devices, 8 to a server (`per_server`), with the planner's default links
(`hardware.cluster`): the MoE all-to-all stays within a server, so the links between servers price both
implementations alike. CPU devices with no `mesh.device` run `buffers`: XLA:CPU computes a ragged dot as a dense
matmul over every expert, so `ragged` costs at least what `buffers` does there.

The trainer (`trainer.run`, `--dry_run` through `compiled.report_for`'s `resolve`), the planner (per layout, with
`cost.step_time`'s same prices) and `bench/moe.py` resolve; a step built from a config still saying `auto` (tests,
decoding) runs `buffers` (`model.moe.implementation`).
"""
from __future__ import annotations

import copy
import math

from jaxpar.config import ConfigError
from jaxpar.layout import Layout
from jaxpar.plan import cost, hardware
from jaxpar.validate import check_experts, check_grouped

PRESENT = "the devices present"


def target(config, devices) -> tuple[str, str]:
    """(the device a run is for: a name of `hardware.DEVICES`, or "cpu"; where that came from). ConfigError for a
    `mesh.device` the table lacks; for devices present that it lacks, None as the name."""
    named = config.mesh.device
    if named:
        if named not in hardware.DEVICES:
            raise ConfigError(f"mesh.device={named!r} is not a device jaxpar/plan/hardware.py prices; pick one of "
                              f"{sorted(hardware.DEVICES)}, or '' for the devices present.")
        return named, "mesh.device"
    first = devices[0]
    if first.platform == "cpu":
        return "cpu", PRESENT
    return hardware.device_named(first.device_kind), PRESENT


def auto_moe(config) -> bool:
    """Whether the config is a MoE model whose `model.moe_impl` is `auto`."""
    return bool(config.model.experts) and config.model.moe_impl == "auto"


def check(config, devices) -> None:
    """What `resolve` refuses whatever the vocabulary, so the trainer can say it before preparing the data: a
    `mesh.device` the table lacks; devices it lacks, when a MoE model's `auto` is to be priced for them."""
    if not (config.mesh.device or auto_moe(config)):
        return
    device, _ = target(config, devices)
    if device is None and auto_moe(config):
        raise ConfigError(f"model.moe_impl='auto' runs what the cost model prices cheaper on these devices, but "
                          f"jaxpar/plan/hardware.py does not know {devices[0].device_kind!r}; set "
                          f"--config.mesh.device to the nearest of {sorted(hardware.DEVICES)}, or model.moe_impl to "
                          f"'buffers' or 'ragged'.")


def choose_moe(config, vocab: int, layout: Layout, devices) -> dict:
    """{"model.moe_impl": what `auto` runs, "device", "source", "prices": {impl: step seconds} (none on CPU),
    "why": one line} for a MoE config on `devices` (`validate`'s layout) that passes `check`."""
    device, source = target(config, devices)
    n = layout.data * layout.model_devices
    if device == "cpu":
        why = (f"model.moe_impl=auto runs buffers on CPU devices (XLA:CPU computes ragged's grouped matmuls over "
               f"every expert); --config.mesh.device=h100 (say) compiles what those GPUs would run")
        return {"model.moe_impl": "buffers", "device": "cpu", "source": source, "prices": {}, "why": why}
    cluster = hardware.cluster(device, n, per_server(n))
    prices = cost.moe_prices(cost.Model.from_config(config, vocab), layout, cluster)
    impl = min(prices, key=prices.get)  # a tie: buffers (as `cost.step_time`)
    return {"model.moe_impl": impl, "device": device, "source": source, "prices": prices,
            "why": explain(prices, f"{n} x {device} ({source})")}


def per_server(devices: int) -> int:
    """Devices per server of the priced cluster: all of them up to 8, else 8, or the largest power of 2 dividing
    them when 8 does not (12 GPUs: 3 servers of 4): a function of the count alone, so every host prices alike."""
    return devices if devices <= 8 else math.gcd(devices, 8)


def explain(prices: dict, where: str) -> str:
    """One line: what `auto` runs `where`, and the two priced step times that decided it."""
    impl = min(prices, key=prices.get)
    other = next(k for k in prices if k != impl)
    return (f"model.moe_impl=auto runs {impl} on {where}: the cost model prices {impl} at {prices[impl]:.3g} s/step "
            f"against {other} at {prices[other]:.3g} s (jaxpar/plan/cost.py)")


def resolve(config, vocab: int, layout: Layout, devices) -> tuple[object, dict | None]:
    """(`config` with its `auto` choices made for its target, what was chosen and why, or None when nothing was
    `auto`). `check`'s refusals first; then `validate`'s MoE rules on the resolved keys (a rule the choice breaks
    is a ConfigError line naming the choice and its prices)."""
    check(config, devices)
    if not auto_moe(config):
        return config, None
    chosen = choose_moe(config, vocab, layout, devices)
    out = copy.deepcopy(config)
    out.model.moe_impl = chosen["model.moe_impl"]
    broken = check_experts(out.model, layout) + check_grouped(out.model, out.train.compute_dtype)
    if broken:  # `validate`'s MoE rules on the choice, each after what chose it
        raise ConfigError("\n".join(f"{chosen['why']}; then: {r}" for r in broken))
    return out, chosen
