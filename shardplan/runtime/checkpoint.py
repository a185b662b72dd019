"""Checkpoints of a program: save, load on any world size, plan and backend, export a full state dict.

[Note: checkpoint format] A checkpoint is a directory written by
torch.distributed.checkpoint (DCP) plus `shardplan.json`. Every parameter is
stored as one flattened 1-D tensor under `model.<name>`, whatever unit, plan,
world size or backend held it: each rank contributes the chunk of it that its
flat shard covers (padding excluded; an FSDP2 rank its rows), a REPLICATE unit
the whole tensor (DCP writes one copy); see chunks.py. Optimizer state shaped like the shard is stored the same way under
`optim.<name>.<key>`; scalar state (Adam's step) as one tensor per parameter.
Persistent buffers are `model.<name>` too. Loading asks DCP for exactly the
chunks this rank's new shards cover, so a checkpoint saved at one world size
and unit grouping loads into any other (DCP reads across chunk boundaries).
`shardplan.json` holds the format version, the plan, the world size, the names,
shapes and dtypes of parameters and buffers, and the optimizer's state schema
and hyperparameters; it is written last, so a directory without it is not a
checkpoint.

[Note: atomic save] Ranks write into `<path>.partial` (rank 0 removes a stale
one first); rank 0 then writes `shardplan.json` into it and swaps directories:
`<path>` → `<path>.old`, `<path>.partial` → `<path>`, remove `<path>.old`. A
crash before the first rename leaves `<path>` as it was; between the renames
only `<path>.old` exists, and `load` falls back to it; after the second,
`<path>` is the new checkpoint. Rank 0's outcome is broadcast, so every rank
returns, or raises the same error, instead of one rank failing alone and the
others hanging at the next collective.
"""
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

from ..dtypes import dtype_name, torch_dtype
from ..errors import PlanError, ShardplanError
from . import collectives
from .chunks import Holder, holders

FORMAT = "shardplan.checkpoint/1"
METADATA_FILE = "shardplan.json"


