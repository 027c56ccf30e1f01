"""A static K/V cache shared by the requests a GPU decodes together (gpt-fast's layout).

Per layer, keys and values of up to ``slots`` requests live in one tensor [slots, Hkv,
capacity + 1, d] (a spare column last); each request's
:class:`~ragblend.decode.decoder.LayerDecoder` claims a slot and its buffers are views of it.
A decode step of requests that share a pool then writes every new K/V row with one scatter
per tensor and attends all of them in **one** SDPA call over the slots from the lowest to the
highest stepping one (a view, each query row masked to its own positions, a sliding window's
too), where the per-request path launches two copies and one SDPA per request and layer: the
step's launches no longer grow with the batch.

Slots inside that span that are not in the step attend key 0 (a row nobody reads), so every
row of the SDPA call is finite. A slot is given back when its decoder is garbage-collected.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ragblend.decode.graph import DecodeGraph
from ragblend.decode.layers import step_layers
from ragblend.models.adapters import LayerProjections, LayerwiseModel

if TYPE_CHECKING:
    from ragblend.kernels import LayerKernels, NativeKernels

log = logging.getLogger(__name__)


class DecodePool:
    """Static K/V for up to ``slots`` requests of up to ``capacity`` tokens each."""

    def __init__(
        self,
        layers: LayerwiseModel,
        slots: int,
        capacity: int,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
        cuda_graphs: bool = False,
    ) -> None:
        if slots < 1 or capacity < 1:
            raise ValueError(
                f"a decode pool needs slots and capacity >= 1, got {slots}, {capacity}"
            )
        self.layers = layers
        self.slots = slots
        self.capacity = capacity
        dtype = dtype or layers.dtype
        device = device or layers.device
        # one column more than a slot holds: where a CUDA graph's idle rows write
        shape = (slots, layers.num_kv_heads, capacity + 1, layers.head_dim)
        self.keys = [
            torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers.num_layers)
        ]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self.key_positions = torch.arange(capacity + 1, device=device)
        self.cuda_graphs = cuda_graphs and torch.device(device).type == "cuda"
        self._graphs: dict[tuple[object, object], DecodeGraph] = {}
        self._heads = torch.arange(layers.num_kv_heads, device=device).view(1, -1)
        self._free = list(range(slots))
        self._lock = threading.Lock()

    def step(
        self,
        tokens: Sequence[int],
        positions: Sequence[int],
        slots: Sequence[int],
        kernels: NativeKernels | None = None,
        fused: LayerKernels | None = None,
    ) -> torch.Tensor:
        """One decode step of the requests in ``slots`` (fed ``tokens`` at ``positions``):
        fp32 logits [B, vocab]. A CUDA graph of the whole step where ``cuda_graphs`` is on
        (:mod:`ragblend.decode.graph`), else :meth:`forward` over their span of slots."""
        if self.cuda_graphs:
            graph = self._graph(kernels, fused)
            if graph is not None:
                return graph.replay(tokens, positions, slots)
        device = self.keys[0].device
        span = slice(min(slots), max(slots) + 1)
        rows = torch.tensor([s - span.start for s in slots], device=device)
        ids = torch.tensor(list(tokens), device=device)
        at = torch.tensor(list(positions), device=device)
        return self.forward(ids, at, rows, span, kernels, fused)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        rows: torch.Tensor,
        span: slice,
        kernels: NativeKernels | None = None,
        fused: LayerKernels | None = None,
    ) -> torch.Tensor:
        """The step's layers on device tensors only (what a CUDA graph records): ``tokens``,
        ``positions``, ``rows`` [B] int64 (rows counted from ``span``'s first slot) → fp32
        logits [B, vocab]. ``kernels``/``fused``: the native CPU or fused layer steps."""
        m = self.layers
        masks: dict[int | None, torch.Tensor] = {}  # one per window size

        def attend(layer: int, proj: LayerProjections, window: int | None) -> torch.Tensor:
            mask = masks.get(window)
            if mask is None:
                mask = masks[window] = self.masks(span, rows, positions, window)
            qkv = (proj.q, proj.k, proj.v)
            return self.attend(layer, span, rows, positions, *qkv, mask, m.scaling(layer))

        return step_layers(m, m.embed(tokens), positions, attend, kernels, fused)

    def _graph(
        self, kernels: NativeKernels | None, fused: LayerKernels | None
    ) -> DecodeGraph | None:
        key = (kernels, fused)
        graph = self._graphs.get(key)
        if graph is None:
            every = slice(0, self.slots)

            def step(tokens: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor):
                return self.forward(tokens, positions, rows, every, kernels, fused)

            try:
                device = self.keys[0].device
                graph = DecodeGraph(step, self.slots, self.capacity, device)
                self._graphs[key] = graph
            except Exception as exc:  # capture unsupported by a step on this device
                log.warning("no CUDA graph of the decode step (%s); decoding eagerly", exc)
                self.cuda_graphs = False
                return None
        return graph

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def claim(self, owner: object) -> int | None:
        """A free slot for ``owner`` (given back when ``owner`` is garbage-collected), or None
        when every slot is taken."""
        with self._lock:
            if not self._free:
                return None
            slot = self._free.pop(0)
        weakref.finalize(owner, self._release, slot)
        return slot

    def _release(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)
            self._free.sort()

    def masks(
        self, span: slice, rows: torch.Tensor, positions: torch.Tensor, window: int | None
    ) -> torch.Tensor:
        """Bool [span's slots, 1, 1, capacity]: the keys each slot's query row of ``span``
        attends in this step (``rows``/``positions`` [B] int64: the stepping slots, counted
        from the span's first, and their new positions; the span's others attend key 0)."""
        last = torch.zeros(span.stop - span.start, dtype=positions.dtype, device=positions.device)
        last.index_copy_(0, rows, positions)
        keys = self.key_positions.view(1, -1)
        allowed = keys <= last.view(-1, 1)
        if window is not None:
            allowed &= keys > (last - int(window)).view(-1, 1)
        return allowed.view(last.shape[0], 1, 1, -1)

    def attend(
        self,
        layer: int,
        span: slice,
        rows: torch.Tensor,
        positions: torch.Tensor,
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        mask: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Write the step's new K/V rows at (slot, position) and attend them all in one call
        over the slots of ``span`` (a view: the lowest to the highest stepping slot, so a
        batch of slots 0…B-1 reads only its own): q [1, H, B, d], k_new / v_new
        [1, Hkv, B, d], ``rows`` and ``mask`` as for :meth:`masks` → [1, B, H*d]."""
        keys, values = self.keys[layer][span], self.values[layer][span]
        at = (rows.view(-1, 1), self._heads, positions.view(-1, 1))  # [B, Hkv] index grid
        keys.index_put_(at, k_new[0].transpose(0, 1))
        values.index_put_(at, v_new[0].transpose(0, 1))
        heads, batch = q.shape[1], q.shape[2]
        if batch == keys.shape[0]:  # every slot of the span steps: the rows are in order
            queries = q[0].transpose(0, 1).unsqueeze(2)
        else:
            queries = q.new_zeros(keys.shape[0], heads, 1, q.shape[-1])
            queries.index_copy_(0, rows, q[0].transpose(0, 1).unsqueeze(2))
        out = F.scaled_dot_product_attention(
            queries,
            keys,
            values,
            attn_mask=mask,
            scale=scale,
            enable_gqa=heads != keys.shape[1],
        )
        if batch != keys.shape[0]:
            out = out.index_select(0, rows)
        return out.reshape(1, batch, -1)
