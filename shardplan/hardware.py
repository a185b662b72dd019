"""Hardware profiles: what one device computes and moves per second, and how much it holds.

The cost model reads a profile only through `compute_time_s`, `collective_time_s`
and `usable_memory_bytes`, so a calibrated profile (`shardplan.calibrate`) and a
built-in one are interchangeable.

[Note: model times measured correction]
Both time formulas are a physical model times measured factors:
- an op: roofline of peak FLOP/s x efficiency(FLOPs per call) against memory bandwidth,
  times the factor measured for that op by name, read off its curve by one call's roofline
  seconds (a GELU on one CPU thread is bound by its arithmetic, not by memory);
- a collective: alpha + bus bytes / bandwidth (alpha-beta, fitted by least squares),
  times correction(bus bytes) = measured / fitted at each calibrated size, plus in a step
  the link's in_step_wait_s.
A datasheet profile carries a generic efficiency curve, no op factors and no correction (1.0). A
calibrated profile carries what this machine did, e.g. a CPU whose copies slow down
once a buffer outgrows the last-level cache, which no straight line fits. Bus bytes
are the full buffer times `ring_factor(kind, group_size)`; a backend that does more
work than the ring (gloo's reduce_scatter_tensor is an all_reduce plus a slice) is
captured by its fitted numbers, not by a special case.
"""
import dataclasses
import difflib
import json
import math
import os
from dataclasses import dataclass, field

import numpy as np

from .errors import HardwareError
from .files import parse_json, read_text

COLLECTIVES = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")
SCHEMA = "shardplan.hardware/1"


def ring_factor(kind: str, group_size: int) -> float:
    """Bytes each rank sends in the ring algorithm of `kind`, as a share of the full buffer.

    All-gather and reduce-scatter: (n - 1) / n; all-reduce is a reduce-scatter then an
    all-gather: 2 (n - 1) / n. `ring_factor("all_reduce", 4) == 1.5`.
    """
    if kind not in COLLECTIVES:
        raise HardwareError(f"unknown collective {kind!r}: use one of {', '.join(COLLECTIVES)}")
    share = (group_size - 1) / group_size
    return 2 * share if kind == "all_reduce" else share


@dataclass(frozen=True, kw_only=True, slots=True)
class SizeCurve:
    """A dimensionless factor by problem size, known at a few sizes.

    Linear in log(size) between points, constant beyond the ends:
    `SizeCurve(points=((1e6, 0.2), (1e8, 0.6))).at(1e7) == 0.4`.
    """

    points: tuple[tuple[float, float], ...]
    """(size, factor) pairs with strictly increasing sizes."""

    def at(self, size: float) -> float:
        sizes = np.log([point[0] for point in self.points])
        factors = [point[1] for point in self.points]
        return float(np.interp(math.log(max(size, 1e-300)), sizes, factors))


NO_CORRECTION = SizeCurve(points=((1.0, 1.0),))


