"""Runtime parity: plans run on spawned gloo ranks train exactly like one process on the whole batch.

One spawned world per world size runs a grid of cases (models × strategies × checkpointing ×
backends, plus micro-batches, clipping, offload, meta init, ties, mixed precision, errors);
rank 0 writes one JSON record per case and the tests read them.
"""

import copy
import warnings
import weakref

import pytest
import torch
import torch.distributed as dist
from parity import TOLERANCE, assert_parity, spawn_world, train_next_to_reference

from shardplan.errors import PlanError, RuntimeMismatchError, ShardplanError
from shardplan.models import zoo
from shardplan.plan import Checkpoint, MixedPrecision, Plan, ShardStrategy
from shardplan.runtime import parallelize
from shardplan.runtime.flat_param import FlatLayout
from shardplan.runtime.manual import manual_plan
from shardplan.runtime.program import split_micro_batches

STEPS = 3
"""Enough for parity: the first step creates the optimizer state, the later ones step with it."""
STRATEGIES = tuple(ShardStrategy)
CHECKPOINTS = tuple(Checkpoint)


# plans by hand

MODELS = {
    "gpt": (
        lambda world, device="cpu": zoo.gpt(batch=2 * world, device=device),
        zoo.gpt_units(zoo.GPTConfig().n_layer),
    ),
    "llama": (
        lambda world, device="cpu": zoo.hf_llama(batch=2 * world, seq=16, device=device),
        [
            ("model.embed_tokens",),
            ("model.layers.0",),
            ("model.layers.1",),
            ("model.norm", "lm_head"),
        ],
    ),
    "gpt2-tied": (
        lambda world, device="cpu": zoo.hf_gpt2(batch=2 * world, seq=16, device=device),
        [
            ("transformer.wte", "transformer.wpe"),
            ("transformer.h.0",),
            ("transformer.h.1",),
            ("transformer.ln_f", "lm_head"),
        ],
    ),
}


def make_plan(model, groups, dp: int, strategies, checkpoints, **options) -> Plan:
    return manual_plan(
        model, groups, dp=dp, strategies=strategies, checkpoints=checkpoints, **options
    )


# one case on every rank


def run_case(rank: int, world: int, case: dict) -> dict:
    """Train `case` for STEPS steps next to a one-process reference; return the largest differences."""
    build, groups = MODELS[case["model"]]
    torch.manual_seed(0)
    entry = build(world, device="meta" if case.get("meta") else "cpu")
    torch.manual_seed(0)
    reference = build(world).model
    model = entry.model if case.get("meta") else copy.deepcopy(reference)
    vocab, seq = reference.config.vocab_size, entry.args[0].shape[1]
    # plans record one rank's input shapes only where a case asks: each costs a capture
    planned = torch.zeros(case.get("planned_batch", 0), seq, dtype=torch.int64)
    plan = make_plan(
        model,
        groups,
        world,
        case["strategies"],
        case["checkpoints"],
        micro_batches=case.get("micro_batches", 1),
        offload=case.get("offload", (False,)),
        prefetch=case.get("prefetch", (True,)),
        precision=MixedPrecision(param_dtype=case.get("param_dtype", "float32")),
        **(
            {"example_inputs": (planned,), "example_kwargs": {"labels": planned}}
            if len(planned)
            else {}
        ),
    )
    torch.manual_seed(0)  # meta init draws the same numbers as building on CPU did
    program = parallelize(model, plan, backend=case.get("backend", "shardplan"))
    batches = [
        torch.randint(
            0,
            vocab,
            (case.get("batch", 2) * world, seq),
            generator=torch.Generator().manual_seed(step),
        )
        for step in range(STEPS)
    ]
    return train_next_to_reference(
        program,
        reference,
        [(ids.chunk(world)[rank], ids) for ids in batches],
        clip=case.get("clip"),
    )


