"""Hardware profiles: what one device computes and moves per second, and how much it holds.

The cost model reads a profile only through `HardwareModel`, so a calibrated profile
(`shardplan.calibration.calibrate`) and a built-in one (profiles/*.json) are interchangeable.

[Note: model times measured correction]
Both time formulas are a physical model times measured factors:
- an op: roofline of peak FLOP/s x efficiency(FLOPs per call) x the share of it sustained at the
  power limit against memory bandwidth,
  times the factor measured for that op by name, read off its curve by one call's roofline
  seconds (a GELU on one CPU thread is bound by its arithmetic, not by memory);
- a collective: alpha + bus bytes / bandwidth (alpha-beta, fitted by least squares; across nodes the
  bandwidth times the share a measured fabric keeps at that node count, LinkProfile.bandwidth_by_nodes),
  times correction(bus bytes) = measured / fitted at each calibrated size, plus in a step
  the link's in_step_wait_s.
A datasheet profile carries a generic efficiency curve, no op factors and no correction (1.0). A
calibrated profile carries what this machine did, e.g. a CPU whose copies slow down
once a buffer outgrows the last-level cache, which no straight line fits. Bus bytes
are the full buffer times `ring_factor(kind, group_size)`; a backend that does more
work than the ring (gloo's reduce_scatter_tensor is an all_reduce plus a slice) is
captured by its fitted numbers, not by a special case.

[Note: a GEMM's traffic shows through]
A GEMM streams its operands in tiles while the tensor cores work on the tiles before, so its memory time hides
under its arithmetic, but not all of it: each tile's prologue and epilogue (the first loads, the result's
store) run with nothing to hide behind, more of them the fewer FLOPs a byte carries. XLA's measured H100
table (375 cuBLAS GEMMs, each side 256-4096) fits time = FLOPs / (peak x efficiency(FLOPs)) + 0.325 x bytes
/ bandwidth best: median measured / fitted 0.99, p10-p90 0.91-1.11, and no trend with FLOPs per byte, which
the roofline (the slower of the two) leaves. A transformer's GEMMs carry about 0.8 x hidden FLOPs a byte in
bf16, so the share costs a 768-wide model's GEMMs ~7% on A100 and an 8192-wide one's under 1%
(MatmulRate.exposed_memory_share). What the share does not hold: at equal bytes a short inner dimension
(k = 256) runs ~10% slower still, and an op's FLOPs and bytes do not tell its k.

[Note: attention by sequence length]
A fused attention kernel (FlashAttention-2 under SDPA) runs each call at a rate its published benchmarks
give by what they vary: the sequence length (a short one gives each thread block few key blocks to spread
its start and its final rescale over, and the causal diagonal's half-masked blocks a larger share), the head
dim (the tiles' inner dimension: 128 keeps the tensor cores busier than 64) and the direction (backward
runs five matmuls to forward's two, and adds into dQ atomically). A profile lists those rates
(HardwareProfile.attention_rates), and a call is priced at the rate of its sequence length, not at the
matmul curve's rate for its FLOPs, which does not fall with a shorter sequence of as many FLOPs.

An op kind carries its FLOPs and bytes, not its shape, but their ratio gives the sequence length S.
Forward: torch counts 4 B H S^2 D FLOPs (QK^T and PV, every score) and the call moves q, k, v and the
output, 4 B H S D elements of the compute dtype (e bytes each): S = e x FLOPs / bytes. Backward: 10 B H S^2 D
FLOPs (five products) over q, k, v, the output, its gradient and the three input gradients, 8 B H S D
elements: S = 0.8 e x FLOPs / bytes. Both hold for any batch B and heads H, and over micro-batches and a
tp rank's heads, which divide FLOPs and bytes alike. The head dim D cannot be read off them (FLOPs and
bytes both scale with B H D): the analysis records it from the call's query (OpKind.head_dim_flops), and a
call of unknown head dim (a chain built by hand) is priced at the mean of the rates the profile lists for
its head dims at S. Limits of the ratio: the log-sum-exp (4 bytes a row, fp32) adds under 1% to
the bytes at head dims of 64 and more; grouped-query attention that hands the kernel k and v of fewer heads
moves fewer bytes, so reads as a longer sequence (1.6x with 4 query heads a key head, 1.8x with 8): a
faster rate by what the published ones gain over that span (they rise 3-12% from 4k to 16k); a call whose
rows are not its keys (cross-attention) reads as a sequence between the two.

Past the longest sequence a figure lists, a kernel's rate keeps rising, more slowly: each thread block of
queries pays fixed work (loading its queries, the final rescale and store, and under a causal mask the
half-masked tile on the diagonal) spread over the S / block key blocks it streams, so the rate approaches its
ceiling as S / (S + S0). A curve is continued in that form through its two longest points: FlashAttention-2
causal at head dim 128 on A100 (203 and 210 TFLOP/s forward at 8k and 16k) gives S0 = 660 and 215 at 32k,
217 at 64k, where holding the 16k rate would price a 64k call 3% slow.
"""

