"""The plan file: schema, invariants with their fixes, round trip, diff and summary."""

import dataclasses
import json
import typing

import pytest

from shardplan.errors import PlanError, ShardplanError
from shardplan.frontend.chain import InputSpec
from shardplan.plan import (
    FLOAT_DTYPES,
    INPUT_DTYPES,
    MAX_WORLD_SIZE,
    SCHEMA,
    SCHEMA_PATH,
    Checkpoint,
    Mesh,
    MixedPrecision,
    Plan,
    Predicted,
    Reasoning,
    Schedule,
    ShardedModule,
    ShardStrategy,
    Stage,
    TensorParallel,
    Unit,
    load_plan,
)


def unit(name: str, params=None, **changes) -> Unit:
    return Unit(
        name=name,
        modules=(name,),
        params=tuple(params if params is not None else (f"{name}.weight",)),
        **changes,
    )


def plan(**changes) -> Plan:
    units = changes.pop(
        "units",
        (
            unit("h.0"),
            unit("h.1", strategy=ShardStrategy.SHARD_GRAD_OP, checkpoint=Checkpoint.FULL),
        ),
    )
    values = dict(
        fingerprint="abc",
        model="GPT",
        world_size=4,
        hardware="cpu-gloo",
        inputs=(),
        mesh=Mesh(dp_shard=4),
        units=units,
        stages=(Stage(index=0, units=tuple(u.name for u in units)),),
        predicted=Predicted(
            peak_bytes=3 * 2**20,
            step_time_s=0.5,
            memory_bytes={"sharded_state": 2**20, "activations": 2 * 2**20},
            time_s={"compute": 0.4, "exposed_comm": 0.1},
        ),
        reasoning=Reasoning(budget_bytes=2**30, binding_constraint="none: the fastest plan fits"),
    )
    values.update(changes)
    return Plan(**values)


def test_round_trip_is_byte_identical(tmp_path):
    original = plan()
    path = tmp_path / "plan.json"
    original.save(path)
    loaded = load_plan(path)
    assert loaded == original
    assert loaded.to_json() == original.to_json() == path.read_text()


def test_a_plan_written_by_hand_round_trips():
    """manual_plan's plans carry no budget and no prediction (zeros), and spawned ranks read them as JSON."""
    from shardplan.models import zoo
    from shardplan.runtime.manual import manual_plan

    entry = zoo.gpt()
    written = manual_plan(entry.model, zoo.gpt_units(entry.model.config.n_layer), dp=2)
    assert written.reasoning.budget_bytes == 0
    assert Plan.from_json(written.to_json()) == written


@pytest.mark.parametrize(
    "change, message",
    [
        (
            dict(mesh=Mesh(dp_shard=3)),
            "make pp \\* dp_replicate \\* dp_shard \\* cp \\* tp equal world_size",
        ),
        (
            dict(
                tensor_parallel=TensorParallel(
                    sharded=(ShardedModule(path="h.0.fc", style="colwise"),)
                )
            ),
            "its mesh has tp=1",
        ),
        (
            dict(units=(unit("h.0"), unit("h.1", params=("h.0.weight",)))),
            "parameter 'h.0.weight' appears in two units",
        ),
        (
            dict(
                stages=(Stage(index=0, units=("h.0", "h.1")), Stage(index=1, units=())),
                mesh=Mesh(dp_shard=2, pp=2),
                schedule=Schedule(num_micro_batches=2, name="1f1b"),
            ),
            "stage 1 has no units",
        ),
        (dict(stages=(Stage(index=0, units=("h.0", "h.9")),)), "unknown units \\['h.9'\\]"),
        (dict(stages=(Stage(index=0, units=("h.1", "h.0")),)), "in the order of Plan.units"),
        (
            dict(schedule=Schedule(num_micro_batches=2, name="1f1b")),
            "use 'none' without a pipeline",
        ),
        (dict(mesh=Mesh(dp_shard=2, pp=2)), "1 stage\\(s\\) but pp=2"),
    ],
)
def test_invariants_are_checked_on_construction_with_the_fix(change, message):
    with pytest.raises(PlanError, match=message):
        plan(**change)


