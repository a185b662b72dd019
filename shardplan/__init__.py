"""shardplan: plan sharded PyTorch training from measured costs, then run the plan.

The whole public API lives here: `capture`, `compile`, `parallelize`, `load_plan`, `Plan`.
"""

from shardplan.compile import compile, solve
from shardplan.costmodel.hardware import HardwareProfile, get_hardware
from shardplan.errors import (
    CaptureError,
    HardwareError,
    InfeasibleError,
    PlanError,
    RuntimeMismatchError,
    ShardplanError,
)
from shardplan.frontend.capture import capture
from shardplan.plan import Checkpoint, MixedPrecision, Plan, ShardStrategy, load_plan
from shardplan.runtime import Program, manual_plan, parallelize, shutdown
from shardplan.runtime.adascale import AdaScale
from shardplan.solver.space import Constraints, SearchSpace

__all__ = [
    "capture",
    "compile",
    "solve",
    "parallelize",
    "shutdown",
    "Program",
    "AdaScale",
    "manual_plan",
    "Constraints",
    "SearchSpace",
    "MixedPrecision",
    "Plan",
    "load_plan",
    "ShardStrategy",
    "Checkpoint",
    "HardwareProfile",
    "get_hardware",
    "ShardplanError",
    "CaptureError",
    "InfeasibleError",
    "PlanError",
    "HardwareError",
    "RuntimeMismatchError",
]
