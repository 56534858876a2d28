"""The fine-tuning quickstart's material, made here (nothing downloaded), and its scorer (docs/finetune.md).

    python scripts/finetune_demo.py make --out data/finetune_demo
        DIR/base/   a tiny Llama "checkpoint" as Hugging Face writes one: random weights, a byte-level BPE
                    tokenizer.json with ChatML's special tokens, tokenizer_config.json with a ChatML chat template
        DIR/train.jsonl, DIR/val.jsonl   instructions with checkable answers, as `messages`: "Reverse the word:
                    lamp" -> "pmal" (a system message in some), 3 to 6 random letters; held-out words in val.jsonl
        DIR/sort_train.jsonl, DIR/sort_val.jsonl   the LoRA step's new skill, the same words: "Sort the letters:
                    lamp" -> "almp"
        DIR/noisy_train.jsonl   the DPO quickstart's SFT data: train.jsonl with half the replies wrong, the word
                    echoed ("lamp" -> "lamp"), as noisy labels leave a model answering either way
        DIR/prefs_train.jsonl   preference pairs for DPO, TRL's conversational form: "Reverse the word: lamp",
                    chosen "pmal", rejected "lamp" (palindromes left out; the held-out words of val.jsonl not used)
        DIR/prompts_train.jsonl, DIR/prompts_val.jsonl   the GRPO quickstart's prompts (docs/rl.md), TRL's
                    conversational form: {"prompt": [... "Reverse the word: lamp"], "solution": "pmal"}, the words
                    of train.jsonl and val.jsonl
    python scripts/finetune_demo.py score --model hf:DIR/base --data DIR/val.jsonl
    python scripts/finetune_demo.py score --model runs/finetune_demo --data DIR/val.jsonl
        the exact-match accuracy of the greedy replies (the chat template, the KV cache, the reply up to the
        end-of-turn token) and the fraction that echo the instruction's word, printed as JSON
    --config.grpo.rewards=scripts/finetune_demo.py:shuffled_match
        the GRPO quickstart's control reward (`shuffled_match`)
"""
import argparse
import json
import os
import random
import string
import sys
import zlib

SPECIAL = ["<|im_start|>", "<|im_end|>"]
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' + '\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def words(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    out = set()
    while len(out) < n:
        out.add("".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 6))))
    return sorted(out)


# the tasks: the instruction, its answer; `reverse` trains the checkpoint (full fine-tuning), `sort` then teaches the
# fine-tuned model a new skill with LoRA adapters
TASKS = {"reverse": ("Reverse the word: {}", lambda w: w[::-1]),
         "sort": ("Sort the letters: {}", lambda w: "".join(sorted(w)))}


def conversation(word: str, system: bool, task: str = "reverse") -> dict:
    messages = [{"role": "system", "content": "Answer with the word only."}] if system else []
    ask, answer = TASKS[task]
    return {"messages": messages + [{"role": "user", "content": ask.format(word)},
                                    {"role": "assistant", "content": answer(word)}]}


def preference(word: str) -> dict:
    """A DPO pair: the reverse instruction (no system message: a pair fits a row of 129 tokens), the reversed word
    chosen over the word echoed."""
    prompt = conversation(word, False)["messages"][:-1]
    reply = lambda text: [{"role": "assistant", "content": text}]  # noqa: E731
    return {"prompt": prompt, "chosen": reply(word[::-1]), "rejected": reply(word)}


def prompt_record(word: str, system: bool) -> dict:
    """A GRPO prompt record (TRL's conversational form): the reverse instruction and its checkable `solution`."""
    messages = conversation(word, system)["messages"]
    return {"prompt": messages[:-1], "solution": messages[-1]["content"]}


def shuffled_match(completions, completion_ids, solution, **kwargs):
    """The GRPO quickstart's control reward (`--config.grpo.rewards=scripts/finetune_demo.py:shuffled_match`): the
    exact-match rewards of a round's completions, permuted among them, so a reward says nothing of the completion it
    is given to (its mean stays the true one). The permutation's seed is the round's completion ids (a checksum): the
    same round, the same permutation (the same seed gives the same run); another round, another."""
    import numpy as np

    from jaxpar.rl.rewards import exact_match

    right = exact_match(completions, solution)
    seed = zlib.crc32(json.dumps([list(map(int, ids)) for ids in completion_ids]).encode())
    return [right[i] for i in np.random.default_rng(seed).permutation(len(right))]


