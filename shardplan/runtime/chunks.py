"""Which chunk of each flattened parameter this rank holds, for either backend (see [Note: checkpoint format]).

A Holder is one tensor an optimizer steps and the parameters in it: a
shardplan unit (one flat shard, many parameters, cut anywhere by the rank
slices) or an FSDP2 parameter (a DTensor sharded along dim 0). Either way a
parameter flattened to 1-D is held in contiguous chunks, one per rank at most,
and a tensor shaped like the holder's parameter (the parameter itself, or its
Adam moments) becomes one DCP entry per parameter name.
"""
import functools
import math
from typing import TYPE_CHECKING, Callable, NamedTuple, cast

import torch
import torch.nn as nn

from ..dtypes import dtype_name
from ..errors import ShardplanError
from . import collectives
from .flat_param import FlatLayout
from .tensor_parallel import ParameterSlice, full_parameter
from .unit import FlatUnit

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

Key = Callable[[str], str]
"""Parameter name → DCP entry name (`model.<name>`, `optim.<name>.exp_avg`)."""


class Chunk(NamedTuple):
    """Where one rank's piece of one flattened parameter lies."""

    rank: int
    offset: int
    """First element of the piece in the flattened parameter."""
    numel: int
    start: int
    """First element of the piece in that rank's local tensor."""


def unit_chunks(layout: FlatLayout, index: int, cut: ParameterSlice | None, *, sharded: bool,
                owner: Callable[[int, int], int]) -> list[Chunk]:
    """Every holder's pieces of parameter `index`, by owner(shard index, tp index): for each tp index (0
    alone for a whole parameter), the runs of its slice (ParameterSlice.runs) cut by each rank's shard of
    the flat buffer (or by the whole buffer, shard index 0, when not `sharded`)."""
    begin, _ = layout.span(index)
    span = layout.shard_numel if sharded else layout.padded_numel
    slices = [cut.of_rank(tp).runs() for tp in range(cut.degree)] if cut else [((0, 0, layout.numels[index]),)]
    chunks = []
    for tp, runs in enumerate(slices):
        for shard in range(layout.dp if sharded else 1):
            low, high = shard * span, (shard + 1) * span
            for local, full, numel in runs:
                start, end = max(begin + local, low), min(begin + local + numel, high)
                if end > start:
                    chunks.append(Chunk(rank=owner(shard, tp), offset=full + start - begin - local,
                                        numel=end - start, start=start - low))
    return chunks


