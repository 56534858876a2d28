"""1F1B and ZB-H1 (backward inside the pipeline's loop): every layout equals the 1-device run, ZeRO included; the
tick tables keep their dependencies and meet the theory; per-device memory stays flat in M where GPipe's grows."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import assert_equals_one_device, assert_trees_close, batch, place, steps_for
from jaxpar.parallel import pipeline
from jaxpar.parallel.mesh import make_mesh
from helpers import BATCHES, VOCAB, microbatches_for, pipe_config

# ZeRO 1 only shards the optimizer state (nothing the pipeline sees); 2 and 3 change what enters and leaves the loop
CASES = [((1, 1, 8), "1f1b", {}), ((2, 1, 4), "1f1b", {}), ((1, 2, 4), "1f1b", {}),
         ((2, 2, 2), "1f1b", {}), ((1, 1, 4), "1f1b", {"pipeline.remat": False}),
         ((2, 2, 2), "1f1b", {"optim.zero_stage": 3}),
         ((1, 1, 4), "zb_h1", {}), ((2, 2, 2), "zb_h1", {}), ((4, 1, 2), "zb_h1", {}),
         ((2, 1, 4), "zb_h1", {"optim.zero_stage": 3}),
         ((1, 1, 4), "1f1b", {"pipeline.virtual_stages": 2}),
         ((2, 2, 2), "1f1b", {"pipeline.virtual_stages": 2, "optim.zero_stage": 2})]


@pytest.mark.parametrize("layout,schedule,over", CASES, ids=lambda x: str(x))
def test_schedule_equals_one_device(layout, schedule, over):
    """`helpers.assert_equals_one_device`: the first step's gradients, losses and params after 3 steps, float64."""
    d, t, s = layout
    assert_equals_one_device(pipe_config(d, t, s, schedule, 1, M=microbatches_for(d), **over), VOCAB, BATCHES)


def toy(mesh, schedule, remat=True):
    """A GPT-free pipeline with separate first/last params: x -> tanh(x W_l); against plain autodiff."""
    M, L, d = schedule.microbatches, 8, 4
    keys = jax.random.split(jax.random.key(0), 4)
    W = jax.random.normal(keys[0], (L, d, d)) / 2
    shared = {"emb": jax.random.normal(keys[1], (d,)), "head": jax.random.normal(keys[2], (d,))}
    xs = {"x": jax.random.normal(keys[3], (M, 2, d))}
    first = lambda sh, mb: mb["x"] * sh["emb"]
    layer = lambda w, a, l, mb: jnp.tanh(a @ w) + 0.01 * l
    last = lambda sh, a, mb: (jnp.sum((a * sh["head"]) ** 2), jnp.float32(a.size))

    def plain(W, shared):
        tot = 0.0
        for i in range(M):
            a = first(shared, {"x": xs["x"][i]})
            for l in range(L):
                a = layer(W[l], a, l, None)
            tot += last(shared, a, None)[0]
        return 0.5 * tot

    loss, grads = jax.value_and_grad(plain, (0, 1))(W, shared)
    S, v = schedule.stages, schedule.virtual
    out = jax.jit(lambda W, sh: pipeline.run_loop(first, layer, last, sh, pipeline.to_stage_major(W, S, v), xs,
                                               schedule, mesh, jnp.float32(0.5), remat=remat))(W, shared)
    return (0.5 * out[0], (pipeline.from_stage_major(out[4], S, v), out[3])), (loss, grads)


@pytest.mark.parametrize("name,v,M,remat", [("1f1b", 1, 6, True), ("1f1b", 1, 6, False), ("zb_h1", 1, 6, True),
                                             ("1f1b", 2, 8, True), ("1f1b", 2, 4, False)])
def test_toy_pipeline_equals_autodiff(name, v, M, remat):
    mesh = make_mesh({"data": 1, "stage": 4, "tensor": 1}, jax.devices()[:4])
    (loss, grads), (ref_loss, ref_grads) = toy(mesh, pipeline.table(name, 4, M, v), remat)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert_trees_close(grads, ref_grads)


