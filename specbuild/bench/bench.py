"""`specbuild bench`: speculative vs target-only decoding (and peers) measured side by side in one process.

Every mode decodes every prompt after one warm-up request; ratios taken within one run are what to trust
on a shared machine, absolute times are rough.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from specbuild_runtime import SpeculativeDecoder
from specbuild_runtime.decode import AUTO, Stats
from specbuild_runtime.engine import PROVIDERS, ort, session_options
from specbuild_runtime.errors import RequestError, SpecbuildError
from specbuild_runtime.slot import WARM_UP_RUNS
from specbuild_runtime.validation import check_seed

from .. import progress
from ..acceptance import theoretical_speedup


def measure_bandwidth(device: str = "cpu", megabytes: int = 256, repeats: int = 5) -> float:
    """The memory bandwidth in GB/s that decoding a model larger than the caches is bound by, measured by
    onnxruntime with the engines' session options (their threads), one node over one array: on the CPU a
    MatMul of one row by it (a decode step's GEMV), bytes read; on CUDA an Identity, bytes read + written
    (the copy rate GPU bandwidth is quoted by). Not a reduction on the CPU: ReduceSum read 11 GB/s on a
    2-core Xeon (2026-11-26) where this GEMV and the engines' calls read 29, and numpy's sum 9."""
    data = np.ones((4096, megabytes * 2**20 // 4 // 4096), dtype=np.float32)
    run = _one_node_call(data, device)
    moved = data.nbytes if device == "cpu" else 2 * data.nbytes
    run()  # warm-up: allocations, kernel loading
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return moved / best / 1e9


def _one_node_call(data: np.ndarray, device: str):
    """A call of a one-node graph over data [K, N], bound on the device (run_with_iobinding returns when the
    device is done): on the CPU a row of ones [1, K] times data, on CUDA an Identity."""
    from onnx import helper

    shape, dtype = list(data.shape), helper.np_dtype_to_tensor_dtype(data.dtype)
    if device == "cpu":
        node, out_shape = helper.make_node("MatMul", ["row", "x"], ["y"]), [1, shape[1]]
        inputs = [helper.make_tensor_value_info("row", dtype, [1, shape[0]])]
    else:
        node, out_shape, inputs = helper.make_node("Identity", ["x"], ["y"]), shape, []
    graph = helper.make_graph([node], "bandwidth", [*inputs, helper.make_tensor_value_info("x", dtype, shape)],
                              [helper.make_tensor_value_info("y", dtype, out_shape)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    session = ort.InferenceSession(model.SerializeToString(), session_options(), providers=[PROVIDERS[device]])
    binding = session.io_binding()
    if device == "cpu":
        binding.bind_ortvalue_input("row", ort.OrtValue.ortvalue_from_numpy(np.ones((1, shape[0]), data.dtype)))
    binding.bind_ortvalue_input("x", ort.OrtValue.ortvalue_from_numpy(data, device, 0))
    binding.bind_ortvalue_output("y", ort.OrtValue.ortvalue_from_shape_and_type(out_shape, data.dtype, device, 0))
    return lambda: session.run_with_iobinding(binding)


@dataclass
class ModeResult:
    """One mode's requests: what each measured (its Stats) and the tokens it decoded; the figures bench
    reports are sums over them."""

    system: str
    gamma: int | str
    requests: list[Stats] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)
    captures: int = 0  # CUDA graphs captured during its timed runs (each costs many calls' time)
    matches_target: bool | None = None

    def add(self, stats: Stats, ids: list[int]) -> None:
        self.requests.append(stats)
        self.outputs.append(ids)

    def _sum(self, name: str):
        return sum(getattr(stats, name) for stats in self.requests)

    drafted = property(lambda self: self._sum("drafted"))
    accepted = property(lambda self: self._sum("accepted"))
    rounds = property(lambda self: self._sum("rounds"))
    draft_seconds = property(lambda self: self._sum("draft_seconds"))
    target_seconds = property(lambda self: self._sum("target_seconds"))
    guessed = property(lambda self: self._sum("guessed"))
    guesses_accepted = property(lambda self: self._sum("guesses_accepted"))

    @property
    def tokens(self) -> int:
        """Decoded after each request's first token (the prompt's call excluded, as Stats.tokens_per_second)."""
        return sum(max(len(stats.token_times) - 1, 0) for stats in self.requests)

    @property
    def decode_seconds(self) -> float:
        return sum(stats.token_times[-1] - stats.token_times[0] for stats in self.requests if len(stats.token_times) > 1)

    @property
    def gaps_ms(self) -> list[float]:
        return [gap for stats in self.requests for gap in (1e3 * np.diff(stats.token_times)).tolist()]

    @property
    def gamma_rounds(self) -> dict[int, int]:
        """γ a round drafted (auto: chose) -> rounds."""
        rounds: dict[int, int] = {}
        for stats in self.requests:
            for gamma, count in stats.gamma_rounds.items():
                rounds[gamma] = rounds.get(gamma, 0) + count
        return dict(sorted(rounds.items()))

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.decode_seconds if self.decode_seconds else 0.0

    @property
    def alpha(self) -> float | None:
        """None where nothing was drafted (target-only, or auto at γ 0 throughout): 0 read as every draft rejected."""
        return self.accepted / self.drafted if self.drafted else None

    @property
    def tau(self) -> float:
        """Tokens per target call after the prompt."""
        return self.tokens / self.rounds if self.rounds else 0.0

    def to_dict(self) -> dict:
        accepted_at = sum(np.array(stats.accepted_at, float) for stats in self.requests)
        proposed_at = sum(np.array(stats.proposed_at, float) for stats in self.requests)
        per_position = ([round(a / p, 4) if p else None for a, p in zip(accepted_at.tolist(), proposed_at.tolist())]
                        if self.drafted else [])  # null: a position never proposed (Stats.to_dict)
        ttft = [stats.ttft_ms for stats in self.requests]
        gaps = self.gaps_ms
        return {
            "system": self.system,
            "gamma": self.gamma,
            "tokens_per_second": round(self.tokens_per_second, 2),
            "ttft_ms": round(float(np.mean(ttft)), 3) if ttft else None,
            "itl_ms_p50": round(float(np.percentile(gaps, 50)), 3) if gaps else None,
            "itl_ms_p95": round(float(np.percentile(gaps, 95)), 3) if gaps else None,
            "acceptance_rate": round(self.alpha, 4) if self.alpha is not None else None,
            "mean_accepted_tokens": round(self.tau, 4) if self.rounds else None,
            # auto's free guesses (docs/how-it-works.md): rounds that checked some, and the tokens they held, which τ
            # and the speed-up count and α, over drafts alone, does not
            "guessed": self.guessed,
            "guesses_accepted": self.guesses_accepted,
            "per_position_acceptance": per_position,
            "draft_step_ms": round(1e3 * self.draft_seconds / self.drafted, 4) if self.drafted else None,
            "target_call_ms": round(1e3 * self.target_seconds / self.rounds, 4) if self.rounds else None,
            "gamma_rounds": self.gamma_rounds,
            "captures_while_timed": self.captures,
            "matches_target": self.matches_target,
        }


def run_ours(decoder: SpeculativeDecoder, prompts: list[list[int]], max_new_tokens: int,
             gammas: list[int | str], sampling: dict | None = None, seed: int | None = 0) -> list[ModeResult]:
    """Every mode (a γ, 0 or "auto") decodes every prompt (sampling: temperature, top_k, top_p; none: greedy;
    prompt i seeded seed + i but under auto; seed None or -1: none seeded, as the runtime's and the command line's -1,
    a random seed; below -1 a RequestError).
    Modes take turns prompt by prompt, so a change in the machine's speed during the run (a shared machine
    drifts by ±15%) falls on all of them alike."""
    seed = check_seed(seed)
    results = [ModeResult("specbuild", gamma) for gamma in gammas]
    # Warm-up: first-run allocations, policy state; with CUDA graphs on CUDA every prompt (a GPU decodes them in
    # seconds), WARM_UP_RUNS + 1 times, so that each call shape is captured before the timed runs (a shape is
    # captured at its run WARM_UP_RUNS + 1; a capture costs a call's time many times over). Auto γ's choices
    # follow timings and may still meet a new shape while timed: the report counts those captures.
    warm, passes = (prompts, WARM_UP_RUNS + 1) if decoder.target.captures else (prompts[:1], 1)
    started = time.perf_counter()
    for _ in progress.steps(range(passes), "warming up", "pass"):
        for gamma in gammas:
            for ids in warm:
                decoder.generate(ids, max_new_tokens, gamma, **(sampling or {}))
    per_prompt = (time.perf_counter() - started) / (passes * len(warm))
    if per_prompt * len(prompts) >= SAY_DURATION_FROM:
        print(duration_line(per_prompt, len(prompts), max_new_tokens, len(gammas)), file=sys.stderr, flush=True)
    # The bar moves between prompts, outside what is timed.
    modes = ", ".join(f"γ {gamma}" for gamma in gammas)
    for number, ids in progress.steps(list(enumerate(prompts)), f"decoding at {modes}", "prompt"):
        for result in results:
            stats, before = Stats(), decoder.graphs_captured
            # Sampled auto unseeded: the policy of requests without a seed (timed costs, α learned across
            # requests), which most traffic uses; a seed would give the reproducible one (decoder._policy).
            tokens = list(decoder.stream(ids, max_new_tokens, result.gamma, **(sampling or {}),
                                         seed=None if result.gamma == AUTO or seed is None else seed + number,
                                         stats=stats))
            result.add(stats, tokens)
            result.captures += decoder.graphs_captured - before
    return results


# A run expected to decode for at least this long says so after its warm-up; a shorter one prints nothing (progress.py).
SAY_DURATION_FROM = progress.LOG_EVERY


def duration_line(per_prompt: float, prompts: int, max_new_tokens: int, modes: int) -> str:
    """What the timed decoding will take, from the warm-up's seconds a prompt (every mode), and how to shorten it: at
    its defaults on a Qwen3-0.6B on a 2-core CPU, an hour or more, which nothing said before. The warm-up's one-off
    costs make it high: a Qwen3-0.6B-shaped int8 target's warm-up (-n 32, 6 modes, load 5) foretold 120 s for 4
    prompts that took 100 s."""
    seconds = per_prompt * prompts
    took = f"{per_prompt / 60:.1f} min" if per_prompt >= 60 else f"{per_prompt:.0f} s"
    return (f"bench: about {_duration(seconds)} to decode {prompts} prompts × {max_new_tokens} tokens in {modes} modes "
            f"(the warm-up's prompt took {took} in all {modes}), then the target's context timing and any peers; "
            "shorten it with --prompts (a file of fewer prompts), -n (fewer tokens) or --gamma (fewer γ, fewer modes)")


def _duration(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 5400 else f"{max(1, round(seconds / 60))} min"


def context_latency(decoder: SpeculativeDecoder, short: int = 64, long: int = 1024, steps: int = 200) -> dict:
    """Time of a target call for one new token (two rows: it re-feeds the one before) at a short and a
    long context (the long one capped by the bundle's).

    One prefill fills the cache to the long context; the two contexts then take turns call by call
    (total_len alone sets how much cache a call reads), so drift in the machine's speed hits both alike.
    """
    long = min(long, decoder.max_seq_len - 1)
    short = min(short, long)
    times: dict[int, list[float]] = {short: [], long: []}
    # The bar shows from the prefill on (at 7B on a CPU, a minute or more), and moves between timed calls.
    with decoder.slots.take() as slot, progress.bar(steps, f"timing the target at contexts {short} and {long}",
                                                    "step") as bar:
        engine = slot.target
        engine.configure(temperature=0.0)
        engine.step([1] * long, total_len=long)
        for _ in range(steps):
            for ctx in (short, long):
                start = time.perf_counter()
                engine.step([1], total_len=ctx + 1)
                times[ctx].append(time.perf_counter() - start)
            bar.update()
    return {ctx: 1e3 * float(np.median(t)) for ctx, t in times.items()}


def predicted_context_growth(decoder: SpeculativeDecoder, short: int, long: int) -> float:
    """Per-token time ratio long/short if a step costs its bytes read: weights + the valid part of the cache."""
    info = decoder.manifest.engines["target"]
    per_position = info.kv_bytes_per_position
    return (info.bytes_per_call + per_position * long) / (info.bytes_per_call + per_position * short)


DEFAULT_GAMMAS = (1, 2, 4, 8)


def bench(bundle: Path, prompts: list[str], max_new_tokens: int, gammas: list[int] | None, peers: list[str],
          sampling: dict | None = None, device: str = "cpu", cuda_graphs: bool | None = None,
          draft_steps: bool | None = None, seed: int | None = 0) -> dict:
    """sampling: temperature, top_k, top_p (none: greedy). Sampled runs (temperature > 0) differ token-wise
    between modes by design: `matches_target` then says nothing, and α/speed-up are the figures to read.
    gammas None: DEFAULT_GAMMAS up to the bundle's maximum. seed: run_ours'."""
    seed = check_seed(seed)  # refused before the bundle loads; -1 reported as what it is, unseeded
    sampling = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, **(sampling or {})}
    temperature = sampling["temperature"]
    with progress.note(f"loading the bundle {bundle}"):  # every file's digest checked, every engine's session made
        # Every mode decodes the same prompts: reusing what the last one left would time a prompt of one row, where
        # the peers compute every prompt whole.
        decoder = SpeculativeDecoder(bundle, device=device, shared_thread_pool=True, cuda_graphs=cuda_graphs,
                                     draft_steps=draft_steps, prefix_reuse=False)
    # The default list stops at the bundle's maximum: one compiled with --gamma 4 failed its warm-up at γ 8 on
    # `bench BUNDLE` alone; a γ asked for above it is refused before anything is measured.
    if gammas is None:
        gammas = [gamma for gamma in DEFAULT_GAMMAS if gamma <= decoder.manifest.gamma]
    elif above := [gamma for gamma in gammas if gamma > decoder.manifest.gamma]:
        raise RequestError(f"--gamma {','.join(map(str, above))} is above this bundle's most drafts per round, "
                           f"{decoder.manifest.gamma} (compile's --gamma); bench at most that")
    prompt_ids = [decoder.encode(p) for p in prompts]
    for number, ids in enumerate(prompt_ids, 1):  # refused now, not after measuring
        try:
            decoder.request(ids, max_new_tokens, **sampling)
        except RequestError as exc:
            raise RequestError(f"prompt {number} of {len(prompt_ids)}: {exc}") from None
    bandwidth = measure_bandwidth(decoder.device)
    modes = run_ours(decoder, prompt_ids, max_new_tokens, [0, *gammas, AUTO], sampling, seed)
    baseline = modes[0]
    for mode in modes:
        mode.matches_target = mode.outputs == baseline.outputs if temperature == 0 else None
    if not baseline.rounds:
        why = sorted({"an EOS" if stats.finish_reason == "eos" else
                      f"a prompt filling the bundle's context of {decoder.max_seq_len} tokens" for stats in baseline.requests})
        raise SpecbuildError(f"every prompt ended at its first token ({' or '.join(why)}), so there is no decoding to "
                             "measure; use other prompts")
    target_step = baseline.target_seconds / baseline.rounds
    rows = []
    for mode in modes:
        row = mode.to_dict()
        row["speedup"] = round(mode.tokens_per_second / baseline.tokens_per_second, 3)
        # -n 2 leaves one token after the first, for which no round drafts: no draft cost to measure.
        if isinstance(mode.gamma, int) and mode.gamma > 0 and mode.drafted:
            c = (mode.draft_seconds / mode.drafted) / target_step
            row["cost_ratio_c"] = round(c, 4)
            row["theoretical_speedup"] = round(theoretical_speedup(mode.tau, mode.gamma, c), 3)
            row["efficiency"] = round(row["speedup"] / row["theoretical_speedup"], 3)
        rows.append(row)
    target_info = decoder.manifest.engines["target"]
    achieved = target_info.bytes_per_call / target_step / 1e9
    # A draft step (a drafted token) against its own weight reads: what is left is per-call cost (launches,
    # copies, the host), which the steps graph spreads over its tokens. The largest γ has the fewest
    # catching-up steps.
    drafting = max((m for m in modes if isinstance(m.gamma, int) and m.drafted), key=lambda m: m.gamma, default=None)
    latency = context_latency(decoder)
    report = {
        "bundle": str(bundle),
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        **sampling,
        "seed": seed if temperature > 0 else None,
        "device": decoder.device,
        "cuda_graphs": decoder.cuda_graphs,  # the greedy-only graphs, captured on cuda (the sampler never)
        # tokens a greedy round's call of the draft's steps graph drafts (0: a call per draft token)
        "draft_steps_per_call": decoder.steps_engine.steps_per_call if decoder.steps_engine else 0,
        "machine_bandwidth_gbs": round(bandwidth, 2),  # cpu: onnxruntime read; cuda: onnxruntime copy (read + write)
        "target_call_ms": round(1e3 * target_step, 4),
        "target_weight_mb": round(target_info.weight_bytes / 1e6, 2),
        "target_read_mb": round(target_info.bytes_per_call / 1e6, 2),  # what a call reads (the bandwidth figures')
        "draft_weight_mb": round(decoder.manifest.engines["draft"].weight_bytes / 1e6, 2),
        "target_bandwidth_gbs": round(achieved, 2),
        "target_bandwidth_fraction": round(achieved / bandwidth, 3),
        "target_only_seconds": round(baseline.decode_seconds, 3),  # every mode decodes the same prompts and tokens
        "target_quantization": target_info.quantization,
        "results": rows,
    }
    if drafting:
        draft_step = drafting.draft_seconds / drafting.drafted
        draft_bytes = decoder.manifest.engines["draft"].bytes_per_call
        report.update(draft_step_ms=round(1e3 * draft_step, 4), draft_step_gamma=drafting.gamma,
                      draft_bandwidth_fraction=round(draft_bytes / draft_step / 1e9 / bandwidth, 3))
    if len(latency) == 2:
        short, long = sorted(latency)
        report["context_latency_ms"] = {str(k): round(v, 4) for k, v in latency.items()}
        report["context_growth_measured"] = round(latency[long] / latency[short], 3)
        report["context_growth_predicted"] = round(predicted_context_growth(decoder, short, long), 3)
    if peers:
        from .peers import run_peers

        report["peers"] = run_peers(peers, decoder, prompt_ids, max_new_tokens, gammas, baseline)
    return report


SHORT_RUN_SECONDS = 2.0  # a run's decoding time below which timer noise and one-off costs show in its ratios


def graphs_note(report: dict) -> str:
    if not report.get("cuda_graphs"):
        return ""
    return " (CUDA graphs)" if report["device"] == "cuda" else " (the greedy-only graphs, uncaptured)"


def format_table(report: dict) -> str:
    rows = report["results"] + report.get("peers", [])
    width = max(28, *(len(row["system"]) + 1 for row in rows))  # "onnxruntime-genai speculative" ran into γ
    header = f"{'system':<{width}}{'γ':>5}{'tok/s':>9}{'speedup':>9}{'α':>7}{'τ':>6}{'theory':>8}{'eff':>6}{'ttft ms':>9}{'itl p50/p95 ms':>16}  exact"
    lines = [header, "-" * len(header)]
    for row in rows:
        def fmt(key, spec):
            value = row.get(key)
            return format(value, spec) if isinstance(value, (int, float)) and value is not None else "-"
        itl = f"{fmt('itl_ms_p50', '.2f')}/{fmt('itl_ms_p95', '.2f')}"
        exact = {True: "yes", False: "NO", None: "-"}[row.get("matches_target")]
        lines.append(
            f"{row['system']:<{width}}{str(row['gamma']):>5}{fmt('tokens_per_second', '.1f'):>9}{fmt('speedup', '.2f'):>9}"
            f"{fmt('acceptance_rate', '.2f'):>7}{fmt('mean_accepted_tokens', '.2f'):>6}{fmt('theoretical_speedup', '.2f'):>8}"
            f"{fmt('efficiency', '.2f'):>6}{fmt('ttft_ms', '.1f'):>9}{itl:>16}  {exact}"
        )
    lines.append(
        f"target {report['target_weight_mb']} MB, draft {report['draft_weight_mb']} MB; on {report['device']}"
        f"{graphs_note(report)}, a "
        f"target-only call takes {report['target_call_ms']:.3f} ms and reads {report['target_read_mb']} MB of weights at "
        f"{report['target_bandwidth_gbs']} GB/s of the measured {report['machine_bandwidth_gbs']} GB/s "
        f"({100 * report['target_bandwidth_fraction']:.0f}%)"
    )
    if "draft_step_ms" in report:
        share = report["draft_bandwidth_fraction"]
        per_call = report.get("draft_steps_per_call") if report["temperature"] == 0 else 0  # sampled: a call a token
        lines.append(
            f"a draft step takes {report['draft_step_ms']:.3f} ms (γ {report['draft_step_gamma']}"
            f"{f', {per_call} steps a call' if per_call else ''}) and reads the draft's weights at {100 * share:.0f}% of "
            "the measured bandwidth" + ("; the rest of it is per-call cost" if share < 0.95 else "")
        )
    quantization = report.get("target_quantization", "none")
    if report.get("peers") and quantization != "none":
        lines.append(f"note: this bundle's target is {quantization}, the peers ran the unquantized source checkpoints: "
                     "their exact column and speed-ups compare other weights (compile without --quantize to compare "
                     "like with like)")
    if report["target_only_seconds"] < SHORT_RUN_SECONDS:
        lines.append(f"note: target-only decoding took {report['target_only_seconds']:.2f} s in all; ratios from a "
                     "run this short are noisy (efficiency above 1, say): give more prompts or a larger -n")
    auto = next((row for row in report["results"] if row["gamma"] == AUTO), None)
    if auto and auto.get("gamma_rounds"):
        guesses = (f"; its free guesses held {progress.count(auto['guesses_accepted'], 'token')} in "
                   f"{progress.count(auto['guessed'], 'round')} (τ and the speed-up count them, α only drafts)"
                   ) if auto.get("guessed") else ""
        lines.append("auto chose γ " + ", ".join(f"{gamma} in {progress.count(rounds, 'round')}"
                                                 for gamma, rounds in auto["gamma_rounds"].items()) + guesses)
    captured = {row["gamma"]: row["captures_while_timed"] for row in report["results"] if row.get("captures_while_timed")}
    if captured:
        lines.append("CUDA graphs captured while timed (slower rows than replays alone): "
                     + ", ".join(f"γ {gamma}: {count}" for gamma, count in captured.items()))
    if "context_latency_ms" in report:
        lat = report["context_latency_ms"]
        lines.append(
            f"target step: {' vs '.join(f'{v:.3f} ms at context {k}' for k, v in lat.items())}: "
            f"x{report['context_growth_measured']} measured, x{report['context_growth_predicted']} predicted from bytes read"
        )
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    systems: dict[str, list[dict]] = {}
    for row in report["results"] + report.get("peers", []):
        systems.setdefault(row["system"], []).append(row)
    for system, rows in systems.items():
        fixed = [r for r in rows if isinstance(r["gamma"], int)]
        if fixed:
            left.plot([r["gamma"] for r in fixed], [r["tokens_per_second"] for r in fixed], "o-", label=system)
            right.plot([r["gamma"] for r in fixed], [r.get("speedup") or 0 for r in fixed], "o-", label=system)
        for r in rows:
            if r["gamma"] == AUTO:
                left.axhline(r["tokens_per_second"], ls="--", color="gray", label=f"{system} auto")
                right.axhline(r["speedup"], ls="--", color="gray", label=f"{system} auto")
    left.set(xlabel="γ (drafts per round; 0 = target only)", ylabel="decode tokens/s", title="Throughput")
    right.set(xlabel="γ", ylabel="speed-up over specbuild target-only", title="Speed-up")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
