"""The fused K/V enter HF's cache without a copy; sliding-window layers keep HF's update."""

from __future__ import annotations

import torch
from helpers import tiny_config

from ragblend.models.hf_cache import dynamic_cache_of


def _kv(layers: int, tokens: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    torch.manual_seed(0)
    keys = [torch.randn(1, 2, tokens, 16) for _ in range(layers)]
    values = [torch.randn(1, 2, tokens, 16) for _ in range(layers)]
    return keys, values


def test_full_attention_layers_adopt_the_tensors_and_later_updates_do_not_write_them():
    keys, values = _kv(3, 10)
    before = [k.clone() for k in keys]
    cache = dynamic_cache_of(tiny_config("llama"), keys, values)
    for layer, k, v in zip(cache.layers, keys, values, strict=True):
        assert layer.keys is k and layer.values is v
    assert cache.get_seq_length() == 10
    new_k, new_v = cache.update(torch.ones(1, 2, 1, 16), torch.ones(1, 2, 1, 16), 0)
    assert new_k.shape[-2] == 11 and torch.equal(new_k[..., :10, :], before[0])
    assert all(torch.equal(k, b) for k, b in zip(keys, before, strict=True))


def test_sliding_window_layers_keep_hf_s_own_update():
    config = tiny_config("mistral", sliding_window=4)
    keys, values = _kv(3, 10)
    cache = dynamic_cache_of(config, keys, values)
    reference = type(cache)(config=config)
    for i, (k, v) in enumerate(zip(keys, values, strict=True)):
        reference.update(k, v, i)
    for ours, theirs in zip(cache.layers, reference.layers, strict=True):
        assert type(ours) is type(theirs)
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)
