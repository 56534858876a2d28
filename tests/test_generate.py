"""The generation engine (`jaxpar/generate/`) against `transformers` and against itself across batches and layouts:
tiny random Llama, Qwen3, GPT-2 and Qwen3-MoE models built here (nothing downloaded), imported with `hf.load`.

Greedy tokens equal `transformers`' `generate` of each prompt alone, for a batch of mixed prompt lengths; each token's
model log-prob equals transformers' (1e-4) and the training forward's (`Engine.score`, 1e-5); a MoE token's experts
are transformers' router's top-k; a padded batch equals each row alone; seeded sampling is the same whatever the batch
and the layout ((data 2, tensor 2), expert parallel, ZeRO-3, a pipeline); the sampler's filters equal their formula;
refilling finished slots changes nothing; bad requests are one line each."""
import math
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402

import tiny_checkpoints  # noqa: E402
from helpers import run_config, steps_for, tiny_config  # noqa: E402
from tiny_checkpoints import SAMPLED, V  # noqa: E402
from jaxpar.config import step_rules  # noqa: E402
from jaxpar.generate.cache import cache_bytes, decode_param_bytes, dry_run_entry  # noqa: E402
from jaxpar.generate.engine import Engine, Request  # noqa: E402
from jaxpar.generate.sampling import Sampling, sample  # noqa: E402
from jaxpar.formats import hf  # noqa: E402

pytestmark = pytest.mark.xdist_group("test_generate")
needs8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (host) devices")

PROMPTS = [np.random.default_rng(i).integers(1, V, n).tolist() for i, n in enumerate((3, 9, 14, 5, 7))]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tiny_checkpoints.save(tmp_path_factory)


def hf_greedy(model, prompt, n):
    """transformers' greedy tokens of `prompt` alone, their log-probs, and (MoE) the router top-2 of every position
    but the last (the prompt's, then those whose logits chose each new token)."""
    with torch.no_grad():
        g = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                           pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        toks = g.sequences[0, len(prompt):].tolist()
        lps = [torch.log_softmax(z[0].double(), -1)[t].item() for z, t in zip(g.logits, toks)]
        experts = None
        if hasattr(model.config, "num_experts"):  # the routing of the positions whose logits chose each token
            routers = model(g.sequences, output_router_logits=True).router_logits  # per layer [tokens, experts]
            top = [torch.topk(r, 2, -1).indices[:-1] for r in routers]
            experts = torch.stack(top, 1).numpy()  # [prompt + new tokens - 1, layers, k]
    return toks, np.asarray(lps), experts


@pytest.mark.parametrize("kind", list(tiny_checkpoints.KINDS))
def test_greedy_equals_transformers_and_log_probs_equal_the_training_forward(models, kind):
    model, d = models[kind]
    fwd, params, tok = hf.load(str(d))
    engine = Engine(fwd, params, slots=8, tokenizer=tok, prompt_experts=True)
    outs = engine.generate([Request(p, max_new_tokens=8) for p in PROMPTS])
    scores = engine.score([p + o.tokens for p, o in zip(PROMPTS, outs)])
    for p, o, s in zip(PROMPTS, outs, scores):
        toks, lps, experts = hf_greedy(model, p, 8)
        assert o.tokens == toks and o.finish_reason == "length" and o.logprobs == o.model_logprobs  # greedy: the model's
        np.testing.assert_allclose(o.model_logprobs, lps, atol=1e-4)
        np.testing.assert_allclose(o.model_logprobs, s[len(p) - 1:], atol=1e-5)
        assert o.text == tok.decode(toks)
        if experts is not None:
            assert o.experts.shape == (8, 2, 2) and o.prompt_experts.shape == (len(p) - 1, 2, 2)
            np.testing.assert_array_equal(np.sort(o.experts, -1), np.sort(experts[len(p) - 1:], -1))
            np.testing.assert_array_equal(np.sort(o.prompt_experts, -1), np.sort(experts[:len(p) - 1], -1))
        else:
            assert o.experts is None and o.prompt_experts is None


