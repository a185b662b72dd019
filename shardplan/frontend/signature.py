"""The model's structural signature: what `parallelize` compares to refuse a plan made for another
model without capturing the model again.

It hashes the module tree (paths and class names) and the parameters and buffers (names, shapes,
dtypes, requires_grad), in the model's own order: a walk over its modules, milliseconds even for
70B shapes on the meta device, where the graph fingerprint (passes/blocks.py) takes a torch.export
capture. Parameters shared between modules are listed once (named_parameters' default), so tying
or untying weights changes it. What it cannot see is a forward that computes otherwise on the same
parameters; the graph fingerprint can (`parallelize(..., verify_graph=True)`).
"""

import hashlib

import torch.nn as nn

SIGNATURE_VERSION = "s1"
"""Names how `model_signature` hashes: a plan whose signature another version made is checked by
its graph fingerprint instead."""


def model_signature(model: nn.Module) -> str:
    """Hash of `model`'s module paths and classes and its parameters' and buffers' names, shapes,
    dtypes and requires_grad; the device is left out (a plan is made on the meta device, run on another).

    Classes are named without their Python module: a class imported as `train.GPT` by the planning
    command and as `__main__.GPT` by the training script is the same model.
    """
    digest = hashlib.sha256()
    for path, module in model.named_modules():
        digest.update(repr(("module", path, type(module).__qualname__)).encode())
    for name, parameter in model.named_parameters():
        digest.update(
            repr(
                (
                    "parameter",
                    name,
                    tuple(parameter.shape),
                    str(parameter.dtype),
                    parameter.requires_grad,
                )
            ).encode()
        )
    for name, buffer in model.named_buffers():
        digest.update(repr(("buffer", name, tuple(buffer.shape), str(buffer.dtype))).encode())
    return f"{SIGNATURE_VERSION}-{digest.hexdigest()[:16]}"
