"""Checkpoints of a program: save, load on any world size, plan and backend, export a full state dict.

[Note: checkpoint format] A checkpoint is a directory written by
torch.distributed.checkpoint (DCP) plus `shardplan.json`. Every parameter is
stored as one flattened 1-D tensor under `model.<name>`, whatever unit, plan,
world size or backend held it: each rank contributes the chunk of it that its
flat shard covers (padding excluded; an FSDP2 rank its rows), a REPLICATE unit
the whole tensor (DCP writes one copy); see chunks.py. A parameter tensor
parallelism slices is stored whole as well: each tp rank's chunks are the runs
of its slice in the full parameter, cut by its flat shard or FSDP2 rows. Optimizer state shaped like the shard is stored the same way under
`optim.<name>.<key>`; scalar state (Adam's step) as one tensor per parameter.
Persistent buffers are `model.<name>` too. Loading asks DCP for exactly the
chunks this rank's new shards cover, so a checkpoint saved at one world size
and unit grouping loads into any other (DCP reads across chunk boundaries).
`shardplan.json` holds the format version, the plan, the world size, the names,
shapes and dtypes of parameters and buffers, the optimizer's state schema
and hyperparameters, the names of extra stateful objects saved beside the model (see [Note:
extra state]), and the manifest: every other file's size and SHA-256.
It is written last, so a directory without it is not a checkpoint; it is read
within files.py's bounds on size and depth and checked against
schemas/checkpoint.schema.json. See [Note: trust model] in dcp_storage.py.

[Note: atomic save] Every rank checks that all were given the same path. Rank 0
refuses a path the renames below cannot replace safely (the working directory,
a symbolic link, a file, a directory that is not a checkpoint) before
anything is written. Ranks write into `<path>.partial` (rank 0 removes a stale
one first) and checksum the files they wrote; rank 0 then writes `shardplan.json` into it and swaps directories:
`<path>` → `<path>.old`, `<path>.partial` → `<path>`, remove `<path>.old`. A
crash before the first rename leaves `<path>` as it was; between the renames
only `<path>.old` exists, and `load` falls back to it; after the second,
`<path>` is the new checkpoint. Rank 0's outcome is broadcast, so every rank
returns, or raises the same error, instead of one rank failing alone and the
others hanging at the next collective.

[Note: load as a transaction] Loading writes nothing live until every rank
has everything: each rank checks its share of the files against the manifest,
then DCP fills copies of this rank's parameters, buffers and optimizer state,
and the hyperparameters are checked against the live optimizer's. After each
of these steps the ranks agree (_agreed): one failure anywhere raises on every
rank, before anything was applied, so every unit stays as it was on every
rank. Only then are the copies put in place, with local copies that cannot
disagree across ranks. The cost: a second copy of this rank's parameters and
buffers while loading.

[Note: extra state] `save(..., extra={"sampler": sampler})` keeps any object with `state_dict()` /
`load_state_dict(state)` beside the model (a sampler, a step counter, an lr scheduler; DCP's
"stateful objects"). Its state is the same on every rank (global training state, not a shard):
rank 0's is written, as `extra.<name>.pt` in the checkpoint directory, listed in the manifest and
under `extra` in `shardplan.json`; every rank loads it. A state must round-trip through
`torch.load(weights_only=True)` (tensors, numbers, strings, lists, dicts), which save checks before
anything is written, so loading runs no code from the checkpoint. Loading sets the extra objects
after every rank has read and checked everything, just before the model: an object whose
`load_state_dict` raises (on any rank) leaves every rank's model and optimizer as they were (extra
objects set before it keep what they loaded).
"""

import functools
import hashlib
import io
import json
import os
import re
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, TypeVar, cast

import torch
import torch.nn as nn

from shardplan.common.dtypes import dtype_name, torch_dtype
from shardplan.common.files import is_finite_number, parse_json, read_text, write_atomically
from shardplan.errors import CheckpointError, RuntimeMismatchError, ShardplanError
from shardplan.runtime import collectives
from shardplan.runtime.chunks import Holder
from shardplan.runtime.dcp_storage import (
    DCP_METADATA_FILE,
    ManifestReader,
    RecordingWriter,
    one_line,
    read_dcp_metadata,
)

if TYPE_CHECKING:  # program.py imports this module where its methods save and load
    from shardplan.runtime.program import Program

FORMAT = "shardplan.checkpoint/2"
"""/2: with the manifest of file checksums."""
METADATA_FILE = "shardplan.json"
SCHEMA_PATH = Path(__file__).parent.parent / "schemas" / "checkpoint.schema.json"

EXTRA_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]{0,63}")
"""An extra state's name: it names the file `extra.<name>.pt`."""

T = TypeVar("T")


