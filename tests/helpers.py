"""Small helpers shared by the tests: the tiny model builders, engines, HF references."""

from __future__ import annotations

import os

import torch

from ragblend import BlendConfig, BlendEngine
from ragblend.fusion.fusor import FusionResult, Segment, fuse
from ragblend.fusion.trace import FusionTrace

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3")

# Gemma 3: two sliding-window layers, then a global one (real models: five, then one), with a
# window shorter than the test prompts so the window masks keys; distinct RoPE bases per type.
GEMMA3 = dict(
    num_hidden_layers=3,
    head_dim=16,
    sliding_window=24,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    query_pre_attn_scalar=16,
    final_logit_softcapping=30.0,
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
    },
)


def tiny_config(family: str, **overrides):
    """A 3-layer GQA config of the family, sharing the embedded tokenizer's vocabulary."""
    from transformers import (
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        Qwen2Config,
        Qwen3Config,
    )

    cls = {
        "gemma3": Gemma3TextConfig,
        "llama": LlamaConfig,
        "mistral": MistralConfig,
        "qwen2": Qwen2Config,
        "qwen3": Qwen3Config,
    }[family]
    kwargs = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    if family == "qwen3":
        kwargs["head_dim"] = 16
    if family == "gemma3":
        kwargs.update(GEMMA3)
    kwargs.update(overrides)
    return cls(**kwargs)


def tiny_model(family: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides))
    return model.to(dtype).eval()


def engine_for(model, tokenizer, **config) -> BlendEngine:
    return BlendEngine(model, tokenizer, BlendConfig(**config))


def hf_forward(model, ids: list[int]):
    with torch.inference_mode():
        return model(torch.tensor([ids]), use_cache=True)


def layer_kv(cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    entry = cache.layers[layer]
    return entry.keys, entry.values


def assert_matches_hf(
    out, ref, layers, atol: float, rtol: float = 0.0, logits_atol: float | None = None
) -> None:
    """A prefill's last-token logits and the given layers' K/V equal HF's forward ``ref``."""
    torch.testing.assert_close(
        out.logits,
        ref.logits[0, -1].float(),
        atol=atol if logits_atol is None else logits_atol,
        rtol=0,
    )
    for layer in layers:
        k, v = layer_kv(out.cache, layer)
        k_ref, v_ref = layer_kv(ref.past_key_values, layer)
        torch.testing.assert_close(k, k_ref, atol=atol, rtol=rtol)
        torch.testing.assert_close(v, v_ref, atol=atol, rtol=rtol)


def fuse_prompt(
    engine: BlendEngine, prompt, ratio: float, trace: FusionTrace | None = None, selector=None
) -> tuple[FusionResult, list[Segment]]:
    """The fusor run on ``prompt`` over the engine's stored chunks at ``ratio`` (its schedule,
    its selector unless given), and the segments it ran on."""
    segments, _ = engine.chunks.lookup(prompt)
    out = fuse(
        engine.layers,
        segments,
        engine.chunks.loader(segments),
        engine.config.schedule(ratio),
        selector or engine.selector,
        trace=trace,
    )
    return out, segments


def flip_last_layer_byte(store, key: str) -> None:
    """Flip one byte inside a DiskStore entry's last layer (its V): a corrupt entry."""
    path = store.data_dir / store.index.get(key).file
    with open(path, "r+b") as f:
        f.seek(-100, os.SEEK_END)
        byte = f.read(1)
        f.seek(-100, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
