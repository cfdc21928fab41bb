"""Resident memory of a SpeculativeDecoder in threads over many mixed requests, as serve decodes them but without the
server: does it plateau, and what holds it? (The server's own: `serve_audit.py soak`, whose mix holds this one.)

    python benchmarks/serve_memory.py decoder BUNDLE --requests 600 --parallel 2 --json decoder.json

Requests mix what changes the shapes onnxruntime sees (its CPU arena and memory-pattern planner key on them):
prompt lengths from a few tokens to most of the context, greedy and seeded sampling, streamed or not, logprobs,
echo with logprobs (scoring the prompt), n = 2, and streams the client leaves after its first chunk. RSS
(/proc/PID/status VmRSS) is sampled every --every requests, with the Python heap (tracemalloc); the report gives the
heap's largest growth by line between the first sample and the last, and the RSS once glibc's malloc_trim(0) has
handed back the free memory malloc keeps: what is left is what the process still uses.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import sys
import threading
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from serve_load import rss_bytes  # noqa: E402

VOCAB = 300  # prompt token ids are drawn below this: every bundle's tokenizer knows them


def jobs(count: int, max_seq_len: int, seed: int = 0) -> list[dict]:
    """`count` completion bodies, each a random mix; "leave" marks a stream the client leaves early."""
    pick = random.Random(seed)
    out = []
    for i in range(count):
        max_tokens = pick.randint(1, 24)
        length = pick.randint(2, max_seq_len - max_tokens - 16)
        job = {"prompt": [pick.randrange(1, VOCAB) for _ in range(length)], "max_tokens": max_tokens,
               "temperature": 0.0 if pick.random() < 0.5 else 0.8}
        if job["temperature"]:
            job["seed"] = i
            if pick.random() < 0.2:
                job["n"] = 2
        if pick.random() < 0.4:
            job["logprobs"] = pick.randint(0, 5)
            if pick.random() < 0.5:
                job["echo"] = True  # scores the prompt
        job["stream"] = "echo" not in job and pick.random() < 0.5
        job["leave"] = job["stream"] and pick.random() < 0.2
        out.append(job)
    return out


def measure_decoder(bundle: Path, parallel: int, work: list[dict], every: int) -> dict:
    from specbuild_runtime import SpeculativeDecoder
    from specbuild_runtime.errors import RequestError

    decoder = SpeculativeDecoder(bundle, parallel=parallel)
    pid = os.getpid()
    tracemalloc.start()
    samples, outcomes, lock = [(0, rss_bytes(pid), tracemalloc.get_traced_memory()[0])], {}, threading.Lock()
    first = tracemalloc.take_snapshot()
    done = 0

    def one(job: dict) -> None:
        nonlocal done
        options = {"max_new_tokens": job["max_tokens"], "temperature": job["temperature"], "seed": job.get("seed"),
                   "logprobs": job.get("logprobs")}
        try:
            for _ in range(job.get("n", 1)):
                if job.get("echo"):
                    decoder.generate(job["prompt"], prompt_logprobs=job["logprobs"], **options)
                elif job["stream"]:
                    stream = decoder.stream(job["prompt"], **options)
                    for _ in stream:
                        if job["leave"]:
                            stream.close()  # as serve does for a client gone
                            break
                else:
                    decoder.generate(job["prompt"], **options)
            outcome = "ok"
        except RequestError as exc:
            outcome = f"refused: {exc}"[:80]
        with lock:
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
            done += 1
            if done % every == 0:
                samples.append((done, rss_bytes(pid), tracemalloc.get_traced_memory()[0]))

    start = time.perf_counter()
    with ThreadPoolExecutor(parallel) as pool:
        list(pool.map(one, work))
    seconds = time.perf_counter() - start
    growth = tracemalloc.take_snapshot().compare_to(first, "lineno")[:5]
    tracemalloc.stop()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        trimmed = round(rss_bytes(pid) / 2**20, 1)
    except (OSError, AttributeError):  # not glibc
        trimmed = None
    return {"parallel": parallel, "seconds": round(seconds, 1), "outcomes": outcomes,
            "rss_mib": [(n, round(rss / 2**20, 1)) for n, rss, _ in samples],
            "python_heap_mib": [(n, round(heap / 2**20, 2)) for n, _, heap in samples], "rss_mib_after_malloc_trim": trimmed,
            "python_heap_growth_by_line": [str(stat) for stat in growth]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("where", choices=("decoder",))
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--parallel", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2])
    parser.add_argument("--every", type=int, default=50, help="sample RSS every this many requests")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    max_seq_len = json.loads((args.bundle / "manifest.json").read_text())["max_seq_len"]
    work = jobs(args.requests, max_seq_len, args.seed)
    runs = []
    for parallel in args.parallel:
        runs.append(measure_decoder(args.bundle, parallel, work, args.every))
        rss = runs[-1]["rss_mib"]
        print(f"{args.where} --parallel {parallel}: {runs[-1]['outcomes']} in {runs[-1]['seconds']} s; RSS MiB by requests: "
              + ", ".join(f"{n}: {mib}" for n, mib in rss), flush=True)
        print(f"  RSS after malloc_trim(0): {runs[-1]['rss_mib_after_malloc_trim']} MiB; Python heap MiB:",
              runs[-1]["python_heap_mib"], *runs[-1]["python_heap_growth_by_line"], sep="\n  ")
    if args.json:
        args.json.write_text(json.dumps({"where": args.where, "bundle": str(args.bundle), "machine_cores": os.cpu_count(),
                                         "requests": args.requests, "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
