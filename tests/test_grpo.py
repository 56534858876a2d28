"""GRPO (`train.objective=grpo`): the loss of every loss type, its gradients and TRL's metrics against an independent
float64 transcription of TRL's `GRPOTrainer._compute_loss` (and its reward scaling) on `transformers` log-probs of
the same tiny model, on one device and on pipeline and ZeRO layouts; the importance ratio of an unchanged policy is
exactly 1 (no clipping), and a second pass on the same completions follows the formula."""
import os
import sys

import jax
import numpy as np
import pytest

try:  # the `interop` extra
    import torch
except ImportError:
    torch = None

sys.path.insert(0, os.path.dirname(__file__))
from helpers import (EQUIVALENT_LAYOUTS as LAYOUTS, float64_config, float64_llamas, random_groups,  # noqa: E402
                     steps_for, tiny_config)
from jaxpar.formats import hf  # noqa: E402
from jaxpar.rl import advantages as adv_mod  # noqa: E402
from jaxpar.rl import rows as rows_mod  # noqa: E402
from jaxpar.train.objectives import TokenLogps  # noqa: E402

pytestmark = pytest.mark.xdist_group("test_grpo")

V, T, G, PROMPTS = 300, 32, 4, 4
ROWS = G * PROMPTS
RTOL = 1e-9


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(policy dir, reference dir, policy model, reference model): two random float64 Llamas of one shape."""
    for name in ("torch", "transformers"):
        pytest.importorskip(name)
    return float64_llamas(tmp_path_factory, V)


def make_round(seed=0):
    """PROMPTS prompts, G completions each (token ids), rewards from two functions (one returns None sometimes) and
    which completions were truncated."""
    rng = np.random.default_rng(seed)
    prompts, completions = random_groups(rng, PROMPTS, G, V)
    per_fn = np.stack([rng.integers(0, 2, ROWS).astype(float), rng.normal(size=ROWS)], 1)
    per_fn[3, 1] = np.nan
    return prompts, completions, per_fn, rng.random(ROWS) < 0.25


# ---- the transcription of TRL's math (float64, written from TRL's GRPOTrainer) -------------------------------------

def trl_advantages(per_fn, weights, group, scale):
    """TRL's `_generate_and_score_completions` ("sum_then_normalize"): nansum of the weighted rewards, group mean,
    nanstd (Bessel) per group or over the batch, (r - mean) / (std + 1e-4); NaN advantages -> 0."""
    r = np.nansum(per_fn * np.asarray(weights)[None], 1)
    r[np.isnan(per_fn).all(1)] = np.nan
    g = r.reshape(-1, group)
    mean = np.repeat(np.nanmean(g, 1), group)

    def nanstd(x):
        n = (~np.isnan(x)).sum(-1)
        return np.sqrt(np.nanmean((x - np.nanmean(x, -1, keepdims=True)) ** 2, -1) * n / (n - 1))

    std = np.full(r.shape, nanstd(r)) if scale == "batch" else np.repeat(nanstd(g), group)
    a = r - mean
    if scale != "none":
        a = a / (std + 1e-4)
    return np.nan_to_num(a, nan=0.0)


def trl_loss(lp, old, ref, adv, mask, s):
    """TRL's `_compute_loss` on `[B, Tc]` completion tensors (lp differentiable), settings `s`; -> (loss, metrics)."""
    adv = adv[:, None]
    log_ratio = lp - old
    if s["loss_type"] == "gspo":  # importance_sampling_level="sequence"
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0))[:, None]
    coef_1 = torch.exp(log_ratio)
    kl = (torch.exp(ref - lp) - (ref - lp) - 1) * (coef_1 if s["bias_kl"] else 1)  # use_bias_correction_kl
    if s["loss_type"] == "cispo":
        per_token = -torch.clamp(coef_1, max=s["eps_high"]).detach() * adv * lp
    else:
        coef_2 = torch.clamp(coef_1, 1 - s["eps"], 1 + s["eps_high"])
        per_token = -torch.min(coef_1 * adv, coef_2 * adv)
    if s["beta"]:
        per_token = per_token + s["beta"] * kl
    if s["loss_type"] in ("grpo", "gspo"):
        loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif s["loss_type"] == "dr_grpo":
        loss = (per_token * mask).sum() / (per_token.size(0) * s["max_len"])
    else:  # dapo, cispo (the global token count), bnpo (one micro-batch: the same)
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1.0)

    def mean(x):
        if x.shape[1] == 1:
            return (x.sum() / x.shape[0]).item()
        return ((x * mask).sum() / mask.sum()).item()

    m = {"kl": mean(kl.detach())} if s["beta"] else {}
    if s["loss_type"] == "cispo":
        m["cispo_clip_ratio"] = mean(((coef_1 > s["eps_high"]) & (adv > 0)).double())
    else:
        low, high = (coef_1 < 1 - s["eps"]) & (adv < 0), (coef_1 > 1 + s["eps_high"]) & (adv > 0)
        m |= {"clip_ratio/low_mean": mean(low.double()), "clip_ratio/high_mean": mean(high.double()),
              "clip_ratio/region_mean": mean((low | high).double())}
    return loss, m