def test_a_padded_batch_equals_each_row_alone_and_refilling_changes_nothing(models):
    fwd, params, _ = hf.load(str(models["llama"][1]))
    reqs = [Request(p, max_new_tokens=n, seed=i, **SAMPLED) for i, (p, n) in enumerate(zip(PROMPTS, (3, 12, 5, 9, 2)))]
    batch = Engine(fwd, params, slots=4).generate(reqs)
    static = Engine(fwd, params, slots=4, refill=False).generate(reqs)
    for i, r in enumerate(reqs):
        alone = Engine(fwd, params, slots=1, chunk=3).generate([r])[0]
        for o in (batch[i], static[i]):
            assert o.tokens == alone.tokens and len(o.tokens) == r.max_new_tokens
            np.testing.assert_allclose(o.model_logprobs, alone.model_logprobs, atol=1e-5)
            np.testing.assert_allclose(o.logprobs, alone.logprobs, atol=1e-5)
    assert len({tuple(o.tokens) for o in batch}) == len(batch)
    other = Engine(fwd, params, slots=4).generate([Request(PROMPTS[0], max_new_tokens=3, seed=7, **SAMPLED)])[0]
    assert other.tokens != batch[0].tokens or other.logprobs != batch[0].logprobs  # the seed matters


def test_stops_end_a_row_with_its_reason(models):
    fwd, params, tok = hf.load(str(models["llama"][1]))
    engine = Engine(fwd, params, slots=2, tokenizer=tok)
    free = engine.generate([Request(PROMPTS[1], max_new_tokens=10)])[0]
    stop_at, stop_text = free.tokens[3], tok.decode(free.tokens[2:4])
    first = free.tokens.index(stop_at)
    ends = min(j for j in range(1, 11) if stop_text in tok.decode(free.tokens[:j]))  # the first prefix holding it
    by_id, by_text = engine.generate([Request(PROMPTS[1], max_new_tokens=10, stop_ids=[stop_at]),
                                      Request(PROMPTS[1], max_new_tokens=10, stop=[stop_text])])
    assert by_id.tokens == free.tokens[:first + 1] and by_id.finish_reason == "stop"
    assert by_id.text == tok.decode(free.tokens[:first])
    assert by_text.finish_reason == "stop" and by_text.tokens == free.tokens[:ends]
    text = tok.decode(free.tokens[:ends])
    assert by_text.text == text[:text.find(stop_text)]


def reference_filter(logits, t, k, p, m):
    """The sampling distribution by its definition, float64: temperature, top-k, top-p, min-p."""
    z = logits.astype(np.float64) / t
    order = np.argsort(-z, kind="stable")
    keep = np.zeros(len(z), bool)
    keep[order[:k or len(z)]] = True
    probs = np.where(keep, np.exp(z - z.max()), 0)
    probs /= probs.sum()
    mass = np.cumsum(probs[order]) - probs[order]
    keep[order[mass >= p]] = False
    keep[order[0]] = True
    probs = np.where(keep, probs, 0)
    probs /= probs.sum()
    keep &= probs >= m * probs.max()
    probs = np.where(keep, probs, 0)
    return probs / probs.sum()


def test_a_group_prefills_its_prompt_once_and_samples_as_without_sharing(models):
    """G = 4 seeded samples (streams 0..3) of each of 3 prompts, as GRPO asks: the prompts' tokens prefilled once
    (P tokens, not G x P), every completion's tokens equal and its log-probs within 1e-6 of a prefill row each."""
    fwd, params, _ = hf.load(str(models["qwen3"][1]))
    reqs = [Request(p, max_new_tokens=6, seed=9, stream=g, temperature=1.0) for p in PROMPTS[:3] for g in range(4)]
    shared, alone = Engine(fwd, params, slots=12), Engine(fwd, params, slots=12, share_prefill=False)
    got, want = shared.generate(reqs), alone.generate(reqs)
    assert shared.stats["prefill_tokens"] * 4 == alone.stats["prefill_tokens"] == 4 * sum(map(len, PROMPTS[:3]))
    assert len({tuple(c.tokens) for c in got}) > 3  # the samples of a group differ
    for g, w in zip(got, want):
        assert g.tokens == w.tokens
        np.testing.assert_allclose(g.model_logprobs, w.model_logprobs, atol=1e-6)
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-6)


