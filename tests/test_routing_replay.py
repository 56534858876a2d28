"""GRPO's routing replay on a mixture of experts (`grpo.routing_replay`, on by default): every pass over a round's
completions routes each token to the experts the generation engine routed it to when sampling.

The independent reference: a MoE router's choice bias only chooses, it never weighs (`moe.route`). So the round is
sampled by a model Q that differs from the training params P in its choice biases only: P's forward with Q's replayed
routes must be Q's own forward, bit for bit, and the engine's sampling log-probs within float32 rounding; P's forward
without replay routes otherwise and differs. On the pipeline, ZeRO-3 and expert-parallel layouts the loss and the
gradients with replay equal the one-device run (float64)."""
import os
import sys

import jax
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from helpers import (EQUIVALENT_LAYOUTS, assert_trees_close, float64_config, steps_for,  # noqa: E402
                     tiny_config)
from jaxpar import model as gpt  # noqa: E402
from jaxpar.generate.engine import Engine  # noqa: E402
from jaxpar.rl import rollout  # noqa: E402
from jaxpar.train.objectives import TokenLogps  # noqa: E402

pytestmark = pytest.mark.xdist_group("test_routing_replay")

V, T, G = 300, 32, 4
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13]]
ROWS = G * len(PROMPTS)
LAYOUTS = {**EQUIVALENT_LAYOUTS, "expert_4x2": {"mesh.data": 2, "mesh.expert": 4},
           "circular_2x2_v2": {"mesh.data": 2, "mesh.stage": 2, "pipeline.schedule": "circular",
                               "pipeline.virtual_stages": 2, "train.microbatches": 2}}  # (layers stored permuted)


def config(**over):
    return tiny_config(**{"mesh.data": 1, "model.seq_len": T, "train.global_batch_size": len(PROMPTS),
                          "train.objective": "grpo", "grpo.num_generations": G, "grpo.max_completion_length": 8,
                          "grpo.epsilon": 0.0, "model.arch": "llama", "model.experts": 4,
                          "model.experts_per_token": 2, "model.expert_mlp": 32, **over})


def _odd(completion_ids, **kw):
    return [sum(i % 2 for i in c) / len(c) for c in completion_ids]


@pytest.fixture(scope="module")
def sampled():
    """(steps, P, Q, the completions Q's engine sampled, the round's batch with `routes`)."""
    st = steps_for(config(), V, jax.devices()[:1])
    assert st.objective.routing_replay  # derived: a MoE model
    P = jax.device_get(st.init(0)["params"])
    Q = jax.tree.map(np.array, P)
    bias = Q["blocks"]["moe"]["router_bias"]
    Q["blocks"]["moe"]["router_bias"] = np.random.default_rng(0).normal(0, 0.05, bias.shape).astype(bias.dtype)
    done = rollout.sample(Engine.on_steps(st, Q, config(), prompt_experts=True), PROMPTS, G, 8, seed=3, temperature=1.0)
    rnd = rollout.round_batch(PROMPTS, [{"prompt": "p"}] * len(PROMPTS), done, [("odd", _odd)], [1.0], G, "group", T,
                              replay=True)
    return st, P, Q, done, rnd.batch


def test_the_round_carries_the_engines_routes(sampled):
    """Row i's routes are completion i's prompt positions' experts then its tokens' (`Completion.prompt_experts`,
    `.experts`), one per input position of the row, -1 past it."""
    _, _, _, done, batch = sampled
    assert batch["routes"].shape == (ROWS, T, 4, 2) and batch["routes"].dtype == np.int32
    for i, c in enumerate(done):
        p = PROMPTS[i // G]
        n = len(p) + len(c.tokens) - 1
        assert c.prompt_experts.shape == (len(p) - 1, 4, 2) and c.experts.shape == (len(c.tokens), 4, 2)
        np.testing.assert_array_equal(batch["routes"][i, :n], np.concatenate([c.prompt_experts, c.experts]))
        assert (batch["routes"][i, n:] == -1).all()


def test_replayed_routes_make_the_training_forward_the_samplers(sampled):
    st, P, Q, _, batch = sampled
    put = lambda b: jax.device_put({k: v.astype(np.float32) if v.dtype == np.float64 else v  # noqa: E731
                                    for k, v in b.items()}, st.batch_sharding)
    without = {k: v for k, v in batch.items() if k != "routes"}
    logps = lambda params, b: np.asarray(st.forward(params, put(b), TokenLogps(ROWS))[1])  # noqa: E731
    replayed, q_own, p_own = logps(P, batch), logps(Q, without), logps(P, without)
    mask, routed = batch["mask"] > 0, batch["routes"][:, :, 0, 0] >= 0  # (past a row, its padding: P's routing)
    np.testing.assert_array_equal(replayed[routed], q_own[routed])  # the sampler's routing, exactly
    assert np.abs(p_own - q_own)[mask].max() > 1e-3  # P routes otherwise: the replay is what made them equal
    np.testing.assert_allclose(replayed[mask], batch["old"][mask], atol=2e-6)  # the engine's sampling log-probs


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_routing_replay_on_layouts_equals_one_device(sampled, name):
    """Float64: with Q's routes, P's old-policy log-probs (`rollout.with_old_logps`, mu = 2), the GRPO loss of a
    second pass (the engine's log-probs as the old policy's) and its gradients on (2,2,2) 1F1B, ZeRO-3,
    expert-parallel and circular (layers stored permuted) layouts equal one device's; without the routes the loss
    differs."""
    _, P, _, _, batch = sampled
    advantages = np.linspace(0.2, 1, ROWS)  # (of one sign: a loss that no cancellation makes tiny)

    def run(over, b, devices):
        c = config(**{"grpo.num_iterations": 2, "grpo.epsilon": 0.2, **over})
        st = steps_for(float64_config(c), V, jax.devices()[:devices])
        order = np.asarray(st.layer_order)
        params = gpt.map_layers(jax.tree.map(lambda a: np.asarray(a, np.float64) if a.dtype.kind == "f" else a, P),
                                lambda a: a[order])
        placed = jax.device_put({**b, "advantages": advantages}, st.batch_sharding)
        old = rollout.with_old_logps(st, st.init_with(jax.tree.map(np.copy, params), 0)["params"], placed)["old"]
        _, metrics, grads = st.train_with_grads(st.init_with(params, 0), placed)  # (grads: canonical order)
        return jax.device_get((metrics["loss"], grads, old))

    with jax.enable_x64(True):
        over = LAYOUTS[name]
        devices = int(np.prod([over.get(f"mesh.{a}", 1) for a in ("data", "tensor", "stage", "expert")]))
        one_loss, one_grads, one_old = run({}, batch, 1)
        loss, grads, old = run(over, batch, devices)
        if name == "expert_4x2":
            without = run({}, {k: v for k, v in batch.items() if k != "routes"}, 1)[0]
            assert abs(without - one_loss) > 1e-6 * abs(one_loss)
    np.testing.assert_allclose(old, one_old, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(loss, one_loss, rtol=1e-9)
    assert_trees_close(grads, one_grads, tol=1e-9)
