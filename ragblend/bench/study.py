"""What the fidelity studies under ``benchmarks/`` share: their command line for the held-out
questions and the model, the engine with the dataset's neighbours, the questions, and the files
each writes after every question (so a long run can be read, or stopped, half way).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ragblend.bench.datasets import Case, load_cases

if TYPE_CHECKING:
    from ragblend.engine import BlendEngine


def add_case_arguments(
    parser: argparse.ArgumentParser,
    offset: int,
    limit: int,
    max_new_tokens: int | None = 32,
) -> None:
    """``--dataset`` (required), ``--offset``/``--limit`` (the questions ``offset`` to
    ``offset + limit``), ``--top-k`` and ``--chunk-tokens`` (each question's chunks: its top-k
    passages, cut to that many tokens), and ``--max-new-tokens`` (the reference answer's
    length) unless ``max_new_tokens`` is None."""
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--offset", type=int, default=offset, help="skip the first N questions")
    parser.add_argument("--limit", type=int, default=limit)
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument("--chunk-tokens", type=int, default=512)
    if max_new_tokens is not None:
        parser.add_argument("--max-new-tokens", type=int, default=max_new_tokens)


def add_model_arguments(
    parser: argparse.ArgumentParser, dtype: str = "float32", dtype_help: str | None = None
) -> None:
    """``--model`` (default the embedded model) and ``--dtype`` (its compute dtype)."""
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--dtype", default=dtype, help=dtype_help or "the model's compute dtype")


def add_output_arguments(parser: argparse.ArgumentParser, name: str | None = None) -> None:
    """``--name`` (the output files' stem, default ``name``; left out where None) and
    ``--out`` (their folder, required)."""
    if name is not None:
        parser.add_argument("--name", default=name, help="stem of the output files")
    parser.add_argument("--out", required=True)


def cases(args: argparse.Namespace, tokenizer: Any, skip: int = 0) -> list[Case]:
    """The questions ``args.offset`` to ``args.offset + args.limit`` of ``args.dataset``, with
    their chunks as :func:`add_case_arguments` describes (``skip``: passages skipped first)."""
    end = args.offset + args.limit
    loaded = load_cases(args.dataset, tokenizer, args.top_k, args.chunk_tokens, end, skip=skip)
    return loaded[args.offset :]


def engine(args: argparse.Namespace, model: str, **config: Any) -> BlendEngine:
    """``BlendEngine.from_pretrained(model, **config)`` with the neighbour source of its
    precompute context over ``args.dataset``'s passages (an explicit choice: the study fails
    where MiniLM is missing rather than measure another context)."""
    from ragblend.bench.neighbours import with_dataset_neighbours
    from ragblend.engine import BlendEngine

    built = BlendEngine.from_pretrained(model, **config)
    return with_dataset_neighbours(built, args.dataset, args.chunk_tokens, explicit=True)


def write_outputs(out: Path, name: str, results: Any, markdown: str | None = None) -> None:
    """``out/name.json`` (``results``, indented) and, given ``markdown``, ``out/name.md``."""
    (out / f"{name}.json").write_text(json.dumps(results, indent=2))
    if markdown is not None:
        (out / f"{name}.md").write_text(markdown)


def question_done(index: int, total: int, started: float) -> None:
    """Print that question ``index`` (from 0) of ``total`` took since ``started``
    (``time.perf_counter()``)."""
    print(f"question {index + 1}/{total} in {time.perf_counter() - started:.0f}s", flush=True)
