"""What the RAG examples share: command line and the dev corpus as distinct passages."""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from ragblend.bench.datasets import default_dataset

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATASET = default_dataset()  # ../shared's dev cases, else the 4 shipped with ragblend
COLLECTION = "musique-dev"


def parse_args(description: str, argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--dataset", type=Path, default=DEFAULT_DATASET, help="MuSiQue-format JSON")
    p.add_argument("--questions", type=int, default=3, help="questions to answer")
    p.add_argument(
        "--cases",
        type=int,
        default=None,
        help="cases whose passages are indexed (default: --questions; 0: all)",
    )
    p.add_argument("--top-k", type=int, default=6, help="passages retrieved per question")
    p.add_argument(
        "--persist-dir",
        type=Path,
        default=None,
        help="Chroma directory (default: a temporary one, removed at exit); "
        "an existing collection there is rebuilt",
    )
    p.add_argument("--model", default="embedded", help="'embedded' or a local HF model dir")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--ratio", type=float, default=None, help="blend recompute ratio")
    return p.parse_args(argv)


def load_passages(path: Path, cases: int) -> tuple[list[dict], list[dict]]:
    """The dataset and each distinct passage of its first ``cases`` cases (0: all) as
    ``{"text", "title", "case", "ctx"}``."""
    if not path.is_file():
        sys.exit(f"dataset not found: {path} (pass --dataset)")
    data = json.loads(path.read_text())
    selected = data if cases == 0 else data[:cases]
    seen: set[str] = set()
    passages = []
    for case_no, case in enumerate(selected):
        for ctx_no, ctx in enumerate(case["ctxs"]):
            text = ctx["text"].strip()
            if text and text not in seen:
                seen.add(text)
                passages.append(
                    {"text": text, "title": ctx.get("title") or "", "case": case_no, "ctx": ctx_no}
                )
    return data, passages


@contextlib.contextmanager
def chroma_dir(persist_dir: Path | None) -> Iterator[Path]:
    """``persist_dir``, or a temporary directory removed on exit when none is given."""
    if persist_dir is not None:
        yield persist_dir
        return
    temp_dir = tempfile.mkdtemp(prefix="ragblend-chroma-")
    try:
        yield Path(temp_dir)
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)
