"""Generation after a prefill: decoders, the decode loop's drivers, streams.

In the style of gpt-fast's ``generate.py``: one frozen :class:`SamplingParams` (in
``ragblend.decode.sampling``) and one decode loop's bookkeeping,
:class:`ragblend.decode.loop.DecodeState`
(EOS, ``max_tokens``, stop strings, ``ignore_eos``, incremental text), shared with the
server's scheduler. Decoding runs into preallocated K/V (a
:class:`~ragblend.decode.decoder.LayerDecoder`, or HF's ``StaticCache`` where that does not
apply, :func:`decoder_for`) so each new token is written in place instead of concatenated
onto every layer's K/V (``DynamicCache`` copies the whole context per token).
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Collection, Generator, Iterator
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import torch

from ragblend.bridge import aiter_in_thread
from ragblend.decode.decoder import LayerDecoder
from ragblend.decode.loop import DecodeState, decode_steps
from ragblend.decode.sampling import Sampler as Sampler
from ragblend.decode.sampling import SamplingParams as SamplingParams
from ragblend.kernels import step_activations

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ragblend.decode.pool import DecodePool
    from ragblend.kernels import LayerKernels, NativeKernels
    from ragblend.models.adapters import LayerwiseModel

log = logging.getLogger(__name__)


@dataclass
class BlendStats:
    """What one request did: timings, token counts, cache hits and how much was recomputed.

    ``mode`` is the mode that actually ran: a blend/reuse request that ends as a full prefill
    (nothing to fuse, or the loading controller's fallback) says ``"full"`` and gives the
    reason in ``fallback_reason`` (a code of ``ragblend.fallback``) and ``fallback_message``.
    """

    mode: str
    ttft_ms: float = 0.0
    load_ms: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    chunk_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose K/V came from the chunk or prefix caches
    chunk_hits: int = 0
    chunk_misses: int = 0
    recomputed_fraction: float = 1.0
    ratio: float | None = None
    finish_reason: str = ""
    decode_ms: float = 0.0
    fallback_reason: str | None = None  # ragblend.fallback's code; None when chunks were fused
    fallback_message: str | None = None  # the same for a person, with what fixes it
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Prefill:
    """The prompt's first-token logits [vocab] (fp32) and an HF cache of the whole prompt."""

    logits: torch.Tensor
    cache: object
    prompt_ids: list[int]
    stats: BlendStats
    fusion: object | None = None  # the FusionResult, for fused modes

    def copy(self) -> Prefill:
        """An independent copy, its cache deep-copied (decoding and teacher forcing run in
        caches of their own and leave this one as it was)."""
        cache = copy.deepcopy(self.cache)
        return Prefill(self.logits, cache, self.prompt_ids, copy.copy(self.stats), self.fusion)


@dataclass
class BlendResult:
    text: str
    token_ids: list[int]
    stats: BlendStats


def decode_cache(model: PreTrainedModel, prompt_cache, total_len: int):
    """A cache for decoding that holds ``prompt_cache``'s K/V and room for ``total_len`` tokens.

    Where every layer can hold ``total_len`` tokens (full attention, or a sliding window no
    shorter than that), a preallocated ``StaticCache``: new tokens are written in place and the
    prompt cache is left as it is. Otherwise (a window shorter than the sequence, or more
    tokens than the model's positions) a deep copy that grows as before.
    """
    from transformers import StaticCache
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    def fits(layer) -> bool:
        if type(layer) is DynamicLayer:
            return True
        return type(layer) is DynamicSlidingWindowLayer and total_len <= layer.sliding_window

    layers = getattr(prompt_cache, "layers", None)
    window = getattr(model.config, "max_position_embeddings", None) or total_len
    if not layers or total_len > window or not all(fits(layer) for layer in layers):
        return copy.deepcopy(prompt_cache)
    static = StaticCache(config=model.config, max_cache_len=total_len)
    for index, layer in enumerate(layers):
        static.update(layer.keys, layer.values, index)
    return static


def decode_tokens(
    model: PreTrainedModel,
    prefill: Prefill,
    params: SamplingParams,
    max_new_tokens: int,
    eos_ids: Collection[int],
    layers: LayerwiseModel | None = None,
    kernels: NativeKernels | None = None,
    *,
    kv_cache_dtype: str = "auto",
    activations: str = "float",
) -> Iterator[int]:
    """Yield generated token ids after ``prefill`` (EOS excluded); updates ``prefill.stats``.

    The ids-only form of the decode loop (:mod:`ragblend.decode.loop`, no text).
    ``prefill.cache`` is not modified: decoding runs in a cache of its own
    (:func:`decoder_for`, with ``kv_cache_dtype`` and ``activations``).
    """
    stats = prefill.stats
    stats.finish_reason = "length"
    state = DecodeState(params, eos_ids, max_new_tokens, prompt_ids=prefill.prompt_ids)
    if state.done:
        return
    total = len(prefill.prompt_ids) + max_new_tokens
    decoder = decoder_for(model, layers, prefill, total, kernels, kv_cache_dtype, activations)
    kept = 0
    for _ in decode_steps(state, prefill.logits, decoder.step):
        stats.finish_reason = state.finish_reason or "length"
        if len(state.token_ids) > kept:  # not the end-of-sequence token that ended it
            kept += 1
            stats.completion_tokens += 1
            yield state.token_ids[-1]


class HFDecoder:
    """Decoding through HF's forward over :func:`decode_cache`, where no
    :class:`LayerDecoder` applies; the same ``step`` as one."""

    def __init__(
        self, model: PreTrainedModel, prefill: Prefill, total_len: int, activations: str = "float"
    ) -> None:
        self.model = model
        self.device = prefill.logits.device if prefill.logits.is_cuda else model.device
        self.cache = decode_cache(model, prefill.cache, total_len)
        self.activations = activations

    def step(self, token: int) -> torch.Tensor:
        """Feed ``token``; fp32 logits [vocab] of the next one."""
        with torch.inference_mode(), step_activations(self.activations):
            out = self.model(
                input_ids=torch.tensor([[token]], device=self.device),
                past_key_values=self.cache,
                use_cache=True,
            )
        return out.logits[0, -1].float()


def decoder_for(
    model: PreTrainedModel,
    layers: LayerwiseModel | None,
    prefill: Prefill,
    total_len: int,
    kernels: NativeKernels | None = None,
    kv_cache_dtype: str = "auto",
    activations: str = "float",
    pool: DecodePool | None = None,
    layer_kernels: LayerKernels | None = None,
) -> LayerDecoder | HFDecoder:
    """A decoder after ``prefill`` with room for ``total_len`` tokens, in a cache of its own:
    given the model's ``layers`` adapter, a :class:`LayerDecoder` (one lean step per token, on
    ``kernels`` where given, its K/V cache stored as ``kv_cache_dtype`` says, batchable:
    ``decode_batch``); otherwise, or where that does not apply, an :class:`HFDecoder`, whose
    cache is HF's in the model's dtype whatever ``kv_cache_dtype`` says (one warning per
    process where it says ``"int8"``). Either multiplies a GGUF's quantized weights by
    ``activations`` (``"float"`` or ``"int8"``, resolved: ``BlendEngine.decode_activations``).
    ``pool``, ``layer_kernels``: a layer-wise decoder's static slot and fused steps
    (:class:`LayerDecoder`)."""
    if layers is not None:
        n = len(prefill.prompt_ids)
        lean = LayerDecoder.for_cache(
            layers,
            prefill.cache,
            n,
            total_len,
            kernels,
            kv_cache_dtype,
            activations,
            pool,
            layer_kernels,
        )
        if lean is not None:
            return lean
    if kv_cache_dtype != "auto" and kv_cache_dtype not in _WARNED_KV_CACHE:
        _WARNED_KV_CACHE.add(kv_cache_dtype)
        log.warning(
            "kv_cache_dtype=%r applies to ragblend's layer-wise decoder only; this prompt's "
            "cache decodes through HF's forward, with its K/V in the model's dtype",
            kv_cache_dtype,
        )
    return HFDecoder(model, prefill, total_len, activations)


_WARNED_KV_CACHE: set[str] = set()  # kv_cache_dtype values HFDecoder was asked for, warned of


def decode_step(
    model: PreTrainedModel,
    layers: LayerwiseModel | None,
    prefill: Prefill,
    total_len: int,
    kernels: NativeKernels | None = None,
    kv_cache_dtype: str = "auto",
    activations: str = "float",
) -> Callable[[int], torch.Tensor]:
    """token → fp32 logits [vocab] of the next one (:func:`decoder_for`'s ``step``)."""
    decoder = decoder_for(model, layers, prefill, total_len, kernels, kv_cache_dtype, activations)
    return decoder.step


class BlendStream:
    """Text deltas of one generation: iterate, ``async for``, or :meth:`collect`.

    ``result`` is set once the stream is exhausted or closed. Stop strings (``stop=``) end it
    inside the decode loop; ``close()`` stops decoding early otherwise, and ``result`` then
    holds what was generated so far, with ``finish_reason == "stop"``.
    """

    def __init__(self, run: Callable[[BlendStream], Generator[str, None, None]]) -> None:
        self.result: BlendResult | None = None
        self._deltas = run(self)

    def __iter__(self) -> Iterator[str]:
        return self._deltas

    def __next__(self) -> str:
        return next(self._deltas)

    async def __aiter__(self) -> AsyncIterator[str]:
        """Decoding runs on a thread of its own (ending with the stream, see
        ``ragblend.threads``), so the event loop is never blocked; leaving the loop early
        closes the stream on that thread after its current token."""
        async for delta in aiter_in_thread(lambda _cancel: self._deltas, "ragblend-stream"):
            yield delta

    def collect(self) -> BlendResult:
        """Run to the end and return the result."""
        for _ in self._deltas:
            pass
        assert self.result is not None
        return self.result

    def close(self) -> None:
        self._deltas.close()


class Decoder:
    """Turns a prefill into a :class:`BlendStream` of text (one request's decoding setup)."""

    def __init__(
        self,
        model,
        tokenizer,
        eos_ids: Collection[int],
        params: SamplingParams,
        max_new_tokens: int,
        layers: LayerwiseModel | None = None,
        kernels: NativeKernels | None = None,
        kv_cache_dtype: str = "auto",
        activations: str = "float",
    ) -> None:
        self.model = model
        self.layers = layers
        self.kernels = kernels
        self.kv_cache_dtype = kv_cache_dtype
        self.activations = activations
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.params = params
        self.max_new_tokens = max_new_tokens

    def stream(
        self,
        prefill: Callable[[], Prefill],
        lock: threading.Lock,
        started: float | None = None,
        before_decode: Callable[[], None] | None = None,
    ) -> BlendStream:
        """A stream that, from its first step, holds ``lock``, runs ``prefill()`` and decodes;
        the lock is released when the stream is exhausted, closed or garbage-collected.
        ``started`` (a perf_counter value) backdates TTFT, e.g. to include tokenisation;
        ``before_decode`` runs after TTFT is taken and before decoding is timed."""

        def run(stream: BlendStream) -> Generator[str, None, None]:
            with lock:
                t0 = time.perf_counter()
                pre = prefill()
                pre.stats.ttft_ms = (time.perf_counter() - (started or t0)) * 1000
                if before_decode is not None:
                    before_decode()
                t0 = time.perf_counter()
                state = DecodeState(
                    self.params, self.eos_ids, self.max_new_tokens, self.tokenizer, pre.prompt_ids
                )
                try:
                    if not state.done:
                        total = len(pre.prompt_ids) + self.max_new_tokens
                        decoder = decoder_for(
                            self.model,
                            self.layers,
                            pre,
                            total,
                            self.kernels,
                            self.kv_cache_dtype,
                            self.activations,
                        )
                        for delta in decode_steps(state, pre.logits, decoder.step):
                            if delta:
                                yield delta
                except GeneratorExit:  # the consumer stopped early (e.g. a stop sequence)
                    state.finish("stop")
                    raise
                finally:
                    pre.stats.decode_ms = (time.perf_counter() - t0) * 1000
                    pre.stats.completion_tokens = len(state.token_ids)
                    pre.stats.finish_reason = state.finish_reason or "length"
                    stream.result = BlendResult(state.text, state.token_ids, pre.stats)

        return BlendStream(run)


def teacher_forced_logits(
    model: PreTrainedModel,
    prefill: Prefill,
    answer_ids: list[int],
    layers: LayerwiseModel | None = None,
    kernels: NativeKernels | None = None,
    *,
    kv_cache_dtype: str = "auto",
    activations: str = "float",
) -> torch.Tensor:
    """fp32 logits [len(answer_ids), V] predicting each answer token after the prompt.

    Row 0 is the prefill's; row i is what a decode step gives after ``answer_ids[:i]``, through
    the decoder :func:`decode_tokens` runs (:func:`decoder_for` with the same ``layers``,
    ``kernels``, ``kv_cache_dtype`` and ``activations``), one token a step. So a greedy answer's
    ids are its own argmax row by row, whatever the numerics (a batched forward over the answer
    rounds some int8 activations differently from the decode's steps). ``prefill.cache`` is not
    modified."""
    rows = [prefill.logits.reshape(-1).float()]
    if len(answer_ids) > 1:
        total = len(prefill.prompt_ids) + len(answer_ids)
        decoder = decoder_for(model, layers, prefill, total, kernels, kv_cache_dtype, activations)
        # a step's logits may sit in a buffer the decoder's next step reuses
        rows += [decoder.step(token).clone() for token in answer_ids[:-1]]
    return torch.stack(rows)
