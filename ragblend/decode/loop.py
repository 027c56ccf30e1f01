"""The decode loop's bookkeeping, one place for every path: when an answer ends and what to show.

:class:`DecodeState` is one request's decoding after its prefill: it samples each token
(``ragblend.decode.sampling``), ends the answer at an end-of-sequence token (unless
``ignore_eos``), at ``max_tokens`` or at a stop string, sets ``finish_reason`` and turns the
ids into text deltas (:class:`~ragblend.decode.detokenize.Detokenizer`, constant work per token).
``generate`` / ``stream`` drive it with :func:`decode_steps` (one request); the server's
scheduler steps a batch and hands each request's row of logits to its own state.

Stop strings: the text that could still be the start of one (the last ``len(longest) - 1``
characters) is held back, so a stream never shows text that a stop later removes; a stop may
span token boundaries. Only that held text and each token's new text are searched, so the
work per token does not grow with the answer either.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

import torch

from ragblend.decode.detokenize import Detokenizer
from ragblend.decode.sampling import Sampler, SamplingParams


class StopStrings:
    """Cuts text at the first of ``stops`` (which is not shown); see the module docstring."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.held = ""  # text not shown yet: it may be the start of a stop string
        self.stopped = False

    def add(self, text: str) -> str:
        """The part of ``text`` (after what is held) that may be shown now."""
        if not self.stops or not text:
            return text
        self.held += text
        hits = [i for i in (self.held.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            shown, self.held = self.held[: min(hits)], ""
            return shown
        cut = len(self.held) - self.hold
        if cut <= 0:
            return ""
        shown, self.held = self.held[:cut], self.held[cut:]
        return shown

    def flush(self) -> str:
        """What is held back, at the end of the answer."""
        shown, self.held = self.held, ""
        return shown


class DecodeState:
    """One request's decoding after its prefill (see the module docstring).

    Feed each chosen token to :meth:`add` (:meth:`sample` chooses it from a step's logits)
    until ``done``; each call returns the text to show now. ``token_ids``: the answer's ids
    (an end-of-sequence token that ended it excluded); ``text``: every delta joined, which
    for an answer not cut by a stop string is ``tokenizer.decode(token_ids,
    skip_special_tokens=True)``. Without a ``tokenizer`` no text is made (ids only).
    """

    def __init__(
        self,
        params: SamplingParams,
        eos_ids: Collection[int],
        max_tokens: int,
        tokenizer: Any | None = None,
        prompt_ids: Sequence[int] = (),
    ) -> None:
        self.params = params
        self.max_tokens = max_tokens
        self.eos_ids: Collection[int] = () if params.ignore_eos else eos_ids
        self.sampler = Sampler(params, prompt_ids)
        self.detokenizer = Detokenizer(tokenizer) if tokenizer is not None else None
        self.stops = StopStrings(params.stop)
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None if max_tokens > 0 else "length"
        self._pieces: list[str] = []

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return "".join(self._pieces)

    @property
    def plain_greedy(self) -> bool:
        """Whether the next token is the logits' argmax (greedy, no penalties)."""
        return self.sampler.plain_greedy

    def sample(self, logits: torch.Tensor, argmax: int | None = None) -> int:
        """The next token from this step's raw ``logits`` [vocab]; ``argmax``: theirs, where
        the caller took it for a batch (:func:`ragblend.decode.sampling.greedy_choices`)."""
        return self.sampler(logits, argmax)

    def add(self, token: int) -> str:
        """Take ``token`` (or end the answer there); the text to show now."""
        if self.done:
            raise RuntimeError("the answer has ended")
        if token in self.eos_ids:
            return self.finish("stop")
        self.token_ids.append(token)
        delta = self.stops.add(self.detokenizer.add(token)) if self.detokenizer else ""
        self._pieces.append(delta)
        if self.stops.stopped:
            self.finish_reason = "stop"
        elif len(self.token_ids) >= self.max_tokens:
            delta += self.finish("length")
        return delta

    def finish(self, reason: str) -> str:
        """End the answer now (e.g. the consumer stopped: ``"stop"``); the text held back,
        unless a stop string is in it."""
        if self.done:
            return ""
        rest = ""
        if self.detokenizer is not None:
            rest = self.stops.add(self.detokenizer.flush())
            if not self.stops.stopped:
                rest += self.stops.flush()
        self._pieces.append(rest)
        self.finish_reason = "stop" if self.stops.stopped else reason
        return rest


def decode_steps(
    state: DecodeState, logits: torch.Tensor, advance: Callable[[int], torch.Tensor]
) -> Iterator[str]:
    """One request's decode loop: from the prefill's ``logits``, sample, hand the token to
    ``state`` and yield its delta (one per token, possibly ""), then ``advance(token)`` → the
    next logits, until ``state.done``."""
    while not state.done:
        yield state.add(state.sample(logits))
        if not state.done:
            logits = advance(state.token_ids[-1])
