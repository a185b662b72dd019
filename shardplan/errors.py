"""The exception hierarchy: every error shardplan raises on bad input is one of these.

Messages state the numbers and the fix, e.g. "needs 41.2 GiB per rank, budget is
40 GiB at world_size=8: allow pipeline or offload, or add ranks".
"""


class ShardplanError(Exception):
    """Base class of every error shardplan raises on purpose."""


EMPTY_BATCH = (
    "the example batch is empty (dim 0 of the first input is 0), so no plan can be made: give example "
    "inputs of 1 sample or more"
)
"""Why an empty example batch gets no plan: the analysis refuses it (it would divide by it, in a mean loss's
backward), and the solver says so of a chain whose inputs are empty."""


class CaptureError(ShardplanError):
    """The model could not be captured into a graph (torch.export and torch.fx both failed)."""


class InfeasibleError(ShardplanError):
    """No plan fits the memory budget."""


class PlanError(ShardplanError):
    """A plan file is corrupt, of an unknown schema version, inconsistent, or for another model."""


class HardwareError(ShardplanError):
    """A hardware profile is unknown, incomplete or has non-positive figures."""


class RuntimeMismatchError(ShardplanError):
    """Ranks disagree (different plans) or a batch does not match the plan's inputs."""


class CheckpointError(PlanError):
    """A checkpoint is corrupt, crafted, of another format or model, or cannot be written where asked."""
