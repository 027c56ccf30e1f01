"""BlendEngine: load a model, precompute chunk KV, answer in full / prefix / reuse / blend mode."""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field

import torch

from ragblend.config import MODES, BlendConfig
from ragblend.errors import CorruptEntryError, RagblendError
from ragblend.fusion.fusor import FusionResult, Segment, fuse
from ragblend.fusion.selectors import make_selector
from ragblend.models.adapters import LayerwiseModel, adapter_for
from ragblend.models.loading import load_model
from ragblend.pipeline import LayerLoader
from ragblend.prompt import (
    CANONICAL_FORMAT,
    FILLER_PASSAGE,
    PromptFormat,
    TokenizedPrompt,
    encode,
    tokenize_prompt,
)
from ragblend.store.base import ChunkKV, KVStore
from ragblend.store.keys import chunk_key, model_fingerprint
from ragblend.store.memory import MemoryStore
from ragblend.store.quant import pack

log = logging.getLogger(__name__)


@dataclass
class BlendStats:
    """What one request did: timings, token counts, cache hits and how much was recomputed."""

    mode: str
    ttft_ms: float = 0.0
    load_ms: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    chunk_tokens: int = 0
    chunk_hits: int = 0
    chunk_misses: int = 0
    recomputed_fraction: float = 1.0
    ratio: float | None = None
    finish_reason: str = ""
    decode_ms: float = 0.0
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Prefill:
    """The prompt's first-token logits and a decode-ready HF cache."""

    logits: torch.Tensor
    cache: object
    prompt_ids: list[int]
    stats: BlendStats
    fusion: FusionResult | None = None

    def copy(self) -> Prefill:
        """An independent copy (decoding mutates the cache)."""
        cache = copy.deepcopy(self.cache)
        return Prefill(self.logits, cache, self.prompt_ids, copy.copy(self.stats), self.fusion)


@dataclass
class BlendResult:
    text: str
    token_ids: list[int]
    stats: BlendStats


class BlendStream:
    """Iterator over text deltas; ``result`` is set once the stream is exhausted or closed.

    ``close()`` stops decoding early (e.g. on a stop sequence); ``result`` then holds what was
    generated so far, with ``finish_reason == "stop"``.
    """

    def __init__(self, deltas: Iterator[str]) -> None:
        self._deltas = deltas
        self.result: BlendResult | None = None

    def __iter__(self) -> Iterator[str]:
        return self._deltas

    def close(self) -> None:
        self._deltas.close()


