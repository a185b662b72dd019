"""The step's own kernels in the step time: the runtime's check of the kept gradients and the
optimizer's step run each kernel at its op's measured factor, and the calibration times exactly the
kernels the cost model prices ([Note: the step's own kernels] in op_factors.py)."""

import dataclasses

import pytest
import torch
from test_cost import block
from torch.utils._python_dispatch import TorchDispatchMode

from shardplan import get_hardware
from shardplan.calibration.op_factors import step_shards, training_step_kernels
from shardplan.costmodel.cost import (
    AVERAGING,
    GRADIENT_ADD,
    GRADIENT_CHECK,
    OPTIMIZER_STEPS,
    PARAMETERS_SYNC,
    CostContext,
    unit_cost,
)
from shardplan.costmodel.hardware import SizeCurve
from shardplan.frontend.passes.execution import is_kernel, moved_bytes
from shardplan.models import zoo
from shardplan.plan import Decision, ShardStrategy


class _WholeShardKernels(TorchDispatchMode):
    """(op, bytes by the analysis's rule) of each kernel reading a whole shard (scalar bookkeeping left out)."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.kernels = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if is_kernel(func) and any(
            isinstance(t, torch.Tensor) and t.numel() == self.numel for t in (*args, out)
        ):
            self.kernels.append(
                (func.overloadpacket.__name__, moved_bytes(func, args, kwargs, out) // self.numel)
            )
        return out


def test_the_calibration_times_the_kernels_the_step_is_priced_by():
    model = zoo.residual_mlp(width=64, depth=1, batch=4).model
    shards = step_shards(model)
    # one flat shard per block, holding every parameter of the model
    assert sum(shard.numel() for shard in shards) == sum(p.numel() for p in model.parameters())
    largest = max(shard.numel() for shard in shards)
    assert [shard.numel() for shard in shards].count(largest) == 1
    step = training_step_kernels(model)
    kernels = _WholeShardKernels(largest)
    with kernels:
        step()
    per_parameter = [
        (op, 4 * nbytes) for op, nbytes in (AVERAGING, GRADIENT_ADD, *PARAMETERS_SYNC)
    ]  # float32
    assert kernels.kernels == [
        *per_parameter[:2],
        GRADIENT_CHECK,
        *OPTIMIZER_STEPS["adamw"].ops,
        *per_parameter[2:],
    ]


def test_each_kernel_of_the_step_is_priced_at_its_ops_factor():
    measured = get_hardware("cpu-gloo")
    plain = dataclasses.replace(measured, op_time_factors={})
    slow = dataclasses.replace(
        plain,
        op_time_factors={
            "sqrt": SizeCurve(points=((1e-6, 10.0),)),
            "any": SizeCurve(points=((1e-6, 6.0),)),
        },
    )

    def optimizer_s(hardware) -> float:
        context = CostContext(hardware=hardware, dp=2)
        return unit_cost(
            (block(numel=10**6),), Decision(strategy=ShardStrategy.REPLICATE), context
        ).optimizer_s

    roofline_s = 10**6 / plain.memory_bandwidth_bytes_per_s
    sqrt_bytes, check_bytes = dict(OPTIMIZER_STEPS["adamw"].ops)["sqrt"], GRADIENT_CHECK[1]
    # the check reads the replicated unit's whole gradient once; the step streams 92 bytes a parameter
    assert optimizer_s(plain) == pytest.approx(
        10 * plain.op_overhead_s + (check_bytes + 92) * roofline_s
    )
    assert optimizer_s(slow) - optimizer_s(plain) == pytest.approx(
        (9 * sqrt_bytes + 5 * check_bytes) * roofline_s
    )
