"""The static decode pool (ragblend.decode.pool): a GPU's batched decode, checked on CPU
tensors against the per-request decoders for every family."""

from __future__ import annotations

import gc

import pytest
import torch
from conftest import CHUNKS, FAMILIES, QUESTION, tiny_model
from helpers import engine_for

from ragblend.bench.op_counter import OpCounter
from ragblend.decode.decoder import decode_batch
from ragblend.errors import RagblendError

WINDOWED = {"mistral": {"sliding_window": 24}}  # a window shorter than the prompts


def _engines(family, tokenizer, **model_kw):
    model = tiny_model(family, **model_kw)
    pooled = engine_for(
        model, tokenizer, row_attention="masked", decode_slots=4, decode_pool_tokens=256
    )
    own = pooled.with_config(decode_slots=0)
    return pooled, own


def _prefills(engine, n=3):
    engine.precompute(CHUNKS)
    prompts = [engine.tokenize(QUESTION[: 20 + 9 * i], CHUNKS[: 1 + i % 2]) for i in range(n)]
    return [engine.prefill(p, "full") for p in prompts]


def _greedy(engine, prefills, steps=6):
    decoders = [engine.decoder(p, steps) for p in prefills]
    tokens = [int(p.logits.argmax()) for p in prefills]
    rows = []
    for _ in range(steps):
        logits = decode_batch(decoders, tokens)
        rows.append(logits)
        tokens = logits.argmax(-1).tolist()
    return decoders, torch.stack(rows)


@pytest.mark.parametrize(
    "family,window",
    [(f, False) for f in FAMILIES] + [("mistral", True)],
    ids=lambda v: v if isinstance(v, str) else ("window" if v else ""),
)
def test_pooled_batch_steps_equal_per_request_decoding(family, window, tokenizer):
    pooled, own = _engines(family, tokenizer, **(WINDOWED[family] if window else {}))
    prefills = _prefills(pooled)
    decoders, got = _greedy(pooled, prefills)
    assert all(d.pool is pooled.decode_pool for d in decoders)
    assert sorted(d.slot for d in decoders) == [0, 1, 2]  # one slot left over: masked rows
    own_decoders, want = _greedy(own, prefills)
    assert all(d.pool is None for d in own_decoders)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_a_step_of_slots_with_a_gap_masks_the_slot_between(tokenizer):
    pooled, own = _engines("qwen3", tokenizer)
    prefills = _prefills(pooled)
    held = [pooled.decoder(p, 4) for p in prefills]
    stepping = [held[0], held[2]]  # slots 0 and 2: slot 1 in the span, not in the step
    mine = [own.decoder(prefills[0], 4), own.decoder(prefills[2], 4)]
    for token in (7, 11):
        got, want = decode_batch(stepping, [token] * 2), decode_batch(mine, [token] * 2)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    assert held[1].position == len(prefills[1].prompt_ids)  # untouched


def test_a_pooled_step_launches_the_same_kernels_for_any_batch(tokenizer):
    pooled, _ = _engines("llama", tokenizer)
    prefills = _prefills(pooled, n=4)

    def kernels(batch):
        decoders = [pooled.decoder(p, 4) for p in prefills[:batch]]
        tokens = [1] * batch
        decode_batch(decoders, tokens)  # warm
        with OpCounter(pooled.model.model.layers, pooled.model.model.norm) as counter:
            decode_batch(decoders, tokens)
        del decoders
        gc.collect()
        return counter.layer(1).num_kernels

    assert kernels(1) == kernels(2) == kernels(4)


def test_slots_come_back_and_a_full_or_too_short_pool_gives_own_buffers(tokenizer):
    pooled, _ = _engines("qwen2", tokenizer)
    pool = pooled.decode_pool
    assert pool is not None and pool.free_slots == 4
    prefill = _prefills(pooled, n=1)[0]
    held = [pooled.decoder(prefill, 4) for _ in range(4)]
    assert pool.free_slots == 0 and all(d.pool is pool for d in held)
    extra = pooled.decoder(prefill, 4)
    assert extra.pool is None and extra.slot is None  # its own buffers
    mixed = decode_batch([held[0], extra], [5, 5])  # per request when not all share the pool
    assert mixed.shape[0] == 2 and torch.equal(mixed[0], mixed[1])  # same prompt, same token
    del held, extra
    gc.collect()
    assert pool.free_slots == 4
    too_long = pooled.decoder(prefill, pool.capacity)  # prompt + answer > the slot's tokens
    assert too_long.pool is None


def test_pool_decoding_with_the_fused_layer_steps_equals_hf_modules(tokenizer):
    pooled, _ = _engines("llama", tokenizer)
    fused = pooled.with_config(layer_kernels="fused")
    prefills = _prefills(pooled)
    _, want = _greedy(pooled, prefills)
    decoders, got = _greedy(fused, prefills)
    assert decoders[0].layer_kernels is not None
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_decode_pool_settings_are_checked(tokenizer):
    from ragblend import BlendConfig

    with pytest.raises(RagblendError, match="decode_slots must be >= 0"):
        BlendConfig(decode_slots=-1)
    with pytest.raises(RagblendError, match="decode_pool_tokens must be >= 1"):
        BlendConfig(decode_pool_tokens=0)
    engine = engine_for(tiny_model("llama"), tokenizer)
    assert engine.decode_pool is None  # off on a CPU by default


def test_cuda_graphs_are_for_cuda_pools_only(tokenizer):
    from ragblend.decode.graph import DecodeGraph
    from ragblend.decode.pool import DecodePool

    pooled, _ = _engines("llama", tokenizer)
    graphs = pooled.with_config(cuda_graphs=True)
    pool = graphs.decode_pool
    assert pool is not None and pool is not pooled.decode_pool and not pool.cuda_graphs
    with pytest.raises(RuntimeError, match="CUDA graphs need a CUDA device, the pool is on cpu"):
        small = DecodePool(pooled.layers, 2, 16)
        step = lambda t, p, r: small.forward(t, p, r, slice(0, small.slots))  # noqa: E731
        DecodeGraph(step, small.slots, small.capacity, small.keys[0].device)
