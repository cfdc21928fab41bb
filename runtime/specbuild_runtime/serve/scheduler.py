"""Requests to decoding threads: `parallel` slots behind a bounded queue, with deadlines, cancellation and draining.

Everything here runs on the event loop. A job decodes through a Relay (../relay.py, as the decoder's async API
does) in one of the decoder's `parallel` worker threads (onnxruntime releases the GIL while it computes, so
slots decode at the same time). After every token (also one whose text is held back, e.g. while it may begin a
stop string) the worker checks whether the request was stopped (client gone, deadline passed, server shutting
down) and if so closes the decoder's generator, which gives the slot back at once.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from dataclasses import dataclass, field
from functools import partial

from ..decode import Stats
from ..relay import Relay
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


@dataclass(eq=False)
class Job:
    """One request's decoding: iterate it for text deltas; `stats` is final once iteration ends.

    Iteration raises Stopped when the server stopped the job, or the decoder's own exception.
    """

    request: Request  # checked by SpeculativeDecoder.request
    arrival: float  # loop.time() (= time.monotonic())
    stats: Stats
    # The deltas; relay.finished (every delta posted) means a deadline after it stops nothing.
    relay: Relay = field(default_factory=Relay)
    started: bool = False  # holds (or held) a slot
    done: bool = False  # its worker returned and the slot is free
    timer: asyncio.TimerHandle | None = None

    def __aiter__(self) -> Relay:
        return self.relay


class Scheduler:
    def __init__(self, decoder, max_queue: int, timeout: float | None, metrics: Metrics):
        self.decoder = decoder
        self.parallel = decoder.slots.size
        self.max_queue = max_queue
        self.timeout = timeout
        self.metrics = metrics
        self.draining = False
        self.cut = False  # the grace period after shutdown ended: what is left is stopped
        self._cut_waiters: set[asyncio.Future] = set()
        self._queue: collections.deque[Job] = collections.deque()
        self._running: set[Job] = set()

    def submit(self, request: Request) -> Job:
        """Start decoding now, or queue; raises Overloaded when the queue is full, Unavailable when draining."""
        if self.draining:
            raise Unavailable("the server is shutting down")
        if len(self._running) >= self.parallel and len(self._queue) >= self.max_queue:
            raise Overloaded(f"all {self.parallel} slots are busy and {len(self._queue)} requests are queued")
        loop = asyncio.get_running_loop()
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
        if job.relay.stopped or job.done or job.relay.finished:
            return
        job.relay.stop(Stopped(reason))
        if job.timer:
            job.timer.cancel()
        if job in self._queue:
            self._queue.remove(job)
            self.metrics.queue_depth.set(len(self._queue))

    def drain(self, grace: float) -> None:
        """On the loop, at shutdown: refuse new requests; stop those still queued or decoding after `grace` seconds."""
        self.draining = True
        asyncio.get_running_loop().call_later(grace, self._cut)

    def until_cut(self) -> asyncio.Future:
        """A future of the running loop, done once the grace period after shutdown has ended (an asyncio.Event would
        bind the scheduler to the first loop that waited on it: on the next, its wait failed at once, read as the cut)."""
        waiter = asyncio.get_running_loop().create_future()
        if self.cut:
            waiter.set_result(None)
        else:
            self._cut_waiters.add(waiter)
            waiter.add_done_callback(self._cut_waiters.discard)
        return waiter

    def _cut(self) -> None:
        self.cut = True
        for waiter in [*self._cut_waiters]:  # also a request still reading its body (app.Server._body_unless_cut)
            if not waiter.done():
                waiter.set_result(None)
        self._stop_all("shutdown")

    async def close(self) -> None:
        self._stop_all("shutdown")
        if self._running:  # each worker returns after at most one more token; the threads stay the decoder's
            await asyncio.wait({job.relay.worker for job in self._running})

    def _stop_all(self, reason: str) -> None:
        for job in [*self._queue, *self._running]:
            self.stop(job, reason)

    def _start(self, job: Job) -> None:
        job.started = True
        self._running.add(job)
        self.metrics.slots_busy.set(len(self._running))
        deltas = partial(self.decoder.stream_request, job.request, job.stats, every_token=True)
        job.relay.start(self.decoder.workers, deltas, held=("",)).add_done_callback(lambda _: self._finished(job))

    def _finished(self, job: Job) -> None:
        """On the loop, after the worker returned (the relay has ended the job's deltas): the slot is free; start
        the next."""
        self._running.discard(job)
        job.done = True
        if job.timer:
            job.timer.cancel()
        self.metrics.decoded(job.stats)
        if job.relay.first_item_at is not None:
            self.metrics.ttft.observe(job.relay.first_item_at - job.arrival)
        while self._queue and len(self._running) < self.parallel:
            self._start(self._queue.popleft())
        self.metrics.queue_depth.set(len(self._queue))
        self.metrics.slots_busy.set(len(self._running))
