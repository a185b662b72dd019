"""Copies of a repeated block (repeats.py) in the analysis: run as stand-ins, then spliced back.

Fake execution (execution.py) runs each representative op by op where it sits in the model, and each
copy as one stand-in op that does at the block's boundary what its representative did there:
it allocates outputs of the same storage sizes, keeps for backward the same inputs and outputs plus
one buffer as large as everything else the representative saved, and in backward returns a gradient
for every input that needs one. So every node outside the copies sees the memory it would see in a
full analysis. `splice_copies` then puts in place of each stand-in a copy of its representative's
nodes, renamed to the copy's module and parameter names, with the representative's facts: the same
kernels and FLOPs, its storages renumbered (its inputs' and outputs' as the copy's, the others new),
its live bytes moved to where the copy's block began. The result is the graph a whole-model export
gives, node for node, annotated as a full analysis annotates it.
"""

import operator
from dataclasses import dataclass, replace

import torch
import torch.fx

from shardplan.frontend.passes.export_names import name_as_export
from shardplan.frontend.passes.facts import KEY, NodeFacts, facts, is_compute, within_module
from shardplan.frontend.passes.ownership import stack_path
from shardplan.frontend.repeats import Copy, RepeatedCapture, Representative

_COPY_STORAGE_STRIDE = 10**7
"""Storage ids of a copy's own storages: (copy's call + 1) × this + the representative's id (a
graph's own ids are counted from 0, far below)."""


