"""Dynamic loss scaling: DeepSpeed's hysteresis/window rule step by step, the floor, stopping, jit, skipped updates.

Expected sequences are written out by hand from the rule in `jaxpar/train/loss_scale.py` (DeepSpeed's
`DynamicLossScaler.update_scale`, consecutive_hysteresis=False)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from helpers import tiny_config
from jaxpar.train import loss_scale as ls

CFG = ls.LossScaleConfig(initial=16.0, window=3, hysteresis=2, min_scale=1.0, factor=2.0)
OK, OV = True, False  # grads finite / overflow


def run(flags, cfg=CFG):
    state = ls.init(cfg)
    out = []
    for f in flags:
        state, apply = ls.update(state, jnp.asarray(f), cfg)
        assert bool(apply) == f
        out.append((float(state.scale), int(state.hysteresis_left), int(state.good_steps),
                    int(state.consecutive_min_overflows)))
    return state, out


def test_defaults_are_deepspeeds():
    d = ls.LossScaleConfig()
    assert (d.initial, d.window, d.hysteresis, d.min_scale, d.factor, d.consecutive_hysteresis) == (
        2.0 ** 16, 1000, 2, 1.0, 2.0, False)
    s = ls.init()
    assert s.scale.dtype == jnp.float32 and float(s.scale) == 65536.0
    assert all(x.dtype == jnp.int32 for x in s[1:])
    assert int(s.hysteresis_left) == 2 and int(s.good_steps) == 0 and int(s.overflows) == 0
    # from_config works before the keys exist, and reads them once they do
    assert ls.from_config(tiny_config()) == d
    c = tiny_config()
    c.train.loss_scale_window = 3
    c.train.loss_scale_initial = 16.0
    assert ls.from_config(c) == ls.LossScaleConfig(initial=16.0, window=3)


def test_overflows_and_clean_steps_follow_the_hysteresis_rule():
    flags = [OV, OV, OK, OK, OK, OV, OK, OV, OV, OV, OV, OV, OV, OK, OV]
    expected = [  # (scale, hysteresis_left, good_steps, consecutive_min_overflows) after each step
        (16.0, 1, 0, 0),  # overflow, hysteresis 2 -> 1: scale kept
        (8.0, 1, 0, 0),   # overflow, hysteresis spent: halve; hysteresis not refilled
        (8.0, 1, 1, 0),
        (8.0, 1, 2, 0),
        (16.0, 2, 0, 0),  # 3rd clean step in a row = window: grow, hysteresis refilled, count restarts
        (16.0, 1, 0, 0),  # overflow spends hysteresis
        (16.0, 1, 1, 0),  # one clean step does not refill it (consecutive_hysteresis=False)
        (8.0, 1, 0, 0),
        (4.0, 1, 0, 0),
        (2.0, 1, 0, 0),
        (1.0, 1, 0, 0),   # reaches the floor
        (1.0, 1, 0, 1),   # max(1 / 2, 1) = 1; first overflow while already at the minimum
        (1.0, 1, 0, 2),
        (1.0, 1, 1, 0),   # a clean step ends the run of overflows at the minimum
        (1.0, 1, 0, 1),
    ]
    state, got = run(flags)
    assert got == expected
    assert int(state.overflows) == flags.count(OV)


def test_consecutive_hysteresis_refills_on_each_clean_step():
    cfg = ls.LossScaleConfig(initial=16.0, window=3, hysteresis=2, consecutive_hysteresis=True)
    _, got = run([OV, OK, OV, OV, OK], cfg)
    assert [g[:2] for g in got] == [(16.0, 1), (16.0, 2), (16.0, 1), (8.0, 1), (8.0, 2)]


def test_clean_steps_grow_every_window():
    _, got = run([OK] * 7)
    assert [g[0] for g in got] == [16.0, 16.0, 32.0, 32.0, 32.0, 64.0, 64.0]
    assert [g[2] for g in got] == [1, 2, 0, 1, 2, 0, 1]
    # an overflow restarts the count even when it only spends hysteresis
    _, got = run([OK, OK, OV, OK, OK, OK])
    assert [g[0] for g in got] == [16.0, 16.0, 16.0, 16.0, 16.0, 32.0]


def test_min_scale_floor_with_non_power_of_two_min():
    cfg = ls.LossScaleConfig(initial=16.0, window=3, hysteresis=1, min_scale=3.0)
    _, got = run([OV] * 5, cfg)
    assert [g[0] for g in got] == [8.0, 4.0, 3.0, 3.0, 3.0]
    assert [g[3] for g in got] == [0, 0, 0, 1, 2]


def test_should_stop_after_patience_overflows_at_min():
    cfg = ls.LossScaleConfig(initial=2.0, window=3, hysteresis=1)
    state = ls.init(cfg)
    stops = []
    for _ in range(5):
        state, _ = ls.update(state, False, cfg)
        stops.append(bool(ls.should_stop(state, cfg, patience=3)))
    # scale 2 -> 1 (not yet at min before the step), then 3 overflows at the minimum
    assert stops == [False, False, False, True, True]
    state, _ = ls.update(state, True, cfg)
    assert not bool(ls.should_stop(state, cfg, patience=3))
    assert not bool(ls.should_stop(ls.init(cfg), cfg))
    with pytest.raises(ValueError):
        ls.should_stop(state, cfg, patience=0)


def test_bad_config_raises():
    for kw in (dict(window=0), dict(hysteresis=0), dict(factor=1.0), dict(min_scale=0.0),
               dict(initial=0.5)):
        with pytest.raises(ValueError):
            ls.LossScaleConfig(**kw)


def test_state_round_trips_through_jit():
    flags = [OV, OV, OK, OK, OK, OV, OK, OV]
    step = jax.jit(ls.update, static_argnums=2)
    state = ls.init(CFG)
    for f in flags:
        state, apply = step(state, jnp.asarray(f), CFG)
    assert isinstance(state, ls.LossScaleState)
    _, ref = run(flags)
    assert (float(state.scale), int(state.hysteresis_left), int(state.good_steps)) == ref[-1][:3]
    # a plain pytree of arrays: flattens and rebuilds unchanged (what Orbax needs)
    leaves, tdef = jax.tree.flatten(state)
    assert len(leaves) == 5 and jax.tree.unflatten(tdef, leaves) == state
    assert step._cache_size() == 1


@pytest.mark.float16
def test_helpers_scale_unscale_all_finite():
    state = ls.init(CFG)
    assert float(ls.scale_loss(jnp.asarray(1.5, jnp.bfloat16), state)) == 24.0
    g = {"a": jnp.full((2, 3), 32.0, jnp.float16), "b": jnp.arange(3.0)}
    u = ls.unscale(g, state)
    assert u["a"].dtype == jnp.float32 and u["a"].shape == (2, 3)
    np.testing.assert_array_equal(u["a"], 2.0)
    np.testing.assert_array_equal(u["b"], np.arange(3.0) / 16)
    assert bool(ls.all_finite(g)) and bool(ls.all_finite({}))
    assert not bool(ls.all_finite({**g, "c": jnp.array([1.0, jnp.inf])}))
    assert not bool(ls.all_finite({**g, "c": jnp.array([jnp.nan])}))
    # an fp16 gradient that overflows to inf after scaling is caught
    big = ls.scale_loss(jnp.asarray(1e5, jnp.float32), state).astype(jnp.float16)
    assert not bool(ls.all_finite(big))


def test_overflow_skips_adam_update_bitwise():
    opt = optax.adam(1e-2)
    params = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3)}
    opt_state = opt.init(params)
    cfg = CFG

    @jax.jit
    def train(params, opt_state, lstate, bad):
        def loss(p):
            return jnp.sum(p["w"] ** 2) + jnp.sum(p["b"]) * jnp.where(bad, jnp.inf, 1.0)
        g = ls.unscale(jax.grad(lambda p: ls.scale_loss(loss(p), lstate))(params), lstate)
        lstate, apply = ls.update(lstate, ls.all_finite(g), cfg)
        updates, new_opt = opt.update(g, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        params, opt_state = ls.select_tree(apply, (new_params, new_opt), (params, opt_state))
        return params, opt_state, lstate

    lstate = ls.init(cfg)
    p1, o1, lstate = train(params, opt_state, lstate, False)  # a real step first: adam state non-trivial
    assert not np.array_equal(p1["w"], params["w"])
    p2, o2, lstate2 = train(p1, o1, lstate, True)
    assert int(lstate2.overflows) == 1 and int(lstate2.hysteresis_left) == 1
    for a, b in zip(jax.tree.leaves((p2, o2)), jax.tree.leaves((p1, o1))):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.atleast_1d(a).view(np.uint8), np.atleast_1d(b).view(np.uint8))
