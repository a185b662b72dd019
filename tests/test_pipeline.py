"""Pipeline parity: plans with pp > 1 train exactly like one process on the whole batch.

One spawned world per world size (pp 2 at world 2; pp 2 × dp 2 at world 4) runs a grid of
cases (schedules × strategies × checkpointing × micro-batches, a Hugging Face model, loss_fn,
a plan the solver chose because pure FSDP did not fit) and the errors; rank 0 returns one
record per case and the tests read them. Both train a Hugging Face Llama on padded batches of
other shapes than planned (PADDED_SHAPES, PADDED_SHAPES_DP2). The world of 4 also runs pp 4 1F1B
over fewer micro-batches than stages, and reports what each stage ran and held. Every plan is
written once, by one of the ranks (its capture is the same on every rank), and shared with the
others as JSON.
"""

import contextlib
import copy
import dataclasses
import functools
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from parity import (
    ADAMW,
    TOLERANCE,
    assert_parity,
    spawn_world,
    train_next_to_reference,
    written_once,
)
from test_user_loop import padded_batch

from shardplan import compile as compile_plan
from shardplan.compile import evaluate, solve
from shardplan.errors import InfeasibleError, PlanError, RuntimeMismatchError, ShardplanError
from shardplan.frontend.passes import analyze
from shardplan.models import zoo
from shardplan.plan import Checkpoint, MixedPrecision, Plan, Schedule, ShardStrategy, Stage
from shardplan.runtime import parallelize, pipelined
from shardplan.runtime.manual import manual_plan
from shardplan.runtime.stage_split import split_stages

STEPS = 3
"""Enough for parity: the first step creates the optimizer state, the later ones step with it."""
MIXED = {"strategies": tuple(ShardStrategy), "checkpoints": tuple(Checkpoint)}
"""Every unit a different strategy and checkpointing (see test_runtime)."""

MODELS = {
    "gpt": (lambda batch: zoo.gpt(batch=batch), zoo.gpt_units(zoo.GPTConfig().n_layer)),
    "llama": (
        lambda batch: zoo.hf_llama(batch=batch, seq=16),
        [
            ("model.embed_tokens",),
            ("model.layers.0",),
            ("model.layers.1",),
            ("model.norm", "lm_head"),
        ],
    ),
    "gpt2-tied": (
        lambda batch: zoo.hf_gpt2(batch=batch, seq=16),
        [
            ("transformer.wte", "transformer.wpe"),
            ("transformer.h.0",),
            ("transformer.h.1",),
            ("transformer.ln_f", "lm_head"),
        ],
    ),
}
REPLICA_BATCH = 4


def run_case(rank: int, world: int, case: dict) -> dict:
    """Train `case` (its plan as JSON under "plan") for STEPS steps next to a one-process reference; return
    the largest differences."""
    plan = Plan.from_json(case["plan"])
    dp = world // plan.mesh.pp
    build, _ = MODELS[case["model"]]
    batch = case.get("replica_batch", REPLICA_BATCH)
    torch.manual_seed(0)
    reference = build(batch * dp).model
    model = copy.deepcopy(reference)
    vocab, seq = reference.config.vocab_size, 32 if case["model"] == "gpt" else 16
    sizes = case.get("replica_batches", (batch,) * STEPS)  # below `batch`: smaller than planned
    batches = [
        torch.randint(0, vocab, (size * dp, seq), generator=torch.Generator().manual_seed(step))
        for step, size in enumerate(sizes)
    ]
    return train_next_to_reference(
        parallelize(model, plan, backend=case.get("backend", "shardplan")),
        reference,
        [(ids.chunk(dp)[rank % dp], ids) for ids in batches],
        clip=case.get("clip"),
    )


def check_loss_fn(rank: int, world: int) -> dict:
    """A model returning predictions, trained with loss_fn: the target reaches the last stage; the step
    is timed on every stage (program.last_step)."""
    dp = world // 2
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    model = copy.deepcopy(reference)
    x = torch.randn(4 * dp, 8, generator=torch.Generator().manual_seed(1))
    y = torch.randn(4 * dp, 1, generator=torch.Generator().manual_seed(2))
    mine_x, mine_y = x.chunk(dp)[rank % dp], y.chunk(dp)[rank % dp]
    plan = manual_plan(
        model, [("0",), ("2",)], dp=dp, pp=2, micro_batches=2, example_inputs=(mine_x,)
    )
    program = parallelize(model, plan, loss_fn=torch.nn.functional.mse_loss)
    loss = program.step(mine_x, mine_y)
    expected = torch.nn.functional.mse_loss(reference(x), y)
    expected.backward()
    norm = program.clip_grad_norm_(1e9)
    expected_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9)
    return {
        "error": max(abs(float(loss) - float(expected)), abs(float(norm) - float(expected_norm))),
        "timed": program.last_step is not None and program.last_step.step_time_s > 0,
    }


