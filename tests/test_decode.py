"""The runtime API: one decoder shared by threads, interleaved streams, the async API, stop strings, streamed text."""

import asyncio
import gc
import json
import math
import random
import subprocess
import sys
import threading
import time
import typing
from collections import Counter
from collections.abc import AsyncGenerator, Generator
from contextlib import closing
from pathlib import Path
from types import SimpleNamespace

import onnxruntime as ort
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from conftest import PROMPTS, make_tokenizer
from specbuild_runtime import DeviceError, RequestError, SpeculativeDecoder, Stats, TokenLogprobs, load_manifest, pool
from specbuild_runtime.policy import MAX_PROBE_EVERY, PROBE_EVERY, FixedGamma
from specbuild_runtime.slot import EngineSlot, fixed_rows
from specbuild_runtime.text import TextStream

# (prompt, options): greedy with adaptive and fixed γ, and seeded sampling (at fixed γ here; auto below).
REQUESTS = [
    (PROMPTS[0], dict(gamma="auto")),
    (PROMPTS[2], dict(gamma=3)),
    (PROMPTS[4], dict(gamma=0)),
    (PROMPTS[5], dict(gamma=8)),
    (PROMPTS[1], dict(gamma=2, temperature=1.0, seed=11)),
    (PROMPTS[3], dict(gamma=4, temperature=0.7, top_p=0.9, seed=12)),
    (PROMPTS[6], dict(gamma=0, temperature=1.0, top_k=20, seed=13)),
    (PROMPTS[8], dict(gamma=1, temperature=1.3, seed=14)),
]
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def bundle(bundles):
    return bundles("llama", draft_seed=1)


@pytest.fixture(scope="module")
def sequential(bundle):
    decoder = SpeculativeDecoder(bundle)
    return [decoder.generate(prompt, NEW_TOKENS, **options).token_ids for prompt, options in REQUESTS]


