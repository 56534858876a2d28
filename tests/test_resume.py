"""Resume through `trainer.run` onto other layouts (the next step's loss equals the uninterrupted run's, the restored
state equals the saved one bitwise), a global-batch change on request, and a failed save surfacing from the loop."""
import hashlib
import os
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from helpers import losses, run_config
from jaxpar import data, trainer
from jaxpar.state.checkpoint import Checkpointer, CheckpointSaveError
from jaxpar.config import MESH_AXES
from jaxpar.config import ConfigError

# one worker builds this module's shared fixtures once (under pytest-xdist `--dist loadgroup`)
pytestmark = pytest.mark.xdist_group("test_resume")

needs8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (host) devices")

# Source layouts (data, tensor, stage), trained uninterrupted to step 6 with checkpoints at 3 and 6.
SOURCES = {
    "pipeline": {"mesh.data": 2, "mesh.tensor": 2, "mesh.stage": 2, "train.microbatches": 2},
    "zero1": {"mesh.data": 4, "mesh.tensor": 2, "mesh.stage": 1, "optim.zero_stage": 1, "train.microbatches": 2},
}





def leaves(tree):
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.fixture(scope="module")
def sources(corpus, tmp_path_factory):
    """{name: (tmp dir, workdir, {step: the canonical state handed to Checkpointer.save, on the host})}."""
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        saved = {}
        real_save = Checkpointer.save

        def spy(self, step, state, meta, force=False):
            saved[int(step)] = jax.device_get(state)  # before the save (and the next step's donation)
            return real_save(self, step, state, meta, force=force)

        mp.setattr(Checkpointer, "save", spy)
        for name, over in SOURCES.items():
            tmp = tmp_path_factory.mktemp(name)
            saved = {}
            trainer.run(run_config(corpus, tmp, **over), str(tmp / "run"))
            assert sorted(saved) == [3, 6]
            out[name] = (tmp, tmp / "run", saved)
    return out


@needs8
@pytest.mark.parametrize("source,target,ndev", [
    ("pipeline", {"mesh.data": 8, "mesh.tensor": 1, "mesh.stage": 1}, 8),
    ("pipeline", {"mesh.data": 1, "mesh.tensor": 1, "mesh.stage": 1, "train.microbatches": 1}, 1),
    ("zero1", {"mesh.data": 2, "mesh.tensor": 1, "mesh.stage": 4, "optim.zero_stage": 3,
               "train.microbatches": 4}, 8),
], ids=["(2,2,2)->(8,1,1)", "(2,2,2)->1 device", "(4,2,1) zero 1->(2,1,4) zero 3"])
@pytest.mark.slow
def test_resume_onto_another_layout(sources, corpus, source, target, ndev, monkeypatch):
    tmp, src, saved = sources[source]
    wd = tmp / ("resume_" + "_".join(str(target[k]) for k in ("mesh.data", "mesh.tensor", "mesh.stage")))
    shutil.copytree(src / "checkpoints" / "3", wd / "checkpoints" / "3")  # the run as if stopped at step 3
    restored = []
    real_restore = Checkpointer.restore

    def spy(self, step, abstract_state):
        state, meta = real_restore(self, step, abstract_state)
        assert all(a.sharding == b.sharding for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(abstract_state)))
        meshes = {tuple(dict(x.sharding.mesh.shape).items()) for x in jax.tree.leaves(state)}
        restored.append((step, jax.device_get(state), meta, meshes))  # before the first step donates it
        return state, meta

    monkeypatch.setattr(Checkpointer, "restore", spy)
    devices = jax.devices()[:ndev]
    trainer.run(run_config(corpus, tmp, **{**SOURCES[source], **target, "train.steps": 4}), str(wd),
                devices=devices)

    # the restored state is the saved one, bit for bit, placed in the new layout's shardings (checked in spy)
    (step, state, meta, meshes), = restored
    assert meshes == {tuple((k, target.get(f"mesh.{k}", 1)) for k in MESH_AXES)}
    assert step == 3 and meta["step"] == 3 and meta["samples"] == 3 * 16
    want, got = leaves(saved[3]), leaves(state)
    assert want.keys() == got.keys()
    for k in want:
        assert want[k].dtype == got[k].dtype and want[k].tobytes() == got[k].tobytes(), k
    # the next step's loss equals the uninterrupted run's: a forward pass from the bitwise-restored params, before
    # any optimizer step on the new layout, so float32 agrees on any CPU
    a, b = losses(src)[4], losses(wd)[4]
    assert sorted(losses(wd)) == [4]
    assert abs(b - a) <= 1e-6 * abs(a), (a, b)