def test_long_prompts_prefill_in_chunks_as_whole(models):
    """Prompts of 20-45 tokens (a 64-position group) prefilled 16 positions at a time: the same tokens, log-probs
    (1e-6) and experts as one prefill."""
    fwd, params, _ = hf.load(str(models["qwen3_moe"][1]))
    prompts = [np.random.default_rng(10 + i).integers(1, V, n).tolist() for i, n in enumerate((45, 20, 33))]
    reqs = [Request(p, max_new_tokens=5, seed=4, temperature=1.0) for p in prompts]
    got = Engine(fwd, params, prefill_chunk=16, prompt_experts=True).generate(reqs)
    want = Engine(fwd, params, prompt_experts=True).generate(reqs)
    for g, w in zip(got, want):
        assert g.tokens == w.tokens
        np.testing.assert_allclose(g.model_logprobs, w.model_logprobs, atol=1e-6)
        np.testing.assert_array_equal(g.prompt_experts, w.prompt_experts)
        np.testing.assert_array_equal(g.experts, w.experts)
    with pytest.raises(ValueError, match="prefill_chunk=24: give a power of two"):
        Engine(fwd, params, prefill_chunk=24)


def test_sampler_filters_equal_their_formula():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, 50)).astype(np.float32) * 3
    knobs = [(0.7, 0, 1.0, 0.0), (1.0, 5, 1.0, 0.0), (1.3, 0, 0.6, 0.0), (0.9, 20, 0.9, 0.1)]
    s = Sampling(*(jax.numpy.asarray(c) for c in zip(*knobs)))
    s = Sampling(s.temperature.astype("float32"), s.top_k.astype("int32"), s.top_p.astype("float32"),
                 s.min_p.astype("float32"))
    counts = np.zeros((4, 50))
    draw = jax.jit(jax.vmap(lambda i: sample(jax.numpy.asarray(logits), jax.vmap(
        lambda r: jax.random.fold_in(jax.random.key(i), r))(np.arange(4)), s)))
    toks, lps, lpms = (np.asarray(a) for a in draw(np.arange(400)))
    for tok, lp, lpm in zip(toks, lps, lpms):
        for r in range(4):
            want = reference_filter(logits[r], *knobs[r])
            assert want[tok[r]] > 0
            np.testing.assert_allclose(lp[r], np.log(want[tok[r]]), atol=1e-5)
            np.testing.assert_allclose(lpm[r], logits[r, tok[r]] - np.log(np.exp(logits[r]).sum()), atol=1e-5)
            counts[r, tok[r]] += 1
    for r in range(4):  # the draws follow the filtered distribution (total variation within sampling noise)
        assert 0.5 * np.abs(counts[r] / 400 - reference_filter(logits[r], *knobs[r])).sum() < 0.12
    # row 0 filters nothing: alone, with nothing sorted (any_filter=False), it draws what it drew beside the others
    one = Sampling(*(a[:1] for a in s))
    alone = jax.jit(jax.vmap(lambda i: sample(jax.numpy.asarray(logits[:1]), jax.random.fold_in(jax.random.key(i), 0)[
        None], one, any_filter=False)))(np.arange(400))
    np.testing.assert_array_equal(np.asarray(alone[0])[:, 0], toks[:, 0])
    np.testing.assert_array_equal(np.asarray(alone[1])[:, 0], lps[:, 0])


def test_the_greedy_head_in_vocabulary_blocks_is_argmax_and_the_log_softmax():
    """`sampling.greedy_head` (the greedy decode step's head, no logits written): the token of `argmax` (ties to the
    lower id, padded ids never) and its log-softmax, with the vocabulary in 2 parts x 8 blocks."""
    import jax.numpy as jnp

    from jaxpar.generate.sampling import greedy_head, vocab_blocks

    rng = np.random.default_rng(0)
    w, h = rng.normal(size=(8, 96)).astype(np.float32), rng.normal(size=(5, 8)).astype(np.float32)
    w[:, 7] *= 5
    w[:, 70] = w[:, 7]  # the same logit twice: id 7 (block 1 of part 0) and 70 (block 3 of part 1)
    h[0] = 3 * w[:, 7]
    w[:, 95] = 100 * h[1]  # the likeliest logit of row 1 is a padded id: never chosen
    tok, lp = greedy_head(jnp.asarray(h), vocab_blocks(jnp.asarray(w), parts=2), jnp.float32, vocab_real=90)
    z = (h.astype(np.float64) @ w.astype(np.float64))[:, :90]
    want = z.argmax(-1)
    assert want[0] == 7 and list(np.asarray(tok)) == list(want)
    np.testing.assert_allclose(lp, -np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)), atol=2e-5)  # (row 0: ln 1/2)


