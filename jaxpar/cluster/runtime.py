"""Process set-up before the first compile: the persistent compilation cache and XLA's GPU flags.

`configure(config)` (train.py calls it before anything touches a device):
- `xla.compile_cache` (default on): JAX's persistent compilation cache in `xla.compile_cache_dir` (default
  `<jaxpar cache>/xla`, the cache of `data.cache_dir` / `$JAXPAR_CACHE` / `~/.cache/jaxpar`); a second start of the
  same run loads its compiled step instead of compiling it (every compile of >= 1 s is kept); JAX's own
  `JAX_COMPILATION_CACHE_DIR` / `JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`, when set, win.
- `xla.gpu_flags` ("default" | "" | flags): added to `XLA_FLAGS` only when a CUDA plugin is installed and
  `JAX_PLATFORMS` does not exclude it; a flag already in `XLA_FLAGS` is never overridden (yours win), and a flag
  this jaxlib's XLA does not know (it would abort the process) is left out (`known_flags`, checked once per version).
  "default" is `GPU_FLAGS`: the overlap flags of JAX's GPU performance tips (docs/gpu_performance_tips.md):
  the latency-hiding scheduler (overlaps collectives with compute), pipelined all-gather / reduce-scatter /
  all-reduce across loop iterations (the layer scan: ZeRO-3 gathers, FSDP reductions), while-loop double buffering,
  collectives on the highest-priority stream.
"""
from __future__ import annotations

import importlib.util
import os

from jaxpar.config import cache_root
from jaxpar.errors import ConfigError

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


def _parses(flags, timeout_s: float = 120) -> bool | None:
    """Whether this jaxlib's XLA knows every flag (an unknown one aborts the process at backend start): checked in
    a CPU-only child process, which parses XLA_FLAGS as the GPU backend would. None: the probe timed out (unknown)."""
    import subprocess
    import sys

    env = dict(os.environ, XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu")
    probe = "import jax; jax.numpy.zeros(1).block_until_ready()"
    try:
        return subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                              timeout=timeout_s).returncode == 0
    except subprocess.TimeoutExpired:
        return None


def known_flags(flags, cache_dir: str | None = None, parses=_parses) -> tuple[tuple, tuple]:
    """(the flags this jaxlib's XLA accepts, the flags left out): all of them or each checked alone, the answers
    cached per jaxlib version (written atomically: several processes may start at once). A probe that timed out
    decides nothing and is never cached: its flags are left out this time and probed again at the next start. If
    the probe cannot run at all (no flags fails too), every flag is left out and nothing is cached."""
    import json

    import jaxlib

    path = os.path.join(cache_dir, f"xla_flags-{jaxlib.__version__}.json") if cache_dir else None
    known = {}
    try:
        with open(path) as f:
            known = json.load(f)
    except (TypeError, OSError, ValueError):  # no cache dir, no file yet, or a file from a crashed writer
        pass
    todo = [f for f in flags if f not in known]
    if todo:
        ok = parses(todo)
        if ok is not True and parses([]) is not True:
            return (), tuple(flags)
        found = {f: True if ok else parses([f]) for f in todo}
        known.update({f: v for f, v in found.items() if v is not None})
        if path:
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(known, f)
            os.replace(tmp, path)
    return tuple(f for f in flags if known.get(f)), tuple(f for f in flags if not known.get(f))


def compile_cache_dir(config) -> str:
    return config.xla.compile_cache_dir or str(cache_root(config) / "xla")


def configure(config, environ=os.environ) -> dict:
    """Apply `config.xla` to this process (see the module docstring) -> what was set: `compile_cache` (the path or
    None), `gpu_flags` (added to XLA_FLAGS) and `gpu_flags_skipped` (unknown to this jaxlib, or not probed in time).

    Raises:
      ConfigError: a cache directory that cannot be created or written (the message names it and the fix).
    """
    import jax

    out = {"compile_cache": None, "gpu_flags": (), "gpu_flags_skipped": ()}
    if config.xla.compile_cache:  # JAX's own variables, when set, win
        path = environ.get("JAX_COMPILATION_CACHE_DIR") or compile_cache_dir(config)
        _writable(path, "the compile cache (xla.compile_cache_dir, or JAX_COMPILATION_CACHE_DIR)",
                  "--config.xla.compile_cache=False")
        jax.config.update("jax_compilation_cache_dir", path)
        if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in environ:
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
        out["compile_cache"] = path
    if cuda_present(environ) and config.xla.gpu_flags:
        root = str(cache_root(config))
        _writable(root, "jaxpar's cache (data.cache_dir, or JAXPAR_CACHE)", "--config.xla.gpu_flags=''")
        extra, skipped = known_flags(gpu_flags(config.xla.gpu_flags), root)
        environ["XLA_FLAGS"] = merged_flags(environ.get("XLA_FLAGS", ""), extra)
        out.update(gpu_flags=extra, gpu_flags_skipped=skipped)
    return out


def _writable(path: str, what: str, off: str) -> None:
    """Create `path` (a directory) if needed and check that this process can write there."""
    try:
        os.makedirs(path, exist_ok=True)
        if not os.access(path, os.W_OK | os.X_OK):
            raise PermissionError(f"no write permission for {path}")
    except OSError as e:
        raise ConfigError(f"{what} at {path} cannot be written ({e.strerror or e}): give a writable directory, or "
                          f"turn it off with {off}.") from None


def describe(said: dict) -> str | None:
    """One line for the log on what `configure` set: the GPU flags set and skipped (None when it set none)."""
    if not said["gpu_flags"] and not said["gpu_flags_skipped"]:
        return None
    line = f"XLA GPU flags set: {' '.join(said['gpu_flags']) or '(none)'}"
    if said["gpu_flags_skipped"]:
        line += (f"; skipped (unknown to this jaxlib, or its probe timed out and is retried at the next start): "
                 f"{' '.join(said['gpu_flags_skipped'])}")
    return line
