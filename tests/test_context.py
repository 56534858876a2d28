"""Context parallelism (`mesh.context`): every layout with the sequence split over `context` computes the 1-device
run (float64 on both sides: loss, gradients, params after AdamW steps), packed documents included; the causal work
per device is balanced (the blockwise kernel's own tile count against the formula); bad settings fail in validate."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import (VOCAB, assert_equals_one_device, batch, float64_config, place, reference_config, steps_for,
                     tiny_config)
from jaxpar.analysis.hlo_flops import hlo_flops
from jaxpar.kernels import blockwise
from jaxpar.parallel import context
from jaxpar.errors import ConfigError
from jaxpar.validate import validate

LLAMA = {"model.arch": "llama", "model.kv_heads": 4, "model.tie_embeddings": False}  # 8 query heads: GQA, 2 per KV
MOE = {"model.experts": 8, "model.experts_per_token": 2, "model.shared_experts": 1, "model.expert_mlp": 32,
       "model.aux_loss": 0.01, "model.router_z_loss": 0.001}
BATCHES = [batch(16, 16, VOCAB, seed=i) for i in range(2)]


def packed(seed):
    """16 rows of 17 tokens cut into documents at random points: many cross the 2-token chunks of context 4, some
    are a single token (shorter than a chunk)."""
    rng = np.random.default_rng(seed)
    seg = np.cumsum(rng.random((16, 17)) < 0.3, axis=1).astype(np.int32)
    return {**batch(16, 16, VOCAB, seed=seed), "segments": seg}


def config(data=1, tensor=1, stage=1, ctx=2, **over):
    return tiny_config(**{"mesh.data": data, "mesh.tensor": tensor, "mesh.stage": stage, "mesh.context": ctx,
                          **LLAMA, **over})


CASES = {
    "context 2": config(ctx=2),
    "context 4": config(ctx=4),
    "context 8": config(ctx=8),
    "data 2 x context 2 x tensor 2, sequence parallel": config(2, 2, ctx=2, **{"model.sequence_parallel": True}),
    "context 2 x stage 2 x data 2, 1f1b": config(2, 1, 2, ctx=2, **{"pipeline.schedule": "1f1b",
                                                                    "train.microbatches": 2}),
    "context 4 x data 2, zero 3": config(2, ctx=4, **{"optim.zero_stage": 3, "train.microbatches": 2}),
    "gpt2, context 4 x data 2": tiny_config(**{"mesh.data": 2, "mesh.context": 4}),
    # a mixture of experts, never gathering the sequences: capacity factor 1 (choices dropped by the per-sequence
    # rule, from all-gathered chunk counts) through `ragged`'s grouped matmuls; and with expert parallelism, sigmoid
    # routing and the choice bias's update through `buffers` (local slots)
    "moe, context 4 x data 2, capacity 1, ragged": config(2, ctx=4, **MOE, **{"model.capacity_factor": 1.0,
                                                                             "model.moe_impl": "ragged"}),
    "moe, context 2 x expert 2 x data 2, bias": config(2, ctx=2, **MOE, **{"mesh.expert": 2, "model.router": "sigmoid",
                                                                        "model.router_bias_rate": 0.01,
                                                                        "model.moe_impl": "buffers"}),
}


@pytest.mark.parametrize("name", CASES)
def test_context_parallel_equals_one_device(name):
    assert_equals_one_device(CASES[name], VOCAB, BATCHES)


def test_packed_documents_across_chunks_equal_one_device():
    """`data.packing=documents` at (data 2, context 4): documents cross the chunk boundaries and some are shorter
    than a chunk; positions restart at each document, attention never crosses one."""
    c = config(2, ctx=4, **{"data.packing": "documents"})
    assert_equals_one_device(c, VOCAB, [packed(0), packed(1)])


def test_evaluation_at_context_4_is_the_one_device_loss():
    c = float64_config(config(2, ctx=4, **{"data.packing": "documents"}))
    with jax.enable_x64(True):
        got = {}
        for name, cfg, n in (("cp", c, 8), ("one", reference_config(c), 1)):
            st = steps_for(cfg, VOCAB, jax.devices()[:n])
            s, count = st.evaluate(st.init(0)["params"], place(st, packed(2)))
            got[name] = float(s) / float(count)
    assert got["cp"] == pytest.approx(got["one"], rel=1e-12)


def test_a_context_4_checkpoint_resumes_at_context_1(tmp_path):
    """2 steps at (data 2, context 4), a checkpoint, the third step on one device: the uninterrupted run's loss."""
    from jaxpar.state.checkpoint import Checkpointer
    c4, c1 = config(2, ctx=4), config(1, ctx=1)
    steps3 = [batch(16, 16, VOCAB, seed=i) for i in range(3)]
    st4 = steps_for(c4, VOCAB)
    state = st4.init(0)
    for b in steps3[:2]:
        state, _ = st4.train(state, place(st4, b))
    st1 = steps_for(c1, VOCAB, jax.devices()[:1])
    with Checkpointer(str(tmp_path), 1, 1, async_save=False) as ck:
        ck.save(2, st4.to_canonical(state), {"step": 2}, force=True)
        resumed, _ = ck.restore(2, st1.abstract_state())
    _, m = st1.train(resumed, place(st1, steps3[2]))
    ref = st4.init(0)
    for b in steps3:
        ref, m_ref = st4.train(ref, place(st4, b))
    assert float(m["loss"]) == pytest.approx(float(m_ref["loss"]), rel=1e-6)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_causal_work_is_balanced_across_context_devices(cp):
    """Each device's tiles, counted by the blockwise kernel as it runs them (chunk-sized tiles): 2·cp + 1 pairs of
    chunks on every device in the balanced order (the formula, `context.pair_work`), against 4i + 3 for device i of
    the contiguous split (imbalance (4cp − 1) / (2cp + 1): 2.3x at cp 2, 3.4x at cp 8)."""
    seq, n = 64, 64 // (2 * cp)
    q = jnp.zeros((1, seq // cp, 2, 4))
    kv = jnp.zeros((1, seq, 2, 4))
    order = context.permutation(seq, cp)
    for balanced in (True, False):
        work = []
        for rank in range(cp):
            mine = context.local_index(seq // cp, cp, rank) if balanced else rank * (seq // cp) + jnp.arange(seq // cp)
            keys = order if balanced else np.arange(seq)
            work.append(int(blockwise.tiles_computed(q, kv, kv, jnp.asarray(mine, jnp.int32),
                                                     jnp.asarray(keys, jnp.int32), block_q=n, block_k=n)))
        assert work == context.pair_work(cp, balanced)
    balanced = context.pair_work(cp)
    assert max(balanced) / min(balanced) - 1 <= 0.10


def test_the_blockwise_kernel_equals_dense_attention_with_documents():
    """float64, GQA, segments, tiles smaller than the sequence: the values and the gradients of dense softmax
    attention (`attention._float64` over a repeated K/V and a causal, same-document mask)."""
    from jaxpar.kernels import attention as kernels
    with jax.enable_x64(True):
        rng = np.random.default_rng(0)
        q, k, v, w = (jnp.asarray(rng.normal(size=s)) for s in ((2, 16, 4, 8), (2, 16, 2, 8), (2, 16, 2, 8),
                                                                  (2, 16, 4, 8)))
        seg = jnp.asarray(np.cumsum(rng.random((2, 16)) < 0.25, axis=1).astype(np.int32))
        idx = jnp.arange(16, dtype=jnp.int32)
        mask = (seg[:, None, :, None] == seg[:, None, None, :]) & jnp.tril(jnp.ones((16, 16), bool))
        dense = lambda q, k, v: (kernels._float64(q, *(jnp.repeat(a, 2, axis=2) for a in (k, v)), mask) * w).sum()
        tiled = lambda q, k, v: (blockwise.attention(q, k, v, idx, idx, seg, seg, 4, 8) * w).sum()
        assert float(tiled(q, k, v)) == pytest.approx(float(dense(q, k, v)), rel=1e-13)
        for a, b in zip(jax.grad(tiled, (0, 1, 2))(q, k, v), jax.grad(dense, (0, 1, 2))(q, k, v)):
            np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-13)


@pytest.mark.parametrize("over,says", [
    ({"model.seq_len": 20, "mesh.context": 4}, "model.seq_len=20 is not divisible by 2 x mesh.context=4 = 8"),
    ({"mesh.context": 2, "model.attention": "pallas"}, "model.attention='pallas' cannot serve mesh.context=2"),
    ({"mesh.context": 2, "model.dropout_resid": 0.1}, "with mesh.context=2: the masks are drawn per whole sequence"),
])
def test_bad_context_settings_are_one_clear_error(over, says):
    with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        validate(tiny_config(**over), 8)


def test_llama3_8b_128k_dry_run_fits_and_never_holds_a_chunk_by_sequence_score_matrix():
    """`configs/llama3_8b_128k.py` (context 8, ZeRO 3) on 8 fake CPU devices: under 80 GB per device, and no float
    buffer of the compiled step spans the 131,072-token sequence together with a device's 16,384 queries (the
    attention works in 512 x 512 tiles; the K/V gathered over context are [131072, 8 KV heads, 128])."""
    import importlib.util
    import re

    from helpers import ROOT
    from jaxpar.compiled import report_for
    spec = importlib.util.spec_from_file_location("llama3_8b_128k", f"{ROOT}/configs/llama3_8b_128k.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rep = report_for(mod.get_config(), vocab=128256)
    assert rep["placement"]["device"] < 80e9
    shapes = [[int(x) for x in m.group(2).split(",")] for m in re.finditer(r"(bf16|f32)\[([\d,]+)\]", rep["hlo_text"])]
    assert not [s for s in shapes if 131072 in s and any(d >= 16384 for d in s if d != 131072)]
    tiles = [s for s in shapes if s[-2:] == [512, 512]]
    assert tiles and max(np.prod(s[-5:]) for s in tiles) * 4 <= 64 * 2 ** 20  # one tile: [b, kv, groups, 512, 512]


def test_the_planner_chooses_a_context_size_for_128k_tokens():
    """Llama 3 8B at 131,072 tokens on 8 H100s (ZeRO 3, full recompute, no tensor or pipeline): without context
    parallelism no layout fits (a device holding whole sequences), the best compiled layout splits the sequence,
    and its K/V traffic is the formula: per layer and microbatch two forward all-gathers (with the recompute) of K
    and V, [b, 131072, 8 KV heads x 128] bf16, and one float32 reduce-scatter of their gradients."""
    import importlib.util

    from helpers import ROOT
    from jaxpar import plan as planner
    from jaxpar.plan import cost, hardware
    from jaxpar.plan.space import Space
    spec = importlib.util.spec_from_file_location("llama3_8b_128k", f"{ROOT}/configs/llama3_8b_128k.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cl = hardware.cluster("h100", 8)
    space = Space(tensor=(1,), stage=(1,), zero=(3,), remat=("full",), offload=("none",))
    p = planner.plan(mod.get_config(), cl, space, compile_top=1, devices=jax.devices())
    best = p.ranked[0]
    assert best.layout.context > 1 and best.memory["source"] == "compiled" and best.fits(p.capacity)
    assert all(c.fits(p.capacity) is not True for c in p.ranked if c.layout.context == 1)
    lay, m = best.layout, p.model
    kv = 2 * lay.micro_batch(m.global_batch) * m.seq * m.embed * m.kv_heads // m.heads
    bw, lat = cl.group_bw(lay.context, 1)
    share = (lay.context - 1) / lay.context
    gather, scatter = share * kv * 2 / bw + lat, share * kv * 4 / bw + lat
    expected = lay.microbatches * m.layers * (2 * gather + scatter)
    assert best.time["cp_comm_s"] == pytest.approx(expected, rel=1e-9)
    assert cost.step_time(m, lay, cl)["cp_comm_s"] == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("impl", ["buffers", "ragged"])
def test_moe_under_context_parallelism_does_each_devices_own_tokens_work(impl):
    """A dropless MoE llama at (data 2, context 4) against (data 8, context 1), the same global batch and tokens per
    device: the compiled train step's matmul FLOPs per device within 1.15x (gathering the sequences made each
    context device do the whole sequence's expert work: about context x the MoE part), and no all-gather of an
    activation `[.., seq, embed]` (the attention's K/V gathers are `[.., seq, kv heads, head_dim]`)."""
    over = {**MOE, "model.moe_impl": impl, "model.seq_len": 32, "model.embed": 64, "model.expert_mlp": 128,
            "train.global_batch_size": 16}
    flops, texts = [], []
    for d, cp in ((2, 4), (8, 1)):
        s = steps_for(config(d, ctx=cp, **over), VOCAB, jax.devices()[:8])
        state = s.abstract_state()
        b = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s.batch_sharding)
             for k, v in place(s, batch(16, 32, VOCAB)).items()}
        texts.append(s.train.lower(state, b).compile().as_text())
        flops.append(hlo_flops(texts[-1])["total"])
    assert flops[0] <= 1.15 * flops[1], flops
    gathers = [ln for ln in texts[0].splitlines() if re.search(r"= \S+\[[^\]]*,64\]\S* all-gather(-start)?\(", ln)]
    assert not gathers, gathers[:3]
