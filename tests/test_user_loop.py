"""The FSDP2 user's loop on what parallelize returns, on both backends: the program called as the model
with its keywords, `loss.backward()`, an optimizer over `program.parameters()`, accumulation by
`set_requires_gradient_sync(False)`, and batches of any size and sequence length (dynamic padding,
a larger evaluation batch), next to one process training the same batches.

One spawned world of 2 gloo ranks runs every case, and asks a pipelined program what it refuses; the
refusals that need no world run alone.
"""

import copy
import types

import pytest
import torch
from parity import ADAMW, spawn_world

from shardplan.errors import RuntimeMismatchError, ShardplanError
from shardplan.frontend.chain import InputSpec
from shardplan.models import zoo
from shardplan.plan import Mesh, SequenceLimit, ShardStrategy
from shardplan.runtime import Program, parallelize
from shardplan.runtime.manual import manual_plan
from shardplan.runtime.program import admit_input

TOLERANCE = 1e-5
WORLD = 2
ACCUMULATED = 2
"""Micro-batches per optimizer step, accumulated by the switch."""
PLANNED_SEQUENCE = 16
"""The sequence length every plan is made for; the steps feed others."""
STEP_LENGTHS = (12, 16, 6)
"""Each step's longest sequence (dynamic padding pads a batch to its longest): none the planned one
but the second, all even, so sequence parallelism over 2 ranks splits them."""

MODELS = {
    "llama": (
        lambda: zoo.hf_llama(
            n_layer=2,
            d_model=64,
            ffn=128,
            heads=4,
            kv_heads=2,
            vocab=128,
            batch=2,
            seq=PLANNED_SEQUENCE,
        ),
        [
            ("model.embed_tokens",),
            ("model.layers.0",),
            ("model.layers.1",),
            ("model.norm", "lm_head"),
        ],
    ),
    "gpt": (
        lambda: zoo.gpt(zoo.GPTConfig(n_layer=2, seq_len=PLANNED_SEQUENCE), batch=2),
        [("wte", "wpe"), ("h.0",), ("h.1",), ("ln_f", "lm_head")],
    ),
}
"""Per model: its builder (a zoo entry planned at batch 2 × PLANNED_SEQUENCE) and its units."""

EVERY_STRATEGY = (
    ShardStrategy.FULL_SHARD,
    ShardStrategy.SHARD_OPTIMIZER,
    ShardStrategy.REPLICATE,
    ShardStrategy.SHARD_GRAD_OP,
)
"""Reduce-scattering units and all-reducing ones, whose gradients the switch keeps local."""

CASES = {
    "llama_dp2_full_shard": dict(model="llama", mesh=dict(dp=2)),
    "llama_dp2_full_shard_fsdp2": dict(model="llama", mesh=dict(dp=2), backend="fsdp2"),
    "gpt_dp2_every_strategy": dict(
        model="gpt", mesh=dict(dp=2), strategies=EVERY_STRATEGY, steps_accumulate=True
    ),
    "gpt_dp2_fsdp2": dict(model="gpt", mesh=dict(dp=2), backend="fsdp2", steps_accumulate=True),
    "llama_tp2_sequence_parallel": dict(
        model="llama",
        mesh=dict(dp=1, tp=2, sequence_parallel=True, vocab_parallel=True),
        strategies=EVERY_STRATEGY,
    ),
    "llama_tp2_sequence_parallel_fsdp2": dict(
        model="llama", mesh=dict(dp=1, tp=2, sequence_parallel=True), backend="fsdp2"
    ),
}
"""steps_accumulate: a plan of 2 micro-batches, and after the loop two step() calls accumulated by the
switch too. Only for GPT: its batches are unpadded, so step's micro-batches, weighted by their
samples, give the batch's mean, where a Hugging Face loss is a mean over unpadded tokens."""


