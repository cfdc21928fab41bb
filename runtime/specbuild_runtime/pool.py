"""The decoder's slots: one per request in flight, handed out first come, first served, and as many as the
memory limit (the machine's, or the container's) holds the KV caches of."""

from __future__ import annotations

import gc
import os
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

from .engine import cgroup_folders
from .errors import RequestError
from .slot import Halt, Slot


# Seconds a thread that drove a busy slot's stream last waits for another thread to resume that stream before
# its own request is refused as a same-thread deadlock (see SlotPool.take).
SAME_THREAD_PATIENCE = 1.0
# While a request waits without a free slot, the pool looks once every this many seconds (the first after this
# long) for a held stream that stood still since its last look, and then runs the cyclic garbage collector: a
# stream abandoned in a reference cycle (a kept exception's traceback holds the frame that held it) keeps its
# slot until a collection closes it, and a process whose threads all wait for a slot starts none, nor does a
# busy one for long (a long stream's generators reach the oldest generation, collected rarely). Only then: a
# full collection costs time in proportion to the process's objects, with the GIL and this pool's lock held
# (0.36 s for a million here), and a saturated decoder, every slot busy decoding, would run one every
# look. Less than SAME_THREAD_PATIENCE: such a stream comes back before its thread is refused.
COLLECT_EVERY = 0.5
# Seconds between a waiting request's looks at its stop event (take(halt)): an async request cancelled while it
# waits for a slot leaves the line this soon, without taking one.
STOP_POLL = 0.05


