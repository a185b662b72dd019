"""ResumableSampler: which samples each step reads, the same whatever the world size, resumable from its state.

[Note: sample stream] The sampler orders the samples as one endless stream: epoch e is a
permutation of range(num_samples) drawn from (seed, e) alone, and the epochs follow each other.
A step takes the next `global_batch_size` samples of the stream (a step may straddle two epochs),
and data-parallel replica r of dp reads the r-th of dp equal consecutive slices of them. The state
is how many samples were taken: a run resumed on another world size, or with another global batch,
takes the samples that follow, so every sample is read exactly once per epoch, none twice, none
skipped, however often the world changes between checkpoints of this state. No torch.distributed
here: every rank computes the same order.
"""

import torch

from shardplan.errors import ShardplanError


class ResumableSampler:
    """The global sample order of a training run; a Stateful for checkpoints (`extra={"sampler": ...}`).

    >>> sampler = ResumableSampler(10, seed=0)
    >>> step = sampler.take(4)                   # the 4 samples of the next step, over all replicas
    >>> ResumableSampler.replica_slice(step, replica=1, replicas=2) == step[2:]
    True
    >>> sampler.state_dict()["consumed"]
    4
    """

    def __init__(self, num_samples: int, seed: int = 0, shuffle: bool = True):
        if num_samples < 1:
            raise ShardplanError(
                f"the dataset has {num_samples} samples: give a dataset with at least one"
            )
        self.num_samples = num_samples
        self.seed = seed
        self.shuffle = shuffle
        self.consumed = 0
        """Samples taken since the start of training, over all epochs: the whole state."""
        self._order: tuple[int, torch.Tensor] | None = None
        """(epoch, its permutation): the last epoch's order, drawn once."""

    @property
    def epoch(self) -> int:
        """The epoch the next sample belongs to."""
        return self.consumed // self.num_samples

    def take(self, global_batch_size: int) -> list[int]:
        """The next `global_batch_size` sample indices of the stream, in order; advances the state."""
        indices = [
            self._at(position)
            for position in range(self.consumed, self.consumed + global_batch_size)
        ]
        self.consumed += global_batch_size
        return indices

    @staticmethod
    def replica_slice(indices: list[int], replica: int, replicas: int) -> list[int]:
        """The consecutive share of one step's `indices` that data-parallel replica `replica` of `replicas` reads."""
        if len(indices) % replicas:
            raise ShardplanError(
                f"a step of {len(indices)} samples does not split evenly over {replicas} "
                f"data-parallel replicas: use a global batch divisible by {replicas}"
            )
        share = len(indices) // replicas
        return indices[replica * share : (replica + 1) * share]

    def _at(self, position: int) -> int:
        epoch, offset = divmod(position, self.num_samples)
        if not self.shuffle:
            return offset
        if self._order is None or self._order[0] != epoch:
            # the epoch's order depends on (seed, epoch) alone, not on how the stream got there
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._order = (epoch, torch.randperm(self.num_samples, generator=generator))
        return int(self._order[1][offset])

    def state_dict(self) -> dict[str, int | bool]:
        return {
            "num_samples": self.num_samples,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "consumed": self.consumed,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue the stream `state` describes; refuses a state of another dataset size, seed or order."""
        mine = {key: value for key, value in self.state_dict().items() if key != "consumed"}
        saved = {key: state.get(key) for key in mine}
        if saved != mine:
            raise ShardplanError(
                f"the saved sampler state is for {saved}, this sampler is {mine}: resume with "
                "the same dataset, seed and shuffle, or start the run afresh"
            )
        consumed = state.get("consumed")
        if not isinstance(consumed, int) or isinstance(consumed, bool) or consumed < 0:
            raise ShardplanError(
                f"the saved sampler state has consumed={str(consumed)[:40]}, not a count of "
                "samples: the checkpoint is corrupt; restore it from a copy"
            )
        self.consumed = consumed