def make(out: str, n_train: int, n_val: int) -> None:
    pool = words(n_train + n_val, seed=0)
    random.Random(1).shuffle(pool)
    os.makedirs(out, exist_ok=True)
    for task in TASKS:
        for name, ws in (("train", pool[:n_train]), ("val", pool[n_train:])):
            with open(os.path.join(out, f"{name}.jsonl" if task == "reverse" else f"{task}_{name}.jsonl"), "w") as f:
                for k, w in enumerate(ws):
                    f.write(json.dumps(conversation(w, system=k % 4 == 0, task=task)) + "\n")
    with open(os.path.join(out, "noisy_train.jsonl"), "w") as f:
        for k, w in enumerate(pool[:n_train]):
            r = conversation(w, system=k % 4 == 0)
            r["messages"][-1]["content"] = w if k % 2 else w[::-1]  # every other reply echoes the word
            f.write(json.dumps(r) + "\n")
    with open(os.path.join(out, "prefs_train.jsonl"), "w") as f:
        for w in pool[:n_train]:
            if w != w[::-1]:
                f.write(json.dumps(preference(w)) + "\n")
    for name, ws in (("train", pool[:n_train]), ("val", pool[n_train:])):
        with open(os.path.join(out, f"prompts_{name}.jsonl"), "w") as f:
            for k, w in enumerate(ws):
                f.write(json.dumps(prompt_record(w, system=k % 4 == 0)) + "\n")
    vocab = write_base(os.path.join(out, "base"))
    print(json.dumps({"out": out, "train": n_train, "val": n_val, "vocab": vocab}))


def write_base(base: str, max_positions: int = 128) -> int:
    """A tiny random-weight Llama checkpoint in DIR `base` as Hugging Face writes one: a byte-level tokenizer (the
    256 bytes, end-of-text and ChatML's special tokens, no merge), a ChatML chat template, `eos_token` the end of a
    turn. -> its vocabulary's size."""
    import torch
    import transformers

    from jaxpar.data import BPETokenizer

    tok = BPETokenizer.train(["Reverse the word"], 257 + len(SPECIAL), SPECIAL)  # bytes and the specials, no merge
    tok.save(base)
    with open(os.path.join(base, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHATML,
                   "eos_token": "<|im_end|>", "bos_token": BPETokenizer.EOT}, f)
    eos = tok.hf.token_to_id("<|im_end|>")
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=tok.vocab_size,
                                   max_position_embeddings=max_positions, tie_word_embeddings=False, bos_token_id=0,
                                   eos_token_id=eos)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(base)
    return tok.vocab_size


def load(model: str):
    """MODEL (a run directory, an export, or hf:DIR) -> (forward, params, tokenizer, its ChatFormat)."""
    from jaxpar.data.chat import ChatFormat
    from jaxpar.formats import hf
    from jaxpar.state.runs import load_params

    where = hf.directory_of(model)
    fwd, params, tok = hf.load(where) if where else load_params(model)
    return fwd, params, tok, ChatFormat.from_dir(tok.directory)


def reply_text(tok, completion) -> str:
    """A completion's reply: its tokens decoded, the end-of-turn token it stopped at left out."""
    return tok.decode(completion.tokens[:-1] if completion.finish_reason == "stop" else completion.tokens)


def score(model: str, data: str, limit: int) -> dict:
    from jaxpar.generate.engine import Engine, Request

    fwd, params, tok, chat = load(model)
    with open(data) as f:
        records = [json.loads(line) for line in f][:limit]
    stops = tuple(sorted(chat.stop_ids))
    done = Engine(fwd, params).generate([Request(chat.prompt(r["messages"][:-1]).tolist(), max_new_tokens=10,
                                                 stop_ids=stops) for r in records])  # greedy
    right, echoed, shown = 0, 0, []
    for r, c in zip(records, done):
        prompt, answer = r["messages"][:-1], r["messages"][-1]["content"]
        reply = reply_text(tok, c)
        right += reply == answer
        echoed += reply == prompt[-1]["content"].split()[-1]  # the word of the instruction, unchanged
        if len(shown) < 3:
            shown.append({"prompt": prompt[-1]["content"], "reply": reply, "answer": answer})
    return {"model": model, "accuracy": right / len(records), "echoed": echoed / len(records),
            "examples": len(records), "first": shown}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("--out", default="data/finetune_demo")
    m.add_argument("--train", type=int, default=4000)
    m.add_argument("--val", type=int, default=200)
    s = sub.add_parser("score")
    s.add_argument("--model", required=True, help="a run directory, an export, or hf:DIR")
    s.add_argument("--data", required=True)
    s.add_argument("--limit", type=int, default=200)
    a = p.parse_args(argv)
    if a.cmd == "make":
        make(a.out, a.train, a.val)
    else:
        print(json.dumps(score(a.model, a.data, a.limit)))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
