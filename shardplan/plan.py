"""The plan: frozen, keyword-only dataclasses with a versioned JSON form.

A plan is data, never code: it is parsed as JSON and validated, never pickled
or evaluated. Things are named as a person knows them (module paths,
parameter names) and the plan carries the fingerprint of the captured graph,
so applying it to another model fails loudly.
"""
import dataclasses
import enum
import json
import os
import tempfile
import typing
from dataclasses import dataclass, field

from .chain import InputSpec
from .errors import PlanError

SCHEMA = "shardplan.plan/1"


class ShardStrategy(str, enum.Enum):
    """How a unit's parameters, gradients and optimizer states are spread over its dp group."""

    FULL_SHARD = "full_shard"
    """ZeRO-3: parameters, gradients, optimizer states sharded; parameters gathered for
    forward, freed after it (reshard after forward), gathered again for backward."""
    SHARD_GRAD_OP = "shard_grad_op"
    """ZeRO-2: as FULL_SHARD but parameters stay gathered from forward until backward."""
    SHARD_OPTIMIZER = "shard_optimizer"
    """ZeRO-1 (FairScale OSS): full parameters on every rank, gradients all-reduced,
    each rank steps its slice of the optimizer state, parameters gathered after the step."""
    REPLICATE = "replicate"
    """DDP: everything replicated, gradients all-reduced."""


class Checkpoint(str, enum.Enum):
    """Activation checkpointing of a unit."""

    NONE = "none"
    FULL = "full"
    """Keep only each block's inputs; recompute the block in backward."""
    SELECTIVE = "selective"
    """Keep the outputs of matmul-like ops, recompute the cheap elementwise ones."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Unit:
    """One FSDP unit: a run of consecutive blocks whose parameters share one flat buffer."""

    name: str
    """The first and last module path, e.g. "h.3" or "h.3..h.5"."""
    modules: tuple[str, ...]
    """Module paths of the blocks in this unit, in execution order."""
    params: tuple[str, ...]
    """Parameter names (model.named_parameters()) in the unit's flat buffer, in order."""
    strategy: ShardStrategy = ShardStrategy.FULL_SHARD
    checkpoint: Checkpoint = Checkpoint.NONE
    offload: bool = False
    """Keep the shard (and its optimizer state) in CPU memory between uses."""
    prefetch: bool = True
    """Start the next unit's gather while this one computes."""

    @property
    def reshard_after_forward(self) -> bool:
        return self.strategy is ShardStrategy.FULL_SHARD


@dataclass(frozen=True, kw_only=True, slots=True)
class Stage:
    """One pipeline stage: consecutive units on one pp rank."""

    index: int
    units: tuple[str, ...]
    """Names of the units in this stage."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Mesh:
    """World = dp × pp; rank r sits at stage r // dp, replica r % dp."""

    dp: int
    pp: int = 1


@dataclass(frozen=True, kw_only=True, slots=True)
class Schedule:
    """How one replica's batch flows: micro-batches and the pipeline schedule."""

    num_micro_batches: int = 1
    name: str = "none"
    """"none" when pp == 1, else "gpipe" or "1f1b"."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MixedPrecision:
    """dtypes as torch spells them ("float32", "bfloat16")."""

    param_dtype: str = "float32"
    """dtype parameters are gathered and computed in."""
    reduce_dtype: str = "float32"
    """dtype of gradient reduction."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Predicted:
    """What the cost model expects on one rank for one step (one replica batch)."""

    peak_bytes: int
    step_time_s: float
    memory_bytes: dict[str, int] = field(default_factory=dict)
    """Peak memory by category: sharded_state, gathered_params, activations, transient."""
    time_s: dict[str, float] = field(default_factory=dict)
    """Step time by component: compute, recompute, exposed_comm, bubble."""
    samples_per_s: float = 0.0
    mfu: float = 0.0


@dataclass(frozen=True, kw_only=True, slots=True)
class Alternative:
    """A runner-up plan, summarized, with why it lost."""

    description: str
    peak_bytes: int
    step_time_s: float


