"""Train a GPT: `python train.py --config configs/NAME.py [--workdir DIR] [--config.KEY=VALUE ...]`.

Rerunning the same command resumes from the latest checkpoint in WORKDIR (default: runs/<config file name>).
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


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO
    from jaxpar import trainer
    from jaxpar.config import ConfigError
    from jaxpar.data import DataError

    config = _CONFIG.value
    workdir = _WORKDIR.value or os.path.join("runs", os.path.splitext(os.path.basename(flags.FLAGS["config"].config_filename))[0])
    try:
        (trainer.dry_run if _DRY_RUN.value else trainer.run)(config, workdir)
    except (ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except trainer.Preempted as e:
        print(f"jaxpar: {e}", file=sys.stderr)
        sys.exit(trainer.PREEMPTED_EXIT_CODE)


if __name__ == "__main__":
    flags.mark_flag_as_required("config")
    app.run(main)
