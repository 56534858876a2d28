"""Matmul FLOPs (from the HLO, loop trip counts applied), peak bytes and collective bytes of a config's train step.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python bench/step_flops.py --config configs/gpt_small.py \
        [--config.KEY=VALUE ...]                      # compile here, then analyse
    python bench/step_flops.py --hlo train_step.hlo.txt --memory compile_report.json --analytic FLOPS

Prints JSON: HLO matmul FLOPs per device per step (total, and in the `embed` / `head` scopes), PaLM's analytic
model FLOPs per device, the excess of the HLO over it (what the program computes that the model count does not:
e.g. a one-hot embedding matmul, in code that predates the `embed` scope), XLA's peak bytes per device, and the
bytes of each collective kind (the program's dtypes). `--hlo` analyses a saved HLO text (e.g. another version's).
"""
import argparse
import json
import sys


def analyse(text: str, analytic: float, memory: dict) -> dict:
    from jaxpar.analysis.hlo import hlo_collectives
    from jaxpar.analysis.hlo_flops import hlo_flops

    f = hlo_flops(text)
    return {"hlo_matmul_flops": f["total"], "embed_flops": f["by_scope"]["embed"],
            "head_flops": f["by_scope"]["head"], "analytic_flops": analytic,
            "excess_over_analytic": f["total"] / analytic - 1 if analytic else None,
            "peak_bytes": memory.get("peak"), "collective_bytes": {k: v["bytes"] for k, v in
                                                                   hlo_collectives(text)["by_kind"].items()}}


def compiled_step(argv):
    import jax
    from absl import flags
    from ml_collections import config_flags

    from jaxpar import model as gpt
    from jaxpar.compiled import abstract_batch, steps_for
    from jaxpar.analysis.compile_report import memory_bytes

    cfg_flag = config_flags.DEFINE_config_file("config", None, "config file")
    flags.FLAGS(argv)
    config = cfg_flag.value
    steps = steps_for(config, int(config.model.vocab_size) or 256)
    B, T = int(config.train.global_batch_size), int(config.model.seq_len)
    compiled = steps.train.lower(steps.abstract_state(), abstract_batch(config, steps)).compile()
    n = jax.device_count()
    return compiled.as_text(), gpt.flops_per_token(steps.cfg) * B * T / n, memory_bytes(compiled)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hlo")
    ap.add_argument("--memory")
    ap.add_argument("--analytic", type=float, default=0.0)
    args, rest = ap.parse_known_args()
    if args.hlo:
        memory = json.load(open(args.memory))["memory"] if args.memory else {}
        print(json.dumps(analyse(open(args.hlo).read(), args.analytic, memory)))
        return
    print(json.dumps(analyse(*compiled_step([sys.argv[0]] + rest))))


if __name__ == "__main__":
    main()
