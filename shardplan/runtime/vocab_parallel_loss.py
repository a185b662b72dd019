"""The causal-LM loss on vocabulary-sharded logits, for a plan with TensorParallel.loss_parallel.

[Note: loss on sharded logits] (torchtitan's loss_parallel) With a vocab-parallel head each tp rank
holds the logits of its slice of the vocabulary, [tokens, vocab / tp]. A token's cross entropy is
log Σ_v exp(z_v) - z_target, and neither term needs the whole logits on one rank:

- each rank takes the log-sum-exp of its slice; the ranks' log-sum-exps are all-gathered (one number
  per token and rank) and combined by a log-sum-exp over the ranks;
- the target logit is read on the rank whose slice holds the target id (zero on the others) and summed
  over the ranks.

Both exchanges are tensor_parallel's custom op (`exchange`), so autograd runs their backward (this
rank's column of the gathered log-sum-exps' gradient; the summed target logit's gradient handed to
every rank as it is), and a captured pipeline stage keeps them as nodes ([Note: exchanges in captured
graphs]). The gradient a rank's logits receive is the softmax over the whole vocabulary minus the
target's one-hot, restricted to its slice, as one process computes it. Every rank computes the same
loss, as with the logits gathered, but no rank holds more than its slice of the logits, of their float
copy, or of their gradient.

`shard_loss` installs it on a Hugging Face model whose loss transformers' ForCausalLMLoss computes
(frontend/sharded_loss.py recognizes one): its `loss_function` becomes `causal_lm_loss` over the tp
group, which reads the head's logits as the head computed them, this rank's slice. The model's
returned `logits` are then this rank's slice when it computes a loss (given labels); without labels,
when nothing reads them as a loss, they are gathered whole before the model returns them.
"""

import functools
from typing import Any

import torch
import torch.nn as nn

from shardplan.errors import RuntimeMismatchError
from shardplan.runtime.collectives import Group, group_world
from shardplan.runtime.context_parallel import IGNORE_INDEX, shifted_labels
from shardplan.runtime.tensor_parallel import exchange


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    group: Group,
    *,
    ignore_index: int = IGNORE_INDEX,
    reduction: str = "mean",
) -> torch.Tensor:
    """F.cross_entropy of the whole logits from this rank's slice of them, `logits` [tokens, vocab / tp]
    (tp rank r holds ids r · vocab / tp onwards), and `target` [tokens]: "mean" over the tokens not
    ignored, or their "sum". The same value on every rank of `group`."""
    index, _ = group_world(group)
    width = logits.shape[-1]
    ranks_lse = exchange(
        torch.logsumexp(logits, dim=-1, keepdim=True), "gather", "local", -1, group
    )
    local = target - index * width
    held = (local >= 0) & (local < width)
    picked = logits.gather(-1, local.clamp(0, width - 1).unsqueeze(-1)).squeeze(-1)
    target_logit = exchange(picked.masked_fill(~held, 0.0), "sum", "copy", 0, group)
    counted = target != ignore_index
    total = (torch.logsumexp(ranks_lse, dim=-1) - target_logit).masked_fill(~counted, 0.0).sum()
    if reduction == "sum":
        return total
    if reduction == "mean":
        return total / counted.sum()
    raise ValueError(f"reduction {reduction!r}: the vocab-parallel loss takes 'mean' or 'sum'")


def causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = IGNORE_INDEX,
    shift_labels: torch.Tensor | None = None,
    *,
    group: Group,
    **kwargs: Any,
) -> torch.Tensor:
    """transformers' ForCausalLMLoss (loss_utils.py, transformers 5) on this rank's slice of the logits:
    in float32, labels shifted by one inside the sequence unless `shift_labels` are given, the mean over
    the predicted tokens or the sum over `num_items_in_batch`."""
    _, degree = group_world(group)
    if logits.shape[-1] * degree != vocab_size:
        raise RuntimeMismatchError(
            f"the vocab-parallel loss got logits of {logits.shape[-1]} ids on each of {degree} tp ranks "
            f"for a vocabulary of {vocab_size}: the head must return this rank's slice"
        )
    if shift_labels is None:
        shift_labels = shifted_labels(labels, ignore_index)
    loss = vocab_parallel_cross_entropy(
        logits.float().flatten(0, -2),
        shift_labels.flatten().to(logits.device),
        group,
        ignore_index=ignore_index,
        reduction="mean" if num_items_in_batch is None else "sum",
    )
    if num_items_in_batch is None:
        return loss
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def shard_loss(model: nn.Module, group: Group) -> None:
    """Make `model` compute its loss on the vocabulary slices of its head's logits over the tp `group`
    (see the module's docstring): a model sharded_loss_refusal accepts (tensor_parallel.plan_layout
    checks), whose head already returns this rank's slice."""
    model.loss_function = functools.partial(causal_lm_loss, group=group)  # type: ignore[assignment]
    model.register_forward_hook(functools.partial(_whole_logits_without_loss, group))


def _whole_logits_without_loss(group: Group, module: nn.Module, args: tuple, output: Any) -> Any:
    """The logits gathered whole when the model computed no loss (no labels): nothing sharded reads them."""
    logits = getattr(output, "logits", None)
    if getattr(output, "loss", None) is None and isinstance(logits, torch.Tensor):
        output.logits = exchange(logits, "gather", "local", -1, group)
    return output