class BlendEngine:
    """CacheBlend over a plain HF causal LM.

    >>> engine = BlendEngine.from_pretrained("embedded")
    >>> engine.precompute(chunks)                       # once, e.g. at index time
    >>> engine.generate("Who wrote X?", chunks).text   # fused prefill + decode
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        config: BlendConfig | None = None,
        store: KVStore | None = None,
        prompt_format: PromptFormat | None = None,
        name: str | None = None,
    ) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = config or BlendConfig()
        self.layers: LayerwiseModel = adapter_for(model)
        self.store: KVStore = store if store is not None else MemoryStore(self.config.ram_bytes)
        self.prompt_format = prompt_format or PromptFormat()
        self.name = name or getattr(model.config, "_name_or_path", "") or type(model).__name__
        self.fingerprint = model_fingerprint(model)
        self.selector = make_selector(self.config.selector, self.config.deviation)
        self.on_miss: Callable[[list[str]], None] | None = None
        self._filler_ids: list[int] | None = None
        self._heads: dict[PromptFormat, list[int]] = {}
        self.controller = None
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
        """Load ``"embedded"`` (SmolLM2-135M-Instruct) or a local HF model directory."""
        config = config or BlendConfig(**overrides)
        model, tokenizer = load_model(name_or_path, device=config.device, dtype=config.dtype)
        name = "SmolLM2-135M-Instruct" if name_or_path == "embedded" else str(name_or_path)
        return cls(model, tokenizer, config, store, prompt_format, name=name)

    def with_config(self, **overrides) -> BlendEngine:
        """A view of this engine (same model and store) with some config fields changed."""
        from dataclasses import replace

        clone = copy.copy(self)
        clone.config = replace(self.config, **overrides)
        clone.selector = make_selector(clone.config.selector, clone.config.deviation)
        return clone

    # ------------------------------------------------------------------ prompts and keys
    @property
    def context_window(self) -> int:
        return self.layers.context_window

    def tokenize(
        self, question: str, chunks: Sequence[str], prompt_format: PromptFormat | None = None
    ) -> TokenizedPrompt:
        prompt = tokenize_prompt(
            self.tokenizer, prompt_format or self.prompt_format, list(chunks), question
        )
        self._check_length(len(prompt))
        return prompt

    def prompt_head(self, prompt_format: PromptFormat | None = None) -> list[int]:
        """Token ids before the first chunk (template head + system + user prefix)."""
        fmt = prompt_format or self.prompt_format
        head = self._heads.get(fmt)
        if head is None:
            head = self._heads[fmt] = tokenize_prompt(self.tokenizer, fmt, ["x"], "").head
        return head

    def _check_length(self, n: int) -> None:
        limit = self.context_window
        if limit and n > limit:
            raise RagblendError(
                f"prompt has {n} tokens, more than the model's context window of {limit}; "
                "retrieve fewer or shorter chunks"
            )

    def _context_ids(self, head: list[int]) -> list[int]:
        kind = self.config.precompute_context
        if kind == "prefix":
            return list(head)
        if kind == "canonical":  # independent of the user's template and system prompt
            return self.prompt_head(CANONICAL_FORMAT)
        if kind == "bos":
            return head[:1]
        if kind == "filler":
            if self._filler_ids is None:
                self._filler_ids = encode(self.tokenizer, FILLER_PASSAGE + "\n\n")
            return list(head) + self._filler_ids
        return []

    def chunk_key(self, chunk_ids: Sequence[int], context_ids: Sequence[int]) -> str:
        return chunk_key(
            fingerprint=self.fingerprint,
            dtype=self.layers.dtype,
            kv_dtype=self.kv_dtype,
            namespace=self.config.namespace,
            context_ids=context_ids,
            chunk_ids=chunk_ids,
        )

    def _prefix_key(self, head: Sequence[int]) -> str:
        return self.chunk_key(head, [])

    @property
    def kv_dtype(self) -> str:
        """Storage dtype of chunk KV ("auto" resolves to the compute dtype)."""
        if self.config.kv_dtype == "auto":
            return str(self.layers.dtype).removeprefix("torch.")
        return self.config.kv_dtype

    # ------------------------------------------------------------------ precompute
    def _loader(self, segments: Sequence[Segment]) -> LayerLoader:
        lay = self.layers
        return LayerLoader(
            [s.kv for s in segments],
            [len(s) for s in segments],
            lay.num_layers,
            lay.num_kv_heads,
            lay.head_dim,
            lay.device,
            lay.dtype,
            prefetch=self.store.prefetch_depth,
        )

    def _compute_kv(self, ids: list[int], context_ids: list[int]) -> ChunkKV:
        """Prefill ``ids`` after ``context_ids`` (served from the exact prefix cache)."""
        context_len = len(context_ids)
        segments = []
        if context_ids:
            segments.append(Segment("prefix", context_ids, self.prefix_kv(context_ids), exact=True))
        segments.append(Segment("chunk", list(ids)))
        out = fuse(self.layers, segments, self._loader(segments), None, capture_pre_rope=True)
        k = torch.stack([k[0] for k in out.pre_rope_keys]).contiguous()
        v = torch.stack([v[0, :, context_len:] for v in out.values]).contiguous()
        meta = {
            "fingerprint": self.fingerprint,
            "dtype": str(self.layers.dtype),
            "tokens": len(ids),
        }
        meta["context"] = self.chunk_key([], context_ids)[:16]  # the precompute context's hash
        return ChunkKV(k=k, v=v, meta=meta)

    def prefix_kv(self, head: list[int]) -> ChunkKV | None:
        """Exact KV of a prompt head (computed once, then served from the store)."""
        if not head:
            return None
        key = self._prefix_key(head)
        kv = self.store.get(key)
        if kv is None:
            kv = self._compute_kv(head, [])
            self.store.put(key, kv)
        return kv

    def precompute_ids(self, chunk_ids: Sequence[int], head: list[int]) -> bool:
        """Precompute one tokenised chunk in this engine's context; False if already stored."""
        context_ids = self._context_ids(head)
        key = self.chunk_key(chunk_ids, context_ids)
        if key in self.store:
            return False
        try:
            kv = self._compute_kv(list(chunk_ids), context_ids)
        except CorruptEntryError:  # the stored prefix was damaged and dropped: recompute it
            kv = self._compute_kv(list(chunk_ids), context_ids)
        self.store.put(key, pack(kv, self.kv_dtype))
        return True

    def precompute(
        self,
        chunks: Sequence[str],
        prompt_format: PromptFormat | None = None,
        progress: bool = False,
    ) -> int:
        """Precompute and store the KV of each chunk; returns how many were newly stored."""
        head = self.prompt_head(prompt_format)
        iterable = chunks
        if progress:
            from tqdm.auto import tqdm

            iterable = tqdm(chunks, desc="precompute KV", unit="chunk")
        stored = 0
        for text in iterable:
            ids = encode(self.tokenizer, text)
            if not ids:
                raise RagblendError("cannot precompute an empty chunk")
            self._check_length(len(self._context_ids(head)) + len(ids))
            stored += self.precompute_ids(ids, head)
        return stored

    def is_cached(self, chunk: str, prompt_format: PromptFormat | None = None) -> bool:
        head = self.prompt_head(prompt_format)
        return self.chunk_key(encode(self.tokenizer, chunk), self._context_ids(head)) in self.store

    # ------------------------------------------------------------------ prefill
    def prefill(
        self, prompt: TokenizedPrompt, mode: str | None = None, ratio: float | None = None
    ) -> Prefill:
        """First-token logits and decode cache for ``prompt`` in the given mode."""
        mode = mode or self.config.mode
        if mode not in MODES:
            raise RagblendError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
        t0 = time.perf_counter()
        ids = prompt.ids
        self._check_length(len(ids))
        stats = BlendStats(mode=mode, prompt_tokens=len(ids))
        stats.chunk_tokens = sum(len(c) for c in prompt.chunks)
        if mode == "blend":
            decision = self._controller_decision(ratio, len(ids))
            if decision is not None:
                stats.extra["controller"] = decision
                if decision["fallback_full"]:  # loading would be slower than a full prefill
                    mode = "full"
        if mode == "full":
            out = self._forward(ids, None)
            logits, cache, fusion = out.logits[0, -1].float(), out.past_key_values, None
        else:
            fusion, cache = self._fused_prefill(prompt, mode, ratio, stats)
            logits = fusion.logits
        if logits.is_cuda:  # kernels are asynchronous: TTFT ends when the logits exist
            torch.cuda.synchronize(logits.device)
        stats.ttft_ms = (time.perf_counter() - t0) * 1000
        return Prefill(logits=logits, cache=cache, prompt_ids=ids, stats=stats, fusion=fusion)

    def _forward(self, ids: list[int], cache):
        device = self.layers.device
        with torch.inference_mode():
            return self.model(
                input_ids=torch.tensor([ids], device=device),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )

    def _new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def _cache_from(self, kv: ChunkKV | None, n: int):
        cache = self._new_cache()
        if kv is None:
            return cache
        lay = self.layers
        pos = torch.arange(n, device=lay.device)
        for layer in range(lay.num_layers):
            k, v = kv.layer(layer)
            k = k.to(lay.device).unsqueeze(0)
            cos, sin = lay.rope(pos, k)
            cache.update(lay.rotate(k, cos, sin), v.to(lay.device).unsqueeze(0).clone(), layer)
        return cache

    def _fused_prefill(self, prompt: TokenizedPrompt, mode: str, ratio, stats: BlendStats):
        """Fused prefill; a stored entry that fails verification is dropped and recomputed."""
        for _ in range(len(prompt.chunks) + 1):
            try:
                return self._fused_prefill_once(prompt, mode, ratio, stats)
            except CorruptEntryError as exc:
                log.info("%s; recomputing it", exc)  # the store has warned already
                self.store.discard(exc.key)
        return self._fused_prefill_once(prompt, mode, ratio, stats)

    def _fused_prefill_once(self, prompt: TokenizedPrompt, mode: str, ratio, stats: BlendStats):
        t_load = time.perf_counter()
        context_ids = self._context_ids(prompt.head)
        segments = [Segment("prefix", prompt.head, self.prefix_kv(prompt.head), exact=True)]
        if mode == "prefix":  # exact prefix cache; everything after it is prefilled
            segments.append(Segment("rest", prompt.ids[len(prompt.head) :]))
            stats.load_ms = (time.perf_counter() - t_load) * 1000
            return self._run_fusion(segments, None, stats)
        missing = []
        for i, chunk in enumerate(prompt.chunks):
            if i and prompt.separator:
                segments.append(Segment("separator", prompt.separator))
            kv = self.store.get(self.chunk_key(chunk, context_ids))
            if kv is None:
                missing.append(i)
            segments.append(Segment("chunk", chunk, kv))
        segments.append(Segment("tail", prompt.tail))
        stats.chunk_misses = len(missing)
        stats.chunk_hits = len(prompt.chunks) - len(missing)
        if missing and self.on_miss is not None and prompt.chunk_texts:
            self.on_miss([prompt.chunk_texts[i] for i in missing])
        if mode == "reuse":
            schedule: list | None = []
        else:
            r = self._choose_ratio(ratio, prompt, stats)
            stats.ratio = r
            schedule = None if r >= 1.0 else self.config.schedule(r)
        stats.load_ms = (time.perf_counter() - t_load) * 1000
        return self._run_fusion(segments, schedule, stats)

    def _run_fusion(self, segments: list[Segment], schedule, stats: BlendStats):
        fusion = fuse(self.layers, segments, self._loader(segments), schedule, self.selector)
        stats.recomputed_fraction = fusion.recomputed_fraction
        cache = self._new_cache()
        for layer, (k, v) in enumerate(zip(fusion.keys, fusion.values)):
            cache.update(k, v, layer)
        fusion.keys, fusion.values = [], []  # now owned by the cache; do not keep two copies
        return fusion, cache

    def _choose_ratio(self, ratio, prompt: TokenizedPrompt, stats: BlendStats) -> float:
        if ratio is not None and ratio != "auto":
            return float(ratio)
        decision = stats.extra.get("controller") or self._controller_decision(ratio, len(prompt))
        if decision is None:
            return float(self.config.ratio)
        stats.extra["controller"] = decision
        return decision["ratio"]

    def _controller_decision(self, ratio, n_tokens: int) -> dict | None:
        """The loading controller's decision when the ratio is "auto" (controller made lazily)."""
        if ratio not in (None, "auto") or (ratio is None and self.config.ratio != "auto"):
            return None
        if self.controller is None:
            from ragblend.controller import LoadingController

            self.controller = LoadingController.for_engine(self)
        return self.controller.decide(n_tokens)

    # ------------------------------------------------------------------ generation
    def greedy_answer(self, prefill: Prefill, max_new_tokens: int) -> list[int]:
        """Greedy answer ids from a copy of ``prefill`` (EOS excluded)."""
        return list(self._decode(prefill.copy(), max_new_tokens, 0.0, 1.0, 0, None))

    def _decode(
        self,
        prefill: Prefill,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
    ) -> Iterator[int]:
        from transformers import (
            LogitsProcessorList,
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )

        sample = temperature > 0
        warpers = LogitsProcessorList()
        if sample:
            warpers.append(TemperatureLogitsWarper(temperature))
            if top_k:
                warpers.append(TopKLogitsWarper(top_k))
            if top_p < 1.0:
                warpers.append(TopPLogitsWarper(top_p))
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        history = torch.tensor([prefill.prompt_ids])
        logits = prefill.logits
        cache = prefill.cache
        stats = prefill.stats
        stats.finish_reason = "length"
        for step in range(max_new_tokens):
            if sample:
                scores = warpers(history, logits.view(1, -1).cpu())
                probs = torch.softmax(scores, dim=-1)
                token = int(torch.multinomial(probs, 1, generator=generator))
            else:
                token = int(torch.argmax(logits))
            if token in self.eos_ids:
                stats.finish_reason = "stop"
                return
            stats.completion_tokens += 1
            yield token
            if step + 1 == max_new_tokens:
                return
            if sample:  # only the logits warpers read the history
                history = torch.cat([history, torch.tensor([[token]])], dim=1)
            with torch.inference_mode():
                out = self.model(
                    input_ids=torch.tensor([[token]], device=self.layers.device),
                    past_key_values=cache,
                    use_cache=True,
                )
            logits = out.logits[0, -1].float()

    def stream(
        self,
        question: str,
        chunks: Sequence[str],
        *,
        mode: str | None = None,
        ratio: float | None = None,
        prompt_format: PromptFormat | None = None,
        max_new_tokens: int | None = None,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
    ) -> BlendStream:
        """Like :meth:`generate` but yields text as it is produced."""
        started = time.perf_counter()
        prompt = self.tokenize(question, chunks, prompt_format)
        return self.stream_prompt(
            prompt, mode, ratio, max_new_tokens, temperature, top_p, top_k, seed, started
        )

    def stream_prompt(
        self,
        prompt: TokenizedPrompt | list[int],
        mode: str | None = None,
        ratio: float | None = None,
        max_new_tokens: int | None = None,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        started: float | None = None,
    ) -> BlendStream:
        """Stream from a tokenised prompt; a plain id list is prefilled in full mode.

        ``started`` (a perf_counter value) backdates TTFT to include tokenisation.
        """
        max_new = self.config.max_new_tokens if max_new_tokens is None else max_new_tokens
        holder = BlendStream(iter(()))

        def run() -> Iterator[str]:
            if isinstance(prompt, list):
                self._check_length(len(prompt))
                t0 = time.perf_counter()
                out = self._forward(prompt, None)
                if out.logits.is_cuda:
                    torch.cuda.synchronize(out.logits.device)
                stats = BlendStats(mode="full", prompt_tokens=len(prompt))
                stats.ttft_ms = (time.perf_counter() - t0) * 1000
                pre = Prefill(out.logits[0, -1].float(), out.past_key_values, prompt, stats)
            else:
                pre = self.prefill(prompt, mode, ratio)
            if started is not None:
                pre.stats.ttft_ms = (time.perf_counter() - started) * 1000
            t0 = time.perf_counter()
            tokens: list[int] = []
            text = ""
            try:
                for token in self._decode(pre, max_new, temperature, top_p, top_k, seed):
                    tokens.append(token)
                    new_text = self.tokenizer.decode(tokens, skip_special_tokens=True)
                    if new_text.endswith("\ufffd"):
                        continue  # incomplete multi-byte character
                    if len(new_text) > len(text):
                        yield new_text[len(text) :]
                        text = new_text
                final = self.tokenizer.decode(tokens, skip_special_tokens=True)
                if len(final) > len(text):
                    yield final[len(text) :]
            except GeneratorExit:  # the consumer stopped early (e.g. a stop sequence)
                pre.stats.finish_reason = "stop"
                raise
            finally:
                pre.stats.decode_ms = (time.perf_counter() - t0) * 1000
                final = self.tokenizer.decode(tokens, skip_special_tokens=True)
                holder.result = BlendResult(text=final, token_ids=tokens, stats=pre.stats)

        holder._deltas = run()
        return holder

    def generate(
        self,
        question: str,
        chunks: Sequence[str],
        *,
        mode: str | None = None,
        ratio: float | None = None,
        prompt_format: PromptFormat | None = None,
        max_new_tokens: int | None = None,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
    ) -> BlendResult:
        """Answer ``question`` over ``chunks`` (retrieval order); mode defaults to config.mode."""
        stream = self.stream(
            question,
            chunks,
            mode=mode,
            ratio=ratio,
            prompt_format=prompt_format,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
        )
        for _ in stream:
            pass
        return stream.result

    def chat_ids(self, messages: list[dict]) -> list[int]:
        """Token ids of chat messages with the generation prompt (for plain, chunk-less use)."""
        if getattr(self.tokenizer, "chat_template", None):
            enc = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=True
            )
            return list(enc["input_ids"])
        text = "\n\n".join(m["content"] for m in messages) + "\n"
        return encode(self.tokenizer, text)

    def generate_chat(self, messages: list[dict], **kwargs) -> BlendResult:
        """Ordinary chat completion (full prefill), for requests that carry no chunks."""
        stream = self.stream_prompt(self.chat_ids(messages), **kwargs)
        for _ in stream:
            pass
        return stream.result

    def teacher_forced_logits(self, prefill: Prefill, answer_ids: list[int]) -> torch.Tensor:
        """fp32 logits [len(answer_ids), V] predicting each answer token after the prompt."""
        if not answer_ids:
            return prefill.logits.view(1, -1)
        cache = copy.deepcopy(prefill.cache)
        with torch.inference_mode():
            out = self.model(
                input_ids=torch.tensor([answer_ids[:-1]], device=self.layers.device),
                past_key_values=cache,
                use_cache=True,
            ) if len(answer_ids) > 1 else None
        rows = [prefill.logits.view(1, -1)]
        if out is not None:
            rows.append(out.logits[0].float())
        return torch.cat(rows, dim=0)
