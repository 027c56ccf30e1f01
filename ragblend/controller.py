"""Loading controller (paper §5.1): pick the recompute ratio that loading can hide.

    T_recompute(r) = r · T_prefill(L)          T_load = bytes_per_token · L / bandwidth(tier)

The ratio is ``max(r*, r_load)`` with ``r_load = T_load / T_prefill(L)`` (the ratio whose
recompute takes as long as loading, so recompute hides behind the pipelined load) and
``r* = 0.15`` (the smallest ratio with negligible quality loss). The engine runs a full prefill
instead (``fallback_full``) when loading alone would take longer than a full prefill, or when
blend at the chosen ratio would not be faster than one on this device:

    T_blend(r, L) = max(B(L) + max(0, r - r_b) · T_prefill(L), T_load)

with ``B(L)`` the measured time of a blend at ratio ``r_b`` on the device (RAM tier, its
loading included; a linear fit over two prompt lengths, like ``T_prefill``). Blend's cost
beyond recomputing ``r`` of the rows (loading, selection, layer bookkeeping, fixed per-call
costs) differs by device: on a CPU blend at 0.15 takes a tenth of a full prefill, on a GPU
whose launches dominated it took nine tenths.

T_prefill, ``B`` and the tiers' read bandwidths come from a quick profile of the model on its
device, cached as JSON under ``ragblend_home()/profiles`` per model fingerprint and device.
Where blend is measured, T_prefill is fitted at the same prompt lengths (hundreds to about two
thousand tokens, where RAG prompts are) rather than at the short ones of the base profile.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ragblend.private import private_dir, private_temp_file
from ragblend.store.quant import kv_bytes_per_token

if TYPE_CHECKING:
    from ragblend.models.adapters import LayerwiseModel

PrefillFn = Callable[[Sequence[int]], object]

log = logging.getLogger(__name__)

PROFILE_VERSION = 2
R_STAR = 0.15
# Cheapest first: the controller prefers the cheapest tier whose loading stays hidden.
TIER_COST_ORDER = ("disk", "ram")


@dataclass
class Profile:
    """Measured costs of one model on one device."""

    fingerprint: str
    device: str
    prefill_ms_fixed: float
    prefill_ms_per_token: float
    bytes_per_token: int
    bandwidth: dict[str, float]  # bytes/s per tier ("ram", "disk")
    disk_path: str | None = None
    version: int = PROFILE_VERSION
    measured: dict = field(default_factory=dict)
    # blend at blend_ratio: ms = blend_ms_fixed + blend_ms_per_token · n (None: not measured)
    blend_ms_fixed: float | None = None
    blend_ms_per_token: float = 0.0
    blend_ratio: float = R_STAR

    def prefill_ms(self, n_tokens: int) -> float:
        """Estimated full-prefill time of ``n_tokens`` (linear fit of the measurements)."""
        return max(1e-6, self.prefill_ms_fixed + self.prefill_ms_per_token * n_tokens)

    def load_ms(self, n_tokens: int, tier: str) -> float:
        """Estimated time to load ``n_tokens`` tokens' KV (all layers) from ``tier``."""
        bandwidth = self.bandwidth.get(tier)
        if not bandwidth:
            return 0.0 if tier == "ram" else float("inf")
        return self.bytes_per_token * n_tokens / bandwidth * 1000.0

    def blend_ms(self, n_tokens: int, ratio: float, tier: str) -> float | None:
        """Estimated blend prefill time at ``ratio`` from ``tier`` (module docstring), or
        None when blend was not measured on this device."""
        if self.blend_ms_fixed is None:
            return None
        measured = self.blend_ms_fixed + self.blend_ms_per_token * n_tokens
        compute = measured + max(0.0, ratio - self.blend_ratio) * self.prefill_ms(n_tokens)
        return max(compute, self.load_ms(n_tokens, tier))

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Profile:
        data = json.loads(text)
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


@dataclass(frozen=True)
class Decision:
    """The controller's choice for one prompt (``asdict`` goes into ``stats.extra``).

    ``fallback_full``: loading alone would take longer than a full prefill (``reason``
    ``"loading"``), or blend would not be faster than one here (``"blend"``), so the engine
    runs a full prefill instead.
    """

    ratio: float
    r_star: float
    r_load: float
    tier: str
    n_tokens: int
    t_prefill_ms: float
    t_load_ms: float
    t_recompute_ms: float
    bytes_per_token: int
    bandwidth_bytes_per_s: float | None
    fallback_full: bool
    t_blend_ms: float | None = None
    reason: str = ""


