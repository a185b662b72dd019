"""Tensor parallelism found in the graph: which linears shard Megatron-style, and at which degrees.

A pair is a group of column-parallel linears (q/k/v, gate/up, or one fused qkv sliced in its three
chunks) whose outputs flow, through ops that keep every feature apart from the others (elementwise
ops, views that split the features into heads, attention over those heads), into row-parallel
linears (o_proj, down_proj). Each tp rank then computes its slice of the features from the whole
input, and the row-parallel linear's partial products are summed over the ranks: one all-reduce in
forward and one in backward per pair (runtime/tensor_parallel.py), and nothing changes outside.

The search follows the output of every linear through the graph, in graph order, keeping the dim
that would be sharded. Outputs that meet (q, k and v in attention; gate and up in a product) join
one group. A group becomes a pair when every path from it ends in a linear that contracts the
sharded dim; any op that mixes the sharded features (a norm or reduction over them, a slice of
them, a sum with a whole tensor, the loss) rejects it, and the reason is kept. What must divide
by the tp degree (heads, kv heads, widths) is read off the graph, so one search answers every
degree: `TensorParallelCandidates.layout(degree)`.

Embeddings (vocab-parallel) and the LM head (column-parallel over the vocabulary) are candidates
with their sizes, sharded when the layout asks for it (`vocab_parallel=True`) and the degree
divides them; a table tied to another module's weight stays whole, with the reason. Sequence
parallelism (`sequence_parallel=True`) shards the activations between the pairs along the sequence:
the layers holding the pairs are named by `TensorParallelLayout.sequence_layers`.

>>> from shardplan.models import zoo
>>> entry = zoo.gpt(zoo.GPTConfig(n_layer=1))
>>> tensor_parallel_candidates(entry.model, entry.args, entry.kwargs).layout(2).styles
{'h.0.attn.qkv': 'colwise_fused(3)', 'h.0.attn.proj': 'rowwise', 'h.0.mlp.fc': 'colwise', 'h.0.mlp.proj': 'rowwise'}
"""

import enum
import operator
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.fx

from shardplan.errors import PlanError
from shardplan.frontend.chain import indivisible
from shardplan.frontend.passes.facts import facts
from shardplan.plan import KeptWhole

aten = torch.ops.aten


class Style(str, enum.Enum):
    """How one linear of a pair is sliced over the tp ranks."""

    COLWISE = "colwise"
    """Weight and bias sliced by output features: a rank computes its features from the whole input."""
    ROWWISE = "rowwise"
    """Weight sliced by input features: the ranks' partial products are summed (all-reduce); the bias
    stays whole and is added once, after the sum."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardedLinear:
    module: str
    """Module path of an nn.Linear, e.g. "h.3.attn.qkv"."""
    style: Style
    chunks: int = 1
    """A fused projection's equal chunks (qkv: 3): a colwise rank holds its slice of each chunk."""

    @property
    def label(self) -> str:
        """ "colwise", "colwise_fused(3)" or "rowwise"."""
        return f"colwise_fused({self.chunks})" if self.chunks > 1 else self.style.value


@dataclass(frozen=True, kw_only=True, slots=True)
class Divisor:
    """A size the tp degree must divide, and what it counts."""

    size: int
    what: str
    """e.g. "heads of h.0.attn.qkv", "kv heads of model.layers.0.self_attn.k_proj"."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorParallelPair:
    name: str
    """The module holding the pair's linears, e.g. "h.0.attn"."""
    linears: tuple[ShardedLinear, ...]
    """Column-parallel ones first, then row-parallel ones, each in graph order."""
    divisors: tuple[Divisor, ...]
    """Sizes the tp degree must divide: heads where the features split into heads, else widths."""

    def refusal(self, degree: int) -> str | None:
        """Why the pair cannot shard over `degree` ranks (None when it can)."""
        return indivisible(
            ((divisor.size, divisor.what) for divisor in self.divisors), degree, "this pair"
        )


