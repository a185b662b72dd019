"""Context parallelism on backend="shardplan": each sequence split over the cp ranks of its replica.

See [Note: context parallelism] in plan.py for the split. Every rank of a cp group is called with
the replica's whole batch, as tp ranks are; `shard_batch` keeps this rank's tokens and feeds the
model what a Hugging Face causal LM takes to compute them as the whole sequence would:

- position_ids: the global positions of the local tokens (RoPE), unless the caller passes them,
  which are then split like the tokens;
- attention_mask: all ones at the local length, which keeps the model's own causal mask out of the
  way (a Hugging Face model reads positions that jump as packed sequences, and masks across them);
  padding is refused, as a padded key would need its mask gathered too;
- shift_labels: the labels shifted by one over the whole sequence before it is split (the causal-LM
  loss shifts inside the sequence, which a split would cut), and num_items_in_batch, the tokens the
  whole batch predicts, so each rank's loss is its sum over that count.

Attention is the one operation that couples tokens: while the model runs, every call of
F.scaled_dot_product_attention gathers the keys and values of the whole sequence over the cp group
(their gradients reduce-scattered back in backward) and masks by the tokens' global positions. The
interception is a TorchFunctionMode entered around the model and around each unit's forward, so an
activation-checkpointed unit recomputes under it too.

[Note: context-parallel loss] Each rank's loss is its tokens' share of the batch's mean, times cp:
the mean over the cp ranks is then the batch's loss, and the units average gradients over dp · cp
ranks (Mesh.parameter_mesh) to the gradient of the batch's mean, as one process computes it.
"""

import contextlib
import functools
import inspect
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from shardplan.errors import RuntimeMismatchError, ShardplanError
from shardplan.runtime.collectives import Group, group_world
from shardplan.runtime.tensor_parallel import gather_sequence_along

IGNORE_INDEX = -100
"""The label a causal-LM loss skips (torch's cross_entropy default, Hugging Face's)."""
_SEQUENCE = 1
"""The sequence dim of the model's inputs (batch first)."""


def shifted_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """The causal-LM targets of `labels` (..., sequence): each token's next, the last `ignore_index`,
    as transformers' ForCausalLMLoss shifts them."""
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]


_KEYS = -2
"""The sequence dim of attention's queries, keys and values: (batch, heads, tokens, head dim)."""


def zigzag_positions(length: int, cp: int, rank: int) -> torch.Tensor:
    """Global positions of the `length // cp` tokens cp rank `rank` holds: chunks `rank` and
    `2 · cp - 1 - rank` of the sequence cut into 2 · cp.

    >>> zigzag_positions(8, 2, 0).tolist()
    [0, 1, 6, 7]
    """
    chunk = length // (2 * cp)
    return torch.cat(
        [
            torch.arange(rank * chunk, (rank + 1) * chunk),
            torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk),
        ]
    )