class LoadingController:
    """Chooses the recompute ratio (and says when to fall back to full prefill)."""

    def __init__(self, profile: Profile, tier: str = "ram", r_star: float = R_STAR) -> None:
        self.profile = profile
        self.tier = tier
        self.r_star = float(r_star)

    def decide(self, n_tokens: int, tier: str | None = None) -> Decision:
        """The decision for a prompt of ``n_tokens`` tokens loaded from ``tier``."""
        tier = tier or self.tier
        t_prefill = self.profile.prefill_ms(n_tokens)
        t_load = self.profile.load_ms(n_tokens, tier)
        r_load = t_load / t_prefill
        ratio = min(1.0, max(self.r_star, r_load))
        t_blend = self.profile.blend_ms(n_tokens, ratio, tier)
        reason = ""
        if t_load >= t_prefill:
            reason = "loading"
        elif t_blend is not None and t_blend >= t_prefill:
            reason = "blend"
        fallback = bool(reason)
        if fallback:
            ratio = 1.0
        return Decision(
            ratio=ratio,
            r_star=self.r_star,
            r_load=r_load,
            tier=tier,
            n_tokens=int(n_tokens),
            t_prefill_ms=t_prefill,
            t_load_ms=t_load,
            t_recompute_ms=ratio * t_prefill,
            bytes_per_token=self.profile.bytes_per_token,
            bandwidth_bytes_per_s=self.profile.bandwidth.get(tier),
            fallback_full=fallback,
            t_blend_ms=t_blend,
            reason=reason,
        )

    def cheapest_tier(self, n_tokens: int, ratio: float | None = None) -> str:
        """The cheapest tier whose loading hides behind recomputing ``ratio`` (default r*)."""
        budget = (self.r_star if ratio is None else ratio) * self.profile.prefill_ms(n_tokens)
        for tier in TIER_COST_ORDER:
            if tier in self.profile.bandwidth and self.profile.load_ms(n_tokens, tier) <= budget:
                return tier
        return "ram"

    @classmethod
    def for_engine(cls, engine, refresh: bool = False, r_star: float = R_STAR) -> LoadingController:
        """A controller for ``engine``'s model, device and store (profiling once if needed)."""
        tier, disk_path = store_tier(engine.store)
        profile = load_or_profile(
            engine.full_prefill,
            engine.layers,
            engine.fingerprint,
            int(engine.model.config.vocab_size),
            disk_path,
            refresh=refresh,
            blend=lambda: measure_blend(engine),
        )
        # loading reads the entries as the codec stores them (the profile keeps the float
        # bytes it was measured with; chunks of 512 tokens set the scales' share)
        lay = engine.layers
        stored = kv_bytes_per_token(
            engine.kv_dtype, lay.num_layers, lay.num_kv_heads, lay.head_dim, 512
        )
        profile = replace(profile, bytes_per_token=int(round(stored)))
        return cls(profile, tier=tier, r_star=r_star)


# ---------------------------------------------------------------------- profiling
def store_tier(store) -> tuple[str, Path | None]:
    """(tier the controller plans for, disk directory) of a store.

    A tiered store is planned as disk (a conservative choice: its misses in RAM read disk).
    """
    kind = store.tier
    if kind == "disk":
        return "disk", Path(store.path)
    if kind == "tiered":
        return "disk", Path(store.disk.path)
    return "ram", None


def profile_path(fingerprint: str, device: str) -> Path:
    from ragblend.paths import profiles_dir

    safe_device = device.replace(":", "")
    return profiles_dir() / f"{fingerprint[:16]}-{safe_device}.json"


