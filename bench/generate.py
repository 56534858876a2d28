"""Generation speed on CPU (prints JSON): jaxpar's engine against `transformers`' `generate` on the same tiny random
Llama, the same prompts and lengths, in one run: prefill and decode apart, and jaxpar with and without refilling
finished slots on a mix of completion lengths (one in four rows long).

    python bench/generate.py [--rows 16] [--slots 8] [--short 8] [--long 64]

Results: docs/results/generation.md.
"""
import argparse
import json
import platform
import tempfile
import time

import numpy as np
import torch
import transformers

from jaxpar.data import ByteTokenizer
from jaxpar.generate.engine import Engine, Request
from jaxpar.interop import hf


def model(d):
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=512, max_position_embeddings=256, tie_word_embeddings=False)).eval()
    m.save_pretrained(d)
    ByteTokenizer.to_hf().save(f"{d}/tokenizer.json")
    return m


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def hf_run(m, prompts, news):
    """transformers, one prompt at a time (its batched generate pads and cannot stop rows apart): prefill = one
    forward of the prompt; decode = generate's time less that."""
    pre = dec = 0.0
    with torch.no_grad():
        for p, n in zip(prompts, news):
            x = torch.tensor([p])
            _, t = timed(lambda: m(x))
            _, g = timed(lambda: m.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0))
            pre, dec = pre + t, dec + g - t
    return pre, dec


def main():
    a = argparse.ArgumentParser()
    a.add_argument("--rows", type=int, default=16)
    a.add_argument("--slots", type=int, default=8)
    a.add_argument("--short", type=int, default=8)
    a.add_argument("--long", type=int, default=64)
    args = a.parse_args()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 512, int(rng.integers(8, 33))).tolist() for _ in range(args.rows)]
    news = [args.long if i % 4 == 0 else args.short for i in range(args.rows)]
    with tempfile.TemporaryDirectory() as d:
        m = model(d)
        fwd, params, _ = hf.load(d)
    reqs = [Request(p, max_new_tokens=n) for p, n in zip(prompts, news)]
    out = {"machine": platform.processor() or platform.machine(), "rows": args.rows, "slots": args.slots,
           "prompt_tokens": sum(map(len, prompts)), "new_tokens": sum(news)}
    for refill in (True, False):
        eng = Engine(fwd, params, slots=args.slots, refill=refill)
        eng.generate(reqs)  # compile
        _, t = timed(lambda: eng.generate(reqs))
        out[f"jaxpar_{'refill' if refill else 'static'}_tokens_per_s"] = sum(news) / t
    eng = Engine(fwd, params, slots=args.slots)
    length = 256
    group = [prompts[:args.slots]]
    eng._admit(eng._empty(args.slots, length), group[0], list(range(args.slots)), length)  # compile
    _, pre = timed(lambda: jax_block(eng._admit(eng._empty(args.slots, length), group[0],
                                                list(range(args.slots)), length)))
    out["jaxpar_prefill_tokens_per_s"] = sum(map(len, group[0])) / pre
    hf_pre, hf_dec = hf_run(m, prompts, news)
    out["transformers_prefill_tokens_per_s"] = out["prompt_tokens"] / hf_pre
    out["transformers_decode_tokens_per_s"] = sum(news) / hf_dec
    out["ratio_decode_jaxpar_refill_over_transformers"] = out["jaxpar_refill_tokens_per_s"] / \
        out["transformers_decode_tokens_per_s"]
    out["ratio_refill_over_static"] = out["jaxpar_refill_tokens_per_s"] / out["jaxpar_static_tokens_per_s"]
    print(json.dumps(out, indent=1))


def jax_block(carry):
    import jax
    return jax.block_until_ready(carry)


if __name__ == "__main__":
    main()
