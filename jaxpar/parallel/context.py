"""Context parallelism's load balance: which tokens of a sequence each device of the `context` mesh axis holds.

The sequence is cut into 2 x CP chunks of equal length; device i holds chunks i and 2·CP−1−i (Llama 3's and
Megatron-Core's assignment; MaxText's dual-chunk swap). Under causal attention a query attends to every key before
it, so chunk c costs c + 1 chunk-pairs of work: device i's two chunks cost (i + 1) + (2·CP − i) = 2·CP + 1 whatever
i, where the contiguous split (device i holding chunks 2i and 2i + 1) costs 4i + 3. The step lays every sequence out
in this order before splitting it over `context` (`permutation`), the tokens keep their true positions, and the
attention finds each token's original index from the device's place (`local_index`). Knows no model.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def permutation(seq: int, cp: int) -> np.ndarray:
    """int32 `[seq]`: the original index of each position of the balanced order (device i's slice of seq / cp
    positions is chunks i and 2·cp − 1 − i). The identity for cp = 1."""
    if cp == 1:
        return np.arange(seq, dtype=np.int32)
    n = seq // (2 * cp)
    chunks = [c for i in range(cp) for c in (i, 2 * cp - 1 - i)]
    return np.concatenate([np.arange(c * n, (c + 1) * n) for c in chunks]).astype(np.int32)


def local_index(local: int, cp: int, rank):
    """int32 `[local]`: the original index of the tokens device `rank` (int or traced) holds, local = seq / cp."""
    n = local // 2
    return jnp.concatenate([rank * n + jnp.arange(n), (2 * cp - 1 - rank) * n + jnp.arange(n)]).astype(jnp.int32)


def pair_work(cp: int, balanced: bool = True) -> list[int]:
    """Chunk pairs (of the 2·cp chunks) each device's causal attention computes, a diagonal pair counted whole:
    2·cp + 1 each when balanced, 4i + 3 for device i of the contiguous split."""
    return [2 * cp + 1 if balanced else 4 * i + 3 for i in range(cp)]
