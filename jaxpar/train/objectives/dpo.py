"""Direct preference optimisation (`train.objective='dpo'`, settings `dpo.*`), and its reference's pass.

`DPO` (Rafailov et al. 2023): on preference pairs packed as segments (pair k of a row: segment 2k its chosen
  sequence, 2k + 1 its rejected one, `jaxpar/data/packing.py`); a sequence's log-prob is the sum over its response
  tokens (the loss mask) of its tokens' log-probs, as TRL; the loss of a pair, with margin
  m = (log pi(chosen) - log pi_ref(chosen)) - (log pi(rejected) - log pi_ref(rejected)),
      sigmoid: -(1 - eps) log sigmoid(beta m) - eps log sigmoid(-beta m)   (eps: `dpo.label_smoothing`)
      ipo:     (m / 1 - 1 / (2 beta))^2, on log-probs averaged over the response tokens (TRL's IPO);
  divided by the step's pairs. Its metrics: `pairs` (the step's), and TRL's rewards/chosen, rewards/rejected
  (beta (log pi - log pi_ref)), rewards/margins, rewards/accuracies, logps/chosen, logps/rejected, means over them.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxpar.data.packing import pairs_per_row
from jaxpar.kernels.cross_entropy import place_rows
from jaxpar.train.objectives.base import Objective


def pair_sums(values, w, seg):
    """values, w `[batch, seq]`, seg `[batch, seq]` (pair k's chosen segment 2k, rejected 2k + 1; -1 padding) ->
    `[batch, pairs_per_row(seq), 2]`: sum of values x w over each pair's chosen ([..., 0]) and rejected ([..., 1])."""
    n = 2 * pairs_per_row(seg.shape[1])
    one = lambda v, s: jax.ops.segment_sum(v, jnp.clip(s, 0, n - 1), num_segments=n)  # noqa: E731
    return jax.vmap(one)(values * w, seg).reshape(seg.shape[0], n // 2, 2)


_METRICS = ("pairs", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "logps/chosen", "logps/rejected")


@dataclasses.dataclass(frozen=True)
class DPO(Objective):
    beta: float
    loss: str  # sigmoid | ipo
    label_smoothing: float
    reference: str = "copy"  # copy | adapters_off | adapters | batch: the model the run starts from (`from_config`)
    dropout: bool = False  # `dpo.dropout`: dropout in the policy's and the reference's passes (the same masks)
    name = "dpo"
    section = "dpo"
    data_kinds = ("pairs",)
    packing = "bfd"
    metric_names = _METRICS + ("rewards/margins",)

    @classmethod
    def from_config(cls, config) -> "DPO":
        """DPO with `dpo.*`; its reference is always the model the run starts from: precomputed
        (`dpo.precompute_reference`: `batch`); under LoRA the frozen base with the starting adapters (`adapters`: a
        frozen copy of `lora.adapter`'s, no second copy of the base) or, with fresh adapters, the base alone
        (`adapters_off`: PEFT's fresh adapters add nothing); else a frozen copy of the starting weights (`copy`)."""
        d = config.dpo
        reference = "batch" if d.precompute_reference else cls.starting_model(config)
        return cls(float(d.beta), str(d.loss), float(d.label_smoothing), reference, bool(d.dropout))

    def reference_head(self, rows: int):
        return ReferenceSums(rows)

    @staticmethod
    def errors(config, lay) -> list[str]:
        """Pairs packed whole into rows (data.packing=bfd), no context parallelism."""
        errs = []
        if config.data.packing not in ("bfd", "auto"):
            errs.append(f"train.objective='dpo' with data.packing={config.data.packing!r}: a preference pair's chosen "
                        f"and rejected sequences must sit whole in one row; set --config.data.packing=bfd.")
        if lay.context > 1:
            errs.append(f"train.objective='dpo' with mesh.context={lay.context}: DPO's per-sequence sums are not "
                        f"context-parallel yet; set mesh.context=1 (sequences up to model.seq_len fit one device's "
                        f"row; use tensor or sequence parallelism for memory).")
        return errs

    def head(self, fwd, params, x, mb):
        lp = fwd.token_logps(params, x, mb["y"])
        w, seg = mb["w"], mb["seg"]
        n = pair_sums(jnp.ones_like(lp), w, seg)
        valid = ((n[..., 0] > 0) & (n[..., 1] > 0)).astype(lp.dtype)
        pol, ref = pair_sums(lp, w, seg), mb["ref"].astype(lp.dtype)  # ref: the reference's sums, `ReferenceSums`
        if self.loss == "ipo":
            pol, ref = pol / jnp.maximum(n, 1), ref / jnp.maximum(n, 1)
        reward = self.beta * (pol - ref)  # [b, P, 2]
        margin = (pol[..., 0] - pol[..., 1]) - (ref[..., 0] - ref[..., 1])
        if self.loss == "ipo":
            per_pair = (margin - 1 / (2 * self.beta)) ** 2
        else:
            eps = self.label_smoothing
            per_pair = -(1 - eps) * jax.nn.log_sigmoid(self.beta * margin) - eps * jax.nn.log_sigmoid(
                -self.beta * margin)
        s = lambda a: (a * valid).sum()  # noqa: E731
        count = jnp.stack([valid.sum(), s(reward[..., 0]), s(reward[..., 1]),
                           s((reward[..., 0] > reward[..., 1]).astype(lp.dtype)), s(pol[..., 0]), s(pol[..., 1])])
        return s(per_pair), count

    def total(self, mask, seg, batch):
        n = pair_sums(jnp.ones_like(mask), mask, seg)
        return ((n[..., 0] > 0) & (n[..., 1] > 0)).sum(dtype=mask.dtype)

    def metrics(self, count, total) -> dict:
        m = {k: count[i] / jnp.maximum(count[0], 1) for i, k in enumerate(_METRICS) if i}
        return {"pairs": count[0], **m, "rewards/margins": m["rewards/chosen"] - m["rewards/rejected"]}


class ReferenceSums:
    """The reference model's pass: no loss; its count is every row's sums of its response tokens' log-probs per pair
    (`pair_sums`), `[global batch, pairs_per_row(seq), 2]`, each microbatch writing its rows (`ids`) and zeros
    elsewhere, so that summing over microbatches and data shards assembles them (what DPO's `ref` is)."""

    def __init__(self, rows: int):
        self.rows = rows

    def head(self, fwd, params, x, mb):
        sums = pair_sums(fwd.token_logps(params, x, mb["y"]), mb["w"], mb["seg"])
        # placed by a one-hot product, a sum over the microbatch's rows (one all-reduce over data), not a scatter
        # (which XLA partitions into all-gathers and collective permutes: XLA:CPU deadlocked on them)
        place = (mb["ids"][:, None] == jnp.arange(self.rows)).astype(sums.dtype)  # [microbatch rows, rows]
        return jnp.zeros((), sums.dtype), place_rows(place, sums)
