"""A plan priced at any batch and sequence length from one analysis at three lengths."""

import dataclasses

import pytest
import torch

from shardplan import compile, get_hardware, parallelize
from shardplan.calibration.accuracy import HF_WORKLOADS, measure_shape_accuracy
from shardplan.compile import evaluate, sequence_fit
from shardplan.errors import RuntimeMismatchError, ShardplanError
from shardplan.frontend.chain import InputSpec
from shardplan.frontend.passes import analyze, example_tensors
from shardplan.frontend.shapes import SequenceFit, inputs_at, sequence_length
from shardplan.models import zoo
from shardplan.plan import BF16_MIXED, Checkpoint, MixedPrecision
from shardplan.runtime.manual import manual_plan
from shardplan.solver.shapes import evaluate_at, longest_sequence, sequence_limits

HARDWARE = get_hardware("h100-80g")


def _gpt_plan(precision: MixedPrecision):
    """The zoo GPT planned at 2 x 128 tokens per replica; its position table holds 1024."""
    entry = zoo.gpt(zoo.GPTConfig(seq_len=1024), batch=2)
    args, kwargs = example_tensors(
        (
            InputSpec(name="0", shape=(2, 128), dtype="int64"),
            InputSpec(name="labels", shape=(2, 128), dtype="int64"),
        )
    )
    plan = manual_plan(
        entry.model,
        zoo.gpt_units(4),
        dp=2,
        checkpoints=(Checkpoint.NONE, Checkpoint.FULL),
        precision=precision,
        example_inputs=args,
        example_kwargs=kwargs,
    )
    return entry.model, plan


@pytest.fixture(scope="module")
def planned():
    model, plan = _gpt_plan(BF16_MIXED)
    return model, plan, sequence_fit(model, plan)


@pytest.mark.parametrize("batch, length", [(1, 96), (4, 1024)])
def test_a_shape_priced_from_the_fit_is_the_shape_analyzed(planned, batch, length):
    """Within the fitted lengths and far beyond them (8x), the fit's chain prices the plan as an
    analysis at that shape does: its quantities are polynomials of degree 2 in the length."""
    model, plan, fit = planned
    at = dataclasses.replace(plan, inputs=inputs_at(plan.inputs, batch, length))
    direct = analyze(
        model,
        *example_tensors(at.inputs),
        compute_dtype=plan.mixed_precision.param_dtype,
    )
    fitted = evaluate_at(fit, plan, micro_batch=batch, length=length, hardware=HARDWARE)
    analyzed = evaluate(direct, at, HARDWARE)
    assert fitted.peak_bytes == pytest.approx(analyzed.peak_bytes, rel=2e-3)
    assert fitted.step_time_s == pytest.approx(analyzed.step_time_s, rel=2e-3)
    # the fit keeps the analysed batch (the cost model scales it); the sequence dims are the length's
    assert [i.shape[1:] for i in fit.chain_at(length).inputs] == [
        i.shape[1:] for i in direct.inputs
    ]


def test_the_longest_sequence_is_the_last_that_fits(planned):
    model, plan, fit = planned

    def peak(length: int) -> int:
        return evaluate_at(fit, plan, micro_batch=2, length=length, hardware=HARDWARE).peak_bytes

    budget = peak(700)
    found = longest_sequence(fit, plan, micro_batch=2, memory_budget=budget, hardware=HARDWARE)
    assert found == 700 or (peak(found) <= budget < peak(found + 1))
    assert longest_sequence(fit, plan, micro_batch=2, memory_budget=1, hardware=HARDWARE) == 0
    roomy = longest_sequence(fit, plan, micro_batch=2, memory_budget="80GiB", hardware=HARDWARE)
    assert roomy == 16 * sequence_length(plan.inputs)  # every length searched fits


def test_sequence_limits_shrink_as_the_micro_batch_grows(planned):
    _, plan, fit = planned
    budget = evaluate_at(fit, plan, micro_batch=2, length=700, hardware=HARDWARE).peak_bytes
    limits = sequence_limits(fit, plan, memory_budget=budget, hardware=HARDWARE)
    assert [size for size, _ in limits] == [1, 2, 4, 8]  # up to 4x the plan's micro-batch of 2
    longest = dict(limits)
    assert longest[2] >= 700 and longest[1] > longest[2] > longest[4] > longest[8] > 0


