"""Training metrics: model FLOPs and MFU, device memory, JSONL + TensorBoard logging, console, profiler window.

Units used throughout:
  * FLOPs: floating-point operations (a multiply-add counts as 2).
  * FLOP/s: FLOPs per second; `PEAK_BF16_FLOPS` and `peak_flops` are per device.
  * tokens/s: tokens processed per second by the whole job (all devices together).
  * bytes: device memory, as reported by the backend.

Metric keys the console knows (all optional; every value is a Python number or None):
  loss, val_loss, lr, grad_norm, tokens_per_s, tflops_per_device, mfu (a fraction in [0, 1]),
  bytes_in_use, peak_bytes_in_use, bytes_limit (bytes, as returned by `device_memory_bytes`).
Any other key is written to JSONL/TensorBoard but not printed on the console.
"""
from __future__ import annotations

import io
import json
import math
import numbers
import os
import re
import sys
from typing import Any, Mapping

import jax
import numpy as np

__all__ = [
    "PEAK_BF16_FLOPS",
    "model_flops_per_token",
    "peak_flops",
    "mfu",
    "tflops_per_device",
    "device_memory_bytes",
    "MetricsWriter",
    "Console",
    "StepProfiler",
    "profile",
]


# ---------------------------------------------------------------------------------------------------------------
# FLOPs and MFU
# ---------------------------------------------------------------------------------------------------------------

def model_flops_per_token(n_params: int, layers: int, embed: int, seq_len: int) -> float:
    """Model FLOPs per trained token (forward + backward), PaLM's MFU numerator.

    Formula (Chowdhery et al. 2022, "PaLM: Scaling Language Modeling with Pathways", Appendix B, "Compute
    usage and model FLOPs utilization"): ``6 N + 12 L H Q T`` with H heads of size Q, so ``H Q = d_model``:

        flops_per_token = 6 * n_params + 12 * layers * embed * seq_len

    * ``6 N``: every parameter takes part in one multiply-add (2 FLOPs) per token in the forward pass and two in
      the backward pass (gradient w.r.t. activations and w.r.t. weights).
    * ``12 L d T``: the attention score and value matmuls (``Q K^T`` and ``P V``), which have no parameters:
      2 matmuls x 2 FLOPs x T x d per token per layer forward, x3 for forward + backward. As in PaLM, the full
      T x T attention matrix is counted (the causal mask's skipped half is not subtracted).
    * Rematerialisation (activation recompute) is excluded by definition: these are *model* FLOPs, so MFU does
      not go up when the trainer recomputes more (PaLM Appendix B contrasts this with hardware FLOPs utilisation).

    Args:
      n_params: N, the number of trained parameters with the tied token embedding counted once (its matmul is
        the output projection to the vocabulary; the input lookup is a gather with no FLOPs) and the learned
        position embedding left out (a lookup and an add, no matmul). The caller computes N from the params tree.
      layers: L, the number of transformer blocks.
      embed: d_model, the residual width (= heads x head size).
      seq_len: T, the training sequence length in tokens.

    Returns:
      FLOPs per token (float).
    """
    for name, v in (("n_params", n_params), ("layers", layers), ("embed", embed), ("seq_len", seq_len)):
        if v < 0:
            raise ValueError(f"{name}={v} must be >= 0.")
    return 6.0 * float(n_params) + 12.0 * float(layers) * float(embed) * float(seq_len)


# Dense (no structured sparsity) peak bf16 tensor-core / MXU throughput in FLOP/s per JAX device, keyed by a
# substring of `jax.Device.device_kind`. Sources: the vendors' product data sheets (NVIDIA H100, H200, A100, A10,
# A30, A40, L4, L40, L40S, V100 data sheets; Google Cloud TPU system-architecture pages for v4, v5e, v5p, v6e).
# NVIDIA data sheets list "with sparsity" figures; the dense figure is half of that, and is what is used here.
# V100 has no bf16 tensor cores: its entries are the fp16 tensor-core peaks (use them with float16 compute).
# Left out on purpose (no reliable published dense bf16 figure per JAX device, or a device_kind string we could
# not confirm): A10G, H800/A800, B100/B200/GB200, TPU v2/v3 (one JAX device per TensorCore) and TPU v4 lite.
PEAK_BF16_FLOPS: dict[str, float] = {
    # NVIDIA Hopper
    "H100 SXM": 989e12,       # e.g. "NVIDIA H100 SXM5 80GB"
    "H100 80GB HBM3": 989e12,  # the SXM5 part's usual device_kind
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H200 NVL": 835e12,
    "H200": 989e12,           # SXM
    "GH200": 989e12,
    # NVIDIA Ampere / Ada / Volta
    "A100": 312e12,           # SXM4 and PCIe, 40 GB and 80 GB
    "A30": 165e12,
    "A40": 149.7e12,
    "A10": 125e12,            # not A10G (AWS part, no published figure): boundary matching keeps them apart
    "L4": 121e12,
    "L40S": 362.05e12,
    "L40": 181.05e12,
    "V100-SXM2": 125e12,      # fp16 (no bf16 tensor cores)
    "V100-PCIE": 112e12,      # fp16
    "V100S": 130e12,          # fp16
    # Google TPU (one JAX device per chip on these generations)
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,    # v5e's device_kind
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
    "TPU v5": 459e12,         # v5p's device_kind
    "TPU v6 lite": 918e12,    # v6e (Trillium)'s device_kind
    "TPU v6e": 918e12,
}