def check_errors(rank: int, world: int) -> dict:
    dp = world // 2
    errors = {}

    def attempt(name: str, action) -> None:
        try:
            action()
            errors[name] = None
        except ShardplanError as error:
            errors[name] = [type(error).__name__, str(error)]

    build, groups = MODELS["gpt"]
    entry = build(REPLICA_BATCH)
    ids = entry.args[0]
    plan = manual_plan(
        entry.model, groups, dp=dp, pp=2, example_inputs=(ids,), example_kwargs={"labels": ids}
    )
    program = parallelize(entry.model, plan)
    attempt("forward_alone", lambda: program(ids, labels=ids))
    return errors


@contextlib.contextmanager
def stage_work():
    """What this rank's stage does in its training steps (not evaluations): "F" for each micro-batch's forward,
    "B" for each backward, in order, and the most micro-batches whose activations it held at once (torch's
    PipelineStage keeps a micro-batch's inputs and outputs in fwd_cache from its forward to its backward)."""
    from torch.distributed.pipelining.stage import _PipelineStageBase

    work = {"order": "", "held": 0}
    forward, backward = _PipelineStageBase.forward_one_chunk, _PipelineStageBase.backward_one_chunk

    def counted_forward(stage, *args, **kwargs):
        output = forward(stage, *args, **kwargs)
        if stage.has_backward:
            work["order"] += "F"
            work["held"] = max(work["held"], len(stage.fwd_cache))
        return output

    def counted_backward(stage, *args, **kwargs):
        if stage.has_backward:  # an evaluation's schedule calls it too, to do nothing
            work["order"] += "B"
        return backward(stage, *args, **kwargs)

    with mock.patch.multiple(
        _PipelineStageBase, forward_one_chunk=counted_forward, backward_one_chunk=counted_backward
    ):
        yield work


def _run_cases_with_stage_work(rank: int, world: int, cases: dict) -> dict:
    """_run_cases, each case's record with "stages": every rank's stage_work, by rank."""
    results = {}
    for name, case in cases.items():
        with stage_work() as work:
            results[name] = run_case(rank, world, case)
        results[name]["stages"] = [None] * world
        dist.all_gather_object(results[name]["stages"], work)
    return results


def _run_cases(rank: int, world: int, cases: dict) -> dict:
    return {name: run_case(rank, world, case) for name, case in cases.items()}


def _all_checks(
    rank: int, world: int, cases: dict, more: dict | None = None, padded: dict | None = None
) -> dict:
    """Every case, loss_fn and the errors; then (under "more") the cases of `more` with each stage's
    work (_run_cases_with_stage_work), and (under "padded") those of `padded` (run_padded_case). The
    ranks first write every case's plan (plan_of, padded_plan_of), each once."""
    writers = {
        **{
            ("cases", name): functools.partial(plan_of, world, case) for name, case in cases.items()
        },
        **{
            ("more", name): functools.partial(plan_of, world, case)
            for name, case in (more or {}).items()
        },
        **{
            ("padded", name): functools.partial(padded_plan_of, world, case)
            for name, case in (padded or {}).items()
        },
    }
    plans = written_once(rank, world, writers)
    cases, more, padded = (
        {name: dict(case, plan=plans[kind, name]) for name, case in (given or {}).items()}
        for kind, given in (("cases", cases), ("more", more), ("padded", padded))
    )
    results = _run_cases(rank, world, cases)
    results["loss_fn"] = check_loss_fn(rank, world)
    results["errors"] = check_errors(rank, world)
    if more:
        results["more"] = _run_cases_with_stage_work(rank, world, more)
    if padded:
        results["padded"] = {name: run_padded_case(rank, case) for name, case in padded.items()}
    return results


