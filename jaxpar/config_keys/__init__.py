"""Every config key, written once: its default, type, allowed range and one-line meaning (`KEYS`: `tables.py`,
`post_training.py`; `Key` and the value sets several keys share: `key.py`).

`config.base_config()` is built from this table, `validate` checks each key's type and range from it (`key_errors`;
the rules between keys stay in `validate`), and the key table of docs/config.md is generated from it
(`python -m jaxpar.config` rewrites it; `tests/test_docs.py` fails when the two differ). Imports nothing of
jaxpar but its own modules.
"""
from __future__ import annotations

import functools

from jaxpar.config_keys.key import (DEFAULT_RULES, DTYPES, GRPO_LOSSES, MESH_AXES, NEW_RULES,  # noqa: F401
                                   OFFLOAD, REMAT_POLICIES, REWARD_SCALES, ROUTERS, Key)
from jaxpar.config_keys.post_training import POST_TRAINING
from jaxpar.config_keys.tables import MODEL, RUN

KEYS = MODEL + POST_TRAINING + RUN


def get(config, key: str):  # the value of a dotted key
    return functools.reduce(lambda c, part: c[part], key.split("."), config)


def changed(config, section: str) -> list[str]:
    """The keys of `section` whose values differ from their defaults (names without the section)."""
    return [k.name.split(".", 1)[1] for k in KEYS if k.name.startswith(section + ".")
            and get(config, k.name) != k.default]


def key_errors(config) -> list[str]:
    """One line for each key whose value has the wrong type or lies outside its range (`Key.error`)."""
    return [e for k in KEYS if (e := k.error(get(config, k.name))) is not None]
