"""`specbuild demo`: the embedded default. Makes the demo pair once (cached), compiles it, and shows
speculation working: a code completion, α, τ, and the speed-up over target-only decoding measured here."""

from __future__ import annotations

import json
from pathlib import Path

import click

from specbuild_runtime import SpeculativeDecoder
from specbuild_runtime.errors import BundleError
from specbuild_runtime.manifest import load_manifest

from .compiler import compile_bundle
from .recipe import read_recipe, resolve_settings
from .verify import read_prompts

DEMO_RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "demo.toml"
PROMPTS = Path(__file__).resolve().parent / "prompts" / "code.jsonl"


def ensure_pair(recipe: Path, pair: Path) -> None:
    from .train import make_demo_pair, read_pair_recipe

    if (pair / "target" / "config.json").is_file() and (pair / "draft" / "config.json").is_file():
        return
    click.echo(f"Making the demo pair in {pair} (once; about 20 minutes on 2 cores) ...", err=True)
    make_demo_pair(pair, **read_pair_recipe(recipe))


def ensure_bundle(recipe: Path, pair: Path, bundle: Path) -> None:
    try:
        load_manifest(bundle)
        return
    except BundleError:
        pass
    compile_table = read_recipe(recipe)
    # The recipe's paths are relative to the pair it describes, which the demo keeps in its cache.
    options = {k: v for k, v in compile_table.items() if k not in ("target", "draft", "output")}
    settings = resolve_settings(None, target=pair / "target", draft=pair / "draft", output=bundle, overwrite=True, **options)
    click.echo(f"Compiling {bundle} ...", err=True)
    compile_bundle(settings)


def measure(decoder: SpeculativeDecoder, prompts: list[list[int]], max_new_tokens: int, gamma) -> tuple[float, list]:
    """Decode tokens/s over all prompts (prompt excluded) and the results, after one warm-up request."""
    decoder.generate(prompts[0], max_new_tokens, gamma)
    results = [decoder.generate(p, max_new_tokens, gamma) for p in prompts]
    tokens = sum(len(r.stats.token_times) - 1 for r in results)
    seconds = sum(r.stats.token_times[-1] - r.stats.token_times[0] for r in results)
    return tokens / seconds, results


def run_demo(cache: Path, recipe: Path, prompt: str | None, max_new_tokens: int) -> dict:
    pair, bundle = cache / "pair", cache / "bundle"
    ensure_pair(recipe, pair)
    ensure_bundle(recipe, pair, bundle)
    decoder = SpeculativeDecoder(bundle, shared_thread_pool=True)
    texts = [prompt] if prompt else read_prompts(PROMPTS)[:8]
    prompts = [decoder.encode(t) for t in texts]
    target_speed, target_results = measure(decoder, prompts, max_new_tokens, 0)
    spec_speed, spec_results = measure(decoder, prompts, max_new_tokens, "auto")
    drafted = sum(r.stats.drafted for r in spec_results)
    accepted = sum(r.stats.accepted for r in spec_results)
    rounds = sum(r.stats.rounds for r in spec_results)
    emitted = sum(r.stats.generated_tokens - 1 for r in spec_results)
    summary = {
        "prompt": texts[0],
        "completion": spec_results[0].text,
        "identical_to_target": [r.token_ids for r in spec_results] == [r.token_ids for r in target_results],
        "acceptance_rate": round(accepted / drafted, 3) if drafted else 0.0,
        "mean_accepted_tokens": round(emitted / rounds, 3) if rounds else 0.0,
        "target_only_tokens_per_second": round(target_speed, 1),
        "speculative_tokens_per_second": round(spec_speed, 1),
        "speedup": round(spec_speed / target_speed, 2),
        "prompts": len(prompts),
        "bundle": str(bundle),
    }
    report = pair / "report.json"
    if report.is_file():
        summary["pair"] = json.loads(report.read_text())
    return summary
