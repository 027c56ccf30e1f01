"""Kernel launches and host syncs of one prefill, counted on a CPU for the path a GPU runs.

On a GPU a prefill's time at small shapes is set by how many kernels it launches and how often
the host waits for the device (a sync drains the launch queue: every kernel after it starts
late). Both are properties of the code path, not of the device, so they are counted here on a
CPU, through PyTorch's own interception points:

* a :class:`~torch.utils._python_dispatch.TorchDispatchMode` sees every aten op that reaches a
  backend (after autograd and composite decompositions, as a CUDA build would run them);
* a :class:`~torch.overrides.TorchFunctionMode` sees the tensor methods that read device data
  on the host without dispatching an aten op on CPU (``tolist``, ``cpu``, ``numpy``, ...).

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

Host or device: on a CPU every tensor is a host tensor, so a counter given a
:class:`DeviceTracker` (as :func:`count_prefill` does) tells apart the tensors that would live
on the GPU — the model's parameters and buffers, what a factory makes with an explicit
``device=``, and every output of an op with such an input — from host tensors (token-id lists
hashed into store keys, the RAM tier's entries): ops on host tensors only are neither kernels
nor syncs (``host_ops``), a read of a host tensor is no sync, a ``copy_`` from a device tensor
into a host one is (device→host). Without a tracker every tensor counts as a device tensor.
Code that skips a host→device copy on CPU (``if device.type == "cpu": return host``) hides
the upload from both modes: :data:`UPLOADS` names such functions, which a counter with a
tracker wraps while it counts (their result is a device tensor, made by one copy kernel).

Layers: forward pre-hooks on each decoder layer's ``input_layernorm`` (the first module both
HF's forward and the fusor call in a layer; on the fused path, the fused RMSNorm op given that
module's weight) open that layer's bucket, and one on the final
norm opens ``"tail"``. Ops before layer 0's norm are ``"setup"``; ops from a layer's norm to
the next layer's norm are that layer's — the fusor's loader yields layer ``i + 1``'s cached
K/V (and the RoPE rows of a changed row set are gathered) before layer ``i + 1``'s norm, so
they count in layer ``i``; ``"tail"`` is the final norm, the LM head and what follows.
"""

from __future__ import annotations

import importlib
import os
import statistics
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakTensorKeyDictionary

import ragblend.kernels.cuda.layer_ops  # noqa: F401  (registers the fused ops counted here)

Bucket = str | int  # "setup", a layer index, or "tail"

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

_COMPOSITE = torch._C.DispatchKey.CompositeImplicitAutograd
_FUSED_NORM: Any = (
    torch.ops.ragblend_layer.rms_norm
)  # registered by ragblend.kernels.cuda.layer_ops

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

_HERE = os.path.abspath(__file__)
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


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


class DeviceTracker:
    """Which tensors would live on the GPU (see the module docstring): the given ones (a
    model's parameters and buffers), what a factory makes with an explicit ``device=``, and
    the outputs of ops with a device tensor among their inputs. Weakly held; share one
    tracker between a warm-up and the counted run so tensors cached by the warm-up keep
    their place."""

    def __init__(self, tensors: Iterable[torch.Tensor] = ()) -> None:
        self._device: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        self.factory_depth = 0  # inside a call with an explicit device=
        self.mark(list(tensors))

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> DeviceTracker:
        return cls([*model.parameters(), *model.buffers()])

    def mark(self, tree: object) -> None:
        """Mark every tensor in ``tree`` (a tensor or nested lists/tuples/dicts of them)."""
        for t in tree_leaves(tree):
            if isinstance(t, torch.Tensor):
                self._device[t] = True

    def on_device(self, t: object) -> bool:
        return isinstance(t, torch.Tensor) and t in self._device

    def any_on_device(self, tree: object) -> bool:
        return any(self.on_device(t) for t in tree_leaves(tree) if isinstance(t, torch.Tensor))