def is_copy(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and (
        node.target is torch.ops.shardplan.repeated_block.default
        or isinstance(node.target, StandIn)
    )


def members(gm: torch.fx.GraphModule, path: str) -> list[torch.fx.Node]:
    """The nodes traced inside the module at `path`, in graph order."""
    return [
        node
        for node in gm.graph.nodes
        if node.op in ("call_function", "call_method", "call_module", "get_attr")
        and within_module(stack_path(node), path)
    ]


def install_stand_ins(gm: torch.fx.GraphModule, repeated: RepeatedCapture | None) -> None:
    """Make every copy's node run a StandIn (run the ownership pass first)."""
    if repeated is None or not repeated.copies:
        return
    by_name = {node.name: node for node in gm.graph.nodes}
    copies = {copy.call: copy for copy in repeated.copies}
    rep_members = {path: members(gm, path) for path in repeated.representatives}
    trainable = {name for name, parameter in gm.named_parameters() if parameter.requires_grad}
    get_attrs = {node.target: node for node in gm.graph.nodes if node.op == "get_attr"}
    for node in [n for n in gm.graph.nodes if is_copy(n)]:
        copy = copies[node.args[1]]
        representative = repeated.representatives[copy.representative]
        anchor = next(
            (
                get_attrs[name]
                for name in sorted(trainable)
                if name.startswith(copy.path + ".") and name in get_attrs
            ),
            None,
        )
        node.target = StandIn(representative, copy, rep_members[representative.path], by_name)
        node.args = (node.args[0], node.args[1], anchor)


@dataclass(frozen=True, kw_only=True, slots=True)
class _Boundary:
    """What a representative did at its boundary, read off its facts once it ran."""

    saved_inputs: tuple[int, ...]
    saved_outputs: tuple[int, ...]
    """Positions among the stand-in's own outputs."""
    other_saved_bytes: int
    outputs: tuple[tuple[torch.Size, tuple[int, ...], int, torch.dtype, int], ...]
    """(shape, stride, storage offset, dtype, storage bytes) of the stand-in's own outputs."""


class StandIn:
    """Runs one copy in the fake execution, as its representative behaved at its boundary."""

    def __init__(
        self,
        representative: Representative,
        copy: Copy,
        rep_members: list[torch.fx.Node],
        by_name: dict[str, torch.fx.Node],
    ):
        self.representative, self.copy = representative, copy
        self.rep_members = rep_members
        self.inputs = [by_name[name] for name in representative.inputs]
        passed = dict(copy.passed_through)
        self.outputs = [
            by_name[name] for i, name in enumerate(representative.outputs) if i not in passed
        ]
        self.boundary: _Boundary | None = None

    def __repr__(self) -> str:  # how the node's target prints
        return f"repeated_block[{self.copy.path} as {self.representative.path}]"

    def __call__(
        self, inputs: list[torch.Tensor], call: int, anchor: torch.Tensor | None
    ) -> list[torch.Tensor]:
        if self.boundary is None:  # the representative ran before every copy of it
            self.boundary = self._read_boundary()
        own = _StandInFunction.apply(self, anchor, *inputs)
        own = iter(own)
        passed = dict(self.copy.passed_through)
        return [
            inputs[passed[i]] if i in passed else next(own)
            for i in range(len(self.representative.outputs))
        ]

    def _read_boundary(self) -> _Boundary:
        saved = {sid: size for node in self.rep_members for sid, size in facts(node).saved}
        input_ids = [_only_storage(node) for node in self.inputs]
        output_ids = [_only_storage(node) for node in self.outputs]
        output_bytes = {sid: size for node in self.outputs for sid, size in facts(node).outputs}
        others = sum(
            size for sid, size in saved.items() if sid not in input_ids and sid not in output_ids
        )
        return _Boundary(
            saved_inputs=tuple(i for i, sid in enumerate(input_ids) if sid in saved),
            saved_outputs=tuple(
                j for j, sid in enumerate(output_ids) if sid in saved and sid not in input_ids
            ),
            other_saved_bytes=others,
            outputs=tuple(
                (
                    value.shape,
                    tuple(value.stride()),
                    value.storage_offset(),
                    value.dtype,
                    output_bytes[sid],
                )
                for node, sid in zip(self.outputs, output_ids)
                for value in [node.meta["val"]]
            ),
        )


def _only_storage(node: torch.fx.Node) -> int:
    """The storage id of a node's one tensor; -1 (no storage's) for a graph input, which has no facts."""
    outputs = facts(node).outputs
    return outputs[0][0] if len(outputs) == 1 else -1


class _StandInFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, stand_in: StandIn, anchor, *inputs):
        boundary = stand_in.boundary
        assert boundary is not None  # StandIn.__call__ read it
        outputs = []
        for shape, stride, offset, dtype, storage_bytes in boundary.outputs:
            storage = torch.empty(-(-storage_bytes // dtype.itemsize), dtype=dtype)
            outputs.append(storage.as_strided(shape, stride, offset))
        kept = [inputs[i] for i in boundary.saved_inputs] + [
            outputs[j] for j in boundary.saved_outputs
        ]
        if boundary.other_saved_bytes:
            kept.append(torch.empty(boundary.other_saved_bytes, dtype=torch.uint8))
        ctx.save_for_backward(*kept)
        ctx.mark_non_differentiable(
            *(t for t, grad in zip(outputs, stand_in.copy.differentiable) if not grad)
        )
        ctx.input_shapes = [(t.shape, t.dtype) for t in inputs]
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        needs = ctx.needs_input_grad[2:]
        return (
            None,
            None,
            *(
                torch.empty(shape, dtype=dtype) if need else None
                for need, (shape, dtype) in zip(needs, ctx.input_shapes)
            ),
        )


def splice_copies(gm: torch.fx.GraphModule, repeated: RepeatedCapture | None) -> None:
    """Replace every copy's node with its representative's nodes, renamed, with translated facts."""
    if repeated is None or not repeated.copies:
        return
    by_name = {node.name: node for node in gm.graph.nodes}
    get_attrs = {node.target: node for node in gm.graph.nodes if node.op == "get_attr"}
    rep_members = {path: members(gm, path) for path in repeated.representatives}
    earlier = {path: _storages_before(gm, nodes[0]) for path, nodes in rep_members.items()}
    copies = {copy.call: copy for copy in repeated.copies}
    backward_keys: dict[torch.fx.Node, tuple[int, int]] = {}
    before = list(gm.graph.nodes)
    spliced = {}
    for node in [n for n in before if is_copy(n)]:
        copy = copies[node.args[1]]
        representative = repeated.representatives[copy.representative]
        spliced[node] = _splice_one(
            gm,
            node,
            copy,
            representative,
            rep_members[representative.path],
            by_name,
            get_attrs,
            earlier[representative.path],
            backward_keys,
        )
    _renumber_backward(gm, backward_keys)
    state = {
        name
        for name, _ in [
            *gm.named_parameters(remove_duplicate=False),
            *gm.named_buffers(remove_duplicate=False),
        ]
    }
    name_as_export(before, spliced, state)


def _storages_before(gm: torch.fx.GraphModule, first: torch.fx.Node) -> set[int]:
    """Storages that existed before `first` ran: a copy shares them with its representative (a mask)."""
    found: set[int] = set()
    for node in gm.graph.nodes:
        if node is first:
            return found
        found.update(sid for sid, _ in facts(node).outputs)
    return found


def _splice_one(
    gm,
    node,
    copy: Copy,
    representative: Representative,
    rep_members,
    by_name,
    get_attrs,
    earlier: set[int],
    backward_keys,
) -> list[tuple[torch.fx.Node, torch.fx.Node]]:
    """Splice one copy in place of `node`; its (new node, representative's node) pairs, in order."""
    rep_inputs = [by_name[name] for name in representative.inputs]
    env: dict[torch.fx.Node, torch.fx.Node] = dict(zip(rep_inputs, node.args[0]))
    rename = _renamer(representative.path, copy.path)

    def mapped(value: torch.fx.Node) -> torch.fx.Node:
        if value not in env and value.op == "get_attr" and rename(value.target) != value.target:
            target = rename(value.target)
            if target not in get_attrs:
                with gm.graph.inserting_before(value):
                    get_attrs[target] = gm.graph.get_attr(target)
            env[value] = get_attrs[target]
        return env.get(value, value)  # anything else is shared with the rest of the model

    passed = dict(copy.passed_through)
    own_outputs = [
        by_name[name] for i, name in enumerate(representative.outputs) if i not in passed
    ]
    getitems = {user.args[1]: user for user in node.users if user.target is operator.getitem}
    translate = _FactTranslation(
        copy, rep_members, rep_inputs, node, own_outputs, getitems, earlier, rename
    )
    pairs = []
    with gm.graph.inserting_before(node):
        for member in rep_members:
            new = gm.graph.node_copy(member, mapped)
            env[member] = new
            pairs.append((new, member))
            stack = member.meta.get("nn_module_stack")
            if stack:
                new.meta["nn_module_stack"] = {
                    key: (rename(path), kind) for key, (path, kind) in stack.items()
                }
            if KEY in member.meta:
                new.meta[KEY], key = translate(facts(member))
                if key is not None:
                    backward_keys[new] = key
    for index, getitem in getitems.items():
        getitem.replace_all_uses_with(env.get(own_outputs[index], own_outputs[index]))
        gm.graph.erase_node(getitem)
    gm.graph.erase_node(node)
    return pairs


def _renamer(old: str, new: str):
    def rename(name):
        return (
            new + name[len(old) :] if isinstance(name, str) and within_module(name, old) else name
        )

    return rename


class _FactTranslation:
    """A representative's node facts as the copy's: names renamed, storages renumbered, live bytes
    moved from where the representative began to where the copy's stand-in began."""

    def __init__(
        self,
        copy: Copy,
        rep_members,
        rep_inputs,
        node,
        own_outputs,
        getitems,
        earlier: set[int],
        rename,
    ):
        self.rename = rename
        self.fresh = (copy.call + 1) * _COPY_STORAGE_STRIDE
        self.storage_map: dict[int, int] = {}
        for rep_input, copy_input in zip(rep_inputs, node.args[0]):
            self._map_storage(rep_input, copy_input)
        for index, getitem in getitems.items():
            self._map_storage(own_outputs[index], getitem)
        self.earlier = earlier
        computed = [facts(m) for m in rep_members if is_compute(m)]
        self.fwd_shift = facts(node).fwd_live_before_bytes - computed[0].fwd_live_before_bytes
        ran = [f for f in computed if f.bwd_order >= 0]
        own = facts(node)
        self.backward = own.bwd_order >= 0 and bool(ran)
        self.bwd_shift = (
            own.bwd_live_before_bytes - min(ran, key=lambda f: f.bwd_order).bwd_live_before_bytes
            if self.backward
            else 0
        )
        self.bwd_position = own.bwd_order

    def _map_storage(self, rep_node: torch.fx.Node, copy_node: torch.fx.Node) -> None:
        for (rep_sid, _), (copy_sid, _) in zip(facts(rep_node).outputs, facts(copy_node).outputs):
            self.storage_map.setdefault(rep_sid, copy_sid)

    def storage(self, sid: int) -> int:
        if sid in self.storage_map:
            return self.storage_map[sid]
        return sid if sid in self.earlier else self.fresh + sid

    def __call__(self, rep: NodeFacts) -> tuple[NodeFacts, tuple[int, int] | None]:
        ran = rep.bwd_order >= 0 and self.backward
        translated = replace(
            rep,
            module_path=self.rename(rep.module_path),
            param_names=tuple(map(self.rename, rep.param_names)),
            outputs=tuple((self.storage(sid), size) for sid, size in rep.outputs),
            saved=tuple((self.storage(sid), size) for sid, size in rep.saved),
            selective_calls=tuple(
                replace(call, storages=tuple(map(self.storage, call.storages)))
                for call in rep.selective_calls
            ),
            fwd_live_before_bytes=rep.fwd_live_before_bytes + self.fwd_shift,
            fwd_peak_live_bytes=rep.fwd_peak_live_bytes + self.fwd_shift,
            bwd_param_grads=tuple(map(self.rename, rep.bwd_param_grads)) if ran else (),
            bwd_moments=rep.bwd_moments if ran else (),
            bwd_order=rep.bwd_order if ran else -1,
            bwd_live_before_bytes=rep.bwd_live_before_bytes + self.bwd_shift if ran else 0,
            bwd_peak_live_bytes=rep.bwd_peak_live_bytes + self.bwd_shift if ran else 0,
        )
        return translated, ((self.bwd_position, rep.bwd_order) if ran else None)


def _renumber_backward(
    gm: torch.fx.GraphModule, copy_keys: dict[torch.fx.Node, tuple[int, int]]
) -> None:
    """Backward positions in one sequence again: a copy's nodes ran where its stand-in ran."""
    keys = dict(copy_keys)
    for node in gm.graph.nodes:
        if node not in keys and facts(node).bwd_order >= 0:
            keys[node] = (facts(node).bwd_order, -1)
    for position, node in enumerate(sorted(keys, key=keys.__getitem__)):
        node.meta[KEY] = replace(facts(node), bwd_order=position)