class Stateful(Protocol):
    """What `extra=` takes: torch.distributed.checkpoint's Stateful (a sampler, an lr scheduler...)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def save(
    program: "Program",
    path: str | os.PathLike,
    optimizer: torch.optim.Optimizer | None = None,
    extra: Mapping[str, Stateful] | None = None,
) -> None:
    """Write `program`'s parameters, buffers, `optimizer`'s state and the `extra` objects' states to the
    directory `path`, atomically.

    Call on every rank, between steps. See [Note: checkpoint format], [Note: atomic save] and [Note:
    extra state]."""
    directory = _agreed_path(path)
    _agreed_optimizer(optimizer, "save")
    program.average_running_statistics()  # [Note: running statistics] in program.py
    held = program.holders()
    metadata = _metadata(program, held, optimizer)
    state = _agreed(lambda: _saved_entries(program, held, optimizer, metadata))
    extras = _agreed(
        lambda: _serialized_extras(extra or {}) if collectives.world().rank == 0 else {}
    )
    _on_rank_zero(lambda: _prepare_target(directory))
    partial = _partial(directory)
    writer = RecordingWriter(os.fspath(partial))
    try:
        collectives.save_checkpoint(state, writer)
    except RuntimeError as error:
        raise CheckpointError(
            f"saving to {directory} failed ({error}); {directory} is as it was: mend the "
            "cause and save again"
        ) from None
    written = writer.written + (
        [DCP_METADATA_FILE] if collectives.world().rank == 0 else []
    )  # DCP's coordinator's
    found = collectives.gather_object(_agreed(lambda: _described_files(partial, written)))
    # gather_object's list on rank 0, the one rank that commits
    _on_rank_zero(lambda: _commit(directory, metadata, _manifest(cast(list[dict], found)), extras))
    # rank 0 leaves the broadcast as soon as it has sent: a script that ends with save() and
    # destroys the process group at once could tear gloo down under the other ranks' receive
    collectives.barrier()


def _saved_entries(
    program: "Program", held: list[Holder], optimizer: torch.optim.Optimizer | None, metadata: dict
) -> dict[str, torch.Tensor]:
    state = {}
    for holder in held:
        state.update(holder.entries(holder.parameter, _model_key))
    if optimizer is not None:
        state.update(_optimizer_entries(_state_of(held, optimizer), metadata["optimizer"]["state"]))
    state.update(_buffer_entries(program.module))
    return state


def load(
    program: "Program",
    path: str | os.PathLike,
    optimizer: torch.optim.Optimizer | None = None,
    extra: Mapping[str, Stateful] | None = None,
) -> None:
    """Set `program`'s parameters, buffers, `optimizer`'s state and the `extra` objects' states from the
    checkpoint at `path`, all or nothing.

    Call on every rank, with the optimizer built over `program.parameters()` (its state is
    replaced, its numeric hyperparameters restored). The plan, world size and backend may differ
    from the saving run's. Extra states the checkpoint holds but `extra` does not name are left
    unread. See [Note: load as a transaction] and [Note: extra state]."""
    agreed = _agreed_path(path)
    _agreed_optimizer(optimizer, "load")
    directory, metadata = _on_rank_zero(lambda: read_metadata(agreed))
    held = program.holders()
    _check_model(program, held, metadata, directory)
    if optimizer is not None and metadata["optimizer"] is None:
        raise CheckpointError(
            f"the checkpoint at {directory} holds no optimizer state (it was saved without "
            "optimizer=...): load with optimizer=None, or save with the optimizer"
        )
    if optimizer is not None and metadata["optimizer"]["type"] != type(optimizer).__name__:
        raise CheckpointError(
            f"the checkpoint at {directory} holds {metadata['optimizer']['type']} state; this "
            f"optimizer is {type(optimizer).__name__}: build a {metadata['optimizer']['type']}, "
            "or load with optimizer=None"
        )
    extra = dict(extra or {})
    _check_extras_saved(extra, metadata, directory)
    _agreed(lambda: _verify_files(directory, metadata["files"]))
    staged = _agreed(lambda: _stage(program, held, optimizer, metadata, directory))
    optimizer_state = _agreed(lambda: _read(staged, metadata))
    extra_states = _agreed(lambda: {name: _read_extra(directory, name) for name in extra})
    _agreed(lambda: _load_extras(extra, extra_states))
    _apply(program, held, optimizer, staged, optimizer_state)


@dataclass(frozen=True)
class _Staged:
    """What a load sets, as copies DCP fills before anything live changes (see [Note: load as a transaction])."""

    parameters: list[torch.Tensor]
    """Per holder, a copy of what its load overwrites."""
    buffers: dict[str, torch.Tensor]
    optimizer_state: dict[Holder, dict]
    """Fresh state tensors for the holders saved with state; scalar state is read per name into `entries`."""
    hyperparameters: list[dict[str, Any]]
    """Per param group, the numeric hyperparameters the checkpoint restores."""
    entries: dict[str, torch.Tensor]
    """What DCP fills: views of the tensors above, by checkpoint key."""
    reader: ManifestReader


def _stage(
    program: "Program",
    held: list[Holder],
    optimizer: torch.optim.Optimizer | None,
    metadata: dict,
    directory: Path,
) -> _Staged:
    sizes_bytes = {name: found["bytes"] for name, found in metadata["files"].items()}
    reader = ManifestReader(
        os.fspath(directory), read_dcp_metadata(directory / DCP_METADATA_FILE, sizes_bytes)
    )
    parameters = [holder.staged() for holder in held]
    entries = {}
    for holder, staged in zip(held, parameters):
        entries.update(holder.load_entries(staged, _model_key))
    buffers = {
        key: buffer.detach().clone() for key, buffer in _buffer_entries(program.module).items()
    }
    entries.update(buffers)
    optimizer_state, hyperparameters = {}, []
    if optimizer is not None:
        saved = metadata["optimizer"]
        optimizer_state = _fresh_state(held, optimizer, saved["state"], saved["params_with_state"])
        entries.update(_optimizer_entries(optimizer_state, saved["state"], loading=True))
        hyperparameters = _restored_hyperparameters(
            optimizer, saved["param_groups"], directory / METADATA_FILE
        )
    return _Staged(parameters, buffers, optimizer_state, hyperparameters, entries, reader)


def _read(staged: _Staged, metadata: dict) -> dict[Holder, dict]:
    """DCP fills the staged copies (a collective); the optimizer state as the optimizer keeps it."""
    try:
        collectives.load_checkpoint(staged.entries, staged.reader)
    except RuntimeError as error:
        raise CheckpointError(
            f"reading {staged.reader.path} failed ({error}): the checkpoint is corrupt or was "
            "crafted; restore it from a copy, or save again"
        ) from None
    return _finished_state(staged.optimizer_state, staged.entries, metadata["optimizer"])


def _apply(
    program: "Program",
    held: list[Holder],
    optimizer: torch.optim.Optimizer | None,
    staged: _Staged,
    optimizer_state: dict[Holder, dict],
) -> None:
    """Put what every rank read in place: local copies only, so the ranks cannot come out different."""
    for holder, parameter in zip(held, staged.parameters):
        holder.apply(parameter)
    with torch.no_grad():
        for key, buffer in _buffer_entries(program.module).items():
            buffer.copy_(staged.buffers[key])
    if optimizer is None:
        return
    for holder in _state_of(held, optimizer):
        optimizer.state.pop(holder.parameter, None)
    optimizer.state.update((holder.parameter, state) for holder, state in optimizer_state.items())
    for group, hyperparameters in zip(optimizer.param_groups, staged.hyperparameters):
        for key, value in hyperparameters.items():
            if isinstance(group[key], torch.Tensor):
                group[key].copy_(value)
            else:
                group[key] = value


def export_full_state_dict(
    program: "Program", path: str | os.PathLike | None = None
) -> dict[str, torch.Tensor]:
    """The whole model's state dict, on CPU, on rank 0 (other ranks get {}); `torch.save`d to `path` if given.

    Units are gathered one at a time and one rank per pipeline stage keeps a copy (rank 0 alone at
    pp = 1), which it sends to rank 0, so no rank holds more than the full model on CPU plus one unit. The keys are `model.state_dict()`'s (tied names
    included, non-persistent buffers excluded), so the plain model's `load_state_dict` and
    Hugging Face's `save_pretrained(dir, state_dict=...)` accept it. Call on every rank."""
    program.average_running_statistics()  # [Note: running statistics] in program.py
    slots = _state_dict_slots(program.module)
    key_of = {
        (id(module), attribute): key
        for key, module, attribute, kind in slots
        if kind == "parameter"
    }
    keep = program.keeps_export_copies
    pieces: dict[str, torch.Tensor] = {}
    """State dict key → the CPU copy; tied slots share one tensor, as in model.state_dict()."""
    for holder in program.holders():
        wholes = holder.gather()
        if keep:
            copies = [whole.to("cpu", copy=True) for whole in wholes]
            pieces.update(
                (key_of[id(module), attribute], copies[index])
                for module, attribute, index in holder.slots
            )
        del wholes
    stages = collectives.gather_object(pieces if keep and collectives.world().rank else None)
    if stages is None:
        return {}
    for found in stages[1:]:
        pieces.update(found or {})
    state = {}
    for key, module, attribute, kind in slots:
        state[key] = (
            pieces[key]
            if kind == "parameter"
            else module.get_buffer(attribute).detach().to("cpu", copy=True)
        )
    if (
        path is not None
    ):  # anew beside `path` and renamed: never through a link or into a FIFO left there
        write_atomically(
            path,
            lambda handle: torch.save(state, handle),
            through_links=False,
            error=CheckpointError,
        )
    return state


