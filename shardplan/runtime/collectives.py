"""Every call the runtime makes into torch.distributed: free functions returning small named tuples.

This is the only module of shardplan that talks to the process group, so the
communication a step does can be read (and counted) in one place. The one
exception is delegated: with pp > 1, torch.distributed.pipelining's stage
(pipelined.py) sends activations and their gradients between stages over the
pipeline group made here.

[Note: averaging] gloo has no ReduceOp.AVG, so gradients are divided by the
group size before a SUM reduction; dividing first also keeps a low-precision
reduce dtype from overflowing.
"""

import contextlib
import datetime
import hashlib
import warnings
from typing import TYPE_CHECKING, Any, Iterator, NamedTuple, TypeVar, cast

import torch
import torch.distributed as dist

from shardplan.errors import RuntimeMismatchError, ShardplanError
from shardplan.plan import MESH_DIMS, Mesh

if TYPE_CHECKING:  # for annotations only: the functions import these modules where they use them
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.checkpoint import StorageReader, StorageWriter
    from torch.distributed.device_mesh import DeviceMesh

T = TypeVar("T")

Group = dist.ProcessGroup | None
"""A process group; None is the whole world."""


class World(NamedTuple):
    rank: int
    size: int


class Pending(NamedTuple):
    """An issued collective: `output` holds the result once `work` has been waited on."""

    output: torch.Tensor
    work: dist.Work | None
    """None when the collective already completed (synchronous, or a group of one)."""


_issued = 0
"""Collectives this process has issued through this module. Every rank issues the same sequence, so
after a failure equal counts on every rank mean every collective in flight has its partners
(see [Note: failed steps] in program.py)."""


def _issue() -> None:
    global _issued
    _issued += 1


def issued() -> int:
    return _issued


def world() -> World:
    if not dist.is_available() or not dist.is_initialized():
        raise ShardplanError(
            "torch.distributed is not initialized: call "
            "torch.distributed.init_process_group(...) on every rank (torchrun does the "
            "environment) before shardplan.parallelize"
        )
    return World(dist.get_rank(), dist.get_world_size())


def group_world(group: Group) -> World:
    """This rank's index in `group` and the group's size (None: the world)."""
    return World(dist.get_rank(group), dist.get_world_size(group))


def group_name(group: Group) -> str:
    """The name `group_named` finds `group` by: how a captured graph's nodes name a group."""
    return cast(dist.ProcessGroup, dist.group.WORLD if group is None else group).group_name


def group_named(name: str) -> dist.ProcessGroup:
    return dist.distributed_c10d._resolve_process_group(
        cast(Any, name)
    )  # a GroupName is a str at run time


def wait(pending: Pending) -> torch.Tensor:
    if pending.work is not None:
        pending.work.wait()
    return pending.output


def all_gather(shard: torch.Tensor, *, async_op: bool, group: Group = None) -> Pending:
    """Concatenate every rank's `shard` (1-D, same numel everywhere) in rank order.

    [Note: groups of one] Over a group of one rank (a pipeline stage without data parallelism) the
    collectives return their input itself: no copy, as the cost model prices them (nothing). (FSDP2
    allocates its gather outputs even over one rank: the cost model prices this backend's runtime.)"""
    size = dist.get_world_size(group)
    if size == 1:
        return Pending(shard, None)
    output = shard.new_empty(shard.numel() * size)
    _issue()
    work = dist.all_gather_single(output, shard, group=group, async_op=async_op)
    return Pending(output, work if async_op else None)