def completion_logps(model, prompts, completions, grad=True):
    """Each completion's per-token log-probs and entropies under `model`, padded `[B, Tc]`, and the mask."""
    tc = max(len(c) for c in completions)
    lps, ents, mask = [], [], torch.zeros(len(completions), tc, dtype=torch.float64)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        ids = torch.tensor(p + c)
        with torch.set_grad_enabled(grad):
            logp = torch.log_softmax(model(ids[None]).logits[0, :-1], -1)[len(p) - 1:]
        lp = logp.gather(-1, ids[len(p):, None]).squeeze(-1)
        pad = torch.zeros(tc - len(c), dtype=torch.float64)
        lps.append(torch.cat([lp, pad]))
        ents.append(torch.cat([-(logp.exp() * logp).sum(-1).detach(), pad]))
        mask[i, :len(c)] = 1.0
    return torch.stack(lps), torch.stack(ents), mask


def torch_grpo(policy, reference, rnd, s, noise):
    """The transcription on transformers' float64 log-probs: (loss, metrics, grads by name, the batch's inputs)."""
    prompts, completions, per_fn, truncated = rnd
    policy.zero_grad()
    lp, ent, mask = completion_logps(policy, prompts, completions)
    ref = completion_logps(reference, prompts, completions, grad=False)[0]
    rng = np.random.default_rng(7)
    old = lp.detach() + torch.tensor(rng.normal(0, noise, lp.shape)) * mask
    adv = trl_advantages(per_fn, s["weights"], G, s["scale"])
    if s["mask_truncated"]:
        mask = mask * torch.tensor(~truncated)[:, None]
    loss, metrics = trl_loss(lp, old, ref, torch.tensor(adv), mask, s)
    loss.backward()
    metrics["entropy"] = ((ent * mask).sum() / mask.sum()).item()
    k = [len(c) for c in completions]
    inputs = dict(old=[old[i, :n].numpy() for i, n in enumerate(k)], ref=[ref[i, :n].numpy() for i, n in enumerate(k)])
    return loss.item(), metrics, checkpoint_names({n: p.grad.numpy() for n, p in policy.named_parameters()}), inputs


def checkpoint_names(grads):
    """transformers 5's fused experts (`experts.gate_up_proj` `[E, 2I, H]`, `experts.down_proj` `[E, H, I]`) under
    the per-expert names of the checkpoints (`experts.{e}.gate_proj.weight`, ...)."""
    out = {}
    for name, g in grads.items():
        head, _, last = name.rpartition(".")
        if last == "gate_up_proj":
            for e, (gate, up) in enumerate(zip(*np.split(g, 2, axis=1))):
                out[f"{head}.{e}.gate_proj.weight"], out[f"{head}.{e}.up_proj.weight"] = gate, up
        elif last == "down_proj" and g.ndim == 3:
            out |= {f"{head}.{e}.down_proj.weight": d for e, d in enumerate(g)}
        else:
            out[name] = g
    return out


