"""compile / solve end to end on the zoo: valid, deterministic, never worse than the expert defaults."""

import dataclasses
import math
import re

import pytest
import torch

from shardplan.common.dtypes import dtype_name
from shardplan.common.sizes import parse_bytes
from shardplan.compile import compile, evaluate, solve
from shardplan.costmodel.hardware import get_hardware
from shardplan.errors import InfeasibleError, PlanError, ShardplanError
from shardplan.models import zoo
from shardplan.plan import Checkpoint, Mesh, MixedPrecision, Plan, Schedule, ShardStrategy
from shardplan.solver.assemble import predict, tensor_parallel_section
from shardplan.solver.explain import expert_defaults
from shardplan.solver.search import Configuration, Setting, search, tensor_parallel_options
from shardplan.solver.space import Constraints, default_space, resolve_rules

WORLD = 8
HARDWARE = "cpu-gloo"


@pytest.fixture(scope="module")
def chains():
    from shardplan.frontend.passes import analyze

    torch.set_num_threads(1)
    found = {}
    for name in ("gpt", "mlp", "cnn", "encoder-decoder"):
        entry = zoo.build(name)
        found[name] = analyze(entry.model, entry.args, entry.kwargs)
    return found


def test_compile_gives_a_valid_deterministic_plan_over_every_parameter():
    torch.set_num_threads(1)
    entry = zoo.gpt()
    first = compile(entry.model, WORLD, entry.args, entry.kwargs, hardware=HARDWARE)
    again = compile(entry.model, WORLD, entry.args, entry.kwargs, hardware=HARDWARE)
    assert first.to_json() == again.to_json()
    assert Plan.from_json(first.to_json()) == first
    assert first.mesh.dp * first.mesh.pp == WORLD
    assert sorted(p for u in first.units for p in u.params) == sorted(
        n for n, _ in entry.model.named_parameters()
    )
    assert first.model == "GPT"
    assert first.predicted.peak_bytes == sum(first.predicted.memory_bytes.values())
    assert math.isclose(
        first.predicted.step_time_s, sum(first.predicted.time_s.values()), rel_tol=1e-9
    )
    assert first.predicted.peak_bytes <= first.reasoning.budget_bytes
    assert any("expert default" in alt.description for alt in first.reasoning.runner_ups)


@pytest.mark.parametrize("fraction", [1.0, 0.75, 0.5])
def test_never_slower_than_the_expert_defaults_at_equal_budget(chains, fraction):
    hw = get_hardware(HARDWARE)
    for name, chain in chains.items():
        dtype = dtype_name(chain.param_dtype)
        precision = MixedPrecision(param_dtype=dtype, reduce_dtype=dtype)
        setting = Setting(
            world_size=WORLD, batch_size=chain.inputs[0].shape[0], mixed_precision=precision
        )
        defaults = expert_defaults(chain, setting, hw)
        budget = int(defaults[0][1].peak_bytes * fraction)
        fitting = [step for _, step in defaults if step.peak_bytes <= budget]
        try:
            plan = solve(chain, WORLD, hardware=hw, memory_budget=budget, near_tie=0)
        except InfeasibleError:
            assert not fitting, (
                name
            )  # the defaults are in the search space: if one fits, a plan exists
            continue
        for step in fitting:
            assert plan.predicted.step_time_s <= step.step_time_s * (1 + 1e-9), name


def test_replanning_from_the_cached_chain_is_deterministic_and_respects_the_budget(chains):
    chain = chains["gpt"]
    loose = solve(chain, WORLD, hardware=HARDWARE)
    budget = loose.predicted.peak_bytes * 3 // 4
    tight = solve(chain, WORLD, hardware=HARDWARE, memory_budget=budget)
    assert tight.predicted.peak_bytes <= budget
    assert tight.predicted.step_time_s >= loose.predicted.step_time_s
    assert tight.reasoning.binding_constraint.startswith("memory")
    assert solve(chain, WORLD, hardware=HARDWARE, memory_budget=budget).to_json() == tight.to_json()
    assert tight.diff(loose)


