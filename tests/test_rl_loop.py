"""GRPO's loop inside `trainer.run` (`train.objective=grpo`, `jaxpar/rl/rounds.py`): rounds sampled by the engine on
the training params from prompt records, scored by a user's reward, trained mu times; TRL's metrics; with mu = 1 the
ratio is exactly 1 at every step (no token clipped at epsilon 0); the same seed gives the same run, and a resume
inside a round continues it exactly; bad input is one line before anything compiles."""
import json
import os
import shutil
import sys

import jax
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from helpers import chat_tokenizer, random_hf_llama, tiny_config  # noqa: E402
from rl_runs import rl_base  # noqa: E402
from jaxpar import trainer  # noqa: E402
from jaxpar.data import DataError  # noqa: E402

pytestmark = pytest.mark.xdist_group("test_rl_loop")

TRL_METRICS = ("reward", "reward_std", "rewards/odd/mean", "rewards/odd/std", "frac_reward_zero_std",
               "completions/mean_length", "completions/min_length", "completions/max_length",
               "completions/clipped_ratio", "completions/mean_terminated_length", "num_tokens", "kl", "entropy",
               "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


@pytest.fixture(scope="module")
def material(tmp_path_factory):
    """A tiny chat Llama (hf:DIR), 40 conversational prompt records, and a reward on the completion's token ids written
    for TRL: it reads `trainer_state`, logs a metric (`log_metric`) and a column of the completions (`log_extra`)."""
    root = tmp_path_factory.mktemp("rl")
    rl_base(root)
    (root / "reward.py").write_text("def odd(completion_ids, solution, trainer_state, log_metric, log_extra, **kw):\n"
                                    "    assert len(solution) == len(completion_ids)\n"
                                    "    log_metric('seen_step', trainer_state.global_step)\n"
                                    "    log_extra('ids', [list(c) for c in completion_ids])\n"
                                    "    return [sum(i % 2 for i in c) / len(c) for c in completion_ids]\n")
    return root


def grpo_config(root, **over):
    c = tiny_config(**{"mesh.data": 2, "model.seq_len": 48, "train.global_batch_size": 4, "train.objective": "grpo",
                       "grpo.num_generations": 4, "grpo.max_completion_length": 8, "grpo.rewards":
                       f"{root}/reward.py:odd", "grpo.beta": 0.04, "grpo.epsilon": 0.0, "train.steps": 4,
                       "optim.lr": 3e-3, **over})
    c.init_from = f"hf:{root}/base"
    c.data.update(sources=f"{root}/prompts.jsonl", cache_dir=f"{root}/cache", val_fraction=0.2)
    c.log.update(every_steps=1, progress=False)
    c.eval.update(every_steps=4, batches=1)
    c.checkpoint.update(every_steps=3, keep=3, async_save=False)
    return c


def rows(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return {r["step"]: r for r in map(json.loads, f)}


TIMING = ("tokens_per_s", "step_time_s", "tflops_per_device", "mfu", "data_wait_s", "time/generate_s", "time/score_s",
          "time/train_s", "rollout_tokens_per_s")


def test_a_grpo_run_samples_scores_and_trains_with_ratio_one(material, tmp_path, monkeypatch):
    """4 steps on (data=2), mu = 1, epsilon 0: every TRL metric logged; no token clipped at any step (the ratio of the
    policy to itself is exactly 1); the k3 KL exactly 0 at step 1 (the reference is the starting model) and > 0
    after updates; completions.jsonl holds the logged completions with their rewards and the reward's `log_extra`
    column, shown as TRL shows them (transformers' `decode(ids, skip_special_tokens=True)`), W&B a table of them per
    log; the reward's `log_metric` of `trainer_state.global_step` (the steps before the round); the held-out
    reward; each round's sampling (and the held-out generation) timed by the step watchdog as a part of its own
    (`watchdog.part`: tests/test_failures.py tries its bounds)."""
    pytest.importorskip("wandb")
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("WANDB_MODE", "offline")
    from jaxpar.cluster import watchdog
    parts, part = [], watchdog.part
    monkeypatch.setattr(watchdog, "part", lambda name: parts.append(name) or part(name))
    work = tmp_path / "run"
    c = grpo_config(material)
    c.log.wandb_project = "grpo"
    trainer.run(c, str(work), jax.devices()[:2])
    assert parts == ["sampling"] * 4 + ["evaluation sampling"], parts  # a round per step (mu = 1), one evaluation
    got = rows(work)
    assert sorted(got) == [1, 2, 3, 4]
    for step, r in got.items():
        assert all(k in r for k in TRL_METRICS), sorted(set(TRL_METRICS) - set(r))
        assert [r[f"clip_ratio/{k}_mean"] for k in ("low", "high", "region")] == [0.0] * 3, (step, r)
        assert r["completion_tokens"] == 16 * r["completions/mean_length"]  # 4 prompts x G = 4 completions
        assert r["time/generate_s"] > 0 and r["time/score_s"] > 0 and r["time/train_s"] > 0, r
        assert 0 < r["tokens/prefill"] < r["tokens/train"] < 16 * 48  # each prompt prefilled once; shared rows
        assert r["rollout_tokens_per_s"] * r["time/generate_s"] == pytest.approx(r["completion_tokens"])
    assert got[1]["kl"] == 0.0 and got[4]["kl"] > 0
    assert got[1]["frac_reward_zero_std"] < 1 and got[1]["reward_std"] > 0  # a learning signal to follow
    assert got[1]["num_tokens"] < got[2]["num_tokens"] < got[4]["num_tokens"]
    assert "val_reward" in got[4] and 0 <= got[4]["val_reward"] <= 1
    assert [got[s]["seen_step"] for s in (1, 2, 3, 4)] == [0, 1, 2, 3] and got[4]["val_seen_step"] == 4
    with open(work / "checkpoints" / "4" / "state" / "_METADATA") as f:  # beta > 0, full fine-tuning: a frozen copy
        assert "reference" in f.read()
    with open(work / "completions.jsonl") as f:
        logged = [json.loads(line) for line in f]
    assert len(logged) == 4 * 4 and logged[0]["prompt"][0]["role"] == "user"
    assert logged[0]["completion"][0]["role"] == "assistant" and set(logged[0]["rewards"]) == {"odd"}
    assert list(logged[0]) == ["step", "round", "prompt", "completion", "rewards", "ids", "advantage"]  # TRL's order
    hf = transformers.AutoTokenizer.from_pretrained(str(material / "base"))
    for row in logged:
        assert row["completion"][0]["content"] == hf.decode(row["ids"], skip_special_tokens=True), row
    special = {i for i, t in hf.added_tokens_decoder.items() if t.special}
    assert any(set(row["ids"]) & special for row in logged)  # (special tokens were sampled, and are not shown)
    from helpers import wandb_records
    tables = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
              for f in (work / "wandb").glob("offline-run-*/run-*.wandb") for rec in wandb_records(f)
              if rec.WhichOneof("record_type") == "history"]
    tables = [(t["step"], t["completions/nrows"]) for t in tables if t.get("completions/_type") == "table-file"]
    assert tables == [(1, 4), (2, 4), (3, 4), (4, 4)], tables


def test_lora_grpo_keeps_no_reference_copy_and_starts_at_kl_zero(material, tmp_path):
    """LoRA (fresh rank-4 adapters, beta > 0): the reference is the base with the adapters off, no weights copied into
    the state; the KL is exactly 0 at step 1 (fresh adapters add nothing) and > 0 once they trained."""
    c = grpo_config(material, **{"train.steps": 2, "optim.lr": 3e-2})
    c.lora.update(rank=4, alpha=8.0, targets="all-linear")
    trainer.run(c, str(tmp_path / "run"), jax.devices()[:2])
    got = rows(tmp_path / "run")
    assert got[1]["kl"] == 0.0 and got[2]["kl"] > 0, (got[1]["kl"], got[2]["kl"])
    from jaxpar.state.resume import latest_checkpoint
    assert latest_checkpoint(str(tmp_path / "run"))[0] == 2
    with open(tmp_path / "run" / "checkpoints" / "2" / "state" / "_METADATA") as f:  # the state's tree, as saved
        tree = f.read()
    assert "opt_state" in tree and "reference" not in tree


def test_same_seed_same_run_and_a_resume_inside_a_round_is_exact(material, tmp_path):
    """mu = 2 (two optimizer steps per round, the old policy's log-probs from the training forward): two runs of one
    seed log the same metrics; a run killed after step 3 (a checkpoint inside round 1, its batch and its metrics not
    logged yet kept beside it) and resumed logs step 4 as the uninterrupted run does, and ends with the same
    params. With `grpo.importance_sampling` the round's importance ratios are kept with it too, and are 1: the engine's
    sampling log-probs are the training forward's (to float32's rounding)."""
    over = {"grpo.num_iterations": 2, "grpo.epsilon": 0.2, "grpo.importance_sampling": "sequence_truncate"}
    whole, parted, again = tmp_path / "whole", tmp_path / "parted", tmp_path / "again"
    def config(**more):  # logs every 2 steps, checkpoints every 3: a job killed after step 3 stops between logs
        c = grpo_config(material, **over, **more)
        c.log.every_steps = 2
        return c

    trainer.run(config(), str(whole), jax.devices()[:2])
    trainer.run(config(), str(again), jax.devices()[:2])
    shutil.copytree(whole, parted)  # killed after step 3's checkpoint: what steps 4 wrote is gone
    shutil.rmtree(parted / "checkpoints" / "4")
    os.remove(parted / "rollouts" / "step-4.npz")
    for name in ("metrics.jsonl", "completions.jsonl"):
        kept = [line for line in open(parted / name) if json.loads(line)["step"] <= 3]
        (parted / name).write_text("".join(kept))
    trainer.run(config(), str(parted), jax.devices()[:2])
    a, b, c = rows(whole), rows(parted), rows(again)
    assert sorted(a) == sorted(b) == sorted(c) == [2, 4]
    same = lambda r: {k: v for k, v in r.items() if k not in TIMING}  # noqa: E731
    for step in (2, 4):  # step 4's averages hold round 1's metrics, sampled at step 3 before the kill
        assert same(a[step]) == same(b[step]) == same(c[step]), step
    assert "reward" in a[2] and "reward" in a[4]
    for step in (2, 4):  # the engine decodes with the training forward's code: the sampler's ratio is 1 (float32)
        assert a[step]["sampling/importance_sampling_ratio/mean"] == pytest.approx(1, abs=1e-4)
        assert 0 < a[step]["sampling/sampling_logp_difference/max"] < 1e-4
    logged = lambda w: [json.loads(line)["step"] for line in open(w / "completions.jsonl")]  # noqa: E731
    assert logged(whole) == logged(parted) == [2] * 4 + [4] * 4
    from jaxpar.state.runs import load_params
    pa, pb = load_params(str(whole))[1], load_params(str(parted))[1]
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb)))


