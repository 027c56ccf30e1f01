"""BlendEngine: load a model, precompute chunk KV, answer in full / prefix / reuse / blend mode."""

from __future__ import annotations

import collections
import copy
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, cast

import torch

from ragblend.chunk_cache import ChunkCache
from ragblend.config import BlendConfig, check_mode, check_ratio, fit_to_depth
from ragblend.decode import (
    BlendResult,
    BlendStats,
    BlendStream,
    DecodePool,
    Decoder,
    HFDecoder,
    LayerDecoder,
    Prefill,
    SamplingParams,
    decode_tokens,
    decoder_for,
    teacher_forced_logits,
)
from ragblend.errors import CorruptEntryError, RagblendError
from ragblend.fallback import CACHE_MISS, CONTROLLER_FULL, NO_KNOWN_CHUNK, fall_back
from ragblend.fusion.fusor import fuse
from ragblend.fusion.selection import make_selector
from ragblend.fusion.selectors import TokenSelector
from ragblend.kernels import (
    LayerKernels,
    NativeKernels,
    layer_kernels,
    native_kernels,
)
from ragblend.matching import ChunkIndex, known_chunks
from ragblend.models.adapters import LayerwiseModel, adapter_for
from ragblend.models.hf_cache import dynamic_cache_of
from ragblend.models.loading import load_model
from ragblend.models.packed import is_packed, pack_decode_linears
from ragblend.models.quantized import decode_activations_for, decode_path
from ragblend.prompt import PromptFormat, TokenizedPrompt, chat_ids
from ragblend.store.base import KVStore
from ragblend.store.keys import model_fingerprint
from ragblend.store.layered import served_from
from ragblend.store.memory import MemoryStore

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ragblend.controller import LoadingController
    from ragblend.neighbours import NeighbourSource

log = logging.getLogger(__name__)

__all__ = ["BlendEngine", "BlendResult", "BlendStats", "BlendStream", "Prefill"]