def test_eight_threads_on_one_decoder_get_their_sequential_outputs(bundle, sequential):
    decoder = SpeculativeDecoder(bundle, parallel=4)
    results = [None] * len(REQUESTS)
    start = threading.Barrier(len(REQUESTS))

    def run(i):
        prompt, options = REQUESTS[i]
        start.wait()
        results[i] = [decoder.generate(prompt, NEW_TOKENS, **options).token_ids for _ in range(2)]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(REQUESTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [[expected, expected] for expected in sequential]
    assert decoder.slots.in_use == 0


# How a stress request's caller ends it: to its end (generate, a stream read whole, streamed text); after
# its first few tokens (closed, dropped unclosed, left by an exception in the loop reading it); or by an engine
# call that fails part-way (onnxruntime's terminate flag), after which its slot must decode as before.
ENDINGS = ["generate", "stream", "stream_text", "close", "drop", "raise", "fail"]


def stress_requests(decoder, count: int, seed: int) -> list[tuple[str, list[int], int, dict, int]]:
    """(ending, prompt ids, max_new_tokens, options, tokens read or engine calls before failing): greedy and
    seeded sampling (top-k, top-p) at auto and fixed γ, some with stop strings, some running into the context."""
    r = random.Random(seed)
    text = decoder.encode("".join(PROMPTS) * 4)
    requests = []
    for _ in range(count):
        length = r.choice([1, 7, 30, decoder.max_seq_len - 12, decoder.max_seq_len])
        start = r.randrange(len(text) - length)
        options = dict(gamma=r.choice(["auto", "auto", 0, 1, 3, decoder.max_gamma]))
        if r.random() < 0.4:
            options.update(temperature=r.choice([0.7, 1.0]), top_k=r.choice([0, 20]), top_p=r.choice([1.0, 0.9]),
                           seed=r.randrange(0, 1099))
        if r.random() < 0.4:
            options["stop"] = r.sample(["(", " =", "self", "e", "\n", " "], 2)
        requests.append((r.choice(ENDINGS), text[start:start + length], r.choice([1, 6, 30]), options, r.randrange(1, 8)))
    return requests


@pytest.mark.parametrize("parallel", [2, 4])
def test_eight_threads_ending_requests_every_way_each_get_their_sequential_outputs(bundle, monkeypatch, parallel):
    """A seeded mix on 8 threads over 2 or 4 slots: every request, and the prefix of every one ended early, is what
    it decodes alone; an abandoned or failed request gives its slot back, and no slot is left held."""
    alone = SpeculativeDecoder(bundle)
    requests = stress_requests(alone, 48, seed=parallel)
    expected = [alone.generate(prompt, new, **options) for _, prompt, new, options, _ in requests]
    assert {e.stats.finish_reason for e in expected} >= {"max_new_tokens", "stop", "context"}
    decoder = SpeculativeDecoder(bundle, parallel=parallel)
    fail_after = threading.local()  # engine calls the current thread's request makes before one fails
    graph = EngineSlot._graph

    def failing(self, *args):
        calls = getattr(fail_after, "calls", None)
        if calls is not None:
            fail_after.calls = calls - 1
            if calls == 0:
                options = ort.RunOptions()
                options.terminate = True
                return options
        return graph(self, *args)

    monkeypatch.setattr(EngineSlot, "_graph", failing)
    got = [None] * len(requests)
    start = threading.Barrier(8)

    def run(thread: int) -> None:
        start.wait()
        for i in range(thread, len(requests), 8):
            ending, prompt, new, options, k = requests[i]
            if ending == "generate":
                got[i] = decoder.generate(prompt, new, **options).token_ids
            elif ending == "stream":
                got[i] = list(decoder.stream(prompt, new, **options))
            elif ending == "stream_text":
                got[i] = "".join(decoder.stream_text(prompt, new, **options))
            elif ending == "fail":
                fail_after.calls = k
                try:
                    got[i] = decoder.generate(prompt, new, **options).token_ids  # ended before its k-th call
                except DeviceError:
                    got[i] = "failed"
                fail_after.calls = None
            else:
                stream, got[i] = decoder.stream(prompt, new, **options), []
                try:
                    for token in stream:
                        got[i].append(token)
                        if len(got[i]) == k:
                            if ending == "raise":
                                raise KeyError(token)
                            break
                except KeyError:
                    pass
                if ending == "close":
                    stream.close()
                del stream  # "drop": the only reference, so its slot comes back here

    threads = [threading.Thread(target=run, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for (ending, _, _, _, k), result, reference in zip(requests, got, expected):
        if ending == "stream_text":
            assert result == reference.text
        elif ending in ("close", "drop", "raise"):
            assert result == reference.token_ids[:k]
        elif result != "failed":
            assert result == reference.token_ids
    assert "failed" in got and decoder.slots.in_use == 0 and decoder.slots.waiting == 0
    monkeypatch.setattr(EngineSlot, "_graph", graph)
    for (_, prompt, new, options, _), reference in list(zip(requests, expected))[:6]:
        assert decoder.generate(prompt, new, **options).token_ids == reference.token_ids


def test_a_thread_waits_for_a_slot_held_by_a_stream_another_thread_now_drives(bundle, sequential):
    """The stream starts here and moves to a worker: this thread no longer holds the slot, so its own
    generate waits for the worker to finish instead of being refused as a same-thread deadlock."""
    decoder = SpeculativeDecoder(bundle, parallel=1)
    (prompt, options), (other, other_options) = REQUESTS[1], REQUESTS[2]
    moved = decoder.stream(prompt, NEW_TOKENS, **options)
    first = [next(moved)]
    resumed = threading.Event()

    def finish():
        first.append(next(moved))
        resumed.set()
        first.extend(moved)

    worker = threading.Thread(target=finish, daemon=True)
    worker.start()
    assert resumed.wait(60)
    assert decoder.generate(other, NEW_TOKENS, **other_options).token_ids == sequential[2]
    worker.join(60)
    assert first == sequential[1]


def test_a_thread_that_drove_a_stream_last_waits_while_another_thread_resumes_it(bundle, sequential, monkeypatch):
    """A thread pool that runs each next() of a stream on whichever worker is free (asyncio.to_thread,
    Starlette's StreamingResponse over a sync generator): the worker that advanced a stream last may be
    handed the first next() of another request while a second worker is about to resume the first stream.
    It must wait for the slot, not be refused as a same-thread deadlock."""
    monkeypatch.setattr(pool, "SAME_THREAD_PATIENCE", 60)  # however late the worker is scheduled on a busy machine
    decoder = SpeculativeDecoder(bundle, parallel=1)
    (prompt, options), (other, other_options) = REQUESTS[1], REQUESTS[2]
    moved = decoder.stream(prompt, NEW_TOKENS, **options)
    first = [next(moved)]  # this thread advanced it last

    def finish():
        while not decoder.slots.waiting:  # until this thread waits for the slot below
            time.sleep(0.001)
        first.extend(moved)

    worker = threading.Thread(target=finish, daemon=True)
    worker.start()
    assert decoder.generate(other, NEW_TOKENS, **other_options).token_ids == sequential[2]
    worker.join(60)
    assert first == sequential[1]


def test_slots_go_to_waiting_threads_first_come_first_served(bundle):
    """A thread that gives a slot back and asks again at once must queue behind the threads already waiting:
    otherwise, under steady load, the threads that hold slots keep them and a waiting request can wait for
    hundreds of later ones (50 threads on 2 slots: first token p50 5 ms, p99 11 s)."""
    decoder = SpeculativeDecoder(bundle, parallel=1)
    order, switch = [], sys.getswitchinterval()
    held = decoder.stream(PROMPTS[0], NEW_TOKENS)
    next(held)

    def waiter():
        decoder.generate(PROMPTS[1], 5)
        order.append("waiting thread")

    worker = threading.Thread(target=waiter, daemon=True)
    worker.start()
    while not decoder.slots.waiting:  # until the worker waits for the slot
        time.sleep(0.001)
    sys.setswitchinterval(5)  # this thread keeps the GIL as long as it runs Python, as a busy server's would
    try:
        held.close()  # gives the slot back...
        decoder.generate(PROMPTS[2], 5)  # ...and asks again at once
        order.append("thread that gave it back")
    finally:
        sys.setswitchinterval(switch)
    worker.join(60)
    assert order == ["waiting thread", "thread that gave it back"]
    assert decoder.slots.in_use == 0


def test_interleaved_streams_in_one_thread_each_decode_as_alone(bundle, sequential):
    decoder = SpeculativeDecoder(bundle, parallel=2)
    a, b = (decoder.stream(prompt, NEW_TOKENS, **options) for prompt, options in (REQUESTS[1], REQUESTS[4]))
    got = [[], []]
    for _ in range(NEW_TOKENS):  # alternate token by token
        for tokens, stream in zip(got, (a, b)):
            token = next(stream, None)
            if token is not None:
                tokens.append(token)
    assert got == [sequential[1], sequential[4]]


def test_a_second_stream_in_the_same_thread_without_a_free_slot_is_an_error_not_a_deadlock(bundle):
    decoder = SpeculativeDecoder(bundle, parallel=1)
    first = decoder.stream(PROMPTS[0], NEW_TOKENS)
    next(first)
    second = decoder.stream(PROMPTS[1], NEW_TOKENS)
    with pytest.raises(RequestError, match="parallel > 1"):
        next(second)
    first.close()  # frees the slot
    assert len(decoder.generate(PROMPTS[1], 5).token_ids) == 5


def test_an_abandoned_stream_frees_its_slot_when_garbage_collected(bundle):
    decoder = SpeculativeDecoder(bundle, parallel=1)
    stream = decoder.stream(PROMPTS[0], NEW_TOKENS)
    next(stream)
    assert decoder.slots.in_use == 1
    del stream
    gc.collect()
    assert decoder.slots.in_use == 0


def test_a_stream_closed_before_its_end_finishes_as_aborted_and_one_closed_at_its_last_token_as_itself(bundle):
    """As vLLM's "abort"; "" before. A consumer that closes the stream once it has the last token (it knows the
    count it asked for) still reads why decoding ended."""
    decoder = SpeculativeDecoder(bundle)
    stats = Stats()
    stream = decoder.stream(PROMPTS[0], NEW_TOKENS, stats=stats)
    next(stream), next(stream)
    stream.close()
    assert stats.finish_reason == "abort"
    stats = Stats()
    stream = decoder.stream(PROMPTS[0], 3, stats=stats)
    [next(stream) for _ in range(3)]
    stream.close()
    assert stats.finish_reason == "max_new_tokens"


@pytest.mark.parametrize("waiter", ["same thread", "another thread"])
def test_a_stream_abandoned_in_a_reference_cycle_comes_back_to_a_request_waiting_for_its_slot(bundle, sequential, waiter):
    """A consumer that keeps the exception it met: the traceback holds the frame that held the stream, a cycle
    that only the cyclic garbage collector frees. Automatic collection is off here, as in a process whose
    threads all wait for a slot and allocate nothing that would start one: the other thread waited forever,
    this one was refused as if it had left a stream unfinished."""
    decoder = SpeculativeDecoder(bundle, parallel=1)

    def consume() -> None:
        stream, kept = decoder.stream(PROMPTS[0], NEW_TOKENS), []
        try:
            for _ in stream:
                raise ValueError("the consumer failed")
        except ValueError as exc:
            kept.append(exc)  # kept -> exc -> its traceback -> this frame -> kept

    prompt, options = REQUESTS[1]
    results = []
    gc.disable()
    try:
        consume()
        assert decoder.slots.in_use == 1
        if waiter == "same thread":
            results.append(decoder.generate(prompt, NEW_TOKENS, **options).token_ids)
        else:
            worker = threading.Thread(target=lambda: results.append(decoder.generate(prompt, NEW_TOKENS, **options).token_ids),
                                      daemon=True)
            worker.start()
            worker.join(60)
    finally:
        gc.enable()
    assert results == [sequential[1]] and decoder.slots.in_use == 0


def test_a_request_waiting_for_a_slot_collects_garbage_only_after_a_held_stream_stood_still(bundle, sequential,
                                                                                             monkeypatch):
    """The collection that brings back a stream abandoned in a reference cycle costs time in proportion to all the
    process's objects (0.36 s for a million here), with the GIL held: run every half second while threads queue
    for busy slots, it took 9-14 s of 22 (a million objects, 3 threads on 1 slot). A stream that moved since the
    waiting request's last look is not abandoned. The test moves a clock and the held stream between its looks."""
    clock, collections, paused = [0.0], [], [True]
    looked, go_on = threading.Semaphore(0), threading.Semaphore(0)
    monkeypatch.setattr(pool, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(pool, "gc", SimpleNamespace(collect=lambda: collections.append(clock[0])))
    wait = pool.SlotPool._wait

    def held_wait(self, timeout, halt):  # the waiting request's pause between looks: until the test goes on
        if paused[0]:
            looked.release()
            go_on.acquire()
        else:
            wait(self, timeout, halt)

    monkeypatch.setattr(pool.SlotPool, "_wait", held_wait)
    decoder = SpeculativeDecoder(bundle, parallel=1)
    held = decoder.stream(PROMPTS[0], NEW_TOKENS)
    next(held)
    (prompt, options), result = REQUESTS[1], []
    worker = threading.Thread(target=lambda: result.append(decoder.generate(prompt, NEW_TOKENS, **options).token_ids),
                              daemon=True)
    worker.start()
    try:
        assert looked.acquire(timeout=60)  # it waits for the slot
        for _ in range(3):  # the held stream moves between looks
            next(held)
            clock[0] += 1
            go_on.release()
            assert looked.acquire(timeout=60)
        assert collections == []
        clock[0] += 1  # and now stands still
        go_on.release()
        assert looked.acquire(timeout=60)
        assert collections == [4.0]
    finally:  # the waiting request holds the pool's lock while paused
        paused[0] = False
        go_on.release()
    held.close()
    worker.join(60)
    assert result == [sequential[1]]


def test_a_held_stream_that_stood_still_since_another_waiters_look_is_collected_at_the_next_look(monkeypatch):
    """Several requests waiting look in turn, each half a second after the last look by any of them. Each compared the
    slots with its own last look, so a stream that moved just before one waiter's look and then stood still looked
    moved to every waiter that had last looked before that move: it came back a look later for each of them, and the
    thread that had abandoned it (in a reference cycle) was refused meanwhile, after SAME_THREAD_PATIENCE (8 threads
    on 2 slots, the demo pair: 8 of 300 requests). The test moves a clock and the held stream between two waiters'
    looks."""
    clock, collections = [0.0], []
    monkeypatch.setattr(pool, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(pool, "gc", SimpleNamespace(collect=lambda: collections.append(clock[0])))
    paused = {name: threading.Semaphore(0) for name in "ab"}
    turn: list[str | None] = [None]
    wait = pool.SlotPool._wait

    def held_wait(self, timeout, halt):  # a waiter's pause between looks: until the test gives it its turn
        me = threading.current_thread().name
        if turn[0] == "all":
            return wait(self, timeout, halt)
        paused[me].release()
        while turn[0] not in (me, "all"):
            self._changed.wait(0.01)  # lets the other waiter in meanwhile
        if turn[0] == me:
            turn[0] = None

    def look(waiter: str) -> None:
        turn[0] = waiter
        assert paused[waiter].acquire(timeout=60)

    monkeypatch.setattr(pool.SlotPool, "_wait", held_wait)
    slots = pool.SlotPool([SimpleNamespace(index=0, allow_calls=lambda: None)])
    held = slots.take()
    slot = held.__enter__()

    def take_and_give_back() -> None:
        with slots.take():
            pass

    waiters = [threading.Thread(target=take_and_give_back, name=name, daemon=True) for name in "ab"]
    try:
        for waiter in waiters:
            waiter.start()
            assert paused[waiter.name].acquire(timeout=60)
        slots.claim(slot)  # the stream moves,
        clock[0] = 1.0
        look("a")
        slots.claim(slot)  # and moves again,
        clock[0] = 2.0
        look("b")
        clock[0] = 3.0  # and now stands still: a's look is the first since it stood still
        look("a")
        assert collections == [3.0]
    finally:
        turn[0] = "all"
        held.__exit__(None, None, None)
        for waiter in waiters:
            waiter.join(60)


def test_a_stream_closed_at_the_token_that_filled_the_context_finishes_as_context(bundle):
    """As at eos or max_new_tokens: a consumer that counted the context's room (as serve's chat default does)
    and closes at that token reads why decoding ended, not "abort"."""
    decoder = SpeculativeDecoder(bundle)
    prompt = decoder.encode(PROMPTS[5]) * 20
    prompt = prompt[: decoder.max_seq_len - 3]
    whole = decoder.generate(prompt, 100, gamma=2)
    assert whole.stats.finish_reason == "context"
    stats = Stats()
    stream = decoder.stream(prompt, 100, gamma=2, stats=stats)
    assert [next(stream) for _ in whole.token_ids] == whole.token_ids
    stream.close()
    assert stats.finish_reason == "context"


def test_one_stats_given_to_two_requests_waiting_for_a_slot_is_refused_to_the_second(bundle):
    """Both checked their Stats before the wait, while it was still new: the second then decoded into the first's
    figures and ended after one token, finish_reason "max_new_tokens", unsaid."""
    decoder = SpeculativeDecoder(bundle)
    holder = decoder.stream(PROMPTS[0], NEW_TOKENS, gamma=0)
    next(holder)  # holds the only slot
    stats, outcomes = Stats(), []

    def decode():
        try:
            outcomes.append(len(list(decoder.stream(PROMPTS[1], 6, gamma=0, ignore_eos=True, stats=stats))))
        except RequestError as error:
            outcomes.append(str(error))

    threads = [threading.Thread(target=decode) for _ in range(2)]
    for thread in threads:
        thread.start()
    time.sleep(0.5)  # both wait for the slot
    holder.close()
    for thread in threads:
        thread.join(60)
    refused = [outcome for outcome in outcomes if isinstance(outcome, str)]
    assert [outcome for outcome in outcomes if isinstance(outcome, int)] == [6], outcomes
    assert len(refused) == 1 and "pass a new Stats() to each call" in refused[0], outcomes
    assert stats.generated_tokens == 6, stats


def test_a_new_stats_of_a_subclass_is_no_other_requests_figures(bundle):
    """stats != Stats() held for every subclass (dataclass __eq__ compares one class only): a new one was refused."""
    class Timed(Stats):
        @property
        def seconds(self) -> float:
            return self.token_times[-1] if self.token_times else 0.0

    stats = Timed()
    assert len(list(SpeculativeDecoder(bundle).stream(PROMPTS[0], 4, gamma=0, ignore_eos=True, stats=stats))) == 4
    assert stats.generated_tokens == 4 and stats.seconds > 0


@pytest.mark.parametrize("stats", [Stats, {}, None], ids=["the class", "a dict", "None"])
def test_stats_or_a_request_of_another_type_is_a_request_error_that_leaves_the_slot_free(bundle, stats):
    """stats=Stats (no parentheses) passed the check that a Stats is new, wrote the request's prompt_tokens into the
    class and then failed on an attribute only instances have; a dict, or None given to stream_request, and a prompt
    given to stream_request in place of a request, failed as AttributeErrors from the decoding loop."""
    decoder = SpeculativeDecoder(bundle, parallel=1)
    with pytest.raises(RequestError, match="stats must be a new Stats"):
        next(decoder.stream_request(decoder.request(PROMPTS[0], 4), stats))
    if stats is not None:
        with pytest.raises(RequestError, match="stats must be a new Stats"):
            next(decoder.stream(PROMPTS[0], 4, stats=stats))
    with pytest.raises(RequestError, match=r"what decoder\.request\(\.\.\.\) returns"):
        next(decoder.stream_request(PROMPTS[0], Stats()))
    assert Stats.prompt_tokens == 0 and decoder.slots.in_use == 0
    assert len(decoder.generate(PROMPTS[1], 5).token_ids) == 5


def test_stats_of_another_type_is_refused_before_the_request_waits_for_a_slot(bundle):
    """Checked with a slot held, it waited for one first: another thread's request as long as every slot stayed busy,
    and this one, whose stream holds the slot, was refused as a same-thread deadlock instead."""
    decoder = SpeculativeDecoder(bundle, parallel=1)
    with closing(decoder.stream(PROMPTS[0], NEW_TOKENS)) as held:
        next(held)
        with pytest.raises(RequestError, match="stats must be a new Stats"):
            next(decoder.stream(PROMPTS[1], 4, stats={}))
        with pytest.raises(RequestError, match="stats must be a new Stats"):
            next(decoder.stream_request(decoder.request(PROMPTS[1], 4), None))


def test_a_stream_that_was_never_started_holds_no_slot(bundle):
    decoder = SpeculativeDecoder(bundle, parallel=1)
    unused = decoder.stream(PROMPTS[0], NEW_TOKENS)
    assert decoder.slots.in_use == 0 and len(decoder.generate(PROMPTS[1], 5).token_ids) == 5
    assert len(list(unused)) == NEW_TOKENS


def test_async_streams_and_generate_give_what_the_sync_api_gives(bundle, sequential):
    decoder = SpeculativeDecoder(bundle)
    whole = decoder.generate(PROMPTS[0], NEW_TOKENS).text
    requests = [*REQUESTS, (PROMPTS[0], dict(stop=[whole[12:15]]))]  # a stop string the text meets
    expected = [decoder.generate(prompt, NEW_TOKENS, **options) for prompt, options in requests]

    async def run():
        tokens = [[token async for token in decoder.astream(prompt, NEW_TOKENS, **options)] for prompt, options in requests]
        texts = ["".join([delta async for delta in decoder.astream_text(prompt, NEW_TOKENS, **options)])
                 for prompt, options in requests]
        return tokens, texts, [await decoder.agenerate(prompt, NEW_TOKENS, **options) for prompt, options in requests]

    tokens, texts, generations = asyncio.run(run())
    assert tokens == [g.token_ids for g in expected] and tokens[:len(REQUESTS)] == sequential
    assert texts == [g.text for g in expected] and expected[-1].stats.finish_reason == "stop"
    assert [(g.text, g.token_ids, g.stats.finish_reason) for g in generations] == [
        (g.text, g.token_ids, g.stats.finish_reason) for g in expected]
    assert decoder.slots.in_use == 0


def test_concurrent_tasks_on_one_decoder_get_their_sequential_outputs(bundle, sequential):
    decoder = SpeculativeDecoder(bundle, parallel=2)

    async def streamed(prompt, options):
        return [token async for token in decoder.astream(prompt, NEW_TOKENS, **options)]

    async def run():
        return await asyncio.gather(*(streamed(prompt, options) for prompt, options in REQUESTS),
                                    *(decoder.agenerate(prompt, NEW_TOKENS, **options) for prompt, options in REQUESTS))

    results = asyncio.run(run())
    assert results[:len(REQUESTS)] == sequential
    assert [g.token_ids for g in results[len(REQUESTS):]] == sequential
    assert decoder.slots.in_use == 0


class PauseAfterFirstToken:
    """The decoder's requests stop decoding after their first token until `go` is set; `paused` is set when
    one does, and `tokens` counts what each decoded."""

    def __init__(self, decoder):
        self.paused, self.go, self.tokens = threading.Event(), threading.Event(), []
        run = decoder._decode_request

        def paused(*args):
            self.tokens.append(0)
            with closing(run(*args)) as tokens:
                for token in tokens:
                    self.tokens[-1] += 1
                    yield token
                    self.paused.set()
                    self.go.wait()

        decoder._decode_request = paused


async def streamed(decoder, prompt):
    return [token async for token in decoder.astream(prompt, 200)]


async def streamed_text(decoder, prompt):
    return [delta async for delta in decoder.astream_text(prompt, 200)]


ASYNC_CALLS = {"astream": streamed, "astream_text": streamed_text,
               "agenerate": lambda decoder, prompt: decoder.agenerate(prompt, 200)}


@pytest.mark.parametrize("call", ASYNC_CALLS)
def test_cancelling_a_task_stops_its_decoding_within_a_round_and_frees_the_slot(bundle, sequential, call):
    decoder = SpeculativeDecoder(bundle, parallel=1)
    pause = PauseAfterFirstToken(decoder)

    async def run():
        task = asyncio.ensure_future(ASYNC_CALLS[call](decoder, PROMPTS[2]))
        assert await asyncio.to_thread(pause.paused.wait, 60)  # the worker is paused after the first token
        task.cancel()
        asyncio.get_running_loop().call_soon(pause.go.set)  # after the task's cancellation ran (callbacks run in order)
        with pytest.raises(asyncio.CancelledError):
            await task
        in_use = decoder.slots.in_use
        return in_use, await asyncio.wait_for(decoder.agenerate(REQUESTS[1][0], NEW_TOKENS, **REQUESTS[1][1]), 60)

    in_use, after = asyncio.run(run())
    assert in_use == 0 and pause.tokens[0] <= 1 + decoder.max_gamma + 1  # the first token, then one round at most
    assert after.token_ids == sequential[1]


@pytest.mark.parametrize("holder", ["task", "sync stream"])
def test_a_task_cancelled_while_its_request_waits_for_a_slot_ends_at_once_without_taking_one(bundle, sequential, holder):
    """The only slot is held by another task's request (so the only worker thread is busy too) or by a sync stream.
    A wait_for timing out around a request queued behind it used to end only once the holder finished (30 s
    here, when the watchdog lets it go on), and the cancelled request then took the slot and decoded a token."""
    decoder = SpeculativeDecoder(bundle, parallel=1)
    pause = PauseAfterFirstToken(decoder)
    (prompt, options) = REQUESTS[1]

    async def run():
        if holder == "task":
            held = asyncio.ensure_future(streamed(decoder, PROMPTS[2]))
            assert await asyncio.to_thread(pause.paused.wait, 60)  # decoding in the worker, paused after a token
            watchdog = threading.Timer(30, pause.go.set)
        else:
            held = decoder.stream(PROMPTS[2], 200)
            next(held)  # holds the slot until resumed
            watchdog = threading.Timer(30, held.close)
        watchdog.start()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(decoder.agenerate(prompt, NEW_TOKENS, **options), 0.5)
        state = decoder.slots.in_use, decoder.slots.waiting, list(pause.tokens)
        watchdog.cancel()
        pause.go.set()
        if holder == "task":
            await held
        else:
            held.close()
        return state, await asyncio.wait_for(decoder.agenerate(prompt, NEW_TOKENS, **options), 60)

    (in_use, waiting, tokens), after = asyncio.run(run())
    assert (in_use, waiting) == (1, 0) and tokens[0] == 1 and tokens[1:] in ([], [0])
    assert after.token_ids == sequential[1] and decoder.slots.in_use == 0


@pytest.mark.parametrize("engine", ["target", "draft"])
def test_a_halt_stops_a_long_prompts_chunked_prefill_before_its_next_chunk_and_the_slot_comes_back(bundle, sequential,
                                                                                                   monkeypatch, engine):
    """On the CPU a long prompt goes in chunks (slot.PREFILL_CHUNK): the target's before the first token, and a sampled
    draft's, which starts afresh, in the first round. Seconds of calls after which a consumer's stop (the server's
    client gone or deadline, chat's Ctrl-C) was first seen; now before the next chunk, as a stop while the prompt is
    scored is (_score)."""
    from specbuild_runtime import slot

    monkeypatch.setattr(slot, "PREFILL_CHUNK", 8)
    decoder = SpeculativeDecoder(bundle, parallel=1)
    halted, halt, chunks, compute_rows = getattr(decoder, engine), threading.Event(), [], EngineSlot._compute_rows

    def halting_after_a_chunk(self, first, total_len, num_drafts, *args, **kwargs):
        result = compute_rows(self, first, total_len, num_drafts, *args, **kwargs)
        if self.engine is halted and total_len - first == 8 and not num_drafts:
            chunks.append(first)
            halt.set()  # as a relay's stop does, from another thread, while the call computes
        return result

    monkeypatch.setattr(EngineSlot, "_compute_rows", halting_after_a_chunk)
    prompt = "".join(PROMPTS[5:9])
    assert len(decoder.encode(prompt)) > 4 * 8
    stats = Stats()
    with pytest.raises(RequestError, match="stopped while a long prompt was fed"):
        list(decoder.stream_request(decoder.request(prompt, NEW_TOKENS, 2, 1.0, seed=0), stats, halt=halt))
    assert chunks == [0] and stats.finish_reason == "abort" and stats.generated_tokens == (engine == "draft")
    monkeypatch.undo()
    assert decoder.generate(REQUESTS[1][0], NEW_TOKENS, **REQUESTS[1][1]).token_ids == sequential[1]  # the slot is back


@pytest.mark.parametrize("prefix_reuse", [True, False], ids=["prefix-reuse", "no-reuse"])
@pytest.mark.parametrize("engine", ["target", "draft"])
def test_the_requests_after_a_prefill_halted_half_way_decode_on_its_slot_as_on_a_fresh_decoder(bundle, monkeypatch,
                                                                                              engine, prefix_reuse):
    """A halt between chunks leaves the slot's cache holding two chunks of the prompt, the rest fed but not computed
    (the target's prefill, or the greedy draft's catch-up, which reuses its cache): the next requests on that slot,
    the same prompt greedy (from the chunks, where prefix reuse is on) and seeded, decode as a fresh decoder does,
    token for token and draft for draft."""
    from specbuild_runtime import slot

    monkeypatch.setattr(slot, "PREFILL_CHUNK", 8)
    decoder, fresh = (SpeculativeDecoder(bundle, parallel=1, prefix_reuse=prefix_reuse) for _ in range(2))
    prompt = decoder.encode("".join(PROMPTS[4:9]))
    assert len(prompt) > 64  # a greedy draft catches up in chunks past MAX_REUSED_IDS (its steps graph's feeds)
    halted, halt, chunks, compute_rows = getattr(decoder, engine), threading.Event(), [], EngineSlot._compute_rows

    def halting_after_two_chunks(self, first, total_len, num_drafts, *args, **kwargs):
        result = compute_rows(self, first, total_len, num_drafts, *args, **kwargs)
        if self.engine is halted and total_len - first == 8 and not num_drafts and not halt.is_set():
            chunks.append(first)
            if len(chunks) == 2:
                halt.set()
        return result

    with monkeypatch.context() as patched:
        patched.setattr(EngineSlot, "_compute_rows", halting_after_two_chunks)
        with pytest.raises(RequestError, match="stopped while a long prompt was fed"):
            list(decoder.stream_request(decoder.request(prompt, NEW_TOKENS, 3), Stats(), halt=halt))
    (held,) = decoder.slots._slots
    assert chunks == [0, 8] and getattr(held, engine).prefix(prompt, len(prompt)) == 16  # the chunks computed alone
    for options in (dict(gamma=3), dict(gamma=2, temperature=1.0, seed=5)):
        after, alone = (d.generate(prompt, NEW_TOKENS, **options) for d in (decoder, fresh))
        assert after.token_ids == alone.token_ids
        assert (after.stats.drafted, after.stats.accepted) == (alone.stats.drafted, alone.stats.accepted) > (0, 0)
        if options == dict(gamma=3):
            cached = (16 if engine == "target" else len(prompt) - 1) if prefix_reuse else 0
            assert after.stats.cached_prompt_tokens == cached and alone.stats.cached_prompt_tokens == 0


def test_a_prefill_halted_after_a_one_row_call_leaves_the_next_request_on_its_slot_the_chunks_it_computed(bundle,
                                                                                                         monkeypatch):
    """A one-token prompt's call computes one row, which the slot's next call re-feeds (slot.Rows: no row is computed
    alone); a long prompt halted after two chunks left that mark in place, and the next request on the slot, told 16
    of its tokens were cached, fed them all again."""
    from specbuild_runtime import slot

    monkeypatch.setattr(slot, "PREFILL_CHUNK", 8)
    decoder = SpeculativeDecoder(bundle, parallel=1)
    prompt = decoder.encode("".join(PROMPTS[4:9]))
    assert len(decoder.encode(PROMPTS[3])) == 1
    decoder.generate(PROMPTS[3], 1, 0)  # its only call, the prompt's, computes one row
    halt, firsts, compute_rows = threading.Event(), [], EngineSlot._compute_rows

    def halting_after_two_calls(self, first, *args, **kwargs):
        result = compute_rows(self, first, *args, **kwargs)
        if self.engine is decoder.target:
            firsts.append(first)
            if len(firsts) == 2:
                halt.set()
        return result

    monkeypatch.setattr(EngineSlot, "_compute_rows", halting_after_two_calls)
    with pytest.raises(RequestError, match="stopped while a long prompt was fed"):
        list(decoder.stream_request(decoder.request(prompt, 4, 0), Stats(), halt=halt))
    assert firsts == [0, 8]
    firsts.clear()
    assert decoder.generate(prompt, 4, 0).stats.cached_prompt_tokens == 16
    assert firsts[0] == 16 - (len(prompt) - 16) % 2  # the last chunk's last row re-fed where the rest is odd (Rows)


def test_a_slow_consumer_does_not_hold_its_slot(bundle, sequential):
    """Decoding runs ahead of a consumer that stops reading (to the request's end at most, as vLLM's AsyncLLM
    does), so a slot is free when its decoding ends, not when its slowest reader catches up."""
    decoder = SpeculativeDecoder(bundle, parallel=1)
    (prompt, options), (other, other_options) = REQUESTS[1], REQUESTS[4]

    async def run():
        slow = decoder.astream(prompt, NEW_TOKENS, **options)
        tokens = [await anext(slow)]
        after = await asyncio.wait_for(decoder.agenerate(other, NEW_TOKENS, **other_options), 60)  # the only slot
        return tokens + [token async for token in slow], after

    tokens, after = asyncio.run(run())
    assert tokens == sequential[1] and after.token_ids == sequential[4]


# The parent decodes through the async API (its worker thread starts), then forks (gunicorn --preload after a
# warm-up); the child does the same. SIGALRM's default action ends a child that waits forever; os._exit leaves
# onnxruntime's sessions alone.
FORKED_ASYNC = """
import asyncio, os, signal, sys
from specbuild_runtime import SpeculativeDecoder
decoder = SpeculativeDecoder(sys.argv[1], parallel=2)

async def generate():
    results = await asyncio.gather(*(decoder.agenerate(p, max_new_tokens=8, gamma=3) for p in sys.argv[2:]))
    return [r.token_ids for r in results]
expected = asyncio.run(generate())
pid = os.fork()
if pid == 0:
    signal.alarm(60)
    os._exit(0 if asyncio.run(generate()) == expected else 1)
print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""


def test_the_async_api_decodes_in_a_process_forked_after_the_parent_used_it(bundle):
    result = subprocess.run([sys.executable, "-c", FORKED_ASYNC, str(bundle), *PROMPTS[:3]], capture_output=True,
                            text=True)
    assert result.stdout.strip() == "0", result.stdout + result.stderr  # -14: SIGALRM ended a child that waited


def test_async_requests_raise_the_errors_the_sync_api_raises(bundle, monkeypatch):
    decoder = SpeculativeDecoder(bundle, parallel=1)
    too_long = decoder.encode(PROMPTS[5]) * 20

    async def first_of(calls):
        errors = []
        for call in calls:
            try:
                await call()
            except Exception as error:
                errors.append(error)
        return errors

    calls = [lambda: decoder.agenerate(too_long), lambda: anext(decoder.astream(too_long)),
             lambda: anext(decoder.astream_text(too_long))]
    with pytest.raises(RequestError) as refused:
        decoder.stream(too_long)
    assert [(type(e), str(e)) for e in asyncio.run(first_of(calls))] == [(RequestError, str(refused.value))] * 3

    def terminated(self, *args):  # onnxruntime's own failure in an engine call, in the worker thread
        import onnxruntime as ort
        options = ort.RunOptions()
        options.terminate = True
        return options

    monkeypatch.setattr(EngineSlot, "_graph", terminated)
    with pytest.raises(DeviceError) as failed:
        decoder.generate(PROMPTS[0])
    calls = [lambda: decoder.agenerate(PROMPTS[0]), lambda: anext(decoder.astream(PROMPTS[0])),
             lambda: anext(decoder.astream_text(PROMPTS[0]))]
    assert [(type(e), str(e)) for e in asyncio.run(first_of(calls))] == [(DeviceError, str(failed.value))] * 3
    assert "\n" not in str(failed.value) and decoder.slots.in_use == 0


def test_stats_hold_measurements_and_the_request_its_gamma(bundle):
    """Stats no longer carries γ: stream(gamma=0, stats=Stats()) decodes with γ 0, not Stats' default."""
    decoder = SpeculativeDecoder(bundle)
    stats = Stats()
    list(decoder.stream(PROMPTS[2], 20, gamma=0, stats=stats))
    assert stats.drafted == 0 and set(stats.gamma_rounds) == {0} and stats.finish_reason == "max_new_tokens"


def test_a_keyword_a_call_does_not_take_is_a_type_error_naming_that_call(bundle):
    """Each passes its keyword options on to request(), so generate(..., stats=Stats()) said
    "SpeculativeDecoder.request() got an unexpected keyword argument 'stats'", a method the caller never called."""
    decoder = SpeculativeDecoder(bundle)
    stats = r"got an unexpected keyword argument 'stats'; read the stats of the Generation it returns \(generation.stats\)$"
    with pytest.raises(TypeError, match=rf"^generate\(\) {stats}"):
        decoder.generate(PROMPTS[0], 4, stats=Stats())
    with pytest.raises(TypeError, match=rf"^agenerate\(\) {stats}"):
        asyncio.run(decoder.agenerate(PROMPTS[0], 4, stats=Stats()))
    for call in ("generate", "stream", "stream_text", "astream", "astream_text"):
        with pytest.raises(TypeError, match=rf"^{call}\(\) got an unexpected keyword argument 'seeds'; its keyword options "
                                            r"are request\(\)'s$"):
            getattr(decoder, call)(PROMPTS[0], 4, seeds=1)
    assert decoder.slots.in_use == 0


def test_a_generations_repr_shows_its_counts_not_a_time_per_token(bundle):
    result = SpeculativeDecoder(bundle).generate(PROMPTS[2], 40, gamma=2)
    shown = repr(result)
    assert "generated_tokens=40" in shown and "finish_reason=" in shown
    assert "token_times" not in shown and "accepted_at" not in shown and len(shown) < 1200


@pytest.fixture(scope="module")
def free_text(bundle):
    """Each prompt's greedy continuation without stop strings, as (token ids, text)."""
    decoder = SpeculativeDecoder(bundle)
    return {p: decoder.generate(p, 60, gamma=3) for p in PROMPTS[:6]}


def piece(text, start, length):
    """The first substring of text from start on with no replacement character (a stop string is text)."""
    return next(text[i:i + length] for i in range(start, len(text)) if "\ufffd" not in text[i:i + length])


def first_stop(decoder, ids, stops):
    """The reference: the first token after which the text holds a stop string, and the text then cut at
    the earliest occurrence."""
    for n in range(1, len(ids) + 1):
        text = decoder.tokenizer.decode(ids[:n])
        cuts = [text.find(s) for s in stops if s in text]
        if cuts:
            return ids[:n], text[:min(cuts)]
    return ids, decoder.tokenizer.decode(ids)


def test_stop_strings_cut_the_text_before_the_earliest_match_as_openai_does(bundle, free_text):
    decoder = SpeculativeDecoder(bundle)
    checked = 0
    for prompt, free in free_text.items():
        text = free.text
        for stops in ([piece(text, 10, 3)], [piece(text, 25, 2), piece(text, 12, 4)], ["\u2603 never"],
                      [piece(text, 30, 1), piece(text, 29, 4)]):
            expected_ids, expected_text = first_stop(decoder, free.token_ids, stops)
            for gamma in (0, 4):
                result = decoder.generate(prompt, 60, gamma, stop=stops)
                assert (result.token_ids, result.text) == (expected_ids, expected_text), (prompt, stops)
                assert result.stats.finish_reason == ("stop" if expected_ids != free.token_ids else "max_new_tokens")
                assert list(decoder.stream(prompt, 60, gamma, stop=stops)) == expected_ids
                checked += expected_ids != free.token_ids
    assert checked >= 10


def test_include_stop_str_in_output_ends_the_text_after_the_stop_string_and_streams_it_unheld(bundle, free_text):
    """vLLM's include_stop_str_in_output: the same tokens, the text cut after the earliest stop string instead of
    before it; text that may become one is sent at once, since it is sent either way."""
    decoder = SpeculativeDecoder(bundle)
    checked = 0
    for prompt, free in free_text.items():
        for stops in ([piece(free.text, 10, 3)], [piece(free.text, 25, 2), piece(free.text, 12, 4)]):
            expected_ids, before = first_stop(decoder, free.token_ids, stops)
            if expected_ids == free.token_ids:
                continue
            text = decoder.tokenizer.decode(expected_ids)
            end = min((text.find(s), -len(s)) for s in stops if s in text)
            for gamma in (0, 4):
                result = decoder.generate(prompt, 60, gamma, stop=stops, include_stop_str_in_output=True)
                assert (result.token_ids, result.text) == (expected_ids, text[:end[0] - end[1]])
                assert result.text.startswith(before) and result.stats.finish_reason == "stop"
                deltas = list(decoder.stream_text(prompt, 60, gamma, stop=stops, include_stop_str_in_output=True))
                assert "".join(deltas) == result.text
                held = list(decoder.stream_text(prompt, 60, gamma, stop=stops))
                assert len(deltas) > len(held) or len(stops[0]) == 1
            checked += 1
    assert checked >= 4


def test_skip_special_tokens_false_shows_special_tokens_and_include_stop_the_eos(bundle):
    """The tests' tokenizer has one special token, its eos: sampled past it (ignore_eos), it shows only where
    skip_special_tokens is false; an eos that ends the request shows only with include_stop_str_in_output too."""
    decoder = SpeculativeDecoder(bundle)
    eos = decoder.tokenizer.token_to_id("<|endoftext|>")
    options = dict(max_new_tokens=120, gamma=3, temperature=1.5)
    seed = next(seed for seed in range(200) if eos in decoder.generate(PROMPTS[1], seed=seed, ignore_eos=True,
                                                                        **options).token_ids[:-1])
    shown = decoder.generate(PROMPTS[1], seed=seed, ignore_eos=True, skip_special_tokens=False, **options)
    assert "<|endoftext|>" in shown.text == decoder.tokenizer.decode(shown.token_ids, skip_special_tokens=False)
    skipped = decoder.generate(PROMPTS[1], seed=seed, ignore_eos=True, **options)
    assert "<|endoftext|>" not in skipped.text == decoder.tokenizer.decode(shown.token_ids)
    assert "".join(decoder.stream_text(PROMPTS[1], seed=seed, ignore_eos=True, skip_special_tokens=False,
                                       **options)) == shown.text
    ended = decoder.generate(PROMPTS[1], seed=seed, skip_special_tokens=False, **options)
    assert ended.stats.finish_reason == "eos" and not ended.text.endswith("<|endoftext|>")
    included = decoder.generate(PROMPTS[1], seed=seed, skip_special_tokens=False, include_stop_str_in_output=True,
                                **options)
    assert included.text == ended.text + "<|endoftext|>"
    assert decoder.generate(PROMPTS[1], seed=seed, include_stop_str_in_output=True, **options).text == ended.text


def test_the_eos_tokens_text_is_left_out_as_vllm_leaves_it_out(bundle, free_text):
    """An eos its tokenizer does not mark special (Phi-3's <|end|> first shipped so) decodes to text, which
    no surface shows: the text is the tokens' before it."""
    decoder = SpeculativeDecoder(bundle)
    for prompt, free in list(free_text.items())[:3]:
        ids = free.token_ids
        texts = [decoder.tokenizer.decode([token]) for token in ids]  # the eos: a token there for the first time, shown whole
        n = next(n for n in range(5, len(ids)) if ids[n] not in ids[:n] and texts[n].isprintable() and "\ufffd" not in texts[n])
        before = decoder.generate(prompt, n, 3).text  # the n tokens before it
        decoder.eos_token_ids = {ids[n]}
        for stop in (None, ["\u2603 never"]):  # decoded at the end, and token by token
            result = decoder.generate(prompt, 60, 3, stop=stop)
            assert result.stats.finish_reason == "eos" and result.token_ids == ids[:n + 1]
            assert result.text == "".join(decoder.stream_text(prompt, 60, 3, stop=stop)) == before
        decoder.eos_token_ids = set(decoder.manifest.eos_token_ids)


def test_an_eos_besides_the_tokenizers_reports_its_id_as_stop_reason_as_vllm_reports_generation_config_eos_ids(
        bundle, free_text):
    """Llama 3 Instruct's generation_config ends at [128001, 128008, 128009], its tokenizer's eos being 128009:
    vLLM makes the other two stop_token_ids, whose id a reply they end reports; the tokenizer's eos reports none."""
    decoder = SpeculativeDecoder(bundle)
    assert decoder.tokenizer_eos == decoder.tokenizer.token_to_id("<|endoftext|>")
    prompt, free = next(iter(free_text.items()))
    ids = free.token_ids
    n = next(n for n in range(5, len(ids)) if ids[n] not in ids[:n])
    decoder.eos_token_ids = {decoder.tokenizer_eos, ids[n]}
    ended = decoder.generate(prompt, 60, 3)
    assert (ended.stats.finish_reason, ended.stats.stop_reason, ended.token_ids) == ("eos", ids[n], ids[:n + 1])
    assert decoder.generate(prompt, 60, 3, ignore_eos=True).stats.stop_reason is None
    decoder.tokenizer_eos = ids[n]
    assert decoder.generate(prompt, 60, 3).stats.stop_reason is None


def test_streamed_text_joins_to_exactly_the_generated_text(bundle, free_text):
    """Random weights emit arbitrary bytes: characters split across tokens are common here."""
    decoder = SpeculativeDecoder(bundle)
    for prompt, free in free_text.items():
        for stop in (None, [piece(free.text, 20, 3)]):
            deltas = list(decoder.stream_text(prompt, 60, 3, stop=stop))
            assert "".join(deltas) == decoder.generate(prompt, 60, 3, stop=stop).text
            if stop is None:
                assert "".join(deltas) == free.text == decoder.tokenizer.decode(free.token_ids)
    # The outputs do split characters across tokens (a prefix decodes to an incomplete character), which
    # streaming must hold back: had it sent the replacement character, the join would differ.
    assert any(decoder.tokenizer.decode(free.token_ids[:n]).endswith("\ufffd")
               for free in free_text.values() for n in range(1, len(free.token_ids)))


def test_a_stop_string_completed_by_the_last_bytes_finishes_with_stop(bundle, free_text):
    """The last token may leave an incomplete character, which only the final decode shows (as U+FFFD):
    a stop string found there still ends the request as "stop"."""
    decoder = SpeculativeDecoder(bundle)
    decode = decoder.tokenizer.decode
    cases = [(prompt, n) for prompt, free in free_text.items() for n in range(2, len(free.token_ids))
             if decode(free.token_ids[:n]).endswith("\ufffd") and "\ufffd" not in decode(free.token_ids[:n - 1])]
    assert cases
    for prompt, n in cases:
        result = decoder.generate(prompt, n, 3, stop=["\ufffd"])
        assert result.stats.finish_reason == "stop" and result.text == decode(free_text[prompt].token_ids[:n])[:-1]
        streamed = Stats()
        assert "".join(decoder.stream_text(prompt, n, 3, stop=["\ufffd"], stats=streamed)) == result.text
        assert streamed.finish_reason == "stop"


def test_a_stop_string_is_found_at_the_token_that_completes_it_even_if_that_token_begins_a_character():
    """A token "x" + the first byte of "‐" (E2 80 90): the text ends in an incomplete character, yet the
    stop string "x" is whole, so the request ends at this token rather than the next."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["xâ"] = len(vocab)  # byte-level: "â" is byte E2
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[("x", "â")]))
    tokenizer.decoder = decoders.ByteLevel()
    for stop, stopped, text in ((("x",), True, ""), (("y",), False, "")):
        stream = TextStream(tokenizer, stop)
        stream.push(vocab["xâ"])
        assert (stream.stopped, stream.text) == (stopped, text)
    stream.push(vocab["Ģ"])  # byte 80
    stream.push(vocab["Ĳ"])  # byte 90: "‐" is whole
    assert stream.text == "x\u2010" and stream.finish() == "x\u2010"


def character_tokenizer(alphabet: str):
    """A token per character, decoded by joining them."""
    from tokenizers import Tokenizer, decoders, models

    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.decoder = decoders.Fuse()
    return tokenizer


@settings(max_examples=500, deadline=None)
@given(st.text("ab\n", max_size=30), st.lists(st.text("ab\n", min_size=1, max_size=8), min_size=1, max_size=4))
def test_text_is_held_back_exactly_while_its_end_may_begin_a_stop_string(text, stops):
    tokenizer = character_tokenizer("ab\n")
    stream, taken = TextStream(tokenizer, tuple(stops)), ""
    for character in text:
        stream.push(tokenizer.token_to_id(character))
        taken += stream.take()
        if stream.stopped:
            break
        held = max((n for s in stops for n in range(1, len(s)) if stream.text.endswith(s[:n])), default=0)
        assert taken == stream.text[:len(stream.text) - held]
    assert taken + stream.finish() == stream.text


@settings(max_examples=300, deadline=None)
@given(st.text("ab\n", max_size=30), st.lists(st.text("ab\n", min_size=1, max_size=8), min_size=1, max_size=4),
       st.integers(0, 12))
def test_a_stop_string_counts_only_where_it_ends_after_the_first_min_tokens_tokens_text(text, stops, min_tokens):
    """vLLM's detokenizer: no stop string is looked for until more than min_tokens tokens are generated, then from
    len(stop) - 1 characters before their text's end (vllm/v1/engine/detokenizer.py)."""
    tokenizer = character_tokenizer("ab\n")
    stream = TextStream(tokenizer, tuple(stops), min_tokens=min_tokens)
    for character in text:
        stream.push(tokenizer.token_to_id(character))
        if stream.stopped:
            break
    stream.finish()
    expected = (text, False)
    for end in range(min_tokens + 1, len(text) + 1):  # a character a token: the text after token `end`
        found = [(i, s) for s in stops if (i := text[:end].find(s, max(0, min_tokens - len(s) + 1))) >= 0]
        if found:
            expected = (text[:min(found)[0]], True)
            break
    assert (stream.text, stream.stopped) == expected


def sentencepiece_tokenizer():
    """Llama 2's decoder chain over a BPE trained here: its Strip (and Metaspace's "first" scheme) drop the
    space that begins whatever is decoded."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                           decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    text = ["the text wraps the lines", "text that wraps", "the lines of text", "wrap the text lines"] * 20
    tokenizer.train_from_iterator(text, trainers.BpeTrainer(vocab_size=60, special_tokens=["<s>"]))
    return tokenizer


def byte_fallback_tokenizer():
    """Llama 2's decoder chain over its 256 byte tokens (<0x0A> is "\\n"), a piece and a special token."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    vocab = {f"<0x{b:02X}>": b for b in range(256)} | {"\u2581a": 256, "<s>": 257}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    tokenizer.add_special_tokens([AddedToken("<s>", special=True)])
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                           decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return tokenizer


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([0x0A, 0x41, 0xC3, 0xA9, 0xE2, 0x80, 0x94, 0xFF, 256, 257]), min_size=1, max_size=12),
       st.booleans())
@example([0x0A, 0xE2, 256], False)  # "\n", then a character that never completes: the run decodes to "\ufffd\ufffd"
@example([0x0A, 257, 0xE2], True)  # a special token kept in the text ends the run
def test_streamed_text_is_what_byte_fallback_decodes_the_tokens_to(ids, special_tokens):
    """ByteFallback decodes a run of byte tokens (special tokens skipped) as one, and a run that is not UTF-8
    as a U+FFFD per byte: text from a byte token waits for the run's end, or the "\\n" sent for <0x0A> would
    not be in generate()'s text. A text that keeps special tokens (a tool parser reading Mistral's
    [TOOL_CALLS]) is what the decoder shows with them."""
    tokenizer = byte_fallback_tokenizer()
    stream, streamed = TextStream(tokenizer, special_tokens=special_tokens), ""
    for token in ids:
        stream.push(token)
        streamed += stream.take()
    assert streamed + stream.finish() == stream.text == tokenizer.decode(ids, skip_special_tokens=not special_tokens)
    assert ("<s>" in stream.text) == (special_tokens and 257 in ids)


@pytest.mark.parametrize("make", [sentencepiece_tokenizer, lambda: make_tokenizer().backend_tokenizer])
def test_streamed_text_is_what_the_prompt_and_the_tokens_decode_to_past_the_prompts_text(make):
    """The first generated word keeps the space before it (decoded alone, a SentencePiece decoder drops it)."""
    tokenizer = make()
    ids = tokenizer.encode("The text wraps the lines, the text wraps").ids
    assert len(ids) > 8
    for cut in range(1, len(ids)):
        expected = tokenizer.decode(ids)[len(tokenizer.decode(ids[:cut])):]
        stream = TextStream(tokenizer, prompt_ids=ids[:cut])
        streamed = ""
        for token in ids[cut:]:
            stream.push(token)
            streamed += stream.take()
        assert streamed + stream.finish() == stream.text == expected, cut


def test_the_first_word_keeps_its_space_after_a_prompt_ending_in_characters_spelled_in_byte_tokens():
    """Llama 2 spells most emoji in byte tokens: the prompt's last tokens begin inside "🙃", and ByteFallback shows
    all of them as U+FFFD, though the prompt's text ends whole."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {f"<0x{b:02X}>": b for b in range(256)} | {"\u2581the": 256}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                           decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    prompt = tokenizer.encode("\U0001f643\U0001f914").ids
    assert tokenizer.decode(prompt[-5:]).endswith("\ufffd")  # the case is what it claims
    stream = TextStream(tokenizer, prompt_ids=prompt)
    stream.push(256)
    assert stream.take() + stream.finish() == tokenizer.decode(prompt + [256])[len(tokenizer.decode(prompt)):] == " the"


def test_the_first_word_keeps_its_space_after_special_tokens_that_follow_a_byte_spelled_character():
    """The prompt's last tokens are special (skipped when decoded) after "é" in two byte tokens: the context began
    at the second byte, which decodes alone as U+FFFD, and the space before "a" was lost with it."""
    tokenizer = byte_fallback_tokenizer()
    prompt = [0xC3, 0xA9, 257, 257, 257, 257]
    stream = TextStream(tokenizer, prompt_ids=prompt)
    for token in (257, 256):
        stream.push(token)
    assert stream.take() + stream.finish() == tokenizer.decode(prompt + [257, 256])[len(tokenizer.decode(prompt)):] == " a"


def test_a_seeded_sampled_request_reproduces_under_auto_gamma_whatever_ran_before(bundle):
    """Which γ a round uses changes which random number judges which draft: a seeded request's auto γ
    follows its own acceptance alone, not timings or the slot's earlier requests. The draft is the target here, so its
    prior (the weight ratio, 1) says no γ could pay: each decoder is told a draft step costs a tenth, as a real draft's."""
    options = dict(gamma="auto", temperature=1.0, seed=5)
    decoder, other = SpeculativeDecoder(bundle), SpeculativeDecoder(bundle, parallel=2)
    decoder._prior_draft_cost = other._prior_draft_cost = 0.1
    first = decoder.generate(PROMPTS[1], NEW_TOKENS, **options)
    assert len(first.stats.gamma_rounds) > 1, "auto used one γ throughout: this test is hollow"
    for prompt in PROMPTS[:4]:  # unseeded traffic teaches the slot's own policy (and the shared costs)
        decoder.generate(prompt, NEW_TOKENS, gamma="auto", temperature=1.0)
    assert decoder.generate(PROMPTS[1], NEW_TOKENS, **options).token_ids == first.token_ids
    assert other.generate(PROMPTS[1], NEW_TOKENS, **options).token_ids == first.token_ids


def test_a_seeded_request_its_prior_keeps_at_gamma_0_first_probes_after_as_many_rounds_as_a_warm_policy(bundle):
    """A seeded sampled request's policy is fresh each time: probing after 8, then 16 and 32 rounds at γ 0, as a new
    slot's does, each probe caught the draft up on the prompt and the tokens since, a tenth of the request's time on the
    demo pair. A draft step priced at 0.7 of a target call (the demo pair's) keeps it at γ 0 at the prior's α."""
    decoder = SpeculativeDecoder(bundle)
    decoder._prior_draft_cost = 0.7
    result = decoder.generate(PROMPTS[1], MAX_PROBE_EVERY - 1, gamma="auto", temperature=1.0, seed=5, ignore_eos=True)
    assert result.stats.rounds > 2 * PROBE_EVERY, "the request ended before a probe was due: this test is hollow"
    assert result.stats.gamma_rounds == {0: result.stats.rounds}


def test_generated_text_follows_the_prompts_text_with_a_decoder_that_strips_a_leading_space(bundle):
    """The bundle's byte-level tokenizer given SentencePiece's last decoding step (Llama 2's Strip): decoded
    alone, a completion beginning with a space would lose it."""
    from tokenizers import Tokenizer, decoders

    decoder = SpeculativeDecoder(bundle)
    decoder.tokenizer = tokenizer = Tokenizer.from_str(decoder.tokenizer.to_str())
    tokenizer.decoder = decoders.Sequence([decoders.ByteLevel(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    decode, spaced = tokenizer.decode, 0
    sampled = [(PROMPTS[0], dict(gamma=2, temperature=1.5, seed=seed)) for seed in range(16)]  # first tokens vary
    for prompt, options in REQUESTS + sampled:
        result = decoder.generate(prompt, NEW_TOKENS, **options)
        expected = decode(result.prompt_token_ids + result.token_ids)[len(decode(result.prompt_token_ids)):]
        assert result.text == "".join(decoder.stream_text(prompt, NEW_TOKENS, **options)) == expected
        spaced += expected.startswith(" ")
    assert spaced, "no completion began with a space: this test is hollow"


def test_a_server_stream_yields_after_every_token_even_while_text_is_held_back(bundle, free_text):
    """The server checks cancellation and deadlines between the items it is given: one per token."""
    decoder = SpeculativeDecoder(bundle)
    for prompt, free in free_text.items():
        stop = [piece(free.text, 20, 3)]
        stats = Stats()
        items = list(decoder.stream_request(decoder.request(prompt, 60, 3, stop=stop), stats, every_token=True))
        assert len(items) in (stats.generated_tokens, stats.generated_tokens + 1)
        assert "".join(items) == decoder.generate(prompt, 60, 3, stop=stop).text


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 8).flatmap(lambda d: st.tuples(st.just(d), st.integers(0, d))), max_size=40))
def test_stats_count_rounds_as_a_plain_reference_does(rounds):
    stats = Stats(accepted_at=[0] * 8, proposed_at=[0] * 8)
    for drafted, accepted in rounds:
        stats.record_round(drafted, accepted, draft_seconds=0.001 * drafted, target_seconds=0.002)
    drafted, accepted = sum(d for d, _ in rounds), sum(a for _, a in rounds)
    assert (stats.rounds, stats.drafted, stats.accepted) == (len(rounds), drafted, accepted)
    assert stats.gamma_rounds == dict(Counter(d for d, _ in rounds))
    assert stats.proposed_at == [sum(d > j for d, _ in rounds) for j in range(8)]
    assert stats.accepted_at == [sum(a > j for _, a in rounds) for j in range(8)]
    if drafted:
        assert stats.acceptance_rate == accepted / drafted
    else:
        assert math.isnan(stats.acceptance_rate) and stats.to_dict()["acceptance_rate"] is None
    assert stats.to_dict()["per_position_acceptance"] == [round(a / p, 4) if p else None
                                                          for a, p in zip(stats.accepted_at, stats.proposed_at)]
    assert stats.target_seconds == pytest.approx(0.002 * len(rounds))


def test_a_request_that_proposed_no_draft_has_alpha_nan_and_null_in_its_json(bundle):
    """α of no draft is undefined, not 0 (every draft rejected): NaN, a float as vLLM's spec-decode metrics give it,
    and null in to_dict, as bench --json writes it (JSON has no NaN)."""
    stats = SpeculativeDecoder(bundle).generate(PROMPTS[0], 8, gamma=0).stats
    assert stats.rounds and not stats.drafted and math.isnan(stats.acceptance_rate)
    figures = json.loads(json.dumps(stats.to_dict(), allow_nan=False))
    assert figures["acceptance_rate"] is None and figures["per_position_acceptance"] == []


@pytest.mark.parametrize("q", [150, -1, float("nan"), "50", None])
@pytest.mark.parametrize("times", [[0.0, 0.1, 0.3], []], ids=["tokens", "none"])
def test_an_itl_percentile_outside_0_to_100_is_one_request_error_whatever_the_stats_hold(q, times):
    """150 raised numpy's "Percentiles must be in the range [0, 100]" from inside it ("50" a TypeError from its
    arithmetic), and only where there were gaps to take it of: with fewer than two tokens it returned 0."""
    with pytest.raises(RequestError, match="^q must be") as raised:
        Stats(token_times=times).itl_ms(q)
    assert "\n" not in str(raised.value)


def test_a_runs_stats_add_up_to_its_tokens(bundle):
    decoder = SpeculativeDecoder(bundle)
    for prompt, options in REQUESTS:
        result = decoder.generate(prompt, NEW_TOKENS, **options)
        s = result.stats
        # Each round emits its accepted drafts (or accepted guess) and one token of the target's own; the
        # last round may be cut short by max_new_tokens.
        emitted = s.accepted + s.guesses_accepted + s.rounds
        assert s.generated_tokens == len(result.token_ids) and emitted >= s.generated_tokens - 1 > emitted - 9
        assert s.rounds == sum(s.gamma_rounds.values()) and s.prompt_tokens == len(result.prompt_token_ids)


def test_stats_count_the_drafts_the_target_accepted_after_the_token_that_ended_the_request(bundles):
    """As vLLM's num_accepted_tokens and llama.cpp's n_draft_accepted: a round's drafts judge the draft whether or not
    the request ends within the round, and generated_tokens counts only what was emitted (Stats' docstring)."""
    decoder = SpeculativeDecoder(bundles("llama"))  # draft = target: every draft holds
    tokens = decoder.generate(PROMPTS[0], NEW_TOKENS, gamma=4).token_ids
    # The prompt's call emits token 0, each round of 4 drafts the next 5: token i is within a round where i % 5.
    end = next(i for i, token in enumerate(tokens) if i % 5 and token not in {*tokens[:i], *decoder.eos_token_ids})
    stats = decoder.generate(PROMPTS[0], NEW_TOKENS, gamma=4, stop_token_ids=[tokens[end]]).stats
    assert stats.finish_reason == "stop_token" and stats.generated_tokens == end + 1
    assert stats.accepted == stats.drafted == 4 * stats.rounds > end - stats.rounds and stats.acceptance_rate == 1.0


def test_cuda_graphs_by_default_on_cuda_for_unquantized_fp16_and_bf16_bundles(bundle):
    """What a GPU decoder replays when cuda_graphs is left unset (checked on the manifest: no GPU here)."""
    from dataclasses import replace

    from specbuild_runtime.decode import graphs_by_default
    from specbuild_runtime.manifest import load_manifest

    fp32 = load_manifest(bundle)
    assert SpeculativeDecoder(bundle).cuda_graphs is False  # the CPU

    def variant(manifest=fp32, **changes):
        return replace(manifest, engines={role: replace(info, **changes) for role, info in manifest.engines.items()})

    for precision in ("fp16", "bf16"):
        assert graphs_by_default(variant(precision=precision), "cuda")
        assert not graphs_by_default(variant(precision=precision), "cuda", parallel=2)  # slots would take turns
        assert not graphs_by_default(variant(precision=precision), "cpu")
    assert not graphs_by_default(fp32, "cuda")  # its attention runs on the CPU provider
    assert not graphs_by_default(variant(precision="fp16", quantization="int4"), "cuda")  # not yet run captured
    assert graphs_by_default(variant(precision="fp16", architecture="GPT2LMHeadModel"), "cuda")  # replayed right on an H100
    assert not graphs_by_default(variant(precision="fp16", architecture="Qwen3ForCausalLM"), "cuda")  # not yet run captured
    assert not graphs_by_default(variant(precision="bf16", architecture="GPT2LMHeadModel"), "cuda")  # its fp16 only
    assert not graphs_by_default(variant(precision="fp16", greedy_file=""), "cuda")  # compiled before them
    assert not graphs_by_default(replace(variant(precision="fp16"), sampler_file=""), "cuda")
    phi3 = variant(precision="fp16", architecture="Phi3ForCausalLM")
    assert graphs_by_default(phi3, "cuda")  # replayed right on an H100, with one rotary table
    switching = replace(phi3, engines={**phi3.engines, "target": replace(phi3.engines["target"], rope_switch_length=16)})
    assert not graphs_by_default(switching, "cuda")  # tests/test_gpu.py has not yet run its table switch captured


def test_why_a_bundle_decodes_uncaptured_by_default_is_said_in_words(bundle):
    """`specbuild inspect` prints it ("on cuda")."""
    from dataclasses import replace

    from specbuild_runtime.decode import uncaptured_because
    from specbuild_runtime.manifest import load_manifest

    fp32 = load_manifest(bundle)

    def variant(**changes):
        return replace(fp32, engines={role: replace(info, **changes) for role, info in fp32.engines.items()})

    assert uncaptured_because(variant(precision="fp16")) == ""
    assert "fp32" in uncaptured_because(fp32)
    assert "int4 engines not yet run captured" in uncaptured_because(variant(precision="bf16", quantization="int4"))
    assert "Qwen3ForCausalLM fp16 not yet run captured" in uncaptured_because(variant(precision="fp16", architecture="Qwen3ForCausalLM"))
    assert "recompile" in uncaptured_because(variant(precision="fp16", greedy_file=""))


def test_auto_that_falls_back_to_the_cpu_refuses_more_slots_than_memory_holds_as_the_cpu_does(bundle, monkeypatch):
    """device "auto" where the CUDA provider is installed but cannot start decodes on the CPU, where every
    slot's KV caches live in host memory: a count that cannot fit is refused there as under device "cpu"."""
    from specbuild_runtime import decode

    real_engine = decode.Engine

    def engine(path, info, max_seq_len, device, **options):
        if device == "cuda":  # as engine._session says it when the provider fails to start
            raise DeviceError("onnxruntime could not start its CUDAExecutionProvider")
        return real_engine(path, info, max_seq_len, device, **options)

    monkeypatch.setattr(decode, "requested_device", lambda device: "cpu" if device == "cpu" else "cuda")
    monkeypatch.setattr(decode, "Engine", engine)
    monkeypatch.setattr(pool, "memory_limit", lambda: (1024, "this machine has"))
    with pytest.raises(RequestError, match="of KV caches"):
        SpeculativeDecoder(bundle, device="cpu")
    with pytest.raises(RequestError, match="of KV caches"):
        SpeculativeDecoder(bundle, device="auto")


def test_streams_are_typed_as_the_generators_whose_close_cancels_them():
    """docs/runtime.md cancels a stream with close() (an async one with aclose()); the package is typed (py.typed), and
    a type checker refuses those calls on an Iterator or AsyncIterator."""
    for name, kind in (("stream", Generator), ("stream_text", Generator), ("stream_request", Generator),
                       ("astream", AsyncGenerator), ("astream_text", AsyncGenerator)):
        assert typing.get_origin(typing.get_type_hints(getattr(SpeculativeDecoder, name))["return"]) is kind, name


def test_a_streams_items_are_typed_token_ids_without_logprobs_and_their_records_with():
    """`for token_id in decoder.stream(...)`: a caller's type checker reads the overloads, so the ids are ints (typed
    int | TokenLogprobs, each needed a cast before a list[int] took it) and records where logprobs is given."""
    for name in ("stream", "astream"):
        hints = [typing.get_type_hints(overload) for overload in typing.get_overloads(getattr(SpeculativeDecoder, name))]
        assert {(hint["logprobs"], typing.get_args(hint["return"])[0]) for hint in hints} == {
            (type(None), int), (int, TokenLogprobs)}, name


CALL_FORMS = """
from typing import AsyncGenerator, Generator, assert_type

from specbuild_runtime import SpeculativeDecoder, Stats, TokenLogprobs

decoder, maybe = SpeculativeDecoder("bundle"), int("0") or None
assert_type(decoder.stream("x"), Generator[int, None, None])
assert_type(decoder.stream("x", logprobs=None), Generator[int, None, None])
assert_type(decoder.stream("x", logprobs=0), Generator[TokenLogprobs, None, None])
assert_type(decoder.stream("x", 8, "auto", 0.0, 0, 1.0, None, None, Stats(), None), Generator[int, None, None])
assert_type(decoder.stream("x", 8, "auto", 0.0, 0, 1.0, None, None, Stats(), 2), Generator[TokenLogprobs, None, None])
assert_type(decoder.stream("x", logprobs=maybe), Generator[TokenLogprobs, None, None] | Generator[int, None, None])
assert_type(decoder.astream("x"), AsyncGenerator[int, None])
assert_type(decoder.astream("x", logprobs=0), AsyncGenerator[TokenLogprobs, None])
assert_type(decoder.astream("x", 8, "auto", 0.0, 0, 1.0, None, None, None, 2), AsyncGenerator[TokenLogprobs, None])
assert_type(decoder.astream("x", logprobs=maybe), AsyncGenerator[TokenLogprobs, None] | AsyncGenerator[int, None])
"""


def test_a_type_checker_types_a_streams_items_by_logprobs_in_every_call_form(tmp_path, mypy_check):
    """logprobs left out, None, an int, an int | None, by keyword or by position: mypy found no overload for an int
    given by position, which the runtime takes."""
    (tmp_path / "calls.py").write_text(CALL_FORMS)
    status, report = mypy_check(tmp_path / "calls.py")
    assert status == 0, report


@pytest.mark.parametrize("cuda_graphs", [False, True])  # the engine graphs' own tail, or the greedy-only graphs + sampler
@pytest.mark.parametrize("options", [dict(gamma=0), dict(gamma=4), dict(gamma="auto"),
                                     dict(gamma=0, temperature=0.8, seed=1), dict(gamma=4, temperature=0.8, seed=1)])
def test_a_target_whose_fp16_logits_overflow_is_one_error_not_token_0(overflowing, options, cuda_graphs):
    from specbuild_runtime import BundleError

    decoder = SpeculativeDecoder(overflowing("target"), cuda_graphs=cuda_graphs)
    with pytest.raises(BundleError, match=r"logits hold NaN or an infinity at generated token 1: its fp16 engine "
                                          r"overflows .* --precision bf16"):
        decoder.generate(PROMPTS[0], 8, **options)


def test_a_target_that_overflows_while_warming_up_says_it_was_warming_up(overflowing):
    """serve warms up at start-up on CUDA (CUDA graphs), and stopped there saying only "at generated token 1"."""
    from specbuild_runtime import BundleError

    decoder = SpeculativeDecoder(overflowing("target"), cuda_graphs=True)
    decoder.target.captures = True  # as on CUDA
    with pytest.raises(BundleError, match=r"^warming up \(a short code prompt, before any request\): the target's logits"):
        decoder.warm_up()


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_a_draft_whose_fp16_logits_overflow_leaves_the_targets_greedy_output(overflowing, cuda_graphs):
    decoder = SpeculativeDecoder(overflowing("draft"), cuda_graphs=cuda_graphs)
    alone = decoder.generate(PROMPTS[0], 16, gamma=0).token_ids
    for gamma in (1, 4, "auto"):
        assert decoder.generate(PROMPTS[0], 16, gamma=gamma).token_ids == alone
    assert decoder.generate(PROMPTS[0], 16, gamma=4, temperature=0.8, seed=1).stats.generated_tokens == 16


def test_auto_gamma_stops_calling_a_draft_whose_fp16_logits_overflow(overflowing, monkeypatch):
    """Such a draft's rounds drafted nothing (decode._draft), which auto γ never counted against it: at the prior α it
    called the draft every round, for nothing. A seeded sampled request's γ follows from its acceptance alone."""
    from specbuild_runtime.slot import EngineSlot

    roles, step = [], EngineSlot.step

    def counted(self, *args, **kwargs):
        roles.append(self.engine.info.role)
        return step(self, *args, **kwargs)

    monkeypatch.setattr(EngineSlot, "step", counted)
    decoder = SpeculativeDecoder(overflowing("draft"))
    decoder.eos_token_ids = set()
    decoder._prior_draft_cost = 0.1  # a draft a tenth of its target, as drafts are (this pair's are alike): worth calling
    result = decoder.generate(PROMPTS[0], 64, gamma="auto", temperature=0.8, seed=1)
    assert roles.count("draft") < result.stats.rounds // 4, (roles.count("draft"), result.stats.rounds)


def test_rounds_that_warm_up_or_capture_a_cuda_graph_leave_auto_gammas_costs_alone(bundle, monkeypatch):
    """Each round that ran a CUDA graph's warm-up or capture (slot.unsteady_calls counts them) updates α but not the
    costs auto γ prices rounds by (test_policy shows the trap). No GPU here: every round made to look so."""
    from specbuild_runtime import decode

    calls = iter(range(10**6))
    monkeypatch.setattr(decode, "unsteady_calls", lambda: next(calls))
    decoder = SpeculativeDecoder(bundle)
    result = decoder.generate(PROMPTS[0], 24, "auto")
    policy = decoder._policies[0][(False, "plain")]
    assert result.stats.rounds > 3
    assert policy.costs.rounds == [None] * (decoder.max_gamma + 1)


def test_a_round_that_waited_on_another_threads_cuda_graph_warm_up_leaves_auto_gammas_costs_alone(bundle, monkeypatch):
    """Captured calls take turns across threads (engine._CUDA_GRAPH_CALLS), so with --cuda-graphs and --parallel 2+ a
    round also waits while another thread warms a graph up or captures it; the costs every slot shares took that
    wait for the round's cost, where only this thread's own warm-ups were counted. Here a second thread's first
    request (every graph warmed up anew) runs inside a round of a request whose own graphs are all captured."""
    decoder = SpeculativeDecoder(bundle, parallel=2, cuda_graphs=True)
    for engine in (decoder.target, decoder.draft):
        engine.captures = True  # graph ids named as on CUDA (the CPU provider ignores them)
    judged = []

    class Recording(FixedGamma):
        def observe(self, *args, timed: bool = True, **kwargs) -> None:
            if threading.current_thread() is threading.main_thread():
                judged.append(timed)

    monkeypatch.setattr(decoder, "_policy", lambda slot, request: Recording(request.gamma))
    for _ in range(3):  # every graph of this request warmed up twice and captured
        decoder.generate(PROMPTS[0], 16, gamma=2)
    draft, rounds = decoder._draft, iter(range(10**6))

    def drafting(*args):
        if threading.current_thread() is threading.main_thread() and next(rounds) == 2:
            other = threading.Thread(target=decoder.generate, args=(PROMPTS[1], 8), kwargs={"gamma": 2})
            other.start()
            other.join()
        return draft(*args)

    monkeypatch.setattr(decoder, "_draft", drafting)
    judged.clear()
    decoder.generate(PROMPTS[0], 16, gamma=2)
    assert len(judged) > 3 and judged[2] is False and all(judged[:2] + judged[3:]), judged


def test_a_round_whose_draft_stopped_short_leaves_auto_gammas_costs_alone(bundle, monkeypatch):
    """A draft stops before the γ asked (an eos or a grammar that leaves its vocabulary nothing, logits not finite): the
    round drafted fewer tokens and computed fewer target rows than a round at that γ, whose cost it was taken for. The
    drafts it never made count as rejected still, but past an eos (the next test); its time prices nothing."""
    decoder = SpeculativeDecoder(bundle)
    judged, cut = [], []

    class Recording(FixedGamma):
        def observe(self, drafted: int, *args, timed: bool = True, **kwargs) -> None:
            judged.append(timed)

    draft = decoder._draft

    def stopping_short(slot, feed, total_len, k, *args):
        cut.append(len(cut) % 2 == 1 and k > 1)  # every other round
        return draft(slot, feed, total_len, 1 if cut[-1] else k, *args)

    monkeypatch.setattr(decoder, "_policy", lambda slot, request: Recording(request.gamma))
    monkeypatch.setattr(decoder, "_draft", stopping_short)
    decoder.generate(PROMPTS[0], 24, gamma=3)
    assert len(judged) > 3 and judged == [not short for short in cut]


def test_a_draft_that_stopped_at_an_eos_under_a_grammar_tells_alpha_of_no_failure(bundles, monkeypatch):
    """Under a grammar the draft stops after an eos (_draft): nothing can follow it, so the γ asked beyond it was never
    missed. Counted rejected, they told α of a failure in the round that ends nearly every such request (the demo pair
    under a JSON schema: α at a request's start 0.75 rather than 0.78). The draft is the target here: every draft holds."""
    decoder = SpeculativeDecoder(bundles("llama", draft_seed=0))
    told, stopped = [], []

    class Recording(FixedGamma):
        def observe(self, drafted: int, accepted: int, *args, **kwargs) -> None:
            told.append((drafted, accepted))

    draft = decoder._draft

    def recording(slot, feed, total_len, k, *args):
        drafts = draft(slot, feed, total_len, k, *args)
        stopped.append(0 < len(drafts) < k and drafts[-1] in decoder.eos_token_ids)
        return drafts

    monkeypatch.setattr(decoder, "_policy", lambda slot, request: Recording(request.gamma))
    monkeypatch.setattr(decoder, "_draft", recording)
    # Choices that begin others: where one may end, the grammar forces no eos, nor is an eos all it allows (where the
    # draft drafts none), so the draft drafts the eos.
    choices = {"choice": ["return a + b", "return a", "pass", "pass a", "raise ValueError", "raise"]}
    ends = [decoder.generate(prompt, 24, gamma=decoder.max_gamma, structured_outputs=choices).stats.finish_reason
            for prompt in PROMPTS[:3]]
    assert any(stopped) and ends == ["eos"] * 3
    assert all(drafted == accepted for drafted, accepted in told), told


def test_no_round_drafts_where_the_grammar_allows_only_an_eos(bundles, monkeypatch):
    """Where the grammar allows only an eos, next or after the tokens it forces, the target's call yields it whatever
    was drafted: a draft there would only cost a draft call, which may first catch up on the whole prompt (a yes/no
    regex: most rounds that drafted were such rounds). The output stays the target's."""
    decoder = SpeculativeDecoder(bundles("llama", draft_seed=0))
    asked = []
    draft = decoder._draft

    def recording(slot, feed, total_len, k, uniforms, greedy, guide=None, forced=(), halt=None):
        asked.append((guide.ends_after(forced), k))
        return draft(slot, feed, total_len, k, uniforms, greedy, guide, forced, halt)

    monkeypatch.setattr(decoder, "_draft", recording)
    choices = {"choice": ["return a + b", "pass", "raise ValueError"]}
    for prompt in PROMPTS[:3]:
        for gamma in (1, 2, "auto"):
            expected = decoder.generate(prompt, 24, gamma=0, structured_outputs=choices).token_ids
            assert decoder.generate(prompt, 24, gamma=gamma, structured_outputs=choices).token_ids == expected
    assert any(ended for ended, k in asked)
    assert [k for ended, k in asked if ended] == [0] * sum(ended for ended, k in asked), asked


# --- Refusing a prompt longer than the context without tokenizing it ----------------------------------------------

# Pieces of text that normalizers join (NFC/NFKC compose U+1F82 from 4 characters, a Hangul syllable from 3 jamo),
# lengthen (ﬁ, é decomposed), or that tokenizers read apart (byte fallback's 4 tokens for an emoji, added tokens).
PIECES = [" ", "  ", "\n", "a", "the", "\u2581", "\u1f82", "\u03b1\u0313\u0300\u0345", "e\u0301", "\u00e9", "\ufb01",
          "\u1100\u1161\u11a8", "\uff21", "\U0001f600", "=" * 8, "<s>", "<|a long added token|>",
          "<|a normalized one|>"]
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")


def spanned_tokenizers():
    """BPE tokenizers of the shapes bundles carry, trained on PIECES so that their longest tokens are runs of them:
    byte-level (GPT-2), Llama 3's (its regex split, then byte-level), Qwen's (NFC, then a regex split and byte-level),
    Llama 2's (Prepend and Replace, byte fallback), and NFKC with added tokens, normalized or not."""
    from tokenizers import AddedToken, Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

    rng = random.Random(0)
    corpus = ["".join(rng.choices(PIECES[:-3], k=40)) for _ in range(300)] + [piece * 12 for piece in PIECES[:-3]]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    shapes = {
        "byte-level": (None, byte_level),
        "llama3": (None, pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_SPLIT), "isolated"),
                                                  pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])),
        "qwen": (normalizers.NFC(), pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r"\p{L}+|\s+|."), "isolated"),
                                                             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])),
        "llama2": (normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]), None),
        "nfkc": (normalizers.NFKC(), None),
    }
    made = {}
    for name, (normalizer, pre_tokenizer) in shapes.items():
        # as they ship: byte-level ones never meet an unknown byte; Llama 2's fuses unknown characters, but falls back to
        # byte tokens first
        sentencepiece = pre_tokenizer is None
        tokenizer = Tokenizer(models.BPE(byte_fallback=sentencepiece, fuse_unk=sentencepiece,
                                         unk_token="<unk>" if sentencepiece else None))
        tokenizer.normalizer, tokenizer.pre_tokenizer = normalizer, pre_tokenizer
        alphabet = [] if sentencepiece else pre_tokenizers.ByteLevel.alphabet()
        byte_tokens = [f"<0x{b:02X}>" for b in range(256)] if sentencepiece else []
        tokenizer.train_from_iterator(corpus, trainers.BpeTrainer(
            vocab_size=400 + len(byte_tokens), special_tokens=["<unk>", "<s>", *byte_tokens], initial_alphabet=alphabet,
            max_token_length=48))
        tokenizer.add_tokens([AddedToken(PIECES[-2], normalized=False), AddedToken(PIECES[-1], normalized=True)])
        made[name] = tokenizer
    return made


