"""Which LM head's logits a model's loss may read sharded over the vocabulary.

Under vocabulary parallelism each tp rank's LM head computes the logits of its slice of the vocabulary.
A cross entropy over those slices needs no rank to hold the whole logits ([Note: loss on sharded
logits] in runtime/vocab_parallel_loss.py), but the runtime can run it only in place of a loss it
knows: a Hugging Face model computing its loss with transformers' ForCausalLMLoss (the labels shifted
inside the sequence, ignore_index -100, the mean over the predicted tokens, or their sum over
`num_items_in_batch`), from the logits of its output embeddings (`lm_head`). Any other loss is the
model's own code over the whole logits: the head gathers them before it (`sharded_loss_refusal` says
why). Which loss runs is the plan's (TensorParallel.loss_parallel): analysis prices it, the runtime runs it.
"""

import torch.nn as nn


def sharded_loss_refusal(model: nn.Module, head: str) -> str | None:
    """Why `model`'s loss cannot run on the vocabulary slices of the logits of its module `head` (None:
    it can)."""
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:
        return "the model's loss is its own code (transformers is not installed)"
    if getattr(model, "loss_function", None) is not ForCausalLMLoss:
        return (
            f"{type(model).__name__} computes its loss in its own code, not with transformers' "
            "ForCausalLMLoss"
        )
    output_embeddings = getattr(model, "get_output_embeddings", lambda: None)()
    if output_embeddings is None or output_embeddings is not model.get_submodule(head):
        return f"{head!r} is not the output embedding {type(model).__name__}'s loss reads"
    return None


def sharded_loss_head(model: nn.Module) -> str | None:
    """The module path of the LM head whose logits `model`'s loss may read sharded over the vocabulary
    (None: the loss reads none so)."""
    output_embeddings = getattr(model, "get_output_embeddings", lambda: None)()
    head = next(
        (path for path, module in model.named_modules() if module is output_embeddings), None
    )
    return head if head is not None and sharded_loss_refusal(model, head) is None else None
