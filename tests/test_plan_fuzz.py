"""Fuzzing the plan loader: mutated plan files load or raise a shardplan error, on one line.

Mutations follow the plan's structure (drop, repeat or add keys; values of the wrong type, huge,
negative, unknown enum strings, lone surrogates; deep nesting) and its bytes (truncated, flipped,
not UTF-8). Whatever loads must round-trip and summarize: a loaded plan is a usable plan.
"""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardplan.errors import ShardplanError
from shardplan.frontend.chain import InputSpec
from shardplan.plan import (
    Alternative,
    Checkpoint,
    Mesh,
    MixedPrecision,
    Plan,
    Predicted,
    Reasoning,
    Schedule,
    ShardStrategy,
    Stage,
    Unit,
    load_plan,
)

_DELETE, _REPEAT = object(), object()


def _valid_plan() -> Plan:
    """A pipelined plan using every field, so every field is mutated."""
    units = tuple(
        Unit(
            name=f"h.{i}",
            modules=(f"h.{i}",),
            params=(f"h.{i}.weight", f"h.{i}.bias"),
            strategy=tuple(ShardStrategy)[i],
            checkpoint=tuple(Checkpoint)[i % 3],
            offload=i == 0,
        )
        for i in range(4)
    )
    return Plan(
        fingerprint="0123abcd",
        model="GPT",
        world_size=4,
        hardware="h100-80g",
        inputs=(
            InputSpec(name="0", shape=(4, 32), dtype="int64"),
            InputSpec(name="labels", shape=(4, 32), dtype="int64"),
        ),
        mesh=Mesh(dp_shard=2, pp=2),
        schedule=Schedule(num_micro_batches=4, name="1f1b"),
        mixed_precision=MixedPrecision(param_dtype="bfloat16", reduce_dtype="float32"),
        units=units,
        stages=(Stage(index=0, units=("h.0", "h.1")), Stage(index=1, units=("h.2", "h.3"))),
        predicted=Predicted(
            peak_bytes=3 * 2**30,
            step_time_s=0.25,
            memory_bytes={"activations": 2**30},
            time_s={"compute": 0.2, "bubble": 0.05},
            samples_per_s=16.0,
            mfu=0.4,
        ),
        reasoning=Reasoning(
            budget_bytes=40 * 2**30,
            binding_constraint="none: the fastest plan fits",
            runner_ups=(Alternative(description="dp=4 pp=1", peak_bytes=2**35, step_time_s=0.3),),
        ),
    )


VALID = json.loads(_valid_plan().to_json())


def _paths(value, path=()):
    yield path
    children = (
        value.items()
        if isinstance(value, dict)
        else enumerate(value)
        if isinstance(value, list)
        else ()
    )
    for key, child in children:
        yield from _paths(child, path + (key,))


PATHS = list(_paths(VALID))
DEPTHS = (31, 33, 2_000, 100_000)


def _nested(depth: int) -> str:
    """A stand-in for lists nested `depth` deep: json.dumps itself cannot write 100 000 levels."""
    return f"\x00nested {depth}\x00"


def _text(data) -> str:
    text = json.dumps(data)
    for depth in DEPTHS:
        text = text.replace(json.dumps(_nested(depth)), "[" * depth + "]" * depth)
    return text


JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from(
        [
            0,
            -1,
            1,
            2**31,
            2**63,
            -(2**63) - 1,
            10**30,
            10**400,
            1.5,
            -0.0,
            1e308,
            float("nan"),
            float("inf"),
        ]
    ),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(
        [
            "",
            "fully_shard",
            "FULL_SHARD",
            "bf16",
            "int8",
            "torch.float32",
            "Tensor",
            "nn",
            "none ",
            "interleaved",
            "\udc80",
            "h.0\ud800",
            "shardplan.plan/2",
            "\x00",
        ]
    ),
    st.text(max_size=8),
    st.lists(st.integers(-3, 3), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.sampled_from(DEPTHS).map(_nested),
)


