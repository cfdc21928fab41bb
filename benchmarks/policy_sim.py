"""Auto γ against every fixed γ on simulated rounds: acceptance independent per draft at a given α, costs
in target calls (a draft step costs c of one, timings scatter by 5%).

What it is for: the GPU runs' random-weight layer pairs accept drafts about independently, unlike text
whose agreement comes in runs, and there auto γ trailed the best fixed γ. Measured here (20000 rounds,
c = 0.16, the H100's draft step over its target call under CUDA graphs): with α decays (0.7,) alone auto
reached 1.02x/1.18x/1.40x/1.99x/2.66x target-only at α 0.3/0.5/0.6/0.8/0.9 where the best fixed γ did
1.11x/1.32x/1.49x/2.06x/2.70x; with the greedy policy's (0.7, 0.95) (policy.GREEDY_DECAYS), 1.08x/1.30x/
1.47x/2.04x/2.69x.

    python benchmarks/policy_sim.py --alphas 0.3,0.5,0.8 --c 0.16
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))

from specbuild_runtime.policy import GREEDY_DECAYS, AdaptiveGamma, FixedGamma  # noqa: E402


def tokens_per_second(policy, alpha: float, c: float, rounds: int, seed: int = 0) -> float:
    rng = np.random.default_rng(seed)
    target = 1e-3  # seconds of a target call: only ratios are reported
    tokens = seconds = 0.0
    for _ in range(rounds):
        k = policy.choose(64)
        accepted = 0
        while accepted < k and rng.random() < alpha:
            accepted += 1
        draft, call = k * c * target, target * (1 + rng.normal(0, 0.05))
        policy.observe(k, accepted, draft, call, False, 0)
        tokens += accepted + 1
        seconds += draft + call
    return tokens / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--alphas", default="0.3,0.5,0.6,0.8,0.9")
    parser.add_argument("--c", type=float, default=0.16, help="a draft step's cost in target calls")
    parser.add_argument("--max-gamma", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=20000)
    args = parser.parse_args()
    for alpha in (float(a) for a in args.alphas.split(",")):
        def speed(policy):
            return tokens_per_second(policy, alpha, args.c, args.rounds)

        base = speed(FixedGamma(0))
        fixed = {g: speed(FixedGamma(g)) for g in range(1, args.max_gamma + 1)}
        best = max(fixed, key=fixed.get)
        autos = {decays: speed(AdaptiveGamma(args.max_gamma, args.c, decays)) for decays in ((0.7,), GREEDY_DECAYS)}
        print(f"α {alpha}: best fixed γ {best} {fixed[best] / base:.2f}x; "
              + "; ".join(f"auto, α decays {decays} {v / base:.2f}x" for decays, v in autos.items()))


if __name__ == "__main__":
    main()
