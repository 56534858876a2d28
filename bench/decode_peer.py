"""Decode speed against a JAX peer, side by side in one run (prints JSON): jaxpar's generation engine and Google
Tunix's sampler (0.1.7, `bench/tunix_peer.py`, in its own venv on the same jax) on the same random Qwen3 (vocabulary
151,936, ~21M parameters), 64 prompts of 16-128 random ids x 128 new tokens, one CPU device, greedy and temperature 1;
tokens/s and CPU seconds of the fastest of 3 calls after a compiling one, each side, in 2 alternating rounds (Tunix,
jaxpar, Tunix, jaxpar: the machine's drift hits both), how many greedy tokens agree;
and greedy against Tunix returning log-probs too (`greedy_logprobs`: the outputs jaxpar's engine always gives,
compared).

    python bench/decode_peer.py --tunix_python /path/to/tunix-venv/bin/python [--rows 64] [--new 128] [--repeats 3] [--rounds 2]

The Tunix venv: `python3 -m venv tunix-venv && tunix-venv/bin/pip install google-tunix==0.1.7 jax==0.10.2`.
Results: docs/results/generation.md.
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")

import numpy as np  # noqa: E402

from jaxpar.data import ByteTokenizer  # noqa: E402
from jaxpar.formats import hf  # noqa: E402
from jaxpar.generate.engine import Engine, Request  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def qwen3(d, vocab: int = 151936):
    """A random Qwen3 (hidden 128, 6 layers, GQA 4/2 heads of 32, MLP 512, tied embeddings) saved in `d`."""
    import torch
    import transformers

    torch.manual_seed(0)
    m = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=vocab, hidden_size=128, intermediate_size=512, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=512, tie_word_embeddings=True,
        rope_theta=1_000_000.0))
    with torch.no_grad():  # weights spread enough that greedy choices are not near-ties
        for name, p in m.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.ndim == 1 else 0.1) + (1.0 if "norm" in name else 0.0))
    m.eval().save_pretrained(d)
    ByteTokenizer.to_hf().save(f"{d}/tokenizer.json")
    return sum(p.numel() for p in m.parameters())


def jaxpar_side(d, prompts, new: int, repeats: int) -> dict:
    """Each mode's fastest of `repeats` calls after a compiling one: seconds, CPU seconds, tokens, the model's
    log-probs of them (the engine always returns them)."""
    fwd, params, _ = hf.load(d)
    engine = Engine(fwd, params, slots=len(prompts))
    out = {}
    for name, knobs in (("greedy", {}), ("temperature_1", {"temperature": 1.0})):
        reqs = [Request(p, max_new_tokens=new, seed=0, stream=i, **knobs) for i, p in enumerate(prompts)]
        engine.generate(reqs)  # compiles
        best = None
        for _ in range(repeats):
            t0, c0 = time.perf_counter(), time.process_time()
            done = engine.generate(reqs)
            took = {"seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0}
            best = took if best is None or took["seconds"] < best["seconds"] else best
        out[name] = {**best, "tokens": [c.tokens for c in done], "logprobs": [c.model_logprobs for c in done],
                     "calls": dict(engine.stats)}
    return out


def faster(best: dict, new: dict) -> dict:
    """Per mode, the faster of two measurements."""
    return {m: r if m not in best or r["seconds"] < best[m]["seconds"] else best[m] for m, r in new.items()}


def main():
    a = argparse.ArgumentParser()
    a.add_argument("--tunix_python", required=True)
    a.add_argument("--rows", type=int, default=64)
    a.add_argument("--new", type=int, default=128)
    a.add_argument("--repeats", type=int, default=3, help="timed calls per mode, each side; the fastest counts")
    a.add_argument("--rounds", type=int, default=2, help="Tunix then jaxpar, this many times, alternating")
    args = a.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as d:
        n_params = qwen3(d)
        prompts = [rng.integers(1, 151936, rng.integers(16, 129)).tolist() for _ in range(args.rows)]
        with open(f"{d}/prompts.json", "w") as f:
            json.dump({"prompts": prompts}, f)
        env = {**os.environ, "XLA_FLAGS": os.environ["XLA_FLAGS"], "JAX_PLATFORMS": "cpu"}
        peer, ours = {}, {}
        for _ in range(args.rounds):  # Tunix, jaxpar, Tunix, ...: a drift of the machine's speed hits both sides
            subprocess.run([args.tunix_python, os.path.join(HERE, "tunix_peer.py"), "--model", d, "--prompts",
                            f"{d}/prompts.json", "--new", str(args.new), "--out", f"{d}/tunix.json", "--repeats",
                            str(args.repeats)], check=True, env=env)
            peer = faster(peer, json.load(open(f"{d}/tunix.json")))
            ours = faster(ours, jaxpar_side(d, prompts, args.new, args.repeats))
    total = args.rows * args.new
    out = {"machine": platform.processor() or platform.machine(), "cores": os.cpu_count(), "params": n_params,
           "rows": args.rows, "new_tokens": args.new, "repeats": args.repeats, "rounds": args.rounds}
    # greedy_logprobs: Tunix also returning each token's log-prob, the outputs jaxpar's engine always gives
    for mode, theirs in (("greedy", "greedy"), ("greedy_logprobs", "greedy_logprobs"),
                         ("temperature_1", "temperature_1")):
        j, t = ours[mode if mode != "greedy_logprobs" else "greedy"], peer[theirs]
        out[mode] = {"jaxpar_tokens_per_s": total / j["seconds"], "tunix_tokens_per_s": total / t["seconds"],
                     "speedup": t["seconds"] / j["seconds"], "jaxpar_cpu_s": j["cpu_seconds"],
                     "tunix_cpu_s": t["cpu_seconds"], "jaxpar_calls": j["calls"]}
    same = sum(a_ == b_ for x, y in zip(ours["greedy"]["tokens"], peer["greedy"]["tokens"])
               for a_, b_ in zip(x, y[:len(x)]))
    out["greedy"]["tokens_equal"] = f"{same} of {total}"
    diff = max(abs(a_ - b_) for x, y in zip(ours["greedy"]["logprobs"], peer["greedy_logprobs"]["logprobs"])
               for a_, b_ in zip(x, y[:len(x)]))
    out["greedy_logprobs"]["logprobs_max_abs_diff"] = diff
    json.dump(out, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
