"""Counting the kernels and host syncs of the code run inside ``with OpCounter(...)``, per
decoder layer, on a CPU (what counts as either: :mod:`ragblend.bench.op_kinds`), through
PyTorch's own interception points:

* a :class:`~torch.utils._python_dispatch.TorchDispatchMode` sees every aten op that reaches a
  backend (after autograd and composite decompositions, as a CUDA build would run them);
* a :class:`~torch.overrides.TorchFunctionMode` sees the tensor methods that read device data
  on the host without dispatching an aten op on CPU (``tolist``, ``cpu``, ``numpy``, ...).

Host or device: on a CPU every tensor is a host tensor, so a counter given a
:class:`DeviceTracker` (as :func:`ragblend.bench.gpu_ops.count_prefill` does) tells apart the
tensors that would live on the GPU — the model's parameters and buffers, what a factory makes
with an explicit ``device=``, and every output of an op with such an input — from host tensors
(token-id lists hashed into store keys, the RAM tier's entries): ops on host tensors only are
neither kernels nor syncs (``host_ops``), a read of a host tensor is no sync, a ``copy_`` from a
device tensor into a host one is (device→host). Without a tracker every tensor counts as a
device tensor. Code that skips a host→device copy on CPU (``if device.type == "cpu": return
host``) hides the upload from both modes: :data:`~ragblend.bench.op_kinds.UPLOADS` names such
functions, which a counter with a tracker wraps while it counts (their result is a device
tensor, made by one copy kernel).

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
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakTensorKeyDictionary

from ragblend.bench.op_kinds import (
    COMPOSITE_KEY,
    FUSED_NORM,
    HOST_READS,
    HOST_TO_DEVICE,
    KEEP_WHOLE,
    NON_KERNEL_OPS,
    SYNC_ONLY_OPS,
    UPLOADS,
    dispatch_is_sync,
    op_name,
)

Bucket = str | int  # "setup", a layer index, or "tail"

_HERE = os.path.abspath(__file__)
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


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
        if packet is FUSED_NORM and len(args) > 1:  # a fused path's input_layernorm
            bucket = counter.norm_buckets.get(id(args[1]))
            if bucket is not None:
                counter.enter(bucket)
        if packet not in KEEP_WHOLE and torch._C._dispatch_has_kernel_for_dispatch_key(
            func.name(), COMPOSITE_KEY
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
            elif tracker is not None and packet is torch.ops.aten.copy_ and len(args) > 1:
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