def snapshot(root):
    """{relative path: sha256} of every file under root: any change to what is on disk shows."""
    out = {}
    for d, _, files in os.walk(root):
        for n in files:
            p = os.path.join(d, n)
            with open(p, "rb") as f:
                out[os.path.relpath(p, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


@needs8
def test_batch_change_only_when_allowed_and_the_order_continues(corpus, tmp_path, monkeypatch):
    seen = []
    real_rows = data.Batches.rows

    def spy(self, step, start=0, stop=None):
        if self.split == "train":
            seen.extend(map(tuple, self.samples(step, start, stop).tolist()))
        return real_rows(self, step, start, stop)

    monkeypatch.setattr(data.Batches, "rows", spy)
    wd = str(tmp_path / "run")
    trainer.run(run_config(corpus, tmp_path, **{"train.global_batch_size": 16, "train.steps": 3}), wd)
    assert len(seen) == 3 * 16

    before = snapshot(wd)
    smaller = run_config(corpus, tmp_path, **{"train.global_batch_size": 8, "train.steps": 6})
    with pytest.raises(ConfigError, match=r"(?s)train.global_batch_size: checkpoint 16 vs now 8.*"
                                          r"allow_batch_change=True"):
        trainer.run(smaller, wd)
    assert snapshot(wd) == before  # refused before touching anything

    smaller.train.allow_batch_change = True
    trainer.run(smaller, wd)
    assert len(seen) == 3 * 16 + 3 * 8
    info = data.prepare(smaller)
    whole = data.Batches(info, "train", 16, len(seen), seed=0)  # the uninterrupted order, one batch
    assert seen == list(map(tuple, whole.samples(0).tolist()))  # a prefix of the order: none repeated or skipped
    assert len(set(seen)) == len(seen)
    with Checkpointer(wd, 1, 1, read_only=True) as ck:
        assert ck.latest_step() == 6
        meta = ck.read_meta(6)
    assert meta["samples"] == 72 and meta["fingerprint"]["train.global_batch_size"] == 8
    assert sorted(losses(wd)) == [1, 2, 3, 4, 5, 6]


@needs8
def test_failed_save_in_the_loop_raises_and_keeps_the_last_good_checkpoint(corpus, tmp_path, monkeypatch):
    cls = ocp.path.atomicity.AtomicRenameTemporaryPath
    original = cls.finalize

    async def broken(self, *args, **kwargs):
        if self._final_path.name == "2":  # the final save: its directory becomes a plain file
            shutil.rmtree(self.get())
            with open(self.get(), "w") as f:
                f.write("not a directory")
        return await original(self, *args, **kwargs)

    monkeypatch.setattr(cls, "finalize", broken)
    wd = str(tmp_path / "run")
    c = run_config(corpus, tmp_path, **{"mesh.data": 8, "train.steps": 2})
    c.checkpoint.every_steps = 1
    with pytest.raises(CheckpointSaveError, match="step 2") as err:
        trainer.run(c, wd)
    assert err.value.step == 2 and err.value.__cause__ is not None
    with Checkpointer(wd, 1, 1, read_only=True) as ck:
        assert ck.all_steps() == [1]