def check_reshard(rank: int, world: int) -> dict:
    """What each unit holds when: FULL_SHARD (h.1) keeps no gathered buffer between forward and backward,
    SHARD_GRAD_OP (h.2) keeps it, the next unit is being gathered while one computes."""
    build, groups = MODELS["gpt"]
    torch.manual_seed(0)
    entry = build(world)
    plan = make_plan(
        entry.model,
        groups,
        world,
        (ShardStrategy.FULL_SHARD, ShardStrategy.SHARD_GRAD_OP),
        (Checkpoint.NONE,),
    )
    program = parallelize(entry.model, plan)
    h1, h2 = program.units[2], program.units[3]
    seen = {}

    def spy(module, args, output):
        seen["h2_while_h1_computes"] = h2.state.value
        seen["h1_buffer"] = weakref.ref(h1.gathered())

    entry.model.h[1].mlp.register_forward_hook(spy)
    mine = entry.args[0].chunk(world)[rank]
    loss = program(mine, labels=mine)
    facts = {
        "h2_while_h1_computes": seen["h2_while_h1_computes"],
        "h1_buffer_alive_after_forward": seen["h1_buffer"]() is not None,
        "after_forward": {unit.spec.strategy.value: unit.state.value for unit in (h1, h2)},
    }
    loss.backward()
    facts["after_backward"] = sorted({unit.state.value for unit in program.units})
    facts["shard_numel"] = [unit.shard.numel() for unit in program.units]
    facts["padded_numel"] = [unit.layout.padded_numel for unit in program.units]
    return facts


def check_loss_fn_and_loading(rank: int, world: int) -> dict:
    """A model returning predictions, with loss_fn; then loading whole weights into the shards."""
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    errors, stats = {}, {}
    for backend in ("shardplan", "fsdp2"):
        model = copy.deepcopy(reference)
        plan = make_plan(
            model,
            [("0",), ("2",)],
            world,
            (ShardStrategy.FULL_SHARD, ShardStrategy.SHARD_OPTIMIZER),
            CHECKPOINTS[:2],
        )
        program = parallelize(model, plan, loss_fn=torch.nn.functional.mse_loss, backend=backend)
        x, y = (
            torch.randn(4 * world, 8, generator=torch.Generator().manual_seed(1)),
            torch.zeros(4 * world, 1),
        )
        before = program.last_step
        loss = program.step(x.chunk(world)[rank], y.chunk(world)[rank])
        stats[backend] = {
            "before": before,
            "step_time_s": program.last_step.step_time_s,
            "peak_bytes": program.last_step.peak_bytes,
            "predicted": program.last_step.predicted_peak_bytes == plan.predicted.peak_bytes,
        }
        expected = torch.nn.functional.mse_loss(reference(x), y)
        grads = torch.autograd.grad(expected, list(reference.parameters()))
        whole = {name: torch.randn(p.shape) for name, p in reference.named_parameters()}
        program.load_full_state_dict(whole)
        exported = program.export_full_state_dict()  # on rank 0, which compares
        loaded = exported if rank == 0 else whole
        errors[backend] = {
            "loss": abs(float(loss) - float(expected)),
            "grad_norm": abs(
                float(program.clip_grad_norm_(1e9))
                - float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads])))
            ),
            "load": max((loaded[name] - value).abs().max().item() for name, value in whole.items()),
            "inf_norm": abs(
                float(program.clip_grad_norm_(1e9, norm_type=float("inf")))
                - max(float(g.abs().max()) for g in grads)
            ),
        }
    return {"errors": errors, "stats": stats}


def check_communication(rank: int, world: int) -> dict:
    """Collectives per step with 2 micro-batches: gathers every micro-batch, gradients reduced once."""
    from shardplan.runtime import collectives

    build, groups = MODELS["gpt"]
    entry = build(world)
    plan = make_plan(
        entry.model, groups, world, (ShardStrategy.FULL_SHARD,), (Checkpoint.NONE,), micro_batches=2
    )
    program = parallelize(entry.model, plan)
    counts = {"all_gather": 0, "reduce_scatter_mean": 0, "all_reduce_mean": 0}
    originals = {name: getattr(collectives, name) for name in counts}

    def counting(name):
        def call(*args, **kwargs):
            before = collectives.issued()
            result = originals[name](*args, **kwargs)
            counts[name] += (
                collectives.issued() - before
            )  # over a group of one (no replica groups), none
            return result

        return call

    for name in counts:
        setattr(collectives, name, counting(name))
    try:
        mine = entry.args[0].chunk(world)[rank]
        program.step(mine, labels=mine)
    finally:
        for name, original in originals.items():
            setattr(collectives, name, original)
    return {"units": len(program.units), **counts}


