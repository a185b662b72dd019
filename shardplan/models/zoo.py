"""The model zoo used by tests, benchmarks and the demo.

In-repo models are small and plain (nanoGPT-style); Hugging Face models are
built from configs with random weights, never downloaded. Every entry returns
`ZooModel(model, args, kwargs)`: a model that returns its loss, and example
inputs of one replica's batch. `device="meta"` builds it without memory.
"""

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class ZooModel:
    model: nn.Module
    args: tuple
    kwargs: dict


@dataclass(frozen=True, kw_only=True, slots=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 32
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 64
    """Small defaults: a test trains it on CPU in well under a second per step."""


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.head_dim = config.d_model // config.n_head
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Widths and head counts come from the tensors, not the config: under tensor parallelism a
        # rank's qkv holds only its heads (runtime/tensor_parallel.py), and this code runs unchanged.
        batch, seq, _ = x.shape
        qkv = self.qkv(x)
        # split, not chunk(3): the same captured op as before this code was made TP-agnostic, so the
        # graph's fingerprint, and every plan saved for this model, stays valid.
        q, k, v = qkv.split(qkv.shape[-1] // 3, dim=-1)
        q, k, v = (t.view(batch, seq, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.fc = nn.Linear(d_model, hidden)
        self.proj = nn.Linear(hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class TransformerBlock(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config.d_model, 4 * config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.d_model)
        self.wpe = nn.Embedding(config.seq_len, config.d_model)
        self.h = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.wte(ids) + self.wpe(positions)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def gpt_units(n_layer: int) -> list[tuple[str, ...]]:
    """GPT's modules grouped into units by hand, as FSDP wraps a transformer: one unit per block.

    Blocks hold most of the parameters, so a unit each keeps about one block's worth gathered at a
    time. The position embedding and the final norm are too small to be worth a collective of their
    own: the two embeddings go together (their outputs are summed before the first block), and the
    norm goes with the head that reads it.

    >>> gpt_units(2)
    [('wte', 'wpe'), ('h.0',), ('h.1',), ('ln_f', 'lm_head')]
    """
    return [("wte", "wpe"), *((f"h.{i}",) for i in range(n_layer)), ("ln_f", "lm_head")]


class ResidualMLP(nn.Module):
    """Regression MLP with residual layers: the smallest chain."""

    def __init__(self, width: int = 64, depth: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth)
        )
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return F.mse_loss(self.head(x).squeeze(-1), target)


class ResidualCNN(nn.Module):
    """A small ResNet-style classifier: convolutions, batch norm buffers, pooling."""

    def __init__(self, channels: int = 16, depth: int = 3, classes: int = 10):
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.layers = nn.ModuleList(
            nn.Sequential(
                nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU()
            )
            for _ in range(depth)
        )
        self.head = nn.Linear(channels, classes)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.stem(images)
        for layer in self.layers:
            x = x + layer(x)
        return F.cross_entropy(self.head(x.mean(dim=(2, 3))), labels)


class EncoderDecoder(nn.Module):
    """A T5-shaped model: the encoder's output feeds every decoder layer (not a plain chain)."""

    def __init__(self, vocab_size: int = 128, d_model: int = 64, n_head: int = 4, depth: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.encoder = nn.ModuleList(
            nn.TransformerEncoderLayer(d_model, n_head, 4 * d_model, dropout=0.0, batch_first=True)
            for _ in range(depth)
        )
        self.decoder = nn.ModuleList(
            nn.TransformerDecoderLayer(d_model, n_head, 4 * d_model, dropout=0.0, batch_first=True)
            for _ in range(depth)
        )
        self.head = nn.Linear(d_model, vocab_size)

    def forward(
        self, source: torch.Tensor, target: torch.Tensor, labels: torch.Tensor
    ) -> torch.Tensor:
        memory = self.embed(source)
        for layer in self.encoder:
            memory = layer(memory)
        x = self.embed(target)
        for layer in self.decoder:
            x = layer(x, memory)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


DEMO_GPT = GPTConfig(vocab_size=1024, seq_len=128, n_layer=6, n_head=8, d_model=256)
"""The demo's and the accuracy benchmarks' GPT: large enough that compute, not Python overhead, dominates a CPU step; small enough for seconds per step."""
DEMO_BATCH = 8
"""Sequences per data-parallel replica."""


def gpt(
    config: GPTConfig = GPTConfig(), batch: int = 4, device: str | torch.device = "cpu"
) -> ZooModel:
    with torch.device(device):
        model = GPT(config)
        ids = torch.randint(0, config.vocab_size, (batch, config.seq_len))
    return ZooModel(model, (ids,), {"labels": ids})


def residual_mlp(width: int = 64, depth: int = 4, batch: int = 16, device="cpu") -> ZooModel:
    with torch.device(device):
        model = ResidualMLP(width, depth)
        x, target = torch.randn(batch, width), torch.randn(batch)
    return ZooModel(model, (x, target), {})


def residual_cnn(batch: int = 4, size: int = 16, device="cpu") -> ZooModel:
    with torch.device(device):
        model = ResidualCNN()
        images, labels = torch.randn(batch, 3, size, size), torch.randint(0, 10, (batch,))
    return ZooModel(model, (images, labels), {})


def encoder_decoder(batch: int = 4, seq: int = 16, device="cpu") -> ZooModel:
    with torch.device(device):
        model = EncoderDecoder()
        source, target = torch.randint(0, 128, (batch, seq)), torch.randint(0, 128, (batch, seq))
    return ZooModel(model, (source, target, target), {})


def _hf_causal_lm(config, batch: int, seq: int, device) -> ZooModel:
    import transformers

    config.use_cache = False  # export cannot capture the KV cache object; training needs none
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config)
        ids = torch.randint(0, config.vocab_size, (batch, seq))
    return ZooModel(model, (ids,), {"labels": ids})


def hf_gpt2(
    n_layer: int = 2, d_model: int = 64, batch: int = 2, seq: int = 32, device="cpu"
) -> ZooModel:
    import transformers

    config = transformers.GPT2Config(
        n_layer=n_layer,
        n_embd=d_model,
        n_head=4,
        vocab_size=512,
        bos_token_id=0,
        eos_token_id=0,
        n_positions=max(seq, 64),
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return _hf_causal_lm(config, batch, seq, device)


def hf_llama(
    n_layer: int = 2,
    d_model: int = 64,
    ffn: int = 172,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 512,
    batch: int = 2,
    seq: int = 32,
    device="cpu",
) -> ZooModel:
    import transformers

    config = transformers.LlamaConfig(
        num_hidden_layers=n_layer,
        hidden_size=d_model,
        intermediate_size=ffn,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        max_position_embeddings=max(seq, 64),
    )
    return _hf_causal_lm(config, batch, seq, device)


def hf_bert(
    n_layer: int = 2, d_model: int = 64, batch: int = 2, seq: int = 32, device="cpu"
) -> ZooModel:
    """BERT for masked language modelling (labels = inputs: every token is a target)."""
    import transformers

    config = transformers.BertConfig(
        vocab_size=512,
        hidden_size=d_model,
        num_hidden_layers=n_layer,
        num_attention_heads=4,
        intermediate_size=2 * d_model,
        max_position_embeddings=max(seq, 64),
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    with torch.device(device):
        model = transformers.BertForMaskedLM(config)
        ids = torch.randint(0, config.vocab_size, (batch, seq))
    return ZooModel(model, (ids,), {"labels": ids})


def hf_t5(
    n_layer: int = 2, d_model: int = 64, batch: int = 2, seq: int = 32, device="cpu"
) -> ZooModel:
    """T5: an encoder-decoder whose encoder output feeds every decoder block."""
    import transformers

    config = transformers.T5Config(
        vocab_size=512,
        d_model=d_model,
        d_kv=d_model // 4,
        d_ff=2 * d_model,
        num_layers=n_layer,
        num_heads=4,
        dropout_rate=0.0,
        use_cache=False,
        decoder_start_token_id=0,
        pad_token_id=0,
    )  # type: ignore[call-arg]  # a **kwargs field
    with torch.device(device):
        model = transformers.T5ForConditionalGeneration(config)
        ids = torch.randint(0, config.vocab_size, (batch, seq))
    return ZooModel(model, (ids,), {"labels": ids})


def hf_mixtral(
    n_layer: int = 2, d_model: int = 64, batch: int = 2, seq: int = 32, device="cpu"
) -> ZooModel:
    """Mixtral: mixture-of-experts layers (4 experts, top-2 routing)."""
    import transformers

    config = transformers.MixtralConfig(
        vocab_size=512,
        hidden_size=d_model,
        intermediate_size=2 * d_model,
        num_hidden_layers=n_layer,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=max(seq, 64),
    )
    return _hf_causal_lm(config, batch, seq, device)


_TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
"""The fields most Hugging Face decoder configs share, at test size (token ids inside the vocabulary)."""
_DECODER = {name: value for name, value in _TINY.items() if name != "num_key_value_heads"}
_GPT_NAMES = dict(
    vocab_size=512, n_embd=64, n_layer=2, n_head=4, bos_token_id=1, eos_token_id=2, pad_token_id=0
)
_MOE = dict(_TINY, moe_intermediate_size=64, num_experts_per_tok=2)

HF_ARCHITECTURES: dict[str, tuple[str, dict, str]] = {
    "llama": ("LlamaConfig", _TINY, "AutoModelForCausalLM"),
    "mistral": ("MistralConfig", _TINY, "AutoModelForCausalLM"),
    "qwen2": ("Qwen2Config", _TINY, "AutoModelForCausalLM"),
    "qwen3": ("Qwen3Config", _TINY, "AutoModelForCausalLM"),
    "phi": ("PhiConfig", _TINY, "AutoModelForCausalLM"),
    "phi3": ("Phi3Config", _TINY, "AutoModelForCausalLM"),
    "gemma": ("GemmaConfig", dict(_TINY, head_dim=16), "AutoModelForCausalLM"),
    "gemma2": ("Gemma2Config", dict(_TINY, head_dim=16, sliding_window=8), "AutoModelForCausalLM"),
    "gemma3": (
        "Gemma3TextConfig",
        dict(_TINY, head_dim=16, sliding_window=8),
        "AutoModelForCausalLM",
    ),
    "gpt2": (
        "GPT2Config",
        dict(_GPT_NAMES, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
        "AutoModelForCausalLM",
    ),
    "gpt-neox": ("GPTNeoXConfig", dict(_DECODER, hidden_dropout=0.0), "AutoModelForCausalLM"),
    "gpt-j": (
        "GPTJConfig",
        dict(
            _GPT_NAMES,
            n_positions=64,
            rotary_dim=8,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        ),
        "AutoModelForCausalLM",
    ),
    "opt": (
        "OPTConfig",
        dict(_DECODER, ffn_dim=128, word_embed_proj_dim=64, dropout=0.0),
        "AutoModelForCausalLM",
    ),
    "bloom": (
        "BloomConfig",
        dict(
            vocab_size=512,
            hidden_size=64,
            n_layer=2,
            n_head=4,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        ),
        "AutoModelForCausalLM",
    ),
    "falcon": ("FalconConfig", dict(_DECODER, hidden_dropout=0.0), "AutoModelForCausalLM"),
    "mixtral": (
        "MixtralConfig",
        dict(_TINY, num_local_experts=4, num_experts_per_tok=2),
        "AutoModelForCausalLM",
    ),
    "qwen2-moe": (
        "Qwen2MoeConfig",
        dict(_MOE, num_experts=4, shared_expert_intermediate_size=64),
        "AutoModelForCausalLM",
    ),
    "qwen3-moe": ("Qwen3MoeConfig", dict(_MOE, num_experts=4), "AutoModelForCausalLM"),
    "deepseek-v3": (
        "DeepseekV3Config",
        dict(
            _MOE,
            num_key_value_heads=4,
            n_routed_experts=4,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=2,
            topk_group=1,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
        ),
        "AutoModelForCausalLM",
    ),
    "olmo": ("OlmoConfig", _TINY, "AutoModelForCausalLM"),
    "olmo2": ("Olmo2Config", _TINY, "AutoModelForCausalLM"),
    "stablelm": ("StableLmConfig", _TINY, "AutoModelForCausalLM"),
    "starcoder2": (
        "Starcoder2Config",
        dict(_TINY, tie_word_embeddings=True),
        "AutoModelForCausalLM",
    ),
    "cohere": ("CohereConfig", _TINY, "AutoModelForCausalLM"),
    "granite": ("GraniteConfig", _TINY, "AutoModelForCausalLM"),
    "bert": (
        "BertConfig",
        dict(_DECODER, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
        "BertForMaskedLM",
    ),
    "roberta": (
        "RobertaConfig",
        dict(_DECODER, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=1),
        "RobertaForMaskedLM",
    ),
    "t5": (
        "T5Config",
        dict(
            vocab_size=512,
            d_model=64,
            d_kv=16,
            d_ff=128,
            num_layers=2,
            num_heads=4,
            dropout_rate=0.0,
            decoder_start_token_id=0,
            pad_token_id=0,
            eos_token_id=1,
        ),
        "T5ForConditionalGeneration",
    ),
    "bart": (
        "BartConfig",
        dict(
            vocab_size=512,
            d_model=64,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=128,
            decoder_ffn_dim=128,
            max_position_embeddings=64,
            dropout=0.0,
            bos_token_id=0,
            pad_token_id=1,
            eos_token_id=2,
            decoder_start_token_id=2,
            forced_eos_token_id=2,
        ),
        "BartForConditionalGeneration",
    ),
}
"""Tiny configs of the Hugging Face architectures the suite checks: name → (config class, its fields, the
model class, by transformers' names). Ties are each architecture's default. Dropout is off: a replica
would draw other masks than one process does."""


def hf_architecture(name: str, batch: int = 2, seq: int = 16, device="cpu", **fields) -> ZooModel:
    """A HF_ARCHITECTURES model with random weights and token inputs that are also its labels, `fields`
    replacing its tiny config's (another size); a ShardplanError when the installed transformers lacks
    the architecture."""
    import transformers

    config_class, tiny, model_class = HF_ARCHITECTURES[name]
    if not hasattr(transformers, config_class):
        from shardplan.errors import ShardplanError

        raise ShardplanError(
            f"transformers {transformers.__version__} has no {config_class} ({name}): "
            "install a version that does"
        )
    config = getattr(transformers, config_class)(
        use_cache=False, **{**tiny, **fields}
    )  # export cannot capture a KV cache
    builder = getattr(transformers, model_class)
    with torch.device(device):
        model = builder.from_config(config) if model_class.startswith("Auto") else builder(config)
        ids = torch.randint(0, config.vocab_size, (batch, seq))
    return ZooModel(model, (ids,), {"labels": ids})


def llama_7b(n_layer: int = 32, batch: int = 1, seq: int = 4096) -> ZooModel:
    """LLaMA-7B shapes on the meta device (no memory): for planning benchmarks."""
    return hf_llama(n_layer, 4096, 11008, 32, 32, 32000, batch, seq, device="meta")


def llama_70b(n_layer: int = 80, batch: int = 1, seq: int = 4096) -> ZooModel:
    """LLaMA-2-70B shapes on the meta device (grouped-query attention, 8 KV heads)."""
    return hf_llama(n_layer, 8192, 28672, 64, 8, 32000, batch, seq, device="meta")


def llama_405b(n_layer: int = 126, batch: int = 1, seq: int = 8192) -> ZooModel:
    """Llama-3.1-405B shapes on the meta device (128 query and 8 KV heads, a 128k vocabulary)."""
    return hf_llama(n_layer, 16384, 53248, 128, 8, 128256, batch, seq, device="meta")


PADDED_VALUES_ATTENTION = "sdpa_padded_values"
"""transformers' attention implementation name for _sdpa_padded_values."""


def _sdpa_padded_values(module, query, key, value, attention_mask, **kwargs):
    """SDPA with the values zero-padded to the queries' head dim and the output cut back, as FlashAttention
    runs multi-head latent attention (its kernels take one head dim): torch's fused kernels on the CPU
    refuse DeepSeek-V3's 192-wide queries over 128-wide values, and the math kernel they fall back to
    keeps every head's scores (gigabytes a layer at 4096 tokens), which no GPU run keeps."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    width = value.shape[-1]
    padded = torch.nn.functional.pad(value, (0, query.shape[-1] - width))
    output, weights = sdpa_attention_forward(module, query, key, padded, attention_mask, **kwargs)
    return output[..., :width], weights


def deepseek_v3(n_layer: int = 61, batch: int = 1, seq: int = 4096) -> ZooModel:
    """DeepSeek-V3 shapes on the meta device, transformers' DeepseekV3Config defaults: multi-head latent
    attention (through _sdpa_padded_values), 3 dense layers, then 256 routed experts of width 2048
    (top-8) and 1 shared a layer."""
    import transformers

    transformers.AttentionInterface.register(PADDED_VALUES_ATTENTION, _sdpa_padded_values)
    config = transformers.DeepseekV3Config(
        num_hidden_layers=n_layer,
        attn_implementation=PADDED_VALUES_ATTENTION,  # type: ignore[call-arg]  # a **kwargs field
    )
    return _hf_causal_lm(config, batch, seq, "meta")


ZOO: dict[str, Callable[..., ZooModel]] = {
    "gpt": gpt,
    "mlp": residual_mlp,
    "cnn": residual_cnn,
    "encoder-decoder": encoder_decoder,
    "hf-gpt2": hf_gpt2,
    "hf-llama": hf_llama,
    "hf-bert": hf_bert,
    "hf-t5": hf_t5,
    "hf-mixtral": hf_mixtral,
    "llama-7b": llama_7b,
    "llama-70b": llama_70b,
    "llama-405b": llama_405b,
    "deepseek-v3": deepseek_v3,
}
"""Zoo entries by the name the CLI and benchmarks use."""


def build(name: str, **options) -> ZooModel:
    if name not in ZOO:
        from shardplan.errors import ShardplanError

        raise ShardplanError(f"no zoo model {name!r}: choose one of {', '.join(ZOO)}")
    return ZOO[name](**options)
