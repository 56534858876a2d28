"""Shared test utilities: tiny configs, synthetic batches, the relative-L2 comparison, and the comparison of params
after optimizer steps against a float64 run."""
import hashlib
import json
import os

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
        if "." in k:
            sect, key = k.split(".")
            c[sect][key] = v
        else:
            c[k] = v
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
    c.data.update(sources=str(corpus / "*.txt"), tokenizer="byte", cache_dir=str(tmp_path / "cache"))
    c.train.steps = over.get("train.steps", 6)
    c.log.update(every_steps=1, progress=False)
    c.eval.update(every_steps=100, batches=1)
    c.checkpoint.update(every_steps=3, keep=3, async_save=True)
    return c


# Params after AdamW steps. AdamW's first updates are about lr * g / |g| per element, so an element whose gradient is
# rounding noise (either sign) moves by a whole learning rate either way: two float32 runs that differ only in the
# order of their sums (another layout, another CPU's vector width) differ in their params far more than in their
# gradients (measured: grads of M=4 vs M=1 agree to 4.6e-7, yet the float32 params after 3 steps are 1.3e-5 from a
# float64 run of the same init). The reference's own error is therefore measured, per tensor, against a float64 run
# (same init: float64 draws in float32 and casts; same batches; float64's rounding is ~1e-16, so p_f64 stands for
# exact arithmetic), and the layout's run p must satisfy
#     ||p - p_ref|| <= max(tol * ||p_ref||, REF_ERROR_FACTOR * ||p_ref - p_f64||).
# Derivation of the factor: ||p - p_ref|| <= ||p - p_f64|| + ||p_ref - p_f64|| (triangle inequality). Both float32
# runs carry the same kind of error (the flips of noise-level gradients, whose number grows with the gradient noise);
# allowing the layout's own error to be up to twice the 1-device run's gives 1 + 2 = 3. A real layout bug moves
# params by O(lr) in every element (a wrong ZeRO shard of the Adam moments, a dropped microbatch: relative errors of
# 1e-3 to 1e-1 here), orders of magnitude above 3 x 1.3e-5; tests/test_layouts.py checks that such a bug fails.
REF_ERROR_FACTOR = 3.0
_F64 = {}


def float64_params(config, vocab, batches):
    """Params after `train` on each of `batches` in float64 on 1 device (cached per config and batches).

    The same run as `config` in exact arithmetic, up to float64 rounding: layout, microbatches, ZeRO and pipeline
    settings change only the order of sums, so the reference runs unpipelined on one device."""
    c = config.copy_and_resolve_references()
    c.mesh.update(data=1, tensor=1, stage=1)
    c.train.update(microbatches=1, param_dtype="float64", compute_dtype="float64")
    c.optim.zero_stage = 0
    c.pipeline.virtual_stages = 1
    h = hashlib.sha256(c.to_json().encode() + str(vocab).encode())
    for b in batches:
        for k in sorted(b):
            h.update(k.encode() + np.ascontiguousarray(b[k]).tobytes())
    key = h.hexdigest()
    if key not in _F64:
        with jax.enable_x64(True):
            s = steps_for(c, vocab, jax.devices()[:1])
            state = s.init(0)
            for b in batches:
                state, _ = s.train(state, place(s, b))
            _F64[key] = jax.device_get(state["params"])
    return _F64[key]


def assert_params_close(p, p_ref, p_f64, tol=1e-5, factor=REF_ERROR_FACTOR):
    """Every tensor of `p` within max(tol, factor x the reference's own float32 error) of `p_ref` (see above).

    With JAXPAR_PARAM_ERRORS=path, appends each tensor's {error, reference error, ratio} as JSON lines there."""
    fa, _ = jax.tree_util.tree_flatten_with_path(p)
    fr, f64 = jax.tree.leaves(p_ref), jax.tree.leaves(p_f64)
    assert len(fa) == len(fr) == len(f64)
    log = os.environ.get("JAXPAR_PARAM_ERRORS")
    for (path, x), y, z in zip(fa, fr, f64):
        x, y, z = (np.asarray(a, np.float64) for a in (x, y, z))
        err, ref_err, norm = (float(np.linalg.norm(a)) for a in (x - y, y - z, y))
        bound = max(tol * norm, factor * ref_err)
        if log:
            with open(log, "a") as f:
                f.write(json.dumps({"leaf": jax.tree_util.keystr(path), "rel_err": err / max(norm, 1e-30),
                                    "rel_ref_err": ref_err / max(norm, 1e-30),
                                    "ratio": err / max(ref_err, 1e-30)}) + "\n")
        assert err <= bound, (f"{jax.tree_util.keystr(path)}: relative L2 {err / max(norm, 1e-30):.3g} > "
                              f"max({tol}, {factor} x the reference's own error "
                              f"{ref_err / max(norm, 1e-30):.3g})")
