"""Group the annotated graph into a chain of blocks at module boundaries.

A block is what FSDP users wrap by hand: one element of a layer container
(`h.3`, `model.layers.12`), or one top-level module beside the layers (the
embedding, the final norm, the head). Blocks without parameters (a rotary
embedding, the loss) join their neighbour, so every block is worth a unit.
"""

import functools
import hashlib
import re
from dataclasses import dataclass
from typing import Any, NamedTuple

import networkx as nx
import torch
import torch.fx
import torch.utils._pytree as pytree

from shardplan.common.dtypes import dtype_bytes, dtype_name
from shardplan.frontend.chain import Block, BlockChain, InputSpec, OpKind, merge_op_kinds
from shardplan.frontend.passes.execution import may_peak
from shardplan.frontend.passes.facts import SelectiveCall, facts, is_compute, within_module
from shardplan.plan import ROUTED_EXPERT_PARAMETERS, alternated

_LAYER_INDEX = re.compile(r"^\d+$")


def block_name(module_path: str, outer_depth: int) -> str:
    """The layer a module belongs to (`h.3.attn.qkv` → `h.3`), else its ancestor at `outer_depth`."""
    parts = module_path.split(".") if module_path else []
    for depth, part in enumerate(parts):
        if _LAYER_INDEX.match(part):
            return ".".join(parts[: depth + 1])
    return ".".join(parts[:outer_depth])


def _outer_depth(paths) -> int:
    """Depth of the modules beside the layers: one less than the shallowest layer's depth."""
    depths = [len(block_name(path, 0).split(".")) for path in paths if block_name(path, 0)]
    return max(min(depths) - 1, 1) if depths else 1


@dataclass(slots=True)
class NodeGroup:
    """Consecutive nodes that will form one block."""

    name: str
    nodes: list[torch.fx.Node]
    modules: list[str]
    """Block-level module paths merged into this group ("" for the model's root is left out)."""


def group_nodes(gm: torch.fx.GraphModule) -> list[NodeGroup]:
    """Consecutive compute nodes with the same block name, parameterless groups merged into a neighbour."""
    compute = [n for n in gm.graph.nodes if is_compute(n)]
    depth = _outer_depth({facts(n).module_path for n in compute})
    groups: list[NodeGroup] = []
    for node in compute:
        name = block_name(facts(node).module_path, depth)
        if groups and groups[-1].name == name:
            groups[-1].nodes.append(node)
        else:
            groups.append(NodeGroup(name, [node], [name] if name else []))
    parameters = {name for name, _ in gm.named_parameters()}
    return _merge_parameterless(groups, parameters)


def _merge_parameterless(groups: list[NodeGroup], parameters: set[str]) -> list[NodeGroup]:
    """Groups that read no parameter of their own (buffers, tied weights read again) join a neighbour:
    the one before, or the first with parameters when nothing comes before."""
    seen: set[str] = set()
    merged: list[NodeGroup] = []
    pending: list[NodeGroup] = []
    for group in groups:
        own = {p for n in group.nodes for p in facts(n).param_names if p in parameters} - seen
        seen.update(own)
        if own and merged and merged[-1].name == group.name:
            _absorb(merged[-1], group)
        elif own:
            for earlier in reversed(pending):
                _absorb(group, earlier, before=True)
            pending = []
            merged.append(group)
        elif merged:
            _absorb(merged[-1], group)
        else:
            pending.append(group)
    if pending:
        merged.append(
            NodeGroup(
                "", [n for g in pending for n in g.nodes], [m for g in pending for m in g.modules]
            )
        )
    return merged


def _absorb(into: NodeGroup, group: NodeGroup, before: bool = False) -> None:
    into.nodes[:] = group.nodes + into.nodes if before else into.nodes + group.nodes
    modules = group.modules + into.modules if before else into.modules + group.modules
    into.modules[:] = list(dict.fromkeys(modules))


