"""A pipelined plan made at one shape trains on batches of others (see [Note: pipelined shapes]).

One spawned world of 2 gloo ranks (pp 2) trains a Hugging Face Llama, planned at 4 x 16 tokens, with
GPipe and with 1F1B on right-padded batches as a data collator gives them (attention_mask, labels
-100 on the padding) of other sequence lengths and batch sizes, next to one process running the same
micro-batches; it also asks what such a program refuses. The refusals that need no world run alone.
"""

import copy
import types
from unittest import mock

import pytest
import torch
from parity import ADAMW, TOLERANCE, spawn_world

from shardplan.errors import RuntimeMismatchError
from shardplan.frontend.chain import InputSpec
from shardplan.models import zoo
from shardplan.plan import Mesh, SequenceLimit
from shardplan.runtime import parallelize, pipelined
from shardplan.runtime.manual import manual_plan
from shardplan.runtime.program import admit_input
from test_pipeline import MIXED
from test_pipeline import MODELS as PIPELINE_MODELS

MICRO_BATCHES = 2
PLANNED = (4, 16)
"""(samples, longest sequence) of the batch every plan is made for, one replica's."""
STEPS = ((4, 12), (4, 16), (2, 6), (6, 12), (4, 12))
"""Each step's (samples, longest sequence): shorter, as planned, fewer samples and shorter, more
samples, and a shape seen before."""
EVALUATED = (8, 10)

CASES = {
    # a cut for each of the 4 new shapes (the evaluation's too), kept
    "gpipe": dict(schedule="gpipe", kept_cuts=pipelined.KEPT_CUTS, cuts=4),
    # 2 kept: (4, 12) was dropped by the time it returns, and is cut again
    "1f1b/2_kept": dict(schedule="1f1b", kept_cuts=2, cuts=5),
}


def _padded_batch(rows: int, longest: int, seed: int) -> dict:
    """`rows` sequences of random lengths up to `longest`, right-padded to `longest` (the first has it)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 512, (rows, longest), generator=generator)
    lengths = torch.randint(longest // 2, longest + 1, (rows,), generator=generator)
    lengths[0] = longest
    mask = torch.arange(longest)[None, :] < lengths[:, None]
    return {
        "input_ids": ids.masked_fill(~mask, 0),
        "attention_mask": mask.long(),
        "labels": ids.masked_fill(~mask, -100),
    }


def _reference_loss(reference: torch.nn.Module, batch: dict) -> torch.Tensor:
    """What a step computes: the mean of its micro-batches' losses, each the model's own (a mean over
    the micro-batch's unpadded tokens)."""
    halves = [
        {name: value.chunk(MICRO_BATCHES)[index] for name, value in batch.items()}
        for index in range(MICRO_BATCHES)
    ]
    return sum(reference(**half).loss for half in halves) / MICRO_BATCHES


def _plan(model: torch.nn.Module, schedule: str):
    return manual_plan(
        model,
        PIPELINE_MODELS["llama"][1],
        dp=1,
        pp=2,
        schedule=schedule,
        micro_batches=MICRO_BATCHES,
        example_kwargs=_padded_batch(*PLANNED, seed=99),
        **MIXED,
    )


def run_case(rank: int, case: dict) -> dict:
    """Train the case's program next to one process; the largest differences in the losses and (on rank
    0) the parameters at the end, and how many times the stages were cut again."""
    torch.manual_seed(0)
    reference = zoo.hf_llama(batch=PLANNED[0], seq=PLANNED[1]).model
    model = copy.deepcopy(reference)
    cuts = 0
    split = pipelined.split_stages

    def counted(*args, **kwargs):
        nonlocal cuts
        cuts += 1
        return split(*args, **kwargs)

    with (
        mock.patch.object(pipelined, "KEPT_CUTS", case["kept_cuts"]),
        mock.patch.object(pipelined, "split_stages", counted),
    ):
        program = parallelize(model, _plan(model, case["schedule"]))
        cuts = 0  # the planned shape's, at start-up
        optimizer = torch.optim.AdamW(program.parameters(), **ADAMW)
        reference_optimizer = torch.optim.AdamW(reference.parameters(), **ADAMW)
        found = {"loss_error": 0.0}
        for step, shape in enumerate(STEPS):
            batch = _padded_batch(*shape, seed=step)
            loss = program.step(**batch)
            reference_loss = _reference_loss(reference, batch)
            reference_loss.backward()
            for each in (optimizer, reference_optimizer):
                each.step()
                each.zero_grad()
            found["loss_error"] = max(found["loss_error"], abs(float(loss) - float(reference_loss)))
        evaluation = _padded_batch(*EVALUATED, seed=7)
        with torch.no_grad():
            expected = _reference_loss(reference, evaluation)
        found["eval_error"] = abs(float(program.evaluate(**evaluation)) - float(expected))
        found["cuts"] = cuts
    state = program.export_full_state_dict()
    if rank == 0:
        found["param_error"] = max(
            (state[name] - parameter.detach()).abs().max().item()
            for name, parameter in reference.named_parameters()
        )
    return found


def refusals(rank: int) -> dict:
    """What a pipelined program says of a batch its micro-batches cannot split evenly, and of stages given
    different shapes; and that it trains on after them."""
    torch.manual_seed(0)
    model = zoo.hf_llama(batch=PLANNED[0], seq=PLANNED[1]).model
    program = parallelize(model, _plan(model, "1f1b"))
    found = {}
    for name, batch in (
        ("uneven", _padded_batch(5, 12, seed=1)),
        ("stages_differ", _padded_batch(4, 12 if rank == 0 else 10, seed=1)),
    ):
        try:
            program.step(**batch)
        except RuntimeMismatchError as error:
            found[name] = str(error)
    found["trains_on"] = bool(torch.isfinite(program.step(**_padded_batch(4, 12, seed=1))))
    return found


def run_world(rank: int, world: int) -> dict:
    return {
        "cases": {name: run_case(rank, case) for name, case in CASES.items()},
        "refusals": refusals(rank),
    }


@pytest.fixture(scope="module")
def results():
    return spawn_world(2, run_world, ())


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES)
def test_a_pipeline_trains_padded_batches_of_any_shape_like_one_process(results, case):
    found = results["cases"][case]
    errors = {name: found[name] for name in ("loss_error", "eval_error", "param_error")}
    assert all(error <= TOLERANCE for error in errors.values()), errors
    assert found["cuts"] == CASES[case]["cuts"]


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_pipeline_refuses_uneven_micro_batches_and_stages_given_different_shapes(results):
    found = results["refusals"]
    assert found["uneven"].startswith(
        "a pipelined plan splits each batch into 2 equal micro-batches along dim 0 (its schedule "
        "runs micro-batches of one shape), but the inputs have batch sizes [5]"
    )
    assert found["stages_differ"].startswith(
        "the ranks of a pipeline (the stages of one replica) were given batches of different "
        "shapes (rank 0: micro-batches input_ids [2, 12], attention_mask [2, 12], labels [2, 12])"
    )
    assert found["trains_on"]


