"""Image classification, a ViT's objective (a family whose data is images trains on this one): cross-entropy of each
image's label from the class token, weighted by the row mask (0: padding rows of an evaluation); divided by the
step's images (`total` of the row mask). Logs top-1 `accuracy`."""
from __future__ import annotations

import jax.numpy as jnp

from jaxpar.train.objectives.base import Objective


class Classify(Objective):
    name = "classify"
    data_kinds = ("images",)
    packing = "concat"
    metric_names = ("accuracy",)

    def head(self, fwd, params, x, mb):
        return fwd.classify(params, x, mb["y"], mb["w"])

    def metrics(self, count, total) -> dict:
        return {"accuracy": count[1] / jnp.maximum(count[0], 1)}
