"""Datasets the elastic training tests name on torchrun's command line (`elastic_data:tokens`)."""

import time
from pathlib import Path

import torch

from shardplan.models import zoo

SAMPLES = 20
"""Not a multiple of the tests' global batch: steps straddle epochs."""
SLOW = Path("elastic-data-slow")
"""While a file of this name is in the working directory, every read of paced_tokens takes the seconds it holds."""


class Tokens(torch.utils.data.Dataset):
    """SAMPLES random sequences for the zoo GPT, as its keyword arguments; reads are slow while `slow` exists."""

    def __init__(self, slow: Path | None = None):
        config = zoo.GPTConfig()
        self.ids = torch.randint(
            0,
            config.vocab_size,
            (SAMPLES, config.seq_len),
            generator=torch.Generator().manual_seed(1234),
        )
        self.slow = slow

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if self.slow is not None:
            try:
                time.sleep(float(self.slow.read_text()))
            except OSError:  # no file: full speed
                pass
        return {"ids": self.ids[index], "labels": self.ids[index]}


def tokens() -> Tokens:
    return Tokens()


def paced_tokens() -> Tokens:
    """Tokens a test can slow down (SLOW) while it acts on a run mid-way."""
    return Tokens(slow=SLOW)
