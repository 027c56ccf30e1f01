"""The 8-bit decode-time K/V cache (``BlendConfig.kv_cache_dtype="int8"``): its q8_0 layout,
the native attention kernel that reads it, and decoding with it on the embedded model."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from conftest import CHUNKS, QUESTION

from ragblend import cpu
from ragblend.cli import build_parser
from ragblend.decode.decoder import LayerDecoder, decode_batch
from ragblend.decode.generation import HFDecoder, decoder_for
from ragblend.errors import RagblendError
from ragblend.kernels.cpu import decode_q8
from ragblend.kernels.cpu.decode_q8 import (
    Q8_BUILDS,
    attend_q8_torch,
    dequantize_q8,
    native_q8,
    q8_block,
    q8_kernel,
    quantize_q8,
)

PROMPTS = ["Hello there, how are you", "The capital of France is a city", "1 2 3 4 5 6 7 8 9"]


@pytest.fixture(scope="module")
def engine(embedded_engine):
    embedded_engine.prepare_decode()  # packed decode linears, as a server's engine runs
    return embedded_engine


@pytest.fixture(scope="module")
def prefills(engine, tokenizer):
    """Full prefills of PROMPTS (decoders copy their caches, so tests share them)."""
    return [engine.full_prefill(tokenizer(p)["input_ids"]) for p in PROMPTS]


def decoders(engine, prefills, steps: int, kv_cache_dtype: str) -> tuple[list, list[int]]:
    """One decoder per prefill (room for ``steps`` more tokens) and the greedy first token of
    each."""
    made, firsts = [], []
    for pre in prefills:
        total = len(pre.prompt_ids) + steps + 1
        made.append(
            decoder_for(engine.model, engine.layers, pre, total, engine.native, kv_cache_dtype)
        )
        firsts.append(int(pre.logits.argmax()))
    return made, firsts


@pytest.mark.parametrize("dim", [64, 48])
def test_quantize_round_trip_is_within_half_a_scale(dim):
    gen = torch.Generator().manual_seed(dim)
    x = torch.randn(1, 3, 37, dim, generator=gen) * torch.rand(1, 3, 37, 1, generator=gen) * 8
    x[0, 0, 5, :] = 0.0  # all-zero blocks quantize to zero codes and a zero scale
    x[0, 1, 7, 3] = 300.0  # an outlier only widens its own block's scale
    block = q8_block(dim)
    codes, scales = quantize_q8(x, block)
    assert codes.dtype == torch.int8 and scales.dtype == torch.float32
    assert scales.shape == (1, 3, 37, dim // block) and block == (32 if dim == 64 else dim)
    assert int(codes.abs().max()) == 127 and not codes[0, 0, 5].any() and not scales[0, 0, 5].any()
    error = (dequantize_q8(codes, scales) - x).abs().unflatten(-1, (-1, block))
    assert (error <= scales.unsqueeze(-1) * 0.5 * (1 + 1e-5)).all()
    if dim == 64:  # the outlier's neighbours in the other block keep their precision
        assert float(scales[0, 1, 7, 1]) < float(scales[0, 1, 7, 0]) / 10


@pytest.mark.parametrize("build", [b for b, _ in Q8_BUILDS], ids=lambda b: b.level)
def test_native_kernel_is_sdpa_over_the_dequantized_cache_and_writes_torchs_codes(build):
    if not cpu.isa_at_least(build.level):
        pytest.skip(f"the {build.level} build needs that CPU level")
    kernel = q8_kernel(build)
    gen = torch.Generator().manual_seed(0)
    for dim, window in ((64, 0), (128, 0), (64, 300), (48, 0)):
        block = q8_block(dim)
        lengths = [1, 33, 517, 1100]  # positions (length - 1) not multiples of 32
        q = torch.randn(1, 9, len(lengths), dim, generator=gen)  # GQA: 9 query heads, 3 KV
        k_new, v_new = torch.randn(2, 1, 3, len(lengths), dim, generator=gen)
        caches = [
            [quantize_q8(torch.randn(1, 3, n + 5, dim, generator=gen), block) for n in lengths]
            for _ in range(2)
        ]
        positions = [n - 1 for n in lengths]
        inputs = (q, k_new, v_new, caches, positions, window)
        got, written = run_q8(kernel, *inputs)
        want, expected = run_q8(attend_q8_torch, *inputs)
        for a, b in zip(written, expected):
            assert all(torch.equal(x, y) for x, y in zip(a, b))
        for b, p in enumerate(positions):  # the new token's codes: quantize_q8's
            codes, scales = quantize_q8(k_new[:, :, b], block)
            assert torch.equal(written[0][b][:, :, p], codes)
            assert torch.equal(written[1][b][:, :, p], scales)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
        assert got.shape == (1, len(lengths), 9 * dim)


def test_native_q8_takes_the_widest_build_whose_lanes_divide_the_head_dim(monkeypatch):
    taken = []

    def load(build, last):
        taken.append(build.name)
        return lambda *args: build.name

    monkeypatch.setattr(decode_q8, "_Q8", {})
    monkeypatch.setattr(decode_q8, "_load_q8", load)
    wide, avx2 = (b.name for b, _ in Q8_BUILDS)
    assert native_q8(64)() == wide and native_q8(128)() == wide
    assert native_q8(48)() == wide  # one scale per row of 48: a multiple of 16
    assert native_q8(40)() == avx2 and native_q8(72)() == avx2
    assert native_q8(36) is None  # no build's lanes divide it: SDPA per request
    assert taken == [wide, avx2]  # each build loaded once per process


def test_a_wide_build_that_does_not_run_leaves_the_avx2_one_with_one_warning(monkeypatch, caplog):
    if not cpu.isa_at_least("avx2"):
        pytest.skip("the AVX2 build needs that CPU level")
    wide = Q8_BUILDS[0][0]
    monkeypatch.setattr(decode_q8, "_Q8", {})
    monkeypatch.setattr(cpu, "isa_at_least", lambda level: True)
    broken = wide._replace(name="ragblend_decode_q8_broken", flags=(*wide.flags, "-fno-such"))
    monkeypatch.setattr(decode_q8, "Q8_BUILDS", ((broken, 16), Q8_BUILDS[1]))
    with caplog.at_level(logging.WARNING, logger="ragblend.kernels.cpu.decode_q8"):
        kernel = native_q8(64)
        assert native_q8(64) is kernel
    assert kernel is not None
    warnings = [r.message for r in caplog.records]
    assert len(warnings) == 1 and "avx512 int8 K/V decode attention does not run" in warnings[0]


def run_q8(attend, q, k_new, v_new, caches, positions, window):
    """``attend`` over copies of ``caches`` ([keys, values], each a (codes, scales) per
    request): its output and the copies after it (key codes, key scales, value codes, value
    scales, each a list over the requests)."""
    bufs = [[c[part].clone() for c in kv] for kv in caches for part in (0, 1)]
    return attend(q, k_new, v_new, *bufs, positions, window, 0.125), bufs


def test_int8_logits_of_a_request_batched_equal_its_logits_alone_bit_for_bit(engine, prefills):
    steps = 3
    feed = [[(7 * s + 3 * b) % 200 + 5 for s in range(steps)] for b in range(len(prefills))]

    def forced(indices):
        made, _ = decoders(engine, [prefills[b] for b in indices], steps, "int8")
        assert all(isinstance(d, LayerDecoder) and d.keys[0].dtype == torch.int8 for d in made)
        return [decode_batch(made, [feed[b][s] for b in indices]) for s in range(steps)]

    together = forced([0, 1, 2])
    for b in range(len(prefills)):
        alone = forced([b])
        assert all(torch.equal(t[b], a[0]) for t, a in zip(together, alone))


def test_auto_is_the_float_decoder_as_before(engine, prefills):
    pre = prefills[1]
    n = len(pre.prompt_ids)
    auto = engine.decoder(pre, 3)  # the engine's default config: kv_cache_dtype="auto"
    before = LayerDecoder.for_cache(
        engine.layers, pre.cache, n, n + 3, engine.native, activations=engine.decode_activations
    )
    assert engine.config.kv_cache_dtype == "auto" and isinstance(auto, LayerDecoder)
    assert auto.keys[0].dtype == engine.layers.dtype and not auto.key_scales
    token = int(pre.logits.argmax())
    for _ in range(3):
        a, b = auto.step(token), before.step(token)
        assert torch.equal(a, b)
        token = int(a.argmax())


def test_int8_greedy_decode_runs_and_stays_close_to_autos(engine):
    """Tolerance: per step KL(auto || int8) < 5e-3 nats and the same greedy token (measured
    on this prompt: KL <= 3e-4, logits within 0.3)."""
    prompt = engine.tokenize(QUESTION, CHUNKS)
    int8 = engine.with_config(kv_cache_dtype="int8")
    pre = engine.prefill(prompt, "full")
    auto_d, int8_d = engine.decoder(pre, 8), int8.decoder(pre, 8)
    assert isinstance(int8_d, LayerDecoder) and int8_d.kv_cache_dtype == "int8"
    token = int(pre.logits.argmax())
    for _ in range(4):
        want, got = auto_d.step(token), int8_d.step(token)
        kl = F.kl_div(got.log_softmax(-1), want.log_softmax(-1), log_target=True, reduction="sum")
        assert float(kl) < 5e-3
        assert int(got.argmax()) == int(want.argmax())
        token = int(want.argmax())


def test_the_torch_fallback_gives_the_native_kernels_logits_to_rounding(engine, prefills):
    """Rounding, amplified: an fp32 rounding difference in one layer's attention can move a
    later new key or value across a rounding boundary of its int8 code (one quantum of its
    block's scale), so logits differ by up to a few 1e-2 (KL per step < 1e-4 nats)."""
    (native,), (first,) = decoders(engine, prefills[2:], 3, "int8")
    (plain,), _ = decoders(engine, prefills[2:], 3, "int8")
    plain.attend_q8 = attend_q8_torch
    for _ in range(3):
        a, b = native.step(first), plain.step(first)
        kl = F.kl_div(b.log_softmax(-1), a.log_softmax(-1), log_target=True, reduction="sum")
        assert float(kl) < 1e-4 and int(a.argmax()) == int(b.argmax())
        first = int(a.argmax())


def test_a_batch_mixing_cache_dtypes_is_a_clear_error(engine, prefills):
    (auto,), (first,) = decoders(engine, prefills[:1], 2, "auto")
    (int8,), _ = decoders(engine, prefills[:1], 2, "int8")
    with pytest.raises(RagblendError, match="one kv_cache_dtype.*auto and int8"):
        decode_batch([auto, int8], [first, first])
    assert auto.position == int8.position == len(prefills[0].prompt_ids)
    with pytest.raises(RagblendError, match="kv_cache_dtype"):
        LayerDecoder(engine.layers, [], 4, 0, kv_cache_dtype="fp8")


def test_the_hf_decoder_keeps_its_dtype_and_says_so_once(engine, prefills, caplog):
    pre = prefills[0]
    with caplog.at_level(logging.WARNING, logger="ragblend.decode.generation"):
        for _ in range(2):
            hf = decoder_for(engine.model, None, pre, len(pre.prompt_ids) + 2, None, "int8")
            assert isinstance(hf, HFDecoder)
    said = [r for r in caplog.records if "kv_cache_dtype" in r.getMessage()]
    assert len(said) <= 1  # once per process: an earlier test may have said it already


def test_the_cli_flags_parse():
    parser = build_parser()
    serve = parser.parse_args(["serve", "--kv-cache-dtype", "int8"])
    assert serve.kv_cache_dtype == "int8"
    assert parser.parse_args(["serve"]).kv_cache_dtype == "auto"
    bench = parser.parse_args(["bench", "--dataset", "d", "--kv-cache-dtype", "int8", "--out", "x"])
    assert bench.kv_cache_dtype == "int8"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--kv-cache-dtype", "fp8"])