SPANNED = spanned_tokenizers()


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(SPANNED)), st.one_of(*(st.lists(st.sampled_from(pieces), min_size=1, max_size=300).map(
    "".join) for pieces in (PIECES, [piece for piece in PIECES if piece.isascii()]))))
@example("nfkc", "\u03b1\u0313\u0300\u0345" * 300)  # NFKC's 4 to 1, then the longest run of U+1F82 it learned
@example("qwen", "\u03b1\u0313\u0300\u0345" * 300)  # NFC's 8 bytes to 3: a byte count would be no bound
@example("byte-level", "<|a long added token|>" * 20)
@example("byte-level", "\U0001f600" * 50)  # 4 bytes each
@example("llama3", "=" * 48 + "the" * 16 + "<|a long added token|>")  # each byte at its longest token
@example("qwen", "=" * 48 + "the" * 16 + "<|a normalized one|>")  # by byte: NFC keeps ASCII as it is
def test_no_text_encodes_to_fewer_tokens_than_its_length_over_the_token_span(shape, text):
    """text.token_span bounds what one token stands for: a prompt refused by it before tokenizing could never have
    fitted. The tightest texts are runs of a vocabulary's longest tokens, normalized or added; by byte, runs of the
    longest token that holds each byte."""
    from specbuild_runtime.text import token_span

    tokenizer = SPANNED[shape]
    span = token_span(tokenizer)
    assert span.in_bytes == (shape in ("byte-level", "llama3"))
    assert bool(span.by_byte) == (shape in ("byte-level", "llama3", "qwen"))
    assert len(tokenizer.encode(text, add_special_tokens=False).ids) >= span.fewest_tokens(text)