class SlotPool:
    """Hands out slots, one per running request, first come first served (a thread that gives a slot back and
    asks again queues behind those already waiting). A request waits for a free one, except in a thread that
    last advanced a busy slot's stream: if only that thread will ever advance it (streams interleaved in one
    thread), none may ever come free, so after SAME_THREAD_PATIENCE without another thread taking the stream
    over (as a thread pool running each next() on any worker does) it fails.

    affinity (engines that capture CUDA graphs): a thread gets the slot it had last time when that one is free,
    else one no thread has had yet. onnxruntime keeps CUDA graphs per thread, and a slot's graphs are its own
    (its buffers' addresses), so a thread that kept changing slots would capture every slot's graphs in turn
    (a server of P worker threads and P slots: P² sets of captures, some in requests long after the first),
    where this keeps it at P. Otherwise the free slot that `prefer` scores highest (take(prefer=...): prefix
    reuse's cached prompt tokens, so a chat's next turn lands where its conversation is), the slot freed first
    among equals (see _pick); without `prefer`, the slot freed last: light traffic keeps to one slot, whose
    adaptive γ then learns from every request.
    """

    def __init__(self, slots: list[Slot], affinity: bool = False):
        self.size = len(slots)
        self._slots = slots
        self.affinity = affinity
        self._free = slots[::-1]  # pop() takes slot 0 first
        self._owners: dict[int, int] = {}  # slot index -> thread ident
        self._last: dict[int, int] = {}  # slot index -> the thread that took it last
        self._waiting: list[object] = []  # a ticket per take() in arrival order: slots go first come, first served
        self._collected = float("-inf")  # time.monotonic() of the last look for a collection (see COLLECT_EVERY)
        self._seen: list[int] = []  # the slots' _moves at that look
        self._moves = [0] * self.size  # per slot, its takes and its stream's resumes: a stream standing still keeps it
        # A slot came free, a waiter left the line, or a held stream moved to another thread. Re-entrant: a
        # generator closed by the GC may release inside take().
        self._changed = threading.Condition(threading.RLock())

    @property
    def in_use(self) -> int:
        return self.size - len(self._free)

    @property
    def waiting(self) -> int:
        """Calls waiting for a slot (a service's queue depth)."""
        return len(self._waiting)

    def claim(self, slot: Slot) -> None:
        """Record the calling thread as the one driving slot's stream (a stream may move between threads, as
        when a web framework advances a sync generator with one worker-thread call per item)."""
        me = threading.get_ident()
        self._moves[slot.index] += 1
        if self._owners.get(slot.index) != me:  # moved: a thread waiting in take() may no longer be its driver
            with self._changed:
                self._owners[slot.index] = me
                self._changed.notify_all()

    @contextmanager
    def take(self, halt: Halt | None = None, prefer: Callable[[Slot], int] | None = None) -> Iterator[Slot]:
        """A slot for the calling thread; a RequestError instead once `halt` is set while it waits. prefer: a
        score of a free slot for this request (without affinity), called with the pool's lock held."""
        me = threading.get_ident()
        with self._changed:
            ticket = object()
            self._waiting.append(ticket)
            try:
                self._wait_for_turn(me, ticket, halt)
            finally:
                self._waiting.remove(ticket)
                # The next in line may take a slot now, or has to start counting its patience.
                self._changed.notify_all()
            slot = self._pick(me, prefer)
            self._owners[slot.index] = self._last[slot.index] = me
            self._moves[slot.index] += 1
        try:
            yield slot
        finally:
            with self._changed:
                del self._owners[slot.index]
                # Its calls returned by now: a slot given back runs calls again. A call that failed left the cache's
                # positions from its first on unreliable, and slot.kept (prefix reuse) below them.
                slot.allow_calls()
                self._free.append(slot)
                self._changed.notify_all()  # whoever is first in line (notify() might wake another, who waits on)

    def terminate_calls(self) -> None:
        """From any thread: fail the engine call in progress of every slot in use, and each call its request makes
        after it, until the request gives the slot back (a server's shutdown need not wait for a stuck or very long
        call: serve's Scheduler, at the end of the grace period)."""
        with self._changed:  # a slot given back meanwhile would keep its calls refused for the next request
            for slot in self._slots:
                if slot.index in self._owners:
                    slot.terminate_calls()

    def _wait_for_turn(self, me: int, ticket: object, halt: Halt | None) -> None:
        """Wait until a slot is free for this ticket: the earliest waiters take the free slots first, so a
        thread that just gave one back cannot take it again ahead of those already waiting."""
        refuse_at = None  # while this thread drove a busy slot's stream last: when to stop waiting for it
        began, at_begin = time.monotonic(), list(self._moves)
        while not (self._free and self._waiting.index(ticket) < len(self._free)):
            if halt is not None and halt.is_set():
                raise RequestError("the request was stopped while it waited for a slot")
            now = time.monotonic()
            collect_at = max(began, self._collected) + COLLECT_EVERY
            if not self._free and now >= collect_at:
                # Since the last look by any waiter (or this one's start, if later): compared with this waiter's own
                # last look, a stream that moved before another's look and stood still since looked moved, and came
                # back a look later per waiter in line, its thread refused meanwhile.
                seen = self._seen if self._collected > began else at_begin
                self._collected, self._seen = now, list(self._moves)
                if any(a == b for a, b in zip(self._seen, seen)):  # one stood still since: abandoned, maybe
                    gc.collect()  # closes unreachable streams in this thread: their slots come back (re-entrantly)
                continue
            if self._free or me not in self._owners.values():  # free slots go to the waiters ahead first
                refuse_at = None
                self._wait(None if self._free else collect_at - now, halt)
                continue
            # This thread advanced a held stream last. If only this thread will ever advance it (streams
            # interleaved in one thread), waiting is a deadlock; but in a thread pool that runs each next()
            # of a stream wherever a worker is free (asyncio.to_thread, Starlette's StreamingResponse over a
            # sync generator), another worker resumes it and claim() moves it there. Wait that long.
            refuse_at = refuse_at or now + SAME_THREAD_PATIENCE
            if now >= refuse_at:
                raise RequestError(
                    f"all {self.size} slots of this decoder are in use, one by an unfinished generate/stream this "
                    f"same thread last advanced and no other thread resumed within {SAME_THREAD_PATIENCE:g} s: "
                    "finish or close() it first, or create the decoder with parallel > "
                    f"{self.size}"
                )
            self._wait(min(refuse_at, collect_at) - now, halt)

    def _wait(self, timeout: float | None, halt: Halt | None) -> None:
        """Wait for a change, at most timeout seconds, and while a halt event is given at most STOP_POLL (setting
        an event notifies no condition)."""
        if halt is not None:
            timeout = STOP_POLL if timeout is None else min(timeout, STOP_POLL)
        self._changed.wait(timeout)

    def _pick(self, me: int, prefer: Callable[[Slot], int] | None = None) -> Slot:
        """Take a free slot for thread `me`: with affinity its own of last time, else one never taken; else the
        one prefer scores highest, the first freed among equals (the conversation answered longest ago: a chat
        just answered is the likeliest to send its next turn, which then finds its cache, as an LRU cache keeps)."""
        if not self.affinity:
            if prefer is None or len(self._free) == 1:
                return self._free.pop()
            slot = max(self._free, key=prefer)  # the first of equals, and _free runs from the first freed
            self._free.remove(slot)
            return slot
        mine = [slot for slot in self._free if self._last.get(slot.index) == me]
        unused = [slot for slot in self._free if slot.index not in self._last]
        slot = (mine or unused[-1:] or self._free)[-1]
        self._free.remove(slot)
        return slot


# A container, or a systemd unit, is killed at its cgroup's memory limit (or an ancestor's), not the machine's.
def memory_limit() -> tuple[int, str]:
    """(bytes, what they are): the machine's memory, or the lowest limit of this process's cgroups if less (v2's
    memory.max, v1's memory.limit_in_bytes, of its cgroup and its ancestors)."""
    limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine has"
    for folder, v2 in cgroup_folders("memory"):
        try:
            text = (folder / ("memory.max" if v2 else "memory.limit_in_bytes")).read_text().strip()
        except (OSError, UnicodeDecodeError):
            continue
        if text.isdigit() and int(text) < limit[0]:  # "max" (v2) or a huge number (v1) when unlimited
            limit = int(text), "this container may use"
    return limit


def check_memory(parallel: int, slot_bytes: int) -> None:
    """Refuse a slot count whose KV caches alone would not fit in this machine's (or container's) memory:
    each slot holds its caches for the whole context from the start."""
    total, where = memory_limit()
    if parallel * slot_bytes > total:
        raise RequestError(f"parallel {parallel} needs {_size(parallel * slot_bytes)} of KV caches "
                           f"({_size(slot_bytes)} a slot) but {where} {_size(total)}; use fewer slots or compile "
                           "with a shorter --max-seq-len")


def _size(size: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20)):
        if size >= 1 << shift:
            return f"{size / (1 << shift):.1f} {unit}"
    return f"{size / 1024:.1f} KiB"
