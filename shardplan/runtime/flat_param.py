"""The flat, padded buffer of one unit: where each parameter lives in it, and which slice a rank keeps.

[Note: flat layout] A unit's parameters are laid end to end in plan order and
padded with zeros to a multiple of the data-parallel size, so every rank's
shard has the same numel (all_gather_into_tensor and reduce_scatter_tensor
need equal chunks). Views are made with one `torch.split`, whose backward is a
single concatenation: the gradient of the whole buffer is built once, not once
per parameter. The padding never reaches a module, so its gradient is zero and
an optimizer leaves its zeros alone.
"""

from dataclasses import dataclass

import torch

from shardplan.errors import ShardplanError


@dataclass(frozen=True, kw_only=True, slots=True)
class FlatLayout:
    names: tuple[str, ...]
    """Parameter names, in buffer order."""
    shapes: tuple[torch.Size, ...]
    numels: tuple[int, ...]
    padded_numel: int
    """Numel of the whole buffer, padding included: a multiple of `dp`."""
    dp: int
    dtype: torch.dtype
    """dtype of the shards (the model's parameter dtype, e.g. float32)."""

    @classmethod
    def of(
        cls, unit_name: str, named_tensors: list[tuple[str, torch.Tensor]], dp: int
    ) -> "FlatLayout":
        dtypes = sorted({str(tensor.dtype) for _, tensor in named_tensors})
        if len(dtypes) > 1:
            raise ShardplanError(
                f"unit {unit_name!r} mixes parameter dtypes {dtypes}: one flat buffer holds "
                "one dtype; cast the model to one dtype before parallelize (mixed precision "
                "is the plan's mixed_precision, not per-parameter dtypes)"
            )
        numels = tuple(tensor.numel() for _, tensor in named_tensors)
        total = sum(numels)
        return cls(
            names=tuple(name for name, _ in named_tensors),
            shapes=tuple(tensor.shape for _, tensor in named_tensors),
            numels=numels,
            padded_numel=max(dp, -(-total // dp) * dp),
            dp=dp,
            dtype=named_tensors[0][1].dtype if named_tensors else torch.float32,
        )

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.dp

    @property
    def padding_numel(self) -> int:
        return self.padded_numel - sum(self.numels)

    def span(self, index: int) -> tuple[int, int]:
        """Where parameter `index` lies in the buffer: [begin, end)."""
        begin = sum(self.numels[:index])
        return begin, begin + self.numels[index]

    def shard_slice(self, rank: int) -> slice:
        return slice(rank * self.shard_numel, (rank + 1) * self.shard_numel)

    def flatten(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """The whole padded buffer from the parameters' values (a new tensor)."""
        # empty, not zeros: the copies write every element but the padding, and zeroing first was one
        # more pass over the model at start-up
        flat = torch.empty(
            self.padded_numel, dtype=self.dtype, device=tensors[0].device if tensors else "cpu"
        )
        for piece, tensor in zip(self.split(flat), tensors, strict=True):
            piece.copy_(tensor)
        flat[self.padded_numel - self.padding_numel :].zero_()
        return flat

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of `flat` shaped like the parameters (see [Note: flat layout])."""
        pieces = torch.split(flat, [*self.numels, self.padding_numel])
        return [piece.view(shape) for piece, shape in zip(pieces, self.shapes)]