def test_a_run_of_the_longest_token_meets_the_token_span():
    """The bound is exact where the text is the longest token repeated: no looser span would be sound."""
    from specbuild_runtime.text import token_span

    tokenizer = SPANNED["byte-level"]
    longest = max((token for token in tokenizer.get_vocab() if token.isascii()), key=len)
    span = token_span(tokenizer)
    assert len(longest) == span.longest and len(tokenizer.encode(longest * 50).ids) == 50


@given(st.lists(st.text("ab\u0120\u00e9\u2581<>", min_size=1, max_size=8), unique=True),
       st.lists(st.text("a\u00e9\U0001f600<>", min_size=1, max_size=6), max_size=3))
def test_each_bytes_longest_token_is_the_longest_of_every_token_that_holds_it(tokens, added):
    """text._longest_by_byte takes the vocabulary a length at a time (0.05 s of CPU at Qwen's 152k tokens, where a loop
    over each token's characters took 0.20 s of every load): the figures that loop gives."""
    from specbuild_runtime.text import EVERY_BYTE, _longest_by_byte
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = {token: i for i, token in enumerate(tokens)}
    longest_with: dict[str, int] = {}
    for token in vocab:
        for char in set(token):
            longest_with[char] = max(longest_with.get(char, 0), len(token))
    longest = max([*(len(text.encode()) for text in added), *longest_with.values(), 1])
    chars = dict(zip(EVERY_BYTE.encode(), ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(
        EVERY_BYTE)[0][0]))
    expected = [longest_with[chars[b]] if chars.get(b) in vocab else longest for b in range(256)]
    for text in added:
        for b in set(text.encode()):
            expected[b] = max(expected[b], len(text.encode()))
    assert _longest_by_byte(vocab, added) == tuple(expected)