def read_metadata(path: str | os.PathLike) -> tuple[Path, dict]:
    """(the checkpoint directory, its checked metadata): `path`, or `path`.old after a crash mid-swap."""
    directory = Path(os.path.abspath(path))
    if not directory.exists() and _old(directory).exists():
        directory = _old(directory)
    if not directory.is_dir():
        raise CheckpointError(
            f"no checkpoint at {path}: give the directory program.save(...) wrote"
        )
    file = directory / METADATA_FILE
    if not file.is_file():
        raise CheckpointError(
            f"{directory} is not a shardplan checkpoint: it has no {METADATA_FILE} (a save writes "
            f"it last, so an unfinished save leaves {_partial(directory).name}, never this): give "
            "the directory a finished program.save(...) wrote"
        )
    metadata = parse_json(
        read_text(file, "checkpoint metadata", CheckpointError),
        f"checkpoint metadata {file}",
        CheckpointError,
    )
    found = metadata.get("format") if isinstance(metadata, dict) else None
    if found != FORMAT:
        raise CheckpointError(
            f"{file} has format {str(found)[:80]!r}; this shardplan reads {FORMAT!r}: load it with "
            "the shardplan version that wrote it and export_full_state_dict() from there"
        )
    _check_schema(metadata, file)
    return directory, metadata


