"""Which chunk of each flattened parameter this rank holds, for either backend (see [Note: checkpoint format]).

A Holder is one tensor an optimizer steps and the parameters in it: a
shardplan unit (one flat shard, many parameters, cut anywhere by the rank
slices) or an FSDP2 parameter (a DTensor sharded along dim 0). Either way it
holds the flattened parameter, or under tp > 1 this tp rank's slice of it, in
contiguous pieces, one per rank at most; a slice's piece lies in the full
parameter as runs (ParameterSlice.runs), so each rank contributes one chunk per
run its piece meets. A tensor shaped like the holder's parameter (the parameter
itself, or its Adam moments) becomes one DCP entry per parameter name.
"""

import functools
import math
from typing import TYPE_CHECKING, Callable, NamedTuple, cast

import torch
import torch.nn as nn

from shardplan.common.dtypes import dtype_name
from shardplan.errors import ShardplanError
from shardplan.plan import Mesh
from shardplan.runtime import collectives
from shardplan.runtime.flat_param import FlatLayout
from shardplan.runtime.tensor_parallel import ParameterSlice, full_parameter
from shardplan.runtime.unit import FlatUnit

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


def unit_chunks(
    layout: FlatLayout,
    index: int,
    cut: ParameterSlice | None,
    *,
    sharded: bool,
    owner: Callable[[int, int], int],
) -> list[Chunk]:
    """Every holder's pieces of parameter `index`, by owner(shard index, tp index): for each tp index (0
    alone for a whole parameter), the runs of its slice (ParameterSlice.runs) cut by each rank's shard of
    the flat buffer (or by the whole buffer, shard index 0, when not `sharded`)."""
    begin, _ = layout.span(index)
    span = layout.shard_numel if sharded else layout.padded_numel
    shards = [
        (shard, shard * span - begin, (shard + 1) * span - begin)
        for shard in range(layout.dp if sharded else 1)
    ]
    return _sliced_chunks(shards, _runs(cut, layout.numels[index]), owner)


def _sliced_chunks(
    shards: list[tuple[int, int, int]],
    slices: list[tuple[tuple[int, int, int], ...]],
    owner: Callable[[int, int], int],
) -> list[Chunk]:
    """Every holder's pieces of one parameter: for each tp index, the runs of its slice (`slices`, from
    `_runs`) cut by each (shard index, low, high), the part of the flattened slice a shard holds, its local
    tensor beginning at `low` (which may lie before the parameter: a flat buffer's other parameters)."""
    chunks = []
    for tp, runs in enumerate(slices):
        for shard, low, high in shards:
            for local, full, numel in runs:
                start, end = max(local, low), min(local + numel, high)
                if end > start:
                    chunks.append(
                        Chunk(
                            rank=owner(shard, tp),
                            offset=full + start - local,
                            numel=end - start,
                            start=start - low,
                        )
                    )
    return chunks


def _runs(cut: ParameterSlice | None, numel: int) -> list[tuple[tuple[int, int, int], ...]]:
    """Each tp index's runs of a parameter (ParameterSlice.runs): one run at tp index 0 alone when it is
    whole (every tp rank holds it again)."""
    return [cut.of_rank(tp).runs() for tp in range(cut.degree)] if cut else [((0, 0, numel),)]


def replica_zero_owner(mesh: Mesh, coordinates: dict[str, int]) -> Callable[[int, int], int]:
    """(shard index, tp index) → the world rank that stands for that part of what the stage at `coordinates`
    holds: replica group 0's, which writes it in a checkpoint and counts it in the gradient norm."""

    def owner_rank(shard: int, tp: int) -> int:
        return sum(
            index * mesh.stride(dim)
            for dim, index in {
                **coordinates,
                "dp_replicate": 0,
                "dp_shard": shard,
                "tp": tp,
            }.items()
        )

    return owner_rank


