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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
import torch.nn as nn

from shardplan.errors import CaptureError


@dataclass(frozen=True, slots=True)
class Captured:
    gm: torch.fx.GraphModule
    method: str
    """"export" or "symbolic_trace"."""
    seconds: float


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


def capture(
    model: torch.nn.Module, example_inputs: tuple = (), example_kwargs: dict | None = None
) -> Captured:
    """Capture `model` into an ATen-level GraphModule.

    >>> from shardplan.models import zoo
    >>> entry = zoo.gpt()
    >>> capture(entry.model, entry.args, entry.kwargs).method
    'export'
    """
    example_kwargs = dict(example_kwargs or {})
    start = time.perf_counter()
    try:
        return export_program(model, tuple(example_inputs), example_kwargs)
    except Exception as export_error:  # any failure inside export falls back to fx
        args, kwargs = to_device((tuple(example_inputs), example_kwargs), model_device(model))
        try:
            gm = torch.fx.symbolic_trace(model, concrete_args=None)
            torch.fx.passes.shape_prop.ShapeProp(gm).propagate(*args, *kwargs.values())
            return Captured(gm, "symbolic_trace", time.perf_counter() - start)
        except Exception as trace_error:
            raise CaptureError(_explain(model, export_error, trace_error)) from export_error


def export_program(model: torch.nn.Module, example_inputs: tuple, example_kwargs: dict) -> Captured:
    """torch.export (non-strict) alone; raises what export raises."""
    # export fakifies real inputs itself; they only need to sit where the model does.
    args, kwargs = to_device((example_inputs, example_kwargs), model_device(model))
    start = time.perf_counter()
    with eager_branches(), tagged_autograd_functions(), torch.fx.traceback.preserve_node_meta():
        exported = torch.export.export(model, args, kwargs, strict=False)
    return Captured(exported.module(), "export", time.perf_counter() - start)


@contextlib.contextmanager
def eager_branches() -> Iterator[None]:
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
    masking: Any = sys.modules.get(
        "transformers.masking_utils"
    )  # its functions are swapped: typed loosely
    if not all(
        hasattr(masking, name)
        for name in ("is_torchdynamo_exporting", "find_packed_sequence_indices")
    ):
        yield  # not a transformers model, or a transformers whose masks this does not know
        return
    exporting, packed = masking.is_torchdynamo_exporting, masking.find_packed_sequence_indices
    masking.is_torchdynamo_exporting = lambda: False
    masking.find_packed_sequence_indices = lambda position_ids: (
        None
    )  # one sequence per row, as eager finds
    try:
        yield
    finally:
        masking.is_torchdynamo_exporting, masking.find_packed_sequence_indices = exporting, packed


AUTOGRAD_FUNCTION = "autograd_function"
"""node.meta["custom"] key of the nodes one call of a model's own torch.autograd.Function traced into:
(its class, the call's number, its arguments with each tensor as its (shape, dtype))."""


@contextlib.contextmanager
def tagged_autograd_functions() -> Iterator[None]:
    """Every call of a torch.autograd.Function defined outside torch tags the nodes its forward traces
    into (AUTOGRAD_FUNCTION; export must preserve node meta). Export inlines the forward's ops, and
    the ops' own autograd would keep their intermediates; eager runs the Function, which keeps what
    its forward saves and runs its own backward (BLOOM's GeLU keeps its input, not the five
    intermediates of its tanh approximation): passes/execution.py runs each tagged call as the Function."""
    original = torch.autograd.Function.__dict__["apply"]
    calls = iter(range(sys.maxsize))

    def apply(cls, *args, **kwargs):
        if (
            cls.__module__.split(".")[0] == "torch"
            or kwargs
            or not all(
                isinstance(arg, (torch.Tensor, int, float, bool, str, type(None))) for arg in args
            )
        ):
            return original.__func__(cls, *args, **kwargs)
        spec = tuple(
            (tuple(arg.shape), arg.dtype) if isinstance(arg, torch.Tensor) else arg for arg in args
        )
        with torch.fx.traceback.annotate({AUTOGRAD_FUNCTION: (cls, next(calls), spec)}):
            return original.__func__(cls, *args)

    torch.autograd.Function.apply = classmethod(apply)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.autograd.Function.apply = original  # type: ignore[method-assign]