def test_a_replan_without_reasoning_is_the_same_plan(chains):
    import dataclasses

    for hardware in (HARDWARE, "h100-80g"):
        explained = solve(chains["gpt"], WORLD, hardware=hardware, memory_budget="6MiB")
        bare = solve(chains["gpt"], WORLD, hardware=hardware, memory_budget="6MiB", explain=False)
        assert explained.reasoning.runner_ups and not bare.reasoning.runner_ups
        assert "explain=False" in bare.reasoning.binding_constraint
        assert (
            dataclasses.replace(bare, reasoning=explained.reasoning).to_json()
            == explained.to_json()
        )


def test_infeasible_names_the_smallest_budget_and_what_would_fit(chains):
    chain = chains["gpt"]
    with pytest.raises(
        InfeasibleError, match=r"no plan fits .* smallest peak any plan reaches .* GiB would fit"
    ) as caught:
        solve(chain, 2, hardware=HARDWARE, memory_budget=4096, allow_pipeline=False)
    assert "raise memory_budget" in str(caught.value)  # nothing at all fits 4 KiB
    # the smallest peak it names is the one: a budget just above it fits (with a plan that peaks no lower,
    # up to the message's 3-digit rounding), one just below does not
    smallest = parse_bytes(
        re.search(r"smallest peak any plan reaches is ([\d.]+ \w+)", str(caught.value)).group(1)
    )
    assert (
        solve(
            chain, 2, hardware=HARDWARE, memory_budget=int(smallest * 1.01), allow_pipeline=False
        ).predicted.peak_bytes
        >= smallest * 0.995
    )
    with pytest.raises(InfeasibleError, match="it would fit with"):  # and names what would fit it
        solve(chain, 2, hardware=HARDWARE, memory_budget=int(smallest * 0.99), allow_pipeline=False)


def test_constraints_reach_the_plan(chains):
    chain = chains["gpt"]
    plan = solve(
        chain,
        WORLD,
        hardware=HARDWARE,
        allow_pipeline=False,
        constraints=Constraints(
            unit_boundary=(r"^h\.2$",), checkpoint=((r"^h\.1$", (Checkpoint.FULL,)),)
        ),
    )
    assert any(u.modules[0] == "h.2" for u in plan.units)
    assert all(u.checkpoint is Checkpoint.FULL for u in plan.units if "h.1" in u.modules)


@pytest.mark.parametrize("mode", [Checkpoint.SELECTIVE, Checkpoint.SELECTIVE_ALTERNATE])
def test_a_selective_mode_pinned_by_a_constraint_is_planned_with_pipelines_searched(chains, mode):
    """The zero-bubble schedule runs no selective checkpointing: its configurations leave a pinned block
    no decision, and are passed over rather than solved."""
    plan = solve(
        chains["gpt"],
        WORLD,
        hardware=HARDWARE,
        constraints=Constraints(checkpoint=(("TransformerBlock", (mode,)),)),
    )
    pinned = [unit for unit in plan.units if unit.modules[0].startswith("h.")]
    assert pinned and all(unit.checkpoint is mode for unit in pinned)


def test_constraints_match_module_classes_and_refuse_patterns_that_match_nothing(chains):
    chain = chains["gpt"]
    assert chain.module_classes["h.0"] == "TransformerBlock"
    plan = solve(
        chain,
        2,
        hardware=HARDWARE,
        allow_pipeline=False,
        constraints=Constraints(unit_boundary=("TransformerBlock",)),
    )
    starts = {u.modules[0] for u in plan.units}
    assert {"h.0", "h.1", "h.2", "h.3"} <= starts
    with pytest.raises(
        ShardplanError,
        match=r"unit_boundary='LlamaDecoderLayer' matches no block.*"
        r"h\.0 \(TransformerBlock\)",
    ):
        solve(
            chain,
            2,
            hardware=HARDWARE,
            constraints=Constraints(unit_boundary=("LlamaDecoderLayer",)),
        )