def reduce_scatter_mean(full: torch.Tensor, *, async_op: bool, group: Group = None) -> Pending:
    """Average `full` (1-D, numel divisible by the world size) over ranks; keep this rank's slice.

    `full` is divided in place (see [Note: averaging]); see [Note: groups of one]."""
    size = dist.get_world_size(group)
    if size == 1:
        return Pending(full, None)
    full.div_(size)
    output = full.new_empty(full.numel() // size)
    _issue()
    work = dist.reduce_scatter_single(
        output, full, op=dist.ReduceOp.SUM, group=group, async_op=async_op
    )
    return Pending(output, work if async_op else None)


def all_reduce_mean(full: torch.Tensor, *, async_op: bool, group: Group = None) -> Pending:
    """Average `full` over ranks, in place (see [Note: averaging])."""
    size = dist.get_world_size(group)
    if size == 1:
        return Pending(full, None)
    full.div_(size)
    _issue()
    work = dist.all_reduce(full, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    return Pending(full, work if async_op else None)


def all_reduce_sum(tensor: torch.Tensor, group: Group = None) -> torch.Tensor:
    if dist.get_world_size(group) > 1:
        _issue()
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def all_reduce_max(tensor: torch.Tensor, group: Group = None) -> torch.Tensor:
    if dist.get_world_size(group) > 1:
        _issue()
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor


def broadcast_(tensor: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Overwrite `tensor` on every rank of `group` with the values of the group's first rank (in place)."""
    if dist.get_world_size(group) > 1:
        _issue()
        dist.broadcast(tensor, group=group, group_src=0)
    return tensor


def check_same_on_all_ranks(text: str, what: str) -> None:
    """Raise on every rank when the ranks were given different `text` (e.g. different plans)."""
    digest = hashlib.sha256(text.encode()).digest()[:8]
    if not same_on_all_ranks(list(digest)):
        raise RuntimeMismatchError(
            f"ranks were given different {what} (rank {dist.get_rank()} of "
            f"{dist.get_world_size()} differs): load the same plan file on every rank"
        )


def same_on_all_ranks(values: list[int], group: Group = None) -> bool:
    """Whether every rank of `group` passed the same `values` (the answer is the same on every rank)."""
    mine = torch.tensor(values, dtype=torch.int64)
    highest, lowest = mine.clone(), -mine
    all_reduce_max(highest, group)
    all_reduce_max(lowest, group)
    return torch.equal(highest, mine) and torch.equal(-lowest, mine)


def control_group() -> dist.ProcessGroup:
    """A gloo group of the whole world that only failure handling uses, so ranks can compare where they
    stopped while the world's own collectives are out of step (see [Note: failed steps] in program.py).

    Its timeout is twice the world's: a rank whose step failed alone waits here while its peers run
    into the world's timeout, and then hears from them."""
    return dist.new_group(backend="gloo", timeout=2 * _world_timeout())


def agree_after_failure(values: list[int], group: dist.ProcessGroup) -> bool:
    """same_on_all_ranks over the control group; False when a rank never comes (timeout) or is gone."""
    try:
        return same_on_all_ranks(values, group)
    except Exception:  # DistBackendError, a timeout's RuntimeError: no agreement either way
        return False


def _world_timeout() -> datetime.timedelta:
    """The timeout the world's process group was made with (init_process_group's `timeout`)."""
    world_group = cast(dist.ProcessGroup, dist.group.WORLD)  # None only before init_process_group
    for device_type in ("cpu", "cuda"):
        try:
            return world_group._get_backend(torch.device(device_type)).options._timeout
        except RuntimeError:  # no backend for this device type in the world group
            continue
    return dist.distributed_c10d.default_pg_timeout


def device_mesh(device_type: str, plan_mesh: Mesh) -> "DeviceMesh":
    """The plan's mesh as a DeviceMesh, dims named as plan.MESH_DIMS in the plan's rank layout ([Note:
    rank layout]: init_device_mesh numbers ranks row-major, tp innermost). The one place the runtime
    makes process groups for a plan: FSDP2 shards over mesh["dp_replicate", "dp_shard"] (HSDP) and
    DTensor's tensor parallelism runs on mesh["tp"]; mesh_groups takes the groups of its dims."""
    from torch.distributed.device_mesh import init_device_mesh

    size = dist.get_world_size()
    if plan_mesh.size != size:
        raise RuntimeMismatchError(
            f"the mesh {plan_mesh.describe()} is {plan_mesh.size} ranks, the world has "
            f"{size}: launch {plan_mesh.size} ranks, or use a mesh of {size}"
        )
    return init_device_mesh(
        device_type, tuple(getattr(plan_mesh, dim) for dim in MESH_DIMS), mesh_dim_names=MESH_DIMS
    )


class MeshGroups(NamedTuple):
    """This rank's place in the plan's mesh and the process groups along its dimensions."""

    coordinates: dict[str, int]
    """This rank's index along each of plan.MESH_DIMS in the mesh the units see (Mesh.parameter_mesh:
    cp folded into dp_shard)."""
    tensor_parallel: dist.ProcessGroup
    """Consecutive ranks: they slice the same replica's sharded modules."""
    shard: dist.ProcessGroup
    """Same stage, replica group and tp index: a unit's flat buffer is sharded over them (dp_shard ×
    cp)."""
    replicate: dist.ProcessGroup
    """Same stage, shard and tp index: they hold the same shards and all-reduce their gradients (HSDP)."""
    data_parallel: dist.ProcessGroup
    """Same stage and tp index: every data-parallel replica of what this rank holds (and its cp ranks,
    which hold the same parameters)."""
    pipeline: dist.ProcessGroup
    """Same replica and tp index, one rank per stage: activations flow between them."""
    mesh: "DeviceMesh"
    """The DeviceMesh (device_mesh) the groups come from."""
    context_parallel: dist.ProcessGroup
    """Same stage, replica, shard and tp index: they split one sequence ([Note: context parallelism])."""


def mesh_groups(device_type: str, plan_mesh: Mesh) -> MeshGroups:
    mesh = device_mesh(device_type, plan_mesh)
    # the cp ranks hold the same parameters: they shard and reduce them with the dp_shard ranks
    sharding = ("dp_shard", "cp") if plan_mesh.cp > 1 else ("dp_shard",)
    data_parallel = mesh[("dp_replicate", *sharding)]._flatten("dp")
    shard = (
        mesh[sharding]._flatten("dp_shard_cp").get_group()
        if plan_mesh.cp > 1
        else mesh.get_group("dp_shard")
    )
    return MeshGroups(
        coordinates=plan_mesh.parameter_mesh.coordinates(dist.get_rank()),
        tensor_parallel=mesh.get_group("tp"),
        shard=shard,
        replicate=mesh.get_group("dp_replicate"),
        data_parallel=data_parallel.get_group(),
        pipeline=mesh.get_group("pp"),
        mesh=mesh,
        context_parallel=mesh.get_group("cp"),
    )


def stages_group(
    plan_mesh: Mesh, stages: tuple[int, ...], backend: str | None = None
) -> dist.ProcessGroup | None:
    """The ranks of `stages` (sorted) that share this rank's replica and tp index, as a group (None when this
    rank's stage is not among them) of `backend` (None: the world's). Every rank makes every such group,
    so call it on all ranks alike."""
    step = plan_mesh.stride("pp")
    mine = None
    for first in range(stages[0] * step, (stages[0] + 1) * step):
        ranks = [first + (stage - stages[0]) * step for stage in stages]
        group = dist.new_group(ranks, backend=backend)
        if dist.get_rank() in ranks:
            mine = group
    return mine


def broadcast_from(tensor: torch.Tensor, source: int, group: Group) -> torch.Tensor:
    """Overwrite `tensor` on every rank of `group` with world rank `source`'s values (in place)."""
    _issue()
    dist.broadcast(tensor, src=source, group=group)
    return tensor


def default_device() -> torch.device:
    """The current CUDA device when the process group runs NCCL, else CPU."""
    if dist.get_backend() == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def barrier() -> None:
    if dist.get_world_size() > 1:
        _issue()
        dist.barrier()


def shutdown() -> None:
    """Leave the process group cleanly: wait for every rank, free programs, then destroy it.

    [Note: shutdown] Programs are reference cycles (wrapped forwards, FSDP2's device
    mesh) that keep the process group alive. Destroyed by the garbage collector at
    interpreter exit, after the group, gloo's threads are torn down while joinable
    and the rank aborts ("terminate called without an active exception"), now and
    then, more often on a loaded machine. Collecting them first, while every rank
    is past its last collective, avoids it.
    """
    import gc

    barrier()
    gc.collect()
    dist.destroy_process_group()


def all_gather_object(value: T) -> list[T]:
    """Every rank's picklable `value`, in rank order, on every rank."""
    if dist.get_world_size() == 1:
        return [value]
    found: list[Any] = [None] * dist.get_world_size()
    _issue()
    dist.all_gather_object(found, value)
    return found


def gather_object(value: T) -> list[T] | None:
    """Every rank's picklable `value`, in rank order, on rank 0 (None elsewhere)."""
    if dist.get_world_size() == 1:
        return [value]
    found: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    _issue()
    dist.gather_object(value, found, dst=0)
    return found


def global_rank(group: Group, group_rank: int) -> int:
    """The world rank of `group`'s rank `group_rank` (None: the world itself)."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def broadcast_object(value: T, source_rank: int = 0) -> T:
    """`source_rank`'s picklable `value` on every rank (so every rank can raise the same error)."""
    if dist.get_world_size() == 1:
        return value
    box = [value]
    _issue()
    dist.broadcast_object_list(box, src=source_rank)
    return box[0]


def chunked_tensor(
    local: list[torch.Tensor], numel: int, chunks: list[tuple[int, int, int]], like: torch.Tensor
) -> "ShardedTensor":
    """A 1-D tensor of `numel` elements held in chunks over ranks, for torch.distributed.checkpoint.

    `chunks` lists (rank, offset, numel) for every rank's chunk; `local` is this rank's chunks, in
    the order `chunks` lists them (none when the rank holds none). The global layout is known on
    every rank, so no communication is needed to describe it. `like` gives the dtype and device."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import (
        ShardedTensorMetadata,
        TensorProperties,
    )

    rank = dist.get_rank()
    metadata = [
        ShardMetadata(
            shard_offsets=[offset], shard_sizes=[size], placement=f"rank:{owner}/{like.device}"
        )
        for owner, offset, size in chunks
    ]
    mine = [shard for shard, (owner, _, _) in zip(metadata, chunks) if owner == rank]
    local_shards = [Shard(piece, shard) for piece, shard in zip(local, mine, strict=True)]
    properties = TensorProperties(
        dtype=like.dtype,
        layout=torch.strided,
        requires_grad=False,
        memory_format=torch.contiguous_format,
        pin_memory=False,
    )
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local_shards, ShardedTensorMetadata(metadata, torch.Size([numel]), properties)
    )


def save_checkpoint(state: dict, writer: "StorageWriter") -> None:
    """Every rank writes its chunks of `state` (plain tensors: one rank writes each) through `writer`.

    DCP reports a failure on any rank as a CheckpointException on every rank: a BaseException, which
    `except Exception` misses, carrying every rank's traceback. The first failing rank's own error is
    raised instead."""
    import torch.distributed.checkpoint as dcp

    with _sharded_tensor_without_deprecation_warnings(), _first_failure():
        dcp.save(state, storage_writer=writer)


def load_checkpoint(state: dict, reader: "StorageReader") -> None:
    """Fill `state`'s tensors in place with the chunks this rank holds, whatever chunks were saved; a
    failure as in save_checkpoint."""
    import torch.distributed.checkpoint as dcp

    with _sharded_tensor_without_deprecation_warnings(), _first_failure():
        dcp.load(state, storage_reader=reader)


@contextlib.contextmanager
def _first_failure() -> Iterator[None]:
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as failure:
        rank = min(failure.failures)
        error = failure.failures[rank][0]
        raise RuntimeError(f"rank {rank}: {' '.join(str(error).split())[:400]}") from None


@contextlib.contextmanager
def _sharded_tensor_without_deprecation_warnings() -> Iterator[None]:
    """ShardedTensor is deprecated as a compute type in favour of DTensor, but it is the only type
    DCP reads and writes at arbitrary chunk offsets (a DTensor shards evenly along dims); DCP
    warns each time it touches one, hundreds of times per checkpoint."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=".*deprecating ShardedTensor", category=FutureWarning
        )
        yield


def all_gather_along(tensor: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """Every rank's `tensor` (same shape everywhere) concatenated along `dim` in rank order: a
    sequence or vocabulary sharded over tensor parallelism, made whole (see [Note: groups of one])."""
    size = dist.get_world_size(group)
    if size == 1:
        return tensor
    moved = tensor.movedim(dim, 0).contiguous()
    output = moved.new_empty((size * moved.shape[0], *moved.shape[1:]))
    dist.all_gather_single(output, moved, group=group)
    return output.movedim(0, dim).contiguous()


def reduce_scatter_sum_along(tensor: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """The sum of every rank's `tensor` over the ranks, keeping this rank's slice along `dim`
    (which the group's size must divide): row-parallel partial products onto a sharded sequence."""
    size = dist.get_world_size(group)
    if size == 1:
        return tensor
    moved = tensor.movedim(dim, 0).contiguous()
    output = moved.new_empty((moved.shape[0] // size, *moved.shape[1:]))
    dist.reduce_scatter_single(output, moved, op=dist.ReduceOp.SUM, group=group)
    return output.movedim(0, dim).contiguous()