def plan_of(world: int, case: dict) -> str:
    """The plan run_case trains `case` on, as JSON: its units by hand, or (under "solver") compile's."""
    if case.get("solver"):
        return solver_pipelined_plan()
    pp = case.get("pp", 2)
    dp = world // pp
    build, groups = MODELS[case["model"]]
    batch = case.get("replica_batch", REPLICA_BATCH)
    mine = torch.zeros(batch, 32 if case["model"] == "gpt" else 16, dtype=torch.int64)
    return manual_plan(
        build(batch * dp).model,
        groups,
        dp=dp,
        pp=pp,
        schedule=case["schedule"],
        micro_batches=case["micro_batches"],
        strategies=case["strategies"],
        checkpoints=case["checkpoints"],
        example_inputs=(mine,),
        example_kwargs={"labels": mine},
        precision=MixedPrecision(param_dtype=case.get("param_dtype", "float32")),
    ).to_json()


def solver_pipelined_plan() -> str:
    """The plan compile chooses for GPT on 2 CPU ranks under a budget pure FSDP cannot meet."""
    entry = zoo.gpt(batch=8)
    # the budget and its infeasibility without a pipeline are the solver's on one analysis: compile
    # would analyse the model again for each
    chain = analyze(entry.model, entry.args, entry.kwargs)
    unbounded = solve(chain, 2, hardware="cpu-gloo", allow_pipeline=False)
    budget = int(0.3 * unbounded.predicted.peak_bytes)
    with pytest.raises(InfeasibleError):
        solve(chain, 2, hardware="cpu-gloo", memory_budget=budget, allow_pipeline=False)
    plan = compile_plan(
        entry.model,
        2,
        entry.args,
        entry.kwargs,
        hardware="cpu-gloo",
        memory_budget=budget,
        allow_pipeline=True,
    )
    assert plan.mesh.pp > 1 and plan.predicted.peak_bytes <= budget, plan.summary()
    return plan.to_json()


def test_stages_are_cut_from_the_graph_where_the_plan_says():
    entry = zoo.gpt(batch=4)
    ids = entry.args[0]
    plan = manual_plan(
        entry.model,
        MODELS["gpt"][1],
        dp=1,
        pp=2,
        micro_batches=2,
        example_inputs=(ids,),
        example_kwargs={"labels": ids},
    )
    first, second = split_stages(entry.model, plan, torch.device("cpu"))
    assert [call.unit for call in first.calls] == ["wte..wpe", "wte..wpe", "h.0", "h.1"]
    assert [call.unit for call in second.calls] == ["h.2", "h.3", "ln_f..lm_head", "ln_f..lm_head"]
    assert first.inbound == ("ids", "labels")
    # stage 1 receives the labels, passed along, and the residual stream
    assert "labels" in second.inbound and len(second.inbound) == 2
    residual = second.examples[second.inbound[1]]
    assert tuple(residual.shape) == (2, 32, 64) and residual.requires_grad  # one micro-batch
    assert not second.examples["labels"].requires_grad
    scrambled = dataclasses.replace(
        plan,
        units=plan.units[1:2] + plan.units[:1] + plan.units[2:],
        stages=(
            Stage(index=0, units=(plan.units[1].name,)),
            Stage(index=1, units=tuple(u.name for u in plan.units if u is not plan.units[1])),
        ),
    )
    with pytest.raises(PlanError, match="stages do not follow the graph's order"):
        split_stages(entry.model, scrambled, torch.device("cpu"))


def test_evaluate_prices_a_pipelined_plan_as_the_solver_did():
    entry = zoo.gpt(batch=8)
    chain = analyze(entry.model, entry.args, entry.kwargs)
    data_parallel = solve(chain, 4, hardware="cpu-gloo", allow_pipeline=False)
    plan = solve(
        chain, 4, hardware="cpu-gloo", memory_budget=int(0.25 * data_parallel.predicted.peak_bytes)
    )
    assert plan.mesh.pp > 1
    predicted = evaluate(chain, plan, "cpu-gloo")
    assert (predicted.peak_bytes, predicted.time_s) == (
        plan.predicted.peak_bytes,
        plan.predicted.time_s,
    )
    assert predicted.time_s["bubble"] > 0


