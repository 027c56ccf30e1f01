"""Decode-step linears through oneDNN's prepacked weights, on CPU.

A decode step multiplies a few rows (one per running request) by every weight matrix. On
CPU, ``F.linear`` reads the weights slowly for so few rows — for 2–16 rows in fp32 it even
re-packs them on every call; the same oneDNN primitive with the weight reordered once for
a small batch (what inductor's weight prepacking does) reads them up to 4× faster:

- **bf16** at the ``avx512`` CPU level and above: inputs of up to 16 rows go to ragblend's
  native kernel (:mod:`ragblend.kernels.cpu.dense_decode`), which reads the module's own weight
  once for all rows, in place, and gives each row the same output whatever the rows beside it
  by construction (each row's fp32 sums run in a fixed order); its outputs are within a bf16
  ulp of ``F.linear``'s (another fp32 summation order flips a rounding in ~1 value in 10^4).
  Weights whose columns are no multiple of 32, and CPUs or builds where the kernel does not
  run, take oneDNN's path below.
- **bf16** through oneDNN, one-row inputs, weights reordered for a batch of one:
  bit-identical outputs to ``F.linear`` in every shape measured (SmolLM2's seven projections
  and its 49k-row LM head). oneDNN reorders bf16 weights only on CPUs with AVX512 (BW/VL/DQ)
  or AVX-NE-CONVERT (:func:`ragblend.cpu.onednn_packs_bf16`).
- **fp32**, inputs of up to 16 rows, weights reordered for a batch of 16: the same values as
  ``F.linear`` to fp32 rounding (another summation order), and each row's output the same
  whatever the number of rows beside it — so a request decoded in a batch gets what it gets
  alone. oneDNN does not promise that: for some shapes (more than ~600 inputs on AVX512) its
  kernel for 2+ rows sums in another order than for one. So every fp32 weight shape is probed
  once when it is packed (random rows alone against the same rows together; fp32 outputs
  show any change of order) and a decode batch is cut into groups of the most rows that gave
  every row its one-row output — one row per call where none did.

oneDNN's bf16 takes one row: its outputs are rounded to bf16, which hides a change of
summation order in all but ~1 in 3000 values, so no affordable probe can show that a bf16
kernel of oneDNN keeps rows as they are alone (the native kernel needs no probe).

Linears that read the same input are fused — an attention's q/k/v, an MLP's gate/up — into
one call (three calls fewer per layer and step): oneDNN's GEMM over their stacked weights, or
the native kernel's ``matmul_cat``, which reads each module's weight where it is and writes
their outputs side by side. Everything else (prefill, more rows) goes to ``F.linear`` as
before, so prefills are untouched.

oneDNN's reordered weights are a second copy of the linear weights, made when an engine first
decodes, and only where it fits: at most half the memory the system has available then
(so a 7B model on a 24 GiB machine keeps one copy). The native bf16 kernel makes no copy (only
the few weights it does not take are reordered, and counted). ``BlendConfig(packed_decode=
False)`` never packs: every decode step then runs ``F.linear``. One log line per model says
which path bf16 decode steps take, or why packing does not apply.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeGuard

import torch
import torch.nn.functional as F
from torch import nn

from ragblend import cpu
from ragblend.kernels.cpu import dense_decode
from ragblend.kernels.cpu.dense_decode import DenseKernel
from ragblend.models import quantized

log = logging.getLogger(__name__)

_ATTR = "_ragblend_packed"
_TRIED = "_ragblend_pack_tried"  # on a model: packing was attempted (and logged) once
_QKV = "_ragblend_packed_qkv"  # on an attention module: a decode step's x → (q, k, v)
_QKV_NAMES = ("q_proj", "k_proj", "v_proj")
_GATE_UP_NAMES = ("gate_proj", "up_proj")

Linear = Callable[[torch.Tensor], torch.Tensor]


class Fused(NamedTuple):
    """A fused decode path: inputs of at most ``rows`` rows -> the linears' outputs."""

    rows: int
    call: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]


@dataclass(frozen=True)
class _Plan:
    rows: int  # inputs of at most this many rows go to the prepacked weights
    hint: int  # the batch size oneDNN reorders the weights for


_PLANS = {torch.bfloat16: _Plan(rows=1, hint=1), torch.float32: _Plan(rows=16, hint=16)}
DECODE_ROWS = _PLANS[torch.float32].rows  # the most requests one fp32 decode step packs for
assert DECODE_ROWS == dense_decode.MAX_ROWS  # and one bf16 step on the native kernel
# (out features, in features, dtype, bias) -> rows one call may take (see ``invariant_rows``)
_probed: dict[tuple[int, int, torch.dtype, bool], int] = {}


