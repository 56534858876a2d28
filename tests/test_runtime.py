"""Process set-up (jaxpar/cluster/runtime.py): XLA flags merged without overriding the user's, applied only with CUDA, and
unknown flags dropped before they can abort a start; the persistent compilation cache."""
import jax

from helpers import tiny_config
from jaxpar.cluster import runtime


def test_user_flags_win_and_gpu_flags_need_cuda(monkeypatch):
    merged = runtime.merged_flags("--xla_gpu_enable_latency_hiding_scheduler=false --foo=1", runtime.GPU_FLAGS)
    assert "--xla_gpu_enable_latency_hiding_scheduler=false" in merged.split()
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" not in merged
    assert "--xla_gpu_enable_pipelined_all_gather=true" in merged.split() and merged.startswith("--xla_gpu_enable")
    assert not runtime.cuda_present({"JAX_PLATFORMS": "cpu"})
    env = {"XLA_FLAGS": "--a=1"}
    monkeypatch.setattr(runtime, "cuda_present", lambda environ: False)
    c = tiny_config(**{"xla.compile_cache": False})
    assert runtime.configure(c, env) == {"compile_cache": None, "gpu_flags": ()} and env == {"XLA_FLAGS": "--a=1"}


def test_unknown_flags_are_dropped_and_remembered(tmp_path):
    good, bad = "--xla_gpu_enable_latency_hiding_scheduler=true", "--xla_gpu_no_such_flag=true"
    assert runtime.known_flags((good, bad), str(tmp_path)) == (good,)
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
