"""Kernel launches and host syncs of one prefill, counted on a CPU for the path a GPU runs.

On a GPU a prefill's time at small shapes is set by how many kernels it launches and how often
the host waits for the device (a sync drains the launch queue: every kernel after it starts
late). Both are properties of the code path, not of the device, so they are counted here on a
CPU: :class:`~ragblend.bench.op_counter.OpCounter` counts them per decoder layer (what counts:
:mod:`ragblend.bench.op_kinds`); this module runs one prefill under it and reduces the
counts to the numbers ``benchmarks/gpu_ops.py`` reports.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ragblend.bench.op_counter import BucketOps, DeviceTracker, OpCounter


@dataclass
class PrefillOps:
    """One prefill's counts (what is counted: :mod:`ragblend.bench.op_kinds`).

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
