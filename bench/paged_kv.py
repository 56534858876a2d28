"""The paged KV cache against dense slots in the same memory, side by side in one run (prints JSON): a GRPO-shaped
round (8 prompts of 32-96 tokens x 8 samples at temperature 1, completions of 1 to 512 tokens, each its own
`max_new_tokens`) on a random Llama with a 640-token context, one CPU device.

- `dense_all`: 64 dense slots of the whole context: the memory that round needs without paging.
- `paged`: 64 slots in a pool of the round's own tokens (each prompt once, every completion, a block of slack each).
- `paged_half`: the same 64 slots in half that pool (rows wait, some are given back and recomputed).
- `dense_fit`: as many dense slots as fit that pool's memory, the rest waiting for a free slot.

Every run's completions equal `dense_all`'s (tokens; log-probs within 1e-6).

    python bench/paged_kv.py

Results: docs/results/generation.md.
"""
import json
import os
import platform
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")

import numpy as np  # noqa: E402

from jaxpar.data import ByteTokenizer  # noqa: E402
from jaxpar.formats import hf  # noqa: E402
from jaxpar.generate import cache as kv, paged  # noqa: E402
from jaxpar.generate.engine import Engine, Request  # noqa: E402

V, CONTEXT, BLOCK = 4096, 640, 16


def llama(d):
    import torch
    import transformers

    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=V, hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=CONTEXT, tie_word_embeddings=False))
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.ndim == 1 else 0.1) + (1.0 if "norm" in name else 0.0))
    m.eval().save_pretrained(d)
    ByteTokenizer.to_hf().save(f"{d}/tokenizer.json")


def the_round():
    rng = np.random.default_rng(0)
    out = []
    for i in range(8):
        prompt = rng.integers(1, V, rng.integers(32, 97)).tolist()
        out += [Request(prompt, max_new_tokens=int(rng.integers(1, 513)), temperature=1.0, seed=i, stream=g)
                for g in range(8)]
    return out


def timed(engine, reqs):
    engine.generate(reqs[:8])  # compiles the programs a call of this engine uses
    t0, c0 = time.perf_counter(), time.process_time()
    done = engine.generate(reqs)
    return done, {"seconds": round(time.perf_counter() - t0, 2), "cpu_seconds": round(time.process_time() - c0, 2),
                  **{k: v for k, v in engine.stats.items() if k.startswith(("kv_", "preempted", "decode"))}}


def main():
    reqs = the_round()
    with tempfile.TemporaryDirectory() as d:
        llama(d)
        fwd, params, _ = hf.load(d)
    cfg = fwd.cfg
    per_block = kv.block_bytes(cfg, BLOCK)
    prompts = {tuple(r.prompt) for r in reqs}
    need = sum(paged.blocks_for(len(p), BLOCK) for p in prompts) + sum(
        paged.blocks_for(r.max_new_tokens, BLOCK) + 1 for r in reqs)  # prompts once, completions, a block of slack
    runs = {"dense_all": Engine(fwd, params, slots=64, kv_block=0),
            "paged": Engine(fwd, params, slots=64, kv_memory=need * per_block),
            "paged_half": Engine(fwd, params, slots=64, kv_memory=need // 2 * per_block)}
    dense_row = kv.cache_bytes(cfg, 1, CONTEXT)["total"]
    runs["dense_fit"] = Engine(fwd, params, slots=max(1, need * per_block // dense_row), kv_block=0)
    out = {"machine": platform.machine(), "cores": os.cpu_count(), "requests": len(reqs),
           "completion_tokens": sum(r.max_new_tokens for r in reqs),
           "prompt_tokens_once": sum(map(len, prompts)), "kv_bytes_per_position": per_block // BLOCK,
           "dense_all_bytes": 64 * dense_row, "pool_bytes": need * per_block, "half_pool_bytes": need // 2 * per_block,
           "dense_slots_in_pool": runs["dense_fit"].slots}
    want = None
    for name, engine in runs.items():
        done, stats = timed(engine, reqs)
        want = want or done
        same = sum(g.tokens == w.tokens and np.allclose(g.model_logprobs, w.model_logprobs, atol=1e-6)
                   for g, w in zip(done, want))
        out[name] = {**stats, "same_completions": f"{same} of {len(reqs)}"}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
