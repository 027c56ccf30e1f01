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

SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(
        family="qwen2",
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
    "qwen2.5-1.5b": dict(
        family="qwen2",
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
    "llama-3.2-3b": dict(
        family="llama",
        vocab_size=128256,
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        tie_word_embeddings=True,
    ),
    "mistral-7b": dict(  # Mistral-7B-v0.2 (no sliding window, rope theta 1e6)
        family="mistral",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32000,
        rope_theta=1e6,
        sliding_window=None,
        max_position_embeddings=32768,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    ),
    "llama3-8b": dict(  # Llama-3-8B
        family="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        bos_token_id=128000,
        eos_token_id=128001,
        tie_word_embeddings=False,
    ),
    "llama-3.1-8b": dict(  # Llama-3.1-8B
        family="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        bos_token_id=128000,
        eos_token_id=128001,
        tie_word_embeddings=False,
    ),
    "qwen2.5-14b": dict(  # Qwen2.5-14B
        family="qwen2",
        vocab_size=152064,
        hidden_size=5120,
        intermediate_size=13824,
        num_hidden_layers=48,
        num_attention_heads=40,
        num_key_value_heads=8,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    ),
    "tiny": dict(  # Mistral-shaped smoke-test model (runs on a CPU in seconds)
        family="mistral",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1024,
        rope_theta=1e6,
        sliding_window=None,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    ),
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
