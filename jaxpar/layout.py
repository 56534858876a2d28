"""The one description of a layout: how a step is spread over the devices and over time.

A `Layout` holds the mesh sizes, the pipeline schedule and its virtual stages, the microbatches, the ZeRO stage, host
offload, the recompute choices and sequence parallelism. It is read off a config once (`Layout.from_config`, `data = -1`
resolved against the devices present) and written back as config keys (`overrides`, `apply`). `validate` checks
it, the step is built from it, the compile report prints it and the planner enumerates it; a new axis (expert,
context) is one more field here. Imports nothing of jaxpar but the config defaults.
"""
from __future__ import annotations

import copy
import dataclasses

from jaxpar.config import MESH_AXES, _get, mesh_shape

# field -> config key: the one place a layout meets the config's key names
KEYS = {"data": "mesh.data", "tensor": "mesh.tensor", "stage": "mesh.stage", "expert": "mesh.expert",
        "context": "mesh.context",
        "microbatches": "train.microbatches",
        "schedule": "pipeline.schedule", "virtual_stages": "pipeline.virtual_stages", "zero_stage": "optim.zero_stage",
        "offload": "optim.offload",
        "remat": "model.remat", "pipeline_remat": "pipeline.remat", "sequence_parallel": "model.sequence_parallel"}


@dataclasses.dataclass(frozen=True)
class Layout:
    data: int
    tensor: int
    stage: int
    microbatches: int  # per step, per data replica (train.microbatches)
    schedule: str = "gpipe"  # pipeline.schedule (a name in `pipeline.SCHEDULES`)
    virtual_stages: int = 1  # as configured; the schedule decides whether it uses them
    zero_stage: int = 0
    remat: str = "none"  # model.remat
    pipeline_remat: bool = True  # pipeline.remat: recompute each stage's layers in the backward pass
    sequence_parallel: bool = False  # model.sequence_parallel
    expert: int = 1  # mesh.expert: the routed experts split over it; the batch over data x expert
    offload: str = "none"  # optim.offload: what lives in pinned host memory between steps
    context: int = 1  # mesh.context: every sequence split over it (context parallelism)

    @classmethod
    def from_config(cls, config, num_devices: int) -> "Layout":
        """The config's layout on `num_devices` devices (`mesh.data = -1`: the devices left over). Raises
        ConfigError when the mesh sizes do not fit the devices (the other keys are `validate`'s)."""
        shape = mesh_shape(config, num_devices)
        return cls(**shape, **{f: _get(config, k) for f, k in KEYS.items() if f not in shape})

    @property
    def mesh_shape(self) -> dict[str, int]:
        """The size of each mesh axis, in `MESH_AXES` order (`mesh.make_mesh`)."""
        return {a: getattr(self, a) for a in MESH_AXES}

    @property
    def model_devices(self) -> int:
        """Devices one data replica spans: tensor x stage x expert x context."""
        return self.tensor * self.stage * self.expert * self.context

    @property
    def batch_split(self) -> int:
        """Devices the batch is split over: data x expert (the data replicas of every non-expert parameter)."""
        return self.data * self.expert

    def micro_batch(self, global_batch: int) -> int:
        """Sequences per microbatch per batch shard: global batch / (data x expert x microbatches)."""
        return global_batch // (self.batch_split * self.microbatches)

    def overrides(self) -> dict:
        """The config keys (dotted) that train this layout."""
        return {k: getattr(self, f) for f, k in KEYS.items()}

    def flags(self) -> str:
        """`--config.KEY=VALUE ...` for train.py."""
        return " ".join(f"--config.{k}={v}" for k, v in self.overrides().items())

    def name(self) -> str:
        """Short form: (d, t, s) schedule[v] M zero remat SP."""
        v = self.virtual_stages
        sched = "" if self.stage == 1 else f" {self.schedule}" + (f" v{v}" if v > 1 else "")
        rem = self.remat if self.stage == 1 or not self.pipeline_remat else "stage"
        return (f"({self.data},{self.tensor},{self.stage}){sched} M{self.microbatches} z{self.zero_stage} {rem}"
                + (" SP" if self.sequence_parallel else "") + (f" E{self.expert}" if self.expert > 1 else "")
                + (f" C{self.context}" if self.context > 1 else "")
                + ("" if self.offload == "none" else f" off:{self.offload[:3]}"))

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def apply(config, layout: Layout):
    """A copy of `config` with `layout`'s keys set."""
    c = copy.deepcopy(config)
    set_layout(c, layout)
    return c


def set_layout(config, layout: Layout):
    """Set `layout`'s keys in `config` (in place)."""
    with config.unlocked():
        for key, v in layout.overrides().items():
            section, name = key.split(".")
            config[section][name] = v