def load_or_profile(
    prefill: PrefillFn,
    layers: LayerwiseModel,
    fingerprint: str,
    vocab_size: int,
    disk_path: Path | None = None,
    refresh: bool = False,
    blend: Callable[[], BlendFit] | None = None,
) -> Profile:
    """The cached profile of a model on its device, measured (and saved) if missing;
    ``blend()`` measures blend against full (:func:`measure_blend`) where given."""
    device = str(layers.device)
    path = profile_path(fingerprint, device)
    profile = None
    if path.is_file() and not refresh:
        try:
            profile = Profile.from_json(path.read_text())
        except (ValueError, TypeError) as exc:
            log.warning("ignoring unreadable profile %s (%s)", path, exc)
        if profile is not None and (
            profile.version != PROFILE_VERSION or profile.fingerprint != fingerprint
        ):
            profile = None
    changed = False
    if profile is None:
        fit = blend() if blend is not None else None
        profile = profile_engine(prefill, layers, fingerprint, vocab_size, fit=fit)
        changed = True
    if disk_path is not None and (
        "disk" not in profile.bandwidth or profile.disk_path != str(disk_path)
    ):
        profile.bandwidth["disk"] = measure_disk_bandwidth(disk_path, layers.device)
        profile.disk_path = str(disk_path)
        changed = True
    if blend is not None and profile.blend_ms_fixed is None:  # a profile made without it
        with_blend(profile, blend())
        changed = True
    if changed:
        _write_json(path, profile.to_json())
    return profile


@dataclass(frozen=True)
class BlendFit:
    """Full and blend prefill times on a device as (fixed ms, ms per token) linear fits."""

    full: tuple[float, float]
    blend: tuple[float, float]
    ratio: float
    measured: dict


def measure_blend(
    engine,
    layouts: Sequence[tuple[int, int]] = ((2, 256), (6, 256)),
    ratio: float = R_STAR,
    repeats: int = 2,
) -> BlendFit:
    """Full and blend (at ``ratio``) prefill times of random prompts of ``layouts`` (chunks ×
    tokens, plus a 16-token head and question) on ``engine``'s device, best of ``repeats``
    each, fitted linearly in the prompt length. The chunks are precomputed into a throwaway
    RAM store: the user's store is not touched.

    Runs the engine's prefill without taking its lock: the engine makes its controller inside
    a prefill, holding it; elsewhere call this where nothing else uses the engine."""
    from ragblend.prompt import TokenizedPrompt
    from ragblend.store.memory import MemoryStore

    view = engine.with_config(
        store=MemoryStore(1 << 40), precompute_context="prefix", ratio=ratio, mode="blend"
    )
    vocab = int(engine.model.config.vocab_size)
    generator = torch.Generator().manual_seed(1)
    top = max(101, vocab - 100)

    def ids(n: int) -> list[int]:
        return torch.randint(100, top, (n,), generator=generator).tolist()

    head, separator, question = ids(16), ids(1), ids(16)
    chunks = [ids(tokens) for count, tokens in layouts for _ in range(count)]
    for chunk in chunks:
        view.precompute_ids(chunk, head)
    prompts, start = [], 0
    for count, _ in layouts:
        prompts.append(TokenizedPrompt(head, chunks[start : start + count], separator, question))
        start += count
    best = {(mode, i): float("inf") for i in range(len(prompts)) for mode in ("full", "blend")}
    for _ in range(repeats + 1):  # the first round warms up
        for mode, i in best:
            _sync(view.layers.device)
            t0 = time.perf_counter()
            view._prefill(prompts[i], mode, ratio)
            _sync(view.layers.device)
            best[mode, i] = min(best[mode, i], (time.perf_counter() - t0) * 1000)
    lengths = [len(p) for p in prompts]
    return BlendFit(
        full=_fit(lengths, [best["full", i] for i in range(len(prompts))]),
        blend=_fit(lengths, [best["blend", i] for i in range(len(prompts))]),
        ratio=ratio,
        measured={
            "prompt_tokens": lengths,
            "full_ms": [best["full", i] for i in range(len(prompts))],
            "blend_ms": [best["blend", i] for i in range(len(prompts))],
        },
    )


def with_blend(profile: Profile, fit: BlendFit) -> None:
    """Set ``profile``'s blend and full-prefill fits from ``fit`` (the full fit too: it was
    measured at the lengths RAG prompts have, beside blend)."""
    profile.prefill_ms_fixed, profile.prefill_ms_per_token = fit.full
    profile.blend_ms_fixed, profile.blend_ms_per_token = fit.blend
    profile.blend_ratio = fit.ratio
    profile.measured["blend"] = fit.measured


