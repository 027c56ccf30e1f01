"""The CPU-level probe, its RAGBLEND_CPU_ISA cap, and every fast path stepping down on a CPU
that cannot run it — with one log line, never a crash."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import CHUNKS, QUESTION, tiny_model

from ragblend import BlendConfig, BlendEngine, cpu
from ragblend.config import MODES
from ragblend.errors import RagblendError
from ragblend.models import dtype as dtypes
from ragblend.models import packed as packing

AVX2 = frozenset({"sse4_2", "avx", "avx2", "fma"})
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
AMX = AVX512 | {"avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"}


@pytest.mark.parametrize(
    ("flags", "level"),
    [
        (frozenset(), "baseline"),
        (frozenset({"avx2"}), "baseline"),  # AVX2 without FMA is not the avx2 level
        (AVX2, "avx2"),
        (AVX2 | {"avx512f"}, "avx2"),  # AVX512F alone: oneDNN's and torch's AVX512 need BW/VL/DQ
        (AVX512, "avx512"),
        (AVX512 | {"avx512_bf16"}, "avx512_bf16"),
        (AMX, "amx"),
        (AVX512 | {"amx_tile", "amx_bf16"}, "avx512"),  # levels are cumulative
    ],
)
def test_the_level_is_the_highest_whose_flags_and_all_below_it_are_present(flags, level):
    assert cpu.native_level(flags) == level


def test_the_cap_lowers_the_level_and_never_raises_it(monkeypatch, caplog):
    monkeypatch.setattr(cpu, "cpu_flags", lambda: AMX)
    monkeypatch.delenv(cpu.ENV_CAP, raising=False)
    assert cpu.cpu_isa() == "amx" and cpu.has_fast_bf16() and cpu.onednn_packs_bf16()
    monkeypatch.setenv(cpu.ENV_CAP, "AVX2")  # case does not matter
    assert cpu.cpu_isa() == "avx2"
    assert not cpu.has_fast_bf16() and not cpu.onednn_packs_bf16()
    assert not cpu.isa_at_least("avx512") and cpu.isa_at_least("avx2")

    monkeypatch.setattr(cpu, "cpu_flags", lambda: AVX2)
    monkeypatch.setenv(cpu.ENV_CAP, "amx")
    with caplog.at_level(logging.WARNING, logger="ragblend.cpu"):
        assert cpu.cpu_isa() == "avx2"
        assert cpu.cpu_isa() == "avx2"
    assert caplog.text.count("above this CPU's level") == 1


def test_an_unknown_cap_is_one_clear_error(monkeypatch):
    monkeypatch.setenv(cpu.ENV_CAP, "avx9")
    with pytest.raises(RagblendError, match="RAGBLEND_CPU_ISA='avx9'.*baseline, avx2, avx512"):
        cpu.cpu_isa()


def test_avx_ne_convert_lets_onednn_pack_on_an_avx2_cpu(monkeypatch):
    monkeypatch.delenv(cpu.ENV_CAP, raising=False)
    monkeypatch.setattr(cpu, "cpu_flags", lambda: AVX2 | {"avx_ne_convert"})
    assert cpu.cpu_isa() == "avx2" and cpu.onednn_packs_bf16()


def test_this_cpu_is_described_for_benchmark_settings():
    info = cpu.describe()
    assert info["cpu_isa"] in cpu.LEVELS
    assert info["cpu_model"] and info["cpu_model"] == cpu.cpu_model()
    assert info["torch_cpu_capability"] == str(torch.backends.cpu.get_cpu_capability())


def test_bf16_on_a_cpu_without_bf16_warns_once(monkeypatch, caplog):
    monkeypatch.setenv(cpu.ENV_CAP, "avx2")
    monkeypatch.setattr(dtypes, "_warned_slow_bf16", False)
    with caplog.at_level(logging.WARNING, logger="ragblend.models.dtype"):
        assert dtypes.resolve_dtype("bfloat16") == torch.bfloat16
        assert dtypes.resolve_dtype("bfloat16") == torch.bfloat16
        assert dtypes.resolve_dtype("bfloat16", "cuda") == torch.bfloat16
    assert caplog.text.count("no bf16 instructions") == 1
    assert dtypes.resolve_dtype("auto") == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_mode_generates_at_the_avx2_level(monkeypatch, tokenizer, dtype, caplog):
    monkeypatch.setenv(cpu.ENV_CAP, "avx2")
    model = tiny_model("llama", dtype=dtype)
    engine = BlendEngine(model, tokenizer, BlendConfig(packed_decode=True))
    engine.precompute(CHUNKS)
    with caplog.at_level(logging.INFO, logger="ragblend.models.packed"):
        for mode in MODES:
            out = engine.generate(QUESTION, CHUNKS, mode=mode, max_new_tokens=4)
            assert len(out.token_ids) == 4 and out.stats.mode == mode
    # oneDNN packs fp32 weights at any level; bf16 ones not at this level: one line says so
    assert getattr(model, packing._ATTR, False) == (dtype == torch.float32)
    expected = 1 if dtype == torch.bfloat16 else 0
    assert caplog.text.count("without prepacked bf16 weights") == expected


def test_a_failing_onednn_reorder_leaves_the_model_unpacked_with_one_warning(
    monkeypatch, tokenizer, caplog
):
    def refuse(weight, bias):
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support")

    monkeypatch.setattr(packing, "cpu_packs", lambda dtype: True)
    monkeypatch.setattr(packing, "_prepacked", refuse)
    monkeypatch.setattr(packing, "native_bf16", lambda: None)  # oneDNN's bf16 path, then
    model = tiny_model("llama", dtype=torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="ragblend.models.packed"):
        assert packing.pack_decode_linears(model) == 0
        assert packing.pack_decode_linears(model) == 0  # tried once per model
    assert caplog.text.count("oneDNN could not pack") == 1
    assert not any("forward" in vars(m) for m in model.modules())
    engine = BlendEngine(model, tokenizer, BlendConfig())
    assert len(engine.generate(QUESTION, CHUNKS, mode="full", max_new_tokens=3).token_ids) == 3