class BlendEngine:
    """CacheBlend over a plain HF causal LM.

    >>> engine = BlendEngine.from_pretrained("embedded")
    >>> engine.precompute(chunks)                       # once, e.g. at index time
    >>> engine.generate("Who wrote X?", chunks).text   # fused prefill + decode

    Generation is serialised per engine (and the views :meth:`with_config` makes of it): one
    prefill + decode runs at a time. A stream holds the engine's lock from its first step
    until it is exhausted, closed or garbage-collected, so close a stream you abandon before
    starting another one on the same thread.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer,
        config: BlendConfig | None = None,
        store: KVStore | None = None,
        prompt_format: PromptFormat | None = None,
        name: str | None = None,
    ) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.layers: LayerwiseModel = adapter_for(model)
        self.config = fit_to_depth(config or BlendConfig(), self.layers.num_layers)
        self.prompt_format = prompt_format or PromptFormat()
        self.name = name or getattr(model.config, "_name_or_path", "") or type(model).__name__
        self.fingerprint = model_fingerprint(model)
        self.selector: TokenSelector = make_selector(self.config)
        self._native: NativeKernels | None | object = _UNRESOLVED
        self._layer_kernels: LayerKernels | None | object = _UNRESOLVED
        # static decode pools by (slots, tokens, CUDA graphs), shared by this engine's views
        self._decode_pools: dict[tuple[int, int, bool], DecodePool] = {}
        self._decode_activations: str | None = None  # resolved on first use
        if self.config.row_attention == "native":  # its error (if any) at once, not mid-query
            self._native = self._native_kernels(self.config)
        store = store if store is not None else MemoryStore(self.config.ram_bytes)
        self.chunks = ChunkCache(self.layers, tokenizer, self.config, store, self.fingerprint)
        self.on_miss: Callable[[list[str]], None] | None = None
        # the LoadingController, made on first use of ratio="auto"
        self.controller: LoadingController | None = None
        self._lock = threading.Lock()
        eos = model.generation_config.eos_token_id if model.generation_config else None
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        if tokenizer.eos_token_id is not None:
            eos.append(tokenizer.eos_token_id)
        self.eos_ids = set(eos)

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str = "embedded",
        config: BlendConfig | None = None,
        store: KVStore | None = None,
        prompt_format: PromptFormat | None = None,
        **overrides,
    ) -> BlendEngine:
        """Load ``"embedded"`` (SmolLM2-135M-Instruct), ``"gemma"`` (Gemma 3 270M, the ``gemma``
        extra), a ``.gguf`` file of a supported family or a local HF model directory.

        ``overrides`` are BlendConfig fields, applied onto ``config`` when both are given.
        """
        config = dataclasses.replace(config, **overrides) if config else BlendConfig(**overrides)
        model, tokenizer = load_model(
            name_or_path, device=config.device, dtype=config.dtype, weights=config.weights
        )
        aliases = {"embedded": "SmolLM2-135M-Instruct", "gemma": "gemma-3-270m-Q4_K_M"}
        name = aliases.get(str(name_or_path), str(name_or_path))
        return cls(model, tokenizer, config, store, prompt_format, name=name)

    def with_config(
        self,
        *,
        store: KVStore | None = None,
        controller=None,
        neighbours: NeighbourSource | None = None,
        **overrides,
    ) -> BlendEngine:
        """A view of this engine (same model, lock and, unless given, store, controller and
        neighbour source) with some config fields changed. ``selector`` may also be a
        TokenSelector object."""
        selector = overrides.get("selector")
        if selector is not None and not isinstance(selector, str):
            overrides["selector"] = getattr(selector, "name", type(selector).__name__)
        view = copy.copy(self)
        config = dataclasses.replace(self.config, **overrides)
        view.config = fit_to_depth(config, self.layers.num_layers)
        if selector is not None and not isinstance(selector, str):
            view.selector = selector
        else:
            view.selector = make_selector(view.config)
        if view.config.decode_activations != self.config.decode_activations:
            view._decode_activations = None
        if (view.config.row_attention, view.config.layer_kernels) != (
            self.config.row_attention,
            self.config.layer_kernels,
        ):
            view._layer_kernels = _UNRESOLVED
        if view.config.row_attention != self.config.row_attention:
            view._native = _UNRESOLVED
            if view.config.row_attention == "native":
                view._native = view._native_kernels(view.config)
        view.chunks = ChunkCache(
            self.layers,
            self.tokenizer,
            view.config,
            self.store if store is None else store,
            self.fingerprint,
        )
        view.chunks.neighbours = self.chunks.neighbours if neighbours is None else neighbours
        if store is not None or controller is not None:
            view.controller = controller
        return view

    def _native_kernels(self, config: BlendConfig) -> NativeKernels | None:
        layers = self.layers
        return native_kernels(config.row_attention, layers.dtype, layers.device, layers.head_dim)

    @property
    def native(self) -> NativeKernels | None:
        """The native CPU kernels blend runs on (:mod:`ragblend.kernels.cpu.native`), or None for
        SDPA blocks. Built on first use, so engines that only precompute (warmup jobs, Ray
        actors) never compile or load them."""
        if self._native is _UNRESOLVED:
            self._native = self._native_kernels(self.config)
        return cast("NativeKernels | None", self._native)

    @native.setter
    def native(self, kernels: NativeKernels | None) -> None:
        self._native = kernels

    @property
    def layer_kernels(self) -> LayerKernels | None:
        """The fused layer steps blend and reuse run (``BlendConfig.layer_kernels``), or None
        for HF's modules (and wherever the native CPU kernels run)."""
        if self._layer_kernels is _UNRESOLVED:
            layers = self.layers
            self._layer_kernels = (
                None
                if self.native is not None
                else layer_kernels(self.config.layer_kernels, layers.device, layers.dtype)
            )
        return cast("LayerKernels | None", self._layer_kernels)

    @property
    def row_attention(self) -> str:
        """The selected-row attention blend runs: ``"native"``, ``"masked"`` (one SDPA call
        per layer, masks built on the device: a GPU's default) or ``"sdpa"`` (blocks)."""
        if self.native is not None:
            return "native"
        choice = self.config.row_attention
        on_gpu = self.layers.device.type != "cpu"
        return "masked" if choice == "masked" or (choice == "auto" and on_gpu) else "sdpa"

    # ------------------------------------------------------------------ prompts and keys
    @property
    def store(self) -> KVStore:
        return self.chunks.store

    @store.setter
    def store(self, store: KVStore) -> None:
        self.chunks.store = store

    @property
    def kv_dtype(self) -> str:
        """Storage dtype of chunk KV ("auto" resolves to the compute dtype)."""
        return self.chunks.kv_dtype

    @property
    def context_window(self) -> int:
        return self.layers.context_window

    def tokenize(
        self, question: str, chunks: Sequence[str], prompt_format: PromptFormat | None = None
    ) -> TokenizedPrompt:
        """The prompt tokenised piecewise (head, each chunk, separators, question + tail)."""
        from ragblend.prompt import tokenize_prompt

        fmt = prompt_format or self.prompt_format
        prompt = tokenize_prompt(self.tokenizer, fmt, list(chunks), question)
        self._check_length(len(prompt))
        return prompt

    def prompt_head(self, prompt_format: PromptFormat | None = None) -> list[int]:
        """Token ids before the first chunk (template head + system + user prefix)."""
        return self.chunks.head(prompt_format or self.prompt_format)

    def chunk_key(self, *, context_ids: Sequence[int], chunk_ids: Sequence[int]) -> str:
        """Store key of ``chunk_ids`` precomputed after ``context_ids`` (as store.keys)."""
        return self.chunks.key(context_ids=context_ids, chunk_ids=chunk_ids)

    def _check_length(self, n: int) -> None:
        limit = self.context_window
        if limit and n > limit:
            raise RagblendError(
                f"prompt has {n} tokens, more than the model's context window of {limit}; "
                "retrieve fewer or shorter chunks"
            )

    # ------------------------------------------------------------------ precompute
    def precompute(
        self,
        chunks: Sequence[str],
        prompt_format: PromptFormat | None = None,
        progress: bool = False,
        neighbours: Mapping[str, Sequence[str]] | None = None,
    ) -> int:
        """Precompute and store the KV of each chunk; returns how many were newly stored.

        With ``precompute_context="neighbours"`` or ``"previous"``, each chunk is prefilled
        after its neighbours: ``neighbours[chunk]`` (texts) where given, else those of
        :attr:`neighbours`; a chunk with none is computed as with ``"canonical"``."""
        texts: Sequence[str] = chunks
        if progress:
            from tqdm.auto import tqdm

            texts = tqdm(chunks, desc="precompute KV", unit="chunk")
        return self.chunks.precompute(texts, self.prompt_head(prompt_format), neighbours)

    def precompute_ids(
        self,
        chunk_ids: Sequence[int],
        head: list[int],
        between_layers: Callable[[], None] | None = None,
        neighbours: Sequence[Sequence[int]] = (),
    ) -> bool:
        """Precompute one tokenised chunk for prompts with ``head``; False if already stored.

        ``between_layers`` is called before each layer's compute (background warmup waits
        there while a query runs); ``neighbours`` (token ids of each, see
        :meth:`neighbour_ids`) go between the context and the chunk, each followed by the
        separator, and are dropped (``config.neighbour_rows``: their KV reused or computed)."""
        return self.chunks.precompute_ids(chunk_ids, head, between_layers, neighbours)

    @property
    def neighbours(self) -> NeighbourSource | None:
        """Where neighbour contexts find a chunk's neighbours (a ``NeighbourIndex`` fed with
        the caller's embeddings, a ``DocumentOrder``); shared with :meth:`with_config` views
        made after it is set. ``None``: chunks without given neighbours are computed alone."""
        return self.chunks.neighbours

    @neighbours.setter
    def neighbours(self, source: NeighbourSource | None) -> None:
        self.chunks.neighbours = source

    def add_embeddings(
        self, texts: Sequence[str], embeddings: Sequence[Sequence[float]] | torch.Tensor
    ) -> None:
        """Make ``texts`` known as neighbours, by their embedding vectors (what the caller's
        vector store computed), in this engine's namespace: adds them to :attr:`neighbours`,
        a ``NeighbourIndex`` created here when it is not one."""
        from ragblend.neighbours import NeighbourIndex

        index = self.neighbours
        if not isinstance(index, NeighbourIndex):
            index = self.neighbours = NeighbourIndex()
        index.add(texts, embeddings, self.config.namespace)

    def neighbour_ids(self, chunk: str) -> list[list[int]]:
        """Token ids of each neighbour ``chunk`` is precomputed after under this config's
        precompute context, least similar first (``[]`` outside neighbour contexts)."""
        return self.chunks.neighbour_ids(chunk)

    def is_cached(self, chunk: str, prompt_format: PromptFormat | None = None) -> bool:
        return self.chunks.is_cached(chunk, self.prompt_head(prompt_format))

    def known_chunks(self) -> ChunkIndex:
        """The chunk texts this engine matches in prompts: those it was warmed with and every
        text recorded with its store (by ``ragblend warmup``, a server, an integration)."""
        index = known_chunks(self)
        index.add(self.chunks.new_texts())
        return index

    def prefix_kv(self, head: list[int]):
        """Exact KV of a prompt head (computed once, then served from the store)."""
        return self.chunks.prefix_kv(head)

    # Kept for callers outside the engine's modules; new code uses ``engine.chunks``.
    def _context_ids(self, head: list[int]) -> list[int]:
        return self.chunks.context_ids(head)

    def _compute_kv(self, ids: list[int], context_ids: list[int]):
        return self.chunks.compute_kv(ids, context_ids)

    def _prefix_key(self, head: Sequence[int]) -> str:
        return self.chunks.prefix_key(head)

    # ------------------------------------------------------------------ prefill
    def prefill(
        self, prompt: TokenizedPrompt, mode: str | None = None, ratio: float | str | None = None
    ) -> Prefill:
        """First-token logits and a decode-ready cache for ``prompt`` in the given mode.

        ``mode``: full / prefix / reuse / blend (default ``config.mode``); ``ratio``: the blend
        recompute ratio in [0, 1] or "auto" (default ``config.ratio``). A reuse/blend call with
        no chunk to fuse (or whose loading would be slower than a full prefill) runs a full
        prefill and says so: ``stats.mode == "full"``, ``stats.fallback_reason``.
        """
        mode = check_mode(mode or self.config.mode)
        check_ratio(ratio)
        with self._lock:
            return self._prefill(prompt, mode, ratio)

    def _prefill(self, prompt: TokenizedPrompt, mode: str, ratio) -> Prefill:
        t0 = time.perf_counter()
        self._check_length(len(prompt))
        stats = BlendStats(mode=mode, prompt_tokens=len(prompt))
        stats.chunk_tokens = sum(len(c) for c in prompt.chunks)
        if mode == "blend" and self._uses_controller(ratio):
            decision = self._controller_decide(len(prompt))
            stats.extra["controller"] = dataclasses.asdict(decision)
            ratio = decision.ratio
            if decision.fallback_full:
                _fall_back(
                    stats,
                    CONTROLLER_FULL,
                    f"loading the chunk KV from the {decision.tier} tier would "
                    "take longer than a full prefill (loading controller)"
                    if decision.reason == "loading"
                    else f"blend at ratio {max(decision.r_star, decision.r_load):.2f} would not "
                    "be faster than a full prefill on this device (loading controller's profile)",
                )
                mode = "full"
        if mode == "full":
            out = self.full_prefill(prompt.ids, stats)
        else:
            out = self._fused_prefill(prompt, mode, ratio, stats)
        if out.logits.is_cuda:  # kernels are asynchronous: TTFT ends when the logits exist
            torch.cuda.synchronize(out.logits.device)
        stats.ttft_ms = (time.perf_counter() - t0) * 1000
        return out

    def full_prefill(self, ids: Sequence[int], stats: BlendStats | None = None) -> Prefill:
        """Plain HF prefill of ``ids`` (also the loading controller's profiling function)."""
        stats = stats or BlendStats(mode="full", prompt_tokens=len(ids))
        with torch.inference_mode():
            out = self.model(
                input_ids=torch.tensor([list(ids)], device=self.layers.device),
                use_cache=True,
                logits_to_keep=1,
            )
        return Prefill(out.logits[0, -1].float(), out.past_key_values, list(ids), stats)

    def _fused_prefill(self, prompt: TokenizedPrompt, mode: str, ratio, stats: BlendStats):
        """Fused prefill; a stored entry that fails verification is dropped and recomputed."""
        # the head, every chunk and the first chunk's exact entry may each be dropped once
        for _ in range(len(prompt.chunks) + 2):
            try:
                return self._fused_prefill_once(prompt, mode, ratio, stats)
            except CorruptEntryError as exc:
                log.info("%s; recomputing it", exc)  # the store has warned already
                self.store.discard(exc.key)
        return self._fused_prefill_once(prompt, mode, ratio, stats)

    def _fused_prefill_once(self, prompt: TokenizedPrompt, mode: str, ratio, stats: BlendStats):
        t_load = time.perf_counter()
        schedule: list | None
        if mode == "prefix":  # exact prefix cache; everything after it is prefilled
            segments, schedule = self.chunks.prefix_segments(prompt), None
        else:
            segments, missing = self.chunks.lookup(prompt)
            stats.chunk_misses = len(missing)
            stats.chunk_hits = len(prompt.chunks) - len(missing)
            held = [s.kv for s in segments if s.kind == "chunk" and s.kv is not None]
            tiers = collections.Counter(served_from(self.store, kv) for kv in held)
            stats.extra["chunk_tiers"] = dict(tiers)  # the tier that served each hit
            if missing and self.on_miss is not None and prompt.chunk_texts:
                self.on_miss([prompt.chunk_texts[i] for i in missing])
            if not stats.chunk_hits:
                what = "every chunk missed the cache" if prompt.chunks else "no chunks given"
                reason = CACHE_MISS if prompt.chunks else NO_KNOWN_CHUNK
                _fall_back(stats, reason, f"no chunk to fuse: {what}; precompute the chunks first")
                return self.full_prefill(prompt.ids, stats)
            if mode == "reuse":
                schedule = []
            else:
                r = float(self.config.ratio if ratio is None else ratio)
                stats.ratio = r
                schedule = None if r >= 1.0 else self.config.schedule(r)
        stats.load_ms = (time.perf_counter() - t_load) * 1000
        # a head missing from the store is computed now (then stored): not served from a cache
        stats.cached_tokens = sum(len(s) for s in segments if s.kv is not None and not s.computed)
        fusion = fuse(
            self.layers,
            segments,
            self.chunks.loader(segments),
            schedule,
            self.selector,
            native=self.native,
            gpu_path=self.row_attention == "masked",
            kernels=self.layer_kernels,
        )
        stats.recomputed_fraction = fusion.recomputed_fraction
        cache = dynamic_cache_of(self.model.config, fusion.keys, fusion.values)
        fusion.keys, fusion.values = [], []  # now owned by the cache; do not keep two copies
        return Prefill(fusion.logits, cache, prompt.ids, stats, fusion)

    def _uses_controller(self, ratio) -> bool:
        return ratio == "auto" or (ratio is None and self.config.ratio == "auto")

    def _controller_decide(self, n_tokens: int):
        if self.controller is None:
            from ragblend.controller import LoadingController

            self.controller = LoadingController.for_engine(self)
        return self.controller.decide(n_tokens)

    # ------------------------------------------------------------------ generation
    def stream(
        self,
        question: str,
        chunks: Sequence[str],
        *,
        mode: str | None = None,
        ratio: float | str | None = None,
        prompt_format: PromptFormat | None = None,
        **sampling,
    ) -> BlendStream:
        """Like :meth:`generate` but yields text as it is produced (bad arguments raise here)."""
        started = time.perf_counter()
        prompt = self.tokenize(question, chunks, prompt_format)
        return self.stream_prompt(prompt, mode, ratio, started=started, **sampling)

    def stream_prompt(
        self,
        prompt: TokenizedPrompt | list[int],
        mode: str | None = None,
        ratio: float | str | None = None,
        *,
        started: float | None = None,
        **sampling,
    ) -> BlendStream:
        """Stream from a tokenised prompt; a plain id list is prefilled in full mode.

        ``sampling``: :class:`SamplingParams` fields. ``started`` (a perf_counter value)
        backdates TTFT to include tokenisation.
        """
        params = SamplingParams(**sampling)
        max_new = params.max_new_tokens
        max_new = self.config.max_new_tokens if max_new is None else max_new
        mode = check_mode(mode or self.config.mode)
        check_ratio(ratio)
        if isinstance(prompt, list):
            self._check_length(len(prompt))

        def prefill() -> Prefill:
            if isinstance(prompt, list):
                return self.full_prefill(prompt)
            return self._prefill(prompt, mode, ratio)

        decode = Decoder(
            self.model,
            self.tokenizer,
            self.eos_ids,
            params,
            max_new,
            self.layers,
            self.native,
            self.config.kv_cache_dtype,
            self.decode_activations,
        )
        return decode.stream(prefill, self._lock, started, self.prepare_decode)

    def generate(
        self,
        question: str,
        chunks: Sequence[str],
        *,
        mode: str | None = None,
        ratio: float | str | None = None,
        prompt_format: PromptFormat | None = None,
        **sampling,
    ) -> BlendResult:
        """Answer ``question`` over ``chunks`` (retrieval order); mode defaults to config.mode.

        ``sampling``: :class:`SamplingParams` fields (``max_new_tokens``, ``temperature``,
        ``top_p``, ``top_k``, ``seed``, ``repetition_penalty``, ``presence_penalty``,
        ``frequency_penalty``, ``stop``, ``ignore_eos``).
        """
        return self.stream(
            question, chunks, mode=mode, ratio=ratio, prompt_format=prompt_format, **sampling
        ).collect()

    def chat_ids(self, messages: list[dict]) -> list[int]:
        """Token ids of chat messages with the generation prompt (for plain, chunk-less use)."""
        return chat_ids(self.tokenizer, messages)

    def generate_chat(self, messages: list[dict], **sampling) -> BlendResult:
        """Ordinary chat completion (full prefill), for requests that carry no chunks."""
        return self.stream_prompt(self.chat_ids(messages), **sampling).collect()

    def prepare_decode(self) -> None:
        """Call before decoding outside :meth:`generate` / :meth:`stream` (which call it):
        decode-step linears on prepacked weights where the copy fits (``config.packed_decode``;
        once per model), and ``config.decode_activations`` resolved (:attr:`decode_activations`:
        the int8 kernels built and checked where it picks them). Not at start-up: engines that
        only precompute (warmup jobs, Ray actors) never pay its time, the weights' second copy
        or a kernel build."""
        if self.config.packed_decode:
            pack_decode_linears(self.model)
        self.decode_activations  # noqa: B018 (resolved now: the int8 kernels built, or not)

    @property
    def decode_activations(self) -> str:
        """What this engine's decode steps multiply a GGUF's quantized weights by: ``"int8"``
        (llama.cpp's 8-bit activations: ``config.decode_activations`` resolved for this CPU,
        the kernels built and checked on first use) or ``"float"`` (exact; also for dense
        models)."""
        if self._decode_activations is None:
            self._decode_activations = decode_activations_for(
                self.model, self.config.decode_activations
            )
        return self._decode_activations

    def decoder(self, prefill: Prefill, max_new_tokens: int) -> LayerDecoder | HFDecoder:
        """A decoder after ``prefill`` with room for ``max_new_tokens`` (its ``step(token)``
        gives the next logits; a :class:`LayerDecoder` also batches with others through
        ``ragblend.decode.decoder.decode_batch``; its K/V cache stored as
        ``config.kv_cache_dtype`` says). ``prefill`` is left as it is. Call
        :meth:`prepare_decode` once first."""
        total = len(prefill.prompt_ids) + max_new_tokens
        kv, activations = self.config.kv_cache_dtype, self.decode_activations
        return decoder_for(
            self.model,
            self.layers,
            prefill,
            total,
            self.native,
            kv,
            activations,
            self.decode_pool,
            self.layer_kernels,
        )

    @property
    def decode_pool(self) -> DecodePool | None:
        """The static decode K/V pool this engine's decoders take slots of
        (``BlendConfig.decode_slots``), made on first use; None where it is off."""
        slots = self.config.decode_slots
        if slots is None:
            slots = 8 if self.layers.device.type != "cpu" else 0
        if not slots:
            return None
        tokens = self.config.decode_pool_tokens
        if self.layers.context_window:
            tokens = min(tokens, self.layers.context_window)
        key = (slots, tokens, self.config.cuda_graphs)
        pool = self._decode_pools.get(key)
        if pool is None:
            graphs = self.config.cuda_graphs
            pool = self._decode_pools[key] = DecodePool(
                self.layers, slots, tokens, cuda_graphs=graphs
            )
        return pool

    @property
    def decode_path(self) -> str:
        """What a decode step's linears read: ``"q4_1-native"`` (quantized blocks, the model's
        most common type; ``"q4_1-int8"`` with 8-bit activations), ``"fp32-packed"`` /
        ``"bf16-packed"`` (once a decode has packed the linears: fp32 on oneDNN-prepacked
        weights, bf16 on the native bf16 matmul or oneDNN's one-row path,
        :mod:`ragblend.models.packed`) or the plain dtype (``"fp32"``)."""
        quantized = decode_path(self.model)
        if quantized is not None and self.decode_activations == "int8":
            return quantized.replace("-native", "-int8")
        if quantized is not None:
            return quantized
        name = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
        dtype = name.get(self.layers.dtype, str(self.layers.dtype))
        return f"{dtype}-packed" if is_packed(self.model) else dtype

    # ------------------------------------------------------------------ benchmarks
    def greedy_answer(self, prefill: Prefill, max_new_tokens: int) -> list[int]:
        """Greedy answer ids after ``prefill`` (EOS excluded; ``prefill`` is left as it was)."""
        pre = dataclasses.replace(prefill, stats=copy.copy(prefill.stats))
        self.prepare_decode()
        greedy = SamplingParams()
        ids = decode_tokens(
            self.model,
            pre,
            greedy,
            max_new_tokens,
            self.eos_ids,
            self.layers,
            self.native,
            kv_cache_dtype=self.config.kv_cache_dtype,
            activations=self.decode_activations,
        )
        return list(ids)

    def teacher_forced_logits(self, prefill: Prefill, answer_ids: list[int]) -> torch.Tensor:
        """fp32 logits [len(answer_ids), V] predicting each answer token after the prompt,
        through this engine's own decode steps (its kernels, ``kv_cache_dtype`` and
        :attr:`decode_activations`): a greedy answer is its own argmax row by row."""
        self.prepare_decode()
        return teacher_forced_logits(
            self.model,
            prefill,
            answer_ids,
            self.layers,
            self.native,
            kv_cache_dtype=self.config.kv_cache_dtype,
            activations=self.decode_activations,
        )


_UNRESOLVED = object()  # BlendEngine._native before the kernels are first asked for


def _fall_back(stats: BlendStats, reason: str, message: str) -> None:
    log.info("full prefill instead of %s: %s", stats.mode, message)
    fall_back(stats, reason, message)
