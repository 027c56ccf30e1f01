"""Batched decoding: several requests' steps as one batch give what each gives alone."""

from __future__ import annotations

import pytest
import torch
from helpers import FAMILIES, engine_for, tiny_model

from ragblend.decode.decoder import DecodeAttention, LayerDecoder, decode_attention, decode_batch
from ragblend.kernels.cpu.native import native_kernels
from ragblend.models.packed import cpu_packs, pack_decode_linears

PROMPTS = ["Hello there, how are you", "The capital of France is a city", "1 2 3 4 5 6 7 8 9"]


def greedy(engine, decoders, first, steps):
    """Greedy ids and per-step logits, decoding ``decoders`` together."""
    tokens, ids, logits = list(first), [[t] for t in first], []
    for _ in range(steps):
        out = decode_batch(decoders, tokens)
        logits.append(out)
        tokens = [int(t) for t in out.argmax(-1)]
        for seq, t in zip(ids, tokens):
            seq.append(t)
    return ids, logits


def start(engine, prompt_ids, steps):
    pre = engine.full_prefill(prompt_ids)
    total = len(prompt_ids) + steps + 1
    return LayerDecoder.for_cache(engine.layers, pre.cache, len(prompt_ids), total), int(
        pre.logits.argmax()
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_greedy_ids_equal_each_request_decoded_alone_fp32(family, tokenizer):
    engine = engine_for(tiny_model(family), tokenizer)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    steps = 10
    alone = []
    for ids in prompts:
        decoder, first = start(engine, ids, steps)
        alone.append(greedy(engine, [decoder], [first], steps))
    started = [start(engine, ids, steps) for ids in prompts]
    together, logits = greedy(engine, [d for d, _ in started], [f for _, f in started], steps)
    assert together == [ids[0] for ids, _ in alone]
    for b, (_, single) in enumerate(alone):  # same values up to GEMM summation order
        for step, batch_logits in zip(single, logits):
            torch.testing.assert_close(batch_logits[b], step[0], atol=1e-4, rtol=1e-4)


def test_one_request_batch_is_the_single_step(tokenizer):
    engine = engine_for(tiny_model("qwen3"), tokenizer)
    ids = tokenizer(PROMPTS[0])["input_ids"]
    a, first = start(engine, ids, 4)
    b, _ = start(engine, ids, 4)
    assert torch.equal(a.step(first), decode_batch([b], [first])[0])
    assert a.position == b.position == len(ids) + 1


def test_a_full_decode_buffer_is_an_error_and_nothing_advances(tokenizer):
    engine = engine_for(tiny_model("llama"), tokenizer)
    ids = tokenizer(PROMPTS[0])["input_ids"]
    roomy, first = start(engine, ids, 5)
    full = LayerDecoder.for_cache(engine.layers, engine.full_prefill(ids).cache, len(ids), len(ids))
    with pytest.raises(IndexError):
        decode_batch([roomy, full], [first, first])
    assert roomy.position == len(ids)
    with pytest.raises(ValueError):
        decode_batch([roomy], [])


WINDOWS = {  # windows shorter than prompt + steps, so the windowed layers drop keys
    "mistral": {"sliding_window": 8},
    "qwen2": {
        "use_sliding_window": True,
        "sliding_window": 8,
        "layer_types": ["full_attention", "sliding_attention", "sliding_attention"],
    },
    "gemma3": {"sliding_window": 8},
}


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_native_decode_steps_batched_equal_alone_bit_for_bit_and_torch_to_rounding(
    family, tokenizer
):
    engine = engine_for(tiny_model(family, **WINDOWS.get(family, {})), tokenizer)
    kernels = engine.native
    if kernels is None or kernels.decode_attend is None or not cpu_packs(torch.float32):
        pytest.skip("no native fp32 kernels (CPU level below avx2, or no compiler) or oneDNN")
    pack_decode_linears(engine.model)  # as an engine does before it decodes
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    steps = 12

    def run(decoding_together: list[list[int]], native: bool):
        started = [start(engine, ids, steps) for ids in decoding_together]
        for decoder, _ in started:
            decoder.kernels = kernels if native else None
            decoder.attend = decode_attention(engine.layers, decoder.kernels)
            assert (decoder.attend is not None) == native
        return greedy(engine, [d for d, _ in started], [f for _, f in started], steps)

    alone = [run([ids], native=True) for ids in prompts]
    together, logits = run(prompts, native=True)
    assert together == [ids[0] for ids, _ in alone]
    for b, (_, single) in enumerate(alone):  # a request's values do not depend on the batch
        assert all(torch.equal(batch[b], step[0]) for batch, step in zip(logits, single))
    plain, plain_logits = run(prompts, native=False)
    assert plain == together
    for got, want in zip(logits, plain_logits):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_decode_reads_bf16_kv_and_gives_what_fp32_buffers_of_its_values_give(
    family, tokenizer
):
    """A bf16 model's decode K/V stays bf16 (half the bytes a step reads); the fp32 attention
    kernel widens each element exactly, so its logits equal those over fp32 copies bit for
    bit."""
    model = tiny_model(family, dtype=torch.bfloat16, **WINDOWS.get(family, {}))
    engine = engine_for(model, tokenizer, dtype="bfloat16")
    fp32 = native_kernels("auto", torch.float32, torch.device("cpu"), engine.layers.head_dim)
    if fp32 is None or fp32.decode_attend is None:
        pytest.skip("no native fp32 kernels (CPU level below avx2, or no compiler)")
    attend = DecodeAttention(fp32.decode_attend, torch.float32)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    steps = 10

    def decoders(ids_list, widen: bool):
        out, firsts = [], []
        for ids in ids_list:
            pre = engine.full_prefill(ids)
            total = len(ids) + steps + 1
            d = LayerDecoder.for_cache(engine.layers, pre.cache, len(ids), total, engine.native)
            assert d is not None
            d.attend = attend
            assert all(k.dtype == torch.bfloat16 for k in d.keys + d.values)
            if widen:
                d.keys = [k.float() for k in d.keys]
                d.values = [v.float() for v in d.values]
            out.append(d)
            firsts.append(int(pre.logits.argmax()))
        return out, firsts

    bf16_ids, bf16_logits = greedy(engine, *decoders(prompts, widen=False), steps)
    fp32_ids, fp32_logits = greedy(engine, *decoders(prompts, widen=True), steps)
    assert bf16_ids == fp32_ids
    assert all(torch.equal(a, b) for a, b in zip(bf16_logits, fp32_logits))


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_kernel_decode_steps_are_sdpas_to_bf16_rounding_and_batch_invariant(family, tokenizer):
    """At the avx512_bf16 level a bf16 model decodes through the bf16 attention kernel: fed
    the same tokens, its logits are those of SDPA per request to bf16 rounding, and each
    request's logits batched are its logits alone, bit for bit."""
    shape = {"hidden_size": 128, "head_dim": 32}  # the bf16 kernels take multiples of 32
    model = tiny_model(family, dtype=torch.bfloat16, **shape, **WINDOWS.get(family, {}))
    engine = engine_for(model, tokenizer, dtype="bfloat16")
    attend = decode_attention(engine.layers, engine.native)
    if attend is None or attend.q_dtype != torch.bfloat16:
        pytest.skip("no native bf16 decode attention (CPU level below avx512_bf16)")
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    steps = 8
    feed = [[(7 * s + 3 * b) % 200 + 5 for s in range(steps)] for b in range(len(prompts))]

    def forced(indices: list[int], native: bool) -> list[torch.Tensor]:
        decoders = []
        for b in indices:
            ids = prompts[b]
            pre = engine.full_prefill(ids)
            d = LayerDecoder.for_cache(
                engine.layers, pre.cache, len(ids), len(ids) + steps + 1, engine.native
            )
            assert d is not None and d.attend == attend
            d.attend = attend if native else None
            decoders.append(d)
        return [decode_batch(decoders, [feed[b][s] for b in indices]) for s in range(steps)]

    together = forced(list(range(len(prompts))), native=True)
    for b in range(len(prompts)):
        alone = forced([b], native=True)
        assert all(torch.equal(t[b], a[0]) for t, a in zip(together, alone))
    sdpa = forced(list(range(len(prompts))), native=False)
    for got, want in zip(together, sdpa):
        torch.testing.assert_close(got, want, atol=5e-2, rtol=5e-2)
