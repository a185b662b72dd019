"""The reasoning a plan carries: expert defaults an expert would run, and runner-ups marked as near ties."""

import re

import pytest
import torch

from shardplan.common.dtypes import dtype_name
from shardplan.compile import solve
from shardplan.costmodel.hardware import get_hardware
from shardplan.frontend.passes import analyze
from shardplan.models import zoo
from shardplan.plan import MixedPrecision
from shardplan.solver import explain
from shardplan.solver.explain import NEAR_TIE, expert_defaults
from shardplan.solver.search import Setting

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


@pytest.mark.parametrize("margin", [NEAR_TIE, 0.1])
def test_runner_ups_within_the_models_error_are_called_near_ties_and_no_others(
    gpt_chain, margin, monkeypatch
):
    """At 10% the demo's runner-ups, 7% and 18% slower a sample, split into a tie and the rest."""
    monkeypatch.setattr(explain, "NEAR_TIE", margin)
    hw = get_hardware(HARDWARE)
    plan = solve(gpt_chain, 4, hardware=hw)
    per_sample = plan.predicted.step_time_s / (plan.batch_per_replica * plan.mesh.dp)
    ties = 0
    for alternative in plan.reasoning.runner_ups:
        samples = re.search(r"([\d.]+) samples a step", alternative.description)
        if samples is None:  # an expert default: the replica batch on every rank
            continue
        slower = alternative.step_time_s / float(samples.group(1)) / per_sample - 1
        tied = "near tie" in alternative.description
        assert tied == (slower <= margin), (alternative.description, slower)
        ties += tied
    assert ties or margin < 0.07
