"""The cost model against the runtime on this machine: every plan kind's and every mesh kind's predicted
peak memory beside what training with it measures (shardplan.calibration.accuracy), on the built-in
cpu-gloo profile.

Memory alone is measured and held here: CPU memory is deterministic. Step time is not: other work on the
cores lengthens every measured step, so a test of it fails on a busy machine whatever the model predicts.
`shardplan check --measure cpu-gloo` holds it, on a machine kept quiet for it."""

import pytest

from shardplan import get_hardware
from shardplan.calibration.accuracy import (
    KIND_NAMES,
    MEMORY_TOLERANCE,
    MESH_KINDS,
    accuracy_table,
    compare,
    demo_mesh_plans,
    measure_by_world,
    measure_memory_accuracy,
)
from shardplan.plan import BF16_MIXED, MixedPrecision

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _assert_within_tolerance(rows, title: str, capsys) -> None:
    with capsys.disabled():  # the table either way: a pass shows the margins, a failure the culprit
        from rich.console import Console

        Console(width=120).print(accuracy_table(rows, title))
    misses = [miss for row in rows for miss in row.memory_misses()]
    assert not misses, misses


@pytest.mark.parametrize(
    "precision, tolerance",
    [(MixedPrecision(), MEMORY_TOLERANCE), (BF16_MIXED, 0.03)],
    ids=["fp32", "bf16"],
)
def test_every_plan_kind_and_two_rank_mesh_kind_is_predicted_within_tolerance(
    precision, tolerance, capsys
):
    """Every strategy x checkpointing and tp 2 (vocabulary and sequence parallel or not) on 2 gloo ranks, in
    fp32 and as GPUs train: fp32 master weights, bf16 compute, gradients reduced in fp32. In bf16 the
    activations are priced in bf16 (the chain analysed computing in it) and a whole unit's bf16 copy is held
    from its forward to its backward; what stays fp32 (master weights, their gradients, the optimizer
    state) stays fp32. bf16 is held within 3%."""
    rows = measure_memory_accuracy(get_hardware("cpu-gloo"), precision, progress=False)
    assert [row.kind for row in rows][: len(KIND_NAMES)] == list(KIND_NAMES) and len(rows) > len(
        KIND_NAMES
    )
    with capsys.disabled():
        from rich.console import Console

        Console(width=120).print(
            accuracy_table(
                rows,
                f"predicted vs measured peak memory, demo GPT, {precision.param_dtype} "
                "compute, 2 gloo ranks (cpu-gloo)",
            )
        )
    ratios = {row.kind: round(row.memory_ratio, 3) for row in rows}
    assert all(abs(ratio - 1) <= tolerance for ratio in ratios.values()), ratios
    # selective_alternate's kept and dropped outputs, counted as torch's selective checkpointing keeps them
    alternate = {kind: ratio for kind, ratio in ratios.items() if "selective_alternate" in kind}
    assert len(alternate) == 4 and all(abs(r - 1) <= 0.03 for r in alternate.values()), alternate


def test_every_four_rank_mesh_kind_is_predicted_within_tolerance(capsys):
    """dp 2 x tp 2 and HSDP 2 x 2 on 4 gloo ranks: memory does not depend on how many cores they share."""
    four = [
        name
        for name, mesh in MESH_KINDS.items()
        if mesh.get("dp", 1) * mesh.get("dp_replicate", 1) * mesh.get("tp", 1) == 4
    ]
    chain, named = demo_mesh_plans(kinds=four)
    _, measured = measure_by_world(list(named.values()), 0, progress=False)  # memory alone
    rows = compare(chain, list(named.values()), measured, get_hardware("cpu-gloo"), four)
    assert [row.kind for row in rows] == four and four
    _assert_within_tolerance(
        rows, "predicted vs measured peak memory, demo GPT, 4-rank mesh kinds (cpu-gloo)", capsys
    )


def test_ranks_sharing_cores_take_ranks_over_cores_times_as_long():
    from shardplan.calibration.accuracy import shared_cores

    cpu = get_hardware("cpu-gloo")
    assert shared_cores(cpu, 2, 2) is cpu
    shared = shared_cores(cpu, 4, 2)
    # a matmul, a copy, a call of its fixed cost, and ops whose measured factor depends on a call's size
    for flops, nbytes, op in (
        (1e8, 1e6, ""),
        (0, 4e6, ""),
        (1e3, 8, ""),
        (0, 4e6, "gelu"),
        (0, 4e4, "gelu"),
    ):
        assert shared.compute_time_s(flops, nbytes, calls=3, op=op) == pytest.approx(
            2 * cpu.compute_time_s(flops, nbytes, calls=3, op=op)
        )
    for nbytes in (4e3, 4e6, 4e8):  # across the correction curve: it is read at the same bus bytes
        assert shared.collective_time_s("all_reduce", nbytes, 2) == pytest.approx(
            2 * cpu.collective_time_s("all_reduce", nbytes, 2)
        )


def test_every_pipelined_kind_is_predicted_within_tolerance_on_each_stage(capsys):
    """pp 2 under GPipe and 1F1B, 2 to 8 micro-batches, with and without checkpointing: each stage's
    peak memory against its rank's. A step's gradients once went to fresh tensors beside the zeroed
    `.grad` (0.77-0.82 of the measured here: the first backward comes early in a pipelined step)."""
    from shardplan.calibration.accuracy import PIPELINE_KINDS, measure_pipeline_accuracy

    rows = measure_pipeline_accuracy(get_hardware("cpu-gloo"), progress=False)
    assert [row.kind for row in rows] == [
        f"{kind}/stage {stage}" for kind in PIPELINE_KINDS for stage in (0, 1)
    ]
    _assert_within_tolerance(
        rows, "predicted vs measured peak memory per stage, demo GPT, pp 2 (cpu-gloo)", capsys
    )


def test_every_pipelined_kind_in_bf16_mixed_precision_is_predicted_within_tolerance_on_each_stage(
    capsys,
):
    """As in fp32, within MEMORY_TOLERANCE, not 3%: a pipelined stage's peak reads 0.95-1.02 of the measured
    in bf16 (0.93-1.05 in fp32), the same misses of the pipeline's schedule in both."""
    from shardplan.calibration.accuracy import measure_pipeline_accuracy

    rows = measure_pipeline_accuracy(get_hardware("cpu-gloo"), progress=False, precision=BF16_MIXED)
    with capsys.disabled():
        from rich.console import Console

        Console(width=120).print(
            accuracy_table(
                rows,
                "predicted vs measured peak memory per stage, demo GPT, pp 2, "
                "bf16 mixed precision (cpu-gloo)",
            )
        )
    ratios = {row.kind: round(row.memory_ratio, 3) for row in rows}
    assert all(abs(ratio - 1) <= MEMORY_TOLERANCE for ratio in ratios.values()), ratios
