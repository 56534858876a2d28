"""Shared test utilities: tiny configs, synthetic batches, the relative-L2 comparison."""
import jax
import numpy as np

from jaxpar import config as jcfg
from jaxpar.mesh import make_mesh
from jaxpar.step import build


def tiny_config(**over):
    c = jcfg.base_config()
    c.model.update(seq_len=16, layers=4, embed=32, heads=8, mlp=64)
    c.train.update(global_batch_size=16, microbatches=1, steps=3)
    c.optim.update(lr=1e-3, warmup_steps=0, decay_steps=10, clip_norm=1.0)
    for k, v in over.items():
        sect, key = k.split(".")
        c[sect][key] = v
    return c


def batch(n, seq, vocab, seed=0):
    rng = np.random.default_rng(seed)
    return {"tokens": rng.integers(0, vocab, (n, seq + 1), dtype=np.int32)}


def steps_for(config, vocab, devices=None):
    devices = jax.devices() if devices is None else devices
    shape = jcfg.validate(config, len(devices))
    return build(config, make_mesh(shape, devices), vocab)


def place(steps, b):
    return jax.tree.map(lambda a: jax.device_put(a, steps.batch_sharding), b)


def rel_l2(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def assert_trees_close(a, b, tol=1e-5):
    fa, _ = jax.tree_util.tree_flatten_with_path(a)
    fb = jax.tree.leaves(b)
    assert len(fa) == len(fb)
    for (path, x), y in zip(fa, fb):
        e = rel_l2(x, y)
        assert e <= tol, f"{jax.tree_util.keystr(path)}: relative L2 {e:.3g} > {tol}"


def run_config(corpus, tmp_path, **over):
    c = tiny_config(**over)
    c.data.update(corpus=str(corpus / "*.txt"), tokenizer="byte", cache_dir=str(tmp_path / "cache"))
    c.train.steps = over.get("train.steps", 6)
    c.log.update(every_steps=1, progress=False)
    c.eval.update(every_steps=100, batches=1)
    c.checkpoint.update(every_steps=3, keep=3, async_save=True)
    return c