def call_site() -> str:
    """``path:function:line`` of the innermost caller outside torch and this module (and of the
    innermost ragblend frame, when that is another one)."""
    outside, ours = None, None
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        path = os.path.abspath(code.co_filename)
        if path != _HERE and not path.startswith(_TORCH_DIR):
            short = _short(path)
            where = f"{short}:{getattr(code, 'co_qualname', code.co_name)}:{frame.f_lineno}"
            if outside is None:
                outside = where
            if short.startswith(("ragblend/", "benchmarks/")):
                ours = where
                break
        frame = frame.f_back  # type: ignore[assignment]
    if outside is None:
        return "?"
    return outside if ours in (None, outside) else f"{outside} <- {ours}"


def _short(path: str) -> str:
    parts = path.replace(os.sep, "/").split("/")
    for anchor in ("site-packages", "dist-packages"):
        if anchor in parts:
            return "/".join(parts[parts.index(anchor) + 1 :])
    for anchor in ("ragblend", "benchmarks", "tests"):
        if anchor in parts:
            return "/".join(parts[len(parts) - 1 - parts[::-1].index(anchor) :])
    return path


@dataclass
class BucketOps:
    """Kernels, syncs and host→device copies of one bucket, by op name (``*_sites``: by op
    name and call site, filled in debug mode); ``host_ops``: ops on host tensors only."""

    kernels: Counter[str] = field(default_factory=Counter)
    syncs: Counter[str] = field(default_factory=Counter)
    host_to_device: Counter[str] = field(default_factory=Counter)
    sync_sites: Counter[str] = field(default_factory=Counter)
    host_ops: Counter[str] = field(default_factory=Counter)
    host_to_device_sites: Counter[str] = field(default_factory=Counter)

    @property
    def num_kernels(self) -> int:
        return sum(self.kernels.values())

    @property
    def num_syncs(self) -> int:
        return sum(self.syncs.values())