def _check_schema(metadata: dict, file: Path) -> None:
    """The checkpoint schema, and dtypes that name torch dtypes (the code below trusts both)."""
    import jsonschema

    errors = list(jsonschema.Draft202012Validator(_schema()).iter_errors(metadata))
    dtypes = (
        [entry["dtype"] for what in ("parameters", "buffers") for entry in metadata[what]]
        if not errors
        else []
    )
    if not errors and metadata["optimizer"] is not None:
        dtypes += [entry["dtype"] for entry in metadata["optimizer"]["state"].values()]
    unknown = [
        dtype for dtype in dtypes if not isinstance(getattr(torch, dtype, None), torch.dtype)
    ]
    if errors:
        error = jsonschema.exceptions.best_match(errors)  # the deepest: inside anyOf, not the anyOf
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path)
        raise CheckpointError(
            f"{file} field {where or '(top)'} does not match the checkpoint schema: "
            f"{error.message[:200]} ({len(errors)} problem(s) in all): it is corrupt or was "
            "edited; restore it from a copy, or save again"
        )
    if unknown:
        raise CheckpointError(
            f"{file} names dtype {unknown[0][:40]!r}, which torch does not have: it is corrupt or "
            "was edited; restore it from a copy, or save again"
        )


@functools.cache
def _schema() -> dict:
    return json.loads(SCHEMA_PATH.read_text())


# what is stored besides the holders' entries


def _model_key(name: str) -> str:
    return f"model.{name}"


def _buffer_entries(module: nn.Module) -> dict[str, torch.Tensor]:
    return {
        f"model.{name}": owner.get_buffer(attribute)
        for name, owner, attribute, kind in _state_dict_slots(module)
        if kind == "buffer"
    }


def _state_dict_slots(model: nn.Module) -> list[tuple[str, nn.Module, str, str]]:
    """(state dict key, module, attribute, "parameter" or "buffer") in `model.state_dict()` order."""
    slots = []
    for path, module in model.named_modules(remove_duplicate=False):
        prefix = f"{path}." if path else ""
        slots += [
            (prefix + attribute, module, attribute, "parameter")
            for attribute, value in module._parameters.items()
            if value is not None
        ]
        slots += [
            (prefix + attribute, module, attribute, "buffer")
            for attribute, value in module._buffers.items()
            if value is not None and attribute not in module._non_persistent_buffers_set
        ]
    return slots


# optimizer state


def _state_of(held: list[Holder], optimizer: torch.optim.Optimizer) -> dict[Holder, dict]:
    """Each holder's optimizer state (empty before its first step); refuses tensors the program does not hold."""
    holder_of = {id(holder.parameter): holder for holder in held}
    stepped = [parameter for group in optimizer.param_groups for parameter in group["params"]]
    for parameter in stepped:
        if id(parameter) not in holder_of:
            raise ShardplanError(
                f"the optimizer steps a tensor of shape {list(parameter.shape)} that is not "
                "one of this program's parameters: build it over program.parameters()"
            )
    return {holder_of[id(parameter)]: optimizer.state.get(parameter, {}) for parameter in stepped}


def _state_schema(states: dict[Holder, dict]) -> dict[str, dict]:
    """Per state key: "shaped" (like the parameter) or "scalar", its dtype, and where it lives."""
    schema: dict[str, dict] = {}
    for holder, state in states.items():
        for key, value in state.items():
            if not isinstance(value, (torch.Tensor, int, float)):
                raise ShardplanError(
                    f"optimizer state {key!r} is a {type(value).__name__}: checkpoints hold "
                    "tensors and numbers; use an optimizer whose state is tensors"
                )
            tensor = _as_tensor(value)
            entry = {
                "kind": "shaped"
                if tensor.dim() and tensor.shape == holder.parameter.shape
                else "scalar",
                "dtype": dtype_name(tensor.dtype),
                "python": not isinstance(value, torch.Tensor),
                "on_param_device": tensor.device == holder.parameter.device,
            }
            if schema.setdefault(key, entry) != entry:
                raise ShardplanError(
                    f"optimizer state {key!r} is {entry} for {holder.label} but "
                    f"{schema[key]} elsewhere: checkpoints need one schema for every parameter"
                )
    return schema


def _merged_schema(schemas: list[dict[str, dict]]) -> dict[str, dict]:
    merged: dict[str, dict] = {}
    for schema in schemas:
        for key, entry in schema.items():
            if merged.setdefault(key, entry) != entry:
                raise ShardplanError(
                    f"optimizer state {key!r} is {entry} on one pipeline stage but {merged[key]} "
                    "on another: checkpoints need one schema for every parameter"
                )
    return merged


