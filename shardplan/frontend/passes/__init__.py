"""The analysis passes, in the order they run, and `analyze`: model → BlockChain.

Each pass reads the graph and writes node.meta["shardplan"] (or rewrites its device
constants); none runs real kernels on real data.
"""

import contextlib
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.fx

from shardplan.common.dtypes import FLOAT_DTYPES, dtype_name, torch_dtype
from shardplan.errors import EMPTY_BATCH, ShardplanError
from shardplan.frontend.capture import Captured, capture, computing_in, model_device
from shardplan.frontend.chain import BlockChain, InputSpec
from shardplan.frontend.passes.blocks import build_chain, fingerprint
from shardplan.frontend.passes.devices import retarget_device_pass
from shardplan.frontend.passes.execution import annotate_execution_pass
from shardplan.frontend.passes.ownership import annotate_ownership_pass
from shardplan.frontend.passes.splice import install_stand_ins, splice_copies
from shardplan.frontend.passes.tensor_parallel import (
    TensorParallelCandidates,
    find_tensor_parallel_pairs,
)
from shardplan.frontend.passes.tensor_parallel_facts import with_tensor_parallel_facts
from shardplan.frontend.repeats import RepeatedCapture, capture_repeated
from shardplan.frontend.sharded_loss import sharded_loss_head
from shardplan.frontend.signature import model_signature


@dataclass(frozen=True, kw_only=True, slots=True)
class PassInputs:
    """What the passes read besides the graph."""

    device: torch.device = torch.device("cpu")
    """Where the graph will run: capturing a model on the meta device bakes `meta` into it."""
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    """The example inputs the execution pass runs the graph on, as fake tensors."""
    repeated: RepeatedCapture | None = None
    """The copies of repeated blocks the graph calls as one op each (repeats.py), if it was captured so."""


PASSES: tuple[tuple[str, Callable[[torch.fx.GraphModule, PassInputs], None]], ...] = (
    ("ownership", lambda gm, inputs: annotate_ownership_pass(gm)),
    (
        "retarget_device",
        lambda gm, inputs: retarget_device_pass(gm, torch.device("meta"), inputs.device),
    ),
    ("stand_ins", lambda gm, inputs: install_stand_ins(gm, inputs.repeated)),
    ("execution", lambda gm, inputs: annotate_execution_pass(gm, inputs.args, inputs.kwargs)),
    ("splice", lambda gm, inputs: splice_copies(gm, inputs.repeated)),
)
"""Every pass over a captured graph, in the order they run. Callers run a slice by name: a pipeline
stage's graph runs through retarget_device, the analysis through splice (run_passes); the
fingerprint runs ownership and splice alone (without execution, the copies' facts are names only)."""


def run_passes(
    gm: torch.fx.GraphModule,
    *,
    last: str,
    first: str = PASSES[0][0],
    inputs: PassInputs = PassInputs(),
) -> None:
    """Run the PASSES from the one named `first` through the one named `last` on `gm`, in order."""
    names = [name for name, _ in PASSES]
    for _, run in PASSES[names.index(first) : names.index(last) + 1]:
        run(gm, inputs)


def analyze(
    model: torch.nn.Module,
    example_inputs: tuple = (),
    example_kwargs: dict | None = None,
    reuse_blocks: bool = True,
    *,
    compute_dtype: "torch.dtype | str | None" = None,
) -> BlockChain:
    """Capture `model` and reduce it to an annotated chain of blocks.

    `reuse_blocks`: trace and run one block of each class of repeated blocks and stamp its facts on
    the others (repeats.py, passes/splice.py); the chain is the one a full analysis gives.
    `compute_dtype`: the dtype mixed precision computes in (MixedPrecision.param_dtype); None: the
    parameters' own. The graph is captured and run with the parameters in it (capture.computing_in),
    so every activation, transient and memory-bound byte is the runtime's; the parameters' own
    bytes (the master weights) stay in their dtype.

    >>> from shardplan.models import zoo
    >>> entry = zoo.gpt()
    >>> [b.name for b in analyze(entry.model, entry.args, entry.kwargs).blocks]
    ['wte', 'h.0', 'h.1', 'h.2', 'h.3', 'ln_f', 'lm_head']
    """
    example_kwargs = dict(example_kwargs or {})
    shapes = [
        value.shape
        for value in (*example_inputs, *example_kwargs.values())
        if hasattr(value, "shape")
    ]
    if shapes and shapes[0][:1] == (0,):
        raise ShardplanError(EMPTY_BATCH)
    start = time.perf_counter()
    signature = model_signature(
        model
    )  # before the capture runs forward: the model as parallelize will get it
    master = _parameter_dtype(model)
    compute = dtype_name(compute_dtype) if compute_dtype is not None else master
    cast = compute != master and master in FLOAT_DTYPES
    stand_in = cast or model_device(model).type == "meta"  # see capture.computing_in
    with computing_in(model, torch_dtype(compute)) if stand_in else contextlib.nullcontext():
        captured, repeated = _capture(model, tuple(example_inputs), example_kwargs, reuse_blocks)
        run_passes(
            captured.gm,
            last="splice",
            inputs=PassInputs(args=tuple(example_inputs), kwargs=example_kwargs, repeated=repeated),
        )
    inputs = input_specs(example_inputs, example_kwargs)
    frozen = tuple(
        sorted(name for name, parameter in model.named_parameters() if not parameter.requires_grad)
    )
    chain = build_chain(
        captured.gm,
        inputs,
        {
            "capture": captured.method,
            "model": type(model).__name__,
            "capture_s": round(captured.seconds, 3),
            "analyze_s": round(time.perf_counter() - start, 3),
            "reused_blocks": len(repeated.copies) if repeated else 0,
        },
    )
    in_blocks = {path for block in chain.blocks for path in block.modules}
    classes = {
        path: type(module).__name__ for path, module in model.named_modules() if path in in_blocks
    }
    chain = dataclasses.replace(
        chain,
        frozen_params=frozen,
        module_classes=classes,
        signature=signature,
        compute_dtype=compute,
    )
    if (
        cast
    ):  # the master weights keep their dtype; a plan is checked against the model as it is given
        chain = _with_master_weights(chain, model, fingerprint_of(model, inputs, reuse_blocks))
    return with_tensor_parallel_facts(captured.gm, chain, sharded_loss_head(model))