def check_meta_hf(rank: int, world: int) -> dict:
    """A Hugging Face model on meta starts: its own _init_weights fills parameters and rotary buffers."""
    build, groups = MODELS["llama"]
    facts = {}
    for backend in ("shardplan", "fsdp2"):
        entry = build(world, device="meta")
        program = parallelize(
            entry.model,
            make_plan(entry.model, groups, world, STRATEGIES, CHECKPOINTS),
            backend=backend,
        )
        state = program.export_full_state_dict()  # on rank 0, which reports the results
        ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(rank))
        expected_inv_freq = build(world).model.model.rotary_emb.inv_freq
        inv_freq = (
            entry.model.model.rotary_emb.inv_freq
        )  # a buffer: whole on every rank, not exported
        facts[backend] = {
            "embedding_std": float(state["model.embed_tokens.weight"].std()) if state else None,
            "inv_freq_error": float((inv_freq - expected_inv_freq).abs().max()),
            "loss": float(program.step(ids, labels=ids)),
        }
    return facts


def check_errors(rank: int, world: int) -> dict:
    build, groups = MODELS["gpt"]
    errors = {}
    attempts = {
        "pp": lambda model: make_plan(model, groups, world // 2, STRATEGIES, CHECKPOINTS, pp=2),
        "missing": lambda model: make_plan(model, groups[:-1], world, STRATEGIES, CHECKPOINTS),
        "dp": lambda model: make_plan(model, groups, world + 1, STRATEGIES, CHECKPOINTS),
        "ranks_disagree": lambda model: make_plan(
            model, groups, world, (STRATEGIES[rank % 2],), CHECKPOINTS
        ),
    }
    for name, attempt in attempts.items():
        model = build(world).model
        try:
            parallelize(model, attempt(model))
            errors[name] = None
        except ShardplanError as error:
            errors[name] = [type(error).__name__, str(error)]
    tied_build, tied_groups = MODELS["gpt2-tied"]
    model = tied_build(world).model
    with warnings.catch_warnings(record=True) as caught:  # FSDP2 shards the tied units as one group
        warnings.simplefilter("always")
        parallelize(
            model, make_plan(model, tied_groups, world, STRATEGIES, CHECKPOINTS), backend="fsdp2"
        )
    errors["fsdp2_tied"] = [
        str(warning.message) for warning in caught if "tied across units" in str(warning.message)
    ]
    model = build(world).model
    try:  # FSDP2 would train the parameters in no unit in its root group, unplanned
        parallelize(
            model, make_plan(model, groups[:-1], world, STRATEGIES, CHECKPOINTS), backend="fsdp2"
        )
    except ShardplanError as error:
        errors["fsdp2_missing"] = [type(error).__name__, str(error)]
    model = build(world).model
    try:
        parallelize(model, make_plan(model, groups, world, STRATEGIES, CHECKPOINTS), backend="nope")
    except ShardplanError as error:
        errors["backend"] = [type(error).__name__, str(error)]
    return errors


def _all_checks(rank: int, world: int, cases: dict) -> dict:
    results = {name: run_case(rank, world, case) for name, case in cases.items()}
    results["reshard"] = check_reshard(rank, world)
    results["errors"] = check_errors(rank, world)
    results["loss_fn"] = check_loss_fn_and_loading(rank, world)
    results["meta_hf"] = check_meta_hf(rank, world)
    results["communication"] = check_communication(rank, world)
    return results


def _grid(models, strategies_checkpoints) -> dict:
    return {
        f"{model}/{strategy.value}/{checkpoint.value}": {
            "model": model,
            "strategies": (strategy,),
            "checkpoints": (checkpoint,),
        }
        for model in models
        for strategy, checkpoint in strategies_checkpoints
    }


EVERY_PAIR = [(strategy, checkpoint) for strategy in STRATEGIES for checkpoint in CHECKPOINTS]
DIAGONAL = [
    (strategy, CHECKPOINTS[index % len(CHECKPOINTS)]) for index, strategy in enumerate(STRATEGIES)
]
MIXED = {"strategies": STRATEGIES, "checkpoints": CHECKPOINTS}
"""Every unit a different strategy and checkpointing: interactions between neighbours."""

WORLD2_CASES = {
    **_grid(["gpt", "llama"], EVERY_PAIR),
    "gpt/mixed/micro_batches2/clip/offload": {
        "model": "gpt",
        **MIXED,
        "micro_batches": 2,
        "clip": 0.05,
        "offload": (True, True, False, False),  # the sharded strategies offload
        "prefetch": (True, True, False),
    },
    "llama/mixed/micro_batches2/clip": {
        "model": "llama",
        **MIXED,
        "micro_batches": 2,
        "clip": 0.05,
    },
    # an epoch's last batch: 3 of the planned 4 samples a rank, in micro-batches of 2 and 1
    "gpt/mixed/smaller_batch": {
        "model": "gpt",
        **MIXED,
        "micro_batches": 2,
        "planned_batch": 4,
        "batch": 3,
    },
    "fsdp2/gpt/smaller_batch": {
        "model": "gpt",
        **MIXED,
        "micro_batches": 2,
        "planned_batch": 4,
        "batch": 3,
        "backend": "fsdp2",
    },
    "gpt/meta_init": {"model": "gpt", **MIXED, "meta": True},
    "gpt/bfloat16": {"model": "gpt", **MIXED, "param_dtype": "bfloat16", "tolerance": 3e-2},
    "gpt2-tied/full_shard": {
        "model": "gpt2-tied",
        "strategies": (ShardStrategy.FULL_SHARD,),
        "checkpoints": CHECKPOINTS,
    },
    "fsdp2/gpt/full_shard/none": {
        "model": "gpt",
        "strategies": (ShardStrategy.FULL_SHARD,),
        "checkpoints": (Checkpoint.NONE,),
        "backend": "fsdp2",
    },
    "fsdp2/gpt/mixed/micro_batches2/clip": {
        "model": "gpt",
        **MIXED,
        "backend": "fsdp2",
        "micro_batches": 2,
        "clip": 0.05,
    },
    "fsdp2/llama/mixed": {"model": "llama", **MIXED, "backend": "fsdp2"},
    **{
        f"fsdp2/{model}/full_shard/selective_alternate": {
            "model": model,
            "strategies": (ShardStrategy.FULL_SHARD,),
            "checkpoints": (Checkpoint.SELECTIVE_ALTERNATE,),
            "backend": "fsdp2",
        }
        for model in ("gpt", "llama")
    },
}
WORLD4_CASES = {
    # every strategy and every checkpointing at 4 shards (uneven chunks, other padding); every pair of
    # them trains at world 2, where a pair's interplay is the same
    **_grid(["gpt", "llama"], DIAGONAL),
    "gpt/mixed/micro_batches2/clip": {"model": "gpt", **MIXED, "micro_batches": 2, "clip": 0.05},
    "fsdp2/gpt/mixed": {"model": "gpt", **MIXED, "backend": "fsdp2"},
}


def _assert_runtime_facts(results: dict, world: int) -> None:
    reshard = results["reshard"]
    assert reshard["after_forward"] == {"full_shard": "sharded", "shard_grad_op": "gathered"}
    assert reshard["h2_while_h1_computes"] == "gathering"  # prefetched
    assert not reshard["h1_buffer_alive_after_forward"]  # saved tensors hold handles, not views
    assert reshard["after_backward"] == ["sharded"]
    assert all(
        padded == shard * world
        for shard, padded in zip(reshard["shard_numel"], reshard["padded_numel"])
    )
    for backend, errors in results["loss_fn"]["errors"].items():
        assert max(errors.values()) <= TOLERANCE, (backend, errors)
    for backend, stats in results["loss_fn"]["stats"].items():  # CPU: no allocator counts the peak
        assert (
            stats["before"] is None and stats["step_time_s"] > 0 and stats["peak_bytes"] is None
        ), (backend, stats)
        assert stats["predicted"], (backend, stats)
    for backend, facts in results["meta_hf"].items():
        # initializer_range 0.02; ln(vocab 512) = 6.24 at initialization
        assert abs(facts["embedding_std"] - 0.02) < 2e-3 and facts["inv_freq_error"] == 0, (
            backend,
            facts,
        )
        assert 5.5 < facts["loss"] < 7.0, (backend, facts)
    communication = results["communication"]
    units = communication["units"]
    # FULL_SHARD: each unit gathered in forward and again in backward, and its gradient
    # reduce-scattered, in each of 2 micro-batches (see [Note: gradient accumulation]);
    # the loss all-reduced once
    assert communication == {
        "units": units,
        "all_gather": 4 * units,
        "reduce_scatter_mean": 2 * units,
        "all_reduce_mean": 1,
    }, communication
    errors = results["errors"]
    assert errors["pp"][0] == "PlanError" and "no input shapes" in errors["pp"][1]
    assert errors["missing"][0] == "PlanError" and "in no unit" in errors["missing"][1]
    assert errors["fsdp2_missing"][0] == "PlanError" and "in no unit" in errors["fsdp2_missing"][1]
    assert errors["dp"][0] == "ShardplanError" and f"dp_shard={world + 1}" in errors["dp"][1]
    assert errors["ranks_disagree"][0] == "RuntimeMismatchError"
    assert errors["backend"][0] == "ShardplanError" and "fsdp2" in errors["backend"][1]
    assert len(errors["fsdp2_tied"]) == 1 and "one group" in errors["fsdp2_tied"][0]


@pytest.mark.distributed
@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    "world, cases", [(2, WORLD2_CASES), (4, WORLD4_CASES)], ids=["world2", "world4"]
)
def test_parity(world, cases):
    results = spawn_world(world, _all_checks, (cases,))
    assert_parity(results, cases)
    _assert_runtime_facts(results, world)


