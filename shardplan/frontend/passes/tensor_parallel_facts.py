"""The tensor-parallel facts of a captured chain's blocks (chain.TensorParallelFacts), from the pairs
the graph offers (tensor_parallel.find_tensor_parallel_pairs).

Node by node: a block slices the matmuls of its pairs' linears and every op of a pair's module that
runs on the column-parallel features, from the column-parallel linear up to the row-parallel one
(attention over the heads, the activation of an MLP, rotary embeddings of q and k), with their FLOPs
and bytes; of what autograd saves for backward, the storages those ops output are sliced (the
row-parallel linear's output is a whole-width partial sum, summed by its exchange, and stays whole).
The inputs of the column-parallel linears are counted apart (gathered_saved_bytes): under sequence
parallelism the runtime saves them after gathering the sequence, whole.
The parameters sliced are the linears' weights and the column-parallel linears' biases.
Of the block's transients, one tensor of its hidden states (its output's bytes) is whole on every tp
rank under sequence parallelism: what the pairs exchange, held whole around each exchange. Of its
backward transient, what the op whose backward peaks allocates for the gradients of sliced tensors
divides over tp (a GPT layer's MLP's row-parallel linear: its input's and its weight's gradients);
under sequence parallelism that linear's backward holds its output gradient gathered whole beside them.
Approximations: the ops outside the pairs (norms, residual adds) count as whole unless sequence
parallelism divides the whole layer; a pair's exchange moves the block's output bytes (its hidden
states). Embeddings and LM heads that may shard over the vocabulary (not tied) carry facts of their
own (_vocab_facts), which a plan without vocab_parallel leaves unused (compile.evaluate); a head whose
loss may run on its vocabulary slices (frontend/sharded_loss.py) carries those of that loss, and beside
them the gathered head's, for a plan without loss_parallel (_sharded_loss_facts). Left out:
pairs rejected by the graph (their layers are not marked for sequence parallelism).
"""

import math
from dataclasses import replace

import torch
import torch.fx

from shardplan.frontend.chain import BlockChain, TensorParallelFacts, merge_op_kinds
from shardplan.frontend.passes.blocks import bwd_peak_node, grads_live_at_bwd_peak, group_nodes
from shardplan.frontend.passes.facts import facts, within_module
from shardplan.frontend.passes.tensor_parallel import (
    Style,
    TensorParallelPair,
    VocabCandidate,
    VocabKind,
    find_tensor_parallel_pairs,
)


