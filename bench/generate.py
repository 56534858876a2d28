"""Generation speed on CPU (prints JSON): jaxpar's engine against `transformers`' `generate` on the same tiny random
Llama, the same prompts and lengths, in one run: prefill and decode apart, and jaxpar with and without refilling
finished slots on a mix of completion lengths (one in four rows long). Prefill and decode are measured on one batch
of `--slots` prompts (transformers left-padded, as its `generate` wants), decode at `--long` tokens a row; the mixed
workload end to end (transformers one prompt at a time: its batched generate cannot free a finished row).

    python bench/generate.py [--rows 16] [--slots 8] [--short 8] [--long 64]

Results: docs/results/generation.md.
"""
import argparse
import json
import platform
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers

from jaxpar.data import ByteTokenizer
from jaxpar.generate.engine import Engine, Request
from jaxpar.generate.sampling import Sampling
from jaxpar.formats import hf


def model(d):
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=512, max_position_embeddings=256, tie_word_embeddings=False)).eval()
    m.save_pretrained(d)
    ByteTokenizer.to_hf().save(f"{d}/tokenizer.json")
    return m


def timed(fn, repeats: int = 3):
    """(fn's result, its best time of `repeats` runs: the machine's noise only ever adds)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return out, best


def hf_mixed(m, prompts, news):
    """transformers on the mixed workload, one prompt at a time (its batched generate pads and cannot free rows):
    tokens/s of new tokens, end to end."""
    with torch.no_grad():
        _, t = timed(lambda: [m.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                         pad_token_id=0) for p, n in zip(prompts, news)], 1)
    return sum(news) / t


def hf_batch(m, prompts, new):
    """transformers on one batch of the prompts (left-padded, as its generate wants): (prefill tokens/s: one forward,
    decode tokens/s: generate's time less that forward, `new` tokens a row)."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        m(ids, attention_mask=mask)  # warm-up
        _, pre = timed(lambda: m(ids, attention_mask=mask))
        _, gen = timed(lambda: m.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                          do_sample=False, pad_token_id=0))
    return sum(map(len, prompts)) / pre, len(prompts) * new / (gen - pre)


def jax_batch(fwd, params, prompts, new, slots):
    """jaxpar on the same batch: (prefill tokens/s: the prompts into the slots, decode tokens/s: `new` tokens a row
    in compiled chunks)."""
    eng = Engine(fwd, params, slots=slots, chunk=8)
    length = 128
    b = slots
    rows = {"seed": jnp.zeros(b, jnp.int32), "stream": jnp.zeros(b, jnp.int32), "index": jnp.zeros(b, jnp.int32),
            "max_new": jnp.full(b, 10 ** 6, jnp.int32), "done": jnp.zeros(b, bool),
            "stop_ids": jnp.full((b, 1), -1, jnp.int32), "wait": jnp.asarray(False)}
    knobs = Sampling(jnp.zeros(b), jnp.zeros(b, jnp.int32), jnp.ones(b), jnp.zeros(b))

    def run():
        carry = jax.block_until_ready(eng._admit(eng.decoder.empty(b, length), prompts, list(range(b)), length))
        t0 = time.perf_counter()
        for _ in range(new // 8):
            carry, out = eng.decoder.decode(eng.params, carry, rows, knobs, 8, "greedy")
        jax.block_until_ready(out)
        return time.perf_counter() - t0

    run()  # compile
    _, pre = timed(lambda: jax.block_until_ready(eng._admit(eng.decoder.empty(b, length), prompts, list(range(b)),
                                                             length)))  # (an empty cache: an allocation)
    return sum(map(len, prompts)) / pre, b * (new // 8) * 8 / min(run() for _ in range(3))


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
        name = "refill" if refill else "static"
        out[f"jaxpar_{name}_tokens_per_s"] = sum(news) / t
        out[f"jaxpar_{name}_calls"] = dict(eng.stats)  # decode calls: `chunk` steps of every slot each
    batch = prompts[:args.slots]
    out["jaxpar_prefill_tokens_per_s"], out["jaxpar_decode_tokens_per_s"] = jax_batch(fwd, params, batch, args.long,
                                                                                       args.slots)
    out["transformers_prefill_tokens_per_s"], out["transformers_decode_tokens_per_s"] = hf_batch(m, batch, args.long)
    out["transformers_mixed_tokens_per_s"] = hf_mixed(m, prompts, news)
    out["ratio_decode_jaxpar_over_transformers"] = out["jaxpar_decode_tokens_per_s"] / \
        out["transformers_decode_tokens_per_s"]
    out["ratio_prefill_jaxpar_over_transformers"] = out["jaxpar_prefill_tokens_per_s"] / \
        out["transformers_prefill_tokens_per_s"]
    out["ratio_mixed_jaxpar_refill_over_transformers"] = out["jaxpar_refill_tokens_per_s"] / \
        out["transformers_mixed_tokens_per_s"]
    out["ratio_refill_over_static"] = out["jaxpar_refill_tokens_per_s"] / out["jaxpar_static_tokens_per_s"]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