def _pipelined_plan(limits: tuple[SequenceLimit, ...] = ()):
    """What admit_input reads of a pp 2 plan made at 8 x 128 tokens."""
    return types.SimpleNamespace(
        mesh=Mesh(pp=2),
        inputs=(InputSpec(name="input_ids", shape=(8, 128), dtype="int64"),),
        tensor_parallel=types.SimpleNamespace(sequence_parallel=False),
        sequence_limits=limits,
    )


def test_a_pipelined_plan_admits_shapes_as_without_a_pipeline():
    plan = _pipelined_plan()
    for shape in ((8, 64), (32, 512), (2, 1)):
        admit_input(plan, (), {"input_ids": torch.zeros(shape, dtype=torch.int64)}, micro_batches=2)
    with pytest.raises(RuntimeMismatchError, match=r"this batch does not pass it, which a pipeline"):
        admit_input(plan, (), {}, micro_batches=2)
    with pytest.raises(RuntimeMismatchError, match=r"into 2 equal micro-batches .* sizes \[3\]"):
        admit_input(plan, (), {"input_ids": torch.zeros(3, 64, dtype=torch.int64)}, micro_batches=2)


def test_a_pipelined_plan_refuses_a_shape_predicted_over_the_budget_as_without_a_pipeline():
    plan = _pipelined_plan((SequenceLimit(micro_batch=4, longest=200),))
    fits, over = torch.zeros(8, 200, dtype=torch.int64), torch.zeros(8, 201, dtype=torch.int64)
    admit_input(plan, (), {"input_ids": fits}, micro_batches=2)
    with pytest.raises(RuntimeMismatchError, match="the longest sequence that fits a micro-batch of 4"):
        admit_input(plan, (), {"input_ids": over}, micro_batches=2)
    with pytest.warns(UserWarning, match="predicted over the plan's memory budget"):
        admit_input(plan, (), {"input_ids": over}, micro_batches=2, over_budget="warn")
    admit_input(plan, (), {"input_ids": over}, micro_batches=2, trains=False)  # an evaluation