def grpo_config(policy_dir, s, **over):
    c = tiny_config(**{"init_from": f"hf:{policy_dir}", "mesh.data": 1, "model.seq_len": T,
                       "train.global_batch_size": ROWS, "train.objective": "grpo", "grpo.loss_type": s["loss_type"],
                       "grpo.epsilon": s["eps"], "grpo.epsilon_high": s["eps_high"], "grpo.beta": s["beta"],
                       "grpo.max_completion_length": s["max_len"], "grpo.num_generations": G,
                       "grpo.scale_rewards": s["scale"], "grpo.mask_truncated_completions": s["mask_truncated"],
                       "grpo.use_bias_correction_kl": s["bias_kl"], **over})
    return float64_config(hf.apply(c, say=False))


def jaxpar_batch(rnd, s, inputs, st=None):
    """The round as jaxpar's rows: one completion per row, or (`st`: the steps) the shared-prompt rows the run's
    layout takes (`rl/rows.py`: the prompt once, K completions a row)."""
    prompts, completions, per_fn, truncated = rnd
    adv, _ = adv_mod.advantages(adv_mod.rewards_of(per_fn, s["weights"]), G, s["scale"])
    k, seq = 1, T
    if st is not None:
        k = st.objective.per_row(PROMPTS, st.layout.batch_split * st.layout.microbatches, T)
        seq = st.objective.longest_row(T, k, st.layout.context)
    return rows_mod.training_batch(prompts[::G] if st else prompts, completions, G if st else 1, k, seq,
                                   st is not None, adv, inputs["old"], inputs["ref"] if s["beta"] else None,
                                   truncated if s["mask_truncated"] else None).batch


def settings(loss_type, scale="group", beta=0.0, eps=0.2, eps_high=0.0, mask_truncated=False, bias_kl=True):
    return dict(loss_type=loss_type, scale=scale, beta=beta, eps=eps, eps_high=eps_high or eps, max_len=10,
                mask_truncated=mask_truncated, weights=(1.0, 0.5), bias_kl=bias_kl)


def check_against_torch(models, s, over=None, devices=1, noise=0.3, seed=0, shared=False):
    policy_dir, ref_dir, policy, reference = models
    rnd = make_round(seed)
    want, want_metrics, want_grads, inputs = torch_grpo(policy, reference, rnd, s, noise)
    with jax.enable_x64(True):
        c = grpo_config(policy_dir, s, **(over or {}))
        st = steps_for(c, V, jax.devices()[:devices])
        state = st.init_with(hf.load_params(str(policy_dir), st.cfg, st.state_shardings["params"], st.layer_order),
                             0)
        batch = jaxpar_batch(rnd, s, inputs, st if shared else None)
        assert batch["advantages"].shape[1] > 1 if shared else batch["tokens"].shape == (ROWS, T + 1)  # (siblings)
        batch = jax.device_put(batch, st.batch_sharding)
        _, metrics, grads = st.train_with_grads(state, batch)
        metrics, grads = jax.device_get((metrics, grads))
    np.testing.assert_allclose(float(metrics["loss"]), want, rtol=RTOL)
    for k, v in want_metrics.items():
        np.testing.assert_allclose(float(metrics[k]), v, rtol=RTOL, atol=1e-12, err_msg=k)
    clipped = [v for k, v in want_metrics.items() if "clip" in k]
    ours = dict(hf.hf_tensors(grads, st.cfg))
    assert set(ours) == set(want_grads)
    for name, g in want_grads.items():
        np.testing.assert_allclose(ours[name], g, rtol=RTOL, atol=1e-12 * np.abs(g).max(), err_msg=name)
    return clipped