def row_chunks(shape: torch.Size, dp: int) -> list[Chunk]:
    """Every rank's piece of a tensor sharded along dim 0 as torch.chunk cuts it (FSDP2's Shard(0))."""
    rows = shape[0] if len(shape) else 0
    row_numel = shape.numel() // rows if rows else 0
    per_rank = -(-rows // dp)
    chunks = []
    for rank in range(dp):
        low, high = min(rank * per_rank, rows), min((rank + 1) * per_rank, rows)
        if high > low:
            chunks.append(Chunk(rank=rank, offset=low * row_numel, numel=(high - low) * row_numel, start=0))
    return chunks


def chunked_entry(local: torch.Tensor, numel: int, chunks: list[Chunk], rank: int) -> torch.Tensor:
    """One parameter's DCP entry: this rank's pieces of `local` (1-D), described with every rank's."""
    if not chunks:  # an empty parameter: nothing to shard
        return local[:0]
    pieces = [local[chunk.start:chunk.start + chunk.numel] for chunk in chunks if chunk.rank == rank]
    return collectives.chunked_tensor(pieces, numel, [(chunk.rank, chunk.offset, chunk.numel) for chunk in chunks],
                                      local)


class UnitHolder:
    """A shardplan unit: one flat shard (or the whole buffer, when stepped whole) holding many parameters."""

    def __init__(self, unit: FlatUnit):
        self.unit = unit
        self.parameter = unit.shard
        """What the optimizer steps: its state is keyed by it and shaped like it."""
        self.names = unit.layout.names
        self.slots = unit.slots
        """(module, attribute, index in names) for every place a parameter is presented, ties included."""
        self.label = f"unit {unit.name!r}"

    def shapes(self) -> dict[str, tuple[list[int], str]]:
        """Full shapes: a parameter tensor parallelism slices is saved whole."""
        dtype = dtype_name(self.unit.layout.dtype)
        return {name: (list(cut.full_shape if cut else shape), dtype)
                for name, shape, cut in zip(self.names, self.unit.layout.shapes, self.unit.cuts)}

    def entries(self, local: torch.Tensor, key: Key, *, loading: bool = False) -> dict[str, torch.Tensor]:
        """One entry per parameter from `local`, a tensor shaped like the shard (see `_entries`)."""
        return self._entries(local, key, sharded=self.unit.traits.shards_optimizer, loading=loading)

    def _entries(self, local: torch.Tensor, key: Key, *, sharded: bool, loading: bool) -> dict[str, torch.Tensor]:
        """One entry per parameter, under its full name and numel, from `local`: this rank's shard when
        `sharded`, else the whole buffer. A part held on several ranks (by every replica group, by every tp
        rank for a whole parameter) is written by one of them (UnitPlace.owner_rank); loading, every rank
        reads its own part."""
        local = local.detach()
        layout, place = self.unit.layout, self.unit.place
        owner = place.owner_rank
        rank = collectives.world().rank
        entries = {}
        for index, (name, cut) in enumerate(zip(self.names, self.unit.cuts)):
            mine = (place.shard_rank if sharded else 0, place.tp_index if cut else 0)
            if loading:
                owner = functools.partial(_read_by, rank, mine, place.owner_rank)
            chunks = unit_chunks(layout, index, cut, sharded=sharded, owner=owner)
            numel = math.prod(cut.full_shape) if cut else layout.numels[index]
            entries[key(name)] = chunked_entry(local, numel, chunks, rank)
        return entries

    def staged(self) -> torch.Tensor:
        """A copy of what loading overwrites, for a load to fill before anything live changes (what no
        entry covers, the padding, keeps its value). A SHARD_OPTIMIZER unit loads its whole `full` buffer,
        which every rank keeps anyway: nothing to gather after, and saving read the shard (`full` may be
        stale)."""
        return self._loaded().clone()

    def load_entries(self, staged: torch.Tensor, key: Key) -> dict[str, torch.Tensor]:
        """Where loading writes the parameters: into `staged`."""
        return self._entries(staged, key, sharded=self.unit.full is None and self.unit.traits.shards_optimizer,
                             loading=True)

    def apply(self, staged: torch.Tensor) -> None:
        """Make a filled `staged` the parameters: the unit resharded, a loaded `full` current on every rank."""
        self.unit.release()
        with torch.no_grad():
            self._loaded().copy_(staged)
        if self.unit.full is not None:
            self.unit._synced_version = self.unit.shard._version

    def _loaded(self) -> torch.Tensor:
        return (self.unit.full if self.unit.full is not None else self.unit.shard).detach()

    def gather(self) -> list[torch.Tensor]:
        """Every parameter whole (a collective for sharded units and sliced parameters: call on every rank)."""
        return [cut.gather(local, self.unit.place.tensor_parallel) if cut else local
                for local, cut in zip(self.unit.layout.split(self.unit.full_values()), self.unit.cuts)]


class DTensorHolder:
    """An FSDP2 parameter: a DTensor sharded along dim 0 over the data-parallel ranks."""

    def __init__(self, name: str, parameter: nn.Parameter, slots: list[tuple[nn.Module, str, int]],
                 program):
        self.parameter = cast("DTensor", parameter)
        self.names = (name,)
        self.slots = slots
        self.label = f"parameter {name!r}"
        self.program = program

    def shapes(self) -> dict[str, tuple[list[int], str]]:
        return {self.names[0]: (list(self.parameter.shape), dtype_name(self.parameter.dtype))}

    def entries(self, tensor: torch.Tensor, key: Key, *, loading: bool = False) -> dict[str, torch.Tensor]:
        """The entry of `tensor`, a DTensor placed like the parameter: rows sharded over dp_shard, written
        by replica group 0 under HSDP (every replica group holds them again); loading, every rank reads
        its own rows."""
        from torch.distributed.tensor import Replicate, Shard

        placements = tuple(self.parameter.placements)
        mesh = self.parameter.device_mesh
        # under tp > 1 a parameter left whole is held by every tp rank's replica group 0: refuse the plan
        # as a whole, not only the sliced parameters, or the whole ones get a writer per tp rank
        if self.program.plan.mesh.tp > 1 or placements not in ((Shard(0),), (Replicate(), Shard(0))):
            raise ShardplanError(f"{self.label} is placed {placements} in a plan with tp={self.program.plan.mesh.tp}: "
                                 "checkpoints of tensor-parallel plans on backend='fsdp2' are not written yet; "
                                 "use backend='shardplan'")
        owners = mesh.mesh.reshape(-1, mesh.mesh.shape[-1])[0].tolist()  # replica group 0's ranks, by shard
        shard = mesh.get_local_rank(len(placements) - 1)
        rank = collectives.world().rank
        if loading:
            owners[shard] = rank
        local = cast("DTensor", tensor).to_local().detach().reshape(-1)
        rows = row_chunks(self.parameter.shape, len(owners))
        held = sum(chunk.numel for chunk in rows if chunk.rank == shard)
        if local.numel() != held:
            raise ShardplanError(f"{self.label}: FSDP2 holds {local.numel()} elements on rank {rank}, "
                                 f"torch.chunk along dim 0 gives {held}: use backend='shardplan' for checkpoints")
        chunks = [chunk._replace(rank=owners[chunk.rank]) for chunk in rows]
        return {key(self.names[0]): chunked_entry(local, self.parameter.numel(), chunks, rank)}

    def staged(self) -> torch.Tensor:
        return self.parameter.detach().clone()

    def load_entries(self, staged: torch.Tensor, key: Key) -> dict[str, torch.Tensor]:
        return self.entries(staged, key, loading=True)

    def apply(self, staged: torch.Tensor) -> None:
        with torch.no_grad():
            self.parameter.copy_(staged)

    def gather(self) -> list[torch.Tensor]:
        return [full_parameter(self.parameter, self.program.fused.get(self.names[0], 1), self.program.plan.mesh.tp)]


def _read_by(rank: int, mine: tuple[int, int], owner_rank: Callable[[int, int], int], shard: int, tp: int) -> int:
    """Loading: the part this rank holds is read by this rank, every other by its owner."""
    return rank if (shard, tp) == mine else owner_rank(shard, tp)


Holder = UnitHolder | DTensorHolder


def dtensor_holders(program) -> list[DTensorHolder]:
    """A program whose parameters are its modules' own (DTensors under FSDP2), in named_parameters order."""
    slots: dict[int, list[tuple[nn.Module, str, int]]] = {}
    for _, module in program.module.named_modules(remove_duplicate=False):
        for attribute, parameter in module._parameters.items():
            if parameter is not None:
                slots.setdefault(id(parameter), []).append((module, attribute, 0))
    return [DTensorHolder(name, parameter, slots[id(parameter)], program)
            for name, parameter in program.module.named_parameters()]
