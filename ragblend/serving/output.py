"""One request's generated text: incremental detokenisation and OpenAI ``stop`` sequences."""

from __future__ import annotations

from collections.abc import Sequence


class TextOutput:
    """Token ids in, text deltas out; stops at the first stop sequence (which is not emitted).

    With stop sequences, the last ``len(longest stop) - 1`` characters are held back until
    they can no longer begin one, so a stream never shows text that a stop later removes.
    """

    def __init__(self, tokenizer, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""
        self.sent = 0  # characters of ``text`` already handed out
        self.stopped = False

    def add(self, token: int) -> str:
        """Append ``token``; the text that may be shown now (sets ``stopped`` on a stop)."""
        self.token_ids.append(token)
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""  # an incomplete multi-byte character: wait for the rest
        self.text = text
        if self.stop:
            start = max(0, self.sent - self._hold)
            hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.text = text[: min(hits)]
                self.stopped = True
                return self.flush()
        return self._take(len(text) - self._hold)

    def flush(self) -> str:
        """Whatever is still held back (at the end of generation)."""
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        if end <= self.sent:
            return ""
        delta = self.text[self.sent : end]
        self.sent = end
        return delta
