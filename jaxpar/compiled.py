"""The one way to turn a config into its step on some devices: validate, lay out the mesh, build (`steps_for`); and
compile that step with abstract inputs for the compile report (`report_for`: `train.py --dry_run`, the planner).

The trainer, `--dry_run`, the planner's measurements and the tests all build their steps here.
"""
from __future__ import annotations

import time

import jax
import numpy as np

from jaxpar.analysis import compile_report as report
from jaxpar import data
from jaxpar.cluster import distributed
from jaxpar.formats import peft, start
from jaxpar import model as gpt
from jaxpar.model import moe
from jaxpar.errors import ConfigError
from jaxpar.parallel.mesh import make_mesh
from jaxpar.train import objectives
from jaxpar.train.step import Steps, build
from jaxpar.validate import validate


def xla_cpu_aborts(platform: str, param_dtype: str, zero_stage: int) -> bool:
    """Whether XLA:CPU (jaxlib 0.10.2) aborts the process compiling this train step: bfloat16 weights at ZeRO 3
    ("Invalid binary instruction opcode copy", both families, dense or MoE); docs/limits.md."""
    return platform == "cpu" and param_dtype == "bfloat16" and zero_stage == 3


def steps_for(config, vocab: int, devices=None, layout=None) -> Steps:
    """`config`'s steps on `devices` (default: all): validated (a `ConfigError` before anything compiles; `layout`:
    what `validate` returned already), the mesh laid out, the steps built (jitted; each compiles at its first
    call)."""
    devices, config = list(jax.devices() if devices is None else devices), gpt.derived(config)
    layout = layout or validate(config, len(devices))
    if xla_cpu_aborts(devices[0].platform, config.train.param_dtype, layout.zero_stage):
        raise ConfigError("train.param_dtype='bfloat16' with optim.zero_stage=3 on CPU devices: XLA:CPU aborts "
                          "compiling this step (docs/limits.md); use optim.zero_stage=2 here, or float32 weights.")
    return build(config, make_mesh(layout, devices), vocab)


def abstract_batch(config, steps: Steps) -> dict:
    """A global batch of `jax.ShapeDtypeStruct`s with the steps' batch sharding (nothing allocated)."""
    B, T, m = int(config.train.global_batch_size), int(config.model.seq_len), config.model
    obj = objectives.from_config(config)
    shapes = data.image_batch_shapes(B, m.image_size, m.channels) if "images" in obj.data_kinds else \
        obj.batch_shapes(config, data.batch_shapes(B, T, objectives.packing(config), ref_dtype(config)), steps.layout)
    return {k: jax.ShapeDtypeStruct(shape, dt, sharding=steps.batch_sharding) for k, (shape, dt) in shapes.items()}


def model_vocab(config) -> int:
    """The model's vocabulary before training (`data.model_vocab`); a ViT's classes: `model.num_classes`, else the
    image data's (preparing it)."""
    family = gpt.family_of(config.model.arch)
    if family.data_kind == "images":
        return family.vocab(config, 0) or data.prepare_images(config).num_classes
    return data.model_vocab(config)


def ref_dtype(config):
    """The dtype of DPO's precomputed reference sums in a batch (`dpo.precompute_reference`), or None without them:
    float64 in float64 runs, else float32."""
    if objectives.from_config(config).reference != "batch":
        return None
    return np.float64 if config.train.compute_dtype == "float64" else np.float32


def report_for(config, vocab: int = 0, devices=None, resolve=None) -> dict:
    """Compile the train step for the config's layout on `devices` (default: all) with abstract inputs (nothing is
    allocated) and return its `report.compile_report` with `compile_s`, the float32 gradient buffer's bytes, the
    layout (a MoE model's `moe_impl` with it), and the optimized HLO under `hlo_text`. vocab 0: the trainer's rule
    (`data.model_vocab`). `resolve(config, vocab, layout, devices) -> (config, what it chose or None)`: the entry
    point's choice of `auto` values for its target before the compile (`plan.target.resolve`), under "resolved"."""
    config = objectives.with_packing(gpt.derived(peft.apply(start.apply(config))))
    devices = list(jax.devices() if devices is None else devices)
    layout = validate(config, len(devices))  # before the data is prepared
    vocab = vocab or distributed.process_0_first(lambda: model_vocab(config), "jaxpar/prepare")
    config, resolved = resolve(config, vocab, layout, devices) if resolve else (config, None)
    steps = steps_for(config, vocab, devices, layout)
    abstract = steps.abstract_state()
    t0 = time.perf_counter()
    compiled = steps.train.lower(abstract, abstract_batch(config, steps)).compile()
    compile_s = time.perf_counter() - t0
    tokens = objectives.from_config(config).rows(config) * int(config.model.seq_len)
    rep = report.compile_report(compiled, abstract_state=abstract,
                                flops_per_step=gpt.flops_per_token(steps.cfg) * tokens, keep_hlo=True)
    rep["compile_s"] = compile_s  # lowering + compiling (a persistent-cache hit skips the compiling)
    grads = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, np.float32, sharding=sh),
                         gpt.trainable(abstract["params"], steps.cfg), steps.grad_shardings)
    rep["state_bytes"]["grad_buffer"] = report.state_group_bytes({"g": grads})["g"]
    rep["layout"] = {**steps.layout.as_dict(),
                     "params": int(sum(np.prod(a.shape) for a in jax.tree.leaves(abstract["params"]))),
                     "trainable": int(sum(np.prod(a.shape) for a in jax.tree.leaves(
                         gpt.trainable(abstract["params"], steps.cfg)))),
                     "compute_dtype": config.train.compute_dtype, "param_dtype": config.train.param_dtype,
                     **({"moe_impl": moe.implementation(steps.cfg)} if steps.cfg.experts else {})}
    rep["resolved"] = resolved
    return rep
