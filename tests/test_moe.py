"""Mixture of experts: the MoE layer against a per-token reference, the balancing rules against hand-written formulas,
every expert-parallel layout against the 1-device run (float64, `helpers.assert_equals_one_device`), the tokens a
capacity factor drops, a resume onto another expert size, and the config errors."""
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import (BATCHES, LOSS_F64_RTOL, VOCAB, assert_equals_one_device, assert_params_exact, batch, float64_run,
                     losses, place, reference_run, run_config, steps_for, tiny_config)
from jaxpar import model as gpt
from jaxpar import trainer
from jaxpar.model import moe, moe_dispatch
from jaxpar.config import ConfigError
from jaxpar.validate import validate

needs8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (host) devices")
MOE = {"model.arch": "llama", "model.kv_heads": 4, "model.experts": 8, "model.experts_per_token": 2,
       "model.shared_experts": 1, "model.expert_mlp": 32, "model.aux_loss": 0.01, "model.router_z_loss": 0.001}


def moe_config(**over):
    return tiny_config(**{**MOE, **over})


def tiny_cfg(**over):
    base = dict(vocab_size=128, vocab_real=128, seq_len=6, layers=1, embed=8, heads=2, mlp=16, arch="llama",
                experts=4, experts_per_token=2, expert_mlp=8, param_dtype="float64", compute_dtype="float64")
    return gpt.ModelConfig(**{**base, **over})


def reference_moe(layer, h, cfg):
    """Each token alone: the k chosen experts' SwiGLU outputs weighted by their (renormalised) scores, plus the
    shared experts; numpy float64, no buffers, no capacity."""
    p = jax.tree.map(np.asarray, nnx_state(layer))
    silu = lambda x: x / (1 + np.exp(-x))  # noqa: E731
    mlp = lambda x, w, i=None: (silu(x @ sel(w["w_gate"], i)) * (x @ sel(w["w_up"], i))) @ sel(w["w_down"], i)  # noqa
    sel = lambda a, i: a if i is None else a[i]  # noqa: E731
    out = np.zeros_like(h)
    for b in range(h.shape[0]):
        for t in range(h.shape[1]):
            x = h[b, t]
            z = x @ p["router"]
            s = np.exp(z - z.max()) / np.exp(z - z.max()).sum() if cfg.router == "softmax" else 1 / (1 + np.exp(-z))
            top = np.argsort(-(s + p["router_bias"]), kind="stable")[:cfg.experts_per_token]
            w = s[top] / s[top].sum() if cfg.router_norm_topk else s[top]
            out[b, t] = sum(wi * mlp(x, p["experts"], e) for wi, e in zip(w, top))
            if cfg.shared_experts:
                out[b, t] += mlp(x, p["shared"])
    return out


def nnx_state(layer):
    return nnx.to_pure_dict(nnx.state(layer))


@pytest.mark.parametrize("over", [{}, {"router": "sigmoid", "shared_experts": 1},
                                  {"router_norm_topk": False, "experts_per_token": 1}])
def test_moe_layer_equals_per_token_reference(over):
    """Dropless dispatch and combine through the fixed-size buffers give each token exactly its k experts' sum."""
    cfg = tiny_cfg(**over)
    with jax.enable_x64(True):
        layer = moe.MoE(cfg, nnx.Rngs(params=0))
        layer.router_bias[...] = jnp.asarray([0.0, 0.3, -0.2, 0.1])  # the bias changes the choice, not the weight
        h = np.asarray(jax.random.normal(jax.random.key(1), (3, cfg.seq_len, cfg.embed), jnp.float64))
        out, stats = layer(jnp.asarray(h), cfg)
        np.testing.assert_allclose(np.asarray(out), reference_moe(layer, h, cfg), rtol=1e-12, atol=1e-14)
        assert float(stats["dropped"]) == 0 and float(stats["load"].sum()) == 3 * cfg.seq_len * cfg.experts_per_token


def slots(idx, experts: int, cap: int):
    """Chosen experts `[b, t, k]` -> (each choice's buffer slot `[b, t, k]` in [0, E x C], E x C meaning dropped;
    each slot's token `[b, E x C]`, t for an empty slot; choices per expert `[b, E]`), one device's sequences: the
    dispatch's own steps (`jaxpar/model/moe_dispatch.py`)."""
    b, t, k = idx.shape
    order = moe_dispatch.priority_order(idx)
    pos, counts, _ = moe_dispatch.queue_positions(order, experts, k)
    dest, token = moe_dispatch.slots_of(order, pos < cap, experts, cap, t)
    return dest.reshape(b, k, t).transpose(0, 2, 1), token, counts


