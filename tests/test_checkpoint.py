"""Checkpoints: resume exactly, reshard to other world sizes, plans and backends, survive a crash mid-save,
export a full state dict.

World 2 trains a GPT for 5 steps, saving after step 3; everything else is compared with that
uninterrupted run: world 2 resumes it exactly, worlds 4 and 1 (other unit groupings and strategy
mixes, and FSDP2 at world 4) continue its losses. A world-1 process dies mid-save for real. World 4
then trains and saves tensor-parallel meshes of its own, which other meshes and backends resume. Each
spawned world runs all its cases and returns rank 0's record, which the tests read; plans that
capture the model are written once, before their world starts.
"""

import functools
import hashlib
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from parity import spawn_world
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from shardplan.errors import CheckpointError, RuntimeMismatchError, ShardplanError
from shardplan.models import zoo
from shardplan.plan import Plan, ShardStrategy
from shardplan.runtime import checkpoint, manual_plan, parallelize
from shardplan.runtime.chunks import Chunk, DTensorHolder, row_chunks, unit_chunks
from shardplan.runtime.flat_param import FlatLayout
from shardplan.runtime.tensor_parallel import ParameterSlice

FS, SGO, SO, REP = (
    ShardStrategy.FULL_SHARD,
    ShardStrategy.SHARD_GRAD_OP,
    ShardStrategy.SHARD_OPTIMIZER,
    ShardStrategy.REPLICATE,
)
PLANS = {
    # the saving run: one unit per block, every strategy
    2: (zoo.gpt_units(zoo.GPTConfig().n_layer), (FS, SGO, SO, REP)),
    # other groupings and strategy mixes: chunks land on other ranks, in other units
    4: ([("wte", "wpe", "h.0"), ("h.1", "h.2"), ("h.3", "ln_f", "lm_head")], (SO, FS, REP)),
    1: ([("wte",), ("wpe", "h.0", "h.1"), ("h.2", "h.3", "ln_f", "lm_head")], (REP, SGO, FS)),
}
GLOBAL_BATCH = 4
"""Sequences per step, split over the ranks: the same data and mean loss at every world size."""
ADAMW = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-6, "weight_decay": 0.1}
SAVE_AFTER, STEPS = 3, 5


def build(rank: int, world: int, config=zoo.GPTConfig(), backend: str = "shardplan"):
    torch.manual_seed(0)
    model = zoo.gpt(config).model
    groups, strategies = PLANS[world]
    program = parallelize(
        model, manual_plan(model, groups, dp=world, strategies=strategies), backend=backend
    )
    return program, torch.optim.AdamW(program.parameters(), **ADAMW)


def batch(step: int, rank: int, world: int) -> torch.Tensor:
    config = zoo.GPTConfig()
    ids = torch.randint(
        0,
        config.vocab_size,
        (GLOBAL_BATCH, config.seq_len),
        generator=torch.Generator().manual_seed(step),
    )
    return ids.chunk(world)[rank]


def train(program, optimizer, steps, rank: int, world: int) -> list[float]:
    losses = []
    for step in steps:
        ids = batch(step, rank, world)
        losses.append(program.step(ids, labels=ids).item())
        optimizer.step()
        optimizer.zero_grad()
    return losses


def resume(rank: int, world: int, directory: Path) -> dict:
    """Load the step-3 checkpoint into a fresh program of this world's plan, train to step 5; the losses
    and state_error, the largest parameter difference from the uninterrupted run's (None off rank 0)."""
    program, optimizer = build(rank, world)
    optimizer.param_groups[0]["lr"] = (
        0.5  # as a scheduler might have left it: load restores the saved lr
    )
    program.load(directory / "ckpt", optimizer)
    losses = train(program, optimizer, range(SAVE_AFTER, STEPS), rank, world)
    state = program.export_full_state_dict()  # whole on rank 0, empty elsewhere
    return {
        "losses": losses,
        "state_error": max_difference(state, torch.load(directory / "final.pt")) if state else None,
    }


def across_backends(rank: int, world: int, directory: Path) -> dict:
    """FSDP2 resumes from the shardplan checkpoint, trains a step and saves; shardplan resumes from that."""
    fsdp2, optimizer = build(rank, world, backend="fsdp2")
    fsdp2.load(directory / "ckpt", optimizer)
    losses = train(fsdp2, optimizer, range(SAVE_AFTER, SAVE_AFTER + 1), rank, world)
    fsdp2.save(directory / "ckpt-fsdp2", optimizer)
    saved = fsdp2.export_full_state_dict()
    program, optimizer = build(rank, world)
    program.load(directory / "ckpt-fsdp2", optimizer)
    loaded = program.export_full_state_dict()
    losses += train(program, optimizer, range(SAVE_AFTER + 1, STEPS), rank, world)
    return {"losses": losses, "export_error": max_difference(saved, loaded) if saved else None}


def pipelined_plan(world: int) -> Plan:
    """PLANS[2]'s units in 2 stages of world / 2 ranks each, 1F1B over 2 micro-batches."""
    dp = world // 2
    groups, strategies = PLANS[2]
    example = batch(0, 0, dp)  # one replica's batch
    return manual_plan(
        zoo.gpt().model,
        groups,
        dp=dp,
        pp=2,
        strategies=strategies,
        micro_batches=2,
        schedule="1f1b",
        example_inputs=(example,),
        example_kwargs={"labels": example},
    )


