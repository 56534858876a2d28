"""DPO (`train.objective=dpo`): the loss, TRL's metrics and the gradients against DPO's formula on `transformers`
log-probs of the same tiny model in float64, on one device and on pipeline and ZeRO layouts; the reference model
stays bitwise unchanged."""
import json
import os
import sys

import jax
import numpy as np
import pytest

try:  # the `interop` extra: only the tests against transformers need it (the fixture `models` skips them without it)
    import torch
    import transformers
except ImportError:
    torch = transformers = None

sys.path.insert(0, os.path.dirname(__file__))
from helpers import (EQUIVALENT_LAYOUTS as LAYOUTS, chat_tokenizer, float64_config, float64_llamas,  # noqa: E402
                     random_hf_llama, steps_for, tiny_config, write_jsonl)
from jaxpar import data, model, trainer  # noqa: E402
from jaxpar.config import ConfigError  # noqa: E402
from jaxpar.formats import hf  # noqa: E402

pytestmark = pytest.mark.xdist_group("test_dpo")

V, T, ROWS = 300, 48, 8
# float64 on both sides (transformers' float32 RMSNorm statistics and RoPE angles made float64: `float64_oracle`)
RTOL = 1e-9


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
    for name in ("torch", "transformers"):
        pytest.importorskip(name)
    return float64_llamas(tmp_path_factory, V)


def torch_dpo(policy, reference, pairs, beta, loss="sigmoid", eps=0.0):
    """DPO on transformers' log-probs (float64): the loss (mean over pairs), TRL's metrics, d loss / d every param."""
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
    return total.item(), metrics, {n: p.grad.numpy() for n, p in policy.named_parameters()}


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
    return float(metrics["loss"]), jax.device_get(metrics), jax.device_get(grads), new, before, s.cfg


def check_against_torch(models, pairs, beta, over, loss="sigmoid", eps=0.0, devices=1):
    """jaxpar's first DPO step against `torch_dpo`: the loss, TRL's metrics, every gradient (by Hugging Face name),
    and the reference bitwise unchanged."""
    policy_dir, ref_dir, policy, reference = models
    want, want_metrics, want_grads = torch_dpo(policy, reference, pairs, beta, loss, eps)
    with jax.enable_x64(True):
        c = dpo_config(policy_dir, **{"dpo.beta": beta, "dpo.loss": loss, "dpo.label_smoothing": eps, **over})
        got, metrics, grads, new, before, cfg = jaxpar_dpo(c, policy_dir, ref_dir, rows_of(pairs), devices)
    np.testing.assert_allclose(got, want, rtol=RTOL)
    for k, v in want_metrics.items():
        np.testing.assert_allclose(float(metrics[k]), v, rtol=RTOL, atol=1e-12, err_msg=k)
    ours = dict(hf.hf_tensors(grads, cfg))
    assert set(ours) == set(want_grads)
    for name, g in want_grads.items():
        np.testing.assert_allclose(ours[name], g, rtol=RTOL, atol=1e-12 * np.abs(g).max(), err_msg=name)
    for a, b in zip(jax.tree.leaves(jax.device_get(new["reference"])), jax.tree.leaves(before)):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("loss,eps", [("sigmoid", 0.0), ("sigmoid", 0.1), ("ipo", 0.0)])
def test_dpo_equals_the_formula_on_transformers_logprobs(models, loss, eps):
    check_against_torch(models, make_pairs(), 0.2, {}, loss, eps)




@pytest.mark.parametrize("name", list(LAYOUTS))
def test_dpo_on_layouts_with_accumulation_equals_the_formula(models, name):
    check_against_torch(models, make_pairs(seed=1), 0.1, LAYOUTS[name], devices=8)


# ---- preference records through the data pipeline and the trainer ---------------------------------------------------

WORDS = "the quick brown fox jumps over lazy dog what is it answer be brief hello world".split()


