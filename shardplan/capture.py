"""Capture: model + example inputs → a torch.fx GraphModule of ATen ops.

torch.export (non-strict) is the primary path: it captures Hugging Face models
and models on the meta device, and every node carries `nn_module_stack`.
torch.fx.symbolic_trace is the fallback for models export rejects but fx can
trace. Capture never runs real kernels on real data: inputs are turned into
meta tensors first, so a 70B-parameter model captures on a laptop.
"""
import contextlib
import sys
import time
from dataclasses import dataclass, field

import sympy
import torch
import torch.fx

from .errors import CaptureError


@dataclass(frozen=True, slots=True)
class Captured:
    gm: torch.fx.GraphModule
    method: str
    """"export" or "symbolic_trace"."""
    seconds: float
    dim_ranges: dict = field(default_factory=dict)
    """(input name, dim) → (smallest, largest) size export allows, for the dims marked dynamic."""


def to_device(value, device: torch.device):
    """The same pytree of tensors, on `device` (the meta device keeps shapes and dtypes, no memory).

    Meta tensors moved to a real device become zeros: export traces shapes, not values. A tensor
    passed twice (ids as input and as labels) is copied the second time: export would capture the
    aliasing, and the graph, its fingerprint with it, would depend on how the caller built the batch."""
    seen: set[int] = set()

    def move(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.is_meta and device.type != "meta":
            return torch.zeros(tensor.shape, dtype=tensor.dtype, device=device)
        moved = tensor.to(device)
        if id(tensor) in seen:
            moved = moved.clone()
        seen.add(id(tensor))
        return moved
    return torch.utils._pytree.tree_map_only(torch.Tensor, move, value)


def model_device(model: torch.nn.Module) -> torch.device:
    first = next(iter(model.parameters()), None)
    return first.device if first is not None else torch.device("cpu")


def capture(model: torch.nn.Module, example_inputs: tuple = (), example_kwargs: dict | None = None,
            dynamic_dims: dict | None = None) -> Captured:
    """Capture `model` into an ATen-level GraphModule.

    `dynamic_dims` maps an input name (positional index as str, or keyword) to
    {dim: name}, e.g. {"0": {0: "batch"}}; those dims stay symbolic in the graph.

    >>> from shardplan import zoo
    >>> entry = zoo.gpt()
    >>> capture(entry.model, entry.args, entry.kwargs).method
    'export'
    """
    example_kwargs = dict(example_kwargs or {})
    start = time.perf_counter()
    try:
        return export_program(model, tuple(example_inputs), example_kwargs, dynamic_dims)
    except Exception as export_error:  # any failure inside export falls back to fx
        args, kwargs = to_device((tuple(example_inputs), example_kwargs), model_device(model))
        try:
            gm = torch.fx.symbolic_trace(model, concrete_args=None)
            torch.fx.passes.shape_prop.ShapeProp(gm).propagate(*args, *kwargs.values())
            return Captured(gm, "symbolic_trace", time.perf_counter() - start)
        except Exception as trace_error:
            raise CaptureError(_explain(model, export_error, trace_error)) from export_error


def export_program(model: torch.nn.Module, example_inputs: tuple, example_kwargs: dict,
                   dynamic_dims: dict | None = None) -> Captured:
    """torch.export (non-strict) alone; raises what export raises."""
    # export fakifies real inputs itself; they only need to sit where the model does.
    args, kwargs = to_device((example_inputs, example_kwargs), model_device(model))
    start = time.perf_counter()
    with eager_branches():
        exported = torch.export.export(model, args, kwargs, strict=False,
                                       dynamic_shapes=_dynamic_shapes(model, args, kwargs, dynamic_dims))
    return Captured(exported.module(), "export", time.perf_counter() - start,
                    _dim_ranges(exported, args, kwargs, dynamic_dims))


@contextlib.contextmanager
def eager_branches():
    """Hugging Face's attention masks built as an eager training step builds them, while export traces.

    [Note: capture takes the eager branches] transformers builds a different program under export
    than it runs: it never skips the causal mask while exporting, and it cannot tell that a batch is
    unpacked (position ids counting up from 0 in every row, a check on the data, which fake tensors
    lack), so it materializes a 4-D mask, and with a mask, repeats the key and value heads of grouped
    query attention before SDPA (three more saved tensors a layer). A training step on token ids
    without an attention mask runs SDPA with no mask (`is_causal` in a decoder): this makes export
    trace that branch, so the analysis prices the program the runtime executes, and pipeline stages
    run it. A batch that passes its own attention mask or packed position ids still traces as
    before; models not built by transformers trace as they would anyway."""
    masking = sys.modules.get("transformers.masking_utils")
    if masking is None:
        yield
        return
    exporting, packed = masking.is_torchdynamo_exporting, masking.find_packed_sequence_indices
    masking.is_torchdynamo_exporting = lambda: False
    masking.find_packed_sequence_indices = lambda position_ids: None  # one sequence per row, as eager finds
    try:
        yield
    finally:
        masking.is_torchdynamo_exporting, masking.find_packed_sequence_indices = exporting, packed


def _dynamic_shapes(model: torch.nn.Module, args: tuple, kwargs: dict, dynamic_dims: dict | None):
    """export's dynamic_shapes, keyed by forward's parameter names.

    Dims are `Dim.AUTO`: export infers their ranges and which dims are equal
    (batch of ids and labels), instead of failing on a range the user did not state.
    """
    if not dynamic_dims:
        return None
    import inspect

    bound = inspect.signature(model.forward).bind(*args, **kwargs)
    names = list(bound.arguments)
    shapes: dict[str, dict | None] = {name: None for name in names}
    for key, dims in dynamic_dims.items():
        name = names[int(key)] if key.isdigit() else key
        if name not in shapes:
            raise CaptureError(f"dynamic_dims names input {key!r}, but forward takes {names}")
        shapes[name] = {dim: torch.export.Dim.AUTO for dim in dims}
    return shapes


def _dim_ranges(exported, args: tuple, kwargs: dict, dynamic_dims: dict | None) -> dict:
    """Size ranges of the dynamic dims, read off export's range constraints (one tensor per input)."""
    if not dynamic_dims:
        return {}
    names = [str(i) for i in range(len(args))] + list(kwargs)
    user_inputs = set(exported.graph_signature.user_inputs)
    placeholders = [n for n in exported.graph.nodes if n.op == "placeholder" and n.name in user_inputs]
    ranges = {}
    for name, node in zip(names, placeholders):
        for dim in dynamic_dims.get(name, {}):
            size = node.meta["val"].shape[dim]
            if isinstance(size, torch.SymInt):
                bounds = exported.range_constraints[size.node.expr]
                upper = int(bounds.upper) if isinstance(bounds.upper, sympy.Integer) else 2**31 - 1  # unbounded
                ranges[(name, dim)] = (int(bounds.lower), upper)
            else:  # export found the dim cannot change (the model fixes it)
                ranges[(name, dim)] = (int(size), int(size))
    return ranges


def _explain(model: torch.nn.Module, export_error: Exception, trace_error: Exception) -> str:
    first_line = str(export_error).strip().splitlines()[0] if str(export_error).strip() else type(export_error).__name__
    where = _failing_location(export_error)
    hint = ("the model's forward branches on tensor values (data-dependent control flow): "
            "rewrite the branch with torch.where / torch.cond, or move it out of forward")
    if "use_cache" in str(export_error) or "DynamicCache" in str(export_error):
        hint = "set config.use_cache = False on Hugging Face models before planning"
    return (f"cannot capture {type(model).__name__}: torch.export failed{where}: {first_line}; "
            f"torch.fx.symbolic_trace failed too: {str(trace_error).strip().splitlines()[0] if str(trace_error).strip() else type(trace_error).__name__}. "
            f"Likely cause and fix: {hint}")


def _failing_location(error: Exception) -> str:
    """The innermost frame of the user's code in the traceback, as " at file:line (function)"."""
    frames = [frame for frame in _walk_traceback(error) if "/torch/" not in frame.filename]
    if not frames:
        return ""
    frame = frames[-1]
    return f" at {frame.filename}:{frame.lineno} ({frame.name})"


def _walk_traceback(error: BaseException | None):
    import traceback

    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield from traceback.extract_tb(error.__traceback__)
        error = error.__cause__ or error.__context__
