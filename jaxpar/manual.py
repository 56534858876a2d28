"""The name before issue 27: the helpers for `jax.shard_map` bodies are `jaxpar/shard_map_body.py`."""
from jaxpar.shard_map_body import put, take, vary, vary_like, varying_axes  # noqa: F401