def preference_records(n=48, seed=0):
    """TRL's two explicit-prompt forms alternating: strings, and messages (`prompt` a conversation, `chosen` and
    `rejected` the assistant's reply)."""
    rng = np.random.default_rng(seed)
    say = lambda k: " ".join(rng.choice(WORDS, k))  # noqa: E731
    out = []
    for i in range(n):
        p, c, r = say(rng.integers(2, 7)), say(rng.integers(1, 6)), say(rng.integers(1, 6))
        if i % 2:
            out.append({"prompt": p + "?", "chosen": " " + c, "rejected": " " + r})
        else:
            msg = lambda role, text: [{"role": role, "content": text}]  # noqa: E731
            out.append({"prompt": msg("user", p), "chosen": msg("assistant", c), "rejected": msg("assistant", r)})
    return out


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """(root, a random Llama with a ChatML tokenizer, written by jaxpar: no torch needed) and pairs.jsonl."""
    root = tmp_path_factory.mktemp("dpo_chat")
    d = root / "model"
    chat_tokenizer(d)
    random_hf_llama(d, data.load_tokenizer(d), seed=2, layers=4, mlp=48, max_positions=128)
    write_jsonl(root / "pairs.jsonl", preference_records())
    return root, d


def chat_dpo_config(root, d, source="pairs.jsonl", **over):
    c = tiny_config(**{"mesh.data": 1, "train.global_batch_size": 4, "model.seq_len": 64, "train.objective": "dpo",
                       "data.packing": "bfd", **over})
    c.init_from = f"hf:{d}"
    c.data.update(sources=str(root / source), cache_dir=str(root / "cache"), val_fraction=0.2)
    return hf.apply(c, say=False)


def documents(info):
    """Every document of a prepared source: (ids, mask values)."""
    s = info.streams()[0]
    b = s.doc_bounds
    return [(s.read(int(b[i]), int(b[i + 1])), s.read(int(b[i]), int(b[i + 1]), masks=True))
            for i in range(len(b) - 1)]


def test_a_pair_is_its_prompt_and_chosen_then_its_prompt_and_rejected_as_sft_renders_them(chat_model, capsys):
    """A preference document is SFT's rendering of (prompt, chosen) then of (prompt, rejected) as prompt/completion
    records (the response tokens: SFT's completion mask), the rejected half marked; packed rows keep each pair in one
    row as segments 2k, 2k + 1; chosen identical to rejected is counted and said."""
    root, d = chat_model
    recs = preference_records() + [{"prompt": "same?", "chosen": " yes", "rejected": " yes"}]
    write_jsonl(root / "with_identical.jsonl", recs)
    sft = [{"prompt": r["prompt"], "completion": r[k]} for r in recs for k in ("chosen", "rejected")]
    write_jsonl(root / "as_sft.jsonl", sft)
    pairs = documents(data.prepare(chat_dpo_config(root, d, "with_identical.jsonl")))
    assert "1 preference records have `chosen` identical to `rejected`" in capsys.readouterr().err
    singles = documents(data.prepare(chat_dpo_config(root, d, "as_sft.jsonl", **{"train.objective": "lm"})))
    assert len(pairs) == len(recs) and len(singles) == 2 * len(recs)
    for (ids, m), (ci, cm), (ri, rm) in zip(pairs, singles[0::2], singles[1::2]):
        np.testing.assert_array_equal(ids, np.concatenate([ci, ri]))
        np.testing.assert_array_equal(m, np.concatenate([cm, rm | 2]))
        assert cm.any() and rm.any()
    c = chat_dpo_config(root, d)
    b = data.Batches(data.prepare(c), "train", 64, 4, pairs=True, packing="bfd")
    for r in range(4):
        rows = b.rows(0)
        seg = rows["segments"][r]
        n = seg.max() + 1
        assert n % 2 == 0 and all(((seg == s).sum() > 0) for s in range(n))


@pytest.mark.parametrize("case", ["missing_rejected", "no_response_left", "text_source", "packing", "beta", "keys"])
def test_bad_preference_input_is_one_line(chat_model, tmp_path, case):
    root, d = chat_model
    recs = preference_records(8)
    over, source = {}, "bad.jsonl"
    if case == "missing_rejected":
        recs[5] = {"prompt": "hi?", "chosen": " yes"}
        want = "bad.jsonl, line 6: a preference record needs `chosen` and `rejected`; `rejected` is missing"
    elif case == "no_response_left":
        recs[3]["prompt"] = " ".join(WORDS * 8) + "?"
        want = "1 preference pairs have no response token left"
    elif case == "text_source":
        (root / "plain.txt").write_text("hello world " * 400)
        source, want = "plain.txt", "holds no preference pairs"
    elif case == "packing":
        over, want = {"data.packing": "concat"}, "set --config.data.packing=bfd"
    elif case == "beta":
        over, want = {"dpo.beta": 0.0}, "dpo.beta=0.0 must be a finite number > 0"
    else:
        over, want = {"train.objective": "lm", "dpo.beta": 0.5}, "dpo.beta=0.5 with train.objective='lm'"
    write_jsonl(root / "bad.jsonl", recs)
    with pytest.raises((data.DataError, ConfigError)) as e:
        trainer.run(chat_dpo_config(root, d, source, **{"train.steps": 1, **over}), str(tmp_path / "run"),
                    jax.devices()[:1])
    assert want in str(e.value) and "\n" not in str(e.value).replace("invalid config:\n", ""), str(e.value)
    assert not (tmp_path / "run" / "checkpoints").exists()