def pipelined(rank: int, world: int, directory: Path, plan_json: str) -> dict:
    """pp 2 × dp 2 (pipelined_plan, as JSON) resumes the step-3 checkpoint, trains to step 5 and saves; a
    pp = 1 plan resumes that. state_error: its parameters' largest difference from the uninterrupted run's,
    reloaded_error: the pp = 1 plan's from what it saved (None off rank 0, which alone holds an export)."""
    dp = world // 2
    torch.manual_seed(0)
    model = zoo.gpt().model
    program = parallelize(model, Plan.from_json(plan_json))
    optimizer = torch.optim.AdamW(program.parameters(), **ADAMW)
    program.load(directory / "ckpt", optimizer)
    losses = train(program, optimizer, range(SAVE_AFTER, STEPS), rank % dp, dp)
    program.save(directory / "ckpt-pp", optimizer)
    state = program.export_full_state_dict()
    flat, flat_optimizer = build(rank, world)
    flat.load(directory / "ckpt-pp", flat_optimizer)
    loaded = flat.export_full_state_dict()
    return {
        "losses": losses,
        "state_error": max_difference(state, torch.load(directory / "final.pt")) if state else None,
        "reloaded_error": max_difference(loaded, state) if loaded else None,
    }


def max_difference(state: dict, reference: dict) -> float:
    assert state.keys() == reference.keys()
    return max((state[name] - reference[name]).abs().max().item() for name in state)


# world 2: the uninterrupted run, exact resume, export, crashes


def uninterrupted(rank: int, world: int, directory: Path) -> dict:
    program, optimizer = build(rank, world)
    losses = train(program, optimizer, range(SAVE_AFTER), rank, world)
    program.save(directory / "ckpt", optimizer)
    losses += train(program, optimizer, range(SAVE_AFTER, STEPS), rank, world)
    state = program.export_full_state_dict(directory / "final.pt")
    ids = batch(STEPS, rank, world)
    program_loss = program.step(ids, labels=ids).item()
    record = {"losses": losses}
    if rank == 0:
        torch.manual_seed(1)
        plain = zoo.gpt().model
        plain.load_state_dict(state)  # strict: every key, no extra
        everything = torch.cat([batch(STEPS, r, world) for r in range(world)])
        record["export"] = {
            "program_loss": program_loss,
            "plain_loss": plain(everything, labels=everything).item(),
            "saved_equal": max_difference(torch.load(directory / "final.pt"), state) == 0.0,
            "keys_match": sorted(state) == sorted(plain.state_dict()),
        }
    return record


def hugging_face_export(rank: int, world: int, directory: Path) -> dict:
    """A tied GPT-2: the export names both tied keys, and save_pretrained / from_pretrained round-trip it."""
    import transformers

    torch.manual_seed(0)
    entry = zoo.hf_gpt2(batch=2 * world, seq=16)
    groups = [
        ("transformer.wte", "transformer.wpe"),
        ("transformer.h.0",),
        ("transformer.h.1",),
        ("transformer.ln_f", "lm_head"),
    ]
    program = parallelize(
        entry.model, manual_plan(entry.model, groups, dp=world, strategies=(FS, SO, SGO, REP))
    )
    optimizer = torch.optim.AdamW(program.parameters(), **ADAMW)
    ids = entry.args[0]
    program.step(ids.chunk(world)[rank], labels=ids.chunk(world)[rank])
    optimizer.step()
    optimizer.zero_grad()
    program_loss = program.step(ids.chunk(world)[rank], labels=ids.chunk(world)[rank]).item()
    state = program.export_full_state_dict()
    if rank != 0:
        return {}
    tied = (
        state.get("lm_head.weight") is state["transformer.wte.weight"]
    )  # before save_pretrained drops one
    plain = transformers.AutoModelForCausalLM.from_config(entry.model.config)
    plain.load_state_dict(state)
    plain.save_pretrained(directory / "hf", state_dict=state)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(directory / "hf")
    return {
        "program_loss": program_loss,
        "plain_loss": plain(ids, labels=ids).loss.item(),
        "reloaded_loss": reloaded(ids, labels=ids).loss.item(),
        "tied_keys": tied,
    }


def crashes(rank: int, world: int, directory: Path, monkeypatch_swap) -> dict:
    """Saves that die before and between the directory renames leave the previous checkpoint loadable."""
    program, optimizer = build(rank, world)
    train(program, optimizer, range(1), rank, world)
    path = directory / "crash"
    program.save(path, optimizer)
    before = program.export_full_state_dict()
    train(program, optimizer, range(1, 2), rank, world)
    record = {}
    for when in ("before_swap", "between_renames"):
        with monkeypatch_swap(when):
            try:
                program.save(path, optimizer)
                record[when] = "saved"
            except RuntimeError as error:
                record[when] = str(error)
        record[f"{when}_dirs"] = sorted(
            p.name for p in directory.iterdir() if p.name.startswith("crash")
        )
        fresh, fresh_optimizer = build(rank, world)
        fresh.load(path, fresh_optimizer)
        restored = fresh.export_full_state_dict()  # a collective: every rank calls it
        record[f"{when}_restored_error"] = max_difference(restored, before) if restored else None
    program.save(path, optimizer)  # a later save cleans up
    record["after_dirs"] = sorted(p.name for p in directory.iterdir() if p.name.startswith("crash"))
    return record


class SwapCrash:
    """Make rank 0 die (raise) in the atomic save: before the renames, or after `<path>` became `.old`."""

    def __init__(self, when: str):
        self.when = when

    def __enter__(self):
        self.original = checkpoint._swap

        def crash(target: Path) -> None:
            if self.when == "between_renames":
                os.replace(target, checkpoint._old(target))
            raise RuntimeError(f"simulated crash {self.when}")

        checkpoint._swap = crash

    def __exit__(self, *exc):
        checkpoint._swap = self.original


