"""`specbuild serve` audited as a service under load, against real servers on loopback (the checks before production;
vLLM's server is the reference where ours is silent). Each command prints its figures as JSON lines (--json: a file).

    python benchmarks/serve_audit.py load BUNDLE --parallel 2 --clients 8,32,128
    python benchmarks/serve_audit.py burst BUNDLE --clients 8,32,128,256
    python benchmarks/serve_audit.py leave BUNDLE
    python benchmarks/serve_audit.py leave BUNDLE --prefill-only --parallel 1
    python benchmarks/serve_audit.py signals BUNDLE
    python benchmarks/serve_audit.py soak BUNDLE --requests 5000
    python benchmarks/serve_audit.py soak BUNDLE --requests 100000 --minutes 10 --device cuda --parallel 4
    python benchmarks/serve_audit.py abuse BUNDLE

`load`: closed-loop clients (each sends its next request once the last is answered; a 429 again after its
Retry-After, as the openai client does), completions and chat completions, streamed and not, greedy code prompts;
every 200 checked against the same prompt decoded alone by SpeculativeDecoder.generate; latency and time to first
token p50/p99 (waits after a 429 included), requests/s, GET /health's latency meanwhile (from a process of its own),
and /metrics' outcomes against what the clients counted. `burst`: that many openai clients at once, with its retries
(max_retries 2) and without, and /metrics' counts against what they got. `leave`: a long prompt whose client gives
up during its prefill (how long the next request waits for the slot: --parallel 1, or it takes another; a bundle
that reads the prompt in under 0.2 s says so and has none to measure), streams left mid-way, clients that time out
while queued or decoding (how long until /metrics shows the slots free and the queue empty). `signals`: SIGTERM and
SIGINT with streams and whole requests in flight, some queued, at two --shutdown-timeout values: what each client
got, how long the server took to exit. `soak`: the server's RSS (VmRSS) every --every requests over thousands of mixed
requests (greedy and seeded sampling at a fixed γ or auto, streamed or not, n 2, logprobs, echo with logprobs, prompts
of 2 tokens to most of the context, streams left, clients that give up, bad bodies), for --requests or --minutes, its
growth after --warmup-requests; every greedy or seeded answer to a text prompt checked, /health meanwhile, metrics
against the clients' counts at the end (the one soak of the server: `serve_memory.py decoder` soaks a decoder in
threads). `abuse`: huge prompts, max_tokens past the context, n beyond the queue, malformed JSON in bulk, while
well-formed clients go on: what each bad one got, and whether every good one got its right text.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).parent))
from serve_load import rss_bytes, serving, sse_events  # noqa: E402


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def metrics(url: str) -> dict:
    """/metrics' samples, {(name, labels): value}."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def outcome_counts(url: str) -> dict:
    """specbuild_requests_total by "endpoint:outcome", and the connections refused beyond --max-connections (answered
    before any endpoint) as "refused_connections"."""
    values = metrics(url)
    counts = {f"{dict(labels)['endpoint']}:{dict(labels)['outcome']}": int(value)
              for (name, labels), value in values.items() if name == "specbuild_requests_total" and value}
    refused = int(values.get(("specbuild_refused_connections_total", ()), 0))
    return {**counts, **({"refused_connections": refused} if refused else {})}


def counted_since(url: str, before: dict) -> dict:
    """outcome_counts(url) less `before`'s, the unchanged left out."""
    after = outcome_counts(url)
    return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}


def prompts(count: int) -> list[str]:
    from specbuild.texts import CODE_PROMPTS, read_prompts
    return read_prompts(CODE_PROMPTS)[:count]


# The server's --model-name in `burst`, which names it in each request (the server's own default is the bundle's folder
# name: "bundle" worked for a bundle in a folder of that name alone, every request a 404 elsewhere).
MODEL = "audit"

# Given to the server with --chat-template (the demo bundle's tokenizer has none): ChatML, as Qwen's.
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def reference_texts(bundle: Path, url: str, texts: list[str], max_tokens: int) -> dict:
    """Each prompt's greedy text from SpeculativeDecoder.generate, as a completion and as a chat's one user turn (its
    ids from the server's /tokenize, which renders it as a chat completion does)."""
    from specbuild_runtime import SpeculativeDecoder

    decoder = SpeculativeDecoder(bundle, shared_thread_pool=True)
    chats = [httpx.post(f"{url}/tokenize", json={"messages": [{"role": "user", "content": text}]}).json()["tokens"]
             for text in texts]
    start = time.perf_counter()
    completions = [decoder.generate(text, max_new_tokens=max_tokens, temperature=0).text for text in texts]
    return {"completions": completions, "chat": [decoder.generate(ids, max_new_tokens=max_tokens, temperature=0).text
                                                 for ids in chats],
            "sequential_requests_per_second": round(len(texts) / (time.perf_counter() - start), 1)}