def _parameter_dtype(model: torch.nn.Module) -> str:
    """The dtype of the model's floating parameters, as the chain records it ("" without any)."""
    floating = sorted({dtype_name(p.dtype) for p in model.parameters() if p.is_floating_point()})
    return floating[0] if floating else ""


def _with_master_weights(
    chain: BlockChain, model: torch.nn.Module, model_fingerprint: str
) -> BlockChain:
    """`chain`, analyzed with its parameters stood in by the compute dtype, with the parameters' bytes and
    dtype of the model itself, and the fingerprint of its own graph."""

    def own_bytes(names: tuple[str, ...]) -> int:
        return sum(
            model.get_parameter(name).numel() * model.get_parameter(name).element_size()
            for name in names
        )

    return dataclasses.replace(
        chain,
        fingerprint=model_fingerprint,
        param_dtype=_parameter_dtype(model),
        blocks=tuple(
            dataclasses.replace(block, param_bytes=own_bytes(block.param_names))
            for block in chain.blocks
        ),
    )


def _capture(
    model: torch.nn.Module, args: tuple, kwargs: dict, reuse_blocks: bool
) -> tuple[Captured, RepeatedCapture | None]:
    """The model captured with its repeated blocks' copies as one op each where it has some, else whole."""
    repeated = capture_repeated(model, args, kwargs) if reuse_blocks else None
    if repeated is not None:
        return repeated.captured, repeated
    return capture(model, args, kwargs), None


def input_specs(args: tuple, kwargs: dict) -> tuple[InputSpec, ...]:
    named = [(str(i), value) for i, value in enumerate(args)] + list(kwargs.items())
    return tuple(
        InputSpec(name=name, shape=tuple(value.shape), dtype=dtype_name(value.dtype))
        for name, value in named
        if isinstance(value, torch.Tensor)
    )


def meta_inputs(inputs) -> tuple[tuple, dict]:
    """(args, kwargs) of meta tensors shaped as `inputs` (InputSpecs; positional ones are named "0", "1")."""
    return example_tensors(inputs, "meta")


def example_tensors(inputs, device: torch.device | str = "cpu") -> tuple[tuple, dict]:
    """(args, kwargs) of tensors shaped as `inputs` and filled with ones: a valid token id, a mask
    that masks nothing. Analysis runs on fake tensors, so only shapes, dtypes and device count."""
    tensors = {
        spec.name: torch.ones(spec.shape, dtype=torch_dtype(spec.dtype), device=device)
        for spec in inputs
    }
    return (
        tuple(t for name, t in tensors.items() if name.isdigit()),
        {name: t for name, t in tensors.items() if not name.isdigit()},
    )


def fingerprint_of(
    model: torch.nn.Module, inputs: tuple[InputSpec, ...], reuse_blocks: bool = True
) -> str:
    """The captured graph's fingerprint, from input shapes alone (as a plan records them).

    Capture only, no execution, each repeated block traced once (as `analyze` does): what a plan
    records, and what `parallelize` compares where it captures the model (see [Note: start-up check]
    in runtime/model_check.py).
    """
    return fingerprint(structural_graph(model, *meta_inputs(inputs), reuse_blocks=reuse_blocks))


def structural_graph(
    model: torch.nn.Module, args: tuple, kwargs: dict, reuse_blocks: bool = True
) -> torch.fx.GraphModule:
    """The whole-model graph with owners (module paths, parameters read) and no execution facts,
    each repeated block traced once and spliced in for its copies: what the fingerprint and the
    tensor-parallel layout read."""
    captured, repeated = _capture(model, args, kwargs, reuse_blocks)
    run_passes(captured.gm, last="ownership")
    run_passes(captured.gm, first="splice", last="splice", inputs=PassInputs(repeated=repeated))
    return captured.gm


def tensor_parallel_candidates(
    model: torch.nn.Module, example_inputs: tuple = (), example_kwargs: dict | None = None
) -> TensorParallelCandidates:
    """Capture `model` (static shapes, each repeated block traced once) and find its tensor-parallel pairs."""
    return find_tensor_parallel_pairs(
        structural_graph(model, tuple(example_inputs), dict(example_kwargs or {}))
    )
