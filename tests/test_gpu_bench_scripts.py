"""benchmarks/gpu/gpu_decode.py and gpu_profile.py on the tiny shape on CPU (seconds).

Each script runs in a subprocess, as the GPU check runs it; its JSON is checked for the
documented keys and consistent numbers. The profile's CUDA branch (runtime launch/sync names,
kernel events) is checked on synthetic profiler events, and the decode script's HF-decoder
path (its decoders stepped one by one) in process.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
GPU_SCRIPTS = BENCH / "gpu"  # the scripts gpu_check.sh runs beside gpu_bench.py
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def run_script(name: str, *args: str) -> subprocess.CompletedProcess:
    res = subprocess.run(
        [sys.executable, str(GPU_SCRIPTS / name), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=ENV,
        cwd=str(BENCH.parent),
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name.removesuffix(".py"), GPU_SCRIPTS / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_decode_tiny_cpu(tmp_path):
    out = tmp_path / "decode"
    res = run_script(
        "gpu_decode.py",
        *("--shape", "tiny", "--device", "cpu", "--dtype", "float32"),
        *("--batches", "1,4", "--prompt-tokens", "256", "--steps", "8", "--repeats", "2"),
        *("--out", str(out)),
    )
    assert "tokens/s" in res.stdout
    data = json.loads((out / "gpu_decode.json").read_text())
    assert data["environment"]["torch"] == torch.__version__
    info = data["shapes"]["tiny"]
    assert info["device"] == "cpu" and info["dtype"] == "float32"
    assert info["prompt_tokens"] == 256
    assert info["path"] == "layer_decode.decode_batch"
    assert set(info["batches"]) == {"1", "4"}
    for b, row in info["batches"].items():
        assert row["ms_per_step"] > 0 and row["tokens_per_s"] > 0 and row["ratio"] > 0
        assert len(row["ms_per_step_repeats"]) == 2
        assert row["tokens_per_s"] == pytest.approx(int(b) * 1e3 / row["ms_per_step"], rel=1e-3)
    assert info["batches"]["1"]["ratio"] == 1.0
    four = info["batches"]["4"]
    assert four["ratio"] == pytest.approx(
        four["tokens_per_s"] / info["batches"]["1"]["tokens_per_s"], rel=1e-3
    )
    assert info["batched_equals_alone"] == {"1": True, "4": True}  # fp32: the same tokens
    assert len(info["alone_tokens"]) == 4


def test_gpu_profile_tiny_cpu(tmp_path):
    out = tmp_path / "profile"
    res = run_script(
        "gpu_profile.py",
        *("--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--layout", "3x48"),
        *("--modes", "full,reuse,blend", "--trace", "--out", str(out)),
    )
    assert "launches" in res.stdout
    data = json.loads((out / "gpu_profile.json").read_text())
    info = data["shapes"]["tiny"]
    assert info["layout"] == "3x48" and info["device"] == "cpu"
    assert info["prompt_tokens"] == 16 + 3 * 48 + 2 + 8
    assert set(info["modes"]) == {"full", "reuse", "blend"}
    for mode, row in info["modes"].items():
        assert row["ran_mode"] == mode, row.get("fallback_reason")
        assert row["wall_ms"] > 0 and row["profiled_wall_ms"] > 0
        assert 0 < row["host_ms"] <= row["host_range_ms"] * 1.01
        assert row["device_kernel_ms"] == 0 and row["device_kernels"] == 0
        launches = row["kernel_launches"]
        assert launches["count"] > 0 and "stand-in" in launches["source"]
        assert launches["count"] <= launches["all_op_events"]
        assert set(row["syncs"]["by_name"]) >= {
            "cudaStreamSynchronize",
            "cudaDeviceSynchronize",
            "cudaEventSynchronize",
            "cudaMemcpy",
            "aten::_local_scalar_dense",
            "aten::nonzero",
        }
        assert row["syncs"]["runtime_total"] == 0  # no CUDA runtime on a CPU
        top = row["top_ops"]
        assert 0 < len(top) <= 12
        assert all(t["count"] > 0 and t["self_cpu_ms"] >= 0 for t in top)
        assert [t["self_cpu_ms"] for t in top] == sorted(
            (t["self_cpu_ms"] for t in top), reverse=True
        )
        trace = json.loads((out / row["trace"]).read_text())
        assert trace["traceEvents"]
    # Every linear of the tiny model is one matmul kernel in a full prefill (7 per layer + head).
    assert info["modes"]["full"]["kernel_launches"]["by_name"]["aten::mm"] == 7 * 4 + 1


class FakeEvent:
    """The FunctionEvent attributes gpu_profile.summarize reads."""

    def __init__(self, name, start, end, kind, device=False, parent=None, self_device_us=0.0):
        self.name = name
        self.activity_type = kind
        self.device_type = (
            torch.autograd.DeviceType.CUDA if device else torch.autograd.DeviceType.CPU
        )
        self.time_range = SimpleNamespace(
            start=start, end=end, elapsed_us=lambda: float(end - start)
        )
        self.is_async = False
        self.cpu_parent = parent
        self.cpu_children = []
        if parent is not None:
            parent.cpu_children.append(self)
        self.cpu_time_total = float(end - start)
        self.self_device_time_total = self_device_us

    @property
    def self_cpu_time_total(self):
        return self.cpu_time_total - sum(c.cpu_time_total for c in self.cpu_children)


def test_gpu_profile_summarize_cuda_events():
    gp = load_script("gpu_profile.py")
    rng = FakeEvent(gp.RANGE, 0, 1000, "user_annotation")
    mm = FakeEvent("aten::mm", 10, 100, "cpu_op", parent=rng, self_device_us=50)
    FakeEvent("cudaLaunchKernel_v7000", 20, 30, "cuda_runtime", parent=mm)
    lin = FakeEvent("aten::addmm", 110, 200, "cpu_op", parent=rng, self_device_us=30)
    FakeEvent("cudaLaunchKernelExC_v11060", 120, 130, "cuda_runtime", parent=lin)
    item = FakeEvent("aten::item", 300, 400, "cpu_op", parent=rng)
    dense = FakeEvent("aten::_local_scalar_dense", 310, 390, "cpu_op", parent=item)
    FakeEvent("cudaMemcpyAsync", 320, 330, "cuda_runtime", parent=dense)
    FakeEvent("cudaStreamSynchronize", 330, 380, "cuda_runtime", parent=dense)
    triton = FakeEvent("triton_kernel", 500, 600, "cpu_op", parent=rng)
    FakeEvent("cuLaunchKernel", 510, 520, "cuda_driver", parent=triton)
    events = [rng, mm, lin, item, dense, triton]
    events += [c for e in (mm, lin, dense, triton) for c in e.cpu_children if c not in events]
    events += [
        FakeEvent("ampere_sgemm", 40, 90, "kernel", device=True),
        FakeEvent("cutlass_gemm", 140, 170, "kernel", device=True),
        FakeEvent("Memcpy DtoH (Device -> Pageable)", 335, 337, "gpu_memcpy", device=True),
        FakeEvent(gp.RANGE, 0, 900, "gpu_user_annotation", device=True),
        # the profiler's own synchronize at its exit: after the range, not counted
        FakeEvent("cudaDeviceSynchronize", 1100, 1200, "cuda_runtime"),
    ]
    got = gp.summarize(SimpleNamespace(events=lambda: events), torch.device("cuda"), 12)
    assert got["kernel_launches"]["count"] == 3
    assert got["kernel_launches"]["by_name"]["cudaLaunchKernelExC"] == 1
    assert got["device_kernels"] == 2 and got["device_kernel_ms"] == pytest.approx(0.08)
    assert got["device_memcpys"] == 1
    assert got["syncs"]["by_name"]["cudaStreamSynchronize"] == 1
    assert got["syncs"]["by_name"]["cudaDeviceSynchronize"] == 0
    assert got["syncs"]["by_name"]["aten::_local_scalar_dense"] == 1
    assert got["syncs"]["runtime_total"] == 1 and got["syncs"]["op_total"] == 1
    assert got["syncs"]["other_memcpy_calls"] == {"cudaMemcpyAsync": 1}
    assert got["top_level_ops"] == 4
    assert got["host_ms"] == pytest.approx((90 + 90 + 100 + 100) / 1e3)
    assert got["host_range_ms"] == pytest.approx(1.0)
    top = {t["name"]: t for t in got["top_ops"]}
    assert top["aten::mm"]["device_ms"] == pytest.approx(0.05)
    assert top["cudaStreamSynchronize"]["self_cpu_ms"] == pytest.approx(0.05)


def test_gpu_decode_hf_decoder_path():
    """Where engine.decoder gives HFDecoders, they are stepped one by one (fresh each run)."""
    gd = load_script("gpu_decode.py")
    from ragblend.bench.shapes import IdTokenizer, build_model
    from ragblend.config import BlendConfig
    from ragblend.decode.generation import HFDecoder
    from ragblend.engine import BlendEngine
    from ragblend.prompt import TokenizedPrompt

    model = build_model("tiny", torch.device("cpu"), torch.float32, 0)
    engine = BlendEngine(model, IdTokenizer(), BlendConfig(device="cpu", dtype="float32"))
    prefill = engine.prefill(TokenizedPrompt([1] + list(range(200, 260)), [], [], []), "full")
    lean = gd.Decoders(engine, prefill, 2, 5)
    assert lean.batched
    expected = lean.run(lean.reset(2), 4)

    class HFOnly:
        def decoder(self, prefill, room):
            return HFDecoder(model, prefill, len(prefill.prompt_ids) + room)

    pool = gd.Decoders(HFOnly(), prefill, 2, 5)
    assert not pool.batched and pool.path == "HFDecoder, one by one"
    assert pool.run(pool.reset(2), 4) == expected
    assert pool.run(pool.reset(2), 4) == expected  # made afresh: the same tokens again


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available")
@pytest.mark.parametrize("name", ["gpu_decode.py", "gpu_profile.py"])
def test_scripts_refuse_cuda_without_it(name, tmp_path):
    with pytest.raises(SystemExit, match="CUDA is not available"):
        load_script(name).main(["--device", "cuda", "--out", str(tmp_path)])


def test_gpu_check_smoke_runs_every_step_and_brings_back_at_most_eight_files(tmp_path):
    # The GPU machine's one prepared script, its --smoke form on this CPU (the CUDA tests'
    # step skipped here: the suite runs them itself).
    out = tmp_path / "out"
    env = {**ENV, "OUT": str(out), "GPU_CHECK_SKIP_TESTS": "1", "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", str(BENCH / "gpu_check.sh"), "--smoke"],
        cwd=BENCH.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8
    assert {"gpu_check.log", "summary.md", "bench_tiny.json", "gpu_decode.json"} <= set(files)
    assert {"gpu_profile.json", "ttft_tiny.png"} <= set(files)
    summary = (out / "summary.md").read_text()
    assert "## Targets" in summary and "n/a (smoke)" in summary and "Missing" not in summary
    assert "every step passed" in done.stdout