WORLD2_CASES = {
    "gpt/gpipe/m2/full_shard": {
        "model": "gpt",
        "schedule": "gpipe",
        "micro_batches": 2,
        "strategies": (ShardStrategy.FULL_SHARD,),
        "checkpoints": (Checkpoint.NONE,),
    },
    "gpt/1f1b/m4/mixed/clip": {
        "model": "gpt",
        "schedule": "1f1b",
        "micro_batches": 4,
        **MIXED,
        "clip": 0.05,
    },
    "gpt/gpipe/m4/mixed": {"model": "gpt", "schedule": "gpipe", "micro_batches": 4, **MIXED},
    "llama/1f1b/m2/mixed/clip": {
        "model": "llama",
        "schedule": "1f1b",
        "micro_batches": 2,
        **MIXED,
        "clip": 0.05,
    },
    # stages computing in bfloat16 send bfloat16 (the model casts to its activations' dtype)
    "llama/gpipe/m2/bfloat16": {
        "model": "llama",
        "schedule": "gpipe",
        "micro_batches": 2,
        **MIXED,
        "param_dtype": "bfloat16",
        "tolerance": 3e-2,
    },
}
WORLD4_CASES = {
    "gpt/gpipe/m2/mixed/clip": {
        "model": "gpt",
        "schedule": "gpipe",
        "micro_batches": 2,
        **MIXED,
        "clip": 0.05,
    },
    "gpt/1f1b/m4/mixed": {"model": "gpt", "schedule": "1f1b", "micro_batches": 4, **MIXED},
    # four stages: the labels pass through three of them
    "gpt/1f1b/m4/pp4": {"model": "gpt", "schedule": "1f1b", "micro_batches": 4, "pp": 4, **MIXED},
    # the embedding on stage 0, its tied head on stage 1: a copy sharded over dp as its owner is
    "gpt2-tied/1f1b/m2/mixed/clip": {
        "model": "gpt2-tied",
        "schedule": "1f1b",
        "micro_batches": 2,
        **MIXED,
        "clip": 0.05,
    },
}


# planned at 4 samples a replica, stepped at 2 (an epoch's last batch), 4, 2...: the schedule made for 2
# re-uses the stage's units; the evaluation at the end runs the first batch, at 2
SMALLER_THAN_PLANNED = {
    "gpt/1f1b/m2/smaller": {
        "model": "gpt",
        "schedule": "1f1b",
        "micro_batches": 2,
        **MIXED,
        "clip": 0.05,
        "replica_batches": (2, 4, 2, 4),
    }
}

PADDED_PLANNED = (4, 16)
"""(samples, longest sequence) of the padded batch a replica of PADDED_SHAPES' Llama is planned at."""
PADDED_STEPS = ((4, 12), (4, 16), (2, 6), (6, 12), (4, 12))
"""Each step's (samples, longest sequence): shorter, as planned, fewer samples and shorter, more
samples, and a shape seen before; then an evaluation at (8, 10). At dp 2 the second replica's
sequences are 2 shorter: replicas may pass different shapes."""
PADDED_SHAPES = {
    # a cut for each of the 4 new shapes (the evaluation's too), each kept. Llama's stages also send its
    # rotary tables, (1, T, d) at every batch size
    "llama/gpipe/m2/padded": {"schedule": "gpipe", "kept_cuts": pipelined.KEPT_CUTS, "cuts": 4},
    # 2 kept: (4, 12) was dropped by the time it returns, and is cut again; then the refusals
    "llama/1f1b/m2/padded/2_kept": {
        "schedule": "1f1b",
        "kept_cuts": 2,
        "cuts": 5,
        "refusals": True,
    },
}
"""A Hugging Face Llama at pp 2 (world 2), trained on right-padded batches (attention_mask, labels -100
on the padding) of other shapes than planned, next to one process running the same micro-batches."""
PADDED_SHAPES_DP2 = {
    "llama/1f1b/m2/padded/dp2": {"schedule": "1f1b", "kept_cuts": pipelined.KEPT_CUTS, "cuts": 4}
}
"""As PADDED_SHAPES, at dp 2 x pp 2 (world 4)."""


def padded_plan_of(world: int, case: dict) -> str:
    """The plan of a case of PADDED_SHAPES for `world` ranks, as JSON."""
    return manual_plan(
        zoo.hf_llama(batch=PADDED_PLANNED[0], seq=PADDED_PLANNED[1]).model,
        MODELS["llama"][1],
        dp=world // 2,
        pp=2,
        schedule=case["schedule"],
        micro_batches=2,
        example_kwargs=padded_batch("llama", *PADDED_PLANNED, seed=99),
        **MIXED,
    ).to_json()


