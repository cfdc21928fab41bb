"""The CLI as a build pipeline and a person use it: real subprocesses, exit codes, one-line errors."""

import json
import subprocess
import sys

import pytest

from conftest import PROMPTS, make_checkpoint, make_tokenizer


def specbuild(*args, check=False):
    result = subprocess.run([sys.executable, "-m", "specbuild", *map(str, args)], capture_output=True, text=True)
    if check:
        assert result.returncode == 0, result.stderr
    return result


def assert_one_line_error(result, *fragments):
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0]


def assert_no_bundle_left(output):
    assert not output.exists()
    assert not [p for p in output.parent.iterdir() if p.name.startswith(f".{output.name}.")]


def test_compile_generate_inspect_round_trip(checkpoints, tmp_path):
    out = tmp_path / "bundle"
    specbuild("compile", "--target", checkpoints("qwen2"), "--draft", checkpoints("qwen2", 1), "-o", out, "--gamma", 3,
              "--max-seq-len", 128, check=True)
    result = json.loads(specbuild("generate", out, "--prompt", PROMPTS[0], "-n", 12, "--json", check=True).stdout)
    assert len(result["token_ids"]) == 12 and result["prompt_token_ids"]
    assert set(result["stats"]) >= {"acceptance_rate", "mean_accepted_tokens", "tokens_per_second", "ttft_ms",
                                    "itl_ms_p50", "itl_ms_p95", "rounds"}
    assert result["gamma"] == "auto" and max(map(int, result["stats"]["gamma_rounds"])) <= 3
    target_only = json.loads(specbuild("generate", out, "-p", PROMPTS[0], "-n", 12, "--gamma", 0, "--json", check=True).stdout)
    assert target_only["token_ids"] == result["token_ids"]
    shown = specbuild("inspect", out, check=True).stdout
    assert "Qwen2ForCausalLM" in shown and "max-seq-len 128" in shown


def test_recipe_supplies_settings_and_options_override_it(checkpoints, tmp_path):
    recipe = tmp_path / "pair.toml"
    recipe.write_text(f'[compile]\ntarget = "{checkpoints("llama")}"\ndraft = "{checkpoints("llama", 1)}"\n'
                      'output = "built"\ngamma = 2\nmax_seq_len = 96\n')
    specbuild("compile", "--recipe", recipe, "--gamma", 5, check=True)
    manifest = json.loads((tmp_path / "built" / "manifest.json").read_text())
    assert manifest["gamma"] == 5 and manifest["max_seq_len"] == 96


def test_verify_reports_identical_and_exits_nonzero_on_divergence(bundles, checkpoints, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:3]))
    ok = specbuild("verify", bundles("llama", 1), "--target", checkpoints("llama"), "--prompts", prompts, "-n", 16)
    assert ok.returncode == 0 and ok.stdout.startswith("identical")
    bad = specbuild("verify", bundles("llama", 1), "--target", checkpoints("llama", 1), "--prompts", prompts, "-n", 16)
    assert bad.returncode == 1 and "DIVERGED on prompt 0" in bad.stdout


def test_mismatched_tokenizers_are_rejected_before_any_bundle_is_written(checkpoints, tmp_path):
    other = make_checkpoint(tmp_path / "other", "llama", make_tokenizer(300, ("argparse.py",)))
    out = tmp_path / "bundle"
    assert_one_line_error(specbuild("compile", "--target", checkpoints("llama"), "--draft", other, "-o", out),
                          "different tokenizers")
    assert_no_bundle_left(out)


def test_padded_embedding_rows_are_accepted_when_tokenizers_agree(checkpoints, tokenizer, tmp_path):
    padded = make_checkpoint(tmp_path / "padded", "llama", tokenizer, seed=3, vocab_size=len(tokenizer) + 64)
    specbuild("compile", "--target", checkpoints("llama"), "--draft", padded, "-o", tmp_path / "b", check=True)


def test_unsupported_architecture_is_named(checkpoints, tmp_path):
    import shutil

    folder = tmp_path / "falcon"
    shutil.copytree(checkpoints("llama"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["FalconForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    out = tmp_path / "bundle"
    assert_one_line_error(specbuild("compile", "--target", folder, "--draft", checkpoints("llama"), "-o", out),
                          "FalconForCausalLM", "LlamaForCausalLM")
    assert_no_bundle_left(out)


@pytest.mark.parametrize("missing", ["folder", "weights", "config"])
def test_missing_checkpoint_files_are_named(missing, checkpoints, tmp_path):
    import shutil

    folder = tmp_path / "target"
    if missing != "folder":
        shutil.copytree(checkpoints("llama"), folder)
        for path in folder.glob("*.safetensors" if missing == "weights" else "config.json"):
            path.unlink()
    out = tmp_path / "bundle"
    assert_one_line_error(specbuild("compile", "--target", folder, "--draft", checkpoints("llama"), "-o", out), str(folder))
    assert_no_bundle_left(out)


def test_a_failure_while_building_leaves_no_partial_bundle(checkpoints, tmp_path):
    out = tmp_path / "bundle"
    # 4096 positions exceed the tiny models' 512: found after loading, inside the staged build.
    assert_one_line_error(specbuild("compile", "--target", checkpoints("llama"), "--draft", checkpoints("llama"),
                                    "-o", out, "--max-seq-len", 4096), "max_position_embeddings")
    assert_no_bundle_left(out)


def test_existing_output_is_kept_unless_overwrite(bundles, checkpoints, tmp_path):
    out = tmp_path / "bundle"
    args = ["compile", "--target", checkpoints("llama"), "--draft", checkpoints("llama"), "-o", out, "--max-seq-len", 64]
    specbuild(*args, check=True)
    assert_one_line_error(specbuild(*args), "--overwrite")
    specbuild(*args, "--overwrite", check=True)
    assert (out / "manifest.json").is_file()


@pytest.mark.parametrize("damage", ["weights", "manifest", "missing-engine"])
def test_corrupted_bundle_is_a_one_line_error(damage, bundles, tmp_path):
    import shutil

    bundle = tmp_path / "bundle"
    shutil.copytree(bundles("llama"), bundle)
    if damage == "weights":
        data = bundle / "target.onnx.data"
        raw = bytearray(data.read_bytes())
        raw[100] ^= 0xFF
        data.write_bytes(bytes(raw))
    elif damage == "manifest":
        (bundle / "manifest.json").write_text("{ not json")
    else:
        (bundle / "draft.onnx").unlink()
    assert_one_line_error(specbuild("generate", bundle, "-p", "x", "-n", 4), str(bundle))


def test_prompt_longer_than_the_context_is_a_one_line_error(bundles):
    result = specbuild("generate", bundles("llama", max_seq_len=64), "-p", PROMPTS[5] * 3, "-n", 4)
    assert_one_line_error(result, "context is 64", "--max-seq-len")


def test_runtime_imports_and_decodes_where_torch_cannot_be_imported(bundles):
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"  # any `import torch` now raises ImportError
        "from specbuild_runtime import SpeculativeDecoder\n"
        f"d = SpeculativeDecoder({str(bundles('llama'))!r})\n"
        "r = d.generate('def add(a, b):', max_new_tokens=8, gamma=3)\n"
        "assert len(r.token_ids) == 8\n"
        "assert 'transformers' not in sys.modules\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
