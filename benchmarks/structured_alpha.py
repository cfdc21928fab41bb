"""α, tokens per target call and speed-up over target-only decoding under sampling penalties and structured outputs,
on any bundle (the demo's trained pair, say) or on a tiny random pair made here.

The draft proposes unpenalised and under the grammar's mask (the runtime's way); the output is the target's either way
(tests/test_penalties.py, tests/test_structured.py), so only how many drafts hold, and so the speed, differs. Each
workload (--workloads: some of them) decodes the demo's prompts (specbuild.texts.measuring_prompts) target-only and at
each of --gammas (γ 4 and auto by default), the modes taking turns prompt by prompt in one process
(specbuild.bench.bench.run_ours, as `specbuild bench`), --repeats times (speed-ups are the medians of each run's, α and
τ pooled); a greedy one checks that every output equals the target-only one, token for token. Under a grammar the draft
also proposes unmasked at γ 4 (from its own logits, as the steps graph would), after the others: its α beside the masked
draft's.

    make demo   # once: the demo pair, compiled into .cache/demo/bundle
    python benchmarks/structured_alpha.py --bundle .cache/demo/bundle --json structured.json
    python benchmarks/structured_alpha.py --scratch /tmp/structured   # the tiny random pair
    python benchmarks/structured_alpha.py --bundle B --gammas 0,2,auto --workloads "choice,T 0.8, choice"

On a shared machine one process says little: to compare two versions of the code, run it in processes that take turns
between their checkouts and a second copy of the old one (an A/A, whose spread is the noise), each with --json, and
compare the medians over processes (docs/how-it-works.md, Forced tokens, was measured so).

The tiny pair's agreement is dialled as tests/test_sampling.py dials it: the draft is the target's first layer, the
target's three later layers write 0.3 times their usual output.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
from pathlib import Path

from compile_scale import tokenizer
from layer_pair import tail_scale
from specbuild.bench.bench import ModeResult, run_ours
from specbuild_runtime import SpeculativeDecoder

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
# Up to 8 indented lines of lower-case calls and assignments: code the demo's model writes, without its colons,
# quotes, capitals and blank lines.
REGEX = r"((    )+[a-z_][a-z_0-9.(), =]*\n){1,8}"
# Choice-like grammars: replies of a few tokens, where most rounds' drafts stop at an eos short of the γ asked.
CHOICES = ["return None", "raise NotImplementedError", "return self", "pass", "yield from self.items()"]
ENUM = {"type": "object", "properties": {"kind": {"enum": ["function", "class", "module", "method"]}},
        "required": ["kind"], "additionalProperties": False}
WORKLOADS = {
    "greedy": {},
    "repetition 1.1": {"repetition_penalty": 1.1},
    "repetition 1.3": {"repetition_penalty": 1.3},
    "presence 0.5": {"presence_penalty": 0.5},
    "frequency 0.5": {"frequency_penalty": 0.5},
    # Compact: with any whitespace allowed (vLLM's default) the demo's model writes whitespace to max_new_tokens.
    "JSON schema": {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
    "regex": {"structured_outputs": {"regex": REGEX}},
    "choice": {"structured_outputs": {"choice": CHOICES}},
    "yes/no regex": {"structured_outputs": {"regex": "(yes|no)"}},
    "date regex": {"structured_outputs": {"regex": r"\d{4}-\d{2}-\d{2}"}},
    "enum schema": {"structured_outputs": {"json": ENUM, "disable_any_whitespace": True}},
    "T 0.8": {"temperature": 0.8},
    "T 0.8, repetition 1.1": {"temperature": 0.8, "repetition_penalty": 1.1},
    "T 0.8, JSON schema": {"temperature": 0.8, "structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
    "T 0.8, choice": {"temperature": 0.8, "structured_outputs": {"choice": CHOICES}},
    "T 0.8, enum schema": {"temperature": 0.8, "structured_outputs": {"json": ENUM, "disable_any_whitespace": True}},
    "T 0.8, date regex": {"temperature": 0.8, "structured_outputs": {"regex": r"\d{4}-\d{2}-\d{2}"}},
}
GAMMAS = "0,4,auto"  # --gammas by default


def pair(scratch: Path, scale: float = 0.3) -> Path:
    """Compile the tiny random pair (once) and return its bundle folder; scale: the target's later layers' outputs
    (0: the draft computes the target's logits; benchmarks/coupling.py dials α with it)."""
    import torch
    import transformers as tf

    from specbuild.compile import compile_bundle
    from specbuild.recipe import CompileSettings

    bundle = scratch / "bundle"
    if bundle.exists():
        return bundle
    tok = tokenizer()
    torch.manual_seed(0)
    config = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=len(tok), max_position_embeddings=512, eos_token_id=tok.eos_token_id)
    target = tf.LlamaForCausalLM(tf.LlamaConfig(num_hidden_layers=4, **config))
    damped = tail_scale(1, scale)
    with torch.no_grad():
        for name, p in target.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.15).mul_(damped(name))
    draft = tf.LlamaForCausalLM(tf.LlamaConfig(num_hidden_layers=1, **config))
    draft.load_state_dict(target.state_dict(), strict=False)
    for name, model in (("target", target), ("draft", draft)):
        model.eval().save_pretrained(scratch / name)
        tok.save_pretrained(scratch / name)
    compile_bundle(CompileSettings(scratch / "target", scratch / "draft", bundle, max_seq_len=256), show_progress=False)
    return bundle


