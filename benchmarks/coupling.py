"""Rejection sampling (ours) against a drafter-invariant coupling (Gumbel-max with noise shared by draft and target),
measured on a bundle's real logits: per drafted position, the chance a draft is accepted under each.

Ours (Leviathan et al. 2023, docs/sampling.md) accepts a draft with probability 1 − TV(p, q) at a position, the most any
coupling can; its output is distributed as p but which sample a seed gives depends on γ and the drafts. The coupling of
Daliri, Musco and Suresh ("Coupling without communication and drafter-invariant speculative decoding", arXiv
2408.07978) takes the target's token as argmax_x(log p_x + G_x) with Gumbel noise G fixed by (seed, position, x), the
draft proposes argmax_x(log q_x + G_x) with the same noise, and a draft holds iff the two are equal: a seed's output is
then target-only sampling's at every γ, at P(match) = Σ_x p_x q_x / (q_x P[r ≥ r_x] + p_x Q[r < r_x]), r = p / q
(exact, for each x integrating the noise of x out), between (1 − TV) / (1 + TV) and 1 − TV.

For each setting (temperature, top-k, top-p), the prompts are decoded target-only (seeded, the runtime's sampling) and
at γ --gamma (the runtime's measured τ, beside the τ the formula gives from the mean 1 − TV); both engines then score
prompt + continuation, and every position a draft could be judged at (each continuation token but the first, which
the prompt's call gives) is transformed as the engines do (transformers' warpers, as tests/test_sampling.py) and
compared. Speed-ups are Leviathan et al.'s (1 − α^(γ+1)) / ((1 − α)(γc + 1)) at the best γ up to 8, α the mean
acceptance, c a draft step over a target-only call as bench measures them in the same run. Then what V Gumbel noises
a row cost: numpy on the host, and in-graph (onnxruntime CPU, and CUDA where there is one) from a counter-based hash
(Widynski's Squares, arXiv 2004.06278) of (seed, position, token) made of ops onnxruntime's CUDA provider has kernels
for: uint64 Mul, Add and Div (it has none for BitShift or the Bitwise ops).

    python benchmarks/coupling.py --bundle .cache/demo/bundle --json coupling.json   # the demo pair: 80 s of CPU
    python benchmarks/coupling.py --scratch /tmp/coupling --scales 0,0.3,1 --cost-ratio 0.2   # tiny pairs, α dialled

The tiny pairs' own c (~0.7: their calls are all fixed cost) says nothing of a real pair's: give one with --cost-ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import transformers as tf
from onnx import TensorProto, helper

from specbuild.acceptance import expected_tokens_per_call, theoretical_speedup
from specbuild.bench.bench import run_ours
from specbuild.compile.quality import every_logit, logits_engine
from specbuild.texts import CODE_PROMPTS, read_prompts
from specbuild_runtime import SpeculativeDecoder
from specbuild_runtime.engine import cuda_provider, ort, session_options
from structured_alpha import pair

RESTRICTIONS = {"": (0, 1.0), "top-p 0.95": (0, 0.95), "top-k 20": (20, 1.0), "top-k 20, top-p 0.95": (20, 0.95)}
MAX_GAMMA = 8
SQUARES_KEY = 0xC8E4FD154CE32F6D  # one of the keys Widynski's Squares paper lists


def sampling_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """[N, V] logits -> the probabilities the engines sample from (temperature, then top-k, then top-p), float64."""
    scores = logits.float() / temperature
    if top_k:
        scores = tf.TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = tf.TopPLogitsWarper(top_p)(None, scores)
    return torch.softmax(scores.double(), -1)


def acceptance(p: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of [N, V] target p and draft q: (1 − TV(p, q), P(Gumbel-max picks the same token under both)).

    Target and draft both pick x iff every other y has E_y > E_x max(p_y / p_x, q_y / q_x) (exponential races, E ~
    Exp(1)); integrating E_x out gives 1 / Σ_y max(p_y / p_x, q_y / q_x). The max is p's ratio exactly where
    r_y = p_y / q_y ≥ r_x, so sorting by r turns the V² sum into cumulative sums."""
    r = torch.where(q > 0, p / q, torch.where(p > 0, torch.inf, 0.0))
    order = torch.argsort(r, dim=-1, descending=True)
    ps, qs = p.gather(-1, order), q.gather(-1, order)
    p_at_least = ps.cumsum(-1)
    q_below = qs.flip(-1).cumsum(-1).flip(-1) - qs
    both = ps * qs
    match = torch.where(both > 0, both / (qs * p_at_least + ps * q_below), 0.0).sum(-1)
    return torch.minimum(p, q).sum(-1), match


