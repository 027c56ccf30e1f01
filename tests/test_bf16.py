"""``dtype="auto"`` picks bf16 only where the hardware has it; ratio-1.0 blend in bf16 is HF's."""

from __future__ import annotations

import pytest
import torch
from conftest import CHUNKS, FAMILIES, QUESTION, tiny_model
from helpers import engine_for, hf_forward, layer_kv

from ragblend import BlendConfig, cpu
from ragblend.errors import RagblendError
from ragblend.models import dtype as dtypes

# bf16 has an 8-bit mantissa, so a 3-layer model's outputs differ from fp32 by ~1e-2 whichever
# way the ops are ordered. The gate: our bf16 blend's error against the fp32 reference is at
# most SLACK × HF-bf16's own error against it, plus FLOOR (for outputs HF gets almost exactly).
SLACK = 1.5
FLOOR = 2e-3

WINDOWED = {
    "mistral": {"sliding_window": 24},
    "qwen2": {
        "use_sliding_window": True,
        "sliding_window": 24,
        "layer_types": ["full_attention", "sliding_attention", "sliding_attention"],
    },
}


AVX512 = {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq"}


@pytest.mark.parametrize(
    ("flags", "cap", "expected"),
    [
        (AVX512 | {"avx512_bf16"}, None, torch.bfloat16),
        (AVX512 | {"avx512_bf16", "amx_tile", "amx_bf16"}, None, torch.bfloat16),
        (AVX512 | {"avx512_bf16", "amx_tile", "amx_bf16"}, "avx512", torch.float32),  # capped
        (AVX512 | {"avx512_bf16", "amx_tile", "amx_bf16"}, "avx2", torch.float32),
        ({"avx2", "fma", "avx512_bf16"}, None, torch.float32),  # no AVX512 under it
        (AVX512, None, torch.float32),  # AVX512 without its bf16 extension
        (set(), None, torch.float32),
    ],
)
def test_auto_dtype_is_bf16_only_on_cpus_with_bf16_instructions(monkeypatch, flags, cap, expected):
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset(flags))
    if cap is None:
        monkeypatch.delenv("RAGBLEND_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("RAGBLEND_CPU_ISA", cap)
    assert dtypes.resolve_dtype("auto", "cpu") == expected


def test_auto_dtype_is_bf16_on_cuda_whatever_the_cpu(monkeypatch):
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset())
    assert dtypes.resolve_dtype("auto", "cuda") == torch.bfloat16
    assert dtypes.resolve_dtype("auto", "cuda:1") == torch.bfloat16


def test_named_dtypes_resolve_and_unknown_ones_are_a_clear_error():
    assert dtypes.resolve_dtype("float32") == torch.float32
    assert dtypes.resolve_dtype("bfloat16", "cuda") == torch.bfloat16
    assert dtypes.resolve_dtype(torch.float16) == torch.float16
    with pytest.raises(RagblendError, match="unknown dtype 'fp8'.*auto"):
        dtypes.resolve_dtype("fp8")


def test_config_default_dtype_is_auto():
    assert BlendConfig().dtype == "auto"


def _outputs(out_logits, cache, num_layers) -> list[torch.Tensor]:
    tensors = [out_logits.float().reshape(-1)]
    for layer in range(num_layers):
        tensors.extend(t.float() for t in layer_kv(cache, layer))
    return tensors


def _max_error(got: list[torch.Tensor], ref: list[torch.Tensor]) -> list[float]:
    return [float((g - r).abs().max()) for g, r in zip(got, ref)]


@pytest.mark.parametrize(
    ("family", "windowed"),
    [(f, False) for f in FAMILIES] + [(f, True) for f in WINDOWED],
    ids=lambda p: p if isinstance(p, str) else ("window" if p else "full"),
)
def test_bf16_blend_at_ratio_one_is_as_close_to_fp32_as_hf_bf16_is(family, windowed, tokenizer):
    overrides = WINDOWED.get(family, {}) if windowed else {}
    model32 = tiny_model(family, **overrides)
    model16 = tiny_model(family, dtype=torch.bfloat16, **overrides)
    engine = engine_for(model16, tokenizer, ratio=1.0)
    engine.precompute(CHUNKS)
    prompt = engine.tokenize(QUESTION, CHUNKS)
    layers = engine.layers.num_layers

    ref32 = hf_forward(model32, prompt.ids)
    ref16 = hf_forward(model16, prompt.ids)
    out = engine.prefill(prompt, "blend")
    assert out.stats.recomputed_fraction == 1.0
    assert layer_kv(out.cache, 0)[0].dtype == torch.bfloat16

    fp32 = _outputs(ref32.logits[0, -1], ref32.past_key_values, layers)
    hf_err = _max_error(_outputs(ref16.logits[0, -1], ref16.past_key_values, layers), fp32)
    our_err = _max_error(_outputs(out.logits, out.cache, layers), fp32)
    names = ["logits"] + [f"{kv}{i}" for i in range(layers) for kv in ("k", "v")]
    for name, ours, hf in zip(names, our_err, hf_err):
        assert ours <= SLACK * hf + FLOOR, f"{name}: ours {ours:.4g} vs HF-bf16 {hf:.4g}"
    # And directly against HF bf16: the same greedy first token.
    assert int(out.logits.argmax()) == int(ref16.logits[0, -1].argmax())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", FAMILIES)
def test_in_place_rope_gives_exactly_the_values_of_rope(family, dtype):
    from ragblend.models.adapters import adapter_for

    model = adapter_for(tiny_model(family, dtype=dtype))
    positions = torch.arange(40)
    k = torch.randn(1, model.num_kv_heads, 40, model.head_dim, dtype=dtype)
    cos, sin = model.rope(positions, k)
    expected = model.rotate(k, cos, sin)
    got = model.rotate_(k.clone(), cos, sin)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)


def test_auto_follows_the_measured_table_at_every_level(monkeypatch):
    monkeypatch.setattr(
        cpu, "cpu_flags", lambda: frozenset(AVX512 | {"avx512_bf16", "amx_tile", "amx_bf16"})
    )
    for level in cpu.LEVELS:
        monkeypatch.setenv("RAGBLEND_CPU_ISA", level)
        choice = dtypes.AUTO_BY_LEVEL[level]
        assert dtypes.resolve_dtype("auto", "cpu") == choice.prefill
        assert choice.measured and choice.why  # every row says where it comes from
        # one copy of the weights serves both phases (no level asks for a second)
        assert choice.decode == choice.prefill
