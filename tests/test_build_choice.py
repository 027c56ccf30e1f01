"""``widest_that_loads``: the widest build a CPU runs, a failing wider one a single warning."""

from __future__ import annotations

import logging

import pytest

from ragblend.kernels.cpu.extensions import Build, widest_that_loads

log = logging.getLogger("probe.builds")

WIDE = Build("avx512", "probe_wide", ())
MIDDLE = Build("avx512_bf16", "probe_middle", ())
NARROW = Build("avx2", "probe_narrow", ())


class Loader:
    """Loads the builds not named in ``failing``; records every build it was asked for."""

    def __init__(self, *failing: str) -> None:
        self.failing = set(failing)
        self.asked: list[str] = []

    def __call__(self, build: Build) -> str:
        self.asked.append(build.name)
        if build.name in self.failing:
            raise RuntimeError(f"{build.name} does not compile")
        return build.name


def test_the_widest_build_that_runs_is_loaded_and_no_other(caplog):
    load = Loader()
    with caplog.at_level(logging.WARNING, logger="probe.builds"):
        assert widest_that_loads((WIDE, NARROW), load, lambda b: True, "probe", log) == "probe_wide"
    assert load.asked == ["probe_wide"] and not caplog.records


def test_builds_the_cpu_does_not_run_are_never_loaded():
    load = Loader()
    runs = {"probe_wide": False, "probe_middle": True, "probe_narrow": True}
    got = widest_that_loads((WIDE, MIDDLE, NARROW), load, lambda b: runs[b.name], "probe", log)
    assert got == "probe_middle" and load.asked == ["probe_middle"]


def test_a_failing_wider_build_is_one_warning_then_the_next(caplog):
    load = Loader("probe_wide")
    with caplog.at_level(logging.WARNING, logger="probe.builds"):
        got = widest_that_loads((WIDE, NARROW), load, lambda b: True, "probe kernels", log)
    assert got == "probe_narrow" and load.asked == ["probe_wide", "probe_narrow"]
    [warning] = [r.getMessage() for r in caplog.records]
    assert "avx512 build probe_wide of its probe kernels fails" in warning
    assert "probe_wide does not compile" in warning and "using the next build" in warning


def test_the_narrowest_build_failing_raises_its_error_for_the_caller():
    load = Loader("probe_wide", "probe_narrow")
    with pytest.raises(RuntimeError, match="probe_narrow does not compile"):
        widest_that_loads((WIDE, NARROW), load, lambda b: True, "probe", log)


def test_none_where_no_build_runs_here():
    load = Loader()
    assert widest_that_loads((WIDE, NARROW), load, lambda b: False, "probe", log) is None
    assert load.asked == []
