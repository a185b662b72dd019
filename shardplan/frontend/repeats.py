"""Repeated blocks captured once: one torch.export of the model in which every copy of a block is one
opaque call, and only the first, second and last block of each class of equal blocks are traced.

A transformer's layers are one block repeated; tracing each costs export ~0.2 s at 7B shapes. Blocks
are the modules the chain groups by (the first numbered element of a container: `model.layers.12`).
Two calls are of one class when their modules have the same class, parameter and buffer names, shapes,
dtypes and requires_grad, and their inputs the same shapes, strides, dtypes, requires_grad and
non-tensor values. Structure alone cannot see an attribute that changes the computation (a layer
index choosing a sliding window), so each call also runs once, untraced, on meta tensors shaped as
its inputs and state, under a mode that hashes every ATen op with its operands' origins, shapes and
constants: equal hashes are the structural hash of the subgraph the call would capture. A call whose
class has its representative becomes `shardplan::repeated_block`, whose fake kernel returns outputs
shaped as the representative's; passes/splice.py later puts a renamed copy of the representative's
nodes (and facts) in its place.

The representative is a class's second call, and its first and last blocks are traced too: a block
sees the model around it, and only those differ from the middle ones. The first reads what comes
before the stack (the embedding's output, which may be read again later); the last is the last reader
of what every block reads (a mask, the encoder's output: freed there in forward) and the first to
send back a gradient for it (which the others add to).

Not reused, traced as usual: a module whose parameters or buffers are shared with another module (tied
weights), one holding batch norms in training (their running statistics are written in place), a call
with other non-tensor inputs than numbers, strings and None, one that cannot run on the meta device,
one returning a view of its input, or two outputs sharing storage. A model holding a
layer under two names (shared layers), or calling a block twice, is captured whole (capture.capture).
"""

import contextlib
import hashlib
import itertools
from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx.experimental import proxy_tensor
from torch.utils._python_dispatch import TorchDispatchMode

from shardplan.frontend.capture import Captured, export_program

_LAYER_INDEX_PART = str.isdigit
FEWEST_REUSED = 4
"""Blocks of one structure needed before any is a copy: the first, the representative, the last are
traced (see above). Fewer are captured as usual, at no extra cost."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Representative:
    """The first call of a class of equal blocks, traced op by op where it runs."""

    path: str
    """Module path, e.g. "model.layers.0"."""
    inputs: tuple[str, ...]
    """Graph node names of its tensor inputs, in the order of its flattened (args, kwargs)."""
    outputs: tuple[str, ...]
    """Graph node names of its tensor outputs, in the order of its flattened result."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Copy:
    """A later call of the same class: one `shardplan::repeated_block` node in the graph."""

    path: str
    representative: str
    call: int
    """The node's `call` argument: which copy it is."""
    passed_through: tuple[tuple[int, int], ...] = ()
    """(tensor output, tensor input) pairs where the block returns its input itself (T5's position
    bias): those outputs are not the node's; the input stands for them."""
    differentiable: tuple[bool, ...] = ()
    """Of the node's outputs, those that require grad."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RepeatedCapture:
    captured: Captured
    representatives: dict[str, Representative] = field(default_factory=dict)
    """Module path → the representative traced there."""
    copies: tuple[Copy, ...] = ()


@dataclass(frozen=True, slots=True)
class _TensorSpec:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool

    @staticmethod
    def of(tensor: torch.Tensor) -> "_TensorSpec":
        return _TensorSpec(
            tuple(tensor.shape),
            tuple(tensor.stride()),
            tensor.dtype,
            tensor.device,
            tensor.requires_grad,
        )


class _Session:
    """What one repeated capture learns while export runs: the classes met, each copy's outputs."""

    def __init__(self) -> None:
        self.representatives: dict[tuple, Representative] = {}
        self.copies: list[Copy] = []
        self.outputs: list[tuple[_TensorSpec, ...]] = []
        """The fake kernel's outputs of each copy (indexed by Copy.call)."""
        self.output_specs: dict[tuple, tuple[_TensorSpec, ...]] = {}
        """Each class's outputs as its representative's trace made them (not passed through)."""
        self.called: set[str] = set()
        self.called_twice = False
        self.calls: dict[tuple, int] = {}
        """Calls of each class so far."""