class ContextParallel:
    """This rank's part of its cp group's sequences: the batch it feeds the model, and attention."""

    def __init__(self, module: nn.Module, group: Group):
        self.group = group
        """The cp ranks of this rank's replica (collectives.MeshGroups.context_parallel)."""
        self.rank, self.cp = group_world(group)
        self.attended = 0
        """Attention calls the model made under the last forward: none is a model this cannot split."""
        takes = inspect.signature(module.forward).parameters
        missing = [name for name in ("position_ids", "attention_mask") if name not in takes]
        if missing:
            raise ShardplanError(
                f"context parallelism feeds the model each token's global position and its "
                f"attention mask, but {type(module).__name__}.forward takes no "
                f"{' or '.join(missing)}: use a model that does (a Hugging Face causal LM), "
                "or re-plan with cp=1"
            )

    def shard_batch(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """This rank's tokens of the replica's batch, and the keywords that compute them as part of the
        whole sequence (see the module's docstring)."""
        labels = kwargs.get("labels")
        if not isinstance(labels, torch.Tensor):
            raise ShardplanError(
                "context parallelism computes the causal-LM loss from the keyword labels=, shifted "
                "over the whole sequence before it is split: pass labels=... (the model's loss over "
                "a split sequence is not the whole sequence's)"
            )
        length = labels.shape[_SEQUENCE] if labels.dim() > _SEQUENCE else 0
        if not length or length % (2 * self.cp):
            raise RuntimeMismatchError(
                f"labels of shape {list(labels.shape)}: context parallelism cuts each sequence into "
                f"2 * cp = {2 * self.cp} equal chunks; pad sequences to a multiple of {2 * self.cp} "
                f"(pad_to_multiple_of={2 * self.cp} in a Hugging Face collator)"
            )
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and not bool(mask.all()):
            raise RuntimeMismatchError(
                "context parallelism takes unpadded sequences: the attention_mask masks "
                f"{int((mask == 0).sum())} token(s); pack or trim sequences to equal lengths"
            )
        positions = zigzag_positions(length, self.cp, self.rank).to(labels.device)
        shifted = shifted_labels(labels)

        def local(value: Any) -> Any:
            sequenced = (
                isinstance(value, torch.Tensor)
                and value.dim() > _SEQUENCE
                and value.shape[_SEQUENCE] == length
            )
            return value.index_select(_SEQUENCE, positions) if sequenced else value

        local_labels = shifted.index_select(_SEQUENCE, positions)
        kwargs = {name: local(value) for name, value in kwargs.items()}
        kwargs.update(
            labels=local_labels,
            shift_labels=local_labels,
            num_items_in_batch=(shifted != IGNORE_INDEX).sum(),
            attention_mask=torch.ones(
                labels.shape[0], len(positions), dtype=torch.long, device=labels.device
            ),
        )
        kwargs.setdefault("position_ids", positions.unsqueeze(0).expand(labels.shape[0], -1))
        return tuple(local(value) for value in args), kwargs

    def scale_loss(self, output: Any) -> Any:
        """The model's output with its loss times cp ([Note: context-parallel loss])."""
        if isinstance(output, torch.Tensor):
            return output * self.cp
        if isinstance(getattr(output, "loss", None), torch.Tensor):
            output.loss = output.loss * self.cp
        return output

    @contextlib.contextmanager
    def attending(self) -> Iterator[None]:
        """Attention over the whole sequence inside: one forward of the model."""
        self.attended = 0
        with self.around_attention():
            yield
        if not self.attended:
            raise ShardplanError(
                "context parallelism splits attention where the model calls "
                "torch.nn.functional.scaled_dot_product_attention, and this model called it nowhere: "
                'load a Hugging Face model with attn_implementation="sdpa", or re-plan with cp=1'
            )

    @contextlib.contextmanager
    def around_attention(self) -> Iterator[None]:
        """Gathered attention inside, entered once however deep (a unit's forward inside the model's,
        or a checkpointed unit's recompute in backward)."""
        if any(isinstance(mode, _GatheredAttention) for mode in _get_current_function_mode_stack()):
            yield
            return
        with _GatheredAttention(self):
            yield

    def wrap(self, forward: Callable) -> Callable:
        """`forward` under gathered attention (a unit's, so its recompute is too)."""

        @functools.wraps(forward)
        def run(*args: Any, **kwargs: Any) -> Any:
            with self.around_attention():
                return forward(*args, **kwargs)

        return run

    def attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        """Scaled dot-product attention of this rank's queries over every rank's keys and values."""
        if attn_mask is not None:
            raise ShardplanError(
                "context parallelism masks attention by the tokens' global positions, but the model "
                f"passed scaled_dot_product_attention a mask of shape {list(attn_mask.shape)}, built "
                "at the local length: let it attend causally (is_causal=True, no mask), or re-plan "
                "with cp=1"
            )
        self.attended += 1
        keys = gather_sequence_along(key, _KEYS, self.group)
        values = gather_sequence_along(value, _KEYS, self.group)
        mask = None
        if is_causal:
            length = query.shape[_KEYS] * self.cp
            mine = zigzag_positions(length, self.cp, self.rank)
            every = torch.cat([zigzag_positions(length, self.cp, rank) for rank in range(self.cp)])
            mask = (mine[:, None] >= every[None, :]).to(query.device)
        return F.scaled_dot_product_attention(
            query,
            keys,
            values,
            attn_mask=mask,
            dropout_p=dropout_p,
            scale=scale,
            enable_gqa=enable_gqa,
        )


class _GatheredAttention(TorchFunctionMode):
    """Routes F.scaled_dot_product_attention to ContextParallel.attention; everything else runs as it is."""

    def __init__(self, context: ContextParallel):
        super().__init__()
        self.context = context

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self.context.attention(*args, **kwargs)
        return func(*args, **kwargs)