@dataclass(frozen=True, kw_only=True, slots=True)
class MatmulRate:
    """How fast one device multiplies matrices in one dtype."""

    peak_flops_per_s: float
    """Dense matmul FLOP/s: the datasheet peak, or the best a calibration measured."""
    efficiency: SizeCurve
    """Share of the peak one call reaches, by its FLOP count (small matmuls cannot fill the device)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CollectiveCost:
    """Alpha-beta cost of one collective kind over one link class (see [Note: model times measured correction])."""

    latency_s: float
    """Alpha: the fixed cost of one call."""
    bus_bandwidth_bytes_per_s: float
    """1 / beta: bus bytes (full buffer x ring_factor) moved per second."""
    correction: SizeCurve = NO_CORRECTION
    """Measured time / alpha-beta time, by bus bytes."""

    def time_s(self, bus_bytes: float) -> float:
        return (self.latency_s + bus_bytes / self.bus_bandwidth_bytes_per_s) * self.correction.at(bus_bytes)


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkProfile:
    """One class of link (within a node, across nodes): a cost for every kind in COLLECTIVES."""

    collectives: dict[str, CollectiveCost]
    in_step_wait_s: float = 0.0
    """Mean time a collective inside a training step takes beyond its own cost, which is timed
    with the ranks arriving together: in a step they arrive apart and communication threads wake
    late (see [Note: collectives in a step] in calibrate.py). 0 where not measured (datasheets)."""
    rails: int = 1
    """Ranks of one node whose own network links carry a collective across nodes side by side (a
    rail-optimized GPU cluster gives every GPU its NICs): a group with k ranks on each node moves
    its bus bytes at min(k, rails) x the collectives' bandwidth, which is then one rank's. 1 where
    a node's ranks share one link."""
    latency_per_node_doubling_s: float = 0.0
    """Latency a collective adds each time the nodes it spans double (the inter-node steps of
    NCCL's tree and ring phases): alpha = latency_s + this x log2(nodes). 0 within a node."""

    def time_s(self, kind: str, bus_bytes: float, *, nodes: int = 1, ranks_per_node: int = 1) -> float:
        """One collective of `kind` moving `bus_bytes` over a group of `nodes` x `ranks_per_node` ranks."""
        cost = self.collectives[kind]
        latency_s = cost.latency_s + self.latency_per_node_doubling_s * math.log2(nodes)
        bandwidth = cost.bus_bandwidth_bytes_per_s * min(ranks_per_node, self.rails)
        return (latency_s + bus_bytes / bandwidth) * cost.correction.at(bus_bytes)