def _as_tensor(value: torch.Tensor | float) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach()
    return torch.tensor(value, dtype=torch.float64 if isinstance(value, float) else torch.int64)


def _optimizer_entries(
    states: dict[Holder, dict], schema: dict[str, dict], *, loading: bool = False
) -> dict[str, torch.Tensor]:
    """`optim.<name>.<key>`: shaped state chunked like the parameter, scalar state whole per parameter."""
    entries = {}
    for holder, state in states.items():
        for key, value in state.items():
            if schema[key]["kind"] == "shaped":
                entries.update(
                    holder.entries(value, lambda name: f"optim.{name}.{key}", loading=loading)
                )
            else:
                entries.update(
                    (f"optim.{name}.{key}", _as_tensor(value).clone()) for name in holder.names
                )
    return entries


def _fresh_state(
    held: list[Holder],
    optimizer: torch.optim.Optimizer,
    schema: dict[str, dict],
    params_with_state: list[str],
) -> dict[Holder, dict]:
    """Zero state tensors for DCP to load into, for every holder whose parameters were saved with state."""
    saved = set(params_with_state)
    states = {}
    for holder in _state_of(held, optimizer):
        has = [name in saved for name in holder.names]
        if any(has) and not all(has):
            raise ShardplanError(
                f"{holder.label} groups parameters saved with optimizer state and without "
                f"({holder.names[has.index(False)]!r}): put them in separate units"
            )
        if all(has):
            states[holder] = {
                key: torch.zeros_like(holder.parameter.detach(), dtype=torch_dtype(entry["dtype"]))
                if entry["kind"] == "shaped"
                else torch.zeros(
                    (),
                    dtype=torch_dtype(entry["dtype"]),
                    device=holder.parameter.device if entry["on_param_device"] else "cpu",
                )
                for key, entry in schema.items()
            }
    return states


def _finished_state(
    states: dict[Holder, dict], loaded: dict[str, torch.Tensor], saved: dict | None
) -> dict[Holder, dict]:
    """The loaded state as the optimizer keeps it: scalar state from its per-parameter copies, Python numbers
    where the saving optimizer had them."""
    if saved is None:  # loaded without an optimizer: no states
        return {}
    finished = {}
    for holder, state in states.items():
        finished[holder] = dict(state)
        for key, entry in saved["state"].items():
            if entry["kind"] == "scalar":
                values = sorted({loaded[f"optim.{name}.{key}"].item() for name in holder.names})
                if len(values) > 1:
                    raise ShardplanError(
                        f"{holder.label} groups parameters saved with different optimizer "
                        f"{key!r} values {values}: one flat buffer has one {key!r}; group "
                        "them as they were saved"
                    )
                finished[holder][key] = state[key].copy_(loaded[f"optim.{holder.names[0]}.{key}"])
            if entry["python"]:
                finished[holder][key] = finished[holder][key].item()
    return finished


def _restored_hyperparameters(
    optimizer: torch.optim.Optimizer, saved: list[dict], file: Path
) -> list[dict]:
    """Per live param group, the saved values of its numeric hyperparameters (lr, betas, eps, weight decay...),
    checked against the live ones' types and shapes. Never `params`: the groups stay the live optimizer's."""
    if len(saved) != len(optimizer.param_groups):
        raise CheckpointError(
            f"the checkpoint's optimizer had {len(saved)} param groups, this one has "
            f"{len(optimizer.param_groups)}: build the optimizer with as many groups"
        )
    restored = []
    for index, (group, values) in enumerate(zip(optimizer.param_groups, saved)):
        restored.append(
            {
                key: _number_like(group[key], values[key], f"{file} param_groups[{index}].{key}")
                for key in values
                if key != "params" and key in group and _is_numeric(group[key])
            }
        )
    return restored


def _is_numeric(value: Any) -> bool:
    """A hyperparameter load restores: a number, a tensor, or a tuple of numbers (betas); not a flag."""
    return (
        is_finite_number(value)
        or isinstance(value, torch.Tensor)
        or (isinstance(value, (tuple, list)) and bool(value) and all(map(is_finite_number, value)))
    )


def _number_like(live: Any, saved: Any, where: str) -> Any:
    """`saved` (from JSON: a number, a list of numbers, {"tensor": nested numbers}) in `live`'s type and shape."""
    try:
        if isinstance(live, torch.Tensor):
            value = torch.tensor(saved["tensor"], dtype=live.dtype)
            if value.shape == live.shape and bool(value.isfinite().all()):
                return value
        elif isinstance(live, (tuple, list)):
            if (
                isinstance(saved, list)
                and len(saved) == len(live)
                and all(map(is_finite_number, saved))
            ):
                return type(live)(saved)
        elif is_finite_number(saved):
            return float(saved) if isinstance(live, float) else saved
    except (TypeError, ValueError, KeyError, RuntimeError):  # a ragged or non-numeric "tensor"
        pass
    raise CheckpointError(
        f"{where} is {json.dumps(saved)[:80]}, where this optimizer has "
        f"{json.dumps(_to_json(live))[:80]}: the file "
        "is corrupt or from another optimizer; restore it from a copy, or build the optimizer "
        "the checkpoint was saved with"
    )


