"""Layout equivalence for data + tensor parallelism, gradient accumulation, vocab padding, one compilation.

Reference: the same config on 1 device. "Equal" (`helpers.assert_equals_one_device`), float64 on both sides: the first
step's gradients, and the losses and params after 3 AdamW steps (losses within 1e-12 relative, every tensor within
1e-9 relative L2, `helpers.F64_TOL`)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import (F64_TOL, assert_equals_one_device, assert_params_exact, batch, float64_train, place,
                     reference_train, steps_for, tiny_config)
from jaxpar.train.step import split_batch

VOCAB = 250


@pytest.mark.parametrize("data,tensor", [(8, 1), (4, 2), (2, 4), (1, 8)])
def test_data_tensor_layouts_equal_one_device(data, tensor):
    c = tiny_config(**{"mesh.data": data, "mesh.tensor": tensor})
    assert_equals_one_device(c, VOCAB, [batch(16, c.model.seq_len, VOCAB)] * 3)
    # TP really is on: the QKV kernel is split over heads on `tensor`
    s = steps_for(c, VOCAB, jax.devices()[:data * tensor])
    shape = s.abstract_state()["params"]["blocks"]["wqkv"]
    assert s.state_shardings["params"]["blocks"]["wqkv"].shard_shape(shape.shape)[3] == c.model.heads // tensor


def uneven_batch():
    b = batch(16, 16, VOCAB, seed=3)
    mask = np.ones((16, 16), np.float32)
    rng = np.random.default_rng(0)
    for r in range(16):  # each row keeps a different number of loss tokens; some microbatches far fewer
        mask[r, rng.integers(1, 16):] = 0
    mask[::4] = 0  # rows 0, 4, 8, 12: all land in microbatch 0 with M = 4
    mask[0, 0] = 1
    b["mask"] = mask
    return b


def test_accumulation_equals_whole_batch_with_uneven_masks():
    """M = 4 microbatches with very different token counts give the M = 1 step: the gradients (a mean of microbatch
    means would weight microbatch 0's two tokens like the others' dozens: a 2x-scale error in its share) and the
    losses and params after 3 steps."""
    b = uneven_batch()
    losses, _ = assert_equals_one_device(tiny_config(**{"mesh.data": 2, "train.microbatches": 4}), VOCAB, [b] * 3)
    assert not np.isclose(losses[0], 0.0)  # and the loss is the mean over masked-in tokens


def test_param_comparison_catches_a_dropped_microbatch():
    """The after-AdamW comparison is not blind: a run that loses one microbatch's tokens (the bug of an accumulation
    that drops its last microbatch) fails it, also with a bound 10^6 times wider (measured here: 0.9 relative L2
    on `b_in`)."""
    c, b = tiny_config(**{"mesh.data": 2, "train.microbatches": 4}), uneven_batch()
    bad = dict(b, mask=b["mask"].copy())
    bad["mask"][3::4] = 0  # the rows of microbatch 3 with M = 4
    _, p_bad = float64_train(c, VOCAB, [bad] * 3)
    _, p_ref = reference_train(c, VOCAB, [b] * 3)
    for tol in (F64_TOL, 1e6 * F64_TOL):
        with pytest.raises(AssertionError, match="float64 on both sides"):
            assert_params_exact(p_bad, p_ref, tol=tol)


def test_padded_vocab_loss_equals_unpadded_reference():
    c = tiny_config(**{"mesh.data": 2, "mesh.tensor": 4})
    s = steps_for(c, VOCAB)
    assert s.cfg.vocab_size == 256 and s.cfg.vocab_real == VOCAB
    params = jax.device_get(s.init(0)["params"])
    b = batch(16, 16, VOCAB)
    loss, _ = s.grads(params, place(s, b))
    # independent reference: plain numpy-free jnp on one device, softmax over the 250 real symbols only
    x, y, _, _ = split_batch({k: jnp.asarray(v) for k, v in b.items()})
    h = s.fwd.layers(params["blocks"], s.fwd.embed(params, x))
    from jaxpar.model.layers import LayerNorm
    from flax import nnx
    h = nnx.merge(nnx.graphdef(LayerNorm(1, jnp.float32)), params["ln_f"])(h)
    logits = h @ params["wte"][:VOCAB].T  # never padded
    ref = -jnp.take_along_axis(jax.nn.log_softmax(logits), y[..., None], -1).mean()
    np.testing.assert_allclose(loss, ref, rtol=1e-6)


def test_second_step_call_does_not_recompile():
    c = tiny_config(**{"mesh.data": 4, "mesh.tensor": 2})
    s = steps_for(c, VOCAB)
    state = s.init(0)
    for i in range(3):
        state, _ = s.train(state, place(s, batch(16, 16, VOCAB, seed=i)))
    assert s.train._cache_size() == 1
