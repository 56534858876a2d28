"""The training objectives' registry: `train.objective` -> the objective's class (`base.Objective`); an objective is
asked, never named: its name is compared only in its own module and here (tests/test_structure.py checks it).

- `lm` (`lm.py`): next-token cross-entropy over the loss mask (documents, conversations);
- `classify` (`classify.py`): the objective of a family whose data is images (a ViT), whatever `train.objective`
  says (validate refuses anything but its default `lm` there);
- `dpo` (`dpo.py`): direct preference optimisation on pairs, with a reference model (a frozen copy, the adapters
  off, or precomputed), TRL's metrics.

- `grpo` (`grpo.py`): the GRPO family's policy-gradient losses (dapo, grpo, dr_grpo, bnpo, gspo, cispo) on sampled
  completions whose old and reference log-probs and advantages arrive with the batch, normalised over the whole step.
"""
from __future__ import annotations

from jaxpar import data
from jaxpar.config_keys import changed
from jaxpar.model import FAMILIES
from jaxpar.train.objectives.base import Objective
from jaxpar.train.objectives.classify import Classify
from jaxpar.train.objectives.dpo import DPO, ReferenceSums, pair_sums
from jaxpar.train.objectives.grpo import GRPO, TokenLogps
from jaxpar.train.objectives.lm import LM

OBJECTIVES: dict[str, type[Objective]] = {c.name: c for c in (LM, DPO, GRPO)}  # what `train.objective` names
DEFAULT = LM.name


def _images(config) -> bool:
    family = FAMILIES.get(config.model.arch)
    return family is not None and family.data_kind == "images"


def from_config(config) -> Objective:
    """The objective of a run config, with its settings: a family that reads images trains on `Classify`."""
    if _images(config):
        return Classify()
    return OBJECTIVES[config.train.objective].from_config(config)


def with_packing(config):
    """`config` with `data.packing=auto` resolved for its objective (`data.with_packing`; an unknown
    `train.objective` is left to `validate`)."""
    return data.with_packing(config, _needs(config))


def packing(config) -> str:
    """`data.packing` as `with_packing` resolves it (no copy of the config)."""
    return data.packing(config, _needs(config))


def _needs(config) -> str:
    """The packing the config's objective needs whatever the records (`Objective.packing`)."""
    known = _images(config) or config.train.objective in OBJECTIVES
    return from_config(config).packing if known else ""


def errors(config, lay) -> list[str]:
    """The objectives' rules, one line each: an image family's objective is its classifier's; another objective's
    settings are refused; the named objective's own rules (`Objective.errors`)."""
    name = config.train.objective
    if _images(config) and name != DEFAULT:
        return [f"model.arch={config.model.arch!r} with train.objective={name!r}: not supported for vision "
                f"transformers; set train.objective={DEFAULT!r} (a ViT trains on labels: cross-entropy of its "
                f"classes)."]
    for other in OBJECTIVES.values():
        given = changed(config, other.section) if other.section and other.name != name else []
        if given:
            return [f"{other.section}.{given[0]}={config[other.section][given[0]]!r} with train.objective={name!r}: "
                    f"set --config.train.objective={other.name} to train on its {' or '.join(other.data_kinds)}, or "
                    f"drop {other.section}.{given[0]}."]
    return OBJECTIVES[name].errors(config, lay) if name in OBJECTIVES else []


__all__ = ["Classify", "DPO", "GRPO", "LM", "OBJECTIVES", "Objective", "ReferenceSums", "errors", "from_config", "packing",
           "pair_sums", "TokenLogps", "with_packing"]
