"""The GPU program, checked without a GPU: jaxpar's train and evaluation steps traced and lowered for CUDA
(`jax.export` with `platforms=["cuda"]`) from abstract inputs on 8 fake CPU devices, with the attention kernel a GPU
would pick. A lowering that fails here is the error the first GPU user would meet; a module without the fused
kernel's Triton call, or with XLA's `[seq, seq]` attention scores, means the kernel choice did not reach the step.
`bench/gpu.py --smoke` runs here too, so the one-shot GPU bench cannot rot.

Kernels join here as they are added: one case per (kernel, layout kind) that only a GPU compiles."""
import dataclasses
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import steps_for, tiny_config
from jaxpar.analysis.hlo_flops import stablehlo_flops
from jaxpar.kernels import attention as kernels
from jaxpar.kernels import grouped
from jaxpar import launch
from jaxpar.data.loader import batch_shapes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 250
SEQ = 32  # the only dimension of 32 in these models: a "32x32" tensor is XLA's attention scores or mask
TRITON = "__gpu$xla.gpu.triton"
MOSAIC = "mosaic_gpu_v2"  # a Mosaic GPU kernel's custom call
SCORES = re.compile(r"[<x]32x32x")
LLAMA = {"model.arch": "llama", "model.kv_heads": 2, "model.tie_embeddings": False}
MOE = {**LLAMA, "model.experts": 4, "model.experts_per_token": 2, "model.expert_mlp": 64,
       "model.capacity_factor": 1.25, "model.aux_loss": 0.01}

# (name, (data, tensor, stage), overrides); every case bf16, documents packed, head_dim 16
CASES = [
    ("gpt2 (1,1,1)", (1, 1, 1), {}),
    ("llama (2,2,2) gpipe", (2, 2, 2), {**LLAMA, "train.microbatches": 2}),
    ("gpt2 (2,1,4) 1f1b", (2, 1, 4), {"pipeline.schedule": "1f1b", "train.microbatches": 4}),
    ("llama (1,2,4) zb_h1", (1, 2, 4), {**LLAMA, "pipeline.schedule": "zb_h1", "train.microbatches": 4}),
    ("gpt2 (4,2,1) zero3 sp", (4, 2, 1), {"optim.zero_stage": 3, "model.sequence_parallel": True}),
    ("llama (4,2,1) zero3 sp", (4, 2, 1), {**LLAMA, "optim.zero_stage": 3, "model.sequence_parallel": True}),
    ("llama moe (2,1,1) expert 4 zero2", (2, 1, 1), {**MOE, "mesh.expert": 4, "optim.zero_stage": 2}),
    ("llama moe (2,1,2) expert 2 1f1b", (2, 1, 2), {**MOE, "mesh.expert": 2, "pipeline.schedule": "1f1b",
                                                    "train.microbatches": 2}),
    ("llama (2,2,2) 1f1b zero1 offload params", (2, 2, 2),
     {**LLAMA, "pipeline.schedule": "1f1b", "train.microbatches": 2, "optim.zero_stage": 1, "optim.offload": "params"}),
    ("llama (4,2,1) zero3 offload params (per layer)", (4, 2, 1),
     {**LLAMA, "optim.zero_stage": 3, "optim.offload": "params"}),
    ("gpt2 (4,2,1) zero3 offload optimizer, remat offload", (4, 2, 1),
     {"optim.zero_stage": 3, "optim.offload": "optimizer", "model.remat": "offload"}),
]


def gpu_config(layout, over, attention="auto", packing="documents"):
    d, t, s = layout
    c = tiny_config(**{"model.seq_len": SEQ, "model.layers": 4, "model.embed": 64, "model.heads": 4,
                       "model.mlp": 128, "train.param_dtype": "float32", "train.compute_dtype": "bfloat16",
                       "data.packing": packing, "mesh.data": d, "mesh.tensor": t, "mesh.stage": s, **over})
    if attention == "auto":  # what `auto` resolves to on a GPU, not on this host
        attention = kernels.choose("auto", jnp.bfloat16, SEQ, 16, packing == "documents", backend="gpu")[0]
    c.model.attention = attention
    return c


