"""The loss on vocabulary-sharded logits ([Note: loss on sharded logits] in
shardplan/runtime/vocab_parallel_loss.py): a Hugging Face Llama under a vocab-parallel plan trains as one
process does, on both backends, with padded (ignored) labels; its peak memory is predicted within 3 % in
float32 and in bf16 mixed precision, half the logits below the same plan with the logits gathered whole.

Pipelines and dp × tp meshes run it too: tests/test_mesh_runtime.py and tests/test_fsdp2_pipeline.py train
Llama's sequence- and vocab-parallel plans, which compute the loss on the slices.
"""

import copy
import json

import pytest
import torch
from parity import spawn_world, train_next_to_reference

from shardplan import get_hardware
from shardplan.calibration.accuracy import Workload, compare, measure_plans
from shardplan.compile import evaluate
from shardplan.errors import PlanError
from shardplan.frontend.passes import analyze
from shardplan.models import zoo
from shardplan.plan import BF16_MIXED, SCHEMA, MixedPrecision, Plan
from shardplan.runtime import parallelize
from shardplan.runtime.manual import manual_plan

UNITS = [
    ("model.embed_tokens",),
    ("model.layers.0",),
    ("model.layers.1",),
    ("model.norm", "lm_head"),
]
PADDED = 5
"""Tokens at the end of every sequence whose labels are ignored (-100), as a collator pads them."""


def _llama():
    return zoo.hf_llama(
        n_layer=2, d_model=64, ffn=128, heads=4, kv_heads=2, vocab=128, batch=2, seq=16
    )


def _ignore_padding(module, args, kwargs):
    labels = kwargs.get("labels")
    if labels is not None:
        padding = torch.arange(labels.shape[-1]) >= labels.shape[-1] - PADDED
        kwargs = {**kwargs, "labels": labels.masked_fill(padding, -100)}
    return args, kwargs


def _padded_llama():
    """The tiny Llama whose labels lose their last PADDED tokens to ignore_index (in its own graph)."""
    entry = _llama()
    entry.model.register_forward_pre_hook(_ignore_padding, with_kwargs=True)
    return entry


CASES = {
    "shardplan tp2 vocab": (dict(dp=1, tp=2, vocab_parallel=True), "shardplan"),
    "fsdp2 tp2 sp vocab": (dict(dp=1, tp=2, sequence_parallel=True, vocab_parallel=True), "fsdp2"),
}


def train_cases(rank: int, world: int, plan_jsons: dict[str, str]) -> dict:
    """Each case: three AdamW steps next to one process on the whole batch; then the logits the program
    returns with labels (this rank's slice) and without (whole, as one process computes them)."""
    results = {}
    for name, plan_json in plan_jsons.items():
        torch.manual_seed(0)
        entry = _padded_llama()
        reference, model = entry.model, copy.deepcopy(entry.model)
        program = parallelize(model, Plan.from_json(plan_json), backend=CASES[name][1])
        batches = [
            (ids, ids)
            for ids in (
                torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(step))
                for step in range(3)
            )
        ]
        errors = train_next_to_reference(program, reference, batches)
        ids = batches[0][0]
        with torch.no_grad():
            errors["sliced_logits"] = tuple(program(ids, labels=ids).logits.shape)
            whole = program(ids).logits
            errors["whole_logits_error"] = (whole - reference(ids).logits).abs().max().item()
        results[name] = errors
    return results


@pytest.fixture(scope="module")
def parity():
    entry = _padded_llama()
    plans = {
        name: manual_plan(
            entry.model, UNITS, example_inputs=entry.args, example_kwargs=entry.kwargs, **mesh
        )
        for name, (mesh, _) in CASES.items()
    }
    assert all(plan.tensor_parallel.loss_parallel for plan in plans.values())
    return spawn_world(2, train_cases, ({name: plan.to_json() for name, plan in plans.items()},))


@pytest.mark.distributed
@pytest.mark.parametrize("name", CASES)
def test_the_loss_on_sharded_logits_trains_like_one_process(parity, name):
    errors = parity[name]
    assert errors["loss_error"] <= 1e-5 and errors["param_error"] <= 1e-5, errors
    # with labels the model returns this rank's half of the vocabulary; without, the whole logits
    assert errors["sliced_logits"] == (2, 16, 64)
    assert errors["whole_logits_error"] <= 1e-5


