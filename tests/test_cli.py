"""The CLI as a build pipeline and a person use it: exit codes, output, one-line errors.

Command lines run through the `specbuild` entry point in one process shared by the session
(tests/cli_driver.py). The bad inputs are tabled in tests/test_bad_inputs.py.
"""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import PROMPTS, make_checkpoint, on_a_terminal


def specbuild(*args, check=False, stdin=None):
    """One command line in its own process (tests/test_bench.py uses it)."""
    result = subprocess.run([sys.executable, "-m", "specbuild", *map(str, args)], capture_output=True, text=True,
                            input=stdin)
    if check:
        assert result.returncode == 0, result.stderr
    return result


def test_a_streamed_generate_that_fails_midway_ends_its_text_with_a_newline(overflowing):
    """The error followed the prompt's last character on a terminal (stdout and stderr on one screen)."""
    result = specbuild("generate", overflowing("target"), "-p", PROMPTS[0], "-n", 4)
    assert result.returncode == 1 and "overflows" in result.stderr
    assert result.stdout == PROMPTS[0] + "\n"


@pytest.mark.parametrize("given", ["-3", "-2", "-1", "0", "7", str(2**70)])
def test_the_seed_option_refuses_what_the_runtimes_check_refuses_in_the_words_the_readme_quotes(given):
    """The option restated check_seed's rule (>= -1) on its own: the runtime's check now decides it."""
    import click
    from specbuild_runtime.errors import RequestError
    from specbuild_runtime.validation import check_seed

    from specbuild.cli import Seed

    try:
        check_seed(int(given))
    except RequestError:
        with pytest.raises(click.BadParameter, match=f"^{given} is not a seed: give a whole number >= 0, or -1 for a "
                                                      "random seed"):
            Seed().convert(given, None, None)
    else:
        assert Seed().convert(given, None, None) == int(given)


def assert_no_bundle_left(output):
    assert not output.exists()
    assert not [p for p in output.parent.iterdir() if p.name.startswith(f".{output.name}.")]


def test_compile_generate_inspect_round_trip(checkpoints, tmp_path, cli):
    out = str(tmp_path / "bundle")
    compiled, sampled, target_only, shown = cli.run([
        ["compile", "--target", str(checkpoints("qwen2")), "--draft", str(checkpoints("qwen2", 1)), "-o", out,
         "--gamma", "3", "--max-seq-len", "128"],
        ["generate", out, "--prompt", PROMPTS[0], "-n", "12", "--json"],
        ["generate", out, "-p", PROMPTS[0], "-n", "12", "--gamma", "0", "--json"],
        ["inspect", out],
    ])
    assert [r["status"] for r in (compiled, sampled, target_only, shown)] == [0, 0, 0, 0], compiled["stderr"]
    result = json.loads(sampled["stdout"])
    assert len(result["token_ids"]) == 12 and result["prompt_token_ids"]
    assert set(result["stats"]) >= {"acceptance_rate", "mean_accepted_tokens", "tokens_per_second", "ttft_ms",
                                    "itl_ms_p50", "itl_ms_p95", "rounds"}
    assert result["gamma"] == "auto" and max(map(int, result["stats"]["gamma_rounds"])) <= 3
    assert json.loads(target_only["stdout"])["token_ids"] == result["token_ids"]
    assert json.loads(target_only["stdout"])["stats"]["acceptance_rate"] is None  # nothing proposed: no α, not 0
    assert "Qwen2ForCausalLM" in shown["stdout"] and "max-seq-len 128" in shown["stdout"]
    assert "uncaptured by default: the target is fp32" in shown["stdout"]
    # An fp32 build runs attention on the CPU on a GPU: compile says so where the choice is made, with the fix.
    assert "on cuda: uncaptured by default: the target is fp32" in compiled["stdout"]
    assert "for a GPU compile with --precision fp16 or bf16" in compiled["stdout"]
    assert "runs on: a CPU or a CUDA GPU" in compiled["stdout"] and "runs on    a CPU or a CUDA GPU" in shown["stdout"]


def test_generates_stats_line_says_auto_decoded_target_only_and_what_its_free_guesses_held():
    """Auto that never drafted gave a line without a word of γ, as if speculation were off or broken."""
    from specbuild.cli import _stats_line
    from specbuild_runtime import Stats

    times = [0.01 * i for i in range(31)]
    guessing = Stats(generated_tokens=31, rounds=6, gamma_rounds={0: 6}, guessed=6, guesses_accepted=24,
                     token_times=times)
    assert _stats_line(guessing, "auto", 256).endswith(
        ", gamma auto drafted nothing: decoded target-only, 24 tokens from free guesses in 6 rounds, 5.00 tokens/round")
    plain = Stats(generated_tokens=31, rounds=30, gamma_rounds={0: 30}, token_times=times)
    assert _stats_line(plain, "auto", 256).endswith(
        ", gamma auto drafted nothing: decoded target-only, 1.00 tokens/round")
    assert _stats_line(plain, 0, 256).endswith("ttft 0.0 ms")  # target-only as asked: nothing to explain
    drafting = Stats(generated_tokens=31, rounds=10, drafted=20, accepted=10, guessed=2, guesses_accepted=1,
                     token_times=times)
    assert _stats_line(drafting, "auto", 256).endswith(
        ", gamma auto, acceptance 0.50, 3.00 tokens/round (1 token from free guesses in 2 rounds)")


def test_compile_json_prints_what_inspect_json_prints(checkpoints, tmp_path, cli):
    """A pipeline reads the bundle compile wrote from its stdout, without running inspect after it: the manifest, as
    inspect --json prints it (and manifest.json holds it), nothing else on stdout."""
    out = tmp_path / "bundle"
    compiled, inspected = cli.run([
        ["compile", "--target", str(checkpoints("llama")), "--draft", str(checkpoints("llama", 1)), "-o", str(out),
         "--max-seq-len", "64", "--json"],
        ["inspect", str(out), "--json"],
    ])
    assert compiled["status"] == 0 and inspected["status"] == 0, compiled["stderr"]
    assert compiled["stdout"] == inspected["stdout"] == (out / "manifest.json").read_text() + "\n"
    assert json.loads(compiled["stdout"])["max_seq_len"] == 64 and "wrote" not in compiled["stderr"]


def test_compile_json_is_no_recipe_key(tmp_path, cli):
    """--json says how to print, not what to build: a recipe cannot set it (its help says so)."""
    recipe = tmp_path / "pair.toml"
    recipe.write_text('[compile]\ntarget = "t"\ndraft = "d"\noutput = "b"\njson = true\n')
    [refused] = cli.run([["compile", "--recipe", str(recipe)]])
    assert refused["status"] == 1 and "json" in refused["stderr"], refused
    help_text = " ".join(specbuild("compile", "--help", check=True).stdout.split())
    assert "not a build setting: no recipe key" in help_text


def test_the_help_states_the_defaults_the_code_takes():
    """Each default the help shows is read from the constant the compile (or bench, or distill) uses, not written
    again: with the constants changed before the CLI is imported, the help changes with them, and so do the
    defaults of distill's own function (which the CLI imports only when distill runs); distill's --loss choices
    too, which the CLI wrote out beside train/divergence.py's table."""
    code = """
import inspect, specbuild.bench.bench as bench, specbuild.recipe as recipe
recipe.DEFAULT_GAMMA, recipe.DEFAULT_MAX_SEQ_LEN, recipe.DEFAULT_ACCURACY_LEVEL, bench.DEFAULT_GAMMAS = 5, 999, 1, (3, 6)
recipe.DISTILL_MINUTES, recipe.DISTILL_GAMMA, recipe.DISTILL_OBJECTIVE = 2.5, 3, "jsd"
recipe.DISTILL_BATCH_SIZE, recipe.DISTILL_SEED, recipe.DISTILL_OBJECTIVES = 7, 11, ("jsd", "tvd")
from specbuild.cli import cli
for command in ("compile", "bench", "distill"):
    cli.main([command, "--help"], standalone_mode=False)
from specbuild.train.distill import distill
print(*(inspect.signature(distill).parameters[key].default for key in ("minutes", "gamma", "objective", "batch_size",
                                                                        "seed")))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    shown = " ".join(result.stdout.split())  # click wraps the help
    for default in ("[default: 5]", "[default: min(999, the longest the pair takes)]",
                    "identical to the target's own. [default: 1]", "[default: 3,6]", "[default: 2.5]",
                    "(1 to 32). [default: 3]", "--loss [jsd|tvd]", "[default: jsd]", "[default: 7]", "[default: 11]"):
        assert default in shown
    assert result.stdout.splitlines()[-1] == "2.5 3 jsd 7 11"


def test_compile_says_nothing_of_transformers_notes_on_a_phi3_config(checkpoints, tmp_path):
    """transformers remarks on a Phi-3 config's original_max_position_embeddings as compile reads it: a line on
    stderr that is no error, where a pipeline reads one-line errors."""
    phi3 = checkpoints("phi3")
    result = specbuild("compile", "--target", phi3, "--draft", phi3, "-o", tmp_path / "bundle", "--max-seq-len", "64",
                       "--no-quality-report", check=True)
    assert "[transformers]" not in result.stderr and "original_max_position_embeddings" not in result.stderr, result.stderr


def test_verify_reports_identical_and_exits_nonzero_on_divergence(bundles, checkpoints, tmp_path, cli):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:3]))
    ok, bad = cli.run([["verify", str(bundles("llama", 1)), "--target", str(checkpoints(*target)),
                                   "--prompts", str(prompts), "-n", "16"] for target in (("llama",), ("llama", 1))])
    assert ok["status"] == 0 and ok["stdout"].startswith("identical")
    assert bad["status"] == 1 and "DIVERGED on prompt 1 (" in bad["stdout"]


def test_every_phase_of_verify_shows_progress_on_a_terminal_and_nothing_elsewhere(bundles, checkpoints, tmp_path,
                                                                                 monkeypatch, capsys):
    """At 7B each phase is minutes (the bundle's digests, transformers' load, its greedy runs, the checkpoint's
    sha256); a build pipeline's log gets none of it."""
    from specbuild.verify import verify_bundle

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:2]))
    bundle, target = bundles("llama", 1), checkpoints("llama")
    capsys.readouterr()  # what making the fixtures' checkpoints printed
    assert verify_bundle(bundle, None, prompts, 8, 4)["same_source"] and capsys.readouterr().err == ""
    terminal = on_a_terminal(monkeypatch)
    assert verify_bundle(bundle, target, prompts, 8, 4)["same_source"]  # a --target given: its sha256 read
    phases = ("loading the bundle", "loading the target checkpoint in transformers (fp32)", "decoding with the bundle",
              "decoding with transformers", "reading the checkpoint")
    assert [phase for phase in phases if phase not in terminal.getvalue()] == [], terminal.getvalue()