def lowered(config):
    """(train, evaluate) StableHLO text, each lowered for CUDA from abstract inputs with this layout's shardings."""
    n = config.mesh.data * config.mesh.tensor * config.mesh.stage * config.mesh.expert * config.mesh.context
    s = steps_for(config, VOCAB, jax.devices()[:n])
    state = s.abstract_state()
    batch = {k: jax.ShapeDtypeStruct(shape, dtype, sharding=s.batch_sharding)
             for k, (shape, dtype) in batch_shapes(16, SEQ, config.data.packing).items()}
    unstable = [jax.export.DisabledSafetyCheck.custom_call(t) for t in (TRITON, MOSAIC, "ragged_all_to_all")]
    export = lambda f, *args: jax.export.export(f, platforms=["cuda"], disabled_checks=unstable)(*args)  # noqa: E731
    with grouped.lowering_for("cuda"):
        return export(s.train, state, batch).mlir_module(), export(s.evaluate, state["params"], batch).mlir_module()


@pytest.mark.parametrize("name,layout,over", CASES, ids=[c[0] for c in CASES])
def test_train_and_eval_steps_lower_for_cuda_with_the_fused_kernel(name, layout, over):
    config = gpu_config(layout, over)
    assert config.model.attention == "pallas"  # packed documents on a GPU: the Pallas kernel takes segment ids
    train, evaluate = lowered(config)
    # forward and backward kernels in the train step, the forward in evaluation; no XLA attention anywhere
    assert train.count(TRITON) >= 2 and evaluate.count(TRITON) >= 1
    assert not SCORES.search(train) and not SCORES.search(evaluate)
    if config.mesh.expert > 1:  # the experts' tokens travel by all-to-all, forward and backward
        assert train.count("all_to_all") >= 4
    if config.optim.offload != "none":  # the offloaded state enters in host memory and is moved to the device
        assert 'mhlo.memory_kind = "pinned_host"' in train and '_xla_buffer_placement = "device"' in train
    if config.model.remat == "offload":  # the residuals go to the host in the forward pass
        assert '_xla_buffer_placement = "pinned_host"' in train


@pytest.mark.parametrize("layout,over", [((2, 1, 1), {"mesh.context": 4, "optim.zero_stage": 3}),
                                         ((1, 2, 2), {"mesh.context": 2, "pipeline.schedule": "1f1b",
                                                      "train.microbatches": 2, "model.sequence_parallel": True})],
                         ids=["context 4 zero3", "context 2 tensor 2 1f1b sp"])
def test_context_parallel_steps_lower_for_cuda_without_whole_score_matrices(layout, over):
    """Context parallelism on a GPU: the blockwise kernel (plain JAX) lowers for CUDA with its K/V all-gathers and
    their reduce-scatters, and no `[seq, seq]` (nor `[seq / context, seq]`) score matrix exists in the program."""
    config = gpu_config(layout, {**LLAMA, **over}, attention="xla")
    train, evaluate = lowered(config)
    assert "all_gather" in train and "reduce_scatter" in train and "all_gather" in evaluate
    local = SEQ // config.mesh.context
    assert not SCORES.search(train) and not re.search(rf"\dx{local}x{SEQ}x(f32|bf16)", train)  # [.., q, k] scores


RAGGED_A2A = re.compile(r"custom_call @ragged_all_to_all\(.*: \(tensor<\d+x64xbf16>")  # rows of width embed
PADDED_A2A = re.compile(r"all_to_all.*: \(tensor<4x\d+x64xbf16>")  # a padded [expert devices, R, embed] buffer