def best_speedup(alpha: float, c: float) -> tuple[int, float]:
    """(γ, speed-up) at the best γ up to MAX_GAMMA under independent acceptances at α (γ 0: target-only, 1.0)."""
    options = [(g, theoretical_speedup(expected_tokens_per_call(alpha, g), g, c)) for g in range(1, MAX_GAMMA + 1)]
    return max([(0, 1.0)] + options, key=lambda option: option[1])


def all_logits(engine, ids: list[int], vocab: int) -> torch.Tensor:
    """[len(ids), vocab] logits after each position of ids, padded with −inf or cut to the target's vocabulary."""
    rows = torch.from_numpy(np.concatenate([logits for _, logits in every_logit(engine, ids)]))
    if rows.shape[1] < vocab:
        return torch.nn.functional.pad(rows, (0, vocab - rows.shape[1]), value=-torch.inf)
    return rows[:, :vocab]


def measure(bundle: Path, prompts: list[str], max_new_tokens: int, gamma: int, temperatures: list[float],
            seed: int, cost_ratio: float | None) -> dict:
    """One row per setting: positions, mean 1 − TV, Gumbel P(match) and the bound, the runtime's τ at gamma, and the
    best speed-ups under each coupling."""
    # As bench: every mode decodes the same prompts whole, not a prefix the mode before left cached.
    decoder = SpeculativeDecoder(bundle, shared_thread_pool=True, prefix_reuse=False)
    target, _ = logits_engine(bundle, decoder.manifest.engines["target"])
    draft, _ = logits_engine(bundle, decoder.manifest.engines["draft"])
    ids = [decoder.encode(text) for text in prompts]
    rows, timed = [], []
    for temperature in temperatures:
        for name, (top_k, top_p) in RESTRICTIONS.items():
            sampling = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
            alone, speculative = run_ours(decoder, ids, max_new_tokens, [0, gamma], sampling, seed)
            timed.append((alone, speculative))
            p, q = [], []
            for prompt, continuation in zip(ids, alone.outputs):
                sequence = prompt + continuation
                # row i decides token i + 1: the continuation's tokens from its second on are the drafted positions
                judged = slice(len(prompt), len(sequence) - 1)
                p.append(all_logits(target, sequence, decoder.vocab_size)[judged])
                q.append(all_logits(draft, sequence, decoder.vocab_size)[judged])
            level, match = acceptance(sampling_probs(torch.cat(p), temperature, top_k, top_p),
                                      sampling_probs(torch.cat(q), temperature, top_k, top_p))
            rows.append({"temperature": temperature, "top_k": top_k, "top_p": top_p, "positions": len(level),
                         "one_minus_tv": level.mean().item(), "gumbel": match.mean().item(),
                         "bound": (level / (2 - level)).mean().item(),  # (1 − TV) / (1 + TV)
                         "runtime_alpha": speculative.alpha, "runtime_tau": speculative.tau,
                         "formula_tau": expected_tokens_per_call(level.mean().item(), gamma)})
    # c as bench measures it, pooled over every setting's runs: a draft step over a target-only call.
    measured_c = ((sum(s.draft_seconds for _, s in timed) / sum(s.drafted for _, s in timed))
                  / (sum(a.target_seconds for a, _ in timed) / sum(a.rounds for a, _ in timed)))
    c = measured_c if cost_ratio is None else cost_ratio
    for row in rows:
        row["best_rejection"] = best_speedup(row["one_minus_tv"], c)
        row["best_gumbel"] = best_speedup(row["gumbel"], c)
    return {"bundle": str(bundle), "vocab_size": decoder.vocab_size, "prompts": len(prompts),
            "max_new_tokens": max_new_tokens, "gamma": gamma, "seed": seed, "measured_c": measured_c, "c": c,
            "rows": rows}


