"""Sampled structured requests whose grammar forces runs (a schema's keys) at a fixed γ: ms per round, and apart, the
forced rounds' slot.Slot.propose_certain, which pushes the whole q buffer (max γ x V floats) to the device
(docs/not-tested.md): what pushing only the forced rows could save a round. The bundle's vocabulary sets the push's
size (TinyLlama's 32k: 1 MB at max γ 8); --push-vocab also times the push alone at a larger one (Qwen's 152k: 4.9 MB).

    python benchmarks/gpu_forced.py BUNDLE --device cuda --json forced.json   # benchmarks/gpu_session.sh quick
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from specbuild_runtime import SpeculativeDecoder
from specbuild_runtime.slot import Buffer, Slot

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "count": {"type": "integer"}, "ok": {"type": "boolean"},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}}},
          "required": ["name", "count", "ok", "tags"], "additionalProperties": False}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--gamma", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("-n", "--max-new-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3, help="runs of every prompt (seeded by its number)")
    parser.add_argument("--push-vocab", type=int, default=151936, help="also time a q push alone at this vocabulary")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()

    from specbuild.texts import measuring_prompts

    decoder = SpeculativeDecoder(args.bundle, device=args.device)
    prompts = [decoder.encode(text) for text in measuring_prompts()]
    structured = {"json": SCHEMA, "disable_any_whitespace": True}
    pushes: list[float] = []
    propose_certain = Slot.propose_certain

    def timed(slot: Slot, tokens: list[int]) -> None:
        start = time.perf_counter()
        propose_certain(slot, tokens)
        pushes.append(time.perf_counter() - start)

    Slot.propose_certain = timed  # type: ignore[method-assign]
    for number, prompt in enumerate(prompts):  # warm-up: first calls' allocations (and captures)
        decoder.generate(prompt, args.max_new_tokens, args.gamma, temperature=args.temperature, seed=number,
                         structured_outputs=structured)
    pushes.clear()
    seconds, rounds, tokens, forced_rounds = 0.0, 0, 0, 0
    for _ in range(args.runs):
        for number, prompt in enumerate(prompts):
            before = len(pushes)
            start = time.perf_counter()
            stats = decoder.generate(prompt, args.max_new_tokens, args.gamma, temperature=args.temperature,
                                     seed=number, structured_outputs=structured).stats
            seconds += time.perf_counter() - start
            rounds, tokens, forced_rounds = rounds + stats.rounds, tokens + stats.generated_tokens, \
                forced_rounds + len(pushes) - before
    q_mb = max(decoder.max_gamma, 1) * decoder.target.vocab_size * 4 / 1e6
    result = {"bundle": str(args.bundle), "device": args.device, "gamma": args.gamma, "temperature": args.temperature,
              "requests": args.runs * len(prompts), "tokens": tokens, "rounds": rounds, "forced_rounds": forced_rounds,
              "ms_per_round": 1e3 * seconds / rounds, "q_mb": q_mb,
              "push_ms_median": 1e3 * statistics.median(pushes) if pushes else None,
              "push_share": sum(pushes) / seconds}
    # the push alone, as propose_certain makes it, at --push-vocab
    q = Buffer(np.zeros((max(decoder.max_gamma, 1), args.push_vocab), np.float32), args.device)
    alone = []
    for _ in range(50):
        start = time.perf_counter()
        q.push()
        alone.append(time.perf_counter() - start)
    result[f"push_alone_ms_at_{args.push_vocab}"] = 1e3 * statistics.median(alone)
    print(f"the push alone at a vocabulary of {args.push_vocab} ({q.host.nbytes / 1e6:.2f} MB): "
          f"{1e3 * statistics.median(alone):.3f} ms (median of 50)")
    print(f"{tokens} tokens in {rounds} rounds, {forced_rounds} of them forced: {result['ms_per_round']:.3f} ms a round;"
          f" each forced round's q push ({q_mb:.2f} MB) {result['push_ms_median'] or 0:.3f} ms (median),"
          f" {100 * result['push_share']:.1f}% of the time")
    if args.json:
        args.json.write_text(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
