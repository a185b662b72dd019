"""Per-op time factors: how far each ATen op runs from its roofline on this machine, in a training step.

Measured by `shardplan calibrate` (calibrate.py runs `time_op_calls_s` on every rank after its
probes) and fitted into HardwareProfile.op_time_factors by `fit_op_factors`.
"""

import dataclasses
import functools
import math
import time
from typing import cast

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shardplan.costmodel.hardware import HardwareProfile, SizeCurve
from shardplan.errors import HardwareError
from shardplan.frontend.passes.blocks import block_name
from shardplan.frontend.passes.execution import is_kernel, moved_bytes, op_flops
from shardplan.models import zoo
from shardplan.runtime.measure import synchronize
from shardplan.runtime.sharded import all_zeros

# [Note: op time factors]
# The roofline prices an op by its FLOPs and bytes alone. On a CPU thread many ops run well below
# it, each by its own factor: a GELU (erf) and a layer norm (two reductions) are bound by their
# arithmetic, not by memory, and ran here at a quarter and half of the copy bandwidth; flash
# attention reaches about half the matmul rate; a matmul in a step meets its operands cold in
# cache. So the calibration runs one training step (forward and backward) of each op workload,
# times every kernel below autograd (a dispatch mode), each call's fastest round kept, and the
# fit divides each op's time, a bare call's fixed cost taken out, by its roofline
# (fit_op_factors). The analysis counts each block's ops by the same names (chain.OpKind), so the
# cost model prices them with the factor; an op no workload runs keeps factor 1. The factor
# depends on a call's size (small calls run further from the roofline: a GELU of 50 us by
# roofline at 3.1x its memory time, one of 190 us at 2.3x), so it is a curve by the call's
# roofline time, and the
# workloads run at a few sizes (activations of 0.1-4 MB). They are float32: factors apply to
# every dtype alike, a limit.


