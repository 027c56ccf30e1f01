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


def assert_matches_hf(out, ref, layers, atol: float, rtol: float = 0.0,
                      logits_atol: float | None = None) -> None:
    """A prefill's last-token logits and the given layers' K/V equal HF's forward ``ref``."""
    torch.testing.assert_close(out.logits, ref.logits[0, -1].float(),
                               atol=atol if logits_atol is None else logits_atol, rtol=0)
    for layer in layers:
        k, v = layer_kv(out.cache, layer)
        k_ref, v_ref = layer_kv(ref.past_key_values, layer)
        torch.testing.assert_close(k, k_ref, atol=atol, rtol=rtol)
        torch.testing.assert_close(v, v_ref, atol=atol, rtol=rtol)
