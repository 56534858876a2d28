"""Tests run on 8 fake CPU devices (set before jax is imported anywhere)."""
import os

_flags = os.environ.get("XLA_FLAGS", "")  # kept: e.g. --xla_cpu_max_isa=AVX2 to try another instruction set
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")


import numpy as np  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    words = ["to", "be", "or", "not", "that", "is", "the", "question", "whether", "tis", "nobler"]
    (d / "a.txt").write_text(" ".join(rng.choice(words, 6000)) + "\n")
    return d