@pytest.mark.parametrize("kernel", ["xla", "mosaic"])
def test_a_dropless_ragged_moe_lowers_for_cuda_to_grouped_matmuls(kernel):
    """`model.moe_impl=ragged`, dropless, (expert 4, data 2): the CUDA program's routed experts are grouped matmuls,
    forward and backward: XLA's `chlo.ragged_dot` composite, or with `model.grouped_matmul=mosaic` the Mosaic GPU
    kernel for the forward and input-gradient matmuls (and the composite for the weight gradient); no dense expert
    matmul of the buffers `[.., experts, slots, embed]` is left (every `dot_general` of the `experts` scope counts 0
    FLOPs). The rows travel by `ragged_all_to_all` (there and back, and the same in the backward pass), never as
    a padded all-to-all of activations."""
    c = gpu_config((2, 1, 1), {**MOE, "mesh.expert": 4, "model.capacity_factor": 0.0, "model.moe_impl": "ragged",
                               "model.grouped_matmul": kernel})
    train, _ = lowered(c)
    composites, kernels_ = train.count('stablehlo.composite "chlo.ragged_dot"'), train.count(f"@{MOSAIC}(")
    want = (9, 0) if kernel == "xla" else (3, 6)  # 3 matmuls forward, 6 backward (with mosaic: 3 of them)
    assert composites >= want[0] and kernels_ >= want[1], (composites, kernels_)
    flops = stablehlo_flops(train, "experts")
    assert flops["dot_general"] == 0 and flops["ragged_dot"] > 0 and (flops["mosaic"] > 0) == (kernel == "mosaic")
    assert len(RAGGED_A2A.findall(train)) >= 4 and not PADDED_A2A.search(train)


@pytest.mark.parametrize("impl,ratio", [("ragged", 1.0), ("buffers", 2.0), ("mosaic", 1.0)])
def test_the_lowered_expert_flops_are_the_active_ones_for_ragged(impl, ratio):
    """One device, dropless, experts 4 of which k = 2: the CUDA program's expert matmul FLOPs (`stablehlo_flops`)
    are the active count 3 x 2 x tokens x k x 3 x embed x expert_mlp for `ragged`, experts / k times it for
    `buffers` (`bench/moe.py --lower cuda` writes the same rows for a bigger model)."""
    kernel = {"model.moe_impl": "ragged", "model.grouped_matmul": "mosaic"} if impl == "mosaic" else {}
    c = gpu_config((1, 1, 1), {**MOE, "model.capacity_factor": 0.0, "model.moe_impl": impl, **kernel})
    train, _ = lowered(c)
    active = 3 * 2 * 16 * SEQ * 2 * 3 * 64 * 64
    assert stablehlo_flops(train, "experts")["total"] == ratio * active


def test_the_checks_see_xla_attention():
    """The control: the same step with `model.attention=xla` has XLA's scores and no Triton call."""
    train, evaluate = lowered(gpu_config((2, 2, 2), {**LLAMA, "train.microbatches": 2}, attention="xla"))
    assert TRITON not in train and SCORES.search(train) and SCORES.search(evaluate)


def cudnn_detected() -> str | None:
    """None when cuDNN's attention can be lowered here, else why not."""
    q = jax.ShapeDtypeStruct((1, SEQ, 4, 16), jnp.bfloat16)
    try:
        jax.export.export(jax.jit(lambda q: kernels.attention(q, q, q, None, "cudnn")), platforms=["cuda"])(q)
    except Exception as e:  # noqa: BLE001 (JAX raises RuntimeError or ValueError depending on the install)
        return f"{type(e).__name__}: {str(e).splitlines()[0]}"
    return None


