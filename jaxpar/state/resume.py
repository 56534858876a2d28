"""A resume's checks, before anything is written: the fingerprint a checkpoint carries (`fingerprint`: the model's
identity, the tokenizer and data, the global batch size, the adapters) against this run's (`check_resume`, one
message naming every difference), fingerprints of older checkpoints read as today's (`upgrade_fingerprint`), where
the data order continues (`samples_consumed`), and the latest complete checkpoint of a WORKDIR (`latest_checkpoint`,
read only)."""
from __future__ import annotations

import os

from jaxpar import model as gpt
from jaxpar.errors import ConfigError
from jaxpar.state.checkpoint import Checkpointer

# What a resume must keep identical (else: refuse before touching anything): the model's identity
# (`model.IDENTITY_FIELDS`), the tokenizer and data, and the global batch size (unless train.allow_batch_change).
# Layout, zero stage, schedule, microbatches, precision, cadence and steps may change.
BATCH_KEY = "train.global_batch_size"


def fingerprint(config, info, steps) -> dict:
    fp = {f"model.{k}": v for k, v in gpt.identity(steps.cfg).items()}
    fp.update({BATCH_KEY: int(config.train.global_batch_size), "tokenizer": getattr(info, "tokenizer_kind", "none"),
               "data": info.identity})  # (images have no tokenizer)
    if config.data.packing != "concat":  # absent from fingerprints written before packing existed
        fp["data.packing"] = config.data.packing
    if config.data.packing == "bfd":
        fp["data.truncate"] = config.data.truncate
    if steps.cfg.lora_rank:  # which adapters the state holds (absent from full fine-tuning's fingerprints)
        fp.update({"lora.rank": steps.cfg.lora_rank, "lora.adapted": sorted(gpt.adapter_specs(steps.cfg))})
    return fp


def upgrade_fingerprint(saved: dict) -> dict:
    """A fingerprint as older checkpoints wrote it -> today's keys: before the model spec (`model.mlp` the config's
    value, 0 meaning 4 x embed, with the width under `mlp_width`; `vocab_real` without a prefix), and before the
    llama family (no `model.arch`, `model.kv_heads`, ...: a gpt2 with the defaults), and before mixtures of experts
    (no `model.experts`, ...: dense)."""
    out = dict(saved)
    if "mlp_width" in saved:
        out = {k: v for k, v in saved.items() if k not in ("mlp_width", "vocab_real")}
        out.update({"model.mlp": saved["mlp_width"], "model.vocab_real": saved.get("vocab_real")})
    if "model.heads" in out:
        old = {k[len("model."):]: v for k, v in out.items() if k.startswith("model.")}
        out.update({f"model.{k}": v for k, v in gpt.identity_defaults(old).items() if f"model.{k}" not in out})
    return out


def check_resume(saved: dict, now: dict, allow_batch_change: bool = False) -> None:
    """Raise ConfigError naming every difference between a checkpoint's fingerprint and this run's.

    `allow_batch_change` (`train.allow_batch_change`) accepts a different `train.global_batch_size`."""
    batch, saved = BATCH_KEY, upgrade_fingerprint(saved)
    diffs = [f"{k}: checkpoint {saved.get(k)!r} vs now {now[k]!r}" for k in now
             if saved.get(k) != now[k] and not (allow_batch_change and k == batch)]
    if diffs:
        hint = ("\nto continue the data order with the new batch size, pass --config.train.allow_batch_change=True."
                if any(d.startswith(batch + ":") for d in diffs) else "")
        raise ConfigError("refusing to resume: the checkpoint was written for another model or data:\n  "
                          + "\n  ".join(diffs)
                          + "\nuse a fresh --workdir, or restore the original settings." + hint)


def samples_consumed(meta: dict, step: int, batch: int) -> int:
    """Positions of the training order consumed before `step`, from the meta of checkpoint `step`: its `samples`,
    or (checkpoints written before it was recorded) `step` x the global batch size of its fingerprint (else `batch`)."""
    if "samples" in meta:
        return int(meta["samples"])
    return int(step) * int(meta.get("fingerprint", {}).get("train.global_batch_size", batch))


def latest_checkpoint(workdir: str) -> tuple[int | None, dict | None]:
    """(the latest complete checkpoint's step, its metadata), or (None, None); reads only."""
    if not os.path.isdir(os.path.join(workdir, "checkpoints")):
        return None, None
    with Checkpointer(workdir, 1, 1, async_save=False, read_only=True) as probe:
        latest = probe.latest_step()
        return latest, (None if latest is None else probe.read_meta(latest))
