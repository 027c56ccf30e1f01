"""Which aten ops launch a GPU kernel and which make the host wait: the op tables
:mod:`ragblend.bench.op_counter` counts by.

What counts:

* **kernel**: an aten op that would launch a GPU kernel: every dispatched op except pure
  view / metadata / allocation ops (:data:`NON_KERNEL_OPS`: views, reshapes without a copy,
  ``empty*``, ``lift_fresh``, ``detach``, ``sym_*`` queries, ...) and the sync-only reads
  (:data:`SYNC_ONLY_OPS`: ``_local_scalar_dense``, ``is_nonzero``), which copy a scalar to the
  host but launch no compute kernel.
* **sync**: an op that makes the host wait for the device: :data:`SYNC_OPS` (``nonzero``,
  ``masked_select``, ``unique*``, ``equal``, ``allclose``, ``_local_scalar_dense`` — i.e.
  ``item()``/``int()``/``bool()``/``float()`` of a tensor —, ``is_nonzero``), boolean-mask
  indexing (``index.Tensor`` / ``index_put(_)`` with a bool or uint8 index: the output size is
  the mask's count), ``repeat_interleave`` without ``output_size``, and at the torch-function
  level :data:`HOST_READS` (``Tensor.tolist/cpu/numpy/item/__bool__/__int__/__float__/
  __index__/__repr__/__format__``). A host read is counted once, at the torch-function level:
  the ops it dispatches (``_local_scalar_dense`` for ``item()``; on CUDA the device→host copy
  of ``cpu()``) are neither syncs nor kernels.
* **host→device copies** (reported beside, not in the sync counts): ``torch.tensor`` /
  ``torch.as_tensor`` of (non-empty) host data with an explicit ``device``: on CUDA a blocking
  copy from pageable memory, which waits for the stream (``cudaMemcpyAsync`` + stream
  synchronize); a ``copy_`` from a host tensor into a device one; :data:`UPLOADS`.

Composite ops (``linear``, ``to``, ``reshape``, ``item``, ...) that reach the dispatch mode
whole (under ``torch.inference_mode`` no autograd key decomposes them first) are decomposed
there, as a GPU build runs them: ``x.to(float32)`` of an fp32 tensor is no kernel, ``linear``
one ``addmm``. :data:`KEEP_WHOLE` ops (``scaled_dot_product_attention``: one fused kernel on
CUDA, a CPU-only backend choice here) count as one kernel.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

import ragblend.kernels.cuda.layer_ops  # noqa: F401  (registers the fused ops counted here)

_aten = torch.ops.aten


def _packets(names: Iterable[str]) -> frozenset[Any]:
    """The aten overload packets of ``names`` that this torch build has."""
    out = set()
    for name in names:
        try:
            out.add(getattr(_aten, name))
        except (AttributeError, RuntimeError):
            continue
    return frozenset(out)


# Views, metadata queries and allocations: no kernel on a GPU.
NON_KERNEL_OPS: frozenset[Any] = _packets(
    (
        # views
        "view",
        "_unsafe_view",
        "_reshape_alias",
        "reshape",  # composite; a copy shows up as clone/_unsafe_view
        "expand",
        "expand_as",
        "transpose",
        "t",
        "permute",
        "slice",
        "select",
        "unsqueeze",
        "squeeze",
        "as_strided",
        "alias",
        "detach",
        "detach_",
        "split",
        "split_with_sizes",
        "unbind",
        "chunk",
        "narrow",
        "tensor_split",
        "diagonal",
        "unfold",
        "view_as_real",
        "view_as_complex",
        "real",
        "imag",
        "_neg_view",
        "_conj",
        "movedim",
        "unflatten",
        "flatten",
        # allocations and wrapping (no data written)
        "empty",
        "empty_like",
        "empty_strided",
        "empty_permuted",
        "new_empty",
        "new_empty_strided",
        "resize_",
        "set_",
        "lift",
        "lift_fresh",
        # metadata queries
        "sym_size",
        "sym_stride",
        "sym_numel",
        "sym_storage_offset",
        "sym_is_contiguous",
        "size",
        "stride",
        "dim",
        "numel",
        "is_contiguous",
        "is_same_size",
        "_has_compatible_shallow_copy_type",
        "record_stream",
    )
)

# Read a scalar to the host (a sync) without launching a compute kernel.
SYNC_ONLY_OPS: frozenset[Any] = _packets(("_local_scalar_dense", "is_nonzero"))

# Always a sync: the host needs a value (or an output size) computed on the device.
SYNC_OPS: frozenset[Any] = SYNC_ONLY_OPS | _packets(
    (
        "nonzero",
        "masked_select",
        "_unique",
        "_unique2",
        "unique_dim",
        "unique_consecutive",
        "unique_dim_consecutive",
        "equal",
        "allclose",
    )
)

# A sync when an index is a bool/uint8 mask (its count sets the output size).
MASK_INDEX_OPS: frozenset[Any] = _packets(("index", "index_put_", "index_put", "_index_put_impl_"))

# A sync unless ``output_size`` is given (the output length is a sum of device values).
REPEAT_INTERLEAVE: Any = _aten.repeat_interleave

# Composite ops counted whole (not decomposed): one fused kernel on CUDA, while their CPU
# decomposition picks a CPU backend.
KEEP_WHOLE: frozenset[Any] = _packets(("scaled_dot_product_attention",))

COMPOSITE_KEY = torch._C.DispatchKey.CompositeImplicitAutograd
FUSED_NORM: Any = torch.ops.ragblend_layer.rms_norm  # registered by ragblend.kernels.cuda.layer_ops

# Tensor methods that read device data on the host; on CPU most dispatch nothing, so they are
# seen at the torch-function level (and counted there only).
HOST_READS: frozenset[Any] = frozenset(
    getattr(torch.Tensor, name)
    for name in (
        "tolist",
        "cpu",
        "numpy",
        "item",
        "__bool__",
        "__int__",
        "__float__",
        "__index__",
        "__repr__",
        "__format__",
    )
)

# Functions (module, name) that return host data on the compute device and, on CPU, the host
# tensor itself (no copy): wrapped while a tracking counter counts, so that their result is a
# device tensor and the copy a GPU makes counts (one kernel, one host→device copy).
UPLOADS: tuple[tuple[str, str], ...] = (("ragblend.fusion.rows", "upload"),)

# Factories that copy host data to their ``device`` (a blocking, stream-waiting copy on CUDA).
HOST_TO_DEVICE: frozenset[Any] = frozenset((torch.tensor, torch.as_tensor))


def op_name(func: Any) -> str:
    """``<namespace>.<packet>`` of an op overload (``aten.mm``, ``ragblend_layer.rope_qk``),
    or a torch function's ``__qualname__``."""
    packet = getattr(func, "overloadpacket", None)
    if packet is not None:
        return f"{getattr(func, 'namespace', 'aten')}.{packet.__name__}"
    name = str(getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or func)
    return name.replace("TensorBase.", "Tensor.").replace("_VariableFunctionsClass.", "torch.")


def is_mask(index: object) -> bool:
    return isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)


def _everywhere(t: object) -> bool:
    return True


def dispatch_is_sync(
    func: Any,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    on_device: Callable[[object], bool] = _everywhere,
) -> bool:
    """Whether a dispatched aten op makes the host wait for the device (``on_device``: whether
    a tensor would be a device tensor; default: all are)."""
    packet = func.overloadpacket
    if packet in SYNC_OPS:
        return any(on_device(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
    if packet in MASK_INDEX_OPS:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(is_mask(i) and on_device(i) for i in indices or ())
    if packet is REPEAT_INTERLEAVE:  # repeats given as a tensor: its sum sizes the output
        if func._overloadname not in ("Tensor", "self_Tensor") or kwargs.get("output_size"):
            return False
        repeats = args[0] if func._overloadname == "Tensor" else args[1]
        return on_device(repeats)
    return False