import dataclasses
import difflib
import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from shardplan.common.dtypes import dtype_bytes
from shardplan.common.files import is_finite_number, parse_json, read_text
from shardplan.common.sizes import LARGEST_SIZE_BYTES
from shardplan.errors import HardwareError

COLLECTIVES = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")
RING_ONLY = ("all_gather_into_tensor", "reduce_scatter_tensor")
"""Kinds NCCL runs only as a ring (its tree algorithm is all-reduce's alone): their latency across
nodes grows with every node the ring passes through (LinkProfile.ring_latency_per_node_s)."""
SCHEMA = "shardplan.costmodel.hardware/1"


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
    """A factor (or a rate, where its field says so) by problem size, known at a few sizes.

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
    sustained_share: float = 1.0
    """Share of the efficiency curve's rate the device keeps up through a training step: a curve timed in
    short runs (a microbenchmark's GEMMs at the boost clock) overstates what a GPU computing for seconds at
    its power limit sustains, whose clock falls. 1 where nothing was measured, and in a calibrated
    profile: its curve is the fastest of short rounds (a burst figure), and a calibration fits no share
    (on a CPU the two agree; on a GPU this is a known limit of `shardplan calibrate`)."""
    exposed_memory_share: float = 0.0
    """Share of a matmul's memory time (its operands and result at the memory bandwidth) that adds to its
    arithmetic time rather than hiding under it ([Note: a GEMM's traffic shows through]). 0: the roofline,
    as a calibration fits its curve."""


@dataclass(frozen=True, kw_only=True, slots=True)
class AttentionRate:
    """FLOP/s one direction of a fused attention kernel reaches, as its benchmarks publish them, by sequence
    length, for each head dim they ran ([Note: attention by sequence length]). FLOPs are counted as
    FlashAttention's benchmark counts them: 4 B H S^2 D forward, 2.5x that backward, halved under a causal
    mask (the blocks past the diagonal the kernel skips). Rates are burst figures (a short benchmark at
    the boost clock): a step keeps MatmulRate.sustained_share of them."""

    causal: dict[str, SizeCurve]
    """By head dim (its decimal digits: a JSON key), FLOP/s by sequence length of a call under a causal mask, on
    its FLOPs less those the mask hides (OpKind.masked_flops)."""
    full: dict[str, SizeCurve]
    """By head dim, FLOP/s by sequence length of a call without a mask, on all its FLOPs."""

    def flops_per_s(self, sequence: float, *, causal: bool, head_dim: float = 0) -> float:
        """The rate at `sequence` of a call of `head_dim` (between two listed head dims linear in head dim, past
        the ends the nearest), or of unknown head dim (0) the mean of every listed head dim's."""
        curves = sorted(
            (int(dim), curve) for dim, curve in (self.causal if causal else self.full).items()
        )
        rates = [_attention_rate_at(curve, sequence) for _, curve in curves]
        if not head_dim:
            return sum(rates) / len(rates)
        return float(np.interp(head_dim, [dim for dim, _ in curves], rates))


def _attention_rate_at(curve: SizeCurve, sequence: float) -> float:
    """`curve`'s rate at `sequence`; past its longest sequence, still rising as its last two points rise
    ([Note: attention by sequence length]): rate = ceiling x S / (S + S0), S0 and the ceiling through those two
    points. A curve that does not rise there holds its last rate."""
    (s1, r1), (s2, r2) = ((0.0, 0.0), *curve.points)[-2:]
    growth = r2 / r1 if r1 > 0 else 0.0
    if sequence <= s2 or not 1 < growth < s2 / s1:
        return curve.at(sequence)
    s0 = s1 * s2 * (growth - 1) / (s2 - growth * s1)
    return r2 * (s2 + s0) / s2 * sequence / (sequence + s0)


ATTENTION_ELEMENTS = {False: (4, 4), True: (8, 10)}
"""By direction (backward?), a fused attention call's tensors of B H S D elements (forward: q, k, v, the
output; backward also the output's gradient and the three it returns) and its FLOPs in units of B H S^2 D
(forward QK^T and PV; backward five products): what [Note: attention by sequence length] reads S from."""


def attention_sequence(
    flops: float, bytes_moved: float, element_bytes: int, *, backward: bool
) -> float:
    """The sequence length of an attention call that counts `flops` (every score's, masked ones too) and moves
    `bytes_moved` in elements of `element_bytes` ([Note: attention by sequence length]): a forward of one sequence
    of 4096, 32 heads of 128, in bf16 counts 4 x 32 x 4096^2 x 128 FLOPs over 4 x 32 x 4096 x 128 x 2 bytes.
    `attention_sequence(4 * 32 * 4096**2 * 128, 4 * 32 * 4096 * 128 * 2, 2, backward=False) == 4096`. Infinite
    without bytes (a hand-made call): the longest sequence's rate."""
    tensors, flops_per_score = ATTENTION_ELEMENTS[backward]
    return (
        element_bytes * tensors / flops_per_score * flops / bytes_moved
        if bytes_moved > 0
        else math.inf
    )


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
        return (self.latency_s + bus_bytes / self.bus_bandwidth_bytes_per_s) * self.correction.at(
            bus_bytes
        )


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
    """Latency an all-reduce adds each time the nodes it spans double (the inter-node steps of
    NCCL's tree): alpha = latency_s + this x log2(nodes). 0 within a node."""
    ring_latency_per_node_s: float = 0.0
    """Latency a ring-only collective (RING_ONLY) adds for each node it spans beyond the first, in
    place of latency_per_node_doubling_s: a ring's steps pass every node in turn, each hop across the
    network a message's latency. 0 within a node."""
    ring_latency_per_local_rank_s: float = 0.0
    """What each further rank of the group on a node adds to ring_latency_per_node_s: inside a node the
    ring takes a step from rank to rank before it leaves for the next node (NCCL's ring latency is
    intra-node steps x their latency + network steps x theirs, src/graph/tuning.cc), so a group with
    fewer ranks on each node (tp > 1, a pipeline's point-to-point pair) waits fewer steps. 0 within a node."""
    bandwidth_by_nodes: dict[str, SizeCurve] = field(default_factory=dict)
    """Share of a kind's bus bandwidth the fabric keeps when a group spans N nodes (each curve's size is N),
    applied across nodes only: a fabric whose links contend as more nodes talk at once moves a world
    collective slower per rank than two nodes do. A kind not listed keeps all of it. Derived from a
    measurement of the fabric by `with_fabric`, never fitted to training steps."""

    def time_s(
        self, kind: str, bus_bytes: float, *, nodes: int = 1, ranks_per_node: int = 1
    ) -> float:
        """One collective of `kind` moving `bus_bytes` over a group of `nodes` x `ranks_per_node` ranks."""
        latency_s, transfer_s = self._terms(kind, bus_bytes, nodes, ranks_per_node)
        share = (
            self.bandwidth_by_nodes[kind].at(nodes)
            if nodes > 1 and kind in self.bandwidth_by_nodes
            else 1.0
        )
        return (latency_s + transfer_s / share) * self.collectives[kind].correction.at(bus_bytes)

    def _terms(
        self, kind: str, bus_bytes: float, nodes: int, ranks_per_node: int
    ) -> tuple[float, float]:
        """(latency, transfer at the full bus bandwidth) of one collective, before its correction."""
        cost = self.collectives[kind]
        ring_per_node_s = self.ring_latency_per_node_s + self.ring_latency_per_local_rank_s * (
            ranks_per_node - 1
        )
        growth_s = (
            ring_per_node_s * (nodes - 1)
            if kind in RING_ONLY and self.ring_latency_per_node_s
            else self.latency_per_node_doubling_s * math.log2(nodes)
        )
        bandwidth = cost.bus_bandwidth_bytes_per_s * min(ranks_per_node, self.rails)
        return cost.latency_s + growth_s, bus_bytes / bandwidth

    def with_fabric(
        self, bus_bandwidth: dict[str, dict[int, float]], *, nbytes: float, ranks_per_node: int
    ) -> "LinkProfile":
        """This link with bandwidth_by_nodes derived from a measurement of the fabric: by kind and node count N,
        the bus bandwidth (bus bytes / s, nccl-tests' busbw) one collective of `nbytes` (its full buffer)
        reached over `ranks_per_node` ranks on each of N nodes. A kind's share at N is what makes this link's
        collective of that size take the measured time once its latency terms at N are taken out of it, at
        most 1 (a fabric measured faster than the link's bandwidth keeps all of it)."""
        curves = {}
        for kind, by_nodes in bus_bandwidth.items():
            points = []
            for nodes, measured in sorted(by_nodes.items()):
                bus_bytes = nbytes * ring_factor(kind, nodes * ranks_per_node)
                latency_s, transfer_s = self._terms(kind, bus_bytes, nodes, ranks_per_node)
                left_s = (
                    bus_bytes / measured / self.collectives[kind].correction.at(bus_bytes)
                    - latency_s
                )
                points.append((float(nodes), min(1.0, transfer_s / left_s) if left_s > 0 else 1.0))
            curves[kind] = SizeCurve(points=tuple(points))
        return dataclasses.replace(self, bandwidth_by_nodes={**self.bandwidth_by_nodes, **curves})


class HardwareModel(Protocol):
    """What the cost model and the solver read of a device: a HardwareProfile, or a stand-in in a test."""

    @property
    def overlaps_communication(self) -> bool:
        """Whether a collective can run while the device computes (HardwareProfile.overlaps_communication)."""

    def compute_time_s(
        self,
        flops: float,
        bytes_moved: float,
        dtype: str = "float32",
        *,
        calls: int = 1,
        op: str = "",
        masked_flops: float = 0.0,
        head_dim: float = 0.0,
    ) -> float:
        """Time of `calls` equal ops that together do `flops` (`masked_flops` of them hidden by a causal
        mask) and move `bytes_moved`."""

    @property
    def collective_compute_share(self) -> float:
        """Share of the compute rate a collective takes while it runs beside the compute
        (HardwareProfile.collective_compute_share)."""

    @property
    def selective_op_overhead_s(self) -> float:
        """What selective checkpointing adds to each op a block's forward dispatches
        (HardwareProfile.selective_op_overhead_s)."""

    @property
    def view_overhead_s(self) -> float:
        """Fixed cost of a dispatch that runs no priced kernel, a view (HardwareProfile.view_overhead_s)."""

    def collective_time_s(
        self,
        kind: str,
        nbytes: float,
        group_size: int,
        *,
        in_step: bool = True,
        ranks_per_node: int = 0,
    ) -> float:
        """Time of one collective of `kind` whose full buffer is `nbytes`, over `group_size` ranks."""


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
    collective_compute_share: float = 0.0
    """Share of the device's compute rate a collective takes while it runs beside the compute: NCCL's
    kernels hold an SM for each channel and stream through the same memory, so compute overlapped
    with a collective of c seconds loses this x c seconds (below 1). 0: not measured."""
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
    skips_masked_flops: tuple[str, ...] = ()
    """Ops, by the names op_time_factors keys, whose kernel on this device skips the blocks a causal mask
    hides (FlashAttention-2): priced on their FLOPs less OpKind.masked_flops, the count their factors are
    against. An op not listed runs every FLOP the analysis counts (CPU's flash attention computes the
    whole of each 512-key block, so all of a causal call of up to 512 keys: its factors are against that).
    Each name must be a key of op_time_factors or attention_rates (checked): a skip is a fact about what an op's
    factors or rates were measured against, so one without either is a misspelling, which would silently price
    every FLOP."""
    attention_rates: dict[str, AttentionRate] = field(default_factory=dict)
    """Fused attention ops by the names op_time_factors keys (forward, and backward with its `_backward` suffix),
    each priced at its published rate for a call's sequence length and head dim ([Note: attention by sequence
    length]) where the matmul curve at the call's FLOPs is no slower (a call too small to fill the device runs
    no faster than a GEMM of its FLOPs), in place of any op factor. Each must be listed in skips_masked_flops: a
    causal rate is on the FLOPs the kernel runs. Empty: attention is priced as any other op."""
    op_fixed_costs_s: dict[str, float] = field(default_factory=dict)
    """Fixed cost of one call of an ATen op by name, in place of op_overhead_s, where a calibration
    timed the op's small calls ([Note: op fixed costs] in op_factors.py): a router's sort or topk
    took 24-33 us a call here, a one-element multiply (op_overhead_s) 3-4 us. An op not listed
    costs op_overhead_s; calibrations on CPU ranks fit them, GPU ones none."""
    selective_op_overhead_s: float = 0.0
    """Fixed cost selective checkpointing (SELECTIVE and SELECTIVE_ALTERNATE alike: the same modes, the
    latter's policy counting matmuls besides) adds to each op a block's forward dispatches, views
    included (Block.fwd_dispatches): its dispatch modes, in Python, see every op in forward and
    again in recompute (calibrate.py, [Note: selective checkpointing's modes]). 0: not measured."""
    view_overhead_s: float = 0.0
    """Fixed cost of one dispatch that runs no kernel the compute prices: a view (transpose, view,
    expand) or an op that moves nothing (_unsafe_view). Each costs the host its dispatch and
    autograd's view tracking, and its backward dispatches a view again (calibrate.py, [Note: views'
    fixed cost]): 1.2-1.5 us a dispatch on 2 CPU ranks here, where T5 dispatches 311 views a forward.
    0: not measured (the built-in profiles; on a GPU, the host runs ahead of the kernels)."""

    def __post_init__(self) -> None:
        for where in ("name", "source"):  # first: every other message quotes the name
            if not isinstance(getattr(self, where), str):
                raise HardwareError(
                    f"hardware profile field {where} is {getattr(self, where)!r:.80}, must be a "
                    "string: quote it in the profile JSON"
                )
        if (
            not self.name.isprintable()
        ):  # reports print it: an escape sequence would drive the terminal
            raise HardwareError(
                f"hardware profile name {self.name!r:.80} holds control characters: name it in "
                "printable characters"
            )
        for where, value in _figures(self, ""):
            if not _is_positive(value):
                raise HardwareError(
                    f"hardware profile {self.name!r}: {where} is {value!r:.80}, must be a positive finite number: "
                    "correct it in the profile JSON or write a new profile with `shardplan calibrate`"
                )
            if where.endswith("_per_s") and value < SLOWEST_RATE:  # type: ignore[operator]
                raise HardwareError(
                    f"hardware profile {self.name!r}: {where} is {value!r:.80}, below {SLOWEST_RATE:.0e} a second, "
                    "slower than any device or link trains on (a slip of units?): correct it in the profile JSON "
                    "or write a new profile with `shardplan calibrate`"
                )
        if not isinstance(self.overlaps_communication, bool):
            raise HardwareError(
                f"hardware profile {self.name!r}: overlaps_communication is "
                f"{self.overlaps_communication!r}, must be true or false"
            )
        for dtype, rate in self.matmul.items():
            if not _is_non_negative(rate.exposed_memory_share) or rate.exposed_memory_share > 1:
                raise HardwareError(
                    f"hardware profile {self.name!r}: matmul.{dtype}.exposed_memory_share is "
                    f"{rate.exposed_memory_share!r:.80}, must be from 0 to 1: the share of a matmul's "
                    "memory time its arithmetic does not hide"
                )
        if (
            not _is_non_negative(self.collective_compute_share)
            or self.collective_compute_share >= 1
        ):
            raise HardwareError(
                f"hardware profile {self.name!r}: collective_compute_share is "
                f"{self.collective_compute_share!r}, must be 0 or more and below 1: it is the share of "
                "the compute rate a collective beside it takes"
            )
        if self.usable_memory_fraction > 1:
            raise HardwareError(
                f"hardware profile {self.name!r}: usable_memory_fraction is "
                f"{self.usable_memory_fraction}, must be at most 1: it is a share of device memory"
            )
        for dtype, rate in self.matmul.items():
            if rate.sustained_share > 1:
                raise HardwareError(
                    f"hardware profile {self.name!r}: matmul.{dtype}.sustained_share is "
                    f"{rate.sustained_share}, must be at most 1: it is the share of the measured "
                    "rate a step sustains"
                )
        for where, value in (
            ("intra_node.in_step_wait_s", self.intra_node.in_step_wait_s),
            ("inter_node.in_step_wait_s", self.inter_node.in_step_wait_s),
            ("intra_node.latency_per_node_doubling_s", self.intra_node.latency_per_node_doubling_s),
            ("inter_node.latency_per_node_doubling_s", self.inter_node.latency_per_node_doubling_s),
            ("intra_node.ring_latency_per_node_s", self.intra_node.ring_latency_per_node_s),
            ("inter_node.ring_latency_per_node_s", self.inter_node.ring_latency_per_node_s),
            (
                "intra_node.ring_latency_per_local_rank_s",
                self.intra_node.ring_latency_per_local_rank_s,
            ),
            (
                "inter_node.ring_latency_per_local_rank_s",
                self.inter_node.ring_latency_per_local_rank_s,
            ),
            ("runtime_reserved_bytes", self.runtime_reserved_bytes),
            ("selective_op_overhead_s", self.selective_op_overhead_s),
            ("view_overhead_s", self.view_overhead_s),
        ):
            if not _is_non_negative(value):
                raise HardwareError(
                    f"hardware profile {self.name!r}: {where} is {value!r:.80}, must be a finite "
                    "number, 0 or more"
                )
        for where, value in (
            ("devices_per_node", self.devices_per_node),
            ("device_memory_bytes", self.device_memory_bytes),
            ("runtime_reserved_bytes", self.runtime_reserved_bytes),
            ("intra_node.rails", self.intra_node.rails),
            ("inter_node.rails", self.inter_node.rails),
        ):
            if (
                type(value) is not int
            ):  # counts: the solver takes ranges of them, a plan's budget is whole bytes
                raise HardwareError(
                    f"hardware profile {self.name!r}: {where} is {value!r}, must be a whole number: "
                    "write it without a decimal point or exponent"
                )
        if self.device_memory_bytes > LARGEST_SIZE_BYTES:
            raise HardwareError(
                f"hardware profile {self.name!r}: device_memory_bytes {self.device_memory_bytes} is "
                f"more than 1 PiB ({LARGEST_SIZE_BYTES} bytes), the most a memory size may be: give "
                "the device's memory in bytes (80 GiB is 85899345920)"
            )
        if self.runtime_reserved_bytes >= self.device_memory_bytes:
            raise HardwareError(
                f"hardware profile {self.name!r}: runtime_reserved_bytes {self.runtime_reserved_bytes} "
                f"leaves nothing of device_memory_bytes {self.device_memory_bytes}: lower it"
            )
        if not self.matmul:
            raise HardwareError(
                f"hardware profile {self.name!r}: matmul lists no dtype: "
                'add at least "float32" or run `shardplan calibrate`'
            )
        unfactored = [
            op
            for op in self.skips_masked_flops
            if op not in self.op_time_factors and op not in self.attention_rates
        ]
        if unfactored:
            raise HardwareError(
                f"hardware profile {self.name!r}: skips_masked_flops names {', '.join(unfactored)}, "
                "which neither op_time_factors nor attention_rates keys: spell each as they key it (a "
                "skip says what that op's factors or rates are measured against), or remove it"
            )
        self._check_attention_rates()
        for link in ("intra_node", "inter_node"):
            missing = [kind for kind in COLLECTIVES if kind not in getattr(self, link).collectives]
            if missing:
                raise HardwareError(
                    f"hardware profile {self.name!r}: {link}.collectives lacks {', '.join(missing)}: "
                    "every collective kind needs a cost; run `shardplan calibrate`"
                )
            for kind, curve in getattr(self, link).bandwidth_by_nodes.items():
                if kind not in COLLECTIVES:
                    raise HardwareError(
                        f"hardware profile {self.name!r}: {link}.bandwidth_by_nodes names {kind!r}: "
                        f"use one of {', '.join(COLLECTIVES)}"
                    )
                if any(share > 1 for _, share in curve.points):
                    raise HardwareError(
                        f"hardware profile {self.name!r}: {link}.bandwidth_by_nodes.{kind} has a "
                        f"share above 1 in {list(curve.points)}: it is the share of the bus "
                        "bandwidth the fabric keeps, at most 1"
                    )

    def _check_attention_rates(self) -> None:
        for op, attention in self.attention_rates.items():
            if op not in self.skips_masked_flops:
                raise HardwareError(
                    f"hardware profile {self.name!r}: attention_rates keys {op}, which "
                    "skips_masked_flops does not list: list it there (a causal rate counts the FLOPs "
                    "the kernel runs, those a mask hides left out)"
                )
            for mask in ("causal", "full"):
                dims = list(getattr(attention, mask))
                if not dims or not all(
                    dim.isascii() and dim.isdigit() and int(dim) > 0 for dim in dims
                ):
                    raise HardwareError(
                        f"hardware profile {self.name!r}: attention_rates.{op}.{mask} is keyed by "
                        f'{dims}: key each curve by a head dim in decimal digits ("128"), at '
                        "least one"
                    )

    @property
    def usable_memory_bytes(self) -> int:
        return int(
            (self.device_memory_bytes - self.runtime_reserved_bytes) * self.usable_memory_fraction
        )

    def compute_time_s(
        self,
        flops: float,
        bytes_moved: float,
        dtype: str = "float32",
        *,
        calls: int = 1,
        op: str = "",
        masked_flops: float = 0.0,
        head_dim: float = 0.0,
    ) -> float:
        """Time of `calls` equal ops that together do `flops` and move `bytes_moved`.

        Roofline: the slower of arithmetic (at the efficiency of one call's size, plus a matmul's
        MatmulRate.exposed_memory_share of its memory time) and memory traffic, times the op's
        measured factor (`op` names it, as ATen does: "gelu"; an op the profile does not key by
        that name, by the name OP_ALIASES gives it), plus the fixed cost of
        each call (the op's own where measured, else op_overhead_s). Of `flops`, the `masked_flops`
        a causal mask hides are not run where the op's kernel skips them (skips_masked_flops). A fused
        attention op the profile lists in attention_rates runs at its published rate for the call's
        sequence length, read off its FLOPs and bytes, and its `head_dim` (0: unknown), where that is
        slower than the matmul curve ([Note: attention by sequence length]); no factor applies to it.
        `dtype` is a name ("bfloat16") or a torch.dtype.
        """
        op = (
            op
            if op in self.op_time_factors or op in self.attention_rates
            else OP_ALIASES.get(op, op)
        )
        counted_flops = flops
        if op in self.skips_masked_flops:
            flops -= masked_flops
        if flops <= 0 and bytes_moved <= 0:
            return 0.0
        arithmetic_s = 0.0
        exposed_share = 0.0
        if flops > 0:
            rate = self._matmul_rate(dtype)
            if op not in self.attention_rates:
                exposed_share = rate.exposed_memory_share
            burst = rate.peak_flops_per_s * rate.efficiency.at(flops / calls)
            if op in self.attention_rates:
                sequence = attention_sequence(
                    counted_flops,
                    bytes_moved,
                    dtype_bytes(dtype),
                    backward=op.endswith("_backward"),
                )
                burst = min(
                    burst,
                    self.attention_rates[op].flops_per_s(
                        sequence, causal=masked_flops > 0, head_dim=head_dim
                    ),
                )
            arithmetic_s = flops / (burst * rate.sustained_share)
        memory_s = bytes_moved / self.memory_bandwidth_bytes_per_s
        roofline_s = max(arithmetic_s + exposed_share * memory_s, memory_s)
        factor = (
            self.op_time_factors[op].at(roofline_s / calls)
            if op in self.op_time_factors and op not in self.attention_rates
            else 1.0
        )
        return calls * self.op_fixed_costs_s.get(op, self.op_overhead_s) + factor * roofline_s

    def collective_time_s(
        self,
        kind: str,
        nbytes: float,
        group_size: int,
        *,
        in_step: bool = True,
        ranks_per_node: int = 0,
    ) -> float:
        """Time of one collective whose full (gathered, unsharded) buffer is `nbytes`: inside a
        training step, or (`in_step=False`) its own cost, all ranks arriving together.

        The group's ranks are consecutive (a data-parallel group of the mesh), so it fills whole
        nodes, unless `ranks_per_node` says how many of its ranks share a node (1: two pipeline
        stages whose ranks sit a node or more apart). A group within one node uses `intra_node`;
        one spanning nodes `inter_node`, at the bandwidth of the links its ranks on a node bring."""
        factor = ring_factor(
            kind, max(group_size, 1)
        )  # first, so an unknown kind fails at any size
        if group_size <= 1 or nbytes <= 0:
            return 0.0
        per_node = min(ranks_per_node or self.devices_per_node, group_size)
        nodes = -(-group_size // per_node)
        link = self.intra_node if nodes == 1 else self.inter_node
        return link.time_s(kind, nbytes * factor, nodes=nodes, ranks_per_node=per_node) + (
            link.in_step_wait_s if in_step else 0.0
        )

    def _matmul_rate(self, dtype: object) -> MatmulRate:
        name = str(dtype).removeprefix("torch.")
        if name not in self.matmul:
            raise HardwareError(
                f"hardware profile {self.name!r} has no matmul figures for {name}: it knows "
                f"{', '.join(sorted(self.matmul))}; compute in one of those, or calibrate "
                "on a device that supports it"
            )
        return self.matmul[name]

    def to_json(self) -> str:
        data = {"schema": SCHEMA, **dataclasses.asdict(self)}
        if (
            not self.skips_masked_flops
        ):  # so a profile without skips (a calibration's) loads on code before them
            del data["skips_masked_flops"]
        if not self.attention_rates:  # likewise without attention rates
            del data["attention_rates"]
        return json.dumps(data, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "HardwareProfile":
        data = parse_json(text, "hardware profile", HardwareError)
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            schema = data.get("schema") if isinstance(data, dict) else None
            raise HardwareError(
                f"hardware profile schema {schema!r:.80} is not supported by this shardplan (reads "
                f"{SCHEMA!r}): install the version that wrote it, or write it again with this one "
                "(`shardplan calibrate -o profile.json`)"
            )
        fields = _fields(
            cls, {key: value for key, value in data.items() if key not in _NOT_FIELDS}, ""
        )
        fields["matmul"] = {
            dtype: _parse_matmul(rate, f"matmul.{dtype}")
            for dtype, rate in _object(fields["matmul"], "matmul").items()
        }
        if "skips_masked_flops" in fields:
            fields["skips_masked_flops"] = _parse_names(
                fields["skips_masked_flops"], "skips_masked_flops"
            )
        if "op_time_factors" in fields:
            fields["op_time_factors"] = {
                op: _parse_curve(curve, f"op_time_factors.{op}")
                for op, curve in _object(fields["op_time_factors"], "op_time_factors").items()
            }
        if "attention_rates" in fields:
            fields["attention_rates"] = {
                op: _parse_attention(rate, f"attention_rates.{op}")
                for op, rate in _object(fields["attention_rates"], "attention_rates").items()
            }
        for link in ("intra_node", "inter_node"):
            fields[link] = _parse_link(fields[link], link)
        return cls(**fields)


OP_ALIASES = {
    "_scaled_dot_product_flash_attention_for_cpu": "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu_backward": "_scaled_dot_product_flash_attention_backward",
}
"""Ops named by the device the analysis ran them on, and the name the same computation has on another
device's kernel: a profile that does not key an op by its own name prices it by this one. The analysis
runs a model on fake CPU tensors, so its attention is CPU's flash kernel; on a GPU the same call runs a
flash kernel, whose published rates (FlashAttention-2's) the GPU profiles key.

A limit, not priced: that holds for a call without a mask or dropout, causal or not, whose causal rows equal
its keys. CPU's flash op also takes calls a GPU's flash kernel refuses: one with an `attn_mask` (T5's position
bias, ALiBi, a sliding window, a padding mask) or causal with rows != keys (PyTorch's can_use_flash_attention,
check_for_attn_mask and check_flash_causal_non_square_seqlens, aten/src/ATen/native/transformers/cuda/
sdp_utils.cpp). On a GPU those run efficient attention (or math), yet are priced here at FlashAttention-2's
rates, a masked call on every FLOP. (A call with dropout never reaches the op: CPU runs it as math, bmm and
softmax, priced as those, where a GPU would run it in flash.)"""

_NOT_FIELDS = ("schema", "sources")
"""Keys of a profile's JSON that are not fields: its format, and where each figure comes from (for readers)."""


# Parsing: explicit per class, so every error names the path of the bad field.


def _object(data: object, where: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise HardwareError(
            f"hardware profile field {where or 'top level'} must be a JSON object, "
            f"got {type(data).__name__}: correct it, or write the profile again with "
            "`shardplan calibrate`"
        )
    return data


def _fields(cls: type, data: object, where: str) -> dict[str, Any]:
    """The keys of `data` as keyword arguments of dataclass `cls`: none missing, none unknown."""
    data = _object(data, where)
    prefix = f"{where}." if where else ""
    names = [f.name for f in dataclasses.fields(cls)]
    required = [
        f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    missing = [f"{prefix}{name}" for name in required if name not in data]
    if missing:
        raise HardwareError(
            f"hardware profile lacks field {', '.join(missing)}: add it to the JSON, "
            "or write a complete profile with `shardplan calibrate`"
        )
    unknown = sorted(f"{prefix}{key}" for key in data if key not in names)
    if unknown:
        raise HardwareError(
            f"hardware profile has unknown field {', '.join(unknown)}: remove it or correct its "
            "spelling (the file was edited or written by another version)"
        )
    return dict(data)


def _parse_curve(data: object, where: str) -> SizeCurve:
    points = _fields(SizeCurve, data, where)["points"]
    if (
        not isinstance(points, list)
        or not points
        or not all(isinstance(point, list) and len(point) == 2 for point in points)
    ):
        raise HardwareError(
            f"hardware profile field {where}.points must be a non-empty list of "
            f"[size, factor] pairs, got {points!r}"
        )
    return SizeCurve(points=tuple((point[0], point[1]) for point in points))


def _parse_names(data: object, where: str) -> tuple[str, ...]:
    if not isinstance(data, list) or not all(isinstance(name, str) for name in data):
        raise HardwareError(
            f"hardware profile field {where} is {data!r}: make it a list of op names as "
            "ATen spells them, or leave it out"
        )
    return tuple(data)


def _parse_matmul(data: object, where: str) -> MatmulRate:
    fields = _fields(MatmulRate, data, where)
    fields["efficiency"] = _parse_curve(fields["efficiency"], f"{where}.efficiency")
    return MatmulRate(**fields)


def _parse_attention(data: object, where: str) -> AttentionRate:
    fields = _fields(AttentionRate, data, where)
    return AttentionRate(
        **{
            mask: {
                dim: _parse_curve(curve, f"{where}.{mask}.{dim}")
                for dim, curve in _object(fields[mask], f"{where}.{mask}").items()
            }
            for mask in ("causal", "full")
        }
    )


def _parse_link(data: object, where: str) -> LinkProfile:
    link = _fields(LinkProfile, data, where)
    costs = {}
    for kind, cost in _object(link["collectives"], f"{where}.collectives").items():
        fields = _fields(CollectiveCost, cost, f"{where}.collectives.{kind}")
        if "correction" in fields:
            fields["correction"] = _parse_curve(
                fields["correction"], f"{where}.collectives.{kind}.correction"
            )
        costs[kind] = CollectiveCost(**fields)
    link["collectives"] = costs
    if "bandwidth_by_nodes" in link:
        link["bandwidth_by_nodes"] = {
            kind: _parse_curve(curve, f"{where}.bandwidth_by_nodes.{kind}")
            for kind, curve in _object(
                link["bandwidth_by_nodes"], f"{where}.bandwidth_by_nodes"
            ).items()
        }
    return LinkProfile(**link)


def _is_non_negative(value: object) -> bool:
    return is_finite_number(value) and value >= 0


SLOWEST_RATE = 1e6
"""The least bytes or FLOPs a second a profile's rate may hold: a kilobyte-a-second link or a megaFLOP device
is a profile written in the wrong unit, whose plans would price steps of years."""


def _is_positive(value: object) -> bool:
    return _is_non_negative(value) and value != 0


def _figures(value: object, where: str) -> Iterator[tuple[str, object]]:
    """(path, value) for every figure of a profile, which must be a positive number.

    Also checks the shape of curves, whose sizes must strictly increase.
    """
    if isinstance(value, SizeCurve):
        sizes = [point[0] for point in value.points]
        if (
            not sizes
            or not all(map(_is_positive, sizes))
            or any(b <= a for a, b in zip(sizes, sizes[1:]))
        ):
            raise HardwareError(
                f"hardware profile field {where}.points has sizes {sizes}: they must be "
                "positive and strictly increasing, at least one point"
            )
        for i, (_, factor) in enumerate(value.points):
            yield f"{where}.points[{i}][1]", factor
    elif dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            if f.name not in _NOT_FIGURES:
                yield from _figures(
                    getattr(value, f.name), f"{where}.{f.name}" if where else f.name
                )
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _figures(item, f"{where}.{key}")
    else:
        yield where, value


_NOT_FIGURES = (
    "name",
    "source",
    "skips_masked_flops",
    "overlaps_communication",
    "exposed_memory_share",
    "collective_compute_share",
    "in_step_wait_s",
    "latency_per_node_doubling_s",
    "ring_latency_per_node_s",
    "ring_latency_per_local_rank_s",
    "runtime_reserved_bytes",
    "selective_op_overhead_s",
    "view_overhead_s",
)
"""Fields that are not positive figures (a wait, a latency step, a reserve, a cost not measured may be 0:
checked on their own)."""


PROFILES_DIR = os.path.join(os.path.dirname(__file__), "profiles")
"""The built-in profiles, one JSON file each, every figure with its source under "sources"."""
BUILTIN = {
    name.removesuffix(".json"): HardwareProfile.from_json(
        read_text(os.path.join(PROFILES_DIR, name), "hardware profile", HardwareError)
    )
    for name in sorted(os.listdir(PROFILES_DIR))
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
    close = sorted(
        known for known in BUILTIN if known.startswith(name.lower())
    ) or difflib.get_close_matches(name, BUILTIN, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise HardwareError(
        f"unknown hardware {name!r}: {hint}use one of {', '.join(sorted(BUILTIN))} "
        "or the path of a profile written by `shardplan calibrate`"
    )