def test_verify_lets_the_bundle_go_before_transformers_loads_the_target(bundles, checkpoints, tmp_path, monkeypatch):
    """Both at once held both models: a Llama-3.2-1B-shaped fp32 bundle's verify peaked at 16.5 GB resident."""
    import weakref

    import specbuild.verify
    from specbuild_runtime import SpeculativeDecoder

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": PROMPTS[0]}) + "\n")
    made, alive = [], []

    class Recorded(SpeculativeDecoder):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(weakref.ref(self))

    def load_reference(*args, **kwargs):
        alive.extend(ref for ref in made if ref() is not None)
        return loaded(*args, **kwargs)

    loaded = specbuild.verify.load_reference
    monkeypatch.setattr("specbuild_runtime.SpeculativeDecoder", Recorded)
    monkeypatch.setattr(specbuild.verify, "load_reference", load_reference)
    assert specbuild.verify.verify_bundle(bundles("llama", 1), checkpoints("llama"), prompts, 8, 4)["identical"]
    assert len(made) == 1 and alive == []


def test_verify_without_prompts_compares_the_bundled_code_prompts_as_bench_does(bundles, cli):
    """--prompts was required, while bench fell back to these."""
    from specbuild.texts import CODE_PROMPTS, read_prompts

    [result] = cli.run([["verify", str(bundles("llama", 1)), "-n", "2", "--json"]])
    assert result["status"] == 0, result
    assert json.loads(result["stdout"])["prompts"] == len(read_prompts(CODE_PROMPTS)), result


def test_verify_without_target_checks_against_the_checkpoint_the_manifest_records(checkpoints, tmp_path, cli):
    prompts, target, bundle = tmp_path / "prompts.jsonl", tmp_path / "target", tmp_path / "bundle"
    prompts.write_text(json.dumps({"prompt": PROMPTS[0]}) + "\n")
    shutil.copytree(checkpoints("llama"), target)
    args = ["verify", str(bundle), "--prompts", str(prompts), "-n", "8"]
    built, ok = cli.run([["compile", "--target", str(target), "--draft", str(checkpoints("llama", 1)), "-o", str(bundle),
                          "--max-seq-len", "64", "--no-quality-report"], args])
    assert built["status"] == 0 and ok["status"] == 0 and ok["stdout"].startswith("identical"), (built, ok)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "edited": True}))
    changed = cli.run([args])[0]
    assert changed["status"] == 1 and "changed since (sha256 differs)" in changed["stderr"], changed


def test_verify_of_a_quantized_target_says_whether_compile_measured_its_quality(checkpoints, tmp_path, cli, monkeypatch,
                                                                            capsys):
    """Compile measures targets of up to ~64M parameters: above (a Qwen3-0.6B), the note sent users to an inspect
    line that said "not measured"."""
    import specbuild.verify
    from specbuild.cli import main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": PROMPTS[0]}) + "\n")
    bundles = {"measured": tmp_path / "measured", "unmeasured": tmp_path / "unmeasured"}
    built = cli.run([["compile", "--target", str(checkpoints("llama")), "--draft", str(checkpoints("llama", 1)), "-o",
                      str(bundle), "--max-seq-len", "64", "--target-quantize", "int4", *extra]
                     for bundle, extra in zip(bundles.values(), ([], ["--no-quality-report"]))])
    assert all(result["status"] == 0 for result in built), built
    divergence = {"prompt_index": 0, "prompt": PROMPTS[0], "position": 0, "bundle_token": 1, "transformers_token": 2}
    monkeypatch.setattr(specbuild.verify, "verify_bundle", lambda *args: {
        "identical": False, "prompts": 1, "tokens": 0, "device": "cpu", "precision": "fp32", "quantization": "int4",
        "same_source": True, "divergence": divergence, "divergences": [divergence]})
    notes = {}
    for name, bundle in bundles.items():
        with pytest.raises(SystemExit):
            main(["verify", str(bundle), "--prompts", str(prompts)])
        notes[name] = capsys.readouterr().err
    assert "compile measured how far (specbuild inspect: quality)" in notes["measured"], notes
    assert "compile did not measure how far (compiled with --no-quality-report)" in notes["unmeasured"], notes


def test_verify_decodes_transformers_plainly_whatever_the_generation_config_asks(checkpoints, tmp_path, cli):
    """Instruct checkpoints ship repetition penalties in generation_config.json, which generate() applies unless
    told otherwise; the runtime decodes the model's plain greedy choices, and so must its reference."""
    prompts, target = tmp_path / "prompts.jsonl", tmp_path / "target"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:2]))
    shutil.copytree(checkpoints("llama"), target)
    generation = json.loads((target / "generation_config.json").read_text()) if (target / "generation_config.json").exists() else {}
    (target / "generation_config.json").write_text(json.dumps({**generation, "repetition_penalty": 1.3,
                                                               "no_repeat_ngram_size": 3}))
    built, verified = cli.run([["compile", "--target", str(target), "--draft", str(checkpoints("llama", 1)), "-o",
                                str(tmp_path / "b"), "--max-seq-len", "64", "--no-quality-report"],
                               ["verify", str(tmp_path / "b"), "--prompts", str(prompts), "-n", "32"]])
    assert built["status"] == 0 and verified["status"] == 0 and verified["stdout"].startswith("identical"), verified


def test_verify_holds_transformers_to_the_bundles_context_and_checks_every_prompt_first(bundles, checkpoints,
                                                                                         tmp_path, cli):
    from specbuild_runtime import SpeculativeDecoder

    bundle = bundles("llama", 1)
    encode, context = SpeculativeDecoder(bundle).encode, 256
    texts = ["def f(x):\n" * n for n in range(1, 200)]
    near = next(t for t in texts if context - 16 < len(encode(t)) < context)  # + 64 new tokens: past the end
    over = next(t for t in texts if len(encode(t)) > context)
    files = {name: tmp_path / f"{name}.jsonl" for name in ("near", "over")}
    files["near"].write_text(json.dumps({"prompt": near}) + "\n")
    files["over"].write_text(json.dumps({"prompt": PROMPTS[0]}) + "\n" + json.dumps({"prompt": over}) + "\n")
    ok, refused = cli.run([["verify", str(bundle), "--target", str(checkpoints("llama")), "--prompts", str(files[name]),
                            "-n", "64"] for name in ("near", "over")])
    assert ok["status"] == 0 and ok["stdout"].startswith("identical"), ok
    assert refused["status"] == 1 and f"prompt 2 of {files['over']}" in refused["stderr"], refused


def test_verify_checks_every_token_generate_gives_a_prompt_that_fills_the_context_or_nearly(bundles, checkpoints,
                                                                                          tmp_path, cli):
    """A prompt of n tokens gets up to context - n + 1 new ones (the last needs no place in the cache), so one that
    fills the context gets one: verify compares each of them with transformers' instead of refusing that prompt
    and leaving the last token of every other unchecked."""
    from specbuild_runtime import SpeculativeDecoder

    bundle = bundles("llama", 1)
    decoder, context = SpeculativeDecoder(bundle), 256
    text = "".join(PROMPTS) * 8

    def of_length(n: int) -> str:  # the longest prefix of text that is n tokens
        return next(text[:end] for end in range(len(text), 0, -1) if len(decoder.encode(text[:end])) == n)

    full, short = of_length(context), of_length(context - 1)
    assert [len(decoder.generate(p, 64).token_ids) for p in (full, short)] == [1, 2]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": full}) + "\n" + json.dumps({"prompt": short}) + "\n")
    [result] = cli.run([["verify", str(bundle), "--target", str(checkpoints("llama")), "--prompts", str(prompts),
                         "-n", "64", "--json"]])
    assert result["status"] == 0, result
    report = json.loads(result["stdout"])
    assert report["identical"] and report["tokens"] == 1 + 2, report


