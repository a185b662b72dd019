"""Hardware profiles: what one device computes and moves per second, and how much it holds.

The cost model reads a profile only through `compute_time_s`, `collective_time_s`
and `usable_memory_bytes`, so a calibrated profile and a built-in one are
interchangeable.
"""
import dataclasses
import json
import os
from dataclasses import dataclass, field

from .errors import HardwareError

COLLECTIVES = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkProfile:
    """One class of link (within a node, across nodes), alpha-beta per collective kind."""

    latency_s: dict[str, float]
    """Fixed cost of one collective call, by kind (COLLECTIVES)."""
    bus_bandwidth_bytes_per_s: dict[str, float]
    """Bus bandwidth by kind: time = latency + bytes * factor(kind, n) / bandwidth."""


@dataclass(frozen=True, kw_only=True, slots=True)
class HardwareProfile:
    name: str
    device_memory_bytes: int
    usable_memory_fraction: float = 0.9
    """Share of device memory a plan may use by default (allocator fragmentation, runtime context)."""
    peak_flops: dict[str, float]
    """Peak dense matmul FLOP/s by dtype ("float32", "bfloat16", "float16")."""
    matmul_efficiency: float = 0.6
    """Fraction of peak that model-sized matmuls reach."""
    memory_bandwidth_bytes_per_s: float
    devices_per_node: int = 8
    intra_node: LinkProfile
    inter_node: LinkProfile
    source: str = ""
    """Where the figures come from."""

    @property
    def usable_memory_bytes(self) -> int:
        return int(self.device_memory_bytes * self.usable_memory_fraction)

    def compute_time_s(self, flops: float, bytes_moved: float, dtype: str = "float32") -> float:
        """Roofline: the slower of arithmetic and memory traffic."""
        peak = self.peak_flops.get(dtype) or self.peak_flops["float32"]
        return max(flops / (peak * self.matmul_efficiency), bytes_moved / self.memory_bandwidth_bytes_per_s)

    def collective_time_s(self, kind: str, nbytes: float, group_size: int) -> float:
        """Time of one collective whose full (gathered, unsharded) buffer is `nbytes`."""
        if group_size <= 1 or nbytes <= 0:
            return 0.0
        link = self.intra_node if group_size <= self.devices_per_node else self.inter_node
        factor = (group_size - 1) / group_size
        if kind == "all_reduce":
            factor *= 2
        return link.latency_s[kind] + nbytes * factor / link.bus_bandwidth_bytes_per_s[kind]

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "HardwareProfile":
        data = json.loads(text)
        data["intra_node"] = LinkProfile(**data["intra_node"])
        data["inter_node"] = LinkProfile(**data["inter_node"])
        return cls(**data)


def _uniform_link(latency_s: float, bandwidth: float) -> LinkProfile:
    return LinkProfile(latency_s={kind: latency_s for kind in COLLECTIVES},
                       bus_bandwidth_bytes_per_s={kind: bandwidth for kind in COLLECTIVES})


BUILTIN = {
    # H100 SXM5 datasheet: 80 GB HBM3, 3.35 TB/s, dense BF16 989 TFLOP/s, TF32 495 TFLOP/s;
    # NVLink 4 at 450 GB/s per direction; 8 GPUs per node; 400 Gb/s (50 GB/s) InfiniBand per GPU.
    "h100-80g": HardwareProfile(
        name="h100-80g", device_memory_bytes=80 * 10**9,
        peak_flops={"float32": 495e12, "bfloat16": 989e12, "float16": 989e12},
        memory_bandwidth_bytes_per_s=3.35e12, devices_per_node=8,
        intra_node=_uniform_link(20e-6, 360e9), inter_node=_uniform_link(40e-6, 45e9),
        source="NVIDIA H100 SXM5 datasheet; link bandwidth at ~80% of line rate"),
    # A CPU process talking gloo over loopback; calibrate on the machine for real figures.
    "cpu-gloo": HardwareProfile(
        name="cpu-gloo", device_memory_bytes=16 * 2**30,
        peak_flops={"float32": 100e9, "bfloat16": 50e9},
        memory_bandwidth_bytes_per_s=10e9, devices_per_node=64,
        intra_node=_uniform_link(100e-6, 2e9), inter_node=_uniform_link(100e-6, 2e9),
        source="order-of-magnitude figures for one CPU process on gloo loopback"),
}


def get_hardware(spec: "str | os.PathLike | HardwareProfile") -> HardwareProfile:
    """A built-in profile by name, a calibrated profile from a JSON path, or a profile as given."""
    if isinstance(spec, HardwareProfile):
        return spec
    if isinstance(spec, str) and spec in BUILTIN:
        return BUILTIN[spec]
    if os.path.exists(spec):
        with open(spec) as handle:
            return HardwareProfile.from_json(handle.read())
    raise HardwareError(f"unknown hardware {spec!r}: use one of {', '.join(sorted(BUILTIN))} "
                        "or the path of a profile written by `shardplan calibrate`")