def test_the_longest_prompt_gets_its_whole_budget(models):
    """Prompt + completion fill the model's context + 1 tokens (a training row): the last token is sampled from the
    context's last position, as transformers samples it."""
    model, d = models["llama"]
    fwd, params, _ = hf.load(str(d))
    prompt = np.random.default_rng(5).integers(1, V, 63).tolist()
    out = Engine(fwd, params).generate([Request(prompt, max_new_tokens=2), Request(prompt + [7], max_new_tokens=5)])
    assert out[0].tokens == hf_greedy(model, prompt, 2)[0] and out[0].finish_reason == "length"
    assert out[1].tokens == hf_greedy(model, prompt + [7], 1)[0] and out[1].finish_reason == "length"


def test_bad_requests_are_one_line_each(models):
    fwd, params, _ = hf.load(str(models["llama"][1]))
    engine = Engine(fwd, params)
    for req, match in ((Request(list(range(1, 66))), "request 0: a prompt of 65 tokens; the model's context is 64"),
                       (Request([1, 2], top_p=0.0), r"request 0: top_p=0.0: it must be in \(0, 1\]"),
                       (Request([1, 2], top_p=1.5), r"top_p=1.5"), (Request([]), "an empty prompt"),
                       (Request([1], stop=["x"]), "stop strings without a tokenizer")):
        with pytest.raises(ValueError, match=match) as e:
            engine.generate([req])
        assert "\n" not in str(e.value)


LAYOUTS = {
    "data2_tensor2": ("llama", {"mesh.data": 2, "mesh.tensor": 2}),
    "zero3": ("qwen3", {"mesh.data": 4, "mesh.tensor": 2, "optim.zero_stage": 3}),
    "expert": ("qwen3_moe", {"mesh.data": 2, "mesh.expert": 4}),
    "pipeline": ("llama", {"mesh.data": 2, "mesh.tensor": 2, "mesh.stage": 2, "train.microbatches": 2,
                           "pipeline.schedule": "circular", "pipeline.virtual_stages": 2}),  # layers out of order
    "context": ("llama", {"mesh.data": 2, "mesh.context": 2, "mesh.tensor": 2}),  # rows over data x context
}


