"""Load benchmark of `specbuild serve` (issue 14's goals), against real servers on loopback.

    python benchmarks/serve_load.py pair DIR                      # a random-weight pair with some agreement, compiled
    python benchmarks/serve_load.py throughput DIR/bundle --parallel 1,2,4 --json out.json
    python benchmarks/serve_load.py throughput BUNDLE --device cuda --parallel 1,4 --cuda-graphs on,off

`throughput` starts one `specbuild serve` per setting, in turns (settings alternate round by round, so
drift in a shared machine's speed hits them alike), and drives each with the same concurrent streaming
clients: tokens/s over the run, time to first token and inter-token latency (p50/p95, measured by the
clients), and the ratio to `--parallel 1`. Every response is checked against `SpeculativeDecoder.generate` for the
same prompt and settings, computed once beforehand in this process: greedy requests adapt γ, sampled ones fix γ and a
seed, so each has exactly one right answer. It writes JSON. A server's memory over minutes of mixed requests:
`serve_audit.py soak`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np

# A target of the demo pair's shape, but random: its later layers' output projections are damped so that
# a draft made of its own first two layers agrees with it often (FACTS.md), as a trained pair would.
TARGET_SHAPE = {"hidden_size": 384, "intermediate_size": 1024, "num_hidden_layers": 6, "num_attention_heads": 6,
                "num_key_value_heads": 2}
DRAFT_LAYERS = 2
DAMPING = 0.1  # scale of o_proj/down_proj in layers DRAFT_LAYERS.. of the target


def make_pair(out: Path, damping: float = DAMPING, max_seq_len: int = 1024) -> Path:
    """Write out/{target,draft} checkpoints and compile out/bundle with `specbuild compile`."""
    import torch
    from transformers import LlamaForCausalLM

    from specbuild.texts import corpus_files, read_source
    from specbuild.train.train import llama, parameter_count, save_checkpoint, train_tokenizer

    tokenizer = train_tokenizer([read_source(p) for p in corpus_files()[0]], 4096, max_chars=2_000_000)
    target = llama(TARGET_SHAPE, tokenizer, max_positions=max_seq_len).eval()
    with torch.no_grad():
        for layer in target.model.layers[DRAFT_LAYERS:]:
            layer.self_attn.o_proj.weight.mul_(damping)
            layer.mlp.down_proj.weight.mul_(damping)
    config = target.config.to_dict() | {"num_hidden_layers": DRAFT_LAYERS}
    draft = LlamaForCausalLM(type(target.config).from_dict(config)).eval()
    missing = draft.load_state_dict(target.state_dict(), strict=False).missing_keys
    assert not missing, missing
    save_checkpoint(target, tokenizer, out / "target")
    save_checkpoint(draft, tokenizer, out / "draft")
    subprocess.run([sys.executable, "-m", "specbuild", "compile", "--target", out / "target", "--draft", out / "draft",
                    "--output", out / "bundle", "--max-seq-len", str(max_seq_len), "--overwrite"], check=True)
    print(f"target {parameter_count(target) / 1e6:.1f}M params, draft {parameter_count(draft) / 1e6:.1f}M: {out / 'bundle'}")
    return out / "bundle"


def workload(args) -> list[dict]:
    """One request per prompt and setting: greedy with adaptive γ, and seeded sampling with a fixed γ."""
    from specbuild.texts import CODE_PROMPTS, read_prompts

    jobs = []
    for i, prompt in enumerate(read_prompts(CODE_PROMPTS)[: args.prompts]):
        jobs.append({"prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0})  # serve samples without one
        jobs.append({"prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0.8, "top_p": 0.95, "seed": i, "gamma": 4})
    return jobs


def expected_outputs(bundle: Path, jobs: list[dict], device: str = "cpu") -> tuple[list[str], float]:
    """Each job's text from SpeculativeDecoder.generate, one after another in this process (with the device's
    defaults), and the tokens/s of doing so (what one request at a time gets without the server)."""
    from specbuild_runtime import SpeculativeDecoder

    decoder = SpeculativeDecoder(bundle, device=device, shared_thread_pool=True)
    runtime_names = {"max_tokens": "max_new_tokens"}
    start = time.perf_counter()
    generations = [decoder.generate(**{runtime_names.get(k, k): v for k, v in job.items()}) for job in jobs]
    speed = sum(len(g.token_ids) for g in generations) / (time.perf_counter() - start)
    return [g.text for g in generations], round(speed, 1)


@contextmanager
def serving(bundle: Path, parallel: int, threads: int = 0, device: str = "cpu", cuda_graphs: str = "default",
            max_queue: int = 1024, more: tuple[str, ...] = ()):
    """A `specbuild serve` of the bundle; cuda_graphs: "on", "off" or "default" (the server's own choice); more:
    more of its command line. Its log goes to a temporary file, shown if it does not start."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    options = [*more, *(["--threads", str(threads)] if threads else [])]
    options += {"on": ["--cuda-graphs"], "off": ["--no-cuda-graphs"], "default": []}[cuda_graphs]
    with tempfile.TemporaryFile("w+") as log:
        process = subprocess.Popen([sys.executable, "-m", "specbuild", "serve", str(bundle), "--port", str(port),
                                    "--parallel", str(parallel), "--max-queue", str(max_queue), "--device", device,
                                    *options],
                                   stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + (600 if device == "cuda" else 120)  # CUDA: start-up captures on every worker
        try:
            while True:
                try:
                    if httpx.get(f"{url}/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if process.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    raise SystemExit(f"the server for --parallel {parallel} did not start:\n{log.read()[-2000:]}")
                time.sleep(0.1)
            yield process, url
        finally:
            process.terminate()
            process.wait(60)


async def sse_events(response: httpx.Response) -> AsyncIterator[dict]:
    """A streamed reply's events (its `data: ` lines but the closing [DONE]), as JSON."""
    async for line in response.aiter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


async def one_request(http: httpx.AsyncClient, url: str, job: dict) -> dict:
    """A streamed completion: its text, token count and the clients' timings."""
    start = time.perf_counter()
    arrivals, text, usage, failure = [], [], None, None
    body = {**job, "stream": True, "stream_options": {"include_usage": True}}
    async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            failure = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
        else:
            async for event in sse_events(response):
                if "error" in event:
                    failure = event["error"]["message"]
                elif event["choices"] and event["choices"][0]["text"]:
                    arrivals.append(time.perf_counter())
                    text.append(event["choices"][0]["text"])
                elif event.get("usage"):
                    usage = event["usage"]
    tokens = usage["completion_tokens"] if usage else 0
    return {"text": "".join(text), "failure": failure, "tokens": tokens, "ttft": arrivals[0] - start if arrivals else None,
            "gaps": np.diff(arrivals).tolist(),  # between text chunks: tokens of one round arrive together
            "tpot": (arrivals[-1] - arrivals[0]) / (tokens - 1) if tokens > 1 and arrivals else None}


async def drive(url: str, jobs: list[dict], expected: list[str], clients: int, requests: int) -> dict:
    """`clients` concurrent clients, each sending requests back to back (client c starts at job c) until `requests`
    were sent; every response is checked against its expected text."""
    results, mismatches, failures = [], [], []
    sent = 0

    async def client(c: int, http: httpx.AsyncClient) -> None:
        nonlocal sent
        i = c
        while sent < requests:
            job = i % len(jobs)
            sent += 1
            i += clients
            result = await one_request(http, url, jobs[job])
            if result["failure"]:
                failures.append(result["failure"])
            elif result["text"] != expected[job]:
                mismatches.append(job)
            results.append(result)

    start = time.perf_counter()
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        await asyncio.gather(*(client(c, http) for c in range(clients)))
    seconds = time.perf_counter() - start
    tokens = sum(r["tokens"] for r in results)
    ttft = [r["ttft"] for r in results if r["ttft"] is not None]
    tpot = [r["tpot"] for r in results if r["tpot"] is not None]
    gaps = [g for r in results for g in r["gaps"]]
    return {
        "requests": len(results), "failed": len(failures), "mismatched": len(mismatches), "failures": failures[:5],
        "seconds": round(seconds, 2), "tokens": tokens, "tokens_per_second": round(tokens / seconds, 1),
        "ttft_ms_p50": round(1e3 * float(np.percentile(ttft, 50)), 1), "ttft_ms_p95": round(1e3 * float(np.percentile(ttft, 95)), 1),
        "itl_ms_p50": round(1e3 * float(np.percentile(gaps, 50)), 2), "itl_ms_p95": round(1e3 * float(np.percentile(gaps, 95)), 2),
        "tpot_ms_p50": round(1e3 * float(np.percentile(tpot, 50)), 2), "tpot_ms_p95": round(1e3 * float(np.percentile(tpot, 95)), 2),
    }


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def throughput(args) -> dict:
    jobs = workload(args)
    expected, sequential = expected_outputs(args.bundle, jobs, args.device)
    print(f"in-process sequential generate: {sequential} tok/s", flush=True)
    settings = [(p, t, g) for p in args.parallel for t in args.threads for g in args.cuda_graphs]
    runs: dict[str, list[dict]] = {}
    for round_ in range(args.rounds):
        for parallel, threads, graphs in settings:
            name = (f"parallel={parallel}" + (f",threads={threads}" if threads else "")
                    + (f",cuda-graphs={graphs}" if graphs != "default" else ""))
            with serving(args.bundle, parallel, threads, args.device, graphs) as (_, url):
                # A fresh server's first requests: with CUDA graphs, they pay for each thread's captures.
                warm_up = asyncio.run(drive(url, jobs[:args.clients], expected[:args.clients], args.clients,
                                            args.clients))
                result = asyncio.run(drive(url, jobs, expected, args.clients, args.requests))
                result["warm_up"] = {k: warm_up[k] for k in ("tokens_per_second", "ttft_ms_p50", "ttft_ms_p95", "failed",
                                                             "mismatched")}
            runs.setdefault(name, []).append(result)
            print(f"round {round_}: {name}: {format_result(result)}; the first {args.clients} requests (warm-up): "
                  f"{warm_up['tokens_per_second']} tok/s, TTFT p50/p95 {warm_up['ttft_ms_p50']}/{warm_up['ttft_ms_p95']} ms",
                  flush=True)
    base = sum(r["tokens_per_second"] for r in runs[next(iter(runs))])
    summary = {name: {"tokens_per_second": [r["tokens_per_second"] for r in rs],
                      "ratio_to_first": round(sum(r["tokens_per_second"] for r in rs) / base, 3),
                      **{k: rs[-1][k] for k in ("ttft_ms_p50", "ttft_ms_p95", "itl_ms_p50", "itl_ms_p95", "tpot_ms_p50", "tpot_ms_p95")},
                      "failed": sum(r["failed"] for r in rs), "mismatched": sum(r["mismatched"] for r in rs)}
               for name, rs in runs.items()}
    for name, s in summary.items():
        print(f"{name:>22}: {s['ratio_to_first']:.2f}x the first setting, {s}")
    return {"clients": args.clients, "requests": args.requests, "max_tokens": args.max_tokens,
            "sequential_generate_tokens_per_second": sequential, "summary": summary, "runs": runs}


def format_result(r: dict) -> str:
    return (f"{r['requests']} requests, {r['failed']} failed, {r['mismatched']} mismatched, {r['tokens_per_second']} tok/s, "
            f"TTFT p50/p95 {r['ttft_ms_p50']}/{r['ttft_ms_p95']} ms, ITL p50/p95 {r['itl_ms_p50']}/{r['itl_ms_p95']} ms, "
            f"TPOT p50/p95 {r['tpot_ms_p50']}/{r['tpot_ms_p95']} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    pair = commands.add_parser("pair", help="make and compile the benchmark pair")
    pair.add_argument("out", type=Path)
    pair.add_argument("--damping", type=float, default=DAMPING)
    command = commands.add_parser("throughput")
    command.add_argument("bundle", type=Path)
    command.add_argument("--parallel", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    command.add_argument("--threads", type=lambda s: [int(x) for x in s.split(",")], default=[0],
                         help="the server's --threads per setting (0: its default, cores / --parallel)")
    command.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    command.add_argument("--cuda-graphs", type=lambda s: s.split(","), default=["default"],
                         help="the server's CUDA graphs per setting: on, off or default (comma-separated)")
    command.add_argument("--clients", type=int, default=16)
    command.add_argument("--prompts", type=int, default=24, help="code prompts; each is sent greedy and sampled")
    command.add_argument("--max-tokens", type=int, default=96)
    command.add_argument("--json", type=Path)
    command.add_argument("--requests", type=int, default=96)
    command.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if args.command == "pair":
        make_pair(args.out, args.damping)
        return
    if not set(args.cuda_graphs) <= {"on", "off", "default"}:
        parser.error(f"--cuda-graphs takes on, off or default, not {args.cuda_graphs}")
    report = {"command": args.command, "bundle": str(args.bundle), "device": args.device, "machine_cores": os.cpu_count(),
              **throughput(args)}
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