@pytest.mark.parametrize(
    "micro_batches, message",
    [
        (
            8,
            "schedule has 8 micro-batches but one replica's batch is 4 sample\\(s\\): give at most 4",
        ),
        (2**20, "schedule has 1048576 micro-batches but one replica's batch is 4"),
        (
            3,
            "splits one replica's batch of 4 samples into 3 micro-batches, and a pipeline runs equal ones",
        ),
    ],
)
def test_a_pipeline_of_more_micro_batches_than_samples_or_unequal_ones_is_refused_on_load(
    micro_batches, message
):
    """Such a plan passed explain and diff, and parallelize failed in torch.fx's tracing of the stage."""
    data = json.loads(
        plan(
            world_size=4,
            mesh=Mesh(dp_shard=2, pp=2),
            schedule=Schedule(num_micro_batches=2, name="1f1b"),
            stages=(Stage(index=0, units=("h.0",)), Stage(index=1, units=("h.1",))),
            inputs=(InputSpec(name="ids", shape=(4, 16), dtype="int64"),),
        ).to_json()
    )
    data["schedule"]["num_micro_batches"] = micro_batches
    with pytest.raises(PlanError, match=message):
        Plan.from_json(json.dumps(data))


def test_the_mesh_lays_tp_innermost_and_pipeline_stages_outermost():
    mesh = Mesh(dp_replicate=2, dp_shard=2, tp=2, pp=2)
    assert mesh.size == 16 and mesh.dp == 4
    assert [mesh.coordinates(rank)["tp"] for rank in range(4)] == [
        0,
        1,
        0,
        1,
    ]  # a tp group: consecutive ranks
    assert mesh.coordinates(13) == {"pp": 1, "dp_replicate": 1, "dp_shard": 0, "cp": 0, "tp": 1}
    assert [mesh.stride(dim) for dim in ("pp", "dp_replicate", "dp_shard", "tp")] == [8, 4, 2, 1]
    assert [mesh.stage_of(rank) for rank in (7, 8)] == [0, 1]
    assert [mesh.replica_of(rank) for rank in (0, 1, 2, 7, 8)] == [
        0,
        0,
        1,
        3,
        0,
    ]  # a tp group reads one batch
    flat = Mesh(dp_shard=3, pp=2)  # plan format 1's dp × pp: stage r // dp, replica r % dp
    assert [(flat.stage_of(r), flat.replica_of(r)) for r in range(6)] == [
        (r // 3, r % 3) for r in range(6)
    ]


def test_a_format_1_plan_loads_as_its_dp_ranks_sharding_every_unit():
    data = json.loads(
        plan(
            world_size=4,
            mesh=Mesh(dp_shard=2, pp=2),
            schedule=Schedule(num_micro_batches=2, name="1f1b"),
            stages=(Stage(index=0, units=("h.0",)), Stage(index=1, units=("h.1",))),
        ).to_json()
    )
    del data["tensor_parallel"]
    data.update(schema="shardplan.plan/1", mesh={"dp": 2, "pp": 2})
    loaded = Plan.from_json(json.dumps(data))
    assert loaded.mesh == Mesh(dp_shard=2, pp=2) and loaded.schema == SCHEMA


def test_a_format_6_plans_dynamic_dims_are_dropped_and_this_format_refuses_them():
    """Formats 1 to 6 could name the dims of an input that may vary; nothing read them, every dim may."""
    with_inputs = plan(inputs=(InputSpec(name="0", shape=(4, 32), dtype="int64"),))
    data = json.loads(with_inputs.to_json())
    data["inputs"][0]["dynamic_dims"] = [0, 1]
    with pytest.raises(PlanError, match="dynamic_dims"):
        Plan.from_json(json.dumps(data))
    data.update(schema="shardplan.plan/6")
    assert Plan.from_json(json.dumps(data)) == with_inputs


def test_a_format_2_plan_loads_without_a_signature_and_saves_as_this_format():
    data = json.loads(plan(signature="s1-0123456789abcdef").to_json())
    del data["signature"]
    data.update(schema="shardplan.plan/2")
    loaded = Plan.from_json(json.dumps(data))
    assert (
        loaded == plan()
        and loaded.signature == ""
        and json.loads(loaded.to_json())["schema"] == SCHEMA
    )


def test_unit_and_mesh_invariants():
    with pytest.raises(PlanError, match="offload needs a sharded strategy"):
        unit("h.0", strategy=ShardStrategy.REPLICATE, offload=True)
    with pytest.raises(PlanError, match="at least 1"):
        Mesh(dp_shard=0)
    with pytest.raises(PlanError, match="unknown"):
        Schedule(name="interleaved")
    with pytest.raises(PlanError, match="no modules"):
        Unit(name="h.0", modules=(), params=())


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda d: d["mesh"].update(dp_shard="4"),
            "plan field plan.mesh.dp_shard does not match the plan schema",
        ),
        (lambda d: d["units"][1].update(checkpoint="sometimes"), "plan.units\\[1\\].checkpoint"),
        (lambda d: d.update(extra=1), "Additional properties"),
        (lambda d: d.pop("predicted"), "'predicted' is a required property"),
        (
            lambda d: d["mesh"].update(dp_shard=2),
            "make pp \\* dp_replicate \\* dp_shard \\* cp \\* tp equal world_size",
        ),
    ],
)
def test_a_bad_file_is_refused_naming_the_field(edit, message):
    data = json.loads(plan().to_json())
    edit(data)
    with pytest.raises(PlanError, match=message):
        Plan.from_json(json.dumps(data))


