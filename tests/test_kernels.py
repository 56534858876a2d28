"""The GPU-speed paths, checked on CPU: sequence parallelism under every schedule equals the 1-device run (both
families); the chunked LM head + cross-entropy equals the whole-logits loss and its autodiff gradients (padded and
vocab-parallel vocabularies); the Pallas flash kernel (interpret mode) equals XLA's attention, with and without
segment ids, alone and inside a sharded model; the embedding costs no matmul FLOPs (the HLO's FLOPs equal PaLM's
count exactly); the kernel choice and its errors."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import assert_trees_close, batch, place, steps_for, tiny_config
from jaxpar.kernels import attention as kernels
from jaxpar import model as gpt
from jaxpar.config import ConfigError
from jaxpar.validate import validate
from jaxpar.analysis.hlo_flops import hlo_flops
from jaxpar.parallel.logical import activation_rules
from jaxpar.train.step import split_batch
from helpers import VOCAB, microbatches_for, pipe_config

# one worker builds this module's shared fixtures once (under pytest-xdist `--dist loadgroup`)
pytestmark = pytest.mark.xdist_group("test_kernels")

LLAMA = {"model.arch": "llama", "model.kv_heads": 2, "model.tie_embeddings": False}
SP = {"model.sequence_parallel": True, "model.loss_chunk": 4}  # 4 chunks of the 16 positions
# every gradient strategy and schedule with tensor > 1; vocab 250 padded to 256 and split over tensor
CASES = [((2, 4, 1), "gpipe", {"train.microbatches": 2, "optim.zero_stage": 2}), ((1, 2, 4), "gpipe", {}),
         ((2, 2, 2), "circular", {"pipeline.virtual_stages": 2}), ((2, 2, 2), "1f1b", {"optim.zero_stage": 3}),
         ((1, 2, 4), "zb_h1", {}), ((2, 2, 2), "1f1b", LLAMA), ((2, 4, 1), "gpipe", LLAMA)]


def loss_grads(c):
    n = c.mesh.data * c.mesh.tensor * c.mesh.stage
    s = steps_for(c, VOCAB, jax.devices()[:n])
    params = s.init(0)["params"]
    loss, grads = s.grads(params, place(s, batch(16, 16, VOCAB)))
    return float(loss), jax.device_get(grads)


@pytest.fixture(scope="module")
def references():
    return {}


@pytest.mark.parametrize("layout,schedule,over", CASES, ids=lambda x: str(x))
def test_sequence_parallel_equals_one_device(references, layout, schedule, over):
    """Loss (1e-6) and every gradient (1e-5 relative L2) of the step equal the 1-device run (whole loss, no SP)."""
    d, t, s = layout
    M = over.get("train.microbatches", microbatches_for(d))
    fam = {k: v for k, v in over.items() if k in LLAMA}
    key = (M, bool(fam))
    if key not in references:
        references[key] = loss_grads(pipe_config(M=M, **fam))
    over = {k: v for k, v in over.items() if k != "train.microbatches"}
    loss, grads = loss_grads(pipe_config(d, t, s, schedule, over.get("pipeline.virtual_stages", 1), M=M,
                                         **SP, **over))
    np.testing.assert_allclose(loss, references[key][0], rtol=1e-6)
    assert_trees_close(grads, references[key][1])


def test_sequence_parallel_splits_the_residual_stream():
    """At tensor 4 the compiled step's temporaries shrink with SP on (the residual stream is split 4 ways)."""
    temps = []
    for sp in (False, True):
        c = tiny_config(**{"mesh.data": 1, "mesh.tensor": 4, "model.sequence_parallel": sp, "model.seq_len": 64,
                           "model.embed": 64})
        s = steps_for(c, VOCAB, jax.devices()[:4])
        p = s.init(0)["params"]
        temps.append(jax.jit(s.grads).lower(p, place(s, batch(16, 64, VOCAB))).compile()
                     .memory_analysis().temp_size_in_bytes)
    assert temps[1] < 0.8 * temps[0], temps


def whole_logits_loss(fwd, params, x, y, w):
    """The loss as it was before chunking: whole float32 logits, log-sum-exp, the target's logit; autodiff."""
    h = fwd.layers(params["blocks"], fwd.embed(params, x))
    z = fwd.logits(params, h)
    return ((jax.nn.logsumexp(z, -1) - jnp.take_along_axis(z, y[..., None], -1)[..., 0]) * w).sum()