def with_tensor_parallel_facts(
    gm: torch.fx.GraphModule, chain: BlockChain, sharded_loss_head: str | None = None
) -> BlockChain:
    """`chain` (built from `gm` by build_chain) with each block holding pairs given its facts;
    `sharded_loss_head`: the LM head whose loss may run on its vocabulary slices (frontend/sharded_loss.py)."""
    candidates = find_tensor_parallel_pairs(gm)
    groups = group_nodes(gm)  # build_chain's grouping: block i holds groups[i].nodes
    if not candidates.pairs or len(groups) != len(chain.blocks):
        return chain
    block_of = {node: index for index, group in enumerate(groups) for node in group.nodes}
    position = {node: index for index, node in enumerate(block_of)}
    by_module: dict[str, list[torch.fx.Node]] = {}
    for node in block_of:
        by_module.setdefault(facts(node).module_path, []).append(node)
    found: dict[int, list[tuple[TensorParallelPair, list[torch.fx.Node]]]] = {}
    for pair in candidates.pairs:
        # A pair's linears lie inside its module: look there only (a search of the whole graph per
        # pair took 4 s at 80 layers).
        linears = {linear.module for linear in pair.linears}
        near = {
            node
            for path, nodes in by_module.items()
            if path in linears or within_module(path, pair.name)
            for node in nodes
        }
        nodes = [node for node in sorted(near, key=position.__getitem__) if _sliced_by(node, pair)]
        owners = {block_of[node] for node in nodes}
        if len(owners) == 1:  # a pair across blocks is left whole (a first cut)
            found.setdefault(owners.pop(), []).append((pair, nodes))
    layers = set(_layers(candidates.pairs))
    parameters = dict(gm.named_parameters())
    blocks = list(chain.blocks)
    for index, pairs in found.items():
        nodes = [node for _, pair_nodes in pairs for node in pair_nodes]
        sliced_parameters = {name for name in _sliced_parameters(pairs) if name in parameters}
        peak = bwd_peak_node(groups[index].nodes)
        fwd = merge_op_kinds(facts(node).fwd_kinds for node in nodes)
        bwd = merge_op_kinds(facts(node).bwd_kinds for node in nodes)
        blocks[index] = replace(
            blocks[index],
            tensor_parallel=TensorParallelFacts(
                divides=math.gcd(*(divisor.size for pair, _ in pairs for divisor in pair.divisors)),
                divisors=tuple(
                    (divisor.size, divisor.what) for pair, _ in pairs for divisor in pair.divisors
                ),
                sliced_numel=sum(parameters[name].numel() for name in sliced_parameters),
                fwd_kinds=fwd,
                bwd_kinds=bwd,
                sliced_fwd_flops=sum(k.flops for k in fwd),
                sliced_bwd_flops=sum(k.flops for k in bwd),
                sliced_saved_bytes=_sliced_saved_bytes(groups[index].nodes, pairs),
                gathered_saved_bytes=_pair_input_saved_bytes(groups[index].nodes, pairs),
                sliced_bwd_transient_bytes=min(
                    _sliced_bwd_peak_bytes(groups[index].nodes, pairs, peak, sliced_parameters),
                    blocks[index].bwd_transient_bytes,
                ),
                gathered_bwd_peak_bytes=_gathered_at_bwd_peak(peak, pairs),
                sliced_peak_grad_numel=sum(
                    parameters[name].numel()
                    for name in grads_live_at_bwd_peak(groups[index].nodes)
                    if name in sliced_parameters
                ),
                sequence_layer=bool(layers.intersection(blocks[index].modules)),
                all_reduces=2 * len(pairs),
                exchange_bytes=blocks[index].output_bytes,
                sharded=tuple(
                    (linear.module, linear.label) for pair, _ in pairs for linear in pair.linears
                ),
            ),
        )
    for candidate in candidates.vocab:
        use = next((node for node in block_of if _looks_up_or_projects(node, candidate)), None)
        if (
            candidate.tied is None
            and use is not None
            and blocks[block_of[use]].tensor_parallel is None
        ):
            index = block_of[use]
            blocks[index] = replace(
                blocks[index],
                tensor_parallel=_vocab_facts(
                    use,
                    candidate,
                    parameters,
                    groups[index].nodes,
                    sharded_loss=candidate.module == sharded_loss_head,
                ),
            )
    return replace(chain, blocks=tuple(blocks))


def _looks_up_or_projects(node: torch.fx.Node, candidate: VocabCandidate) -> bool:
    """Whether `node` is the lookup of a token embedding or the matmul of an LM head."""
    path = facts(node).module_path
    return path == candidate.module and f"{path}.weight" in facts(node).param_names


def _vocab_facts(
    node: torch.fx.Node,
    candidate: VocabCandidate,
    parameters: dict,
    block_nodes: list[torch.fx.Node],
    sharded_loss: bool,
) -> TensorParallelFacts:
    """A table or head sliced over the vocabulary (runtime/tensor_parallel.py): its weight is 1/tp per
    rank. An embedding's lookups are summed over the ranks (an all-reduce of its output in forward)
    and cost what a whole lookup does; a head's matmul is 1/tp and the gradient of its input is summed
    (an all-reduce in backward). Its logits are gathered whole for the loss, which keeps them (nothing
    saved divides), or with `sharded_loss` read as they are by a loss on the vocabulary slices, whose
    ops, saved tensors and transients over the logits divide as the head's matmul does."""
    embedding, found = candidate.kind is VocabKind.EMBEDDING, facts(node)
    gathered = TensorParallelFacts(
        divides=candidate.divisor.size,
        divisors=((candidate.divisor.size, candidate.divisor.what),),
        sliced_numel=sum(
            parameters[name].numel()
            for name in (f"{candidate.module}.weight", f"{candidate.module}.bias")
            if name in parameters
        ),
        fwd_kinds=() if embedding else found.fwd_kinds,
        bwd_kinds=() if embedding else found.bwd_kinds,
        sliced_fwd_flops=0 if embedding else found.fwd_flops,
        sliced_bwd_flops=0 if embedding else found.bwd_flops,
        all_reduces=1,
        exchange_bytes=found.out_bytes if embedding else _storage_bytes(node.all_input_nodes[0]),
        loss_exchanges=() if embedding else (("all_gather_into_tensor", _storage_bytes(node)),),
        sharded=((candidate.module, f"vocab_{candidate.kind.value}"),),
    )
    if embedding or not sharded_loss:
        return gathered
    return _sharded_loss_facts(node, gathered, block_nodes)