def test_verify_refuses_a_gamma_above_the_bundles_before_loading_the_target(bundles, tmp_path, cli):
    """Loading transformers' target takes minutes and gigabytes at scale: --gamma is checked before it, as the
    prompts are (here a target that cannot load would say so first otherwise)."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": PROMPTS[0]}) + "\n")
    [result] = cli.run([["verify", str(bundles("llama", 1)), "--target", str(tmp_path / "no-such-checkpoint"),
                         "--prompts", str(prompts), "--gamma", "9"]])
    assert result["status"] == 1 and "gamma must be from 0 to 8" in result["stderr"], result


@pytest.mark.parametrize("given, says", [("no-such-checkpoint", "no-such-checkpoint is not a folder; pass a Hugging Face"),
                                         ("bundle", "is a specbuild bundle, not a checkpoint")])
def test_verify_says_a_target_that_is_no_folder_or_a_bundle_as_compile_and_distill_do(given, says, bundles, tmp_path,
                                                                                       cli):
    """load_reference kept its own check, which said "is not a Hugging Face checkpoint folder (no config.json)" of a
    --target that does not exist (a typo) or is the bundle itself (load.check_checkpoint_folder tells each)."""
    bundle = bundles("llama", 1)
    target = bundle if given == "bundle" else tmp_path / given
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": PROMPTS[0]}) + "\n")
    [result] = cli.run([["verify", str(bundle), "--target", str(target), "--prompts", str(prompts), "-n", "2"]])
    assert result["status"] == 1 and says in result["stderr"] and result["stderr"].count("\n") == 1, result


def test_verify_holds_a_half_precision_bundle_against_transformers_in_its_precision(checkpoints, tmp_path, cli):
    """An fp16 bundle is compared with transformers fp16 (equal here, as tests/test_exactness.py shows); a
    divergence says where each leaves transformers fp32's output, to tell rounding from a bug."""
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "fp16"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:2]))
    compiled, ok, bad = cli.run([
        ["compile", "--target", str(checkpoints("llama")), "--draft", str(checkpoints("llama", 1)), "-o", str(out),
         "--precision", "fp16", "--max-seq-len", "128"],
        *[["verify", str(out), "--target", str(checkpoints(*target)), "--prompts", str(prompts), "-n", "16"]
          for target in (("llama",), ("llama", 1))]])
    assert compiled["status"] == 0, compiled["stderr"]
    assert ok["status"] == 0 and ok["stdout"].startswith("identical") and "(fp16 on cpu)" in ok["stdout"], ok
    assert bad["status"] == 1 and "(and 1 more of 2 prompts)" in bad["stdout"], bad  # every prompt is checked
    assert re.search(r"the bundle diverges at token \d+, \d+, transformers fp16 itself at \S+, \S+, prompt by prompt",
                     bad["stdout"]), bad


def test_verify_holds_the_fp32_reference_of_a_half_precision_divergence_to_the_bundles_context(checkpoints, tmp_path,
                                                                                                 cli):
    """A prompt near the end of the context: the fp32 reference that places a divergence decodes as far as the
    bundle and transformers did, not --max-new-tokens past it (a GPT-2 has no positions there: exit 3)."""
    from specbuild_runtime import SpeculativeDecoder

    out, prompts = tmp_path / "fp16", tmp_path / "prompts.jsonl"
    context = 512  # the tiny GPT-2's n_positions
    compiled = cli.run([["compile", "--target", str(checkpoints("gpt2")), "--draft", str(checkpoints("gpt2")), "-o", str(out),
                         "--precision", "fp16", "--max-seq-len", str(context), "--no-quality-report"]])[0]
    assert compiled["status"] == 0, compiled["stderr"]
    encode = SpeculativeDecoder(out).encode
    near = next(t for t in ("def f(x):\n" * n for n in range(1, 200)) if context - 16 < len(encode(t)) < context)
    prompts.write_text(json.dumps({"prompt": near}) + "\n")
    # Another checkpoint of the same shape diverges from the bundle at once.
    verified = cli.run([["verify", str(out), "--target", str(checkpoints("gpt2", 1)), "--prompts", str(prompts),
                         "-n", "64", "--json"]])[0]
    assert verified["status"] == 1, verified["stderr"]
    divergence = json.loads(verified["stdout"])["divergence"]
    compared = context - len(encode(near))
    for key in ("bundle_vs_fp32", "transformers_vs_fp32"):
        assert divergence[key] is None or divergence[key] < compared, divergence


def test_a_failure_while_building_leaves_no_partial_bundle(checkpoints, tmp_path, monkeypatch):
    """Writing the draft's engine fails (a shard that cannot be read, say) while the target's engine already
    sits in the staging folder (the spy proves the failure came inside staging, not before it)."""
    from contextlib import contextmanager

    from specbuild.compile import compile_bundle, pipeline
    from specbuild.recipe import CompileSettings

    staged, export, at_failure = pipeline.staged_bundle, pipeline.export_engine, []

    @contextmanager
    def spy(*args, **kwargs):
        with staged(*args, **kwargs) as folder:
            try:
                yield folder
            except BaseException:
                at_failure.extend(sorted(p.name for p in folder.iterdir()))
                raise

    def failing_draft(ckpt, role, *args, **kwargs):
        if role == "draft":
            raise OSError(5, "Input/output error", str(ckpt.path / "model.safetensors"))
        return export(ckpt, role, *args, **kwargs)

    monkeypatch.setattr(pipeline, "staged_bundle", spy)
    monkeypatch.setattr(pipeline, "export_engine", failing_draft)
    out = tmp_path / "bundle"
    with pytest.raises(OSError):
        compile_bundle(CompileSettings(checkpoints("llama"), checkpoints("llama", 1), out, max_seq_len=64),
                       show_progress=False)
    assert "target.onnx.data" in at_failure, f"the compile failed before staging ({at_failure}): this test is hollow"
    assert_no_bundle_left(out)


def test_an_interrupt_once_the_bundle_is_published_is_dropped_through_the_interpreters_shutdown(checkpoints,
                                                                                               tmp_path):
    """Ctrl-C or SIGTERM in a compile's last second: while it printed its summary, "error: interrupted" (exit 130:
    nothing left behind) over the new bundle; while the interpreter shut down, a traceback, or death by the
    signal. Both are sent at those two moments, from the `specbuild` command's own process."""
    script = (
        "import atexit, os, signal, sys, click\n"
        "from specbuild.cli import main\n"
        "interrupt = lambda: [os.kill(os.getpid(), n) for n in (signal.SIGINT, signal.SIGTERM)]\n"
        "atexit.register(interrupt)  # in the interpreter's shutdown\n"
        "echo = click.echo\n"
        "click.echo = lambda message=None, *a, **k: (echo(message, *a, **k), str(message).startswith('wrote ') "
        "and interrupt())\n"
        "sys.argv[1:] = ['compile', '--target', sys.argv[1], '--draft', sys.argv[2], '-o', sys.argv[3], "
        "'--max-seq-len', '64']\n"
        "main()\n"
    )
    out = tmp_path / "bundle"
    result = subprocess.run([sys.executable, "-c", script, checkpoints("llama"), checkpoints("llama", 1), out],
                            capture_output=True, text=True)
    assert result.returncode == 0 and result.stderr == "", (result.returncode, result.stderr[-2000:])
    assert (out / "manifest.json").is_file()


def test_padded_embedding_rows_are_accepted_when_tokenizers_agree(checkpoints, tokenizer, tmp_path):
    from specbuild.compile import compile_bundle
    from specbuild.recipe import CompileSettings

    padded = make_checkpoint(tmp_path / "padded", "llama", tokenizer, seed=3, vocab_size=len(tokenizer) + 64)
    compile_bundle(CompileSettings(checkpoints("llama"), padded, tmp_path / "b", max_seq_len=64), show_progress=False)


def test_an_unexpected_exception_is_one_line_saying_it_is_a_bug_and_debug_shows_the_traceback(monkeypatch, capsys):
    import specbuild.compile
    from specbuild.cli import main
    from specbuild_runtime.serve.cli import EXIT_BUG

    def broken(*args, **kwargs):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(specbuild.compile, "compile_bundle", broken)
    args = ["compile", "--target", "t", "--draft", "d", "-o", "out"]
    with pytest.raises(SystemExit) as exited:
        main(args)
    err = capsys.readouterr().err
    assert exited.value.code == EXIT_BUG == 3 and err.count("\n") == 1, err
    assert err.startswith("error: internal error (ZeroDivisionError: division by zero); this is a bug") and "--debug" in err
    with pytest.raises(SystemExit) as exited:
        main(["--debug", *args])
    err = capsys.readouterr().err
    assert exited.value.code == EXIT_BUG and "Traceback" in err and 'raise ZeroDivisionError("division by zero")' in err
    assert err.splitlines()[-1].startswith("error: internal error")


def test_a_reader_that_closes_stdout_early_ends_the_command_quietly(bundles):
    """click's way: no traceback, no message, status 1 (`true` is gone long before the output is written)."""
    command = f"{sys.executable} -m specbuild inspect {bundles('llama')} | true; exit ${{PIPESTATUS[0]}}"
    result = subprocess.run(["bash", "-c", command], capture_output=True, text=True)
    assert result.returncode == 1 and result.stderr == "", result.stderr