def _to_json(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return {"tensor": value.tolist()}
    if isinstance(value, tuple):
        return list(value)
    return value


# metadata and the model check


def _metadata(
    program: "Program", held: list[Holder], optimizer: torch.optim.Optimizer | None
) -> dict:
    optimizer_metadata = None
    if optimizer is not None:

        def mine() -> tuple[dict[str, dict], list[str]]:
            states = _state_of(held, optimizer)
            return _state_schema(states), [
                name for holder, state in states.items() if state for name in holder.names
            ]

        # every rank's, as each pipeline stage steps its own parameters
        found = collectives.all_gather_object(_agreed(mine))
        optimizer_metadata = {
            "type": type(optimizer).__name__,
            "state": _merged_schema([schema for schema, _ in found]),
            "params_with_state": list(dict.fromkeys(name for _, names in found for name in names)),
            "param_groups": [
                {key: _to_json(value) for key, value in group.items() if key != "params"}
                for group in optimizer.param_groups
            ],
        }
        try:
            json.dumps(optimizer_metadata["param_groups"])
        except TypeError as error:
            raise ShardplanError(
                f"an optimizer hyperparameter cannot be written to {METADATA_FILE} ({error}): "
                "keep param_groups to numbers, strings, tuples and tensors"
            ) from None
    return {
        "format": FORMAT,
        "world_size": collectives.world().size,
        "plan": json.loads(program.plan.to_json()),
        "parameters": _described(_parameter_shapes(held)),
        "buffers": _described(_buffer_shapes(program)),
        "optimizer": optimizer_metadata,
    }


def _parameter_shapes(held: list[Holder]) -> dict[str, tuple[list[int], str]]:
    """Every rank's parameters, in rank order (a pipeline stage holds only its own); a collective."""
    shapes = {}
    for found in collectives.all_gather_object(
        {name: shape for holder in held for name, shape in holder.shapes().items()}
    ):
        shapes.update(found)
    return shapes


def _buffer_shapes(program: "Program") -> dict[str, tuple[list[int], str]]:
    return {
        name[len("model.") :]: (list(buffer.shape), dtype_name(buffer.dtype))
        for name, buffer in _buffer_entries(program.module).items()
    }


def _described(shapes: dict[str, tuple[list[int], str]]) -> list[dict]:
    return [
        {"name": name, "shape": shape, "dtype": dtype} for name, (shape, dtype) in shapes.items()
    ]


def _check_model(program: "Program", held: list[Holder], metadata: dict, directory: Path) -> None:
    """Refuse a checkpoint of another model, naming the first differences."""
    problems = []
    for what, mine in (("parameter", _parameter_shapes(held)), ("buffer", _buffer_shapes(program))):
        saved = {entry["name"]: (entry["shape"], entry["dtype"]) for entry in metadata[what + "s"]}
        problems += [
            f"{what} {name!r} is not in the checkpoint" for name in mine if name not in saved
        ]
        problems += [
            f"the checkpoint's {what} {name!r} is not in the model"
            for name in saved
            if name not in mine
        ]
        problems += [
            f"{what} {name!r} is {saved[name][1]}{saved[name][0]} in the checkpoint, "
            f"{mine[name][1]}{mine[name][0]} in the model"
            for name in mine
            if name in saved and saved[name] != mine[name]
        ]
    if problems:
        raise CheckpointError(
            f"the checkpoint at {directory} was saved from another model ({len(problems)} differences; "
            f"first: {'; '.join(problems[:3])}): load it into the model it was saved from "
            "(same parameter names, shapes and dtypes), or export_full_state_dict() there and "
            "convert the names"
        )


# extra stateful objects (see [Note: extra state])


def _extra_file(name: str) -> str:
    return f"extra.{name}.pt"


def _serialized_extras(extra: Mapping[str, Stateful]) -> dict[str, bytes]:
    """Each extra object's state_dict(), torch.save'd, once it is known to load with weights_only."""
    serialized = {}
    for name, stateful in extra.items():
        if not isinstance(name, str) or not EXTRA_NAME.fullmatch(name):
            raise CheckpointError(
                f"extra state name {str(name)[:80]!r} cannot name a file: use 1-64 letters, "
                "digits, '_' or '-' (e.g. 'sampler')"
            )
        try:
            state = stateful.state_dict()
        except Exception as error:  # the object's own code: any type
            raise CheckpointError(
                f"extra state {name!r}: {type(stateful).__name__}.state_dict() failed "
                f"({one_line(error)[:160]}): mend it, or save without it"
            ) from None
        buffer = io.BytesIO()
        try:
            torch.save(state, buffer)  # pickling: a lambda or a local class fails here
            torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
        except Exception as error:  # weights_only names the refused type in its own exception types
            raise CheckpointError(
                f"extra state {name!r} ({type(stateful).__name__}.state_dict()) holds what a "
                f"checkpoint cannot store, or load without running code ({one_line(error)[:160]}): "
                "keep it to tensors, numbers, strings, lists and dicts"
            ) from None
        serialized[name] = buffer.getvalue()
    return serialized


def _check_extras_saved(extra: Mapping[str, Stateful], metadata: dict, directory: Path) -> None:
    saved = metadata.get("extra", [])
    missing = [
        name for name in extra if name not in saved or _extra_file(name) not in metadata["files"]
    ]
    if missing:
        raise CheckpointError(
            f"the checkpoint at {directory} holds no extra state {missing[0]!r} (it holds "
            f"{saved or 'none'}): save it with extra={{{missing[0]!r}: ...}}, or load without it"
        )


def _load_extras(extra: Mapping[str, Stateful], states: dict[str, Any]) -> None:
    for name, state in states.items():
        extra[name].load_state_dict(state)


def read_saved_extra(path: str | os.PathLike, name: str) -> Any:
    """A checkpoint's extra state `name` as saved, read without running code, from `path` or, after a crash
    mid-swap, `path`.old (as read_metadata falls back); CheckpointError where it cannot be read."""
    directory = Path(os.path.abspath(path))
    if not directory.exists() and _old(directory).exists():
        directory = _old(directory)
    return _read_extra(directory, name)


def remove_checkpoint(path: str | os.PathLike) -> None:
    """Remove a checkpoint and what a save cut short left beside it (`path`.old, `path`.partial)."""
    directory = Path(os.path.abspath(path))
    for stale in (directory, _old(directory), _partial(directory)):
        _remove(stale)


def _read_extra(directory: Path, name: str) -> Any:
    """An extra object's state, read without running code (its bytes were checked against the manifest)."""
    file = directory / _extra_file(name)
    try:
        return torch.load(file, weights_only=True)
    except (
        Exception
    ) as error:  # torch.load raises many types on a crafted file; each becomes this one
        raise CheckpointError(
            f"checkpoint file {file} cannot be read ({one_line(error)[:160]}): it is corrupt or "
            "was crafted; restore it from a copy, or save again"
        ) from None


# the directory protocol (see [Note: atomic save])


def _agreed_path(path: str | os.PathLike) -> Path:
    """`path` made absolute, the same on every rank or an error on every rank (a collective)."""
    directory = Path(os.path.abspath(path))
    digests = collectives.all_gather_object(hashlib.sha256(os.fsencode(directory)).hexdigest())
    if len(set(digests)) > 1:
        other = next(rank for rank, digest in enumerate(digests) if digest != digests[0])
        raise RuntimeMismatchError(
            f"ranks were given different checkpoint paths (rank 0's and rank {other}'s "
            f"differ; this rank's is {directory}): pass the same path on every rank (e.g. "
            "built from the step number, not from a clock each rank reads)"
        )
    return directory


def _agreed_optimizer(optimizer: torch.optim.Optimizer | None, call: str) -> None:
    """Every rank passed an optimizer, or none did (a collective): the optimizer's entries are collectives of
    their own, which ranks without it would pair with the next ones."""
    given = collectives.all_gather_object(optimizer is not None)
    if len(set(given)) > 1:
        with_it = [rank for rank, passed in enumerate(given) if passed]
        raise RuntimeMismatchError(
            f"ranks {with_it} passed an optimizer to {call} and the others did not: pass it on "
            "every rank, or on none"
        )


def _partial(directory: Path) -> Path:
    return directory.with_name(directory.name + ".partial")


def _old(directory: Path) -> Path:
    return directory.with_name(directory.name + ".old")


def _on_rank_zero(action: Callable[[], T]) -> T:
    """Run `action` on rank 0 and give its result, or raise its error, on every rank."""
    outcome: Any = None
    if collectives.world().rank == 0:
        try:
            outcome = ("ok", action())
        except Exception as error:  # re-raised below, on every rank
            outcome = ("error", error)
    kind, value = collectives.broadcast_object(outcome)
    if kind == "error":
        raise value
    return value


def _agreed(action: Callable[[], T]) -> T:
    """Run `action` on every rank and give this rank's result, or raise on every rank if it failed on any: a
    failing rank its own error, the others the lowest failing rank's (see [Note: load as a transaction])."""
    failure: Exception | None = None
    try:
        result = action()
    except Exception as error:  # re-raised below, on every rank
        failure = error
    shared = (
        failure
        if failure is None or isinstance(failure, ShardplanError)
        else RuntimeError(one_line(failure))
    )
    found = [error for error in collectives.all_gather_object(shared) if error is not None]
    if failure is not None:
        raise failure
    if found:
        raise found[0]
    return result


def _prepare_target(directory: Path) -> None:
    """Refuse a path that the renames of a save cannot replace safely, before anything is written; clear a
    stale `<path>.partial`. A previous checkpoint at `directory` stays as it is."""
    if Path.cwd().resolve().is_relative_to(directory.resolve()):
        raise CheckpointError(
            f"cannot save to {directory}: it is the working directory or holds it, and a save "
            f"replaces its directory by renames: save to a new directory, e.g. {directory / 'ckpt'}"
        )
    if directory.is_symlink():
        raise CheckpointError(
            f"cannot save to {directory}: it is a symbolic link (to {os.readlink(directory)}), "
            "which a save's renames would replace: save to the directory it points to, "
            f"{directory.resolve()}"
        )
    if directory.exists() and not directory.is_dir():
        raise CheckpointError(
            f"cannot save to {directory}: it is a file, which a save would replace: save to "
            "another path, or remove it"
        )
    if (
        directory.is_dir()
        and not (directory / METADATA_FILE).is_file()
        and any(directory.iterdir())
    ):
        raise CheckpointError(
            f"{directory} exists and is not a shardplan checkpoint: saving would replace it; "
            "save to another path, or remove it"
        )
    foreign = (
        sorted(entry.name for entry in directory.iterdir() if not _written_by_a_save(entry.name))
        if directory.is_dir()
        else []
    )
    if foreign:
        listed = ", ".join(foreign[:3]) + (
            f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
        )
        raise CheckpointError(
            f"cannot save to {directory}: it holds {listed}, which no save writes and saving would "
            "delete (a save replaces the checkpoint's directory whole); nothing was changed: move "
            "them out, or save to another path"
        )
    existing = next(parent for parent in directory.parents if parent.exists())
    if not existing.is_dir():
        raise CheckpointError(
            f"cannot save to {directory}: {existing} is a file, so no directory can be made "
            "under it: save to another path"
        )
    try:
        _remove(_partial(directory))
        directory.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise CheckpointError(
            f"cannot save to {directory} ({one_line(error)}): save where this process may write"
        ) from None


def _written_by_a_save(name: str) -> bool:
    """Whether a save writes an entry of this name in a checkpoint's directory: shardplan.json, DCP's metadata and
    data files, an extra state's file. Any other entry is the user's (notes, evaluation results, a config)."""
    extra = name.removeprefix("extra.").removesuffix(".pt")
    return (
        name in (METADATA_FILE, DCP_METADATA_FILE)
        or name.endswith(".distcp")
        or (name == _extra_file(extra) and EXTRA_NAME.fullmatch(extra) is not None)
    )


def _remove(path: Path) -> None:
    """Remove a directory tree, or a file or link of that name (a stale `<path>.partial` or `.old`)."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def _manifest(found: list[dict]) -> dict[str, dict]:
    """Every rank's files, by name."""
    return dict(sorted((name, entry) for mine in found for name, entry in mine.items()))


def _described_files(directory: Path, names: list[str]) -> dict[str, dict]:
    """The manifest's entries for files this rank wrote: size and SHA-256."""
    return {
        name: {
            "bytes": (directory / name).stat().st_size,
            "sha256": _sha256_of_file(directory / name),
        }
        for name in names
    }


def _sha256_of_file(path: Path) -> str:
    """The SHA-256 of a file's bytes, streamed, as 64 hex digits."""
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _verify_files(directory: Path, files: dict[str, dict]) -> None:
    """This rank's share of the manifest (every rank checks a different slice, so each file is read once)."""
    world = collectives.world()
    for name in sorted(files)[world.rank :: world.size]:
        path, expected = directory / name, files[name]
        try:
            found = path.stat()
            problem = (
                "is not a regular file"
                if not stat.S_ISREG(found.st_mode)
                else f"is {found.st_size} bytes, the manifest says {expected['bytes']}"
                if found.st_size != expected["bytes"]
                else "has other bytes than the manifest's SHA-256"
                if _sha256_of_file(path) != expected["sha256"]
                else None
            )
        except OSError as error:
            problem = f"cannot be read ({one_line(error)})"
        if problem is not None:
            raise CheckpointError(
                f"checkpoint file {path} {problem}: it is corrupt, truncated or from another "
                f"checkpoint; restore {directory} from a copy, or save again"
            )


def _commit(
    directory: Path, metadata: dict, files: dict[str, dict], extras: dict[str, bytes]
) -> None:
    """Write the extra states and `shardplan.json`, last, into `<path>.partial`; swap it in."""
    partial = _partial(directory)
    for name, data in extras.items():
        with open(partial / _extra_file(name), "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())  # on disk before the swap names this checkpoint the newest
    files = {**files, **_described_files(partial, [_extra_file(name) for name in extras])}
    metadata = {**metadata, "files": dict(sorted(files.items()))}
    if extras:
        metadata["extra"] = sorted(extras)
    temporary = partial / (METADATA_FILE + ".tmp")
    with open(temporary, "w") as handle:
        json.dump(metadata, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, partial / METADATA_FILE)
    _fsync_directory(partial)
    _swap(directory)


def _swap(directory: Path) -> None:
    """`<path>` → `<path>.old`, `<path>.partial` → `<path>`, remove `<path>.old`."""
    old = _old(directory)
    if directory.exists():
        _remove(old)  # stale: `<path>` is the checkpoint to keep
        os.replace(directory, old)
    os.replace(_partial(directory), directory)
    _fsync_directory(directory.parent)
    _remove(old)


def _fsync_directory(directory: Path) -> None:
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
