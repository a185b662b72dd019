"""`shardplan export`: a checkpoint's model as a Hugging Face `save_pretrained` folder, or a plain
state dict (`model.pt`) for any other model.

The checkpoint is loaded in this process, on one rank (a gloo group of one), into a plan of the
checkpoint's own units; `Program.export_full_state_dict` then gathers the whole state dict. The
folder is written beside the output under a temporary name and renamed into place, so an export cut
short leaves no half-written folder, and an existing file or folder that is not empty is refused.
"""

import contextlib
import json
import os
import shutil
from pathlib import Path

from shardplan.errors import ShardplanError

SETTINGS_FILE = "settings.json"
"""What `shardplan train` records in its run folder: the model's SPEC among its settings."""
STATE_DICT_FILE = "model.pt"


def export(checkpoint: str, output: str, model_spec: str | None = None, warn=print) -> str:
    """Write `checkpoint`'s model into the folder `output`; its path. `model_spec` defaults to the
    model the run folder's settings.json names."""
    from shardplan.runtime.checkpoint import read_metadata

    target = Path(output)
    _check_target(target)
    directory, metadata = read_metadata(checkpoint)
    spec = model_spec or _recorded_model(directory)
    dtypes = {entry["dtype"] for entry in metadata["parameters"]}
    with _one_rank():
        model, state = _gathered(spec, directory, metadata, fp32=dtypes == {"float32"})
        partial = target.with_name(f".{target.name}.partial-{os.getpid()}")
        shutil.rmtree(partial, ignore_errors=True)
        try:
            partial.mkdir(parents=True)
            if hasattr(model, "save_pretrained"):
                model.save_pretrained(partial, state_dict=state)
            else:
                import torch

                torch.save(state, partial / STATE_DICT_FILE)
            if target.is_dir():
                target.rmdir()  # empty: _check_target refused any other
            os.replace(partial, target)
        except OSError as error:
            raise ShardplanError(
                f"cannot write {output}: {error.strerror or error}; give a folder this process may "
                "write"
            ) from None
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    return str(target) if hasattr(model, "save_pretrained") else str(target / STATE_DICT_FILE)


def _check_target(target: Path) -> None:
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        raise ShardplanError(
            f"cannot export to {target}: a file or link has that name; give a new folder"
        )
    if target.is_dir() and any(target.iterdir()):
        raise ShardplanError(
            f"cannot export to {target}: the folder is not empty (nothing in it is overwritten); "
            "give a new or empty folder"
        )


def _recorded_model(checkpoint: Path) -> str:
    """The model SPEC `shardplan train` recorded in the checkpoint's run folder."""
    from shardplan.common.files import parse_json, read_text

    settings = checkpoint.parent / SETTINGS_FILE
    if not settings.is_file():
        raise ShardplanError(
            f"{checkpoint} has no {SETTINGS_FILE} beside it naming its model (it was not saved by "
            "`shardplan train`): pass --model SPEC, the model it was trained as"
        )
    data = parse_json(read_text(settings, "run settings"), f"run settings {settings}")
    model = data.get("model") if isinstance(data, dict) else None
    if not isinstance(model, str):
        raise ShardplanError(
            f"{settings} names no model: pass --model SPEC, the model it was trained as"
        )
    if model.endswith(".json") and not os.path.isabs(model):
        recorded_from = data.get("cwd")
        if isinstance(recorded_from, str) and not os.path.exists(model):
            model = os.path.join(recorded_from, model)
    return model


def _gathered(spec: str, directory: Path, metadata: dict, fp32: bool):
    """(a fresh model of `spec` to save with, the checkpoint's full state dict)."""
    from shardplan.cli.model_spec import load_model
    from shardplan.plan import Plan
    from shardplan.runtime import parallelize
    from shardplan.runtime.manual import manual_plan

    model = load_model(spec, fp32_params=fp32, shape_flags=()).model
    saved = Plan.from_json(json.dumps(metadata["plan"]))
    try:
        plan = manual_plan(model, [unit.modules for unit in saved.units], dp=1)
    except ShardplanError as error:
        raise ShardplanError(
            f"the checkpoint's plan does not fit model {spec} ({error}): pass --model, the model "
            "it was trained as"
        ) from None
    program = parallelize(model, plan)
    program.load(directory)
    state = program.export_full_state_dict()
    fresh = load_model(spec, fp32_params=fp32, shape_flags=()).model
    return fresh, state


@contextlib.contextmanager
def _one_rank():
    """A gloo process group of this process alone, unless one is up already."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
