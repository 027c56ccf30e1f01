"""llama.cpp as a benchmark peer: full-prefill TTFT on the same GGUF and the same prompt ids.

Optional (``pip install -e ".[peer]"``, which builds llama-cpp-python from source). The peer gets
exactly the token ids ragblend prefills (the piecewise-tokenised prompt), never text, and starts
every measurement from an empty KV cache. llama.cpp's extra buffer types (weights repacked for
the CPU's SIMD width at load, its fastest CPU path) are on, except on a CPU with AMX, where its AMX
buffer type segfaults (upstream llama.cpp #20824): there ``use_extra_bufts=False``.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from ragblend import cpu
from ragblend.errors import RagblendError

# (n_batch, flash_attn) pairs tried per model; the best median over the first prompts is kept.
SETTINGS: tuple[tuple[int, bool], ...] = ((512, False), (512, True), (2048, False), (2048, True))


def use_extra_buffer_types() -> bool:
    """Whether llama.cpp may repack weights into its extra buffer types: everywhere but on a
    CPU with AMX tiles (whatever ``RAGBLEND_CPU_ISA`` caps ragblend at: llama.cpp is not capped)."""
    return cpu.native_level() != "amx"


def available() -> bool:
    """True when llama-cpp-python is importable."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(frozen=True)
class PeerSetting:
    n_batch: int
    flash_attn: bool


class LlamaCppPeer:
    """One llama.cpp context on a GGUF; ``ttft_ms(ids)`` = cleared-cache prefill + first token."""

    def __init__(
        self,
        gguf: str | os.PathLike,
        n_ctx: int,
        setting: PeerSetting,
        threads: int | None = None,
    ) -> None:
        try:
            from llama_cpp import Llama
        except ImportError:
            raise RagblendError(
                "llama-cpp-python is not installed: pip install -e '.[peer]'"
            ) from None
        if not Path(gguf).is_file():
            raise RagblendError(f"GGUF not found: {gguf}")
        threads = threads or _torch_threads()
        kwargs: dict[str, Any] = dict(
            model_path=str(gguf),
            n_ctx=n_ctx,
            n_batch=setting.n_batch,
            n_ubatch=setting.n_batch,
            n_threads=threads,
            n_threads_batch=threads,
            flash_attn=setting.flash_attn,
            verbose=False,
        )
        self.setting = setting
        self._prefilled: tuple[int, ...] | None = None  # the ids the context holds, if known
        if use_extra_buffer_types():
            self.llm = Llama(**kwargs)
        elif "use_extra_bufts" in inspect.signature(Llama.__init__).parameters:
            self.llm = Llama(**kwargs, use_extra_bufts=False)
        else:  # 0.3.36 has the field in llama_model_params but not as a Llama() argument
            with _no_extra_buffer_types():
                self.llm = Llama(**kwargs)

    def ttft_ms(self, ids: Sequence[int]) -> tuple[float, int]:
        """(milliseconds, greedy first token) for a full prefill of ``ids`` from an empty cache."""
        ids = [int(i) for i in ids]
        start = time.perf_counter()
        self.llm.reset()  # n_tokens = 0: eval() drops every cached position before decoding
        self.llm.eval(ids)
        self._prefilled = tuple(ids)
        first = self._last_argmax()
        return (time.perf_counter() - start) * 1000, first

    def _last_argmax(self) -> int:
        """The greedy token after what the context holds."""
        # without logits_all, llama-cpp-python keeps no scores: read the last row from the context
        import numpy as np

        vocab = self.llm.n_vocab()
        return int(np.ctypeslib.as_array(self.llm._ctx.get_logits_ith(-1), shape=(vocab,)).argmax())

    def decode_tok_s(self, ids: Sequence[int], tokens: int) -> float:
        """Greedy decode rate after a full prefill of ``ids``: ``tokens`` single-token evals
        (each feeding the previous argmax), timed from the first to the last. The prefill is the
        one :meth:`ttft_ms` left when it was the last call, on the same ids."""
        ids = [int(i) for i in ids]
        if self._prefilled != tuple(ids):
            self.ttft_ms(ids)
        return self.decode_on(tokens)

    def decode_on(self, tokens: int) -> float:
        """Greedy decode rate of ``tokens`` single-token evals going on from whatever the
        context holds (each feeding the previous argmax), timed from the first to the last."""
        self._prefilled = None  # the evals below extend the context
        token = self._last_argmax()
        start = time.perf_counter()
        for _ in range(tokens):
            self.llm.eval([token])
            token = self._last_argmax()
        return tokens / (time.perf_counter() - start)

    def close(self) -> None:
        self.llm.close()


@contextlib.contextmanager
def _no_extra_buffer_types() -> Iterator[None]:
    """While a ``Llama`` is built: its model params with ``use_extra_bufts = False``."""
    import llama_cpp.llama_cpp as bindings

    default = bindings.llama_model_default_params

    def without_extra_bufts():
        params = default()
        params.use_extra_bufts = False
        return params

    bindings.llama_model_default_params = without_extra_bufts
    try:
        yield
    finally:
        bindings.llama_model_default_params = default


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def best_setting(
    gguf: str | os.PathLike,
    prompts: Sequence[Sequence[int]],
    n_ctx: int,
    repeats: int = 2,
    settings: Sequence[tuple[int, bool]] = SETTINGS,
) -> tuple[PeerSetting, dict[str, float]]:
    """The (n_batch, flash_attn) with the lowest median TTFT on ``prompts`` (a few suffice)."""
    medians: dict[str, float] = {}
    best: tuple[float, PeerSetting] | None = None
    for n_batch, flash in tqdm(settings, desc="llama.cpp tuning", unit="setting"):
        setting = PeerSetting(n_batch, flash)
        peer = LlamaCppPeer(gguf, n_ctx, setting)
        try:
            peer.ttft_ms(prompts[0])  # warm-up
            times = [peer.ttft_ms(p)[0] for p in prompts for _ in range(repeats)]
        finally:
            peer.close()
        med = statistics.median(times)
        medians[f"n_batch={n_batch},flash_attn={flash}"] = med
        if best is None or med < best[0]:
            best = (med, setting)
    assert best is not None
    return best[1], medians


def run_peer(
    gguf: str | os.PathLike,
    prompts: Sequence[Sequence[int]],
    repeats: int = 3,
    tune_on: int = 2,
) -> dict:
    """Per-question median TTFT of llama.cpp's full prefill at its best batch setting.

    Returns ``{"ttft_ms": [...], "median_ttft_ms", "setting", "tuning"}`` (JSON-able).
    """
    if not prompts:
        raise RagblendError("no prompts to run the llama.cpp peer on")
    n_ctx = max(len(p) for p in prompts) + 16
    setting, tuning = best_setting(gguf, prompts[:tune_on], n_ctx)
    peer = LlamaCppPeer(gguf, n_ctx, setting)
    try:
        peer.ttft_ms(prompts[0])
        per_question = [
            statistics.median(peer.ttft_ms(p)[0] for _ in range(repeats))
            for p in tqdm(prompts, desc="llama.cpp", unit="question")
        ]
    finally:
        peer.close()
    return {
        "ttft_ms": per_question,
        "median_ttft_ms": statistics.median(per_question),
        "setting": {"n_batch": setting.n_batch, "flash_attn": setting.flash_attn},
        "tuning": tuning,
        "use_extra_bufts": use_extra_buffer_types(),
    }
