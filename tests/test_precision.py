"""Mixed precision in the real step: fp16 overflows skip updates and move the loss scale by DeepSpeed's rule; bf16
and fp16 train; non-finite steps follow `train.nonfinite`; the loss scale survives a resume."""
import json
import os

import jax
import numpy as np
import pytest

from helpers import batch, place, run_config, steps_for, tiny_config
from jaxpar import trainer

# one worker builds this module's shared fixtures once (under pytest-xdist `--dist loadgroup`)
pytestmark = pytest.mark.xdist_group("test_precision")

VOCAB = 250


@pytest.mark.float16
@pytest.mark.parametrize("schedule", ["gpipe", "zb_h1"])
def test_fp16_overflow_skips_update_and_lowers_scale_per_hysteresis(schedule):
    c = tiny_config(**{"mesh.data": 2, "mesh.tensor": 2, "mesh.stage": 2, "train.microbatches": 2,
                       "train.compute_dtype": "float16", "train.loss_scale_initial": 2.0 ** 40,
                       "train.loss_scale_max": 2.0 ** 40,
                       "pipeline.schedule": schedule})
    s = steps_for(c, VOCAB)
    state = s.init(0)
    before = jax.device_get((state["params"], state["opt_state"]))
    scales, skipped = [], []
    for i in range(3):
        state, m = s.train(state, place(s, batch(16, 16, VOCAB, seed=i)))
        scales.append(float(m["loss_scale"]))
        skipped.append(int(m["skipped"]))
    # 2^40 * loss overflows fp16 activations' cotangents: every step skipped; hysteresis 2 spends one overflow,
    # then each overflow halves the scale (DeepSpeed's update_scale, consecutive_hysteresis=False)
    assert skipped == [1, 1, 1]
    assert scales == [2.0 ** 40, 2.0 ** 39, 2.0 ** 38]  # the scale after each step's update
    after = jax.device_get((state["params"], state["opt_state"]))
    for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before)):
        np.testing.assert_array_equal(a, b)
    assert int(state["loss_scale"].overflows) == 3 and float(state["loss_scale"].scale) == 2.0 ** 38


def five_steps(dtype, arch="gpt2"):
    c = tiny_config(**{"mesh.data": 4, "mesh.tensor": 2, "train.compute_dtype": dtype, "optim.lr": 3e-3,
                       "model.arch": arch, "model.kv_heads": 2 if arch == "llama" else 0})
    s = steps_for(c, VOCAB)
    state = s.init(0)
    b = place(s, batch(16, 16, VOCAB))
    for _ in range(5):
        state, m = s.train(state, b)
    assert int(m["skipped"]) == 0
    return float(m["loss"])


@pytest.fixture(scope="module")
def fp32_loss():
    cache = {}

    def of(arch):
        if arch not in cache:
            cache[arch] = five_steps("float32", arch)
        return cache[arch]

    return of


@pytest.mark.parametrize("dtype,arch", [("bfloat16", "gpt2"), pytest.param("float16", "gpt2", marks=pytest.mark.float16),
                                        ("bfloat16", "llama")])  # (fp16's loss scaling is the step's, not the model's)
def test_low_precision_trains_close_to_fp32(fp32_loss, dtype, arch):
    loss = five_steps(dtype, arch)
    assert loss < 5.5 and abs(loss - fp32_loss(arch)) < 0.05


def metrics(wd):
    with open(os.path.join(wd, "metrics.jsonl")) as f:
        return {r["step"]: r for r in map(json.loads, f)}


@pytest.mark.float16
def test_fp16_resume_continues_with_saved_scale_and_counters(corpus, tmp_path):
    over = {"mesh.data": 4, "mesh.tensor": 2, "train.compute_dtype": "float16", "train.loss_scale_window": 2,
            "train.loss_scale_initial": 2.0 ** 10}
    trainer.run(run_config(corpus, tmp_path, **over), str(tmp_path / "full"))
    trainer.run(run_config(corpus, tmp_path, **over, **{"train.steps": 3}), str(tmp_path / "part"))
    trainer.run(run_config(corpus, tmp_path, **over), str(tmp_path / "part"))
    a, b = metrics(tmp_path / "full"), metrics(tmp_path / "part")
    for k in range(1, 7):
        assert (a[k]["loss"], a[k]["loss_scale"], a[k]["overflow_steps"]) == \
               (b[k]["loss"], b[k]["loss_scale"], b[k]["overflow_steps"])
    assert a[6]["loss_scale"] > a[1]["loss_scale"]  # grew after clean windows of 2


@pytest.mark.parametrize("policy", ["stop", "skip"])
@pytest.mark.slow
def test_nonfinite_policy(corpus, tmp_path, policy, monkeypatch):
    real_build = trainer.steps_for

    def build(*a, **k):  # the 3rd step gets a NaN loss mask: NaN loss and grads through the real step
        st = real_build(*a, **k)
        train, n = st.train, {"i": 0}

        def poisoned(state, b):
            n["i"] += 1
            if n["i"] == 3:
                b = dict(b, mask=jax.numpy.full((b["tokens"].shape[0], b["tokens"].shape[1] - 1), jax.numpy.nan))
            return train(state, b)

        st.train = poisoned
        return st

    monkeypatch.setattr(trainer, "steps_for", build)
    c = run_config(corpus, tmp_path, **{"train.nonfinite": policy, "mesh.data": 8})
    wd = str(tmp_path / policy)
    if policy == "stop":
        with pytest.raises(FloatingPointError, match="non-finite loss or gradients at step 3"):
            trainer.run(c, wd)
        assert not os.path.exists(os.path.join(wd, "checkpoints", "3"))  # a NaN never reaches a checkpoint
    else:
        trainer.run(c, wd)
        m = metrics(wd)
        assert m[6]["nonfinite_steps"] == 1 and np.isfinite(m[6]["loss"])
