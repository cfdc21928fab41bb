"""`specbuild demo`: the embedded default. Makes the demo pair once (cached), compiles it, and shows
speculation working: a code completion, α, τ, and the speed-up over target-only decoding measured here."""

from __future__ import annotations

import json
import os
from pathlib import Path

import click

from specbuild_runtime import SpeculativeDecoder
from specbuild_runtime.errors import BundleError, RequestError
from specbuild_runtime.manifest import load_manifest

from .bench.bench import run_ours
from .compile import compile_bundle
from .compile.bundle import is_bundle
from .errors import CheckpointError, OutputError, SettingsError, UnsupportedModelError
from .recipe import RECIPE_KEYS, at_line, read_table, resolve_settings
from .staging import replace_file
from .texts import measuring_prompts

DEMO_RECIPE = Path(__file__).resolve().parent / "recipes" / "demo.toml"  # package data: in wheels too


def ensure_pair(recipe: Path, pair: Path) -> None:
    if (pair / "target" / "config.json").is_file() and (pair / "draft" / "config.json").is_file():
        check_pair_recipe(recipe, pair)
        return
    from transformers.utils import logging as transformers_logging

    from .train.demo_pair import make_demo_pair, read_pair_recipe

    transformers_logging.disable_progress_bar()  # its per-checkpoint loading bars; ours show the work
    settings = read_pair_recipe(recipe)
    click.echo(f"Making the demo pair in {pair} (once; {settings.minutes:.0f} minutes of training, then about a "
               "minute to measure and compile) ...", err=True)
    make_demo_pair(pair, settings)


def check_pair_recipe(recipe: Path, pair: Path) -> None:
    """A cached pair made from another [pair] table is refused, not retrained over: it took minutes to make."""
    try:
        made_from = json.loads((pair / "report.json").read_bytes())["recipe"]
    except (OSError, ValueError, LookupError, TypeError):
        made_from = None
    if not isinstance(made_from, dict):  # a pair from before reports, or its last step killed: take it as it is
        return
    table = read_table(recipe, "pair", set(made_from))
    differ = sorted(key for key in made_from if table.get(key) != made_from[key])
    if differ:
        raise SettingsError(f"{pair} was made from another [pair] recipe ({', '.join(differ)} differ); pass --cache "
                            f"with a new folder to make this recipe's pair, or delete {pair}")


# [compile] keys the demo sets itself: the pair it made and the bundle, both in --cache (the packaged recipe names
# the pair's folders). Other values were ignored without a word, as if the demo compiled what they named.
DEMO_OWN = {"target": "target", "draft": "draft", "output": None, "overwrite": None}


def ensure_bundle(recipe: Path, pair: Path, bundle: Path) -> None:
    for key, value in read_table(recipe, "compile", RECIPE_KEYS).items():
        if key in DEMO_OWN and value != DEMO_OWN[key]:
            allowed = f" or as {DEMO_OWN[key]!r}" if DEMO_OWN[key] else ""
            raise SettingsError(f"recipe {recipe}{at_line(recipe, 'compile', key)}: the demo compiles the pair it made "
                                f"into its --cache, so [compile] {key} {value!r} would be ignored; leave it out{allowed} "
                                "(specbuild compile --recipe compiles other checkpoints)")
    # The recipe's paths are relative to the pair it describes, which the demo keeps in its cache.
    settings = resolve_settings(recipe, target=pair / "target", draft=pair / "draft", output=bundle, overwrite=True)
    # The bundle is compiled again when the recipe's [compile] table or the pair changed (a pair deleted and
    # made again has a report of its own): it takes a minute at most.
    compiled_with = bundle.parent / "bundle-settings.json"
    report = pair / "report.json"
    wanted = json.dumps({"compile": read_table(recipe, "compile", RECIPE_KEYS),
                         "pair": report.read_text() if report.is_file() else None}, sort_keys=True)
    try:
        load_manifest(bundle)
        if compiled_with.is_file() and compiled_with.read_text() == wanted:
            return
    except BundleError:
        if os.path.lexists(bundle) and not is_bundle(bundle) and not (bundle.is_dir() and not any(bundle.iterdir())):
            # compile --overwrite replaces only a folder whose manifest says it is a bundle, and the demo has
            # no options about that: say which folder to delete
            raise OutputError(f"the demo's bundle {bundle} is damaged (its manifest.json is unreadable); delete "
                              f"{bundle} and run `specbuild demo` again to recompile it") from None
    click.echo(f"Compiling {bundle} ...", err=True)
    try:
        compile_bundle(settings)
    except UnsupportedModelError:  # the recipe asks more of the pair (a longer max_seq_len): remaking it won't help
        raise
    except CheckpointError as exc:  # the pair the demo made and keeps, not a download to fetch again
        raise CheckpointError(f"the demo pair in {pair} is damaged ({str(exc).split('; ')[0]}); delete {pair} and run "
                              "`specbuild demo` again to remake it (minutes of training)") from None
    replace_file(compiled_with, wanted)


def run_demo(cache: Path, recipe: Path, prompt: str | None, max_new_tokens: int) -> dict:
    if prompt == "":  # as generate refuses it; None (no --prompt) takes the bundled prompts
        raise RequestError("the prompt is empty; give code to complete, or leave --prompt out for the bundled prompts")
    pair, bundle = cache / "pair", cache / "bundle"
    ensure_pair(recipe, pair)
    ensure_bundle(recipe, pair, bundle)
    decoder = SpeculativeDecoder(bundle, check_digests=False, shared_thread_pool=True)  # ensure_bundle checked them
    texts = measuring_prompts() if prompt is None else [prompt]
    prompts = [decoder.encode(t) for t in texts]
    target_only, speculative = run_ours(decoder, prompts, max_new_tokens, [0, "auto"])
    summary = {
        "prompt": texts[0],
        "completion": decoder.tokenizer.decode(speculative.outputs[0]),
        "identical_to_target": speculative.outputs == target_only.outputs,
        "acceptance_rate": None if speculative.alpha is None else round(speculative.alpha, 3),  # None: drafted nothing
        "mean_accepted_tokens": round(speculative.tau, 3),
        "target_only_tokens_per_second": round(target_only.tokens_per_second, 1),
        "speculative_tokens_per_second": round(speculative.tokens_per_second, 1),
        "speedup": round(speculative.tokens_per_second / target_only.tokens_per_second, 2),
        "prompts": len(prompts),
        "bundle": str(bundle),
    }
    try:
        summary["pair"] = json.loads((pair / "report.json").read_bytes())
    except (OSError, ValueError):  # none, or cut short by a kill: the pair is taken as it is (check_pair_recipe)
        pass
    return summary
