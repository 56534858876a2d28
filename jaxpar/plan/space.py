"""The layouts to rank: every (data, tensor, stage, expert, schedule, virtual stages, microbatches, ZeRO stage,
host offload, recompute, sequence parallelism, context) that `validate.validate` accepts for the config's model and global batch on
`gpus` devices. Expert sizes divide the model's experts, and expert x context x tensor stays within a node (the
all-to-all, the K/V all-gathers)."""
from __future__ import annotations

import copy
import dataclasses
import itertools

from jaxpar.config import OFFLOAD, ConfigError
from jaxpar.layout import Layout, apply, set_layout  # noqa: F401 (apply, set_layout: the planner's callers use them)
from jaxpar.validate import validate


SEARCHED_REMAT = ("none", "selective", "full")  # the recompute policies the cost model prices (of REMAT_POLICIES)


@dataclasses.dataclass(frozen=True)
class Space:
    """What the enumeration may choose; None = every value that can run. Tuples restrict (the CLI's --tensor etc.)."""
    tensor: tuple | None = None
    stage: tuple | None = None
    expert: tuple | None = None  # None: every size dividing the model's experts (1 for a dense model)
    context: tuple | None = None  # None: every size c with 2c dividing seq_len (1 for a MoE model)
    schedule: tuple | None = None
    zero: tuple | None = (0, 1, 2, 3)
    offload: tuple | None = OFFLOAD  # optim.offload modes
    remat: tuple | None = SEARCHED_REMAT
    sp: tuple | None = (False, True)
    max_micro_batch: int = 16
    max_virtual: int = 8
    gpus_per_node: int = 8  # tensor stays within a node (`mesh.node_order`): sizes dividing it


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _recompute(stage: int, schedule: str, space: Space):
    """(model.remat, pipeline.remat) pairs: one stage: model.remat; pipelines: the stage recompute
    (pipeline.remat=True, model.remat none), or with pipeline.remat=False (1f1b only) model.remat."""
    remats = space.remat or SEARCHED_REMAT
    if stage == 1:
        return [(r, True) for r in remats]
    pairs = [("none", True)]
    if schedule == "1f1b":
        pairs += [(r, False) for r in remats]
    return pairs


def _schedules(stage: int, layers: int, space: Space):
    """(schedule, virtual stages) pairs for `stage` stages."""
    if stage == 1:
        return [("gpipe", 1)]
    names = space.schedule or ("gpipe", "1f1b", "zb_h1", "circular")
    out = []
    for name in names:
        vs = [v for v in divisors(layers // stage) if 1 < v <= space.max_virtual] if name in ("circular", "1f1b") \
            else []
        out += ([(name, 1)] if name != "circular" else []) + [(name, v) for v in vs]
    return out


def candidates(config, gpus: int, space: Space = Space()):
    """Every `Layout` of `space` that `validate(config, gpus)` accepts, with tensor within a node."""
    work = copy.deepcopy(config)
    for layout in _grid(config, gpus, space):
        set_layout(work, layout)
        try:
            validate(work, gpus)
        except ConfigError:
            continue
        yield layout


def _grid(config, gpus: int, space: Space):
    """Every combination before validation (products of the mesh sizes equal to gpus)."""
    L, B, E = int(config.model.layers), int(config.train.global_batch_size), int(config.model.experts)
    T = int(config.model.seq_len)
    node = min(space.gpus_per_node, gpus)
    tensors = [t for t in space.tensor or [t for t in divisors(gpus) if t & (t - 1) == 0 and t <= 8]
               if node % t == 0]
    for t, s in ((t, s) for t in tensors for s in space.stage or divisors(gpus // t if gpus % t == 0 else 1)):
        if gpus % (t * s) or L % s:
            continue
        for e in space.expert or [e for e in divisors(gpus // (t * s)) if (E % e == 0 if E else e == 1)]:
            if gpus % (t * s * e) or node % (t * e):
                continue
            for c in space.context or [c for c in divisors(gpus // (t * s * e)) if c == 1 or (not E and T % (2 * c) == 0)]:
                if gpus % (t * s * e * c) or node % (t * e * c):
                    continue
                d = gpus // (t * s * e * c)
                if B % (d * e):
                    continue
                per_replica = B // (d * e)
                for M in divisors(per_replica):
                    if per_replica // M > space.max_micro_batch or (s > 1 and M < s):
                        continue
                    yield from _rest(d, t, s, e, c, M, L, space)


def _rest(d, t, s, e, c, M, L, space: Space):
    """The layouts of one mesh and microbatch count: schedules, ZeRO stages, SP, offload, recompute."""
    for (sched, v), zero, sp, off in itertools.product(_schedules(s, L, space), space.zero or (0,),
                                                       space.sp if t > 1 else (False,), space.offload or ("none",)):
        for remat, premat in _recompute(s, sched, space):
            yield Layout(d, t, s, M, sched, v, zero, remat, premat, sp, e, off, c)
