"""Language modelling (`train.objective='lm'`): next-token cross-entropy over the loss mask (documents, or
conversations' replies: `jaxpar/data/chat.py`), divided by the step's masked tokens."""
from __future__ import annotations

from jaxpar.train.objectives.base import Objective


class LM(Objective):
    name = "lm"
    data_kinds = ("documents", "conversations")

    def head(self, fwd, params, x, mb):
        return fwd.head_loss(params, x, mb["y"], mb["w"])
