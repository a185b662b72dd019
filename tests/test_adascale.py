"""AdaScale (runtime/adascale.py): its estimators against their definition, its runs against one process.

Pure: the estimates of gradients of known noise average to that noise. One spawned world of 2
ranks: under every unit strategy (and checkpointing), micro-batches, a 1F1B pipeline and tp with
sequence parallelism, the gains, estimates and parameters equal a one-process reference that takes
every sample's gradient (one micro-batch of one replica: see [Note: AdaScale's samples]) by itself;
scale 1 trains exactly as plain SGD; the state goes through a save and load and continues alike, and
loaded on a world of another global batch re-derives its scale; backend fsdp2 is refused.
"""

import copy
import io
import math

import pytest
import torch
from parity import spawn_world

from shardplan.errors import ShardplanError
from shardplan.models import zoo
from shardplan.plan import Checkpoint, ShardStrategy
from shardplan.runtime import parallelize
from shardplan.runtime.adascale import AdaScale, estimate
from shardplan.runtime.manual import manual_plan

STEPS = 3
LR = 0.5
GLOBAL_BATCH = 4
CONFIG = zoo.GPTConfig(n_layer=2, seq_len=16, d_model=32, n_head=4, vocab_size=64)
UNITS = zoo.gpt_units(CONFIG.n_layer)
MIXED = {
    "strategies": (
        ShardStrategy.FULL_SHARD,
        ShardStrategy.SHARD_GRAD_OP,
        ShardStrategy.SHARD_OPTIMIZER,
        ShardStrategy.REPLICATE,
    ),
    "checkpoints": tuple(Checkpoint),
}
"""Every unit a different strategy (reduce-scattered and all-reduced gradients) and checkpointing."""

CASES = {
    "strategies": {"mesh": dict(dp=2), "micro_batches": 1},
    "micro_batches": {"mesh": dict(dp=2), "micro_batches": 2},
    "pipeline_1f1b": {
        "mesh": dict(dp=1, pp=2, schedule="1f1b"),
        "micro_batches": 2,
        "scale": 2.0,
        "one_group": True,
    },  # a stage's units differ from the other's: one group on each
    "tp2_sequence_parallel": {
        "mesh": dict(dp=1, tp=2, sequence_parallel=True, vocab_parallel=True),
        "micro_batches": 2,
        "scale": 3.0,
    },
}
"""Per case: the mesh, micro-batches, AdaScale's scale (default: dp) and parameter groups (default: one a unit)."""


# the estimators on gradients of known noise


def test_estimates_average_to_the_noise_and_gradient_they_measure():
    torch.manual_seed(0)
    mean = torch.tensor([0.6, -0.8, 0.0, 0.0])  # μ² = 1
    sample_variance, samples, scale = 3.0, 4, 8.0  # trace of one sample's covariance
    estimates = []
    for _ in range(4000):
        gradients = (
            mean + torch.randn(samples, 4, dtype=torch.float64) * (sample_variance / 4) ** 0.5
        )
        estimates.append(
            estimate(
                float(gradients.pow(2).sum()), float(gradients.mean(0).pow(2).sum()), samples, scale
            )
        )
    variance, square = (sum(values) / len(values) for values in zip(*estimates))
    # at the base batch (scale / samples of a sample's), σ² = 3 × 8 / 4 = 6; a standard error ~1%
    assert variance == pytest.approx(sample_variance * scale / samples, rel=0.04)
    assert square == pytest.approx(1.0, rel=0.06)


# one process, every sample's gradient taken by itself


class Reference:
    """AdaScale from its definition, on `groups` of a plain model: each step's samples' gradients are taken
    one by one, σ² from their spread about their mean, and SGD steps at lr × gain."""

    def __init__(self, groups: list[list[torch.nn.Parameter]], samples: int, scale: float):
        self.groups, self.samples, self.scale = groups, samples, scale
        self.smoothing = max(1 - samples / 1000, 0.0)
        self.sums = {name: [0.0] * len(groups) for name in ("var", "sqr", "weight")}

    def step(self, model: torch.nn.Module, samples: list[torch.Tensor]) -> dict:
        gradients = []
        for ids in samples:
            model.zero_grad()
            model(ids, labels=ids).backward()
            gradients.append(
                [[parameter.grad.clone() for parameter in group] for group in self.groups]
            )
        found = {"gain": [], "var": [], "sqr": []}
        for index, group in enumerate(self.groups):
            mean = [
                torch.stack([sample[index][at] for sample in gradients]).mean(0)
                for at in range(len(group))
            ]
            spread = sum(
                float((sample[index][at] - mean[at]).pow(2).sum())
                for sample in gradients
                for at in range(len(group))
            ) / (self.samples - 1)
            square_of_mean = sum(float(part.pow(2).sum()) for part in mean)
            variance = max(
                spread * self.scale / self.samples, 1e-6
            )  # one sample's, at the base batch
            square = max(square_of_mean - variance / self.scale, 0.0)
            for name, value in (("var", variance), ("sqr", square), ("weight", 1.0)):
                self.sums[name][index] = (
                    self.smoothing * self.sums[name][index] + (1 - self.smoothing) * value
                )
            variance, square = (
                self.sums[name][index] / self.sums["weight"][index] for name in ("var", "sqr")
            )
            gain = (variance + square) / (variance / self.scale + square)
            with torch.no_grad():
                for parameter, part in zip(group, mean):
                    parameter -= LR * gain * part
            for name, value in (("gain", gain), ("var", variance), ("sqr", square)):
                found[name].append(value)
        return found


