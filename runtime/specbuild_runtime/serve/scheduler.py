"""Requests to decoding threads: `parallel` slots behind a bounded queue, with deadlines, cancellation and draining.

Everything here runs on the event loop except `_decode`, which runs in one of `parallel` worker threads
(onnxruntime releases the GIL while it computes, so slots decode at the same time). A worker hands each
text delta to the loop with `call_soon_threadsafe`; after every token (also one whose text is held back,
e.g. while it may begin a stop string) it checks whether the request was stopped (client gone, deadline
passed, server shutting down) and if so closes the decoder's generator, which gives the slot back at once.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass, field

from ..decode import Stats
from ..validation import Request
from .metrics import Metrics

log = logging.getLogger("specbuild.serve")


class Overloaded(Exception):
    """Every slot is busy and the queue is full (429)."""


class Unavailable(Exception):
    """The server is shutting down (503)."""


class Stopped(Exception):
    """The server stopped a request before it finished: "timeout", "shutdown" or "cancelled"."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


FINISHED = object()  # the decoder's generator ended: the last event of a job that was not stopped


@dataclass(eq=False)
class Job:
    """One request's decoding: iterate it for text deltas; `stats` is final once iteration ends.

    Iteration raises Stopped when the server stopped the job, or the decoder's own exception.
    """

    request: Request  # checked by SpeculativeDecoder.request
    arrival: float  # loop.time() (= time.monotonic())
    stats: Stats
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    halt: threading.Event = field(default_factory=threading.Event)  # read by the worker after every token
    started: bool = False  # holds (or held) a slot
    done: bool = False  # its worker returned and the slot is free
    decoded: bool = False  # set by the worker once the decoder's generator ended: a deadline after it stops nothing
    first_delta_at: float | None = None  # time.monotonic(), set by the worker
    timer: asyncio.TimerHandle | None = None

    def __aiter__(self):
        return self

    async def __anext__(self) -> str:
        event = await self.events.get()
        if isinstance(event, str):
            return event
        if event is FINISHED:
            raise StopAsyncIteration
        raise event


class Scheduler:
    def __init__(self, decoder, parallel: int, max_queue: int, timeout: float | None, metrics: Metrics):
        self.decoder = decoder
        self.parallel = parallel
        self.max_queue = max_queue
        self.timeout = timeout
        self.metrics = metrics
        self.draining = False
        self._queue: collections.deque[Job] = collections.deque()
        self._running: set[Job] = set()
        self._workers = ThreadPoolExecutor(parallel, thread_name_prefix="specbuild-slot")
        self._loop: asyncio.AbstractEventLoop | None = None

    def warm_up(self) -> int:
        """Before the first request: every worker thread captures its slot's CUDA graphs (decoder.warm_up), so
        that no request waits for a capture. Returns the graphs captured (0 without CUDA graphs)."""
        before = self.decoder.graphs_captured
        # No task ends before all have begun, so each runs on a worker thread of its own.
        started = threading.Barrier(self.parallel, timeout=60)

        def task() -> None:
            started.wait()
            self.decoder.warm_up()
        try:
            tasks = [self._workers.submit(task) for _ in range(self.parallel)]
        except BaseException:
            started.abort()  # the tasks already started would wait for the others forever
            raise
        for future in tasks:
            future.result()
        return self.decoder.graphs_captured - before

    def submit(self, request: Request) -> Job:
        """Start decoding now, or queue; raises Overloaded when the queue is full, Unavailable when draining."""
        if self.draining:
            raise Unavailable("the server is shutting down")
        if len(self._running) >= self.parallel and len(self._queue) >= self.max_queue:
            raise Overloaded(f"all {self.parallel} slots are busy and {len(self._queue)} requests are queued")
        self._loop = loop = asyncio.get_running_loop()
        job = Job(request, loop.time(), Stats())
        if self.timeout:
            job.timer = loop.call_at(job.arrival + self.timeout, self.stop, job, "timeout")
        if len(self._running) < self.parallel:
            self._start(job)
        else:
            self._queue.append(job)
            self.metrics.queue_depth.set(len(self._queue))
        return job

    def stop(self, job: Job, reason: str) -> None:
        """Stop a job that has not finished: its iterator raises Stopped(reason); a running one frees its slot
        after the token it is decoding. A no-op for a job already stopped or finished."""
        if job.halt.is_set() or job.done or job.decoded:
            return
        job.halt.set()
        if job.timer:
            job.timer.cancel()
        if job in self._queue:
            self._queue.remove(job)
            self.metrics.queue_depth.set(len(self._queue))
        job.events.put_nowait(Stopped(reason))

    def drain(self, grace: float) -> None:
        """On the loop, at shutdown: refuse new requests; stop those still queued or decoding after `grace` seconds."""
        self.draining = True
        asyncio.get_running_loop().call_later(grace, self._stop_all, "shutdown")

    async def close(self) -> None:
        self._stop_all("shutdown")
        await asyncio.to_thread(self._workers.shutdown)  # each worker returns after at most one more token

    def _stop_all(self, reason: str) -> None:
        for job in [*self._queue, *self._running]:
            self.stop(job, reason)

    def _start(self, job: Job) -> None:
        job.started = True
        self._running.add(job)
        self.metrics.slots_busy.set(len(self._running))
        done = self._loop.run_in_executor(self._workers, self._decode, job)
        done.add_done_callback(lambda future: self._finished(job, future))

    def _finished(self, job: Job, future: asyncio.Future) -> None:
        """On the loop, after the worker returned: the slot is free; end the job's events; start the next."""
        self._running.discard(job)
        job.done = True
        if job.timer:
            job.timer.cancel()
        job.events.put_nowait(future.exception() or FINISHED)
        self.metrics.decoded(job.stats)
        if job.first_delta_at is not None:
            self.metrics.ttft.observe(job.first_delta_at - job.arrival)
        while self._queue and len(self._running) < self.parallel:
            self._start(self._queue.popleft())
        self.metrics.queue_depth.set(len(self._queue))
        self.metrics.slots_busy.set(len(self._running))

    def _decode(self, job: Job) -> None:
        """In a worker thread: run the decoder, handing each delta to the loop, until it ends or the job halts."""
        if job.halt.is_set():  # stopped between being given a slot and this thread starting
            return
        post = self._loop.call_soon_threadsafe
        with closing(self.decoder.stream_request(job.request, job.stats, every_token=True)) as deltas:
            for delta in deltas:
                if delta:
                    job.first_delta_at = job.first_delta_at or time.monotonic()
                    post(job.events.put_nowait, delta)
                if job.halt.is_set():
                    return  # closing() ends the generator here, which frees its slot
        job.decoded = True  # every delta is posted; the loop is yet to run _finished