CASES = {  # every loss type and reward scaling; KL on (its bias correction on and off) and off; clipping active
    "dapo_group_kl": settings("dapo", "group", beta=0.1, bias_kl=True),  # (noise 0.3 on the old log-probs) or not
    "grpo_batch": settings("grpo", "batch", mask_truncated=True),
    "dr_grpo_none_kl_unclipped": settings("dr_grpo", "none", beta=0.05, eps=0.99, eps_high=100.0, bias_kl=False),
    "bnpo_group_truncated": settings("bnpo", "group", mask_truncated=True),
    "gspo_batch_kl": settings("gspo", "batch", beta=0.1, eps=0.03, eps_high=0.04, bias_kl=True),
    "cispo_none": settings("cispo", "none", eps_high=1.2),
}


@pytest.mark.parametrize("shared", [False, True], ids=["row_each", "shared_prompt"])
@pytest.mark.parametrize("case", list(CASES))
def test_grpo_losses_equal_trl_on_transformers_logprobs(models, case, shared):
    """Every loss type on a row per completion and on the shared-prompt rows (the prompt once, each completion
    seeing it and itself: `rl/rows.py`), where each completion's normalisation and gspo's ratio are per segment."""
    clipped = check_against_torch(models, CASES[case], shared=shared)
    assert (max(clipped) == 0) if "unclipped" in case else (max(clipped) > 0)  # the clipping active, or not


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_grpo_on_layouts_with_accumulation_equals_trl(models, name):
    """Per-sequence means (grpo) over microbatches of different token counts, the KL term, truncated completions, on
    shared-prompt rows (two completions a row: the rows split over data shards and microbatches)."""
    check_against_torch(models, settings("grpo", "batch", beta=0.1, mask_truncated=True), LAYOUTS[name], devices=8,
                        seed=1, shared=True)


CONTEXT_LAYOUTS = {  # context parallelism: each sequence over 2 devices (the balanced order), with tensor and data
    "context2_gspo": ({"mesh.context": 2}, 2, settings("gspo", "batch", beta=0.1, eps=0.03, eps_high=0.04,
                                                        bias_kl=True)),
    "context2_tensor2_data2_grpo": ({"mesh.context": 2, "mesh.tensor": 2, "mesh.data": 2}, 8,
                                    settings("grpo", "batch", beta=0.1, mask_truncated=True))}


@pytest.mark.parametrize("shared", [False, True], ids=["row_each", "shared_prompt"])
@pytest.mark.parametrize("name", list(CONTEXT_LAYOUTS))
def test_grpo_under_context_parallelism_equals_trl(models, name, shared):
    """Each row's tokens over 2 context devices: the per-token inputs (the old policy's and the reference's
    log-probs) laid out in the context order with them, each completion's normalisation (grpo) and its sequence
    ratio (gspo) summed over the devices holding its tokens."""
    over, devices, s = CONTEXT_LAYOUTS[name]
    check_against_torch(models, s, over, devices=devices, seed=1, shared=shared)


