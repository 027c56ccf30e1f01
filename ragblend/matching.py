"""Content-addressed chunk recovery: find known chunk texts inside a finished prompt string.

Frameworks join retrieved texts into one prompt before the LLM sees it. To fuse chunk caches
anyway, the prompt is searched for the exact texts of known chunks — the documents this query
retrieved (:func:`add_retrieved`, scoped per thread / asyncio task with a context variable) and
every chunk an engine was warmed with (:func:`known_chunks`) — and split there. Each piece
(head text, chunk, between-text, tail) is tokenised on its own, as the documented chunked
paths do. Separators are never parsed: only exact chunk texts split the prompt.

A chunk is also found in the forms frameworks turn texts into (:func:`prompt_forms`): LlamaIndex's
``simple_summarize`` formats its context as a Python list, so each chunk appears with its
newlines and quotes escaped. The matched chunk is always the text as it occurs in the prompt, so
the fused prompt is the very text a full prefill would read.
"""

from __future__ import annotations

import contextvars
import threading
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import ahocorasick

from ragblend.fallback import CACHE_MISS, NO_KNOWN_CHUNK, fall_back
from ragblend.prompt import TokenizedPrompt, encode

# Texts shorter than this are never matched: short strings occur by chance in any prompt.
MIN_CHUNK_CHARS = 24
# Each known chunk is indexed by a window from its middle (common prefixes such as metadata
# lines or suffixes would make one key stand for many chunks); a hit is verified by hash.
WINDOW_CHARS = 32
_MARK = "\x00RAGBLEND_CHUNKS\x00"

_retrieved: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar(
    "ragblend_retrieved", default=()
)


def prompt_forms(text: str) -> list[str]:
    """The forms ``text`` can take inside a prompt: itself, and its body inside a Python ``repr``
    (a list of strings formatted into a template, e.g. LlamaIndex ``simple_summarize``) with
    either quote style. Duplicates are dropped; ``text`` comes first."""
    forms = [text, repr("\"'" + text)[4:-1]]  # both quotes present: single-quoted, ' escaped
    if '"' not in text:
        forms.append(repr("'" + text)[2:-1])  # double-quoted repr, ' left as is
    return list(dict.fromkeys(forms))


def add_retrieved(texts: Iterable[str]) -> None:
    """Record texts this query retrieved (visible only to this thread / task and its children)."""
    new = tuple(t for t in texts if t and len(t) >= MIN_CHUNK_CHARS)
    if new:
        _retrieved.set(_retrieved.get() + new)


def clear_retrieved() -> None:
    """Forget the current query's retrieved texts (call when a new query starts)."""
    _retrieved.set(())


def current_retrieved() -> tuple[str, ...]:
    """Texts recorded by :func:`add_retrieved` in the current context."""
    return _retrieved.get()


