"""Linear and embedding layers over a GGUF's quantized blocks, kept as stored.

A GGUF's Q4_0 … Q6_K tensors stay as their blocks (uint8 [rows, row_bytes], memory-mapped from
the file): 4.5-8.5 bits a weight instead of 32. Two kinds of call read them:

- **decode steps** (at most :data:`MAX_ROWS` input rows): a native kernel multiplies the
  rows by the blocks directly (:mod:`ragblend.kernels.cpu.quant_kernels`), reading the weights once
  for all rows; each row's output is the same whatever the rows beside it, and equals
  dequantize + ``F.linear`` to fp32 rounding.
- **prefills** (more rows): the blocks are dequantized into the compute dtype and
  ``F.linear`` runs on them, so a prefill computes exactly what the same model converted to
  dense weights computes (the values are the ``gguf`` package's, bit for bit). Each call
  dequantizes into a buffer freed after it: no dense copy is kept (measured on the embedded
  model, a kept copy did not make blend's TTFT measurably faster, and took 5× the memory).

Where the kernels cannot run (a CPU below AVX2, a failed build), every call dequantizes
through the ``gguf`` package and runs ``F.linear``: slower, the same values.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ragblend.kernels import (
    MAX_ROWS,
    QUANT_TYPES,
    dequantize_reference,
    in_int8_step,
    int8_kernels,
    quant_kernels,
    resolve_decode_activations,
)

log = logging.getLogger(__name__)

_KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # what the matmul kernel takes and returns


# a model's quantized linears keep the dense weights a prefill makes where all of them fit in
# this many bytes in the compute dtype (the embedded model: 269 MB in bf16, 538 MB in fp32)
KEEP_DENSE_BYTES = 1 << 30


class QuantizedWeight:
    """A weight matrix [rows, cols] as GGUF blocks: ``blocks`` uint8 [rows, row_bytes] of
    ggml type ``qtype`` (one of :data:`QUANT_TYPES`). ``keep_dense``: :meth:`dense` keeps the
    weights it dequantizes (:func:`keep_dense_weights`)."""

    def __init__(self, blocks: torch.Tensor, qtype: int, cols: int) -> None:
        if qtype not in QUANT_TYPES:
            raise ValueError(f"no kernel for ggml type {qtype}")
        self.blocks = blocks
        self.qtype = qtype
        self.cols = cols
        self.keep_dense = False
        self._dense: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return int(self.blocks.shape[0])

    @property
    def type_name(self) -> str:
        return QUANT_TYPES[self.qtype]

    def dequantize(self, dtype: torch.dtype, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The weights (or the rows ``rows``, int64 [n]) as ``dtype`` [rows, cols]: the
        ``gguf`` package's values, rounded to ``dtype``."""
        blocks = self.blocks if rows is None else self.blocks.index_select(0, rows)
        kernels = quant_kernels()
        if kernels is None:
            return dequantize_reference(blocks, self.qtype, self.cols).to(dtype)
        return kernels.dequantize(blocks, self.qtype, self.cols, dtype)

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """All the weights as ``dtype`` [rows, cols] for a prefill's ``F.linear``: the same
        values as :meth:`dequantize`, made on first use and kept where :attr:`keep_dense` (a
        prefill then spends nothing on them), else made on every call."""
        kept = self._dense
        if kept is not None and kept.dtype == dtype:
            return kept
        values = self.dequantize(dtype)
        if self.keep_dense:
            self._dense = values
        return values

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """fp32 or bf16 ``x`` [n, cols] @ weights.T (+ ``bias``) → [n, rows] in x's dtype on
        the blocks, for ``n`` ≤ :data:`MAX_ROWS` (bf16: the fp32 result rounded to bf16, or
        with ``avx512_bf16`` kernels the products of the weights rounded to bf16, as
        :mod:`~ragblend.kernels.cpu.quant_kernels` says); None where the kernels do not run here."""
        kernels = quant_kernels()
        if kernels is None or x.shape[0] > MAX_ROWS:
            return None
        if x.dtype not in _KERNEL_DTYPES:
            raise TypeError(f"QuantizedWeight.matmul takes float32 or bfloat16 x, not {x.dtype}")
        b = bias if bias is None or bias.dtype in _KERNEL_DTYPES else bias.float()
        return kernels.matmul(x.contiguous(), self.blocks, self.qtype, self.cols, b)

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()


