"""Datasets the elastic training tests name on torchrun's command line (`elastic_data:tokens`)."""
import time

import torch

from shardplan import zoo

SAMPLES = 20
"""Not a multiple of the tests' global batch: steps straddle epochs."""


class Tokens(torch.utils.data.Dataset):
    """SAMPLES random sequences for the zoo GPT, as its keyword arguments; `delay_s` slows every read."""

    def __init__(self, delay_s: float = 0.0):
        config = zoo.GPTConfig()
        self.ids = torch.randint(0, config.vocab_size, (SAMPLES, config.seq_len),
                                 generator=torch.Generator().manual_seed(1234))
        self.delay_s = delay_s

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        time.sleep(self.delay_s)
        return {"ids": self.ids[index], "labels": self.ids[index]}


def tokens() -> Tokens:
    return Tokens()


def slow_tokens() -> Tokens:
    """Slow enough (0.1 s a step at 4 samples a rank) that a test can signal a run mid-way."""
    return Tokens(delay_s=0.025)