@dataclass(frozen=True, kw_only=True, slots=True)
class Reasoning:
    budget_bytes: int
    binding_constraint: str
    """What limits the plan, in words: "memory (96% of budget)" or "none: fastest plan fits"."""
    runner_ups: tuple[Alternative, ...] = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """Everything `parallelize` needs to train the model, plus the predictions that justify it."""

    schema: str = SCHEMA
    fingerprint: str
    """Fingerprint of the captured graph (BlockChain.fingerprint)."""
    model: str
    """The model's class name, for people."""
    world_size: int
    hardware: str
    inputs: tuple[InputSpec, ...]
    mesh: Mesh
    schedule: Schedule = Schedule()
    mixed_precision: MixedPrecision = MixedPrecision()
    optimizer: str = "adamw"
    units: tuple[Unit, ...]
    stages: tuple[Stage, ...]
    predicted: Predicted
    reasoning: Reasoning

    def to_json(self) -> str:
        """Deterministic bytes: same plan, same text."""
        return json.dumps(_to_data(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise PlanError(f"plan file is not valid JSON ({error}); it may be truncated: "
                            "write it again with plan.save() or `shardplan plan`") from None
        if not isinstance(data, dict):
            raise PlanError("plan file must hold a JSON object")
        schema = data.get("schema")
        if schema != SCHEMA:
            raise PlanError(f"plan schema {schema!r} is not supported by this shardplan (reads {SCHEMA!r}): "
                            "re-plan with this version, or install the version that wrote it")
        return _from_data(cls, data, "plan")

    def save(self, path: str | os.PathLike) -> None:
        """Write atomically: a crash mid-write leaves any previous file intact."""
        path = os.fspath(path)
        folder = os.path.dirname(os.path.abspath(path))
        descriptor, temporary = tempfile.mkstemp(dir=folder, prefix=".plan-", suffix=".tmp")
        try:
            with os.fdopen(descriptor, "w") as handle:
                handle.write(self.to_json())
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, path)
        except BaseException:
            os.unlink(temporary)
            raise


def load_plan(path: str | os.PathLike) -> Plan:
    """Read and validate a plan written by `Plan.save`.

    >>> plan = load_plan("plan.json")  # doctest: +SKIP
    """
    try:
        with open(path) as handle:
            text = handle.read()
    except OSError as error:
        raise PlanError(f"cannot read plan file {os.fspath(path)!r}: {error.strerror}") from None
    except UnicodeDecodeError:
        raise PlanError(f"plan file {os.fspath(path)!r} is not text: it is corrupt") from None
    return Plan.from_json(text)


def _to_data(value):
    if dataclasses.is_dataclass(value):
        return {f.name: _to_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (tuple, list)):
        return [_to_data(item) for item in value]
    if isinstance(value, dict):
        return {str(key): _to_data(item) for key, item in value.items()}
    return value


def _from_data(kind, data, where: str):
    """Build `kind` (a type annotation) from parsed JSON, naming the path of any bad field."""
    origin = typing.get_origin(kind)
    if dataclasses.is_dataclass(kind):
        if not isinstance(data, dict):
            raise PlanError(f"plan field {where} must be an object, got {type(data).__name__}")
        hints = typing.get_type_hints(kind)
        names = {f.name for f in dataclasses.fields(kind)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise PlanError(f"plan field {where} has unknown keys {unknown}: the file was edited or "
                            "written by another version")
        values = {}
        for f in dataclasses.fields(kind):
            if f.name in data:
                values[f.name] = _from_data(hints[f.name], data[f.name], f"{where}.{f.name}")
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise PlanError(f"plan field {where}.{f.name} is missing")
        try:
            return kind(**values)
        except (TypeError, ValueError) as error:
            raise PlanError(f"plan field {where} is inconsistent: {error}") from None
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        try:
            return kind(data)
        except ValueError:
            allowed = ", ".join(repr(member.value) for member in kind)
            raise PlanError(f"plan field {where} is {data!r}; expected one of {allowed}") from None
    if origin is tuple:
        if not isinstance(data, list):
            raise PlanError(f"plan field {where} must be a list, got {type(data).__name__}")
        item_kind = typing.get_args(kind)[0]
        return tuple(_from_data(item_kind, item, f"{where}[{i}]") for i, item in enumerate(data))
    if origin is dict:
        if not isinstance(data, dict):
            raise PlanError(f"plan field {where} must be an object, got {type(data).__name__}")
        value_kind = typing.get_args(kind)[1]
        return {key: _from_data(value_kind, item, f"{where}.{key}") for key, item in data.items()}
    if kind is float:
        if isinstance(data, bool) or not isinstance(data, (int, float)):
            raise PlanError(f"plan field {where} must be a number, got {data!r}")
        return float(data)
    if kind in (int, str, bool):
        if type(data) is not kind:
            raise PlanError(f"plan field {where} must be {kind.__name__}, got {data!r}")
        return data
    raise PlanError(f"plan field {where}: unsupported type {kind}")