@needs8
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_greedy_and_seeded_sampling_equal_one_device_on_training_layouts(models, corpus, tmp_path, name):
    kind, over = LAYOUTS[name]
    d = models[kind][1]
    config = hf.apply(run_config(corpus, tmp_path, **{**over, "init_from": f"hf:{d}"}))
    n = math.prod(over.get(f"mesh.{a}", 1) for a in ("data", "tensor", "expert", "stage", "context"))
    steps = steps_for(config, V, jax.devices()[:n])
    placed = hf.load_params(str(d), steps.cfg, steps.state_shardings["params"], steps.layer_order)
    fwd, params, _ = hf.load(str(d))
    reqs = [Request(p, max_new_tokens=6) for p in PROMPTS[:4]] + \
           [Request(p, max_new_tokens=6, seed=3, **SAMPLED) for p in PROMPTS[:4]]
    alone = Engine(fwd, params, slots=8, prompt_experts=True, share_prefill=False, kv_block=0)  # dense, unshared
    want = alone.generate(reqs)
    engine = Engine.on_steps(steps, placed, config, slots=8, prompt_experts=True)  # each prompt prefilled once
    got = engine.generate(reqs)
    assert 2 * engine.stats["prefill_tokens"] == alone.stats["prefill_tokens"] == 2 * sum(map(len, PROMPTS[:4]))
    pages = Engine.on_steps(steps, placed, config, slots=8, prompt_experts=True, kv_block=8)  # a paged cache
    for g, w in zip(got + pages.generate(reqs), want + want):
        assert g.tokens == w.tokens
        np.testing.assert_allclose(g.model_logprobs, w.model_logprobs, atol=1e-5)
        if w.experts is not None:
            np.testing.assert_array_equal(g.experts, w.experts)
            np.testing.assert_array_equal(g.prompt_experts, w.prompt_experts)
    # the KV cache is sharded as `--dry_run` prices it: rows over data x expert x context, KV heads over tensor
    shape = (steps.cfg.layers, 8, 64, steps.cfg.kv_heads, steps.cfg.head_dim)
    shard = engine.decoder.cache_sharding(8, 64).shard_shape(shape)
    assert shard[1] == 8 // (over["mesh.data"] * over.get("mesh.expert", 1) * over.get("mesh.context", 1))
    assert shard[3] == steps.cfg.kv_heads // over.get("mesh.tensor", 1)
    priced = cache_bytes(steps.cfg, 8, 64, steps.layout, step_rules(config))
    assert priced == {"total": 2 * 4 * int(np.prod(shape)), "per_device": 2 * 4 * int(np.prod(shard))}
    pool = pages.decoder.pool_sharding(64).shard_shape((shape[3], shape[0], 64, 8, shape[4]))
    assert pool[2] == shard[1] * 8 and pool[0] == shard[3]  # the pool's blocks split as the rows
    leaf = jax.tree.leaves(engine.params)[0]
    assert dict(leaf.sharding.mesh.shape) == dict(steps.mesh.shape)
    if name == "pipeline":  # the decode layout: the layers gathered over stage, in their canonical order
        assert list(steps.layer_order) == [0, 2, 1, 3]
        assert all((tuple(a.sharding.spec) + (None,))[0] is None for a in jax.tree.leaves(engine.params["blocks"]))
        held = sum(a.addressable_shards[0].data.nbytes for a in jax.tree.leaves(engine.params))
        assert decode_param_bytes(placed) == held  # the price the guide states: stage x the per-layer share
    elif name == "zero3":  # ZeRO-3's split over data gathered once for the engine; kept (gather_zero3=False): no copy
        assert any("data" in str(a.sharding.spec) for a in jax.tree.leaves(placed))
        assert not any("data" in str(a.sharding.spec) for a in jax.tree.leaves(engine.params))
        kept = Engine.on_steps(steps, placed, config, slots=8, gather_zero3=False)
        assert all(a is b for a, b in zip(jax.tree.leaves(kept.params), jax.tree.leaves(placed)))
        assert [c.tokens for c in kept.generate(reqs)] == [w.tokens for w in want]
    else:  # no second copy: the engine reads the training arrays themselves
        assert all(a is b for a, b in zip(jax.tree.leaves(engine.params), jax.tree.leaves(placed)))


def test_cli_writes_n_samples_resumes_and_refuses_bad_records_one_line_each(models, tmp_path, capsys):
    import json

    from jaxpar.generate.__main__ import main

    d = str(models["llama"][1])
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    recs = [{"prompt": "to be", "id": "a"}, {"prompt": "or not", "max_new_tokens": 3, "stop": "zz"},
            {"prompt": "that is", "temperature": 0.9, "extra": [1]}]
    src.write_text("".join(json.dumps(r) + "\n" for r in recs))
    args = ["--model", f"hf:{d}", "--prompts", str(src), "--out", str(out), "--max_new_tokens", "5", "--n", "2",
            "--progress", "0", "--slots", "4"]
    assert main(args) == 0
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert [g["extra"] for g in got[2:]] == [[1]] and got[0]["id"] == "a" and len(got) == 3
    assert [len(ids) for g in got for ids in g["completion_ids"]] == [5, 5, 3, 3, 5, 5]
    fwd, params, tok = hf.load(d)
    want = Engine(fwd, params, tokenizer=tok).generate([Request(tok.encode("to be"), max_new_tokens=5)])[0]
    assert got[0]["completion_ids"] == [want.tokens] * 2 and got[0]["completion"] == [want.text] * 2
    assert got[2]["completion_ids"][0] != got[2]["completion_ids"][1]  # two streams of one seed
    whole = out.read_text()
    out.write_text(whole.splitlines()[0] + "\n" + whole.splitlines()[1][:20])  # interrupted mid-record
    assert main(args) == 0  # resumed: the rest written, the same (log-probs to rounding: other batch shapes)
    again = [json.loads(line) for line in out.read_text().splitlines()]
    assert [{**g, "logprobs": 0} for g in again] == [{**g, "logprobs": 0} for g in got]
    np.testing.assert_allclose(sum(sum((g["logprobs"] for g in again), []), []),
                               sum(sum((g["logprobs"] for g in got), []), []), atol=1e-5)
    for lines, flags, says in (
            (['{"prompt": "ab"}', '{"prompt": 3}'], [], "in.jsonl:2: field 'prompt' must be a string, got int."),
            (['{"prompt": "' + "x" * 70 + '"}'], [], "in.jsonl:1: a prompt of 70 tokens; the model's context is 64"),
            (['{"prompt": "ab"'], [], "in.jsonl:1: not a JSON record"),
            (['{"prompt": "ab", "temperature": "hot"}'], [], "field 'temperature' must be an integer or a number"),
            (['{"prompt": "ab"}'], ["--top_p", "1.5"], "--top_p=1.5 is outside (0, 1]")):
        src.write_text("\n".join(lines) + "\n")
        out.unlink(missing_ok=True)
        capsys.readouterr()
        assert main(args + flags) == 2
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1, err


