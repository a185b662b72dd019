"""Plan a Hugging Face model from its config alone, then train it with the plan.

No weights are downloaded: the model is built from a config on the meta
device, so planning takes seconds even for LLaMA-7B shapes.

Plan (one process, no GPU):

    python examples/plan_hf_model.py --world-size 2 -o llama-plan.json
    python examples/plan_hf_model.py --config path/to/config.json --world-size 64 --seq 4096 -o big.json

Train with it (the same flags, under torchrun, with --train):

    torchrun --standalone --nproc-per-node 2 examples/plan_hf_model.py --world-size 2 \\
        -o llama-plan.json --train --steps 5
"""

import argparse
import datetime
import json

import torch
import torch.distributed as dist
import transformers

import shardplan

SMALL_LLAMA = dict(
    model_type="llama",
    num_hidden_layers=4,
    hidden_size=128,
    intermediate_size=344,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=1024,
    max_position_embeddings=256,
)
"""A LLaMA small enough to train on CPU ranks in seconds; pass --config for a real one."""


def build(config_path: str | None, batch: int, seq: int, device: str):
    fields = SMALL_LLAMA if config_path is None else json.load(open(config_path))
    config = transformers.AutoConfig.for_model(**fields)
    config.use_cache = False  # training needs no KV cache, and export cannot capture it
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config)
    ids = torch.randint(0, config.vocab_size, (batch, seq))
    return model, ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="a Hugging Face config.json (default: a small LLaMA)")
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--batch", type=int, default=4, help="sequences per data-parallel replica")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--hardware", default="cpu-gloo")
    parser.add_argument("--memory-budget")
    parser.add_argument("-o", "--output", default="plan.json")
    parser.add_argument(
        "--train", action="store_true", help="run under torchrun and train with the plan"
    )
    parser.add_argument("--steps", type=int, default=5)
    options = parser.parse_args()

    if not options.train:
        model, ids = build(options.config, options.batch, options.seq, device="meta")
        plan = shardplan.compile(
            model,
            options.world_size,
            (ids,),
            {"labels": ids},
            hardware=options.hardware,
            memory_budget=options.memory_budget,
        )
        plan.save(options.output)
        print(plan.summary())
        print(f"wrote {options.output}")
        return

    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    torch.manual_seed(0)
    model, _ = build(options.config, options.batch, options.seq, device="meta")
    plan = shardplan.load_plan(options.output)
    program = shardplan.parallelize(model, plan)
    optimizer = torch.optim.AdamW(program.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(
        plan.mesh.replica_of(dist.get_rank())
    )  # a replica's stages share its batch
    for step in range(options.steps):
        ids = torch.randint(
            0, model.config.vocab_size, (options.batch, options.seq), generator=generator
        )
        loss = program.step(ids, labels=ids)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if dist.get_rank() == 0:
            print(f"step {step}: loss {float(loss):.4f}")
    shardplan.shutdown()  # frees the program before the process group: see runtime/collectives.py


if __name__ == "__main__":
    main()
