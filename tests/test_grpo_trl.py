"""GRPO against TRL 1.16's own `GRPOTrainer` (not a transcription): a real `trl.GRPOTrainer` around a tiny float64
Llama scores a round of completions with its `_compute_loss`, and its loss, gradients and logged metrics (the KL that
`use_bias_correction_kl` changes, the entropy, the clip fractions) equal jaxpar's step in float64, with the correction
on and off, at ratio 1 (no old log-probs: TRL takes the policy's own, detached; jaxpar's batch has no `old`, mu = 1)
and at ratios away from 1 (perturbed old log-probs, mu = 2); and its `_calculate_rewards` calls a reward function
with the keywords `rewards.score` passes.

The reference model's and the old policy's log-probs are inputs of the loss: TRL computes them (its reference model,
read from the second Llama's directory, through `_get_per_token_logps_and_entropies`) and both sides get the same
numbers. TRL's fused LM head (`trl.kernels.ChunkedLogProbFunction`) accumulates the softmax in float32 (relative
errors of 1e-7), which would make no float64 oracle: `exact_logprobs` (the same function, its log-softmax in the
model's float64) stands in for that kernel alone, checked against it to float32's precision; everything else (the
backbone call, the label shift and mask, `_compute_loss`) is TRL's."""
import dataclasses
import os
import sys
import types

import jax
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from helpers import float64_config, float64_llamas, random_groups, steps_for, tiny_config  # noqa: E402
from jaxpar.formats import hf  # noqa: E402
from jaxpar.rl import advantages as adv_mod  # noqa: E402
from jaxpar.rl import importance, rewards  # noqa: E402
from jaxpar.rl import rows as rows_mod  # noqa: E402

pytestmark = pytest.mark.xdist_group("test_grpo_trl")

V, T, G, PROMPTS, BETA, MAX_LEN = 300, 32, 4, 2, 0.1, 10
ROWS = G * PROMPTS
RTOL = 1e-9  # float64 on both sides (tests/test_grpo.py's bound)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(policy dir, reference dir, policy model, reference model): two random float64 Llamas of one shape."""
    for name in ("torch", "transformers", "trl", "datasets"):
        pytest.importorskip(name)
    return float64_llamas(tmp_path_factory, V)


def exact_logprobs(hidden, weight, bias, targets, temperature, chunk_size, softcap=None, logit_scale=1.0,
                   outputs=("log_probs",)):
    """`ChunkedLogProbFunction.apply`'s function (its arguments, its five outputs) in the inputs' dtype."""
    import torch
    z = torch.nn.functional.linear(hidden, weight, bias) * logit_scale
    z = z if softcap is None else softcap * torch.tanh(z / softcap)
    logp = torch.log_softmax(z / temperature, -1)
    entropy = -(logp.exp() * logp).sum(-1) if "entropy" in outputs else None
    return logp.gather(-1, targets[:, None]).squeeze(-1), entropy, None, None, None


def zero(completions, **kw):
    return [0.0] * len(completions)


def trl_trainer(models, tmp_path, loss_type="dapo", bias_kl=True, reward=zero):
    """A `trl.GRPOTrainer` on the fixture's float64 policy (one micro-batch: the whole round), its reference model
    the fixture's second Llama."""
    import trl
    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast
    policy_dir, ref_dir, policy, _ = models
    policy.config._name_or_path = str(ref_dir)  # (where TRL reads its reference model from)
    tok = PreTrainedTokenizerFast(tokenizer_file=str(policy_dir / "tokenizer.json"), pad_token="<pad>")
    args = trl.GRPOConfig(str(tmp_path / "trl"), beta=BETA, use_bias_correction_kl=bias_kl, loss_type=loss_type,
                          epsilon=0.2, epsilon_high=0.2, max_completion_length=MAX_LEN, num_generations=G,
                          per_device_train_batch_size=ROWS, report_to="none", use_cpu=True, bf16=False,
                          save_strategy="no")
    trainer = trl.GRPOTrainer(policy, reward, args, train_dataset=Dataset.from_dict({"prompt": ["a", "b"]}),
                              processing_class=tok)
    trainer.current_gradient_accumulation_steps = 1  # (what TRL's train loop sets: one micro-batch per step)
    trainer.model.train()
    return trainer