def test_chains_of_another_structure_are_refused_and_so_are_unfit_shapes(planned):
    _, plan, fit = planned
    other = analyze(*_mlp())
    with pytest.raises(ShardplanError, match="changes structure with the sequence length"):
        SequenceFit.of((32, 64, 128), (fit.chains[0], fit.chains[1], other))
    with pytest.raises(ShardplanError, match="three chains at three distinct lengths"):
        SequenceFit.of((32, 32, 128), fit.chains)
    with pytest.raises(ShardplanError, match="micro-batch 0 trains no sample"):
        evaluate_at(fit, plan, micro_batch=0, length=64)
    with pytest.raises(ShardplanError, match="holds no token"):
        fit.chain_at(0)


def _mlp():
    entry = zoo.residual_mlp()
    return entry.model, entry.args, entry.kwargs


def test_inputs_at_changes_the_batch_and_every_sequence_dim():
    inputs = (
        InputSpec(name="input_ids", shape=(4, 128), dtype="int64"),
        InputSpec(name="attention_mask", shape=(4, 1, 128, 128), dtype="bool"),
        InputSpec(name="pixel", shape=(4, 3), dtype="float32"),
    )
    assert [s.shape for s in inputs_at(inputs, 2, 64)] == [(2, 64), (2, 1, 64, 64), (2, 3)]
    assert sequence_length(inputs) == 128
    features = InputSpec(name="0", shape=(16, 64), dtype="float32")  # an MLP's: no sequence
    assert sequence_length((features,)) == 0


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_memory_at_three_other_shapes_is_predicted_within_3_percent(capsys):
    """A Hugging Face Llama planned at 4 x 128 per replica, trained at 2 x 64, 4 x 256 and 8 x 96 on 2
    gloo ranks in fp32 (benchmarks/bench_shapes.py shows bf16 too, where the smallest shape reads 0.95:
    docs/limits.md)."""
    rows = measure_shape_accuracy(
        HF_WORKLOADS["hf-llama"], MixedPrecision(), kinds=("full_shard/none",), progress=False
    )
    ratios = {row.kind: round(row.memory_ratio, 3) for row in rows}
    with capsys.disabled():
        print(ratios)
    assert len(ratios) == 3 and all(abs(r - 1) <= 0.03 for r in ratios.values()), ratios


def test_the_runtime_refuses_a_shape_predicted_over_the_budget_and_warns_if_asked(world_of_one):
    """Planned at 2 x 64 tokens with room for a little more: the plan records the longest sequence of
    each micro-batch size, and a step past it is refused in one line naming it."""
    entry = zoo.gpt(zoo.GPTConfig(seq_len=1024), batch=2)
    ids = entry.args[0][:, :64]
    roomy = compile(entry.model, 1, (ids,), {"labels": ids}, hardware="cpu-gloo", explain=False)
    budget = int(roomy.predicted.peak_bytes * 1.5)
    plan = compile(
        entry.model, 1, (ids,), {"labels": ids}, hardware="cpu-gloo", memory_budget=budget
    )
    longest = dict((r.micro_batch, r.longest) for r in plan.sequence_limits)
    assert 64 <= longest[2] < 1024 and longest[1] > longest[2] > longest[4]
    program = parallelize(entry.model, plan)
    fits, over = entry.args[0][:, : longest[2]], entry.args[0][:, : longest[2] + 1]
    assert torch.isfinite(program.step(fits, labels=fits))
    with pytest.raises(
        RuntimeMismatchError,
        match=f"the longest sequence that fits a micro-batch of 2 is {longest[2]}",
    ):
        program.step(over, labels=over)
    program.over_budget = "warn"
    with pytest.warns(UserWarning, match="predicted over the plan's memory budget"):
        assert torch.isfinite(program.step(over, labels=over))