def _padded_micro_batch_loss(reference: torch.nn.Module, batches: list[dict]) -> torch.Tensor:
    """What a step of 2 micro-batches over the replicas' `batches` computes: the mean of their micro-batches'
    losses, each the model's own (a mean over the micro-batch's unpadded tokens)."""
    halves = [
        {name: value.chunk(2)[index] for name, value in batch.items()}
        for batch in batches
        for index in range(2)
    ]
    return sum(reference(**half).loss for half in halves) / len(halves)


def run_padded_case(rank: int, case: dict) -> dict:
    """Train a Llama planned at PADDED_PLANNED on PADDED_STEPS next to one process; the largest
    differences in the losses and (on rank 0) the parameters at the end, and how many times the stages
    were cut again. With "refusals", then what the program refuses: a batch its micro-batches cannot
    split evenly, and stages given different shapes; and that it trains on after them."""
    plan = Plan.from_json(case["plan"])
    torch.manual_seed(0)
    reference = zoo.hf_llama(batch=PADDED_PLANNED[0], seq=PADDED_PLANNED[1]).model
    model = copy.deepcopy(reference)
    split, cuts = pipelined.split_stages, []

    def counted(*args):
        cuts.append(args)
        return split(*args)

    def batches(rows: int, longest: int, seed: int) -> list[dict]:  # each replica's
        return [
            padded_batch("llama", rows, longest - 2 * replica, seed=10 * seed + replica)
            for replica in range(plan.mesh.dp)
        ]

    replica = plan.mesh.replica_of(rank)
    with (
        mock.patch.object(pipelined, "KEPT_CUTS", case["kept_cuts"]),
        mock.patch.object(pipelined, "split_stages", counted),
    ):
        program = parallelize(model, plan)
        cuts.clear()  # the planned shape's, at start-up
        optimizer = torch.optim.AdamW(program.parameters(), **ADAMW)
        reference_optimizer = torch.optim.AdamW(reference.parameters(), **ADAMW)
        found: dict = {"loss_error": 0.0}
        for step, shape in enumerate(PADDED_STEPS):
            each_replica = batches(*shape, seed=step)
            loss = program.step(**each_replica[replica])
            reference_loss = _padded_micro_batch_loss(reference, each_replica)
            reference_loss.backward()
            for each in (optimizer, reference_optimizer):
                each.step()
                each.zero_grad()
            error = abs(float(loss) - float(reference_loss.detach()))
            found["loss_error"] = max(found["loss_error"], error)
        evaluation = batches(8, 10, seed=7)
        with torch.no_grad():
            expected = _padded_micro_batch_loss(reference, evaluation)
        found["eval_error"] = abs(float(program.evaluate(**evaluation[replica])) - float(expected))
        state = program.export_full_state_dict()
        if rank == 0:  # whose export is compared
            found["param_error"] = max(
                (state[name] - parameter.detach()).abs().max().item()
                for name, parameter in reference.named_parameters()
            )
        found["cuts"] = len(cuts)
        if case.get("refusals"):
            for name, batch in (
                ("uneven", padded_batch("llama", 5, 12, seed=1)),
                ("stages_differ", padded_batch("llama", 4, 12 if rank == 0 else 10, seed=1)),
            ):
                try:
                    program.step(**batch)
                except RuntimeMismatchError as error:
                    found[name] = str(error)
            found["trains_on"] = bool(
                torch.isfinite(program.step(**padded_batch("llama", 4, 12, seed=1)))
            )
    return found


@pytest.fixture(scope="module")
def world2():
    """The world of 2: WORLD2_CASES, the solver's plan, SMALLER_THAN_PLANNED, loss_fn, the errors and
    PADDED_SHAPES."""
    cases = dict(
        WORLD2_CASES,
        solver={"model": "gpt", "solver": True, "replica_batch": 8},
        **SMALLER_THAN_PLANNED,
    )
    return cases, spawn_world(2, _all_checks, (cases, None, PADDED_SHAPES))


@pytest.mark.timeout(600)
def test_pipeline_world2_matches_one_process(world2):
    cases, results = world2
    cases = {name: case for name, case in cases.items() if name not in SMALLER_THAN_PLANNED}
    assert_parity(results, cases)
    assert results["loss_fn"]["error"] <= TOLERANCE and results["loss_fn"]["timed"]
    errors = results["errors"]
    assert errors["forward_alone"][0] == "ShardplanError" and "step(" in errors["forward_alone"][1]


@pytest.mark.timeout(600)
def test_pipeline_steps_batches_smaller_than_planned(world2):
    assert_parity(world2[1], SMALLER_THAN_PLANNED)


