"""Train the zoo GPT with a shardplan plan under torchrun.

Plan once, anywhere (no GPU needed):

    shardplan plan gpt --world-size 4 --hardware cpu-gloo -o plan.json

Then run it on every rank. One machine:

    torchrun --standalone --nproc-per-node 4 examples/train_gpt.py --plan plan.json

Two machines of 2 ranks each (run on both, HOST being the first machine's address):

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        --rdzv-id gpt-run examples/train_gpt.py --plan plan.json

The plan may cut the model into pipeline stages (`shardplan plan ... --no-pipeline`
keeps one); the script is the same. The plan's world size must equal torchrun's (nnodes x nproc-per-node); every rank
must load the same plan file (parallelize checks both before any training).
"""

import argparse
import datetime
import os

import torch
import torch.distributed as dist

import shardplan
from shardplan.models import zoo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", required=True)
    parser.add_argument("--steps", type=int, default=10)
    options = parser.parse_args()
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    # A collective that waits longer than this fails instead of hanging (a rank died, say).
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(minutes=5))
    rank = dist.get_rank()

    plan = shardplan.load_plan(options.plan)
    torch.manual_seed(
        0
    )  # the initialization below draws from it (rank 0's values are broadcast anyway)
    entry = zoo.gpt(device="meta")  # parameters appear only as this rank's shards
    program = shardplan.parallelize(entry.model, plan)
    optimizer = torch.optim.AdamW(program.parameters(), lr=1e-3)
    shape = plan.inputs[0].shape  # one data-parallel replica's batch
    # a stand-in for a data loader: one fixed batch per replica, which the loss visibly learns;
    # a replica's pipeline stages read the same batch
    generator = torch.Generator().manual_seed(plan.mesh.replica_of(rank))
    ids = torch.randint(0, zoo.GPTConfig().vocab_size, shape, generator=generator)
    for step in range(options.steps):
        loss = program.step(ids, labels=ids)
        program.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if rank == 0:
            print(f"step {step}: loss {float(loss):.4f}")
    shardplan.shutdown()  # frees the program before the process group: see runtime/collectives.py


if __name__ == "__main__":
    main()
