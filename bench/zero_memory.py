"""Per-device bytes and collectives of the compiled step for ZeRO stages 0-3, next to the ZeRO paper's formulas.

    python bench/zero_memory.py --config configs/shakespeare.py --config.mesh.data=8 \
        --config.model.embed=384 --config.model.heads=6 --config.model.mlp=1536 --config.model.layers=6 \
        --config.train.microbatches=4 [--markdown]

Runs `train.py --dry_run`'s compile report (no training) once per stage and prints JSON (or a markdown table).
Formulas (Rajbhandari et al. 2020, sec. 5.1, Adam with K = 12 optimizer bytes per parameter, mixed precision):
16Ψ; 4Ψ + 12Ψ/N; 2Ψ + 14Ψ/N; 16Ψ/N. jaxpar keeps float32 params and grads (4 + 4 bytes) and Adam's two float32
moments (8 bytes): also 16 bytes per parameter, split 8Ψ + 8Ψ/N; 4Ψ + 12Ψ/N; 16Ψ/N at stages 1, 2, 3.
"""
import json
import os
import tempfile

from absl import app, flags, logging
from ml_collections import config_flags

from jaxpar.trainer import dry_run

_CONFIG = config_flags.DEFINE_config_file("config", None, "config file")
_MD = flags.DEFINE_bool("markdown", False, "print a markdown table instead of JSON")


def main(argv):
    del argv
    logging.set_verbosity(logging.ERROR)
    rows = []
    for zero in range(4):
        c = _CONFIG.value
        c.optim.zero_stage = zero
        with tempfile.TemporaryDirectory() as wd, open(os.devnull, "w") as null:
            import contextlib
            with contextlib.redirect_stdout(null):
                rep = dry_run(c, wd)
        n, psi = rep["layout"]["data"], rep["layout"]["params"]
        sb = rep["state_bytes"]
        coll = {k: v["bytes"] for k, v in rep["collectives_by_kind"].items()}
        paper = {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n, 3: 16 * psi / n}[zero]
        ours = {0: 16 * psi, 1: 8 * psi + 8 * psi / n, 2: 4 * psi + 12 * psi / n, 3: 16 * psi / n}[zero]
        rows.append({"zero_stage": zero, "params": psi, "data": n, "params_bytes": sb["params"],
                     "opt_state_bytes": sb["opt_state"], "grad_buffer_bytes": sb["grad_buffer"],
                     "model_state_bytes": sb["params"] + sb["opt_state"] + sb["grad_buffer"],
                     "formula_fp32_bytes": ours, "zero_paper_bytes": paper,
                     "xla_argument_bytes": rep["memory"]["argument"], "xla_temp_bytes": rep["memory"]["temp"],
                     "xla_peak_bytes": rep["memory"]["peak"], "collective_bytes_per_step": coll})
    if _MD.value:
        mib = lambda b: f"{b / 2**20:.1f}"
        print("| ZeRO | params | opt state | grad buffer | total | formula (fp32 Adam) | paper (fp16 Adam) "
              "| XLA peak | collectives per step (result bytes) |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            col = ", ".join(f"{k} {mib(v)}" for k, v in sorted(r["collective_bytes_per_step"].items()))
            print(f"| {r['zero_stage']} | {mib(r['params_bytes'])} | {mib(r['opt_state_bytes'])} | "
                  f"{mib(r['grad_buffer_bytes'])} | {mib(r['model_state_bytes'])} | {mib(r['formula_fp32_bytes'])} | "
                  f"{mib(r['zero_paper_bytes'])} | {mib(r['xla_peak_bytes'])} | {col} |")
    else:
        print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    flags.mark_flag_as_required("config")
    app.run(main)
