"""The captured graph split into the plan's pipeline stages (see [Note: stage graphs]); the solver chose the cuts.

[Note: stage graphs] A stage cannot be cut out of the model's Python code, so
it is cut out of its graph: the model is captured again at the shape of one
micro-batch (from fake stand-ins of its tensors on the device it runs on,
parameters in the compute dtype, so the graph bakes the dtypes and the device
branches the runtime takes, and capturing allocates nothing), the graph is split into one partition per block (the blocks of
the analysis, torch.fx split_module), and each rank runs the partitions of
its stage, in graph order. Values that cross a cut are what a stage sends and
the next receives: the residual stream, and any model input a later stage
reads (labels), which the stages before it pass along.

With tp > 1 the model captured is the one tensor parallelism sliced, so the graph
holds this rank's widths and the tp exchanges as nodes ([Note: tensor parallel
stages] in pipelined.py), and what crosses a cut is what this tp rank holds there.

A partition takes its parameters as arguments; they are read from the model
only when it runs, inside the scheduler's wrap, once its units have presented
their gathered views. So a block is run as a module is without pipelining:
gathered, prefetched, released and checkpointed the same way, and a stage's
units shard over its data-parallel group unchanged. On backend="fsdp2" a unit's
consecutive blocks run as its FSDP2 group's forward ([Note: FSDP2 stages] in fsdp2.py).
"""

import contextlib
import dataclasses
import operator
from dataclasses import dataclass
from typing import Any, Callable, cast

import torch
import torch.fx
import torch.nn as nn
from torch.fx.passes.split_module import split_module

from shardplan.common.dtypes import torch_dtype
from shardplan.errors import PlanError, ShardplanError
from shardplan.frontend.capture import put_stand_ins, restore
from shardplan.frontend.chain import InputSpec
from shardplan.frontend.passes.blocks import attribute_of
from shardplan.plan import Plan


@dataclass(frozen=True, kw_only=True, slots=True)
class BlockCall:
    """One block's partition and how the stage calls it."""

    name: str
    """The block's name (its module path)."""
    unit: str
    """The unit the block belongs to."""
    partition: torch.fx.GraphModule
    arguments: tuple[tuple[bool, str], ...]
    """(is an attribute, name) per argument: a value's node name, or the dotted name of a parameter,
    buffer or constant."""
    results: tuple[str, ...] | None
    """Node names of the partition's outputs when it returns a tuple; None when it returns one value,
    bound to the block's own name in the graph."""
    node: str
    """The partition's node name in the split graph."""

    @property
    def attributes(self) -> tuple[str, ...]:
        return tuple(name for is_attribute, name in self.arguments if is_attribute)


@dataclass(frozen=True, kw_only=True, slots=True)
class StageGraph:
    """What one stage runs, and what crosses its cuts."""

    index: int
    calls: tuple[BlockCall, ...]
    inbound: tuple[str, ...]
    """Values the stage receives, in order (stage 0: the model's flat inputs)."""
    outbound: tuple[str, ...]
    """Values it sends on (the last stage: the model's flat outputs)."""
    examples: dict[str, torch.Tensor]
    """A meta tensor like each inbound and outbound value (shape, dtype, requires_grad), which the
    pipeline sizes its receive buffers by."""
    constants: dict[str, torch.Tensor]
    """Tensors the capture made that the model does not hold (lifted constants), by dotted name, on the device."""
    input_spec: Any
    """How the model's (args, kwargs) flatten into stage 0's inputs (a pytree spec)."""
    output_spec: Any
    """How the last stage's outputs unflatten into what the model returns."""


