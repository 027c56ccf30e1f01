"""ragblend.threads: fresh threads return results and re-raise errors on the caller."""

from __future__ import annotations

import asyncio
import threading

import pytest

from ragblend.threads import call_in_fresh_thread, run_in_fresh_thread


def test_call_in_fresh_thread_runs_elsewhere_and_returns_or_raises():
    seen = []

    def work(x):
        seen.append(threading.current_thread())
        return x * 2

    assert call_in_fresh_thread(work, 21) == 42
    assert seen[0] is not threading.current_thread() and not seen[0].is_alive()
    with pytest.raises(KeyError, match="missing"):
        call_in_fresh_thread(lambda: {}["missing"])


def test_run_in_fresh_thread_awaits_a_new_thread_per_call():
    seen = []

    def work(x):
        seen.append(threading.current_thread())
        return x + 1

    async def main():
        return [await run_in_fresh_thread(work, i) for i in range(3)]

    assert asyncio.run(main()) == [1, 2, 3]
    assert len(set(seen)) == 3 and threading.current_thread() not in seen
    for thread in seen:  # each ends right after handing its result to the loop
        thread.join(timeout=5)
        assert not thread.is_alive()

    async def failing():
        await run_in_fresh_thread(lambda: 1 / 0)

    with pytest.raises(ZeroDivisionError):
        asyncio.run(failing())