def test_capacity_drops_by_priority_within_each_sequence():
    """Capacity C per expert per sequence; all first choices before any second choice, each in token order; a
    dropped choice adds nothing."""
    idx = jnp.asarray([[[0, 1], [0, 2], [0, 1]]])  # one sequence, 3 tokens, k = 2, experts 0..2
    dest, token, counts = slots(idx, 3, 2)
    sink = 3 * 2
    # first choices: expert 0 by tokens 0, 1, 2 -> slots 0, 1, dropped; second: expert 1 by 0, 2 -> 2, 3; expert 2
    np.testing.assert_array_equal(dest[0], [[0, 2], [1, 4], [sink, 3]])
    np.testing.assert_array_equal(token[0], [0, 1, 0, 2, 1, 3])  # slot -> token (3: empty)
    np.testing.assert_array_equal(counts[0], [3, 2, 1])
    assert moe.capacity(tiny_cfg(capacity_factor=1.0), 6) == 3 and moe.capacity(tiny_cfg(), 6) == 6


def test_balancing_loss_and_bias_update_equal_the_formulas():
    """aux = sum over sequences of E * sum_e f_e P_e (f_e: the sequence's fraction of choices for e, P_e its mean
    probability); z = sum over sequences of the mean of logsumexp(logits)^2; the bias moves by rate toward the mean
    load (DeepSeek-V3)."""
    cfg = tiny_cfg(experts=4, experts_per_token=2)
    logits = np.asarray(jax.random.normal(jax.random.key(3), (2, 5, 4)), np.float32)
    scores, idx, _ = moe.route(jnp.asarray(logits), jnp.zeros(4), cfg)
    _, _, counts = slots(idx, 4, 5)
    aux, z = moe.balance_stats(jnp.asarray(logits), scores, counts, cfg)
    p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    want_aux = want_z = 0.0
    for b in range(2):
        top = np.argsort(-p[b], axis=-1)[:, :2]
        f = np.array([(top == e).sum() for e in range(4)]) / (2 * 5)
        want_aux += 4 * np.sum(f * p[b].mean(0))
        want_z += np.mean(np.log(np.exp(logits[b]).sum(-1)) ** 2)
    np.testing.assert_allclose([float(aux), float(z)], [want_aux, want_z], rtol=1e-6)
    load = jnp.asarray([[5.0, 1.0, 3.0, 3.0]])
    np.testing.assert_allclose(moe.update_bias(jnp.zeros((1, 4)), load, 0.01), [[-0.01, 0.01, 0.0, 0.0]])


def test_active_parameters_count_k_of_the_experts():
    """FLOPs count the router, the shared experts and k of E routed experts per MoE layer; the dense layers their
    MLP."""
    cfg = tiny_cfg(layers=4, first_dense_layers=1, shared_experts=1)
    c = gpt.param_counts(cfg)
    d, f, fe, E, k = cfg.embed, cfg.mlp, cfg.expert_mlp, cfg.experts, cfg.experts_per_token
    attn = 2 * d * cfg.heads * cfg.head_dim + 2 * d * cfg.kv_heads * cfg.head_dim
    moe_layer = attn + d * E + 3 * d * fe + k * 3 * d * fe
    dense_layer = attn + 3 * d * f
    assert c["matmul"] == 3 * moe_layer + dense_layer + cfg.vocab_size * d
    assert c["experts"] == 4 * E * 3 * d * fe


# ---- every layout equals the 1-device run (float64) ------------------------------------------------------------

def packed(seed=0):
    b = batch(16, 16, VOCAB, seed)
    seg = np.zeros((16, 17), np.int32)
    rng = np.random.default_rng(seed)
    for r in range(16):
        for c in sorted(rng.choice(np.arange(1, 17), int(rng.integers(0, 4)), replace=False)):
            seg[r, c:] += 1
    return {**b, "segments": seg}


