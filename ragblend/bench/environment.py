"""Where and how a benchmark ran: command, versions, device, GPU clocks, filesystem."""

from __future__ import annotations

import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from ragblend import cpu


def environment(device: torch.device) -> dict:
    """The command, git commit, Python/torch/CUDA/transformers versions and the device."""
    import transformers

    env = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "argv": list(sys.argv),
        "cwd": os.getcwd(),
        "when_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "device": str(device),
    }
    try:
        env["git_commit"] = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=Path(__file__).resolve().parent,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        env["git_commit"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(
            device_name=torch.cuda.get_device_name(device),
            capability=".".join(map(str, torch.cuda.get_device_capability(device))),
            device_memory_bytes=int(props.total_memory),
            cudnn=torch.backends.cudnn.version(),
        )
    else:
        env["device_name"] = platform.processor() or platform.machine()
    smi = nvidia_smi()
    if smi is not None:
        env["nvidia_smi"] = smi
    return env


def cpu_environment() -> dict:
    """The CPU's model and ragblend level, torch's and Python's versions and the local date:
    what a CPU kernel benchmark records beside its results."""
    return {
        "cpu": cpu.cpu_model(),
        "cpu_isa": cpu.cpu_isa(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def write_report(path: Path, report: dict) -> None:
    """``report`` as indented JSON at ``path`` (its directory made); prints where."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")


def nvidia_smi() -> str | None:
    """Name, driver, clocks, power and temperature from ``nvidia-smi`` (None without it)."""
    if not shutil.which("nvidia-smi"):
        return None
    query = (
        "name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem,"
        "power.draw,power.limit,temperature.gpu,memory.total,persistence_mode"
    )
    try:
        res = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        return res.stdout.strip() or res.stderr.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return f"failed: {exc}"


def filesystem_of(path: Path) -> str | None:
    """Filesystem type of ``path`` from /proc/mounts (tmpfs means the disk tier is RAM)."""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return None
    best, kind = "", None
    target = str(path.resolve())
    for line in mounts:
        parts = line.split()
        if (
            len(parts) >= 3
            and (
                target == parts[1]
                or target.startswith(parts[1].rstrip("/") + "/")
                or parts[1] == "/"
            )
            and len(parts[1]) >= len(best)
        ):
            best, kind = parts[1], parts[2]
    return kind