def test_an_expert_parallel_moe_run_has_ratio_one(material, tmp_path):
    """A mixture of experts (4 experts, 2 per token) on (expert 2), mu = 2: the round sampled on the expert-parallel
    layout, the old policy's log-probs from the training forward before the first pass, which routes every token as
    that pass does: no token clipped at epsilon 0 in the first pass (the ratio exactly 1); in the second, after an
    update, the ratio moved. The round's batch carries the engine's routes (routing replay), kept with the checkpoint
    inside the round: the resume from it logs step 2 as the uninterrupted run and ends with the same params."""
    from jaxpar.data import BPETokenizer
    from jaxpar.state.runs import load_params
    moe = tmp_path / "moe"
    chat_tokenizer(moe)
    random_hf_llama(moe, BPETokenizer.from_file(moe / "tokenizer.json"), experts=4, experts_per_token=2, expert_mlp=32)
    c = grpo_config(material, **{"mesh.data": 1, "mesh.expert": 2, "train.steps": 2, "grpo.num_iterations": 2})
    c.init_from = f"hf:{moe}"
    c.checkpoint.every_steps = 1
    run, parted = tmp_path / "run", tmp_path / "parted"
    trainer.run(c, str(run), jax.devices()[:2])
    first, second = rows(run)[1], rows(run)[2]
    assert [first[f"clip_ratio/{k}_mean"] for k in ("low", "high", "region")] == [0.0] * 3, first
    assert first["completion_tokens"] > 0 and second["clip_ratio/region_mean"] > 0
    with np.load(run / "rollouts" / "step-1.npz") as f:  # 4 shared-prompt rows (a prompt, its 4 completions) x 64
        # positions x 2 layers x top-2, -1 on padding
        assert f["routes"].shape == (4, 64, 2, 2) and (f["routes"] >= 0).any() and (f["routes"] == -1).any()
    shutil.copytree(run, parted)  # killed after step 1's checkpoint, inside round 0
    shutil.rmtree(parted / "checkpoints" / "2")
    os.remove(parted / "rollouts" / "step-2.npz")
    (parted / "metrics.jsonl").write_text("".join(line for line in open(run / "metrics.jsonl")
                                                  if json.loads(line)["step"] <= 1))
    trainer.run(c, str(parted), jax.devices()[:2])
    same = lambda r: {k: v for k, v in r.items() if k not in TIMING}  # noqa: E731
    assert same(rows(parted)[2]) == same(second)
    pa, pb = load_params(str(run))[1], load_params(str(parted))[1]
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb)))


