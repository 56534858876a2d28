"""The GRPO quickstart's material (docs/rl.md): `scripts/finetune_demo.py make` writes prompt records in TRL's
conversational form whose solutions are the reversed words, the held-out words kept out of the training prompts;
the control reward `shuffled_match`, loaded as `grpo.rewards` loads it, is a permutation of `exact_match`'s values,
the same for the same round and another for another round."""
import json
import os

import pytest

from jaxpar.rl import rewards

pytest.importorskip("transformers")  # `make` writes a Hugging Face checkpoint

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "finetune_demo.py")


def _read(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_make_writes_the_grpo_prompts(tmp_path):
    shuffled = dict(rewards.load(f"{SCRIPT}:shuffled_match")[0])["shuffled_match"]
    shuffled.__globals__["make"](str(tmp_path), 40, 10)
    train, val = _read(tmp_path / "prompts_train.jsonl"), _read(tmp_path / "prompts_val.jsonl")
    assert len(train) == 40 and len(val) == 10
    word = lambda r: r["prompt"][-1]["content"].removeprefix("Reverse the word: ")  # noqa: E731
    for r in train + val:
        assert r["prompt"][-1]["role"] == "user" and r["solution"] == word(r)[::-1]
    assert not {word(r) for r in train} & {word(r) for r in val}
    conversations = _read(tmp_path / "val.jsonl")  # what `score` reads: the same held-out words
    assert [c["messages"][-2]["content"] for c in conversations] == [r["prompt"][-1]["content"] for r in val]


def test_the_control_reward_permutes_the_exact_matches():
    shuffled = dict(rewards.load(f"{SCRIPT}:shuffled_match")[0])["shuffled_match"]
    completions = [[{"role": "assistant", "content": t}] for t in ("pmal", "lamp", "pmal", "x", "pmal", "pm")]
    ids = [[1, 2], [3], [4, 5], [6], [7], [8]]
    right = rewards.exact_match(completions, ["pmal"] * 6)
    got = shuffled(completions=completions, completion_ids=ids, solution=["pmal"] * 6)
    assert sorted(got) == sorted(right) and got == shuffled(completions=completions, completion_ids=ids,
                                                            solution=["pmal"] * 6)
    others = [shuffled(completions=completions, completion_ids=ids[:k] + [[99]] + ids[k + 1:], solution=["pmal"] * 6)
              for k in range(6)]
    assert any(o != got for o in others)  # another round (other ids), another permutation