def test_infeasibility_caused_by_constraints_names_them(chains):
    chain = chains["gpt"]
    replicated = Constraints(strategy=((r"^h\.", (ShardStrategy.REPLICATE,)),))
    with pytest.raises(InfeasibleError, match=r"smallest peak any plan reaches is") as refused:
        solve(chain, 2, hardware=HARDWARE, allow_pipeline=False, memory_budget=1)
    with pytest.raises(
        InfeasibleError, match=r"smallest peak any plan reaches is ([0-9.]+) MiB"
    ) as pinned:
        solve(
            chain,
            2,
            hardware=HARDWARE,
            allow_pipeline=False,
            constraints=replicated,
            memory_budget=1,
        )
    least, least_replicated = (
        float(re.search(r"reaches is ([0-9.]+) MiB", str(error.value)).group(1))
        for error in (refused, pinned)
    )
    budget = f"{(least + least_replicated) / 2:.2f} MiB"
    assert least < least_replicated
    with pytest.raises(
        InfeasibleError, match=r"under the constraints, and one fits without them: relax strategy="
    ):
        solve(
            chain,
            2,
            hardware=HARDWARE,
            allow_pipeline=False,
            constraints=replicated,
            memory_budget=budget,
        )


def test_predictions_name_every_unit_with_its_memory_and_compute(chains):
    plan = solve(chains["gpt"], 2, hardware=HARDWARE, allow_pipeline=False, memory_budget="4MiB")
    units = plan.predicted.units
    assert [u.unit for u in units] == [u.name for u in plan.units]
    assert max(max(u.forward_bytes, u.backward_bytes) for u in units) <= plan.predicted.peak_bytes
    assert min(u.forward_bytes for u in units) > 0
    per_micro_batch = sum(u.compute_s for u in units)
    assert math.isclose(
        per_micro_batch * plan.schedule.num_micro_batches,
        plan.predicted.time_s["compute"] + plan.predicted.time_s["recompute"],
        rel_tol=1e-9,
    )
    assert Plan.from_json(plan.to_json()) == plan


def test_a_global_batch_is_split_over_the_replicas_in_the_plan_and_its_fingerprint():
    from shardplan.frontend.passes import analyze, fingerprint_of

    torch.set_num_threads(1)
    entry = zoo.gpt()  # captured at 4 sequences a replica
    plan = compile(
        entry.model,
        4,
        entry.args,
        entry.kwargs,
        hardware=HARDWARE,
        global_batch_size=8,
        allow_pipeline=False,
    )
    assert plan.mesh.dp == 4 and [spec.shape for spec in plan.inputs] == [(2, 32), (2, 32)]
    assert (
        plan.batch_per_replica == 2
        and "global batch 8 samples a step = 4 data-parallel ranks x 2" in plan.summary()
    )
    assert plan.fingerprint == fingerprint_of(entry.model, plan.inputs)
    again = evaluate(analyze(entry.model, entry.args, entry.kwargs), plan)
    assert (
        again.peak_bytes == plan.predicted.peak_bytes
        and again.step_time_s == plan.predicted.step_time_s
    )