_ACTIVE: list[_Session] = []
"""The capture running now (the custom op's fake kernel and autograd read it); empty between captures."""


@torch.library.custom_op("shardplan::repeated_block", mutates_args=())
def repeated_block(inputs: list[torch.Tensor], call: int) -> list[torch.Tensor]:
    """A copy of a representative block, as one op. Only traced: the execution pass runs a stand-in
    (passes/splice.py) and the splice replaces it with the representative's nodes."""
    raise NotImplementedError(
        "shardplan::repeated_block is a capture placeholder; it never runs eagerly"
    )


@repeated_block.register_fake
def _repeated_block_fake(inputs, call):
    return [
        torch.empty_strided(s.shape, s.stride, dtype=s.dtype, device=s.device)
        for s in _ACTIVE[-1].outputs[call]
    ]


def _setup_context(ctx, inputs, output) -> None:
    specs = _ACTIVE[-1].outputs[inputs[1]]
    ctx.mark_non_differentiable(*(t for t, s in zip(output, specs) if not s.requires_grad))


def _backward(ctx, grads):
    raise NotImplementedError("shardplan::repeated_block is traced, never differentiated")


repeated_block.register_autograd(_backward, setup_context=_setup_context)


def candidate_blocks(model: torch.nn.Module) -> dict[str, tuple]:
    """Block modules that may be reused, by path → their structural key (class, parameters, buffers),
    in the model's order; only keys shared by FEWEST_REUSED blocks or more are kept."""
    owners: dict[int, set[str]] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name, tensor in itertools.chain(
            module.named_parameters(prefix, recurse=False, remove_duplicate=False),
            module.named_buffers(prefix, recurse=False, remove_duplicate=False),
        ):
            owners.setdefault(id(tensor), set()).add(name)
    paths: dict[int, list[str]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        paths.setdefault(id(module), []).append(path)
    if any(
        len(names) > 1 and any(map(_LAYER_INDEX_PART, ".".join(names).split(".")))
        for names in paths.values()
    ):
        return {}  # a layer under two names (shared layers): export's module paths there are not the model's
    keys: dict[str, tuple] = {}
    for path, module in model.named_modules():
        parts = path.split(".")
        numbered = [i for i, part in enumerate(parts) if _LAYER_INDEX_PART(part)]
        if not numbered or numbered[0] != len(parts) - 1:
            continue
        state = list(itertools.chain(module.named_parameters(path), module.named_buffers(path)))
        shared = any(owners[id(t)] != {name} for name, t in state)
        if shared or any(
            isinstance(m, torch.nn.modules.batchnorm._NormBase) and m.training
            for m in module.modules()
        ):
            continue
        keys[path] = (
            type(module).__qualname__,
            type(module).__module__,
            module.training,
            tuple((name[len(path) :], _TensorSpec.of(t)) for name, t in state),
        )
    counts: dict[tuple, int] = {}
    for key in keys.values():
        counts[key] = counts.get(key, 0) + 1
    return {path: key for path, key in keys.items() if counts[key] >= FEWEST_REUSED}


def capture_repeated(model: torch.nn.Module, args: tuple, kwargs: dict) -> RepeatedCapture | None:
    """Export `model` with every repeated block after the first of its class as one opaque call; None
    when no block repeats or export cannot capture it so (capture.capture then traces it whole)."""
    blocks = candidate_blocks(model)
    if not blocks:
        return None
    session = _Session()
    modules = dict(model.named_modules())
    last = {key: path for path, key in blocks.items()}
    with contextlib.ExitStack() as stack:
        for path, key in blocks.items():
            if last[key] != path:
                stack.enter_context(_calls_recorded(modules[path], path, key, session))
        _ACTIVE.append(session)
        stack.callback(_ACTIVE.pop)
        try:
            captured = export_program(model, args, kwargs)
        except Exception:  # capture.capture tries again without reuse, and explains a failure
            return None
    names = {node.name for node in captured.gm.graph.nodes}
    representatives = {rep.path: rep for rep in session.representatives.values()}
    if session.called_twice or not all(
        name in names for rep in representatives.values() for name in rep.inputs + rep.outputs
    ):
        return None
    return RepeatedCapture(
        captured=captured, representatives=representatives, copies=tuple(session.copies)
    )


@contextlib.contextmanager
def _calls_recorded(module: torch.nn.Module, path: str, key: tuple, session: _Session):
    """Route `module`'s calls through `_call` while the capture runs."""
    original = module.forward
    own = module.__dict__.get("forward")
    """An instance-level forward (a hook library's), put back after."""

    def forward(*args, **kwargs):
        return _call(module, original, path, key, session, args, kwargs)

    module.forward = forward
    try:
        yield
    finally:
        del module.forward
        if own is not None:
            module.forward = own


def _call(module, original, path: str, key: tuple, session: _Session, args: tuple, kwargs: dict):
    mode = proxy_tensor.get_proxy_mode()
    if mode is None:  # not under export's trace (the meta run below calls the module too)
        return original(*args, **kwargs)
    if path in session.called:
        session.called_twice = True
    session.called.add(path)
    leaves, tree = pytree.tree_flatten((args, kwargs))
    signature = _signature(leaves, tree)
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    if signature is None:
        return original(*args, **kwargs)
    try:
        digest, result, meta_inputs = _hashed_run(module, leaves, tree)
    except Exception:  # a block that cannot run on the meta device is traced as usual
        return original(*args, **kwargs)
    out_leaves, out_tree = pytree.tree_flatten(result)
    passed = _passed_through(
        [leaf for leaf in out_leaves if isinstance(leaf, torch.Tensor)], meta_inputs
    )
    class_key = (key, signature, digest)
    representative = session.representatives.get(class_key)
    if representative is None or passed is None:
        # Names now: an op returning its input itself (`x.to(x.dtype)`) moves the name to its node.
        input_names = tuple(_node_name(mode, t) for t in tensors)
        traced = original(*args, **kwargs)
        session.calls[class_key] = session.calls.get(class_key, 0) + 1
        if session.calls[class_key] == 2 and passed is not None:
            outputs = [t for t in pytree.tree_leaves(traced) if isinstance(t, torch.Tensor)]
            session.representatives[class_key] = Representative(
                path=path, inputs=input_names, outputs=tuple(_node_name(mode, t) for t in outputs)
            )
            session.output_specs[class_key] = tuple(
                _TensorSpec.of(t) for i, t in enumerate(outputs) if i not in passed
            )
        return traced
    specs = session.output_specs[class_key]
    call = len(session.copies)
    session.copies.append(
        Copy(
            path=path,
            representative=representative.path,
            call=call,
            passed_through=tuple(passed.items()),
            differentiable=tuple(s.requires_grad for s in specs),
        )
    )
    session.outputs.append(specs)
    produced = iter(repeated_block(tensors, call))
    tensor_at = iter(range(len(passed) + len(specs)))
    rebuilt = []
    for leaf in out_leaves:
        if isinstance(leaf, torch.Tensor):
            index = next(tensor_at)
            leaf = tensors[passed[index]] if index in passed else next(produced)
        rebuilt.append(leaf)
    return pytree.tree_unflatten(rebuilt, out_tree)


def _signature(leaves: list, tree) -> tuple | None:
    """The inputs' shapes, strides, dtypes, requires_grad and which share storage, with the
    non-tensor values; None when a non-tensor input is not a plain value."""
    storages: dict[int, int] = {}
    described: list[tuple] = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            storage = storages.setdefault(leaf.untyped_storage()._cdata, len(storages))
            described.append((_TensorSpec.of(leaf), leaf.storage_offset(), storage))
        elif leaf is None or isinstance(leaf, (bool, int, float, str)):
            described.append((type(leaf).__name__, leaf))
        else:
            return None
    return str(tree), tuple(described)


def _passed_through(
    outputs: list[torch.Tensor], inputs: list[torch.Tensor]
) -> dict[int, int] | None:
    """Output position → input position for outputs that are an input itself; None when an output
    shares storage with an input otherwise, or with another output."""
    by_identity = {id(t): i for i, t in enumerate(inputs)}
    input_storages = {t.untyped_storage()._cdata for t in inputs}
    passed, seen = {}, set()
    for index, tensor in enumerate(outputs):
        if id(tensor) in by_identity:
            passed[index] = by_identity[id(tensor)]
            continue
        storage = tensor.untyped_storage()._cdata
        if storage in input_storages or storage in seen:
            return None
        seen.add(storage)
    return passed


def _node_name(mode, tensor: torch.Tensor) -> str:
    slot = proxy_tensor.get_proxy_slot(tensor, mode.tracer, None)
    return "" if slot is None else slot.proxy.node.name


class _OpHash(TorchDispatchMode):
    """Hashes every op dispatched: its name, where each tensor operand comes from (an input, a
    parameter or buffer by name, an earlier op's output), shapes, strides, dtypes and constants."""

    def __init__(self, origins: dict[int, str]):
        super().__init__()
        self.origins = origins
        self.ops: list[tuple] = []
        """Per op: (op, its operands described, its outputs described); hashed once at the end."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outputs = pytree.tree_leaves(out)
        label = f"op{len(self.ops)}."
        for index, tensor in enumerate(outputs):
            if isinstance(tensor, torch.Tensor):
                self.origins[id(tensor)] = label + str(index)
        self.ops.append(
            (
                func,
                [self._describe(a) for a in pytree.tree_leaves((args, kwargs))],
                [self._describe(t) for t in outputs],
            )
        )
        return out

    def _describe(self, value):
        if isinstance(value, torch.Tensor):
            return (
                self.origins.get(id(value), "?"),
                tuple(value.shape),
                value.stride(),
                value.dtype,
            )
        return value

    def hexdigest(self) -> str:
        return hashlib.sha256(repr(self.ops).encode()).hexdigest()


def _hashed_run(
    module: torch.nn.Module, leaves: list, tree
) -> tuple[str, object, list[torch.Tensor]]:
    """(The op hash of one untraced run of the block on meta tensors shaped as its inputs and state,
    the run's result, its meta inputs). Meta, not export's fake tensors: an op costs a few
    microseconds instead of a millisecond."""
    with proxy_tensor.disable_proxy_modes_tracing(), unset_fake_temporarily():
        inputs = [_on_meta(leaf) for leaf in leaves if isinstance(leaf, torch.Tensor)]
        replaced = iter(inputs)
        args, kwargs = pytree.tree_unflatten(
            [next(replaced) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves], tree
        )
        state = {
            name: _on_meta(t)
            for name, t in itertools.chain(module.named_parameters(), module.named_buffers())
        }
        origins = {id(t): f"input{i}" for i, t in enumerate(inputs)}
        origins.update((id(t), name) for name, t in state.items())
        hasher = _OpHash(origins)
        with hasher:
            result = torch.func.functional_call(module, state, args, kwargs)
    return hasher.hexdigest(), result, inputs


def _on_meta(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(
        tensor.shape,
        tensor.stride(),
        dtype=tensor.dtype,
        device="meta",
        requires_grad=tensor.requires_grad,
    )