def build_chain(
    gm: torch.fx.GraphModule, inputs: tuple[InputSpec, ...], extra: dict[str, Any]
) -> BlockChain:
    """The BlockChain of an annotated graph (run the ownership and execution passes first)."""
    groups = group_nodes(gm)
    param_names = {name for name, _ in gm.named_parameters()}
    block_of = {node: index for index, group in enumerate(groups) for node in group.nodes}
    modules_of = block_modules(groups)
    owner_of: dict[str, int] = {}
    """Parameter → the first block reading it, which holds it."""
    tied_edges: set[tuple[int, int]] = set()
    """(i, j): block j reads a parameter block i holds (tied weights): a stage cut between them would
    need the parameter on two stages."""
    seen_saved: set[int] = set()
    kept_before: set[int] = set()
    """Storages earlier blocks keep when checkpointed (counted in the first that keeps them)."""
    flow = nx.DiGraph()
    flow.add_nodes_from(range(len(groups)))
    kept_of = [
        _kept_by_checkpoint(group.nodes, modules_of[index], block_of)
        for index, group in enumerate(groups)
    ]
    held = {sid for n in gm.graph.nodes for sid, _ in facts(n).saved} | {
        sid for kept in kept_of for sid in kept
    }
    """Storages something holds for backward: autograd's saved tensors, and the checkpointed modules' inputs."""
    storage_bytes = {
        sid: size for n in gm.graph.nodes for sid, size in (*facts(n).outputs, *facts(n).saved)
    }
    blocks = []
    for index, group in enumerate(groups):
        name, nodes = group.name, group.nodes
        read = list(dict.fromkeys(p for n in nodes for p in facts(n).param_names))
        reads = [p for p in read if p not in owner_of]
        tied_edges.update((owner_of[p], index) for p in read if p in owner_of and p in param_names)
        owner_of.update((p, index) for p in reads)
        tensors = {p: attribute_of(gm, p) for p in reads}
        saved = {sid: size for n in nodes for sid, size in facts(n).saved if sid not in seen_saved}
        seen_saved.update(saved)
        # a tensor an earlier block keeps too is one tensor, kept by that block when both are checkpointed
        # (an encoder's output read by every decoder layer, a position bias): count it there
        kept = kept_of[index]
        kept_here = {sid: size for sid, size in kept.items() if sid not in kept_before}
        kept_before.update(kept)
        for arg in {
            arg
            for n in nodes
            for arg in n.all_input_nodes
            if arg in block_of and block_of[arg] < index
        }:
            flow.add_edge(block_of[arg], index)
        outputs_read = _storages(
            n for n in nodes if any(block_of.get(u, index) > index for u in n.users)
        )
        alternate_calls, alternate_recomputes = _alternate(nodes, modules_of[index])
        selective, alternate = (
            _selective_keeps(
                nodes, modules_of[index], calls, kept, kept_here, saved, held, storage_bytes
            )
            for calls in ({n: facts(n).selective_calls for n in nodes}, alternate_calls)
        )
        expert_numel, expert_count, routed = _routed_experts(nodes, tensors)
        blocks.append(
            Block(
                index=index,
                name=name,
                modules=modules_of[index],
                param_names=tuple(p for p in reads if p in param_names),
                param_numel=sum(t.numel() for p, t in tensors.items() if p in param_names),
                param_bytes=sum(
                    t.numel() * t.element_size() for p, t in tensors.items() if p in param_names
                ),
                buffer_bytes=sum(
                    t.numel() * t.element_size() for p, t in tensors.items() if p not in param_names
                ),
                fwd_flops=sum(facts(n).fwd_flops for n in nodes),
                bwd_flops=sum(facts(n).bwd_flops for n in nodes),
                **{
                    name: sum(getattr(facts(n), name) for n in nodes)
                    for name in (
                        "fwd_memory_bytes",
                        "bwd_memory_bytes",
                        "fwd_ops",
                        "bwd_ops",
                        "fwd_dispatches",
                    )
                },
                selective_bytes=selective.bytes,
                selective_saved_bytes=selective.saved_bytes,
                selective_dropped_bytes=selective.dropped_bytes,
                alternate_bytes=alternate.bytes,
                alternate_saved_bytes=alternate.saved_bytes,
                alternate_dropped_bytes=alternate.dropped_bytes,
                alternate_recompute_kinds=alternate_recomputes,
                fwd_kinds=merge_op_kinds(facts(n).fwd_kinds for n in nodes),
                bwd_kinds=merge_op_kinds(facts(n).bwd_kinds for n in nodes),
                saved_bytes=sum(saved.values()),
                input_bytes=sum(kept_here.values()),
                output_bytes=outputs_read,
                fwd_transient_bytes=_fwd_transient(nodes),
                bwd_transient_bytes=_bwd_transient(nodes),
                recompute_transient_bytes=_fwd_transient(nodes, modules_of[index]),
                bwd_peaks=_bwd_peaks(nodes),
                bwd_peak_grad_numel=sum(
                    attribute_of(gm, p).numel()
                    for p in grads_live_at_bwd_peak(nodes)
                    if p in param_names
                ),
                first_node=nodes[0].name,
                last_node=nodes[-1].name,
                attention_kv_bytes=_attention_kv_bytes(nodes),
                expert_param_numel=expert_numel,
                routed_experts=expert_count,
                routed_elements=routed,
            )
        )
    dtypes = sorted({dtype_name(p.dtype) for p in gm.parameters()})
    return BlockChain(
        blocks=tuple(blocks),
        fingerprint=fingerprint(gm),
        param_dtype=dtypes[0] if dtypes else "",
        returned_bytes=facts(
            next(n for n in reversed(gm.graph.nodes) if n.op == "output")
        ).out_bytes,
        inputs=inputs,
        input_bytes=sum(_numel(s.shape) * dtype_bytes(s.dtype) for s in inputs),
        extra=dict(extra, nodes=len(gm.graph.nodes)),
        skip_edges=tuple(sorted((i, j) for i, j in flow.edges if j > i + 1)),
        tied_edges=tuple(sorted(tied_edges)),
    )