def test_a_batch_no_mesh_takes_is_named_as_the_cause_not_memory(chains):
    """No plan at any budget: the message says why, where it once said "raise memory_budget"."""
    with pytest.raises(InfeasibleError) as refused:
        solve(chains["gpt"], 2, hardware=HARDWARE, global_batch_size=7, allow_pipeline=False)
    assert str(refused.value) == (
        "the global batch of 7 samples splits evenly over none of the data-parallel degrees "
        "searched at world_size=2 (2): give a global batch one of them divides (e.g. 8); or "
        "allow_pipeline=True, whose stages leave fewer replicas"
    )
    assert (
        solve(chains["gpt"], 2, hardware=HARDWARE, global_batch_size=7).mesh.pp == 2
    )  # as it says
    entry = zoo.residual_mlp(batch=0)
    with pytest.raises(
        ShardplanError, match=r"^the example batch is empty \(dim 0 of the first input is 0\)"
    ):
        compile(entry.model, 2, entry.args, entry.kwargs, hardware=HARDWARE)
    from shardplan.frontend.passes import analyze

    with pytest.raises(
        ShardplanError, match=r"^the example batch is empty"
    ):  # the analysis alone (elastic, demo)
        analyze(entry.model, entry.args, entry.kwargs)
    with pytest.raises(
        InfeasibleError, match=r"^the example batch is empty"
    ):  # a chain analyzed elsewhere
        solve(
            dataclasses.replace(
                chains["mlp"],
                inputs=tuple(
                    dataclasses.replace(spec, shape=(0, *spec.shape[1:]))
                    for spec in chains["mlp"].inputs
                ),
            ),
            2,
            hardware=HARDWARE,
        )
    with pytest.raises(
        ShardplanError, match="global_batch_size=0 trains no samples"
    ):  # not taken as None
        solve(chains["gpt"], 2, hardware=HARDWARE, global_batch_size=0)


def test_bad_arguments_are_refused(chains):
    with pytest.raises(ShardplanError, match="world_size"):
        solve(chains["gpt"], 0, hardware=HARDWARE)
    with pytest.raises(ShardplanError, match="optimizer"):
        solve(chains["gpt"], 2, hardware=HARDWARE, optimizer="lion")
    with pytest.raises(ShardplanError, match="memory size"):
        solve(chains["gpt"], 2, hardware=HARDWARE, memory_budget="lots")
    with pytest.raises(
        ShardplanError, match="max_tensor_parallel=0 leaves no tensor-parallel degree"
    ):
        solve(
            chains["gpt"], 2, hardware=HARDWARE, max_tensor_parallel=0
        )  # not taken as the default


def test_a_skip_connection_crossing_a_stage_boundary_is_sent_too(chains):
    from shardplan.solver.search import boundary_bytes

    chain = chains["encoder-decoder"]
    edges = chain.skip_edges
    i, j = edges[0]
    crossing = boundary_bytes(chain.blocks, edges)
    assert crossing[j] == chain.blocks[j - 1].output_bytes + chain.blocks[i].output_bytes
    assert crossing[i + 1] == chain.blocks[i].output_bytes


def test_a_bound_within_rounding_of_a_plans_time_keeps_that_plan(chains):
    """Search bounds come from plans walked event by event (the simple plans' guesses), while the
    DP sums the same times in another order: a plan as fast as the bound up to the last bits is
    kept (it once turned a plan that fit into an InfeasibleError)."""
    hw = get_hardware(HARDWARE)
    for name, chain in chains.items():
        dtype = dtype_name(chain.param_dtype)
        precision = MixedPrecision(param_dtype=dtype, reduce_dtype=dtype)
        setting = Setting(
            world_size=WORLD, batch_size=chain.inputs[0].shape[0], mixed_precision=precision
        )
        rules, space = resolve_rules(chain.blocks, None), default_space(len(chain.blocks))
        best = search(chain.blocks, rules, setting, hw, hw.usable_memory_bytes, space)[0]
        walked_s = predict(chain, best, setting, hw).step_time_s
        assert math.isclose(walked_s, best.step_time_s, rel_tol=1e-12)
        for bound_s in (walked_s, best.step_time_s * (1 - 1e-12)):
            again = search(
                chain.blocks,
                rules,
                setting,
                hw,
                hw.usable_memory_bytes,
                space,
                time_bound_s=bound_s,
            )
            assert again and again[0].step_time_s == best.step_time_s, name