def unmasked(decoder, prompts: list[list[int]], max_new_tokens: int, options: dict, seed: int) -> ModeResult:
    """run_ours at γ 4 with the draft proposing from its own logits, the grammar's mask left out."""
    masked_draft = SpeculativeDecoder._draft

    def unmasked_draft(slot, feed, total_len, k, uniforms, greedy, guide=None, forced=(), halt=None):
        return masked_draft(slot, feed, total_len, k, uniforms, greedy, forced=forced, halt=halt)

    SpeculativeDecoder._draft = staticmethod(unmasked_draft)
    try:
        mode = run_ours(decoder, prompts, max_new_tokens, [4], options, seed)[0]
    finally:
        SpeculativeDecoder._draft = staticmethod(masked_draft)
    mode.system = "draft unmasked"
    return mode


def run(decoder, prompts: list[list[int]], max_new_tokens: int, options: dict, seed: int,
        gammas: list[int | str]) -> list[ModeResult]:
    """The modes of gammas (target-only first) taking turns prompt by prompt; under a grammar, then the draft
    unmasked."""
    modes = run_ours(decoder, prompts, max_new_tokens, gammas, options, seed)
    if "structured_outputs" in options:
        modes.append(unmasked(decoder, prompts, max_new_tokens, options, seed))
    return modes


def rows(runs: list[list[ModeResult]], greedy: bool) -> list[dict]:
    """One row per mode, its requests pooled over the runs: α, τ (tokens per target call), tok/s, the median over
    runs of its speed-up over the target-only mode of the same run and, greedy, whether every output was exact."""
    out = []
    for modes in zip(*runs):
        pooled = ModeResult(modes[0].system, modes[0].gamma)
        for mode in modes:
            pooled.requests += mode.requests
            pooled.outputs += mode.outputs
        row = pooled.to_dict()
        row.update(tokens=pooled.tokens, matches_target=all(mode.outputs == run[0].outputs
                                                            for mode, run in zip(modes, runs)) if greedy else None,
                   # the unmasked draft's runs are not interleaved with target-only: their speed is not comparable
                   speedup=round(statistics.median(mode.tokens_per_second / run[0].tokens_per_second
                                                   for mode, run in zip(modes, runs)), 3)
                   if pooled.system == "specbuild" else None)
        out.append(row)
    return out


def table(results: dict) -> str:
    def fmt(value, spec):
        return "-" if value is None else format(value, spec)
    lines = [f"{'workload':<24}{'mode':<16}{'tok/s':>8}{'speed-up':>10}{'α':>7}{'τ':>6}{'tokens':>8}  exact"]
    for name, workload in results.items():
        for row in workload:
            mode = "target-only" if row["gamma"] == 0 else f"{row['system'].replace('specbuild', 'γ')} {row['gamma']}"
            exact = {True: "yes", False: "NO", None: "-"}[row["matches_target"]]
            lines.append(f"{name:<24}{mode:<16}{row['tokens_per_second']:>8.1f}{fmt(row['speedup'], '.2f'):>10}"
                         f"{fmt(row['acceptance_rate'], ''):>7}"
                         f"{fmt(row['mean_accepted_tokens'], '.2f'):>6}{row['tokens']:>8}  {exact}")
    return "\n".join(lines)


