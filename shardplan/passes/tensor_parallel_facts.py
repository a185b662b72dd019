"""The tensor-parallel facts of a captured chain's blocks (chain.TensorParallelFacts), from the pairs
the graph offers (tensor_parallel.find_tensor_parallel_pairs).

A first cut, node by node: a block slices the nodes of its pairs' linears (their matmuls) and the
matmul-like ops inside a pair's module between them (attention over the heads), with their FLOPs,
bytes and outputs kept for backward (NodeFacts.selective_bytes); the parameters sliced are the
linears' weights and the column-parallel linears' biases. Approximations: every other op of the block
(norms, rotary tables, elementwise ops between the linears, softmax of an unfused attention) counts
as whole unless sequence parallelism divides the whole layer; a pair's exchange moves the block's
output bytes (its hidden states). Left out: vocab-parallel embeddings and heads, and pairs rejected
by the graph (their layers are not marked for sequence parallelism).
"""
import math
from dataclasses import replace

import torch.fx

from ..chain import BlockChain, TensorParallelFacts, merge_op_kinds
from ..plan import SELECTIVE_SAVED_OPS
from .blocks import group_nodes
from .facts import facts
from .tensor_parallel import Style, TensorParallelPair, find_tensor_parallel_pairs


def with_tensor_parallel_facts(gm: torch.fx.GraphModule, chain: BlockChain) -> BlockChain:
    """`chain` (built from `gm` by build_chain) with each block holding pairs given its facts."""
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
        near = {node for path, nodes in by_module.items() if path in linears or _inside(path, pair.name)
                for node in nodes}
        nodes = [node for node in sorted(near, key=position.__getitem__) if _sliced_by(node, pair)]
        owners = {block_of[node] for node in nodes}
        if len(owners) == 1:  # a pair across blocks is left whole (a first cut)
            found.setdefault(owners.pop(), []).append((pair, nodes))
    layers = set(_layers(candidates.pairs))
    parameters = dict(gm.named_parameters())
    blocks = list(chain.blocks)
    for index, pairs in found.items():
        nodes = [node for _, pair_nodes in pairs for node in pair_nodes]
        fwd = merge_op_kinds(facts(node).fwd_kinds for node in nodes)
        bwd = merge_op_kinds(facts(node).bwd_kinds for node in nodes)
        blocks[index] = replace(blocks[index], tensor_parallel=TensorParallelFacts(
            divides=math.gcd(*(divisor.size for pair, _ in pairs for divisor in pair.divisors)),
            divisors=tuple((divisor.size, divisor.what) for pair, _ in pairs for divisor in pair.divisors),
            sliced_numel=sum(_sliced_numel(parameters, pair) for pair, _ in pairs),
            fwd_kinds=fwd, bwd_kinds=bwd, sliced_fwd_flops=sum(k.flops for k in fwd),
            sliced_bwd_flops=sum(k.flops for k in bwd),
            sliced_saved_bytes=sum(facts(node).selective_bytes for node in nodes),
            sequence_layer=bool(layers.intersection(blocks[index].modules)), all_reduces=2 * len(pairs),
            exchange_bytes=blocks[index].output_bytes,
            sharded=tuple((linear.module, linear.label) for pair, _ in pairs for linear in pair.linears)))
    return replace(chain, blocks=tuple(blocks))


def _inside(path: str, module: str) -> bool:
    return path == module or path.startswith(module + ".")


def _sliced_by(node: torch.fx.Node, pair: TensorParallelPair) -> bool:
    """Whether `node` is a matmul of one of the pair's linears or a matmul-like op between them."""
    path = facts(node).module_path
    if any(path == linear.module for linear in pair.linears):
        return bool(facts(node).fwd_flops)
    target = getattr(node.target, "__name__", str(node.target)).split(".")[0]
    return _inside(path, pair.name) and target in SELECTIVE_SAVED_OPS


def _sliced_numel(parameters: dict, pair: TensorParallelPair) -> int:
    """The linears' weights, and the column-parallel ones' biases (a row-parallel bias stays whole)."""
    return sum(parameters[name].numel() for linear in pair.linears
               for name in (f"{linear.module}.weight", f"{linear.module}.bias")
               if name in parameters and (linear.style is Style.COLWISE or name.endswith(".weight")))


def _layers(pairs) -> list[str]:
    """The layers holding the pairs (TensorParallelLayout.sequence_layers)."""
    return [pair.name.rpartition(".")[0] for pair in pairs]