def test_captured_layers_carry_their_tensor_parallel_facts_and_cpu_plans_keep_tp_1(chains):
    chain = chains["gpt"]
    layer = next(b for b in chain.blocks if b.name == "h.0")
    facts = layer.tensor_parallel
    n_embd = 64  # zoo.GPTConfig's width
    assert (
        facts.divides == 4 and facts.sequence_layer and facts.all_reduces == 4
    )  # 4 heads, two pairs
    assert dict(facts.sharded) == {
        "h.0.attn.qkv": "colwise_fused(3)",
        "h.0.attn.proj": "rowwise",
        "h.0.mlp.fc": "colwise",
        "h.0.mlp.proj": "rowwise",
    }
    # every parameter but the norms' and the row-parallel linears' biases
    assert facts.sliced_numel == layer.param_numel - 4 * n_embd - 2 * n_embd
    assert (
        facts.sliced_fwd_flops == layer.fwd_flops
    )  # the norms' FLOPs are not counted: every counted op slices
    # saved for backward: the qkv, attention, fc and GELU outputs slice (12 hidden states); the norms'
    # outputs, the pairs' inputs, stay whole, under sequence parallelism too (gathered before the pair)
    hidden = chain.inputs[0].shape[0] * chain.inputs[0].shape[1] * n_embd * 4
    assert (facts.sliced_saved_bytes, facts.gathered_saved_bytes) == (12 * hidden, 2 * hidden)
    assert (
        facts.exchange_bytes == hidden
    )  # exchanged whole around each pair, and whole in its transients under sp
    # its backward peaks at the MLP's row-parallel linear: the gradients of the GELU's output (4 hidden states)
    # and of its weight (4 n_embd x n_embd) divide over tp; its bias's, the rest of the transient, does not
    assert (
        facts.sliced_bwd_transient_bytes
        == 4 * hidden + 4 * n_embd * n_embd * 4
        == layer.bwd_transient_bytes - n_embd * 4
    )
    # under sequence parallelism that linear gathers its output gradient whole beside them; its backward is the
    # layer's first, so no parameter's gradient was made before the peak
    assert (
        facts.gathered_bwd_peak_bytes,
        layer.bwd_peak_grad_numel,
        facts.sliced_peak_grad_numel,
    ) == (hidden, 0, 0)
    assert chain.blocks[0].tensor_parallel.sharded == (
        ("wte", "vocab_embedding"),
    )  # wpe is no vocabulary table
    assert chain.blocks[-1].tensor_parallel.sharded == (("lm_head", "vocab_head"),)
    assert solve(chain, 4, hardware="cpu-gloo").mesh.tp == 1  # CPU ranks: tp only when asked
    # asked, without pipelines, and at a budget data parallelism alone cannot meet
    with pytest.raises(InfeasibleError):
        solve(chain, 4, hardware="cpu-gloo", allow_pipeline=False, memory_budget="1.5MiB")
    plan = solve(
        chain,
        4,
        hardware="cpu-gloo",
        max_tensor_parallel=4,
        allow_pipeline=False,
        memory_budget="1.5MiB",
    )
    assert plan.mesh.tp > 1 and plan.tensor_parallel.sharded


def test_tensor_parallel_across_nodes_is_refused_in_one_line(chains):
    with pytest.raises(
        ShardplanError,
        match=r"^max_tensor_parallel=16 would put tp groups across nodes of 8 "
        r"devices \(h100-80g\): use at most 8$",
    ):
        solve(chains["gpt"], 16, hardware="h100-80g", max_tensor_parallel=16)