def percentile_ms(values: list[float], q: float) -> float | None:
    return round(1e3 * float(np.percentile(values, q)), 1) if values else None


async def completion(http: httpx.AsyncClient, url: str, body: dict, timeout: float | None = None,
                     endpoint: str = "completions") -> dict:
    """One completion or chat completion, streamed or not: its status, text, time to first text and end to end, or
    what refused it."""
    start = time.perf_counter()
    first, text, error, status, retry_after = None, [], None, None, None
    path = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}[endpoint]

    def text_of(choice: dict) -> str:
        return choice.get("text") or (choice.get("delta") or choice.get("message") or {}).get("content") or ""

    try:
        async with http.stream("POST", f"{url}{path}", json=body, timeout=timeout) as response:
            status, retry_after = response.status_code, response.headers.get("retry-after")
            if status != 200:
                error = json.loads(await response.aread())["error"]["message"]
            elif body.get("stream"):
                async for event in sse_events(response):
                    if "error" in event:
                        error = event["error"]["message"]
                    elif event["choices"] and text_of(event["choices"][0]):
                        first = first or time.perf_counter()
                        text.append(text_of(event["choices"][0]))
            else:
                reply = json.loads(await response.aread())
                text.append(text_of(reply["choices"][0]))
    except httpx.TransportError as exc:
        error = (f"{type(exc).__name__} {'in' if status else 'before'} the response, "
                 f"{time.perf_counter() - start:.3f} s after the request: {exc}")
    end = time.perf_counter()
    return {"status": status, "text": "".join(text), "error": error, "retry_after": retry_after,
            "ttft": first - start if first else None, "latency": end - start, "sent": start}


PROBE = """
import sys, time, httpx
with httpx.Client(timeout=60) as http:
    while sys.stdin.readline():
        sent = time.perf_counter()
        assert http.get(sys.argv[1] + "/health").status_code == 200
        print(time.perf_counter() - sent, flush=True)
"""


@contextmanager
def probing_health(url: str):
    """GET /health every 0.1 s from a process of its own (in the clients' process their own work delayed it), as a
    load balancer's probe: yields the list its latencies are added to once the block ends."""
    latencies: list[float] = []
    probe = subprocess.Popen([sys.executable, "-c", PROBE, url], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    stop = threading.Event()

    def ask() -> None:
        while not stop.wait(0.1):
            probe.stdin.write("\n")
            probe.stdin.flush()
            latencies.append(float(probe.stdout.readline()))

    asking = threading.Thread(target=ask)
    asking.start()
    try:
        yield latencies
    finally:
        stop.set()
        asking.join()
        probe.stdin.close()
        probe.wait(30)


async def closed_loop(url: str, texts: list[str], expected: dict, clients: int, requests: int,
                      max_tokens: int) -> dict:
    """`clients` clients, each sending its next request once the last is answered, until `requests` were sent: in
    turn a completion streamed, one whole, a chat streamed, one whole; each 200 checked against `expected`. A 429 is
    sent again after its Retry-After (its latency counts the wait), as the openai client does."""
    results: list[dict] = []
    wrong: list[int] = []
    busy: list[str] = []  # the 429s, each followed by a retry
    sent = 0

    async def client(c: int, http: httpx.AsyncClient) -> None:
        nonlocal sent
        while sent < requests:
            i = sent
            sent += 1
            job, endpoint = i % len(texts), "chat" if i % 4 >= 2 else "completions"
            body = {"max_tokens": max_tokens, "temperature": 0, "stream": bool(i % 2),
                    **({"prompt": texts[job]} if endpoint == "completions" else
                       {"messages": [{"role": "user", "content": texts[job]}]})}
            started = time.perf_counter()
            while (result := await completion(http, url, body, endpoint=endpoint))["status"] == 429:
                busy.append(result["error"])  # then waits as it is told, as the openai client does
                await asyncio.sleep(float(result["retry_after"]))
            waited = result["sent"] - started  # its waits included in its figures
            result["latency"] += waited
            result["ttft"] = result["ttft"] and result["ttft"] + waited
            if result["status"] == 200 and not result["error"] and result["text"] != expected[endpoint][job]:
                wrong.append(i)
            results.append(result)

    start = time.perf_counter()
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    with probing_health(url) as health:
        async with httpx.AsyncClient(timeout=600, limits=limits) as http:
            await asyncio.gather(*(client(c, http) for c in range(clients)))
    seconds = time.perf_counter() - start
    ok = [r for r in results if r["status"] == 200 and not r["error"]]
    refused: dict[str, int] = {}
    for r in results:
        if r not in ok:
            key = f"{r['status']} retry-after={r['retry_after']}: {r['error']}"
            refused[key] = refused.get(key, 0) + 1
    return {"clients": clients, "requests": len(results), "ok": len(ok), "wrong_text": len(wrong), "refused": refused,
            "retried_429": len(busy), "a_429": busy[0] if busy else None,
            "seconds": round(seconds, 1), "requests_per_second": round(len(ok) / seconds, 2),
            "latency_ms_p50": percentile_ms([r["latency"] for r in ok], 50),
            "latency_ms_p99": percentile_ms([r["latency"] for r in ok], 99),
            "ttft_ms_p50": percentile_ms([r["ttft"] for r in ok if r["ttft"]], 50),
            "ttft_ms_p99": percentile_ms([r["ttft"] for r in ok if r["ttft"]], 99),
            "health_ms_p50_p99": [percentile_ms(health, 50), percentile_ms(health, 99)]}


def load(args) -> dict:
    texts = prompts(args.prompts)
    runs = []
    with serving(args.bundle, args.parallel, max_queue=args.max_queue, more=("--chat-template", CHATML)) as (process,
                                                                                                          url):
        expected = reference_texts(args.bundle, url, texts, args.max_tokens)
        print(f"in-process generate, one request after another: {expected['sequential_requests_per_second']} "
              "requests/s", flush=True)
        for clients in args.clients:
            before = outcome_counts(url)
            run = asyncio.run(closed_loop(url, texts, expected, clients, args.requests, args.max_tokens))
            run["metrics_outcomes"] = counted_since(url, before)
            run["load_average"] = load_average()
            run["rss_mib"] = round(rss_bytes(process.pid) / 2**20, 1)
            print(json.dumps(run), flush=True)
            runs.append(run)
    return {"parallel": args.parallel, "max_queue": args.max_queue,
            "sequential_requests_per_second": expected["sequential_requests_per_second"], "runs": runs}


async def until_idle(url: str, http: httpx.AsyncClient, since: float, limit: float = 60.0) -> float | None:
    """Seconds from `since` until /metrics shows no slot busy and nothing queued (polled every 10 ms), None past
    `limit`."""
    while time.perf_counter() - since < limit:
        text = (await http.get(f"{url}/metrics")).text
        values = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
                  if s.name in ("specbuild_slots_busy", "specbuild_queue_depth")}
        if values["specbuild_slots_busy"] == 0 and values["specbuild_queue_depth"] == 0:
            return round(time.perf_counter() - since, 3)
        await asyncio.sleep(0.01)
    return None