def test_the_old_policys_log_probs_under_context_parallelism_come_back_in_the_rows_order(models):
    """The training forward's per-token log-probs (`TokenLogps`: the old policy's pass, the reference's) on
    (data 2, context 2, tensor 2) equal one device's position for position (float64): each context device writes its
    pieces at their own places, so `old` and the sampler's ratios meet the tokens they belong to."""
    rnd, s = make_round(1), settings("grpo")
    ones = {"old": [np.zeros(len(c)) for c in rnd[1]]}
    got = []
    with jax.enable_x64(True):
        for over, n in (({}, 1), ({"mesh.context": 2, "mesh.tensor": 2, "mesh.data": 2}, 8)):
            st = steps_for(grpo_config(models[0], s, **over), V, jax.devices()[:n])
            params = hf.load_params(str(models[0]), st.cfg, st.state_shardings["params"], st.layer_order)
            batch = jax.device_put(jaxpar_batch(rnd, s, ones), st.batch_sharding)
            got.append(np.asarray(jax.device_get(st.forward(params, batch, TokenLogps(ROWS))[1])))
    assert got[0].shape == (ROWS, T) and np.abs(got[0]).min() > 0
    np.testing.assert_allclose(got[1], got[0], rtol=1e-12, atol=0)


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    """(dir, dir, model, model): a random float64 Qwen3-MoE (8 experts, 2 per token), its own reference."""
    for name in ("torch", "transformers"):
        pytest.importorskip(name)
    import transformers
    from helpers import float64_oracle
    from jaxpar.data import ByteTokenizer
    torch.manual_seed(3)
    m = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=V,
        max_position_embeddings=64, tie_word_embeddings=False, rms_norm_eps=1e-5, head_dim=8, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=24, norm_topk_prob=True, router_aux_loss_coef=0.0)).double()  # TRL: no aux loss
    with torch.no_grad():  # routers sharp enough that the choice matters
        for name, p in m.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.ndim == 1 else 0.1) + (1.0 if "norm" in name else 0.0))
    d = tmp_path_factory.mktemp("moe")
    m.save_pretrained(d)
    ByteTokenizer.to_hf().save(str(d / "tokenizer.json"))
    m = float64_oracle(m.eval())
    return d, d, m, m


def test_grpo_on_an_expert_parallel_moe_equals_trl(moe_model):
    """Qwen3-MoE on (expert 4, data 2): tokens reach their experts by all-to-all; the loss and gradients are TRL's."""
    check_against_torch(moe_model, settings("dr_grpo", "group"), {"mesh.data": 2, "mesh.expert": 4}, devices=8,
                        shared=True)


def test_advantages_follow_trl_for_every_scaling():
    for seed in range(3):
        per_fn = make_round(seed)[2]
        for scale in adv_mod.SCALES:
            got, _ = adv_mod.advantages(adv_mod.rewards_of(per_fn, (1.0, 0.5)), G, scale)
            np.testing.assert_allclose(got, trl_advantages(per_fn, (1.0, 0.5), G, scale), rtol=1e-12)
    zero = adv_mod.advantages(np.r_[np.ones(G), np.arange(G)], G)[1]
    assert zero.tolist() == [True] * G + [False] * G


def test_an_unchanged_policy_has_ratio_one_and_a_second_pass_follows_the_formula(models):
    """float32, epsilon 0: with the old log-probs from a pass of the same params (mu = 1), no token is clipped for
    the advantages or their negation, so every ratio is exactly 1 and the loss is -sum(A) over the tokens / tokens.
    After that update (mu = 2) the same batch's loss and clip fractions are the formula's on the new log-probs."""
    policy_dir = models[0]
    rnd = make_round(4)
    s = settings("dapo", eps=0.0, eps_high=0.0)
    c = hf.apply(tiny_config(**{"init_from": f"hf:{policy_dir}", "mesh.data": 1, "model.seq_len": T,
                                "train.global_batch_size": ROWS, "train.objective": "grpo", "grpo.epsilon": 0.0,
                                "grpo.num_generations": G, "grpo.max_completion_length": 10,
                                "optim.lr": 1e-2}), say=False)
    st = steps_for(c, V, jax.devices()[:1])
    params = hf.load_params(str(policy_dir), st.cfg, st.state_shardings["params"], st.layer_order)
    zeros = [np.zeros(len(x)) for x in rnd[1]]
    batch = jaxpar_batch(rnd, s, {"old": zeros, "ref": zeros})
    put = lambda b: jax.device_put({k: v.astype(np.float32) if v.dtype == np.float64 else v  # noqa: E731
                                    for k, v in b.items()}, st.batch_sharding)
    logps = lambda p: np.asarray(st.forward(p, put(batch), TokenLogps(ROWS))[1])  # noqa: E731
    batch["old"] = logps(params)
    mask, adv = batch["mask"], batch["advantages"]
    assert (adv > 0).any() and (adv < 0).any()
    for sign in (-1, 1):
        state = st.init_with(jax.tree.map(np.asarray, jax.device_get(params)), 0)
        new, m = st.train(state, put({**batch, "advantages": sign * adv}))
        m = jax.device_get(m)
        assert [float(m[k]) for k in ("clip_ratio/low_mean", "clip_ratio/high_mean")] == [0.0, 0.0]
        np.testing.assert_allclose(float(m["loss"]), -(sign * adv * mask).sum() / mask.sum(), rtol=1e-6)
    lp1 = logps(new["params"])
    ratio = np.exp(lp1.astype(np.float64) - batch["old"])
    want = (-np.minimum(ratio * adv, adv) * mask).sum() / mask.sum()  # (adv `[rows, 1]`: one completion a row)
    m = jax.device_get(st.train(new, put(batch))[1])
    np.testing.assert_allclose(float(m["loss"]), want, rtol=1e-5)
    tokens = mask.sum()
    low, high = ((ratio < 1) & (adv < 0)), ((ratio > 1) & (adv > 0))
    np.testing.assert_allclose(float(m["clip_ratio/low_mean"]), (low * mask).sum() / tokens, rtol=1e-6)
    np.testing.assert_allclose(float(m["clip_ratio/high_mean"]), (high * mask).sum() / tokens, rtol=1e-6)
    assert 0 < (low * mask).sum() and 0 < (high * mask).sum() and abs(float(m["loss"]) - want) < 1e-3


