"""Quality metrics: SQuAD-style F1, normalised answer agreement, KL to full prefill."""

from __future__ import annotations

import argparse
import re
import string
from collections import Counter

import torch

from ragblend.config import DECODE_ACTIVATIONS


def normalize_answer(text: str) -> str:
    """Lower-case, strip punctuation, articles and extra whitespace (SQuAD)."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def f1_score(prediction: str, gold: str) -> float:
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    common = Counter(pred) & Counter(ref)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(ref)
    return 2 * precision * recall / (precision + recall)


def best_f1(prediction: str, answers: list[str]) -> float:
    return max((f1_score(prediction, a) for a in answers), default=0.0)


def kl_divergence(reference_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(reference ‖ other) per row of logits [T, V] (or [V]), in nats."""
    p_log = torch.log_softmax(reference_logits.float(), dim=-1)
    q_log = torch.log_softmax(logits.float(), dim=-1)
    return (p_log.exp() * (p_log - q_log)).sum(dim=-1).clamp_min(0.0)  # no float-noise negatives


def add_decode_activations_argument(parser: argparse.ArgumentParser) -> None:
    """``--decode-activations`` of a fidelity benchmark (default ``float``): the
    ``BlendConfig.decode_activations`` its reference answer is decoded and teacher-forced with.
    Exact activations leave the prefill's error alone in every KL; ``auto`` (8-bit on AVX2 for
    a GGUF) adds llama.cpp's rounding to it."""
    parser.add_argument(
        "--decode-activations",
        default="float",
        choices=DECODE_ACTIVATIONS,
        help="decode activations of the answers' decode and teacher forcing (default float: "
        "the prefill's error alone; the issue-54 grids of 2026-11-27 ran with auto)",
    )
