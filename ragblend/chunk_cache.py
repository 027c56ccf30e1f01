"""Chunk caches: the precompute context, keys, the exact prefix cache, precompute and lookup.

A chunk's KV is computed once after a *precompute context* (``BlendConfig.precompute_context``)
and stored (pre-RoPE K, V; packed to ``kv_dtype``) under a key of the model, dtypes,
namespace, context ids and chunk ids. A prompt head (template + system prompt) is cached
exactly, as full prefill computes it. :meth:`ChunkCache.lookup` turns a tokenised prompt
into the fusor's segments plus the indices of the chunks that missed. The texts of precomputed
chunks are recorded with the store (``ragblend.store.chunk_texts``), so every engine on that
store can match them in prompts. With a neighbour context (``"neighbours"``/``"previous"``) a
chunk is prefilled after the canonical head and its neighbours (``ragblend.neighbours``), and
only its own rows are kept; its key is the canonical one (the neighbours are not in it), so
any engine looking the chunk up under ``"canonical"`` finds it — a store holds one cache per
chunk, whichever context computed it first. With ``exact_first_chunk`` a chunk also has an
entry under the key of the prompt head it was precomputed for (a prefix cache of head +
chunk), which a prompt's first chunk takes exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import torch

from ragblend.config import NEIGHBOUR_CONTEXTS, BlendConfig
from ragblend.errors import CorruptEntryError, RagblendError
from ragblend.fusion.fusor import Segment, fuse
from ragblend.fusion.layer_loader import LayerLoader
from ragblend.fusion.trace import PreRopeCapture
from ragblend.models.adapters import LayerwiseModel
from ragblend.neighbours import NeighbourSource
from ragblend.prompt import (
    CANONICAL_FORMAT,
    FILLER_PASSAGE,
    PromptFormat,
    TokenizedPrompt,
    encode,
    tokenize_prompt,
)
from ragblend.store import basis as bases
from ragblend.store.base import ChunkKV, KVEntry, KVStore
from ragblend.store.chunk_texts import ChunkTexts
from ragblend.store.keys import chunk_key, ids_digest
from ragblend.store.memory import MemoryStore
from ragblend.store.quant import auto_kv_dtype, dtype_name, needs_basis, pack
from ragblend.store.transform import Basis
from ragblend.threads import core_free_for_a_reader

# the neighbours' isolated KV one ChunkCache keeps while precomputing (neighbour_rows="reused")
ISOLATED_BYTES = 1 << 30


class ChunkCache:
    """Keys, precompute and lookup of chunk KV for one model, config and store."""

    def __init__(
        self,
        layers: LayerwiseModel,
        tokenizer,
        config: BlendConfig,
        store: KVStore,
        fingerprint: str,
    ) -> None:
        self.layers = layers
        self.tokenizer = tokenizer
        self.config = config
        self.store = store
        self.fingerprint = fingerprint
        self._heads: dict[PromptFormat, list[int]] = {}
        self._filler_ids: list[int] | None = None
        self._texts: ChunkTexts | None = None
        self._texts_store: KVStore | None = None
        self._separator_ids: list[int] | None = None
        self._isolated: MemoryStore | None = None
        self._basis: Basis | None = None
        # where a neighbour context finds a chunk's neighbours (BlendEngine.neighbours)
        self.neighbours: NeighbourSource | None = None

    # ------------------------------------------------------------------ contexts and keys
    @property
    def kv_dtype(self) -> str:
        """Storage dtype or codec of chunk KV (``"auto"``: ``quant.auto_kv_dtype``)."""
        if self.config.kv_dtype == "auto":
            return auto_kv_dtype(self.layers.dtype)
        return self.config.kv_dtype

    @property
    def lossless(self) -> bool:
        """Whether chunk KV is stored at the compute dtype (an exact cache stays exact)."""
        return self.kv_dtype == dtype_name(self.layers.dtype)

    def head(self, prompt_format: PromptFormat) -> list[int]:
        """Token ids before the first chunk (template head + system + user prefix)."""
        head = self._heads.get(prompt_format)
        if head is None:
            head = tokenize_prompt(self.tokenizer, prompt_format, ["x"], "").head
            self._heads[prompt_format] = head
        return head

    def context_ids(self, head: list[int]) -> list[int]:
        """The ids each chunk is precomputed after, for prompts whose head is ``head``."""
        kind = self.config.precompute_context
        if kind == "prefix":
            return list(head)
        # template-independent; a neighbour context's neighbours are not part of the key
        if kind == "canonical" or kind in NEIGHBOUR_CONTEXTS:
            return self.head(CANONICAL_FORMAT)
        if kind == "bos":
            return head[:1]
        if kind == "filler":
            if self._filler_ids is None:
                self._filler_ids = encode(self.tokenizer, FILLER_PASSAGE + "\n\n")
            return list(head) + self._filler_ids
        return []

    def key(
        self,
        *,
        context_ids: Sequence[int],
        chunk_ids: Sequence[int],
        tag: str = "",
        coded: bool = True,
    ) -> str:
        """The store key of ``chunk_ids`` precomputed after ``context_ids`` (``tag``: see
        :func:`ragblend.store.keys.chunk_key`). A transform coder's chunk keys name the basis
        they are coded with (``coded``; none loaded: a key no entry has); ``coded=False`` for
        what is not stored in ``kv_dtype`` (prefix entries, the text scope)."""
        kv_dtype = self.kv_dtype
        if coded and needs_basis(kv_dtype):
            kv_dtype += f"@{self._basis.id if self._basis is not None else 'none'}"
        return chunk_key(
            fingerprint=self.fingerprint,
            dtype=self.layers.dtype,
            kv_dtype=kv_dtype,
            namespace=self.config.namespace,
            context_ids=context_ids,
            chunk_ids=chunk_ids,
            tag=tag,
        )

    def prefix_key(self, head: Sequence[int]) -> str:
        return self.key(context_ids=[], chunk_ids=head, coded=False)

    # ------------------------------------------------------------------ calibration basis
    @property
    def basis_key(self) -> str:
        """Where the transform coder's basis for this model, dtype and namespace is stored."""
        return chunk_key(
            fingerprint=self.fingerprint,
            dtype=self.layers.dtype,
            kv_dtype="float32",
            namespace=self.config.namespace,
            context_ids=[],
            chunk_ids=[],
            tag=bases.KIND,
        )

    def load_basis(self, create: bool = False) -> Basis | None:
        """The transform coder's basis (``kv_dtype`` ``pca<bits>``; else None): the one in use,
        else the store's, else (``create``) calibrated now from the calibration passages and
        stored. A stored basis that fails to read or verify is dropped (and, with ``create``,
        calibrated again)."""
        if not needs_basis(self.kv_dtype):
            return None
        if self._basis is None:
            self._basis = self._stored_basis()
        if self._basis is None and create:
            calibrated = self._calibrate()
            self.store.put(self.basis_key, bases.as_entry(calibrated, self._meta()))
            flush = getattr(self.store, "flush", None)  # the Redis tier writes asynchronously
            if callable(flush):
                flush()
            # read back: where two processes calibrated at once, every engine uses the winner;
            # a store that did not keep it (full, unreachable) leaves it to this engine alone
            # (its entries are then misses for every other engine: keys name the basis)
            self._basis = self._stored_basis() or bases.register(calibrated)
        return self._basis

    def _stored_basis(self) -> Basis | None:
        lay = self.layers
        entry = self.store.get(self.basis_key)
        if entry is None:
            return None
        found = bases.from_entry(entry, (lay.num_layers, lay.num_kv_heads, lay.head_dim))
        if found is None:
            self.store.discard(self.basis_key)
            return None
        return bases.register(found)

    def _calibrate(self) -> Basis:
        head = self.head(CANONICAL_FORMAT)
        kvs = [
            self.compute_kv(encode(self.tokenizer, text)[: bases.CALIBRATION_TOKENS], head)
            for text in bases.calibration_texts()
        ]
        return bases.calibrate_from(kvs)

    def _meta(self) -> dict:
        return {"fingerprint": self.fingerprint, "dtype": str(self.layers.dtype)}

    def pack(self, kv: ChunkKV) -> KVEntry:
        """``kv`` as stored in ``kv_dtype`` (a transform coder calibrates its basis first)."""
        return pack(kv, self.kv_dtype, self.load_basis(create=True))

    # ------------------------------------------------------------------ neighbours
    @property
    def separator_ids(self) -> list[int]:
        """The canonical separator, put after each neighbour as between prompt chunks."""
        if self._separator_ids is None:
            prompt = tokenize_prompt(self.tokenizer, CANONICAL_FORMAT, ["x", "y"], "")
            self._separator_ids = list(prompt.separator)
        return self._separator_ids

    def neighbour_ids(self, text: str, given: Sequence[str] | None = None) -> list[list[int]]:
        """Token ids of the neighbours chunk ``text`` is precomputed after (``given``, else
        from ``self.neighbours``), least similar first, one list per neighbour (the separator
        goes after each when computed); ``[]`` when the context is not a neighbour context or
        no neighbour is known."""
        if self.config.precompute_context not in NEIGHBOUR_CONTEXTS:
            return []
        if given is None:
            source = self.neighbours
            n = self.config.precompute_neighbours
            given = [] if source is None else source.neighbours(text, n, self.config.namespace)
        return [encode(self.tokenizer, nb) for nb in given if nb and nb != text]

    def neighbour_segments(
        self,
        neighbours: Sequence[Sequence[int]],
        context_ids: list[int],
        between_layers: Callable[[], None] | None = None,
        prefix: Segment | None = None,
    ) -> list[Segment]:
        """Each neighbour as a segment followed by the separator. ``neighbour_rows="reused"``:
        with its KV — its own stored cache, else its isolated KV (computed here where this
        cache does not hold it in :attr:`isolated`; ``prefix``: the context's segment, when
        the caller has it); ``"computed"``: without KV."""
        segments = []
        for ids in neighbours:
            kv = None
            if self.config.neighbour_rows == "reused":
                kv = self._neighbour_kv(list(ids), context_ids, between_layers, prefix)
            segments += [
                Segment("neighbour", list(ids), kv),
                Segment("separator", self.separator_ids),
            ]
        return segments

    def _neighbour_kv(
        self,
        ids: list[int],
        context_ids: list[int],
        between_layers: Callable[[], None] | None,
        prefix: Segment | None,
    ) -> KVEntry:
        own = self.store.get(self.key(context_ids=context_ids, chunk_ids=ids))
        if own is not None:
            return own
        key = self.key(context_ids=context_ids, chunk_ids=ids, tag="isolated")
        kv = self.isolated.get(key)
        if kv is None:
            kv = self.pack(self.compute_kv(ids, context_ids, between_layers, (), prefix))
            self.isolated.put(key, kv)
        return kv

    @property
    def isolated(self) -> MemoryStore:
        """Neighbours' isolated KV made while precomputing, least recently used dropped past
        :data:`ISOLATED_BYTES`: in this process only, never in the store (they serve no query;
        the store keeps what prompts hit)."""
        if self._isolated is None:
            self._isolated = MemoryStore(ISOLATED_BYTES)
        return self._isolated

    # ------------------------------------------------------------------ chunk texts
    @property
    def text_scope(self) -> str:
        """What chunk texts are grouped by in the store: model, dtypes and namespace."""
        return self.key(context_ids=[], chunk_ids=[], coded=False)

    @property
    def texts(self) -> ChunkTexts:
        """The chunk texts recorded with this cache's store."""
        if self._texts is None or self._texts_store is not self.store:
            self._texts, self._texts_store = ChunkTexts(self.store), self.store
        return self._texts

    def record_texts(self, chunks: Iterable[tuple[str, Sequence[int]]], head: list[int]) -> None:
        """Record ``(text, token ids)`` of precomputed chunks with the store."""
        context_ids = self.context_ids(head)
        records = [(self.key(context_ids=context_ids, chunk_ids=ids), t) for t, ids in chunks]
        self.texts.add(self.text_scope, records)

    def new_texts(self) -> list[str]:
        """Chunk texts recorded with the store (by any engine) since the previous call."""
        return self.texts.new_texts(self.text_scope)

    # ------------------------------------------------------------------ computing KV
    def loader(self, segments: Sequence[Segment]) -> LayerLoader:
        """The layer loader feeding ``segments``' cached K/V to the fusor: reading ahead on a
        thread (the store's ``prefetch_depth``) only where a core is free for it."""
        lay = self.layers
        ahead = self.store.prefetch_depth if core_free_for_a_reader(lay.device) else 0
        return LayerLoader(
            [s.kv for s in segments],
            [len(s) for s in segments],
            lay.num_layers,
            lay.num_kv_heads,
            lay.head_dim,
            lay.device,
            lay.dtype,
            prefetch=ahead,
        )

    def compute_kv(
        self,
        ids: list[int],
        context_ids: list[int],
        between_layers: Callable[[], None] | None = None,
        neighbours: Sequence[Sequence[int]] = (),
        prefix: Segment | None = None,
    ) -> ChunkKV:
        """Prefill ``ids`` after ``context_ids`` (served from the exact prefix cache) and
        ``neighbours`` (each followed by the separator; their KV reused or computed as
        ``neighbour_rows`` says, then dropped); the KV of ``ids`` only: pre-RoPE K and V,
        [layers, kv_heads, len(ids), head_dim]. ``prefix``: the context's segment where the
        caller has it (it is not looked up again).

        ``between_layers`` is called before each layer (background warmup blocks there while a
        query runs, so a chunk already started yields the cores within one layer)."""
        window = self.layers.context_window
        neighbours = list(neighbours)
        sep = len(self.separator_ids) if neighbours else 0
        while (
            window
            and neighbours
            and (len(context_ids) + sum(len(n) + sep for n in neighbours) + len(ids) > window)
        ):
            neighbours.pop(0)  # the least similar first: the one next to the chunk matters most
        segments = []
        if context_ids:
            prefix = prefix or self.prefix_segment(context_ids)
            segments.append(prefix)
        segments += self.neighbour_segments(neighbours, context_ids, between_layers, prefix)
        segments.append(Segment("chunk", list(ids)))
        context_len = sum(len(s) for s in segments) - len(ids)
        capture = PreRopeCapture()
        layers: Iterable = self.loader(segments)
        if between_layers is not None:
            layers = _calling_before_each(layers, between_layers)
        # cached neighbours are reused as they are ([]: only rows without a cache are computed)
        reused = any(s.kv is not None and not s.exact for s in segments)
        out = fuse(self.layers, segments, layers, [] if reused else None, trace=capture)
        # the capture holds every computed row (neighbours or separators, then the chunk)
        k = torch.stack([k[0, :, k.shape[2] - len(ids) :] for k in capture.keys]).contiguous()
        v = torch.stack([v[0, :, context_len:] for v in out.values]).contiguous()
        meta = {
            **self._meta(),
            "tokens": len(ids),
            "context": self.key(context_ids=context_ids, chunk_ids=[], coded=False)[:16],
        }
        if neighbours:  # a string: every tier keeps scalar meta (see Segment.fits)
            meta["neighbours"] = ",".join(ids_digest(n) for n in neighbours)
        return ChunkKV(k=k, v=v, meta=meta)

    def prefix_kv(self, head: list[int]) -> KVEntry | None:
        """Exact KV of a prompt head (computed once, then served from the store)."""
        return self.prefix_segment(head).kv

    def prefix_segment(self, head: list[int]) -> Segment:
        """The head as an exact segment with its KV (``computed`` when it was not stored)."""
        if not head:
            return Segment("prefix", head, None, exact=True)
        key = self.prefix_key(head)
        kv = self.store.get(key)
        if kv is None:
            kv = self.compute_kv(head, [])
            self.store.put(key, kv)
            return Segment("prefix", head, kv, exact=True, computed=True)
        return Segment("prefix", head, kv, exact=True)

    def precompute_ids(
        self,
        chunk_ids: Sequence[int],
        head: list[int],
        between_layers: Callable[[], None] | None = None,
        neighbours: Sequence[Sequence[int]] = (),
    ) -> bool:
        """Precompute one tokenised chunk for prompts with ``head``; False if already stored.
        ``between_layers`` and ``neighbours`` (token ids of each): see ``compute_kv``. With
        ``exact_first_chunk``, also the chunk as a prompt's first chunk (after ``head``)."""
        self.load_basis(create=True)  # chunk keys name a transform coder's basis
        context_ids = self.context_ids(head)
        entries = [(context_ids, neighbours)]
        if self.config.exact_first_chunk and context_ids != list(head):
            entries.append((list(head), ()))
        stored = False
        for context, nb in entries:
            key = self.key(context_ids=context, chunk_ids=chunk_ids)
            if key in self.store:
                continue
            args = (list(chunk_ids), context, between_layers, nb)
            try:
                kv = self.compute_kv(*args)
            except CorruptEntryError:  # the stored prefix was damaged and dropped: recompute it
                kv = self.compute_kv(*args)
            self.store.put(key, self.pack(kv))
            stored = True
        return stored

    def precompute(
        self,
        texts: Iterable[str],
        head: list[int],
        neighbours: Mapping[str, Sequence[str]] | None = None,
    ) -> int:
        """Precompute each chunk text; returns how many were newly stored. ``neighbours``:
        the texts to precompute a chunk after (neighbour contexts only), by chunk text; a
        chunk not in it asks ``self.neighbours``."""
        neighbours = neighbours or {}
        stored = 0
        window = self.layers.context_window
        for text in texts:
            ids = encode(self.tokenizer, text)
            if not ids:
                raise RagblendError("cannot precompute an empty chunk")
            n = len(self.context_ids(head)) + len(ids)
            if window and n > window:
                raise RagblendError(
                    f"chunk with its precompute context has {n} tokens, more than the model's "
                    f"context window of {window}"
                )
            nb = self.neighbour_ids(text, neighbours.get(text))
            stored += self.precompute_ids(ids, head, neighbours=nb)
            self.record_texts([(text, ids)], head)
        return stored

    def is_cached(self, text: str, head: list[int]) -> bool:
        self.load_basis()
        ids = encode(self.tokenizer, text)
        return self.key(context_ids=self.context_ids(head), chunk_ids=ids) in self.store

    # ------------------------------------------------------------------ lookup
    def lookup(self, prompt: TokenizedPrompt) -> tuple[list[Segment], list[int]]:
        """The prompt as fusor segments (head exact, chunks with their stored KV or none,
        separators and tail uncached) and the indices of the chunks that missed (every chunk
        while a transform coder's basis is neither loaded nor stored)."""
        self.load_basis()
        context_ids = self.context_ids(prompt.head)
        segments = [self.prefix_segment(prompt.head)]
        missing = []
        for i, chunk in enumerate(prompt.chunks):
            if i and prompt.separator:
                segments.append(Segment("separator", prompt.separator))
            if i == 0 and self.config.exact_first_chunk:
                kv = self.store.get(self.key(context_ids=prompt.head, chunk_ids=chunk))
                if kv is not None:
                    segments.append(Segment("chunk", chunk, kv, exact=self.lossless))
                    continue
            kv = self.store.get(self.key(context_ids=context_ids, chunk_ids=chunk))
            if kv is None:
                missing.append(i)
            fits = bool(i) and kv is not None and precomputed_after(kv, prompt.chunks[i - 1])
            segments.append(Segment("chunk", chunk, kv, fits=fits))
        segments.append(Segment("tail", prompt.tail))
        return segments, missing

    def stored_entries(
        self, chunks: Sequence[Sequence[int]], head: list[int]
    ) -> list[list[KVEntry]]:
        """For each of ``chunks`` (token ids, for prompts with ``head``) stored under its
        precompute context: that entry, then its first-chunk exact entry where one is stored
        (what the chunk costs the store)."""
        self.load_basis()
        context_ids = self.context_ids(head)
        out = []
        for chunk in chunks:
            own = self.store.get(self.key(context_ids=context_ids, chunk_ids=chunk))
            if own is None:
                continue
            found = [own]
            if context_ids != list(head):
                first = self.store.get(self.key(context_ids=head, chunk_ids=chunk))
                found += [first] if first is not None else []
            out.append(found)
        return out

    def prefix_segments(self, prompt: TokenizedPrompt) -> list[Segment]:
        """Exact prefix cache, everything after it uncached (``prefix`` mode)."""
        return [
            self.prefix_segment(prompt.head),
            Segment("rest", prompt.ids[len(prompt.head) :]),
        ]


def precomputed_after(kv: KVEntry, ids: Sequence[int]) -> bool:
    """Whether ``kv`` was precomputed after the chunk ``ids`` (one of its neighbours)."""
    named = str(kv.meta.get("neighbours") or "")
    return bool(named) and ids_digest(ids) in named.split(",")


def _calling_before_each(items: Iterable, hook: Callable[[], None]) -> Iterator:
    for item in items:
        hook()
        yield item