def test_the_dry_run_prices_the_kv_cache_of_the_layout():
    """`train.py --dry_run`'s line: keys and values of every layer for global_batch_size rows x seq_len positions,
    rows split over data, KV heads over tensor (the sharding the layout test above reads off the engine)."""
    c = tiny_config(**{"model.arch": "llama", "model.kv_heads": 2, "mesh.data": 4, "mesh.tensor": 2})
    total = 2 * 4 * 16 * 16 * 2 * (32 // 8) * 4  # k and v x layers x rows x positions x kv heads x head_dim x fp32
    assert dry_run_entry(c, 8) == {"rows": 16, "positions": 16, "total": total, "per_device": total // 8}
    c.model.kv_heads = 1  # one KV head: replicated over tensor, as its params are
    assert dry_run_entry(c, 8)["per_device"] == total // 2 // 4


def test_the_dry_run_prices_grpos_paged_pool():
    """GRPO's rounds: a pool of blocks of `grpo.kv_block` positions, as large as the dense cache by default, else
    `grpo.kv_cache_gib` a device in blocks split over data (the rows) and tensor (the KV heads); under context
    parallelism over context too: the rows while a row fits a device's part, else each block's positions."""
    c = tiny_config(**{"model.arch": "llama", "model.kv_heads": 2, "mesh.data": 4, "mesh.tensor": 2,
                       "train.objective": "grpo", "grpo.kv_block": 8})
    rows, block = 16 * 8, 2 * 4 * 8 * 2 * (32 // 8) * 4  # prompts x G; a block: k, v x layers x 8 x KV heads x hd
    rows_split = {"parts": 4, "kv_context": False}
    assert dry_run_entry(c, 8)["paged"] == {"block": 8, "kv_blocks": rows * 2, "total": rows * 2 * block,
                                            "per_device": rows * 2 * block // 8, **rows_split}
    c.grpo.kv_cache_gib = 1000 * block / 2 / 2 ** 30  # a device holds half of each of its part's blocks (tensor 2)
    assert dry_run_entry(c, 8)["paged"] == {"block": 8, "kv_blocks": 4000, "total": 4000 * block,
                                            "per_device": 1000 * block // 2, **rows_split}  # 1,000 in each part
    # (data 2, context 2, tensor 2), a device's pool half a block: with the rows over data x context a part would
    # hold one block of a row's two (16 positions), so each row's KV splits over context: 2 parts of 2 blocks
    c.mesh.update(data=2, context=2)
    c.grpo.kv_cache_gib = block / 2 / 2 ** 30
    assert dry_run_entry(c, 8)["paged"] == {"block": 8, "kv_blocks": 4, "total": 4 * block, "per_device": block // 2,
                                            "parts": 2, "kv_context": True}


def test_rules_read_back_from_a_run_directory_key_the_same_programs():
    """A run's config.json holds its rules as lists: the decode layout's rules are the same hashable tuples (equal
    decoders share their compiled programs)."""
    import json

    from jaxpar.config_keys import DEFAULT_RULES
    from jaxpar.generate.cache import decode_rules

    read = decode_rules(json.loads(json.dumps(DEFAULT_RULES)))
    assert read == decode_rules(DEFAULT_RULES) and hash(read) == hash(decode_rules(DEFAULT_RULES))
    assert dict(read)["layers"] is None and dict(read)["batch"] == ("data", "expert", "context")
    split = dict(decode_rules(DEFAULT_RULES, kv_context=True))  # a row's KV positions over context, not the rows
    assert split["batch"] == ("data", "expert") and split["kv_block"] == "context"