def test_onnxruntime_telemetry_is_off_and_says_nothing_where_home_is_read_only(bundles):
    """onnxruntime 1.32 sends telemetry from Linux and printed a colored warning where it could not store a
    device id (a read-only HOME, as containers often have): a second line on stderr, and a build step's
    unasked upload."""
    env = {key: value for key, value in os.environ.items() if key != "ORT_DISABLE_TELEMETRY"}
    result = subprocess.run([sys.executable, "-m", "specbuild", "generate", str(bundles("llama")), "-p", "x", "-n", "2"],
                            capture_output=True, text=True, env={**env, "HOME": "/proc/no-home"})
    assert result.returncode == 0 and result.stderr.count("\n") == 1 and "telemetry" not in result.stderr, result.stderr


def test_a_bad_specbuild_gpu_total_len_is_one_line_where_a_decoder_starts(bundles):
    """The variable was checked when the runtime was imported: a typo made every command, `--help` and compile
    too, a traceback."""
    env = {**os.environ, "SPECBUILD_GPU_TOTAL_LEN": "row"}
    run = [sys.executable, "-m", "specbuild"]
    assert subprocess.run([*run, "--help"], capture_output=True, env=env).returncode == 0
    result = subprocess.run([*run, "generate", str(bundles("llama")), "-p", "x", "-n", "2"], capture_output=True,
                            text=True, env=env)
    assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("error: SPECBUILD_GPU_TOTAL_LEN='row' is neither max nor bucket"), result.stderr


def test_generate_to_a_stdout_that_cannot_spell_the_text_escapes_it(bundles):
    """A latin-1 stdout (PYTHONIOENCODING, a cp1252 console redirected) ended generate with "internal error
    (UnicodeEncodeError ...); this is a bug", exit 3."""
    result = subprocess.run([sys.executable, "-m", "specbuild", "generate", str(bundles("llama")), "-p", "h\u00e9 \U0001f600",
                             "-n", "2"], capture_output=True, env={**os.environ, "PYTHONIOENCODING": "latin-1"})
    assert result.returncode == 0 and result.stdout.startswith(b"h\xe9 \\U0001f600"), result.stderr


@pytest.mark.parametrize("damage", ["bundle manifest", "pair weights"])
def test_a_damaged_demo_cache_says_which_folder_to_delete(damage, checkpoints, tmp_path, cli):
    """The demo used to answer with advice for options it does not have (--overwrite, another output) or for
    a download it never made ("download or save the checkpoint again")."""
    cache = tmp_path / "demo"
    for role, seed in (("target", 0), ("draft", 1)):  # the pair as the demo keeps it (its recipe: 1024 positions)
        shutil.copytree(checkpoints("llama", seed, max_position_embeddings=2048), cache / "pair" / role)
    if damage == "bundle manifest":
        (cache / "bundle").mkdir()
        (cache / "bundle" / "manifest.json").write_text('{"format": "specbuild-bun')  # cut short
        damaged = cache / "bundle"
    else:
        weights = cache / "pair" / "target" / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:1000])
        damaged = cache / "pair"
    [result] = cli.run([["demo", "--cache", str(cache), "-n", "2"]])
    error = result["stderr"].splitlines()[-1]
    assert result["status"] == 1 and f"delete {damaged} and run `specbuild demo` again" in error, error
    assert "--overwrite" not in error and "download" not in error, error


@pytest.mark.parametrize("no_color", ["1", ""])
def test_no_color_set_keeps_the_demos_output_plain_on_a_terminal(no_color, monkeypatch):
    """https://no-color.org: set and not empty, no ANSI colour; click reads only whether stdout is a terminal."""
    from click.testing import CliRunner

    import specbuild.demo
    from specbuild.cli import cli

    summary = {"prompt": "def f():", "completion": "\n    return 1", "prompts": 1, "acceptance_rate": 0.5,
               "mean_accepted_tokens": 1.5, "target_only_tokens_per_second": 100.0,
               "speculative_tokens_per_second": 150.0, "speedup": 1.5, "identical_to_target": True}
    monkeypatch.setattr(specbuild.demo, "run_demo", lambda *args: summary)
    result = CliRunner().invoke(cli, ["demo"], color=True, env={"NO_COLOR": no_color})  # color: as on a terminal
    assert result.exit_code == 0, result.output
    assert ("\x1b[" in result.output) == (not no_color), result.output


def test_the_demo_says_auto_drafted_nothing_where_a_short_run_never_drafted(monkeypatch):
    """A run too short for auto to draft has no α: the demo failed on it (exit 3) once bench's α became None there."""
    from click.testing import CliRunner

    import specbuild.demo
    from specbuild.cli import cli

    summary = {"prompt": "def f():", "completion": "\n    return 1", "prompts": 1, "acceptance_rate": None,
               "mean_accepted_tokens": 1.0, "target_only_tokens_per_second": 100.0,
               "speculative_tokens_per_second": 100.0, "speedup": 1.0, "identical_to_target": True}
    monkeypatch.setattr(specbuild.demo, "run_demo", lambda *args: summary)
    result = CliRunner().invoke(cli, ["demo"])
    assert result.exit_code == 0, result.output
    assert "auto drafted nothing (target-only, with free guesses), 1.00 tokens per target call" in result.output