def _batches(steps: int = STEPS) -> list[torch.Tensor]:
    return [
        torch.randint(
            0,
            CONFIG.vocab_size,
            (GLOBAL_BATCH, CONFIG.seq_len),
            generator=torch.Generator().manual_seed(step),
        )
        for step in range(steps)
    ]


def _program(model: torch.nn.Module, mesh: dict, micro_batches: int, replica_batch: int):
    ids = torch.zeros(replica_batch, CONFIG.seq_len, dtype=torch.long)
    plan = manual_plan(
        model,
        UNITS,
        **MIXED,
        **mesh,
        micro_batches=micro_batches,
        example_inputs=(ids,),
        example_kwargs={"labels": ids},
    )
    return parallelize(model, plan)


def _mine(program, rank: int, whole: torch.Tensor) -> torch.Tensor:
    return whole.chunk(program.plan.mesh.dp)[program.plan.mesh.replica_of(rank)]


def _measured(adascale: AdaScale) -> dict:
    groups = range(len(adascale.optimizer.param_groups))
    return {
        "gain": [adascale.gain(index) for index in groups],
        "var": adascale.variance,
        "sqr": adascale.square,
    }


def _param_error(program, reference: torch.nn.Module) -> float | None:
    state = program.export_full_state_dict()
    if not state:  # off rank 0
        return None
    return max(
        (state[name] - parameter.detach()).abs().max().item()
        for name, parameter in reference.named_parameters()
    )