def _routed_experts(nodes: list[torch.fx.Node], tensors: dict[str, Any]) -> tuple[int, int, int]:
    """(parameters of the block's routed experts, ROUTED_EXPERT_PARAMETERS 3-D with the expert dim
    first; the fewest experts one of its modules holds; elements of the hidden states its forward
    routes to them). Each routed row costs 2 FLOPs per parameter of one expert in
    forward, so the experts' modules' forward FLOPs over that give the rows (tokens · top-k, as
    routed: no expert drops any), each `hidden` wide (the gate-up projection's input features)."""
    experts = {
        name.rsplit(".", 1)[0]: tensor
        for name, tensor in tensors.items()
        if name.rsplit(".", 1)[-1] == ROUTED_EXPERT_PARAMETERS[0] and tensor.dim() == 3
    }
    numel = sum(
        tensors[f"{module}.{name}"].numel()
        for module in experts
        for name in ROUTED_EXPERT_PARAMETERS
        if f"{module}.{name}" in tensors
    )
    routed = 0
    for module, gate_up in experts.items():
        count, _, hidden = gate_up.shape
        per_expert = sum(
            tensors[f"{module}.{name}"].numel() // count
            for name in ROUTED_EXPERT_PARAMETERS
            if f"{module}.{name}" in tensors
        )
        flops = sum(
            facts(n).fwd_flops for n in nodes if within_module(facts(n).module_path, module)
        )
        routed += flops // (2 * per_expert) * hidden
    return numel, min((gate_up.shape[0] for gate_up in experts.values()), default=0), routed


