"""DPO (`train.objective=dpo`): the loss, TRL's metrics and the gradients against DPO's formula on `transformers`
log-probs of the same tiny model in float64, on one device and on pipeline and ZeRO layouts; the reference model
stays bitwise unchanged."""
import os
import sys

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

sys.path.insert(0, os.path.dirname(__file__))
from helpers import float64_config, steps_for, tiny_config  # noqa: E402
from jaxpar.data import ByteTokenizer  # noqa: E402
from jaxpar.interop import hf  # noqa: E402

pytestmark = pytest.mark.xdist_group("test_dpo")

V, T, ROWS = 300, 48, 8
# float64 on both sides (transformers' float32 RMSNorm statistics and RoPE angles are made float64 by `float64_torch`)
RTOL = 1e-9
COMMON = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=V, max_position_embeddings=64, tie_word_embeddings=False, rms_norm_eps=1e-5,
              bos_token_id=0, eos_token_id=0)


@pytest.fixture(autouse=True)
def float64_torch(monkeypatch):
    """transformers' Llama computes RMSNorm's statistics and RoPE's angles in float32 even in a float64 model: here
    in float64 (RoPE's inverse frequencies stay float32 values, as both libraries store them)."""
    from transformers.models.llama import modeling_llama as ml

    def norm(self, h):
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    def rope(self, x, position_ids):
        freqs = position_ids[..., None].double() * self.inv_freq.double()
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    monkeypatch.setattr(ml.LlamaRMSNorm, "forward", norm)
    monkeypatch.setattr(ml.LlamaRotaryEmbedding, "forward", rope)


def make_pairs(seed=0, n=2 * ROWS):
    """n (chosen, rejected) pairs of (ids, response mask), a shared prompt each; two pairs to a row."""
    rng = np.random.default_rng(seed)
    pairs = []
    for _ in range(n):
        prompt = rng.integers(1, V, rng.integers(3, 7)).tolist()
        seqs = []
        for _ in range(2):
            reply = rng.integers(1, V, rng.integers(2, 6)).tolist()
            seqs.append((np.asarray(prompt + reply), np.r_[np.zeros(len(prompt)), np.ones(len(reply))]))
        pairs.append(tuple(seqs))
    return pairs