# device_kind substrings that a shorter key above would otherwise claim, with no figure of their own.
_NO_PEAK = ("TPU v4 lite",)


def _contains_token(haystack: str, needle: str) -> bool:
    """`needle` occurs in `haystack` (case-insensitive) with no letter or digit right before or after it."""
    pattern = r"(?<![A-Za-z0-9])" + re.escape(needle) + r"(?![A-Za-z0-9])"
    return re.search(pattern, haystack, flags=re.IGNORECASE) is not None


def peak_flops(device_kind: str) -> float | None:
    """Dense bf16 peak FLOP/s of one device, looked up in `PEAK_BF16_FLOPS` by `jax.Device.device_kind`.

    The longest matching key wins; a key matches only as a whole token, so "A10" does not match "A10G" or "A100"
    and "L4" does not match "L40S". Returns None for CPU and for any device not in the table, so callers print
    "n/a" rather than an invented MFU.
    """
    if not device_kind:
        return None
    for key in _NO_PEAK:
        if _contains_token(device_kind, key):
            return None
    for key in sorted(PEAK_BF16_FLOPS, key=len, reverse=True):
        if _contains_token(device_kind, key):
            return PEAK_BF16_FLOPS[key]
    return None


def tflops_per_device(tokens_per_s: float, flops_per_token: float, num_devices: int) -> float:
    """Achieved model TFLOP/s per device: ``tokens_per_s * flops_per_token / num_devices / 1e12``.

    Args:
      tokens_per_s: tokens/s of the whole job (global batch tokens per step / step time).
      flops_per_token: FLOPs per token, from `model_flops_per_token`.
      num_devices: devices the job runs on (all of data x stage x tensor).
    """
    if num_devices < 1:
        raise ValueError(f"num_devices={num_devices} must be >= 1.")
    return float(tokens_per_s) * float(flops_per_token) / num_devices / 1e12


def mfu(tokens_per_s: float, flops_per_token: float, num_devices: int, peak: float | None) -> float | None:
    """Model FLOPs utilisation (PaLM, Chowdhery et al. 2022, Section 4.1 and Appendix B), as a fraction.

    ``tokens_per_s * flops_per_token / (num_devices * peak)``: achieved model FLOP/s over the job's peak.

    Args:
      tokens_per_s: tokens/s of the whole job.
      flops_per_token: FLOPs per token, from `model_flops_per_token`.
      num_devices: devices the job runs on.
      peak: peak FLOP/s of one device (`peak_flops`), or None when unknown.

    Returns:
      The fraction (0.5 means 50 %), or None when `peak` is None or not positive.
    """
    if peak is None or not peak > 0:
        return None
    if num_devices < 1:
        raise ValueError(f"num_devices={num_devices} must be >= 1.")
    return float(tokens_per_s) * float(flops_per_token) / (num_devices * float(peak))


# ---------------------------------------------------------------------------------------------------------------
# Device memory
# ---------------------------------------------------------------------------------------------------------------

_MEMORY_KEYS = ("bytes_in_use", "peak_bytes_in_use", "bytes_limit")


def device_memory_bytes(device: jax.Device | None = None) -> dict[str, int] | None:
    """Memory of one device in bytes, from `jax.Device.memory_stats()` (default: `jax.local_devices()[0]`).

    Returns:
      ``{"bytes_in_use": int, "peak_bytes_in_use": int, "bytes_limit": int}`` with whichever of those keys the
      backend reports (GPU and TPU do; `peak_bytes_in_use` is the high-water mark since the process started),
      or None when the backend reports nothing (CPU returns None).
    """
    try:
        dev = device if device is not None else jax.local_devices()[0]
        stats = dev.memory_stats()
    except Exception:  # a backend without the API
        return None
    if not stats:
        return None
    out = {k: int(stats[k]) for k in _MEMORY_KEYS if k in stats}
    return out or None


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
    """

    def __init__(self, workdir: str, enabled: bool):
        self.enabled = bool(enabled)
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
        for k, v in record.items():
            if k == "step" or isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            self._tb.add_scalar(k, v, global_step=step)
        self._tb.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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
                            ("lr", "lr", "{:.2e}"), ("grad_norm", "gnorm", "{:.3g}")):
        x = _num(metrics.get(key))
        if x is not None:
            parts.append(f"{label} {fmt.format(x)}")
    x = _num(metrics.get("tokens_per_s"))
    if x is not None:
        parts.append(f"{x:,.0f} tok/s")
    x = _num(metrics.get("tflops_per_device"))
    if x is not None:
        parts.append(f"{x:.1f} TFLOP/s/dev")
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
