"""lm-eval `loglikelihood` requests per second: jaxpar's backend (`--model jaxpar`, the forward pass on the training
layout) against lm-eval's own `hf` backend (transformers + torch), on the same random Llama directory, the same
requests (multiple-choice-like: a context of 20-120 tokens, 4 continuations of 1-8 tokens each), one run, CPU.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python bench/evaluate.py [--requests 400] [--out bench/results]

Both backends get the requests in one call at the same batch size; each is warmed first on a few requests (jaxpar:
its compiles for every padded length; torch: its first call). Also reported: the largest relative difference of the
two backends' log-likelihoods and whether every is_greedy agrees. Needs `pip install -e '.[interop,eval]'`.
Prints JSON rows and a markdown table.
"""
import argparse
import json
import os
import random
import sys
import tempfile
import time

import jax
import numpy as np

from common import write_results


def make_model(directory: str, layers: int, embed: int, vocab: int) -> None:
    """A random Llama with a byte-level BPE tokenizer (trained here), saved as transformers saves it."""
    import torch
    import transformers

    from jaxpar.data import BPETokenizer

    words = "the quick brown fox jumps over a lazy dog and answer what is it".split()
    rng = random.Random(0)
    texts = [" ".join(rng.choice(words) for _ in range(200)) for _ in range(20)]
    tok = BPETokenizer.train(texts, vocab, ["<|endoftext|>"])
    tok.save(directory)
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
                   "bos_token": "<|endoftext|>"}, f)
    eot = tok.hf.token_to_id("<|endoftext|>")
    cfg = transformers.LlamaConfig(hidden_size=embed, intermediate_size=embed * 3, num_hidden_layers=layers,
                                   num_attention_heads=embed // 32, num_key_value_heads=embed // 64,
                                   vocab_size=tok.vocab_size, max_position_embeddings=256, tie_word_embeddings=False,
                                   bos_token_id=eot, eos_token_id=eot)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(directory)


def requests(n: int, seed: int = 0):
    """`n` (context, continuation) pairs: groups of 4 continuations per context, as multiple choice asks."""
    from lm_eval.api.instance import Instance

    words = "the quick brown fox jumps over a lazy dog and answer what is it".split()
    rng, out = random.Random(seed), []
    while len(out) < n:
        ctx = " ".join(rng.choice(words) for _ in range(rng.randint(15, 90)))
        for _ in range(4):
            cont = " " + " ".join(rng.choice(words) for _ in range(rng.randint(1, 6)))
            out.append(Instance("loglikelihood", {}, (ctx, cont), len(out)))
    return out[:n]


def timed(lm, reqs, warm) -> tuple[float, list]:
    lm.loglikelihood(warm, disable_tqdm=True)
    t0 = time.perf_counter()
    res = lm.loglikelihood(reqs, disable_tqdm=True)
    return time.perf_counter() - t0, res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--embed", type=int, default=256)
    p.add_argument("--vocab", type=int, default=2000)
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    from lm_eval.models.huggingface import HFLM

    from jaxpar.evaluate.lm import JaxparLM
    from jaxpar.generate.source import on_layout

    with tempfile.TemporaryDirectory() as d:
        make_model(d, a.layers, a.embed, a.vocab)
        reqs = requests(a.requests)
        warm = requests(a.requests, seed=1)  # other requests, every padded length jaxpar compiles for
        hf_lm = HFLM(pretrained=d, dtype="float32", batch_size=a.batch_size, device="cpu")
        hf_s, hf_res = timed(hf_lm, reqs, warm[:32])
        ours = JaxparLM(source=on_layout("hf:" + d, [], a.batch_size, devices=jax.devices()[:1]),
                        batch_size=a.batch_size)
        jp_s, jp_res = timed(ours, reqs, warm)
    lp = lambda res: np.array([r[0] for r in res])  # noqa: E731
    rel = float(np.max(np.abs(lp(jp_res) - lp(hf_res)) / np.maximum(np.abs(lp(hf_res)), 1e-30)))
    rows = [{"backend": name, "requests": a.requests, "batch_size": a.batch_size, "seconds": round(s, 3),
             "requests_per_s": round(a.requests / s, 1), "device": jax.devices()[0].device_kind if name == "jaxpar"
             else "cpu (torch)"} for name, s in (("hf", hf_s), ("jaxpar", jp_s))]
    summary = {"max_rel_diff": rel, "is_greedy_agree": [r[1] for r in jp_res] == [r[1] for r in hf_res],
               "model": f"llama {a.layers} layers, embed {a.embed}, vocab {a.vocab}", "cpus": os.cpu_count()}
    for r in rows + [summary]:
        print(json.dumps(r))
    table = "| backend | requests/s | seconds |\n|---|---|---|\n" + "\n".join(
        f"| {r['backend']} | {r['requests_per_s']} | {r['seconds']} |" for r in rows)
    print(table)
    write_results(a.out, "evaluate", rows + [summary], table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