@dataclass(frozen=True, kw_only=True, slots=True)
class HardwareProfile:
    """One device and its links. Every figure is positive and finite, checked on construction."""

    name: str
    device_memory_bytes: int
    usable_memory_fraction: float = 0.9
    """Share of the memory left past runtime_reserved_bytes that a plan may use by default: the
    caching allocator's fragmentation (and, where runtime_reserved_bytes is 0, the runtime's own)."""
    runtime_reserved_bytes: int = 0
    """Device memory the runtime takes before any tensor of the plan: on a GPU the CUDA context,
    NCCL's communicator buffers, cuBLAS workspaces. 0 where usable_memory_fraction covers it."""
    matmul: dict[str, MatmulRate]
    """By dtype name as torch spells it: "float32", "bfloat16", "float16"."""
    memory_bandwidth_bytes_per_s: float
    """Bytes read plus bytes written per second by a large copy."""
    op_overhead_s: float
    """Fixed cost of one kernel in a training step: its dispatch, autograd's node and its engine
    (calibrate.py, training_op_probe), and on a GPU the launch; the shortest kernel on GPU."""
    devices_per_node: int
    """Groups up to this size use `intra_node` links, larger ones `inter_node`."""
    overlaps_communication: bool = True
    """Whether a collective can run while the device computes. GPUs: yes (NCCL kernels on their
    own stream). CPU ranks on gloo: no, the transfers take the cores the compute needs, so the
    cost model hides no communication under compute."""
    intra_node: LinkProfile
    inter_node: LinkProfile
    source: str
    """Where the figures come from (datasheets, or the machine and settings of a calibration)."""
    op_time_factors: dict[str, SizeCurve] = field(default_factory=dict)
    """Measured time / roofline time of ATen ops by name, by one call's roofline seconds, on this
    machine in a training step ([Note: op time factors] in op_factors.py); an op not listed is
    priced at its roofline (1). Small calls run further from it: a GELU of 50 us by roofline took
    3.1x its memory time here, one of 190 us 2.3x. Read at the call's roofline in the compute dtype,
    though fitted in float32 (a limit)."""

    def __post_init__(self) -> None:
        for where, value in _figures(self, ""):
            if not _is_positive(value):
                raise HardwareError(
                    f"hardware profile {self.name!r}: {where} is {value!r}, must be a positive finite number: "
                    "correct it in the profile JSON or write a new profile with `shardplan calibrate`")
        if not isinstance(self.overlaps_communication, bool):
            raise HardwareError(f"hardware profile {self.name!r}: overlaps_communication is "
                                f"{self.overlaps_communication!r}, must be true or false")
        if self.usable_memory_fraction > 1:
            raise HardwareError(f"hardware profile {self.name!r}: usable_memory_fraction is "
                                f"{self.usable_memory_fraction}, must be at most 1: it is a share of device memory")
        for where, value in (("intra_node.in_step_wait_s", self.intra_node.in_step_wait_s),
                             ("inter_node.in_step_wait_s", self.inter_node.in_step_wait_s),
                             ("intra_node.latency_per_node_doubling_s", self.intra_node.latency_per_node_doubling_s),
                             ("inter_node.latency_per_node_doubling_s", self.inter_node.latency_per_node_doubling_s),
                             ("runtime_reserved_bytes", self.runtime_reserved_bytes)):
            if not _is_non_negative(value):
                raise HardwareError(f"hardware profile {self.name!r}: {where} is {value!r}, must be a finite "
                                    "number, 0 or more")
        if self.runtime_reserved_bytes >= self.device_memory_bytes:
            raise HardwareError(f"hardware profile {self.name!r}: runtime_reserved_bytes {self.runtime_reserved_bytes} "
                                f"leaves nothing of device_memory_bytes {self.device_memory_bytes}: lower it")
        if not self.matmul:
            raise HardwareError(f"hardware profile {self.name!r}: matmul lists no dtype: "
                                "add at least \"float32\" or run `shardplan calibrate`")
        for link in ("intra_node", "inter_node"):
            missing = [kind for kind in COLLECTIVES if kind not in getattr(self, link).collectives]
            if missing:
                raise HardwareError(f"hardware profile {self.name!r}: {link}.collectives lacks {', '.join(missing)}: "
                                    "every collective kind needs a cost; run `shardplan calibrate`")

    @property
    def usable_memory_bytes(self) -> int:
        return int((self.device_memory_bytes - self.runtime_reserved_bytes) * self.usable_memory_fraction)

    def compute_time_s(self, flops: float, bytes_moved: float, dtype: str = "float32", *, calls: int = 1,
                       op: str = "") -> float:
        """Time of `calls` equal ops that together do `flops` and move `bytes_moved`.

        Roofline: the slower of arithmetic (at the efficiency of one call's size) and memory
        traffic, times the op's measured factor (`op` names it, as ATen does: "gelu"), plus the
        fixed cost of each op. `dtype` is a name ("bfloat16") or a torch.dtype.
        """
        if flops <= 0 and bytes_moved <= 0:
            return 0.0
        arithmetic_s = 0.0
        if flops > 0:
            rate = self._matmul_rate(dtype)
            arithmetic_s = flops / (rate.peak_flops_per_s * rate.efficiency.at(flops / calls))
        memory_s = bytes_moved / self.memory_bandwidth_bytes_per_s
        roofline_s = max(arithmetic_s, memory_s)
        factor = self.op_time_factors[op].at(roofline_s / calls) if op in self.op_time_factors else 1.0
        return calls * self.op_overhead_s + factor * roofline_s

    def collective_time_s(self, kind: str, nbytes: float, group_size: int, *, in_step: bool = True,
                          ranks_per_node: int = 0) -> float:
        """Time of one collective whose full (gathered, unsharded) buffer is `nbytes`: inside a
        training step, or (`in_step=False`) its own cost, all ranks arriving together.

        The group's ranks are consecutive (a data-parallel group of the mesh), so it fills whole
        nodes, unless `ranks_per_node` says how many of its ranks share a node (1: two pipeline
        stages whose ranks sit a node or more apart). A group within one node uses `intra_node`;
        one spanning nodes `inter_node`, at the bandwidth of the links its ranks on a node bring."""
        factor = ring_factor(kind, max(group_size, 1))  # first, so an unknown kind fails at any size
        if group_size <= 1 or nbytes <= 0:
            return 0.0
        per_node = min(ranks_per_node or self.devices_per_node, group_size)
        nodes = -(-group_size // per_node)
        link = self.intra_node if nodes == 1 else self.inter_node
        return (link.time_s(kind, nbytes * factor, nodes=nodes, ranks_per_node=per_node)
                + (link.in_step_wait_s if in_step else 0.0))

    def _matmul_rate(self, dtype) -> MatmulRate:
        name = str(dtype).removeprefix("torch.")
        if name not in self.matmul:
            raise HardwareError(f"hardware profile {self.name!r} has no matmul figures for {name}: it knows "
                                f"{', '.join(sorted(self.matmul))}; compute in one of those, or calibrate "
                                "on a device that supports it")
        return self.matmul[name]

    def to_json(self) -> str:
        data = {"schema": SCHEMA, **dataclasses.asdict(self)}
        return json.dumps(data, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "HardwareProfile":
        data = parse_json(text, "hardware profile", HardwareError)
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            schema = data.get("schema") if isinstance(data, dict) else None
            raise HardwareError(f"hardware profile schema {schema!r} is not {SCHEMA!r}: "
                                "write it again with `shardplan calibrate -o profile.json`")
        fields = _fields(cls, {key: value for key, value in data.items() if key != "schema"}, "")
        fields["matmul"] = {dtype: _parse_matmul(rate, f"matmul.{dtype}")
                            for dtype, rate in _object(fields["matmul"], "matmul").items()}
        if "op_time_factors" in fields:
            fields["op_time_factors"] = {op: _parse_curve(curve, f"op_time_factors.{op}")
                                         for op, curve in _object(fields["op_time_factors"], "op_time_factors").items()}
        for link in ("intra_node", "inter_node"):
            fields[link] = _parse_link(fields[link], link)
        return cls(**fields)


# Parsing: explicit per class, so every error names the path of the bad field.

def _object(data, where: str) -> dict:
    if not isinstance(data, dict):
        raise HardwareError(f"hardware profile field {where or 'top level'} must be a JSON object, "
                            f"got {type(data).__name__}: correct it, or write the profile again with "
                            "`shardplan calibrate`")
    return data


def _fields(cls, data, where: str) -> dict:
    """The keys of `data` as keyword arguments of dataclass `cls`: none missing, none unknown."""
    data = _object(data, where)
    prefix = f"{where}." if where else ""
    names = [f.name for f in dataclasses.fields(cls)]
    required = [f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [f"{prefix}{name}" for name in required if name not in data]
    if missing:
        raise HardwareError(f"hardware profile lacks field {', '.join(missing)}: add it to the JSON, "
                            "or write a complete profile with `shardplan calibrate`")
    unknown = sorted(f"{prefix}{key}" for key in data if key not in names)
    if unknown:
        raise HardwareError(f"hardware profile has unknown field {', '.join(unknown)}: remove it or correct its "
                            "spelling (the file was edited or written by another version)")
    return dict(data)


def _parse_curve(data, where: str) -> SizeCurve:
    points = _fields(SizeCurve, data, where)["points"]
    if not isinstance(points, list) or not points or not all(
            isinstance(point, list) and len(point) == 2 for point in points):
        raise HardwareError(f"hardware profile field {where}.points must be a non-empty list of "
                            f"[size, factor] pairs, got {points!r}")
    return SizeCurve(points=tuple((point[0], point[1]) for point in points))


def _parse_matmul(data, where: str) -> MatmulRate:
    fields = _fields(MatmulRate, data, where)
    fields["efficiency"] = _parse_curve(fields["efficiency"], f"{where}.efficiency")
    return MatmulRate(**fields)


def _parse_link(data, where: str) -> LinkProfile:
    link = _fields(LinkProfile, data, where)
    costs = {}
    for kind, cost in _object(link["collectives"], f"{where}.collectives").items():
        fields = _fields(CollectiveCost, cost, f"{where}.collectives.{kind}")
        if "correction" in fields:
            fields["correction"] = _parse_curve(fields["correction"], f"{where}.collectives.{kind}.correction")
        costs[kind] = CollectiveCost(**fields)
    return LinkProfile(**dict(link, collectives=costs))


def _is_non_negative(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def _is_positive(value) -> bool:
    return _is_non_negative(value) and value > 0


def _figures(value, where: str):
    """(path, value) for every figure of a profile, which must be a positive number.

    Also checks the shape of curves, whose sizes must strictly increase.
    """
    if isinstance(value, SizeCurve):
        sizes = [point[0] for point in value.points]
        if not sizes or not all(map(_is_positive, sizes)) or any(b <= a for a, b in zip(sizes, sizes[1:])):
            raise HardwareError(f"hardware profile field {where}.points has sizes {sizes}: they must be "
                                "positive and strictly increasing, at least one point")
        for i, (_, factor) in enumerate(value.points):
            yield f"{where}.points[{i}][1]", factor
    elif dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            if f.name not in _NOT_FIGURES:
                yield from _figures(getattr(value, f.name), f"{where}.{f.name}" if where else f.name)
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _figures(item, f"{where}.{key}")
    else:
        yield where, value


_NOT_FIGURES = ("name", "source", "overlaps_communication", "in_step_wait_s", "latency_per_node_doubling_s",
                "runtime_reserved_bytes")
"""Fields that are not positive figures (a wait, a latency step, a reserve may be 0: checked on their own)."""


# Built-in profiles. float32 is what PyTorch runs by default (full FP32, not TF32:
# torch.backends.cuda.matmul.allow_tf32 is False unless set_float32_matmul_precision("high")).
#
# Large cuBLAS GEMMs reach ~70-85% of the dense peak, small ones are latency-bound
# (NVIDIA "Matrix Multiplication Background User's Guide", GEMM performance vs size);
# this curve is that shape, not a measurement: calibrate for real figures.
_GPU_MATMUL_EFFICIENCY = SizeCurve(points=((1e6, 0.01), (1e8, 0.15), (1e9, 0.45), (1e10, 0.7), (1e11, 0.8)))
# The shortest CUDA kernel plus its launch: a few microseconds (order of magnitude, not a datasheet figure).
_GPU_OP_OVERHEAD_S = 4e-6
# FlashAttention-2 reaches about 35% of H100's dense BF16 peak (Shah et al. 2024, FlashAttention-3,
# abstract and fig. 5-6) and 50-73% of A100's (Dao 2023, FlashAttention-2, abstract), against the
# ~0.78 the matmul curve gives a call of its size: 2.2x the roofline on Hopper, 1.3x on Ampere,
# forward and backward.
# What a GPU process holds before any tensor: the CUDA context (~0.5 GiB with lazy module loading,
# CUDA 12) and NCCL's buffers (NCCL_BUFFSIZE 4 MiB per channel, protocol and peer over a few
# communicators: ~1 GiB); cuBLAS workspaces are MiBs. What is left the caching allocator hands out
# with ~5% lost to fragmentation.
_GPU_RUNTIME_RESERVED_BYTES = 1536 * 2**20
_GPU_USABLE_FRACTION = 0.95
_FLASH_ATTENTION_OPS = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward")
_HOPPER_OP_TIME_FACTORS = {op: SizeCurve(points=((1.0, 2.2),)) for op in _FLASH_ATTENTION_OPS}
_AMPERE_OP_TIME_FACTORS = {op: SizeCurve(points=((1.0, 1.3),)) for op in _FLASH_ATTENTION_OPS}


def _gpu_matmul(fp32_flops_per_s: float, half_flops_per_s: float) -> dict[str, MatmulRate]:
    return {"float32": MatmulRate(peak_flops_per_s=fp32_flops_per_s, efficiency=_GPU_MATMUL_EFFICIENCY),
            "bfloat16": MatmulRate(peak_flops_per_s=half_flops_per_s, efficiency=_GPU_MATMUL_EFFICIENCY),
            "float16": MatmulRate(peak_flops_per_s=half_flops_per_s, efficiency=_GPU_MATMUL_EFFICIENCY)}


def _uniform_link(latency_s: float, bus_bandwidth_bytes_per_s: float, **link) -> LinkProfile:
    cost = CollectiveCost(latency_s=latency_s, bus_bandwidth_bytes_per_s=bus_bandwidth_bytes_per_s)
    return LinkProfile(collectives={kind: cost for kind in COLLECTIVES}, **link)


# NCCL latency of a small collective: ~10-20 us within an NVLink node, ~30-50 us across
# InfiniBand (nccl-tests small-message times, order of magnitude). Bus bandwidth: ~80% of
# the per-direction line rate, what nccl-tests' busbw reaches for large messages.
# Across nodes every GPU of a DGX / HGX node has its own NIC (rail-optimized: 8 rails), so a
# group with all 8 GPUs of each node moves 8x one GPU's network bandwidth (the figure given).
_GPU_RAILS = 8
_A100_NVLINK = _uniform_link(15e-6, 240e9)      # NVLink 3: 600 GB/s total, 300 GB/s per direction
# DGX A100: one 200 Gb/s HDR port (25 GB/s) per GPU; how its latency grows with nodes is not measured here.
_HDR_INFINIBAND = _uniform_link(40e-6, 20e9, rails=_GPU_RAILS)
_H100_NVLINK = _uniform_link(15e-6, 360e9)      # NVLink 4: 900 GB/s total, 450 GB/s per direction
# 400 Gb/s (50 GB/s) per GPU: DGX H100's NDR InfiniBand port, AWS p5's 4 x 100 Gb/s EFA. Measured on
# p5.48xlarge (nccl-tests all_reduce_perf, 2-32 nodes of 8 H100, 32 MiB-8 GiB buffers;
# github.com/crazyguitar/aws-gpu-communication-benchmark, data/nccl_all_reduce.csv), least squares
# of time = 0.24 ms x log2(nodes) + bus bytes / 358 GB/s (within -39%..+36% of every point): bus
# bandwidth 358 GB/s a node of 8 GPUs, 44.8 GB/s a GPU (90% of line rate); the latency grows by
# 0.24 ms each time the nodes double (a 32 MiB all-reduce takes 0.43 ms over 2 nodes, 1.0 ms over 32).
# The fit's own intercept is ~0; 30 us is a small message's latency across nodes (order of magnitude).
_HOPPER_NETWORK = _uniform_link(30e-6, 44.8e9, rails=_GPU_RAILS, latency_per_node_doubling_s=0.24e-3)
_MIB = 2**20
_CPU_LOOPBACK = LinkProfile(in_step_wait_s=2.3e-3, collectives={
    "all_gather_into_tensor": CollectiveCost(latency_s=110e-6, bus_bandwidth_bytes_per_s=1.8e9, correction=SizeCurve(
        points=((1.9e5, 1.0), (3.7e5, 0.72), (1.5e6, 0.74), (3e6, 1.04), (1.2e7, 1.6), (2.4e7, 3.1)))),
    "reduce_scatter_tensor": CollectiveCost(latency_s=155e-6, bus_bandwidth_bytes_per_s=1.07e9, correction=SizeCurve(
        points=((1.9e5, 0.82), (7.4e5, 0.61), (3e6, 1.2), (1.2e7, 1.8), (2.4e7, 2.3)))),
    "all_reduce": CollectiveCost(latency_s=165e-6, bus_bandwidth_bytes_per_s=2.9e9, correction=SizeCurve(
        points=((1.9e5, 0.82), (1.5e6, 0.67), (5.9e6, 1.0), (2.4e7, 1.47), (1e8, 1.55))))})
_CPU_OP_TIME_FACTORS = {op: SizeCurve(points=points) for op, points in {
    # (one call's roofline seconds, factor)
    "mm": ((8.5e-5, 1.22), (3.2e-4, 1.12), (1.5e-3, 1.04), (5.7e-3, 1.0)),
    "addmm": ((8.4e-5, 1.24), (3.5e-4, 1.1), (1.5e-3, 1.07), (5.7e-3, 1.0)),
    "_scaled_dot_product_flash_attention_for_cpu": ((3.2e-4, 2.2), (2.1e-3, 1.3)),
    "_scaled_dot_product_flash_attention_for_cpu_backward": ((8.1e-4, 1.7), (5.2e-3, 1.2)),
    "convolution": ((1.5e-4, 2.8), (7.8e-4, 1.4)), "convolution_backward": ((1.5e-4, 1.9), (1.6e-3, 1.2)),
    "gelu": ((4.7e-5, 3.05), (1.9e-4, 2.3)), "gelu_backward": ((7.1e-5, 3.1), (2.8e-4, 2.6)),
    "native_layer_norm": ((4.7e-5, 1.9),), "native_layer_norm_backward": ((7.1e-5, 2.0),),
    "native_batch_norm": ((6.3e-5, 7.7),), "native_batch_norm_backward": ((9.4e-5, 1.7),),
    "_log_softmax": ((6.3e-5, 3.2), (2.5e-4, 3.0)), "_log_softmax_backward_data": ((4.7e-5, 1.3),),
    "embedding": ((4.7e-5, 2.6),), "embedding_dense_backward": ((1.1e-4, 1.2),), "sum": ((7.6e-5, 1.9),),
    "add": ((4.9e-5, 0.73), (1.9e-4, 0.78)), "relu": ((6.3e-5, 0.77), (1.3e-4, 0.87)),
    "threshold_backward": ((9.4e-5, 0.67), (1.9e-4, 0.75)),
}.items()}

def _gpu_profile(name: str, memory_mib: int, fp32_flops_per_s: float, half_flops_per_s: float,
                 memory_bandwidth_bytes_per_s: float, intra_node: LinkProfile, inter_node: LinkProfile,
                 op_time_factors: dict[str, SizeCurve], source: str) -> HardwareProfile:
    """A datasheet GPU of an 8-GPU node: what every built-in GPU profile shares, spelled once."""
    return HardwareProfile(
        name=name, device_memory_bytes=memory_mib * _MIB, matmul=_gpu_matmul(fp32_flops_per_s, half_flops_per_s),
        memory_bandwidth_bytes_per_s=memory_bandwidth_bytes_per_s, op_overhead_s=_GPU_OP_OVERHEAD_S,
        devices_per_node=8, intra_node=intra_node, inter_node=inter_node, op_time_factors=op_time_factors,
        runtime_reserved_bytes=_GPU_RUNTIME_RESERVED_BYTES, usable_memory_fraction=_GPU_USABLE_FRACTION,
        source=source)


BUILTIN = {
    # A100 SXM4 40GB datasheet: 40 GB HBM2 at 1,555 GB/s; FP32 19.5 TFLOP/s, BF16/FP16 tensor 312 TFLOP/s
    # dense; 8 GPUs per DGX/HGX node. Memory as nvidia-smi reports it: 40,960 MiB.
    "a100-40g": _gpu_profile(
        "a100-40g", 40_960, 19.5e12, 312e12, 1.555e12, _A100_NVLINK, _HDR_INFINIBAND, _AMPERE_OP_TIME_FACTORS,
        "NVIDIA A100 datasheet (SXM4 40GB); links: NVLink 3 and HDR InfiniBand at ~80% of line rate"),
    # A100 SXM4 80GB datasheet: 80 GB HBM2e at 2,039 GB/s; compute as the 40GB part. nvidia-smi: 81,920 MiB.
    "a100-80g": _gpu_profile(
        "a100-80g", 81_920, 19.5e12, 312e12, 2.039e12, _A100_NVLINK, _HDR_INFINIBAND, _AMPERE_OP_TIME_FACTORS,
        "NVIDIA A100 datasheet (SXM4 80GB); links: NVLink 3 and HDR InfiniBand at ~80% of line rate"),
    # H100 SXM5 datasheet: 80 GB HBM3 at 3.35 TB/s; FP32 67 TFLOP/s, BF16/FP16 tensor 989 TFLOP/s dense
    # (1,979 is with sparsity). nvidia-smi: 81,559 MiB.
    "h100-80g": _gpu_profile(
        "h100-80g", 81_559, 67e12, 989e12, 3.35e12, _H100_NVLINK, _HOPPER_NETWORK, _HOPPER_OP_TIME_FACTORS,
        "NVIDIA H100 datasheet (SXM5 80GB); links: NVLink 4 at ~80% of line rate, 400 Gb/s a GPU across nodes "
        "as nccl-tests measured it on AWS p5"),
    # H200 SXM datasheet: 141 GB HBM3e at 4.8 TB/s; compute as H100 SXM (same Hopper die and clocks).
    # nvidia-smi: 143,771 MiB.
    "h200": _gpu_profile(
        "h200", 143_771, 67e12, 989e12, 4.8e12, _H100_NVLINK, _HOPPER_NETWORK, _HOPPER_OP_TIME_FACTORS,
        "NVIDIA H200 datasheet (SXM 141GB); links: NVLink 4 at ~80% of line rate, 400 Gb/s a GPU across nodes "
        "as nccl-tests measured it on AWS p5"),
    # One CPU process per rank with 1 thread, gloo over loopback TCP: rounded from
    # `shardplan calibrate --world-size 2` on this project's 2-core AMD EPYC (Zen 4, AVX-512 BF16)
    # VM, torch 2.13, 2026-11-22, the machine quiet. Collectives: their own cost (ranks arriving
    # together), slowing 2-3x past ~12 MB of bus bytes (the 32 MB last-level cache); gloo's
    # reduce_scatter_tensor is an all_reduce plus a slice, slower still; in a step each waits
    # ~2.3 ms more (calibrate.py, [Note: collectives in a step]). Kernels: 4.1 us fixed cost in
    # a training step; op factors as measured, by one call's roofline time (GELU and norms are
    # bound by arithmetic on one thread, not memory; op_factors.py, [Note: op time factors]).
    # Calibrate for real figures.
    "cpu-gloo": HardwareProfile(
        name="cpu-gloo", device_memory_bytes=8 * 2**30,  # a conservative share of host memory per rank
        overlaps_communication=False,
        matmul={"float32": MatmulRate(peak_flops_per_s=99e9, efficiency=SizeCurve(points=((5e5, 0.95), (3e7, 1.0)))),
                "bfloat16": MatmulRate(peak_flops_per_s=210e9, efficiency=SizeCurve(
                    points=((5e5, 0.16), (4e6, 0.58), (3e7, 0.93), (3e8, 1.0))))},
        memory_bandwidth_bytes_per_s=33e9, op_overhead_s=4.1e-6, devices_per_node=64,
        intra_node=_CPU_LOOPBACK, inter_node=_CPU_LOOPBACK, op_time_factors=_CPU_OP_TIME_FACTORS,
        source="rounded calibration of a 2-core CPU VM, 1 thread per rank, gloo over loopback; "
               "inter_node copies intra_node (one machine)"),
}


def get_hardware(spec: "str | os.PathLike | HardwareProfile") -> HardwareProfile:
    """A built-in profile by name, a calibrated profile from a JSON path, or a profile as given."""
    if isinstance(spec, HardwareProfile):
        return spec
    if isinstance(spec, str) and spec in BUILTIN:
        return BUILTIN[spec]
    if os.path.isfile(spec):
        return HardwareProfile.from_json(read_text(spec, "hardware profile", HardwareError))
    name = os.fspath(spec)
    # A prefix ("h100") names its profile better than spelling distance, which finds "h200".
    close = sorted(known for known in BUILTIN if known.startswith(name.lower())) or difflib.get_close_matches(
        name, BUILTIN, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise HardwareError(f"unknown hardware {name!r}: {hint}use one of {', '.join(sorted(BUILTIN))} "
                        "or the path of a profile written by `shardplan calibrate`")
