"""Tests run on 8 fake CPU devices (set before jax is imported anywhere)."""
import os
import re

_flags = os.environ.get("XLA_FLAGS", "")  # kept: e.g. --xla_cpu_max_isa=AVX2 to try another instruction set
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
# XLA:CPU's backend optimization level 0 (LLVM -O0): the suite's programs are tiny, so compiling them is most of its
# time, and -O0 compiles ~40 % faster (measured: a 1F1B train step on 8 devices 12.9 s -> 8.9 s). Only the machine
# code changes (as on another CPU); JAXPAR_TEST_XLA_OPT=default keeps XLA's default level.
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"] and \
        os.environ.get("JAXPAR_TEST_XLA_OPT", "0") != "default":
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# JAX's persistent compilation cache, shared by the whole run and the processes it starts (train.py, the launcher):
# the suite compiles the same small programs many times over (each test builds its own steps). Off with
# JAXPAR_TEST_COMPILE_CACHE=0; a JAX_COMPILATION_CACHE_DIR already set wins.
if os.environ.get("JAXPAR_TEST_COMPILE_CACHE", "1") != "0" and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxpar-test-xla-cache-")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


import numpy as np  # noqa: E402
import pytest  # noqa: E402

# XLA:CPU told to target SSE4.2 (no F16C) cannot convert float16 at all (LLVM: "Symbols not found:
# [ __extendhfsf2 ]"): the float16 tests are skipped there, and only there.
NO_F16C = re.search(r"--xla_cpu_max_isa=SSE4_2\b", os.environ["XLA_FLAGS"]) is not None


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="--xla_cpu_max_isa=SSE4_2: XLA:CPU has no float16 conversion without F16C")
    for item in items:
        if NO_F16C and "float16" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    words = ["to", "be", "or", "not", "that", "is", "the", "question", "whether", "tis", "nobler"]
    text = rng.choice(words, 6000)
    for i in range(6):  # six documents (one per file): the last is the validation split
        (d / f"{'abcdef'[i]}.txt").write_text(" ".join(text[i * 1000:(i + 1) * 1000]) + "\n")
    return d


@pytest.fixture(scope="session")
def one_file_corpus(tmp_path_factory):
    """The corpus as runs before documents existed saw it (tests/fixtures/old_run): one file, one line."""
    d = tmp_path_factory.mktemp("corpus1")
    rng = np.random.default_rng(0)
    words = ["to", "be", "or", "not", "that", "is", "the", "question", "whether", "tis", "nobler"]
    (d / "a.txt").write_text(" ".join(rng.choice(words, 6000)) + "\n")
    return d


@pytest.fixture(scope="session")
def grpo_reference(tmp_path_factory):
    """`helpers.grpo_material`'s GRPO run on 1 process x 8 devices (root/one), float64: the reference of the
    multi-process runs (tests/test_multihost_engine.py, tests/test_slurm.py); -> (root, the x64 environment)."""
    import subprocess
    import sys

    from rl_runs import grpo_material
    from jaxpar import launch

    root = tmp_path_factory.mktemp("grpo_reference")
    grpo_material(root)
    env = dict(launch.cpu_env(os.environ, 8), JAX_ENABLE_X64="1")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res = subprocess.run([sys.executable, os.path.join(repo, "train.py"), "--config", str(root / "config.py"),
                          "--workdir", str(root / "one"), f"--config.data.cache_dir={root}/cache_one"], env=env,
                         cwd=repo, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return root, env