def test_a_round_sampled_by_the_engine_trains_with_ratio_exactly_one(tmp_path):
    """A round from the generation engine on the training state's params: G completions per prompt, scored by a
    user's FILE.py reward, TRL's advantages; the engine's model log-probs within 2e-6 of the training forward's; with
    the training forward's as the old policy's (mu = 1), no token is clipped at epsilon 0 for the advantages or their
    negation: every ratio is exactly 1."""
    from jaxpar.generate.engine import Engine
    from jaxpar.rl import rewards, rollout
    f = tmp_path / "parity.py"
    f.write_text("def odd(completion_ids, **kw):\n    return [sum(i % 2 for i in c) / len(c) for c in completion_ids]\n")
    fns, w = rewards.load(f"{f}:odd")
    c = tiny_config(**{"mesh.data": 1, "model.seq_len": T, "train.global_batch_size": ROWS, "train.objective": "grpo",
                       "grpo.epsilon": 0.0, "grpo.num_generations": G, "grpo.max_completion_length": 8})
    st = steps_for(c, V, jax.devices()[:1])
    state = st.init(0)
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
    done = rollout.sample(Engine.on_steps(st, state["params"], c), prompts, G, 8, seed=3, temperature=1.0)
    n = len(prompts) * G
    assert len(done) == n and len({tuple(x.tokens) for x in done}) > 1
    k = st.objective.per_row(len(prompts), 1, T)  # shared-prompt rows (the default): G completions a row
    batch, per_fn, _, a, _, _ = rollout.round_batch(prompts, [{"prompt": "p"}] * len(prompts), done, fns, w, G,
                                                    "group", st.objective.longest_row(T, k), per_row=k, shared=True)
    assert (a > 0).any() and (a < 0).any() and per_fn.shape == (n, 1) and batch["advantages"].shape == (2, G)
    put = lambda b: jax.device_put({k: v.astype(np.float32) if v.dtype == np.float64 else v  # noqa: E731
                                    for k, v in b.items()}, st.batch_sharding)
    trained = rollout.with_old_logps(st, state["params"], put(batch))
    mask = batch["mask"] > 0
    np.testing.assert_allclose(np.asarray(trained["old"])[mask], batch["old"][mask], atol=2e-6)  # the engine's
    params = jax.device_get(state["params"])
    for sign in (-1, 1):
        m = jax.device_get(st.train(st.init_with(jax.tree.map(np.asarray, params), 0),
                                    {**trained, "advantages": put({"a": sign * batch["advantages"]})["a"]})[1])
        assert [float(m[k]) for k in ("clip_ratio/low_mean", "clip_ratio/high_mean")] == [0.0, 0.0], sign

