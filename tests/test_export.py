"""`shardplan export`, and `explain` / `diff` of a checkpoint: on checkpoints saved in-process by one rank."""

import json

import pytest
import torch
import torch.distributed as dist

from shardplan.cli.main import main
from shardplan.cli.model_spec import load_model
from shardplan.runtime import parallelize
from shardplan.runtime.manual import manual_plan


@pytest.fixture(scope="module")
def one_rank():
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if started:
        dist.destroy_process_group()


def _saved(spec: str, folder, one_rank) -> dict[str, torch.Tensor]:
    """Save a checkpoint of `spec` (one unit per top-level module) into `folder`; its full state dict."""
    torch.manual_seed(0)
    model = load_model(spec).model
    plan = manual_plan(model, [[name] for name, _ in model.named_children()], dp=1)
    program = parallelize(model, plan)
    optimizer = torch.optim.AdamW(program.parameters(), lr=1e-3)
    program.save(folder, optimizer)
    return program.export_full_state_dict()


@pytest.fixture(scope="module")
def hugging_face_checkpoint(tmp_path_factory, one_rank):
    transformers = pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("hf")
    config = transformers.Qwen3Config(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        tie_word_embeddings=False,
    )
    config.save_pretrained(folder / "config")
    spec = str(folder / "config" / "config.json")
    run = folder / "run"
    run.mkdir()
    (run / "settings.json").write_text(json.dumps({"model": spec}))
    state = _saved(spec, run / "step_00000030", one_rank)
    return run / "step_00000030", state


def test_export_writes_a_folder_from_pretrained_loads_with_the_same_weights(
    hugging_face_checkpoint, tmp_path, capsys
):
    import transformers

    checkpoint, state = hugging_face_checkpoint
    output = tmp_path / "exported"
    assert main(["export", str(checkpoint), "-o", str(output)]) == 0  # the model from settings.json
    loaded = transformers.AutoModelForCausalLM.from_pretrained(output).state_dict()
    assert set(state) <= set(loaded)
    for name, tensor in state.items():
        assert torch.equal(loaded[name], tensor), name
    assert f"wrote {output}" in capsys.readouterr().out


def test_export_writes_a_plain_state_dict_for_other_models(one_rank, tmp_path):
    state = _saved("gpt", tmp_path / "step_00000002", one_rank)
    output = tmp_path / "exported"
    assert (
        main(["export", str(tmp_path / "step_00000002"), "--model", "gpt", "-o", str(output)]) == 0
    )
    loaded = torch.load(output / "model.pt", weights_only=True)
    assert loaded.keys() == state.keys()
    assert all(torch.equal(loaded[name], state[name]) for name in state)


def test_export_never_writes_into_a_folder_that_holds_something(
    hugging_face_checkpoint, tmp_path, capsys
):
    checkpoint, _ = hugging_face_checkpoint
    output = tmp_path / "mine"
    output.mkdir()
    (output / "notes.txt").write_text("keep me")
    assert main(["export", str(checkpoint), "-o", str(output)]) == 2
    error = capsys.readouterr().err
    assert "not empty" in error and "Traceback" not in error and error.count("\n") == 1
    assert [path.name for path in output.iterdir()] == ["notes.txt"]
    assert (output / "notes.txt").read_text() == "keep me"


def test_export_without_a_recorded_model_asks_for_it(one_rank, tmp_path, capsys):
    _saved("mlp", tmp_path / "step_00000001", one_rank)
    assert main(["export", str(tmp_path / "step_00000001"), "-o", str(tmp_path / "out")]) == 2
    assert "pass --model SPEC" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_explain_and_diff_read_a_checkpoints_plan(hugging_face_checkpoint, tmp_path, capsys):
    checkpoint, _ = hugging_face_checkpoint
    for given in (checkpoint, checkpoint / "shardplan.json"):
        assert main(["explain", str(given), "--pictures", str(tmp_path / "pictures")]) == 0
        out = capsys.readouterr().out
        assert (
            "Qwen3ForCausalLM" in out and "tensors" not in out
        )  # elements counted, from the shapes
    assert sorted(path.name for path in checkpoint.iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "shardplan.json",
    ]
    assert main(["diff", str(checkpoint / "shardplan.json"), str(checkpoint)]) == 0
    assert capsys.readouterr().out.strip() == "the plans are the same"