def test_usage_errors_are_one_line_with_exit_status_2(capsys):
    from specbuild.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["compile", "--max-seq-len", "x"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1 and "'--max-seq-len'" in err and "specbuild compile --help" in err


@pytest.mark.parametrize("args", [["generate", "bundle", "-p", "def", "fib(n):"],
                                  ["generate", "bundle", "-p", "x", "--choice", "yes", "no"]],
                         ids=["unquoted", "choices"])
def test_an_extra_argument_says_an_option_takes_one_value_to_quote_or_repeat(args, tmp_path, monkeypatch, capsys):
    """click's 'Got unexpected extra argument (fib(n):)' named the word, not that the prompt wanted quotes."""
    from specbuild.cli import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        main(args)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1, err
    assert f"Got unexpected extra argument ({args[-1]}): an option takes one value, so quote" in err, err


COMPILE = ["compile", "--target", "target", "--draft", "draft", "-o", "bundle"]
TENSORRT_LLM_INT4 = ["--backend", "tensorrt-llm", "--quantize", "int4", "--precision", "fp16"]


@pytest.mark.parametrize("args, says", [
    (COMPILE + ["--tp", "2"], "tp 2 splits the TensorRT-LLM export"),
    (COMPILE + ["--block-size", "64"], "block_size and accuracy_level shape quantized engines"),
    (COMPILE + ["--block-size", "32"], "block_size and accuracy_level shape quantized engines"),
    (COMPILE + ["--quality-report"], "quality_report measures them"),
    (COMPILE + TENSORRT_LLM_INT4 + ["--block-size", "64"], "block_size applies to the ONNX engines"),
    (COMPILE + TENSORRT_LLM_INT4 + ["--quality-report"], "quality_report applies to the ONNX engines"),
    (COMPILE + ["--backend", "tensorrt-llm", "--quantize", "int4"],
     "int4 quantization (--quantize or --target-quantize) with --backend tensorrt-llm needs --precision fp16 or bf16"),
    (COMPILE + ["--max-seq-len", "8", "--gamma", "8"], "the context holds 8 tokens"),
    (COMPILE + ["--quantize", "int4", "--target-quantize", "none", "--draft-quantize", "none"],
     "quantize int4 applies to neither engine"),
    (["distill", "--target", "target", "-o", "draft", "--init", "draft", "--draft-config", "num_hidden_layers=1"],
     "give either --init or --draft-config, not both"),
    (["generate", "bundle", "-p", "x", "--logprobs", "2"], "give --json too"),
    (["bench", "bundle", "--threads", "1", "--peers", "llama.cpp"], "leave out --threads or those peers"),
    (["serve", "bundle", "--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
], ids=["compile-tp", "compile-block-size", "compile-default-block-size", "compile-quality-report",
        "compile-tensorrt-llm-block-size", "compile-tensorrt-llm-quality-report", "compile-tensorrt-llm-fp32-int4",
        "compile-max-seq-len", "compile-quantize-overridden-for-both",
        "distill", "generate", "bench", "serve"])
def test_options_in_conflict_are_a_usage_error_in_every_command(args, says, tmp_path, monkeypatch, capsys):
    """compile's exited 1, as if an input were wrong, where every other command's exit 2 (docs/commands.md, Exit
    statuses); the command line alone is at fault, and it is refused before anything it names is read."""
    from specbuild.cli import main

    monkeypatch.chdir(tmp_path)  # where none of the paths exist
    with pytest.raises(SystemExit) as exited:
        main(args)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1 and says in err and f"specbuild {args[0]} --help" in err, err


@pytest.mark.parametrize("option", ["--max-model-len=4096", "--tensor-parallel-size", "-tp", "--gpu-memory-utilization",
                                    "--dtype", "--quantization", "--enforce-eager"])
def test_a_vllm_serve_option_without_a_counterpart_says_what_to_do_instead_not_a_look_alike(option, tmp_path,
                                                                                          monkeypatch, capsys):
    """click suggested '--parallel' for --tensor-parallel-size, which sets slots: a vLLM command line copied over
    would have served with that many slots instead of refusing."""
    from specbuild.cli import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        main(["serve", "bundle", option, "2"])
    err = capsys.readouterr().err
    name = option.split("=")[0]
    assert exited.value.code == 2 and err.count("\n") == 1, err
    assert f"{name} is vLLM's option, which this server does not take: " in err and "Did you mean" not in err, err


@pytest.mark.parametrize("args, says", [
    (["compile", "--device", "cuda"], "--device is not compile's: "),
    (["compile", "--dtype=fp16"], "--dtype is vLLM's name for --precision here"),
    (["compile", "--num-speculative-tokens", "4"], "--num-speculative-tokens is vLLM's name for --gamma here"),
    (["generate", "bundle", "--dtype", "fp16"], "--dtype is vLLM's option, which specbuild generate does not take: "),
    (["chat", "bundle", "--max-model-len", "4096"], "--max-model-len is vLLM's option, which specbuild chat does not "),
    (["bench", "bundle", "--quantization", "awq"], "--quantization is vLLM's option, which specbuild bench does not "),
    (["verify", "bundle", "--num-speculative-tokens", "4"], "--num-speculative-tokens is vLLM's name for --gamma here"),
    (["generate", "bundle", "-p", "x", "-ngl", "99"], "-ngl is llama.cpp's option, which specbuild generate does not "),
    (["generate", "bundle", "-p", "x", "-ngl", "99", "-n", "128"], "-ngl is llama.cpp's option, which specbuild "),
    (["serve", "bundle", "-ngl", "99"], "-ngl is llama.cpp's option, which this server does not take: "),
    (["chat", "bundle", "--ctx-size", "4096"], "--ctx-size is llama.cpp's option, which specbuild chat does not "),
    (["bench", "bundle", "-m", "bundle"], "-m is llama.cpp's option, which specbuild bench does not take: "),
    (["verify", "bundle", "--draft-max", "4"], "--draft-max is llama.cpp's name for --gamma here"),
    (["distill", "--dtype", "bf16"], "--dtype is not distill's: it holds the target and trains and writes the draft "),
    (["bench", "bundle", "--num-speculative-tokens", "4"], "--gamma here (the fixed drafts per round to measure beside "
                                                            "auto, comma-separated)"),
    (["generate", "bundle", "--enforce-eager"], "--enforce-eager is vLLM's option, which specbuild generate does not "
                                                "take: give --no-cuda-graphs instead"),
], ids=lambda value: value[0] if isinstance(value, list) else None)
def test_another_tools_option_says_what_to_do_instead_not_a_look_alike(args, says, tmp_path, monkeypatch, capsys):
    """click suggested '--tp' for compile's --dtype, '--recipe' for its --device and '--max-new-tokens' (the reply's
    length) for generate's --max-model-len (the context's), '--data' for distill's --dtype, and read llama.cpp's -ngl
    99 as -n gl."""
    from specbuild.cli import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        main(args)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1, err
    assert says in err and "Did you mean" not in err, err


def test_no_other_tools_option_a_command_answers_is_one_of_its_own():
    """An answer is given only for an option click could not read, so one named as the command's own would never be
    given, and a stale one would say the command does not take what it does."""
    from specbuild.cli import cli
    from specbuild_runtime.serve.cli import serve_command

    for command in [*cli.commands.values(), serve_command]:
        own = {name for param in command.params for name in param.opts + param.secondary_opts}
        assert not own & set(getattr(command, "foreign", {})), command.name


@pytest.mark.parametrize("args", [["generate", "bundle", "-p", "--dtype", "--temprature", "1"],
                                  ["serve", "bundle", "--model-name", "-tp", "--prot", "1"],
                                  ["generate", "bundle", "-p", "-ngl", "--temprature", "1"]])
def test_an_other_tools_option_given_as_a_value_is_not_answered_for_the_option_click_could_not_read(
        args, tmp_path, monkeypatch, capsys):
    """The arguments were searched for any of them: a prompt "--dtype" beside a mistyped option was told --dtype is
    vLLM's option."""
    from specbuild.cli import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        main(args)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and f"No such option '{args[-2]}'" in err and "vLLM" not in err, err
    assert "llama.cpp" not in err, err


@pytest.mark.parametrize("args", [["generate", "bundle", "-p", "-ngl", "-n", "0"],
                                  ["serve", "bundle", "--model-name", "-tp", "-tx"]])
def test_an_other_tools_option_given_as_a_value_is_not_answered_for_an_option_click_could_not_read_beside_it(
        args, tmp_path, monkeypatch, capsys):
    """-n 0 beside a prompt "-ngl" was told -ngl is llama.cpp's (-ngl begins with the -n click named), and -tx
    beside a model name "-tp" that -tp is vLLM's."""
    from specbuild.cli import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        main(args)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and ("'-n': 0 is not in the range" in err or "No such option '-t'" in err), err


@pytest.mark.parametrize("table, options", [("tp = 2\n", []), ("", ["--tp", "2"]),
                                            ("max_seq_len = 8\n", ["--gamma", "8"]),
                                            ('quantize = "int4"\nbackend = "tensorrt-llm"\n', [])],
                         ids=["in-the-recipe", "with-an-option", "recipe-and-option", "quantized-fp32-export"])
def test_settings_in_conflict_where_a_recipe_takes_part_are_the_recipes_error(table, options, tmp_path, capsys):
    """An input that is wrong (exit 1), as a wrong value in the recipe is; the message names the recipe's line where
    the setting at fault is its own."""
    from specbuild.cli import main

    recipe = tmp_path / "pair.toml"
    recipe.write_text(f'[compile]\ntarget = "target"\ndraft = "draft"\noutput = "bundle"\n{table}')
    with pytest.raises(SystemExit) as exited:
        main(["compile", "--recipe", str(recipe), *options])
    err = capsys.readouterr().err
    assert exited.value.code == 1 and err.count("\n") == 1 and "--help" not in err, err
    assert (f"{recipe} line 5" in err) == bool(table), err


def test_bench_plot_without_matplotlib_is_the_installations_error_not_the_command_lines(tmp_path, monkeypatch, capsys):
    """It exited 2, as a malformed command line does, where serve without its extra exits 1."""
    from specbuild.cli import main

    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # what an import of an absent package raises
    with pytest.raises(SystemExit) as exited:
        main(["bench", str(tmp_path / "bundle"), "--plot", str(tmp_path / "plot.png")])
    err = capsys.readouterr().err
    assert exited.value.code == 1 and err == "error: --plot needs matplotlib: pip install matplotlib\n", err


@pytest.mark.parametrize("gammas", ["", ","])
def test_bench_with_no_fixed_gamma_is_a_usage_error(gammas, tmp_path):
    """An empty --gamma (a script's unset variable) ran without the draft's step cost, the bound or the
    peers' speculative rows, and exited 0 (parsed only here: nothing loads or measures)."""
    import click

    from specbuild.cli import bench

    with pytest.raises(click.BadParameter, match="give at least one γ"):
        bench.make_context("bench", [str(tmp_path), "--gamma", gammas])
    assert bench.make_context("bench", [str(tmp_path), "--gamma", "2,"]).params["gammas"] == [2]


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


def test_a_reference_on_cuda_without_a_cuda_torch_is_a_device_error(checkpoints):
    """verify/bench peers on --device cuda need transformers on the GPU too: one line saying what to install."""
    import torch

    from specbuild.compile.reference import load_reference
    from specbuild_runtime.errors import DeviceError

    if torch.cuda.is_available():
        pytest.skip("this torch has CUDA")
    with pytest.raises(DeviceError, match="install a CUDA build of torch"):
        load_reference(checkpoints("llama"), device="cuda")


def test_quantize_on_the_command_line_wins_over_a_recipes_per_engine_quantization(tmp_path):
    """The README: options given on the command line win. A recipe's target_quantize = "none" kept the target
    unquantized under `--quantize int4`."""
    from specbuild.recipe import resolve_settings

    recipe = tmp_path / "pair.toml"
    recipe.write_text('[compile]\ntarget = "t"\ndraft = "d"\noutput = "b"\ntarget_quantize = "none"\n')
    settings = resolve_settings(recipe, quantize="int4")
    assert (settings.quantization("target"), settings.quantization("draft")) == ("int4", "int4")
    settings = resolve_settings(recipe, quantize="int4", draft_quantize="int8")
    assert (settings.quantization("target"), settings.quantization("draft")) == ("int4", "int8")


def test_per_engine_quantizations_on_the_command_line_win_over_a_recipes_quantize_for_both(tmp_path):
    """7135dc3 refused a recipe's quantize = "int4" under --target-quantize int8 --draft-quantize none as applying to
    neither engine, naming the recipe's line, where the command line's options win (as --quantize over a recipe's
    per-engine ones)."""
    from specbuild.recipe import resolve_settings

    recipe = tmp_path / "pair.toml"
    recipe.write_text('[compile]\ntarget = "t"\ndraft = "d"\noutput = "b"\nquantize = "int4"\n'
                      'draft_quantize = "int8"\n')
    for options in ({"target_quantize": "int8", "draft_quantize": "none"}, {"target_quantize": "none"}):
        settings = resolve_settings(recipe, **options)
        assert (settings.quantization("target"), settings.quantization("draft")) == (
            options["target_quantize"], options.get("draft_quantize", "int8"))


def test_compile_asks_for_one_missing_setting_as_an_option_and_for_several_as_options(tmp_path):
    """It read "missing --output (give it as options or in a recipe)"."""
    from specbuild.errors import MissingSettingsError
    from specbuild.recipe import resolve_settings

    with pytest.raises(MissingSettingsError, match=r"^missing --output \(give it as an option or in a recipe\)$"):
        resolve_settings(None, target=tmp_path, draft=tmp_path)
    with pytest.raises(MissingSettingsError, match=r"^missing --draft, --output \(give them as options or in a recipe\)$"):
        resolve_settings(None, target=tmp_path)


def test_a_recipe_may_start_with_a_bom_and_name_paths_from_home(tmp_path, monkeypatch):
    from specbuild.recipe import resolve_settings

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    recipe = tmp_path / "pair.toml"
    recipe.write_text('\ufeff[compile]\ntarget = "~/target"\ndraft = "draft"\noutput = "~/bundle"\n', encoding="utf-8")
    settings = resolve_settings(recipe)
    assert (settings.target, settings.draft, settings.output) == (tmp_path / "home" / "target", tmp_path / "draft",
                                                                  tmp_path / "home" / "bundle")


# The C locale without Python's UTF-8 mode (PYTHONUTF8=0, or LC_ALL=C.ascii-like locales): its encoding is ASCII.
ASCII_LOCALE = {**os.environ, "PYTHONUTF8": "0", "LC_ALL": "C"}


def test_a_recipes_bad_key_names_its_line_in_an_ascii_locale(tmp_path):
    recipe = tmp_path / "pair.toml"
    recipe.write_text("[compile]\n# γ: the most drafts per round\ngama = 4\n", encoding="utf-8")
    result = subprocess.run([sys.executable, "-m", "specbuild", "compile", "--recipe", str(recipe)], capture_output=True,
                            text=True, env=ASCII_LOCALE)
    assert result.returncode == 1 and "line 3: unknown [compile] keys ['gama']" in result.stderr, result.stderr


def test_compile_keeps_a_non_ascii_tokenizer_config_in_an_ascii_locale(checkpoints, tmp_path):
    target = tmp_path / "target"
    shutil.copytree(checkpoints("llama"), target)
    config = json.loads((target / "tokenizer_config.json").read_text(encoding="utf-8"))
    (target / "tokenizer_config.json").write_text(json.dumps({**config, "note": "<｜begin▁of▁sentence｜>"},
                                                             ensure_ascii=False), encoding="utf-8")
    result = subprocess.run([sys.executable, "-m", "specbuild", "compile", "--target", str(target), "--draft", str(target),
                             "-o", str(tmp_path / "bundle"), "--max-seq-len", "32"], capture_output=True, text=True,
                            env=ASCII_LOCALE)
    assert result.returncode == 0, result.stderr
    written = json.loads((tmp_path / "bundle" / "tokenizer" / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert written["note"] == "<｜begin▁of▁sentence｜>"


def test_a_prompts_file_may_start_with_a_bom(tmp_path):
    from specbuild.texts import read_prompts

    path = tmp_path / "prompts.jsonl"
    path.write_text('\ufeff{"prompt": "a"}\n{"prompt": "b"}\n', encoding="utf-8")
    assert read_prompts(path) == ["a", "b"]


def test_overwrite_refuses_a_bundle_folder_holding_files_of_the_users(bundles, checkpoints, tmp_path):
    """A bench report or notes kept beside the engines were deleted without a word by compile --overwrite."""
    out = tmp_path / "bundle"
    shutil.copytree(bundles("llama", 1), out)
    (out / "bench.json").write_text("{}")  # `specbuild bench bundle --json bundle/bench.json`
    result = specbuild("compile", "--target", checkpoints("llama"), "--draft", checkpoints("llama", 1), "-o", out,
                       "--max-seq-len", 32, "--overwrite")
    assert result.returncode == 1 and "files it did not have (bench.json)" in result.stderr, result.stderr
    assert (out / "bench.json").read_text() == "{}" and (out / "manifest.json").is_file()
    (out / "bench.json").unlink()
    built = out / "tensorrt-llm" / "engines" / "target" / "rank0.engine"  # what the bundle's build plan makes there
    built.parent.mkdir(parents=True)
    built.write_bytes(b"stale once the bundle is replaced")
    specbuild("compile", "--target", checkpoints("llama"), "--draft", checkpoints("llama", 1), "-o", out,
              "--max-seq-len", 32, "--overwrite", check=True)
    assert not built.exists()


def test_no_overwrite_on_the_command_line_wins_over_a_recipes_overwrite(bundles, checkpoints, tmp_path):
    output = tmp_path / "bundle"
    shutil.copytree(bundles("llama"), output)
    recipe = tmp_path / "pair.toml"
    recipe.write_text(f'[compile]\ntarget = "{checkpoints("llama")}"\ndraft = "{checkpoints("llama")}"\n'
                      f'output = "bundle"\nmax_seq_len = 64\noverwrite = true\n')
    result = subprocess.run([sys.executable, "-m", "specbuild", "compile", "--recipe", str(recipe), "--no-overwrite"],
                            capture_output=True, text=True)
    assert result.returncode == 1 and "pass --overwrite" in result.stderr, result.stderr


def test_a_prompt_from_a_closed_stdin_is_a_usage_error_not_a_bug(bundles):
    command = f"{sys.executable} -m specbuild generate {bundles('llama', 1)} -p - -n 2 <&-"
    result = subprocess.run(["bash", "-c", command], capture_output=True, text=True)
    assert result.returncode == 2 and "stdin, which is closed" in result.stderr, result.stderr


def test_generate_reads_the_prompt_from_stdin_given_a_dash(bundles):
    prompt = "def add(a, b):\n    return"  # a newline, as files have
    piped = specbuild("generate", bundles("llama", 1), "-p", "-", "-n", 6, "--json", stdin=prompt, check=True)
    given = specbuild("generate", bundles("llama", 1), "-p", prompt, "-n", 6, "--json", check=True)
    piped, given = json.loads(piped.stdout), json.loads(given.stdout)
    assert (piped["prompt_token_ids"], piped["token_ids"]) == (given["prompt_token_ids"], given["token_ids"])


def test_generate_that_fills_the_context_before_its_max_new_tokens_says_so(bundles, cli):
    """-n 100 on a 16-token context printed a few tokens and a stats line, as though that were all it was asked."""
    bundle = str(bundles("llama", 1, max_seq_len=16))
    full, short = cli.run([["generate", bundle, "-p", "import os", "-n", n] for n in ("100", "2")])
    assert full["status"] == short["status"] == 0, (full, short)
    assert "the bundle's context (16 tokens) is full" in full["stderr"], full["stderr"]
    assert "context" not in short["stderr"], short["stderr"]


def test_generate_stop_ends_the_output_where_the_api_stop_string_would(bundles):
    from specbuild_runtime import SpeculativeDecoder

    bundle, prompt = bundles("llama", 1), "def add(a, b):"
    full = SpeculativeDecoder(bundle).generate(prompt, 24).text
    stop = full[len(full) // 2:len(full) // 2 + 2]
    expected = SpeculativeDecoder(bundle).generate(prompt, 24, stop=[stop, "never there"]).text
    assert stop not in expected and len(expected) < len(full)
    streamed = specbuild("generate", bundle, "-p", prompt, "-n", 24, "--stop", stop, "--stop", "never there", check=True)
    as_json = json.loads(specbuild("generate", bundle, "-p", prompt, "-n", 24, "--stop", stop, "--json", check=True).stdout)
    assert streamed.stdout == prompt + expected + "\n" and as_json["text"] == expected
    assert as_json["stats"]["finish_reason"] == "stop" and as_json["stats"]["stop_reason"] == stop


def test_generate_json_gives_each_tokens_logprobs_as_the_api_does(bundles):
    from specbuild_runtime import SpeculativeDecoder

    bundle, prompt = bundles("llama", 1), "def add(a, b):"
    expected = SpeculativeDecoder(bundle).generate(prompt, 8, logprobs=2)
    as_json = json.loads(specbuild("generate", bundle, "-p", prompt, "-n", 8, "--json", "--logprobs", 2, check=True).stdout)
    assert as_json["logprobs"] == [{"token_id": r.token_id, "logprob": r.logprob, "top": [list(t) for t in r.top]}
                                   for r in expected.logprobs]
    assert len(as_json["logprobs"]) == len(as_json["token_ids"]) == 8
    assert "logprobs" not in json.loads(specbuild("generate", bundle, "-p", prompt, "-n", 2, "--json", check=True).stdout)
    refused = specbuild("generate", bundle, "-p", prompt, "--logprobs", 2)
    assert refused.returncode == 2 and "give --json too" in refused.stderr


def test_generate_min_p_samples_as_the_python_apis_min_p(bundles, cli):
    from specbuild_runtime import SpeculativeDecoder

    bundle, prompt = bundles("llama", 1), "def add(a, b):"
    decoder = SpeculativeDecoder(bundle)
    expected = decoder.generate(prompt, 16, temperature=1.5, seed=2, min_p=0.5).token_ids
    assert expected != decoder.generate(prompt, 16, temperature=1.5, seed=2).token_ids  # it bites
    ran, greedy = cli.run([["generate", str(bundle), "-p", prompt, "-n", "16", "--temperature", "1.5", "--seed", "2",
                            "--min-p", "0.5", "--json"], ["generate", str(bundle), "-p", prompt, "--min-p", "0.5"]])
    assert ran["status"] == 0 and json.loads(ran["stdout"])["token_ids"] == expected, ran
    assert greedy["status"] == 2 and "--min-p applies to sampling: give --temperature too" in greedy["stderr"], greedy


def test_generate_penalty_and_min_tokens_flags_decode_as_the_python_apis(bundles, cli):
    from specbuild_runtime import SpeculativeDecoder

    bundle, prompt = bundles("llama", 1), "def add(a, b):"
    penalties = dict(repetition_penalty=1.4, presence_penalty=0.5, frequency_penalty=-0.3, min_tokens=20)
    expected = SpeculativeDecoder(bundle).generate(prompt, 24, **penalties).token_ids
    assert expected != SpeculativeDecoder(bundle).generate(prompt, 24).token_ids  # they bite
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in penalties.items()]
    ran, refused = cli.run([["generate", str(bundle), "-p", prompt, "-n", "24", *flags, "--json"],
                            ["generate", str(bundle), "-p", prompt, "--presence-penalty", "2.5"]])
    assert ran["status"] == 0 and json.loads(ran["stdout"])["token_ids"] == expected, ran
    assert refused["status"] == 2 and "2.5 is not in the range -2<=x<=2" in refused["stderr"], refused


def test_generate_structured_output_flags_decode_as_the_python_apis_structured_outputs(bundles, tmp_path, cli):
    """Each flag is its structured_outputs key (a schema or grammar also from @FILE); two at once, bad JSON, an unreadable
    file or a grammar llguidance refuses are usage errors of one line; a bundle without logit_bias rows names the flag."""
    from conftest import compiled_before_penalties
    from specbuild_runtime import SpeculativeDecoder

    bundle, prompt = bundles("llama", 1), "def add(a, b):"
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    (tmp_path / "bad.json").write_text("{'type': 'object'}")
    old = compiled_before_penalties(shutil.copytree(bundle, tmp_path / "old"))
    asked = [(["--json-schema", f"@{tmp_path / 'schema.json'}"], {"json": schema}),
             (["--regex", "(yes|no)!"], {"regex": "(yes|no)!"}),
             (["--grammar", 'start: "a" "b"*'], {"grammar": 'start: "a" "b"*'}),
             (["--choice", "pass", "--choice", "return a + b"], {"choice": ["pass", "return a + b"]})]
    refused = [(["--json-schema", "{}", "--regex", "a"], "--json-schema and --regex each ask for a structured output: give one"),
               (["--json-schema", f"@{tmp_path / 'bad.json'}"],
                "'--json-schema': is not JSON (Expecting property name enclosed in double quotes, line 1 column 2)"),
               (["--grammar", f"@{tmp_path / 'missing'}"], f"'--grammar': cannot read '{tmp_path / 'missing'}' (No such file"),
               (["--regex", "("], "--regex is not a grammar llguidance compiles")]
    generate = ["generate", str(bundle), "-p", prompt, "-n", "12", "--json"]
    *results, too_old = cli.run([[*generate, *flags] for flags, _ in asked + refused] +
                                [["generate", str(old), "-p", prompt, "--regex", "a"]])
    decoder = SpeculativeDecoder(bundle)
    for ran, (_, structured) in zip(results, asked):
        assert ran["status"] == 0, ran["stderr"]
        assert json.loads(ran["stdout"])["token_ids"] == decoder.generate(prompt, 12, structured_outputs=structured).token_ids
    assert json.loads(results[len(asked) - 1]["stdout"])["text"] in ("pass", "return a + b")
    for ran, (_, message) in zip(results[len(asked):], refused):
        assert ran["status"] == 2 and message in ran["stderr"] and ran["stderr"].count("\n") == 1, (message, ran["stderr"])
    assert too_old["status"] == 1 and too_old["stderr"] == (
        f"error: --regex needs a bundle compiled with logit_bias rows; {old} was compiled before them: recompile it with "
        "`specbuild compile`, or leave --regex out\n"), too_old["stderr"]


def test_the_cuda_graphs_help_names_every_architecture_captured_by_default():
    """The default it states is engine.CAPTURED_BY_DEFAULT's, which grew past Llama alone."""
    from specbuild_runtime.engine import CAPTURED_BY_DEFAULT

    shown = " ".join(specbuild("generate", "--help", check=True).stdout.split())  # click wraps the help
    assert all(architecture in shown for architecture in CAPTURED_BY_DEFAULT)


def test_top_k_beside_a_temperature_too_small_to_sample_names_that_temperature(tmp_path, cli):
    """A temperature below 1e-5 decodes greedily; one that was given must not be asked for ("give --temperature
    too"). Checked before the bundle loads: none is needed."""
    [refused] = cli.run([["generate", str(tmp_path / "bundle"), "-p", "x", "--temperature", "5e-6", "--top-k", "5"]])
    assert refused["status"] == 2 and "--temperature 5e-06 is below 1e-05" in refused["stderr"], refused


def test_top_k_beside_temperature_0_says_0_decodes_greedily_not_give_a_temperature(tmp_path, cli):
    """--temperature 0 was given: "give --temperature too" told a user to give what they gave."""
    [refused] = cli.run([["generate", str(tmp_path / "bundle"), "-p", "x", "--temperature", "0", "--top-p", "0.9"]])
    assert refused["status"] == 2 and "--temperature 0 decodes greedily" in refused["stderr"], refused
    assert "give --temperature too" not in refused["stderr"]


def test_a_seed_without_a_temperature_is_taken_and_changes_nothing_as_the_api_and_vllm_take_it(bundles, cli):
    """A --seed with greedy decoding was refused, where serve, the Python API and vLLM take it (lm-evaluation-harness
    sends one at temperature 0): a script passing one at every temperature, 0 included, failed at 0."""
    bundle = str(bundles("llama", 1))
    plain, seeded, small = cli.run([["generate", bundle, "-p", "x", "-n", "8", "--json"],
                                    ["generate", bundle, "-p", "x", "-n", "8", "--seed", "1", "--json"],
                                    ["generate", bundle, "-p", "x", "-n", "8", "--temperature", "5e-6", "--seed", "1",
                                     "--json"]])
    assert [run["status"] for run in (plain, seeded, small)] == [0, 0, 0], (seeded, small)
    assert json.loads(seeded["stdout"])["token_ids"] == json.loads(small["stdout"])["token_ids"] == \
        json.loads(plain["stdout"])["token_ids"]


# Records the size each command gives onnxruntime's shared pool, and torch's threads at exit.
POOL_SIZES = (
    "import atexit, sys\n"
    "import onnxruntime.capi._pybind_state as state\n"
    "sized = state.set_global_thread_pool_sizes\n"
    "state.set_global_thread_pool_sizes = lambda *sizes: (print('pool', *sizes, file=sys.stderr), sized(*sizes))[1]\n"
    "atexit.register(lambda: 'torch' in sys.modules and print('torch', sys.modules['torch'].get_num_threads(),\n"
    "                                                        file=sys.stderr))\n"
    "from specbuild.cli import main\n"
    "main(sys.argv[1:])\n"
)


@pytest.mark.parametrize("command", ["generate", "bench", "verify"])
def test_threads_bounds_every_pool_a_decoding_command_runs(command, bundles, tmp_path):
    """Only serve took --threads: generate, bench and verify ran a thread per core (and verify's transformers
    torch's own), where a pipeline on a shared machine gives each command its share."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": PROMPTS[0]}) + "\n")
    args = {"generate": ["-p", "x", "-n", "2"], "bench": ["--prompts", prompts, "-n", "2", "--gamma", "1", "--json"],
            "verify": ["--prompts", prompts, "-n", "2"]}[command]
    result = subprocess.run([sys.executable, "-c", POOL_SIZES, command, bundles("llama"), *map(str, args), "--threads", "1"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "pool 1 1" in result.stderr.splitlines(), result.stderr
    assert ("torch 1" in result.stderr.splitlines()) == (command == "verify"), result.stderr


def test_bench_refuses_threads_beside_peers_that_choose_their_own(tmp_path):
    """Their rows would be timed on every core beside rows held to one: refused while the command line is read."""
    from specbuild.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["bench", str(tmp_path), "--threads", "1", "--peers", "transformers,llama.cpp"])
    assert exited.value.code == 2


def test_ctrl_c_is_one_line_in_a_build_log(monkeypatch, capsys):
    """click wrote an empty line to stderr before "error: interrupted": a second line where stderr is a file."""
    import signal

    import specbuild_runtime
    from specbuild.cli import main

    monkeypatch.setattr(specbuild_runtime, "SpeculativeDecoder", lambda *a, **k: os.kill(os.getpid(), signal.SIGINT))
    with pytest.raises(SystemExit) as exited:
        main(["generate", "bundle", "-p", "x"])
    assert exited.value.code == 130 and capsys.readouterr().err == "error: interrupted\n"


@pytest.mark.parametrize("interrupt", ["KeyboardInterrupt", "ImportError('initialization failed') from KeyboardInterrupt()"],
                         ids=["python-module", "extension-module"])
@pytest.mark.parametrize("project, command, args", [(".", "specbuild", ["inspect", "bundle"]),
                                                    ("runtime", "specbuild-serve", ["bundle"])])
def test_ctrl_c_while_the_command_imports_is_one_line_and_status_130(interrupt, project, command, args):
    """The entry points imported numpy and onnxruntime (most of a second) before main() took over: a Ctrl-C then
    printed a traceback and ended the process by the signal. The interrupt is raised where onnxruntime's extension
    module would load, under each entry point pyproject.toml installs: as Python raises it, or as that module's
    loading (pybind11's) reports it, an ImportError from it."""
    import tomllib
    from pathlib import Path

    pyproject = Path(__file__).parents[1] / project / "pyproject.toml"
    module, _, function = tomllib.loads(pyproject.read_text())["project"]["scripts"][command].partition(":")
    script = (
        "import sys\n"
        "class Interrupt:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'onnxruntime.capi.onnxruntime_pybind11_state':\n"
        f"            raise {interrupt}\n"
        "sys.meta_path.insert(0, Interrupt())\n"
        f"from {module} import {function}\n"
        f"sys.exit({function}())\n"
    )
    result = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True)
    assert (result.returncode, result.stderr) == (130, "error: interrupted\n"), result.stderr[-2000:]


def run_entry_point(command: str, setup: str, *args: str) -> subprocess.CompletedProcess:
    """command's entry point, as its pyproject.toml names it, run with args in a new interpreter after setup's
    lines."""
    import tomllib
    from pathlib import Path

    root = Path(__file__).parents[1]
    scripts = {**tomllib.loads((root / "pyproject.toml").read_text())["project"]["scripts"],
               **tomllib.loads((root / "runtime" / "pyproject.toml").read_text())["project"]["scripts"]}
    module, _, function = scripts[command].partition(":")
    script = f"import sys\n{setup}\nfrom {module} import {function}\n{function}()\n"
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("command", ["specbuild", "specbuild-serve"])
def test_the_command_without_onnxruntime_says_in_one_line_which_to_install(command):
    """Neither onnxruntime is a dependency (the cpu and gpu extras pick one: they break each other), so an install
    without either extra has none: the command printed the runtime's ModuleNotFoundError under a traceback
    (specbuild-serve's still did once specbuild's was caught: the check then ran when its package was imported)."""
    result = run_entry_point(command, "sys.modules['onnxruntime'] = None", "bundle")
    assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr[-2000:]
    assert result.stderr.startswith("error: specbuild-runtime needs onnxruntime: pip install './runtime[cpu]', or "
                                    "'./runtime[gpu]'"), result.stderr


@pytest.mark.parametrize("command, options", [("specbuild", ["generate", "--prompt", "def"]), ("specbuild-serve", [])])
def test_the_command_on_an_onnxruntime_left_without_its_files_says_in_one_line_how_to_reinstall(command, options,
                                                                                                 bundles, tmp_path):
    """onnxruntime and onnxruntime-gpu both installed, uninstalling one removes the files both wrote and leaves
    onnxruntime/capi/, which imports as an empty namespace package: every command said "internal error
    (AttributeError: module 'onnxruntime' has no attribute ...); this is a bug in specbuild"."""
    (tmp_path / "onnxruntime" / "capi").mkdir(parents=True)
    setup = ("import importlib.machinery, importlib.util\n"
             f"spec = importlib.machinery.PathFinder.find_spec('onnxruntime', [{str(tmp_path)!r}])\n"
             "sys.modules['onnxruntime'] = importlib.util.module_from_spec(spec)")
    result = run_entry_point(command, setup, *options, str(bundles("llama")))
    assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr[-2000:]
    assert "pip uninstall -y onnxruntime onnxruntime-gpu, then pip install './runtime[cpu]'" in result.stderr


def test_output_to_a_full_disk_is_one_line_that_names_stdout(bundles, tmp_path):
    """`> log` on a full disk said only "error: No space left on device": after compile, read as the bundle's disk
    though the bundle was written. (/dev/full: every write fails with ENOSPC.)"""
    with open("/dev/full", "w") as full:
        result = subprocess.run([sys.executable, "-m", "specbuild", "inspect", bundles("llama")], stdout=full,
                                stderr=subprocess.PIPE, text=True)
    assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("error: cannot write the output to stdout (No space left on device)"), result.stderr


def test_inspect_shows_the_longest_context_the_pair_takes_where_the_manifest_records_it(bundles, tmp_path, cli):
    old = tmp_path / "old"
    shutil.copytree(bundles("llama"), old)
    manifest = json.loads((old / "manifest.json").read_text())
    del manifest["context_limit"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    before, today = cli.run([["inspect", str(old)], ["inspect", str(bundles("llama"))]])
    assert "max-seq-len 256   eos" in before["stdout"], before["stdout"] + before["stderr"]
    assert "max-seq-len 256 (of up to 512)   eos" in today["stdout"], today["stdout"]


def test_inspect_says_which_engines_were_made_before_the_non_finite_check(bundles, tmp_path, cli):
    """An engine without not_finite_token (compiled before it) decodes token 0 from NaN logits: inspect says so and what
    to do; a bundle of today says nothing of it, and its engines use one rotary table (no rope_switch_length)."""
    old = tmp_path / "old"
    shutil.copytree(bundles("llama"), old)
    manifest = json.loads((old / "manifest.json").read_text())
    del manifest["engines"]["draft"]["not_finite_token"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    before, today = cli.run([["inspect", str(old)], ["inspect", str(bundles("llama"))]])
    assert before["status"] == today["status"] == 0, before["stderr"]
    lines = before["stdout"].splitlines()
    made = [i for i, line in enumerate(lines) if "made before the non-finite check" in line]
    assert len(made) == 1 and lines.index(next(line for line in lines if line.startswith("draft "))) < made[0], lines
    assert "recompile" in lines[made[0]]
    assert "non-finite" not in today["stdout"] and "rotary" not in today["stdout"]


def test_inspect_says_which_request_options_the_engines_take_as_the_decoder_refuses_the_others(bundles, tmp_path, cli):
    from conftest import compiled_before_min_p, compiled_before_penalties
    from specbuild_runtime import RequestError, SpeculativeDecoder

    today = bundles("llama")
    no_min_p = compiled_before_min_p(shutil.copytree(today, tmp_path / "no-min-p"))
    no_penalties = compiled_before_penalties(shutil.copytree(today, tmp_path / "no-penalties"))
    options = {"logprobs": {"logprobs": 1}, "min_p": {"temperature": 1.0, "min_p": 0.1},
               "penalties": {"repetition_penalty": 1.2}, "min_tokens": {"min_tokens": 1}, "logit_bias": {"logit_bias": {0: 1.0}},
               "structured outputs": {"structured_outputs": {"choice": ["a"]}}}
    lacking = {today: [], no_min_p: ["min_p"], no_penalties: ["penalties", "min_tokens", "logit_bias", "structured outputs"]}
    for bundle, shown in zip(lacking, cli.run([["inspect", str(bundle)] for bundle in lacking])):
        [line] = [line for line in shown["stdout"].splitlines() if line.startswith("requests ")]
        taken = [name for name in options if name not in lacking[bundle]]
        assert line == "requests   take " + ", ".join(taken) + (
            f"; not {', '.join(lacking[bundle])} (compiled before them: recompile with `specbuild compile` to have them)"
            if lacking[bundle] else ""), line
        decoder = SpeculativeDecoder(bundle)
        for name, option in options.items():  # what inspect says is what a request meets
            if name in taken:
                decoder.request(PROMPTS[0], 4, **option)
            else:
                with pytest.raises(RequestError, match="recompile it with `specbuild compile`"):
                    decoder.request(PROMPTS[0], 4, **option)


@pytest.mark.parametrize("existing", [False, True], ids=["new-output", "overwrite"])
def test_ctrl_c_mid_compile_says_nothing_was_written_and_what_the_output_holds(checkpoints, bundles, tmp_path,
                                                                              monkeypatch, capsys, existing):
    """Ctrl-C while the draft's engine was written (the target's already staged) said only "error: interrupted",
    which left a half-written bundle, or an old one lost, to be feared at the output."""
    import signal

    from specbuild.cli import main
    from specbuild.compile import pipeline

    target, draft, bundle = checkpoints("llama"), checkpoints("llama", 1), bundles("llama", 1)  # made uninterrupted
    export = pipeline.export_engine

    def interrupted_at_the_draft(ckpt, role, *args, **kwargs):
        if role == "draft":
            os.kill(os.getpid(), signal.SIGINT)
        return export(ckpt, role, *args, **kwargs)

    monkeypatch.setattr(pipeline, "export_engine", interrupted_at_the_draft)
    out = tmp_path / "bundle"
    if existing:
        shutil.copytree(bundle, out)
    before = {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()}
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        main(["compile", "--target", str(target), "--draft", str(draft), "-o", str(out),
              "--max-seq-len", "64", *(["--overwrite"] if existing else [])])
    where = "holds what it held before" if existing else "was not made"
    assert exited.value.code == 130
    assert capsys.readouterr().err == (f"error: interrupted: nothing was written ({out.resolve()} {where}); run the "
                                       "command again to write it\n")
    assert {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == (["bundle"] if existing else [])


@pytest.mark.parametrize("existing", [False, True], ids=["new-output", "overwrite"])
def test_ctrl_c_as_compile_loads_its_modules_says_nothing_was_written_as_later_ones_do(tmp_path, monkeypatch, capsys,
                                                                                      existing):
    """Before staging began (torch and transformers loading: seconds on a busy machine) it said only
    "error: interrupted"."""
    import signal

    from specbuild import cli

    monkeypatch.setattr(cli, "use_threads", lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGINT))
    out = tmp_path / "bundle"
    if existing:
        out.mkdir()
    with pytest.raises(SystemExit) as exited:
        cli.main(["compile", "--target", "t", "--draft", "d", "-o", str(out)])
    where = "holds what it held before" if existing else "was not made"
    assert exited.value.code == 130
    assert capsys.readouterr().err == (f"error: interrupted: nothing was written ({out.resolve()} {where}); run the "
                                       "command again to write it\n")
