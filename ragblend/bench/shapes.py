"""Real model architectures with random weights: time without downloading any weights.

``SHAPES`` holds the configs (their config.json values) of Qwen2.5-0.5B/1.5B, Llama-3.2-3B,
Mistral-7B-v0.2, Llama-3-8B, Llama-3.1-8B and Qwen2.5-14B (and a tiny Mistral-shaped model for
CPU smoke tests); :func:`build_model` creates one with random weights directly on a device, and
:class:`IdTokenizer` lets the engine run on token ids alone (``random_ids``), so neither a
tokenizer nor a dataset is needed. Answers from random weights mean nothing; compute per mode
does not depend on the weights (the recompute budget is fixed by the ratio).
"""

from __future__ import annotations

import random
from typing import Any

import torch


def _sizes(
    vocab: int, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int
) -> dict[str, int]:
    """The sizes every shape sets, under config.json's names."""
    return dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
    )


def _llama3_rope(factor: float) -> dict[str, Any]:
    """Llama 3.1/3.2's RoPE scaling (``factor`` 8 for 3.1, 32 for 3.2)."""
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }


# each family's values that its shapes here share
_QWEN2 = dict(
    family="qwen2", max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6
)
_MISTRAL = dict(family="mistral", rope_theta=1e6, sliding_window=None, rms_norm_eps=1e-5)
_MISTRAL_IDS = dict(bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
_LLAMA3 = dict(family="llama", rope_theta=500000.0, rms_norm_eps=1e-5)
_LLAMA3_IDS = dict(bos_token_id=128000, eos_token_id=128001, tie_word_embeddings=False)

SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": {**_QWEN2, **_sizes(151936, 896, 4864, 24, 14, 2), "tie_word_embeddings": True},
    "qwen2.5-1.5b": {
        **_QWEN2,
        **_sizes(151936, 1536, 8960, 28, 12, 2),
        "tie_word_embeddings": True,
    },
    "llama-3.2-3b": {
        **_LLAMA3,
        **_sizes(128256, 3072, 8192, 28, 24, 8),
        "head_dim": 128,
        "max_position_embeddings": 131072,
        "rope_scaling": _llama3_rope(32.0),
        "tie_word_embeddings": True,
    },
    # Mistral-7B-v0.2 (no sliding window, rope theta 1e6)
    "mistral-7b": {
        **_MISTRAL,
        **_sizes(32000, 4096, 14336, 32, 32, 8),
        "max_position_embeddings": 32768,
        **_MISTRAL_IDS,
    },
    "llama3-8b": {  # Llama-3-8B
        **_LLAMA3,
        **_sizes(128256, 4096, 14336, 32, 32, 8),
        "max_position_embeddings": 8192,
        **_LLAMA3_IDS,
    },
    "llama-3.1-8b": {  # Llama-3.1-8B
        **_LLAMA3,
        **_sizes(128256, 4096, 14336, 32, 32, 8),
        "rope_scaling": _llama3_rope(8.0),
        "max_position_embeddings": 131072,
        **_LLAMA3_IDS,
    },
    "qwen2.5-14b": {  # Qwen2.5-14B
        **_QWEN2,
        **_sizes(152064, 5120, 13824, 48, 40, 8),
        "tie_word_embeddings": False,
    },
    # a Mistral-shaped smoke-test model (runs on a CPU in seconds)
    "tiny": {
        **_MISTRAL,
        **_sizes(1024, 64, 128, 4, 4, 2),
        "max_position_embeddings": 4096,
        **_MISTRAL_IDS,
    },
}


class IdTokenizer:
    """Stands in for a tokenizer: the engine is driven with token ids only."""

    bos_token_id = None
    eos_token_id = None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(str(i) for i in ids)


def build_model(
    shape: str, device: torch.device, dtype: torch.dtype, seed: int, **overrides: Any
) -> Any:
    """A random-weight HF causal LM of ``shape`` (a key of ``SHAPES``), created on ``device``
    (``meta``: its shapes only); ``overrides`` replace config values (e.g. ``vocab_size``)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

    spec = {**SHAPES[shape], **overrides}
    family = spec.pop("family")
    cls = {"mistral": MistralConfig, "llama": LlamaConfig, "qwen2": Qwen2Config}[family]
    config = cls(**spec)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if next(model.parameters()).device != device:  # older transformers ignore the context
        model.to(device)
    return model.eval()


def shape_engine(
    shape: str,
    device: torch.device,
    dtype: str,
    seed: int,
    store: Any,
    model_overrides: dict[str, Any] | None = None,
    **config: Any,
) -> tuple[Any, float]:
    """A ``BlendEngine`` over a random-weight ``shape`` (``dtype`` a ``BlendConfig.dtype``
    name; ``model_overrides`` as :func:`build_model`'s, ``config`` further ``BlendConfig``
    fields) driven by token ids (no chat template: chunks are keyed by the given head), and
    the seconds the model took to build."""
    import time

    from ragblend.bench.harness import sync
    from ragblend.config import BlendConfig
    from ragblend.engine import BlendEngine
    from ragblend.models.dtype import DTYPES

    t0 = time.perf_counter()
    model = build_model(shape, device, DTYPES[dtype], seed, **(model_overrides or {}))
    sync(device)
    build_s = time.perf_counter() - t0
    engine = BlendEngine(
        model,
        IdTokenizer(),
        BlendConfig(device=str(device), dtype=dtype, precompute_context="prefix", **config),
        store=store,
        name=f"{shape} (random weights)",
    )
    return engine, build_s


def pinned(t: torch.Tensor, pin: bool) -> torch.Tensor:
    """``t`` as a contiguous host tensor, page-locked where ``pin`` (a RAM tier beside a GPU)."""
    t = t.detach().to("cpu").contiguous()
    return t.pin_memory() if pin else t


def random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    """``n`` random token ids, clear of the low special ids and Llama-3's special tokens."""
    hi = min(vocab, 128000)  # stay below Llama-3's special tokens
    lo = min(100, hi // 4)
    return [rng.randrange(lo, hi) for _ in range(n)]