async def leave_streams(url: str, count: int, prompt: str, max_tokens: int, after_events: int) -> dict:
    """`count` streams at once, each closed by its client after `after_events` events: time until the server is idle."""
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=count + 1)) as http, \
            httpx.AsyncClient(timeout=120) as probe:
        async def one() -> int:
            body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
            seen = 0
            async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        seen += 1
                        if seen >= after_events:
                            break
            return seen
        seen = await asyncio.gather(*(one() for _ in range(count)))
        left = time.perf_counter()
        idle = await until_idle(url, probe, left)
    return {"streams": count, "events_read": sum(seen), "seconds_until_idle": idle}


async def time_out_requests(url: str, count: int, prompt: str, max_tokens: int, client_timeout: float,
                            stream: bool) -> dict:
    """`count` requests whose client gives up after `client_timeout` s (httpx's read timeout closes the connection)."""
    outcomes: dict[str, int] = {}
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=count + 1)) as http, \
            httpx.AsyncClient(timeout=120) as probe:
        async def one() -> None:
            body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
            try:
                async with http.stream("POST", f"{url}/v1/completions", json=body,
                                       timeout=httpx.Timeout(120, read=client_timeout)) as response:
                    async for _ in response.aiter_raw():
                        pass
                key = f"HTTP {response.status_code}"
            except httpx.TimeoutException as exc:
                key = type(exc).__name__
            outcomes[key] = outcomes.get(key, 0) + 1
        await asyncio.gather(*(one() for _ in range(count)))
        gave_up = time.perf_counter()
        idle = await until_idle(url, probe, gave_up)
    return {"requests": count, "stream": stream, "client_timeout_s": client_timeout, "client_saw": outcomes,
            "seconds_until_idle": idle}


