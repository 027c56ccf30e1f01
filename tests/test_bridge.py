"""The thread → asyncio bridge: items in order, errors re-raised, early exit stops the producer."""

import asyncio
import threading

import pytest

from ragblend.bridge import aiter_in_thread


def test_items_arrive_in_order_and_errors_reach_the_consumer():
    def failing(_cancel):
        yield 1
        yield 2
        raise ValueError("boom")

    async def consume():
        got = []
        with pytest.raises(ValueError, match="boom"):
            async for x in aiter_in_thread(failing):
                got.append(x)
        return got

    assert asyncio.run(consume()) == [1, 2]


def test_consumer_leaving_early_closes_the_generator():
    closed = threading.Event()

    def endless(cancel):
        try:
            i = 0
            while not cancel.is_set():
                yield i
                i += 1
        finally:
            closed.set()

    async def consume():
        async for x in aiter_in_thread(endless):
            if x == 3:
                break

    asyncio.run(consume())
    assert closed.wait(5)
