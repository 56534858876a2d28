"""Distillation's loss (`jaxpar/kernels/divergence.py`): the generalized JSD of a student's and a teacher's
next-token distributions from their hidden states and heads, against TRL 1.16's own `_chunked_divergence_loss`
(`DistillationTrainer`'s loss, run here on the same hidden states and heads) for beta 0, 0.5, 1 at two
temperatures: the loss, the student's entropy and the gradients of the student's hidden states and head."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.kernels.divergence import generalized_jsd

B, K, DS, DT, V, PADDED = 2, 12, 16, 24, 50, 64  # the teacher wider than the student; the vocabulary padded to 64


def material(seed=0):
    rng = np.random.default_rng(seed)
    hs, ht = rng.normal(size=(B, K, DS)).astype(np.float32), rng.normal(size=(B, K, DT)).astype(np.float32)
    ws, wt = rng.normal(size=(DS, PADDED)).astype(np.float32), rng.normal(size=(DT, PADDED)).astype(np.float32)
    mask = (rng.random((B, K)) < 0.75).astype(np.float32)
    return hs, ht, ws, wt, mask


def trl_loss(hs, ht, ws, wt, mask, beta, temperature):
    """TRL's loss (mean over the masked positions), the student's entropy sum, and the loss's gradients of the
    student's hidden states and head (`[DS, V]`)."""
    torch = pytest.importorskip("torch")
    from trl.trainer.distillation_trainer import _chunked_divergence_loss

    h = torch.tensor(hs, requires_grad=True)
    w = torch.tensor(ws[:, :V].T.copy(), requires_grad=True)  # TRL's lm_head weight: [V, H]
    loss, entropy, n = _chunked_divergence_loss(h, torch.tensor(ht), w, torch.tensor(wt[:, :V].T.copy()),
                                                torch.tensor(mask), beta, temperature=temperature)
    loss.backward()
    return float(loss.detach()), float(entropy), h.grad.numpy(), w.grad.numpy().T


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_the_generalized_jsd_equals_trls_loss_and_gradients(beta, temperature):
    """Positions in chunks of 4 (3 chunks); padded vocabulary ids count for nothing, and their head columns get no
    gradient. TRL computes its logits in float32 whatever the inputs' dtype, so both sides run in float32."""
    hs, ht, ws, wt, mask = material()
    want, entropy, dh, dw = trl_loss(hs, ht, ws, wt, mask, beta, temperature)

    def loss(hs, ws):
        div, ent = generalized_jsd(hs, ws, jnp.asarray(ht), jnp.asarray(wt), jnp.asarray(mask), beta, temperature,
                                   V, 4)
        return div / mask.sum(), ent

    (got, ent), (gh, gw) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(jnp.asarray(hs), jnp.asarray(ws))
    assert want > 0
    np.testing.assert_allclose(float(got), want, rtol=2e-6)
    np.testing.assert_allclose(float(ent), entropy, rtol=2e-6)
    for g, w in ((gh, dh), (np.asarray(gw)[:, :V], dw)):  # (both float32 sums: within 1e-5 of the largest entry;
        np.testing.assert_allclose(np.asarray(g), w, rtol=0, atol=1e-5 * np.abs(w).max())  # float64 below: exact)
    assert not np.asarray(gw)[:, V:].any()


def transcribed(hs, ht, ws, wt, mask, beta, temperature):
    """TRL's definition transcribed in float64 torch autograd (its own code computes in float32): the summed
    divergence and its gradients of the student's hidden states and head."""
    torch = pytest.importorskip("torch")
    h, w = torch.tensor(hs, dtype=torch.float64, requires_grad=True), torch.tensor(ws[:, :V], dtype=torch.float64,
                                                                                 requires_grad=True)
    ls = torch.log_softmax(h @ w / temperature, -1)
    lt = torch.log_softmax(torch.tensor(ht, dtype=torch.float64) @ torch.tensor(wt[:, :V], dtype=torch.float64)
                           / temperature, -1)
    if beta == 0.0:
        div = (lt.exp() * (lt - ls)).sum(-1)
    elif beta == 1.0:
        div = (ls.exp() * (ls - lt)).sum(-1)
    else:
        lm = torch.logaddexp(ls + np.log(1 - beta), lt + np.log(beta))
        div = (beta * lt.exp() * (lt - lm) + (1 - beta) * ls.exp() * (ls - lm)).sum(-1)
    total = (div * torch.tensor(mask, dtype=torch.float64)).sum()
    total.backward()
    return float(total.detach()), h.grad.numpy(), w.grad.numpy()


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_the_generalized_jsd_equals_trls_definition_in_float64(beta):
    hs, ht, ws, wt, mask = (a.astype(np.float64) for a in material(2))
    want, dh, dw = transcribed(hs, ht, ws, wt, mask, beta, 0.7)
    with jax.enable_x64(True):
        f = lambda hs, ws: generalized_jsd(hs, ws, jnp.asarray(ht), jnp.asarray(wt), jnp.asarray(mask), beta, 0.7,  # noqa
                                           V, 4)[0]
        got, (gh, gw) = jax.value_and_grad(f, argnums=(0, 1))(jnp.asarray(hs), jnp.asarray(ws))
        assert got.dtype == jnp.float64
    np.testing.assert_allclose(float(got), want, rtol=1e-12)
    np.testing.assert_allclose(np.asarray(gh), dh, rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(np.asarray(gw)[:, :V], dw, rtol=1e-10, atol=1e-14)


def test_the_teacher_gets_no_gradient_and_bad_settings_are_one_line():
    hs, ht, ws, wt, mask = material(1)
    g = jax.grad(lambda ht, wt: generalized_jsd(jnp.asarray(hs), jnp.asarray(ws), ht, wt, jnp.asarray(mask), 0.5,
                                                1.0, V, 4)[0], argnums=(0, 1))(jnp.asarray(ht), jnp.asarray(wt))
    assert not any(np.asarray(a).any() for a in g)
    for beta, t in ((1.5, 1.0), (0.5, 0.0)):
        with pytest.raises(ValueError, match="must lie in \\[0, 1\\] and temperature"):
            generalized_jsd(hs, ws, ht, wt, mask, beta, t, V, 4)