class ChunkIndex:
    """A set of known chunk texts, searchable inside a prompt with one Aho-Corasick pass.

    Holds a window and a hash per form of a chunk (:func:`prompt_forms`), not the texts.
    Thread-safe; the automaton is rebuilt lazily on the first search after texts were added.
    """

    def __init__(self) -> None:
        self._windows: dict[str, set[tuple[int, int, int]]] = {}
        self._automaton: ahocorasick.Automaton | None = None
        self._lock = threading.Lock()
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def add(self, texts: Iterable[str]) -> int:
        """Index ``texts`` (too-short ones are ignored); returns how many were new."""
        added = 0
        with self._lock:
            for text in texts:
                if not text or len(text) < MIN_CHUNK_CHARS:
                    continue
                new = False
                for form in prompt_forms(text):
                    offset = max(0, (len(form) - WINDOW_CHARS) // 2)
                    window = form[offset : offset + WINDOW_CHARS]
                    entry = (offset, len(form), hash(form))
                    bucket = self._windows.setdefault(window, set())
                    if entry not in bucket:
                        bucket.add(entry)
                        new = True
                added += new
            if added:
                self._size += added
                self._automaton = None
        return added

    def _built(self) -> ahocorasick.Automaton | None:
        with self._lock:
            if self._automaton is None and self._windows:
                automaton = ahocorasick.Automaton()
                for window, entries in self._windows.items():
                    automaton.add_word(window, (len(window), tuple(entries)))
                automaton.make_automaton()
                self._automaton = automaton
            return self._automaton

    def spans(self, text: str) -> list[tuple[int, int]]:
        """Every ``(start, end)`` where a known chunk occurs verbatim in ``text``."""
        automaton = self._built()
        if automaton is None:
            return []
        found = []
        for end, (window_len, entries) in automaton.iter(text):
            window_start = end - window_len + 1
            for offset, length, digest in entries:
                start = window_start - offset
                if start >= 0 and start + length <= len(text):
                    if hash(text[start : start + length]) == digest:
                        found.append((start, start + length))
        return found


_INDEXES: weakref.WeakKeyDictionary[object, ChunkIndex] = weakref.WeakKeyDictionary()
_INDEXES_LOCK = threading.Lock()


def known_chunks(engine: object) -> ChunkIndex:
    """The index of chunk texts ``engine`` was warmed with (one per engine, shared)."""
    with _INDEXES_LOCK:
        index = _INDEXES.get(engine)
        if index is None:
            index = _INDEXES[engine] = ChunkIndex()
        return index


def find_chunks(
    text: str, index: ChunkIndex | None = None, retrieved: Iterable[str] = ()
) -> list[tuple[int, int]]:
    """Non-overlapping spans of known chunks in ``text``, leftmost first, longest on ties."""
    spans = list(index.spans(text)) if index is not None else []
    forms = {form for chunk in set(retrieved) for form in prompt_forms(chunk)}
    for chunk in forms:
        if len(chunk) < MIN_CHUNK_CHARS:
            continue
        start = text.find(chunk)
        while start >= 0:
            spans.append((start, start + len(chunk)))
            start = text.find(chunk, start + 1)
    spans.sort(key=lambda s: (s[0], s[0] - s[1]))
    chosen: list[tuple[int, int]] = []
    for start, end in spans:
        if not chosen or start >= chosen[-1][1]:
            chosen.append((start, end))
    return chosen


def uniform_run(text: str, spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The longest run of consecutive spans joined by one identical between-text.

    The fused prefill takes one separator between chunks; chunks outside the run stay plain
    text in the head or tail (prefilled, never mangled).
    """
    best: list[tuple[int, int]] = []
    run: list[tuple[int, int]] = []
    between: str | None = None
    for span in spans:
        gap = text[run[-1][1] : span[0]] if run else None
        if run and (between is None or gap == between):
            between = gap
            run.append(span)
        else:
            run, between = ([run[-1], span], gap) if run else ([span], None)
        if len(run) > len(best):
            best = list(run)
    return best


@dataclass
class ChunkedText:
    """A text split at chunk boundaries: ``before + chunk1 + separator + … + after``."""

    before: str
    chunks: list[str]
    separator: str
    after: str


def split_text(text: str, spans: Sequence[tuple[int, int]]) -> ChunkedText | None:
    """Split ``text`` at the best uniform run of ``spans`` (None when there is none)."""
    run = uniform_run(text, spans)
    if not run:
        return None
    separator = text[run[0][1] : run[1][0]] if len(run) > 1 else ""
    return ChunkedText(
        before=text[: run[0][0]],
        chunks=[text[s:e] for s, e in run],
        separator=separator,
        after=text[run[-1][1] :],
    )


def chunked_prompt(
    tokenizer,
    messages: Sequence[dict] | None,
    text: str | None = None,
    index: ChunkIndex | None = None,
    retrieved: Iterable[str] | None = None,
) -> TokenizedPrompt | None:
    """A chunked :class:`TokenizedPrompt` for chat ``messages`` (or a raw ``text``) or None.

    The message whose content holds the most chunk text carries the chunks; the chat template
    is rendered around it and each piece tokenised on its own (one BOS at position 0 when the
    model uses one). ``retrieved`` defaults to :func:`current_retrieved`. Returns None when no
    known chunk occurs.
    """
    retrieved = current_retrieved() if retrieved is None else tuple(retrieved)
    if messages is None:
        split = split_text(text or "", find_chunks(text or "", index, retrieved))
        return None if split is None else _tokenized(tokenizer, "", split, "")
    found = best_split(messages, index, retrieved)
    if found is None:
        return None
    best, split = found
    marked = [dict(m) for m in messages]
    marked[best]["content"] = _MARK
    template_before, template_after = _render(tokenizer, marked)
    return _tokenized(tokenizer, template_before, split, template_after)


def best_split(
    messages: Sequence[dict], index: ChunkIndex | None = None, retrieved: Iterable[str] = ()
) -> tuple[int, ChunkedText] | None:
    """The message whose content holds the most chunk text (its index) and that content split
    at its chunks; None when no known chunk occurs in any message. The chunks a chat prompt
    fuses (:func:`chunked_prompt`), found without a tokenizer (a router uses it)."""
    retrieved = tuple(retrieved)
    best, best_chars, chosen = -1, 0, None
    for i, message in enumerate(messages):
        content = message.get("content") or ""
        split = split_text(content, find_chunks(content, index, retrieved))
        chars = sum(len(c) for c in split.chunks) if split else 0
        if chars > best_chars:
            best, best_chars, chosen = i, chars, split
    return None if chosen is None else (best, chosen)


def _render(tokenizer, messages: list[dict]) -> tuple[str, str]:
    """Chat-template text before and after the marked message's content."""
    if getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
    else:  # as BlendEngine.chat_ids renders chats for template-less models
        rendered = "\n\n".join(m["content"] for m in messages) + "\n"
    if rendered.count(_MARK) != 1:
        raise ValueError("the chat template does not render message content verbatim")
    before, after = rendered.split(_MARK)
    return before, after


def _tokenized(tokenizer, template_before: str, split: ChunkedText, template_after: str):
    head = encode(tokenizer, template_before + split.before)
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None and _adds_bos(tokenizer) and (not head or head[0] != bos):
        head = [bos] + head
    return TokenizedPrompt(
        head=head,
        chunks=[encode(tokenizer, c) for c in split.chunks],
        separator=encode(tokenizer, split.separator),
        tail=encode(tokenizer, split.after + template_after),
        chunk_texts=list(split.chunks),
    )


def _adds_bos(tokenizer) -> bool:
    ids = tokenizer("a")["input_ids"]
    return bool(ids) and ids[0] == tokenizer.bos_token_id


# Why a blend/reuse call fused nothing, and what fixes it (logged once per LLM instance).
FALLBACK_FIXES = {
    "no_known_chunk": "no known chunk text occurs in the prompt; warm the chunks at ingestion "
    "(BlendWarmup / llm.warmup / ChatRagBlend.warm) or pass them as chunks",
    "cache_miss": "every chunk in the prompt missed the KV store; wait for warmup "
    "(wait_for_warmup) or precompute with BlendConfig(precompute_context='canonical') so "
    "chunks hit under any template",
    "controller_full": "the controller judged loading slower than a full prefill here",
}


def mark_fallback(stats, requested_mode: str) -> str | None:
    """Record why a ``reuse``/``blend`` call fused no chunk (``ragblend.fallback``'s code in
    ``stats.fallback_reason``, mirrored in ``stats.extra["fallback_reason"]``, and
    ``stats.mode = "full"``); returns the code (None: chunks were fused)."""
    if requested_mode not in ("reuse", "blend"):
        return None
    reason = stats.extra.get("fallback_reason") or stats.fallback_reason
    if reason is None and stats.mode == "full":
        reason = NO_KNOWN_CHUNK  # the integration found no chunk in the text
    elif reason is None and not stats.chunk_hits:
        reason = CACHE_MISS
    if reason is not None:
        if stats.fallback_reason != reason:
            fall_back(stats, reason)
        stats.extra["fallback_reason"] = reason
    return reason


def fallback_message(owner: str, reason: str) -> str:
    """The WARNING text for a call that fell back to a full prefill."""
    fix = FALLBACK_FIXES.get(reason, reason)
    return f"{owner} ran a full prefill although blending was requested ({reason}): {fix}"
