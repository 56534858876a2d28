"""Device and link constants for the planner: one table each, every number with its source.

Units: FLOP/s, bytes/s, bytes. A link's `busbw` is the bus bandwidth nccl-tests reports for a large all-reduce
(`all_reduce_perf`; a ring all-reduce of X bytes over n ranks takes 2(n-1)/n · X / busbw); the datasheet figure is
kept beside it. `--measure` (python -m jaxpar.plan) checks the whole model against a real step.
"""
from __future__ import annotations

import dataclasses
import re

GiB = 2 ** 30


@dataclasses.dataclass(frozen=True)
class Device:
    name: str
    peak_flops: float  # dense bf16/fp16 tensor-core FLOP/s
    hbm_bw: float  # bytes/s
    memory: float  # bytes
    intra_node: str  # default link between GPUs of one server (a key of LINKS)
    source: str
    host: str = "pcie4"  # the link to host memory (a key of HOST_LINKS): `optim.offload`'s transfers
    kinds: tuple = ()  # this part's `jax.Device.device_kind`s (CUDA's device names) less "NVIDIA "
    hopper: bool = False  # compute capability 9.x: the Mosaic GPU grouped kernel runs (`kernels.grouped.choose`)


@dataclasses.dataclass(frozen=True)
class Link:
    name: str
    busbw: float  # bytes/s per GPU, as nccl-tests reports it (what the model uses)
    datasheet: float  # bytes/s per GPU per direction
    latency: float  # seconds per collective (small-message time)
    source: str


DEVICES = {d.name: d for d in (
    Device("a100-80g", 312e12, 2.039e12, 80 * GiB, "nvlink3",
           "NVIDIA A100 datasheet (SXM4 80GB): 312 TFLOP/s bf16 dense, 2,039 GB/s HBM2e, 80 GB; PCIe Gen4",
           kinds=("A100-SXM4-80GB",)),
    Device("a100-80g-pcie", 312e12, 1.935e12, 80 * GiB, "pcie4",
           "NVIDIA A100 datasheet (PCIe 80GB): 312 TFLOP/s bf16 dense, 1,935 GB/s HBM2e, 80 GB, no NVLink switch; "
           "PCIe Gen4", kinds=("A100 80GB PCIe",)),
    Device("h100", 989e12, 3.35e12, 80 * GiB, "nvlink4",
           "NVIDIA H100 datasheet (SXM5): 989 TFLOP/s bf16 dense, 3.35 TB/s HBM3, 80 GB; PCIe Gen5", "pcie5",
           kinds=("H100 80GB HBM3", "H100 SXM5 80GB"), hopper=True),
    Device("h200", 989e12, 4.8e12, 140 * GiB, "nvlink4",
           "NVIDIA H200 datasheet (SXM): 989 TFLOP/s bf16 dense, 4.8 TB/s HBM3e, 141 GB; PCIe Gen5", "pcie5",
           kinds=("H200",), hopper=True),
)}

LINKS = {k.name: k for k in (
    Link("nvlink3", 230e9, 300e9, 10e-6,
         "A100 NVLink 3 + NVSwitch, 600 GB/s bidirectional; nccl-tests all_reduce busbw 232.5 GB/s on 8 x A100 "
         "(NVIDIA/nccl-tests#175), ~200 GB/s (#149)"),
    Link("nvlink4", 450e9, 450e9, 10e-6,
         "H100/H200 NVLink 4 + NVSwitch, 900 GB/s bidirectional; all_reduce busbw 480 GB/s with NVLS (GTC S62129, "
         "quoted in NVIDIA/nccl#1374), 450 taken"),
    Link("pcie4", 20e9, 32e9, 20e-6,
         "PCIe Gen4 x16, 32 GB/s per direction; an A100 node's all_reduce falls to ~20 GB/s busbw once the ring "
         "leaves NVLink for PCIe/SMP (NVIDIA/nccl-tests#178)"),
    Link("ib-hdr", 21.5e9, 25e9, 20e-6,
         "InfiniBand HDR 200 Gb/s = 25 GB/s per NIC; 2 nodes x 8 A100 with 4 HDR NICs each reach 86 of 100 GB/s "
         "all_reduce busbw (NVIDIA/nccl-tests#175, #119: 85-96): 0.86 x 25 per NIC"),
    Link("ib-ndr", 43e9, 50e9, 20e-6,
         "InfiniBand NDR 400 Gb/s = 50 GB/s per NIC; the same 0.86 of line rate as HDR (assumed)"),
    Link("ethernet-100g", 10.5e9, 12.5e9, 30e-6, "100 GbE RoCE, 12.5 GB/s per NIC; 0.86 of line rate (assumed)"),
)}