def test_corrupt_and_foreign_files_are_refused(tmp_path):
    text = plan().to_json()
    with pytest.raises(PlanError, match="truncated"):
        Plan.from_json(text[: len(text) // 2])
    with pytest.raises(PlanError, match="not supported"):
        Plan.from_json(text.replace(SCHEMA, "shardplan.plan/9"))
    with pytest.raises(PlanError, match="cannot read"):
        load_plan(tmp_path / "missing.json")
    future = tmp_path / "future.json"
    future.write_text(text.replace(SCHEMA, "shardplan.plan/99"))
    with pytest.raises(
        PlanError, match=r"^plan file '.*future\.json': plan schema .* not supported"
    ):
        load_plan(future)


def test_the_shipped_schema_names_every_field_of_the_dataclasses():
    with open(SCHEMA_PATH) as handle:
        schema = json.load(handle)

    def check(kind, node):
        fields = {f.name for f in dataclasses.fields(kind)}
        assert set(node["properties"]) == fields, kind.__name__
        hints = typing.get_type_hints(kind)
        for name in fields:
            inner = hints[name]
            while typing.get_origin(inner) in (tuple, dict):
                inner = typing.get_args(inner)[-1 if typing.get_origin(inner) is dict else 0]
            if dataclasses.is_dataclass(inner):
                check(inner, schema["$defs"][inner.__name__])

    check(Plan, schema)


def test_diff_names_what_changed():
    before = plan()
    after = plan(
        units=(
            unit("h.0", checkpoint=Checkpoint.SELECTIVE),
            unit("h.1..h.2", params=("h.1.weight",)),
        ),
        predicted=Predicted(peak_bytes=2**20, step_time_s=0.5),
    )
    lines = before.diff(after)
    assert 'units[\'h.0\'].checkpoint: "none" -> "selective"' in lines
    assert "units: added 'h.1..h.2'" in lines and "units: removed 'h.1'" in lines
    assert "predicted.peak_bytes: 3145728 -> 1048576" in lines
    assert before.diff(plan()) == []


def test_summary_is_a_readable_table():
    text = plan().summary()
    assert "pp=1 dp_shard=4" in text
    assert "h.1" in text and "shard_grad_op" in text and "full" in text
    assert "peak memory per rank 3.00 MiB" in text and "activations" in text
    assert "step time 0.5 s" in text and "exposed_comm" in text
    assert "binding constraint: none" in text


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda d: d["mixed_precision"].update(param_dtype="nn"),
            "plan.mixed_precision.param_dtype",
        ),
        (
            lambda d: d["mixed_precision"].update(reduce_dtype="int64"),
            "plan.mixed_precision.reduce_dtype",
        ),
        (
            lambda d: d["inputs"].append(dict(name="0", shape=[4, 32], dtype="junk")),
            "plan.inputs\\[0\\].dtype",
        ),
        (
            lambda d: d["inputs"].append(dict(name="0", shape=[-4, 32], dtype="int64")),
            "plan.inputs\\[0\\].shape\\[0\\]",
        ),
        (
            lambda d: d["inputs"].append(dict(name="0", shape=[2**62], dtype="int64")),
            "plan.inputs\\[0\\].shape\\[0\\]",
        ),
        (
            lambda d: d["inputs"].append(dict(name="0", shape=[2**30, 2**30], dtype="int64")),
            "elements in all",
        ),
        (
            lambda d: d["inputs"].append(dict(name="0", shape=[1] * 65, dtype="int64")),
            "plan.inputs\\[0\\].shape",
        ),
        (lambda d: d.update(world_size=2**30) or d["mesh"].update(dp_shard=2**30), "maximum"),
        (lambda d: d["stages"][0].update(index=-1), "plan.stages\\[0\\].index"),
        (lambda d: d["predicted"].update(peak_bytes=10**400), "plan.predicted.peak_bytes"),
        (lambda d: d.update(model="GPT\udc80"), "lone surrogate '\\\\udc80'"),
    ],
)
def test_junk_values_are_refused_naming_the_field(edit, message):
    data = json.loads(plan().to_json())
    edit(data)
    with pytest.raises(PlanError, match=message):
        Plan.from_json(json.dumps(data))