def test_cudnn_lowers_where_cudnn_is_detected():
    """Unpacked bf16 with head_dim 16 on a GPU: `auto` picks cuDNN. Its lowering needs cuDNN installed (JAX checks
    at trace time); without it the test is skipped and says why."""
    config = gpu_config((2, 2, 2), {**LLAMA, "train.microbatches": 2}, packing="concat")
    assert config.model.attention == "cudnn"
    why = cudnn_detected()
    if why is not None:
        pytest.skip(f"cuDNN cannot be lowered on this host ({why})")
    train, _ = lowered(config)
    assert "cudnn" in train.lower() and not SCORES.search(train)


def test_lowered_module_is_for_cuda_not_the_host():
    """The export really targets CUDA (the platform recorded in the module), and the host stays a CPU."""
    q = jax.ShapeDtypeStruct((2, SEQ, 4, 16), jnp.bfloat16)
    s = jnp.zeros((2, SEQ), np.int32)
    exp = jax.export.export(jax.jit(lambda q, s: kernels.attention(q, q, q, s, "pallas")), platforms=["cuda"],
                            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON)])(q, s)
    assert exp.platforms == ("cuda",) and jax.default_backend() == "cpu"
    assert TRITON in exp.mlir_module()


@pytest.mark.slow
def test_gpu_bench_smoke_runs_every_row():
    """`bench/gpu.py --smoke`: the one-shot GPU bench's logic on tiny models, so it cannot rot between GPU runs; every
    row and the loss check finish without an error."""
    env = launch.cpu_env(os.environ, 1)
    out = subprocess.run([sys.executable, "bench/gpu.py", "--smoke", "--steps", "2"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout[:out.stdout.rindex("\n}") + 2])
    assert len(result["rows"]) == 9 and not result["skipped"], result
    assert [r for r in result["rows"] if "error" in r] == []
    assert result["loss_check"] and "error" not in result["loss_check"], result["loss_check"]


def test_a_paged_decode_step_lowers_for_cuda_with_the_paged_kernel(monkeypatch):
    """The engine's decode step on (data 2, tensor 2), bf16, KV blocks of 16, `model.attention=pallas` (what
    `auto` takes on a GPU): lowered for CUDA, each layer's attention is JAX's Pallas paged-attention kernel (Triton)
    reading the pool in place, and no row's keys are gathered out of the pool (the XLA path's `[rows, positions,
    kv_heads, head_dim]` read, which the control with `xla` has)."""
    from jaxpar import model as gpt
    from jaxpar.generate import decode
    from jaxpar.generate.engine import Engine, Request
    from jaxpar.layout import Layout
    from jaxpar.parallel.mesh import make_mesh

    config = gpu_config((2, 2, 1), LLAMA)
    cfg = gpt.config_from(config, VOCAB, 2)
    mesh = make_mesh(Layout.from_config(config, 4), jax.devices()[:4])
    params = jax.device_put(gpt.init_params(cfg, jax.random.key(0)), jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec()))
    seen, compiled = [], decode._jit_decode
    monkeypatch.setattr(decode, "_jit_decode", lambda *a: seen.append(a) or compiled(*a))
    Engine(gpt.Forward(cfg), params, mesh=mesh, slots=4, kv_block=16, chunk=2).generate(
        [Request([1, 2, 3], max_new_tokens=2)])
    read = re.compile(r'"stablehlo.gather".*-> tensor<(\d+x){4}16x16xbf16>')  # [parts, kv heads, rows, width, ..]

    def module(attention):
        d = seen[0][0]
        fwd = gpt.Forward(dataclasses.replace(cfg, attention=attention))
        d = decode.Decoder(fwd, d.mesh, d.rules, *d.key[3:])
        return jax.export.export(compiled, platforms=["cuda"], disabled_checks=[
            jax.export.DisabledSafetyCheck.custom_call(TRITON)])(d, *seen[0][1:]).mlir_module()

    kernel, control = module("pallas"), module("xla")
    assert kernel.count(TRITON) >= 1 and "paged_attention" in kernel and TRITON not in control
    assert not read.search(kernel) and len(read.findall(control)) >= 2  # the control reads keys and values