async def left_in_prefill(url: str, prompt: list[int], after: float, stream: bool, times: int) -> dict:
    """A long prompt whose client gives up `after` s, while its prefill runs, then at once a one-token request, which
    waits for the slot: its latency, beside that of the same one-token request sent after the long prompt is decoded
    whole (the time it takes alone). Each long prompt is one the slot's cache does not hold (its first token
    differs). A bundle that reads the prompt in less than `after` has none to measure."""
    waited, alone, whole = [], [], []
    tiny = {"prompt": prompt[:4], "max_tokens": 1, "temperature": 0}
    async with httpx.AsyncClient(timeout=120) as http:
        for i in range(times):
            body = {"prompt": [prompt[0] + i + 1, *prompt[1:]], "max_tokens": 1, "temperature": 0, "stream": stream}
            result = await completion(http, url, body, timeout=httpx.Timeout(120, read=after))
            if not (result["error"] or "").startswith("ReadTimeout"):
                return {"prompt_tokens": len(prompt), "read_within_s": after, "seconds": round(result["latency"], 3)}
            waited.append((await completion(http, url, tiny))["latency"])
            body["prompt"] = [prompt[0] + i + 1 + times, *prompt[1:]]
            whole.append((await completion(http, url, body))["latency"])
            alone.append((await completion(http, url, tiny))["latency"])
    return {"prompt_tokens": len(prompt), "client_gave_up_after_s": after, "stream": stream,
            "next_request_s_median": round(float(np.median(waited)), 3),
            "same_request_alone_s_median": round(float(np.median(alone)), 3),
            "long_prompt_whole_s_median": round(float(np.median(whole)), 3),
            "next_request_s": [round(x, 3) for x in waited]}


def leave(args) -> dict:
    texts = prompts(args.prompts)
    long_prompt = " ".join(texts) * 4  # prefill of most of the context, cut to fit below
    from specbuild_runtime import SpeculativeDecoder
    decoder = SpeculativeDecoder(args.bundle)
    ids = decoder.tokenizer.encode(long_prompt).ids[: decoder.max_seq_len - 40]
    report = {}
    with serving(args.bundle, args.parallel, max_queue=args.max_queue) as (_, url):
        for stream in (False, True):
            report[f"left_in_prefill_{'stream' if stream else 'whole'}"] = asyncio.run(
                left_in_prefill(url, ids, 0.2, stream, 5))
        before = outcome_counts(url)
        if not args.prefill_only:
            report["streams_left_after_2_events"] = asyncio.run(leave_streams(url, 16, texts[0], 400, 2))
            report["streams_left_after_1_event_long_prompt"] = asyncio.run(leave_streams(url, 16, ids, 30, 1))
            for stream in (False, True):
                report[f"client_timeout_0.3s_{'stream' if stream else 'whole'}"] = asyncio.run(
                    time_out_requests(url, 24, ids, 30, 0.3, stream))
        report["metrics_outcomes"] = counted_since(url, before)
        report["load_average"] = load_average()
    for name, value in report.items():
        print(name, json.dumps(value), flush=True)
    return report


async def signalled(url: str, process, sig: int, streams: int, whole: int, prompt: str, max_tokens: int) -> dict:
    """`streams` streams and `whole` unstreamed requests in flight (more than the slots: some queued), then `sig` once
    two streams have their first event: what each client got, and when the server exited."""
    results: list[str] = []
    first_events = asyncio.Semaphore(0)
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=streams + whole + 4)) as http:
        async def stream() -> None:
            body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
            events, got = 0, None
            try:
                async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
                    async for line in response.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        events += 1
                        if events == 1:
                            first_events.release()
                        if "error" in line:
                            got = "error event: " + json.loads(line[6:])["error"]["message"]
                        elif line == "data: [DONE]":
                            got = (got or "finished") + " + [DONE]"
                got = f"stream HTTP {response.status_code}: {got or 'no [DONE]'}"
            except httpx.TransportError as exc:
                first_events.release()
                got = f"stream {type(exc).__name__}"
            results.append(got)

        async def one() -> None:
            body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
            try:
                response = await http.post(f"{url}/v1/completions", json=body)
                got = f"whole HTTP {response.status_code}"
                if response.status_code != 200:
                    got += f" retry-after={response.headers.get('retry-after')}: {response.json()['error']['message']}"
            except httpx.TransportError as exc:
                got = f"whole {type(exc).__name__}"
            results.append(got)

        tasks = [asyncio.ensure_future(stream()) for _ in range(streams)]
        tasks += [asyncio.ensure_future(one()) for _ in range(whole)]
        for _ in range(min(streams, 2)):
            await first_events.acquire()
        sent = time.perf_counter()
        process.send_signal(sig)
        while process.poll() is None:
            await asyncio.sleep(0.01)
        exited = time.perf_counter() - sent
        await asyncio.gather(*tasks)
    summary: dict[str, int] = {}
    for got in results:
        summary[got] = summary.get(got, 0) + 1
    return {"signal": signal.Signals(sig).name, "seconds_to_exit": round(exited, 2), "exit_status": process.returncode,
            "clients_got": summary}