def test_blocks_whose_heads_do_not_divide_stay_whole_with_the_reason(chains):
    import dataclasses

    chain = chains["gpt"]
    odd = dataclasses.replace(
        chain.blocks[3],
        tensor_parallel=dataclasses.replace(
            chain.blocks[3].tensor_parallel, divides=2, divisors=((2, "heads of h.1.attn.qkv"),)
        ),
    )
    chain = dataclasses.replace(chain, blocks=chain.blocks[:3] + (odd,) + chain.blocks[4:])
    section = tensor_parallel_section(
        chain, Configuration(mesh=Mesh(dp_shard=1, tp=4), schedule=Schedule())
    )
    assert [k.module for k in section.kept_whole] == [odd.name]
    assert section.kept_whole[0].reason == (
        "2 heads of h.1.attn.qkv do not divide by tp=4: tp must divide 2 to shard this block"
    )  # the layout's reason, one line
    assert not any(m.path.startswith(odd.name + ".") for m in section.sharded)
    assert tensor_parallel_options(chain.blocks, 4, 4) == (
        (1, False),
        (2, True),
        (4, False),
    )  # no sequence shard


def test_a_plan_slicing_a_block_whose_heads_do_not_divide_is_refused_in_one_line(chains):
    import dataclasses

    chain = chains["gpt"]
    plan = solve(
        chain,
        4,
        hardware="cpu-gloo",
        max_tensor_parallel=4,
        allow_pipeline=False,
        memory_budget="1.5MiB",
    )
    assert plan.mesh.tp > 1
    evaluate(chain, plan)  # as compiled: fine
    three = dataclasses.replace(
        plan,
        world_size=plan.mesh.size // plan.mesh.tp * 3,
        mesh=dataclasses.replace(plan.mesh, tp=3),
    )
    # the first block it slices: the token table, over the vocabulary
    with pytest.raises(
        PlanError,
        match=r"^the plan slices 'wte' over tp=3, but 256 rows of wte's table do not divide "
        r"by tp=3: tp must divide 256 to shard this block: choose such a tp, or list its "
        r"modules as kept whole$",
    ):
        evaluate(chain, three)


def test_a_compiled_tensor_parallel_section_is_the_layout_the_runtime_finds_again(chains):
    from shardplan.runtime.tensor_parallel import plan_layout

    entry = zoo.build("gpt")
    plan = solve(
        chains["gpt"],
        4,
        hardware="cpu-gloo",
        max_tensor_parallel=2,
        allow_pipeline=False,
        memory_budget="1.5MiB",
    )
    assert (
        plan.mesh.tp == 2
        and plan.tensor_parallel.sequence_parallel
        and plan.tensor_parallel.vocab_parallel
    )
    layout = plan_layout(entry.model, plan)  # raises if they differ
    assert [c.module for c in layout.vocab] == ["wte", "lm_head"]
    assert 2 * len(layout.pairs) + len(layout.vocab) == len(plan.tensor_parallel.sharded)


def test_the_search_offers_tensor_parallelism_inside_pipeline_stages():
    """The runtime runs tp > 1 with pp > 1 (backend shardplan): the search offers every tp x pp mesh that divides."""
    from shardplan.solver.search import Setting, configurations

    setting = Setting(
        world_size=64, batch_size=64, tensor_parallel=((1, False), (2, False), (4, True))
    )
    meshes = {(c.mesh.tp, c.mesh.pp) for c in configurations(setting, n_blocks=12)}
    assert {(2, 2), (2, 8), (4, 2), (4, 4)} <= meshes


def test_a_selectively_checkpointed_llama_peaks_where_the_runtime_measured():
    """probe_rank_peak.py --model llama --kind full_shard/selective: 54,128,428 bytes on rank 0 (MemTracker),
    in a layer's MLP backward after its recompute dropped the query, key and output projections it kept,
    with the layer's output gradient and its down projection's weight gradient live (benchmarks/probe_rank_peak.py)."""
    from shardplan.calibration.accuracy import KINDS, demo_chain_and_plans, hf_workload

    chain, plans = demo_chain_and_plans(2, hf_workload("llama"))
    plan = plans[KINDS.index((ShardStrategy.FULL_SHARD, Checkpoint.SELECTIVE))]
    assert evaluate(chain, plan, "cpu-gloo").peak_bytes == pytest.approx(54_128_428, abs=512)
