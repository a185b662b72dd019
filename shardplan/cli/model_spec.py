"""A model named on the command line or in a baseline: a zoo name, `package.module:factory`, or a
Hugging Face config JSON, built into a ZooModel (the model and its example inputs)."""

import functools
import importlib
import inspect
import re

from shardplan.common.dtypes import dtype_name
from shardplan.errors import ShardplanError

HUGGING_FACE_DEFAULT_BATCH, HUGGING_FACE_DEFAULT_SEQ = 1, 512
"""Example input of a Hugging Face config when no batch or sequence length is given."""


def load_model(
    spec: str,
    batch: int | None = None,
    seq: int | None = None,
    *,
    fp32_params: bool = False,
    warn=lambda text: None,
    shape_flags: tuple[str, ...] = ("--batch", "--seq"),
):
    """A zoo name, `package.module:factory`, or a Hugging Face config JSON → ZooModel.

    `fp32_params`: build a Hugging Face model in float32 whatever its config's torch_dtype (master
    weights for mixed precision); `warn(text)` hears what a person should know about the model built.
    `shape_flags`: the caller's flags that set a Hugging Face config's example batch and sequence
    length, named in the warning when one is left at its default; () where the example's shape does
    not matter (training reads the data's shapes), or where the caller sets the batch otherwise."""
    sizes = {key: value for key, value in (("batch", batch), ("seq", seq)) if value is not None}
    for key, value in sizes.items():
        if value < 1:
            raise ShardplanError(f"--{key} {value} is not a size: give 1 or more")
    try:
        return _built(spec, sizes, fp32_params, warn, shape_flags)
    except (MemoryError, RuntimeError) as error:
        if isinstance(error, RuntimeError) and "allocate" not in str(error):
            raise
        asked = " ".join(f"--{key} {value}" for key, value in sizes.items()) or "its own sizes"
        raise ShardplanError(
            f"building {spec} at {asked} ran out of memory: give a smaller --batch or --seq (the "
            "example is one replica's batch; --global-batch plans a larger step)"
        ) from None


def _built(spec: str, sizes: dict[str, int], fp32_params: bool, warn, shape_flags: tuple[str, ...]):
    from shardplan.models import zoo

    batch, seq = sizes.get("batch"), sizes.get("seq")
    if spec in zoo.ZOO:
        return zoo.build(spec, **_sizes_taken(zoo.ZOO[spec], sizes, f"zoo model {spec}"))
    if spec.endswith(".json"):
        return _hugging_face_from_config(spec, batch, seq, fp32_params, warn, shape_flags)
    if ":" in spec:
        module_name, factory_name = spec.split(":", 1)
        try:
            factory = getattr(importlib.import_module(module_name), factory_name)
        except (ImportError, AttributeError) as error:
            raise ShardplanError(
                f"cannot load {spec!r}: {error}; write package.module:function, importable "
                "from here (set PYTHONPATH)"
            ) from None
        built = factory(**_sizes_taken(factory, sizes, f"factory {spec}"))
        if isinstance(built, zoo.ZooModel):
            return built
        if not isinstance(built, tuple) or len(built) != 3:
            shown = (
                f"a {type(built).__name__} of {len(built)}"
                if isinstance(built, (tuple, list))
                else type(built).__name__
            )
            raise ShardplanError(
                f"factory {spec} returned {shown}: return a "
                "zoo.ZooModel or (model, args, kwargs), the model and its example inputs "
                "(e.g. return model, (tokens,), {})"
            )
        return zoo.ZooModel(*built)
    raise ShardplanError(
        f"unknown model {spec!r}: give a zoo name ({', '.join(zoo.ZOO)}), "
        "package.module:factory, or a Hugging Face config .json"
    )


def _sizes_taken(factory, sizes: dict[str, int], what: str) -> dict[str, int]:
    """`sizes` if `factory` takes each as a keyword; else which flag does not apply (it would be ignored)."""
    parameters = inspect.signature(factory).parameters
    if any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters.values()):
        return sizes
    for key in sizes:
        if key not in parameters:
            taken = " and ".join(f"--{name}" for name in ("batch", "seq") if name in parameters)
            raise ShardplanError(
                f"--{key} does not apply to {what}: it takes {taken or 'neither --batch nor --seq'}; "
                f"leave --{key} out"
            )
    return sizes


