"""The name before issue 27: the throughput formulas (MFU, TFLOP/s, peak FLOPs, device memory) are
`jaxpar/throughput.py`; the writers of the metrics are `jaxpar/monitor.py`."""
from jaxpar.throughput import PEAK_BF16_FLOPS, device_memory_bytes, mfu, peak_flops, tflops_per_device  # noqa: F401
