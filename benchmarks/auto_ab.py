"""Auto γ against target-only (or any fixed γ) side by side: one decoder per mode in one process, so that no mode's
policy learns from another's rounds, whole requests of the demo's measuring prompts (prompt included), the modes taking
turns prompt by prompt in an order that rotates run by run, so that a change in the machine's speed falls on all alike.

Prints, per mode, the median over runs of its speed over the first mode's in the same run (and the quartiles), and
what it did: the γs of its rounds and its free guesses. A mode listed twice is an A/A, whose spread is the noise. To
compare two versions of the runtime, run this from each in turn (PYTHONPATH) and compare their ratios: each process
measures its own against its own target-only.

    python benchmarks/auto_ab.py --scratch /tmp/structured --modes 0,auto,0   # structured_alpha's tiny random pair
    python benchmarks/auto_ab.py --bundle .cache/demo/bundle --modes 0,auto,0 --temperature 0.8
    python benchmarks/auto_ab.py --bundle BUNDLE --device cuda --runs 3   # benchmarks/gpu_session.sh quick
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from specbuild_runtime import SpeculativeDecoder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--bundle", type=Path, help="the bundle to measure (the demo's: .cache/demo/bundle)")
    where.add_argument("--scratch", type=Path, help="structured_alpha's tiny random pair, made here once")
    parser.add_argument("--modes", default="0,auto,0", help="γs, the first the baseline; one listed twice: an A/A")
    parser.add_argument("--runs", type=int, default=5, help="runs of every prompt in every mode; ratios are medians")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=0.0, help="above 0: sampled (prompt i seeded i, auto not)")
    parser.add_argument("--device", default="cpu", help="where the engines run (cuda: CUDA graphs where the bundle's "
                        "default)")
    parser.add_argument("--json", type=Path, help="append one line of results here")
    args = parser.parse_args()

    from specbuild.texts import measuring_prompts

    if args.scratch:
        from structured_alpha import pair
    bundle = args.bundle or pair(args.scratch)
    modes: list[int | str] = [mode if mode == "auto" else int(mode) for mode in args.modes.split(",")]
    # As `specbuild bench`: every mode decodes the same prompts whole, not a prefix the mode before left cached.
    decoders = [SpeculativeDecoder(bundle, device=args.device, shared_thread_pool=True, prefix_reuse=False)
                for _ in modes]
    prompts = [decoders[0].encode(text) for text in measuring_prompts()]

    def request(m: int, number: int):
        """Seconds of a whole request, and its Stats."""
        start = time.perf_counter()
        stats = decoders[m].generate(prompts[number], args.max_new_tokens, modes[m], temperature=args.temperature,
                                     seed=None if modes[m] == "auto" else number).stats
        return time.perf_counter() - start, stats

    load = os.getloadavg()[0]
    for m in range(len(modes)):  # warm-up: first calls' allocations, and auto learns the pair
        for number in range(len(prompts)):
            request(m, number)
    speeds: list[list[float]] = [[] for _ in modes]
    gammas: list[dict[int, int]] = [{} for _ in modes]
    guessed, held = [0] * len(modes), [0] * len(modes)
    for run in range(args.runs):
        seconds, tokens = [0.0] * len(modes), [0] * len(modes)
        for number in range(len(prompts)):
            for turn in range(len(modes)):
                m = (run + turn) % len(modes)
                took, stats = request(m, number)
                seconds[m] += took
                tokens[m] += stats.generated_tokens
                for gamma, rounds in stats.gamma_rounds.items():
                    gammas[m][gamma] = gammas[m].get(gamma, 0) + rounds
                guessed[m] += stats.guessed
                held[m] += stats.guesses_accepted
        for m in range(len(modes)):
            speeds[m].append(tokens[m] / seconds[m])
    ratios = [sorted(speed / base for speed, base in zip(speeds[m], speeds[0])) for m in range(len(modes))]
    print(f"{bundle}: {len(prompts)} prompts x {args.max_new_tokens} tokens, T {args.temperature}, {args.runs} runs, "
          f"load {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end")
    for m, mode in enumerate(modes):
        quartiles = statistics.quantiles(ratios[m], n=4) if len(ratios[m]) > 1 else ratios[m] * 3
        print(f"γ {mode!s:<5} {statistics.median(ratios[m]):.3f}x ({quartiles[0]:.3f}-{quartiles[2]:.3f})  "
              f"{statistics.median(speeds[m]):7.1f} tok/s  γ rounds {dict(sorted(gammas[m].items()))}  "
              f"guessed {guessed[m]}, {held[m]} held")
    if args.json:
        with args.json.open("a") as out:
            out.write(json.dumps({"bundle": str(bundle), "device": args.device, "temperature": args.temperature,
                                  "modes": modes,
                                  "load": [round(load, 2), round(os.getloadavg()[0], 2)],
                                  "ratios": [statistics.median(r) for r in ratios]}) + "\n")


if __name__ == "__main__":
    main()
