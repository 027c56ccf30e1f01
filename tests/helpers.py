"""Small helpers shared by the tests."""

from __future__ import annotations

import torch

from ragblend import BlendConfig, BlendEngine


def engine_for(model, tokenizer, **config) -> BlendEngine:
    return BlendEngine(model, tokenizer, BlendConfig(**config))


def hf_forward(model, ids: list[int]):
    with torch.inference_mode():
        return model(torch.tensor([ids]), use_cache=True)


def layer_kv(cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    entry = cache.layers[layer]
    return entry.keys, entry.values
