"""Tests run on 8 fake CPU devices (set before jax is imported anywhere)."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
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
