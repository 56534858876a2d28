"""Which keys a query may see, by segment id: one rule for every kernel that takes segment ids. Knows no model.

A segment id is a packed document's (an int in [0, 2^16); -1 padding): a query sees the keys of its own segment.
A row may also hold a shared prefix and its continuations (GRPO's shared-prompt rows, `jaxpar/rl/rows.py`): the
prefix has id b, its continuations member * 2^16 + b (member >= 1), and a continuation's queries see its own keys and
the prefix's (`base(id)` = b), never another continuation's. A document's id is its own base, so packed rows keep
their rule. Causality is the kernel's (by position); the prefix comes first in its row.
"""
from __future__ import annotations

SHIFT = 16  # member ids sit above the base's 16 bits
BASE = (1 << SHIFT) - 1


def continuation(member: int, base: int) -> int:
    """The id of continuation `member` (>= 1) of the prefix whose id is `base` (0 <= base < 2^16)."""
    return (int(member) << SHIFT) | int(base)


def member(ids):
    """Each id's member: 0 for a document or a prefix, k for continuation k (-1 for padding)."""
    return ids >> SHIFT


def visible(q_ids, k_ids):
    """Whether each query may see each key (broadcast): the same segment, or the key is the query's prefix."""
    return (q_ids == k_ids) | ((q_ids & BASE) == k_ids)
