"""Node names of a spliced graph (passes/splice.py) as a whole-model export names them.

Export names a node after its op and numbers each op's nodes in the order it traces them ("linear",
"linear_1", ...), counting some nodes it later drops, so the numbers have gaps. A copy spliced in
where one opaque op stood takes as many numbers of each op as its representative took (the gaps
included: up to the representative's next node of that op), and every node after it moves up by
them. Names are for people (Block.first_node, last_node): nothing is looked up by them.
"""

import re

import torch.fx

_NUMBERED = re.compile(r"^(.*)_(\d+)$")


def _split(name: str) -> tuple[str, int]:
    match = _NUMBERED.match(name)
    return (match.group(1), int(match.group(2))) if match else (name, 0)


def _named(node: torch.fx.Node, state: set[str]) -> bool:
    """Nodes export numbers by op: not inputs, outputs or parameters (named after the parameter)."""
    return node.op not in ("placeholder", "output") and not (
        node.op == "get_attr" and node.target in state
    )


def name_as_export(
    before: list[torch.fx.Node],
    spliced: dict[torch.fx.Node, list[tuple[torch.fx.Node, torch.fx.Node]]],
    state: set[str],
) -> None:
    """Rename the nodes of `before` (the graph's order before splicing, copies' ops included) and of
    `spliced` (copy op → its (new node, representative's node) pairs), as export would have."""
    numbered = [
        (node, *_split(node.name)) for node in before if _named(node, state) and node not in spliced
    ]
    position = {node: index for index, (node, _, _) in enumerate(numbered)}
    taken = _taken_per_representative(before, spliced, numbered, position)
    shift: dict[str, int] = {}
    following = _next_numbers(before, numbered, spliced)
    names: dict[torch.fx.Node, str] = {}
    for node in before:
        if node in spliced:
            first_of, used = taken[id(spliced[node][0][1])] if spliced[node] else ({}, {})
            for new, member in spliced[node]:
                base, number = _split(member.name)
                start = following[node].get(base, 0) + shift.get(base, 0)
                names[new] = _name(base, number - first_of[base] + start)
            for base, count in used.items():
                shift[base] = shift.get(base, 0) + count
        elif node in position:
            _, base, number = numbered[position[node]]
            names[node] = _name(base, number + shift.get(base, 0))
    for node, name in names.items():
        node.name = name


def _name(base: str, number: int) -> str:
    return f"{base}_{number}" if number else base


def _taken_per_representative(before, spliced, numbered, position):
    """Representative's first node (by id) → (its first number of each op, the numbers it took)."""
    taken = {}
    for pairs in spliced.values():
        if not pairs or id(pairs[0][1]) in taken:
            continue
        members = [member for _, member in pairs]
        first_of: dict[str, int] = {}
        last_of: dict[str, int] = {}
        for member in members:
            base, number = _split(member.name)
            first_of.setdefault(base, number)
            last_of[base] = number
        last_index = max(position[m] for m in members if m in position)
        after: dict[str, int] = {}
        for _, base, number in numbered[last_index + 1 :]:
            after.setdefault(base, number)
        used = {
            base: after.get(base, last_of[base] + 1) - first for base, first in first_of.items()
        }
        taken[id(pairs[0][1])] = (first_of, used)
    return taken


def _next_numbers(before, numbered, spliced) -> dict[torch.fx.Node, dict[str, int]]:
    """For each copy op, each op's number the export counter stood at there: the next node's of that
    op after it, else one past the last before it."""
    result = {}
    upcoming: dict[str, int] = {}
    numbered_set = {node: (base, number) for node, base, number in numbered}
    for node in reversed(before):
        if node in spliced:
            result[node] = dict(upcoming)
        elif node in numbered_set:
            base, number = numbered_set[node]
            upcoming[base] = number
    seen: dict[str, int] = {}
    for node in before:
        if node in spliced:
            for base, number in seen.items():
                result[node].setdefault(base, number + 1)
        elif node in numbered_set:
            base, number = numbered_set[node]
            seen[base] = number
    return result