def run_case(rank: int, case: dict) -> dict:
    """Train `case` with SGD under AdaScale next to Reference: every step's gains and estimates, both sides."""
    torch.manual_seed(0)
    reference = zoo.GPT(CONFIG)
    dp, count = case["mesh"].get("dp_replicate", 1) * case["mesh"]["dp"], case["micro_batches"]
    program = _program(copy.deepcopy(reference), case["mesh"], count, GLOBAL_BATCH // dp)
    if case.get("one_group"):
        groups, reference_groups = (
            [{"params": program.parameters()}],
            [list(reference.parameters())],
        )
    else:
        named = dict(reference.named_parameters())
        groups = [{"params": [unit.shard]} for unit in program.units]
        reference_groups = [[named[name] for name in unit.params] for unit in program.plan.units]
    adascale = AdaScale(torch.optim.SGD(groups, lr=LR), program, scale=case.get("scale"))
    expected = Reference(reference_groups, dp * count, adascale.scale)
    measured, wanted = [], []
    for whole in _batches():
        mine = _mine(program, rank, whole)
        program.step(mine, labels=mine)
        measured.append(_measured(adascale))
        adascale.step()
        adascale.zero_grad()
        wanted.append(
            expected.step(
                reference, [micro for replica in whole.chunk(dp) for micro in replica.chunk(count)]
            )
        )
    return {
        "measured": measured,
        "expected": wanted,
        "param_error": _param_error(program, reference),
    }


def scale_one_and_round_trip(rank: int) -> dict:
    """On dp 2, four programs on the same batches: AdaScale at scale 1 and plain SGD; AdaScale at the default
    scale, and a program stepped by hand at that AdaScale's learning rates for 2 steps that then loads its
    state (through torch.save) into an AdaScale of its own for the third."""
    torch.manual_seed(0)
    model = zoo.GPT(CONFIG)
    programs = [_program(copy.deepcopy(model), dict(dp=2), 1, GLOBAL_BATCH // 2) for _ in range(4)]
    optimizers = [torch.optim.SGD(program.parameters(), lr=LR) for program in programs]
    at_scale_one, plain, original, resumed = programs
    scale_one = AdaScale(optimizers[0], at_scale_one, scale=1)
    adascale = AdaScale(optimizers[2], original)
    scale_one_gains, compared, resumed_adascale = [], None, None
    for step, whole in enumerate(_batches()):
        if step == 2:
            resumed_adascale = AdaScale(optimizers[3], resumed)
            buffer = io.BytesIO()
            torch.save(adascale.state_dict(), buffer)
            buffer.seek(0)
            resumed_adascale.load_state_dict(torch.load(buffer))
        mine = _mine(plain, rank, whole)
        for program in programs:
            program.step(mine, labels=mine)
        scale_one_gains.append(scale_one.gain())
        if resumed_adascale is None:  # the update AdaScale makes, by hand
            optimizers[3].param_groups[0]["lr"] = LR * adascale.gain()
            optimizers[3].step()
            optimizers[3].param_groups[0]["lr"] = LR
        else:
            compared = (_measured(adascale), _measured(resumed_adascale))
            resumed_adascale.step()
        for stepper in (scale_one, optimizers[1], adascale):
            stepper.step()
        for optimizer in optimizers:
            optimizer.zero_grad()

    def difference(one, other) -> float:
        return max(float((a - b).abs().max()) for a, b in zip(one.parameters(), other.parameters()))

    found = {
        "scale_one_gains": scale_one_gains,
        "scale_one_vs_plain": difference(at_scale_one, plain),
        "compared": compared,
        "resumed_vs_original": difference(resumed, original),
        "states": (adascale.state_dict(), resumed_adascale.state_dict()),
    }
    # an epoch's last batch, smaller than planned: its micro-batches are no samples of the base size
    last = _mine(plain, rank, _batches(1)[0])[:1]
    original.step(last, labels=last)
    found["smaller_batch_kept_averages"] = (
        adascale.state_dict()["averages"] == found["states"][0]["averages"]
    )
    adascale.step()
    optimizers[2].zero_grad()
    # a step that overflowed (a loop would skip it for its loss): its gradients are not finite
    with torch.no_grad():
        original.parameters()[0].fill_(float("inf"))
    full = _mine(plain, rank, _batches(1)[0])
    loss = original.step(full, labels=full)
    found["overflowed_step"] = (
        math.isfinite(float(loss)),
        adascale.state_dict()["averages"] == found["states"][0]["averages"],
        math.isfinite(adascale.gain()),
    )
    return found


def elsewhere(rank: int, state: dict) -> dict:
    """A state saved at global batch 4 loaded on tp 2 (one replica of batch 2); the refusals."""
    found = {}
    model = zoo.GPT(CONFIG)
    program = _program(model, dict(dp=1, tp=2), 1, 2)
    optimizer = torch.optim.SGD(program.parameters(), lr=LR)
    with pytest.raises(ShardplanError) as one_sample:
        AdaScale(optimizer, program, scale=2)
    found["one_sample"] = str(one_sample.value)
    adascale = AdaScale(optimizer, program)
    adascale.load_state_dict(state)
    found["scale"], found["loaded"] = adascale.scale, adascale.state_dict() == state
    found["bad_states"] = {}
    for name, bad in _bad_states(state).items():
        try:
            adascale.load_state_dict(bad)
            found["bad_states"][name] = "loaded"
        except ShardplanError as error:
            found["bad_states"][name] = str(error)
    found["kept_after_bad_states"] = (
        adascale.state_dict() == state and adascale.scale == found["scale"]
    )
    with pytest.raises(ShardplanError) as smaller_base:  # a world that shrank to one sample a step
        adascale.load_state_dict({**state, "base_batch": 1.0})
    found["smaller_base"] = str(smaller_base.value)
    with pytest.raises(ShardplanError) as unmeasured:
        adascale.step()
    found["unmeasured"] = str(unmeasured.value)
    fsdp2 = parallelize(zoo.GPT(CONFIG), manual_plan(zoo.GPT(CONFIG), UNITS, dp=2), backend="fsdp2")
    with pytest.raises(ShardplanError) as refused:
        AdaScale(torch.optim.SGD(fsdp2.parameters(), lr=LR), fsdp2)
    found["fsdp2"] = str(refused.value)
    return found


def _bad_states(state: dict) -> dict[str, dict]:
    """`state` with one number AdaScale never holds, by what is wrong."""

    def with_average(name: str, value) -> dict:
        return {
            **state,
            "averages": {**state["averages"], name: [value] * len(state["averages"][name])},
        }

    return {
        "nan variance": with_average("var", float("nan")),
        "infinite square": with_average("sqr", float("inf")),
        "negative variance": with_average("var", -1.0),
        "weight past 1": with_average("var_weight", 2.0),
        "base batch 0": {**state, "base_batch": 0},
        "negative progress": {**state, "progress": -3.0},
        "text progress": {**state, "progress": "3"},
        "no averages": {"base_batch": 4.0, "progress": 0.0},
    }


def run_world(rank: int, world: int) -> dict:
    results = {
        "cases": {name: run_case(rank, case) for name, case in CASES.items()},
        "scale_one_and_round_trip": scale_one_and_round_trip(rank),
    }
    results["elsewhere"] = elsewhere(rank, results["scale_one_and_round_trip"]["states"][0])
    return results


@pytest.fixture(scope="module")
def results():
    return spawn_world(2, run_world, ())


@pytest.mark.parametrize("name", CASES)
def test_gains_estimates_and_parameters_equal_one_process_taking_each_sample_alone(results, name):
    found = results["cases"][name]
    for step, (measured, expected) in enumerate(zip(found["measured"], found["expected"])):
        for field in ("gain", "var", "sqr"):
            assert measured[field] == pytest.approx(expected[field], rel=1e-5, abs=1e-8), (
                step,
                field,
            )
    assert max(found["measured"][-1]["gain"]) > 1.05  # the noise was measured, not the floor
    assert found["param_error"] <= 1e-5


def test_scale_one_trains_exactly_as_plain_sgd(results):
    found = results["scale_one_and_round_trip"]
    assert found["scale_one_gains"] == [1.0] * STEPS
    assert found["scale_one_vs_plain"] == 0.0


def test_a_saved_state_continues_as_if_never_saved(results):
    found = results["scale_one_and_round_trip"]
    original, resumed = found["compared"]
    assert original == resumed and original["gain"][0] > 1.05
    assert found["resumed_vs_original"] == 0.0
    assert found["states"][0] == found["states"][1]  # the averages, the base batch and progress


def test_a_batch_smaller_than_planned_leaves_the_estimates_alone(results):
    assert results["scale_one_and_round_trip"]["smaller_batch_kept_averages"]


def test_a_step_whose_gradients_overflowed_leaves_the_estimates_alone(results):
    loss_finite, kept_averages, gain_finite = results["scale_one_and_round_trip"]["overflowed_step"]
    assert not loss_finite and kept_averages and gain_finite


def test_a_state_loaded_on_another_global_batch_rederives_its_scale(results):
    found = results["elsewhere"]
    assert (
        found["loaded"] and found["scale"] == 1.0
    )  # base batch 4 / 2 replicas, on one replica of 2


def test_refusals_name_the_fix(results):
    found = results["elsewhere"]
    assert found["one_sample"] == (
        "AdaScale at scale 2.0 estimates the gradient's noise from several gradients a "
        "step, and this plan averages one (dp=1, 1 micro-batch): plan dp > 1 or "
        "micro-batches > 1, or use scale=1"
    )
    assert found["smaller_base"].endswith(
        "plan dp > 1 or micro-batches > 1, or train at the saved base batch of 1 without AdaScale"
    )
    assert found["unmeasured"].startswith("AdaScale.step() found no program.step(...)")
    assert found["fsdp2"].endswith("parallelize with backend='shardplan'")


def test_a_state_holding_numbers_adascale_never_holds_is_refused_and_changes_nothing(results):
    """NaN averages would make every parameter NaN at the next step, a base batch of 0 divide by zero."""
    found = results["elsewhere"]
    refusals = found["bad_states"]
    assert all(refusal.startswith("the AdaScale state ") for refusal in refusals.values()), refusals
    assert (
        "has var [nan]" in refusals["nan variance"]
        and "has base_batch 0" in refusals["base batch 0"]
    )
    assert found["kept_after_bad_states"]


# the convergence benchmark's task (benchmarks/bench_adascale.py), briefly


def test_where_the_gradient_is_mostly_noise_the_gain_nears_the_scale_and_trains_further():
    """40 steps at 4 times the base batch on the benchmark's Markov chain, whose gradients at the base batch
    are mostly noise: the gain measured is near the scale, as the closed form says of noise alone, and the
    held-out loss ends well below plain SGD's at the same learning rate (AdaScale's steps are gain times
    longer)."""
    from benchmarks import bench_adascale as bench

    successors = bench.markov_chain(0)
    held_out = bench.sequences(
        successors, bench.EVAL_SEQUENCES, torch.Generator().manual_seed(1000)
    )
    task = bench.Task(successors, held_out, target=0.0, max_steps=40, eval_every=40, momentum=0.9)
    batch = bench.SCALE * 2
    adascale, plain = bench.train(
        task,
        [
            bench.Run("AdaScale", batch, 0.02, adascale=True, micro_batches=2),
            bench.Run("SGD", batch, 0.02),
        ],
    )
    assert 3.0 < adascale.gain <= bench.SCALE
    assert adascale.loss < plain.loss - 0.3, (adascale.loss, plain.loss)
