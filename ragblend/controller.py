"""Loading controller (paper §5.1): pick the recompute ratio that loading can hide.

    T_recompute(r) = r · T_prefill(L)          T_load = bytes_per_token · L / bandwidth(tier)

The ratio is ``max(r*, r_load)`` with ``r_load = T_load / T_prefill(L)`` (the ratio whose
recompute takes as long as loading, so recompute hides behind the pipelined load) and
``r* = 0.15`` (the smallest ratio with negligible quality loss). When loading alone would take
longer than a full prefill, the engine runs a full prefill instead (``fallback_full``).

T_prefill and the tiers' read bandwidths come from a quick profile of the model on its device,
cached as JSON under ``ragblend_home()/profiles`` per model fingerprint and device.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ragblend.private import private_dir, private_temp_file

if TYPE_CHECKING:
    from ragblend.models.adapters import LayerwiseModel

PrefillFn = Callable[[Sequence[int]], object]

log = logging.getLogger(__name__)

PROFILE_VERSION = 1
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

    def prefill_ms(self, n_tokens: int) -> float:
        """Estimated full-prefill time of ``n_tokens`` (linear fit of the measurements)."""
        return max(1e-6, self.prefill_ms_fixed + self.prefill_ms_per_token * n_tokens)

    def load_ms(self, n_tokens: int, tier: str) -> float:
        """Estimated time to load ``n_tokens`` tokens' KV (all layers) from ``tier``."""
        bandwidth = self.bandwidth.get(tier)
        if not bandwidth:
            return 0.0 if tier == "ram" else float("inf")
        return self.bytes_per_token * n_tokens / bandwidth * 1000.0

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Profile:
        data = json.loads(text)
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


@dataclass(frozen=True)
class Decision:
    """The controller's choice for one prompt (``asdict`` goes into ``stats.extra``).

    ``fallback_full``: loading alone would take longer than a full prefill, so the engine
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
        fallback = t_load >= t_prefill
        ratio = 1.0 if fallback else min(1.0, max(self.r_star, r_load))
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
        )
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
) -> Profile:
    """The cached profile of a model on its device, measured (and saved) if missing."""
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
        profile = profile_engine(prefill, layers, fingerprint, vocab_size)
        changed = True
    if disk_path is not None and (
        "disk" not in profile.bandwidth or profile.disk_path != str(disk_path)
    ):
        profile.bandwidth["disk"] = measure_disk_bandwidth(disk_path, layers.device)
        profile.disk_path = str(disk_path)
        changed = True
    if changed:
        _write_json(path, profile.to_json())
    return profile


def profile_engine(
    prefill: PrefillFn,
    layers: LayerwiseModel,
    fingerprint: str,
    vocab_size: int,
    lengths: tuple[int, int] = (64, 256),
    repeats: int = 2,
) -> Profile:
    """Measure ``prefill`` time (two prompt lengths, linear fit) and RAM → device bandwidth.

    ``prefill(ids)`` runs a full prefill of ``ids`` (the engine's ``full_prefill``).
    """
    device = layers.device
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
    (n1, n2), (t1, t2) = lengths, times
    per_token = max(1e-6, (t2 - t1) / (n2 - n1))
    fixed = max(0.0, t1 - per_token * n1)
    return Profile(
        fingerprint=fingerprint,
        device=str(device),
        prefill_ms_fixed=fixed,
        prefill_ms_per_token=per_token,
        bytes_per_token=layers.kv_bytes_per_token(),
        bandwidth={"ram": measure_ram_bandwidth(device)},
        measured={
            "prefill_ms": dict(zip(map(str, lengths), times, strict=True)),
            "when": time.time(),
            "torch_threads": torch.get_num_threads(),
        },
    )


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