def rows_of(pairs):
    """The packed batch: pair k of a row is segments 2k (chosen), 2k + 1 (rejected), as `data/packing.py` packs."""
    tokens = np.zeros((ROWS, T + 1), np.int32)
    segments = np.full((ROWS, T + 1), -1, np.int32)
    mask = np.zeros((ROWS, T + 1), np.int32)
    for r in range(ROWS):
        at = 0
        for k, pair in enumerate(pairs[2 * r:2 * r + 2]):
            for j, (ids, m) in enumerate(pair):
                tokens[r, at:at + ids.size], mask[r, at:at + ids.size] = ids, m
                segments[r, at:at + ids.size] = 2 * k + j
                at += ids.size
    return {"tokens": tokens, "segments": segments, "mask": mask[:, 1:]}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(policy dir, reference dir, policy model, reference model): two random float64 Llamas of one shape."""
    out = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        m = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON)).double()
        with torch.no_grad():
            for name, p in m.named_parameters():
                p.copy_(torch.randn_like(p) * (0.3 if p.ndim == 1 else 0.1) + (1.0 if "norm" in name else 0.0))
        d = tmp_path_factory.mktemp(f"m{seed}")
        m.save_pretrained(d)
        ByteTokenizer.to_hf().save(str(d / "tokenizer.json"))
        out.append((d, m.eval()))
    return out[0][0], out[1][0], out[0][1], out[1][1]


def torch_dpo(policy, reference, pairs, beta, loss="sigmoid", eps=0.0):
    """DPO on transformers' log-probs (float64): the loss (mean over pairs), TRL's metrics, d loss / d lm_head."""
    policy.zero_grad()

    def logps(model, ids, m):
        logits = model(torch.tensor(ids[None])).logits[0]
        lp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ids[1:, None])).squeeze(-1)
        w = torch.tensor(m[1:])
        s = (lp * w).sum()
        return s / w.sum() if loss == "ipo" else s

    with torch.no_grad():
        ref = [[logps(reference, *seq) for seq in pair] for pair in pairs]
    pol = [[logps(policy, *seq) for seq in pair] for pair in pairs]
    total, metrics = 0.0, {k: 0.0 for k in ("rewards/chosen", "rewards/rejected", "rewards/accuracies",
                                             "logps/chosen", "logps/rejected")}
    for (pc, pr), (rc, rr) in zip(pol, ref):
        margin = (pc - pr) - (rc - rr)
        if loss == "ipo":
            total = total + (margin - 1 / (2 * beta)) ** 2
        else:
            f = torch.nn.functional.logsigmoid
            total = total - (1 - eps) * f(beta * margin) - eps * f(-beta * margin)
        c, r = beta * (pc - rc).item(), beta * (pr - rr).item()
        for k, v in zip(metrics, (c, r, float(c > r), pc.item(), pr.item())):
            metrics[k] += v / len(pairs)
    total = total / len(pairs)
    total.backward()
    metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
    return total.item(), metrics, policy.lm_head.weight.grad.numpy().T


def dpo_config(policy_dir, **over):
    c = tiny_config(**{"init_from": f"hf:{policy_dir}", "mesh.data": 1, "model.seq_len": T,
                       "train.global_batch_size": ROWS, "train.objective": "dpo", "data.packing": "bfd", **over})
    return float64_config(hf.apply(c, say=False))


def jaxpar_dpo(config, policy_dir, ref_dir, batch, devices=1):
    """One step from the policy with the reference as its own weights: (loss, metrics, canonical grads, new state,
    the reference it started from)."""
    s = steps_for(config, V, jax.devices()[:devices])
    load = lambda d: hf.load_params(str(d), s.cfg, s.state_shardings["params"], s.layer_order)  # noqa: E731
    state = s.init_with(load(policy_dir), 0)
    state["reference"] = load(ref_dir)
    before = jax.device_get(state["reference"])
    new, metrics, grads = s.train_with_grads(state, jax.tree.map(lambda a: jax.device_put(a, s.batch_sharding),
                                                                 batch))
    return float(metrics["loss"]), jax.device_get(metrics), jax.device_get(grads), new, before


@pytest.mark.parametrize("loss,eps", [("sigmoid", 0.0), ("sigmoid", 0.1), ("ipo", 0.0)])
def test_dpo_equals_the_formula_on_transformers_logprobs(models, loss, eps):
    policy_dir, ref_dir, policy, reference = models
    pairs = make_pairs()
    want, want_metrics, want_dw = torch_dpo(policy, reference, pairs, 0.2, loss, eps)
    with jax.enable_x64(True):
        c = dpo_config(policy_dir, **{"dpo.beta": 0.2, "dpo.loss": loss, "dpo.label_smoothing": eps})
        got, metrics, grads, new, before = jaxpar_dpo(c, policy_dir, ref_dir, rows_of(pairs))
    np.testing.assert_allclose(got, want, rtol=RTOL)
    for k, v in want_metrics.items():
        np.testing.assert_allclose(float(metrics[k]), v, rtol=RTOL, atol=1e-12, err_msg=k)
    np.testing.assert_allclose(grads["lm_head"][:, :V], want_dw, rtol=RTOL, atol=1e-12)
    for a, b in zip(jax.tree.leaves(jax.device_get(new["reference"])), jax.tree.leaves(before)):
        assert np.array_equal(a, b)


LAYOUTS = {"1f1b_2x2x2": {"mesh.data": 2, "mesh.tensor": 2, "mesh.stage": 2, "pipeline.schedule": "1f1b",
                          "train.microbatches": 4},
           "zero3_4x2x1": {"mesh.data": 4, "mesh.tensor": 2, "train.microbatches": 2, "optim.zero_stage": 3}}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_dpo_on_layouts_with_accumulation_equals_the_formula(models, name):
    policy_dir, ref_dir, policy, reference = models
    pairs = make_pairs(seed=1)
    want, want_metrics, want_dw = torch_dpo(policy, reference, pairs, 0.1)
    with jax.enable_x64(True):
        c = dpo_config(policy_dir, **LAYOUTS[name])
        got, metrics, grads, new, before = jaxpar_dpo(c, policy_dir, ref_dir, rows_of(pairs), devices=8)
    np.testing.assert_allclose(got, want, rtol=RTOL)
    for k, v in want_metrics.items():
        np.testing.assert_allclose(float(metrics[k]), v, rtol=RTOL, atol=1e-12, err_msg=k)
    np.testing.assert_allclose(grads["lm_head"][:, :V], want_dw, rtol=RTOL, atol=1e-12)
    for a, b in zip(jax.tree.leaves(jax.device_get(new["reference"])), jax.tree.leaves(before)):
        assert np.array_equal(a, b)