def _ticks(sched, lane):
    """`[S, M]` tick at which each stage runs each microbatch in `lane`; asserts each runs exactly once."""
    out = np.full((sched.stages, sched.microbatches), -1)
    for t, s in zip(*np.nonzero(sched.ok[lane])):
        assert out[s, sched.mb[lane][t, s]] == -1
        out[s, sched.mb[lane][t, s]] = t
    assert (out >= 0).all()
    return out


@pytest.mark.parametrize("S,M", [(2, 2), (2, 9), (4, 4), (4, 16), (8, 8), (8, 40)])
def test_tick_tables_keep_dependencies_and_meet_theory(S, M):
    one, zb = pipeline.one_f_one_b(S, M), pipeline.zb_h1(S, M)
    for sched in (one, zb):
        F, B = _ticks(sched, "f"), _ticks(sched, "b")
        assert (F[1:] > F[:-1]).all() and (B[:-1] > B[1:]).all() and (B > F).all()
        if sched.split:
            W = _ticks(sched, "w")
            assert (W > B).all()
            assert (sched.ok["f"].astype(int) + sched.ok["b"] + sched.ok["w"] <= 1).all()  # one op per tick
    # f = b = w = 1: 1F1B (M + S - 1)/M of the ideal 3M (Narayanan et al. 2021); ZB-H1 (M + (S - 1)/3)/M (Qi et al.)
    assert one.ticks == M + 2 * S - 1 and one.time() == 3 * (M + S - 1)
    assert zb.time() == 3 * M + S - 1
    assert pipeline.zb_h1(S, M, cap=lambda s: S - s).time() == 3 * M + 2 * (S - 1)
    # O(S) in flight per stage, whatever M
    assert (one.in_flight() <= 2 * (S - np.arange(S)) - 1).all()
    assert (zb.in_flight() <= 2 * S - 1 - np.arange(S)).all()
    assert one.ring("act") <= 2 * S and zb.ring("wgrad") <= 2 * S


@pytest.mark.parametrize("S,v,M", [(2, 2, 4), (4, 2, 8), (4, 2, 32), (4, 3, 12), (8, 2, 16)])
def test_interleaved_1f1b_table(S, v, M):
    sched = pipeline.one_f_one_b(S, M, v)
    F, B = sched.chunk_ticks("f"), sched.chunk_ticks("b")  # [v·S, M]: chunk c on stage c mod S
    assert (F >= 0).all() and (B >= 0).all()
    assert (F[1:] > F[:-1]).all() and (B[:-1] > B[1:]).all() and (B > F).all()
    # (v·M + S - 1)/(v·M) of the ideal (Narayanan et al. 2021, sec. 2.2); O(v·S) held per stage whatever M
    assert sched.time() == pytest.approx(3 * M * (v * M + S - 1) / (v * M))
    assert (sched.in_flight() <= (v + 1) * S).all() and sched.ring("act") <= 2 * v * S


def temp_bytes(schedule, M):
    c = pipe_config(1, 1, 4, schedule, 1, M=M, **{"train.global_batch_size": 4 * M, "model.embed": 64,
                                                    "model.mlp": 256, "model.seq_len": 64, "model.layers": 4})
    s = steps_for(c, VOCAB, jax.devices()[:4])
    lowered = s.train.lower(s.abstract_state(), place(s, batch(4 * M, 64, VOCAB)))
    return lowered.compile().memory_analysis().temp_size_in_bytes


def test_activation_memory_flat_in_microbatches():
    """Per-device temporaries from M = 8 to M = 16 (4 sequences of 64 tokens per microbatch, S = 4): GPipe's grow by
    at least one stage input per extra microbatch (what autodiff keeps per tick), 1F1B's and ZB-H1's by less than
    one stage input in all (ring buffers of O(S) microbatches, full from M = 2S on)."""
    act = 4 * 64 * 64 * 4  # bytes of one stage input [micro_batch, seq, embed] float32
    grow = lambda name: temp_bytes(name, 16) - temp_bytes(name, 8)
    assert grow("gpipe") >= 8 * act
    for name in ("1f1b", "zb_h1"):
        assert grow(name) < act, name
