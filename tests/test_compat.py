"""Run directories written by older jaxpar (commit 341b35e, before issue 13's restructuring:
`tests/fixtures/make_old_checkpoint.py`; commit bfe3231, before issue 27's: `tests/fixtures/make_run_fixture.py`)
restore with today's code: every leaf of the saved state bit for bit, and the resumed step 3 gives the old code's
loss."""
import hashlib
import json
import os
import shutil

import jax
import numpy as np
import pytest

from jaxpar import data, trainer
from jaxpar.state import runs
from jaxpar.state.checkpoint import Checkpointer
from jaxpar.compiled import steps_for
from jaxpar.model import identity_defaults

needs8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (host) devices")


# run directories written by older jaxpar: (fixture, the corpus it was trained on)
FIXTURES = [("old_run", "one_file_corpus"),  # commit 341b35e: GPT-2, circular (2,2,2), ZeRO 1 (make_old_checkpoint.py)
            ("run_bfe3231", "corpus")]  # commit bfe3231: Llama GQA, interleaved 1F1B, ZeRO 2, packed documents


@pytest.fixture(params=FIXTURES, ids=[f for f, _ in FIXTURES])
def old_run(request, tmp_path):
    """A copy of an old run directory, its config pointed at this session's corpus (the same seeded text)."""
    name, corpus = request.param
    src = os.path.join(os.path.dirname(__file__), "fixtures", name)
    work = tmp_path / "run"
    shutil.copytree(src, work)
    config = runs.read_config(str(work))
    config.data.update(sources=str(request.getfixturevalue(corpus) / "*.txt"), cache_dir=str(tmp_path / "cache"))
    with open(os.path.join(src, "expected.json")) as f:
        return work, config, json.load(f)


@needs8
@pytest.mark.slow
def test_old_checkpoint_restores_bitwise_and_resumes(old_run):
    work, config, expected = old_run
    steps = steps_for(config, data.load_tokenizer(str(work / "tokenizer")).vocab_size)
    ckpt = Checkpointer(str(work), 1, 1, async_save=False, read_only=True)
    state, meta = ckpt.restore(2, steps.abstract_state())
    ckpt.close()
    flat = jax.tree_util.tree_flatten_with_path(jax.device_get(state))[0]
    got = {jax.tree_util.keystr(p): hashlib.sha256(np.ascontiguousarray(x).tobytes()).hexdigest() for p, x in flat}
    fresh = {k: got.pop(k) for k in list(got) if k.startswith("['spikes']")}  # newer than these checkpoints
    assert got == expected["sha256"]
    assert meta["step"] == 2
    assert len(fresh) == 5 and int(state["spikes"]["count"]) == 0 and int(state["spikes"]["last"]) == -1

    trainer.run(config, str(work))
    with open(work / "metrics.jsonl") as f:
        losses = {r["step"]: r["loss"] for r in map(json.loads, f)}
    assert sorted(losses) == [3]  # resumed at step 2, not restarted
    np.testing.assert_allclose(losses[3], expected["loss_step_3"], rtol=1e-6)


OLD_FP = {"model.seq_len": 16, "model.layers": 4, "model.embed": 32, "model.heads": 8, "model.mlp": 0,
          "model.tie_embeddings": True, "train.global_batch_size": 16, "vocab_real": 259, "mlp_width": 128,
          "tokenizer": "byte", "data": "d"}  # as checkpoints before the model spec wrote it (mlp 0 = 4 x embed)


def now_fp(**over):
    fp = {"model.vocab_real": 259, "model.seq_len": 16, "model.layers": 4, "model.embed": 32, "model.heads": 8,
          "model.mlp": 128, "model.tie_embeddings": True, "train.global_batch_size": 16, "tokenizer": "byte",
          "data": "d"}
    fp.update({f"model.{k}": v for k, v in identity_defaults({"heads": 8, "seq_len": 16, "mlp": 128, "embed": 32}).items()})
    return {**fp, **over}


def test_old_fingerprint_resumes_the_same_model_and_refuses_another():
    trainer.check_resume(OLD_FP, now_fp())  # the same model: no error
    with pytest.raises(trainer.ConfigError, match=r"model.mlp: checkpoint 128 vs now 256"):
        trainer.check_resume(OLD_FP, now_fp(**{"model.mlp": 256}))
    with pytest.raises(trainer.ConfigError, match=r"model.vocab_real: checkpoint 259 vs now 300"):
        trainer.check_resume(OLD_FP, now_fp(**{"model.vocab_real": 300}))
    with pytest.raises(trainer.ConfigError, match=r"model.arch: checkpoint 'gpt2' vs now 'llama'"):
        trainer.check_resume(OLD_FP, now_fp(**{"model.arch": "llama"}))