def die_mid_save(rank: int, world: int, directory: Path) -> None:
    """The process dies for real (os._exit) after `<path>` became `<path>.old`, the worst moment."""
    program, optimizer = build(rank, world)
    train(program, optimizer, range(1), rank, world)
    program.save(directory / "dying", optimizer)
    program.export_full_state_dict(directory / "dying-saved.pt")
    train(program, optimizer, range(1, 2), rank, world)

    def die(target: Path) -> None:
        os.replace(target, checkpoint._old(target))
        os._exit(17)

    checkpoint._swap = die
    program.save(directory / "dying", optimizer)


def after_death(rank: int, world: int, directory: Path) -> float | None:
    """Another world size loads what the dead save left: the checkpoint before it. Returns the largest
    difference from what that checkpoint held (None off rank 0, which alone holds an export)."""
    program, optimizer = build(rank, world)
    program.load(directory / "dying", optimizer)
    state = program.export_full_state_dict()
    return max_difference(state, torch.load(directory / "dying-saved.pt")) if state else None


def expect(found: dict, name: str, action) -> None:
    """found[name]: None if `action` returned, else the error's type name and message. Any error: DCP's
    CheckpointException derives from BaseException, and the assertions should name it."""
    try:
        action()
        found[name] = None
    except BaseException as error:
        found[name] = [type(error).__name__, str(error)]


def errors(rank: int, world: int, directory: Path) -> dict:
    found = {}

    other = zoo.GPTConfig(d_model=32, n_layer=4)
    program, optimizer = build(rank, world, other)
    expect(found, "other_model", lambda: program.load(directory / "ckpt", optimizer))
    if rank == 0:
        for name in ("missing", "corrupt", "future"):
            shutil.copytree(directory / "ckpt", directory / name)
        (directory / "missing" / checkpoint.METADATA_FILE).unlink()
        (directory / "corrupt" / checkpoint.METADATA_FILE).write_text('{"format": "shardplan.chec')
        metadata = json.loads((directory / "ckpt" / checkpoint.METADATA_FILE).read_text())
        future = {**metadata, "format": "shardplan.checkpoint/3"}
        (directory / "future" / checkpoint.METADATA_FILE).write_text(json.dumps(future))
    dist.barrier()
    program, optimizer = build(rank, world)
    for name in ("missing", "corrupt", "future", "nowhere"):
        expect(found, name, lambda: program.load(directory / name, optimizer))
    expect(
        found,
        "other_optimizer",
        lambda: program.load(directory / "ckpt", torch.optim.SGD(program.parameters())),
    )
    # an FSDP2 parameter sharded along another dim than FSDP2's own: its pieces are no rows
    columns = distribute_tensor(
        torch.zeros(4, 6), init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",)), [Shard(1)]
    )
    holder = DTensorHolder("columns", torch.nn.Parameter(columns), [], program, None)
    expect(
        found, "placement", lambda: holder.entries(holder.parameter, lambda name: f"model.{name}")
    )
    return found