def make_round(seed=5):
    """PROMPTS prompts of 3-6 tokens, G completions of 2-8 tokens each, and their group-relative advantages."""
    rng = np.random.default_rng(seed)
    prompts, completions = random_groups(rng, PROMPTS, G, V)
    return prompts, completions, adv_mod.advantages(rng.normal(size=ROWS), G, "group")[0]


def trl_inputs(prompts, completions, advantages):
    """`_compute_loss`'s inputs as `_generate_and_score_completions` leaves them: prompts left-padded, completions
    right-padded (the log-probs are added by the caller)."""
    import torch
    lp, lc = max(map(len, prompts)), max(map(len, completions))
    out = {k: torch.zeros(ROWS, n, dtype=torch.long) for k, n in
           (("prompt_ids", lp), ("prompt_mask", lp), ("completion_ids", lc), ("completion_mask", lc))}
    for i, (p, c) in enumerate(zip(prompts, completions)):
        out["prompt_ids"][i, lp - len(p):], out["prompt_mask"][i, lp - len(p):] = torch.tensor(p), 1
        out["completion_ids"][i, :len(c)], out["completion_mask"][i, :len(c)] = torch.tensor(c), 1
    return out | {"advantages": torch.tensor(advantages), "num_items_in_batch": out["completion_mask"].sum()}


def jaxpar_step(policy_dir, loss_type, bias_kl, batch, mode="none"):
    """jaxpar's float64 step on the round (`batch`: with `old` mu = 2, else mu = 1): (metrics, grads by name)."""
    c = tiny_config(**{"init_from": f"hf:{policy_dir}", "mesh.data": 1, "model.seq_len": T,
                       "train.global_batch_size": ROWS, "train.objective": "grpo", "grpo.loss_type": loss_type,
                       "grpo.epsilon": 0.2, "grpo.beta": BETA, "grpo.use_bias_correction_kl": bias_kl,
                       "grpo.max_completion_length": MAX_LEN, "grpo.num_generations": G,
                       "grpo.num_iterations": 2 if "old" in batch else 1, "grpo.importance_sampling": mode})
    with jax.enable_x64(True):
        st = steps_for(float64_config(hf.apply(c, say=False)), V, jax.devices()[:1])
        state = st.init_with(hf.load_params(str(policy_dir), st.cfg, st.state_shardings["params"], st.layer_order),
                             0)
        _, metrics, grads = st.train_with_grads(state, jax.device_put(batch, st.batch_sharding))
        metrics, grads = jax.device_get((metrics, grads))
    return metrics, dict(hf.hf_tensors(grads, st.cfg))