@needs8
@pytest.mark.parametrize("over", [
    {"mesh.expert": 4, "mesh.data": 2},
    {"mesh.expert": 2, "mesh.tensor": 2, "mesh.data": 2, "model.sequence_parallel": True},
    {"mesh.expert": 4, "mesh.data": 2, "optim.zero_stage": 3, "train.microbatches": 2},
    {"mesh.expert": 2, "mesh.data": 4, "optim.zero_stage": 2, "model.router": "sigmoid",
     "model.router_bias_rate": 0.01, "model.first_dense_layers": 1, "model.remat": "selective"},
    {"mesh.expert": 2, "mesh.stage": 2, "mesh.data": 2, "train.microbatches": 4, "pipeline.schedule": "1f1b"},
    {"mesh.expert": 2, "mesh.stage": 2, "mesh.data": 2, "train.microbatches": 4, "pipeline.schedule": "zb_h1",
     "model.router": "sigmoid", "model.router_bias_rate": 0.01, "model.first_dense_layers": 1},
    {"mesh.expert": 2, "mesh.stage": 2, "mesh.data": 2, "train.microbatches": 4, "pipeline.schedule": "circular",
     "pipeline.virtual_stages": 2, "optim.zero_stage": 1},
], ids=["e4d2", "e2t2d2-SP", "e4d2-zero3-M2", "e2d4-zero2-sigmoid-bias-dense1", "e2s2d2-1f1b",
        "e2s2d2-zbh1-sigmoid-bias-dense1", "e2s2d2-circular-v2-zero1"])
def test_expert_parallel_layouts_equal_one_device(over):
    assert_equals_one_device(moe_config(**over), VOCAB, BATCHES)


@needs8
def test_packed_documents_on_expert_parallel_layout():
    assert_equals_one_device(moe_config(**{"mesh.expert": 4, "mesh.data": 2}), VOCAB, [packed(s) for s in range(3)])


@needs8
def test_capacity_drops_the_same_tokens_on_every_layout():
    """capacity factor 1.0: the same choices dropped on 1 device and on (expert 4, data 2) (counted per layer), and
    the same losses, gradients and params."""
    assert_same_drops(moe_config(**{"model.capacity_factor": 1.0, "mesh.expert": 4, "mesh.data": 2}), BATCHES)


def assert_same_drops(c, batches):
    """`c`'s layout equals its 1-device run (losses, gradients, params in float64) and drops the same choices, some
    in every layer and step (counted per layer), with the same load per expert."""
    (got, params, grads, m), (want, r_params, r_grads, r_m) = float64_run(c, VOCAB, batches), \
        reference_run(c, VOCAB, batches)
    assert_params_exact(grads, r_grads)
    assert_params_exact(params, r_params)
    np.testing.assert_allclose(got, want, rtol=LOSS_F64_RTOL)
    for a, b in zip(m, r_m):
        assert np.asarray(a["moe_dropped"]).min() > 0  # some choices were dropped in every layer, every step
        np.testing.assert_array_equal(a["moe_dropped"], b["moe_dropped"])
        np.testing.assert_array_equal(a["moe_load"], b["moe_load"])


# ---- ragged: the choices sorted by expert, grouped matmuls (`model.moe_impl=ragged`) ---------------------------

@pytest.mark.parametrize("over", [{}, {"router": "sigmoid", "shared_experts": 1, "capacity_factor": 1.0}])
def test_ragged_equals_buffers_and_the_per_token_reference(over):
    """One device, float64: the sorted rows through grouped matmuls give the buffers' outputs, stats and gradients
    (dropless: also each token's k experts' sum)."""
    cfg, buf = tiny_cfg(moe_impl="ragged", **over), tiny_cfg(moe_impl="buffers", **over)
    with jax.enable_x64(True):
        layer = moe.MoE(cfg, nnx.Rngs(params=0))
        layer.router_bias[...] = jnp.asarray([0.0, 0.3, -0.2, 0.1])
        h = jnp.asarray(jax.random.normal(jax.random.key(1), (3, cfg.seq_len, cfg.embed), jnp.float64))
        (out, stats), (want, want_stats) = layer(h, cfg), layer(h, buf)
        np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-12, atol=1e-15)
        for k in moe.STATS:
            np.testing.assert_allclose(np.asarray(stats[k]), np.asarray(want_stats[k]), rtol=1e-12)
        if not over:
            np.testing.assert_allclose(np.asarray(out), reference_moe(layer, np.asarray(h), cfg), rtol=1e-12,
                                       atol=1e-14)
        else:
            assert float(stats["dropped"]) > 0
        grad = lambda c: nnx.grad(lambda m: jnp.sum(jnp.sin(m(h, c)[0])))(layer)  # noqa: E731
        for a, b in zip(jax.tree.leaves(grad(cfg)), jax.tree.leaves(grad(buf))):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-12, atol=1e-15)


RAGGED = {"model.moe_impl": "ragged"}


