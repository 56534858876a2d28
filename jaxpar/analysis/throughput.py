"""The throughput formulas: MFU, TFLOP/s per device, peak FLOP/s by device kind, device memory (the model's FLOPs per
token are the model spec's, `model.flops_per_token`). Where they are written: `monitor`.

Units used throughout:
  * FLOPs: floating-point operations (a multiply-add counts as 2).
  * FLOP/s: FLOPs per second; `PEAK_BF16_FLOPS` and `peak_flops` are per device.
  * tokens/s: tokens processed per second by the whole job (all devices together).
  * bytes: device memory, as reported by the backend.

"""
from __future__ import annotations

import contextlib
import re
import time

import jax

__all__ = [
    "PEAK_BF16_FLOPS",
    "peak_flops",
    "mfu",
    "tflops_per_device",
    "device_memory_bytes",
]


# ---------------------------------------------------------------------------------------------------------------
# FLOPs and MFU
# ---------------------------------------------------------------------------------------------------------------

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


class Interval:
    """What the throughput of a log interval counts: the steps since the last log and the real (non-padding) tokens
    they processed, over the seconds they took less what is not training: the first step of a start (it compiles)
    is left out, and so are checkpoint saves (`paused`). `clock` is injectable for tests."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.restart()

    def restart(self) -> None:
        self.steps, self.tokens, self.paused, self.t0 = 0, 0, 0.0, self.clock()

    def add(self, tokens: int) -> None:
        self.steps, self.tokens = self.steps + 1, self.tokens + int(tokens)

    @contextlib.contextmanager
    def pause(self):
        t = self.clock()
        try:
            yield
        finally:
            self.paused += self.clock() - t

    def rates(self) -> dict:
        """{tokens_per_s, step_time_s}, or {} when no step was timed (the first step of a start alone)."""
        dt = self.clock() - self.t0 - self.paused
        return {} if self.steps == 0 or dt <= 0 else {"tokens_per_s": self.tokens / dt, "step_time_s": dt / self.steps}
