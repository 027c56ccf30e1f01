"""The interleaved benchmark runner behind ``ragblend bench`` and the sweep scripts."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ragblend.bench.datasets import Case
from ragblend.bench.metrics import best_f1, kl_divergence, normalize_answer
from ragblend.config import fold_selection
from ragblend.engine import BlendEngine


@dataclass
class Variant:
    """One configuration under test: a mode plus BlendConfig overrides."""

    name: str
    mode: str
    overrides: dict = field(default_factory=dict)


@dataclass
class Record:
    ttft_ms: list[float] = field(default_factory=list)
    answer: str = ""
    f1: float = 0.0
    agrees: bool = False
    first_token_kl: float = 0.0
    answer_kl: float = 0.0
    recomputed_fraction: float = 1.0
    decode_tokens_per_s: float = float("nan")


def sync(device: torch.device | str) -> None:
    """Wait for the device's queued kernels (CUDA is asynchronous), so a timer sees them."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize(device)


def resolve_device(name: str, script: str) -> torch.device:
    """The device a benchmark's ``--device name`` (cuda, cuda:N or cpu) names, with its index;
    a clear exit naming ``script`` where CUDA is asked for and absent, or the name is unknown."""
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise SystemExit(
                f"{script}: error: --device {name} requested but CUDA is not available "
                f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'}); "
                "run on a GPU machine or use --device cpu --shape tiny for a smoke test"
            )
        device = torch.device(name)
        return torch.device(
            "cuda", torch.cuda.current_device() if device.index is None else device.index
        )
    if name != "cpu":
        raise SystemExit(f"{script}: error: unknown device {name!r} (cuda, cuda:N, cpu)")
    return torch.device("cpu")


def peak_memory(device: torch.device) -> int | None:
    """Bytes the run allocated at most on a CUDA ``device`` (None elsewhere); releases the
    cached blocks and resets the peak for the next run."""
    if device.type != "cuda":
        return None
    peak = int(torch.cuda.max_memory_allocated(device))
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return peak


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def mean(xs: Sequence[float]) -> float:
    return float(statistics.fmean(xs)) if xs else float("nan")


def percentile(xs: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``xs``, linear between order statistics (NaN if empty)."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    pos = (len(s) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return float(s[lo] + (s[hi] - s[lo]) * (pos - lo))


def run_benchmark(
    engine: BlendEngine,
    cases: Sequence[Case],
    variants: Sequence[Variant],
    repeats: int = 3,
    max_new_tokens: int = 32,
    before_measure: Callable[[Variant], None] | None = None,
    progress: bool = True,
) -> dict:
    """Run every variant on every case, interleaved per question; returns per-variant summaries.

    A ``full`` reference runs first for each question (greedy answer, teacher-forced logits);
    TTFT of each variant is the median of ``repeats`` interleaved measurements, from the call
    with (chunks, question) to the first token's logits.
    """
    if not any(v.mode == "full" for v in variants):
        variants = [Variant("full", "full"), *variants]
    engine.native  # noqa: B018 (built on first use: before any clock, and shared by the views)
    views = {
        v.name: engine.with_config(**fold_selection(engine.config, v.overrides)) for v in variants
    }
    records: dict[str, list[Record]] = {v.name: [] for v in variants}
    warmup_s = 0.0
    iterator = cases
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(cases, desc="bench", unit="question")
    for case in iterator:
        t0 = time.perf_counter()
        for v in variants:
            if v.mode in ("reuse", "blend"):
                views[v.name].precompute(case.chunks)
        warmup_s += time.perf_counter() - t0
        recs = {v.name: Record() for v in variants}
        ref_name = next(v.name for v in variants if v.mode == "full")
        ordered = sorted(variants, key=lambda v: v.name != ref_name)  # reference first
        reference = None
        for repeat in range(repeats):
            for v in ordered:
                if before_measure is not None:
                    before_measure(v)
                view = views[v.name]
                start = time.perf_counter()
                prompt = view.tokenize(case.question, case.chunks)
                pre = view.prefill(prompt, v.mode)
                recs[v.name].ttft_ms.append((time.perf_counter() - start) * 1000)
                if repeat == repeats - 1:  # score the last measurement, then free it
                    reference = _score(
                        engine, view, v, pre, case, recs[v.name], reference, max_new_tokens
                    )
                del pre
        for v in variants:
            records[v.name].append(recs[v.name])
    return summarize(records, ref_name, warmup_s, len(cases))


def _score(engine, view, variant, pre, case, rec: Record, reference, max_new_tokens: int):
    """Fill ``rec``'s quality fields; returns the reference (set when ``variant`` is full)."""
    if reference is None:  # this is the full-prefill reference
        ids = engine.greedy_answer(pre, max_new_tokens)
        reference = (
            pre.logits,
            ids,
            engine.tokenizer.decode(ids, skip_special_tokens=True),
            engine.teacher_forced_logits(pre, ids),
        )
    ref_logits, ref_ids, ref_text, ref_tf = reference
    t0 = time.perf_counter()
    ids = view.greedy_answer(pre, max_new_tokens)
    if ids:
        rec.decode_tokens_per_s = len(ids) / (time.perf_counter() - t0)
    rec.answer = engine.tokenizer.decode(ids, skip_special_tokens=True)
    rec.f1 = best_f1(rec.answer, case.answers)
    rec.agrees = normalize_answer(rec.answer) == normalize_answer(ref_text)
    rec.first_token_kl = float(kl_divergence(ref_logits, pre.logits))
    rec.answer_kl = float(kl_divergence(ref_tf, engine.teacher_forced_logits(pre, ref_ids)).mean())
    rec.recomputed_fraction = pre.stats.recomputed_fraction
    return reference


def summarize(records: dict[str, list[Record]], ref_name: str, warmup_s: float, n: int) -> dict:
    modes = {}
    for name, recs in records.items():
        ttfts = [median(r.ttft_ms) for r in recs]
        modes[name] = {
            "ttft_ms_median": median(ttfts),
            "ttft_ms_mean": mean(ttfts),
            "f1": mean([r.f1 for r in recs]),
            "agreement_with_full": mean([float(r.agrees) for r in recs]),
            "first_token_kl_mean": mean([r.first_token_kl for r in recs]),
            "answer_kl_mean": mean([r.answer_kl for r in recs]),
            "recomputed_fraction_mean": mean([r.recomputed_fraction for r in recs]),
            "decode_tokens_per_s": median(
                [r.decode_tokens_per_s for r in recs if not math.isnan(r.decode_tokens_per_s)]
            ),
            "n": len(recs),
        }
    ref = records[ref_name]
    speedup = {}
    for name, recs in records.items():
        if name == ref_name:
            continue
        ratios = [median(a.ttft_ms) / median(b.ttft_ms) for a, b in zip(ref, recs)]
        speedup[name] = median(ratios)
    answers = [{name: recs[i].answer for name, recs in records.items()} for i in range(n)]
    return {
        "modes": modes,
        "speedup_vs_full": speedup,
        "warmup_s": warmup_s,
        "answers": answers,
    }


def torch_threads() -> int:
    return torch.get_num_threads()