def test_the_mosaic_grouped_kernel_runs_the_experts_as_xla_would():
    """`model.grouped_matmul=mosaic` (JAX's Hopper kernel; here in Mosaic GPU's interpret mode) in a bfloat16 MoE
    layer with LoRA adapters on its experts (their rank-8 matmuls fall back to `ragged_dot`), dropping choices:
    outputs and every gradient equal the `xla` kernel's. Both round each matmul once to bfloat16 from float32
    sums, in another order: the bound is a few bfloat16 spacings (2^-8) of each tensor's largest value."""
    over = dict(embed=64, expert_mlp=64, moe_impl="ragged", capacity_factor=1.0, param_dtype="bfloat16",
                compute_dtype="bfloat16", lora_rank=8, lora_alpha=16, lora_targets=("moe.experts.w_gate", "moe.experts.w_down"))
    cfg, ref = tiny_cfg(grouped_matmul="mosaic", **over), tiny_cfg(grouped_matmul="xla", **over)
    layer = moe.MoE(cfg, nnx.Rngs(params=0))
    for name in ("w_gate", "w_down"):  # PEFT's B starts at zero: make the adapters count
        b = getattr(layer.experts.lora, name).b
        b[...] = jax.random.normal(jax.random.key(b.size), b.shape, b.dtype) * 0.1
    h = jax.random.normal(jax.random.key(1), (2, cfg.seq_len, cfg.embed), jnp.bfloat16)
    run = lambda c: nnx.value_and_grad(lambda m: jnp.sum(jnp.sin(m(h, c)[0].astype(jnp.float32))))(layer)  # noqa
    (loss, grads), (want, want_grads) = run(cfg), run(ref)
    assert float(layer(h, cfg)[1]["dropped"]) > 0
    for got, exp in [(loss, want)] + list(zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads))):
        got, exp = np.asarray(got, np.float32), np.asarray(exp, np.float32)
        assert np.abs(got - exp).max() <= 4 * 2.0 ** -8 * np.abs(exp).max(), (np.abs(got - exp).max(), exp.shape)


@needs8
@pytest.mark.parametrize("over", [
    {"mesh.expert": 2, "mesh.tensor": 2, "mesh.data": 2, "model.sequence_parallel": True},
    {"mesh.expert": 2, "mesh.stage": 2, "mesh.data": 2, "train.microbatches": 4, "pipeline.schedule": "1f1b",
     "optim.zero_stage": 3},
], ids=["e2t2d2-SP", "e2s2d2-1f1b-zero3"])
def test_ragged_expert_parallel_layouts_equal_the_one_device_buffers_run(over):
    """`ragged` on expert-parallel layouts against the 1-device run of `buffers` (`helpers.reference_config`), so
    the one comparison shows both equalities."""
    assert_equals_one_device(moe_config(**RAGGED, **over), VOCAB, BATCHES)


@needs8
def test_ragged_drops_the_same_choices_on_packed_documents():
    """capacity factor 1.0 and packed documents at (expert 4, data 2): `ragged` drops the same choices as the
    1-device `buffers` run (counted per layer) and computes the same losses, gradients and params."""
    assert_same_drops(moe_config(**RAGGED, **{"model.capacity_factor": 1.0, "mesh.expert": 4, "mesh.data": 2}),
                      [packed(s) for s in range(3)])


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes):
    """`jax.lax.ragged_all_to_all` over `expert` (one slice per device) as its documentation specifies it, built of
    plain all-to-alls and a scatter, since XLA:CPU has no ragged all-to-all."""
    n, d = operand.shape
    r = jnp.arange(n)
    rows = jnp.take(operand, jnp.clip(input_offsets[:, None] + r[None, :], 0, n - 1), axis=0)  # [ep, n, d]
    blocks = jnp.where((r[None, :] < send_sizes[:, None])[..., None], rows, 0)
    arrived = jax.lax.all_to_all(blocks, "expert", 0, 0, tiled=True)  # block s: what device s sent here
    offsets = jax.lax.all_to_all(output_offsets, "expert", 0, 0, tiled=True)  # where device s said to put it
    place = jnp.where(r[None, :] < recv_sizes[:, None], offsets[:, None] + r[None, :], output.shape[0])
    return output.at[place.reshape(-1)].set(arrived.reshape(-1, d), mode="drop")


