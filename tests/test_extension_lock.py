"""A first-use compile that dies mid-way must not hang later processes: ``load_ops`` holds a
flock while torch builds and removes the ``lock`` baton a killed build left behind. Each case
runs ``load_ops`` in real subprocesses on a one-op source of its own, under a private
``TORCH_EXTENSIONS_DIR``, each with a timeout so that a hang fails instead of stalling CI."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler (c++)")

NAME = "ragblend_lock_probe"
# generous: the compile takes ~10 s alone, several times that on a loaded 2-core machine
TIMEOUT_S = 300
STALE = "removed a stale build lock"
SOURCE = f"""\
#include <ATen/core/Tensor.h>
#include <torch/library.h>

at::Tensor twice(const at::Tensor& x) {{ return x.add(x); }}

TORCH_LIBRARY({NAME}, m) {{ m.def("twice(Tensor x) -> Tensor", &twice); }}
"""
# one process that loads the probe through load_ops, checks its op and says "ok"
CHILD = f"""
import logging, sys
from pathlib import Path
import torch
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
from ragblend.kernels.cpu.extensions import load_ops
ops = load_ops({NAME!r}, ["probe.cpp"], [], csrc=Path(sys.argv[1]))
assert ops.twice(torch.ones(3)).tolist() == [2.0, 2.0, 2.0]
print("ok")
"""


@pytest.fixture
def probe(tmp_path: Path) -> tuple[Path, Path]:
    """The probe's source folder and its private extensions root."""
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    (csrc / "probe.cpp").write_text(SOURCE)
    return csrc, tmp_path / "extensions"


def _start(csrc: Path, root: Path) -> subprocess.Popen[str]:
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(root))
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, str(csrc)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _finish(proc: subprocess.Popen[str]) -> str:
    """Wait for a child to load the probe; its stderr. Fails (killing it) on a hang or error."""
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"load_ops hung for over {TIMEOUT_S} s")
    assert proc.returncode == 0 and out.strip() == "ok", err
    return err


def _stale_warnings(err: str) -> list[str]:
    return [line for line in err.splitlines() if STALE in line]


def test_a_stale_lock_file_is_removed_with_one_warning_and_the_build_completes(probe):
    csrc, root = probe
    baton = root / NAME / "lock"
    baton.parent.mkdir(parents=True)
    baton.touch()

    err = _finish(_start(csrc, root))

    assert len(_stale_warnings(err)) == 1, err
    assert not baton.exists()


def test_a_process_killed_mid_compile_does_not_block_the_next_load(probe):
    csrc, root = probe
    baton = root / NAME / "lock"
    first = _start(csrc, root)
    deadline = time.monotonic() + TIMEOUT_S
    while not baton.exists():
        assert first.poll() is None, "the first load ended before its compile was caught"
        assert time.monotonic() < deadline, "torch's build lock never appeared"
        time.sleep(0.01)
    # SIGKILL the loader alone, as the OOM killer would: its ninja and compiler are orphaned
    # and finish their objects while the next process rebuilds
    first.kill()
    first.communicate()
    assert baton.exists()

    err = _finish(_start(csrc, root))

    assert len(_stale_warnings(err)) == 1, err


def test_two_processes_loading_a_fresh_extension_at_once_both_succeed(probe):
    csrc, root = probe
    procs = [_start(csrc, root), _start(csrc, root)]

    errs = [_finish(proc) for proc in procs]

    assert not any(_stale_warnings(err) for err in errs), errs
    assert not (root / NAME / "lock").exists()
