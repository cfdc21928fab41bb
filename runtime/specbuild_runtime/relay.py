"""A decoder's sync stream run in a worker thread and iterated on an asyncio event loop, which only moves tokens
and text: it never waits for a decode step. SpeculativeDecoder.astream/astream_text/agenerate and `specbuild
serve`'s scheduler both decode through a Relay, in the decoder's worker threads (SpeculativeDecoder.workers)."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Executor
from contextlib import closing
from typing import Any, Callable, Generator

END = object()  # the stream ended: the last item of a relay


class Relay:
    """`async for item in relay`: the items of a sync stream that a worker thread iterates.

    The worker hands each item to the loop (call_soon_threadsafe) and, after every item, checks whether the relay
    was stopped; if so it closes the stream, which gives the decoder's slot back at once: decoding ends within the
    round in progress. Iteration raises what the stream raised (the same exception object), or the error that
    stop() was given.

    The worker never waits for its consumer: the items a slow one has not read yet stay queued, at most the
    request's tokens (max_new_tokens, within the context), and the slot is free as soon as decoding ends. vLLM's
    AsyncLLM does the same (a slow consumer's outputs are merged, the engine does not wait for it). A bounded queue
    would keep a slot, 1/parallel of the decoder, busy for as long as its slowest reader takes.
    """

    def __init__(self) -> None:
        self._items: asyncio.Queue = asyncio.Queue()
        self.halt = threading.Event()  # read by the worker after every item, and while its stream waits for a slot
        # Whether the worker has begun (under the lock, with its look at halt): one that has not will return at once
        # when it does, so close() need not wait for a worker thread to come free (behind other requests).
        self._began = False
        self._lock = threading.Lock()
        self._last: Any = None  # END or the exception iteration ended with: every later __anext__ ends so again
        self.finished = False  # set by the worker once the stream ended and every item was posted
        self.first_item_at: float | None = None  # time.monotonic() when the worker posted the first item
        self.worker: asyncio.Future  # from start(): the worker's run, done once it returned, its slot free

    @property
    def stopped(self) -> bool:
        return self.halt.is_set()

    def start(self, workers: Executor, stream: Callable[[], Generator], held: tuple = ()) -> asyncio.Future:
        """Iterate stream() in a worker. Items in `held` are not posted: they only let the worker stop between
        tokens ("" for a token whose text is held back). Returns the worker's future."""
        loop = asyncio.get_running_loop()
        self.worker = loop.run_in_executor(workers, self._iterate, loop.call_soon_threadsafe, stream, held)
        self.worker.add_done_callback(self._returned)
        return self.worker

    def stop(self, error: BaseException | None = None) -> None:
        """Stop the worker after the item it is producing. With an error, iteration raises it after the items
        posted so far."""
        self.halt.set()
        if error is not None:
            self._items.put_nowait(error)

    async def close(self) -> None:
        """stop(), then wait for the worker to return: its slot is free by then. A worker not yet begun (its request
        queued behind others for a worker thread) is not waited for: it will return at once, having taken no slot.
        A cancelled wait leaves the worker to stop on its own; nothing cancels the worker's future, which would end
        before the worker does."""
        self.stop()
        with self._lock:
            began = self._began
        if began:
            await asyncio.wait({self.worker})

    def __aiter__(self) -> Relay:
        return self

    async def __anext__(self) -> Any:
        if self._last is None:
            item = await self._items.get()
            if item is not END and not isinstance(item, BaseException):
                return item
            self._last = item
        if self._last is END:
            raise StopAsyncIteration
        raise self._last

    def _returned(self, worker: asyncio.Future) -> None:
        """On the loop, once the worker returned: after its items (posted before), the end or its exception."""
        self._items.put_nowait(END if worker.cancelled() else worker.exception() or END)

    def _iterate(self, post: Callable, stream: Callable[[], Generator], held: tuple) -> None:
        """In a worker thread: stream()'s items posted to the loop (post), until it ends or halt is set."""
        with self._lock:
            if self.halt.is_set():  # stopped while it waited for this thread: nothing decoded, no slot taken
                return
            self._began = True
        with closing(stream()) as items:
            for item in items:
                if item not in held:
                    self.first_item_at = self.first_item_at or time.monotonic()
                    post(self._items.put_nowait, item)
                if self.halt.is_set():
                    return  # closing() ends the stream here, which frees its slot
        self.finished = True
