"""The matrix: every Hugging Face architecture of zoo.HF_ARCHITECTURES, from its tiny config,
compiled and trained on 2 gloo ranks against one eager process.

    .venv/bin/python benchmarks/bench_architectures.py                 # all 29 (several minutes on 2 cores)
    .venv/bin/python benchmarks/bench_architectures.py mixtral bart    # some
    .venv/bin/python benchmarks/bench_architectures.py --pp-backend fsdp2 llama gpt2   # pp 2 on backend "fsdp2"

Per architecture, one spawned world of 2 ranks:
- compile: `shardplan.compile` for world 2 on the cpu-gloo profile, data parallelism alone, a unit per
  block (so tied blocks sit in different units, the case the runtimes must keep; tests/test_architectures.py
  compiled);
- dp 2: that plan on backend "shardplan", each rank half the batch;
- pp 2: the same units cut into 2 stages of as many units each (GPipe, 2 micro-batches), each rank the
  whole batch (pipelined there), on backend "shardplan" (or the one --pp-backend names);
- fsdp2: the compiled plan on backend "fsdp2" (which merges tied units, with a warning).
Each trains 2 AdamW steps with gradient clipping next to one eager process on the whole batch
(tests/parity.py); a mode passes when the loss, the clipped gradient norm (relative) and every
parameter after training are within 1e-5 of it. A cell shows the largest of those differences, or
the error's first line.
"""

import argparse
import copy
import os
import sys
import time
import warnings

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from parity import TOLERANCE, spawn_world, train_next_to_reference  # noqa: E402
from test_architectures import compiled, pipelined  # noqa: E402

from shardplan.errors import ShardplanError  # noqa: E402
from shardplan.models import zoo  # noqa: E402

BATCH, SEQ, STEPS, CLIP = 4, 16, 2, 0.05
MODES = ("compile", "dp 2", "pp 2", "fsdp2")


def _entry(name: str):
    torch.manual_seed(0)
    return zoo.hf_architecture(name, batch=BATCH, seq=SEQ)


def _batches(vocab: int) -> list[torch.Tensor]:
    return [
        torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))
        for step in range(STEPS)
    ]


def _train(name: str, plan, mode: str, rank: int, pp_backend: str) -> float | None:
    """The largest difference from one process (None off rank 0)."""
    from shardplan.runtime import parallelize

    reference = _entry(name).model
    model = copy.deepcopy(reference)
    if mode == "pp 2":
        plan = pipelined(plan, model, BATCH)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fsdp2 says it merges the tied units
        program = parallelize(
            model, plan, backend={"fsdp2": "fsdp2", "pp 2": pp_backend}.get(mode, "shardplan")
        )
    whole = _batches(reference.config.vocab_size)
    mine = whole if mode == "pp 2" else [ids.chunk(2)[rank] for ids in whole]
    errors = train_next_to_reference(program, reference, list(zip(mine, whole)), clip=CLIP)
    return None if rank else max(errors.values())


def _first_line(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".splitlines()[0]
    return text if len(text) <= 160 else text[:157] + "..."


def _architecture(rank: int, world: int, name: str, pp_backend: str) -> dict:
    """mode → the largest difference, or the error's first line; every rank runs every mode."""
    warnings.simplefilter("ignore")  # transformers' and torch's, on every model
    cells: dict[str, float | str | None] = {}
    start = time.perf_counter()
    try:
        model = _entry(name).model
        plan = compiled(model, _batches(model.config.vocab_size)[0])
        cells["compile"] = f"{len(plan.units)} units"
    except Exception as error:  # noqa: BLE001 (a cell of the table)
        return {mode: _first_line(error) for mode in MODES} | {
            "seconds": time.perf_counter() - start
        }
    for mode in MODES[1:]:
        try:
            cells[mode] = _train(name, plan, mode, rank, pp_backend)
        except Exception as error:  # noqa: BLE001
            cells[mode] = _first_line(error)
    return cells | {"seconds": time.perf_counter() - start}


def _cell(value) -> str:
    if isinstance(value, float):
        return f"ok ({value:.0e})" if value <= TOLERANCE else f"**off by {value:.1e}**"
    return str(value).replace("|", "\\|")


def main() -> None:
    import transformers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "names", nargs="*", help=f"of {', '.join(zoo.HF_ARCHITECTURES)} (default: all)"
    )
    parser.add_argument(
        "--pp-backend",
        choices=("shardplan", "fsdp2"),
        default="shardplan",
        help="the backend the pp 2 column runs on",
    )
    options = parser.parse_args()
    names = options.names or list(zoo.HF_ARCHITECTURES)
    print(
        f"transformers {transformers.__version__}, torch {torch.__version__}, 2 gloo ranks, batch {BATCH} x "
        f"{SEQ} tokens, {STEPS} steps, clip {CLIP}"
        f"{'' if options.pp_backend == 'shardplan' else f', pp 2 on backend {options.pp_backend!r}'}; a cell: "
        "the largest difference from one process "
        f"(pass: <= {TOLERANCE:.0e}), or the error\n"
    )
    print("| architecture | " + " | ".join(MODES) + " | s |")
    print("|---|" + "---|" * len(MODES) + "---:|")
    passed = 0
    for name in names:
        try:
            zoo.hf_architecture(name, batch=1, seq=1, device="meta")
            cells = spawn_world(2, _architecture, (name, options.pp_backend))
        except ShardplanError as error:  # not in this transformers
            cells = {mode: _first_line(error) for mode in MODES} | {"seconds": 0.0}
        except Exception as error:  # noqa: BLE001 (a rank died: the world's error)
            cells = {mode: _first_line(error) for mode in MODES} | {"seconds": 0.0}
        passed += all(
            isinstance(cells[mode], float) and cells[mode] <= TOLERANCE for mode in MODES[1:]
        )
        print(
            f"| {name} | "
            + " | ".join(_cell(cells[mode]) for mode in MODES)
            + f" | {cells['seconds']:.0f} |",
            flush=True,
        )
    print(f"\n{passed} of {len(names)} architectures pass every mode")


if __name__ == "__main__":
    main()