def _hugging_face_from_config(
    path: str,
    batch: int | None,
    seq: int | None,
    fp32_params: bool,
    warn,
    shape_flags: tuple[str, ...] = ("--batch", "--seq"),
):
    import torch
    import transformers

    from shardplan.common.files import parse_json, read_text
    from shardplan.models import zoo

    fields = parse_json(read_text(path, "Hugging Face config"), f"Hugging Face config {path!r}")
    if not isinstance(fields, dict) or not isinstance(fields.get("model_type"), str):
        raise ShardplanError(
            f'Hugging Face config {path!r} is not a JSON object with a "model_type" string: '
            "give the config.json saved with the model (config.save_pretrained)"
        )
    if fields["model_type"] not in transformers.CONFIG_MAPPING:
        raise ShardplanError(
            f"Hugging Face config {path!r} has model_type {fields['model_type']!r}, which "
            f"transformers {transformers.__version__} does not know: fix it (e.g. 'llama', 'gpt2') "
            "or upgrade transformers"
        )
    if _takes_dtype() and "torch_dtype" in fields:  # its old name: transformers warns on every read
        fields = {"dtype": fields["torch_dtype"], **fields}
        del fields["torch_dtype"]
    try:
        config = transformers.AutoConfig.for_model(**fields)
    except (
        Exception
    ) as error:  # transformers and huggingface_hub validate fields with errors of their own
        raise ShardplanError(
            f"cannot read Hugging Face config {path!r}: {summary(error)}: fix that field"
        ) from None
    config.use_cache = False
    defaulted = [
        (flag, f"{name} {default}")
        for flag, name, given, default in (
            ("--batch", "batch", batch, HUGGING_FACE_DEFAULT_BATCH),
            ("--seq", "sequence length", seq, HUGGING_FACE_DEFAULT_SEQ),
        )
        if given is None and flag in shape_flags
    ]
    if defaulted:
        warn(
            f"{path}: example input at {' and '.join(words for _, words in defaulted)} (pass "
            f"{' and '.join(flag for flag, _ in defaulted)} for your training shape)"
        )
    if fp32_params:
        dtype = torch.float32
    else:
        dtype = _config_dtype(fields) or torch.get_default_dtype()
        if dtype in (torch.bfloat16, torch.float16):
            name = dtype_name(dtype)
            warn(
                f"{path} says torch_dtype {name}: parameters, gradients and their reduction all in {name}, "
                f"no fp32 master weights; to keep fp32 masters pass --param-dtype {name} --reduce-dtype float32"
            )
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            config, **{"dtype" if _takes_dtype() else "torch_dtype": dtype}
        )
        ids = torch.zeros(
            batch or HUGGING_FACE_DEFAULT_BATCH, seq or HUGGING_FACE_DEFAULT_SEQ, dtype=torch.long
        )
    return zoo.ZooModel(model, (ids,), {"labels": ids})


@functools.cache
def _takes_dtype() -> bool:
    """Whether this transformers names a model's dtype `dtype` (4.56 on), where `torch_dtype` warns."""
    try:
        import transformers
    except ImportError:
        return True
    major, minor = (int(part) for part in re.findall(r"\d+", transformers.__version__)[:2])
    return (major, minor) >= (4, 56)


def _config_dtype(fields: dict):
    """The dtype a config asks its model be built in (torch_dtype, or dtype in newer transformers), or None."""
    import torch

    name = fields.get("torch_dtype", fields.get("dtype"))
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None


def summary(error: Exception) -> str:
    """A library's error on one line, at most 300 characters."""
    text = (
        " ".join(line.strip() for line in str(error).splitlines() if line.strip())
        or type(error).__name__
    )
    return text if len(text) <= 300 else text[:300] + "..."