def squares_graph(vocab: int) -> bytes:
    """An ONNX graph: row uint64 [rows, 1] -> Gumbel noise float32 [rows, vocab], token x's from Widynski's 32-bit
    Squares hash of the counter row + x (four rounds; each rotation by 32 bits is x / 2^32 + x * 2^32, which wrap as
    uint64 do) and its top 24 bits as a uniform in (0, 1), as numpy's float32 ones."""
    nodes, constants = [], []

    def const(value, dtype: int = TensorProto.UINT64) -> str:
        constants.append(helper.make_tensor(f"const{len(constants)}", dtype, [], [value]))
        return constants[-1].name

    def op(kind: str, *inputs: str, out: str = "", **attributes) -> str:
        nodes.append(helper.make_node(kind, list(inputs), [out or f"t{len(nodes)}"], **attributes))
        return nodes[-1].output[0]

    def rotate(x: str) -> str:
        return op("Add", op("Div", x, const(1 << 32)), op("Mul", x, const(1 << 32)))

    key = const(SQUARES_KEY)
    x = y = op("Mul", op("Add", "row", "tokens"), key)
    z = op("Add", y, key)
    for add in (y, z, y):
        x = rotate(op("Add", op("Mul", x, x), add))
    bits = op("Div", op("Add", op("Mul", x, x), z), const(1 << 40))  # the hash's top 24 bits
    uniform = op("Mul", op("Add", op("Cast", bits, to=TensorProto.FLOAT), const(0.5, TensorProto.FLOAT)),
                 const(2.0 ** -24, TensorProto.FLOAT))
    op("Neg", op("Log", op("Neg", op("Log", uniform))), out="noise")
    tokens = helper.make_tensor("tokens", TensorProto.UINT64, [vocab], np.arange(vocab, dtype=np.uint64))
    graph = helper.make_graph(nodes, "gumbel_noise",
                              [helper.make_tensor_value_info("row", TensorProto.UINT64, ["rows", 1])],
                              [helper.make_tensor_value_info("noise", TensorProto.FLOAT, ["rows", vocab])],
                              [tokens, *constants])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString()


def squares_noise(rows: np.ndarray, vocab: int) -> np.ndarray:
    """What squares_graph computes, in numpy: [rows] uint64 counters -> [rows, vocab] float32 Gumbel noise."""
    key = np.uint64(SQUARES_KEY)
    with np.errstate(over="ignore"):
        x = y = (rows[:, None] + np.arange(vocab, dtype=np.uint64)) * key
        z = y + key
        for add in (y, z, y):
            x = x * x + add
            x = (x >> np.uint64(32)) | (x << np.uint64(32))
        bits = (x * x + z) >> np.uint64(40)
    uniform = (bits.astype(np.float32) + np.float32(0.5)) * np.float32(2.0 ** -24)
    return -np.log(-np.log(uniform))