def available() -> bool:
    """Whether this torch build has oneDNN's linear prepacking (CPU builds with mkldnn)."""
    return bool(torch.backends.mkldnn.is_available()) and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    )


def cpu_packs(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether oneDNN can prepack ``dtype`` weights here: a oneDNN build and, for bf16, a CPU
    level it packs at (see :func:`ragblend.cpu.onednn_packs_bf16`)."""
    if dtype not in _PLANS or not available():
        return False
    return dtype == torch.float32 or cpu.onednn_packs_bf16()


def available_memory() -> int | None:
    """Bytes the system can still give this process without swapping (Linux's MemAvailable),
    or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def pack_decode_linears(model: nn.Module) -> int:
    """Route decode-step inputs of every bf16 or fp32 CPU ``nn.Linear`` of ``model`` to a
    faster path — bf16: up to :data:`DECODE_ROWS` rows to the native kernel where it runs
    (:func:`native_bf16`), else one row to a prepacked weight; fp32: up to :data:`DECODE_ROWS`
    rows to a prepacked weight — q/k/v and gate/up fused, the others one by one; returns how
    many linears were newly packed (0 where it does not apply, and once ``model`` is packed or
    tried: then this returns at once). Where neither path can run (no native kernel, and oneDNN
    cannot pack: :func:`cpu_packs`, or a reorder that raises) or oneDNN's second copy would take
    more than half the available memory, nothing is packed; one log line per model says why,
    or which path bf16 decode steps take.

    A GGUF model's linears over quantized blocks (:class:`ragblend.models.quantized.
    QuantLinear`) need no packing, but their q/k/v and gate/up are fused the same way, on the
    quantized kernels' ``matmul_cat`` (no copy; counted in the return value).

    A model on a GPU returns 0 at once: nothing here is for it, and no CPU kernel is
    compiled or checked for it.

    Fused linears get no path of their own (oneDNN: that would be a third copy of their
    weights): their decode-step path is :func:`qkv_projections` and the MLP's ``forward``, which
    the layer-wise decoder uses; HF's own forward (decoding over a sliding-window cache) runs
    q/k/v unpacked.
    """
    if getattr(model, _ATTR, False) or getattr(model, _TRIED, False):
        return 0
    if _off_cpu(model):  # every path here is a CPU kernel: none is compiled or checked
        return 0
    setattr(model, _TRIED, True)
    fused_blocks = len(_fuse_groups(model, _fused_blocks))
    linears = [m for m in model.modules() if _packable(m)]
    if not linears:
        return fused_blocks
    dtype = linears[0].weight.dtype
    name = "bf16" if dtype == torch.bfloat16 else "fp32"
    native = native_bf16() if dtype == torch.bfloat16 else None
    # oneDNN reorders what the native kernel does not take (with it: only odd-sized weights)
    reordered = [m for m in linears if native is None or not dense_decode.supports(m.weight)]
    onednn = bool(reordered) and available() and cpu_packs(dtype)
    if native is None and not available():
        log.info("decoding without prepacked %s weights: this torch has no oneDNN", name)
        return 0
    if native is None and not cpu_packs(dtype):
        log.info(
            "decoding without prepacked bf16 weights: oneDNN packs them with AVX512 or "
            "AVX-NE-CONVERT, and this CPU is at level %s",
            cpu.cpu_isa(),
        )
        return 0
    copy = sum(m.weight.numel() * m.weight.element_size() for m in reordered) if onednn else 0
    free = available_memory()
    if free is not None and 2 * copy > free:
        log.info(
            "decoding without prepacked %s weights: their copy (%.1f GiB) would take more "
            "than half the available memory (%.1f GiB)",
            name,
            copy / 2**30,
            free / 2**30,
        )
        return 0
    try:
        packed = _pack(model, native, onednn)
    except RuntimeError as exc:  # oneDNN's own check of the CPU, should ours be wrong
        unpack_decode_linears(model)
        setattr(model, _TRIED, True)
        log.warning("decoding without prepacked %s weights: oneDNN could not pack (%s)", name, exc)
        return 0
    if native is not None:
        log.info(
            "bf16 decode steps: up to %d rows per call through ragblend's native kernel (%s "
            "build) on %d of %d linears (their weights in place, no copy); the others "
            "(columns no multiple of %d): %s",
            DECODE_ROWS,
            native.level,
            len(linears) - len(reordered),
            len(linears),
            dense_decode.COLS_MULTIPLE,
            "one row through oneDNN's prepacked weights" if onednn else "F.linear",
        )
    elif dtype == torch.bfloat16:
        log.info(
            "bf16 decode steps: one row per call through oneDNN's prepacked weights (no native "
            "kernel at CPU level %s)",
            cpu.cpu_isa(),
        )
    return packed


def native_bf16() -> DenseKernel | None:
    """ragblend's native bf16 decode matmul where it runs here (:mod:`.dense_decode`)."""
    return dense_decode.dense_kernel()


def _pack(model: nn.Module, native: DenseKernel | None, onednn: bool) -> int:
    fused = _fuse_groups(model, lambda module, names: _fused(module, names, native, onednn))
    packed = len(fused)
    for module in model.modules():
        if not _packable(module) or id(module) in fused or getattr(module, _ATTR, False):
            continue
        forward = _decode_forward(module, native, onednn)
        if forward is None:
            continue
        module.forward = forward  # type: ignore[method-assign,assignment]
        setattr(module, _ATTR, True)
        packed += 1
    setattr(model, _ATTR, True)
    return packed


def _fuse_groups(
    model: nn.Module, fuse: Callable[[nn.Module, Sequence[str]], Fused | None]
) -> set[int]:
    """Each module's q/k/v and, in a gated MLP, gate/up as ``fuse`` fuses them (None: left
    as they are): the attention's decode path (:func:`qkv_projections`) and the MLP's
    ``forward``; returns the ids of the linears fused."""
    fused: set[int] = set()
    for module in model.modules():
        qkv = fuse(module, _QKV_NAMES)
        if qkv is not None:
            setattr(module, _QKV, qkv)
            fused.update(id(getattr(module, name)) for name in _QKV_NAMES)
        gated = callable(getattr(module, "act_fn", None))
        gate_up = fuse(module, _GATE_UP_NAMES) if gated else None
        if gate_up is not None:
            module.forward = _decode_mlp(module, gate_up)
            setattr(module, _ATTR, True)
            fused.update(id(getattr(module, name)) for name in _GATE_UP_NAMES)
    return fused


def _fused_blocks(module: nn.Module, names: Sequence[str]) -> Fused | None:
    """``module``'s linears ``names`` over GGUF blocks in one quantized-kernel call
    (:func:`ragblend.models.quantized.fused_matmul`; no copy), or None."""
    call = quantized.fused_matmul([getattr(module, name, None) for name in names])
    return None if call is None else Fused(quantized.MAX_ROWS, call)


def is_packed(model: nn.Module) -> bool:
    """Whether :func:`pack_decode_linears` packed ``model``'s linears."""
    return bool(getattr(model, _ATTR, False))


def unpack_decode_linears(model: nn.Module) -> None:
    """Undo :func:`pack_decode_linears` (the classes' own ``forward`` again)."""
    vars(model).pop(_TRIED, None)
    for module in model.modules():
        vars(module).pop(_QKV, None)
        if getattr(module, _ATTR, False):
            vars(module).pop("forward", None)
            delattr(module, _ATTR)


def qkv_projections(attn: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)``: one fused call for a packed
    model's decode-step input, the three modules otherwise."""
    fused: Fused | None = vars(attn).get(_QKV)
    if fused is not None and _decode_rows(x, fused.rows):
        return fused.call(x)
    mods: Any = attn
    return mods.q_proj(x), mods.k_proj(x), mods.v_proj(x)


def _off_cpu(model: nn.Module) -> bool:
    """Whether ``model``'s weights live on another device than the CPU (a GPU)."""
    first = next(model.parameters(), None)
    return first is not None and first.device.type != "cpu"


def _packable(module: nn.Module) -> TypeGuard[nn.Linear]:
    return (
        isinstance(module, nn.Linear)
        and module.weight.dtype in _PLANS
        and module.weight.device.type == "cpu"
    )


def _decode_rows(x: torch.Tensor, rows: int) -> bool:
    """Whether ``x`` is a decode step's input: at most ``rows`` rows, no grad."""
    return x.numel() <= rows * x.shape[-1] and not x.requires_grad


def _native(
    native: DenseKernel, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None]
) -> Linear:
    """``F.linear`` of a decode step's ``x`` (``[..., cols]``, at most 16 rows) on each of
    ``weights`` (the modules' own tensors, detached: no copy), outputs side by side."""
    ws = [w.detach() for w in weights]
    bs = [None if b is None else b.detach() for b in biases]

    def call(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        out = native.matmul(flat, ws[0], bs[0]) if len(ws) == 1 else native.matmul_cat(flat, ws, bs)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    return call


def _prepacked(
    weight: torch.Tensor, bias: torch.Tensor | None
) -> Callable[[torch.Tensor], torch.Tensor]:
    """``F.linear(x, weight, bias)`` for a decode step's ``x``, on ``weight`` reordered once
    by oneDNN for the dtype's batch size; rows in groups that keep each row's output as it is
    alone (:func:`invariant_rows`)."""
    plan = _PLANS[weight.dtype]
    with torch.no_grad():
        reordered = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), plan.hint)

    def call(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, reordered, bias, "none", [], "")

    shape = (weight.shape[0], weight.shape[1], weight.dtype, bias is not None)
    group = _probed.get(shape, 1 if plan.rows == 1 else None)
    if group is None:
        group = _probed[shape] = invariant_rows(call, weight.shape[1], weight.dtype, plan.rows)
        if group < plan.rows:
            log.info(
                "decode rows through a %d x %d %s linear go %d at a time: with more, oneDNN "
                "sums in another order than for one row",
                *weight.shape,
                "bf16" if weight.dtype == torch.bfloat16 else "fp32",
                group,
            )

    def linear(x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[:-1].numel()
        if rows <= group:
            return call(x)
        parts = [call(part) for part in x.reshape(rows, x.shape[-1]).split(group)]
        return torch.cat(parts).reshape(*x.shape[:-1], -1)

    return linear


def invariant_rows(
    call: Callable[[torch.Tensor], torch.Tensor], in_features: int, dtype: torch.dtype, limit: int
) -> int:
    """The most rows (<= ``limit``) ``call`` may take at once so that every row's output is
    the one it gets alone: ``limit`` random rows through ``call`` one by one, then the first
    2, 3, ... together, until a row differs."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(limit, in_features, generator=generator).to(dtype)
    with torch.no_grad():
        alone = torch.cat([call(x[i : i + 1]) for i in range(limit)])
        for n in range(2, limit + 1):
            if not torch.equal(call(x[:n]), alone[:n]):
                return n - 1
    return limit


def _decode_forward(
    module: nn.Linear, native: DenseKernel | None, onednn: bool
) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """``module``'s forward with a decode step's rows on the native kernel (bf16 weights it
    takes) or oneDNN's prepacked weight; None where neither applies."""
    weight, bias = module.weight, module.bias
    if native is not None and dense_decode.supports(weight):
        packed, rows = _native(native, [weight], [bias]), DECODE_ROWS
    elif onednn:
        packed, rows = _prepacked(weight, bias), _PLANS[weight.dtype].rows
    else:
        return None

    def forward(x: torch.Tensor) -> torch.Tensor:
        if _decode_rows(x, rows) and x.dtype == weight.dtype:
            return packed(x)
        return F.linear(x, weight, bias)

    return forward


def _fused(
    module: nn.Module, names: Sequence[str], native: DenseKernel | None, onednn: bool
) -> Fused | None:
    """One call for ``module``'s linears ``names`` (same input size, all with or all without
    bias) on a decode step's input, their outputs split back; or None. The native kernel reads
    the weights where they are (``matmul_cat``: one call, no stacked copy); oneDNN runs one GEMM
    over their stacked, prepacked weights."""
    linears = [getattr(module, name, None) for name in names]
    if not all(lin is not None and _packable(lin) for lin in linears):
        return None
    layers: list[nn.Linear] = linears  # type: ignore[assignment]
    with_bias = [lin.bias is not None for lin in layers]
    if len({lin.in_features for lin in layers}) != 1 or len(set(with_bias)) != 1:
        return None
    sizes = [lin.out_features for lin in layers]
    if native is not None and all(dense_decode.supports(lin.weight) for lin in layers):
        both = _native(native, [lin.weight for lin in layers], [lin.bias for lin in layers])
        return Fused(DECODE_ROWS, lambda x: both(x).split(sizes, dim=-1))
    if not onednn:
        return None
    with torch.no_grad():
        stacked = torch.cat([lin.weight.detach() for lin in layers])
        bias = torch.cat([lin.bias.detach() for lin in layers]) if with_bias[0] else None
    packed = _prepacked(stacked, bias)
    return Fused(_PLANS[stacked.dtype].rows, lambda x: packed(x).split(sizes, dim=-1))


def _decode_mlp(mlp: nn.Module, gate_up: Fused) -> Callable[[torch.Tensor], torch.Tensor]:
    """HF's gated MLP, ``down(act(gate(x)) * up(x))``, with gate/up fused for a decode step."""
    mods: Any = mlp
    own = type(mlp).forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        if not _decode_rows(x, gate_up.rows):
            return own(mlp, x)
        gate, up = gate_up.call(x)
        return mods.down_proj(mods.act_fn(gate) * up)

    return forward