class VocabKind(str, enum.Enum):
    EMBEDDING = "embedding"
    """A token embedding table: each rank holds vocab / tp rows, looks up the ids it holds, and the
    ranks' lookups are summed."""
    HEAD = "head"
    """The LM head: column-parallel over the vocabulary, its logits gathered before the model's loss, or
    read sharded by a loss the runtime computes on them (TensorParallelLayout.sharded_loss)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class VocabCandidate:
    """An embedding table (rows) or the LM head (output features) that could shard over the vocabulary."""

    module: str
    kind: VocabKind
    divisor: Divisor
    tied: str | None = None
    """Why it cannot shard (its weight is read elsewhere too); None when it can."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorParallelLayout:
    """What tensor parallelism over `degree` ranks shards, module by module; the rest stays whole on
    every tp rank, with equal gradients (see [Note: whole parameters under tensor parallelism] in
    runtime/tensor_parallel.py)."""

    degree: int
    pairs: tuple[TensorParallelPair, ...]
    """Applied: each rank holds 1/degree of these linears' weights."""
    replicated: tuple[str, ...]
    """Modules with parameters every tp rank holds whole, in the model's order (the row-parallel
    linears' biases are whole too, though their modules are sharded)."""
    rejected: tuple[KeptWhole, ...] = ()
    """Pairs found in the graph that stay replicated, each with the reason."""
    deferred: tuple[KeptWhole, ...] = ()
    """Embeddings and the LM head left whole, each with the reason (not asked for, indivisible, tied)."""
    vocab: tuple[VocabCandidate, ...] = ()
    """Embeddings and the LM head sharded over the vocabulary (only with vocab_parallel)."""
    sequence_parallel: bool = False
    """Activations between the pairs sharded along the sequence (dim 1) over the tp ranks."""
    sharded_loss: bool = False
    """The loss runs on the vocab-parallel head's slices of the logits, which are not gathered
    (frontend/sharded_loss.py says which losses can)."""

    @property
    def sequence_layers(self) -> tuple[str, ...]:
        """The layers (each pair's parent module, in order) whose input and output, under sequence
        parallelism, are sharded along the sequence: the sequence enters sharded at the first
        one and is gathered after the last."""
        return tuple(dict.fromkeys(pair.name.rpartition(".")[0] for pair in self.pairs))

    @property
    def head(self) -> str | None:
        """The module path of the LM head sliced over the vocabulary (None when none is)."""
        return next((c.module for c in self.vocab if c.kind is VocabKind.HEAD), None)

    @property
    def styles(self) -> dict[str, str]:
        """Module path → "colwise", "colwise_fused(n)" or "rowwise", for every sharded linear."""
        return {linear.module: linear.label for pair in self.pairs for linear in pair.linears}


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorParallelCandidates:
    """What the graph allows, whatever the degree: `layout(degree)` checks the sizes."""

    pairs: tuple[TensorParallelPair, ...]
    rejected: tuple[KeptWhole, ...]
    """Pairs the graph itself forbids (an op mixes their features), with the op that does."""
    vocab: tuple[VocabCandidate, ...]
    modules: tuple[str, ...]
    """Every module holding parameters, in graph order."""

    def layout(
        self,
        degree: int,
        *,
        sequence_parallel: bool = False,
        vocab_parallel: bool = False,
        sharded_loss: bool = False,
    ) -> TensorParallelLayout:
        if degree < 1:
            raise PlanError(f"tensor-parallel degree is {degree}: it counts ranks, use 1 or more")
        refusals = {pair.name: pair.refusal(degree) for pair in self.pairs}
        applied = tuple(pair for pair in self.pairs if refusals[pair.name] is None)
        rejected = self.rejected + tuple(
            KeptWhole(module=pair.name, reason=reason)
            for pair in self.pairs
            if (reason := refusals[pair.name]) is not None
        )
        verdicts = {
            candidate.module: _vocab_verdict(candidate, degree, vocab_parallel)
            for candidate in self.vocab
        }
        vocab = tuple(candidate for candidate in self.vocab if verdicts[candidate.module] is None)
        if sharded_loss and not any(candidate.kind is VocabKind.HEAD for candidate in vocab):
            raise PlanError(
                f"the loss is to run on the head's vocabulary slices, but no LM head is sliced over "
                f"tp={degree}: make the layout with vocab_parallel=True, or without sharded_loss"
            )
        sharded = {linear.module for pair in applied for linear in pair.linears} | {
            c.module for c in vocab
        }
        layout = TensorParallelLayout(
            degree=degree,
            pairs=applied,
            replicated=tuple(m for m in self.modules if m not in sharded),
            rejected=rejected,
            vocab=vocab,
            sequence_parallel=sequence_parallel,
            sharded_loss=sharded_loss,
            deferred=tuple(
                KeptWhole(module=module, reason=verdict)
                for module, verdict in verdicts.items()
                if verdict is not None
            ),
        )
        if sequence_parallel:
            _check_sequence_layers(layout)
        return layout