def _kept_by_checkpoint(
    nodes: list[torch.fx.Node], modules: tuple[str, ...], block_of: dict[torch.fx.Node, int]
) -> dict[int, int]:
    """The storages a checkpointed block keeps: the runtime checkpoints each of its modules' forwards on
    its own (runtime/activation_checkpoint.py), which keeps what that module's call reads from outside it
    (an earlier block's output, another of the block's modules'); the block's ops outside its modules (the
    model's root: a GPT's sum of its two embeddings, a loss) are not checkpointed and keep what autograd
    saves for them. An earlier block's output that only such an op reads (the token embedding's, read by
    that sum, which saves nothing) is not kept."""
    kept: dict[int, int] = {}
    for node in nodes:
        module = next((m for m in modules if within_module(facts(node).module_path, m)), None)
        if module is None:
            kept.update(facts(node).saved)
        else:
            kept.update(
                _outputs(
                    arg
                    for arg in node.all_input_nodes
                    if arg in block_of and not within_module(facts(arg).module_path, module)
                )
            )
    return kept


class SelectiveKeeps(NamedTuple):
    """What a selective mode keeps of a block (Block.selective_bytes, selective_saved_bytes,
    selective_dropped_bytes and their SELECTIVE_ALTERNATE counterparts)."""

    bytes: int
    saved_bytes: int
    dropped_bytes: int


def _selective_keeps(
    nodes: list[torch.fx.Node],
    modules: tuple[str, ...],
    calls: dict[torch.fx.Node, tuple[SelectiveCall, ...]],
    kept: dict[int, int],
    kept_here: dict[int, int],
    saved: dict[int, int],
    held: set[int],
    storage_bytes: dict[int, int],
) -> SelectiveKeeps:
    """What a selective mode keeps of a block whose checkpointed block keeps `kept` (`kept_here` counted in
    it), keeping the outputs of `calls` (each node's, in order)."""
    outputs = {sid for node in nodes for call in calls[node] for sid in call.storages}
    return SelectiveKeeps(
        # an output the block keeps as its input too (a root op's saved tensor: RoBERTa's head saves its
        # dense output for the GELU outside its modules) is one tensor, counted there
        bytes=sum(call.bytes for node in nodes for call in calls[node])
        - sum(size for sid, size in kept_here.items() if sid in outputs),
        saved_bytes=sum(size for sid, size in saved.items() if sid in outputs or sid in kept),
        dropped_bytes=_dropped_by_recompute(nodes, modules, calls, held, storage_bytes),
    )


def _alternate(
    nodes: list[torch.fx.Node], modules: tuple[str, ...]
) -> tuple[dict[torch.fx.Node, tuple[SelectiveCall, ...]], tuple[OpKind, ...]]:
    """(each node's selective calls SELECTIVE_ALTERNATE keeps, the op kinds of those it re-runs). Each call
    of one of the block's modules is checkpointed on its own, and counts its matmuls (plan.alternated) from 1
    in the order they run, keeping the odd ones (runtime/activation_checkpoint.py); a call is a run of
    consecutive nodes of the module. Ops outside the modules (the model's root) are not checkpointed: what
    selective checkpointing keeps of them is kept."""
    kept: dict[torch.fx.Node, tuple[SelectiveCall, ...]] = {}
    recomputed: list[OpKind] = []
    region, count = None, 0
    for node in nodes:
        module = next((m for m in modules if within_module(facts(node).module_path, m)), None)
        if module != region:
            region, count = module, 0
        keep = []
        for call in facts(node).selective_calls:
            if module is not None and alternated(call.kind.name):
                count += 1
                if count % 2 == 0:
                    recomputed.append(call.kind)
                    continue
            keep.append(call)
        kept[node] = tuple(keep)
    return kept, merge_op_kinds([recomputed])