def _send_rows_run(trip, factor, xs, groups, w):
    """`moe_dispatch._expert_parallel` on 4 expert devices (float64) -> (outputs, rows lost, gradients of
    sum(sin(outputs)) for the rows and the three weights)."""
    from types import SimpleNamespace

    from jax.sharding import PartitionSpec as P

    from jaxpar.model import moe_dispatch

    def body(x, g, wg, wu, wd):
        mlp = SimpleNamespace(w_gate=wg, w_up=wu, w_down=wd)
        ys, lost = moe_dispatch._expert_parallel(mlp, x[0], g[0], factor, trip=trip)
        return ys[None], lost[None]

    mesh = jax.make_mesh((xs.shape[0],), ("expert",), devices=jax.devices()[:xs.shape[0]])
    run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("expert"),) * 5, out_specs=(P("expert"),) * 2))
    args = [jax.device_put(a, jax.sharding.NamedSharding(mesh, P("expert"))) for a in (xs, groups, *w)]
    ys, lost = run(*args)
    loss = lambda x, *w: jnp.sum(jnp.sin(run(x, args[1], *w)[0]))  # noqa: E731
    with jax.set_mesh(mesh):
        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(args[0], *args[2:])
    return np.asarray(ys), np.asarray(lost), [np.asarray(g) for g in grads]


@needs8
@pytest.mark.parametrize("factor", [0.0, 1.0])
def test_the_expert_parallel_send_buffer_drops_what_overflows_it(factor, monkeypatch):
    """`moe_dispatch` under expert parallelism (4 devices, 8 experts), against numpy: each row comes back as its
    expert's SwiGLU; with `expert_buffer_factor` f each device sends at most R = ceil(f x rows / 4) rows to each
    device, the last rows of a longer run come back as zeros and are counted; f = 0 (the worst case) drops none.
    The GPU's exchange (`jax.lax.ragged_all_to_all`, here emulated from its documented semantics) gives the padded
    all-to-all's outputs and gradients."""
    from jaxpar.model import moe_dispatch

    ep, E, n, d, f = 4, 8, 24, 6, 5
    rng = np.random.default_rng(0)
    experts = np.sort(rng.choice(E, (ep, n), p=[0.4, 0.3] + [0.05] * 6), axis=1)  # skewed: some runs overflow
    groups = np.stack([np.bincount(e, minlength=E) for e in experts]).astype(np.int32)
    xs, w = rng.normal(size=(ep, n, d)), [rng.normal(size=s) for s in ((E, d, f), (E, d, f), (E, f, d))]
    monkeypatch.setattr(moe_dispatch, "exchange_ragged", emulated_ragged_all_to_all)
    with jax.enable_x64(True):
        ys, lost, grads = _send_rows_run("padded", factor, xs, groups, w)
        ragged_ys, ragged_lost, ragged_grads = _send_rows_run("ragged", factor, xs, groups, w)
    np.testing.assert_array_equal(ragged_lost, lost)
    for a, b in zip([ragged_ys] + ragged_grads, [ys] + grads):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
    R = moe_dispatch.send_rows(n, ep, factor)
    silu = lambda v: v / (1 + np.exp(-v))  # noqa: E731
    for dev in range(ep):
        dst = experts[dev] // (E // ep)
        rank = np.array([np.sum(dst[:i] == dst[i]) for i in range(n)])  # place in its destination's run
        for i, e in enumerate(experts[dev]):
            want = (silu(xs[dev, i] @ w[0][e]) * (xs[dev, i] @ w[1][e])) @ w[2][e] if rank[i] < R else np.zeros(d)
            np.testing.assert_allclose(np.asarray(ys[dev, i]), want, rtol=1e-12, atol=1e-12)
        assert int(lost[dev]) == sum(max(0, int(np.sum(dst == k)) - R) for k in range(ep))
    assert (int(np.sum(lost)) > 0) == (factor > 0)
    assert np.abs(grads[0]).max() > 0 and (np.abs(grads[0]).min(-1) == 0).any() == (factor > 0)  # dropped: none


@needs8
def test_resume_onto_another_expert_size(corpus, tmp_path):
    """A run at (expert 4, data 2) stopped at step 3 resumes at (expert 2, data 4): its step-4 loss (a forward pass
    from the restored params) equals the uninterrupted run's."""
    src = tmp_path / "src"
    trainer.run(run_config(corpus, tmp_path, **MOE, **{"mesh.expert": 4, "mesh.data": 2}), str(src))
    wd = tmp_path / "resumed"
    shutil.copytree(src / "checkpoints" / "3", wd / "checkpoints" / "3")
    trainer.run(run_config(corpus, tmp_path, **MOE, **{"mesh.expert": 2, "mesh.data": 4, "train.steps": 4}), str(wd))
    a, b = losses(src)[4], losses(wd)[4]
    assert abs(b - a) <= 1e-6 * abs(a), (a, b)