def _check_padded(found: dict, case: dict) -> None:
    errors = {name: found[name] for name in ("loss_error", "eval_error", "param_error")}
    assert all(error <= TOLERANCE for error in errors.values()), errors
    assert found["cuts"] == case["cuts"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", PADDED_SHAPES)
def test_a_pipeline_trains_padded_batches_of_other_shapes_like_one_process(world2, case):
    _check_padded(world2[1]["padded"][case], PADDED_SHAPES[case])


@pytest.mark.timeout(600)
def test_a_pipeline_refuses_uneven_micro_batches_and_stages_given_different_shapes(world2):
    found = world2[1]["padded"]["llama/1f1b/m2/padded/2_kept"]
    assert found["uneven"].startswith(
        "a pipelined plan splits each batch into 2 equal micro-batches along dim 0 (its schedule "
        "runs micro-batches of one shape), but the inputs have batch sizes [5]"
    )
    assert found["stages_differ"].startswith(
        "the ranks of a pipeline (the stages of one replica) were given batches of different "
        "shapes (rank 0: micro-batches input_ids [2, 12], attention_mask [2, 12], labels [2, 12])"
    )
    assert found["trains_on"]


FEWER_MICRO_BATCHES_THAN_STAGES = {
    "gpt/1f1b/m1/pp4": {"model": "gpt", "schedule": "1f1b", "micro_batches": 1, "pp": 4, **MIXED},
    "gpt/1f1b/m2/pp4": {
        "model": "gpt",
        "schedule": "1f1b",
        "micro_batches": 2,
        "pp": 4,
        **MIXED,
        "clip": 0.05,
    },
    "gpt/1f1b/m3/pp4": {
        "model": "gpt",
        "schedule": "1f1b",
        "micro_batches": 3,
        "pp": 4,
        **MIXED,
        "replica_batch": 3,
    },
    "gpt/1f1b/m2/pp4/fsdp2": {
        "model": "gpt",
        "schedule": "1f1b",
        "micro_batches": 2,
        "pp": 4,
        "strategies": (ShardStrategy.FULL_SHARD,),
        "checkpoints": (Checkpoint.NONE,),
        "backend": "fsdp2",
    },
}
"""1F1B over fewer micro-batches than its 4 stages (see [Note: 1F1B over fewer micro-batches than stages])."""


FEWER_CASES = {
    name: dict(case, replica_batches=(case.get("replica_batch", REPLICA_BATCH),) * 2)
    for name, case in FEWER_MICRO_BATCHES_THAN_STAGES.items()
}


@pytest.fixture(scope="module")
def world4():
    """The world of 4: WORLD4_CASES, loss_fn and the errors, then FEWER_CASES with each stage's work, and
    PADDED_SHAPES_DP2."""
    return spawn_world(4, _all_checks, (WORLD4_CASES, FEWER_CASES, PADDED_SHAPES_DP2))


@pytest.mark.timeout(600)
def test_pipeline_world4_pp2_dp2_matches_one_process(world4):
    assert_parity(world4, WORLD4_CASES)
    assert world4["loss_fn"]["error"] <= TOLERANCE and world4["loss_fn"]["timed"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", PADDED_SHAPES_DP2)
def test_replicas_of_a_pipeline_train_padded_batches_of_their_own_shapes_like_one_process(
    world4, case
):
    _check_padded(world4["padded"][case], PADDED_SHAPES_DP2[case])


@pytest.mark.timeout(600)
def test_one_f_one_b_over_fewer_micro_batches_than_stages_matches_one_process_as_priced(world4):
    cases = FEWER_CASES
    results = world4["more"]
    assert_parity(results, cases)
    for name, case in cases.items():
        schedule = Schedule(num_micro_batches=case["micro_batches"], name="1f1b")
        m, steps = schedule.num_micro_batches, len(case["replica_batches"])
        for stage, work in enumerate(results[name]["stages"]):
            # warm-up forwards, then a backward and a forward each, then the last backwards: stages with
            # pp - stage >= m run fill-drain, and each holds the micro-batches the cost model prices
            warm_up = schedule.in_flight(stage, 4)
            assert (
                work["order"] == ("F" * warm_up + "BF" * (m - warm_up) + "B" * warm_up) * steps
            ), (name, stage)
            assert work["held"] == warm_up == min(m, 4 - stage), (name, stage)