def save(program, path: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Write `program`'s parameters, buffers and `optimizer`'s state to the directory `path`, atomically.

    Call on every rank, between steps. See [Note: checkpoint format] and [Note: atomic save]."""
    directory = Path(path)
    held = holders(program)
    metadata = _metadata(program, held, optimizer)
    state = {}
    for holder in held:
        state.update(holder.entries(holder.parameter, _model_key))
    if optimizer is not None:
        state.update(_optimizer_entries(_state_of(held, optimizer), metadata["optimizer"]["state"]))
    state.update(_buffer_entries(program.module))
    _on_rank_zero(lambda: _clear_partial(directory))
    collectives.save_checkpoint(state, os.fspath(_partial(directory)))
    _on_rank_zero(lambda: _commit(directory, metadata))
    # rank 0 leaves the broadcast as soon as it has sent: a script that ends with save() and
    # destroys the process group at once could tear gloo down under the other ranks' receive
    collectives.barrier()


def load(program, path: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Set `program`'s parameters, buffers and `optimizer`'s state from the checkpoint at `path`.

    Call on every rank, with the optimizer built over `program.parameters()` (its state is
    replaced). The plan, world size and backend may differ from the saving run's."""
    directory, metadata = _on_rank_zero(lambda: read_metadata(path))
    held = holders(program)
    _check_model(program, held, metadata, directory)
    if optimizer is not None and metadata["optimizer"] is None:
        raise ShardplanError(f"the checkpoint at {directory} holds no optimizer state (it was saved without "
                             "optimizer=...): load with optimizer=None, or save with the optimizer")
    if optimizer is not None and metadata["optimizer"]["type"] != type(optimizer).__name__:
        raise ShardplanError(f"the checkpoint at {directory} holds {metadata['optimizer']['type']} state; this "
                             f"optimizer is {type(optimizer).__name__}: build a {metadata['optimizer']['type']}, "
                             "or load with optimizer=None")
    state = {}
    for holder in held:
        holder.before_load()
        state.update(holder.load_entries(_model_key))
    state.update(_buffer_entries(program.module))
    if optimizer is not None:
        schema = metadata["optimizer"]["state"]
        fresh = _fresh_state(held, optimizer, schema, metadata["optimizer"]["params_with_state"])
        state.update(_optimizer_entries(fresh, schema))
    collectives.load_checkpoint(state, os.fspath(directory))
    for holder in held:
        holder.after_load()
    if optimizer is not None:
        _finish_optimizer(held, optimizer, fresh, state, metadata["optimizer"])


def export_full_state_dict(program, path: str | os.PathLike | None = None) -> dict[str, torch.Tensor]:
    """The whole model's state dict, on CPU, on rank 0 (other ranks get {}); `torch.save`d to `path` if given.

    Units are gathered one at a time and one rank per pipeline stage keeps a copy (rank 0 alone at
    pp = 1), which it sends to rank 0, so no rank holds more than the full model on CPU plus one unit. The keys are `model.state_dict()`'s (tied names
    included, non-persistent buffers excluded), so the plain model's `load_state_dict` and
    Hugging Face's `save_pretrained(dir, state_dict=...)` accept it. Call on every rank."""
    slots = _state_dict_slots(program.module)
    key_of = {(id(module), attribute): key for key, module, attribute, kind in slots if kind == "parameter"}
    keep = program.keeps_export_copies
    pieces: dict[str, torch.Tensor] = {}
    """State dict key → the CPU copy; tied slots share one tensor, as in model.state_dict()."""
    for holder in holders(program):
        wholes = holder.gather()
        if keep:
            copies = [whole.to("cpu", copy=True) for whole in wholes]
            pieces.update((key_of[id(module), attribute], copies[index]) for module, attribute, index in holder.slots)
        del wholes
    stages = collectives.gather_object(pieces if keep and collectives.world().rank else None)
    if stages is None:
        return {}
    for found in stages[1:]:
        pieces.update(found or {})
    state = {}
    for key, module, attribute, kind in slots:
        state[key] = pieces[key] if kind == "parameter" else module._buffers[attribute].detach().to("cpu", copy=True)
    if path is not None:
        torch.save(state, path)
    return state


def read_metadata(path: str | os.PathLike) -> tuple[Path, dict]:
    """(the checkpoint directory, its metadata): `path`, or `path`.old after a crash mid-swap."""
    directory = Path(path)
    if not directory.exists() and _old(directory).exists():
        directory = _old(directory)
    if not directory.is_dir():
        raise ShardplanError(f"no checkpoint at {path}: give the directory program.save(...) wrote")
    file = directory / METADATA_FILE
    if not file.is_file():
        raise PlanError(f"{directory} is not a shardplan checkpoint: it has no {METADATA_FILE} (a save writes it "
                        f"last, so an unfinished save leaves {_partial(Path(path)).name}, never this): give the "
                        "directory a finished program.save(...) wrote")
    try:
        metadata = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise PlanError(f"{file} is corrupt ({error}): restore it from a copy, or save again") from None
    found = metadata.get("format") if isinstance(metadata, dict) else None
    if found != FORMAT:
        raise PlanError(f"{file} has format {found!r}; this shardplan reads {FORMAT!r}: load it with the "
                        "shardplan version that wrote it and export_full_state_dict() from there")
    missing = [key for key in ("world_size", "plan", "parameters", "buffers", "optimizer") if key not in metadata]
    if missing:
        raise PlanError(f"{file} lacks {missing}: it is corrupt; restore it from a copy, or save again")
    return directory, metadata


# what is stored besides the holders' entries

def _model_key(name: str) -> str:
    return f"model.{name}"


def _buffer_entries(module: nn.Module) -> dict[str, torch.Tensor]:
    return {f"model.{name}": owner._buffers[attribute]
            for name, owner, attribute, kind in _state_dict_slots(module) if kind == "buffer"}


def _state_dict_slots(model: nn.Module) -> list[tuple[str, nn.Module, str, str]]:
    """(state dict key, module, attribute, "parameter" or "buffer") in `model.state_dict()` order."""
    slots = []
    for path, module in model.named_modules(remove_duplicate=False):
        prefix = f"{path}." if path else ""
        slots += [(prefix + attribute, module, attribute, "parameter")
                  for attribute, value in module._parameters.items() if value is not None]
        slots += [(prefix + attribute, module, attribute, "buffer") for attribute, value in module._buffers.items()
                  if value is not None and attribute not in module._non_persistent_buffers_set]
    return slots


# optimizer state

def _state_of(held: list[Holder], optimizer: torch.optim.Optimizer) -> dict[Holder, dict]:
    """Each holder's optimizer state (empty before its first step); refuses tensors the program does not hold."""
    holder_of = {id(holder.parameter): holder for holder in held}
    stepped = [parameter for group in optimizer.param_groups for parameter in group["params"]]
    for parameter in stepped:
        if id(parameter) not in holder_of:
            raise ShardplanError(f"the optimizer steps a tensor of shape {list(parameter.shape)} that is not "
                                 "one of this program's parameters: build it over program.parameters()")
    return {holder_of[id(parameter)]: optimizer.state.get(parameter, {}) for parameter in stepped}


def _state_schema(states: dict[Holder, dict]) -> dict[str, dict]:
    """Per state key: "shaped" (like the parameter) or "scalar", its dtype, and where it lives."""
    schema: dict[str, dict] = {}
    for holder, state in states.items():
        for key, value in state.items():
            if not isinstance(value, (torch.Tensor, int, float)):
                raise ShardplanError(f"optimizer state {key!r} is a {type(value).__name__}: checkpoints hold "
                                     "tensors and numbers; use an optimizer whose state is tensors")
            tensor = _as_tensor(value)
            entry = {"kind": "shaped" if tensor.dim() and tensor.shape == holder.parameter.shape else "scalar",
                     "dtype": dtype_name(tensor.dtype), "python": not isinstance(value, torch.Tensor),
                     "on_param_device": tensor.device == holder.parameter.device}
            if schema.setdefault(key, entry) != entry:
                raise ShardplanError(f"optimizer state {key!r} is {entry} for {holder.label} but "
                                     f"{schema[key]} elsewhere: checkpoints need one schema for every parameter")
    return schema


def _merged_schema(schemas: list[dict[str, dict]]) -> dict[str, dict]:
    merged: dict[str, dict] = {}
    for schema in schemas:
        for key, entry in schema.items():
            if merged.setdefault(key, entry) != entry:
                raise ShardplanError(f"optimizer state {key!r} is {entry} on one pipeline stage but {merged[key]} "
                                     "on another: checkpoints need one schema for every parameter")
    return merged


def _as_tensor(value) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach()
    return torch.tensor(value, dtype=torch.float64 if isinstance(value, float) else torch.int64)


def _optimizer_entries(states: dict[Holder, dict], schema: dict[str, dict]) -> dict[str, torch.Tensor]:
    """`optim.<name>.<key>`: shaped state chunked like the parameter, scalar state whole per parameter."""
    entries = {}
    for holder, state in states.items():
        for key, value in state.items():
            if schema[key]["kind"] == "shaped":
                entries.update(holder.entries(value, lambda name: f"optim.{name}.{key}"))
            else:
                entries.update((f"optim.{name}.{key}", _as_tensor(value).clone()) for name in holder.names)
    return entries


def _fresh_state(held: list[Holder], optimizer: torch.optim.Optimizer, schema: dict[str, dict],
                 params_with_state: list[str]) -> dict[Holder, dict]:
    """Zero state tensors for DCP to load into, for every holder whose parameters were saved with state."""
    saved = set(params_with_state)
    states = {}
    for holder in _state_of(held, optimizer):
        has = [name in saved for name in holder.names]
        if any(has) and not all(has):
            raise ShardplanError(f"{holder.label} groups parameters saved with optimizer state and without "
                                 f"({holder.names[has.index(False)]!r}): put them in separate units")
        if all(has):
            states[holder] = {
                key: torch.zeros_like(holder.parameter.detach(), dtype=torch_dtype(entry["dtype"]))
                if entry["kind"] == "shaped" else
                torch.zeros((), dtype=torch_dtype(entry["dtype"]),
                            device=holder.parameter.device if entry["on_param_device"] else "cpu")
                for key, entry in schema.items()}
    return states


def _finish_optimizer(held: list[Holder], optimizer: torch.optim.Optimizer, states: dict[Holder, dict],
                      loaded: dict[str, torch.Tensor], saved: dict) -> None:
    """Scalar state from its per-parameter copies, the state into the optimizer, then the hyperparameters."""
    for holder in _state_of(held, optimizer):
        optimizer.state.pop(holder.parameter, None)
    for holder, state in states.items():
        for key, entry in saved["state"].items():
            if entry["kind"] == "scalar":
                values = sorted({loaded[f"optim.{name}.{key}"].item() for name in holder.names})
                if len(values) > 1:
                    raise ShardplanError(f"{holder.label} groups parameters saved with different optimizer "
                                         f"{key!r} values {values}: one flat buffer has one {key!r}; group "
                                         "them as they were saved")
                state[key].copy_(loaded[f"optim.{holder.names[0]}.{key}"])
            if entry["python"]:
                state[key] = state[key].item()
        optimizer.state[holder.parameter] = state
    groups = saved["param_groups"]
    if len(groups) != len(optimizer.param_groups):
        raise ShardplanError(f"the checkpoint's optimizer had {len(groups)} param groups, this one has "
                             f"{len(optimizer.param_groups)}: build the optimizer with as many groups")
    for group, hyperparameters in zip(optimizer.param_groups, groups):
        for key, value in hyperparameters.items():
            group[key] = _from_json(group.get(key), value)


def _to_json(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return {"tensor": value.tolist()}
    if isinstance(value, tuple):
        return list(value)
    return value


def _from_json(current: Any, value: Any) -> Any:
    """Put a saved hyperparameter back in the type the live optimizer uses (tensor lr, tuple betas)."""
    if isinstance(value, dict) and "tensor" in value:
        if isinstance(current, torch.Tensor):
            return current.copy_(torch.tensor(value["tensor"]))
        return torch.tensor(value["tensor"])
    if isinstance(current, tuple):
        return tuple(value)
    return value


# metadata and the model check

def _metadata(program, held: list[Holder], optimizer: torch.optim.Optimizer | None) -> dict:
    optimizer_metadata = None
    if optimizer is not None:
        states = _state_of(held, optimizer)
        # every rank's, as each pipeline stage steps its own parameters
        found = collectives.all_gather_object((_state_schema(states), [name for holder, state in states.items()
                                                                       if state for name in holder.names]))
        optimizer_metadata = {
            "type": type(optimizer).__name__,
            "state": _merged_schema([schema for schema, _ in found]),
            "params_with_state": list(dict.fromkeys(name for _, names in found for name in names)),
            "param_groups": [{key: _to_json(value) for key, value in group.items() if key != "params"}
                             for group in optimizer.param_groups]}
        try:
            json.dumps(optimizer_metadata["param_groups"])
        except TypeError as error:
            raise ShardplanError(f"an optimizer hyperparameter cannot be written to {METADATA_FILE} ({error}): "
                                 "keep param_groups to numbers, strings, tuples and tensors") from None
    return {"format": FORMAT, "world_size": collectives.world().size, "plan": json.loads(program.plan.to_json()),
            "parameters": _described(_parameter_shapes(held)), "buffers": _described(_buffer_shapes(program)),
            "optimizer": optimizer_metadata}


def _parameter_shapes(held: list[Holder]) -> dict[str, tuple[list[int], str]]:
    """Every rank's parameters, in rank order (a pipeline stage holds only its own); a collective."""
    shapes = {}
    for found in collectives.all_gather_object({name: shape for holder in held
                                                for name, shape in holder.shapes().items()}):
        shapes.update(found)
    return shapes


def _buffer_shapes(program) -> dict[str, tuple[list[int], str]]:
    return {name[len("model."):]: (list(buffer.shape), dtype_name(buffer.dtype))
            for name, buffer in _buffer_entries(program.module).items()}


def _described(shapes: dict[str, tuple[list[int], str]]) -> list[dict]:
    return [{"name": name, "shape": shape, "dtype": dtype} for name, (shape, dtype) in shapes.items()]


def _check_model(program, held: list[Holder], metadata: dict, directory: Path) -> None:
    """Refuse a checkpoint of another model, naming the first differences."""
    problems = []
    for what, mine in (("parameter", _parameter_shapes(held)), ("buffer", _buffer_shapes(program))):
        saved = {entry["name"]: (entry["shape"], entry["dtype"]) for entry in metadata[what + "s"]}
        problems += [f"{what} {name!r} is not in the checkpoint" for name in mine if name not in saved]
        problems += [f"the checkpoint's {what} {name!r} is not in the model" for name in saved if name not in mine]
        problems += [f"{what} {name!r} is {saved[name][1]}{saved[name][0]} in the checkpoint, "
                     f"{mine[name][1]}{mine[name][0]} in the model"
                     for name in mine if name in saved and saved[name] != mine[name]]
    if problems:
        raise PlanError(f"the checkpoint at {directory} was saved from another model ({len(problems)} differences; "
                        f"first: {'; '.join(problems[:3])}): load it into the model it was saved from "
                        "(same parameter names, shapes and dtypes), or export_full_state_dict() there and "
                        "convert the names")


# the directory protocol (see [Note: atomic save])

def _partial(directory: Path) -> Path:
    return directory.with_name(directory.name + ".partial")


def _old(directory: Path) -> Path:
    return directory.with_name(directory.name + ".old")


def _on_rank_zero(action: Callable[[], Any]) -> Any:
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


def _clear_partial(directory: Path) -> None:
    if directory.exists() and not (directory / METADATA_FILE).is_file() and any(directory.iterdir()):
        raise ShardplanError(f"{directory} exists and is not a shardplan checkpoint: saving would replace it; "
                             "save to another path, or remove it")
    shutil.rmtree(_partial(directory), ignore_errors=True)
    directory.parent.mkdir(parents=True, exist_ok=True)


def _commit(directory: Path, metadata: dict) -> None:
    partial = _partial(directory)
    temporary = partial / (METADATA_FILE + ".tmp")
    with open(temporary, "w") as handle:
        json.dump(metadata, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, partial / METADATA_FILE)
    _swap(directory)


def _swap(directory: Path) -> None:
    """`<path>` → `<path>.old`, `<path>.partial` → `<path>`, remove `<path>.old`."""
    old = _old(directory)
    if directory.exists():
        shutil.rmtree(old, ignore_errors=True)  # stale: `<path>` is the checkpoint to keep
        os.replace(directory, old)
    os.replace(_partial(directory), directory)
    _fsync_directory(directory.parent)
    shutil.rmtree(old, ignore_errors=True)


def _fsync_directory(directory: Path) -> None:
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