def test_a_context_parallel_round_samples_rows_longer_than_a_devices_pool(material, tmp_path):
    """On (context 2) each KV block's positions split over the two devices: a pool a device holds 16 positions of
    (two blocks of 8, whole) samples rows of 23-26 positions (prompts of 16-19 tokens, 8 new). The round runs, and
    the engine's log-prob of every sampled token equals the context-parallel training forward's (the old policy's
    pass, float32)."""
    from jaxpar.generate.cache import dry_run_entry
    c = grpo_config(material, **{"mesh.data": 1, "mesh.context": 2, "train.steps": 1, "grpo.kv_block": 8,
                                 "grpo.importance_sampling": "token_truncate"})
    dense = dry_run_entry(c, 2)["paged"]  # (a pool of every slot's whole context: its bytes per block per device)
    whole = 2 * dense["per_device"] // dense["kv_blocks"]  # a block's bytes on a device holding all its positions
    c.grpo.kv_cache_gib = 2 * whole / 2 ** 30
    assert dry_run_entry(c, 2)["paged"]["kv_blocks"] == 4  # 32 positions over the two devices, 16 on each
    trainer.run(c, str(tmp_path / "run"), jax.devices()[:2])
    first = rows(tmp_path / "run")[1]
    assert first["completion_tokens"] > 0 and first["sampling/sampling_logp_difference/max"] < 1e-5, first


