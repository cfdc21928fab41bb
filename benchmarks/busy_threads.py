"""Decoding speed on a busy machine, by onnxruntime thread pool, beside 0, 1 and 2 busy loops of our own.

Pools: `shared` (onnxruntime's process-wide pool, one thread per core: what every specbuild command decodes on),
`per` (each session's own pool, spinning stopped between calls: a decoder's default), `per-nospin` (those pools
with session.intra_op.allow_spinning 0: the threads sleep when idle) and `shared1` (a shared pool of one thread,
`--threads 1`). Each run is its own process (load, warm-up, then timed), since a process has one shared pool;
each round takes the busy-loop counts in shuffled order and every (pool, bundle, mode) in shuffled order within
them, so the machine's other load falls on all alike. Prints, per cell, the median tok/s, its quartiles, the
ratio to the shared pool's and the CPU time per token (all the process's threads: spinning shows there).

    python benchmarks/busy_threads.py .cache/demo/bundle /tmp/pairs/bundle-x0.5 --rounds 8 --json busy.jsonl
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time

POOLS = ("shared", "per", "per-nospin", "shared1")
MODES = ("0", "auto")  # γ: target only, adaptive


def one_run(pool: str, bundle: str, gamma: str, prompts: int, tokens: int) -> dict:
    from specbuild.texts import CODE_PROMPTS, read_prompts
    from specbuild_runtime import SpeculativeDecoder, engine
    if pool == "per-nospin":
        made = engine.session_options

        def sleeping() -> engine.ort.SessionOptions:  # the runtime has no setting for it: this is what is measured
            options = made()
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
            return options
        engine.session_options = sleeping
    if pool == "shared1":
        engine.use_shared_thread_pool(1)
    decoder = SpeculativeDecoder(bundle, shared_thread_pool=pool.startswith("shared"), check_digests=False)
    texts = read_prompts(CODE_PROMPTS)[:prompts]
    asked = gamma if gamma == "auto" else int(gamma)
    decoder.generate(texts[0], max_new_tokens=16, gamma=asked)
    load = os.getloadavg()[0]
    made_tokens, start, cpu = 0, time.perf_counter(), time.process_time()
    for text in texts:
        made_tokens += len(decoder.generate(text, max_new_tokens=tokens, gamma=asked).token_ids)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {"tok_s": made_tokens / wall, "cpu_ms_per_token": 1000 * cpu / made_tokens, "load": load}


def measure(args: argparse.Namespace) -> list[dict]:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # run the finally below: no busy loop outlives us
    rows = []
    for round_ in range(args.rounds):
        for busy in random.sample([0, 1, 2], 3):
            loops = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(busy)]
            try:
                cells = [(p, b, g) for p in POOLS for b in args.bundles for g in MODES]
                for pool, bundle, gamma in random.sample(cells, len(cells)):
                    out = subprocess.run([sys.executable, __file__, "--one", pool, bundle, gamma, "--prompts",
                                          str(args.prompts), "--tokens", str(args.tokens)],
                                         capture_output=True, text=True, check=True).stdout
                    row = {**json.loads(out.splitlines()[-1]), "pool": pool, "bundle": bundle, "gamma": gamma,
                           "busy": busy, "round": round_}
                    rows.append(row)
                    if args.json:
                        with open(args.json, "a") as log:
                            log.write(json.dumps(row) + "\n")
            finally:
                for loop in loops:
                    loop.kill()
                    loop.wait()
    return rows


def report(rows: list[dict]) -> None:
    cells = collections.defaultdict(list)
    for row in rows:
        cells[row["bundle"], row["gamma"], row["busy"], row["pool"]].append(row)
    loads = [row["load"] for row in rows]
    print(f"{len(rows)} runs, 1-minute load {min(loads):.1f}-{max(loads):.1f} (median {statistics.median(loads):.1f})")
    for bundle, gamma, busy in sorted({key[:3] for key in cells}):
        shared = statistics.median(row["tok_s"] for row in cells[bundle, gamma, busy, "shared"])
        print(f"{bundle} γ {gamma}, {busy} busy loops:")
        for pool in POOLS:
            runs = cells[bundle, gamma, busy, pool]
            speeds = sorted(row["tok_s"] for row in runs)
            quartiles = statistics.quantiles(speeds, n=4) if len(speeds) > 1 else speeds * 3
            print(f"  {pool:10} {statistics.median(speeds):8.1f} tok/s [{quartiles[0]:.1f}-{quartiles[2]:.1f}] "
                  f"{statistics.median(speeds) / shared:5.2f}x  "
                  f"{statistics.median(row['cpu_ms_per_token'] for row in runs):6.2f} ms CPU/token  n={len(runs)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundles", nargs="*")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=4, help="code prompts a run decodes")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens a prompt")
    parser.add_argument("--json", help="append each run here as a JSON line")
    parser.add_argument("--one", nargs=3, metavar=("POOL", "BUNDLE", "GAMMA"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_run(*args.one, args.prompts, args.tokens)))
    elif args.bundles:
        report(measure(args))
    else:
        parser.error("give one bundle or more")


if __name__ == "__main__":
    main()