def signals(args) -> dict:
    texts = prompts(args.prompts)
    report = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        for grace in (30, 1):
            with serving(args.bundle, args.parallel, max_queue=args.max_queue,
                         more=("--shutdown-timeout", str(grace))) as (process, url):
                result = asyncio.run(signalled(url, process, sig, 6, 6, texts[0], 900))
            result["shutdown_timeout"] = grace
            print(json.dumps(result), flush=True)
            report[f"{result['signal']}_grace_{grace}"] = result
    return report


def bad_bodies(max_seq_len: int, prompt: str, seed: int = 0) -> list[tuple[str, str, bytes]]:
    """(what, path, body) of requests a careless or hostile client sends. Those made of many of a thing are sized
    under the body limit: past it, the 413 answers them before the check they are meant for."""
    from specbuild_runtime.serve.app import BODY_BYTES_BASE, BODY_BYTES_PER_TOKEN

    limit = BODY_BYTES_BASE + BODY_BYTES_PER_TOKEN * max_seq_len
    depth, biases, stops, parts = limit // 2 - 20, limit // 12, limit // 16, limit // 32
    pick = random.Random(seed)
    text = json.dumps
    out = [
        ("huge prompt (8 MB)", "/v1/completions", text({"prompt": "word " * 1_600_000}).encode()),
        ("prompt just under the body limit", "/v1/completions", text({"prompt": "ab " * (limit // 3 - 20)}).encode()),
        ("prompt of more token ids than the context", "/v1/completions",
         text({"prompt": [5] * (max_seq_len + 1)}).encode()),
        ("max_tokens past the context", "/v1/completions",
         text({"prompt": prompt, "max_tokens": max_seq_len}).encode()),
        ("max_tokens 1e30", "/v1/completions", text({"prompt": prompt, "max_tokens": 1e30}).encode()),
        ("max_tokens -1", "/v1/completions", text({"prompt": prompt, "max_tokens": -1}).encode()),
        ("chat max_tokens past the context", "/v1/chat/completions",
         text({"messages": [{"role": "user", "content": prompt}], "max_tokens": 10 * max_seq_len}).encode()),
        ("n 1000", "/v1/completions", text({"prompt": prompt, "n": 1000}).encode()),
        ("n 10**9", "/v1/chat/completions",
         text({"messages": [{"role": "user", "content": "hi"}], "n": 10**9}).encode()),
        ("n 0", "/v1/completions", text({"prompt": prompt, "n": 0}).encode()),
        ("n 2.5", "/v1/completions", text({"prompt": prompt, "n": 2.5}).encode()),
        ("batch of 10000 prompts", "/v1/completions", text({"prompt": ["a"] * 10000}).encode()),
        ("temperature NaN", "/v1/completions", b'{"prompt": "x", "temperature": NaN}'),
        ("top_p Infinity", "/v1/completions", b'{"prompt": "x", "top_p": Infinity}'),
        ("logprobs 10**6", "/v1/completions", text({"prompt": prompt, "logprobs": 10**6}).encode()),
        ("top_logprobs 10**6", "/v1/chat/completions",
         text({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 10**6}).encode()),
        ("seed 2**80", "/v1/completions", text({"prompt": prompt, "seed": 2**80, "temperature": 1}).encode()),
        (f"{stops} stop strings", "/v1/completions", text({"prompt": prompt, "stop": ["x" * 10] * stops}).encode()),
        (f"logit_bias of {biases} tokens", "/v1/completions",
         text({"prompt": prompt, "logit_bias": {str(i): 1 for i in range(biases)}}).encode()),
        (f"JSON nested {depth} deep", "/v1/completions", b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"),
        ("JSON array", "/v1/completions", b"[1, 2, 3]"),
        ("empty body", "/v1/completions", b""),
        ("invalid UTF-8", "/v1/completions", b'{"prompt": "\xff\xfe"}'),
        ("lone surrogate", "/v1/completions", b'{"prompt": "\\ud800"}'),
        ("token id past the vocabulary", "/v1/completions", text({"prompt": [10**9]}).encode()),
        ("messages not a list", "/v1/chat/completions", text({"messages": "hi"}).encode()),
        (f"a message of {parts} parts", "/v1/chat/completions",
         text({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * parts}]}).encode()),
        ("unknown field", "/v1/completions", text({"prompt": prompt, "frobnicate": 1}).encode()),
        ("stream_options without stream", "/v1/completions",
         text({"prompt": prompt, "stream_options": {"include_usage": True}}).encode()),
    ]
    good = text({"prompt": prompt, "max_tokens": 8}).encode()
    for i in range(200):  # truncated and mangled copies of a good body
        cut = pick.randrange(1, len(good))
        mangled = bytearray(good)
        mangled[pick.randrange(len(good))] = pick.randrange(256)
        out.append(("truncated JSON", "/v1/completions", good[:cut]))
        out.append(("a byte changed", "/v1/completions", bytes(mangled)))
    return out


async def abuse_run(url: str, bodies: list, good_prompt: str, expected: str, good_clients: int) -> dict:
    """Every bad body sent (16 at a time) while `good_clients` send good requests back to back until the bad are
    done: what the bad got, and whether each good one got its right text."""
    by_what: dict[str, dict[str, int]] = {}
    examples: dict[str, str] = {}
    good = {"ok": 0, "wrong": 0, "failed": []}
    done = asyncio.Event()
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=64)) as http:
        async def bad(semaphore, what: str, path: str, body: bytes) -> None:
            async with semaphore:
                start = time.perf_counter()
                try:
                    response = await http.post(f"{url}{path}", content=body,
                                               headers={"content-type": "application/json"})
                    key = f"{response.status_code}"
                    try:
                        message = response.json()["error"]["message"]
                    except (ValueError, KeyError, TypeError):
                        message = response.text[:120]
                except httpx.TransportError as exc:
                    key, message = type(exc).__name__, str(exc)
                by_what.setdefault(what, {})
                by_what[what][key] = by_what[what].get(key, 0) + 1
                examples.setdefault(f"{what}: {key}", f"{time.perf_counter() - start:.2f} s: {message[:160]}")

        async def good_client() -> None:
            while not done.is_set():
                result = await completion(http, url, {"prompt": good_prompt, "max_tokens": 16, "temperature": 0})
                if result["status"] != 200 or result["error"]:
                    good["failed"].append(f"{result['status']}: {result['error']}")
                elif result["text"] == expected:
                    good["ok"] += 1
                else:
                    good["wrong"] += 1

        goods = [asyncio.ensure_future(good_client()) for _ in range(good_clients)]
        semaphore = asyncio.Semaphore(16)
        await asyncio.gather(*(bad(semaphore, *one) for one in bodies))
        done.set()
        await asyncio.gather(*goods)
    return {"bad": by_what, "examples": examples, "good": good}


def abuse(args) -> dict:
    texts = prompts(args.prompts)
    from specbuild_runtime import SpeculativeDecoder
    decoder = SpeculativeDecoder(args.bundle)
    expected = decoder.generate(texts[1], max_new_tokens=16, temperature=0).text
    with serving(args.bundle, args.parallel, max_queue=args.max_queue, more=("--chat-template", CHATML)) as (process,
                                                                                                          url):
        rss_before = rss_bytes(process.pid)
        report = asyncio.run(abuse_run(url, bad_bodies(decoder.max_seq_len, texts[0]), texts[1], expected, 4))
        report["outcomes"] = outcome_counts(url)
        report["rss_mib"] = [round(rss_before / 2**20, 1), round(rss_bytes(process.pid) / 2**20, 1)]
        report["healthy_after"] = httpx.get(f"{url}/health").status_code
    report["load_average"] = load_average()
    for what, example in report["examples"].items():
        print(f"{what}, the first in {example}")
    print(json.dumps({k: v for k, v in report.items() if k != "examples"}), flush=True)
    return report


def soak_jobs(count: int, texts: list[str], max_seq_len: int, seed: int = 0) -> list[dict]:
    """Mixed requests, which change the shapes onnxruntime sees (its CPU arena and memory-pattern planner key on them):
    greedy, and seeded sampling (top-p 0.95, at a fixed γ 4 or auto), streamed or not, n 2, logprobs, echo with
    logprobs (scoring the prompt), prompts of 2 token ids to most of the context, streams the client leaves after its
    first event ("leave"), requests it gives up on after 50 ms ("give_up"), and bad bodies ("bad"). "check": a text
    prompt's, whose answer (its first choice's) has one right text: greedy, or sampled from a seed."""
    pick = random.Random(seed)
    out = []
    for _ in range(count):
        job = {"prompt": pick.choice(texts), "max_tokens": pick.randint(1, 48), "temperature": 0,
               "stream": pick.random() < 0.5}
        kind = pick.random()
        if kind < 0.25:  # a few seeds and lengths, so that their right texts are few to compute
            job.update(temperature=0.8, top_p=0.95, seed=pick.randrange(4), max_tokens=pick.choice((16, 48)),
                       **({"gamma": 4} if pick.random() < 0.5 else {}), **({"n": 2} if kind < 0.05 else {}))
        elif kind < 0.3:
            job.update(echo=True, logprobs=2, stream=False)
        elif kind < 0.35:
            job["prompt"] = [pick.randrange(1, 300) for _ in range(pick.randint(2, max_seq_len - 60))]
        elif kind < 0.45:
            job["logprobs"] = pick.randint(0, 5)
        out.append({"body": job, "check": "echo" not in job and isinstance(job["prompt"], str),
                    "leave": job["stream"] and pick.random() < 0.08, "give_up": pick.random() < 0.04,
                    "bad": pick.random() < 0.05})
    return out


def answer_key(body: dict) -> tuple:
    """What decides a checked request's text."""
    return tuple(body.get(name) for name in ("prompt", "max_tokens", "temperature", "top_p", "seed", "gamma"))


async def soak_run(url: str, pid: int, jobs: list[dict], expected: dict, clients: int, every: int,
                   seconds_limit: float | None) -> dict:
    counted: dict[str, int] = {}
    checked, wrong = 0, []
    start = time.perf_counter()
    rss = [(0, 0.0, rss_bytes(pid))]  # (requests done, seconds, bytes)
    usage_tokens = 0
    done = 0
    queue = iter(jobs)

    def count(key: str) -> None:
        counted[key] = counted.get(key, 0) + 1

    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=clients + 2)) as http:
        async def one(job: dict) -> None:
            nonlocal usage_tokens, checked
            body = dict(job["body"])
            if job["bad"]:
                response = await http.post(f"{url}/v1/completions", content=json.dumps(body)[:-3])
                return count(f"HTTP {response.status_code}")
            if body["stream"]:
                body["stream_options"] = {"include_usage": True}
            timeout = httpx.Timeout(120, read=0.05) if job["give_up"] else None
            text, usage = [], None
            try:
                async with http.stream("POST", f"{url}/v1/completions", json=body,
                                       **({"timeout": timeout} if timeout else {})) as response:
                    if response.status_code != 200:
                        await response.aread()
                        return count(f"HTTP {response.status_code}")
                    if not body["stream"]:
                        reply = json.loads(await response.aread())
                        text, usage = [reply["choices"][0]["text"]], reply["usage"]
                    else:
                        async for event in sse_events(response):
                            if job["leave"]:
                                return count("left")
                            if event.get("usage"):
                                usage = event["usage"]
                            elif event["choices"] and event["choices"][0].get("index", 0) == 0:
                                text.append(event["choices"][0]["text"])
            except httpx.TimeoutException:
                return count("gave up")
            count("ok")
            usage_tokens += usage["completion_tokens"]
            if job["check"]:
                checked += 1
                if "".join(text) != expected[answer_key(body)]:
                    wrong.append(body)

        async def client() -> None:
            nonlocal done
            for job in queue:
                if seconds_limit is not None and time.perf_counter() - start >= seconds_limit:
                    return
                await one(job)
                done += 1
                if done % every == 0:
                    rss.append((done, round(time.perf_counter() - start, 1), rss_bytes(pid)))

        with probing_health(url) as health:
            await asyncio.gather(*(client() for _ in range(clients)))
        seconds = time.perf_counter() - start
    return {"clients": clients, "requests": done, "seconds": round(seconds, 1), "clients_counted": counted,
            "checked": checked, "wrong_text": len(wrong),
            "usage_completion_tokens_of_ok": usage_tokens,
            "health_ms_p50_p99_max": [percentile_ms(health, 50), percentile_ms(health, 99),
                                      round(1e3 * max(health), 1)],
            "rss_mib": [(n, t, round(b / 2**20, 1)) for n, t, b in rss]}


