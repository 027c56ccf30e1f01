"""Evaluation cases in the MuSiQue / CacheBlend format."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ragblend.errors import RagblendError

# shipped with the package (4 MuSiQue dev cases, CC BY 4.0: ragblend/data/README.md)
DEMO_DATASET = Path(__file__).resolve().parents[1] / "data" / "musique_demo.json"
# the 40 dev cases beside a development checkout (../shared), when it has them
DEV_DATASET = Path(__file__).resolve().parents[3] / "shared" / "data" / "musique_dev.json"


def default_dataset() -> Path:
    """The dataset a demo or example uses when none is given: the dev cases beside a checkout
    where they are, else the demo cases shipped with the package."""
    return DEV_DATASET if DEV_DATASET.is_file() else DEMO_DATASET


@dataclass
class Case:
    question: str
    answers: list[str]
    chunks: list[str]


def cut_to_tokens(tokenizer, text: str, max_tokens: int) -> str:
    """The longest prefix of ``text`` covering at most ``max_tokens`` tokens (cut, never pad)."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = enc["offset_mapping"]
    if len(offsets) <= max_tokens:
        return text
    return text[: offsets[max_tokens - 1][1]]


def _read(path: str | Path) -> list:
    path = Path(path)
    if not path.is_file():
        raise RagblendError(f"dataset {path} not found")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise RagblendError(f"dataset {path} is not valid JSON: {exc}") from None
    if not isinstance(raw, list):
        raise RagblendError(f"dataset {path} must be a JSON list of cases")
    return raw


def _passages(item, tokenizer, chunk_tokens: int, top_k: int | None, skip: int = 0) -> list[str]:
    chunks = []
    for c in item["ctxs"][skip : None if top_k is None else skip + top_k]:
        text = (c.get("title") + "\n" if c.get("title") else "") + c["text"]
        chunks.append(cut_to_tokens(tokenizer, text, chunk_tokens))
    return chunks


def load_cases(
    path: str | Path,
    tokenizer,
    top_k: int = 6,
    chunk_tokens: int = 512,
    limit: int | None = None,
    skip: int = 0,
) -> list[Case]:
    """Read a JSON list of ``{question, answers, ctxs: [{title, text}]}``; chunks = the top-k
    passages after the first ``skip`` (another retrieval set for the same questions)."""
    raw = _read(path)
    cases = []
    for i, item in enumerate(raw[:limit] if limit else raw):
        try:
            chunks = _passages(item, tokenizer, chunk_tokens, top_k, skip)
            cases.append(Case(str(item["question"]), list(item.get("answers", [])), chunks))
        except (KeyError, TypeError) as exc:
            raise RagblendError(f"case {i} of {path} is malformed: missing {exc}") from None
    return cases


def dataset_passages(path: str | Path, tokenizer, chunk_tokens: int = 512) -> list[list[str]]:
    """Every passage of every case (all ctxs, in order), cut as :func:`load_cases` cuts."""
    documents = []
    for i, item in enumerate(_read(path)):
        try:
            documents.append(_passages(item, tokenizer, chunk_tokens, None))
        except (KeyError, TypeError) as exc:
            raise RagblendError(f"case {i} of {path} is malformed: missing {exc}") from None
    return documents