@pytest.mark.parametrize("data,tensor,chunk", [(1, 1, 4), (1, 1, 5), (2, 4, 4), (2, 4, 16)])
def test_chunked_loss_equals_whole_logits(data, tensor, chunk):
    """Loss 1e-6, grads 1e-5 (fp32) against the whole-logits loss, on one device and vocab-parallel (250 ids padded
    to 256, split 4 ways); chunk 5 of seq 16 runs as 4 chunks of 4 (the largest divisor)."""
    c = tiny_config(**{"mesh.data": data, "mesh.tensor": tensor, "model.loss_chunk": chunk,
                       "model.tie_embeddings": tensor == 1})
    s = steps_for(c, VOCAB, jax.devices()[:data * tensor])
    assert s.cfg.vocab_size == 256
    params = s.init(0)["params"]

    def both(p, bt):
        x, y, w, _ = split_batch(bt)
        w = w.at[:, ::3].set(0.0)  # some tokens masked out
        with activation_rules(c.rules, s.mesh):
            new = jax.value_and_grad(lambda p: s.fwd.loss(p, x, y, w)[0])(p)
            old = jax.value_and_grad(lambda p: whole_logits_loss(s.fwd, p, x, y, w))(p)
        return new, old

    (l, g), (lr, gr) = jax.device_get(jax.jit(both)(params, place(s, batch(16, 16, VOCAB))))
    np.testing.assert_allclose(l, lr, rtol=1e-6)
    assert_trees_close(g, gr)


def packed_segments(b, t, seed=0):
    starts = np.random.default_rng(seed).random((b, t)) < 0.03
    starts[:, 0] = True
    return jnp.asarray(np.cumsum(starts, axis=1), jnp.int32)


@pytest.mark.parametrize("packed", [False, True], ids=["causal", "segments"])
def test_pallas_kernel_equals_xla(packed):
    """The Pallas flash kernel in interpret mode (2 blocks of 128: causal across blocks) against XLA's attention:
    output 1e-6 and d(q, k, v) 1e-5 relative L2 (fp32)."""
    k = jax.random.split(jax.random.key(0), 4)
    q, kk, v = (jax.random.normal(x, (2, 256, 2, 16)) for x in k[:3])
    dy = jax.random.normal(k[3], q.shape)
    seg = packed_segments(2, 256) if packed else None

    def run(impl):
        y, pull = jax.vjp(lambda q, k, v: kernels.attention(q, k, v, seg, impl), q, kk, v)
        return y, pull(dy)

    (y, g), (yr, gr) = jax.jit(lambda: run("pallas"))(), jax.jit(lambda: run("xla"))()
    assert_trees_close(y, yr, tol=1e-6)
    assert_trees_close(g, gr)
    if packed:  # and the segments are really honoured: a query never sees another document
        assert not np.allclose(y, jax.jit(lambda: kernels.attention(q, kk, v, None, "xla"))(), atol=1e-3)


def test_pallas_in_a_sharded_packed_model_equals_one_device():
    """model.attention=pallas, packed documents, tensor 2 with 2 microbatches: the kernel runs per shard of heads
    and the loss and grads equal the 1-device XLA run. (Inside the data-parallel or pipeline shard_map, Pallas'
    interpret mode fails JAX's varying-axes check in its own while loop, so this CPU check is tensor-parallel only.)"""
    over = {"model.embed": 64, "model.heads": 4}
    b = batch(16, 16, VOCAB)
    b["segments"] = np.asarray(packed_segments(16, 17, seed=1))

    def run(c):
        n = c.mesh.data * c.mesh.tensor * c.mesh.stage
        s = steps_for(c, VOCAB, jax.devices()[:n])
        loss, g = s.grads(s.init(0)["params"], place(s, b))
        return float(loss), jax.device_get(g)

    ref = run(pipe_config(M=8, **{**over, "model.attention": "xla"}))
    out = run(pipe_config(1, 2, 1, M=2, **{**over, "model.attention": "pallas"}))
    np.testing.assert_allclose(out[0], ref[0], rtol=1e-6)
    assert_trees_close(out[1], ref[1])


def test_hlo_matmul_flops_equal_palm_count_and_embedding_has_none():
    """The compiled step's matmul FLOPs (loops applied) are exactly PaLM's 6N + 12·L·d·T per token (N without the
    input table: the lookup is a gather); the `embed` scope holds no matmul."""
    c = tiny_config(**{"train.microbatches": 2})
    s = steps_for(c, VOCAB, jax.devices()[:1])
    p = s.init(0)["params"]
    f = hlo_flops(jax.jit(s.grads).lower(p, place(s, batch(16, 16, VOCAB))).compile().as_text())
    assert f["total"] == gpt.flops_per_token(s.cfg) * 16 * 16
    assert f["by_scope"]["embed"] == 0 and f["by_scope"]["head"] > 0


