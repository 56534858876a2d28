"""Train a GPT: `python train.py --config configs/NAME.py [--workdir DIR] [--config.KEY=VALUE ...]`.

Rerunning the same command resumes from the latest checkpoint in WORKDIR (default: runs/<config file name>).
Several processes (hosts): under `srun` nothing to add; elsewhere --coordinator, --num_processes, --process_id (or
JAXPAR_* variables, see jaxpar/cluster/distributed.py); on one machine: `python -m jaxpar.launch --num_processes N -- train.py`.

Guides: docs/getting-started.md, docs/layouts.md (--dry_run), docs/multihost.md; every key: docs/config.md.
"""
import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "ml_collections config file (configs/*.py).")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Compile the step for the layout, write WORKDIR/compile_report.json "
                                                "(memory, FLOPs, collectives) and exit without training.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (checkpoints, metrics, config). "
                                                "Default: runs/<config file name>.")
_COORDINATOR = flags.DEFINE_string("coordinator", None, "host:port of process 0 (multi-process runs outside SLURM).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Number of processes (multi-process runs).")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index, 0 .. num_processes - 1.")


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO
    from jaxpar.cluster import distributed, runtime
    from jaxpar.config import ConfigError

    config = _CONFIG.value
    try:  # before anything touches a device
        plan = distributed.resolve(os.environ, _COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
        distributed.initialize(plan, config.dist.heartbeat_timeout_s, config.dist.init_timeout_s)
    except distributed.DistributedError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    try:  # compile cache, GPU flags: before the backend starts; an error ends every process at once
        said = runtime.describe(runtime.configure(config))
    except ConfigError as e:
        distributed.stop_all(2, f"error: {e}")
    if said and plan.process_id == 0:
        print(f"jaxpar: {said}", file=sys.stderr)
    train(config)


def train(config):
    from jaxpar import trainer
    from jaxpar.cluster import distributed
    from jaxpar.config import ConfigError
    from jaxpar.data import DataError
    from jaxpar.cluster.preemption import PREEMPTED_EXIT_CODE, Preempted
    from jaxpar.state.checkpoint import CheckpointSaveError

    workdir = _WORKDIR.value or os.path.join("runs", os.path.splitext(os.path.basename(flags.FLAGS["config"].config_filename))[0])
    try:
        (trainer.dry_run if _DRY_RUN.value else trainer.run)(config, workdir)
    except (ConfigError, DataError) as e:
        distributed.stop_all(2, f"error: {e}")
    except CheckpointSaveError as e:  # a full disk, a lost mount: the message says what to do, no traceback
        distributed.await_lost_peer(e)  # or a peer that failed while this process saved: its verdict first
        distributed.stop_all(1, f"error: {e}")
    except Preempted as e:
        print(f"jaxpar: {e}", file=sys.stderr)
        sys.exit(PREEMPTED_EXIT_CODE)
    except Exception as e:  # several processes: traceback, then the others exit with its message (never a hang)
        distributed.fail_all(e)
        raise


if __name__ == "__main__":
    from jaxpar.config import ConfigError, check_command_line  # defaults only: no backend starts

    try:
        check_command_line(sys.argv[1:])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    flags.mark_flag_as_required("config")
    app.run(main)
