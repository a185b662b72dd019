"""Live bytes as each block of a GPT begins its backward, at its backward's peak and after it, in one process.

    .venv/bin/python benchmarks/probe_layer_backward.py                 # hidden 512, 2 layers, 4 x 512 tokens
    .venv/bin/python benchmarks/probe_layer_backward.py --d-model 1024

The GPT (zoo.gpt's, vocabulary 64) trained one step on this process's CPU, its layers not checkpointed,
checkpointed whole and selectively (runtime.activation_checkpoint.checkpointed, as the runtime wraps a
unit), every parameter's gradient dropped as it is made (as the analysis does: the cost model counts them
with the state); MemTracker's snapshots of the block's backward (every tensor live, MiB). What the cost
model's working set of a block's backward is read against ([Note: a block's output gradient] in
shardplan/costmodel/cost.py): at a block's start the gradient of its outputs is live already.
"""

import argparse

import torch
from torch.distributed._tools.mem_tracker import MemTracker, _ModState

from shardplan.models import zoo
from shardplan.plan import Checkpoint
from shardplan.runtime.activation_checkpoint import checkpointed

BLOCKS = ("h.0", "h.1", "ln_f", "lm_head")
MOMENTS = {"begins": _ModState.PRE_BW, "peak": _ModState.PEAK_BW, "ends": _ModState.POST_BW}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=512, help="the hidden size (8 heads)")
    options = parser.parse_args()
    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    for kind in Checkpoint:
        torch.manual_seed(0)
        model = zoo.GPT(
            zoo.GPTConfig(vocab_size=64, seq_len=512, n_layer=2, n_head=8, d_model=options.d_model)
        )
        for param in model.parameters():
            param.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
        if kind is not Checkpoint.NONE:
            for layer in model.h:
                layer.forward = checkpointed(layer.forward, kind)
        ids, labels = torch.randint(0, 64, (4, 512)), torch.randint(0, 64, (4, 512))
        tracker = MemTracker()
        tracker.track_external(model)
        with tracker:
            model(ids, labels).backward()
        for name in BLOCKS:
            snapshots = tracker.memory_tracking[model.get_submodule(name)].snapshots
            live = {
                moment: snapshots[state][-1][cpu]["Total"] / 2**20
                for moment, state in MOMENTS.items()
            }
            print(
                f"{kind.value:9s} {name:7s} "
                + ", ".join(f"{moment} {mib:.2f}" for moment, mib in live.items())
                + f"; peak - begins {live['peak'] - live['begins']:.2f} MiB"
            )


if __name__ == "__main__":
    main()
