"""Incremental detokenisation: each new token id → the text it adds, in constant work.

Decoding every output id again at each token costs time that grows with the answer (its
square over a whole answer). As vLLM's and Hugging Face TGI's incremental detokenisers do,
:class:`Detokenizer` decodes only a short window: the last token(s) already shown (the
*prefix*, whose text gives context such as a word's leading space) and the tokens not yet
shown; the new text is what the window's text adds to the prefix's. A window whose text
ends with ``"\\ufffd"`` holds an incomplete multi-byte character: nothing is shown until
the tokens that complete it arrive (or the end, :meth:`Detokenizer.flush`).

Special tokens (those ``decode(..., skip_special_tokens=True)`` drops) never enter the
window, so a run of them costs nothing and the joined deltas equal
``tokenizer.decode(all ids, skip_special_tokens=True)``.
"""

from __future__ import annotations

import weakref
from typing import Any

_SKIPPED: weakref.WeakKeyDictionary[Any, frozenset[int]] = weakref.WeakKeyDictionary()


def skipped_ids(tokenizer: Any) -> frozenset[int]:
    """Ids whose text ``decode(..., skip_special_tokens=True)`` drops (once per tokenizer)."""
    try:
        return _SKIPPED[tokenizer]
    except (KeyError, TypeError):
        pass
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    special = set(getattr(tokenizer, "all_special_ids", ()) or ())
    ids = frozenset(
        i for i in set(added) | special if tokenizer.decode([i], skip_special_tokens=True) == ""
    )
    try:
        _SKIPPED[tokenizer] = ids
    except TypeError:  # not weak-referenceable: computed again next time
        pass
    return ids


class Detokenizer:
    """Token ids in, text deltas out (see the module docstring). ``ids_decoded`` counts the
    ids this has passed to ``tokenizer.decode``: the work, which stays the same per token
    however long the answer grows."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.skipped = skipped_ids(tokenizer)
        self.window: list[int] = []  # the prefix, then the ids not shown yet
        self.read = 0  # how many ids of ``window`` are the prefix
        self.prefix_text = ""
        self.ids_decoded = 0

    def add(self, token: int) -> str:
        """The text ``token`` adds ("" while a character is incomplete)."""
        if token in self.skipped:
            return ""
        self.window.append(token)
        text = self._decode(self.window)
        if len(text) <= len(self.prefix_text) or text.endswith("\ufffd"):
            return ""
        return self._show(text)

    def flush(self) -> str:
        """Text still held back (an incomplete character at the end of the answer)."""
        if self.read == len(self.window):
            return ""
        return self._show(self._decode(self.window))

    def _show(self, text: str) -> str:
        """What the window's ``text`` adds to the prefix's; the ids not shown become the
        prefix."""
        delta = text[len(self.prefix_text) :]
        self.window = self.window[self.read :]
        self.read = len(self.window)
        self.prefix_text = self._decode(self.window)
        return delta

    def _decode(self, ids: list[int]) -> str:
        self.ids_decoded += len(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=True)