class QuantLinear(nn.Module):
    """``nn.Linear`` over a :class:`QuantizedWeight` (``bias`` in the compute dtype or None).

    ``dtype`` is the compute dtype: a prefill's dense weights and every output are in it.
    Inside an int8 decode step (:func:`ragblend.kernels.step_activations`), inputs of up to
    :data:`MAX_ROWS` rows take llama.cpp's 8-bit-activation arithmetic instead."""

    def __init__(
        self, weight: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.qweight = weight
        self.in_features = weight.cols
        self.out_features = weight.rows
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows <= MAX_ROWS and not (torch.is_grad_enabled() and x.requires_grad):
            flat = x.reshape(rows, self.in_features)
            if flat.dtype not in _KERNEL_DTYPES:
                flat = flat.float()
            out = self._int8(flat) if in_int8_step() else None
            if out is None:
                out = self.qweight.matmul(flat, self.bias)
            if out is not None:
                return out.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return F.linear(x, self.qweight.dense(self.dtype), self.bias)

    def _int8(self, flat: torch.Tensor) -> torch.Tensor | None:
        kernels = int8_kernels()
        if kernels is None:
            return None
        bias = None if self.bias is None else self.bias.detach().float()
        w = self.qweight
        return kernels.matmul(flat.float().contiguous(), w.blocks, w.qtype, w.cols, bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"type={self.qweight.type_name}, bias={self.bias is not None}"
        )


def fused_matmul(
    linears: Sequence[nn.Module | None],
) -> Callable[[torch.Tensor], tuple[torch.Tensor, ...]] | None:
    """One kernel call for several :class:`QuantLinear` that read the same input (an
    attention's q/k/v, an MLP's gate/up): ``x`` [..., cols] of at most :data:`MAX_ROWS` rows ->
    each linear's output, the same values as its own forward, in x's dtype; None unless they
    are all QuantLinear of one input size and the kernels run here."""
    kernels = quant_kernels()
    if kernels is None or not linears or not all(isinstance(m, QuantLinear) for m in linears):
        return None
    layers = [m for m in linears if isinstance(m, QuantLinear)]
    cols = layers[0].in_features
    if any(m.in_features != cols for m in layers):
        return None
    blocks = [m.qweight.blocks for m in layers]
    qtypes = [m.qweight.qtype for m in layers]
    biases = [None if m.bias is None else m.bias.detach() for m in layers]
    biases = [b if b is None or b.dtype in _KERNEL_DTYPES else b.float() for b in biases]
    sizes = [m.out_features for m in layers]
    float_biases = [None if b is None else b.float() for b in biases]

    def call(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        flat = x.reshape(-1, cols)
        if flat.dtype not in _KERNEL_DTYPES:
            flat = flat.float()
        int8 = int8_kernels() if in_int8_step() else None
        if int8 is not None:
            out = int8.matmul_cat(flat.float().contiguous(), blocks, qtypes, cols, float_biases)
        else:
            current = quant_kernels() or kernels  # a benchmark's kernels_in_use, else these
            out = current.matmul_cat(flat.contiguous(), blocks, qtypes, cols, biases)
        return out.to(x.dtype).view(*x.shape[:-1], out.shape[-1]).split(sizes, dim=-1)

    return call


class QuantEmbedding(nn.Module):
    """``nn.Embedding`` over a :class:`QuantizedWeight`: each looked-up row dequantized into
    the compute dtype (then times ``embed_scale`` where the model's embedding has one, as
    Gemma's ``ScaledWordEmbedding`` does)."""

    def __init__(
        self,
        weight: QuantizedWeight,
        dtype: torch.dtype,
        embed_scale: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.qweight = weight
        self.num_embeddings = weight.rows
        self.embedding_dim = weight.cols
        self.dtype = dtype
        self.embed_scale: torch.Tensor | None
        self.register_buffer("embed_scale", embed_scale, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).to(torch.int64)
        rows = self.qweight.dequantize(self.dtype, flat).view(*ids.shape, self.embedding_dim)
        if self.embed_scale is not None:
            return rows * self.embed_scale.to(self.dtype)
        return rows

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, type={self.qweight.type_name}"


def keep_dense_weights(model: nn.Module, budget: int = KEEP_DENSE_BYTES) -> bool:
    """Let ``model``'s :class:`QuantLinear` weights keep their dense copies
    (:meth:`QuantizedWeight.dense`) where all of them together, in their compute dtype, fit
    in ``budget`` bytes: a small model's prefills then stop dequantizing every weight each
    time, for that much more memory (a weight the LM head shares with the embedding counted
    once). Returns whether they do."""
    weights = {id(m.qweight): m for m in model.modules() if isinstance(m, QuantLinear)}
    itemsize = {k: torch.empty((), dtype=m.dtype).element_size() for k, m in weights.items()}
    total = sum(m.in_features * m.out_features * itemsize[k] for k, m in weights.items())
    keep = bool(weights) and total <= budget
    for m in weights.values():
        m.qweight.keep_dense = keep
    return keep


def quantized_weights(model: nn.Module) -> dict[str, QuantizedWeight]:
    """``{module name + ".weight": weight}`` of the model's quantized layers."""
    return {
        f"{name}.weight": module.qweight
        for name, module in model.named_modules()
        if isinstance(module, QuantLinear | QuantEmbedding)
    }


def weight_bytes(model: nn.Module) -> int:
    """Resident bytes of the model's weights as run: parameters and quantized blocks (shared
    blocks counted once)."""
    seen: set[int] = set()
    total = 0
    tensors: list[torch.Tensor] = list(model.parameters())
    tensors += [w.blocks for w in quantized_weights(model).values()]
    for t in tensors:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def decode_path(model: nn.Module) -> str | None:
    """What a decode step's linears read when they are quantized, e.g. ``"q4_1-native"``
    (the most common type of the model's quantized linears; ``"-dequantize"`` where the
    kernels do not run); None for a model without quantized linears."""
    counts: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, QuantLinear):
            name = module.qweight.type_name.lower()
            counts[name] = counts.get(name, 0) + module.qweight.nbytes
    if not counts:
        return None
    kind = "native" if quant_kernels() is not None else "dequantize"
    return f"{max(counts, key=counts.__getitem__)}-{kind}"


def decode_activations_for(model: nn.Module, mode: str) -> str:
    """What ``model``'s decode steps use for ``BlendConfig.decode_activations`` ``mode``
    (``"auto"``, ``"float"`` or ``"int8"``): ``"int8"`` where it resolves to int8
    (:func:`ragblend.kernels.resolve_decode_activations`), the model has quantized linears and the
    int8 kernels run here (else one warning per process, and ``"float"``); ``"float"``
    otherwise."""
    if resolve_decode_activations(mode) != "int8":
        return "float"
    if not any(isinstance(m, QuantLinear) for m in model.modules()):
        return "float"
    return "int8" if int8_kernels() is not None else "float"