def micro_batch_of(inputs: tuple[InputSpec, ...], count: int) -> tuple[InputSpec, ...]:
    """`inputs`, a replica's batch, at one of its `count` micro-batches (dim 0 divided by `count`)."""
    return tuple(
        dataclasses.replace(spec, shape=(spec.shape[0] // count, *spec.shape[1:]))
        if spec.shape
        else spec
        for spec in inputs
    )


def split_stages(
    model: nn.Module,
    plan: Plan,
    device: torch.device,
    micro_batch: tuple[InputSpec, ...] | None = None,
) -> list[StageGraph]:
    """Capture `model` at the inputs of one `micro_batch` (the plan's own if None) and split its graph
    into the stages of `plan` (pp · virtual stages per rank), to run on `device`.

    Every rank splits out every stage, so a plan that cannot run fails alike on all of them."""
    from shardplan.frontend.passes.blocks import block_modules, group_nodes

    gm = _capture_micro_batch(
        model,
        plan,
        device,
        micro_batch or micro_batch_of(plan.inputs, plan.schedule.num_micro_batches),
    )
    groups = group_nodes(gm)
    units = _unit_of_blocks(plan, block_modules(groups))
    stage_of_unit = plan.stage_of_unit
    block_of = {node: index for index, group in enumerate(groups) for node in group.nodes}
    split = split_module(gm, gm, lambda node: block_of[node], keep_original_order=True)

    count = len(plan.stages)  # pp · virtual stages per rank
    last = count - 1
    made_by: dict[str, int] = {}
    """Value → the stage computing it; model inputs count as stage 0's."""
    last_read_by: dict[str, int] = {}
    calls: list[list[BlockCall]] = [[] for _ in range(count)]
    for node in split.graph.nodes:
        if node.op == "placeholder":
            made_by[node.name] = 0
        elif node.op == "call_module":
            block = int(str(node.target).removeprefix("submod_"))
            made_by[node.name] = stage_of_unit[units[block]]
            calls[made_by[node.name]].append(
                _block_call(split, node, groups[block].name, units[block])
            )
        elif node.op == "call_function" and node.target is operator.getitem:
            made_by[node.name] = made_by[node.args[0].name]
        reader = (
            last if node.op == "output" else made_by.get(node.name, 0)
        )  # nodes made by no stage read nothing
        for value in node.all_input_nodes:
            if value.op != "get_attr":
                last_read_by[value.name] = max(last_read_by.get(value.name, 0), reader)

    tuples = {node.name for node in split.graph.nodes if _returns_tuple(node)}

    def crossing(cut: int) -> tuple[str, ...]:  # values made before the cut and read after it
        return tuple(
            name
            for name in made_by
            if made_by[name] < cut <= last_read_by.get(name, -1) and name not in tuples
        )

    placeholders = tuple(node.name for node in split.graph.find_nodes(op="placeholder"))
    output = next(iter(split.graph.find_nodes(op="output")))
    stages = []
    for index in range(count):
        inbound = placeholders if index == 0 else crossing(index)
        outbound = _output_names(output) if index == last else crossing(index + 1)
        stages.append(
            StageGraph(
                index=index,
                calls=tuple(calls[index]),
                inbound=inbound,
                outbound=outbound,
                examples=_examples(split, inbound + outbound),
                constants={
                    target: attribute_of(split, target).to(device)
                    for call in calls[index]
                    for target in call.attributes
                    if attribute_of(model, target) is None
                },
                input_spec=gm._in_spec,
                output_spec=gm._out_spec,
            )
        )
    return stages


def _capture_micro_batch(
    model: nn.Module, plan: Plan, device: torch.device, micro_batch: tuple[InputSpec, ...]
) -> torch.fx.GraphModule:
    from shardplan.frontend.capture import capture
    from shardplan.frontend.passes import PassInputs, meta_inputs, run_passes

    if not plan.inputs:
        raise PlanError(
            "this plan records no input shapes (written by hand?): pipeline stages are cut from "
            "a capture at those shapes; make the plan with shardplan.compile"
        )
    with _stand_ins(model, torch_dtype(plan.mixed_precision.param_dtype), device):
        gm = capture(model, *meta_inputs(micro_batch)).gm
    if not hasattr(gm, "_in_spec"):
        raise ShardplanError(
            f"torch.export could not capture {type(model).__name__} (only symbolic tracing "
            "could), and pipeline stages are cut from an exported graph: make the model "
            "exportable, or plan with pp=1"
        )
    for node in gm.graph.find_nodes(op="call_module"):
        if str(node.target).startswith("_guards"):
            gm.graph.erase_node(node)  # re-checks input shapes, which Program.step has done
    run_passes(
        gm, last="retarget_device", inputs=PassInputs(device=device)
    )  # stand-ins capture `arange(device=meta)`
    return gm


@contextlib.contextmanager
def _stand_ins(model: nn.Module, compute_dtype: torch.dtype, device: torch.device):
    """The model's parameters and buffers replaced, for a capture, by fake tensors on `device`, the
    parameters in the compute dtype: the graph then bakes the dtypes the runtime computes in (a Hugging
    Face model casts to `x.dtype`, which capture writes down as a constant) and the branches the model
    takes on the device it runs on (transformers' MoE routing picks histc's dtype by `device.type`; on
    meta stand-ins it baked the CUDA branch, which fails on CPU), and capturing allocates nothing."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    originals = put_stand_ins(
        model,
        lambda value: True,
        buffers=True,
        parameter_dtype=compute_dtype,
        fake=(FakeTensorMode(allow_non_fake_inputs=True), device),
    )
    try:
        yield
    finally:
        restore(originals)


def _unit_of_blocks(plan: Plan, modules_of_block: list[tuple[str, ...]]) -> list[str]:
    """The plan's unit of each block of the graph; a block of no module joins the block before it."""
    unit_of_module = {module: unit.name for unit in plan.units for module in unit.modules}
    units: list[str] = []
    for modules in modules_of_block:
        found = [unit_of_module[m] for m in modules if m in unit_of_module]
        if modules and not found:
            raise PlanError(
                f"the graph has a block of modules {list(modules)} that no unit of the plan holds: "
                "the plan was made for another model; re-plan with this one"
            )
        units.append(found[0] if found else units[-1] if units else plan.units[0].name)
    stages = [plan.stage_of_unit[unit] for unit in units]
    if stages != sorted(stages):
        raise PlanError(
            f"the plan's stages do not follow the graph's order (stage of each block: {stages}): "
            "each stage must hold consecutive blocks; re-plan with shardplan.compile"
        )
    return units


def _block_call(
    split: torch.fx.GraphModule, node: torch.fx.Node, name: str, unit: str
) -> BlockCall:
    if node.kwargs:
        raise ShardplanError(
            f"block {name!r} was split with keyword arguments, which stages do not pass"
        )
    arguments = tuple(
        (value.op == "get_attr", str(value.target) if value.op == "get_attr" else value.name)
        for value in cast(tuple[torch.fx.Node, ...], node.args)
    )  # split_module passes nodes alone
    results = None
    if _returns_tuple(node):
        by_index: dict[Any, str] = {user.args[1]: user.name for user in node.users}
        results = tuple(by_index.get(index, "") for index in range(max(by_index) + 1))
    return BlockCall(
        name=name,
        unit=unit,
        partition=getattr(split, str(node.target)),
        arguments=arguments,
        results=results,
        node=node.name,
    )


def _returns_tuple(node: torch.fx.Node) -> bool:
    """A partition returning several values: its users are the getitems taking them apart."""
    return (
        node.op == "call_module"
        and bool(node.users)
        and all(
            user.op == "call_function" and user.target is operator.getitem for user in node.users
        )
    )


def _examples(split: torch.fx.GraphModule, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Meta tensors like the values `names` (capture recorded them on the partitions' outputs)."""
    nodes = {node.name: node for node in split.graph.nodes}
    examples = {}
    for name in names:
        node, index = nodes[name], None
        if node.op == "call_function":  # a getitem of a partition's outputs
            node, index = node.args[0], node.args[1]
        if node.op == "placeholder":
            value = node.meta["val"]
        else:
            returned = next(
                iter(getattr(split, str(node.target)).graph.find_nodes(op="output"))
            ).args[0]
            value = (returned if index is None else returned[index]).meta["val"]
        if not isinstance(value, torch.Tensor):
            raise ShardplanError(
                f"a pipeline stage would send {name!r}, a {type(value).__name__}, to the next "
                "stage: only tensors cross stages; plan with pp=1 for this model"
            )
        examples[name] = torch.empty(
            value.shape,
            dtype=value.dtype,
            device="meta",  # sent contiguous
            requires_grad=node.op != "placeholder" and value.is_floating_point(),
        )
    return examples


def _output_names(output: torch.fx.Node) -> tuple[str, ...]:
    values: Any = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    if not all(isinstance(value, torch.fx.Node) for value in values):
        raise ShardplanError(
            "the model returns values that are not tensors computed by the graph (constants or "
            "None): the last pipeline stage can only return tensors; return only tensors, or "
            "plan with pp=1"
        )
    return tuple(value.name for value in values)


class StageModule(nn.Module):
    """The forward of one pipeline stage: its blocks in graph order, inbound values in, outbound out.

    The blocks run in segments, each the consecutive blocks of one unit: `run_segment(calls)` gives the
    callable that runs a segment from the values it reads, by name, and returns those it makes (the
    runtime wraps its blocks with unit gathering and checkpointing, or calls the unit's FSDP2 module);
    `forward_pass()` is the context one micro-batch's forward runs in."""

    def __init__(
        self,
        graph: StageGraph,
        run_segment: Callable[[tuple[BlockCall, ...]], Callable[[dict], dict]],
        forward_pass: Callable[[], contextlib.AbstractContextManager],
    ):
        super().__init__()
        self.graph = graph
        self._runs = [
            (_segment_reads(segment), run_segment(segment))
            for segment in unit_segments(graph.calls)
        ]
        self._forward_pass = forward_pass

    def forward(self, *inbound: torch.Tensor) -> tuple[torch.Tensor, ...]:
        values = dict(zip(self.graph.inbound, inbound))
        with self._forward_pass():
            for reads, run in self._runs:
                values.update(run({name: values[name] for name in reads}))
        # sends need contiguous tensors (a BERT head's residual arrives transposed)
        return tuple(values[name].contiguous() for name in self.graph.outbound)


def unit_segments(calls: tuple[BlockCall, ...]) -> list[tuple[BlockCall, ...]]:
    """`calls` cut into runs of consecutive blocks of one unit."""
    segments: list[list[BlockCall]] = []
    for call in calls:
        if segments and segments[-1][0].unit == call.unit:
            segments[-1].append(call)
        else:
            segments.append([call])
    return [tuple(segment) for segment in segments]


def _segment_reads(segment: tuple[BlockCall, ...]) -> tuple[str, ...]:
    """The values a segment's blocks read that none of them makes."""
    made = {name for call in segment for name in (call.results or (call.node,))}
    return tuple(
        dict.fromkeys(
            name
            for call in segment
            for is_attribute, name in call.arguments
            if not is_attribute and name not in made
        )
    )


def run_blocks(runs: list[tuple[BlockCall, Callable]], values: dict[str, Any]) -> dict[str, Any]:
    """Run each (call, runner) of a segment in order on `values`, by name; return the values they make."""
    known, made = dict(values), {}
    for call, run in runs:
        result = run(*(known[name] for is_attribute, name in call.arguments if not is_attribute))
        new = (
            {call.node: result}
            if call.results is None
            else {name: value for name, value in zip(call.results, result) if name}
        )
        known.update(new)
        made.update(new)
    return made


def block_runner(call: BlockCall, model: nn.Module, constants: dict[str, torch.Tensor]) -> Callable:
    """A callable running `call`'s partition on activations, reading its attributes from `model` as it starts
    (where the block's units present their gathered parameters) or from `constants`."""

    def run(*values):
        given = iter(values)
        arguments = [
            (constants[name] if name in constants else attribute_of(model, name))
            if is_attribute
            else next(given)
            for is_attribute, name in call.arguments
        ]
        return call.partition(*arguments)

    return run