def row_counters(seed: int, positions: np.ndarray) -> np.ndarray:
    """Each (seed, position)'s counter base: a 32-bit hash of the two (splitmix64's finaliser) times 2^32, so that a
    row's tokens count up from it."""
    with np.errstate(over="ignore"):
        h = np.uint64(seed) * np.uint64(0x9E3779B97F4A7C15) + positions.astype(np.uint64)
        h = (h ^ (h >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        h = (h ^ (h >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return (h ^ (h >> np.uint64(31))) << np.uint64(32)


def median_ms(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def noise_cost(vocab: int, rows: int, repeats: int = 20) -> dict:
    """Milliseconds for rows × vocab Gumbel noises: numpy on the host (float32 uniforms from a Philox stream keyed by
    (seed, position), then −log(−log(u))), and squares_graph on each onnxruntime provider here; its output is checked
    against squares_noise first."""
    counters = row_counters(0, np.arange(rows))

    def host() -> np.ndarray:
        out = np.empty((rows, vocab), np.float32)
        for row in range(rows):
            u = np.random.Generator(np.random.Philox(key=[0, row])).random(vocab, dtype=np.float32)
            out[row] = -np.log(-np.log(u + np.float32(2.0 ** -25)))
        return out

    result = {"vocab": vocab, "rows": rows, "numpy_host_ms": median_ms(host, repeats)}
    reference = squares_noise(counters, vocab)
    model, feed = squares_graph(vocab), {"row": counters[:, None]}
    for provider in ["CPUExecutionProvider"] + ["CUDAExecutionProvider"] * cuda_provider():
        session = ort.InferenceSession(model, session_options(), providers=[provider])
        if not np.allclose(session.run(None, feed)[0], reference, rtol=1e-5, atol=1e-5):
            raise SystemExit(f"the in-graph hash on {provider} differs from numpy's: a bug in this script, report it")
        result[f"onnxruntime_{provider.removesuffix('ExecutionProvider').lower()}_ms"] = median_ms(
            lambda: session.run(None, feed), repeats)
    return result


def table(report: dict) -> str:
    given = "" if report["c"] == report["measured_c"] else f"given; measured {report['measured_c']:.3f}"
    lines = [f"{report['bundle']}: vocabulary {report['vocab_size']}, {report['prompts']} prompts x "
             f"{report['max_new_tokens']} tokens, c {report['c']:.3f} ({given or 'measured'})",
             f"{'setting':<30}{'positions':>10}{'1-TV':>7}{'Gumbel':>8}{'ratio':>7}{'bound':>7}"
             f"{'τ γ' + str(report['gamma']):>8}{'formula':>9}   best γ, speed-up: ours  Gumbel"]
    for row in report["rows"]:
        setting = ", ".join([f"T {row['temperature']}"] + [name for name, (k, p) in RESTRICTIONS.items()
                                                          if name and (k, p) == (row["top_k"], row["top_p"])])
        (g1, s1), (g2, s2) = row["best_rejection"], row["best_gumbel"]
        lines.append(f"{setting:<30}{row['positions']:>10}{row['one_minus_tv']:>7.3f}{row['gumbel']:>8.3f}"
                     f"{row['gumbel'] / row['one_minus_tv']:>7.3f}{row['bound']:>7.3f}{row['runtime_tau']:>8.2f}"
                     f"{row['formula_tau']:>9.2f}   {g1:>6} {s1:.2f}x  {g2:>3} {s2:.2f}x")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--bundle", type=Path, help="the bundle to measure (the demo's: .cache/demo/bundle)")
    where.add_argument("--scratch", type=Path, help="make tiny random pairs (structured_alpha's) and their bundles here")
    parser.add_argument("--scales", default="0,0.3,1", help="with --scratch: the target's later layers' output scales, "
                        "one pair each (0: the draft computes the target's logits)")
    parser.add_argument("--prompts", type=int, default=24, help="how many of specbuild/prompts/code.jsonl's prompts")
    parser.add_argument("-n", "--max-new-tokens", type=int, default=64, help="tokens per prompt")
    parser.add_argument("--gamma", type=int, default=4, help="γ of the runtime's speculative runs (its τ)")
    parser.add_argument("--temperatures", default="1.0,0.8,0.7", help="comma-separated")
    parser.add_argument("--seed", type=int, default=0, help="prompt i is seeded seed + i")
    parser.add_argument("--cost-ratio", type=float, help="c for the speed-ups (default: measured in the same run)")
    parser.add_argument("--noise-vocab", type=int, default=151936, help="vocabulary to time Gumbel noise at "
                        "(Qwen's 151,936; 0: skip)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()

    prompts = read_prompts(CODE_PROMPTS)[:args.prompts]
    temperatures = [float(t) for t in args.temperatures.split(",")]
    bundles = ([args.bundle] if args.bundle else
               [pair(args.scratch / f"scale-{scale}", float(scale)) for scale in args.scales.split(",")])
    load = os.getloadavg()[0]
    reports = [measure(bundle, prompts, args.max_new_tokens, args.gamma, temperatures, args.seed, args.cost_ratio)
               for bundle in bundles]
    noise = noise_cost(args.noise_vocab, args.gamma + 1) if args.noise_vocab else None
    print(f"{platform.machine()} {os.cpu_count()} CPUs, load {load:.1f} at the start, "
          f"{os.getloadavg()[0]:.1f} at the end")
    for report in reports:
        print(table(report))
    if noise:
        times = [f"{name.removesuffix('_ms').replace('_', ' ')} {ms:.2f} ms"
                 for name, ms in noise.items() if name.endswith("_ms")]
        print(f"{noise['rows']} rows x {noise['vocab']} Gumbel noises: {', '.join(times)}")
    if args.json:
        load = [round(load, 2), round(os.getloadavg()[0], 2)]
        args.json.write_text(json.dumps({"pairs": reports, "noise": noise, "load": load}, indent=2))


if __name__ == "__main__":
    main()
