"""Where training metrics go: JSONL + TensorBoard (`MetricsWriter`), the console (`Console`: a rich progress bar on a
terminal, plain lines elsewhere), and profiler traces of chosen steps (`StepProfiler`). Only process 0 writes.

Metric keys the console knows (all optional; every value is a Python number or None):
  loss, val_loss, lr, grad_norm, tokens_per_s, tflops_per_device, mfu (a fraction in [0, 1]),
  DPO's rewards/margins, rewards/accuracies and val_rewards/accuracies (as margin, acc, val_acc),
  bytes_in_use, peak_bytes_in_use, bytes_limit (bytes, as returned by `throughput.device_memory_bytes`).
Any other key is written to JSONL/TensorBoard but not printed on the console.
"""
from __future__ import annotations

import io
import json
import math
import numbers
import os
import sys
import uuid
from typing import Any, Mapping

import jax
import numpy as np

from jaxpar.analysis.throughput import _MEMORY_KEYS

# ---------------------------------------------------------------------------------------------------------------
# JSONL + TensorBoard
# ---------------------------------------------------------------------------------------------------------------

def _to_python(v: Any) -> Any:
    """Plain Python value for JSON: numpy/JAX scalars to int/float/bool, exact (no rounding)."""
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, numbers.Integral):
        return int(v)
    if isinstance(v, numbers.Real):
        return float(v)
    if isinstance(v, (np.ndarray, np.generic, jax.Array)):
        return np.asarray(v).tolist()  # exact: float32 widens to float64 losslessly
    if isinstance(v, Mapping):
        return {str(k): _to_python(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_to_python(x) for x in v]
    return str(v)


def _json_safe(v: Any) -> Any:
    """NaN and +-inf are not JSON: write them as the strings "nan", "inf", "-inf" (kept, unlike null)."""
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    if isinstance(v, dict):
        return {k: _json_safe(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_json_safe(x) for x in v]
    return v


class MetricsWriter:
    """Append-only metrics log: ``WORKDIR/metrics.jsonl`` plus TensorBoard scalars in ``WORKDIR/tb``.

    Each `write(step, values)` appends one JSON object ``{"step": step, **values}`` on one line and flushes it,
    so a crash loses no written line. Floats are written with Python's shortest round-trip repr (never rounded);
    NaN/inf become the strings "nan"/"inf"/"-inf" so every line stays valid JSON; None stays null. The same
    numeric values go to TensorBoard (tensorboardX) with the value's key as tag; None and non-numbers are skipped.
    The file is opened in append mode, so a resumed run continues the same log.

    Pass ``enabled=(jax.process_index() == 0)``: when disabled every method is a no-op and nothing is created.
    `wandb`: a `WandbRun` that gets the same numeric values at the same steps (closed with this writer).
    """

    def __init__(self, workdir: str, enabled: bool, wandb: "WandbRun | None" = None):
        self.enabled = bool(enabled)
        self._wandb = wandb if self.enabled else None
        self.path = os.path.join(workdir, "metrics.jsonl")
        self.tb_dir = os.path.join(workdir, "tb")
        self._file = None
        self._tb = None
        if not self.enabled:
            return
        os.makedirs(workdir, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")
        from tensorboardX import SummaryWriter

        self._tb = SummaryWriter(logdir=self.tb_dir)

    def write(self, step: int, values: Mapping[str, Any]) -> None:
        """Log `values` (str -> number or None) at `step` (int)."""
        if not self.enabled or self._file is None:
            return
        step = int(step)
        record = {"step": step}
        for k, v in values.items():
            if k == "step":
                continue
            record[str(k)] = _to_python(v)
        self._file.write(json.dumps(_json_safe(record), allow_nan=False) + "\n")
        self._file.flush()
        for k, v in record.items():  # per layer (MoE): a histogram each for a row per layer
            for i, x in enumerate(v) if isinstance(v, list) else ():
                if isinstance(x, list):
                    self._tb.add_histogram(f"{k}/layer{i}", np.asarray(x, float), global_step=step)
        scalars = _scalars(record)
        for k, v in scalars.items():
            self._tb.add_scalar(k, v, global_step=step)
        self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step)

    def table(self, name: str, rows: list, step: int) -> None:
        """Rows of one kind (dicts with the same keys: GRPO's logged completions) as a W&B table at `step`, when W&B
        is on (metrics.jsonl and TensorBoard hold numbers only)."""
        if self._wandb is not None and rows:
            self._wandb.table(name, rows, step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.close()
            self._wandb = None

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class WandbRun:
    """A Weights & Biases run (`log.wandb_project`) that gets what `MetricsWriter` writes: the numbers, at the
    same steps (per-layer lists as `key/layerI`), and the resolved config. Its id is kept in WORKDIR/wandb_id, so a
    resumed or requeued job continues the same run (`resume="allow"`); its local files go to `$WANDB_DIR` when set,
    else to WORKDIR/wandb (passed to `init`, not left to wandb's reading of the environment, which it caches for the
    life of the process). `WANDB_MODE=offline` (no network) and W&B's other environment settings apply as wandb
    reads them.

    Every metric is plotted against `step` (the training step, `define_metric`); W&B's own `_step`, which must grow,
    counts the logs (kept in WORKDIR/wandb_step), so the steps a resume from an older checkpoint than the last log
    does again are logged again, beside the first ones, never dropped."""

    ID_FILE, COUNT_FILE, STEP = "wandb_id", "wandb_step", "step"

    def __init__(self, workdir: str, log, config: dict):
        import wandb

        path = os.path.join(workdir, self.ID_FILE)
        os.makedirs(workdir, exist_ok=True)
        run_id = open(path).read().strip() if os.path.isfile(path) else uuid.uuid4().hex[:12]
        with open(path, "w") as f:  # before the run starts: a job killed during `init` resumes the same id
            f.write(run_id + "\n")
        name = log.wandb_name or os.path.basename(os.path.abspath(workdir))
        self.run = wandb.init(project=log.wandb_project, entity=log.wandb_entity or None, name=name,
                              tags=[str(t) for t in log.wandb_tags] or None, id=run_id, resume="allow",
                              dir=os.environ.get("WANDB_DIR") or workdir, config=config)
        self.run.define_metric(self.STEP)
        self.run.define_metric("*", step_metric=self.STEP)
        self.count_path = os.path.join(workdir, self.COUNT_FILE)
        saved = int(open(self.count_path).read()) if os.path.isfile(self.count_path) else 0
        self.logged = max(saved, int(self.run.step or 0))  # (an offline run's resume starts at 0: the file knows)

    def log(self, scalars: dict, step: int) -> None:
        self.run.log({**scalars, self.STEP: int(step)}, step=self.logged)
        self.logged += 1
        with open(self.count_path, "w") as f:
            f.write(f"{self.logged}\n")

    def table(self, name: str, rows: list, step: int) -> None:
        import wandb

        columns = list(rows[0])
        text = lambda v: v if isinstance(v, (int, float)) else json.dumps(v)  # noqa: E731 (messages, rewards)
        self.log({name: wandb.Table(columns=columns, data=[[text(r[c]) for c in columns] for r in rows])}, step)

    def close(self) -> None:
        self.run.finish()


def writer_for(config, workdir: str, enabled: bool) -> MetricsWriter:
    """The run's `MetricsWriter`, with its W&B run when `log.wandb_project` names one (process 0 only)."""
    tracker = WandbRun(workdir, config.log, config.to_dict()) if enabled and config.log.wandb_project else None
    return MetricsWriter(workdir, enabled, tracker)


def _scalar(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _scalars(record: Mapping[str, Any]) -> dict:
    """{tag: number} of a written record: its numbers, and each per-layer list's numbers as `key/layerI`."""
    out = {}
    for k, v in record.items():
        if isinstance(v, list):
            out.update({f"{k}/layer{i}": x for i, x in enumerate(v) if _scalar(x)})
        elif k != "step" and _scalar(v):
            out[k] = v
    return out


# ---------------------------------------------------------------------------------------------------------------
# Console
# ---------------------------------------------------------------------------------------------------------------

_GIB = 1024 ** 3


def _num(v: Any) -> float | None:
    if v is None or isinstance(v, (bool, str)):
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def format_metrics(step: int, total_steps: int, metrics: Mapping[str, Any]) -> str:
    """One compact log line, e.g.
    ``step 100/1000 | loss 3.2146 | val_loss 3.3012 | lr 3.00e-04 | gnorm 0.512 | 52,310 tok/s |
    41.7 TFLOP/s/dev | MFU 4.2% | mem 12.31/139.81 GiB (peak 13.02)``.
    Missing or None fields are left out, except MFU which prints "n/a". Memory is in GiB (2**30 bytes).
    """
    parts = [f"step {int(step)}/{int(total_steps)}"]
    for key, label, fmt in (("loss", "loss", "{:.4f}"), ("val_loss", "val_loss", "{:.4f}"),
                            ("rewards/margins", "margin", "{:.3f}"), ("rewards/accuracies", "acc", "{:.2f}"),
                            ("val_rewards/accuracies", "val_acc", "{:.2f}"),
                            ("lr", "lr", "{:.2e}"), ("grad_norm", "gnorm", "{:.3g}")):
        x = _num(metrics.get(key))
        if x is not None:
            parts.append(f"{label} {fmt.format(x)}")
    load = metrics.get("moe_load_max_mean")
    if load is not None:  # the most loaded expert of the most unbalanced MoE layer, over the mean
        parts.append(f"experts max/mean {float(np.max(load)):.2f}")
    x = _num(metrics.get("tokens_per_s"))
    if x is not None:
        parts.append(f"{x:,.0f} tok/s")
    x = _num(metrics.get("tflops_per_device"))
    if x is not None:  # below 1 TFLOP/s (a CPU) in GFLOP/s, so the figure never reads 0.0
        parts.append(f"{x:.1f} TFLOP/s/dev" if x >= 1 else f"{1e3 * x:.3g} GFLOP/s/dev")
    x = _num(metrics.get("mfu"))
    parts.append("MFU n/a" if x is None else f"MFU {100 * x:.1f}%")
    used, peak, limit = (_num(metrics.get(k)) for k in _MEMORY_KEYS)
    if used is not None or peak is not None:
        mem = f"{(used if used is not None else peak) / _GIB:.2f}"
        if limit is not None:
            mem += f"/{limit / _GIB:.2f}"
        mem = f"mem {mem} GiB"
        if used is not None and peak is not None:
            mem += f" (peak {peak / _GIB:.2f})"
        parts.append(mem)
    return " | ".join(parts)


class Console:
    """Training console: a rich progress bar on a terminal, plain lines everywhere else.

    Call `update(step, metrics)` after every step with `step` the number of steps completed; pass `metrics`
    (see the module docstring for keys) only on log steps: a non-empty `metrics` prints one line from
    `format_metrics`. On a terminal the line is printed above a live progress bar (steps done / total, elapsed,
    remaining); when the stream is not a terminal (CI logs, pipes, files) or `progress` is False there is no bar
    and each line is written plainly and flushed. When disabled (processes other than 0) it does nothing.

    Args:
      enabled: print at all (pass ``jax.process_index() == 0``).
      total_steps: last step of the run (the bar's total).
      start_step: step the run starts from (a resumed run's bar starts here).
      progress: allow the bar (config.log.progress); it is shown only when the stream is a terminal.
      stream: where to write (default sys.stdout).
    """

    def __init__(self, enabled: bool, total_steps: int, start_step: int = 0, progress: bool = True,
                 stream: io.TextIOBase | None = None):
        self.enabled = bool(enabled)
        self.total_steps = int(total_steps)
        self.stream = stream if stream is not None else sys.stdout
        self._progress = None
        self._task = None
        if not self.enabled:
            return
        isatty = getattr(self.stream, "isatty", None)
        if progress and isatty is not None and isatty():
            import rich.console
            import rich.progress as rp

            self._progress = rp.Progress(
                rp.TextColumn("[bold]train"), rp.BarColumn(), rp.MofNCompleteColumn(),
                rp.TimeElapsedColumn(), rp.TextColumn("eta"), rp.TimeRemainingColumn(),
                console=rich.console.Console(file=self.stream), transient=False)
            self._task = self._progress.add_task("train", total=self.total_steps, completed=int(start_step))
            self._progress.start()

    def update(self, step: int, metrics: Mapping[str, Any] | None = None) -> None:
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.update(self._task, completed=int(step))
        if metrics:
            self.print(format_metrics(step, self.total_steps, metrics))

    def print(self, line: str) -> None:
        """Print one plain line (no markup) above the bar, or to the stream."""
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.console.print(line, markup=False, highlight=False, soft_wrap=True)
        else:
            self.stream.write(line + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def __enter__(self) -> "Console":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------------------------
# Profiler window
# ---------------------------------------------------------------------------------------------------------------

class StepProfiler:
    """Records a `jax.profiler` trace to ``WORKDIR/profile`` over a window of steps (view it in TensorBoard's
    profile plugin, or Perfetto).

    Call `maybe_start(step)` just before running step `step` and `maybe_stop(step, block_on)` just after it. The
    trace starts before the first step in `steps` (min) and stops after the last (max), so ``steps=(10, 12)``
    records steps 10, 11 and 12. `block_on` (e.g. the step's loss) is waited for before stopping, so the trace
    holds the device work of the last step. Empty `steps` disables it. A run resumed inside the window starts the
    trace at its first step; one resumed past it records nothing. Also a context manager that stops an open
    trace on exit.
    """

    def __init__(self, workdir: str, steps: tuple[int, ...] = ()):
        steps = tuple(int(s) for s in (steps or ()))
        self.log_dir = os.path.join(workdir, "profile")
        self.first = min(steps) if steps else None
        self.last = max(steps) if steps else None
        self.active = False
        self.done = not steps

    def maybe_start(self, step: int) -> bool:
        """Start the trace if `step` is in the window and none has run yet; returns True when it started."""
        if self.done or self.active or not (self.first <= int(step) <= self.last):
            return False
        os.makedirs(self.log_dir, exist_ok=True)
        jax.profiler.start_trace(self.log_dir)
        self.active = True
        return True

    def maybe_stop(self, step: int, block_on: Any = None) -> bool:
        """Stop the trace after the window's last step; returns True when it stopped."""
        if not self.active or int(step) < self.last:
            return False
        self.stop(block_on)
        return True

    def stop(self, block_on: Any = None) -> None:
        if not self.active:
            return
        if block_on is not None:
            jax.block_until_ready(block_on)
        try:
            jax.profiler.stop_trace()
        finally:
            self.active = False
            self.done = True

    def __enter__(self) -> "StepProfiler":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def profile(workdir: str, steps: tuple[int, ...] = ()) -> StepProfiler:
    """A `StepProfiler` writing to ``WORKDIR/profile`` for the step window `steps` (config.log.profile_steps)."""
    return StepProfiler(workdir, steps)