def test_plans_built_in_code_are_held_to_the_same_rules():
    with pytest.raises(PlanError, match="not a floating-point dtype"):
        MixedPrecision(reduce_dtype="int8")
    with pytest.raises(PlanError, match="lone surrogate"):
        plan(model="GPT\udc80")
    with pytest.raises(PlanError, match="input '0' has shape \\[-1\\]"):
        plan(inputs=(InputSpec(name="0", shape=(-1,), dtype="int64"),))
    with pytest.raises(PlanError, match="input name '0' appears in two inputs"):
        plan(inputs=(InputSpec(name="0", shape=(1,), dtype="int64"),) * 2)
    with pytest.raises(PlanError, match=f"more than the {MAX_WORLD_SIZE} ranks"):
        plan(world_size=2**21, mesh=Mesh(dp_shard=2**21))


@pytest.mark.parametrize(
    "text, message",
    [
        (
            "[" * 100_000 + "]" * 100_000,
            "more than 32 levels deep",
        ),  # past Python's recursion limit
        (
            '{"schema": "shardplan.plan/1", "model": ' + "[" * 40 + "]" * 40 + "}",
            "more than 32 levels deep",
        ),
        ('{"schema": "shardplan.plan/1", "world_size": NaN}', "NaN is not a JSON number"),
        (
            '{"schema": "shardplan.plan/1", "schema": "shardplan.plan/1"}',
            "key 'schema' appears twice",
        ),
        ('{"world_size": 1' + "0" * 5000 + "}", "not valid JSON"),
        (" " * (16 * 2**20 + 1), "longer than 16 MiB"),
    ],
)
def test_hostile_json_is_refused_in_one_line(text, message):
    with pytest.raises(PlanError, match=message) as refused:
        Plan.from_json(text)
    assert "\n" not in str(refused.value)


