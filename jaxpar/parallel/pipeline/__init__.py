"""Pipeline parallelism over the mesh axis `stage`; knows nothing about models.

- `tables`: the schedules as tick tables (GPipe, circular, 1F1B, interleaved 1F1B, ZB-H1), pure numpy, and the
  chunk placement (stage-major layer order).
- `registry`: schedule name -> table builder, engine, virtual stages, validation.
- `autodiff`: the engine whose backward pass is autodiff of the forward tick loop (GPipe, circular).
- `loop`: the engine with the backward pass inside the tick loop (1F1B, ZB-H1).
"""
from jaxpar.parallel.pipeline.autodiff import AXIS, DATA, run
from jaxpar.parallel.pipeline.loop import run as run_loop
from jaxpar.parallel.pipeline.registry import NAMES, SCHEDULES, forward_table, table, virtual_stages
from jaxpar.parallel.pipeline.tables import (LANES, Schedule, circular, from_stage_major, gpipe, one_f_one_b, to_stage_major,
                                    zb_h1)

__all__ = ["AXIS", "DATA", "run", "run_loop", "NAMES", "SCHEDULES", "forward_table", "table", "virtual_stages",
           "LANES", "Schedule", "circular", "from_stage_major", "gpipe", "one_f_one_b", "to_stage_major", "zb_h1"]
