"""The reasoning a plan carries: expert defaults an expert would run, and runner-ups marked as near ties."""

import re

import pytest
import torch

from shardplan.common.dtypes import dtype_name
from shardplan.compile import solve
from shardplan.costmodel.hardware import get_hardware
from shardplan.errors import ShardplanError
from shardplan.frontend.passes import analyze
from shardplan.models import zoo
from shardplan.plan import Checkpoint, Decision, Mesh, MixedPrecision, Schedule
from shardplan.solver.chain_dp import ChainSolution
from shardplan.solver.explain import expert_defaults
from shardplan.solver.search import Candidate, Configuration, Setting, simplest_near_the_fastest
from shardplan.solver.stages import StageCut

HARDWARE = "cpu-gloo"


@pytest.fixture(scope="module")
def gpt_chain():
    torch.set_num_threads(1)
    entry = zoo.gpt(batch=8)
    return analyze(entry.model, entry.args, entry.kwargs)


def _setting(chain, world: int) -> Setting:
    dtype = dtype_name(chain.param_dtype)
    return Setting(
        world_size=world,
        batch_size=chain.inputs[0].shape[0],
        mixed_precision=MixedPrecision(param_dtype=dtype, reduce_dtype=dtype),
    )


def test_expert_defaults_accumulate_over_the_fewest_micro_batches_that_fit(gpt_chain):
    hw, setting = get_hardware(HARDWARE), _setting(gpt_chain, 1)
    (_, whole), _ = expert_defaults(gpt_chain, setting, hw)
    budget = whole.peak_bytes - 1  # one micro-batch of 8 no longer fits
    (label, accumulated), _ = expert_defaults(gpt_chain, setting, hw, budget)
    assert accumulated.peak_bytes <= budget < whole.peak_bytes
    assert int(re.search(r"(\d+) micro-batch", label).group(1)) in (2, 4, 8)
    (label, _), _ = expert_defaults(gpt_chain, setting, hw, whole.peak_bytes)
    assert label.endswith(", 1 micro-batch(es)")


def _candidate(pp: int, settings: int, step_time_s: float) -> Candidate:
    decisions = tuple(Decision(checkpoint=mode) for mode in list(Checkpoint)[:settings])
    solution = ChainSolution(
        bounds=tuple(range(settings)), decisions=decisions, time_s=step_time_s, peak_bytes=1
    )
    return Candidate(
        configuration=Configuration(
            mesh=Mesh(dp_shard=8 // pp, pp=pp),
            schedule=Schedule(num_micro_batches=4, name="1f1b" if pp > 1 else "none"),
        ),
        stages=(StageCut(start=0, end=settings, solution=solution, time_s=step_time_s),),
        step_time_s=step_time_s,
        peak_bytes=1,
    )


@pytest.mark.parametrize(
    "near_tie, chosen",
    [(0.0, "pipeline"), (0.01, "mixed units"), (0.02, "plain"), (0.5, "plain")],
)
def test_within_the_near_tie_the_plan_without_a_pipeline_then_fewest_settings_wins(
    near_tie, chosen
):
    candidates = {
        "pipeline": _candidate(pp=2, settings=2, step_time_s=1.0),
        "mixed units": _candidate(pp=1, settings=3, step_time_s=1.005),
        "plain": _candidate(pp=1, settings=1, step_time_s=1.015),
        "slow": _candidate(pp=1, settings=1, step_time_s=1.5),
    }
    setting = Setting(
        world_size=8, batch_size=4, global_batch_size=32
    )  # 32 samples a step, any mesh
    ranked = simplest_near_the_fastest(list(candidates.values()), setting, near_tie)
    assert ranked[0] is candidates[chosen]
    assert sorted(map(id, ranked)) == sorted(map(id, candidates.values()))


@pytest.mark.parametrize("near_tie", [0.02, 0.1])
def test_the_reasoning_marks_near_ties_and_the_faster_plan_passed_over(gpt_chain, near_tie):
    """At 10% the demo's runner-up 7% slower a sample ties with the fastest plan."""
    plan = solve(gpt_chain, 4, hardware=get_hardware(HARDWARE), near_tie=near_tie)
    per_sample = plan.predicted.step_time_s / (plan.batch_per_replica * plan.mesh.dp)
    for alternative in plan.reasoning.runner_ups:
        samples = re.search(r"([\d.]+) samples a step", alternative.description)
        if samples is None:  # an expert default
            continue
        slower = alternative.step_time_s / float(samples.group(1)) / per_sample - 1
        if slower < 0:
            assert -slower <= near_tie and "the simpler plan was chosen" in alternative.description
        else:
            tied = "near tie" in alternative.description
            assert tied == (slower <= near_tie), (alternative.description, slower)


def test_a_near_tie_that_is_no_share_is_refused(gpt_chain):
    with pytest.raises(ShardplanError, match="near_tie=1.5 is no share"):
        solve(gpt_chain, 4, hardware=HARDWARE, near_tie=1.5)
