"""`specbuild demo`'s cache: a pair is made once per [pair] recipe, a bundle compiled again when [compile] changes."""

import json
import shutil
from dataclasses import asdict
from pathlib import Path

import pytest

from specbuild.demo import DEMO_RECIPE, ensure_bundle, ensure_pair, run_demo
from specbuild.errors import SettingsError, UnsupportedModelError
from specbuild.train.demo_pair import read_pair_recipe
from specbuild_runtime.manifest import load_manifest


@pytest.fixture
def pair(checkpoints, tmp_path):
    """A cached pair as make_demo_pair leaves it, made from the packaged recipe."""
    pair = tmp_path / "cache" / "pair"
    shutil.copytree(checkpoints("llama", 0), pair / "target")
    shutil.copytree(checkpoints("llama", 1), pair / "draft")
    (pair / "report.json").write_text(json.dumps({"recipe": asdict(read_pair_recipe(DEMO_RECIPE))}))
    return pair


def recipe_with(tmp_path, table: str, **changes) -> Path:
    """The packaged recipe with keys of one table ([pair] or [compile]) set to other TOML values."""
    lines, current = [], None
    for line in DEMO_RECIPE.read_text().splitlines():
        current = line.strip("[] ") if line.startswith("[") else current
        key = line.split(" ")[0]
        lines.append(f"{key} = {changes[key]}" if current == table and key in changes else line)
    path = tmp_path / f"recipe-{len(list(tmp_path.glob('recipe-*')))}.toml"
    path.write_text("\n".join(lines))
    return path


def test_a_cached_pair_made_from_another_pair_recipe_is_refused_and_kept(pair, tmp_path):
    with pytest.raises(SettingsError, match="gamma, target_minutes differ.*--cache"):
        ensure_pair(recipe_with(tmp_path, "pair", target_minutes=1, gamma=2), pair)
    assert (pair / "target" / "config.json").is_file() and (pair / "draft" / "config.json").is_file()
    ensure_pair(recipe_with(tmp_path, "compile", gamma=2, max_seq_len=512), pair)  # its pair is this one


@pytest.mark.parametrize("report", ['{"recipe": {"vocab', '{"target": {}}', "[]"])
def test_a_pair_whose_report_was_cut_short_is_taken_as_it_is(report, pair, tmp_path):
    (pair / "report.json").write_text(report)  # killed while make_demo_pair wrote it
    ensure_pair(DEMO_RECIPE, pair)


def test_a_pair_whose_report_was_cut_short_still_demonstrates(pair, tmp_path):
    """ensure_pair takes such a pair as it is; the summary then read the report again and failed (exit 3)."""
    (pair / "report.json").write_text('{"recipe": {"vocab')
    summary = run_demo(pair.parent, recipe_with(tmp_path, "compile", max_seq_len=128, draft_quantize='"none"'),
                       "def add(a, b):", 4)
    assert summary["identical_to_target"] and "pair" not in summary


def test_the_cached_bundle_is_compiled_again_only_when_the_compile_table_or_the_pair_changes(pair, tmp_path):
    bundle = pair.parent / "bundle"
    small = dict(max_seq_len=128, draft_quantize='"none"')
    ensure_bundle(recipe_with(tmp_path, "compile", **small), pair, bundle)
    manifest = (bundle / "manifest.json").stat().st_mtime_ns
    ensure_bundle(recipe_with(tmp_path, "compile", **small), pair, bundle)
    assert (bundle / "manifest.json").stat().st_mtime_ns == manifest
    ensure_bundle(recipe_with(tmp_path, "compile", **small, gamma=3), pair, bundle)
    assert load_manifest(bundle).gamma == 3
    manifest = (bundle / "manifest.json").stat().st_mtime_ns
    (pair / "report.json").write_text((pair / "report.json").read_text() + " ")  # the pair was made again
    ensure_bundle(recipe_with(tmp_path, "compile", **small, gamma=3), pair, bundle)
    assert (bundle / "manifest.json").stat().st_mtime_ns != manifest


def test_a_compile_table_the_pair_cannot_take_is_blamed_on_the_recipe_not_the_pair(pair, tmp_path):
    """Deleting the pair (minutes of training) would only make the same pair again."""
    with pytest.raises(UnsupportedModelError, match="max_seq_len 1024 exceeds") as error:  # the pair has 512 positions
        ensure_bundle(recipe_with(tmp_path, "compile", max_seq_len=1024), pair, pair.parent / "bundle")
    assert "delete" not in str(error.value)


def test_a_seed_torch_cannot_take_is_refused_with_its_line_before_anything_is_made(tmp_path):
    """TOML holds no integer above 2**63 - 1, Python's reader takes any: seed = 2**64 failed after the corpus and
    tokenizer were made, as a bug (exit 3, torch's "Overflow when unpacking long long")."""
    from specbuild.errors import TrainingError

    with pytest.raises(TrainingError, match=r"line \d+: \[pair\] seed must be a whole number from 0 to 18446744073709551614, "
                                            r"not 18446744073709551616"):
        run_demo(tmp_path / "cache", recipe_with(tmp_path, "pair", seed=str(2**64)), None, 4)
    assert not (tmp_path / "cache").exists()


def test_an_empty_prompt_is_refused_before_anything_is_made(tmp_path):
    """As generate refuses it (the demo used the bundled prompts instead, as if --prompt were not given)."""
    from specbuild_runtime import RequestError

    with pytest.raises(RequestError, match="the prompt is empty"):
        run_demo(tmp_path / "cache", DEMO_RECIPE, "", 4)
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("key, value", [("target", '"my-target"'), ("output", '"/tmp/elsewhere"'), ("overwrite", "false")])
def test_a_compile_key_the_demo_sets_itself_is_refused_not_ignored(key, value, pair, tmp_path):
    """The demo compiles its own pair into its cache: another target, output or overwrite in [compile] was ignored
    without a word, the bundle compiled from the pair into the cache all the same."""
    recipe = recipe_with(tmp_path, "compile", **{key: value})
    if f"\n{key} = " not in recipe.read_text():  # not in the packaged recipe: [compile] is its last table
        recipe.write_text(f"{recipe.read_text()}\n{key} = {value}\n")
    with pytest.raises(SettingsError, match=rf"line \d+: the demo compiles the pair it made into its --cache, so "
                                            rf"\[compile\] {key} .* would be ignored"):
        ensure_bundle(recipe, pair, pair.parent / "bundle")
    assert not (pair.parent / "bundle").exists()