def transactions(rank: int, world: int, directory: Path) -> dict:
    """World 2: a save to a different path on each rank fails on both; loads that fail (a truncated shard
    that only some reads hit, an optimizer of another shape) leave every rank's state as it was, and the
    ranks still step together."""
    program, optimizer = build(rank, world)
    train(program, optimizer, range(1), rank, world)
    program.save(directory / "tx", optimizer)
    train(program, optimizer, range(1, 2), rank, world)
    found = {}
    expect(found, "per_rank_paths", lambda: program.save(directory / f"tx-rank-{rank}", optimizer))
    found["per_rank_dirs"] = sorted(
        p.name for p in directory.iterdir() if p.name.startswith("tx-rank")
    )
    expect(
        found,
        "optimizer_on_one_rank",
        lambda: program.save(directory / "tx-half", optimizer if rank else None),
    )
    found["optimizer_on_one_rank_dirs"] = sorted(
        p.name for p in directory.iterdir() if p.name.startswith("tx-half")
    )
    before = program.export_full_state_dict()
    optimizer_before = {
        id(p): {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
        for p, state in optimizer.state.items()
    }
    if rank == 0:
        shutil.copytree(directory / "tx", directory / "tx-truncated")
        shard = directory / "tx-truncated" / "__1_0.distcp"
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    dist.barrier()
    expect(found, "truncated", lambda: program.load(directory / "tx-truncated", optimizer))
    groups = [list(program.parameters())[:1], list(program.parameters())[1:]]
    two_groups = torch.optim.AdamW([{"params": group} for group in groups], **ADAMW)
    expect(found, "two_groups", lambda: program.load(directory / "tx", two_groups))
    after = (
        program.export_full_state_dict()
    )  # a collective: ranks that disagree on a unit abort here
    found["optimizer_unchanged"] = (
        all(
            all(
                torch.equal(value, optimizer_before[id(p)][key])
                if isinstance(value, torch.Tensor)
                else value == optimizer_before[id(p)][key]
                for key, value in state.items()
            )
            for p, state in optimizer.state.items()
        )
        and not two_groups.state
    )
    found["state_error"] = max_difference(after, before) if after else None
    found["losses"] = train(program, optimizer, range(2, 4), rank, world)
    return found


def tampered(rank: int, world: int, directory: Path) -> dict:
    """World 1: flipped bytes, a shard of another checkpoint, crafted metadata (code in `.metadata` or in a
    shard's tensor data, with a manifest that matches), params=[] and deep nesting in shardplan.json."""
    found = {}
    marker = directory / "code-ran"
    cases = {
        name: directory / f"tampered-{name}"
        for name in ("flipped", "swapped", "pickle", "tensor_pickle", "frozen", "deep")
    }
    for name, target in cases.items():
        shutil.copytree(directory / "ckpt", target)
    flipped = cases["flipped"] / "__1_0.distcp"
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0xFF
    flipped.write_bytes(bytes(data))
    shutil.copyfile(directory / "crash" / "__0_0.distcp", cases["swapped"] / "__0_0.distcp")
    (cases["pickle"] / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    restamp(cases["pickle"], ".metadata")
    with open(cases["tensor_pickle"] / ".metadata", "rb") as handle:
        dcp_metadata = pickle.load(handle)  # this test's own checkpoint: trusted
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    evil = pickle.dumps(RunsCode(marker))
    (cases["tensor_pickle"] / "evil.distcp").write_bytes(evil)
    key = next(iter(dcp_metadata.storage_data))
    dcp_metadata.storage_data[key] = _StorageInfo(
        relative_path="evil.distcp", offset=0, length=len(evil)
    )
    (cases["tensor_pickle"] / ".metadata").write_bytes(pickle.dumps(dcp_metadata))
    restamp(cases["tensor_pickle"], ".metadata", "evil.distcp")
    metadata = json.loads((cases["frozen"] / checkpoint.METADATA_FILE).read_text())
    (cases["frozen"] / checkpoint.METADATA_FILE).write_text(
        json.dumps(
            {
                **metadata,
                "optimizer": {
                    **metadata["optimizer"],
                    "param_groups": [{**metadata["optimizer"]["param_groups"][0], "params": []}],
                },
            }
        )
    )
    (cases["deep"] / checkpoint.METADATA_FILE).write_text(
        json.dumps({**metadata, "plan": "PLAN"}).replace('"PLAN"', "[" * 100_000 + "]" * 100_000)
    )
    program, optimizer = build(rank, world)
    for name, target in cases.items():
        expect(found, name, lambda: program.load(target, optimizer))
    found["code_ran"] = marker.exists()
    return found


class RunsCode:
    """Pickles to a call of os.mkdir(marker): what a crafted file would run on load."""

    def __init__(self, marker: Path):
        self.marker = os.fspath(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def restamp(directory: Path, *names: str) -> None:
    """Write the manifest entries of files an attacker replaced, as they would."""
    metadata = json.loads((directory / checkpoint.METADATA_FILE).read_text())
    for name in names:
        data = (directory / name).read_bytes()
        metadata.setdefault("files", {})[name] = {
            "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
        }
    (directory / checkpoint.METADATA_FILE).write_text(json.dumps(metadata))


def save_paths(rank: int, world: int, directory: Path) -> dict:
    """World 1: paths a save cannot replace safely are refused with the reason; the checkpoint there survives."""
    program, optimizer = build(rank, world)
    found = {}
    (directory / "link").symlink_to(directory / "ckpt", target_is_directory=True)
    (directory / "a-file").write_text("keep me")
    working = Path.cwd()
    os.chdir(directory / "ckpt")
    try:
        expect(found, "dot", lambda: program.save(".", optimizer))
    finally:
        os.chdir(working)
    for name, path in (
        ("symlink", directory / "link"),
        ("file", directory / "a-file"),
        ("under_file", directory / "a-file" / "ckpt"),
    ):
        expect(found, name, lambda: program.save(path, optimizer))
    found["file_kept"] = (directory / "a-file").read_text() == "keep me"
    found["link_kept"] = (directory / "link").is_symlink()
    expect(found, "still_loads", lambda: program.load(directory / "ckpt", optimizer))
    annotated = directory / "annotated"
    program.save(annotated, optimizer, extra={"counter": Counter()})
    program.save(
        annotated, optimizer, extra={"counter": Counter()}
    )  # over its own files: as before
    (annotated / "NOTES.md").write_text("eval at step 3")
    (annotated / "eval").mkdir()
    (annotated / "eval" / "results.txt").write_text("0.71")
    expect(found, "foreign", lambda: program.save(annotated, optimizer))
    found["foreign_kept"] = sorted(path.name for path in annotated.iterdir())
    expect(
        found,
        "annotated_loads",
        lambda: program.load(annotated, optimizer, extra={"counter": Counter()}),
    )
    return found


class Counter:
    """An extra state, whose file a save writes beside the shards."""

    def state_dict(self) -> dict:
        return {"value": 1}

    def load_state_dict(self, state: dict) -> None:
        pass


def saving_run(rank: int, world: int, directory: Path) -> dict:
    """World 2: the uninterrupted run that saves the step-3 checkpoint, its exact resume, crashes, exports;
    then replicas' BatchNorm statistics on each backend."""
    # in this order: resume loads what the uninterrupted run saved
    return {
        "uninterrupted": uninterrupted(rank, world, directory),
        "resume": resume(rank, world, directory),
        "crashes": crashes(rank, world, directory, SwapCrash),
        "hugging_face": hugging_face_export(rank, world, directory),
        "transactions": transactions(rank, world, directory),
        "batch_norm": {
            backend: running_statistics_run(rank, world, directory, backend)
            for backend in ("shardplan", "fsdp2")
        },
    }


def resuming_run(rank: int, world: int, directory: Path, plans: dict | None = None) -> dict:
    """Worlds 4 and 1: resume the step-3 checkpoint on another plan; world 4 also across backends, pipelined
    and after the death mid-save, then the tensor-parallel checkpoints of its own run, its plans
    (`plans`: pipelined_plan's and tensor_parallel_plans', as JSON) written before it started; world 1
    the refusals."""
    results = resume(rank, world, directory)
    if world == 4:
        results["fsdp2"] = across_backends(rank, world, directory)
        results["pipelined"] = pipelined(rank, world, directory, plans["pipelined"])
        results["after_death"] = after_death(rank, world, directory)
        results["tensor_parallel"] = tensor_parallel_checkpoints(
            rank, world, directory, plans["tensor_parallel"]
        )
    if world == 1:
        results["errors"] = errors(rank, world, directory)
        results["tampered"] = tampered(rank, world, directory)
        results["save_paths"] = save_paths(rank, world, directory)
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    directory = tmp_path_factory.mktemp("checkpoints")
    saved = spawn_world(2, saving_run, (directory,))
    with pytest.raises(mp.ProcessExitedException, match="exit code 17"):
        spawn_world(1, die_mid_save, (directory,))
    saved["dead_dirs"] = sorted(p.name for p in directory.iterdir() if p.name.startswith("dying"))
    plans = {  # the same on every rank: captured once, here
        "pipelined": pipelined_plan(4).to_json(),
        "tensor_parallel": {name: plan.to_json() for name, plan in tensor_parallel_plans().items()},
    }
    return {
        "save": saved,
        4: spawn_world(4, resuming_run, (directory, plans)),
        1: spawn_world(1, resuming_run, (directory,)),
        "directory": directory,
    }


@pytest.mark.timeout(300)
def test_resume_on_the_same_plan_is_exact(runs):
    uninterrupted, resumed = runs["save"]["uninterrupted"], runs["save"]["resume"]
    assert resumed["losses"] == uninterrupted["losses"][SAVE_AFTER:]
    assert resumed["state_error"] == 0.0  # every parameter bit-equal after the two resumed steps


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [4, 1])
def test_resume_on_another_world_size_and_plan(runs, world):
    expected = runs["save"]["uninterrupted"]["losses"][SAVE_AFTER:]
    assert runs[world]["losses"] == pytest.approx(expected, abs=1e-5)
    assert runs[world]["state_error"] < 1e-5


@pytest.mark.timeout(300)
def test_pipelined_programs_resume_and_save_the_same_format(runs):
    pipelined = runs[4]["pipelined"]
    assert pipelined["losses"] == pytest.approx(
        runs["save"]["uninterrupted"]["losses"][SAVE_AFTER:], abs=1e-5
    )
    assert (
        pipelined["state_error"] < 1e-5
    )  # pp 2 × dp 2 trained on from the checkpoint as the uninterrupted run did
    assert (
        pipelined["reloaded_error"] == 0.0
    )  # and what it saved loads bit-exactly into a pp = 1 plan


@pytest.mark.timeout(300)
def test_fsdp2_backend_reads_and_writes_the_same_format(runs):
    expected = runs["save"]["uninterrupted"]["losses"][SAVE_AFTER:]
    assert runs[4]["fsdp2"]["losses"] == pytest.approx(expected, abs=1e-5)
    assert runs[4]["fsdp2"]["export_error"] == 0.0


@pytest.mark.timeout(300)
def test_checkpoint_directory_holds_the_metadata(runs):
    metadata = json.loads((runs["directory"] / "ckpt" / checkpoint.METADATA_FILE).read_text())
    assert metadata["format"] == checkpoint.FORMAT and metadata["world_size"] == 2
    assert len(metadata["plan"]["units"]) == 6
    assert {entry["name"]: entry["shape"] for entry in metadata["parameters"]}["wte.weight"] == [
        256,
        64,
    ]
    assert metadata["optimizer"]["type"] == "AdamW"
    assert set(metadata["optimizer"]["state"]) == {"step", "exp_avg", "exp_avg_sq"}
    assert metadata["optimizer"]["param_groups"][0]["betas"] == [0.9, 0.95]
    listed = sorted(
        p.name for p in (runs["directory"] / "ckpt").iterdir() if p.name != checkpoint.METADATA_FILE
    )
    assert sorted(metadata["files"]) == listed == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    for name, entry in metadata["files"].items():
        data = (runs["directory"] / "ckpt" / name).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


@pytest.mark.timeout(300)
def test_exported_state_dict_loads_into_the_plain_model(runs):
    export = runs["save"]["uninterrupted"]["export"]
    assert export["keys_match"] and export["saved_equal"]
    assert export["plain_loss"] == pytest.approx(export["program_loss"], abs=1e-5)


@pytest.mark.timeout(300)
def test_exported_hugging_face_state_dict_keeps_ties_and_round_trips(runs):
    export = runs["save"]["hugging_face"]
    assert export["tied_keys"]
    assert export["plain_loss"] == pytest.approx(export["program_loss"], abs=1e-5)
    assert export["reloaded_loss"] == pytest.approx(export["program_loss"], abs=1e-5)


@pytest.mark.timeout(300)
def test_a_crash_mid_save_leaves_the_previous_checkpoint(runs):
    crashes = runs["save"]["crashes"]
    assert crashes["before_swap"] == "simulated crash before_swap"
    assert crashes["before_swap_dirs"] == ["crash", "crash.partial"]
    assert crashes["before_swap_restored_error"] == 0.0
    assert crashes["between_renames"] == "simulated crash between_renames"
    assert crashes["between_renames_dirs"] == ["crash.old", "crash.partial"]
    assert crashes["between_renames_restored_error"] == 0.0
    assert crashes["after_dirs"] == ["crash"]


@pytest.mark.timeout(300)
def test_a_process_dying_mid_save_leaves_the_previous_checkpoint(runs):
    assert runs["save"]["dead_dirs"] == ["dying-saved.pt", "dying.old", "dying.partial"]
    assert runs[4]["after_death"] == 0.0


@pytest.mark.timeout(300)
def test_bad_checkpoints_are_refused_with_the_reason(runs):
    found = runs[1]["errors"]
    assert (
        found["other_model"][0] == "CheckpointError"
        and "'wte.weight' is float32[256, 64] in the checkpoint, float32[256, 32] in the model"
        in found["other_model"][1]
    )
    assert (
        found["missing"][0] == "CheckpointError" and "has no shardplan.json" in found["missing"][1]
    )
    assert found["corrupt"][0] == "CheckpointError" and "is not valid JSON" in found["corrupt"][1]
    assert (
        found["future"][0] == "CheckpointError" and "'shardplan.checkpoint/3'" in found["future"][1]
    )
    assert found["nowhere"][0] == "CheckpointError" and "no checkpoint at" in found["nowhere"][1]
    assert (
        found["other_optimizer"][0] == "CheckpointError"
        and "holds AdamW state" in found["other_optimizer"][1]
    )
    assert (
        found["placement"][0] == "ShardplanError"
        and "placed (Shard(dim=1),) over mesh dims ('dp_shard',)" in found["placement"][1]
    )
    assert issubclass(CheckpointError, ShardplanError)


@pytest.mark.timeout(300)
def test_ranks_given_different_paths_save_nothing(runs):
    found = runs["save"]["transactions"]
    assert (
        found["per_rank_paths"][0] == "RuntimeMismatchError"
        and "checkpoint paths" in found["per_rank_paths"][1]
    )
    assert found["per_rank_dirs"] == []
    assert issubclass(RuntimeMismatchError, ShardplanError)


@pytest.mark.timeout(300)
def test_ranks_saving_with_and_without_the_optimizer_save_nothing_and_say_so(runs):
    found = runs["save"]["transactions"]
    assert found["optimizer_on_one_rank"][0] == "RuntimeMismatchError"
    assert (
        "ranks [1] passed an optimizer to save and the others did not"
        in found["optimizer_on_one_rank"][1]
    )
    assert found["optimizer_on_one_rank_dirs"] == []


@pytest.mark.timeout(300)
def test_a_failed_load_applies_nothing_on_any_rank(runs):
    found = runs["save"]["transactions"]
    assert found["state_error"] == 0.0  # parameters as before both failed loads
    assert found["optimizer_unchanged"]
    assert found["truncated"][0] == "CheckpointError" and "__1_0.distcp" in found["truncated"][1]
    assert found["two_groups"][0] == "CheckpointError" and "param groups" in found["two_groups"][1]
    # the ranks still run their collectives in step: two more steps train, as the uninterrupted run's did
    assert found["losses"] == pytest.approx(runs["save"]["uninterrupted"]["losses"][2:4], abs=1e-5)


@pytest.mark.timeout(300)
def test_tampered_checkpoints_are_refused_and_run_no_code(runs):
    found = runs[1]["tampered"]
    assert not found["code_ran"]
    for name, fragment in (
        ("flipped", "__1_0.distcp has other bytes"),
        ("swapped", "__0_0.distcp has other bytes"),
        ("pickle", "posix.mkdir"),
        ("tensor_pickle", "evil.distcp"),
        ("frozen", "params"),
        ("deep", "levels deep"),
    ):
        assert found[name][0] == "CheckpointError" and fragment in found[name][1], (
            name,
            found[name],
        )
        assert "\n" not in found[name][1]


@pytest.mark.timeout(300)
def test_paths_a_save_cannot_replace_are_refused(runs):
    found = runs[1]["save_paths"]
    for name, fragment in (
        ("dot", "working directory"),
        ("symlink", "symbolic link"),
        ("file", "is a file"),
        ("under_file", "a-file is a file"),
    ):
        assert found[name][0] == "CheckpointError" and fragment in found[name][1], (
            name,
            found[name],
        )
    assert found["file_kept"] and found["link_kept"]
    assert found["still_loads"] is None
    error, message = found[
        "foreign"
    ]  # a user's notes beside the shards: the save's swap would delete them
    assert (
        error == "CheckpointError"
        and "annotated: it holds NOTES.md, eval, which no save writes" in message
    )
    assert "nothing was changed: move them out, or save to another path" in message
    assert found["foreign_kept"] == [
        ".metadata",
        "NOTES.md",
        "__0_0.distcp",
        "eval",
        "extra.counter.pt",
        "shardplan.json",
    ]
    assert found["annotated_loads"] is None


# pure: the chunk arithmetic, against the flat buffer itself


@pytest.mark.parametrize("numels,dp", [((3, 5), 4), ((1,), 4), ((7, 0, 2, 9), 3), ((4, 4), 1)])
def test_unit_chunks_tile_each_parameter_exactly(numels, dp):
    shapes = [torch.Size([numel]) for numel in numels]
    layout = FlatLayout.of(
        "unit", [(f"p{i}", torch.empty(shape)) for i, shape in enumerate(shapes)], dp
    )
    flat = torch.arange(layout.padded_numel, dtype=torch.float32)
    shards = flat.chunk(dp)
    for index, whole in enumerate(layout.split(flat)):
        rebuilt = torch.full((numels[index],), -1.0)
        for chunk in unit_chunks(layout, index, None, sharded=True, owner=lambda shard, tp: shard):
            rebuilt[chunk.offset : chunk.offset + chunk.numel] = shards[chunk.rank][
                chunk.start : chunk.start + chunk.numel
            ]
        assert torch.equal(rebuilt, whole)


@pytest.mark.parametrize(
    "dim,chunks,sharded", [(0, 1, True), (0, 3, True), (1, 1, True), (1, 1, False)]
)
def test_unit_chunks_of_tensor_parallel_slices_tile_the_full_parameter(dim, chunks, sharded):
    """A parameter sliced over tp 2 next to a whole one in a unit over dp 3: every (shard, tp rank)'s
    chunks put the full parameter back, in its full flattened order."""
    full = torch.arange(6.0 * 12).view(6, 12)
    cuts = [
        ParameterSlice(full_shape=(6, 12), dim=dim, chunks=chunks, index=tp, degree=2)
        for tp in range(2)
    ]
    layout = FlatLayout.of("unit", [("whole", torch.empty(5)), ("sliced", cuts[0].take(full))], 3)
    flats = [
        layout.flatten([torch.zeros(5), cut.take(full)]) for cut in cuts
    ]  # each tp rank's buffer
    held = {
        (shard, tp): flats[tp].chunk(3)[shard] if sharded else flats[tp]
        for shard in range(3)
        for tp in range(2)
    }
    rebuilt = torch.full((full.numel(),), -1.0)
    for chunk in unit_chunks(
        layout, 1, cuts[0], sharded=sharded, owner=lambda shard, tp: (shard, tp)
    ):
        rebuilt[chunk.offset : chunk.offset + chunk.numel] = held[chunk.rank][
            chunk.start : chunk.start + chunk.numel
        ]
    assert torch.equal(rebuilt, full.flatten())


def test_row_chunks_follow_torch_chunk_along_dim_0():
    assert row_chunks(torch.Size([5, 3]), 2) == [
        Chunk(rank=0, offset=0, numel=9, start=0),
        Chunk(rank=1, offset=9, numel=6, start=0),
    ]
    assert row_chunks(torch.Size([1, 4]), 4) == [Chunk(rank=0, offset=0, numel=4, start=0)]
    tensor = torch.arange(7 * 2).view(7, 2)
    pieces = tensor.chunk(3)
    assert [chunk.numel for chunk in row_chunks(tensor.shape, 3)] == [
        piece.numel() for piece in pieces
    ]


def running_statistics_run(rank: int, world: int, directory: Path, backend: str) -> dict:
    """Replicas train a CNN with BatchNorm on batches of their own, then save (in
    batch-norm-<backend>) and export (rank 0's record)."""
    torch.manual_seed(0)
    entry = zoo.residual_cnn(batch=4)
    plan = manual_plan(
        entry.model, [("stem",), ("layers.0", "layers.1", "layers.2"), ("head",)], dp=world
    )
    program = parallelize(entry.model, plan, backend=backend)
    generator = torch.Generator().manual_seed(
        rank
    )  # each replica its own images: its own statistics
    images = torch.randn(4, 3, 16, 16, generator=generator) * (1 + rank)
    program.step(images, entry.args[1])
    mine = {
        name: buffer.detach().clone()
        for name, buffer in entry.model.named_buffers()
        if "running" in name
    }
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    exported = program.export_full_state_dict()
    program.save(directory / f"batch-norm-{backend}")
    saved = {
        name: buffer.detach().clone()
        for name, buffer in entry.model.named_buffers()
        if "running" in name
    }
    # plain lists: tensors would cross to the test process through shared memory the rank frees as it exits
    return {
        "replicas": [{k: v.tolist() for k, v in replica.items()} for replica in gathered],
        "exported": {k: v.tolist() for k, v in exported.items() if "running" in k},
        "live": {k: v.tolist() for k, v in saved.items()},
    }


@pytest.mark.distributed
@pytest.mark.parametrize("backend", ["shardplan", "fsdp2"])
def test_batch_norm_statistics_are_the_replicas_mean_in_checkpoints_and_exports(runs, backend):
    record = runs["save"]["batch_norm"][backend]  # world 2's, after its other cases
    first, second = (
        {name: torch.tensor(values, dtype=torch.float64) for name, values in replica.items()}
        for replica in record["replicas"]
    )
    assert any(
        not torch.equal(first[name], second[name]) for name in first
    )  # the replicas did drift apart
    for name in first:
        mean = (first[name] + second[name]) / 2
        for where in ("exported", "live"):
            torch.testing.assert_close(
                torch.tensor(record[where][name], dtype=torch.float64), mean, rtol=1e-6, atol=1e-7
            )
    saved = json.loads((runs["directory"] / f"batch-norm-{backend}" / "shardplan.json").read_text())
    assert any("running_mean" in entry["name"] for entry in saved["buffers"])


TENSOR_PARALLEL_GPT = zoo.GPTConfig(n_layer=2)
"""The tensor-parallel checkpoints' GPT: the default's width (its shapes are checked) and two blocks,
which each layout treats as it treats four; every load reads metadata per chunk of each parameter."""


def tensor_parallel_plan(dp: int, **options):
    """The GPT's plan over 4 ranks with tp 2, `dp` ranks sharding each unit, the rest as `options` say."""
    example = batch(0, 0, dp * options.get("dp_replicate", 1))  # one replica's batch
    return manual_plan(
        zoo.gpt(TENSOR_PARALLEL_GPT).model,
        zoo.gpt_units(TENSOR_PARALLEL_GPT.n_layer),
        dp=dp,
        tp=2,
        example_inputs=(example,),
        example_kwargs={"labels": example},
        **options,
    )


def tensor_parallel_plans() -> dict[str, Plan]:
    """The plans of tensor_parallel_checkpoints, by name."""
    return {
        "tp2_dp2": tensor_parallel_plan(dp=2),
        "tp2_dp2_sp_vocab": tensor_parallel_plan(dp=2, sequence_parallel=True, vocab_parallel=True),
        "tp2_hsdp2": tensor_parallel_plan(dp=1, dp_replicate=2),
        "tp2_pp2": tensor_parallel_plan(dp=1, pp=2, micro_batches=2, schedule="1f1b"),
    }


def tensor_parallel_program(plan_json: str, backend: str, rank: int) -> tuple:
    """(a program of the plan `plan_json` on `backend` from seed 0, its optimizer, this rank's replica, the
    replicas)."""
    plan = Plan.from_json(plan_json)
    torch.manual_seed(0)
    program = parallelize(zoo.gpt(TENSOR_PARALLEL_GPT).model, plan, backend=backend)
    return (
        program,
        torch.optim.AdamW(program.parameters(), **ADAMW),
        plan.mesh.replica_of(rank),
        plan.mesh.dp,
    )


def tensor_parallel_gpt_on_dp(world: int) -> tuple:
    """(a shardplan program of the tensor-parallel checkpoints' GPT on `world` data-parallel ranks, one
    unit per block and PLANS[4]'s strategy mix, its optimizer)."""
    torch.manual_seed(0)
    model = zoo.gpt(TENSOR_PARALLEL_GPT).model
    units = zoo.gpt_units(TENSOR_PARALLEL_GPT.n_layer)
    program = parallelize(model, manual_plan(model, units, dp=world, strategies=PLANS[4][1]))
    return program, torch.optim.AdamW(program.parameters(), **ADAMW)


def tensor_parallel_checkpoints(rank: int, world: int, directory: Path, plans: dict) -> dict:
    """`plans`: tensor_parallel_plans', as JSON. fsdp2 tp 2 × dp 2 trains 5 steps, saving after step 3. From that checkpoint: shardplan dp 4 and fsdp2
    tp 2 × dp 2 with sequence and vocab parallelism resume; shardplan tp 2 × dp 2 takes a step and saves,
    which fsdp2 tp 2 × HSDP 2 resumes; fsdp2 tp 2 × pp 2 resumes and saves at the end, which shardplan dp 4
    loads. Per case: its losses after step 3, loaded_error (each load's export against the saving program's
    at its save: the largest) and state_error (its final state against the uninterrupted run's), both None
    off rank 0, which alone holds an export."""

    def difference(state: dict, reference: dict) -> float | None:
        return max_difference(state, reference) if state else None

    def resumed(
        program, optimizer, replica: int, replicas: int, *, path: str, saved: dict, steps: range
    ) -> tuple[list[float], float | None]:
        """Load the checkpoint `path`, whose saving program exported `saved`, and train `steps`: (the losses,
        the loaded export's difference from `saved`)."""
        program.load(directory / path, optimizer)
        loaded = program.export_full_state_dict()
        return train(program, optimizer, steps, replica, replicas), difference(loaded, saved)

    def record(state: dict, losses: list[float], *loaded_errors: float | None) -> dict:
        return {
            "losses": losses,
            "loaded_error": None if None in loaded_errors else max(loaded_errors),
            "state_error": difference(state, final),
        }

    sharded = plans["tp2_dp2"]
    program, optimizer, replica, replicas = tensor_parallel_program(sharded, "fsdp2", rank)
    uninterrupted = train(program, optimizer, range(SAVE_AFTER), replica, replicas)
    program.save(directory / "fsdp2-tp", optimizer)
    at_save = program.export_full_state_dict()
    uninterrupted += train(program, optimizer, range(SAVE_AFTER, STEPS), replica, replicas)
    final = program.export_full_state_dict()
    results: dict = {"uninterrupted": uninterrupted}
    resume = functools.partial(
        resumed, path="fsdp2-tp", saved=at_save, steps=range(SAVE_AFTER, STEPS)
    )

    program, optimizer = tensor_parallel_gpt_on_dp(world)
    losses, loaded_error = resume(program, optimizer, rank, world)
    results["shardplan dp 4"] = record(program.export_full_state_dict(), losses, loaded_error)

    program, *rest = tensor_parallel_program(plans["tp2_dp2_sp_vocab"], "fsdp2", rank)
    losses, loaded_error = resume(program, *rest)
    results["fsdp2 tp 2 × dp 2, sequence and vocab parallel"] = record(
        program.export_full_state_dict(), losses, loaded_error
    )

    program, optimizer, *rest = tensor_parallel_program(sharded, "shardplan", rank)
    losses, loaded_error = resume(
        program, optimizer, *rest, steps=range(SAVE_AFTER, SAVE_AFTER + 1)
    )
    program.save(directory / "shardplan-tp", optimizer)
    at_step = program.export_full_state_dict()
    program, *rest = tensor_parallel_program(plans["tp2_hsdp2"], "fsdp2", rank)
    more, hybrid_error = resumed(
        program, *rest, path="shardplan-tp", saved=at_step, steps=range(SAVE_AFTER + 1, STEPS)
    )
    results["shardplan tp 2 × dp 2, then fsdp2 tp 2 × HSDP 2"] = record(
        program.export_full_state_dict(), losses + more, loaded_error, hybrid_error
    )

    program, optimizer, *rest = tensor_parallel_program(plans["tp2_pp2"], "fsdp2", rank)
    losses, loaded_error = resume(program, optimizer, *rest)
    program.save(directory / "fsdp2-tp-pp", optimizer)
    at_end = program.export_full_state_dict()
    _, reloaded_error = resumed(
        *tensor_parallel_gpt_on_dp(world),
        rank,
        world,
        path="fsdp2-tp-pp",
        saved=at_end,
        steps=range(0),
    )
    results["fsdp2 tp 2 × pp 2, then shardplan dp 4"] = record(
        at_end, losses, loaded_error, reloaded_error
    )
    return results


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_fsdp2_tensor_parallel_checkpoints_resume_on_other_meshes_and_backends(runs):
    results = dict(runs[4]["tensor_parallel"])  # world 4's own run, in the checkpoints' directory
    expected = results.pop("uninterrupted")[SAVE_AFTER:]
    assert len(results) == 4
    for name, resumed in results.items():
        assert resumed["losses"] == pytest.approx(expected, abs=1e-5), name
        assert resumed["loaded_error"] == 0.0, (
            name
        )  # every parameter bit-equal to the saving program's
        assert resumed["state_error"] < 1e-5, name
    metadata = json.loads((runs["directory"] / "fsdp2-tp" / checkpoint.METADATA_FILE).read_text())
    shapes = {entry["name"]: entry["shape"] for entry in metadata["parameters"]}
    assert shapes["h.0.attn.qkv.weight"] == [192, 64] and shapes["h.0.mlp.proj.weight"] == [64, 256]