def padded_batch(model_name: str, rows: int, longest: int, seed: int) -> dict:
    """A batch of `rows` sequences of random lengths up to `longest`, right-padded to `longest` (the
    longest one has it): the keywords a data collator gives the model."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 128, (rows, longest), generator=generator)
    if model_name == "gpt":  # its forward takes no mask: every row full
        return {"ids": ids, "labels": ids}
    lengths = torch.randint(longest // 2, longest + 1, (rows,), generator=generator)
    lengths[0] = longest
    mask = torch.arange(longest)[None, :] < lengths[:, None]
    return {
        "input_ids": ids.masked_fill(~mask, 0),
        "attention_mask": mask.long(),
        "labels": ids.masked_fill(~mask, -100),
    }


def _loss(output) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output.loss


def run_case(rank: int, case: dict) -> dict:
    """Train the case's program with the user's loop next to one process on every rank's batches;
    return the largest differences in the losses and (on rank 0) the parameters at the end."""
    build, units = MODELS[case["model"]]
    torch.manual_seed(0)
    entry = build()
    reference, model = entry.model, copy.deepcopy(entry.model)
    planned = padded_batch(case["model"], 2, PLANNED_SEQUENCE, seed=99)
    plan = manual_plan(
        model,
        units,
        strategies=case.get("strategies", (ShardStrategy.FULL_SHARD,)),
        micro_batches=2 if case.get("steps_accumulate") else 1,
        example_kwargs=planned,
        **case["mesh"],
    )
    program = parallelize(model, plan, backend=case.get("backend", "shardplan"))
    optimizer = torch.optim.AdamW(program.parameters(), **ADAMW)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), **ADAMW)
    replicas, replica = plan.mesh.dp, plan.mesh.replica_of(rank)
    found: dict = {"loss_error": 0.0}
    if plan.tensor_parallel.sequence_parallel:
        odd = padded_batch(case["model"], 2, 7, seed=98)
        try:
            program(**odd)
        except RuntimeMismatchError as error:
            found["odd_sequence"] = str(error)
    for step, longest in enumerate(STEP_LENGTHS):
        for micro in range(ACCUMULATED):
            batches = [
                padded_batch(case["model"], 2, longest, seed=100 * step + 10 * micro + index)
                for index in range(replicas)
            ]
            program.set_requires_gradient_sync(micro == ACCUMULATED - 1)
            loss = _loss(program(**batches[replica]))
            (loss / ACCUMULATED).backward()
            if step == micro == 0 and hasattr(program, "units"):  # backend "shardplan"
                found["reduced_unsynced"] = [unit.shard.grad is not None for unit in program.units]
            reference_losses = [_loss(reference(**batch)) for batch in batches]
            (sum(reference_losses) / (ACCUMULATED * replicas)).backward()
            found["loss_error"] = max(
                found["loss_error"], abs(float(loss) - float(reference_losses[replica]))
            )
        optimizer.step()
        optimizer.zero_grad()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    if case.get("steps_accumulate"):
        for sync in (False, True):
            batches = [
                padded_batch(case["model"], 2, 10, seed=500 + 10 * sync + index)
                for index in range(replicas)
            ]
            program.set_requires_gradient_sync(sync)
            loss = program.step(**batches[replica])  # the mean over the replicas' losses
            reference_loss = sum(_loss(reference(**batch)) for batch in batches) / replicas
            reference_loss.backward()
            found["loss_error"] = max(found["loss_error"], abs(float(loss) - float(reference_loss)))
        optimizer.step()
        optimizer.zero_grad()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    # evaluation at three times the planned batch and another sequence length, called and by evaluate
    evaluation = padded_batch(case["model"], 6, 10, seed=7)
    with torch.no_grad():
        expected = float(_loss(reference(**evaluation)))
        called = float(_loss(program(**evaluation)))
    evaluated = float(program.evaluate(**evaluation))
    found["eval_error"] = max(abs(called - expected), abs(evaluated - expected))
    state = program.export_full_state_dict()
    if rank == 0:
        found["param_error"] = max(
            (state[name] - parameter.detach()).abs().max().item()
            for name, parameter in reference.named_parameters()
        )
    return found


def pipelined_refusals() -> dict:
    """What a pipelined program (2 stages, backend "shardplan") says when called as the model, or asked to
    hold back its gradients."""
    build, units = MODELS["gpt"]
    entry = build()
    plan = manual_plan(
        entry.model,
        units,
        dp=1,
        pp=2,
        micro_batches=2,
        example_inputs=entry.args,
        example_kwargs=entry.kwargs,
    )
    program = parallelize(entry.model, plan)
    found = {}
    for name, call in (
        ("call", lambda: program(*entry.args, **entry.kwargs)),
        ("switch", lambda: program.set_requires_gradient_sync(False)),
    ):
        try:
            call()
        except ShardplanError as error:
            found[name] = str(error)
    return found


def run_world(rank: int, world: int) -> dict:
    return {
        "cases": {name: run_case(rank, case) for name, case in CASES.items()},
        "pipelined": pipelined_refusals(),
    }


@pytest.fixture(scope="module")
def results():
    return spawn_world(WORLD, run_world, ())


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", CASES)
def test_the_fsdp2_loop_with_accumulation_and_padded_batches_trains_like_one_process(results, case):
    errors = {
        field: results["cases"][case][field]
        for field in ("loss_error", "eval_error", "param_error")
    }
    assert all(error <= TOLERANCE for error in errors.values()), errors


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", [name for name in CASES if "sequence_parallel" in name])
def test_a_sequence_sequence_parallelism_cannot_split_is_refused_before_the_forward(results, case):
    assert results["cases"][case]["odd_sequence"].startswith(
        "input 'input_ids' has a sequence of 7 tokens (shape [2, 7]), which the plan's "
        "sequence parallelism cannot split over tp=2 ranks: pad sequences to a multiple of 2"
    )


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_unsynced_backwards_hold_back_the_all_reductions_and_reduce_scatter_as_planned(results):
    # EVERY_STRATEGY's units: reduce-scattered, all-reduced twice, reduce-scattered
    assert results["cases"]["gpt_dp2_every_strategy"]["reduced_unsynced"] == [
        True,
        False,
        False,
        True,
    ]


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_a_pipelined_program_trains_by_step_only(results):
    assert results["pipelined"] == {
        "call": "a pipelined program runs whole training steps, each stage on its own ranks: call "
        "program.step(...); to run the model's forward alone, plan with pp=1",
        "switch": "a pipelined plan (pp > 1) accumulates gradients over its micro-batches inside "
        "program.step(...): pass the whole accumulation batch to one step()",
    }


def _plan_of(
    pp: int = 1,
    tp: int = 1,
    sequence_parallel: bool = False,
    limits: tuple[SequenceLimit, ...] = (),
):
    """What admit_input and the switch read of a plan made at 8 x 128 tokens: its mesh, inputs, tensor
    parallelism and sequence limits (by default none: no batch is refused for memory)."""
    return types.SimpleNamespace(
        mesh=Mesh(pp=pp, tp=tp),
        inputs=(InputSpec(name="input_ids", shape=(8, 128), dtype="int64"),),
        tensor_parallel=types.SimpleNamespace(sequence_parallel=sequence_parallel),
        sequence_limits=limits,
    )


def test_any_batch_size_and_sequence_length_is_admitted_but_not_other_dims_or_dtypes():
    for shape in ((8, 64), (32, 512), (1, 1)):
        admit_input(_plan_of(), (), {"input_ids": torch.zeros(shape, dtype=torch.int64)})
    admit_input(_plan_of(), (), {})  # a planned input left out: the model decides
    with pytest.raises(
        RuntimeMismatchError, match=r"input 'input_ids' has 1 dims .*pass it with 2"
    ):
        admit_input(_plan_of(), (), {"input_ids": torch.zeros(8, dtype=torch.int64)})
    with pytest.raises(RuntimeMismatchError, match="input 'input_ids' is int32"):
        admit_input(_plan_of(), (), {"input_ids": torch.zeros(8, 64, dtype=torch.int32)})
    with pytest.raises(RuntimeMismatchError, match=r"no samples \(shape \[0, 64\]\): give every"):
        admit_input(_plan_of(), (), {"input_ids": torch.zeros(0, 64, dtype=torch.int64)})


def test_sequence_parallelism_admits_sequences_it_splits_evenly():
    plan = _plan_of(tp=4, sequence_parallel=True)
    admit_input(plan, (torch.zeros(3, 64, dtype=torch.int64),), {})
    with pytest.raises(RuntimeMismatchError, match=r"pad_to_multiple_of=4 .*or re-plan without"):
        admit_input(plan, (torch.zeros(3, 66, dtype=torch.int64),), {})


def test_a_pipelined_plan_admits_any_shape_in_equal_micro_batches_and_keeps_its_step():
    plan = _plan_of(pp=2)
    for shape in ((8, 64), (32, 512), (2, 1)):
        admit_input(plan, (), {"input_ids": torch.zeros(shape, dtype=torch.int64)}, micro_batches=2)
    with pytest.raises(RuntimeMismatchError, match="this batch does not pass it, which a pipeline"):
        admit_input(plan, (), {}, micro_batches=2)  # its first stage reads every planned input
    with pytest.raises(RuntimeMismatchError, match=r"into 2 equal micro-batches .* sizes \[3\]"):
        admit_input(plan, (), {"input_ids": torch.zeros(3, 64, dtype=torch.int64)}, micro_batches=2)
    with pytest.raises(ShardplanError, match=r"pass the whole accumulation batch to one step\(\)"):
        Program(torch.nn.Module(), plan, None).set_requires_gradient_sync(False)


def test_a_pipelined_plan_refuses_a_shape_predicted_over_the_budget_as_without_a_pipeline():
    plan = _plan_of(pp=2, limits=(SequenceLimit(micro_batch=4, longest=200),))
    fits, over = torch.zeros(8, 200, dtype=torch.int64), torch.zeros(8, 201, dtype=torch.int64)
    admit_input(plan, (), {"input_ids": fits}, micro_batches=2)
    with pytest.raises(
        RuntimeMismatchError, match="the longest sequence that fits a micro-batch of 4"
    ):
        admit_input(plan, (), {"input_ids": over}, micro_batches=2)
    with pytest.warns(UserWarning, match="predicted over the plan's memory budget") as caught:
        admit_input(plan, (), {"input_ids": over}, micro_batches=2, over_budget="warn")
    assert caught[0].filename == __file__  # the caller's line, however deep the warning is raised
    admit_input(plan, (), {"input_ids": over}, micro_batches=2, trains=False)  # an evaluation
