"""Process set-up (jaxpar/cluster/runtime.py): XLA flags merged without overriding the user's, applied only with CUDA, and
unknown flags dropped before they can abort a start; the persistent compilation cache."""
import jax
import pytest

from helpers import tiny_config
from jaxpar.cluster import runtime
from jaxpar.config import ConfigError


def test_user_flags_win_and_gpu_flags_need_cuda(monkeypatch):
    merged = runtime.merged_flags("--xla_gpu_enable_latency_hiding_scheduler=false --foo=1", runtime.GPU_FLAGS)
    assert "--xla_gpu_enable_latency_hiding_scheduler=false" in merged.split()
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" not in merged
    assert "--xla_gpu_enable_pipelined_all_gather=true" in merged.split() and merged.startswith("--xla_gpu_enable")
    assert not runtime.cuda_present({"JAX_PLATFORMS": "cpu"})
    env = {"XLA_FLAGS": "--a=1"}
    monkeypatch.setattr(runtime, "cuda_present", lambda environ: False)
    c = tiny_config(**{"xla.compile_cache": False})
    assert runtime.configure(c, env) == {"compile_cache": None, "gpu_flags": (), "gpu_flags_skipped": ()}
    assert env == {"XLA_FLAGS": "--a=1"}


def test_unknown_flags_are_dropped_and_remembered(tmp_path):
    good, bad = "--xla_gpu_enable_latency_hiding_scheduler=true", "--xla_gpu_no_such_flag=true"
    assert runtime.known_flags((good, bad), str(tmp_path)) == ((good,), (bad,))
    assert runtime._parses([good]) and not runtime._parses([bad])
    assert len(list(tmp_path.glob("xla_flags-*.json"))) == 1


def test_compile_cache_goes_to_the_jaxpar_cache(tmp_path):
    c = tiny_config(**{"data.cache_dir": str(tmp_path)})
    before = jax.config.jax_compilation_cache_dir
    try:
        out = runtime.configure(c, {})
        assert out["compile_cache"] == str(tmp_path / "xla") and (tmp_path / "xla").is_dir()
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "xla")
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


def test_a_probe_that_timed_out_is_never_cached(tmp_path):
    """A timed-out probe (None) leaves its flag out this time, says so, and is probed again at the next start."""
    a, b = "--xla_gpu_a=true", "--xla_gpu_b=true"
    answers = {(a, b): False, (): True, (a,): True, (b,): None}
    calls = []
    parses = lambda flags: calls.append(tuple(flags)) or answers[tuple(flags)]
    assert runtime.known_flags((a, b), str(tmp_path), parses) == ((a,), (b,))
    answers[(b,)] = True  # the next start's probe answers
    assert runtime.known_flags((a, b), str(tmp_path), parses) == ((a, b), ())
    assert calls[-1] == (b,)  # only b probed again: a's answer was kept
    assert runtime.known_flags((a, b), str(tmp_path), lambda flags: 1 / 0) == ((a, b), ())  # both cached now
    line = runtime.describe({"compile_cache": None, "gpu_flags": (a,), "gpu_flags_skipped": (b,)})
    assert line.startswith(f"XLA GPU flags set: {a}; skipped") and line.endswith(b)


def test_an_unwritable_cache_is_one_line(tmp_path):
    """A compile cache that cannot be created is a ConfigError naming the path and the fix (train.py prints it
    after the processes joined, so every peer exits with it), never a traceback."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    c = tiny_config(**{"xla.compile_cache_dir": str(blocker / "xla")})
    with pytest.raises(ConfigError, match=r"compile cache .* at .*file/xla cannot be written .*"
                                          r"--config.xla.compile_cache=False"):
        runtime.configure(c, {})
    assert blocker.read_text() == ""