CASES = {  # loss type, use_bias_correction_kl, the old log-probs' noise (0: ratio 1; 0.3: ratios clipped), and
    # grpo.importance_sampling (the sampler's log-probs: the old ones perturbed again)
    "dapo_corrected_ratio_one": ("dapo", True, 0.0, "none"),
    "grpo_uncorrected_ratio_one": ("grpo", False, 0.0, "none"),
    "grpo_corrected_off_policy": ("grpo", True, 0.3, "none"),
    "dapo_uncorrected_off_policy": ("dapo", False, 0.3, "none"),
    "dapo_token_truncate_ratio_one": ("dapo", True, 0.0, "token_truncate"),
    "grpo_sequence_mask_off_policy": ("grpo", True, 0.3, "sequence_mask"),
    # the shared-prompt rows (`rl/rows.py`): per-completion means and per-completion importance ratios within a row
    "grpo_sequence_truncate_off_policy_shared": ("grpo", True, 0.3, "sequence_truncate"),
    "dapo_token_mask_off_policy_shared": ("dapo", False, 0.3, "token_mask"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_grpo_equals_trls_own_compute_loss(models, case, tmp_path, monkeypatch):
    import torch
    loss_type, bias_kl, noise, mode = CASES[case]
    shared = case.endswith("_shared")
    prompts, completions, advantages = make_round()
    trainer = trl_trainer(models, tmp_path, loss_type, bias_kl)
    inputs = trl_inputs(prompts, completions, advantages)
    mask = inputs["completion_mask"] > 0
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    logps = lambda model, entropy=True: trainer._get_per_token_logps_and_entropies(  # noqa: E731
        model, ids, attention, mask.shape[1], compute_entropy=entropy)[:2]
    with torch.no_grad():
        own = logps(trainer.model)  # TRL's kernel, its softmax accumulated in float32
        monkeypatch.setattr("trl.trainer.utils._ChunkedLogProbFunction", types.SimpleNamespace(apply=exact_logprobs))
        lp, entropy = logps(trainer.model)
        inputs["ref_per_token_logps"] = logps(trainer.ref_model, entropy=False)[0]
    np.testing.assert_allclose(own[0][mask].numpy(), lp[mask].numpy(), rtol=1e-6)  # the stand-in: the kernel's
    np.testing.assert_allclose(own[1][mask].numpy(), entropy[mask].numpy(), rtol=1e-6)  # function
    if noise:
        inputs["old_per_token_logps"] = lp + torch.tensor(np.random.default_rng(7).normal(0, noise, lp.shape)) * mask
    if mode != "none":  # TRL's `vllm_importance_sampling_*` with sampler log-probs 0.05 from the old ones
        old = inputs.get("old_per_token_logps", lp)
        sampled = old + torch.tensor(np.random.default_rng(8).normal(0, 0.05, lp.shape)) * mask
        inputs["importance_sampling_ratio"] = trl_is_ratio(old, sampled, mask.double(), mode, None, 1.02 if "mask"
                                                           in mode else 1.03)
        trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
    trainer.model.zero_grad()
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    want_grads = {n: p.grad.numpy() for n, p in trainer.model.named_parameters()}
    want = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    rows = lambda x: [x[i, :len(c)].numpy() for i, c in enumerate(completions)]  # noqa: E731
    k = G if shared else 1  # shared-prompt rows: a group's prompt once, its G completions (`rl/rows.py`)
    laid = rows_mod.training_batch(prompts[::G] if shared else prompts, completions, G if shared else 1, k,
                                   T - MAX_LEN + k * (MAX_LEN + 1) if shared else T, shared, advantages,
                                   rows(inputs.get("old_per_token_logps", lp)), rows(inputs["ref_per_token_logps"]))
    batch = laid.batch
    if mode != "none":  # jaxpar's ratios of the same log-probs (`rl/importance.py`), laid out as the batch is
        batch["is_ratio"] = importance.ratios(batch["old"], rows_mod.place(laid, rows(sampled)), batch["mask"], mode,
                                              0.0, 1.02 if "mask" in mode else 1.03, rows_mod.members(batch), k)[0]
    if not noise:
        del batch["old"]  # the policy's own log-probs, detached: ratio exactly 1
    metrics, grads = jaxpar_step(models[0], loss_type, bias_kl, batch, mode)
    assert ("segments" in batch) == shared
    np.testing.assert_allclose(float(metrics["loss"]), loss.item(), rtol=RTOL)
    for name in ("kl", "entropy"):
        np.testing.assert_allclose(float(metrics[name]), want[name], rtol=RTOL, atol=1e-12, err_msg=name)
    for name in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):  # TRL: clipped tokens
        assert np.float32(metrics[name]) == want[name], name  # / tokens in float32 (`.float()`), exactly
    assert (want["clip_ratio/region_mean"] > 0) == bool(noise)  # the clipping active off policy
    assert set(grads) == set(want_grads)
    for name, g in want_grads.items():
        np.testing.assert_allclose(grads[name], g, rtol=RTOL, atol=1e-12 * np.abs(g).max(), err_msg=name)


def trl_is_ratio(old, sampled, mask, mode, clip_min, clip_max):
    """TRL 1.16's `_generate_and_score_completions` importance-sampling ratio (`vllm_importance_sampling_mode`),
    transcribed in float64: `[B, T]` per token, `[B, 1]` per sequence."""
    import math

    import torch
    diff = torch.nan_to_num((old - sampled) * mask, nan=0.0)
    ratio = torch.exp(diff.sum(-1, keepdim=True) if mode.startswith("sequence") else diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    lo = clip_min if clip_min is not None else -math.inf
    hi = clip_max if clip_max is not None else math.inf
    return ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_importance_ratios_equal_trls(mode):
    """`rl/importance.py` against the transcription of TRL's formulas: both bounds and none below, NaN sampler
    log-probs counting as no difference, and TRL's five metrics."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    mask = (rng.random((6, 9)) < 0.7).astype(float)
    old = rng.normal(-2, 1, (6, 9))
    sampled = old + rng.normal(0, 0.6, (6, 9))
    sampled[1, 2] = np.nan
    for lo, hi in ((0.0, 3.0), (0.8, 1.25)):
        got, metrics = importance.ratios(old, sampled, mask, mode, lo, hi)
        want = trl_is_ratio(*(torch.tensor(a) for a in (old, sampled, mask)), mode, lo or None, hi).numpy()
        np.testing.assert_allclose(got, np.broadcast_to(want, got.shape), rtol=1e-15)
        assert 0 < (got[mask > 0] != 1).mean() and ((got == 0).any() == (mode.endswith("mask")))
        on = mask > 0
        flat = want.ravel() if mode.startswith("sequence") else want[on]
        delta = np.abs(old - sampled)[on & ~np.isnan(sampled)]
        assert metrics == pytest.approx({
            "sampling/sampling_logp_difference/mean": delta.mean(), "sampling/sampling_logp_difference/max":
            delta.max(), "sampling/importance_sampling_ratio/min": flat.min(),
            "sampling/importance_sampling_ratio/mean": flat.mean(), "sampling/importance_sampling_ratio/max":
            flat.max()}, rel=1e-12)


def test_reward_functions_get_the_keywords_trls_calculate_rewards_passes(models, tmp_path):
    """TRL's `_calculate_rewards` and `rewards.score` call a reward function with the same keywords (jaxpar's
    `max_completion_length` besides): `prompts`, `completions`, `completion_ids`, every record column but `prompt`,
    `completion`, `completion_ids`, `trainer_state` (jaxpar's with attribute names of TRL's `TrainerState`),
    `log_extra`, `log_metric`; what it logs lands as in TRL; a `log_extra` of another length is one line naming it."""
    calls = []

    def spy(prompts, completions, completion_ids, **kw):
        calls.append(set(kw))
        kw["log_metric"]("steps", kw["trainer_state"].global_step)
        kw["log_extra"]("level", [lv * 2 for lv in kw["level"]])
        return [float(len(c)) for c in completion_ids]

    recs = [{"prompt": "q", "completion": "x", "completion_ids": [9], "solution": "1", "level": lv} for lv in range(4)]
    ids = [[1], [1, 2], [3], [4, 5, 6]]
    trainer = trl_trainer(models, tmp_path, reward=spy)
    want = trainer._calculate_rewards(recs, ["q"] * 4, ["a", "b", "c", "d"], ids)
    state = rewards.TrainerState(global_step=3, max_steps=10, epoch=0.5, num_input_tokens_seen=100)
    log = rewards.RewardLog(4, state)
    got = rewards.score([("spy", spy)], ["q"] * 4, ["a", "b", "c", "d"], ids, recs, log, max_completion_length=8)
    np.testing.assert_array_equal(got[:, 0], want[:, 0].numpy())
    assert calls[1] - {"max_completion_length"} == calls[0] == {"solution", "level", "trainer_state", "log_extra",
                                                                "log_metric"}
    assert {f.name for f in dataclasses.fields(rewards.TrainerState)} <= set(vars(trainer.state))
    assert log.extra == dict(trainer._pending_extra_logs) == {"level": [0, 2, 4, 6]}
    assert log.means() == {"steps": 3.0} and trainer._pending_metrics["steps"] == [0]
    with pytest.raises(rewards.RewardError) as e:  # (a call of 3 completions logging a column for 4)
        rewards.score([("spy", spy)], ["q"] * 3, ["a", "b", "c"], ids[:3], recs[:3], log)
    assert str(e.value) == ("reward function 'spy': log_extra('level', ...) got 3 values for 4 completions; give one "
                            "per completion."), str(e.value)
