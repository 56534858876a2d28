"""Process set-up before the first compile: the persistent compilation cache and XLA's GPU flags.

`configure(config)` (train.py calls it before anything touches a device):
- `xla.compile_cache` (default on): JAX's persistent compilation cache in `xla.compile_cache_dir` (default
  `<jaxpar cache>/xla`, the cache of `data.cache_dir` / `$JAXPAR_CACHE` / `~/.cache/jaxpar`); a second start of the
  same run loads its compiled step instead of compiling it (every compile of >= 1 s is kept).
- `xla.gpu_flags` ("default" | "" | flags): added to `XLA_FLAGS` only when a CUDA plugin is installed and
  `JAX_PLATFORMS` does not exclude it; a flag already in `XLA_FLAGS` is never overridden (yours win).
  "default" is `GPU_FLAGS`: the overlap flags of JAX's GPU performance tips (docs/gpu_performance_tips.md):
  the latency-hiding scheduler (overlaps collectives with compute), pipelined all-gather / reduce-scatter /
  all-reduce across loop iterations (the layer scan: ZeRO-3 gathers, FSDP reductions), while-loop double buffering,
  collectives on the highest-priority stream.
"""
from __future__ import annotations

import importlib.util
import os

GPU_FLAGS = ("--xla_gpu_enable_latency_hiding_scheduler=true",
             "--xla_gpu_enable_pipelined_all_gather=true",
             "--xla_gpu_enable_pipelined_reduce_scatter=true",
             "--xla_gpu_enable_pipelined_all_reduce=true",
             "--xla_gpu_enable_while_loop_double_buffering=true",
             "--xla_gpu_enable_highest_priority_async_stream=true")


def cuda_present(environ=os.environ) -> bool:
    """A CUDA plugin is installed and JAX_PLATFORMS (if set) lets JAX use it; nothing is initialised."""
    platforms = environ.get("JAX_PLATFORMS", "")
    if platforms and not any(p in platforms.split(",") for p in ("cuda", "gpu")):
        return False
    return any(importlib.util.find_spec(m) is not None for m in ("jax_cuda12_plugin", "jax_cuda13_plugin"))


def merged_flags(current: str, extra) -> str:
    """`current` XLA_FLAGS plus each of `extra` whose flag name it does not already set."""
    have = {f.split("=")[0] for f in current.split()}
    return " ".join([current] * bool(current.strip()) + [f for f in extra if f.split("=")[0] not in have])


def gpu_flags(setting: str) -> tuple:
    return GPU_FLAGS if setting == "default" else tuple(setting.split())


def compile_cache_dir(config) -> str:
    from jaxpar.data.preprocess import cache_root

    return config.xla.compile_cache_dir or str(cache_root(config) / "xla")


def configure(config, environ=os.environ) -> dict:
    """Apply `config.xla` to this process (see the module docstring) -> what was set."""
    import jax

    out = {"compile_cache": None, "gpu_flags": ()}
    if config.xla.compile_cache:
        path = compile_cache_dir(config)
        os.makedirs(path, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
        out["compile_cache"] = path
    if cuda_present(environ) and config.xla.gpu_flags:
        extra = gpu_flags(config.xla.gpu_flags)
        environ["XLA_FLAGS"] = merged_flags(environ.get("XLA_FLAGS", ""), extra)
        out["gpu_flags"] = extra
    return out