@pytest.mark.parametrize("case", ["unknown_reward", "wrong_length", "no_room", "text_source", "no_prompt"])
def test_bad_rl_input_is_one_line(material, tmp_path, case):
    """An unknown reward function, a prompt with no room left for a completion, a source that is not records, a
    record without a prompt: one line before anything compiles or is written; a reward that returns the wrong number
    of values: one line naming it at the first round, no checkpoint written."""
    (tmp_path / "short.py").write_text("def short(completions, **kw):\n    return [1.0]\n")
    (tmp_path / "bad.jsonl").write_text(json.dumps({"question": "hi"}) + "\n")
    (tmp_path / "text.txt").write_text("some text\n")
    over, want = {
        "unknown_reward": ({"grpo.rewards": "jaxpar.rl.rewards:exactly"}, "jaxpar.rl.rewards has no function"),
        "wrong_length": ({"grpo.rewards": f"{tmp_path}/short.py:short"}, "reward function 'short' returned 1 values "
                                                                         "for 16 completions"),
        "no_room": ({"grpo.max_completion_length": 40}, "prompts.jsonl, line 1: the prompt has"),
        "text_source": ({"data.sources": str(tmp_path / "text.txt")}, "is read as text"),
        "no_prompt": ({"data.sources": str(tmp_path / "bad.jsonl")}, "bad.jsonl, line 1: a prompt record needs "
                                                                    "`prompt`")}[case]
    c = grpo_config(material)
    for k, v in over.items():
        c[k.split(".")[0]][k.split(".")[1]] = v
    with pytest.raises(DataError) as e:
        trainer.run(c, str(tmp_path / "run"), jax.devices()[:2])
    assert want in str(e.value) and "\n" not in str(e.value), str(e.value)
    from jaxpar.state.resume import latest_checkpoint
    assert latest_checkpoint(str(tmp_path / "run"))[0] is None
    assert case == "wrong_length" or not (tmp_path / "run" / "checkpoints").exists()  # (the others: before compiling)