# A device's link to pinned host memory (per GPU, per direction): what `optim.offload` moves each step crosses it.
HOST_LINKS = {k.name: k for k in (
    Link("pcie4", 25e9, 32e9, 10e-6,
         "PCIe Gen4 x16: 16 GT/s x 16 lanes, 128b/130b = 31.5 GB/s per direction (PCI-SIG); pinned host<->device "
         "copies reach ~80 % of it (CUDA's bandwidthTest on A100: ~25 GB/s; assumed for every Gen4 device)"),
    Link("pcie5", 50e9, 64e9, 10e-6,
         "PCIe Gen5 x16: 32 GT/s x 16 lanes = 63 GB/s per direction (PCI-SIG); the same ~80 % taken for pinned "
         "copies (assumed; bench/offload.py measures it on the device present)"),
)}


def device_named(device_kind: str) -> str | None:
    """The `DEVICES` name of a `jax.Device.device_kind` ("NVIDIA H100 80GB HBM3" -> "h100"), or None for a part
    the table does not hold (an H100 PCIe, an H200 NVL, an A100 40GB, a CPU): the device_kind without the vendor's
    "NVIDIA " equals one of the part's `kinds`, case aside."""
    name = re.sub(r"^NVIDIA ", "", device_kind.strip(), flags=re.IGNORECASE)
    return next((d.name for d in DEVICES.values() for k in d.kinds if name.lower() == k.lower()), None)


@dataclasses.dataclass(frozen=True)
class Cluster:
    """`gpus` devices, `gpus_per_node` per server over `intra` links, servers joined by `nics_per_node` NICs of
    `inter` links."""
    device: Device
    gpus: int
    gpus_per_node: int
    intra: Link
    inter: Link
    nics_per_node: int

    def group_bw(self, size: int, stride: int) -> tuple[float, float]:
        """(busbw bytes/s, latency s) of a collective over `size` ranks `stride` device ids apart (the mesh is
        (data, stage, tensor), tensor fastest; `jaxpar.parallel.mesh`): NVLink/PCIe when the group lies within a node, else
        the node's NICs shared by the groups that cross them at once (min(stride, gpus_per_node) of them)."""
        if size <= 1:
            return float("inf"), 0.0
        if size * stride <= self.gpus_per_node:
            return self.intra.busbw, self.intra.latency
        sharing = min(stride, self.gpus_per_node)  # the ring still runs through the node's own link
        return min(self.intra.busbw, self.inter.busbw * self.nics_per_node / sharing), self.inter.latency


    def p2p_bw(self, across_nodes: bool) -> tuple[float, float]:
        """(bytes/s, latency s) of a point-to-point transfer: the intra-node link, or across nodes the sender's own
        share of the NICs (NCCL sends through the NIC nearest the GPU)."""
        if not across_nodes:
            return self.intra.busbw, self.intra.latency
        return self.inter.busbw * self.nics_per_node / self.gpus_per_node, self.inter.latency


def cluster(device: str, gpus: int, gpus_per_node: int = 8, interconnect: str = "ib-hdr",
            nics_per_node: int = 0, intra_node: str = "") -> Cluster:
    """A `Cluster` from names (DEVICES, LINKS); nics_per_node 0: one per GPU (DGX-style)."""
    if device not in DEVICES:
        raise ValueError(f"--device={device!r}: pick one of {sorted(DEVICES)}")
    for flag, name in (("interconnect", interconnect), ("intra_node", intra_node)):
        if name and name not in LINKS:
            raise ValueError(f"--{flag}={name!r}: pick one of {sorted(LINKS)}")
    if gpus < 1 or gpus_per_node < 1 or nics_per_node < 0:
        raise ValueError(f"--gpus={gpus}, --gpus_per_node={gpus_per_node}, --nics_per_node={nics_per_node}: need "
                         f"gpus, gpus_per_node >= 1 and nics_per_node >= 0")
    if gpus > gpus_per_node and gpus % gpus_per_node:
        raise ValueError(f"--gpus={gpus} is not a multiple of --gpus_per_node={gpus_per_node}: jaxpar's mesh needs "
                         f"every node to hold the same number of devices")
    d, per_node = DEVICES[device], min(gpus_per_node, gpus)
    return Cluster(d, gpus, per_node, LINKS[intra_node or d.intra_node], LINKS[interconnect],
                   nics_per_node or per_node)
