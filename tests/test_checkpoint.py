"""Checkpointer: sharded save, restore onto other layouts, retention, async errors, half-written steps."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # before jax is imported

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxpar.state.checkpoint import Checkpointer, CheckpointSaveError
from jaxpar.config import MESH_AXES, base_config

needs8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (host) devices")


def _mesh(shape):
    """(data, stage, tensor) sizes -> a mesh with every axis of `MESH_AXES` (the others of size 1)."""
    n, sizes = int(np.prod(shape)), dict(zip(("data", "stage", "tensor"), shape))
    return Mesh(np.array(jax.devices()[:n]).reshape([sizes.get(a, 1) for a in MESH_AXES]), MESH_AXES)


# Param name -> (shape, spec on the saving (data, stage, tensor) = (2, 2, 2) mesh).
PARAMS = {
    "embed": ((16, 8), P("tensor", None)),  # vocab-parallel
    "blocks": {
        "w_in": ((4, 8, 16), P("stage", None, "tensor")),  # stacked layers over stage, mlp over tensor
        "w_out": ((4, 16, 8), P("stage", "tensor", None)),
        "ln_scale": ((4, 8), P("stage", None)),
    },
    "final_ln": ((8,), P()),  # replicated
}


def _is_spec(x):
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], P)


def _train_state(mesh, seed=0):
    """A real adamw state after one update, every array sharded like its parameter."""
    rng = np.random.default_rng(seed)
    params = jax.tree.map(
        lambda t: jax.device_put(rng.standard_normal(t[0], np.float32), NamedSharding(mesh, t[1])),
        PARAMS, is_leaf=_is_spec)
    opt = optax.adamw(1e-2, weight_decay=0.1)
    opt_state = opt.init(params)
    grads = jax.tree.map(lambda p: jnp.sin(p) * 0.3, params)

    @jax.jit
    def update(params, opt_state, grads):
        upd, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, upd), opt_state

    params, opt_state = update(params, opt_state, grads)
    rep = NamedSharding(mesh, P())
    return {
        "params": params,
        "opt_state": opt_state,
        "step": jax.device_put(jnp.int32(7), rep),
        "rng": jax.device_put(jax.random.key_data(jax.random.key(seed + 1)), rep),
    }


def _small_state(value=1.0):
    return {"w": jnp.full((4, 3), value, jnp.float32), "step": jnp.int32(int(value))}


def _abstract(state, sharding_fn):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding_fn(x)), state)


def _assert_bitwise_equal(a, b):
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape, jax.tree_util.keystr(path)
        assert x.tobytes() == y.tobytes(), jax.tree_util.keystr(path)


def _step_dirs(ck):
    return sorted(int(n) for n in os.listdir(ck.directory) if n.isdigit())


@needs8
def test_restore_onto_other_layouts(tmp_path):
    mesh = _mesh((2, 2, 2))
    state = _train_state(mesh)
    mu = state["opt_state"][0].mu
    assert "tensor" in mu["embed"].sharding.spec and mu["final_ln"].sharding.spec == P()
    assert len(mu["blocks"]["w_in"].sharding.device_set) == 8
    meta = {"data_position": 1234, "fingerprint": "abc"}
    with Checkpointer(str(tmp_path), every_steps=10, keep=3) as ck:
        assert ck.save(10, state, meta)
        ck.wait()

    # A fresh checkpointer (as after a restart) onto a (data, stage, tensor) = (8, 1, 1) mesh with other specs...
    mesh8 = _mesh((8, 1, 1))

    def by_data(x):
        return NamedSharding(mesh8, P("data") if x.ndim and x.shape[0] % 8 == 0 else P(None, "data")
                             if x.ndim > 1 and x.shape[1] % 8 == 0 else P())

    # ... and onto a single device.
    mesh1 = _mesh((1, 1, 1))
    with Checkpointer(str(tmp_path), every_steps=10, keep=3) as ck:
        assert ck.latest_step() == 10
        for fn in (by_data, lambda x: NamedSharding(mesh1, P())):
            abstract = _abstract(state, fn)
            restored, rmeta = ck.restore(10, abstract)
            _assert_bitwise_equal(restored, state)
            assert rmeta == meta
            assert isinstance(restored["opt_state"][0], optax.ScaleByAdamState)
            for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(abstract)):
                assert got.sharding == want.sharding
        assert restored["params"]["embed"].sharding.mesh.devices.size == 1
        assert ck.read_meta(10) == meta


def test_restore_errors(tmp_path):
    state = _small_state()
    with Checkpointer(str(tmp_path), every_steps=1, keep=1) as ck:
        ck.save(1, state, {})
        ck.wait()
        with pytest.raises(FileNotFoundError, match="step 2"):
            ck.restore(2, _abstract(state, lambda x: NamedSharding(_mesh((1, 1, 1)), P())))
        with pytest.raises(FileNotFoundError):
            ck.read_meta(2)
        with pytest.raises(ValueError, match="sharding"):
            ck.restore(1, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state))
        dev = NamedSharding(_mesh((1, 1, 1)), P())
        sds = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=dev)  # noqa: E731
        # Checked against the checkpoint's metadata before any read: never silent padding, truncation or casts.
        with pytest.raises(ValueError, match=r"w: saved float32\[4, 3\], requested float32\[5, 3\]"):
            ck.restore(1, {"w": sds((5, 3), jnp.float32), "step": sds((), jnp.int32)})
        with pytest.raises(ValueError, match=r"step: saved int32\[\], requested float32\[\]"):
            ck.restore(1, {"w": sds((4, 3), jnp.float32), "step": sds((), jnp.float32)})
        with pytest.raises(ValueError, match="missing from the checkpoint: extra") as err:
            ck.restore(1, {"w": sds((4, 3), jnp.float32), "extra": sds((), jnp.int32)})
        assert "not in abstract_state: step" in str(err.value)


def test_restore_part_reads_only_the_leaves_asked_for(tmp_path):
    """`restore_part` (a run read back: its params, no optimizer state) returns the saved values of the leaves asked
    for, bitwise, and refuses a leaf the checkpoint lacks or holds in another shape, before reading."""
    state = _small_state(2.5)
    with Checkpointer(str(tmp_path), every_steps=1, keep=1, async_save=False) as ck:
        ck.save(1, state, {})
    dev = NamedSharding(_mesh((1, 1, 1)), P())
    expect = {k: np.asarray(v) for k, v in state.items() if k == "w"}
    with Checkpointer(str(tmp_path), 1, 1, async_save=False, read_only=True) as ck:
        _assert_bitwise_equal(ck.restore_part(1, _abstract(expect, lambda x: dev)), expect)
        with pytest.raises(ValueError, match="missing from the checkpoint: extra"):
            ck.restore_part(1, {"extra": jax.ShapeDtypeStruct((), jnp.int32, sharding=dev)})
        with pytest.raises(ValueError, match=r"w: saved float32\[4, 3\], requested float32\[5, 3\]"):
            ck.restore_part(1, {"w": jax.ShapeDtypeStruct((5, 3), jnp.float32, sharding=dev)})


def test_keep_and_latest_step(tmp_path):
    with Checkpointer(str(tmp_path), every_steps=2, keep=2) as ck:
        assert ck.latest_step() is None
        for step in range(1, 7):
            assert ck.save(step, _small_state(step), {"step": step}) == (step % 2 == 0)
        ck.wait()
        assert ck.latest_step() == 6
        assert ck.all_steps() == [4, 6]
        assert _step_dirs(ck) == [4, 6]
        assert not ck.save(6, _small_state(6), {}, force=True)  # a final save of an already saved step: skipped
        assert ck.save(7, _small_state(7), {"step": 7}, force=True)  # forced off the period
    assert _step_dirs(ck) == [6, 7]
    assert Checkpointer(str(tmp_path), every_steps=2, keep=2).latest_step() == 7


def test_from_config_and_bad_args(tmp_path):
    c = base_config()
    ck = Checkpointer.from_config(str(tmp_path), c)
    assert (ck.every_steps, ck.keep, ck.async_save) == (c.checkpoint.every_steps, c.checkpoint.keep, True)
    assert ck.directory == os.path.join(str(tmp_path), "checkpoints")
    with pytest.raises(TypeError, match="JSON"):
        ck.save(c.checkpoint.every_steps, _small_state(), {"x": object()})
    ck.close()
    ck.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        ck.save(0, _small_state(), {})
    for kw in (dict(every_steps=0, keep=1), dict(every_steps=1, keep=0)):
        with pytest.raises(ValueError):
            Checkpointer(str(tmp_path), **kw)


def test_async_save_then_wait(tmp_path):
    state = {"w": jnp.arange(4096.0, dtype=jnp.float32).reshape(64, 64), "step": jnp.int32(3)}
    expect = jax.tree.map(np.asarray, state)
    meta = {"data_position": [3, 17], "fingerprint": "f00d", "nested": {"a": 1.5, "b": None}}
    ck = Checkpointer(str(tmp_path), every_steps=3, keep=2, async_save=True)
    assert ck.save(3, state, meta)
    # The caller may donate / free its buffers and change its meta once save returns.
    for x in jax.tree.leaves(state):
        x.delete()
    meta["data_position"][0] = 999
    ck.wait()
    assert ck.latest_step() == 3
    assert ck.read_meta(3) == {"data_position": [3, 17], "fingerprint": "f00d", "nested": {"a": 1.5, "b": None}}
    dev = NamedSharding(_mesh((1, 1, 1)), P())
    restored, _ = ck.restore(3, _abstract(expect, lambda x: dev))
    _assert_bitwise_equal(restored, expect)
    ck.close()


def test_half_written_checkpoints_are_ignored(tmp_path):
    ck = Checkpointer(str(tmp_path), every_steps=2, keep=5)
    ck.save(2, _small_state(2), {"step": 2})
    ck.wait()
    root = ck.directory
    # A save killed before its rename (Orbax's tmp dir) and a step dir without Orbax's commit marker.
    shutil.copytree(os.path.join(root, "2"), os.path.join(root, "4.orbax-checkpoint-tmp"))
    os.remove(os.path.join(root, "4.orbax-checkpoint-tmp", ocp.path.atomicity.COMMIT_SUCCESS_FILE))
    shutil.copytree(os.path.join(root, "2"), os.path.join(root, "6"))
    os.remove(os.path.join(root, "6", ocp.path.atomicity.COMMIT_SUCCESS_FILE))
    os.makedirs(os.path.join(root, "8", "state"))
    assert ck.latest_step() == 2 and ck.all_steps() == [2]
    with pytest.raises(FileNotFoundError):
        ck.read_meta(6)
    ck.close()
    ck2 = Checkpointer(str(tmp_path), every_steps=2, keep=5)  # a restart
    assert ck2.latest_step() == 2
    # the marker-less step folders were set aside (and removed), so saving those steps again works; 2 is untouched
    assert sorted(n for n in os.listdir(root) if n.isdigit()) == ["2"]
    assert ck2.save(6, _small_state(6), {"step": 6})
    ck2.wait()
    assert ck2.read_meta(2) == {"step": 2}
    assert ck2.save(10, _small_state(10), {"step": 10})
    ck2.wait()
    assert ck2.latest_step() == 10 and ck2.all_steps() == [2, 6, 10]
    assert not os.path.exists(os.path.join(root, "4.orbax-checkpoint-tmp"))  # leftover tmp dirs are cleaned up
    ck2.close()


@pytest.mark.parametrize("surface", ["wait", "save", "close", "sync"])
def test_failed_save_raises_and_keeps_old(tmp_path, monkeypatch, surface):
    cls = ocp.path.atomicity.AtomicRenameTemporaryPath
    original = cls.finalize

    async def broken(self, *args, **kwargs):
        tmp = self.get()  # the directory being written: replace it by a plain file
        shutil.rmtree(tmp)
        with open(tmp, "w") as f:
            f.write("not a directory")
        return await original(self, *args, **kwargs)

    ck = Checkpointer(str(tmp_path), every_steps=2, keep=2, async_save=surface != "sync")
    ck.save(2, _small_state(2), {"step": 2})
    ck.save(4, _small_state(4), {"step": 4})
    ck.wait()
    monkeypatch.setattr(cls, "finalize", broken)
    with pytest.raises(CheckpointSaveError) as err:
        started = ck.save(6, _small_state(6), {"step": 6})
        assert started and surface != "sync"  # an async failure shows later
        if surface == "wait":
            ck.wait()
        elif surface == "save":
            ck.save(8, _small_state(8), {"step": 8})  # raises step 6's error before starting step 8
        else:
            ck.close()
    assert err.value.step == 6 and err.value.__cause__ is not None
    monkeypatch.setattr(cls, "finalize", original)
    assert ck.latest_step() == 4 and _step_dirs(ck) == [2, 4]
    reader = Checkpointer(str(tmp_path), 2, 2) if surface == "close" else ck
    dev = NamedSharding(_mesh((1, 1, 1)), P())
    for step in (2, 4):
        restored, meta = reader.restore(step, _abstract(_small_state(), lambda x: dev))
        _assert_bitwise_equal(restored, jax.tree.map(np.asarray, _small_state(step)))
        assert meta == {"step": step}
    if surface == "close":
        reader.close()
        return
    # The checkpointer stays usable; retention again counts what is on disk.
    ck.wait()  # the error was raised once
    assert ck.save(8, _small_state(8), {"step": 8})
    ck.close()
    assert _step_dirs(ck) == [4, 8]


def test_read_only_reader_leaves_a_save_in_progress_alone(tmp_path):
    with Checkpointer(str(tmp_path), every_steps=1, keep=3, async_save=False) as ck:
        ck.save(1, {"x": jnp.arange(4.0)}, {"step": 1})
    in_progress = tmp_path / "checkpoints" / "2.orbax-checkpoint-tmp-123"
    in_progress.mkdir()
    reader = Checkpointer(str(tmp_path), every_steps=1, keep=1, async_save=False, read_only=True)
    assert reader.latest_step() == 1
    reader.close()
    assert in_progress.is_dir()
    assert not (tmp_path / "nothing").exists()
    Checkpointer(str(tmp_path / "nothing"), 1, 1, async_save=False, read_only=True).close()
    assert not (tmp_path / "nothing" / "checkpoints").exists()


class _Killed(Exception):
    """Stands in for SIGKILL: the deletion stops in the middle (bench/chaos.py sends real SIGKILLs)."""


def test_a_kill_while_an_old_checkpoint_is_deleted_never_leaves_it_listed(tmp_path, monkeypatch):
    real_rmtree = shutil.rmtree

    def killed_midway(path, *args, **kwargs):  # removes part of the tree (the arrays, not the commit marker), dies
        if os.path.isdir(os.path.join(path, "state")):
            real_rmtree(os.path.join(path, "state"))
        raise _Killed

    ck = Checkpointer(str(tmp_path), every_steps=2, keep=1, async_save=False)
    ck.save(2, _small_state(2), {"step": 2})
    monkeypatch.setattr(shutil, "rmtree", killed_midway)
    try:
        ck.save(4, _small_state(4), {"step": 4})  # drops step 2 (keep=1)
        ck.wait()
    except (_Killed, CheckpointSaveError):
        pass
    # Whenever the deletion stopped, step 2 is either complete or not listed: never listed half-deleted.
    assert ck.all_steps() == [4]
    assert ck.latest_step() == 4
    monkeypatch.setattr(shutil, "rmtree", real_rmtree)
    ck2 = Checkpointer(str(tmp_path), every_steps=2, keep=1, async_save=False)  # a restart removes the leftovers
    assert sorted(os.listdir(ck2.directory)) == ["4"]
    dev = NamedSharding(_mesh((1, 1, 1)), P())
    restored, meta = ck2.restore(4, _abstract(_small_state(), lambda x: dev))
    _assert_bitwise_equal(restored, jax.tree.map(np.asarray, _small_state(4)))
    ck2.close()
    ck._closed = True  # the "killed" checkpointer is abandoned, as a killed process's would be