def _fit(lengths: Sequence[int], times: Sequence[float]) -> tuple[float, float]:
    """(fixed ms, ms per token) through the first and last (length, time) points."""
    (n1, n2), (t1, t2) = (lengths[0], lengths[-1]), (times[0], times[-1])
    per_token = max(1e-6, (t2 - t1) / max(1, n2 - n1))
    return max(0.0, t1 - per_token * n1), per_token


def profile_engine(
    prefill: PrefillFn,
    layers: LayerwiseModel,
    fingerprint: str,
    vocab_size: int,
    lengths: tuple[int, int] = (64, 256),
    repeats: int = 2,
    fit: BlendFit | None = None,
) -> Profile:
    """Measure ``prefill`` time (two prompt lengths, linear fit) and RAM → device bandwidth.

    ``prefill(ids)`` runs a full prefill of ``ids`` (the engine's ``full_prefill``). Given
    ``fit`` (:func:`measure_blend`), its full and blend fits are taken instead of timing
    ``prefill`` again.
    """
    device = layers.device
    measured: dict = {"when": time.time(), "torch_threads": torch.get_num_threads()}
    if fit is None:
        generator = torch.Generator().manual_seed(0)
        top = max(101, vocab_size - 100)
        ids = torch.randint(100, top, (max(lengths),), generator=generator).tolist()
        prefill(ids[:16])  # warm up kernels and allocator
        times = []
        for n in lengths:
            best = float("inf")
            for _ in range(repeats):
                _sync(device)
                t0 = time.perf_counter()
                prefill(ids[:n])
                _sync(device)
                best = min(best, (time.perf_counter() - t0) * 1000)
            times.append(best)
        fixed, per_token = _fit(lengths, times)
        measured["prefill_ms"] = dict(zip(map(str, lengths), times, strict=True))
    else:
        fixed, per_token = fit.full
    profile = Profile(
        fingerprint=fingerprint,
        device=str(device),
        prefill_ms_fixed=fixed,
        prefill_ms_per_token=per_token,
        bytes_per_token=layers.kv_bytes_per_token(),
        bandwidth={"ram": measure_ram_bandwidth(device)},
        measured=measured,
    )
    if fit is not None:
        with_blend(profile, fit)
    return profile


def measure_ram_bandwidth(device: torch.device | str, nbytes: int = 64 << 20) -> float:
    """Bytes/s of copying cached KV from RAM to where the fusor computes."""
    device = torch.device(device)
    n = nbytes // 4
    if device.type == "cuda" and torch.cuda.is_available():
        src = torch.empty(n, dtype=torch.float32, pin_memory=True)
        dst = torch.empty(n, dtype=torch.float32, device=device)
    else:
        src = torch.ones(n, dtype=torch.float32)
        dst = torch.empty(n, dtype=torch.float32)
    dst.copy_(src)
    best = float("inf")
    for _ in range(3):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return nbytes / max(best, 1e-9)


def measure_disk_bandwidth(
    directory: str | os.PathLike, device: torch.device | str = "cpu", nbytes: int = 64 << 20
) -> float:
    """Bytes/s of cold reads (page cache dropped where the OS allows) from ``directory``.

    On CUDA the result is capped by the host → device bandwidth (the pipeline's next stage).
    """
    directory = private_dir(directory)
    buf = torch.ones(nbytes, dtype=torch.uint8)
    fd, name = private_temp_file(directory, ".bandwidth-", ".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(buf.numpy().data)
            f.flush()
            os.fsync(f.fileno())
        view = buf.numpy().data
        rfd = os.open(name, os.O_RDONLY)
        try:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(rfd, 0, 0, os.POSIX_FADV_DONTNEED)
            t0 = time.perf_counter()
            done = 0
            while done < nbytes:
                got = os.preadv(rfd, [view[done:]], done)
                if got <= 0:
                    break
                done += got
            seconds = time.perf_counter() - t0
        finally:
            os.close(rfd)
    finally:
        try:
            os.unlink(name)
        except OSError:
            pass
    bandwidth = nbytes / max(seconds, 1e-9)
    if torch.device(device).type == "cuda":
        bandwidth = min(bandwidth, measure_ram_bandwidth(device))
    return bandwidth


def _sync(device: torch.device) -> None:
    if device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize(device)


def _write_json(path: Path, text: str) -> None:
    private_dir(path.parent)
    fd, tmp = private_temp_file(path.parent, ".profile-", ".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