@pytest.mark.timeout(120)  # a guard against reading an endless file to its end
def test_plan_files_are_read_within_bounds(tmp_path):
    with pytest.raises(PlanError, match="larger than 16 MiB"):
        load_plan("/dev/zero")  # endless: read up to the limit and refused
    (tmp_path / "notepad.json").write_bytes(
        b"\xef\xbb\xbf" + plan().to_json().encode()
    )  # a byte order mark
    assert load_plan(tmp_path / "notepad.json") == plan()
    (tmp_path / "latin1.json").write_bytes(b'{"model": "caf\xe9"}')
    with pytest.raises(PlanError, match="not UTF-8 text"):
        load_plan(tmp_path / "latin1.json")
    with pytest.raises(PlanError, match="cannot read plan file"):
        load_plan(tmp_path)


def test_the_schema_allows_the_dtypes_and_world_sizes_the_code_does():
    with open(SCHEMA_PATH) as handle:
        schema = json.load(handle)
    assert schema["$defs"]["MixedPrecision"]["properties"]["param_dtype"]["enum"] == list(
        FLOAT_DTYPES
    )
    assert schema["$defs"]["InputSpec"]["properties"]["dtype"]["enum"] == list(INPUT_DTYPES)
    assert schema["properties"]["world_size"]["maximum"] == MAX_WORLD_SIZE


def test_writing_to_a_folder_is_refused_in_one_line(tmp_path):
    with pytest.raises(ShardplanError, match="it is a folder; give a file path"):
        plan().save(tmp_path)
    with pytest.raises(ShardplanError, match="create the folder or write elsewhere"):
        plan().save(tmp_path / "missing" / "plan.json")
    assert list(tmp_path.iterdir()) == []  # no temporary file left behind


@pytest.mark.parametrize(
    "change, message",
    [
        (
            dict(hardware=7),
            "plan.hardware does not match the plan schema: 7 is not of type 'string'",
        ),
        (
            dict(reasoning=Reasoning(budget_bytes=2**51, binding_constraint="x")),
            "plan.reasoning.budget_bytes does not match the plan schema: 2251799813685248 is greater than the maximum",
        ),
        (
            dict(predicted=Predicted(peak_bytes=2**64, step_time_s=0.5)),
            "plan.predicted.peak_bytes does not match",
        ),
        (dict(predicted=Predicted(peak_bytes=1, step_time_s=float("nan"))), "NaN or infinite"),
    ],
)
def test_a_plan_that_would_not_load_back_is_not_written(change, message, tmp_path):
    """What from_json refuses, to_json refuses too, before any file or checkpoint holds it."""
    path = tmp_path / "plan.json"
    plan().save(path)
    before = path.read_text()
    with pytest.raises(PlanError, match=message) as refused:
        plan(**change).save(path)
    assert "would not load back" in str(refused.value) and "\n" not in str(refused.value)
    assert path.read_text() == before


def test_saving_keeps_the_files_permissions_and_writes_through_a_symbolic_link(tmp_path):
    """A shared plan stays readable by whoever could read it, and a link stays a link."""
    import os
    import stat

    existing = tmp_path / "shared.json"
    existing.write_text("{}")
    existing.chmod(0o644)
    plan().save(existing)
    assert stat.S_IMODE(existing.stat().st_mode) == 0o644 and load_plan(existing) == plan()
    umask = os.umask(0o027)
    try:
        plan().save(tmp_path / "new.json")
    finally:
        os.umask(umask)
    assert (
        stat.S_IMODE((tmp_path / "new.json").stat().st_mode) == 0o640
    )  # 0o666 less the umask, as open() gives
    link = tmp_path / "plan.json"
    link.symlink_to(existing)
    plan(model="other").save(link)
    assert link.is_symlink() and load_plan(existing).model == "other"
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "new.json",
        "plan.json",
        "shared.json",
    ]
