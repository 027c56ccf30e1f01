"""Thread → asyncio bridge: iterate a blocking generator from an event loop.

Prefill and decode are blocking torch calls; async framework APIs (LlamaIndex ``astream_*``,
LangChain ``_astream``) run them on a daemon thread and receive the items through an
``asyncio.Queue``. When the consumer stops early (``break``, cancellation, a closed loop) the
producer is told via a ``threading.Event`` and the generator is closed, so decoding stops.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TypeVar

T = TypeVar("T")
_DONE = object()


async def aiter_in_thread(
    make: Callable[[threading.Event], Iterator[T]], name: str = "ragblend-bridge"
) -> AsyncIterator[T]:
    """Yield the items of ``make(cancel)``, produced on a daemon thread.

    ``make`` receives the cancel event (set when the consumer goes away) and may poll it
    between items; the bridge also checks it after each item and closes the generator.
    Exceptions raised by the generator are re-raised in the consumer.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    cancel = threading.Event()

    def put(item: object, exc: BaseException | None = None) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, (item, exc))
        except RuntimeError:  # the loop is closed: nobody is listening any more
            cancel.set()

    def produce() -> None:
        gen = None
        try:
            gen = make(cancel)
            for item in gen:
                if cancel.is_set():
                    return
                put(item)
        except BaseException as exc:  # forwarded to the consumer
            put(_DONE, exc)
            return
        finally:
            close = getattr(gen, "close", None)  # plain iterators have no close()
            if cancel.is_set() and close is not None:
                close()
        put(_DONE)

    threading.Thread(target=produce, name=name, daemon=True).start()
    try:
        while True:
            item, exc = await queue.get()
            if item is _DONE:
                if exc is not None:
                    raise exc
                return
            yield item
    finally:
        cancel.set()