# ---- bad input: one line each, before compiling -----------------------------------------------------------------

@pytest.mark.parametrize("over,match", [
    ({"mesh.expert": 3, "mesh.data": 1}, r"model.experts=8 is not divisible by mesh.expert=3"),
    ({"model.experts_per_token": 9}, r"model.experts_per_token=9 > model.experts=8"),
    ({"model.capacity_factor": -1.0}, r"model.capacity_factor=-1.0 must be a number >= 0"),
    ({"mesh.expert": 4, "mesh.data": 2, "train.global_batch_size": 12},
     r"global_batch_size=12 is not divisible by mesh.data=2 x mesh.expert=4 x train.microbatches=1 = 8"),
    ({"model.experts": 0, "mesh.expert": 2}, r"mesh.expert=2 but model.experts=0"),
    ({"model.moe_impl": "buffers", "mesh.expert": 4, "mesh.data": 2, "model.expert_buffer_factor": 1.5},
     r"model.expert_buffer_factor=1.5 bounds the rows `ragged` sends .* but model.moe_impl='buffers' sends fixed"),
    ({"model.moe_impl": "ragged", "model.expert_buffer_factor": 1.5}, r"but mesh.expert=1 sends no rows"),
    ({"model.moe_impl": "grouped"}, r"model.moe_impl='grouped'"),
    ({"model.moe_impl": "buffers", "model.grouped_matmul": "mosaic"},
     r"grouped_matmul='mosaic' runs `ragged`'s grouped matmuls, but model.moe_impl='buffers' runs none"),
    ({**RAGGED, "model.grouped_matmul": "mosaic"}, r"in train.compute_dtype=float32: the Mosaic GPU grouped kernel "
                                                   r"takes float16/bfloat16"),
    ({**RAGGED, "model.grouped_matmul": "mosaic", "train.compute_dtype": "bfloat16"},
     r"cannot run the experts' \[32, 32\] matmuls .* multiples of 64, not 32 x 32; use 'auto' or 'xla'"),
])
def test_bad_moe_config_is_one_clear_error(over, match):
    with pytest.raises(ConfigError, match=match):
        validate(moe_config(**over), 8 if over.get("mesh.expert", 1) != 3 else 3)


def test_the_mosaic_kernel_is_refused_on_a_gpu_before_hopper(monkeypatch):
    from types import SimpleNamespace

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "devices", lambda *a: [SimpleNamespace(device_kind="NVIDIA A100-SXM4-80GB",
                                                                    compute_capability="8.0")])
    over = {**RAGGED, "model.grouped_matmul": "mosaic", "train.compute_dtype": "bfloat16", "model.embed": 64,
            "model.expert_mlp": 64}
    with pytest.raises(ConfigError, match=r"runs JAX's Hopper kernel \(compute capability 9.x\), but this GPU is "
                                          r"NVIDIA A100-SXM4-80GB \(8.0\); use 'auto' or 'xla'"):
        validate(moe_config(**over), 1)


@needs8
def test_bfloat16_expert_parallel_step_compiles_once_and_keeps_the_state_dtypes():
    """bfloat16 weights and compute at (expert 4, data 2): the state keeps its dtypes across steps (AdamW's moment
    would come back in the float32 gradients' dtype), so the step compiles once; its first loss is float32's within
    bfloat16's rounding."""
    bf16 = moe_config(**{"mesh.expert": 4, "mesh.data": 2, "train.param_dtype": "bfloat16",
                         "train.compute_dtype": "bfloat16"})
    s = steps_for(bf16, VOCAB, jax.devices())
    state = s.init(0)
    dtypes = jax.tree.map(lambda a: a.dtype, state)
    losses = []
    for b in BATCHES:
        state, m = s.train(state, place(s, b))
        losses.append(float(m["loss"]))
    assert jax.tree.map(lambda a: a.dtype, state) == dtypes and s.train._cache_size() == 1
    f32 = float64_run(moe_config(**{"mesh.expert": 4, "mesh.data": 2}), VOCAB, BATCHES[:1])[0][0]
    assert np.isfinite(losses).all() and abs(losses[0] - f32) <= 2e-2 * f32, (losses, f32)
