"""Run the graph once, forward and backward, on fake tensors, and write what it cost.

Nothing runs on real data: parameters and inputs are fake CPU tensors (shapes,
dtypes and storages without memory), so a 70B model is analyzed on a laptop.
Fake CPU rather than meta tensors, so that every op dispatches to the kernel
eager CPU training runs (attention picks the same variant, whose FLOPs count
differently from the math fallback), and device moves in the model work. Three things are observed at once:

- each kernel's name, FLOPs (torch.utils.flop_counter's formulas) and bytes moved,
  attributed to the node that ran (forward) or whose autograd node ran
  (backward), summed by op name (chain.OpKind);
- what autograd saves for backward (saved_tensors_hooks), by storage;
- activation bytes live after every op (a dispatch mode that follows each
  output storage until it is freed), for the transient peaks.

Parameter gradients are dropped as soon as they are accumulated: the gradient
state is the cost model's to count, not the activations'. Which node's backward
made each one is recorded (bwd_param_grads), for the gradients a runtime holds
until its unit's backward ends (passes/blocks.py, Block.bwd_peak_grad_numel), and
how many of the bytes a node's backward holds at the moments it may peak are
gradients (bwd_moments): those do not grow with the batch.
"""

import itertools
import math
import weakref
from typing import cast

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import (
    FlopCounterMode,
    flop_registry,
    sdpa_backward_flop_count,
    sdpa_flop_count,
    shape_wrapper,
)

from shardplan.frontend.capture import AUTOGRAD_FUNCTION
from shardplan.frontend.chain import OpKind
from shardplan.frontend.passes.facts import SelectiveCall, update_facts
from shardplan.plan import kept_by_selective


class _LiveStorages(TorchDispatchMode):
    """Follows every storage an op allocates until it is freed; `live_bytes` is their sum.

    A storage's Python object lives exactly as long as the storage (PyTorch
    preserves it while C++ holds a reference, e.g. autograd's saved tensors),
    so a finalizer on it marks the free at O(1) cost.
    """

    def __init__(self, ignored: set):
        super().__init__()
        self.ignored = ignored
        """Storage keys never counted: parameters, buffers, inputs."""
        self.tracked: dict[StorageWeakRef, int] = {}
        """Each live storage → its serial number (a key may be reused once its storage is freed; a serial is not)."""
        self.serials = itertools.count()
        self.live_bytes = 0
        self.peak_bytes = 0
        """Highest live_bytes since the last `reset_peak`."""
        self.events: list[tuple[int, int]] | None = None
        """Where set: (serial, +bytes) per storage allocated, (serial, -bytes) per storage freed, and (-1, 0)
        after each op, when the peak is read."""

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    def serial(self, storage) -> int | None:
        """The serial number of a live storage it follows (None: not followed)."""
        return self.tracked.get(StorageWeakRef(storage))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                key = StorageWeakRef(storage)
                if key not in self.tracked and key not in self.ignored:
                    serial = self.tracked[key] = next(self.serials)
                    self.live_bytes += storage.nbytes()
                    if self.events is not None:
                        self.events.append((serial, storage.nbytes()))
                    weakref.finalize(storage, self._free, key, serial, storage.nbytes())
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        if self.events is not None:
            self.events.append((-1, 0))
        return out

    def _free(self, key: StorageWeakRef, serial: int, size: int) -> None:
        if self.tracked.get(key) == serial:
            del self.tracked[key]
        self.live_bytes -= size
        if self.events is not None:
            self.events.append((serial, -size))