def _dropped_by_recompute(
    nodes: list[torch.fx.Node],
    modules: tuple[str, ...],
    calls: dict[torch.fx.Node, tuple[SelectiveCall, ...]],
    held: set[int],
    storage_bytes: dict[int, int],
) -> int:
    """Bytes of the outputs of `calls` a selective mode keeps that nothing `held` holds (autograd does not
    save them: a Llama layer's query and key projections, which the rotary embedding reads, its output
    projection, which the residual add reads; the attention scores a node's math attention makes inside
    it, Falcon's), and that the recompute replays: it takes them out of the checkpoint's cache to re-run
    their readers, and drops them. torch.utils.checkpoint (non-reentrant, with early stop) re-runs a
    module's forward until it saves the last tensor its forward saved: a matmul saves its inputs before it
    runs, so the op that saves last is not replayed, nor is any op after it (the down projection, whose
    output only the residual add after it reads, stays in the cache until the module's backward ends)."""
    dropped: dict[int, int] = {}
    inside = 0
    """Kept outputs no node outputs or saves (`storage_bytes` names none of them): each node's own."""
    for module in modules:
        region = [node for node in nodes if within_module(facts(node).module_path, module)]
        replayed = max((i for i, node in enumerate(region) if facts(node).saved), default=0)
        for node in region[:replayed]:
            for call in calls[node]:
                named = {sid: storage_bytes[sid] for sid in call.storages if sid in storage_bytes}
                dropped.update((sid, size) for sid, size in named.items() if sid not in held)
                inside += call.bytes - sum(named.values())
    return sum(dropped.values()) + inside


def _attention_kv_bytes(nodes) -> int:
    """Bytes of the keys and values (arguments 1 and 2) of the attention nodes among `nodes`."""
    return sum(
        tensor.numel() * tensor.element_size()
        for node in nodes
        if node.target is torch.ops.aten.scaled_dot_product_attention.default
        for tensor in (argument.meta.get("val") for argument in node.args[1:3])
        if isinstance(tensor, torch.Tensor)
    )


def block_modules(groups: list[NodeGroup]) -> list[tuple[str, ...]]:
    """Each block's modules, leaving out ancestors of blocks (`transformer` holds `transformer.h.0`)
    and modules already listed by an earlier block (one module called from two places)."""
    names = [g.name for g in groups]
    taken: set[str] = set()
    result = []
    for group in groups:
        own = [
            m
            for m in group.modules
            if m not in taken and not any(other.startswith(m + ".") for other in names)
        ]
        taken.update(own)
        result.append(tuple(own))
    return result


def attribute_of(module: torch.nn.Module, target: str) -> Any:
    """The parameter, buffer or tensor at dotted name `target`; None if there is none."""
    try:
        return functools.reduce(getattr, target.split("."), module)
    except AttributeError:
        return None


def _storages(nodes) -> int:
    """Bytes of the distinct storages behind these nodes' outputs (views of one tensor count once)."""
    return sum(_outputs(nodes).values())


def _outputs(nodes) -> dict[int, int]:
    """The distinct storages behind these nodes' outputs: id -> bytes."""
    return dict(output for node in nodes for output in facts(node).outputs)


def _fwd_transient(nodes, modules: tuple[str, ...] | None = None) -> int:
    """The forward's peak above the block's start, over every node or over those of `modules`."""
    start = facts(nodes[0]).fwd_live_before_bytes
    ran = [
        n
        for n in nodes
        if modules is None or any(within_module(facts(n).module_path, m) for m in modules)
    ]
    return max(max((facts(n).fwd_peak_live_bytes for n in ran), default=start) - start, 0)


def _bwd_transient(nodes) -> int:
    peak = bwd_peak_node(nodes)
    if peak is None:
        return 0
    first = min((n for n in nodes if facts(n).bwd_order >= 0), key=lambda n: facts(n).bwd_order)
    return max(facts(peak).bwd_peak_live_bytes - facts(first).bwd_live_before_bytes, 0)


