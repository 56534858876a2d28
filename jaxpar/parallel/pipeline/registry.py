"""Schedule name -> (tick-table builder, engine, virtual stages, validation): the one list of pipeline schedules,
read by config validation, the train step and the benches."""
from __future__ import annotations

import dataclasses
from typing import Callable

from jaxpar.config import nearest_multiples
from jaxpar.parallel.pipeline import tables


@dataclasses.dataclass(frozen=True)
class ScheduleSpec:
    table: Callable  # (stages, microbatches, virtual) -> tables.Schedule
    engine: str  # "autodiff": backward pass by autodiff of the forward loop; "loop": backward inside the loop
    virtual: bool  # takes pipeline.virtual_stages (interleaved / circular); else runs with v = 1
    check: Callable  # (stages, microbatches, virtual, remat) -> config errors (strings); called with stages > 1


def _no_checks(S, M, v, remat):
    return []


def _check_1f1b(S, M, v, remat):


    if v > 1 and M % S:
        return [f"train.microbatches={M} is not a multiple of mesh.stage={S}, which interleaved 1F1B "
                f"(virtual_stages={v}) needs (Megatron-LM's rule); use {nearest_multiples(M, S)}."]
    return []


def _check_zb_h1(S, M, v, remat):
    errs = []
    if v > 1:
        errs.append(f"pipeline.virtual_stages={v} with pipeline.schedule='zb_h1': the zero-bubble schedule has no "
                    f"interleaved form here; set --config.pipeline.virtual_stages=1 or use '1f1b' (interleaved).")
    return errs


SCHEDULES = {
    "gpipe": ScheduleSpec(lambda S, M, v: tables.gpipe(S, M), "autodiff", False, _no_checks),
    "circular": ScheduleSpec(lambda S, M, v: tables.circular(S, v, M), "autodiff", True, _no_checks),
    "1f1b": ScheduleSpec(lambda S, M, v: tables.one_f_one_b(S, M, v), "loop", True, _check_1f1b),
    "zb_h1": ScheduleSpec(lambda S, M, v: tables.zb_h1(S, M), "loop", False, _check_zb_h1),
}
NAMES = tuple(SCHEDULES)
# recomputing the stage forward in B is how the split (ZB-H1) engine gets its per-layer inputs
NEEDS_REMAT = ("zb_h1",)


def errors(name: str, stages: int, microbatches: int, virtual: int, remat: bool) -> list[str]:
    """Config errors of `pipeline.schedule` = name with this layout (empty when it can run)."""
    if name not in SCHEDULES:
        return [f"pipeline.schedule={name!r}: pick one of {NAMES}."]
    errs = SCHEDULES[name].check(stages, microbatches, virtual, remat) if stages > 1 else []
    if name in NEEDS_REMAT and not remat:
        errs.append(f"pipeline.remat=False (keep the vjp residuals) is implemented for 1f1b only; {name} recomputes "
                    f"its stage forward: set --config.pipeline.remat=True.")
    return errs


def virtual_stages(name: str, stages: int, virtual: int) -> int:
    """The virtual stages (chunks per stage) the schedule runs with: `virtual` where it takes them, else 1."""
    return int(virtual) if stages > 1 and SCHEDULES[name].virtual else 1


def table(name: str, stages: int, microbatches: int, virtual: int = 1) -> tables.Schedule:
    return SCHEDULES[name].table(stages, microbatches, virtual_stages(name, stages, virtual))


def forward_table(name: str, stages: int, microbatches: int, virtual: int = 1) -> tables.Schedule:
    """The forward-only table for evaluating under schedule `name`: its own for the autodiff engine; circular with
    the same chunks (the same stage-major layer order) for a loop schedule."""
    if SCHEDULES[name].engine == "autodiff":
        return table(name, stages, microbatches, virtual)
    return tables.circular(stages, virtual_stages(name, stages, virtual), microbatches)


