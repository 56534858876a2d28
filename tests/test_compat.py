"""A run directory written before the restructuring (jaxpar at commit 341b35e, `tests/fixtures/make_old_checkpoint.py`)
restores with today's code: every leaf of the saved state bit for bit, and the resumed step 3 gives the old code's
loss."""
import hashlib
import json
import os
import shutil

import jax
import numpy as np
import pytest

from jaxpar import data, runs, trainer
from jaxpar.checkpoint import Checkpointer
from jaxpar.mesh import make_mesh
from jaxpar.config import validate
from jaxpar.step import build

OLD = os.path.join(os.path.dirname(__file__), "fixtures", "old_run")
needs8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (host) devices")


@pytest.fixture
def old_run(corpus, tmp_path):
    """A copy of the old run directory, its config pointed at this session's corpus (the same seeded text)."""
    work = tmp_path / "run"
    shutil.copytree(OLD, work)
    config = runs.read_config(str(work))
    config.data.update(corpus=str(corpus / "*.txt"), cache_dir=str(tmp_path / "cache"))
    with open(os.path.join(OLD, "expected.json")) as f:
        return work, config, json.load(f)


@needs8
def test_old_checkpoint_restores_bitwise_and_resumes(old_run):
    work, config, expected = old_run
    steps = build(config, make_mesh(validate(config, 8)), data.load_tokenizer(str(work / "tokenizer")).vocab_size)
    ckpt = Checkpointer(str(work), 1, 1, async_save=False, read_only=True)
    state, meta = ckpt.restore(2, steps.abstract_state())
    ckpt.close()
    flat = jax.tree_util.tree_flatten_with_path(jax.device_get(state))[0]
    got = {jax.tree_util.keystr(p): hashlib.sha256(np.ascontiguousarray(x).tobytes()).hexdigest() for p, x in flat}
    assert got == expected["sha256"]
    assert meta["step"] == 2

    trainer.run(config, str(work))
    with open(work / "metrics.jsonl") as f:
        losses = {r["step"]: r["loss"] for r in map(json.loads, f)}
    assert sorted(losses) == [3]  # resumed at step 2, not restarted
    np.testing.assert_allclose(losses[3], expected["loss_step_3"], rtol=1e-6)
