"""Packed documents (`data.packing = "documents"`): the loss and gradients of a packed batch equal the sum over its
documents run one by one, unpacked, on one device (attention never crosses a boundary, positions restart at each
document, a document's last token predicts nothing), for both families and under pipelines and tensor parallelism."""
import jax
import numpy as np
import pytest

from helpers import assert_trees_close, place, rel_l2, steps_for, tiny_config
from jaxpar import model as gpt

VOCAB, T, B = 64, 16, 8
CASES = [((1, 1, 1), "gpipe", {}), ((2, 2, 2), "gpipe", {}),
         ((2, 2, 2), "1f1b", {"model.arch": "llama", "model.kv_heads": 2, "model.tie_embeddings": False})]


def packed_batch(seed=0):
    """B rows of T + 1 tokens, each cut into 1-4 documents at random points (some of one token)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, (B, T + 1), dtype=np.int32)
    seg = np.zeros((B, T + 1), np.int32)
    for r in range(B):
        for c in sorted(rng.choice(np.arange(1, T + 1), int(rng.integers(0, 4)), replace=False)):
            seg[r, c:] += 1
    seg[0, -1] += 1  # a one-token document at the end
    return {"tokens": tokens, "segments": seg}


def unpacked_reference(cfg, params, b):
    """(mean loss, grads of it) over the documents, each alone in its own row from position 0: `[documents, T]`,
    padded at the end (causal: padding after a document never reaches it) with loss weight 0 there."""
    fwd = gpt.Forward(cfg)
    docs = [row[seg == s] for row, seg in zip(b["tokens"], b["segments"]) for s in np.unique(seg)]
    docs = [d for d in docs if d.size >= 2]
    x, y, w = (np.zeros((len(docs), T), dt) for dt in (np.int32, np.int32, np.float32))
    for i, d in enumerate(docs):
        n = d.size - 1
        x[i, :n], y[i, :n], w[i, :n] = d[:-1], d[1:], 1.0

    def mean_loss(p):
        s, n = fwd.loss(p, x, y, w)
        return s / n

    return jax.jit(jax.value_and_grad(mean_loss))(params)


def plain_grads(cfg, params, b):
    """The grads of the same rows run without segments (attention across documents), for the test's own check."""
    fwd = gpt.Forward(cfg)
    t, seg = b["tokens"], b["segments"]
    w = (seg[:, 1:] == seg[:, :-1]).astype(np.float32)
    return jax.jit(jax.grad(lambda p: fwd.loss(p, t[:, :-1], t[:, 1:], w)[0] / w.sum()))(params)


@pytest.mark.parametrize("layout,schedule,over", CASES, ids=lambda x: str(x))
def test_packed_batch_equals_its_documents_one_by_one(layout, schedule, over):
    d, t, s = layout
    c = tiny_config(**{"mesh.data": d, "mesh.tensor": t, "mesh.stage": s, "pipeline.schedule": schedule,
                       "train.microbatches": 2 * s, "train.global_batch_size": B, "data.packing": "documents",
                       **over})
    steps = steps_for(c, VOCAB, jax.devices()[:d * t * s])
    state = steps.init(0)
    b = packed_batch()
    loss, grads = jax.device_get(steps.grads(state["params"], place(steps, b)))
    params = jax.device_get(steps.to_canonical(state)["params"])
    with jax.default_device(jax.devices()[0]):
        want_loss, want_grads = jax.device_get(unpacked_reference(steps.cfg, params, b))
        plain = jax.device_get(plain_grads(steps.cfg, params, b))
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    assert_trees_close(grads, want_grads)
    # attention across the documents is another computation, far outside the tolerance: the test can tell
    assert max(rel_l2(a, b) for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(want_grads))) > 1e-2