def test_the_plan_says_which_loss_runs_and_the_runtime_holds_it():
    gpt = zoo.gpt(zoo.GPTConfig(n_layer=1))
    gpt_plan = manual_plan(
        gpt.model,
        [("wte", "wpe"), ("h.0",), ("ln_f", "lm_head")],
        dp=1,
        tp=2,
        vocab_parallel=True,
        example_inputs=gpt.args,
        example_kwargs=gpt.kwargs,
    )
    # the zoo GPT's loss is its own code: its logits are gathered before it, and the plan says so
    assert not gpt_plan.tensor_parallel.loss_parallel
    assert "the head's logits gathered whole before the loss" in gpt_plan.summary()
    llama = _llama()
    plan = manual_plan(
        llama.model,
        UNITS,
        dp=1,
        tp=2,
        vocab_parallel=True,
        example_inputs=llama.args,
        example_kwargs=llama.kwargs,
    )
    assert "the loss on the head's vocabulary slices" in plan.summary()
    with pytest.raises(PlanError, match="loss_parallel"):
        Plan.from_json(plan.to_json().replace('"vocab_parallel": true', '"vocab_parallel": false'))
    # a format 6 plan, written before the loss could run on the slices, gathers the logits as priced
    older = json.loads(plan.to_json())
    older["schema"] = "shardplan.plan/6"
    del older["tensor_parallel"]["loss_parallel"]
    loaded = Plan.from_json(json.dumps(older))
    assert loaded.schema == SCHEMA and not loaded.tensor_parallel.loss_parallel


MEMORY_WORKLOAD = Workload(
    name="hf-llama",
    options=(
        ("n_layer", 2),
        ("d_model", 256),
        ("ffn", 688),
        ("vocab", 8192),
        ("batch", 2),
        ("seq", 128),
    ),
)
"""A vocabulary large beside the model: 2 x 128 tokens' float32 logits are 8 MiB, the hidden states 0.25."""
LOGITS_BYTES = 2 * 128 * 8192 * 4


@pytest.mark.distributed
def test_predicted_peak_memory_within_3_percent_half_the_logits_below_gathering():
    entry = MEMORY_WORKLOAD.build()
    plans, chains, drops = [], [], {}
    for precision in (MixedPrecision(), BF16_MIXED):
        chain = analyze(entry.model, entry.args, entry.kwargs, compute_dtype=precision.param_dtype)
        sharded, gathered = (
            manual_plan(
                entry.model,
                MEMORY_WORKLOAD.units(chain),
                dp=1,
                tp=2,
                vocab_parallel=True,
                loss_parallel=loss_parallel,
                precision=precision,
                example_inputs=entry.args,
                example_kwargs=entry.kwargs,
            )
            for loss_parallel in (True, False)
        )
        assert sharded.tensor_parallel.loss_parallel
        hardware = get_hardware("cpu-gloo")
        drops[precision.param_dtype] = (
            evaluate(chain, gathered, hardware).peak_bytes
            - evaluate(chain, sharded, hardware).peak_bytes
        )
        plans.append(sharded)
        chains.append(chain)
    # each rank holds half the float32 logits; in bf16 mixed precision half the bf16 logits too, and half
    # of their float copy for the loss (measured: 8.4 MB less in both, the bf16 prediction 1.5x that)
    assert abs(drops["float32"] / (LOGITS_BYTES / 2) - 1) < 0.001, drops
    assert abs(drops["bfloat16"] / (LOGITS_BYTES * 3 / 4) - 1) < 0.001, drops
    _, measured = measure_plans(plans, 2, 0, progress=False, workload=MEMORY_WORKLOAD)
    ratios = {
        plan.mixed_precision.param_dtype: compare(
            chain, [plan], [found], get_hardware("cpu-gloo"), ["tp2 vocab"]
        )[0].memory_ratio
        for chain, plan, found in zip(chains, plans, measured)
    }
    assert all(abs(ratio - 1) <= 0.03 for ratio in ratios.values()), ratios