def _edited(path: tuple, new) -> str:
    """VALID with the node at `path` replaced (or deleted, or its key written twice), as JSON text."""
    if not path:
        return _text(None if new is _DELETE else new)
    copy = json.loads(json.dumps(VALID))
    parent = copy
    for key in path[:-1]:
        parent = parent[key]
    if new is _DELETE:
        del parent[path[-1]]
    elif new is _REPEAT and isinstance(parent, dict):
        marker = "\x00repeat\x00"
        parent[marker] = parent[path[-1]]
        return _text(copy).replace(json.dumps(marker), json.dumps(path[-1]), 1)
    elif new is not _REPEAT:
        parent[path[-1]] = new
    return _text(copy)


def _added(path: tuple, key: str, value) -> str:
    copy = json.loads(json.dumps(VALID))
    node = copy
    for step in path:
        node = node[step]
    if isinstance(node, dict):
        node[key] = value
    elif isinstance(node, list):
        node.append(value)
    return _text(copy)


TEXTS = st.one_of(
    st.tuples(st.sampled_from(PATHS), JUNK).map(lambda change: _edited(*change)),
    st.sampled_from(PATHS).map(lambda path: _edited(path, _DELETE)),
    st.sampled_from(PATHS[1:]).map(lambda path: _edited(path, _REPEAT)),
    st.tuples(
        st.sampled_from(PATHS), st.sampled_from(["extra", "units", "name", "\udc80"]), JUNK
    ).map(lambda change: _added(*change)),
)
VALID_BYTES = json.dumps(VALID).encode()
BYTES = st.one_of(
    TEXTS.map(
        lambda text: text.encode("utf-8", "surrogatepass")
    ),  # lone surrogates as raw (invalid) UTF-8
    st.integers(0, len(VALID_BYTES) - 1).map(lambda cut: VALID_BYTES[:cut]),
    st.tuples(
        st.integers(0, len(VALID_BYTES) - 1),
        st.sampled_from(
            [b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x00", b"{", b"]", b'"', b"\\", b"9" * 5000]
        ),
    ).map(lambda change: VALID_BYTES[: change[0]] + change[1] + VALID_BYTES[change[0] + 1 :]),
)


def _loads_or_refuses(load) -> None:
    try:
        plan = load()
    except ShardplanError as error:
        assert "\n" not in str(error) and len(str(error)) < 2_000, str(error)[:3_000]
        return
    assert Plan.from_json(plan.to_json()) == plan
    assert plan.summary() and plan.diff(plan) == []


def test_the_unmutated_plan_loads():
    assert Plan.from_json(json.dumps(VALID)) == _valid_plan()


@settings(max_examples=1_000, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(TEXTS)
def test_mutated_plan_text_loads_or_raises_a_shardplan_error(text):
    _loads_or_refuses(lambda: Plan.from_json(text))


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz") / "plan.json"


@settings(max_examples=500, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(data=BYTES)
def test_mutated_plan_files_load_or_raise_a_shardplan_error(plan_file, data):
    plan_file.write_bytes(data)
    _loads_or_refuses(lambda: load_plan(plan_file))


NAMES = st.text(st.characters(blacklist_categories=("Cs",)), max_size=30)
SIZES = st.integers(min_value=-(2**70), max_value=2**70)
TIMES = st.floats(min_value=0) | st.just(float("nan"))


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(model=NAMES, hardware=NAMES, unit=NAMES, peak=SIZES, budget=SIZES, memory=SIZES, step=TIMES)
def test_a_plan_built_in_code_is_refused_when_written_or_loads_back_equal(
    model, hardware, unit, peak, budget, memory, step
):
    """What to_json writes, from_json reads: a plan file or a checkpoint never holds one that would not load."""
    import dataclasses

    base = _valid_plan()
    try:
        plan = dataclasses.replace(
            base,
            model=model,
            hardware=hardware,
            units=(dataclasses.replace(base.units[0], name=unit), *base.units[1:]),
            stages=(dataclasses.replace(base.stages[0], units=(unit, "h.1")), base.stages[1]),
            predicted=dataclasses.replace(
                base.predicted,
                peak_bytes=peak,
                step_time_s=step,
                memory_bytes={"activations": memory},
            ),
            reasoning=dataclasses.replace(
                base.reasoning,
                budget_bytes=budget,
                runner_ups=(Alternative(description=model, peak_bytes=peak, step_time_s=step),),
            ),
        )
        text = plan.to_json()
    except ShardplanError as error:
        assert "\n" not in str(error)
        return
    assert Plan.from_json(text) == plan
