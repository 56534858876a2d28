"""GRPO's inputs as TRL takes them and the refusals of bad ones: built-in rewards and user reward functions called
with TRL's arguments, bad reward functions, weights and GRPO settings refused in one line before compiling (split
from `tests/test_grpo.py`, whose subject is the loss against TRL's formulas)."""
import jax
import numpy as np
import pytest

from helpers import run_config

pytestmark = pytest.mark.xdist_group("test_grpo_inputs")


def test_builtin_rewards_and_user_functions_are_called_as_trl_calls_them(tmp_path):
    pytest.importorskip("math_verify")
    from jaxpar.rl import rewards
    f = tmp_path / "my_rewards.py"
    f.write_text("def echo(prompts, completions, completion_ids, difficulty, **kw):\n"
                 "    return [None if d is None else float(d) + len(c) for d, c in zip(difficulty, completions)]\n")
    fns, w = rewards.load(f"jaxpar.rl.rewards:exact_answer, {f}:echo,jaxpar.rl.rewards:soft_overlong",
                          "1, 0.5, 2")
    assert [n for n, _ in fns] == ["exact_answer", "echo", "soft_overlong"] and w.tolist() == [1.0, 0.5, 2.0]
    completions = ["<think>6*7=42, not 41</think> <answer>42</answer>", [{"role": "assistant", "content": "The answer is $\\frac{1}{2}$"}], "41", "x"]
    records = [{"prompt": "q", "solution": "42", "difficulty": 1}, {"prompt": "q", "solution": "0.5",
                                                                   "difficulty": None},
               {"prompt": "q", "solution": "42", "difficulty": 2}, {"prompt": "q", "solution": "no", "difficulty": 0}]
    ids = [[1] * 5, [1] * 8, [1] * 9, [1] * 12]
    got = rewards.score(fns, ["q"] * 4, completions, ids, records, max_completion_length=10)
    np.testing.assert_array_equal(got[:, 0], [1.0, 1.0, 0.0, np.nan])  # "no" parses to nothing: None
    np.testing.assert_array_equal(got[:, 1], [1.0 + len(completions[0]), np.nan, 4.0, 1.0])
    np.testing.assert_allclose(got[:, 2], [0.0, 0.0, -0.5, -1.0])  # cache 2 tokens: 8 -> 0, 9 -> -0.5, over -> -1
    fmt = rewards.think_format(completions=["<think>a\nb</think> <answer>3</answer>", "<answer>3</answer>",
                                            "<think>a</think><think>b</think><answer>3</answer>"])
    assert fmt == [1.0, 0.0, 0.0]


@pytest.mark.parametrize("case", ["unknown", "no_file", "wrong_length", "raises", "weights"])
def test_bad_reward_functions_are_one_line(tmp_path, case):
    from jaxpar.rl import rewards
    f = tmp_path / "r.py"
    f.write_text("def short(completions, **kw):\n    return [1.0]\n"
                 "def boom(completions, **kw):\n    raise KeyError('solution')\n")
    spec, weights, want = {
        "unknown": ("jaxpar.rl.rewards:exact", "", "jaxpar.rl.rewards has no function 'exact'"),
        "no_file": ("missing.py:f", "", "no file missing.py"),
        "wrong_length": (f"{f}:short", "", "reward function 'short' returned 1 values for 2 completions"),
        "raises": (f"{f}:boom", "", "reward function 'boom' raised KeyError: 'solution' (on the round's first "
                                    "record {'prompt': 'q'}"),
        "weights": (f"{f}:short", "1,2", "grpo.reward_weights has 2 weights for 1 reward functions")}[case]
    with pytest.raises(rewards.RewardError) as e:
        fns, _ = rewards.load(spec, weights)
        rewards.score(fns, ["q"] * 2, ["a", "b"], [[1], [2]], [{"prompt": "q"}] * 2)
    assert want in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("case", ["one_generation", "no_room", "block_context"])
def test_bad_grpo_config_is_one_line_before_compiling(corpus, tmp_path, case):
    from jaxpar import trainer
    from jaxpar.config import ConfigError
    from jaxpar.data import DataError
    over, want = {
        "one_generation": ({"grpo.num_generations": 1}, "grpo.num_generations=1"),
        "no_room": ({"grpo.max_completion_length": 16}, "grpo.max_completion_length=16 with model.seq_len=16: no "
                                                          "room is left for a prompt"),
        "block_context": ({"grpo.kv_block": 6, "mesh.context": 4, "grpo.kv_cache_gib": 0.5},
                          "grpo.kv_block=6 with mesh.context=4 and grpo.kv_cache_gib=0.5: a completion that does not "
                          "fit one device's pool splits its KV blocks' positions over the context devices; use a "
                          "multiple of 4 (e.g. 8)")}[case]
    n = over.get("mesh.context", 1)
    c = run_config(corpus, tmp_path, **{"mesh.data": 1, "train.objective": "grpo", "grpo.max_completion_length": 8,
                                        **over})
    with pytest.raises((ConfigError, DataError)) as e:
        trainer.run(c, str(tmp_path / "run"), jax.devices()[:n])
    msg = str(e.value).replace("invalid config:\n", "")
    assert want in msg and "\n" not in msg.strip(), msg
    assert not (tmp_path / "run" / "checkpoints").exists()
