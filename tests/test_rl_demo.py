"""scripts/rl_demo.py, the RL quickstart's material (docs/rl.md): `make` writes the documented files, with held-out
pairs kept out of the training files; the control reward `shuffled_answer` is a deterministic permutation of the
exact-answer rewards, loaded as `grpo.rewards` loads it; `score` runs on the random base checkpoint."""
import json
import os

import pytest

from jaxpar.rl import rewards

pytest.importorskip("transformers")  # `make` writes a Hugging Face checkpoint
pytest.importorskip("math_verify")  # the exact-answer reward (the `rl` extra)

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "rl_demo.py")


@pytest.fixture(scope="module")
def demo():
    return dict(rewards.load(f"{SCRIPT}:shuffled_answer")[0])["shuffled_answer"].__globals__


@pytest.fixture(scope="module")
def made(demo, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("rl_demo"))
    demo["make"](out, top=12, n_sft=30, n_train=20, n_val=10)
    return out


def _read(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def _operands(text):
    a, b = text.removeprefix("What is ").removesuffix("?").split("+")
    return int(a), int(b)


def test_make_writes_the_documented_files(made):
    sft, train, val = (_read(os.path.join(made, f"{n}.jsonl")) for n in ("sft", "train", "val"))
    assert (len(sft), len(train), len(val)) == (30, 20, 10)
    for r in sft:
        (user, assistant), = [r["messages"]]
        assert user["role"] == "user" and assistant["role"] == "assistant"
        assert int(assistant["content"]) == sum(_operands(user["content"]))
    for r in train + val:
        assert set(r) == {"prompt", "solution"} and [m["role"] for m in r["prompt"]] == ["user"]
        assert int(r["solution"]) == sum(_operands(r["prompt"][0]["content"]))
    asked = lambda rs, f: {frozenset(_operands(f(r))) for r in rs}  # noqa: E731 - unordered: 3+5 is 5+3
    held = asked(val, lambda r: r["prompt"][0]["content"])
    assert len(held) == 10
    assert not held & asked(train, lambda r: r["prompt"][0]["content"])
    assert not held & asked(sft, lambda r: r["messages"][0]["content"])
    with open(os.path.join(made, "base", "tokenizer_config.json")) as f:
        assert "<|im_start|>" in json.load(f)["chat_template"]
    assert os.path.isfile(os.path.join(made, "base", "model.safetensors"))


def test_make_refuses_more_problems_than_pairs(demo, tmp_path):
    with pytest.raises(SystemExit, match="operands 0..3 give 10 pairs"):
        demo["make"](str(tmp_path), top=3, n_sft=5, n_train=5, n_val=1)


def test_shuffled_answer_permutes_the_exact_answers(demo):
    shuffled = rewards.load(f"{SCRIPT}:shuffled_answer")[0][0][1]
    solution = [str(k) for k in range(16)]
    completions = [[{"role": "assistant", "content": str(k if k % 3 else k + 1)}] for k in range(16)]
    ids = [[48 + k] for k in range(16)]
    kw = dict(prompts=[None] * 16, completions=completions, completion_ids=ids, solution=solution)
    exact = rewards.exact_answer(completions, solution)
    assert exact.count(1.0) == 10 and exact.count(0.0) == 6
    got = shuffled(**kw)
    assert sorted(got) == sorted(exact) and got != exact  # the same rewards, given to other completions
    assert shuffled(**kw) == got  # the same round: the same permutation
    assert shuffled(**{**kw, "completion_ids": [[49 + k] for k in range(16)]}) != got  # another round: another


def test_score_runs_on_the_base_checkpoint(demo, made):
    got = demo["score"](f"hf:{made}/base", os.path.join(made, "val.jsonl"), limit=4)
    assert got["examples"] == 4 and 0.0 <= got["accuracy"] <= 1.0
    assert [f["answer"] for f in got["first"]] == [r["solution"] for r in _read(os.path.join(made, "val.jsonl"))[:3]]