def _sharded_loss_facts(
    head: torch.fx.Node, gathered: TensorParallelFacts, block_nodes: list[torch.fx.Node]
) -> TensorParallelFacts:
    """The head and its loss on the vocabulary slices ([Note: loss on sharded logits] in
    runtime/vocab_parallel_loss.py): the head's matmul and every op of its block over its logits (the
    loss) divide, with the tensors they output (in forward, and their gradients in backward) and those
    of them that are saved; the head's input and its gradient stay whole. What the ops allocate inside
    themselves is priced as at tp 1: the graph computes the model's own loss there, a cross entropy
    whose log-softmax is internal to it, saved, while on a rank's slice the vocab-parallel loss's
    log-sum-exp holds its shifted logits and exponentials, saves its input, and its backward holds more
    per logit than the log-softmax's. The two come to about as much: a Llama's peak is measured within
    2 % in float32 and bf16 (docs/benchmarks.md)."""
    nodes = _over_logits(head, block_nodes)
    outputs = {storage: size for node in nodes for storage, size in facts(node).outputs}
    saved = {storage: size for node in block_nodes for storage, size in facts(node).saved}
    fwd = merge_op_kinds(facts(node).fwd_kinds for node in nodes)
    bwd = merge_op_kinds(facts(node).bwd_kinds for node in nodes)
    value = head.meta["val"]
    tokens = value.numel() // value.shape[-1]
    return replace(
        gathered,
        fwd_kinds=fwd,
        bwd_kinds=bwd,
        sliced_fwd_flops=sum(kind.flops for kind in fwd),
        sliced_bwd_flops=sum(kind.flops for kind in bwd),
        sliced_saved_bytes=sum(size for storage, size in saved.items() if storage in outputs),
        sliced_fwd_transient_bytes=sum(outputs.values()),
        sliced_bwd_transient_bytes=sum(outputs.values()),
        sharded_loss=True,
        loss_exchanges=(("all_reduce", 4 * tokens),) * 2,
        gathered_loss=gathered,
    )


def _over_logits(head: torch.fx.Node, block_nodes: list[torch.fx.Node]) -> list[torch.fx.Node]:
    """The head's matmul and the ops of its block that read its logits, directly or through each other."""
    reached = {head}
    for node in block_nodes:
        if any(source in reached for source in node.all_input_nodes):
            reached.add(node)
    return [node for node in block_nodes if node in reached]


def _storage_bytes(node: torch.fx.Node) -> int:
    return sum(size for _, size in facts(node).outputs)


def _sliced_by(node: torch.fx.Node, pair: TensorParallelPair) -> bool:
    """Whether `node` is a matmul of one of the pair's linears or runs on the features between them."""
    path = facts(node).module_path
    if any(path == linear.module for linear in pair.linears):
        return bool(facts(node).fwd_flops)
    return _on_sliced_features(node, pair)


def _on_sliced_features(node: torch.fx.Node, pair: TensorParallelPair) -> bool:
    """Whether `node` runs on (and outputs) the column-parallel features of `pair`: an op of the pair's
    module that is not its row-parallel linear."""
    path = facts(node).module_path
    rowwise = {linear.module for linear in pair.linears if linear.style is Style.ROWWISE}
    return within_module(path, pair.name) and path not in rowwise