def row_chunks(shape: torch.Size, dp: int) -> list[Chunk]:
    """Every rank's piece of a tensor sharded along dim 0 as torch.chunk cuts it (FSDP2's Shard(0))."""
    rows = shape[0] if len(shape) else 0
    row_numel = shape.numel() // rows if rows else 0
    per_rank = -(-rows // dp)
    chunks = []
    for rank in range(dp):
        low, high = min(rank * per_rank, rows), min((rank + 1) * per_rank, rows)
        if high > low:
            chunks.append(
                Chunk(rank=rank, offset=low * row_numel, numel=(high - low) * row_numel, start=0)
            )
    return chunks


def chunked_entry(local: torch.Tensor, numel: int, chunks: list[Chunk], rank: int) -> torch.Tensor:
    """One parameter's DCP entry: this rank's pieces of `local` (1-D), described with every rank's."""
    if not chunks:  # an empty parameter: nothing to shard
        return local[:0]
    pieces = [
        local[chunk.start : chunk.start + chunk.numel] for chunk in chunks if chunk.rank == rank
    ]
    return collectives.chunked_tensor(
        pieces, numel, [(chunk.rank, chunk.offset, chunk.numel) for chunk in chunks], local
    )


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
        return {
            name: (list(cut.full_shape if cut else shape), dtype)
            for name, shape, cut in zip(self.names, self.unit.layout.shapes, self.unit.cuts)
        }

    def entries(
        self, local: torch.Tensor, key: Key, *, loading: bool = False
    ) -> dict[str, torch.Tensor]:
        """One entry per parameter from `local`, a tensor shaped like the shard (see `_entries`)."""
        return self._entries(local, key, sharded=self.unit.traits.shards_optimizer, loading=loading)

    def _entries(
        self, local: torch.Tensor, key: Key, *, sharded: bool, loading: bool
    ) -> dict[str, torch.Tensor]:
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
        return self._entries(
            staged,
            key,
            sharded=self.unit.full is None and self.unit.traits.shards_optimizer,
            loading=True,
        )

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
        return [
            cut.gather(local, self.unit.place.tensor_parallel) if cut else local
            for local, cut in zip(self.unit.layout.split(self.unit.full_values()), self.unit.cuts)
        ]


class DTensorHolder:
    """An FSDP2 parameter: a DTensor whose rows FSDP2 shards over dp_shard (and replicates over dp_replicate,
    HSDP), of the whole parameter or, under tp > 1, of this tp rank's slice of it (`cut`)."""

    def __init__(
        self,
        name: str,
        parameter: nn.Parameter,
        slots: list[tuple[nn.Module, str, int]],
        program,
        cut: ParameterSlice | None,
    ):
        self.parameter = cast("DTensor", parameter)
        self.names = (name,)
        self.slots = slots
        self.label = f"parameter {name!r}"
        self.program = program
        self.cut = cut
        mesh = program.plan.mesh
        at = mesh.coordinates(collectives.world().rank)
        self.owner_rank = replica_zero_owner(mesh, at)
        self.mine = (at["dp_shard"], at["tp"] if cut else 0)
        """The (shard index, tp index) of the part this rank holds, as `owner_rank` takes them."""

    def shapes(self) -> dict[str, tuple[list[int], str]]:
        """Full shapes: a parameter tensor parallelism slices is saved whole."""
        return {
            self.names[0]: (
                list(self.cut.full_shape if self.cut else self.parameter.shape),
                dtype_name(self.parameter.dtype),
            )
        }

    def entries(
        self, tensor: torch.Tensor, key: Key, *, loading: bool = False
    ) -> dict[str, torch.Tensor]:
        """The entry of `tensor`, a DTensor placed like the parameter: each tp rank's slice (the whole
        parameter at tp index 0 alone, though every tp rank holds it) cut into the rows each shard holds,
        through the slice's runs in the full parameter; written by replica group 0 (every replica group
        holds them again); loading, every rank reads its own part."""
        self._check_placements()
        rank = collectives.world().rank
        owner = (
            functools.partial(_read_by, rank, self.mine, self.owner_rank)
            if loading
            else self.owner_rank
        )
        local = cast("DTensor", tensor).to_local().detach().reshape(-1)
        full_shape = self.cut.full_shape if self.cut else tuple(self.parameter.shape)
        held_shape = torch.Size(
            size // self.cut.degree if self.cut and dim == self.cut.dim else size
            for dim, size in enumerate(full_shape)
        )  # this tp rank's slice, whole over dp
        rows = row_chunks(held_shape, self.program.plan.mesh.dp_shard)
        held = sum(chunk.numel for chunk in rows if chunk.rank == self.mine[0])
        if local.numel() != held:
            raise ShardplanError(
                f"{self.label}: FSDP2 holds {local.numel()} elements on rank {rank}, "
                f"torch.chunk along dim 0 gives {held}: use backend='shardplan' for checkpoints"
            )
        shards = [(chunk.rank, chunk.offset, chunk.offset + chunk.numel) for chunk in rows]
        chunks = _sliced_chunks(shards, _runs(self.cut, held_shape.numel()), owner)
        return {key(self.names[0]): chunked_entry(local, math.prod(full_shape), chunks, rank)}

    def _check_placements(self) -> None:
        """Refuse a placement `entries` cannot describe: rows sharded over dp_shard (strided over the tp
        slices where FSDP2 shards a tensor-parallel DTensor), replicated over dp_replicate, and over tp
        sliced along the cut's dim or replicated."""
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.placement_types import (
            _StridedShard,  # FSDP2's dp placement over a tp slice
        )

        expected = {
            "dp_replicate": (Replicate(),),
            "dp_shard": (Shard(0), _StridedShard(0, split_factor=self.program.plan.mesh.tp)),
            "tp": (Shard(self.cut.dim) if self.cut else Replicate(),),
        }
        names = self.parameter.device_mesh.mesh_dim_names or ()
        placements = tuple(self.parameter.placements)
        if len(names) != len(placements) or not all(
            placement in expected.get(name, ()) for name, placement in zip(names, placements)
        ):
            raise ShardplanError(
                f"{self.label} is placed {placements} over mesh dims {names}, which checkpoints "
                "cannot describe (dp_shard rows, tp slices): use backend='shardplan'"
            )

    def staged(self) -> torch.Tensor:
        return self.parameter.detach().clone()

    def load_entries(self, staged: torch.Tensor, key: Key) -> dict[str, torch.Tensor]:
        return self.entries(staged, key, loading=True)

    def apply(self, staged: torch.Tensor) -> None:
        with torch.no_grad():
            self.parameter.copy_(staged)

    def gather(self) -> list[torch.Tensor]:
        return [
            full_parameter(
                self.parameter, self.program.fused.get(self.names[0], 1), self.program.plan.mesh.tp
            )
        ]


def _read_by(
    rank: int, mine: tuple[int, int], owner_rank: Callable[[int, int], int], shard: int, tp: int
) -> int:
    """Loading: the part this rank holds is read by this rank, every other by its owner."""
    return rank if (shard, tp) == mine else owner_rank(shard, tp)


Holder = UnitHolder | DTensorHolder


def dtensor_holders(program, cuts: dict[str, ParameterSlice]) -> list[DTensorHolder]:
    """A program whose parameters are its modules' own (DTensors under FSDP2), in named_parameters order;
    `cuts`: the slice of each parameter tensor parallelism sliced."""
    slots: dict[int, list[tuple[nn.Module, str, int]]] = {}
    for _, module in program.module.named_modules(remove_duplicate=False):
        for attribute, parameter in module._parameters.items():
            if parameter is not None:
                slots.setdefault(id(parameter), []).append((module, attribute, 0))
    return [
        DTensorHolder(name, parameter, slots[id(parameter)], program, cuts.get(name))
        for name, parameter in program.module.named_parameters()
    ]
