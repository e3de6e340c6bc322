"""A bounded worker pool for blocking engine calls: priorities, and the queue and compute time of each job."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import heapq
import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Generic, TypeVar

from voicemesh import cpus, telemetry

R = TypeVar("R")
T = TypeVar("T")


@dataclass(frozen=True)
class Timed(Generic[R]):
    result: R
    queue_ms: float
    compute_ms: float


class WorkerPool:
    """At most `workers` jobs at once; a waiting job with a lower `priority` number starts first, then FIFO.

    With `nice` > 0 its threads run at that nice value (voicemesh/cpus.py): for work that may wait for idle cores.
    """

    def __init__(self, workers: int, name: str, nice: int = 0) -> None:
        if workers < 1:
            raise ValueError("workers must be >= 1")
        cpus.check_nice(nice)
        self.nice = nice
        self.workers = workers
        self._free = workers
        self._waiting: list[tuple[int, int, asyncio.Future[None]]] = []
        self._order = itertools.count()
        self._executor = ThreadPoolExecutor(
            workers, thread_name_prefix=name, initializer=functools.partial(cpus.lower_this_thread, nice)
        )
        self._busy = telemetry.WORKER_BUSY.labels(name)
        telemetry.WORKERS.labels(name).set(workers)

    @property
    def waiting(self) -> int:
        return sum(1 for *_, future in self._waiting if not future.done())

    @property
    def busy(self) -> int:
        return self.workers - self._free

    async def _acquire(self, priority: int) -> None:
        if self._free > 0 and not self._waiting:
            self._free -= 1
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (priority, next(self._order), future)
        heapq.heappush(self._waiting, entry)
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self._release()  # we were handed the worker as we were cancelled: pass it on
            else:
                self._waiting.remove(entry)
                heapq.heapify(self._waiting)
            raise

    @contextlib.asynccontextmanager
    async def slot(self, priority: int = 0) -> AsyncIterator[float]:
        """Hold one worker; yields the milliseconds spent waiting for it."""
        enqueued = time.monotonic_ns()
        await self._acquire(priority)
        try:
            yield (time.monotonic_ns() - enqueued) / 1e6
        finally:
            self._release()

    def _release(self) -> None:
        while self._waiting:
            *_, future = heapq.heappop(self._waiting)
            if not future.done():
                future.set_result(None)
                return
        self._free += 1

    async def run(self, fn: Callable[..., R], *args: object, priority: int = 0) -> Timed[R]:
        """Run blocking `fn(*args)` on a worker thread once one is free."""
        enqueued = time.monotonic_ns()
        await self._acquire(priority)
        started = time.monotonic_ns()
        future = asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        # The worker stays taken until the thread returns, even if the caller gives up waiting.
        future.add_done_callback(lambda _: self._finished(started))
        result = await asyncio.shield(future)
        return Timed(result, (started - enqueued) / 1e6, (time.monotonic_ns() - started) / 1e6)

    def _finished(self, started_ns: int) -> None:
        self._busy.inc((time.monotonic_ns() - started_ns) / 1e9)
        self._release()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class Newest(Generic[T]):
    """Runs `work(value)` for the values offered, one call at a time: a value offered while a call runs waits for
    it, and only the newest of those runs next (the words of a partial transcript, superseded by the next one).
    Nothing runs while `held()` is true."""

    def __init__(self, work: Callable[[T], Awaitable[None]], held: Callable[[], bool] = lambda: False) -> None:
        self._work = work
        self._held = held
        self._next: T | None = None
        self._task: asyncio.Task[None] | None = None

    def offer(self, value: T) -> None:
        self._next = value
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while (value := self._next) is not None and not self._held():
            self._next = None
            await self._work(value)

    async def close(self) -> None:
        """Cancel the call in flight, if any, and wait for it to end."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