def _sliced_saved_bytes(block_nodes: list[torch.fx.Node], pairs) -> int:
    """Bytes of what the block's ops save for backward that are outputs of ops on a pair's
    column-parallel features (each storage once, as build_chain counts saved_bytes)."""
    sliced = _sliced_feature_storages(block_nodes, pairs)
    saved = {storage: size for node in block_nodes for storage, size in facts(node).saved}
    return sum(size for storage, size in saved.items() if storage in sliced)


def _sliced_feature_storages(block_nodes: list[torch.fx.Node], pairs) -> set[int]:
    """The storages the block's ops on a pair's column-parallel features output."""
    return {
        storage
        for node in block_nodes
        for pair, _ in pairs
        if _on_sliced_features(node, pair)
        for storage, _ in facts(node).outputs
    }


def _sliced_bwd_peak_bytes(
    block_nodes: list[torch.fx.Node], pairs, peak: torch.fx.Node | None, weights: set[str]
) -> int:
    """What divides over tp of the allocations of the op whose backward peaks the block's (a GPT layer's:
    its MLP's row-parallel linear, which makes the gradients of the column-parallel features and of its
    weight, both sliced): its allocations times the share of its gradients' bytes that are of sliced
    tensors (the pairs' column-parallel features, the sliced weights and biases: `weights`)."""
    if peak is None:
        return 0
    sliced = _sliced_feature_storages(block_nodes, pairs)
    gradients = {
        storage: (size, storage in sliced or (arg.op == "get_attr" and arg.target in weights))
        for arg in peak.all_input_nodes
        if _differentiable(arg)
        for storage, size in facts(arg).outputs
    }
    total = sum(size for size, _ in gradients.values())
    divided = sum(size for size, cut in gradients.values() if cut)
    allocated = facts(peak).bwd_peak_live_bytes - facts(peak).bwd_live_before_bytes
    return allocated * divided // total if total else 0


def _differentiable(node: torch.fx.Node) -> bool:
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and value.dtype.is_floating_point


def _gathered_at_bwd_peak(peak: torch.fx.Node | None, pairs) -> int:
    """The output gradient a row-parallel linear's backward gathers whole under sequence parallelism, where
    that backward is the block's peak (a GPT layer's MLP): its output's bytes. At tp 1 that gradient was live
    before the op ran (the block's output gradient), so the tp 1 transient does not hold it; 0 where another
    op peaks."""
    rowwise = {
        linear.module
        for pair, _ in pairs
        for linear in pair.linears
        if linear.style is Style.ROWWISE
    }
    if peak is None or facts(peak).module_path not in rowwise or not facts(peak).fwd_flops:
        return 0
    return _storage_bytes(peak)


def _sliced_parameters(pairs) -> set[str]:
    """The linears' weights, and the column-parallel ones' biases (a row-parallel bias stays whole)."""
    return {
        f"{linear.module}.{name}"
        for pair, _ in pairs
        for linear in pair.linears
        for name in ("weight", "bias")
        if linear.style is Style.COLWISE or name == "weight"
    }


def _pair_input_saved_bytes(block_nodes: list[torch.fx.Node], pairs) -> int:
    """Bytes of what the block's ops save for backward that are inputs of a pair's column-parallel
    linears (sequence parallelism gathers them whole; each storage once)."""
    columns = {
        linear.module
        for pair, _ in pairs
        for linear in pair.linears
        if linear.style is not Style.ROWWISE
    }
    inputs = {
        storage
        for node in block_nodes
        if facts(node).module_path in columns and facts(node).fwd_flops
        for storage, _ in facts(node.all_input_nodes[0]).outputs
    }
    saved = {storage: size for node in block_nodes for storage, size in facts(node).saved}
    return sum(size for storage, size in saved.items() if storage in inputs)


def _layers(pairs) -> list[str]:
    """The layers holding the pairs (TensorParallelLayout.sequence_layers)."""
    return [pair.name.rpartition(".")[0] for pair in pairs]