def soak(args) -> dict:
    texts = prompts(args.prompts)
    from specbuild_runtime import SpeculativeDecoder
    decoder = SpeculativeDecoder(args.bundle, device=args.device, shared_thread_pool=True)
    jobs = soak_jobs(args.requests, texts, decoder.max_seq_len)
    expected = {}
    for job in jobs:
        key = answer_key(job["body"])
        if job["check"] and key not in expected:
            prompt, max_tokens, temperature, top_p, seed, gamma = key
            expected[key] = decoder.generate(prompt, max_new_tokens=max_tokens, temperature=temperature,
                                             top_p=top_p or 1.0, seed=seed, gamma=gamma or "auto").text
    del decoder
    # vllm: a sampled request's omitted top_k, min_p and penalties are OpenAI's, as generate's, whatever the bundle's
    # generation_config says
    with serving(args.bundle, args.parallel, device=args.device, cuda_graphs=args.cuda_graphs, max_queue=args.max_queue,
                 more=("--generation-config", "vllm")) as (process, url):
        report = asyncio.run(soak_run(url, process.pid, jobs, expected, args.clients, args.every,
                                      60 * args.minutes if args.minutes else None))
        values = metrics(url)
        report["metrics"] = {
            "outcomes": outcome_counts(url),
            "generation_tokens_total": values[("specbuild_generation_tokens_total", ())],
            "slots_busy": values[("specbuild_slots_busy", ())], "queue_depth": values[("specbuild_queue_depth", ())]}
    warm = [mib for n, _, mib in report["rss_mib"] if n >= args.warmup_requests]
    report["rss_growth_after_warmup"] = round((warm[-1] - warm[0]) / warm[0], 4) if len(warm) > 1 else None
    report["load_average"] = load_average()
    print(json.dumps(report), flush=True)
    return report