def test_kernel_choice():
    ch = kernels.choose
    assert ch("auto", jnp.bfloat16, 2048, 128, False, "cpu")[0] == "xla"
    assert ch("auto", jnp.bfloat16, 2048, 128, False, "gpu")[0] == "cudnn"
    assert ch("auto", jnp.bfloat16, 2048, 128, True, "gpu")[0] == "pallas"  # packed: cuDNN's ids are not public
    impl, why = ch("auto", jnp.float32, 2000, 64, True, "gpu")
    assert impl == "xla" and "multiple of 128" in why and "float32" in why
    with pytest.raises(ValueError, match="bfloat16"):
        ch("cudnn", jnp.float32, 2048, 64, False, "gpu")
    assert "power of two" in ch("auto", jnp.bfloat16, 100, 64, True, "gpu")[1]  # Triton blocks: powers of two
    for over, msg in [({"model.attention": "flash"}, "pick one of"), ({"model.attention": "cudnn"}, "needs a GPU"),
                      ({"model.attention": "pallas", "model.seq_len": 24, "model.max_positions": 24}, "seq a multiple"),
                      ({"model.loss_chunk": 0}, "loss_chunk=0"),
                      ({"model.loss_chunk": 16, "model.seq_len": 34}, "pick a loss_chunk dividing 34"),
                      ({"model.sequence_parallel": True, "model.seq_len": 18, "mesh.tensor": 4}, "seq_len=18")]:
        with pytest.raises(ConfigError, match=msg):
            validate(tiny_config(**{"mesh.data": 1, **over}), 4 if "mesh.tensor" in over else 1)


# ---- grouped matmuls (`jaxpar/kernels/grouped.py`): the Mosaic GPU kernel, here in its interpret mode ------------

def _ulps_off(got, want):
    """|got - want| in units of bfloat16's spacing at |want| (got: bfloat16 results, want: the float32 reference)."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    spacing = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(want), 1e-30))) - 7)
    return np.abs(got - want) / spacing


def test_mosaic_grouped_kernel_and_its_gradients_equal_the_float32_reference():
    """`model.grouped_matmul=mosaic` off GPU runs JAX's Hopper kernel in Mosaic GPU's interpret mode: the forward
    matmul and the input gradient (the same kernel, weight transposed) are the float32 `ragged_dot` of the same
    bfloat16 operands rounded once (<= 1 bfloat16 spacing), with an empty group and rows past the groups (zeros out,
    no gradient in); the weight gradient (XLA's ragged contraction) likewise."""
    from jaxpar.kernels import grouped

    rows, fan_in, fan_out = 256, 64, 128
    groups = jnp.array([50, 0, 130, 60], jnp.int32)  # 240 rows; the last 16 belong to no group
    rng = np.random.default_rng(0)
    x, w, dy = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
                for s in ((rows, fan_in), (4, fan_in, fan_out), (rows, fan_out)))
    assert grouped.choose("mosaic", jnp.bfloat16, fan_in, fan_out) == "mosaic"
    y, vjp = jax.vjp(lambda x, w: grouped.grouped_matmul(x, w, groups, "mosaic"), x, w)
    dx, dw = vjp(dy)
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    want, want_vjp = jax.vjp(lambda x, w: jax.lax.ragged_dot(x, w, groups), f32(x), f32(w))
    want_dx, want_dw = want_vjp(f32(dy))
    for got, ref in ((y, want), (dx, want_dx), (dw, want_dw)):
        assert got.dtype == jnp.bfloat16 and got.shape == ref.shape
        assert _ulps_off(got, ref).max() <= 1.0, _ulps_off(got, ref).max()
    assert not np.asarray(y[240:], np.float32).any() and not np.asarray(dx[240:], np.float32).any()
    assert np.asarray(y[:240], np.float32).all()


def test_grouped_kernel_choice():
    from jaxpar.kernels import grouped

    assert grouped.choose("auto", jnp.bfloat16, 64, 128, backend="cpu") == "xla"  # no Hopper here
    assert grouped.choose("mosaic", jnp.float32, 64, 128) == "xla"  # per matmul: the kernel cannot run float32
    assert grouped.choose("mosaic", jnp.bfloat16, 64, 16) == "xla"  # a rank-16 adapter
    assert "multiples of 64, not 64 x 16" in grouped.mosaic_reason(jnp.bfloat16, 64, 16)
    with pytest.raises(ValueError, match="pick one of"):
        grouped.choose("triton", jnp.bfloat16, 64, 64)
