"""The RL tests' material: a tiny chat Llama with prompt records (`rl_base`, tests/test_rl_loop.py), and a GRPO run
to repeat on several processes (`grpo_material`; tests/test_multihost_engine.py, tests/test_slurm.py, conftest's
`grpo_reference`) with what compares two of its runs."""
import json
import os

from helpers import chat_tokenizer, random_hf_llama

GRPO_TIMING = ("tokens_per_s", "step_time_s", "tflops_per_device", "mfu", "data_wait_s", "time/generate_s",
               "time/score_s", "time/train_s", "rollout_tokens_per_s")
GRPO_REWARD = """import jax

def odd(completion_ids, solution, trainer_state, log_metric, log_extra, **kw):
    share = len(completion_ids) * jax.process_count()  # (this process's share: of a round's 16 or 4 held out)
    assert len(solution) == len(completion_ids) and share in (16, 4), share
    log_metric("seen_step", trainer_state.global_step)
    log_extra("process", [jax.process_index()] * len(completion_ids))
    return [sum(i % 2 for i in c) / len(c) for c in completion_ids]
"""
GRPO_CONFIG = """from jaxpar.config import base_config

def get_config():
    c = base_config()
    c.model.update(seq_len=48)
    c.mesh.update(data=4, tensor=2)
    c.train.update(objective="grpo", steps=4, global_batch_size=4, seed=0, param_dtype="float64",
                   compute_dtype="float64")
    c.grpo.update(num_generations=4, max_completion_length=8, rewards="{root}/reward.py:odd", beta=0.04,
                  epsilon=0.2, num_iterations=2, log_completions=16)
    c.optim.update(lr=3e-3, warmup_steps=0, decay_steps=10, clip_norm=1.0)
    c.init_from = "hf:{root}/base"
    c.data.update(sources="{root}/prompts.jsonl", cache_dir="{root}/cache", val_fraction=0.2)
    c.log.update(every_steps=2, progress=False)
    c.eval.update(every_steps=4, batches=1, tasks="jaxpar_mc", tasks_include="{tasks}")
    c.checkpoint.update(every_steps=3, keep=3, async_save=False)
    return c
"""



def rl_base(root) -> None:
    """A tiny chat Llama (root/base, for hf:DIR) and 40 conversational prompt records (root/prompts.jsonl: "What is
    i+i?", solution 2i)."""
    from jaxpar.data import BPETokenizer

    chat_tokenizer(root / "base")
    random_hf_llama(root / "base", BPETokenizer.from_file(root / "base" / "tokenizer.json"))
    with open(root / "prompts.jsonl", "w") as f:
        for i in range(40):
            f.write(json.dumps({"prompt": [{"role": "user", "content": f"What is {i}+{i}?"}],
                                "solution": str(2 * i)}) + "\n")


def grpo_material(root) -> None:
    """`rl_base`, a reward that asserts it sees its process's share of a round (`GRPO_REWARD`) and `GRPO_CONFIG` as
    root/config.py: 4 float64 steps on (data 4, tensor 2), mu = 2 (checkpoint 3 lies inside round 1), lm-eval's
    multiple-choice fixture task at the last step (`eval.tasks`; the runs start in the repository root)."""
    rl_base(root)
    (root / "reward.py").write_text(GRPO_REWARD)
    tasks = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "lm_eval")
    (root / "config.py").write_text(GRPO_CONFIG.format(root=root, tasks=tasks))


def grpo_metrics(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return {r["step"]: {k: v for k, v in r.items() if k not in GRPO_TIMING} for r in map(json.loads, f)}


def grpo_completions(workdir):
    with open(os.path.join(workdir, "completions.jsonl")) as f:
        return [json.loads(line) for line in f]


def assert_same_grpo_run(a, b):
    import pytest

    assert sorted(a) == sorted(b) == [2, 4]
    for step in a:
        assert a[step].keys() == b[step].keys(), step
        for k, v in a[step].items():  # rewards and lengths exactly; losses, KL, entropy within float64's rounding
            assert v == pytest.approx(b[step][k], rel=1e-9, abs=1e-12), (step, k, v, b[step][k])
        assert {k: v for k, v in a[step].items() if "reward" in k} == \
            {k: v for k, v in b[step].items() if "reward" in k}, step


def cut_grpo_run(run, to) -> None:
    """`run` (a finished `grpo_material` run) copied to `to` as if killed after step 3's checkpoint, inside round 1
    (its sampled batch kept beside the checkpoint): checkpoint 4, its batch and what was logged after step 3 gone."""
    import shutil

    shutil.copytree(run, to)
    shutil.rmtree(os.path.join(to, "checkpoints", "4"))
    os.remove(os.path.join(to, "rollouts", "step-4.npz"))
    for name in ("metrics.jsonl", "completions.jsonl"):
        with open(os.path.join(to, name)) as f:
            kept = [line for line in f if json.loads(line)["step"] <= 3]
        with open(os.path.join(to, name), "w") as f:
            f.write("".join(kept))