def timed_costs(decoder) -> dict[str, list[float | None]]:
    """Auto's costs of a round at each γ at the end, per kind of request that decoded (the kinds share them across
    workloads: every grammar's greedy requests one table): None where no round at that γ was timed, so that the prior
    (the weight-byte ratio a draft step) priced it. A round whose draft stopped short of the γ asked times nothing, so
    under a grammar whose replies are a few tokens most γs stay untimed."""
    tables = {}
    for (sampled, processing), policy in decoder._policies[0].items():
        rounds = policy.costs.rounds
        if rounds[0] is not None:
            tables[f"{'sampled' if sampled else 'greedy'} {processing}"] = [None if cost is None else round(cost, 3)
                                                                            for cost in [1.0, *rounds[1:]]]
    return tables


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--bundle", type=Path, help="the bundle to measure (the demo's: .cache/demo/bundle)")
    where.add_argument("--scratch", type=Path, help="make the tiny random pair and its bundle here (a few MB)")
    parser.add_argument("--max-new-tokens", type=int, default=96, help="tokens per prompt (the demo's 96)")
    parser.add_argument("--seed", type=int, default=0, help="sampled: prompt i is seeded seed + i (auto unseeded)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of every workload; speed-ups are their medians")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--gammas", default=GAMMAS, help="the modes, comma-separated: 0 (target-only, first), γs, auto")
    parser.add_argument("--workloads", help=f"comma-separated names of some of: {', '.join(WORKLOADS)}")
    args = parser.parse_args()
    gammas: list[int | str] = [g if g == "auto" else int(g) if g.isdigit() else "" for g in args.gammas.split(",")]
    if "" in gammas:
        parser.error(f"--gammas takes whole numbers and auto, comma-separated, not {args.gammas!r}")
    workloads = WORKLOADS
    if args.workloads:
        names = re.split(r",(?! )", args.workloads)  # "T 0.8, choice" holds a comma and a space
        if unknown := [name for name in names if name not in WORKLOADS]:
            parser.error(f"no workload {unknown[0]!r}; there are: {', '.join(WORKLOADS)}")
        workloads = {name: WORKLOADS[name] for name in names}
    if gammas[0] != 0:
        parser.error("--gammas must begin with 0: speed-ups are against target-only")

    from specbuild.texts import measuring_prompts

    bundle = args.bundle or pair(args.scratch)
    # As `specbuild bench`: every mode decodes the same prompts whole, not a prefix the mode before left cached.
    decoder = SpeculativeDecoder(bundle, shared_thread_pool=True, prefix_reuse=False)
    prompts = [decoder.encode(text) for text in measuring_prompts()]
    load = os.getloadavg()[0]
    runs: dict[str, list] = {name: [] for name in workloads}
    for _ in range(args.repeats):  # repeats outermost: a change in the machine's speed falls on every workload
        for name, options in workloads.items():
            runs[name].append(run(decoder, prompts, args.max_new_tokens, options, args.seed, gammas))
    results = {name: rows(runs[name], not workloads[name].get("temperature")) for name in workloads}
    print(f"{bundle}: {len(prompts)} prompts x {args.max_new_tokens} tokens, {platform.machine()} "
          f"{os.cpu_count()} CPUs, load {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end")
    print(table(results))
    costs = timed_costs(decoder)
    for kind, kind_costs in costs.items():
        print(f"auto's costs of a round at γ 0-{decoder.max_gamma}, {kind} (rounds without drafts; - untimed, priced by the "
              f"prior): {' '.join('-' if cost is None else f'{cost:.2f}' for cost in kind_costs)}")
    if args.json:
        report = {"bundle": str(bundle), "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
                  "seed": args.seed, "repeats": args.repeats, "load": [round(load, 2), round(os.getloadavg()[0], 2)],
                  "workloads": workloads, "results": results, "auto_costs": costs}
        args.json.write_text(json.dumps(report, indent=2))
    if any(row["matches_target"] is False for workload in results.values() for row in workload):
        raise SystemExit("a greedy output differs from target-only decoding (exact: NO above): a bug, report it")


if __name__ == "__main__":
    main()