def run_losses(config, workdir):
    with jax.enable_x64(True):
        trainer.run(config, str(workdir), jax.devices()[:2])
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r], [r for r in rows if "val_loss" in r]


def test_precomputed_reference_gives_the_live_reference_losses(chat_model, tmp_path):
    """The same float64 DPO run with the reference live (a frozen copy) and precomputed (`dpo.precompute_reference`:
    no reference in the state): the same losses, metrics and evaluation; resumed, the precomputed run reads its
    reference back."""
    root, d = chat_model
    runs = {}
    for name, pre, stops in (("live", False, (3,)), ("precomputed", True, (2, 3))):
        for steps in stops:  # the precomputed run stopped after step 2 and resumed
            c = float64_config(chat_dpo_config(root, d, **{"train.steps": steps, "dpo.precompute_reference": pre,
                                                          "mesh.data": 2, "optim.lr": 1e-2, "optim.warmup_steps": 0}))
            c.log.update(every_steps=1, progress=False)
            c.eval.update(every_steps=3, batches=2)
            c.checkpoint.update(every_steps=2, async_save=False)
            runs[name] = run_losses(c, tmp_path / name)
    (live, live_val), (pre, pre_val) = runs["live"], runs["precomputed"]
    assert len(live) == 3
    keys = ["loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
            "logps/rejected"]
    for a, b in zip(live, pre):
        np.testing.assert_allclose([b[k] for k in keys], [a[k] for k in keys], rtol=1e-12, atol=1e-15)
    for k in ["val_loss", "val_rewards/accuracies", "val_logps/chosen"]:  # at step 3
        np.testing.assert_allclose(pre_val[-1][k], live_val[-1][k], rtol=1e-12)
    assert sorted(p.name for p in (tmp_path / "precomputed" / "reference_logps").iterdir()) == \
        ["made_by.json", "train-0.npy", "val-0.npy"]
    assert live[0]["rewards/chosen"] == 0 and live[1]["rewards/chosen"] != 0  # the policy starts as the reference


def test_with_lora_the_reference_is_the_base_model(chat_model):
    """With LoRA the reference is the policy with its adapters off: its sums equal the base model's (no LoRA), while
    the adapted policy's rewards are not zero."""
    root, d = chat_model
    with jax.enable_x64(True):
        plain = float64_config(chat_dpo_config(root, d))
        lora = float64_config(chat_dpo_config(root, d, **{"lora.rank": 4, "lora.targets": "all-linear"}))
        batch = data.Batches(data.prepare(plain), "train", 64, 4, pairs=True, packing="bfd").rows(0)
        out = {}
        for name, c in (("plain", plain), ("lora", lora)):
            s = steps_for(c, data.model_vocab(c), jax.devices()[:1])
            params = hf.load_params(str(d), s.cfg, s.state_shardings["params"], s.layer_order)
            if name == "lora":
                adapters = jax.tree.map(lambda a: jax.random.normal(jax.random.key(1), a.shape, a.dtype) * 0.1,
                                        s.init_adapters(0))
                params = model.merge_trainable(adapters, params)
            b = jax.tree.map(lambda a: jax.device_put(a, s.batch_sharding), batch)
            out[name] = np.asarray(s.reference_sums(params, b))
            if name == "lora":
                metrics = s.train(s.init_with(params, 0), b)[1]
        assert np.abs(out["plain"]).sum() > 0
        np.testing.assert_allclose(out["lora"], out["plain"], rtol=1e-12)
        assert abs(float(metrics["rewards/chosen"])) > 1e-6