def op_workloads(device: torch.device) -> list[zoo.ZooModel]:
    """Models whose training step the op factors are measured on: the zoo's native ones, at shapes
    other than the demo's (so the benchmarks that check the factors do not check them on their
    own workload)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        gpt = zoo.GPTConfig(vocab_size=2048, seq_len=256, n_layer=2, n_head=6, d_model=384)
        return [
            zoo.gpt(gpt, batch=2, device=device),
            zoo.gpt(
                dataclasses.replace(gpt, seq_len=128), batch=1, device=device
            ),  # a micro-batch's small calls
            zoo.residual_mlp(width=1024, depth=2, batch=512, device=device),
            zoo.residual_cnn(batch=16, size=32, device=device),
            zoo.encoder_decoder(batch=8, seq=128, device=device),
            *(pointwise_ops(rows, device) for rows in (128, 512)),
            routing_ops(device),
            biased_attention(device),
        ]


class PointwiseOps(torch.nn.Module):
    """The transcendental ops of transformer layers the zoo's models do not run, forward and backward,
    each on the same input: tanh (GPT-2's and BLOOM's GELU, written out), sigmoid, SiLU (a gated MLP's)
    and a softmax (a router's). The roofline prices an op by its bytes, but these are bound by their
    arithmetic on a CPU core: a tanh of 512 x 1024 floats took 1.05 ms here where the copy bandwidth
    moves its 4 MB in 80 us, so GPT-2's four layers' tanh, priced without a factor, ran 4 ms longer
    than predicted, 8 ms under selective checkpointing, which runs it again. No other op runs at
    the input's size but an add of a bias, the sums and backward's adds of the input's gradients (as
    `add`, of which the models' steps hold many more): the tensors here stay in cache, where the
    models' come cold from the op before, and a `mul` (exp's backward, a scale) measured here read
    at half the factor of the models' own."""

    def __init__(self, width: int):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x + self.bias
        return functools.reduce(
            torch.add,
            (
                op(y).sum()
                for op in (
                    torch.tanh,
                    torch.sigmoid,
                    torch.nn.functional.silu,
                    functools.partial(torch.softmax, dim=-1),
                )
            ),
        )


def pointwise_ops(rows: int, device: torch.device, width: int = 1024) -> zoo.ZooModel:
    """PointwiseOps on `rows` x `width` floats: calls of 0.5-2 MB, as a layer's activations."""
    with torch.device(device):
        return zoo.ZooModel(PointwiseOps(width), (torch.randn(rows, width),), {})


class RoutingOps(torch.nn.Module):
    """A mixture of experts' routing, forward and backward, as transformers' MoE layers run it: a
    softmax over the experts, topk, the tokens sorted and counted by expert (sort, histc, cumsum),
    gathered (index) and scattered back weighted (index_put), a one-hot mask (scatter). Its calls
    are small, so what they measure is each op's fixed cost ([Note: op fixed costs]), which for
    these runs 5-10 times a one-element multiply's."""

    def __init__(self, width: int, experts: int):
        super().__init__()
        self.router = torch.nn.Linear(width, experts, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts = self.router.out_features
        probs = torch.softmax(self.router(x), dim=-1)
        weights, chosen = probs.topk(2, dim=-1)
        order = chosen.flatten().argsort()
        offsets = torch.histc(chosen.float(), bins=experts, min=0, max=experts - 1).cumsum(0)
        rows = torch.arange(chosen.numel(), device=x.device)[order] // chosen.shape[-1]
        routed = x[rows] * weights.flatten()[order, None]
        combined = torch.zeros_like(x).index_put((rows,), routed, accumulate=True)
        mask = torch.zeros_like(probs).scatter(-1, chosen, 1.0)
        return combined.sum() + (mask * probs).sum() + offsets[-1] * 0


def routing_ops(
    device: torch.device, tokens: int = 128, width: int = 64, experts: int = 8
) -> zoo.ZooModel:
    """RoutingOps of `tokens` rows over `experts` experts: calls of a few kB, all fixed cost."""
    with torch.device(device):
        return zoo.ZooModel(RoutingOps(width, experts), (torch.randn(tokens, width),), {})


class BiasedAttention(torch.nn.Module):
    """Attention with a learned additive bias on its scores (T5's relative position bias), forward and
    backward. A mask that needs a gradient takes scaled_dot_product_attention's math path: scores by
    bmm, a `_safe_softmax` (a softmax that zeroes fully masked rows: isneginf, all, where, one call),
    bmm again. No other workload runs those two. In T5's 2-rank step `_safe_softmax` took 390 us a
    call where its bytes price 42 (it is bound by its exp, as a softmax is), and bmm 12% over the
    matmul rate of its size: 8 ms a step under full checkpointing, unpriced. The bias has the
    scores' whole shape, so its add is an add of equal shapes, as the models' others are."""

    def __init__(self, width: int, heads: int, batch: int, seq: int):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(width, 3 * width, bias=False)
        self.bias = torch.nn.Parameter(torch.zeros(batch, heads, seq, seq))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = (
            self.qkv(x).view(batch, seq, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        )
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=self.bias).sum()


def biased_attention(
    device: torch.device, batch: int = 2, seq: int = 256, width: int = 256, heads: int = 4
) -> zoo.ZooModel:
    """BiasedAttention of `batch` x `seq` tokens, heads of 64: scores of 2 MB, as a small model's
    attention. With heads of 32 the 2-rank calibrations read bmm at 1.27-1.34x the matmul rate, with
    heads of 64 at 1.07-1.17x; T5's, of 64, ran at 1.12-1.14x in its step."""
    with torch.device(device):
        return zoo.ZooModel(
            BiasedAttention(width, heads, batch, seq), (torch.randn(batch, seq, width),), {}
        )


# [Note: the step's own kernels]
# Past backward, a training step runs kernels over every parameter the rank holds: the runtime's
# check of the gradients kept between steps (runtime/sharded.py, all_zeros: `any` over each
# unit's gradient) and the optimizer's step and zero_grad, each one kernel per flat shard (the
# runtime gives the optimizer one shard per unit). These stream megabytes a call with little
# arithmetic, and run far from the copy bandwidth, each by its own factor: on 2 ranks of this CPU
# AdamW over Mixtral's units (1.8M parameters a shard) took 1.4-2x the copy bandwidth's time
# (`sqrt` and `div` write fresh tensors of a shard each, whose pages the allocator hands back and
# takes again), and `any` 6x. So the calibration runs them too, on one flat shard per block of each
# op workload (a layer's parameters, an embedding's: 0.1-1.8M), after the workload's backward as
# in training, and they are fitted into op factors by name like the model's ops; the cost model
# prices OPTIMIZER_STEPS' kernels and the check by those names (cost.optimizer_s).
# The runtime's kernels around its collectives ([Note: the runtime's kernels] in cost.py) are timed
# the same way, on the same shards: the averaging `div_` and the adding into `.grad` of a reduced
# gradient before the step, SHARD_OPTIMIZER's clone of the stepped shard and `copy_` of the gathered
# parameters after it. No model workload runs a `div_` of that size; it read at half the copy
# bandwidth's time over Mixtral's 7 MB gradients, which a profile without its factor prices whole.


def step_shards(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Flat float32 parameters, one per block of `model` (a layer of a layer container, else a
    top-level module: passes.blocks.block_name), with zero gradients: what the runtime gives the
    optimizer for a plan of one unit per block."""
    sizes: dict[str, int] = {}
    for name, parameter in model.named_parameters():
        block = block_name(name.rpartition(".")[0], 1)
        sizes[block] = sizes.get(block, 0) + parameter.numel()
    shards = [
        torch.nn.Parameter(torch.zeros(numel, device=parameter.device)) for numel in sizes.values()
    ]
    for shard in shards:
        shard.grad = torch.zeros_like(shard)
    return shards


def training_step_kernels(model: torch.nn.Module):
    """A callable running the step's own kernels ([Note: the step's own kernels]) over `model`'s
    step_shards: the runtime's averaging of a gradient and its adding into `.grad`, its gradient check,
    AdamW's single-tensor step (the kernels cost.OPTIMIZER_STEPS names) and zero_grad, then the
    runtime's copies of the stepped parameters around their gather. The gradients stay zero, as
    zero_grad leaves them for the next step's check; the elementwise kernels take as long on zeros."""
    shards = step_shards(model)
    optimizer = torch.optim.AdamW(shards, lr=1e-3, foreach=False)
    reduced = [
        torch.zeros_like(shard) for shard in shards
    ]  # what a reduction returns: zeros keep `.grad` zero
    synced = [
        torch.empty_like(shard) for shard in shards
    ]  # SHARD_OPTIMIZER's full buffer, gathered into

    def step() -> None:
        with torch.no_grad():
            for shard, result in zip(shards, reduced):
                grad = cast(torch.Tensor, shard.grad)  # step_shards gives each one
                grad.div_(2)  # the averaging, in place, before the reduction
                grad.add_(result)
        all_zeros([shard.grad for shard in shards])
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        with torch.no_grad():
            for shard, full in zip(shards, synced):
                full.copy_(shard.detach().clone())

    step()  # the first step makes the optimizer's state: other kernels than every later step's
    return step


class _KernelClock(TorchDispatchMode):
    """Records every kernel's (op name, FLOPs, bytes, seconds), in order (views and metadata
    queries run no kernel). FLOPs and bytes are counted after the clock stops, by the rules the
    analysis counts a block's ops with."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device
        self.calls: list[tuple[str, int, int, float]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not is_kernel(func):
            return func(*args, **(kwargs or {}))
        synchronize(self.device)
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        synchronize(self.device)
        seconds = time.perf_counter() - start
        self.calls.append(
            (
                func.overloadpacket.__name__,
                op_flops(func, args, kwargs, out),
                moved_bytes(func, args, kwargs, out),
                seconds,
            )
        )
        return out


def time_op_calls_s(
    workloads: list,
    device: torch.device,
    rounds: int,
    report=lambda text: None,
    steps: list | None = None,
) -> tuple[tuple[str, int, int, float], ...]:
    """Every kernel of one training step of each workload: (op name, FLOPs, bytes, seconds), the
    seconds the fastest of `rounds` rounds (a step runs the same kernels in the same order);
    `report` after each round. `steps`: a callable per workload run after its backward (its
    training_step_kernels), whose kernels are timed as well."""
    if rounds < 1:
        raise HardwareError(f"timing op kinds needs at least 1 round, got {rounds}")
    fastest: list[tuple[str, int, int, float]] = []
    for round_index in range(
        rounds + 1
    ):  # the first round warms caches and allocators, and is not kept
        clock = _KernelClock(device)
        with clock:
            for index, entry in enumerate(workloads):
                entry.model(*entry.args, **entry.kwargs).backward()
                entry.model.zero_grad(set_to_none=True)
                if steps:
                    steps[index]()
        if round_index and [c[:3] for c in clock.calls] != [c[:3] for c in fastest]:
            raise HardwareError(
                f"round {round_index} of the op workloads ran {len(clock.calls)} kernels, not the "
                f"{len(fastest)} of the round before, or other ones: a workload is not deterministic"
            )
        fastest = (
            clock.calls
            if round_index <= 1
            else [min(best, call, key=lambda c: c[3]) for best, call in zip(fastest, clock.calls)]
        )
        if round_index:
            report(f"op kinds, round {round_index} of {rounds}")
    return tuple(fastest)


# Fitting: a pure function of the timings.


def fit_op_factors(
    profile: HardwareProfile, op_calls, kernel_overhead_s: float
) -> dict[str, SizeCurve]:
    """Per op name, a factor by one call's roofline seconds in `profile` (see [Note: op time factors]):
    over the calls in each factor-of-2 band of roofline time, measured seconds (less a bare call's
    fixed cost) over roofline seconds, at the band's mean roofline time. Calls the roofline prices
    under _FACTOR_MIN_OVERHEADS fixed costs are left out: their time is mostly fixed cost and timer
    noise, which would read as a factor of hundreds on their few bytes.

    An op with FLOPs (a matmul, attention) runs a larger call as tiles of a smaller one, so its
    seconds per FLOP never rise with size: a band slower per FLOP than a smaller band takes that
    band's rate. A call longer than a scheduler's time slice is slowed by other processes in every
    round on a loaded machine: here mm calls of 1.4-10 ms read 1.7-4.6x their roofline at load
    8-25 on 2 cores, 1.0-1.07x on a quiet one (docs/benchmarks.md, "The demo")."""
    bands: dict[str, dict[int, list[float]]] = {}
    for name, flops, nbytes, seconds in op_calls:
        roofline_s = profile.compute_time_s(flops, nbytes) - profile.op_overhead_s
        if roofline_s >= _FACTOR_MIN_OVERHEADS * profile.op_overhead_s:
            band = bands.setdefault(name, {}).setdefault(
                math.floor(math.log2(roofline_s)), [0.0, 0.0, 0, 0]
            )
            band[0] += max(seconds - kernel_overhead_s, 0.0)
            band[1] += roofline_s
            band[2] += 1
            band[3] += flops
    return {
        name: SizeCurve(points=_factor_points(by_band)) for name, by_band in sorted(bands.items())
    }


# [Note: op fixed costs]
# op_overhead_s is the fixed cost of a one-element multiply in a training step (dispatch, autograd's
# node, the kernel's start). Other ops cost more before they move a byte: a sort, a topk, a histc or
# a softmax over a router's few experts allocates several outputs and sets up its loops. In one
# process at load 2, a Mixtral router's calls (its softmax, sort, histc, topk, index_put, arange)
# took 19-37 us each where the model priced 3-4 (roofline under 1 us). So the fit takes each op's
# calls the roofline prices under _FIXED_COST_MAX_OVERHEADS fixed costs (their time is fixed cost):
# the op's fixed cost is op_overhead_s plus their mean time beyond a bare call's fixed cost and their
# factor x roofline. Ops with FLOPs are left out: a small matmul runs at the efficiency its size
# reads on the matmul sweep (MatmulRate.efficiency), which prices its fixed cost already. Ops that
# read at op_overhead_s or below keep it (a one-element multiply is the
# cheapest call a step has); an op no workload runs small keeps it too, a limit for ops of no workload.


def fit_op_fixed_costs(
    profile: HardwareProfile, op_calls, kernel_overhead_s: float
) -> dict[str, float]:
    """Per op name, the fixed cost of a call where it measured above `profile`'s op_overhead_s ([Note:
    op fixed costs]). `profile` carries the fitted op factors and no fixed costs of its own."""
    excess: dict[str, list[float]] = {}
    for name, flops, nbytes, seconds in op_calls:
        if flops > 0 or nbytes <= 0:
            continue  # a matmul's small calls run at its rate's efficiency at their size; no bytes: not priced
        kernel_s = profile.compute_time_s(flops, nbytes, op=name) - profile.op_overhead_s
        if kernel_s < _FIXED_COST_MAX_OVERHEADS * profile.op_overhead_s:
            excess.setdefault(name, []).append(seconds - kernel_overhead_s - kernel_s)
    means = {name: sum(values) / len(values) for name, values in sorted(excess.items())}
    return {name: profile.op_overhead_s + mean for name, mean in means.items() if mean > 0}


def _factor_points(by_band: dict[int, list[float]]) -> tuple[tuple[float, float], ...]:
    """(mean roofline seconds, factor) of each band, by size; seconds per FLOP never rising (see fit_op_factors)."""
    points, fastest_s_per_flop = [], math.inf
    for _, (measured_s, roofline_s, count, flops) in sorted(by_band.items()):
        if flops:
            fastest_s_per_flop = min(fastest_s_per_flop, measured_s / flops)
            measured_s = fastest_s_per_flop * flops
        points.append((roofline_s / count, max(measured_s / roofline_s, _SMALLEST_FACTOR)))
    return tuple(points)


_FACTOR_MIN_OVERHEADS = 10
"""Calls priced under this many fixed costs by the roofline do not enter a factor."""
_FIXED_COST_MAX_OVERHEADS = 2
"""Calls priced under this many fixed costs by the roofline are what an op's fixed cost is fitted on."""
_SMALLEST_FACTOR = 1e-3
"""A floor: a factor of 0 (an op timed under a bare call's fixed cost) would be rejected by profiles."""
