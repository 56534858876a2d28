"""The RL quickstart's material, made here (nothing downloaded), its scorer and its control reward (docs/rl.md).

    python scripts/rl_demo.py make --out data/rl_demo
        DIR/base/   the tiny random-weight Llama checkpoint of `finetune_demo.py` (a byte-level tokenizer, a ChatML
                    chat template, `eos_token` the end of a turn)
        DIR/sft.jsonl   conversations for the short SFT that gives the model partial skill: "What is 23+45?" -> "68"
        DIR/train.jsonl   GRPO's prompts, TRL's conversational form: {"prompt": [{"role": "user", "content":
                    "What is 23+45?"}], "solution": "68"} (every column besides `prompt` reaches a reward function
                    as a keyword)
        DIR/val.jsonl   held-out problems in train.jsonl's form: pairs in neither sft.jsonl nor train.jsonl
        The operands are whole numbers 0 to --max (99), each unordered pair in one file at most.
    python scripts/rl_demo.py score --model runs/rl_demo_sft --data DIR/val.jsonl
        the held-out accuracy of the greedy replies (the chat template, the KV cache, the reply up to the end-of-turn
        token) under the exact-answer reward (`jaxpar.rl.rewards:exact_answer`, math-verify), printed as JSON;
        MODEL is a run directory, an export, or hf:DIR
    --config.grpo.rewards=scripts/rl_demo.py:shuffled_answer
        the control run's reward: the exact-answer rewards of a round's completions, permuted among them, so a
        reward says nothing about the completion it is given to (its mean stays the true one)
"""
import argparse
import json
import os
import random
import sys
import zlib

ASK = "What is {}+{}?"
HERE = os.path.dirname(os.path.abspath(__file__))


def _finetune_demo():
    """scripts/finetune_demo.py, beside this file: the checkpoint's maker and the model loader are its."""
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    import finetune_demo
    return finetune_demo


def pairs(top: int, seed: int) -> list[tuple[int, int]]:
    """Every unordered pair of operands 0..top (a <= b), shuffled with `seed`; each is asked in a random order."""
    rng = random.Random(seed)
    out = [(a, b) if rng.random() < 0.5 else (b, a) for a in range(top + 1) for b in range(a, top + 1)]
    rng.shuffle(out)
    return out


def problem(a: int, b: int) -> dict:
    """A GRPO prompt record, TRL's conversational form, with its checkable `solution`."""
    return {"prompt": [{"role": "user", "content": ASK.format(a, b)}], "solution": str(a + b)}


def conversation(a: int, b: int) -> dict:
    return {"messages": [{"role": "user", "content": ASK.format(a, b)}, {"role": "assistant", "content": str(a + b)}]}


def _write(path: str, records) -> None:
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def make(out: str, top: int, n_sft: int, n_train: int, n_val: int) -> None:
    pool = pairs(top, seed=0)
    if n_val + n_sft + n_train > len(pool):
        raise SystemExit(f"make: {n_val} + {n_sft} + {n_train} problems asked for, but operands 0..{top} give "
                         f"{len(pool)} pairs; lower the counts or raise --max.")
    val, sft, train = pool[:n_val], pool[n_val:n_val + n_sft], pool[n_val + n_sft:n_val + n_sft + n_train]
    os.makedirs(out, exist_ok=True)
    _write(os.path.join(out, "sft.jsonl"), (conversation(a, b) for a, b in sft))
    _write(os.path.join(out, "train.jsonl"), (problem(a, b) for a, b in train))
    _write(os.path.join(out, "val.jsonl"), (problem(a, b) for a, b in val))
    vocab = _finetune_demo().write_base(os.path.join(out, "base"))
    print(json.dumps({"out": out, "max": top, "sft": len(sft), "train": len(train), "val": len(val),
                      "vocab": vocab}))


def score(model: str, data: str, limit: int) -> dict:
    from jaxpar.generate.engine import Engine, Request
    from jaxpar.rl.rewards import exact_answer

    demo = _finetune_demo()
    fwd, params, tok, chat = demo.load(model)
    with open(data) as f:
        records = [json.loads(line) for line in f][:limit]
    stops = tuple(sorted(chat.stop_ids))
    done = Engine(fwd, params, slots=32).generate([Request(chat.prompt(r["prompt"]).tolist(), max_new_tokens=8,
                                                           stop_ids=stops) for r in records])  # greedy
    replies = [demo.reply_text(tok, c) for c in done]
    right = exact_answer([[{"role": "assistant", "content": t}] for t in replies], [r["solution"] for r in records])
    shown = [{"prompt": r["prompt"][-1]["content"], "reply": t, "answer": r["solution"]}
             for r, t in zip(records[:3], replies)]
    return {"model": model, "accuracy": sum(v or 0.0 for v in right) / len(records), "examples": len(records),
            "first": shown}


def shuffled_answer(prompts, completions, completion_ids, solution, **kwargs):
    """The control run's reward: `exact_answer`'s values permuted across the round's completions. The permutation's
    seed is the round's completion ids (a checksum), so it is the same whenever the same round comes again (the same
    seed gives the same run) and differs from round to round."""
    import numpy as np

    from jaxpar.rl.rewards import exact_answer

    right = exact_answer(completions, solution)
    seed = zlib.crc32(json.dumps([list(map(int, ids)) for ids in completion_ids]).encode())
    return [right[i] for i in np.random.default_rng(seed).permutation(len(right))]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("--out", default="data/rl_demo")
    m.add_argument("--max", type=int, default=99, help="the largest operand")
    m.add_argument("--sft", type=int, default=2000)
    m.add_argument("--train", type=int, default=2000)
    m.add_argument("--val", type=int, default=200)
    s = sub.add_parser("score")
    s.add_argument("--model", required=True, help="a run directory, an export, or hf:DIR")
    s.add_argument("--data", required=True)
    s.add_argument("--limit", type=int, default=200)
    a = p.parse_args(argv)
    if a.cmd == "make":
        make(a.out, a.max, a.sft, a.train, a.val)
    else:
        print(json.dumps(score(a.model, a.data, a.limit)))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(HERE))
    sys.exit(main())