async def openai_burst(url: str, texts: list[str], expected: list[str], clients: int, max_tokens: int,
                       max_retries: int) -> dict:
    """`clients` requests at once from the openai client (its own retries of a 429: `max_retries`), streamed and not."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=max_retries, timeout=600,
                                http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=clients)))
    got: dict[str, int] = {}
    latencies = []

    async def one(i: int) -> None:
        job = i % len(texts)
        start = time.perf_counter()
        try:
            if i % 2:
                text = "".join([chunk.choices[0].text async for chunk in await client.completions.create(
                    model=MODEL, prompt=texts[job], max_tokens=max_tokens, temperature=0, stream=True)
                    if chunk.choices])
            else:
                text = (await client.completions.create(model=MODEL, prompt=texts[job], max_tokens=max_tokens,
                                                        temperature=0)).choices[0].text
            key = "right text" if text == expected[job] else "wrong text"
            latencies.append(time.perf_counter() - start)
        except openai.APIStatusError as exc:
            key = f"{type(exc).__name__} {exc.status_code}: {exc.message[:100]}"
        got[key] = got.get(key, 0) + 1

    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(clients)))
    seconds = time.perf_counter() - start
    await client.close()
    return {"clients": clients, "max_retries": max_retries, "got": got, "seconds": round(seconds, 2),
            "latency_ms_p50": percentile_ms(latencies, 50), "latency_ms_p99": percentile_ms(latencies, 99)}


def burst(args) -> dict:
    texts = prompts(args.prompts)
    runs = []
    with serving(args.bundle, args.parallel, max_queue=args.max_queue,
                 more=("--chat-template", CHATML, "--model-name", MODEL)) as (_, url):
        expected = reference_texts(args.bundle, url, texts, args.max_tokens)["completions"]
        for clients in args.clients:
            for retries in (0, 2):
                before = outcome_counts(url)
                runs.append(asyncio.run(openai_burst(url, texts, expected, clients, args.max_tokens, retries)))
                runs[-1]["metrics_outcomes"] = counted_since(url, before)  # against what the clients got
                runs[-1]["load_average"] = load_average()
                print(json.dumps(runs[-1]), flush=True)
    return {"parallel": args.parallel, "max_queue": args.max_queue, "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    for name in ("load", "burst", "leave", "signals", "soak", "abuse"):
        command = commands.add_parser(name)
        command.add_argument("bundle", type=Path)
        command.add_argument("--parallel", type=int, default=2)
        command.add_argument("--max-queue", type=int, default=64)
        command.add_argument("--prompts", type=int, default=16)
        command.add_argument("--json", type=Path)
    for name in ("load", "burst"):  # the others' requests ask for what each of their cases needs
        commands.choices[name].add_argument("--max-tokens", type=int, default=32)
    commands.choices["load"].add_argument("--clients", type=lambda s: [int(x) for x in s.split(",")],
                                          default=[8, 32, 128])
    commands.choices["load"].add_argument("--requests", type=int, default=256)
    commands.choices["burst"].add_argument("--clients", type=lambda s: [int(x) for x in s.split(",")],
                                           default=[8, 32, 128])
    commands.choices["leave"].add_argument("--prefill-only", action="store_true")
    soak_command = commands.choices["soak"]
    soak_command.add_argument("--requests", type=int, default=5000)
    soak_command.add_argument("--minutes", type=float, help="stop sending after this long, if before --requests")
    soak_command.add_argument("--clients", type=int, default=32)
    soak_command.add_argument("--every", type=int, default=250, help="sample RSS every this many requests")
    # the mix's RSS levels off near request 2500 (docs/serving.md, Under load: +9-10 MiB from 500 to 2500, +0.1-1.1
    # over the 2500 after), so growth from 500 was mostly the warm-up's
    soak_command.add_argument("--warmup-requests", type=int, default=2500,
                              help="RSS growth is measured from the first sample at or after this many requests")
    soak_command.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    soak_command.add_argument("--cuda-graphs", choices=("on", "off", "default"), default="default",
                              help="the server's CUDA graphs: on, off or its own choice")
    args = parser.parse_args()
    report = {"command": args.command, "bundle": str(args.bundle), "load_average_before": load_average(),
              **globals()[args.command](args)}
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
