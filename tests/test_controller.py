"""Loading controller: ratio = max(r*, r_load), full-prefill fallback, cached profiles."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import CHUNKS, QUESTION, tiny_model

from ragblend import BlendConfig, BlendEngine
from ragblend import controller as ctl
from ragblend.controller import LoadingController, Profile
from ragblend.store import DiskStore, MemoryStore, TieredStore


def profile(ms_per_token=1.0, disk=None, ram=1e12, bytes_per_token=1000) -> Profile:
    """Injected numbers: prefill 1 ms/token; loading takes bytes_per_token / bandwidth s/token."""
    bandwidth = {"ram": ram}
    if disk is not None:
        bandwidth["disk"] = disk
    return Profile("fp", "cpu", 0.0, ms_per_token, bytes_per_token, bandwidth)


def test_fast_loading_keeps_the_quality_floor_r_star():
    decision = LoadingController(profile(), tier="ram").decide(1000)
    assert decision.ratio == pytest.approx(0.15)
    assert decision.r_load < 0.15
    assert decision.fallback_full is False
    assert decision.t_recompute_ms == pytest.approx(0.15 * decision.t_prefill_ms)


def test_slow_loading_raises_the_ratio_to_what_loading_hides():
    # 1000 B/token at 2 MB/s = 0.5 ms/token of loading against 1 ms/token of prefill.
    decision = LoadingController(profile(disk=2e6), tier="disk").decide(1000)
    assert decision.r_load == pytest.approx(0.5)
    assert decision.ratio == pytest.approx(0.5)
    assert decision.t_load_ms == pytest.approx(500.0)
    assert decision.t_recompute_ms == pytest.approx(decision.t_load_ms)
    assert decision.fallback_full is False
    assert decision.tier == "disk"


def test_loading_slower_than_a_full_prefill_falls_back_to_full():
    decision = LoadingController(profile(disk=5e5), tier="disk").decide(1000)
    assert decision.t_load_ms > decision.t_prefill_ms
    assert decision.fallback_full is True
    assert decision.ratio == 1.0


def test_ratio_is_the_max_of_r_star_and_r_load_over_bandwidths():
    for bandwidth in (1e5, 1e6, 2e6, 5e6, 1e7, 1e8):
        d = LoadingController(profile(disk=bandwidth), tier="disk", r_star=0.2).decide(500)
        if not d.fallback_full:
            assert d.ratio == pytest.approx(max(0.2, d.r_load))


def test_cheapest_tier_is_disk_when_its_loading_hides_behind_recompute():
    fast_disk = LoadingController(profile(disk=1e8))
    slow_disk = LoadingController(profile(disk=2e6))
    assert fast_disk.cheapest_tier(1000) == "disk"
    assert slow_disk.cheapest_tier(1000) == "ram"
    assert slow_disk.cheapest_tier(1000, ratio=0.6) == "disk"


def test_controller_plans_a_tiered_store_as_disk(tmp_path):
    assert ctl.store_tier(MemoryStore()) == ("ram", None)
    disk = DiskStore(tmp_path, 1 << 20)
    assert ctl.store_tier(disk) == ("disk", tmp_path)
    assert ctl.store_tier(TieredStore(MemoryStore(), disk)) == ("disk", tmp_path)


@pytest.fixture
def engine(tokenizer):
    return BlendEngine(tiny_model("llama"), tokenizer, BlendConfig(ratio="auto"), MemoryStore())


def test_auto_ratio_uses_the_controller_and_records_its_decision(engine):
    engine.controller = LoadingController(profile(disk=2e6), tier="disk")
    engine.precompute(CHUNKS)
    result = engine.generate(QUESTION, CHUNKS, max_new_tokens=3)
    decision = result.stats.extra["controller"]
    assert decision["ratio"] == pytest.approx(0.5)
    assert result.stats.ratio == pytest.approx(0.5)
    explicit = engine.generate(QUESTION, CHUNKS, max_new_tokens=3, ratio=0.3)
    assert explicit.stats.ratio == pytest.approx(0.3)
    assert "controller" not in explicit.stats.extra


def test_fallback_runs_a_full_prefill(engine):
    engine.controller = LoadingController(profile(disk=5e5), tier="disk")
    engine.precompute(CHUNKS)
    prompt = engine.tokenize(QUESTION, CHUNKS)
    got = engine.prefill(prompt, mode="blend")
    assert got.stats.extra["controller"]["fallback_full"] is True
    assert got.stats.mode == "full"  # the mode that ran, not the one asked for
    assert got.stats.fallback_reason == "controller_full"
    assert "longer than a full prefill" in got.stats.fallback_message
    assert got.fusion is None  # no fused path was taken
    want = engine.prefill(prompt, mode="full")
    assert torch.equal(got.logits, want.logits)


def test_profile_is_measured_once_and_cached_per_model_and_device(engine, tmp_path, monkeypatch):
    monkeypatch.setattr(ctl, "profile_path", lambda fp, dev: tmp_path / f"{fp[:16]}-{dev}.json")
    monkeypatch.setattr(ctl, "measure_disk_bandwidth", lambda path, device: 3e9)
    engine.store = DiskStore(tmp_path / "kv", 1 << 30, fsync=False)
    engine.precompute(CHUNKS[:1])
    result = engine.generate(QUESTION, CHUNKS[:1], max_new_tokens=2)  # controller made lazily
    assert isinstance(engine.controller, LoadingController)
    decision = result.stats.extra["controller"]
    assert decision["tier"] == "disk" and decision["bandwidth_bytes_per_s"] == 3e9
    saved = json.loads((tmp_path / f"{engine.fingerprint[:16]}-cpu.json").read_text())
    assert saved["fingerprint"] == engine.fingerprint and saved["device"] == "cpu"
    assert saved["bytes_per_token"] == 2 * 3 * 2 * 16 * 4  # layers · kv heads · head_dim · fp32
    assert saved["prefill_ms_per_token"] > 0 and saved["bandwidth"]["disk"] == 3e9

    def no_profiling(*args, **kwargs):
        raise AssertionError("the cached profile should have been used")

    monkeypatch.setattr(ctl, "profile_engine", no_profiling)
    monkeypatch.setattr(ctl, "measure_disk_bandwidth", no_profiling)
    again = LoadingController.for_engine(engine)
    assert again.profile.prefill_ms_per_token == saved["prefill_ms_per_token"]


def test_disk_bandwidth_measurement_reads_a_real_file(tmp_path):
    bandwidth = ctl.measure_disk_bandwidth(tmp_path, "cpu", nbytes=4 << 20)
    assert bandwidth > 0
    assert not list(tmp_path.iterdir())  # the probe file is removed


def test_blend_that_would_not_beat_full_on_this_device_falls_back_to_full():
    # A device where blend at 0.15 took 0.9 of a full prefill (launch-bound GPU): at r = 0.15
    # it still pays; once loading pushes the ratio to 0.3 it would not.
    slow = profile(disk=2e6)  # loading: r_load 0.5
    slow.blend_ms_fixed, slow.blend_ms_per_token, slow.blend_ratio = 0.0, 0.9, 0.15
    fast_ram = LoadingController(slow, tier="ram").decide(1000)
    assert fast_ram.fallback_full is False and fast_ram.ratio == pytest.approx(0.15)
    assert fast_ram.t_blend_ms == pytest.approx(900.0)
    disk = LoadingController(slow, tier="disk").decide(1000)
    assert disk.fallback_full is True and disk.reason == "blend" and disk.ratio == 1.0
    assert disk.t_blend_ms == pytest.approx(1000 * (0.9 + 0.5 - 0.15))
    cpu_like = profile(disk=2e6)
    cpu_like.blend_ms_fixed, cpu_like.blend_ms_per_token = 0.0, 0.1  # a tenth of full
    assert LoadingController(cpu_like, tier="disk").decide(1000).fallback_full is False
    unmeasured = LoadingController(profile(disk=2e6), tier="disk").decide(1000)
    assert unmeasured.t_blend_ms is None and unmeasured.fallback_full is False


def test_blend_judged_slower_runs_full_and_says_why(engine):
    slow = profile()
    slow.blend_ms_fixed, slow.blend_ms_per_token = 0.0, 1.2
    engine.controller = LoadingController(slow, tier="ram")
    engine.precompute(CHUNKS)
    got = engine.prefill(engine.tokenize(QUESTION, CHUNKS), mode="blend")
    assert got.stats.mode == "full" and got.stats.fallback_reason == "controller_full"
    assert "would not be faster than a full prefill" in got.stats.fallback_message


def test_blend_is_measured_on_the_device_without_touching_the_engine_store(engine):
    engine.precompute(CHUNKS[:1])
    before = set(engine.store.keys())
    fit = ctl.measure_blend(engine, layouts=((1, 32), (3, 32)), repeats=1)
    assert fit.ratio == ctl.R_STAR
    assert fit.measured["prompt_tokens"] == [16 + 32 + 16, 16 + 3 * 32 + 2 + 16]
    assert all(t > 0 for t in fit.measured["full_ms"] + fit.measured["blend_ms"])
    assert fit.full[1] > 0 and fit.blend[1] > 0 and min(fit.full + fit.blend) >= 0
    assert set(engine.store.keys()) == before


def test_the_profile_keeps_the_measured_blend_and_refits_prefill_at_its_lengths(
    engine, tmp_path, monkeypatch
):
    monkeypatch.setattr(ctl, "profile_path", lambda fp, dev: tmp_path / f"{fp[:16]}-{dev}.json")
    fit = ctl.BlendFit((3.0, 0.5), (1.0, 0.1), 0.15, {"prompt_tokens": [100, 300]})
    monkeypatch.setattr(ctl, "measure_blend", lambda engine: fit)
    got = LoadingController.for_engine(engine).profile
    assert (got.prefill_ms_fixed, got.prefill_ms_per_token) == (3.0, 0.5)
    assert (got.blend_ms_fixed, got.blend_ms_per_token, got.blend_ratio) == (1.0, 0.1, 0.15)
    assert got.blend_ms(1000, 0.15, "ram") == pytest.approx(1.0 + 100.0)
    assert got.blend_ms(1000, 0.35, "ram") == pytest.approx(101.0 + 0.2 * 503.0)
    saved = Profile.from_json(next(tmp_path.glob("*.json")).read_text())
    assert saved.blend_ms_per_token == 0.1 and saved.measured["blend"] == fit.measured