def peak_moments(events: list[tuple[int, int]], grads: set[int]) -> tuple[tuple[int, int], ...]:
    """(parameter gradients, other bytes) held above the start, after the op where the events peak, where
    they hold the most gradients, and where they hold the most of the rest: the moments that can peak at
    another batch, whose gradients stay while the rest grows with it (a head's loss backward holds the
    logits' gradient, its weight gradient comes later). A storage freed that was allocated before the
    events began is not a gradient."""
    allocated: set[int] = set()
    held_grads = held_other = 0
    moments = [(0, 0)]
    for serial, change in events:
        if serial < 0:
            moments.append((held_grads, held_other))
            continue
        if change > 0:
            allocated.add(serial)
        if serial in grads and serial in allocated:
            held_grads += change
        else:
            held_other += change
    return may_peak(moments)


def may_peak(moments: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Of (parameter gradients, other bytes) moments, those that may peak at another batch: the one holding
    the most, the one holding the most gradients, the one holding the most of the rest."""
    return tuple(
        dict.fromkeys(
            (max(moments, key=sum), max(moments), max(moments, key=lambda held: (held[1], held[0])))
        )
    )


def _cpu_attention_flops(
    query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs
) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_attention_backward_flops(
    grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs
) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


def _grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """2·M·N·K summed over the groups, which split one dimension of a 2-D operand (the routed rows,
    sorted by expert, for the forward of a mixture of experts). The sum over the groups is the whole
    dimension, so the offsets' values, unknown under fake tensors, are not needed: every row is priced
    as routed, as transformers routes every token to its top-k experts (no capacity drops them; only
    expert parallelism's rows for other ranks' experts, past the last offset, would be overpriced)."""
    if (
        len(a_shape) == 3 and len(b_shape) == 2
    ):  # the groups split b's columns: out is (M, all columns)
        return 2 * out_shape[0] * out_shape[1] * a_shape[-1]
    return 2 * math.prod(a_shape) * b_shape[-1]  # a's rows are every group's (or G batches of them)


def _grouped_mm_fallback_backward_flops(
    input_shape, weight_shape, offs_shape, grad_out_shape, *args, out_shape=None, **kwargs
) -> int:
    return 2 * _grouped_mm_flops(input_shape, weight_shape)  # the input's gradient and the weight's


_aten = torch.ops.aten
EXTRA_FLOP_FORMULAS = {
    "aten::_scaled_dot_product_flash_attention_for_cpu": _cpu_attention_flops,
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward": _cpu_attention_backward_flops,
    "aten::_grouped_mm": _grouped_mm_flops,
    "transformers::grouped_mm_fallback": _grouped_mm_flops,
    "transformers::grouped_mm_fallback_backward": _grouped_mm_fallback_backward_flops,
}
"""FLOP formulas torch's FlopCounterMode lacks (2.13), by qualified op name: the attention kernels
eager CPU runs, counted as torch counts their CUDA twins (without them a CPU transformer's attention
had no FLOPs and was priced as a memory-bound op, ~5x faster than it runs); the grouped matmuls of
routed experts, which transformers 5 runs eagerly as `_grouped_mm` and, captured by export (float32),
as its own custom ops (without them every expert matmul, forward and backward, counted 0 FLOPs)."""


GROUPED_MATMULS = {"grouped_mm_fallback": 1, "grouped_mm_fallback_backward": 2}
"""Grouped matmuls that run as a loop of `mm`, one per group (per expert: its routed rows), and how many
`mm` per group: transformers' fallback ops, which export captures (float32) where eager runs ATen's
`_grouped_mm`, on CPU the same loop (measured: 4 experts, 24 `mm` a layer's step). The analysis counts
them as those `mm` calls (its offsets' length the groups, the rows split evenly), so each is priced
at the size it runs, with `mm`'s measured factor and fixed cost: as one matmul of every group's rows
a Mixtral-like model's experts were predicted 8% faster than they ran."""


def op_flops(func, args: tuple, kwargs: dict | None, out) -> int:
    """FLOPs of one op by torch's formula (or EXTRA_FLOP_FORMULAS), 0 for an op without one:
    what FlopCounterMode counts for an op it need not decompose."""
    formula = flop_registry.get(func.overloadpacket)
    if formula is None and (
        extra := EXTRA_FLOP_FORMULAS.get(f"{func.namespace}::{func.overloadpacket.__name__}")
    ):
        formula = shape_wrapper(extra)
    return 0 if formula is None else formula(*args, **(kwargs or {}), out_val=out)


SDPA_LAYOUT_ATTENTION = (
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_cudnn_attention_backward",
)
"""ATen's attention ops (namespace aten) whose `query` and `key` are laid out (batch, heads, sequence, head dim), as
scaled_dot_product_attention takes them, and that take `is_causal`: the ones op_masked_flops reads. Not the
kernels under them, such as `_flash_attention_forward`, which lay q out (batch, sequence, heads, head dim)."""


def _sdpa_arguments(func, args: tuple, kwargs: dict | None) -> dict | None:
    """An SDPA_LAYOUT_ATTENTION op's arguments by name; None for any other op."""
    if func.namespace != "aten" or func.overloadpacket.__name__ not in SDPA_LAYOUT_ATTENTION:
        return None
    return dict(zip((argument.name for argument in func._schema.arguments), args)) | (kwargs or {})


def op_head_dim_flops(func, args: tuple, kwargs: dict | None, flops: int) -> int:
    """An attention op's `flops` times its head dim (OpKind.head_dim_flops): its query's last dim, for an op of
    SDPA_LAYOUT_ATTENTION. 0 for any other op."""
    values = _sdpa_arguments(func, args, kwargs)
    return flops * values["query"].shape[-1] if values and flops else 0


def op_masked_flops(func, args: tuple, kwargs: dict | None, flops: int) -> int:
    """Of an op's `flops`, those a causal mask hides (OpKind.masked_flops): for an attention op of
    SDPA_LAYOUT_ATTENTION called with `is_causal`, the share of its scores above the diagonal (torch's mask
    keeps query row i the keys 0..i), every product it counts (QK^T, PV and their gradients) being one per
    score. 0 for any other op."""
    values = _sdpa_arguments(func, args, kwargs)
    if not flops or not values or not values.get("is_causal"):
        return 0
    rows, keys = values["query"].shape[-2], values["key"].shape[-2]
    diagonal = min(rows, keys)
    kept = (
        diagonal * (diagonal + 1) // 2 + (rows - diagonal) * keys
    )  # rows past the last key keep them all
    return flops * (rows * keys - kept) // (rows * keys)


def flop_counter() -> FlopCounterMode:
    """FlopCounterMode with EXTRA_FLOP_FORMULAS: what the analysis counts, for checks against eager.
    transformers' ops join once transformers has registered them (a model of it was built)."""
    packets: dict = {}
    for name, formula in EXTRA_FLOP_FORMULAS.items():
        namespace, op = name.split("::")
        packet = getattr(getattr(torch.ops, namespace), op, None)
        if packet is not None:
            packets[packet] = formula
    return FlopCounterMode(display=False, custom_mapping=packets)


GATHER_OPS = {_aten.embedding: 0, _aten.index_select: 0, _aten.gather: 0}
"""Ops that read only some rows of one input (position given): an embedding lookup reads the rows
it gathers, as many bytes as it writes, not its whole table."""


def is_dispatch(func) -> bool:
    """Whether an op a mode sees is one the model dispatched: not a metadata query (`prim` ops such as
    tensor.device, which modes see for fake tensors' own queries too)."""
    return func.namespace != "prim"


def is_kernel(func) -> bool:
    """Whether a dispatched op runs a kernel: not a view, not a metadata query."""
    return not func.is_view and is_dispatch(func)


class _Tally:
    """What the ops of one node's forward (or backward) did, by op name."""

    def __init__(self) -> None:
        self.kinds: dict[str, OpKind] = {}
        """Op name → its calls so far, summed."""
        self.selective_calls: list[tuple[OpKind, int, list[StorageWeakRef]]] = []
        """(op kind, output bytes, output storages) of each call of the ops selective checkpointing keeps
        (plan.SELECTIVE_SAVED_OPS), in order: storages, not the tensors, which holding would keep live."""
        self.dispatches = 0
        """Ops dispatched, views included (metadata queries not)."""

    def add(self, kind: OpKind) -> None:
        self.kinds[kind.name] = self.kinds[kind.name] + kind if kind.name in self.kinds else kind

    def op_kinds(self) -> tuple[OpKind, ...]:
        return tuple(self.kinds[name] for name in sorted(self.kinds))

    def facts(self, phase: str) -> dict:
        kinds = self.op_kinds()
        changes = {
            f"{phase}_kinds": kinds,
            f"{phase}_flops": sum(k.flops for k in kinds),
            f"{phase}_memory_bytes": sum(k.bytes for k in kinds if not k.flops),
            f"{phase}_ops": sum(k.calls for k in kinds),
        }
        if phase == "fwd":
            changes["fwd_dispatches"] = self.dispatches
        return changes


class _OpTally(TorchDispatchMode):
    """Adds every kernel's name, FLOPs (op_flops), bytes (moved_bytes) and the bytes of those that
    are parameters or buffers (`weights`, storages) to the tally of the node running (`tally`)."""

    def __init__(self, weights: set[StorageWeakRef]):
        super().__init__()
        self.weights = weights
        self.tally: _Tally | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tally = self.tally
        if tally is not None and is_dispatch(func):
            tally.dispatches += 1
        if tally is None or not is_kernel(func):
            return out
        name = func.overloadpacket.__name__
        matmuls = GROUPED_MATMULS.get(name)
        flops = op_flops(func, args, kwargs, out)
        kind = OpKind(
            name="mm" if matmuls else name,
            calls=matmuls * args[2].shape[0] if matmuls else 1,
            flops=flops,
            bytes=moved_bytes(func, args, kwargs, out),
            weight_bytes=moved_bytes(func, args, kwargs, out, only=self.weights),
            masked_flops=op_masked_flops(func, args, kwargs, flops),
            head_dim_flops=op_head_dim_flops(func, args, kwargs, flops),
        )
        tally.add(kind)
        if kept_by_selective(name):
            storages = [
                t.untyped_storage() for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)
            ]
            tally.selective_calls.append(
                (kind, sum(s.nbytes() for s in storages), [StorageWeakRef(s) for s in storages])
            )
        return out


def moved_bytes(
    func, args: tuple, kwargs: dict | None, out, only: set[StorageWeakRef] | None = None
) -> int:
    """Bytes an op reads and writes (those of `only` storages, when given).

    An op is taken to read its inputs and write its outputs once each, with two exceptions: a
    gather (GATHER_OPS) reads from its table only the rows it writes, and an op that returns an
    input's storage without mutating it (_unsafe_view: a view the dispatcher runs as an op) moves
    nothing. Matmul-like ops are priced by their FLOPs (op_flops), the rest by these bytes.
    """
    inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    outputs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    if not func._schema.is_mutable and _shares_storage(outputs, inputs):
        return 0
    table = GATHER_OPS.get(func.overloadpacket)
    if table is not None and table < len(args):
        inputs = [
            t
            for t in pytree.tree_leaves((args[:table] + args[table + 1 :], kwargs))
            if isinstance(t, torch.Tensor)
        ] + outputs  # the rows read, as many bytes as written
    tensors = inputs + outputs
    if only is not None:
        tensors = [t for t in tensors if StorageWeakRef(t.untyped_storage()) in only]
    return sum(t.numel() * t.element_size() for t in tensors)


def _shares_storage(outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> bool:
    storages = {StorageWeakRef(t.untyped_storage()) for t in inputs}
    return bool(outputs) and all(StorageWeakRef(t.untyped_storage()) in storages for t in outputs)


class _StorageIds:
    """Small stable integers for storages, in order of first sight (deterministic facts)."""

    def __init__(self) -> None:
        self.ids: dict[StorageWeakRef, int] = {}

    def __call__(self, tensor: torch.Tensor) -> int:
        return self.ids.setdefault(StorageWeakRef(tensor.untyped_storage()), len(self.ids))


class _FunctionCall:
    """The nodes one call of a model's own torch.autograd.Function traced into (capture's
    AUTOGRAD_FUNCTION tag), run as that Function: eager keeps what its forward saves and runs its
    backward, not the autograd of the ops its forward inlined into the graph."""

    def __init__(
        self,
        function,
        spec: tuple,
        members: list[torch.fx.Node],
        output: torch.fx.Node,
        tensors: list[torch.fx.Node],
    ):
        self.function, self.spec, self.members, self.output, self.tensors = (
            function,
            spec,
            members,
            output,
            tensors,
        )
        self.arguments: list = []

    def run(self, node: torch.fx.Node, env: dict):
        """The call's result at its output node; nothing at the nodes it replaces. Its tensor arguments
        are read at its first node (the interpreter drops a value after its last user runs)."""
        if node is self.members[0]:
            self.arguments = [env[tensor] for tensor in self.tensors]
        if node is not self.output:
            return None
        tensors, self.arguments = iter(self.arguments), []
        return self.function.apply(
            *(next(tensors) if _is_tensor_spec(arg) else arg for arg in self.spec)
        )


def _is_tensor_spec(arg) -> bool:
    """Whether `arg` of a tagged call's arguments stands for a tensor: its (shape, dtype)."""
    return isinstance(arg, tuple) and len(arg) == 2 and isinstance(arg[1], torch.dtype)


def _function_calls(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, _FunctionCall]:
    """Each tagged node → its call, for the calls that can run as their Function: one output node, and
    each tensor argument the one node outside the call of its shape and dtype (else the inlined ops run)."""
    groups: dict[int, list[torch.fx.Node]] = {}
    tags = {}
    for node in gm.graph.nodes:
        tag = node.meta.get("custom", {}).get(AUTOGRAD_FUNCTION)
        if tag is not None:
            groups.setdefault(tag[1], []).append(node)
            tags[tag[1]] = tag
    calls: dict[torch.fx.Node, _FunctionCall] = {}
    for number, members in groups.items():
        function, _, spec = tags[number]
        inside = set(members)
        outputs = [node for node in members if any(user not in inside for user in node.users)]
        outside = list(
            dict.fromkeys(
                arg for node in members for arg in node.all_input_nodes if arg not in inside
            )
        )
        matches = [
            [
                node
                for node in outside
                if isinstance(value := node.meta.get("val"), torch.Tensor)
                and (tuple(value.shape), value.dtype) == arg
            ]
            for arg in filter(_is_tensor_spec, spec)
        ]
        tensors = [found[0] for found in matches if len(found) == 1]
        if len(outputs) == 1 and len(tensors) == len(matches):
            call = _FunctionCall(function, spec, members, outputs[0], tensors)
            calls.update((node, call) for node in members)
    return calls


def annotate_execution_pass(gm: torch.fx.GraphModule, args: tuple, kwargs: dict) -> None:
    """Write out_bytes, fwd/bwd FLOPs, saved storages and live-byte marks on every node."""
    meta = _FakeState(gm)
    flat_inputs = [
        meta.stand_in(t) if isinstance(t, torch.Tensor) else t
        for t in _flatten_inputs(gm, args, kwargs)
    ]
    meta.ignored.update(
        StorageWeakRef(t.untyped_storage()) for t in flat_inputs if isinstance(t, torch.Tensor)
    )
    for node in (
        gm.graph.nodes
    ):  # stand-ins made before counting starts: making them is not the model's work
        if node.op == "get_attr":
            meta.tensor(node.target)
    live = _LiveStorages(meta.ignored)
    storage_id = _StorageIds()
    tally = _OpTally(weights={StorageWeakRef(t.untyped_storage()) for t in meta.tensors.values()})
    grad_fn_owner: dict[torch.autograd.graph.Node, torch.fx.Node] = {}
    current: list[torch.fx.Node] = []
    saved: dict[torch.fx.Node, dict[int, int]] = {}
    function_calls = _function_calls(gm)

    def pack(tensor: torch.Tensor):
        key = StorageWeakRef(tensor.untyped_storage())
        if current and key not in meta.ignored:
            saved.setdefault(current[-1], {})[storage_id(tensor)] = (
                tensor.untyped_storage().nbytes()
            )
        return tensor

    class Runner(torch.fx.Interpreter):
        def fetch_attr(self, target: str):
            return meta.tensor(target)

        def run_node(self, node):
            current.append(node)
            live.reset_peak()
            live_before = live.live_bytes
            tally.tally = _Tally()
            call = function_calls.get(node)
            result = super().run_node(node) if call is None else call.run(node, self.env)
            for tensor in pytree.tree_leaves(result):
                if isinstance(tensor, torch.Tensor) and tensor.grad_fn is not None:
                    grad_fn_owner.setdefault(tensor.grad_fn, node)
            outputs = {
                storage_id(t): t.untyped_storage().nbytes()
                for t in pytree.tree_leaves(result)
                if isinstance(t, torch.Tensor)
            }
            selective_calls = tuple(
                SelectiveCall(
                    kind=kind,
                    bytes=nbytes,
                    storages=tuple(
                        dict.fromkeys(storage_id.ids[ref] for ref in refs if ref in storage_id.ids)
                    ),
                )
                for kind, nbytes, refs in tally.tally.selective_calls
            )
            update_facts(
                node,
                **tally.tally.facts("fwd"),
                selective_calls=selective_calls,
                outputs=tuple(sorted(outputs.items())),
                out_bytes=max(live.live_bytes - live_before, 0),
                fwd_live_before_bytes=live_before,
                fwd_peak_live_bytes=live.peak_bytes,
                saved=tuple(sorted(saved.get(node, {}).items())),
            )
            current.pop()
            tally.tally = None
            return result

    # The fake mode is entered first so that it is innermost: the counting modes see each op before it.
    with meta.fake_mode:
        with tally, live, torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            outputs = Runner(gm).run(*flat_inputs)
        saved_ids = {sid for node_saved in saved.values() for sid in node_saved}
        returned = {
            storage_id(t): t.untyped_storage().nbytes()
            for t in pytree.tree_leaves(outputs)
            if isinstance(t, torch.Tensor)
        }
        output_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
        update_facts(
            output_node,
            out_bytes=sum(size for sid, size in returned.items() if sid not in saved_ids),
        )
        loss = _loss_of(outputs)
        _run_backward(loss, grad_fn_owner, tally, live, meta)


def _run_backward(loss, grad_fn_owner, ops: _OpTally, live: _LiveStorages, meta) -> None:
    """Backward on fake tensors; each autograd node's costs and live peak go to its fx node."""
    order: list[torch.fx.Node] = []
    tallies: dict[torch.fx.Node, _Tally] = {}
    marks: dict[torch.fx.Node, dict] = {}
    running: list = [None]  # the fx node whose backward runs now

    def close_running() -> None:
        node = running[0]
        if node is not None:
            marks[node]["bwd_peak_live_bytes"] = max(
                marks[node]["bwd_peak_live_bytes"], live.peak_bytes
            )

    def on_backward_start(node):
        def hook(grad_outputs):
            close_running()
            live.reset_peak()
            if node not in marks:
                order.append(node)
                tallies[node] = _Tally()
                marks[node] = {
                    "bwd_live_before_bytes": live.live_bytes,
                    "bwd_peak_live_bytes": live.live_bytes,
                }
                events[node] = []
            live.events = events[
                node
            ]  # a node's backward may run in several autograd nodes: one list
            running[0] = node
            ops.tally = tallies[node]

        return hook

    made: dict[torch.fx.Node, list[str]] = {}
    """Each node → the parameters whose gradients were accumulated while its backward ran."""
    events: dict[torch.fx.Node, list[tuple[int, int]]] = {}
    """Each node → what its backward allocated and freed (_LiveStorages.events)."""
    grad_serials: set[int] = set()
    """The storages that became parameter gradients."""

    def drop_grad(name: str):
        def hook(param: torch.Tensor) -> None:
            if running[0] is not None:
                made.setdefault(running[0], []).append(name)
            serial = live.serial(param.grad.untyped_storage()) if param.grad is not None else None
            if serial is not None:
                grad_serials.add(serial)
            param.grad = None

        return hook

    for grad_fn, node in grad_fn_owner.items():
        grad_fn.register_prehook(on_backward_start(node))
    for name, param in meta.params_requiring_grad():
        param.register_post_accumulate_grad_hook(drop_grad(name))
    with ops, live:
        loss.backward()
        close_running()
    ops.tally, live.events = None, None
    for position, node in enumerate(order):
        update_facts(
            node,
            bwd_order=position,
            bwd_param_grads=tuple(made.get(node, ())),
            **marks[node],
            bwd_moments=peak_moments(events[node], grad_serials),
            **tallies[node].facts("bwd"),
        )


class _FakeState:
    """Fake CPU stand-ins for the graph's parameters, buffers and inputs, made once each."""

    def __init__(self, gm: torch.fx.GraphModule):
        self.gm = gm
        self.fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
        self.tensors: dict[str, torch.Tensor] = {}
        self.ignored: set[StorageWeakRef] = set()
        """Storages that are not activations: parameters, buffers, inputs."""

    def stand_in(self, real: torch.Tensor, requires_grad: bool = False) -> torch.Tensor:
        with self.fake_mode:
            fake = torch.empty_strided(real.shape, real.stride(), dtype=real.dtype, device="cpu")
        if requires_grad:
            fake.requires_grad_(True)
        self.ignored.add(StorageWeakRef(fake.untyped_storage()))
        return fake

    def tensor(self, target: str) -> torch.Tensor | torch.nn.Module:
        if target not in self.tensors:
            real = self.gm
            for attr in target.split("."):
                real = getattr(real, attr)
            if not isinstance(real, torch.Tensor):
                return real  # a submodule, such as export's input-guard check
            trainable = isinstance(real, torch.nn.Parameter) and real.requires_grad
            self.tensors[target] = self.stand_in(real, requires_grad=trainable)
        return self.tensors[target]

    def params_requiring_grad(self) -> list[tuple[str, torch.Tensor]]:
        """(name, stand-in) of each trainable parameter."""
        return [(name, t) for name, t in self.tensors.items() if t.requires_grad]


def _flatten_inputs(gm: torch.fx.GraphModule, args: tuple, kwargs: dict) -> list:
    """The inputs in the order of the graph's placeholders."""
    info = getattr(gm.graph._codegen, "pytree_info", None)
    if info is not None and info.in_spec is not None:
        import torch.fx._pytree as fx_pytree

        return list(fx_pytree.tree_flatten_spec((tuple(args), kwargs), info.in_spec))
    return list(args) + list(kwargs.values())


def _loss_of(outputs) -> torch.Tensor:
    """The model's loss: its first scalar floating output; else the sum of its floating outputs."""
    leaves = [
        t for t in pytree.tree_leaves(outputs) if isinstance(t, torch.Tensor) and t.requires_grad
    ]
    scalars = [t for t in leaves if t.dim() == 0 and t.is_floating_point()]
    if scalars:
        return scalars[0]
    if not leaves:
        from shardplan.errors import CaptureError

        raise CaptureError("the model's outputs do not depend on any parameter: nothing to train")
    return cast(torch.Tensor, sum(t.float().sum() for t in leaves))  # leaves is not empty: never 0