# no processes


def test_flat_layout_pads_to_equal_shards_and_splits_into_views():
    tensors = [torch.randn(3, 2), torch.randn(5)]
    layout = FlatLayout.of("u", [("a", tensors[0]), ("b", tensors[1])], dp=4)
    assert (layout.padded_numel, layout.shard_numel, layout.padding_numel) == (12, 3, 1)
    flat = layout.flatten(tensors)
    assert flat[-1] == 0
    views = layout.split(flat)
    assert all(torch.equal(view, tensor) for view, tensor in zip(views, tensors))
    assert views[1].untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    assert torch.equal(torch.cat([flat[layout.shard_slice(rank)] for rank in range(4)]), flat)


def test_flat_layout_rejects_mixed_dtypes():
    with pytest.raises(ShardplanError, match="mixes parameter dtypes"):
        FlatLayout.of(
            "u", [("a", torch.zeros(2)), ("b", torch.zeros(2, dtype=torch.bfloat16))], dp=2
        )


def test_split_micro_batches_splits_every_batched_tensor():
    ids, scalar = torch.arange(8).view(4, 2), torch.tensor(3.0)
    parts = split_micro_batches((ids,), {"labels": ids, "scale": scalar, "flag": True}, 2)
    assert [
        torch.equal(args[0], ids[2 * i : 2 * i + 2]) for i, (args, _, _) in enumerate(parts)
    ] == [True, True]
    assert parts[1][1]["scale"] is scalar and parts[1][1]["flag"] is True
    assert [
        (args[0].shape[0], share) for args, _, share in split_micro_batches((ids[:3],), {}, 2)
    ] == [(2, 2 / 3), (1, 1 / 3)]
    assert [args[0].shape[0] for args, _, _ in split_micro_batches((ids[:1],), {}, 2)] == [1]
    with pytest.raises(RuntimeMismatchError, match="one batch size"):
        split_micro_batches((ids,), {"mask": ids[:2]}, 2)


def test_parallelize_needs_a_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    entry = zoo.gpt()
    plan = make_plan(entry.model, MODELS["gpt"][1], 1, STRATEGIES, CHECKPOINTS)
    with pytest.raises(ShardplanError, match="init_process_group"):
        parallelize(entry.model, plan)
    assert PlanError.__mro__[1] is ShardplanError