@pytest.mark.parametrize("normalizer", [None, "NFC"])
def test_a_prompt_of_words_is_refused_by_its_bytes_not_by_the_longest_run_of_spaces_in_the_vocabulary(normalizer):
    """Llama 3's vocabulary, as Qwen's and GPT-2's, holds runs of spaces, "=" or "-" over a hundred bytes long: a
    prompt's bytes over that are a tenth of its tokens or less, and an 8 MB prompt for a 128K context was tokenized (13
    s) before it was refused. Counted by byte, a letter stands for at most 1 / (the longest token holding it) tokens;
    under Qwen's NFC, where the text is ASCII, which no Unicode normal form changes (else 4 characters compose to 1)."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
    from specbuild_runtime import text as text_module
    from specbuild_runtime.validation import check_text_fits

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizer and normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), "isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    source = Path(text_module.__file__).read_text()
    tokenizer.train_from_iterator([source, *(c * 128 for c in " =-")], trainers.BpeTrainer(
        vocab_size=2000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), max_token_length=None))
    span = text_module.token_span(tokenizer)
    prompt = source.encode("ascii", "ignore").decode() * 20
    tokens = len(tokenizer.encode(prompt).ids)
    assert tokens >= span.fewest_tokens(prompt) > 4 * -(-len(prompt.encode()) // 128)
    with pytest.raises(RequestError, match="at least"):
        check_text_fits(prompt, span, max_seq_len=span.fewest_tokens(prompt) - 1, max_new_tokens=1)


@pytest.mark.parametrize("change, text", [
    ("Metaspace before ByteLevel", " " * 400),  # " " is "\u2581", three other bytes
    ("ByteLevel twice", " " * 400),  # " " is "\u0120", two other bytes
    ("Lowercase normalizer", "THE " * 100),  # "T" is "t"
    ("added token matched normalized", "KKK" * 100),  # U+212A KELVIN SIGN is "K" in NFC
    ("continuing_subword_prefix", "ab"),  # "##b" unknown, merged with "a" as "a" + "<unk>"[2:]
])
def test_a_tokenizer_that_may_take_a_byte_with_a_token_not_holding_it_is_not_bounded_by_byte(change, text):
    """Counted by byte, each byte of the text is taken by a token that holds it, whose length bounds that byte's share.
    Not where a step spells the byte in others, or an unknown token takes it: 400 spaces under Metaspace are 7 tokens,
    none holding the byte of a space, whose only token is itself (by byte, 1 a space). These are bounded by length."""
    from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers, trainers
    from specbuild_runtime.text import token_span

    tokenizer = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.pre_tokenizer = {
        "Metaspace before ByteLevel": pre_tokenizers.Sequence([pre_tokenizers.Metaspace(split=False), byte_level]),
        "ByteLevel twice": pre_tokenizers.Sequence([pre_tokenizers.ByteLevel(use_regex=False), byte_level]),
    }.get(change, byte_level)
    tokenizer.normalizer = {"Lowercase normalizer": normalizers.Lowercase(),
                            "added token matched normalized": normalizers.NFC()}.get(change)
    tokenizer.train_from_iterator(["the " * 50, " " * 120], trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.add_tokens([AddedToken("\u212a" * 3, normalized=True)])
    if change == "continuing_subword_prefix":
        vocab = {token: i for i, token in enumerate(["<unk>", "ank>", *pre_tokenizers.ByteLevel.alphabet()])}
        tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "<unk>")], unk_token="<unk>",
                                         continuing_subword_prefix="##"))
        tokenizer.pre_tokenizer = byte_level
    assert len(tokenizer.encode(text).ids) >= token_span(tokenizer).fewest_tokens(text)


def test_a_replace_of_the_empty_pattern_lengthens_the_text_its_tokens_stand_for():
    """Replace("", "x") writes "x" between characters: "a" * 100 is "xaxa...x", whose tokens "xaxa" stand for 2
    characters of the prompt each. Its shrink is 1, not 0 (which left the longest added token as the span, or, with
    none, divided by zero on every prompt)."""
    from tokenizers import AddedToken, Tokenizer, models, normalizers
    from specbuild_runtime.text import token_span

    tokenizer = Tokenizer(models.BPE(vocab={"<unk>": 0, "x": 1, "a": 2, "xa": 3, "xaxa": 4}, unk_token="<unk>",
                                     merges=[("x", "a"), ("xa", "xa")]))
    tokenizer.normalizer = normalizers.Replace("", "x")
    for added in ([], [AddedToken("!", normalized=False)]):
        tokenizer.add_tokens(added)
        text = "a" * 100
        assert len(tokenizer.encode(text).ids) >= token_span(tokenizer).fewest_tokens(text)


@pytest.mark.parametrize("change, text", [
    ("Strip normalizer", " " * 1000),
    ("Replace by nothing", "\u200b" * 1000),
    ("Whitespace pre-tokenizer", " " * 1000),
    ("UnicodeScripts pre-tokenizer", " " * 1000 + "a"),
    ("Split removing", "," * 1000),
    ("added token taking the spaces after it", "<end>" + " " * 1000),
    ("truncation", "a b " * 1000),
    ("unknown characters fused", "\u4e00" * 1000),
    ("unknown characters dropped", "a" + "\u00e9" * 1000),
    ("byte fallback lacking a byte", "a" + "\u00e9" * 1000),
    ("a byte missing from a byte-level vocabulary", "a" + "\u00e9" * 1000),
    ("byte-level with a continuing_subword_prefix", "ab" * 1000),
    ("byte-level with an end_of_word_suffix", "ab" * 1000),
])
def test_a_tokenizer_that_can_drop_or_fuse_text_has_no_token_span(change, text):
    """Each of these encodes 1000 characters or more into a token or two: no length bound holds, and such a bundle's
    prompts are tokenized to be measured."""
    from tokenizers import AddedToken, Regex, Tokenizer, models, normalizers, pre_tokenizers
    from specbuild_runtime.text import token_span

    tokenizer = Tokenizer.from_str(SPANNED["byte-level"].to_str())
    if change == "Strip normalizer":
        tokenizer.normalizer = normalizers.Strip()
    elif change == "Replace by nothing":
        tokenizer.normalizer = normalizers.Replace("\u200b", "")
    elif change == "Whitespace pre-tokenizer":
        tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    elif change == "UnicodeScripts pre-tokenizer":  # drops the spaces that begin the text
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.UnicodeScripts(), tokenizer.pre_tokenizer])
    elif change == "Split removing":
        tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(","), "removed")
    elif change == "added token taking the spaces after it":
        tokenizer.add_tokens([AddedToken("<end>", rstrip=True)])
    elif change == "truncation":
        tokenizer.enable_truncation(2)
    elif change == "unknown characters fused":
        tokenizer = Tokenizer(models.BPE(vocab={"<unk>": 0, "a": 1}, merges=[], unk_token="<unk>", fuse_unk=True))
    elif change == "unknown characters dropped":  # no unk_token: a character the vocabulary lacks is no token
        tokenizer = Tokenizer(models.BPE(vocab={"a": 0}, merges=[]))
    elif change == "byte fallback lacking a byte":  # "é" is C3 A9: the fallback needs both, else it drops the character
        tokenizer = Tokenizer(models.BPE(vocab={"a": 0, "<0xC3>": 1}, merges=[], byte_fallback=True))
    else:  # byte-level BPE without an unk_token, whose vocabulary cannot spell every byte as its model looks it up
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        affix = {"byte-level with a continuing_subword_prefix": {"continuing_subword_prefix": "##"},
                 "byte-level with an end_of_word_suffix": {"end_of_word_suffix": "</w>"}}.get(change, {})
        if change == "a byte missing from a byte-level vocabulary":
            alphabet = [c for c in alphabet if c not in byte_level.pre_tokenize_str("\u00e9")[0][0]]
        tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[], **affix))
        tokenizer.pre_tokenizer = byte_level
        if change == "byte-level with an end_of_word_suffix":  # a word a character: "a</w>", "b</w>"... are unknown
            tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex("."), "isolated"), byte_level])
    assert len(tokenizer.encode(text).ids) <= 2
    assert token_span(tokenizer) is None


@pytest.mark.parametrize("option, value, message", [
    ("cuda_graphs", "no", "^cuda_graphs must be true or false, not 'no'$"),
    ("prefix_reuse", None, "^prefix_reuse must be true or false, not None$"),
    ("draft_steps", 1, "^draft_steps must be true or false, not 1$"),
    ("target_rows", 5, r"^target_rows must be None or a slot.Rows \(slot.fixed_rows\(n\)\), not 5$"),
])
def test_a_decoder_option_of_another_type_is_one_line_before_anything_loads(bundles, option, value, message):
    """cuda_graphs="no" counted as true (on the CPU it loaded the greedy graphs), prefix_reuse=None as false, and
    target_rows=5 failed as an AttributeError from the slots."""
    with pytest.raises(RequestError, match=message):
        SpeculativeDecoder(bundles("llama"), **{option: value})


def test_fixed_target_rows_too_few_for_the_bundles_gamma_are_one_line_before_the_engines_load(bundles, monkeypatch):
    """fixed_rows(4) on a bundle of max γ 8 loaded, then failed in an onnxruntime Gather ("report it") at the first
    round of 5 drafts or more."""
    bundle = bundles("llama")
    gamma = load_manifest(bundle).gamma
    monkeypatch.setattr(SpeculativeDecoder, "_engines", lambda *args: pytest.fail("the engines loaded"))
    with pytest.raises(RequestError, match=rf"^target_rows: fixed calls of {gamma} rows cannot verify the {gamma} "
                                           rf"drafts this bundle's γ allows; pass slot.fixed_rows\({gamma}\)$"):
        SpeculativeDecoder(bundle, target_rows=fixed_rows(gamma - 1))


@pytest.mark.parametrize("text, message", [
    (None, r"^text must be a str \(encode takes one text\), not None \(NoneType\)$"),
    (b"def f():", r"^text must be a str \(encode takes one text\), not b'def f\(\):' \(bytes\)$"),
    (["def", "f"], r"^text must be a str \(encode takes one text\), not \['def', 'f'\] \(list\)$"),
    ("x\ud800", r"^text is not valid UTF-8: surrogates not allowed at character 1 "),
])
def test_encode_of_anything_but_valid_text_is_one_request_error(bundle, text, message):
    """tokenizers refused None, bytes and half a surrogate pair alike with "TextEncodeInput must be
    Union[TextInputSequence, Tuple[InputSequence, InputSequence]]", a TypeError, and encoded two texts as a pair."""
    with pytest.raises(RequestError, match=message):
        SpeculativeDecoder(bundle).encode(text)


@pytest.mark.parametrize("option", ["parallel", "grammar_cache"])
def test_a_decoder_count_below_one_is_refused_before_the_bundle_loads_or_the_process_changes(tmp_path, monkeypatch,
                                                                                            option):
    """parallel=0 was refused after shared_thread_pool had changed every later session of the process, grammar_cache=0
    after the bundle and its tokenizer had loaded."""
    import specbuild_runtime.decode as decode
    done = []
    monkeypatch.setattr(decode, "use_shared_thread_pool", lambda: done.append("shared pool"))
    monkeypatch.setattr(decode, "load_manifest", lambda *args, **kwargs: done.append("bundle"))
    with pytest.raises(RequestError, match=f"^{option} must be >= 1, not 0$"):
        SpeculativeDecoder(tmp_path, shared_thread_pool=True, **{option: 0})
    assert done == []