def test_the_policy_log_probs_are_the_sampling_temperatures():
    """grpo.temperature 0.7: the training forward's per-token log-probs (the old policy's, `with_old_logps`) are of
    softmax(logits / 0.7), the distribution the engine sampled from (its `logprobs`, no top-k or top-p), as TRL
    computes them; at temperature 1 they would differ by far more than the 2e-6 allowed."""
    from helpers import steps_for
    from jaxpar.generate.engine import Engine
    from jaxpar.rl import rewards, rollout
    T, G, PROMPTS = 32, 4, 2
    fns, w = rewards.load("jaxpar.rl.rewards:soft_overlong")
    c = tiny_config(**{"mesh.data": 1, "model.seq_len": T, "train.global_batch_size": G * PROMPTS,
                       "train.objective": "grpo", "grpo.num_generations": G, "grpo.max_completion_length": 8,
                       "grpo.temperature": 0.7})
    st = steps_for(c, 300, jax.devices()[:1])
    state = st.init(0)
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
    done = rollout.sample(Engine.on_steps(st, state["params"], c), prompts, G, 8, seed=3, temperature=0.7)
    batch = rollout.round_batch(prompts, [{"prompt": "p"}] * PROMPTS, done, fns, w, G, "group", T,
                                      max_completion_length=8).batch
    batch = jax.device_put({k: v.astype(np.float32) if v.dtype == np.float64 else v for k, v in batch.items()},
                           st.batch_sharding)
    old = np.asarray(rollout.with_old_logps(st, state["params"], batch)["old"])
    mask, sampled = np.asarray(batch["mask"]) > 0, np.zeros(old.shape)
    for i, (p, x) in enumerate(zip([p for p in prompts for _ in range(G)], done)):
        sampled[i, len(p) - 1:len(p) - 1 + len(x.tokens)] = x.logprobs
    np.testing.assert_allclose(old[mask], sampled[mask], atol=2e-6)
    untempered = np.zeros(old.shape)
    for i, (p, x) in enumerate(zip([p for p in prompts for _ in range(G)], done)):
        untempered[i, len(p) - 1:len(p) - 1 + len(x.tokens)] = x.model_logprobs
    assert np.abs(untempered[mask] - sampled[mask]).max() > 1e-2


def test_gsm8k_records_become_prompts_as_transformers_renders_them(tmp_path):
    """`grpo.map_records=jaxpar.data.prompts:gsm8k` on records in GSM8K's form (`question`, `answer` ending in
    `#### N`) under Qwen3's released chat template: each prompt's ids are `transformers`' `apply_chat_template` with
    the generation prompt, the solution the number after `####` (its thousands comma dropped), and a completion
    ends at the template's end of turn."""
    transformers = pytest.importorskip("transformers")
    from helpers import released_template
    from jaxpar.data import prompts
    chat_tokenizer(tmp_path / "tok", template=released_template("qwen3"), bos=None, eos="<|im_end|>")
    recs = [{"question": "Janet has 3 ducks and buys 4 more. How many?", "answer": "3 + 4 = 7\n#### 7"},
            {"question": "What is 1000 + 234?", "answer": "It is 1,234.\n#### 1,234"}]
    (tmp_path / "gsm8k.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    c = tiny_config(**{"model.seq_len": 256, "grpo.max_completion_length": 16, "train.objective": "grpo",
                       "grpo.map_records": "jaxpar.data.prompts:gsm8k"})
    c.data.update(sources=str(tmp_path / "gsm8k.jsonl"), tokenizer=str(tmp_path / "tok"), val_fraction=0.0,
                  cache_dir=str(tmp_path / "cache"))
    info, (train, _) = prompts.read(c)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    for rec, ids in zip(train.records, train.ids):
        text = hf.apply_chat_template(rec["prompt"], add_generation_prompt=True, tokenize=False)
        assert list(ids) == hf(text, add_special_tokens=False)["input_ids"]  # (what TRL does: render, tokenize)
    assert [r["solution"] for r in train.records] == ["7", "1234"]
    assert hf.convert_tokens_to_ids("<|im_end|>") in prompts.stop_ids(info, c)
