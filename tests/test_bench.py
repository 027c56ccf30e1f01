"""Benchmark metrics and the `ragblend bench` contract (flags, results.json keys, plot)."""

from __future__ import annotations

import json

import pytest
import torch

from ragblend import cpu
from ragblend.bench.datasets import cut_to_tokens, load_cases
from ragblend.bench.metrics import best_f1, f1_score, kl_divergence, normalize_answer
from ragblend.cli import main
from ragblend.errors import RagblendError
from ragblend.kernels.cpu.int8_decode import int8_kernels, resolve_decode_activations
from ragblend.models.dtype import resolve_dtype

MODE_KEYS = {
    "ttft_ms_median",
    "ttft_ms_mean",
    "f1",
    "agreement_with_full",
    "first_token_kl_mean",
    "answer_kl_mean",
    "decode_tokens_per_s",
    "n",
}


def test_squad_f1_normalises_case_punctuation_and_articles():
    assert normalize_answer("The  Exeter College!") == "exeter college"
    assert f1_score("Exeter College", "the exeter college") == 1.0
    assert f1_score("Oxford", "Exeter College") == 0.0
    assert f1_score("Exeter College, Oxford", "Exeter College") == pytest.approx(0.8)
    assert best_f1("Paris", ["London", "paris"]) == 1.0


def test_kl_is_zero_for_identical_and_positive_for_different_distributions():
    a = torch.tensor([[2.0, 0.0, -1.0]])
    assert kl_divergence(a, a).item() == pytest.approx(0.0, abs=1e-7)
    assert kl_divergence(a, torch.tensor([[0.0, 2.0, -1.0]])).item() > 0.1


def test_chunks_are_cut_to_the_token_budget_and_never_padded(tokenizer):
    text = "one two three four five six seven eight nine ten " * 20
    cut = cut_to_tokens(tokenizer, text, 16)
    assert text.startswith(cut)
    assert len(tokenizer(cut, add_special_tokens=False)["input_ids"]) == 16
    assert cut_to_tokens(tokenizer, "short text", 16) == "short text"


def test_malformed_dataset_is_a_clear_error(tmp_path, tokenizer):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([{"question": "q"}]))
    with pytest.raises(RagblendError, match="case 0.*malformed"):
        load_cases(path, tokenizer)


@pytest.mark.slow
def test_bench_cli_writes_the_contract_results_and_plot(tmp_path, dev_cases):
    dataset = tmp_path / "cases.json"
    dataset.write_text(json.dumps(dev_cases[:1]))
    out = tmp_path / "out"
    code = main(
        [
            "bench",
            "--dataset",
            str(dataset),
            "--limit",
            "1",
            "--top-k",
            "2",
            "--chunk-tokens",
            "64",
            "--modes",
            "full,prefix,reuse,blend",
            "--repeats",
            "1",
            "--max-new-tokens",
            "4",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    settings = results["settings"]
    for key in (
        "model",
        "device",
        "top_k",
        "chunk_tokens",
        "ratio",
        "selector",
        "tier",
        "n",
        "repeats",
        "torch_threads",
        "cpu_isa",
        "cpu_model",
    ):
        assert key in settings
    assert settings["cpu_isa"] == cpu.cpu_isa() and settings["cpu_model"] == cpu.cpu_model()
    assert settings["top_k"] == 2 and settings["n"] == 1 and settings["tier"] == "ram"
    # the embedded GGUF's Q4_1 / Q8_0 tensors are kept: decode steps read the Q4_1 blocks
    assert settings["weights"] == "quantized"
    # with 8-bit activations where this CPU level's auto picks them (or the kernels cannot run)
    runs = int8_kernels() is not None
    assert settings["decode_activations"] == (
        resolve_decode_activations("auto") if runs else "float"
    )
    kind = "int8" if settings["decode_activations"] == "int8" else "native"
    assert settings["decode_path"] in (f"q4_1-{kind}", "q4_1-dequantize")
    assert settings["kv_cache_dtype"] == "auto"
    assert 50e6 < settings["weight_bytes"] < 1.2e9  # blocks (+ a dense copy for prefills)
    # dtype "auto" is recorded resolved ("bfloat16" on AMX/AVX512-BF16 CPUs, else "float32").
    assert settings["dtype"] == str(resolve_dtype("auto")).removeprefix("torch.")
    assert set(results["modes"]) == {"full", "prefix", "reuse", "blend"}
    for mode in results["modes"].values():
        assert MODE_KEYS <= set(mode)
    assert results["modes"]["full"]["agreement_with_full"] == 1.0
    assert results["modes"]["full"]["answer_kl_mean"] == pytest.approx(0.0, abs=1e-6)
    # prefix is exact in fp32; in bf16 the layer-wise prefill after the prefix cache and HF's
    # forward accumulate in different orders, a noise of ~1e-3 (10 dev questions: 0.0014 mean)
    # that moves with any rounding change upstream — still far below reuse's KL
    bound = 1e-3 if settings["dtype"] == "float32" else 5e-3
    assert results["modes"]["prefix"]["answer_kl_mean"] == pytest.approx(0.0, abs=bound)
    assert 0 < results["modes"]["blend"]["recomputed_fraction_mean"] < 1
    assert all(m["decode_tokens_per_s"] > 0 for m in results["modes"].values())
    assert set(results["speedup_vs_full"]) == {"prefix", "reuse", "blend"}
    assert (out / "ttft_vs_quality.png").stat().st_size > 1000


def test_bench_cli_rejects_unknown_modes(tmp_path, dev_cases, capsys):
    dataset = tmp_path / "cases.json"
    dataset.write_text(json.dumps(dev_cases[:1]))
    assert (
        main(
            [
                "bench",
                "--dataset",
                str(dataset),
                "--modes",
                "full,turbo",
                "--out",
                str(tmp_path / "o"),
            ]
        )
        == 2
    )
    assert "unknown mode 'turbo'" in capsys.readouterr().err
