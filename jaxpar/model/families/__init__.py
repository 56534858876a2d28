"""The model families' registry: `model.arch` -> the family's object (`base.Family`). A family is asked, never
named: its name is compared only in its own module and here (tests/test_structure.py checks it).

Adding a family: its module beside these (a `Family` subclass: block, norm, ends, config fields, rules) and one
entry in `FAMILIES` (docs/architecture.md shows what else a family may touch)."""
from __future__ import annotations

from jaxpar.errors import ConfigError
from jaxpar.model.families.base import Family
from jaxpar.model.families.gpt2 import GPT2
from jaxpar.model.families.llama import Llama
from jaxpar.model.families.vit import ViT

FAMILIES: dict[str, Family] = {f.name: f for f in (GPT2(), Llama(), ViT())}
ARCHS = tuple(FAMILIES)  # the values `model.arch` may take


def of(arch: str) -> Family:
    """The family `model.arch` names; ConfigError naming the choices for another."""
    if arch not in FAMILIES:
        raise ConfigError(f"model.arch={arch!r}: pick one of {ARCHS}.")
    return FAMILIES[arch]


def derived(config):
    """`config` with the keys other keys fix (a ViT's `model.seq_len`: `ViT.derived`); other configs come back as they
    are (the same object). An unknown `model.arch` comes back as it is too (validate names it)."""
    family = FAMILIES.get(config.model.arch)
    return config if family is None else family.derived(config)


__all__ = ["ARCHS", "FAMILIES", "Family", "derived", "of"]
