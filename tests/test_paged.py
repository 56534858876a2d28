"""The paged KV cache (`jaxpar/generate/paged.py`): the same completions as the dense cache (tokens equal, log-probs
within 1e-6, a MoE's experts equal) with a pool as large as the dense cache, and with one much smaller, where rows
wait, are given back and recomputed; the blocks' bookkeeping; a request no pool holds is one line. The training
layouts run it in `test_generate.py`'s layout test, on the same tiny checkpoints (`tiny_checkpoints.py`)."""
import dataclasses
import math
import re

import jax
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import tiny_checkpoints  # noqa: E402
from tiny_checkpoints import SAMPLED, V  # noqa: E402
from jaxpar.formats import hf  # noqa: E402
from jaxpar.generate import cache as kv, paged  # noqa: E402
from jaxpar.generate.engine import Engine, Request  # noqa: E402
from jaxpar.model.forward import Forward  # noqa: E402

pytestmark = pytest.mark.xdist_group("test_paged")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tiny_checkpoints.save(tmp_path_factory, ("qwen3", "qwen3_moe"))


def ragged_round(seed: int = 0) -> list:
    """6 prompts of 1-40 tokens x 3 samples each (greedy, plain temperature, filtered), 1-60 new tokens."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(6):
        prompt = rng.integers(1, V, rng.integers(1, 41)).tolist()
        for g, knobs in enumerate(({}, {"temperature": 1.0}, SAMPLED)):
            out.append(Request(prompt, max_new_tokens=int(rng.integers(1, 61)), seed=i, stream=g, **knobs))
    return out


def assert_same(got, want):
    for g, w in zip(got, want):
        assert g.tokens == w.tokens and g.finish_reason == w.finish_reason
        np.testing.assert_allclose(g.model_logprobs, w.model_logprobs, atol=1e-6)
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-6)
        if w.experts is not None:
            np.testing.assert_array_equal(g.experts, w.experts)
            np.testing.assert_array_equal(g.prompt_experts, w.prompt_experts)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_a_paged_cache_generates_what_the_dense_one_does_in_the_memory_of_its_tokens(models, kind):
    fwd, params, _ = hf.load(str(models[kind][1]))
    reqs = ragged_round()
    want = Engine(fwd, params, slots=8, prompt_experts=True, kv_block=0).generate(reqs)  # dense
    roomy = Engine(fwd, params, slots=8, prompt_experts=True, kv_block=16)
    assert_same(roomy.generate(reqs), want)
    assert roomy.stats["preempted"] == 0 and roomy.stats["kv_peak_blocks"] <= roomy.stats["kv_blocks"] == 8 * 4
    # a pool of 14 blocks of 8 positions: 112 positions, where 8 dense slots of the model's context hold 512
    tight = Engine(fwd, params, slots=8, prompt_experts=True, kv_block=8, kv_memory=14 * kv.block_bytes(fwd.cfg, 8))
    assert_same(tight.generate(reqs), want)
    assert tight.stats["preempted"] > 0 and tight.stats["kv_peak_blocks"] <= tight.stats["kv_blocks"] == 14
    greedy = [r for r in reqs if r.temperature == 0]  # all greedy: every token from the head in blocks, whichever
    small = Engine(fwd, params, slots=8, prompt_experts=True, kv_block=8, kv_memory=tight.kv_memory, chunk=5)
    assert_same(small.generate(greedy), [w for w, r in zip(want, reqs) if r.temperature == 0])  # call it starts
    per_position = kv.block_bytes(fwd.cfg, 8) // 8
    assert kv.cache_bytes(fwd.cfg, 8, fwd.cfg.max_positions)["total"] == 512 * per_position > tight.kv_memory


def test_the_paged_decode_kernel_generates_what_xla_attention_does(models):
    """`model.attention=pallas`: each decode step reads the pool through JAX's Pallas paged-attention kernel (what
    `auto` takes on a GPU; here in Pallas' interpret mode): tokens equal, log-probs within 1e-6 of XLA's attention
    over the gathered blocks, for greedy, plain and filtered rows (`test_lowering.py` lowers it for CUDA)."""
    fwd, params, _ = hf.load(str(models["qwen3"][1]))
    reqs = ragged_round(1)[:6]
    want = Engine(fwd, params, slots=4, kv_block=16).generate(reqs)
    kernel = Forward(dataclasses.replace(fwd.cfg, attention="pallas"))
    assert_same(Engine(kernel, params, slots=4, kv_block=16).generate(reqs), want)
    with pytest.raises(ValueError, match="model.attention='pallas' cannot decode here: the paged kernel needs "
                                         "kv_block a power of two >= 16, not 8; use 'auto' or 'xla'"):
        Engine(kernel, params, slots=4, kv_block=8).generate(reqs[:1])


def test_a_grpo_runs_engine_decodes_with_the_runs_attention():
    """GRPO's shared-prompt rows train with XLA's attention under `auto` (the fused kernels see a query's own segment,
    not its shared prompt: `train.step.model_config`); the engine of its rounds keeps the run's `auto`, so a GPU
    decodes through the paged kernel."""
    from types import SimpleNamespace

    from helpers import tiny_config
    from jaxpar import model as gpt
    from jaxpar.train.step import model_config

    config = tiny_config(**{"train.objective": "grpo", "model.arch": "llama", "model.kv_heads": 2})
    cfg = model_config(config, V, 1)
    steps = SimpleNamespace(fwd=Forward(cfg), mesh=None, layout=SimpleNamespace(zero_stage=0), layer_order=None)
    engine = Engine.on_steps(steps, gpt.init_params(cfg, jax.random.key(0)), config)
    assert cfg.attention == "xla" and engine.cfg.attention == config.model.attention == "auto"
    assert dataclasses.replace(engine.cfg, attention="xla") == cfg


def test_samples_of_a_prompt_share_its_full_blocks_and_give_them_back():
    pages = paged.Blocks(blocks=12, block=4, slots=4, width=8, split=2)  # shards {slots 0, 1}, {2, 3}
    pages.grow(0, 10)  # 3 blocks: 2 full, 1 partial
    pages.share(1, 0, 10)  # the 2 full ones shared, a partial of its own
    assert list(pages.table[1, :2]) == list(pages.table[0, :2]) and pages.table[1, 2] != pages.table[0, 2]
    assert pages.in_use() == 4 and pages.spare(0) == 2 and pages.spare(2) == 6
    assert set(pages.table[0, :3]) | set(pages.table[1, :3]) <= set(range(6))  # the first shard's half of the pool
    pages.release(0)
    assert pages.in_use() == 3 and list(pages.table[0]) == [12] * 8  # the shared ones kept for slot 1
    pages.release(1)
    assert pages.in_use() == 0 and pages.peak == 4
    pages.grow(2, 8)
    assert paged.steps_that_fit(pages, [(2, 8, 30)], 100) == (16, set())  # 4 blocks spare in its shard: 16 positions
    pages.grow(0, 20)  # the first shard's whole half
    assert paged.steps_that_fit(pages, [(0, 20, 30)], 100) == (4, set())  # the end of its last block
    pages.grow(0, 24)
    assert paged.steps_that_fit(pages, [(0, 24, 30)], 100) == (0, {0})  # none spare: it gives a row back


def test_a_request_no_pool_holds_is_one_line(models):
    fwd, params, _ = hf.load(str(models["qwen3"][1]))
    engine = Engine(fwd, params, kv_block=8, kv_memory=2 * kv.block_bytes(fwd.cfg, 8))
    with pytest.raises(ValueError, match=r"request 0: a prompt of 10 \+ 20 new tokens needs 4 KV blocks of 8 "):
        engine.generate([Request(list(range(1, 11)), max_new_tokens=20)])
    with pytest.raises(ValueError, match="a paged cache needs kv_block >= 1"):
        Engine(fwd, params, kv_block=0, kv_memory=1 << 20)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (host) devices")
@pytest.mark.parametrize("data,context", [(4, 1), (2, 2)], ids=["data4_tensor2", "data2_context2_tensor2"])
def test_a_split_pool_is_read_and_written_on_its_devices(models, monkeypatch, data, context):
    """On (data 4, tensor 2) the pool's blocks split as the rows: the decode step moves no block between devices
    (no collective of the rows' gathered keys: only the tensor split's activations and the sampler's logits). On
    (data 2, context 2, tensor 2) with a pool whose part, with the rows split over context, is smaller than the
    longest row: each block's positions split over context, each device reads its half of every row's keys, and only
    the attention's maxima, sums and outputs cross the context split."""
    from jaxpar.generate import decode
    from jaxpar.layout import Layout
    from jaxpar.parallel.mesh import make_mesh

    fwd, params, _ = hf.load(str(models["qwen3"][1]))
    mesh = make_mesh(Layout(data=data, tensor=2, stage=1, microbatches=1, context=context), jax.devices()[:8])
    params = jax.device_put(params, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    want = Engine(fwd, params, slots=8, kv_block=0).generate(ragged_round()[:8])
    seen, compiled = [], decode._jit_decode
    monkeypatch.setattr(decode, "_jit_decode", lambda *a: seen.append(compiled.lower(*a).compile().as_text())
                        or compiled(*a))
    longest = max(min(len(r.prompt) + r.max_new_tokens, 65) - 1 for r in ragged_round()[:8])  # (a context of 64)
    memory = None if context == 1 else (-(-longest // 8) - 1) * kv.block_bytes(fwd.cfg, 8) // 2  # (tensor 2)
    engine = Engine(fwd, params, mesh=mesh, slots=8, kv_block=8, kv_memory=memory)
    assert_same(engine.generate(ragged_round()[:8]), want)
    assert engine.decoder.kv_context == (context > 1)
    held = engine.decoder.pool_sharding(64).shard_shape((fwd.cfg.kv_heads, fwd.cfg.layers, 64, 8, fwd.cfg.head_dim))
    assert held[2] == 64 // data and held[3] == 8 // context  # blocks split as the rows; positions over context
    moved = [line for line in seen[0].splitlines() if re.search(r"= \S+ (all-gather|all-reduce|all-to-all|"
                                                                r"collective-permute)\(", line)]
    sizes = [math.prod(int(n) for n in re.search(r"\[([\d,]*)\]", line).group(1).split(",") if n) for line in moved]
    view = 8 // data * 64 * (fwd.cfg.kv_heads // 2) * fwd.cfg.head_dim  # one layer's keys of a device's rows
    assert moved and max(sizes) < view, moved  # (a gather of them across the split moves that view each layer)