def _explain(model: torch.nn.Module, export_error: Exception, trace_error: Exception) -> str:
    first_line = (
        str(export_error).strip().splitlines()[0]
        if str(export_error).strip()
        else type(export_error).__name__
    )
    where = _failing_location(export_error)
    both = f"{export_error}\n{trace_error}"
    if "use_cache" in str(export_error) or "DynamicCache" in str(export_error):
        hint = "set config.use_cache = False on Hugging Face models before planning"
    elif "data-dependent" in both or "control flow" in both:
        hint = (
            "the model's forward branches on tensor values (data-dependent control flow): "
            "rewrite the branch with torch.where / torch.cond, or move it out of forward"
        )
    else:  # the model fails on these inputs eagerly too: a dtype, a shape or a device the model does not take
        hint = (
            "the model fails on these example inputs, as the error says: call model(*inputs) eagerly to see "
            "it, and give the inputs the dtypes, shapes and devices forward takes (token ids as torch.long)"
        )
    return (
        f"cannot capture {type(model).__name__}: torch.export failed{where}: {first_line}; "
        f"torch.fx.symbolic_trace failed too: {str(trace_error).strip().splitlines()[0] if str(trace_error).strip() else type(trace_error).__name__}. "
        f"Likely cause and fix: {hint}"
    )


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


def put_stand_ins(
    model: nn.Module,
    chosen: Callable[[torch.Tensor], bool],
    *,
    buffers: bool = False,
    parameter_dtype: torch.dtype | None = None,
    fake: tuple[Any, torch.device] | None = None,
) -> list[tuple[dict, str, torch.Tensor]]:
    """Replace the `chosen` parameters (and buffers) of `model` by meta tensors of their shapes (floating
    parameters in `parameter_dtype`, if given), or by `fake` = (a FakeTensorMode, device)'s tensors on
    that device, one per tensor so tied parameters stay tied; return (slots, name, original) for each
    replaced slot."""
    originals = []
    stand_in: dict[int, Any] = {}  # a Parameter or a buffer, as the slot it fills holds
    for module in model.modules():
        for slots, is_parameter in ((module._parameters, True), (module._buffers, False)):
            if not (is_parameter or buffers):
                continue
            for name, value in list(slots.items()):
                if value is None or not chosen(value):
                    continue
                originals.append((slots, name, value))
                if id(value) not in stand_in:
                    floating = (
                        is_parameter and parameter_dtype is not None and value.is_floating_point()
                    )
                    dtype = parameter_dtype if floating else value.dtype
                    with fake[0] if fake else contextlib.nullcontext():
                        empty = torch.empty(
                            value.shape, dtype=dtype, device=fake[1] if fake else "meta"
                        )
                    stand_in[id(value)] = (
                        nn.Parameter(empty, value.requires_grad) if is_parameter else empty
                    )
                slots[name] = stand_in[id(value)]
    return originals


def restore(originals: list[tuple[dict, str, torch.Tensor]]) -> None:
    """Put back what put_stand_ins replaced."""
    for slots, name, value in originals:
        slots[name] = value


@contextlib.contextmanager
def computing_in(model: nn.Module, dtype: torch.dtype) -> Iterator[None]:
    """`model` with its floating parameters stood in by fake tensors in `dtype`, and its other parameters and
    buffers by fake tensors of their own dtypes, on its device, while it is captured and analyzed: what mixed
    precision runs (the runtimes cast parameters, not buffers or inputs, to the compute dtype). The graph then
    bakes the dtypes the runtime computes in, as eager code writes them (a cast to `x.dtype`, a softmax
    upcast to float32 and cast back, a loss taken in float32), which casting the fp32 graph's values
    afterwards could not see; it takes the branches the model takes on its device (transformers' MoE
    routing picks histc's dtype by `device.type`), and it allocates nothing.

    A model on the meta device is stood in on the CPU: the analysis runs the graph on fake CPU tensors
    (passes/execution.py), so the graph must take the CPU branches (on meta, transformers' routing
    bakes histc over integers, which the CPU refuses), and a model too large to build for real still
    captures (a DeepSeek-V3 shape)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    device = model_device(model)
    on = torch.device("cpu") if device.type == "meta" else device
    originals = put_stand_ins(
        model,
        lambda value: True,
        buffers=True,
        parameter_dtype=dtype,
        fake=(FakeTensorMode(allow_non_fake_inputs=True), on),
    )
    try:
        yield
    finally:
        restore(originals)
