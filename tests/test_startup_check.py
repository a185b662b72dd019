"""parallelize's start-up check: the structural signature refuses a plan made for another model without
capturing the model; the graph is captured only where asked, for an older plan, or where tp > 1 needs it."""

import dataclasses

import pytest
import torch
import torch.nn as nn

from shardplan import PlanError, parallelize
from shardplan.frontend.signature import model_signature
from shardplan.models import zoo
from shardplan.runtime.manual import manual_plan
from shardplan.runtime.model_check import check_model
from shardplan.runtime.tensor_parallel import plan_layout


@pytest.fixture
def captures(monkeypatch) -> list[str]:
    """The captures of the model made while the test runs (torch.export, or fx's fallback), by kind."""
    calls: list[str] = []
    export, trace = torch.export.export, torch.fx.symbolic_trace

    def spied_export(*args, **kwargs):
        calls.append("export")
        return export(*args, **kwargs)

    def spied_trace(*args, **kwargs):
        calls.append("symbolic_trace")
        return trace(*args, **kwargs)

    monkeypatch.setattr(torch.export, "export", spied_export)
    monkeypatch.setattr(torch.fx, "symbolic_trace", spied_trace)
    return calls


class _OtherLayerNorm(nn.LayerNorm):
    pass


def _one_shape_changed():
    entry = zoo.gpt()
    entry.model.h[1].mlp.fc = nn.Linear(
        entry.model.h[1].mlp.fc.in_features, entry.model.h[1].mlp.fc.out_features + 8
    )
    return entry.model


def _renamed():
    entry = zoo.gpt()
    entry.model.add_module("final_norm", entry.model.ln_f)
    del entry.model.ln_f
    return entry.model


def _other_class():
    entry = zoo.gpt()
    norm = entry.model.ln_f
    entry.model.ln_f = _OtherLayerNorm(norm.normalized_shape, eps=norm.eps)
    return entry.model


def _frozen():
    entry = zoo.gpt()
    entry.model.wte.weight.requires_grad_(False)
    return entry.model


@pytest.mark.parametrize(
    "other",
    [_one_shape_changed, _renamed, _other_class, _frozen],
    ids=["one parameter's shape", "a renamed module", "another class", "a frozen parameter"],
)
def test_a_plan_for_another_model_is_refused_by_its_signature_without_a_capture(
    other, gpt_plan, world_of_one, captures
):
    model = other()
    with pytest.raises(
        PlanError, match=r"made for another model: its structural signature .* re-plan"
    ):
        parallelize(model, gpt_plan)
    assert captures == []


def test_the_same_model_is_accepted_without_a_capture(gpt_plan, world_of_one, captures):
    entry = zoo.gpt()
    program = parallelize(entry.model, gpt_plan)
    assert captures == []
    assert torch.isfinite(program.step(*entry.args, **entry.kwargs))


class _Scaled(nn.Module):
    """Two linears whose forward doubles or not: the same parameters, another computation."""

    def __init__(self, doubles: bool):
        super().__init__()
        self.first, self.second = nn.Linear(8, 16), nn.Linear(16, 8)
        self.doubles = doubles

    def forward(self, x):
        hidden = self.first(x) * (2.0 if self.doubles else 1.0)
        return self.second(torch.relu(hidden)).square().mean()


def test_verify_graph_captures_and_refuses_the_same_parameters_computing_otherwise(
    world_of_one, captures
):
    x = torch.randn(4, 8)
    plan = manual_plan(_Scaled(doubles=False), [("first",), ("second",)], dp=1, example_inputs=(x,))
    other = _Scaled(doubles=True)
    assert model_signature(other) == plan.signature
    captures.clear()
    parallelize(other, plan)  # the signature cannot tell them apart
    assert captures == []
    with pytest.raises(
        PlanError, match=r"made for another model: its graph fingerprint .* re-plan"
    ):
        parallelize(_Scaled(doubles=True), plan, verify_graph=True)
    assert "export" in captures
    parallelize(_Scaled(doubles=False), plan, verify_graph=True)


def test_a_plan_without_a_signature_is_checked_by_its_graph(gpt_plan, world_of_one, captures):
    older = dataclasses.replace(gpt_plan, signature="")  # format 2 made none
    with pytest.raises(
        PlanError, match=r"made for another model: its graph fingerprint .* re-plan"
    ):
        parallelize(zoo.gpt(zoo.GPTConfig(n_layer=5)).model, older)
    assert "export" in captures
    parallelize(zoo.gpt().model, older)


def test_with_tp_the_graph_the_layout_needs_is_the_one_checked(captures):
    entry = zoo.gpt()
    ids = entry.args[0]
    plan = manual_plan(
        entry.model,
        zoo.gpt_units(4),
        dp=1,
        tp=2,
        example_inputs=(ids,),
        example_kwargs={"labels": ids},
    )
    captures.clear()
    check_model(entry.model, plan)
    assert captures == []  # parallelize leaves the graph to the layout's capture
    assert plan_layout(entry.model, plan).degree == 2
    assert len(captures) == 1  # the layout and the fingerprint share one capture
    other = dataclasses.replace(plan, fingerprint="g2-0000000000000000")
    with pytest.raises(
        PlanError, match=r"made for another model: its graph fingerprint .* re-plan"
    ):
        plan_layout(entry.model, other)


def test_compile_and_manual_plans_and_their_json_carry_the_signature(gpt_plan):
    entry = zoo.gpt()
    expected = model_signature(entry.model)
    assert (
        gpt_plan.signature == expected
        and type(gpt_plan).from_json(gpt_plan.to_json()).signature == expected
    )
    assert manual_plan(entry.model, zoo.gpt_units(4), dp=1).signature == expected


def test_a_tp_degree_the_model_does_not_divide_is_named_as_the_cause():
    entry = zoo.gpt()  # 4 heads
    ids = entry.args[0]
    plan = manual_plan(
        entry.model,
        zoo.gpt_units(4),
        dp=1,
        tp=2,
        example_inputs=(ids,),
        example_kwargs={"labels": ids},
    )
    edited = dataclasses.replace(
        plan, mesh=dataclasses.replace(plan.mesh, tp=3), world_size=3
    )  # its file edited
    with pytest.raises(
        PlanError,
        match=r"slices 'h\.0\.attn\.\w+' over tp=3, but .*do not divide by tp=3.* re-plan "
        r"with a tp that divides them",
    ):
        plan_layout(entry.model, edited)
