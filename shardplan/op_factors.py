"""Per-op time factors: how far each ATen op runs from its roofline on this machine, in a training step.

Measured by `shardplan calibrate` (calibrate.py runs `time_op_calls_s` on every rank after its
probes) and fitted into HardwareProfile.op_time_factors by `fit_op_factors`.
"""
import dataclasses
import functools
import math
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import zoo
from .errors import HardwareError
from .hardware import HardwareProfile, SizeCurve
from .passes.blocks import block_name
from .passes.execution import is_kernel, moved_bytes, op_flops
from .runtime.measure import synchronize
from .runtime.sharded import _all_zeros as all_zeros

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
        return [zoo.gpt(gpt, batch=2, device=device),
                zoo.gpt(dataclasses.replace(gpt, seq_len=128), batch=1, device=device),  # a micro-batch's small calls
                zoo.residual_mlp(width=1024, depth=2, batch=512, device=device),
                zoo.residual_cnn(batch=16, size=32, device=device),
                zoo.encoder_decoder(batch=8, seq=128, device=device),
                *(pointwise_ops(rows, device) for rows in (128, 512))]


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
        return sum(op(y).sum() for op in (torch.tanh, torch.sigmoid, torch.nn.functional.silu,
                                           functools.partial(torch.softmax, dim=-1)))


def pointwise_ops(rows: int, device: torch.device, width: int = 1024) -> zoo.ZooModel:
    """PointwiseOps on `rows` x `width` floats: calls of 0.5-2 MB, as a layer's activations."""
    with torch.device(device):
        return zoo.ZooModel(PointwiseOps(width), (torch.randn(rows, width),), {})


# [Note: the step's own kernels]
# Past backward, a training step runs kernels over every parameter the rank holds: the runtime's
# check of the gradients kept between steps (runtime/sharded.py, _all_zeros: `any` over each
# unit's gradient) and the optimizer's step and zero_grad, each one kernel per flat shard (the
# runtime gives the optimizer one shard per unit). These stream megabytes a call with little
# arithmetic, and run far from the copy bandwidth, each by its own factor: on 2 ranks of this CPU
# AdamW over Mixtral's units (1.8M parameters a shard) took 1.4-2x the copy bandwidth's time
# (`sqrt` and `div` write fresh tensors of a shard each, whose pages the allocator hands back and
# takes again), and `any` 6x. So the calibration runs them too, on one flat shard per block of each
# op workload (a layer's parameters, an embedding's: 0.1-1.8M), after the workload's backward as
# in training, and they are fitted into op factors by name like the model's ops; the cost model
# prices OPTIMIZER_STEPS' kernels and the check by those names (cost.optimizer_s).

def step_shards(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Flat float32 parameters, one per block of `model` (a layer of a layer container, else a
    top-level module: passes.blocks.block_name), with zero gradients: what the runtime gives the
    optimizer for a plan of one unit per block."""
    sizes: dict[str, int] = {}
    for name, parameter in model.named_parameters():
        block = block_name(name.rpartition(".")[0], 1)
        sizes[block] = sizes.get(block, 0) + parameter.numel()
    shards = [torch.nn.Parameter(torch.zeros(numel, device=parameter.device)) for numel in sizes.values()]
    for shard in shards:
        shard.grad = torch.zeros_like(shard)
    return shards


def training_step_kernels(model: torch.nn.Module):
    """A callable running the step's own kernels ([Note: the step's own kernels]) over `model`'s
    step_shards: the runtime's gradient check, AdamW's step (torch's default for the device) and
    zero_grad. The gradients stay zero, as zero_grad leaves them for the next step's check; the
    elementwise kernels take as long on zeros."""
    shards = step_shards(model)
    optimizer = torch.optim.AdamW(shards, lr=1e-3)

    def step() -> None:
        all_zeros([shard.grad for shard in shards])
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
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
        self.calls.append((func.overloadpacket.__name__, op_flops(func, args, kwargs, out),
                           moved_bytes(func, args, kwargs, out), seconds))
        return out


def time_op_calls_s(workloads: list, device: torch.device, rounds: int, report=lambda text: None,
                    steps: list | None = None) -> tuple[tuple[str, int, int, float], ...]:
    """Every kernel of one training step of each workload: (op name, FLOPs, bytes, seconds), the
    seconds the fastest of `rounds` rounds (a step runs the same kernels in the same order);
    `report` after each round. `steps`: a callable per workload run after its backward (its
    training_step_kernels), whose kernels are timed as well."""
    if rounds < 1:
        raise HardwareError(f"timing op kinds needs at least 1 round, got {rounds}")
    fastest: list[tuple[str, int, int, float]] = []
    for round_index in range(rounds + 1):  # the first round warms caches and allocators, and is not kept
        clock = _KernelClock(device)
        with clock:
            for index, entry in enumerate(workloads):
                entry.model(*entry.args, **entry.kwargs).backward()
                entry.model.zero_grad(set_to_none=True)
                if steps:
                    steps[index]()
        if round_index and [c[:3] for c in clock.calls] != [c[:3] for c in fastest]:
            raise HardwareError(f"round {round_index} of the op workloads ran {len(clock.calls)} kernels, not the "
                                f"{len(fastest)} of the round before, or other ones: a workload is not deterministic")
        fastest = clock.calls if round_index <= 1 else [min(best, call, key=lambda c: c[3])
                                                        for best, call in zip(fastest, clock.calls)]
        if round_index:
            report(f"op kinds, round {round_index} of {rounds}")
    return tuple(fastest)


# Fitting: a pure function of the timings.

def fit_op_factors(profile: HardwareProfile, op_calls, kernel_overhead_s: float) -> dict[str, SizeCurve]:
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
            band = bands.setdefault(name, {}).setdefault(math.floor(math.log2(roofline_s)), [0.0, 0.0, 0, 0])
            band[0] += max(seconds - kernel_overhead_s, 0.0)
            band[1] += roofline_s
            band[2] += 1
            band[3] += flops
    return {name: SizeCurve(points=_factor_points(by_band)) for name, by_band in sorted(bands.items())}


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
_SMALLEST_FACTOR = 1e-3
"""A floor: a factor of 0 (an op timed under a bare call's fixed cost) would be rejected by profiles."""
