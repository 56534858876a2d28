"""What GRPO's routing replay corrects, measured (prints JSON): a random mixture of experts samples a round with the
generation engine; the training forward then computes each completion token's log-prob with and without replaying
the engine's routing. Without replay the training forward routes each position afresh, and where it breaks a near-tie
otherwise than the engine did (the engine decodes a token at a time, the training forward whole rows) its log-prob
is of another policy than the one that sampled the token; the figures say how often (tokens whose routing differs in
some layer) and by how much (|training log-prob - the engine's|), in float32 and in bfloat16 compute.

    python bench/routing_replay.py [--prompts 16] [--generations 8] [--tokens 32]

Results: docs/results/rl.md.
"""
import argparse
import json
import platform

import jax
import numpy as np

from jaxpar.compiled import steps_for
from jaxpar.config import base_config
from jaxpar.generate.engine import Engine
from jaxpar.rl import rollout
from jaxpar.train.objectives import TokenLogps


def config(args, dtype: str):
    c = base_config()
    c.model.update(arch="llama", seq_len=96, layers=4, embed=128, heads=4, mlp=256, experts=16, experts_per_token=2,
                   expert_mlp=64)
    c.train.update(objective="grpo", global_batch_size=args.prompts, compute_dtype=dtype)
    c.grpo.update(num_generations=args.generations, max_completion_length=args.tokens)
    return c


def measure(args, dtype: str) -> dict:
    c = config(args, dtype)
    st = steps_for(c, 512, jax.devices()[:1])
    params = st.init(0)["params"]
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, 500, rng.integers(8, 40))) for _ in range(args.prompts)]
    done = rollout.sample(Engine.on_steps(st, params, c, slots=len(prompts) * args.generations,
                                          prompt_experts=True), prompts,
                          args.generations, args.tokens, seed=1, temperature=1.0)
    rnd = rollout.round_batch(prompts, [{"prompt": ""}] * len(prompts), done,
                              [("none", lambda completions, **kw: [0.0] * len(completions))], [1.0],
                              args.generations, "none", int(c.model.seq_len), replay=True)
    batch = {k: v.astype(np.float32) if v.dtype == np.float64 else v for k, v in rnd.batch.items()}
    mask, rows = batch["mask"] > 0, batch["tokens"].shape[0]
    out = {}
    for name, b in (("replayed", batch), ("afresh", {k: v for k, v in batch.items() if k != "routes"})):
        lp = np.asarray(st.forward(params, jax.device_put(b, st.batch_sharding), TokenLogps(rows))[1])
        gap = np.abs(lp - batch["old"])[mask]
        out[name] = {"mean_abs_logp_gap": float(gap.mean()), "max_abs_logp_gap": float(gap.max()),
                     "tokens_off_by_1e-2": float(np.mean(gap > 1e-2))}
    out["completion_tokens"] = int(mask.sum())
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    result = {"machine": platform.processor() or platform.machine(), "backend": jax.default_backend(),
              "model": "random llama MoE: 4 layers, embed 128, 16 experts, top-2",
              **{dtype: measure(args, dtype) for dtype in ("float32", "bfloat16")}}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
