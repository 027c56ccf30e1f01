"""Fidelity to full prefill, scored as the quality studies under ``benchmarks/`` score it.

Every prefill of a prompt is compared with full prefill of the same prompt:

- ``first_token_kl``: KL(full ‖ prefill) of the first token's logits;
- ``answer_kl``: the mean KL over full prefill's greedy answer, both teacher-forced on it;
- ``agrees``: exact greedy agreement, by teacher forcing: a prefill's greedy answer equals
  full prefill's iff its argmax after every prefix of that answer is the answer's next token
  (and EOS after the whole answer, where the answer ended there). The prefill is fed full
  prefill's answer (the decode steps the answer KL needs anyway) instead of decoding its own.

Teacher forcing runs the engine's own decode steps, so with exact decode activations
(``--decode-activations float``) every KL is the prefill's error alone.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from ragblend.bench.datasets import Case
from ragblend.bench.harness import Variant
from ragblend.bench.metrics import kl_divergence

if TYPE_CHECKING:
    from ragblend.decode.generation import Prefill
    from ragblend.engine import BlendEngine


class Reference(NamedTuple):
    """Full prefill's answer to one prompt: what every other prefill of it is scored against."""

    logits: torch.Tensor  # [V] the first token's logits
    answer: list[int]  # the greedy answer's token ids
    ended: bool  # the answer ended (EOS) before the token limit
    taught: list[int]  # the answer, and EOS after it where it ended: the teacher-forced ids
    forced: torch.Tensor  # [len(taught), V] full prefill's teacher-forced logits


def reference(engine: BlendEngine, full: Prefill, max_new_tokens: int) -> Reference:
    """The :class:`Reference` of ``full``, a full prefill on ``engine``."""
    ids = engine.greedy_answer(full, max_new_tokens)
    ended = len(ids) < max_new_tokens
    taught = ids + [min(engine.eos_ids)] if ended else ids
    return Reference(full.logits, ids, ended, taught, engine.teacher_forced_logits(full, taught))


def score(engine: BlendEngine, ref: Reference, pre: Prefill) -> dict[str, Any]:
    """``pre``'s first-token KL, answer KL and agreement against ``ref``, and its recomputed
    share (see the module docstring)."""
    tf = engine.teacher_forced_logits(pre, ref.taught)
    n = len(ref.answer)
    agrees = bool((tf[:n].argmax(-1) == torch.tensor(ref.answer)).all())
    if ref.ended:
        agrees = agrees and int(tf[n].argmax()) in engine.eos_ids
    return {
        "first_token_kl": float(kl_divergence(ref.logits, pre.logits)),
        "answer_kl": float(kl_divergence(ref.forced[:n], tf[:n]).mean()) if n else 0.0,
        "agrees": agrees,
        "recomputed_fraction": pre.stats.recomputed_fraction,
    }


def measure_case(
    engine: BlendEngine,
    views: Mapping[str, BlendEngine],
    grid: Sequence[Variant],
    case: Case,
    max_new_tokens: int,
) -> dict[str, dict[str, Any]]:
    """One question: every variant's TTFT (tokenize + prefill, ms) and its fidelity to full
    prefill. ``grid[0]`` must be full prefill (the reference); ``views`` maps each variant's
    name to the engine view it runs on."""
    records: dict[str, dict[str, Any]] = {}
    ref = None
    for v in grid:
        view = views[v.name]
        start = time.perf_counter()
        prompt = view.tokenize(case.question, case.chunks)
        pre = view.prefill(prompt, v.mode)
        ttft_ms = (time.perf_counter() - start) * 1000
        if ref is None:
            ref = reference(engine, pre, max_new_tokens)
        records[v.name] = {"ttft_ms": ttft_ms, **score(engine, ref, pre)}
        del pre
    return records


def summarize(rows: Sequence[Mapping[str, Mapping[str, Any]]]) -> dict[str, Any]:
    """Per-variant means over the questions' :func:`measure_case` records (``speedup_vs_full``:
    the median of per-question TTFT ratios to ``full``)."""
    modes, speedup = {}, {}
    for name in rows[0]:
        recs = [r[name] for r in rows]
        modes[name] = {
            "ttft_ms_median": statistics.median(r["ttft_ms"] for r in recs),
            "answer_kl_mean": statistics.fmean(r["answer_kl"] for r in recs),
            "first_token_kl_mean": statistics.fmean(r["first_token_kl"] for r in recs),
            "agreement_with_full": statistics.fmean(float(r["agrees"]) for r in recs),
            "recomputed_fraction_mean": statistics.fmean(r["recomputed_fraction"] for r in recs),
            "n": len(recs),
        }
        speedup[name] = statistics.median(r["full"]["ttft_ms"] / r[name]["ttft_ms"] for r in rows)
    return {"modes": modes, "speedup_vs_full": speedup, "per_question": rows}
