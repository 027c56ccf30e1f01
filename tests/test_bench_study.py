"""What the fidelity studies share: ragblend.bench.study (arguments, questions, output files)
and ragblend.bench.fidelity (scoring against full prefill), on stand-ins for the engine."""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import pytest
import torch

from ragblend.bench import fidelity, study
from ragblend.bench.datasets import DEMO_DATASET
from ragblend.bench.harness import Variant


class WordTokenizer:
    """Whitespace tokens with character offsets: enough for ``load_cases``'s cutting."""

    def __call__(self, text, add_special_tokens=False, return_offsets_mapping=False):
        offsets, start = [], 0
        for word in text.split():
            start = text.index(word, start)
            offsets.append((start, start + len(word)))
            start += len(word)
        return {"offset_mapping": offsets}


def parse(argv: list[str], **defaults) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    study.add_case_arguments(ap, **defaults)
    study.add_model_arguments(ap, dtype="auto")
    study.add_output_arguments(ap, name="stem")
    return ap.parse_args(argv)


def test_case_arguments_keep_each_studys_defaults():
    args = parse(["--dataset", "d.json", "--out", "o"], offset=12, limit=28)
    assert (args.offset, args.limit, args.top_k, args.chunk_tokens) == (12, 28, 6, 512)
    assert (args.max_new_tokens, args.model, args.dtype, args.name) == (
        32,
        "embedded",
        "auto",
        "stem",
    )
    args = parse(["--dataset", "d.json", "--out", "o"], offset=0, limit=8, max_new_tokens=None)
    assert not hasattr(args, "max_new_tokens")
    with pytest.raises(SystemExit):
        parse(["--out", "o"], offset=0, limit=1)  # --dataset is required


def test_cases_are_the_offset_window_cut_to_chunk_tokens():
    args = parse(
        ["--dataset", str(DEMO_DATASET), "--out", "o", "--top-k", "2", "--chunk-tokens", "5"],
        offset=1,
        limit=2,
    )
    cases = study.cases(args, WordTokenizer())
    everything = json.loads(DEMO_DATASET.read_text())
    assert [c.question for c in cases] == [str(q["question"]) for q in everything[1:3]]
    assert all(len(c.chunks) == 2 for c in cases)
    assert all(len(chunk.split()) <= 5 for c in cases for chunk in c.chunks)


def test_write_outputs_writes_json_and_markdown(tmp_path):
    study.write_outputs(tmp_path, "run", {"a": 1}, "| table |\n")
    assert json.loads((tmp_path / "run.json").read_text()) == {"a": 1}
    assert (tmp_path / "run.md").read_text() == "| table |\n"
    study.write_outputs(tmp_path, "plain", [1, 2])
    assert not (tmp_path / "plain.md").exists()


EOS = 9


def one_hot(ids: list[int], vocab: int = 10) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(ids), vocab).float() * 10


class FakeEngine:
    """Teacher-forced logits that predict ``predicts`` (a row per taught token)."""

    eos_ids = {EOS}

    def __init__(self, answer: list[int], predicts: dict[int, list[int]]) -> None:
        self.answer, self.predicts = answer, predicts

    def greedy_answer(self, pre, max_new_tokens):
        return self.answer[:max_new_tokens]

    def teacher_forced_logits(self, pre, taught):
        return one_hot(self.predicts[id(pre)][: len(taught)])


def prefill(logits: list[int], recomputed: float = 0.0) -> SimpleNamespace:
    return SimpleNamespace(
        logits=one_hot(logits)[0], stats=SimpleNamespace(recomputed_fraction=recomputed)
    )


def test_score_agreement_needs_every_token_and_the_eos():
    full, same, off, late = prefill([1]), prefill([1], 0.15), prefill([2], 0.15), prefill([1])
    engine = FakeEngine(
        [1, 2],
        {id(full): [1, 2, EOS], id(same): [1, 2, EOS], id(off): [1, 3, EOS], id(late): [1, 2, 4]},
    )
    ref = fidelity.reference(engine, full, max_new_tokens=4)
    assert ref.ended and ref.taught == [1, 2, EOS]
    exact = fidelity.score(engine, ref, same)
    assert exact["agrees"] and exact["answer_kl"] == pytest.approx(0.0, abs=1e-6)
    assert exact["first_token_kl"] == pytest.approx(0.0, abs=1e-6)
    assert exact["recomputed_fraction"] == 0.15
    wrong = fidelity.score(engine, ref, off)
    assert not wrong["agrees"] and wrong["answer_kl"] > 1 and wrong["first_token_kl"] > 1
    assert not fidelity.score(engine, ref, late)["agrees"]  # right tokens, no EOS after them


def test_measure_case_scores_every_variant_against_the_first():
    engine = FakeEngine([3], {})
    pres = {"full": prefill([3]), "blend": prefill([4], 0.2)}
    engine.predicts = {id(pres["full"]): [3], id(pres["blend"]): [5]}  # answer hit the limit
    views = {
        name: SimpleNamespace(tokenize=lambda q, c: None, prefill=lambda p, m, _n=name: pres[_n])
        for name in pres
    }
    grid = [Variant("full", "full"), Variant("blend", "blend")]
    case = SimpleNamespace(question="q", chunks=["c"])
    rows = fidelity.measure_case(engine, views, grid, case, max_new_tokens=1)
    assert list(rows) == ["full", "blend"] and rows["full"]["agrees"]
    assert not rows["blend"]["agrees"] and rows["blend"]["recomputed_fraction"] == 0.2
    assert all(r["ttft_ms"] >= 0 for r in rows.values())


def test_summarize_means_and_median_speedup():
    def rec(ttft, kl, agrees):
        return {
            "ttft_ms": ttft,
            "answer_kl": kl,
            "first_token_kl": 2 * kl,
            "agrees": agrees,
            "recomputed_fraction": 0.1,
        }

    rows = [
        {"full": rec(100, 0, True), "blend": rec(25, 0.2, True)},
        {"full": rec(90, 0, True), "blend": rec(45, 0.4, False)},
        {"full": rec(120, 0, True), "blend": rec(40, 0.6, True)},
    ]
    out = fidelity.summarize(rows)
    blend = out["modes"]["blend"]
    assert blend["answer_kl_mean"] == pytest.approx(0.4)
    assert blend["first_token_kl_mean"] == pytest.approx(0.8)
    assert blend["agreement_with_full"] == pytest.approx(2 / 3)
    assert blend["ttft_ms_median"] == 40 and blend["n"] == 3
    assert out["speedup_vs_full"] == {"full": 1.0, "blend": 3.0}
    assert out["per_question"] is rows
