"""Which threads run torch compute: background work on threads that end with it.

PyTorch's CPU wheels parallelise ops with GNU OpenMP, and every thread that runs a parallel op
gets an OpenMP team of its own that lives as long as that thread. Once a process holds more
OpenMP threads than cores, libgomp stops spinning between parallel regions ("throttled"
waiting) and every parallel op in the process pays for waking its threads: on the 2-core
benchmark machine a blend prefill ran 1.7× slower while an *idle* warmup worker that had once
computed merely existed (``benchmarks/serving/warmup_interference.py``). So ragblend never parks a
thread that has computed: background compute and async offloading run on a fresh thread per
job, which exits with it, and threads that only copy data use one torch thread.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch

T = TypeVar("T")


def call_in_fresh_thread(fn: Callable[..., T], *args: Any, name: str = "ragblend-compute") -> T:
    """``fn(*args)`` on a new thread that ends when it returns; its result or exception."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn(*args)
        except BaseException as exc:  # re-raised on the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


async def run_in_fresh_thread(fn: Callable[..., T], *args: Any) -> T:
    """Await ``fn(*args)`` run on a new thread (``asyncio.to_thread`` parks its pool's
    threads, each keeping its OpenMP team; see the module docstring)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if future.cancelled():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)

    def target() -> None:
        value, error = None, None
        try:
            value = fn(*args)
        except BaseException as exc:  # forwarded to the awaiting coroutine
            error = exc
        try:
            loop.call_soon_threadsafe(settle, value, error)
        except RuntimeError:  # the loop is closed: nobody awaits the result any more
            pass

    threading.Thread(target=target, name="ragblend-async", daemon=True).start()
    return await future


def copy_only_thread() -> None:
    """Call first on a long-lived thread that only moves tensors (writers, loaders): one
    torch thread, so it never holds an OpenMP team."""
    torch.set_num_threads(1)


def core_free_for_a_reader(device: torch.device) -> bool:
    """Whether a thread that reads cached K/V ahead can run beside the compute on ``device``
    without taking a core from it: always beside a GPU; on CPU only when the process may use
    more cores than torch's intra-op threads. Otherwise the reader preempts one of the OpenMP
    team, and the team waits for it at every barrier. On the 2-core benchmark machine a blend
    prefill from the disk tier that reads each layer when it is due takes 0.94× the time of one
    reading two layers ahead on a thread with a warm page cache, 0.87–0.97× with a cold one
    (three interleaved runs)."""
    if device.type != "cpu":
        return True
    getaffinity = getattr(os, "sched_getaffinity", None)
    cores = len(getaffinity(0)) if getaffinity is not None else (os.cpu_count() or 1)
    return cores > torch.get_num_threads()
