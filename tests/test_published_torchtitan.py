"""torchtitan's published FSDP2 rows as plans (benchmarks/bench_published_torchtitan.py), on a Llama small
enough to analyze here: each row's units, checkpointing and precision must be the ones it ran, and its
checkpointing must trade time for memory as the rows published it did."""

import dataclasses

import pytest

from shardplan.plan import BF16_MIXED, Checkpoint, ShardStrategy

TINY = "tiny-llama"


@pytest.fixture(scope="module")
def outcomes(published_torchtitan_bench):
    bench = published_torchtitan_bench
    shape = bench.LlamaShape(layers=4, hidden=64, ffn=160, heads=4, kv_heads=2, vocab=256)
    rows = {
        mode: dataclasses.replace(
            bench.ROWS[0], model=TINY, seq=64, local_batch=2, gpus=8, checkpointing=mode
        )
        for mode in bench.CHECKPOINTING
    }
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(bench.LLAMAS, TINY, shape)
        return {mode: bench.predict_row(row) for mode, row in rows.items()}


def test_a_row_is_the_plan_it_ran(outcomes):
    plan = outcomes["selective layer"].plan
    assert plan.mesh.dp_shard == 8
    assert plan.mixed_precision == BF16_MIXED
    assert plan.optimizer == "adamw"
    assert [unit.modules for unit in plan.units] == [
        ("model.embed_tokens", "model.rotary_emb"),
        *((f"model.layers.{block}",) for block in range(4)),
        ("model.norm",),
        ("lm_head",),
    ]
    assert {unit.strategy for unit in plan.units} == {ShardStrategy.FULL_SHARD}
    # torchtitan's selective_ac_option "2" wraps every second block, counting from 1
    assert [unit.checkpoint for unit in plan.units] == [Checkpoint.NONE] * 2 + [
        Checkpoint.FULL,
        Checkpoint.NONE,
        Checkpoint.FULL,
    ] + [Checkpoint.NONE] * 2
    checkpoints = [unit.checkpoint for unit in outcomes["selective op"].plan.units]
    assert (
        checkpoints
        == [Checkpoint.NONE] + [Checkpoint.SELECTIVE_ALTERNATE] * 4 + [Checkpoint.NONE] * 2
    )


def test_checkpointing_trades_time_for_memory(outcomes):
    by = {mode: outcome.predicted for mode, outcome in outcomes.items()}
    peaks = [by[mode].peak_bytes for mode in ("none", "selective layer", "full")]
    recomputes = [by[mode].time_s["recompute"] for mode in ("none", "selective layer", "full")]
    assert peaks[0] > peaks[1] > peaks[2]
    assert recomputes[0] == 0 < recomputes[1] < recomputes[2]