def _vocab_verdict(candidate: VocabCandidate, degree: int, asked: bool) -> str | None:
    """Why `candidate` stays whole (None: it shards)."""
    size, what = candidate.divisor.size, candidate.divisor.what
    if candidate.tied:
        return candidate.tied
    if size % degree:
        return f"{size} {what} do not divide by tp={degree}: it stays whole"
    if not asked:
        return f"{size} {what} divide by tp={degree}, but it stays whole: the layout was made without vocab_parallel"
    return None


def _check_sequence_layers(layout: TensorParallelLayout) -> None:
    """Sequence parallelism runs whole layers on a shard of the sequence: each must hold its pairs
    below itself (the pair gathers the sequence at its own input), and none may hold a pair left
    whole, which would attend over one rank's tokens only."""
    for pair in layout.pairs:
        if "." not in pair.name:
            raise PlanError(
                f"sequence parallelism needs pair {pair.name or '(the model)'!r} inside a layer "
                "module (attention or MLP inside a block): make the layout with sequence_parallel=False"
            )
    layers = layout.sequence_layers
    for rejection in layout.rejected:
        if any(
            rejection.module == layer or rejection.module.startswith(layer + ".")
            for layer in layers
        ):
            raise PlanError(
                f"sequence parallelism would run {rejection.module!r} on a shard of the sequence, but "
                f"it stays whole over tp ({rejection.reason}): make the layout with "
                "sequence_parallel=False, or choose a tp that shards it"
            )


def find_tensor_parallel_pairs(gm: torch.fx.GraphModule) -> TensorParallelCandidates:
    """The pairs of a captured graph (torch.export's ATen ops, after annotate_ownership_pass).

    Linears are `aten.linear` calls that read their own module's weight (and bias) and nothing else
    reads: a tied or reused weight cannot be sliced for one use alone, so it stays whole. (A graph
    from capture's symbolic_trace fallback calls modules, not `aten.linear`: it has no pairs.)"""
    linears = _own_linears(gm)
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    flow = _Flow()
    for node in gm.graph.nodes:
        flow.visit(node, linears)
    pairs, rejected, heads, used = [], [], [], set[str]()
    for group in flow.roots():
        modules = [facts(node).module_path for node in [*group.columns, *group.rows]]
        name = _common_parent(modules)
        clash = sorted(used.intersection(modules))
        if (
            not group.rows
        ):  # the head, a linear whose output joins the residual stream, or a blocked pair
            if group.ending is _Ending.LOSS and list(group.columns.values()) == [1]:
                heads.append(_head_candidate(next(iter(group.columns))))
            elif group.ending is _Ending.MIXED and not clash:
                rejected.append(KeptWhole(module=name, reason=str(group.failure)))
            continue
        if group.failure or clash:
            reason = group.failure or f"{clash[0]} is already sharded by another pair"
            rejected.append(KeptWhole(module=name, reason=reason))
            continue
        used.update(modules)
        pairs.append(group.pair(name, order))
    return TensorParallelCandidates(
        pairs=tuple(pairs),
        rejected=tuple(rejected),
        vocab=tuple(_embedding_candidates(gm) + heads),
        modules=tuple(dict.fromkeys(name.rpartition(".")[0] for name, _ in gm.named_parameters())),
    )


