"""Requests to decoding threads: `parallel` slots behind a bounded queue, with deadlines, cancellation and draining.

Everything here runs on the event loop but the checks (tokenizing, rendering a chat), which take one thread in turn: a
request takes its place (a slot's or the queue's) before its check, so that one waiting for it is bounded, timed and
drained as a queued one is. A job decodes through a Relay (../relay.py, as the decoder's async API does) in one of
the decoder's `parallel` worker threads (onnxruntime releases the GIL while it computes, so slots decode at the same
time). After every token (also one whose text is held back, e.g. while it may begin a
stop string) the worker checks whether the request was stopped (client gone, deadline passed, server shutting
down) and if so closes the decoder's generator, which gives the slot back at once.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass, field
from functools import partial
from typing import Awaitable, Callable, TypeVar, cast

from ..decode import Stats
from ..relay import Relay
from ..validation import Request
from .metrics import Metrics

log = logging.getLogger("specbuild.serve")
T = TypeVar("T")
# stream_request's item for a token whose text is held back: the relay does not post it, and Job.decoded does not
# count it (one definition: counted apart from what is posted, continuous usage would count tokens not yet read)
HELD = ("",)


async def unless(work: Awaitable[T], stopper: Awaitable, reason: str) -> T:
    """work's result, or Stopped(reason) once `stopper` is done first: work is then cancelled, as it is when the caller
    is (an executor's call not begun never runs)."""
    working, stopping = asyncio.ensure_future(work), asyncio.ensure_future(stopper)
    try:
        done, _ = await asyncio.wait({working, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when the caller is cancelled
        stopping.cancel()
        if not working.done():
            working.cancel()
    if working not in done:
        raise Stopped(reason)
    return working.result()


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

    request: Request | None  # checked by SpeculativeDecoder.request; None until then
    arrival: float  # loop.time() (= time.monotonic()), before the check
    stats: Stats
    # The deltas; relay.finished (every delta posted) means a deadline after it stops nothing.
    relay: Relay = field(default_factory=Relay)
    started: bool = False  # holds (or held) a slot
    done: bool = False  # its worker returned and the slot is free
    timer: asyncio.TimerHandle | None = None
    check: asyncio.Future | None = None  # its check, while it is waited for
    # The tokens decoded, and how many there were when each item was posted (by the worker, before it posts it): the
    # ids and usage of the text read so far (return_token_ids, continuous_usage_stats), the worker being ahead of it.
    token_ids: list[int] = field(default_factory=list)
    decoded: list[int] = field(default_factory=list)

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
        self._checking: set[Job] = set()  # waiting for their check or in it: each holds a slot's or a queue place
        # Requests are checked one at a time, off the event loop: tokenizing takes ~200 bytes of memory a byte of text
        # (a 320 KB prompt, which a 4096-token context's body limit admits, ~70 MB), so checks side by side in
        # asyncio's pool (cores + 4 threads) multiplied what a burst of long prompts took.
        self._checker = ThreadPoolExecutor(1, thread_name_prefix="specbuild-check")

    async def submit(self, check: Callable[[], Request]) -> Job:
        """Check a request (`check()` on the checking thread), then start decoding it or queue it. Raises Overloaded
        when every slot and queue place is taken, Unavailable when draining, and what `check` raises. A job stopped
        while it waited for its check (its deadline, the drain's cut) comes back stopped, as a queued one would."""
        job, request = await self._checked(check)
        if job.relay.stopped:  # while it waited: its iteration raises the Stopped, as a queued job's would
            return job
        job.request = request
        if len(self._running) < self.parallel:
            self._start(job)
        else:
            self._queue.append(job)
            self._waiting_changed()
        return job

    async def run_check(self, work: Callable[[], T]) -> T:
        """work() on the checking thread, as a request's check: tokenizing for /tokenize and /detokenize holds as much
        memory as a request's check, so it takes a place (Overloaded when none is left), its turn and its --timeout
        as one does, and raises Stopped as a job stopped before its check would ("timeout", "shutdown")."""
        job, result = await self._checked(work)
        if job.relay.stopped:  # while it waited: raises the Stopped that stopped it, as a stopped job's iteration does
            await anext(job.relay)
        if job.timer:
            job.timer.cancel()
        return cast(T, result)  # work's own, None too: whether the job was stopped is the job's to say

    async def _checked(self, work: Callable[[], T]) -> tuple[Job, T | None]:
        """A job holding a place (a slot's or the queue's) while work() waits for the checking thread and runs there,
        and work's result; None where the job was stopped first (its deadline, the drain's cut: job.relay.stopped).
        Raises Overloaded, Unavailable, and what work raises."""
        if self.draining:
            raise Unavailable("the server is shutting down")
        if len(self._running) + len(self._queue) + len(self._checking) >= self.parallel + self.max_queue:
            # Every place counted, not the slots decoding alone: in a burst all may wait for their check, and "0 of 2
            # slots are busy" answered a request refused as busy.
            raise Overloaded(f"its places (--parallel {self.parallel}, --max-queue {self.max_queue}) are all taken, "
                             f"{len(self._running)} decoding and {len(self._queue) + len(self._checking)} waiting for "
                             "a slot or for their check")
        loop = asyncio.get_running_loop()
        job = Job(None, loop.time(), Stats())
        if self.timeout:
            job.timer = loop.call_at(job.arrival + self.timeout, self.stop, job, "timeout")
        job.check = loop.run_in_executor(self._checker, work)
        self._checking.add(job)
        self._waiting_changed()
        try:
            await asyncio.wait({job.check})  # stop() cancels it: a check not begun never runs
            return job, None if job.relay.stopped else job.check.result()
        except BaseException:  # the check refused it, or this handler was cancelled: its deadline goes too
            self.stop(job, "cancelled")
            raise
        finally:
            self._checking.discard(job)
            self._waiting_changed()
            job.check = None

    async def unless_cut(self, awaited: Awaitable[T]) -> T:
        """awaited's result, or Stopped("shutdown") once the grace period after shutdown ends first (see unless)."""
        return await unless(awaited, self.until_cut(), "shutdown")

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
        if job.check:
            job.check.cancel()
            self._checking.discard(job)
        self._waiting_changed()

    def drain(self, grace: float) -> None:
        """On the loop, at shutdown: refuse new requests; stop those still queued or decoding after `grace` seconds."""
        self.draining = True
        asyncio.get_running_loop().call_later(grace, self._cut)

    def cut_now(self) -> None:
        """On the loop: end the grace period at once (a second signal while draining)."""
        self.draining = True
        self._cut()

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
        # A stopped job frees its slot after the engine call in progress, which a stuck device or a very long call
        # (a long prompt on a big model) could make hold the shutdown until SIGKILL: those calls fail now.
        self.decoder.slots.terminate_calls()

    async def close(self) -> None:
        self._stop_all("shutdown")  # which cancels the checks not begun; the checking thread stays for the next loop
        if self._running:  # each worker returns after at most one more token; the threads stay the decoder's
            await asyncio.wait({job.relay.worker for job in self._running})

    def _stop_all(self, reason: str) -> None:
        for job in [*self._checking, *self._queue, *self._running]:
            self.stop(job, reason)

    def _waiting_changed(self) -> None:
        self.metrics.queue_depth.set(len(self._queue) + len(self._checking))

    def _start(self, job: Job) -> None:
        job.started = True
        self._running.add(job)
        self.metrics.slots_busy.set(len(self._running))
        job.relay.start(self.decoder.workers, partial(self._deltas, job), held=HELD).add_done_callback(
            lambda _: self._finished(job))

    def _deltas(self, job: Job):
        """The job's items, each posted one (all but HELD) counted in job.decoded."""
        # halt: a stop also ends a long prompt's chunked prefill (CPU) or scoring (echo's logprobs), many calls before
        # the first token
        with closing(self.decoder.stream_request(job.request, job.stats, every_token=True, halt=job.relay.halt,
                                                 token_ids=job.token_ids)) as items:
            for item in items:
                if item not in HELD:
                    job.decoded.append(len(job.token_ids))
                yield item

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
        self._waiting_changed()
        self.metrics.slots_busy.set(len(self._running))
