"""The peer's side of `bench/decode_peer.py`: Google Tunix's sampler (`tunix.generate.sampler.Sampler`, google-tunix
0.1.7) on a Hugging Face Qwen3 directory, run in Tunix's own virtual environment (it is not a jaxpar dependency):

    TUNIX_PYTHON bench/tunix_peer.py --model DIR --prompts PROMPTS.json --new 128 --out OUT.json

PROMPTS.json: {"prompts": [[ids...], ...]}; the prompts reach the sampler as their ids written out (a tokenizer
that reads and writes ids, no BOS), so both engines see the same ids. Greedy (temperature 0) and temperature 1
(Tunix's top-p path with p = 1: its only sampling mode), each timed after a first compiling call; writes
{"greedy": {"seconds", "cpu_seconds", "tokens"}, "temperature_1": {...}}.
"""
import argparse
import json
import time

import jax
import numpy as np


class Ids:
    """A tokenizer of written-out ids: "3 17 5" <-> [3, 17, 5]; no BOS (id 0 means none to Tunix)."""

    def encode(self, text, **kw):
        return [int(t) for t in text.split()]

    def decode(self, ids, **kw):
        return " ".join(str(int(i)) for i in ids)

    def bos_id(self):
        return 0

    def eos_id(self):
        return -1  # no token ends a row: every row makes its `new` tokens, as in jaxpar's run

    def pad_id(self):
        return 0


def main():
    a = argparse.ArgumentParser()
    a.add_argument("--model", required=True)
    a.add_argument("--prompts", required=True)
    a.add_argument("--new", type=int, default=128)
    a.add_argument("--out", required=True)
    a.add_argument("--repeats", type=int, default=3)
    args = a.parse_args()
    from tunix.generate import sampler as sampler_lib
    from tunix.models.qwen3 import model as qwen3, params as qwen3_params

    hf = json.load(open(f"{args.model}/config.json"))
    cfg = qwen3.ModelConfig(num_layers=hf["num_hidden_layers"], vocab_size=hf["vocab_size"],
                            embed_dim=hf["hidden_size"], hidden_dim=hf["intermediate_size"],
                            num_heads=hf["num_attention_heads"], head_dim=hf["head_dim"],
                            num_kv_heads=hf["num_key_value_heads"], rope_theta=int(hf.get("rope_theta") or hf["rope_parameters"]["rope_theta"]),
                            norm_eps=hf["rms_norm_eps"], use_tied_embedding=hf["tie_word_embeddings"])
    model = qwen3_params.create_model_from_safe_tensors(args.model, cfg)
    prompts = json.load(open(args.prompts))["prompts"]
    longest = max(map(len, prompts))
    sampler = sampler_lib.Sampler(model, Ids(), sampler_lib.CacheConfig(
        cache_size=longest + args.new, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim))
    texts = [" ".join(map(str, p)) for p in prompts]
    out = {}
    modes = (("greedy", dict(temperature=0.0)), ("greedy_logprobs", dict(temperature=0.0, return_logprobs=True)),
             ("temperature_1", dict(temperature=1.0, top_p=1.0, seed=0)))
    for name, knobs in modes:
        run = lambda: sampler(texts, max_generation_steps=args.new, max_prompt_length=longest,  # noqa: E731
                              eos_tokens=[-1], **knobs)
        jax.block_until_ready(run().tokens)  # compiles
        best = None
        for _ in range(args.repeats):  # the fastest of `repeats` calls
            t0, c0 = time.perf_counter(), time.process_time()
            got = run()
            tokens = [np.asarray(t).tolist() for t in got.tokens]
            took = {"seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0}
            best = took if best is None or took["seconds"] < best["seconds"] else best
        out[name] = {**best, "tokens": tokens, "logprobs": got.logprobs}
    json.dump(out, open(args.out, "w"))


if __name__ == "__main__":
    main()