def _own_linears(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    readers: dict[str, int] = {}
    for node in gm.graph.nodes:
        for name in facts(node).param_names:
            readers[name] = readers.get(name, 0) + 1
    own = set()
    for node in gm.graph.nodes:
        path, params = facts(node).module_path, facts(node).param_names
        if (
            node.target is aten.linear.default
            and f"{path}.weight" in params
            and set(params) <= {f"{path}.weight", f"{path}.bias"}
            and all(readers[p] == 1 for p in params)
        ):
            own.add(node)
    return own


def _embedding_candidates(gm: torch.fx.GraphModule) -> list[VocabCandidate]:
    """Lookups of the model's inputs (token embeddings, not position tables) in a table of their own;
    a table another op reads too (an LM head tied to it) is listed with the reason it stays whole."""
    readers: dict[str, set[str]] = {}
    for node in gm.graph.nodes:
        for name in facts(node).param_names:
            readers.setdefault(name, set()).add(facts(node).module_path)
    found = {}
    for node in gm.graph.nodes:
        path, params = facts(node).module_path, facts(node).param_names
        if (
            node.target is aten.embedding.default
            and params == (f"{path}.weight",)
            and node.args[1].op == "placeholder"
        ):
            rows = _shape(node.args[0])[0]
            others = sorted(readers[params[0]] - {path})
            tied = (
                (
                    f"its table {params[0]} is tied to {', '.join(others)}: a tied embedding and head stay "
                    "whole (untie them to shard both over the vocabulary)"
                )
                if others
                else None
            )
            found[path] = VocabCandidate(
                module=path,
                kind=VocabKind.EMBEDDING,
                tied=tied,
                divisor=Divisor(size=rows, what=f"rows of {path}'s table"),
            )
    return list(found.values())


def _head_candidate(linear: torch.fx.Node) -> VocabCandidate:
    path = facts(linear).module_path
    return VocabCandidate(
        module=path,
        kind=VocabKind.HEAD,
        divisor=Divisor(size=_shape(linear)[-1], what=f"output features of {path}"),
    )


def _common_parent(paths: list[str]) -> str:
    """The deepest module holding every one of `paths` ("" for the model itself)."""
    common = []
    for names in zip(*(path.split(".")[:-1] for path in paths)):
        if len(set(names)) > 1:
            break
        common.append(names[0])
    return ".".join(common)


class _Ending(enum.Enum):
    """How the sharded features of a group that reaches no row-parallel linear end."""

    MIXED = "mixed"
    """An op mixes them (a norm, a softmax over them): a pair blocked half-way, worth reporting."""
    JOINED = "joined"
    """They meet a whole tensor as wide as they are (the residual stream): the linear is a
    row-parallel one's peer, never the start of a pair."""
    LOSS = "loss"
    """They reach the loss or the model's output: the mark of an LM head."""


class _Refused(Exception):
    """An op the sharded features cannot flow through (flow control inside the search only)."""

    def __init__(self, why: str, ending: _Ending = _Ending.MIXED):
        super().__init__(why)
        self.ending = ending


@dataclass(frozen=True, slots=True)
class _Sharded:
    """A value whose `dim` would be sharded over tp, and where its features come from."""

    group: int
    dim: int
    origin: torch.fx.Node
    """The column-parallel linear these features come from (for messages and fused chunks)."""
    untouched: bool = False
    """The linear's output itself: a fused projection may be cut into chunks here."""


@dataclass(slots=True)
class _Group:
    """Column-parallel linears whose sharded outputs meet, and what following them found."""

    columns: dict[torch.fx.Node, int]
    """linear → its fused chunks (1 for a plain projection)."""
    rows: list[torch.fx.Node] = field(default_factory=list)
    heads: dict[torch.fx.Node, int] = field(default_factory=dict)
    """column linear → the number of heads its features split into."""
    failure: str | None = None
    ending: _Ending | None = None

    def absorb(self, other: "_Group") -> None:
        self.columns.update(other.columns)
        self.rows += other.rows
        self.heads.update(other.heads)
        if not self.failure:
            self.failure, self.ending = other.failure, other.ending

    def pair(self, name: str, order: dict[torch.fx.Node, int]) -> TensorParallelPair:
        columns = sorted(self.columns, key=order.__getitem__)
        most_heads = max(self.heads.values(), default=0)
        divisors = []
        for linear in columns:
            path = facts(linear).module_path
            if linear in self.heads:  # heads divide the width: the count is the binding size
                kind = "heads" if self.heads[linear] == most_heads else "kv heads"
                divisors.append(Divisor(size=self.heads[linear], what=f"{kind} of {path}"))
            else:
                chunks = self.columns[linear]
                what = (
                    f"output features in each of {path}'s {chunks} chunks"
                    if chunks > 1
                    else f"output features of {path}"
                )
                divisors.append(Divisor(size=_shape(linear)[-1] // chunks, what=what))
        linears = [
            ShardedLinear(module=facts(n).module_path, style=Style.COLWISE, chunks=self.columns[n])
            for n in columns
        ]
        linears += [
            ShardedLinear(module=facts(n).module_path, style=Style.ROWWISE)
            for n in sorted(self.rows, key=order.__getitem__)
        ]
        return TensorParallelPair(name=name, linears=tuple(linears), divisors=tuple(divisors))


class _Flow:
    """The sharded values met so far, and their groups (a union-find over the column linears)."""

    def __init__(self) -> None:
        self.values: dict[torch.fx.Node, _Sharded] = {}
        self.groups: list[_Group] = []
        self.parent: list[int] = []

    def root(self, group: int) -> int:
        while self.parent[group] != group:
            group = self.parent[group]
        return group

    def roots(self) -> list[_Group]:
        """Every group that was not merged into another, in the order of their first linear."""
        return [group for index, group in enumerate(self.groups) if self.parent[index] == index]

    def merge(self, groups: list[int]) -> int:
        first, *rest = sorted({self.root(group) for group in groups})
        for other in rest:
            self.groups[first].absorb(self.groups[other])
            self.parent[other] = first
        return first

    def visit(self, node: torch.fx.Node, linears: set[torch.fx.Node]) -> None:
        inputs = [value for value in node.all_input_nodes if value in self.values]
        group = self.merge([self.values[value].group for value in inputs]) if inputs else None
        if node in linears:
            if group is not None:
                self._end_at_linear(node, group)
            self.groups.append(_Group(columns={node: 1}))
            self.parent.append(len(self.groups) - 1)
            self.values[node] = _Sharded(
                len(self.groups) - 1, len(_shape(node)) - 1, node, untouched=True
            )
            return
        if group is None or self.groups[group].failure or _op_name(node) in _IGNORED:
            return
        try:
            self.values[node] = _follow(node, self.values, self.groups[group], group)
        except _Refused as refused:
            where = facts(node).module_path or "the model"
            self.groups[group].failure = f"{_op_name(node)} ({node.name} in {where}) {refused}"
            self.groups[group].ending = refused.ending

    def _end_at_linear(self, linear: torch.fx.Node, group: int) -> None:
        features = cast(torch.fx.Node, linear.args[0])
        value = self.values.get(features)
        if value is None or value.dim != len(_shape(features)) - 1:
            self.groups[group].failure = (
                f"{facts(linear).module_path} reads the sharded features "
                "other than as its input features"
            )
        else:
            self.groups[group].rows.append(linear)


def _follow(node: torch.fx.Node, values: dict, group: _Group, group_index: int) -> _Sharded:
    """The value `node` computes from sharded inputs, or _Refused when its features would mix."""
    if node.op == "output":
        raise _Refused("returns the sharded features from the model", _Ending.LOSS)
    if node.op != "call_function":
        raise _Refused("is not an ATen op the search knows")
    origin = next(values[v] for v in node.all_input_nodes if v in values).origin
    if node.target is operator.getitem:  # a piece of a split that kept the sharded dim (see _split)
        return _Sharded(group_index, values[node.args[0]].dim, origin)
    name = _op_name(node)
    if name in _LOSSES:
        raise _Refused("computes the loss over the sharded features", _Ending.LOSS)
    if name in _VIEWS:
        source = cast(torch.fx.Node, node.args[0])
        dim, heads = _view_dim(_shape(source), _shape(node), values[source].dim)
        if heads:
            group.heads.setdefault(origin, heads)
        return _Sharded(group_index, dim, origin)
    if name in ("split", "split_with_sizes", "chunk"):
        return _split(node, values[node.args[0]], group, group_index)
    rule = _RULES.get(name) or (
        _pointwise
        if torch.Tag.pointwise in getattr(node.target, "tags", ()) or name in _SAME_SHAPE
        else None
    )
    if rule is None:
        raise _Refused("is not an op the search knows to keep features apart")
    return _Sharded(group_index, rule(node, values), origin)


_IGNORED = {"_assert_tensor_metadata", "sym_size", "sym_numel", "sym_stride"}
"""Ops that read a value's metadata, never its features."""
_LOSSES = {
    "cross_entropy_loss",
    "nll_loss",
    "nll_loss_nd",
    "mse_loss",
    "binary_cross_entropy_with_logits",
}
_VIEWS = {"view", "reshape", "_unsafe_view", "flatten", "unflatten", "squeeze", "unsqueeze"}
"""Ops that keep the elements in order and change only the shape."""
_SAME_SHAPE = {"to", "_to_copy", "type_as", "contiguous", "alias", "detach", "dropout", "clone"}
"""Ops without torch.Tag.pointwise that act on each element alone."""


def _op_name(node: torch.fx.Node) -> str:
    packet = getattr(node.target, "overloadpacket", None)
    return (
        packet.__name__
        if packet is not None
        else getattr(node.target, "__name__", str(node.target))
    )


def _shape(node: torch.fx.Node) -> tuple[int, ...]:
    return tuple(int(size) for size in node.meta["val"].shape)


def _view_dim(source: tuple, target: tuple, dim: int) -> tuple[int, int | None]:
    """Where `dim` of `source` goes when the same elements take the shape `target`, and, when it
    splits into several dims, the size of the outermost one (the heads): the dim a rank's slice
    then cuts. Refused when `dim` merges under an outer dim (a rank's slice would interleave)."""
    if source[dim] == 1:
        raise _Refused("reshapes a sharded dim of size 1", _Ending.JOINED)
    sources = [i for i, size in enumerate(source) if size != 1]
    targets = [j for j, size in enumerate(target) if size != 1]
    i = j = 0
    while i < len(sources):  # walk both shapes in groups of dims whose sizes multiply to the same
        merged, split = [sources[i]], [targets[j]]
        source_size, target_size = source[sources[i]], target[targets[j]]
        i, j = i + 1, j + 1
        while source_size != target_size:
            if source_size < target_size:
                merged.append(sources[i])
                source_size *= source[sources[i]]
                i += 1
            else:
                split.append(targets[j])
                target_size *= target[targets[j]]
                j += 1
        if dim in merged:
            if dim != merged[0]:
                raise _Refused(f"merges the sharded dim under an outer one ({source} to {target})")
            outer = split[0]
            return outer, (target[outer] if target[outer] < source[dim] else None)
    raise AssertionError(f"view {source} -> {target} lost dim {dim}")


def _split(node: torch.fx.Node, value: _Sharded, group: _Group, group_index: int) -> _Sharded:
    """A split along another dim keeps the sharded one; equal chunks of a linear's own output along
    the sharded dim are a fused projection's (qkv): each rank slices every chunk."""
    args: tuple[Any, ...] = node.args  # an ATen op's arguments: untyped in torch.fx
    ndim = len(_shape(args[0]))
    dim_argument: Any = args[2] if len(args) > 2 else node.kwargs.get("dim", 0)
    split_dim = dim_argument % ndim
    if split_dim != value.dim:
        return _Sharded(group_index, value.dim, value.origin)
    pieces = {tuple(piece.shape) for piece in node.meta["val"]}
    if not value.untouched or len(pieces) != 1:
        raise _Refused(
            "cuts the sharded features into pieces other than equal chunks of a linear's output"
        )
    group.columns[value.origin] = len(node.meta["val"])
    return _Sharded(group_index, value.dim, value.origin)


def _tensor_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    return [arg for arg in node.all_input_nodes if isinstance(arg.meta.get("val"), torch.Tensor)]


def _pointwise(node: torch.fx.Node, values: dict) -> int:
    """Broadcasting elementwise op: every sharded input's dim must land on one output dim, and every
    whole input must broadcast along it (size 1, or no such dim)."""
    ndim = len(_shape(node))
    dims = {
        values[arg].dim + ndim - len(_shape(arg)) for arg in _tensor_inputs(node) if arg in values
    }
    if len(dims) != 1:
        raise _Refused("combines values sharded along different dims")
    dim = dims.pop()
    for arg in _tensor_inputs(node):
        aligned = dim - (ndim - len(_shape(arg)))
        if arg not in values and aligned >= 0 and _shape(arg)[aligned] != 1:
            raise _Refused(
                f"combines the sharded features with a whole tensor ({arg.name}, shape {_shape(arg)})",
                _Ending.JOINED,
            )
    return dim


def _transpose(node: torch.fx.Node, values: dict) -> int:
    args: tuple[Any, ...] = node.args  # an ATen op's arguments: untyped in torch.fx
    ndim = len(_shape(node))
    dim, first, second = values[args[0]].dim, args[1] % ndim, args[2] % ndim
    return second if dim == first else first if dim == second else dim


def _permute(node: torch.fx.Node, values: dict) -> int:
    args: tuple[Any, ...] = node.args  # an ATen op's arguments: untyped in torch.fx
    ndim = len(_shape(node))
    return [d % ndim for d in args[1]].index(values[args[0]].dim)


def _expand(node: torch.fx.Node, values: dict) -> int:
    args: tuple[Any, ...] = node.args  # an ATen op's arguments: untyped in torch.fx
    source = args[0]
    dim = values[source].dim + len(_shape(node)) - len(_shape(source))
    if _shape(node)[dim] != _shape(source)[values[source].dim]:
        raise _Refused("broadcasts the sharded dim")
    return dim


def _slice(node: torch.fx.Node, values: dict) -> int:
    args: tuple[Any, ...] = node.args  # an ATen op's arguments: untyped in torch.fx
    value = values[args[0]]
    if args[1] % len(_shape(node)) == value.dim and _shape(node) != _shape(args[0]):
        raise _Refused("slices the sharded features")
    return value.dim


def _select(node: torch.fx.Node, values: dict) -> int:
    args: tuple[Any, ...] = node.args  # an ATen op's arguments: untyped in torch.fx
    dim, selected = values[args[0]].dim, args[1] % len(_shape(args[0]))
    if selected == dim:
        raise _Refused("selects one of the sharded features")
    return dim - (selected < dim)


def _cat(node: torch.fx.Node, values: dict) -> int:
    args: tuple[Any, ...] = node.args  # an ATen op's arguments: untyped in torch.fx
    pieces = args[0]
    if any(piece not in values for piece in pieces):
        raise _Refused("concatenates sharded features with whole ones")
    dims = {values[piece].dim for piece in pieces}
    along = (args[1] if len(args) > 1 else 0) % len(_shape(node))
    if len(dims) != 1 or along in dims:
        raise _Refused("concatenates along the sharded dim")
    return dims.pop()


def _softmax(node: torch.fx.Node, values: dict) -> int:
    args: tuple[Any, ...] = node.args  # an ATen op's arguments: untyped in torch.fx
    dim = values[args[0]].dim
    if args[1] % len(_shape(node)) == dim:
        raise _Refused("normalizes over the sharded features")
    return dim


def _reduce(node: torch.fx.Node, values: dict) -> int:
    """sum / mean / amax over dims other than the sharded one."""
    args: tuple[Any, ...] = node.args  # an ATen op's arguments: untyped in torch.fx
    ndim, dim = len(_shape(args[0])), values[args[0]].dim
    over = args[1] if len(args) > 1 and args[1] is not None else range(ndim)
    over = {d % ndim for d in ([over] if isinstance(over, int) else over)}
    keepdim = args[2] if len(args) > 2 else node.kwargs.get("keepdim", False)
    if dim in over:
        raise _Refused("reduces over the sharded features")
    return dim if keepdim else dim - sum(d < dim for d in over)


def _norm(node: torch.fx.Node, values: dict) -> int:
    """layer_norm / rms_norm over the trailing `normalized_shape` dims."""
    args: tuple[Any, ...] = node.args  # an ATen op's arguments: untyped in torch.fx
    if args[0] not in values or values[args[0]].dim >= len(_shape(node)) - len(args[1]):
        raise _Refused("normalizes over the sharded features")
    return values[args[0]].dim


def _attention(node: torch.fx.Node, values: dict) -> int:
    """scaled_dot_product_attention over sharded heads: query, key and value all sharded along their
    heads dim; a mask sharded alike or broadcast over the heads."""
    args: tuple[Any, ...] = node.args  # an ATen op's arguments: untyped in torch.fx
    query, key, value = args[:3]
    mask = args[3] if len(args) > 3 else node.kwargs.get("attn_mask")
    heads = len(_shape(node)) - 3
    if any(t not in values or values[t].dim != heads for t in (query, key, value)):
        raise _Refused("attends over query, key and value not all sharded along their heads")
    if isinstance(mask, torch.fx.Node) and mask not in values:
        aligned = heads - (len(_shape(node)) - len(_shape(mask)))
        if aligned >= 0 and _shape(mask)[aligned] != 1:
            raise _Refused("masks the attention with a mask over every head")
    return heads


def _matmul(node: torch.fx.Node, values: dict) -> int:
    """A batched matmul (attention written by hand) whose sharded dim is a batch dim of both operands,
    or of one while the other broadcasts along it."""
    args: tuple[Any, ...] = node.args  # an ATen op's arguments: untyped in torch.fx
    operands = args[:2]
    ndim = len(_shape(node))
    dims = {values[arg].dim for arg in operands if arg in values}
    if len(dims) != 1 or any(len(_shape(arg)) != ndim for arg in operands) or min(dims) >= ndim - 2:
        raise _Refused("multiplies over the sharded features")
    dim = dims.pop()
    if any(arg not in values and _shape(arg)[dim] != 1 for arg in operands):
        raise _Refused("multiplies sharded heads with whole ones")
    return dim


_RULES = {
    "transpose": _transpose,
    "permute": _permute,
    "expand": _expand,
    "slice": _slice,
    "select": _select,
    "cat": _cat,
    "softmax": _softmax,
    "_softmax": _softmax,
    "log_softmax": _softmax,
    "_log_softmax": _softmax,
    "sum": _reduce,
    "mean": _reduce,
    "amax": _reduce,
    "amin": _reduce,
    "layer_norm": _norm,
    "rms_norm": _norm,
    "scaled_dot_product_attention": _attention,
    "matmul": _matmul,
    "bmm": _matmul,
}