class _FunctionLevel(TorchFunctionMode):
    def __init__(self, counter: OpCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        counter = self.counter
        if func in HOST_READS:
            if args and counter.on_device(args[0]):
                counter._record_sync(op_name(func))
            counter._host_read_depth += 1
            try:
                return func(*args, **kwargs)
            finally:
                counter._host_read_depth -= 1
        if kwargs.get("device") is None:
            return func(*args, **kwargs)
        # an explicit device: what this call makes lives there
        tracker = counter.tracker
        if tracker is not None:
            tracker.factory_depth += 1
        try:
            out = func(*args, **kwargs)
        finally:
            if tracker is not None:
                tracker.factory_depth -= 1
        if tracker is not None:
            tracker.mark(out)
        if func in HOST_TO_DEVICE and isinstance(out, torch.Tensor) and out.numel():
            data = args[0] if args else kwargs.get("data")
            if not isinstance(data, torch.Tensor):  # host data copied over (none when empty)
                counter._record_upload(op_name(func))
        return out


class _DispatchLevel(TorchDispatchMode):
    def __init__(self, counter: OpCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        counter = self.counter
        packet = func.overloadpacket
        if packet is _FUSED_NORM and len(args) > 1:  # a fused path's input_layernorm
            bucket = counter.norm_buckets.get(id(args[1]))
            if bucket is not None:
                counter.enter(bucket)
        if packet not in KEEP_WHOLE and torch._C._dispatch_has_kernel_for_dispatch_key(
            func.name(), _COMPOSITE
        ):  # decompose as a GPU build runs it, with this mode seeing the parts
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        tracker = counter.tracker
        on_device = (
            tracker is None or bool(tracker.factory_depth) or tracker.any_on_device((args, kwargs))
        )
        if not counter._host_read_depth:  # inside a host read: counted as that read only
            name = op_name(func)
            if packet not in NON_KERNEL_OPS and packet not in SYNC_ONLY_OPS:
                if on_device:
                    counter.current.kernels[name] += 1
                else:
                    counter.current.host_ops[name] += 1
            if on_device and dispatch_is_sync(func, args, kwargs, counter.on_device):
                counter._record_sync(name)
            elif tracker is not None and packet is _aten.copy_ and len(args) > 1:
                dst, src = args[0], args[1]
                if tracker.on_device(src) and not tracker.on_device(dst):
                    counter._record_sync(f"{name} (device to host)")
                elif tracker.on_device(dst) and not tracker.on_device(src):
                    counter._record_upload(name)
        out = func(*args, **kwargs)
        if tracker is not None and on_device and not func._schema.is_mutable:
            tracker.mark(out)  # an in-place op's tensor stays where it is
        return out


class OpCounter:
    """Counts kernels and syncs of the code run inside ``with OpCounter(...)``, per bucket.

    ``layers``: the decoder layers (each with an ``input_layernorm``); ``final_norm``: the
    model's final norm. Without them every op lands in ``"setup"``. ``tracker``: which tensors
    are device tensors (None: all of them). ``debug``: also record each sync's call site
    (``sync_sites``; slow: a stack walk per sync).

    The modes are thread-local: work on other threads (a prefetching loader) is not seen.

    >>> with OpCounter() as c:
    ...     _ = torch.arange(4).nonzero()
    >>> c.total_syncs
    1
    """

    def __init__(
        self,
        layers: Sequence[torch.nn.Module] = (),
        final_norm: torch.nn.Module | None = None,
        tracker: DeviceTracker | None = None,
        debug: bool = False,
    ) -> None:
        self.layers = list(layers)
        self.final_norm = final_norm
        self.tracker = tracker
        self.debug = debug
        self.buckets: dict[Bucket, BucketOps] = {"setup": BucketOps()}
        self.current = self.buckets["setup"]
        self._host_read_depth = 0
        self._hooks: list[Any] = []
        # the layers' input_layernorm weights: a fused RMSNorm op given one opens its bucket
        self.norm_buckets: dict[int, Bucket] = {
            id(weight): i
            for i, layer in enumerate(self.layers)
            if (weight := getattr(layer.input_layernorm, "weight", None)) is not None
        }
        self._modes: list[Any] = []
        self._patched: list[tuple[Any, str, Any]] = []

    # ------------------------------------------------------------------ buckets
    def enter(self, bucket: Bucket) -> None:
        """Count what follows in ``bucket`` (made on first use)."""
        self.current = self.buckets.setdefault(bucket, BucketOps())

    def _opener(self, bucket: Bucket) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any) -> None:
            self.enter(bucket)

        return hook

    def _upload(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """``original`` (an upload of :data:`UPLOADS`) marking its result as a device tensor
        and counting the copy it makes on a GPU where it made none."""
        name = f"upload ({getattr(original, '__qualname__', original)})"

        def upload(host: Any, *args: Any, **kwargs: Any) -> Any:
            out = original(host, *args, **kwargs)
            if self.tracker is not None and not self.tracker.any_on_device(out):
                self.tracker.mark(out)
                if not self._host_read_depth:
                    self.current.kernels["aten._to_copy"] += 1
                    self._record_upload(name)
            return out

        return upload

    def on_device(self, t: object) -> bool:
        """Whether ``t`` counts as a device tensor."""
        return self.tracker is None or self.tracker.on_device(t)

    def _record_upload(self, name: str) -> None:
        self.current.host_to_device[name] += 1
        if self.debug:
            self.current.host_to_device_sites[f"{name} @ {call_site()}"] += 1

    def _record_sync(self, name: str) -> None:
        self.current.syncs[name] += 1
        if self.debug:
            self.current.sync_sites[f"{name} @ {call_site()}"] += 1

    # ------------------------------------------------------------------ context
    def __enter__(self) -> OpCounter:
        for i, layer in enumerate(self.layers):
            norm: Any = layer.input_layernorm
            self._hooks.append(norm.register_forward_pre_hook(self._opener(i)))
        if self.final_norm is not None:
            self._hooks.append(self.final_norm.register_forward_pre_hook(self._opener("tail")))
        if self.tracker is not None:
            for module_name, name in UPLOADS:
                module = importlib.import_module(module_name)
                original = getattr(module, name, None)
                if original is not None:
                    setattr(module, name, self._upload(original))
                    self._patched.append((module, name, original))
        self._modes = [_FunctionLevel(self), _DispatchLevel(self)]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        self._modes = []
        for module, name, original in reversed(self._patched):
            setattr(module, name, original)
        self._patched = []
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    # ------------------------------------------------------------------ totals
    @property
    def total_kernels(self) -> int:
        return sum(b.num_kernels for b in self.buckets.values())

    @property
    def total_syncs(self) -> int:
        return sum(b.num_syncs for b in self.buckets.values())

    def layer(self, i: int) -> BucketOps:
        """Layer ``i``'s bucket (empty if nothing ran in it)."""
        return self.buckets.get(i, BucketOps())

    def merged(self, attr: str, buckets: Iterable[Bucket] | None = None) -> Counter[str]:
        """One of ``kernels``/``syncs``/``host_to_device``/``sync_sites``/``host_ops`` summed over
        ``buckets`` (default all)."""
        out: Counter[str] = Counter()
        for key in self.buckets if buckets is None else buckets:
            if key in self.buckets:
                out.update(getattr(self.buckets[key], attr))
        return out


@dataclass
class PrefillOps:
    """One prefill's counts (see the module docstring for what is counted).

    ``kernels_per_layer``: median over ordinary layers (neither layer 0, the last layer nor a
    check layer); ``kernels_per_check_layer``: max over the check layers that ran (0 without
    any); ``syncs_per_layer``: max over the layers; ``syncs_per_prefill``: setup + layers + tail.
    """

    mode: str
    num_layers: int
    check_layers: list[int]
    ordinary_layers: list[int]
    kernels_per_layer: float
    kernels_per_check_layer: int
    syncs_per_layer: int
    syncs_per_prefill: int
    kernels_per_prefill: int
    host_to_device_per_prefill: int
    kernels_by_layer: list[int]
    syncs_by_layer: list[int]
    kernels_setup: int
    kernels_tail: int
    syncs_setup: int
    syncs_tail: int
    sync_ops: dict[str, int]
    sync_ops_by_bucket: dict[str, dict[str, int]]
    kernel_ops_ordinary_layer: dict[str, int]
    host_to_device_ops: dict[str, int]
    host_ops_per_prefill: int
    sync_sites: dict[str, int] = field(default_factory=dict)
    sync_sites_by_bucket: dict[str, dict[str, int]] = field(default_factory=dict)
    host_to_device_sites: dict[str, int] = field(default_factory=dict)

    def contract(self) -> dict[str, float | int]:
        """The four numbers other checks read."""
        return {
            "kernels_per_layer": self.kernels_per_layer,
            "kernels_per_check_layer": self.kernels_per_check_layer,
            "syncs_per_layer": self.syncs_per_layer,
            "syncs_per_prefill": self.syncs_per_prefill,
        }

    def as_dict(self) -> dict[str, Any]:
        return {**self.contract(), **asdict(self)}


def summarize(
    counter: OpCounter, mode: str, num_layers: int, check_layers: Sequence[int]
) -> PrefillOps:
    """The :class:`PrefillOps` of a counter that saw one prefill of a ``num_layers`` model."""
    checks = sorted(c for c in check_layers if 0 <= c < num_layers)
    ordinary = [i for i in range(1, num_layers - 1) if i not in checks]
    kernels = [counter.layer(i).num_kernels for i in range(num_layers)]
    syncs = [counter.layer(i).num_syncs for i in range(num_layers)]
    median = statistics.median(kernels[i] for i in ordinary) if ordinary else 0
    if ordinary:  # report a typical layer's op mix: the first ordinary one at the median
        typical = min(ordinary, key=lambda i: (abs(kernels[i] - median), i))
        mix = dict(counter.layer(typical).kernels.most_common())
    else:
        mix = {}
    setup, tail = counter.buckets["setup"], counter.buckets.get("tail", BucketOps())
    return PrefillOps(
        mode=mode,
        num_layers=num_layers,
        check_layers=checks,
        ordinary_layers=ordinary,
        kernels_per_layer=int(median) if float(median).is_integer() else float(median),
        kernels_per_check_layer=max((kernels[i] for i in checks), default=0),
        syncs_per_layer=max(syncs, default=0),
        syncs_per_prefill=counter.total_syncs,
        kernels_per_prefill=counter.total_kernels,
        host_to_device_per_prefill=sum(counter.merged("host_to_device").values()),
        kernels_by_layer=kernels,
        syncs_by_layer=syncs,
        kernels_setup=setup.num_kernels,
        kernels_tail=tail.num_kernels,
        syncs_setup=setup.num_syncs,
        syncs_tail=tail.num_syncs,
        sync_ops=dict(counter.merged("syncs").most_common()),
        sync_ops_by_bucket={
            str(k): dict(b.syncs.most_common()) for k, b in counter.buckets.items() if b.syncs
        },
        kernel_ops_ordinary_layer=mix,
        host_to_device_ops=dict(counter.merged("host_to_device").most_common()),
        host_ops_per_prefill=sum(counter.merged("host_ops").values()),
        sync_sites=dict(counter.merged("sync_sites").most_common()),
        host_to_device_sites=dict(counter.merged("host_to_device_sites").most_common()),
        sync_sites_by_bucket={
            str(k): dict(b.sync_sites.most_common())
            for k, b in counter.buckets.items()
            if b.sync_sites
        },
    )


def count_prefill(
    engine: Any,
    prompt: Any,
    mode: str,
    ratio: float | None = None,
    warmup: int = 1,
    debug: bool = False,
    tracker: DeviceTracker | None = None,
) -> PrefillOps:
    """Kernels and syncs of one ``engine.prefill(prompt, mode, ratio)`` (a
    :class:`ragblend.engine.BlendEngine`), after ``warmup`` uncounted prefills (one-time
    builds: RoPE caches, compiled kernels, the store's prefix entry).

    ``tracker``: the device tensors (default: the engine model's parameters and buffers, and
    what derives from them); pass one tracker to every call on an engine so tensors cached
    by an earlier call keep their place. Check layers are the config's (blend only). Run on
    CPU with
    ``BlendConfig(row_attention="sdpa")`` and a store without prefetch (``prefetch_depth``
    0) for the path a GPU runs: no native CPU kernels, every layer's loading on this thread.
    """
    lay = engine.layers
    if tracker is None:
        tracker = DeviceTracker.for_model(engine.model)
    for _ in range(warmup):  # tracked too: what it caches for later prefills keeps its place
        with OpCounter(tracker=tracker):
            engine.prefill(prompt, mode=mode, ratio=ratio)
    with OpCounter(lay.layers, lay.decoder.norm, tracker=tracker, debug=debug) as counter:
        out = engine.prefill(prompt, mode=mode, ratio=ratio)
    if out.stats.mode != mode:
        raise RuntimeError(
            f"the {mode} prefill ran as {out.stats.mode} ({out.stats.fallback_reason}); "
            "precompute the prompt's chunks first"
        )
    checks = list(engine.config.check_layers) if mode == "blend" else []
    return summarize(counter, mode, lay.num_layers, checks)


__all__ = [
    "HOST_READS",
    "HOST_TO_DEVICE",
    "MASK_INDEX_OPS",
    "NON_KERNEL_OPS",
    "SYNC_ONLY_OPS",
    "SYNC_OPS",
    "UPLOADS",
    "KEEP_WHOLE",
    "BucketOps",
    "DeviceTracker",
    "OpCounter",
    "PrefillOps",
    "count_prefill",
    "dispatch_is_sync",
    "summarize",
]