def _bwd_peaks(nodes) -> tuple[tuple[int, int], ...]:
    """The block's backward moments that may peak (Block.bwd_peaks), above the block's start: of every
    node's (NodeFacts.bwd_moments), the one holding the most, the most gradients, the most of the rest."""
    ran = [node for node in nodes if facts(node).bwd_order >= 0]
    if not ran:
        return ()
    start = facts(min(ran, key=lambda n: facts(n).bwd_order)).bwd_live_before_bytes
    moments = [
        (grads, other + facts(node).bwd_live_before_bytes - start)
        for node in ran
        for grads, other in facts(node).bwd_moments
    ]
    return may_peak(moments) if moments else ()


def bwd_peak_node(nodes: list[torch.fx.Node]) -> torch.fx.Node | None:
    """The node whose backward peaks the live bytes of these nodes' backward (None: none has a backward)."""
    ran = [node for node in nodes if facts(node).bwd_order >= 0]
    return max(ran, key=lambda node: facts(node).bwd_peak_live_bytes) if ran else None


def grads_live_at_bwd_peak(nodes: list[torch.fx.Node]) -> tuple[str, ...]:
    """The parameters whose gradients these nodes' backward made before the node where it peaks
    (bwd_peak_node), in the order made: the analysis dropped them as made, and the runtime holds them
    until its unit's backward ends ([Note: gradients in backward] in cost.py). The peak node's own
    gradients are in its live bytes."""
    peak = bwd_peak_node(nodes)
    if peak is None:
        return ()
    before = sorted(
        (node for node in nodes if 0 <= facts(node).bwd_order < facts(peak).bwd_order),
        key=lambda node: facts(node).bwd_order,
    )
    return tuple(dict.fromkeys(name for node in before for name in facts(node).bwd_param_grads))


def fingerprint(gm: torch.fx.GraphModule) -> str:
    """Hash of the graph's ops, wiring, owning modules and tensor shapes: stable across runs and ranks.

    Constant arguments are hashed too (devices aside). Wiring is hashed by position, not by node
    name, and attributes other than parameters and
    buffers (export's submodules and lifted constants, numbered by export) by kind: a graph spliced
    from a representative block's copies (passes/splice.py) hashes as the whole-model export does."""
    digest = hashlib.sha256()
    state = {
        name
        for name, _ in [
            *gm.named_parameters(remove_duplicate=False),
            *gm.named_buffers(remove_duplicate=False),
        ]
    }
    position: dict[torch.fx.Node, int] = {}
    for index, node in enumerate(gm.graph.nodes):
        position[node] = index
        value = node.meta.get("val")
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else None
        target = node.target if node.op != "get_attr" or node.target in state else "attribute"
        constants = [
            repr(value)
            for value in pytree.tree_leaves((node.args, node.kwargs))
            if _hashed_constant(value)
        ]
        digest.update(
            repr(
                (
                    node.op,
                    str(target),
                    facts(node).module_path,
                    [position[a] for a in node.all_input_nodes],
                    shape,
                    constants,
                )
            ).encode()
        )
    for name, param in sorted(gm.named_parameters()):
        digest.update(repr((name, tuple(param.shape), str(param.dtype))).encode())
    return f"{FINGERPRINT_VERSION}-{digest.hexdigest()[:16]}"


FINGERPRINT_VERSION = "g2"
"""Names how `fingerprint` hashes: a plan whose fingerprint another version made (unprefixed: before
positions and constants were hashed) is told to re-plan, not that it is for another model."""


_DEVICE_NAME = re.compile(r"^(cpu|meta|cuda|mps|xpu)(:\d+)?$")


def _hashed_constant(value) -> bool:
    """A constant argument the fingerprint hashes (a scale, an eps, a dim): not a node, and not a
    device, which differs between the model planned on the meta device and the one run."""
    return not isinstance(value, (torch.fx.Node, torch.device)) and not (
        isinstance(value, str) and _DEVICE_NAME.match(value)
    )


def _numel(shape) -> int:
    total = 1
    for size in shape:
        total *= size
    return total
