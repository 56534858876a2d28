"""What feeds the train loop its batches (`Feed`): the rows of prepared data (`TokenFeed`: documents, conversations,
preference pairs, images), or an RL objective's rounds sampled from prompts (`jaxpar/rl/rounds.py`). The loop asks a
feed for each step's global batch, the tokens it counts, its metrics at a log, its evaluation, what a checkpoint
records of it, and closes it.
"""
from __future__ import annotations

import numpy as np

from jaxpar import data


class Feed:
    tokens = 0  # the tokens of the last batch (`batch`), as throughput counts them

    def batch(self, step: int, state) -> dict:
        """The global batch of `step` on the steps' batch sharding (`state`: the state it trains)."""
        raise NotImplementedError

    def log(self, done: int, steps: int, writer=None) -> dict:
        """Its metrics at a log after step `done`, `steps` steps after the last; anything else it logs to `writer`
        (`observe.monitor.MetricsWriter`)."""
        return {}

    def evaluate(self, state) -> dict:
        return {}

    def resume_at(self, start: int, samples: int) -> None:
        """Continue from the checkpoint of step `start` (`samples`: the order's positions it had consumed)."""

    def save(self, done: int) -> dict:
        """What the checkpoint of step `done` records of the feed (its metadata), anything it keeps beside it
        written."""
        return {}

    def close(self) -> None:
        pass


def to_global(rows: dict, steps, global_batch: int, ref=None) -> dict:
    """This process's rows of a batch -> the global batch on the steps' sharding (`ref`: the dtype of DPO's
    precomputed reference sums)."""
    rows = rows if ref is None or "ref" not in rows else {**rows, "ref": rows["ref"].astype(ref)}
    return {k: data.to_global(v, steps.batch_sharding, global_batch) for k, v in rows.items()}


def reference_of(state) -> tuple:
    """The evaluation step's extra argument: DPO's frozen reference weights when the state holds them."""
    return (state["reference"],) if "reference" in state else ()


class TokenFeed(Feed):
    """Rows of prepared data, read ahead while the devices run (`data.Prefetch`); the validation loss over
    `eval.batches` batches."""

    def __init__(self, config, steps, train_data, val_data, eval_step, ref_dtype, total: int):
        """`eval_step`: `steps.evaluate` compiled (before the step watchdog is armed, so that a first evaluation's
        compile never counts as a stall); `ref_dtype`: `compiled.ref_dtype`."""
        self.config, self.steps, self.train_data, self.val_data = config, steps, train_data, val_data
        self.B, self.ref_dtype, self.eval_step = int(config.train.global_batch_size), ref_dtype, eval_step
        self.rows = data.process_rows(steps.batch_sharding, self.B)
        self.per_row = steps.cfg.family.tokens_per_item(steps.cfg)  # tokens per counted row (a ViT: per image)
        self.next_rows = data.Prefetch(train_data.rows, int(config.data.prefetch), total)

    def batch(self, step: int, state) -> dict:
        rows = self.next_rows(step, *self.rows)
        self.tokens = self.train_data.tokens_in(rows) * self.per_row * self.B // len(next(iter(rows.values())))
        return self.to_global(rows)

    def batch_at(self, source, i):
        return self.to_global(source(i, *self.rows))

    def to_global(self, rows: dict) -> dict:
        return to_global(rows, self.steps, self.B, self.ref_dtype)

    def log(self, done: int, steps: int, writer=None) -> dict:
        out = self.train_data.tokens_by_source(done) | {"data_wait_s": self.next_rows.waited_s / max(steps, 1)}
        self.next_rows.waited_s = 0.0
        return out

    def evaluate(self, state) -> dict:
        """{"val_loss": the mean loss over the weighted tokens (DPO: the pairs) of the `eval.batches` validation
        batches, and the objective's metrics over them, `val_` before their names}.

        Raises:
          DataError: those batches hold no weighted token (a mean over nothing is no loss).
        """
        tot, n = 0.0, 0.0
        for i in range(int(self.config.eval.batches)):
            s, c = self.eval_step(state["params"], self.batch_at(self.val_data.val_batch, i), *reference_of(state))
            tot, n = tot + float(s), n + np.asarray(c, np.float64)
        if np.ravel(n)[0] <= 0:  # (checked when the data was prepared: `Batches.check_loss_tokens`)
            raise data.no_loss_tokens(self.config.eval.batches)
        metrics = self.steps.objective.metrics(n, np.ravel(n)[0]) if np.ndim(n) else {}
        return {"val_loss": tot / np.ravel(n)[0]} | {f"val_{k}": float(v) for k, v in metrics.items()}

    def resume_at(self, start: int, samples: int) -> None:
        self.train_data.resume_at(start, samples)

    def save(self, done: int) -> dict:
        return {"samples": self.train_data.samples_before(done)}

    def close(self) -> None:
        self.next_rows.close()
