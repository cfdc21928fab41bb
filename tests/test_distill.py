"""Distillation on tiny models trained on nothing (fast, CPU only): where its prompts come from, what the
target's data holds, how α is measured, and the rule that a draft is never written out worse."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import ARCHITECTURES, make_checkpoint, make_tokenizer, on_a_terminal
from test_bad_inputs import MARKER, plant_pickle
from specbuild.acceptance import rounds
from specbuild.demo import DEMO_RECIPE
from specbuild.errors import (CheckpointError, OutputError, PairMismatchError, SpecbuildError, TrainingError,
                             UnsupportedModelError)
from specbuild.recipe import DISTILL_OBJECTIVES, MAX_GAMMA
from specbuild.train import distill as distill_module
from specbuild.train import divergence, generate
from specbuild.train.distill import (SHAPE_KEYS, acceptance, alpha, distill, load_model, shrunk_config,
                                     target_references)
from specbuild.train.generate import Sequence, continue_prompts, right_padded, score
from specbuild.train.prompts import (HELDOUT_SHARE, SPAN_TOKENS, from_file, from_target, from_text, read_prompt_file,
                                     read_texts, start_token)
from specbuild.train.demo_pair import code_only, read_pair_recipe
from specbuild.train.train import StepTuner, parameter_count

SMALLER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
PROMPTS = ["def add(a, b):\n", "import os\n", "class Stack:\n", "x = 1\n", "for i in range(3):\n", "while True:\n",
           "return self\n", "if a:\n"]


@pytest.fixture(scope="module")
def pair(checkpoints):
    """(target folder, draft folder): tiny Llamas of one tokenizer, the draft smaller and unrelated."""
    return checkpoints("llama"), checkpoints("llama", 1, **SMALLER)


@pytest.fixture(scope="module")
def models(pair):
    (target, tokenizer), (draft, _) = load_model(pair[0], "target"), load_model(pair[1], "draft")
    return target, draft, tokenizer


@pytest.fixture()
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return path


def test_a_distilled_draft_names_a_tokenizer_class_transformers_4_has(models, tmp_path):
    """transformers 5 saves the tokenizer as TokenizersBackend, which transformers 4 (allowed by this package, and
    what TensorRT-LLM pins) does not know: a compile there refused the draft distill wrote."""
    from specbuild.train.train import write_checkpoint

    _, draft, tokenizer = models
    write_checkpoint(draft, tokenizer, tmp_path)
    assert json.loads((tmp_path / "tokenizer_config.json").read_bytes())["tokenizer_class"] == "PreTrainedTokenizerFast"


def test_rounds_follow_greedy_speculative_decoding():
    # token 0: the prompt pass's; round 1 from 1: drafts 4, accepts 1 (+ target token at 2); round 2 from 3:
    # drafts 4, accepts 4 (+ target at 7)
    assert rounds([False, True, False, True, True, True, True, False], gamma=4) == (5, 8)
    # the first token is the prompt pass's and the last always the target's own: nothing is drafted for them
    assert rounds([True], gamma=4) == (0, 0) and rounds([True, True], gamma=4) == (0, 0)
    # eos at token 2 (end 3): the round drafting past it still counts what was accepted, then decoding stops
    assert rounds([True, True, True, True, True, False], gamma=4, end=3) == (4, 4)


def test_rounds_end_where_the_request_does_however_far_the_continuation_runs():
    # 5 tokens asked: the prompt pass's, one round of 3 drafts (the last token is the target's); the
    # continuation's other 5 tokens are never decoded (they counted rounds of negative drafts)
    assert rounds([True] * 10, gamma=4, new_tokens=5) == (3, 3)
    assert rounds([True] * 10, gamma=4, new_tokens=5, end=8) == (3, 3)


def test_a_prompts_file_holds_out_every_fourth_prompt(models, prompts_file):
    _, _, tokenizer = models
    prompts = from_file(tokenizer, read_prompt_file(prompts_file), max_heldout=64)
    encoded = tokenizer(PROMPTS)["input_ids"]
    assert prompts.heldout == [encoded[3], encoded[7]]
    assert prompts.train == [ids for i, ids in enumerate(encoded) if i not in (3, 7)]


def test_a_prompts_file_of_one_prompt_is_refused(tmp_path):
    (tmp_path / "one.jsonl").write_text('{"prompt": "x"}\n')
    with pytest.raises(TrainingError, match="one prompt"):
        read_prompt_file(tmp_path / "one.jsonl")


def test_a_prompt_repeated_in_the_file_never_trains_where_a_copy_is_held_out(models, tmp_path):
    _, _, tokenizer = models
    (tmp_path / "dup.jsonl").write_text("".join(f'{{"prompt": "{p}"}}\n' for p in ["a b", "c", "d", "a b", "e", "a b"]))
    prompts = from_file(tokenizer, read_prompt_file(tmp_path / "dup.jsonl"), max_heldout=64)
    encoded = tokenizer(["a b", "c", "d", "e"])["input_ids"]
    assert prompts.heldout == [encoded[0]]  # the fourth line
    assert prompts.train == [encoded[1], encoded[2], encoded[3]]
    (tmp_path / "same.jsonl").write_text('{"prompt": "x"}\n' * 5)
    with pytest.raises(TrainingError, match="two or more distinct prompts"):
        from_file(tokenizer, read_prompt_file(tmp_path / "same.jsonl"), max_heldout=64)


def test_text_spans_hold_out_the_last_tenth_of_every_file(models, tmp_path):
    _, _, tokenizer = models
    words = [f"w{i} " for i in range(4000)]  # every span is unique, so where it came from is unambiguous
    files = []
    for n in range(2):
        files.append(tmp_path / f"{n}.txt")
        files[-1].write_text("".join(words[n * 2000 : (n + 1) * 2000]))
    prompts = from_text(tokenizer, [f.read_text() for f in files], n_heldout=8, seed=0)
    encoded = [tokenizer(f.read_text(), add_special_tokens=False)["input_ids"] for f in files]
    cuts = [int(len(ids) * (1 - HELDOUT_SHARE)) for ids in encoded]

    def found_in(span, part):
        return any(part[i : i + len(span)] == span for i in range(len(part) - len(span) + 1))

    assert len(prompts.heldout) == 8 and all(len(span) == SPAN_TOKENS for span in prompts.heldout + prompts.train)
    assert all(any(found_in(s, ids[cut:]) for ids, cut in zip(encoded, cuts)) for s in prompts.heldout)
    assert all(any(found_in(s, ids[:cut]) for ids, cut in zip(encoded, cuts)) for s in prompts.train[:50])


def test_data_is_every_text_file_under_a_folder(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "notes.h").write_text("int x;\n")
    (tmp_path / "a.txt").write_text("hello\n")
    (tmp_path / "blob.bin").write_bytes(bytes(range(256)) * 4)
    assert sorted(read_texts(tmp_path)) == ["hello\n", "int x;\n"]
    with pytest.raises(TrainingError, match="no text files"):
        read_texts(tmp_path / "blob.bin")


def test_without_prompts_the_target_is_held_out_on_its_own_samples(models):
    target, _, tokenizer = models
    prompts = from_target(target, tokenizer, n_heldout=4, seed=0)
    assert prompts.train == [[start_token(tokenizer)]]
    assert all(p[0] == start_token(tokenizer) and len(p) == SPAN_TOKENS + 1 for p in prompts.heldout)
    assert len({tuple(p) for p in prompts.heldout}) > 1  # sampled, not one greedy text four times


def test_a_sample_of_the_target_that_ends_at_its_last_token_is_not_held_out(models, monkeypatch):
    """A sample whose eos is its last token had SPAN_TOKENS + 1 tokens, as a sample that runs on has, and was held
    out: α was measured on what the target writes after an eos, which no request decodes."""
    from specbuild.train import prompts as prompts_module

    target, _, tokenizer = models
    eos = next(iter(generate.eos_ids(target)))
    words = [t for t in range(len(tokenizer)) if t not in generate.eos_ids(target)][:SPAN_TOKENS]
    ended, running = ([start_token(tokenizer), *words[:-1], eos], [start_token(tokenizer), *words])
    monkeypatch.setattr(prompts_module, "continue_prompts", lambda *args, **kwargs: [
        Sequence(np.asarray(tokens, np.int32), 0, np.zeros((SPAN_TOKENS, 0)), np.zeros((SPAN_TOKENS, 0)))
        for tokens in (ended, running)])
    assert from_target(target, tokenizer, n_heldout=2, seed=0).heldout == [running]


def test_generated_teacher_data_equal_a_teacher_forced_pass(models):
    target, _, tokenizer = models
    prompts = tokenizer(PROMPTS[:4])["input_ids"]  # different lengths: generate() pads them on the left
    for sample in (False, True):
        made = continue_prompts(target, prompts, 12, len(tokenizer), sample=sample)
        rescored = score(target, made, len(tokenizer))
        for generated, forced in zip(made, rescored):
            assert np.array_equal(generated.top_ids[:, :4], forced.top_ids[:, :4])
            np.testing.assert_allclose(generated.top_logprobs, forced.top_logprobs, atol=1e-4)
            if not sample:  # greedy: each new token is the target's most likely one
                assert np.array_equal(generated.tokens[generated.first + 1 :], generated.top_ids[:, 0])


def speculate_step_by_step(target, draft, prompt: list[int], new_tokens: int, gamma: int) -> tuple[int, int]:
    """Greedy speculative decoding as the runtime does it: the target's prompt pass gives the first token,
    then rounds draft gamma tokens, keep the agreeing prefix and the target's own next token, repeat."""
    tokens = list(prompt) + [int(target(input_ids=torch.tensor([prompt])).logits[0, -1].argmax())]
    produced, accepted, drafted = 1, 0, 0
    while produced < new_tokens:
        k = min(gamma, new_tokens - produced - 1)
        guess = list(tokens)
        for _ in range(k):
            guess.append(int(draft(input_ids=torch.tensor([guess])).logits[0, -1].argmax()))
        choices = target(input_ids=torch.tensor([guess])).logits[0, len(tokens) - 1 :].argmax(-1).tolist()
        run = 0
        while run < k and guess[len(tokens) + run] == choices[run]:
            run += 1
        tokens += guess[len(tokens) : len(tokens) + run] + [choices[run]]
        accepted, drafted, produced = accepted + run, drafted + k, produced + run + 1
    return accepted, drafted


@torch.no_grad()
def test_alpha_from_one_pass_equals_step_by_step_speculation(models):
    target, draft, tokenizer = models
    prompts = tokenizer(PROMPTS[:3])["input_ids"]
    references = target_references(target, prompts, len(tokenizer), new_tokens=10)
    # No eos in the way (speculate_step_by_step would stop there).
    assert all(tokenizer.eos_token_id not in r.tokens[r.first + 1 :] for r in references)
    for gamma in (1, 3):
        expected = np.sum([speculate_step_by_step(target, draft, p, 10, gamma) for p in prompts], axis=0)
        assert acceptance(draft, references, gamma, len(tokenizer), {tokenizer.eos_token_id}, new_tokens=10) == tuple(expected)
    assert alpha(acceptance(target, references, 4, len(tokenizer), {tokenizer.eos_token_id}, new_tokens=10)) == 1.0


def near_copy(source, folder):
    """The checkpoint at source, its weights slightly perturbed: as a draft, α far from 0 and 1."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, folder)
    weights = load_file(source / "model.safetensors")
    torch.manual_seed(1)
    save_file({k: (v + 0.03 * v.std() * torch.randn_like(v) if v.dim() > 1 else v).contiguous() for k, v in weights.items()},
              folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_alpha_is_what_the_runtime_counts_on_the_same_prompts(pair, tmp_path, prompts_file):
    """Bench's α is the runtime's accepted / drafted; distill's must be the same number, prompts that end
    at eos included (the runtime drafts past an eos it has not seen yet)."""
    from specbuild.compile import compile_bundle
    from specbuild.recipe import CompileSettings
    from specbuild_runtime import SpeculativeDecoder

    draft_dir = near_copy(pair[0], tmp_path / "near")
    compile_bundle(CompileSettings(target=pair[0], draft=draft_dir, output=tmp_path / "bundle", max_seq_len=256),
                   show_progress=False)
    (target, tokenizer), (draft, _) = load_model(pair[0], "target"), load_model(draft_dir, "draft")
    prompts = tokenizer([*PROMPTS, "def main():\n"])["input_ids"]  # the target ends the last within 32 tokens
    references = target_references(target, prompts, len(tokenizer), new_tokens=32)
    assert any(tokenizer.eos_token_id in r.tokens[r.first + 1 :] for r in references)
    decoder = SpeculativeDecoder(tmp_path / "bundle")
    counted = np.sum([[(s := decoder.generate(p, 32, 4).stats).accepted, s.drafted] for p in prompts], axis=0)
    assert 0 < counted[0] < counted[1]
    assert acceptance(draft, references, 4, len(tokenizer), {tokenizer.eos_token_id}, new_tokens=32) == tuple(counted)
    assert alpha(acceptance(target, references, 4, len(tokenizer), {tokenizer.eos_token_id}, new_tokens=32)) == 1.0  # past eos too


@pytest.mark.parametrize("named_by", ["generation_config", "tokenizer"])
def test_alpha_ends_a_request_at_the_targets_eos_ids_as_its_bundle_does(pair, tmp_path, prompts_file, named_by):
    """A bundle stops at the target's eos ids: generation_config.json's list, and the tokenizer's eos (a
    fine-tune's generation_config.json may name only its base model's). A draft's may be fewer (a new draft's
    come from the target's config.json, a base model's from its own): distill's α counted the rounds past an
    eos only the target has, which no decoding makes."""
    from specbuild.compile import compile_bundle
    from specbuild.recipe import CompileSettings
    from specbuild_runtime import SpeculativeDecoder

    target_dir = tmp_path / "target"
    shutil.copytree(pair[0], target_dir)
    target, tokenizer = load_model(target_dir, "target")
    heldout = from_file(tokenizer, read_prompt_file(prompts_file), 2).heldout
    reference = target_references(target, heldout[:1], len(tokenizer))[0]
    other_eos = int(reference.tokens[reference.first + 5])  # one the target writes early in a held-out request
    if named_by == "generation_config":
        draft_dir = near_copy(target_dir, tmp_path / "near")  # its generation_config.json: the one eos
        config = json.loads((target_dir / "generation_config.json").read_text())
        (target_dir / "generation_config.json").write_text(
            json.dumps({**config, "eos_token_id": [tokenizer.eos_token_id, other_eos]}))
    else:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(other_eos)  # generation_config.json keeps the other
        tokenizer.save_pretrained(target_dir)
        draft_dir = near_copy(target_dir, tmp_path / "near")
    report = distill(target_dir, tmp_path / "draft", init=draft_dir, prompts_file=prompts_file, minutes=0.01,
                     heldout_prompts=2)
    compile_bundle(CompileSettings(target=target_dir, draft=draft_dir, output=tmp_path / "bundle", max_seq_len=256),
                   show_progress=False)
    decoder = SpeculativeDecoder(tmp_path / "bundle")
    runs = [decoder.generate(p, distill_module.NEW_TOKENS, report["gamma"]) for p in heldout]
    assert runs[0].stats.finish_reason == "eos" and runs[0].token_ids[-1] == other_eos
    accepted, drafted = np.sum([[r.stats.accepted, r.stats.drafted] for r in runs], axis=0)
    assert report["heldout_drafted_tokens"] > 0 and report["alpha_before"] == round(accepted / drafted, 4)


def test_a_draft_that_cannot_improve_is_not_written(pair, tmp_path):
    # The target as its own draft: alpha is 1 before, so it cannot rise.
    report = distill(pair[0], tmp_path / "draft", init=pair[0], minutes=0.01, heldout_prompts=4)
    assert report["alpha_before"] == 1.0 and not report["written"]
    assert not (tmp_path / "draft").exists()
    forced = distill(pair[0], tmp_path / "draft", init=pair[0], minutes=0.01, heldout_prompts=4, force=True)
    assert forced["written"] and (tmp_path / "draft" / "config.json").is_file()


@pytest.mark.parametrize("where", ["the target", "the target's parent", "inside the target", "the init",
                                   "the prompts' folder"])
def test_distill_never_writes_over_or_around_its_inputs(pair, tmp_path, prompts_file, monkeypatch, where):
    monkeypatch.setattr(distill_module, "train_model", lambda *a, **k: pytest.fail("refused only after training"))
    target = tmp_path / "target"
    shutil.copytree(pair[0], target)
    init = tmp_path / "init"
    shutil.copytree(pair[0], init)
    output = {"the target": target, "the target's parent": tmp_path, "inside the target": target / "draft",
              "the init": init, "the prompts' folder": prompts_file.parent}[where]
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(OutputError, match="writing there could destroy it"):
        distill(target, output, init=init, prompts_file=prompts_file, minutes=0.01, force=True, overwrite=True)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_distill_replaces_a_checkpoint_only_with_overwrite_and_nothing_else_ever(pair, tmp_path):
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "mine.txt").write_text("keep me")
    for overwrite in (False, True):
        with pytest.raises(OutputError, match="is not a checkpoint"):
            distill(pair[0], folder, init=pair[0], minutes=0.01, force=True, overwrite=overwrite)
    assert (folder / "mine.txt").read_text() == "keep me"

    draft = tmp_path / "draft"
    distill(pair[0], draft, init=pair[0], minutes=0.01, heldout_prompts=2, force=True)
    with pytest.raises(OutputError, match="pass --overwrite"):
        distill(pair[0], draft, init=pair[0], minutes=0.01, heldout_prompts=2, force=True)
    assert distill(pair[0], draft, init=pair[0], minutes=0.01, heldout_prompts=2, force=True, overwrite=True)["written"]


def test_an_output_where_nothing_can_be_written_is_refused_before_training(pair, tmp_path):
    """A read-only folder (a read-only mount here: root may write anywhere else) was found out only when the
    draft was saved, after --minutes of training (and the trained draft was lost)."""
    if not (shutil.which("unshare") and subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode == 0):
        pytest.skip("cannot mount here (needs unshare -rm)")
    readonly = tmp_path / "readonly"
    readonly.mkdir()
    script = ("import sys\n"
              "from specbuild.train import distill as d\n"
              "d.train_model = lambda *a, **k: sys.exit('refused only after training')\n"
              f"try: d.distill({str(pair[0])!r}, {str(readonly / 'sub' / 'draft')!r}, minutes=0.01, force=True)\n"
              "except Exception as exc: print(type(exc).__name__, exc)\n")
    result = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o ro none {readonly} && {sys.executable} -c \"$0\"",
                             script], capture_output=True, text=True)
    assert result.stdout.startswith("OutputError cannot write in") and "refused only after training" not in result.stderr, \
        (result.stdout, result.stderr[-500:])


def test_the_distill_command_refuses_a_folder_of_the_users_in_one_line(pair, tmp_path):
    (tmp_path / "mine.txt").write_text("keep me")
    result = distill_command("--target", pair[0], "-o", tmp_path, "--minutes", "0.01", "--force", "--overwrite")
    assert result.returncode == 1 and result.stderr.startswith("error: ") and "is not a checkpoint" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and (tmp_path / "mine.txt").read_text() == "keep me"


def test_a_draft_whose_alpha_rose_is_written_with_the_targets_tokenizer(pair, tmp_path, monkeypatch, prompts_file):
    measured = iter([(1, 10), (5, 10)])  # alpha 0.1 before, 0.5 after
    monkeypatch.setattr(distill_module, "acceptance", lambda *args, **kwargs: next(measured))
    report = distill(pair[0], tmp_path / "draft", draft_config=SMALLER, minutes=0.02, prompts_file=prompts_file)
    assert report["written"] and report["alpha_gain"] == 0.4
    assert report["theoretical_speedup_after"] > report["theoretical_speedup_before"]
    assert report["prompts"].startswith("prompts of") and report["heldout_prompts"] == 2
    draft, draft_tokenizer = load_model(tmp_path / "draft", "draft")
    assert draft_tokenizer.get_vocab() == load_model(pair[0], "target")[1].get_vocab()
    assert parameter_count(draft) == report["draft_parameters"] < report["target_parameters"]


def test_overwrite_replaces_a_draft_only_with_one_of_higher_alpha(pair, tmp_path, monkeypatch):
    """The draft at the output is measured on the same held-out prompts: a new one whose α rose from its own
    start but stays below it leaves it in place (a fresh draft rising from 0.00 to 0.01 replaced one of 1.00)."""
    output = tmp_path / "draft"
    shutil.copytree(pair[0], output)  # the target as its own draft: α 1
    files = {p.name: p.read_bytes() for p in output.iterdir()}
    real = distill_module.acceptance
    monkeypatch.setattr(distill_module, "train_model", lambda *args, **kwargs: {"steps": 0, "seconds": 0.0})
    for force in (False, True):
        rising, trained = iter([(1, 10), (5, 10)]), []  # the new draft's α: 0.1 before, 0.5 after

        def measured(model, *args, **kwargs):
            trained[:] = trained or [model]  # the first model measured is the new draft
            return next(rising) if model is trained[0] else real(model, *args, **kwargs)

        monkeypatch.setattr(distill_module, "acceptance", measured)
        report = distill(pair[0], output, draft_config=SMALLER, minutes=0.01, heldout_prompts=4, overwrite=True, force=force)
        assert report["written"] == force and ({p.name: p.read_bytes() for p in output.iterdir()} == files) != force
        assert (report["alpha_before"], report["alpha_after"], report["alpha_replaced"]) == (0.1, 0.5, 1.0)


def distill_command(*args):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # tiny models; a busy machine makes two threads crawl
    return subprocess.run([sys.executable, "-m", "specbuild", "distill", *map(str, args)], capture_output=True,
                          text=True, env=env)


def test_the_distill_command_says_in_one_line_that_it_wrote_nothing(pair, tmp_path):
    result = distill_command("--target", pair[0], "--init", pair[0], "-o", tmp_path / "draft", "--minutes", "0.01")
    assert result.returncode == 1
    assert "on the held-out prompts: 1.000 -> " in result.stdout
    assert "prompts: the target's own samples from its start token (" in result.stdout
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "was not written" in lines[0], result.stderr
    assert not (tmp_path / "draft").exists()


@pytest.mark.parametrize("target, shape, overrides, architecture", [
    ("qwen3moe", {}, (), "Qwen3ForCausalLM"), ("mixtral", {}, (), "MistralForCausalLM"),
    ("qwen3moe", {"use_sliding_window": True, "sliding_window": 8}, (), "Qwen3ForCausalLM"),
    ("qwen3moe", {}, ("--draft-config", "model_type=qwen3_moe"), "Qwen3MoeForCausalLM")])
def test_a_mixture_of_experts_target_distills_a_draft_its_bundle_decodes_exactly(checkpoints, tmp_path, target, shape,
                                                                                  overrides, architecture):
    """The default draft is the dense sibling users pair with the mixture (Qwen3, its head tied, and Mistral;
    windowed in every layer where the mixture is, past the 16 tokens decoded); model_type=qwen3_moe still asks for the
    target's own, shrunk, which transformers 5 holds fused and must save one tensor per expert, as compile reads it."""
    from specbuild.compile import compile_bundle
    from specbuild.recipe import CompileSettings
    from specbuild_runtime import SpeculativeDecoder

    target = checkpoints(target, **shape)
    result = distill_command("--target", target, "-o", tmp_path / "draft", "--minutes", "0.01", "--force", *overrides)
    assert result.returncode == 0, result.stderr
    written = json.loads((tmp_path / "draft/config.json").read_text())
    assert written["architectures"] == [architecture]
    assert written["tie_word_embeddings"] is (architecture == "Qwen3ForCausalLM")  # a tied draft compiles and decodes
    compile_bundle(CompileSettings(target=target, draft=tmp_path / "draft", output=tmp_path / "b", max_seq_len=64),
                   show_progress=False)
    decoder, prompt = SpeculativeDecoder(tmp_path / "b"), [1, 2, 3, 4]
    assert decoder.generate(prompt, 12, gamma=3).token_ids == decoder.generate(prompt, 12, gamma=0).token_ids


@pytest.mark.parametrize("architecture, dense, windowed", [("qwen3moe", "Qwen3Config", False),
                                                           ("qwen3moe", "Qwen3Config", True),
                                                           ("mixtral", "MistralConfig", True)])
def test_a_mixture_of_experts_targets_default_draft_is_its_dense_sibling_of_its_attention(checkpoints, architecture,
                                                                                          dense, windowed):
    """No expert or router key, the target's vocabulary, special tokens and attention (q/k norms and head_dim through
    the class, rope, a window in every layer where the target windows them), checked as compile checks the pair."""
    from specbuild.compile.load import load_config
    from specbuild.train.distill import new_draft

    folder = checkpoints(architecture, **({"use_sliding_window": True, "sliding_window": 8}
                                          if windowed and architecture == "qwen3moe" else {}))
    target_config = load_config(folder, "target")
    config = shrunk_config(target_config)
    assert type(config).__name__ == dense
    assert not [key for key in config.to_dict() if "expert" in key or "router" in key or "moe" in key]
    for key in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id", "rope_parameters", "rms_norm_eps",
                "max_position_embeddings"):
        assert getattr(config, key) == getattr(target_config, key), key
    assert config.sliding_window == (8 if windowed else None)
    target, tokenizer = load_model(folder, "target")
    draft = new_draft(target, tokenizer, config, None, seed=0)
    assert getattr(draft.config, "layer_types", None) in (None, [
        "sliding_attention" if windowed else "full_attention"] * draft.config.num_hidden_layers)
    assert draft(input_ids=torch.tensor([[1, 2, 3]])).logits.isfinite().all()


@pytest.mark.parametrize("architecture, tied", [("qwen3moe", True), ("mixtral", False)])
def test_a_mixture_targets_dense_sibling_ties_its_head_as_its_familys_small_releases_do(checkpoints, architecture,
                                                                                         tied):
    """Qwen3's 0.6B-4B tie their head to their embeddings, Mistral's releases never do (the mixtures never): a tied
    draft of the same shape reads the same head each step and holds the table once. --draft-config unties it."""
    from specbuild.compile.load import load_config

    target_config = load_config(checkpoints(architecture), "target")
    assert not target_config.tie_word_embeddings
    config = shrunk_config(target_config)
    assert config.tie_word_embeddings is tied
    untied = shrunk_config(target_config, {"tie_word_embeddings": False})
    assert not untied.tie_word_embeddings
    assert [getattr(untied, key) for key in SHAPE_KEYS] == [getattr(config, key) for key in SHAPE_KEYS]


@pytest.mark.parametrize("architecture", [a for a in ARCHITECTURES if a not in ("qwen3moe", "mixtral")] + ["gpt2"])
def test_a_dense_targets_default_draft_is_of_its_own_config_class_and_keys(checkpoints, architecture):
    """Only a mixture's draft is another model_type's: a dense target's default draft is shrunk from its own config
    (as a comparison of every tiny and benchmark config's default draft before and after DENSE_SIBLINGS found,
    byte for byte)."""
    from specbuild.compile.load import load_config

    target_config = load_config(checkpoints(architecture), "target")
    config = shrunk_config(target_config)
    assert type(config) is type(target_config) and config.to_dict().keys() == target_config.to_dict().keys()


@pytest.mark.parametrize("architecture, overrides, message", [
    ("qwen3moe", {"model_type": "mistral"},
     "^--draft-config model_type=mistral: a new draft is of the target's model_type \\(qwen3_moe\\) or its dense "
     "sibling's \\(qwen3, the default\\); to draft with another architecture, pass its checkpoint with --init$"),
    ("qwen3moe", {"num_experts": 4},
     "^--draft-config num_experts: the draft's qwen3 config \\(the dense sibling of the target's qwen3_moe; "
     "model_type=qwen3_moe gives a mixture-of-experts draft\\) has no such key"),
    ("mixtral", {"num_local_experts": 2}, "the draft's mistral config \\(the dense sibling of the target's mixtral"),
])
def test_a_mixture_targets_draft_config_is_checked_against_its_dense_draft_and_says_how_to_get_a_mixture(
        checkpoints, architecture, overrides, message):
    from specbuild.compile.load import load_config

    with pytest.raises(TrainingError, match=message):
        shrunk_config(load_config(checkpoints(architecture), "target"), overrides)


def test_a_mixture_targets_draft_config_may_name_either_model_type(checkpoints):
    """model_type=qwen3 names the default (nothing changes); model_type=qwen3_moe the target's own, with its expert
    keys then taking overrides."""
    from specbuild.compile.load import load_config

    target_config = load_config(checkpoints("qwen3moe"), "target")
    dense = shrunk_config(target_config, {"model_type": "qwen3"})
    assert dense.to_json_string() == shrunk_config(target_config).to_json_string()
    mixture = shrunk_config(target_config, {"model_type": "qwen3_moe", "num_experts": 4})
    assert type(mixture) is type(target_config) and mixture.num_experts == 4


def test_the_distill_command_prints_only_its_one_line_on_stderr_for_a_phi3_target(checkpoints, tmp_path):
    """transformers remarks on a Phi-3 config's original_max_position_embeddings when distill first reads it (its size
    against memory), before anything quieted transformers: a second line on stderr beside the error."""
    target = checkpoints("phi3")
    result = distill_command("--target", target, "--init", target, "-o", tmp_path / "draft", "--minutes", "0.01")
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1 and len(lines) == 1 and "was not written" in lines[0], result.stderr


# What a user at a terminal sees of each phase before, during and after training: on a 7B target each one is
# minutes (docs/commands.md, distill), which a silent terminal would pass off as a hang.
DISTILL_PHASES = ("loading the target checkpoint", "initialising the draft", "the target samples 4 held-out prompts",
                  "the target continues", "measuring α before training", "distill", "the target writes 64 sampled sequences",
                  "measuring α after training", "writing the draft to")


def test_every_phase_of_distill_shows_progress_on_a_terminal(pair, tmp_path, monkeypatch):
    terminal = on_a_terminal(monkeypatch)
    distill(pair[0], tmp_path / "draft", draft_config=SMALLER, minutes=0.01, heldout_prompts=4, force=True)
    shown = terminal.getvalue()
    assert [phase for phase in DISTILL_PHASES if phase not in shown] == [], shown


def test_distill_prints_no_progress_where_stderr_is_no_terminal(pair, tmp_path, capsys):
    """A build log or a pipeline reading one-line errors gets nothing on stderr from a run that succeeds, where no
    phase lasts a minute (progress.LOG_EVERY; test_progress.py has the lines of a longer one)."""
    distill(pair[0], tmp_path / "draft", draft_config=SMALLER, minutes=0.01, heldout_prompts=4, force=True)
    assert capsys.readouterr().err == ""


def test_the_distill_command_takes_one_source_of_prompts(pair, tmp_path, prompts_file):
    result = distill_command("--target", pair[0], "-o", tmp_path / "draft", "--prompts", prompts_file, "--data", prompts_file)
    assert result.returncode == 2 and "either --prompts or --data" in result.stderr


def test_a_draft_config_that_is_not_key_value_is_refused_before_torch_is_imported(tmp_path):
    """`--draft-config foo` was refused in the command's body, after distill had imported torch and transformers
    (4.5 s on 2 cores), where the command's other wrong values are refused as the command line is parsed."""
    code = ("import sys\nfrom specbuild.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as exited:\n"
            "    print(exited.code, 'torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code, "distill", "--target", str(tmp_path), "-o", str(tmp_path / "d"),
                             "--draft-config", "foo"], capture_output=True, text=True)
    assert result.stdout.split() == ["2", "False"], result.stderr
    assert "'foo' is not KEY=VALUE; write it as num_hidden_layers=2" in result.stderr


def passes_option_with_the_apis_default(monkeypatch, tmp_path, capsys, option: str, value: str, refused: str) -> str:
    """`distill --option value` reaches the API as given and, left out, as the API's own default; `refused` is a
    usage error (exit 2). Returns its stderr."""
    import inspect

    from specbuild.cli import main

    name = option.removeprefix("--").replace("-", "_")
    asked = []
    monkeypatch.setattr(distill_module, "distill", lambda *args, **kwargs: asked.append(kwargs) or {"written": True})
    for extra in ([option, value], []):
        with pytest.raises(SystemExit) as exited:
            main(["distill", "--target", str(tmp_path), "-o", str(tmp_path / "draft"), "--json", *extra])
        assert exited.value.code == 0, capsys.readouterr().err
    assert [a[name] for a in asked] == [int(value), inspect.signature(distill).parameters[name].default]
    with pytest.raises(SystemExit) as exited:
        main(["distill", "--target", str(tmp_path), "-o", str(tmp_path / "draft"), option, refused])
    assert exited.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("before, after, replaced, says", [
    (0.0012, 0.0014, None, "0.0012 -> 0.0014 (+0.0002)"),
    (0.25, 0.5, None, "0.250 -> 0.500 (+0.250)"),
    (0.5, 0.5004, 0.5006, "α rose (0.5000 -> 0.5004) but not above the 0.5006 of the draft at"),
], ids=["written", "written-far", "not-replaced"])
def test_the_distill_command_prints_alpha_with_the_decimals_that_show_a_rise(monkeypatch, tmp_path, capsys, before,
                                                                           after, replaced, says):
    """A draft is written on any rise of α, which three decimals hid: "α 0.001 -> 0.001 (+0.000)", then "wrote"."""
    from specbuild.cli import main

    report = {"alpha_before": before, "alpha_after": after, "alpha_gain": round(after - before, 4),
              "alpha_replaced": replaced, "written": replaced is None, "heldout_prompts": 32,
              "generation": {"sequences": 64, "seconds": 60.0}, "training": {"seconds": 180.0, "steps": 10},
              "cost_ratio": 0.1, "theoretical_speedup_before": 1.0, "theoretical_speedup_after": 1.0,
              "draft_parameters": 10, "target_parameters": 100}
    monkeypatch.setattr(distill_module, "distill", lambda *args, **kwargs: report)
    with pytest.raises(SystemExit) as exited:
        main(["distill", "--target", str(tmp_path), "-o", str(tmp_path / "draft")])
    out, err = capsys.readouterr()
    assert exited.value.code == (0 if replaced is None else 1) and says in out + err, (out, err)


def test_the_distill_command_trains_with_the_batch_size_given_and_the_functions_by_default(monkeypatch, tmp_path, capsys):
    """A smaller batch is the remedy for training that outgrows memory: the command had no way to ask for one."""
    assert "1 or more" in passes_option_with_the_apis_default(monkeypatch, tmp_path, capsys, "--batch-size", "2", "0")


def test_the_distill_command_takes_a_seed_as_bench_does_with_the_apis_default(monkeypatch, tmp_path, capsys):
    """distill's API takes a seed (the new draft's weights, its prompts, training's batches); the command had none.
    numpy's generators take no negative seed."""
    assert "--seed" in passes_option_with_the_apis_default(monkeypatch, tmp_path, capsys, "--seed", "7", "-1")


def test_the_distill_commands_seed_help_gives_its_range_in_the_words_of_its_refusal(tmp_path, capsys):
    """It wrote "0 to 2**64 - 2", Python's notation, where a refusal says "a whole number from 0 to 18446744073709551614"."""
    from specbuild.cli import main

    with pytest.raises(SystemExit):
        main(["distill", "--target", str(tmp_path), "-o", str(tmp_path / "draft"), "--seed", "-1"])
    refused = re.search(r"a whole number from 0 to \d+", capsys.readouterr().err)[0]
    with pytest.raises(SystemExit):
        main(["distill", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert f"Seed, {refused}, for a new draft's weights" in shown and "**" not in shown


WRONG_SETTINGS = [("objective", "kl"), ("minutes", 0), ("minutes", float("nan")), ("gamma", 0), ("gamma", MAX_GAMMA + 1),
                  ("batch_size", 0), ("lr", -1e-3), ("seed", -1),
                  # a ValueError, a ZeroDivisionError and a ValueError on "s" once α had been measured
                  ("kinds", ("bogus",)), ("kinds", ()), ("kinds", "sampled"),
                  # all the minutes' training on one set of sequences; a few steps
                  ("generation_share", 0.0), ("generation_share", 1.0),
                  # max() of an empty sequence in the first measurement (the target's own samples)
                  ("heldout_prompts", 0)]


@pytest.mark.parametrize("key, value", WRONG_SETTINGS)
def test_distill_refuses_a_wrong_setting_before_it_loads_anything(tmp_path, key, value):
    """Called from Python with objective="kl", distill measured α before training (minutes on a large target)
    and then failed with a KeyError; the other settings the command checks went unchecked. There is no target
    here: a refusal that came after loading it would be a CheckpointError."""
    with pytest.raises(TrainingError, match=f"^distill setting {key} must be ") as refused:
        distill(tmp_path / "no target", tmp_path / "draft", **{key: value})
    assert key != "objective" or ", ".join(DISTILL_OBJECTIVES) in str(refused.value)


@pytest.mark.parametrize("option, value, key, given", [
    ("--minutes", "0", "minutes", 0.0), ("--batch-size", "0", "batch_size", 0),
    ("--gamma", str(MAX_GAMMA + 1), "gamma", MAX_GAMMA + 1), ("--seed", "-1", "seed", -1)])
def test_the_distill_command_refuses_a_setting_in_the_functions_words(tmp_path, capsys, option, value, key, given):
    """One rule each (recipe.DISTILL_RULES) for the command's number options and the function's arguments: the
    command refused with click's ranges, a second check that could drift from the first. (--loss stays a
    click.Choice of recipe.DISTILL_OBJECTIVES, the list the function's rule takes too.)"""
    from specbuild.cli import main

    with pytest.raises(TrainingError) as refused:
        distill(tmp_path / "no target", tmp_path / "draft", **{key: given})
    with pytest.raises(SystemExit) as exited:
        main(["distill", "--target", str(tmp_path), "-o", str(tmp_path / "draft"), option, value])
    assert exited.value.code == 2
    assert str(refused.value).removeprefix(f"distill setting {key} ") in capsys.readouterr().err


@pytest.mark.parametrize("first, second, options", [("init", "draft_config", ["--init", "--draft-config"]),
                                                     ("prompts_file", "data", ["--prompts", "--data"])])
def test_distill_refuses_arguments_that_exclude_each_other_as_the_command_does(tmp_path, capsys, first, second, options):
    """From Python, distill started from init and ignored draft_config, and read prompts_file and ignored data, where the
    command refused them: one check (recipe.distill_conflict) for both, each naming them its own way. There is no
    target here: a refusal that came after loading it would be a CheckpointError."""
    from specbuild.cli import main

    given = {"init": tmp_path, "draft_config": {"num_hidden_layers": 1}, "prompts_file": tmp_path / "p.jsonl",
             "data": tmp_path}
    with pytest.raises(TrainingError, match=f"^give either {first} or {second}, not both$"):
        distill(tmp_path / "no target", tmp_path / "draft", **{first: given[first], second: given[second]})
    (tmp_path / "p.jsonl").write_text('{"prompt": "a"}\n')
    values = {"--init": str(tmp_path), "--draft-config": "num_hidden_layers=1", "--prompts": str(tmp_path / "p.jsonl"),
              "--data": str(tmp_path)}
    with pytest.raises(SystemExit) as exited:
        main(["distill", "--target", str(tmp_path), "-o", str(tmp_path / "draft"),
              *[part for option in options for part in (option, values[option])]])
    assert exited.value.code == 2 and f"give either {options[0]} or {options[1]}, not both" in capsys.readouterr().err


@pytest.mark.parametrize("lines, refused", [('{"prompt": "x"}\n', "has one prompt"),
                                             ("x\n", 'is not a JSON object with a "prompt" field')])
def test_distill_refuses_a_prompts_file_it_cannot_use_before_it_loads_the_target(tmp_path, lines, refused):
    """A prompts file of one prompt, or not JSONL, was refused once the target had loaded and a new draft had been
    initialised (minutes on a large target). There is no target here: a refusal that came after loading it would be
    a CheckpointError."""
    (tmp_path / "p.jsonl").write_text(lines)
    with pytest.raises(SpecbuildError, match=refused):
        distill(tmp_path / "no target", tmp_path / "draft", prompts_file=tmp_path / "p.jsonl")


@pytest.mark.parametrize("files, refused", [([], "no config.json"), (["config.json"], r"no \*\.safetensors weights")])
def test_distill_refuses_an_init_that_is_no_checkpoint_before_it_loads_the_target(tmp_path, files, refused):
    """An --init without config.json or safetensors was refused once the target had loaded (minutes on a large
    one). There is no target here: a refusal that came after loading it would name the target."""
    (tmp_path / "init").mkdir()
    for name in files:
        (tmp_path / "init" / name).write_text("{}")
    with pytest.raises(CheckpointError, match=f"^draft checkpoint {tmp_path / 'init'} .*{refused}"):
        distill(tmp_path / "no target", tmp_path / "draft", init=tmp_path / "init")


def test_distill_refuses_an_init_whose_config_json_is_unreadable_before_it_loads_the_target(pair, tmp_path):
    """The target's config.json was read before its weights load, the --init's only once they had (minutes on a large
    target). There is no target here: a refusal that came after loading it would name the target."""
    init = tmp_path / "init"
    shutil.copytree(pair[1], init)
    (init / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=f"^{init / 'config.json'} is not valid JSON"):
        distill(tmp_path / "no target", tmp_path / "draft", init=init)


def test_distill_refuses_a_draft_with_another_tokenizer(pair, tmp_path):
    other = make_checkpoint(tmp_path / "other", "llama", make_tokenizer(vocab_size=300), **SMALLER)
    with pytest.raises(CheckpointError, match="different tokenizer"):
        distill(pair[0], tmp_path / "draft", init=other, minutes=0.01)


def test_distill_starts_from_a_draft_saved_without_tokenizer_files(pair, tmp_path):
    """A pruned or layer-sliced draft saved with save_pretrained of the model alone speaks the target's tokenizer,
    as compile takes it; distill refused it ('has no usable tokenizer')."""
    init = tmp_path / "init"
    shutil.copytree(pair[1], init)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (init / name).unlink(missing_ok=True)
    report = distill(pair[0], tmp_path / "out", init=init, minutes=0.01, heldout_prompts=2, force=True)
    assert report["written"] and (tmp_path / "out" / "tokenizer.json").is_file()


def test_distill_refuses_a_draft_without_tokenizer_files_of_another_vocabulary(tmp_path, tokenizer):
    target = make_checkpoint(tmp_path / "target", "llama", tokenizer)
    init = make_checkpoint(tmp_path / "init", "llama", make_tokenizer(vocab_size=300), **SMALLER)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (init / name).unlink(missing_ok=True)
    with pytest.raises(PairMismatchError, match="has no tokenizer files.* its 300 embedding rows do not fit"):
        distill(target, tmp_path / "draft", init=init, minutes=0.01)
    assert not (tmp_path / "draft").exists()


def test_distill_starts_from_a_base_draft_of_an_instruct_target_with_another_eos(tmp_path):
    """Qwen2.5-7B-Instruct's tokenizer ends at <|im_end|>, Qwen2.5-0.5B's at <|endoftext|>, over the same
    vocabulary: compile accepts the pair (the draft's eos is never read), and distill --init refused it."""
    import transformers as tf

    tokenizer = make_tokenizer()
    folders = {}
    for role, seed, shape in (("target", 0, {}), ("draft", 1, SMALLER)):
        folders[role] = make_checkpoint(tmp_path / role, "llama", tokenizer, seed, vocab_size=len(tokenizer) + 1, **shape)
        own = tf.AutoTokenizer.from_pretrained(folders[role])
        own.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})
        if role == "target":
            own.eos_token = "<|im_end|>"
        own.save_pretrained(folders[role])
    report = distill(folders["target"], tmp_path / "out", init=folders["draft"], minutes=0.01, heldout_prompts=2, force=True)
    assert report["written"]


def test_distill_never_unpickles_a_checkpoint(pair, tmp_path):
    marker = tmp_path / MARKER
    pickled = tmp_path / "pickled"
    shutil.copytree(pair[0], pickled)
    plant_pickle(pickled)
    report = distill(pickled, tmp_path / "draft", init=pair[0], minutes=0.01, heldout_prompts=2)
    assert report["alpha_before"] == 1.0  # it read the safetensors beside the pickle
    (pickled / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        distill(pickled, tmp_path / "draft", minutes=0.01)
    assert not marker.exists()


@pytest.mark.parametrize("overrides, message", [
    ({"num_hidden_layers": "abc"}, "must be of type int"), ({"hiden_size": 64}, "has no such key"),
    ({"hidden_size": 63}, "multiple of 16"), ({"num_hidden_layers": 1.5}, "must be of type int"),
    ({"num_hidden_layers": 0}, "must be 1 or more"), ({"num_attention_heads": 0}, "must be 1 or more"),
    ({"intermediate_size": 0}, "must be 1 or more"), ({"num_key_value_heads": 3}, "no multiple of num_key_value_heads"),
    ({"vocab_size": 100}, "embedding rows"), ({"max_position_embeddings": 16}, "max_position_embeddings 16"),
    ({"architectures": ["GPTNeoXForCausalLM"]}, "which specbuild does not compile"),
    ({"model_type": "gpt2"}, "a new draft is of the target's model_type"),
])
def test_draft_config_values_that_make_no_compilable_draft_are_refused_before_training(pair, tmp_path, monkeypatch,
                                                                                        overrides, message):
    monkeypatch.setattr(distill_module, "train_model", lambda *a, **k: pytest.fail("refused only after training"))
    with pytest.raises((TrainingError, UnsupportedModelError), match=message):
        distill(pair[0], tmp_path / "draft", draft_config=overrides, minutes=0.01)


@pytest.mark.parametrize("overrides, message", [
    ({"hiden_size": 64}, "^--draft-config hiden_size: the target's config.json has no such key"),
    ({"num_hidden_layers": "abc"}, "^--draft-config num_hidden_layers=abc: must be of type int"),
])
def test_a_draft_config_key_or_value_the_target_cannot_take_is_refused_before_the_target_loads(pair, tmp_path,
                                                                                              monkeypatch, overrides,
                                                                                              message):
    """Only config.json decides them, but they were refused after the target's weights had loaded (minutes on a
    large target)."""
    monkeypatch.setattr(distill_module, "load_model", lambda *a, **k: pytest.fail("refused only after loading"))
    with pytest.raises(TrainingError, match=message):
        distill(pair[0], tmp_path / "draft", draft_config=overrides, minutes=0.01)


def test_a_new_draft_of_a_bf16_target_is_initialised_and_trained_in_fp32(pair, tmp_path):
    """The new draft's config is read from config.json, which names most targets' dtype as bf16: transformers then
    built the draft in bf16, where distill holds and trains both models in fp32."""
    from specbuild.compile.load import load_config
    from specbuild.train.distill import new_draft

    target_dir = tmp_path / "target"
    shutil.copytree(pair[0], target_dir)
    config = json.loads((target_dir / "config.json").read_text())
    (target_dir / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    target, tokenizer = load_model(target_dir, "target")
    draft = new_draft(target, tokenizer, shrunk_config(load_config(target_dir, "target"), SMALLER), SMALLER, seed=0)
    assert {p.dtype for p in draft.parameters()} == {torch.float32}


def test_draft_config_takes_a_configs_own_names_and_transformers_aliases(checkpoints):
    from transformers import AutoConfig

    gpt2 = AutoConfig.from_pretrained(checkpoints("gpt2"))
    assert shrunk_config(gpt2, {"num_hidden_layers": 1}).n_layer == shrunk_config(gpt2, {"n_layer": 1}).n_layer == 1
    with pytest.raises(TrainingError, match="its shape keys: n_embd, n_inner, n_layer, n_head"):
        shrunk_config(gpt2, {"hidden_layers": 1})


@pytest.mark.parametrize("architecture", ["qwen3", "gemma2"])
def test_draft_config_may_ask_for_a_draft_deeper_than_the_default_one(checkpoints, architecture):
    """Qwen's and Gemma's configs list every layer's attention (layer_types): cut to the default draft's depth,
    the list was too short for more layers, and distill refused such a --draft-config as no model transformers
    can build."""
    from specbuild.compile.load import load_config
    from specbuild.train.distill import new_draft

    target, tokenizer = load_model(checkpoints(architecture), "target")
    layers = target.config.num_hidden_layers
    assert shrunk_config(target.config).num_hidden_layers < layers
    deeper = {"num_hidden_layers": layers}
    draft = new_draft(target, tokenizer, shrunk_config(load_config(checkpoints(architecture), "target"), deeper), deeper,
                      seed=0)
    assert draft.config.num_hidden_layers == layers and draft.config.layer_types == target.config.layer_types


@pytest.mark.parametrize("overrides, windows", [
    ({"max_window_layers": 0}, [8]),
    ({"num_hidden_layers": 3, "max_window_layers": 2}, [None, None, 8]),
    ({"num_hidden_layers": 4}, [None, 8, 8, 8]),  # the target's rule (from layer 1 on), not its list repeated
    ({"num_hidden_layers": 3, "use_sliding_window": False}, [None, None, None])])
def test_a_qwen2_drafts_window_keys_decide_which_of_its_layers_slide(checkpoints, overrides, windows):
    """Qwen2 and Qwen3 slide the layers from max_window_layers on; their classes make layer_types of it only when a
    config is built, and --draft-config's max_window_layers=N was set after and changed no layer."""
    from specbuild.compile.load import load_config, model_spec

    target_config = load_config(checkpoints("qwen2-window"), "target")  # 3 layers, the last two windowed
    config = shrunk_config(target_config, overrides)
    assert model_spec(config, "Qwen2ForCausalLM", Path("draft"), "draft").sliding_windows == windows


def test_a_qwen2_target_listing_layer_types_of_no_rule_gives_a_deeper_draft_its_pattern(tmp_path, tokenizer):
    """Only a list that is the class's rule is made anew of max_window_layers: a list of another pattern (sliding
    first, as no max_window_layers makes it) is repeated to the draft's depth, as Gemma's is."""
    from specbuild.compile.load import load_config, model_spec

    listed = ["sliding_attention", "full_attention", "sliding_attention"]
    target_config = load_config(make_checkpoint(tmp_path, "qwen2-window", tokenizer, layer_types=listed), "target")
    config = shrunk_config(target_config, {"num_hidden_layers": 4})
    assert model_spec(config, "Qwen2ForCausalLM", Path("draft"), "draft").sliding_windows == [8, None, 8, 8]


def test_a_window_override_reads_the_rule_anew_on_a_target_listing_layer_types_of_no_rule(tmp_path, tokenizer):
    """Where the target's list is no rule's, its pattern is repeated, unless a window key the user gives moves the
    rule's result: then the rule decides, as the draft's class reads its config.json."""
    from specbuild.compile.load import load_config, model_spec

    listed = ["sliding_attention", "full_attention", "sliding_attention"]
    target_config = load_config(make_checkpoint(tmp_path, "qwen2-window", tokenizer, layer_types=listed), "target")
    config = shrunk_config(target_config, {"num_hidden_layers": 4, "max_window_layers": 2})
    assert model_spec(config, "Qwen2ForCausalLM", Path("draft"), "draft").sliding_windows == [None, None, 8, 8]


@pytest.mark.parametrize("target, windows", [("gemma2", [8, None, 8, None]), ("gemma3", [8, None, 8, None])])
def test_a_draft_deeper_than_a_gemma_target_alternates_as_its_class_does(checkpoints, target, windows):
    """The 3-layer targets' s f s follows their class's rule (every 2nd layer full), so a 4-layer draft's list is
    the rule's, not the target's list repeated (s f s s)."""
    from specbuild.compile.load import load_config, model_spec

    config = shrunk_config(load_config(checkpoints(target), "target"), {"num_hidden_layers": 4})
    assert model_spec(config, config.architectures[0], Path("draft"), "draft").sliding_windows == windows


FULL, SLIDING = "full_attention", "sliding_attention"


@pytest.mark.parametrize("target, overrides, refusal", [
    # the target's max_window_layers (the class's 28) is the 1-layer draft's depth or more: every layer stays full
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8}, "use_sliding_window=true slides no layer of the "
     "1-layer draft; add max_window_layers=K .layers from K on slide.$"),
    ("qwen2-window", {"sliding_window": 4}, "sliding_window=4 slides no layer of the 1-layer draft; add "
     "max_window_layers=K"),
    # without use_sliding_window, Qwen's class drops the window, here the target's too
    ("qwen2", {"sliding_window": 8}, "add use_sliding_window=true and max_window_layers=K"),
    ("qwen3", {"max_window_layers": 0}, "add use_sliding_window=true and sliding_window=N"),
    ("qwen3moe", {"model_type": "qwen3_moe", "sliding_window": 8}, "add use_sliding_window=true$"),
    ("olmo3", {"num_hidden_layers": 2, "layer_types": [FULL, FULL], "sliding_window": 4},
     'sliding_window=4 slides no layer of the 2-layer draft; add layer_types listing "sliding_attention" layers'),
    ("llama", {"sliding_window": 8}, r"remove it \(no other window key of the draft's LlamaForCausalLM makes it "),
    # the rule of every draft's depth: max_window_layers=2 slides no layer of a 1-layer one, whatever else is given
    ("qwen3moe", {"max_window_layers": 2}, r"remove it \(no other window key of the draft's Qwen3ForCausalLM makes")])
def test_a_draft_window_override_that_slides_no_layer_is_refused_naming_the_keys_it_needs(checkpoints, target,
                                                                                         overrides, refusal):
    """transformers' rules (Qwen's: layer i slides where use_sliding_window and i >= max_window_layers) left these
    overrides without effect on the compiled draft, and distill trained it all the same."""
    from specbuild.compile.load import load_config

    target_config = load_config(checkpoints(target, **({"sliding_window": None} if target == "llama" else {})),
                                "target")  # a Llama config.json with a window key, which Llama's layers never read
    with pytest.raises(TrainingError, match=refusal):
        shrunk_config(target_config, overrides)


@pytest.mark.parametrize("target, overrides, windows", [
    ("gemma3", {"num_hidden_layers": 4, "sliding_window_pattern": 4}, [8, 8, 8, None]),  # every 4th full; was 2nd
    ("qwen2-window", {"use_sliding_window": False}, [None]),  # no window asked for, none had: taken
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0}, [8]),
    ("olmo3", {"num_hidden_layers": 2, "layer_types": [FULL, SLIDING], "sliding_window": 4}, [None, 4]),
    # what Gemma 2's rule gives a 4-layer draft anyway, written out: the draft's own value, not a no-op to refuse
    ("gemma2", {"num_hidden_layers": 4, "layer_types": [SLIDING, FULL] * 2, "sliding_window": 4}, [4, None, 4, None]),
    # null turns the window off where the class allows it: the type check refused it as not the target's int
    ("mistral-window", {"sliding_window": None}, [None]), ("phi3", {"sliding_window": None}, [None]),
    ("mixtral", {"sliding_window": None}, [None]),
    ("gemma2", {"num_hidden_layers": 2, "layer_types": [FULL] * 2}, [None] * 2)])  # Gemma's way to turn it off
def test_a_draft_window_override_with_the_keys_it_needs_decides_the_compiled_windows(checkpoints, target, overrides,
                                                                                      windows):
    """Gemma 3's class makes layer_types of sliding_window_pattern only when a config is built, as Qwen's does of
    max_window_layers: set after, it changed no layer."""
    from specbuild.compile.load import load_config, model_spec

    config = shrunk_config(load_config(checkpoints(target), "target"), overrides)
    config = type(config).from_dict(config.to_dict())  # as compile reads the draft's config.json
    assert model_spec(config, config.architectures[0], Path("draft"), "draft").sliding_windows == windows


@pytest.mark.parametrize("target", ["gemma2", "gemma3", "olmo3"])
def test_a_null_sliding_window_is_refused_where_the_draft_layers_need_a_window(checkpoints, target):
    """Their classes take sliding_window=None, and their models fail on it in the first forward pass (a TypeError
    or ValueError in transformers), whatever layer_types says."""
    from specbuild.compile.load import load_config

    refusal = (r"^--draft-config sliding_window=null: the draft's \w+ layers need a window; to turn it off, list "
               "full_attention layers alone in layer_types")
    for overrides in ({"sliding_window": None}, {"sliding_window": None, "layer_types": [FULL]}):  # depth 1
        with pytest.raises(TrainingError, match=refusal):
            shrunk_config(load_config(checkpoints(target), "target"), overrides)


def test_a_draft_layer_types_of_another_depth_is_refused_in_one_line(checkpoints):
    """transformers' strict config class checks the list's length against num_hidden_layers only when a config is
    built: the window check built one and its traceback escaped as a bug in specbuild."""
    from specbuild.compile.load import load_config

    with pytest.raises(TrainingError, match=r"^--draft-config: `num_hidden_layers` \(1\) must be equal to the number "
                                            r"of `layer_types` \(2\)$"):
        shrunk_config(load_config(checkpoints("gemma2"), "target"), {"layer_types": [FULL, FULL]})


def test_a_default_draft_of_a_longrope_target_takes_its_factors_at_its_own_heads_width(tmp_path, tokenizer):
    """Phi-3.5 and Phi-4-mini list a LongRoPE factor for each rotary pair of their heads; a default draft's heads
    are narrower, and sizing it failed in transformers (a RuntimeError, reported as a bug in specbuild)."""
    from specbuild.compile.load import load_config
    from specbuild.train.distill import new_draft

    factors = dict(short_factor=[1.0 + 0.01 * i for i in range(32)], long_factor=[2.0 + 0.05 * i for i in range(32)])
    folder = make_checkpoint(tmp_path / "phi3", "phi3", tokenizer, hidden_size=256, intermediate_size=512,
                             rope_scaling=dict(rope_type="longrope", **factors))  # heads of 128, half rotary: 32 pairs
    target, target_tokenizer = load_model(folder, "target")
    draft = new_draft(target, target_tokenizer, shrunk_config(load_config(folder, "target")), None, seed=0)
    rope = draft.config.rope_parameters
    assert len(rope["short_factor"]) == len(rope["long_factor"]) < 32
    assert set(rope["short_factor"]) <= set(factors["short_factor"]) and rope["long_factor"][0] == factors["long_factor"][0]
    assert draft(input_ids=torch.tensor([[1, 2, 3]])).logits.isfinite().all()


def test_a_draft_config_as_wide_as_a_longrope_target_takes_the_targets_own_factors(tmp_path, tokenizer):
    """--draft-config's heads were fitted from the default draft's lists, already thinned to its narrower heads: a
    draft as wide as the target got each of its factors repeated, not the target's own."""
    factors = dict(short_factor=[1.0 + 0.01 * i for i in range(32)], long_factor=[2.0 + 0.05 * i for i in range(32)])
    folder = make_checkpoint(tmp_path / "phi3", "phi3", tokenizer, hidden_size=256, intermediate_size=512,
                             rope_scaling=dict(rope_type="longrope", **factors))  # heads of 128, half rotary: 32 pairs
    target, _ = load_model(folder, "target")
    assert len(shrunk_config(target.config).rope_parameters["short_factor"]) < 32
    rope = shrunk_config(target.config, {"hidden_size": 256, "num_attention_heads": 2}).rope_parameters
    assert rope["short_factor"] == factors["short_factor"] and rope["long_factor"] == factors["long_factor"]


def test_longrope_factors_are_fitted_where_transformers_4_keeps_them():
    """transformers 4.56 and 4.57 (which the project supports) keep LongRoPE's factors in rope_scaling, with "type":
    fitted in rope_parameters alone, a Phi-3.5 target's default draft still failed there (a RuntimeError)."""
    from types import SimpleNamespace

    from specbuild.train.distill import _fit_rope_factors

    factors = dict(short_factor=[1.0 + 0.01 * i for i in range(32)], long_factor=[2.0 + 0.05 * i for i in range(32)])
    config = SimpleNamespace(hidden_size=64, num_attention_heads=2, partial_rotary_factor=0.5,  # 8 rotary pairs
                             rope_scaling=dict(type="longrope", **factors))
    _fit_rope_factors(config)
    assert config.rope_scaling["short_factor"] == factors["short_factor"][::4]
    assert config.rope_scaling["long_factor"] == factors["long_factor"][::4] and config.rope_scaling["type"] == "longrope"


RELEASED_SHAPES = Path(__file__).parents[1] / "benchmarks/configs"  # released checkpoints' config.json, transcribed


@pytest.mark.parametrize("shape", sorted(path.name for path in RELEASED_SHAPES.glob("*.json")))
def test_the_default_draft_of_every_released_shape_builds_and_runs_a_forward_pass(shape):
    """Widths that were multiples of 32 alone split into heads of an odd width (672 in 10 heads of 67), which rotary
    embeddings cannot pair: OLMo 3 7B's YaRN table failed while the candidates were sized, and compile refused Llama
    3.2 1B's and Qwen2.5 7B's default drafts (heads of 67 and 65); distill made none of the three. The meta device
    checks every shape without allocating a weight."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from specbuild.compile.load import model_spec

    config = shrunk_config(AutoConfig.for_model(**json.loads((RELEASED_SHAPES / shape).read_text())))
    model_spec(config, config.architectures[0], Path(shape), "draft")  # as compile checks a draft (its head width, ...)
    with torch.device("meta"):
        logits = AutoModelForCausalLM.from_config(config)(input_ids=torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, config.vocab_size)


def test_a_window_override_beside_heads_of_another_width_builds_a_longrope_draft():
    """The window check builds the draft through its class, which refuses LongRoPE factors of other heads: they were
    fitted only after it, and Phi-4-mini with 8 heads and a sliding_window failed in transformers' traceback."""
    from transformers import AutoConfig

    from specbuild.compile.load import model_spec

    target_config = AutoConfig.for_model(**json.loads((RELEASED_SHAPES / "phi-4-mini.json").read_text()))
    config = shrunk_config(target_config, {"num_attention_heads": 8, "num_key_value_heads": 8, "sliding_window": 4096})
    windows = model_spec(config, "Phi3ForCausalLM", Path("draft"), "draft").sliding_windows
    assert windows == [4096] * config.num_hidden_layers


def test_a_target_with_fewer_embedding_rows_than_its_tokenizer_is_refused_as_compile_refuses_it(pair, tmp_path,
                                                                                                    monkeypatch):
    """distill said the draft lacked rows and to give it more: a draft given them trained for its minutes beside a
    target that compile then refused."""
    import transformers as tf

    monkeypatch.setattr(distill_module, "train_model", lambda *a, **k: pytest.fail("refused only after training"))
    target = tmp_path / "target"
    shutil.copytree(pair[0], target)
    tokenizer = tf.AutoTokenizer.from_pretrained(target)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})
    tokenizer.save_pretrained(target)
    for draft_config in (None, {"vocab_size": len(tokenizer)}):
        with pytest.raises(CheckpointError, match=r"target checkpoint .* has \d+ embedding rows but its tokenizer has ids up "
                                                  r"to \d+; the checkpoint and its tokenizer do not belong together"):
            distill(target, tmp_path / "draft", draft_config=draft_config, minutes=0.01)


def test_distill_refuses_a_target_specbuild_cannot_compile_before_training(pair, tmp_path, monkeypatch):
    monkeypatch.setattr(distill_module, "train_model", lambda *a, **k: pytest.fail("refused only after training"))
    target = tmp_path / "target"
    shutil.copytree(pair[0], target)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForSequenceClassification"]}))
    with pytest.raises(UnsupportedModelError, match="which specbuild does not compile"):
        distill(target, tmp_path / "draft", minutes=0.01)


def test_a_disk_without_room_for_the_draft_is_refused_before_training(pair, tmp_path, monkeypatch):
    """distill trained for its minutes, then found the disk full when it wrote the draft."""
    monkeypatch.setattr(distill_module, "train_model", lambda *a, **k: pytest.fail("refused only after training"))
    disk_usage = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: disk_usage(path)._replace(free=1000))
    with pytest.raises(OutputError, match=r"the draft's weights take [\d.]+ MB and the disk of .* has 0\.0 MB free"):
        distill(pair[0], tmp_path / "draft", draft_config=SMALLER, minutes=0.01)
    assert [p.name for p in tmp_path.iterdir()] == []


def test_distill_says_a_target_or_init_that_does_not_exist_is_no_folder_as_compile_does(tmp_path, pair):
    """It said "is not a Hugging Face folder (no config.json)" of a path that names nothing (a typo)."""
    with pytest.raises(CheckpointError, match=r"target checkpoint \S*missing is not a folder; pass a Hugging Face"):
        distill(tmp_path / "missing", tmp_path / "draft", minutes=0.01)
    with pytest.raises(CheckpointError, match=r"draft checkpoint \S*missing is not a folder; pass a Hugging Face"):
        distill(pair[0], tmp_path / "draft", init=tmp_path / "missing", minutes=0.01)


def test_distill_reads_the_targets_config_json_once(pair, tmp_path, cli):
    """Stages took the target's path and read its config.json again: seven times in a run (the draft's config, the
    memory check, the model's and the tokenizer's loads); it is read once and passed on."""
    ran, = cli.run([["distill", "--target", str(pair[0]), "--output", str(tmp_path / "draft"), "--minutes", "0.01",
                     "--force"]], watch=pair[0])
    assert ran["status"] == 0, ran["stderr"]
    assert ran["opened"].count(str(pair[0] / "config.json")) == 1, ran["opened"]


def test_distill_overwrite_replaces_a_model_folder_not_any_folder_with_a_config_json(pair, tmp_path, monkeypatch):
    monkeypatch.setattr(distill_module, "train_model", lambda *a, **k: pytest.fail("refused only after training"))
    project = tmp_path / "project"  # an app of the user's: its own config.json
    (project / "src").mkdir(parents=True)
    (project / "config.json").write_text('{"port": 8080}')
    (project / "src" / "app.py").write_text("print(1)")
    with pytest.raises(OutputError, match="is not a checkpoint"):
        distill(pair[0], project, minutes=0.01, force=True, overwrite=True)
    assert (project / "src" / "app.py").read_text() == "print(1)"


def test_the_demo_recipe_holds_every_setting_of_the_pair():
    recipe = read_pair_recipe(DEMO_RECIPE)
    assert recipe.target["hidden_size"] > recipe.draft["hidden_size"]


def test_a_pair_recipe_missing_a_setting_is_refused(tmp_path):
    text = DEMO_RECIPE.read_text()
    (tmp_path / "recipe.toml").write_text("\n".join(line for line in text.splitlines() if not line.startswith("seq_len")))
    with pytest.raises(TrainingError, match="lacks seq_len"):
        read_pair_recipe(tmp_path / "recipe.toml")


@pytest.mark.parametrize("line, value, message", [
    ("vocab_size", '"4096"', "vocab_size must be a whole number"), ("target_minutes", "-1", "positive number"),
    ("seq_len", "0", "seq_len must be a whole number, 2 or more"), ("skip_dirs", '"encodings"', "list of folder names"),
    ("hidden_size = 128", "0", "draft hidden_size must be a whole number"),
])
def test_a_pair_recipe_value_of_the_wrong_kind_is_refused_before_training(line, value, message, tmp_path):
    key = line.split()[0]
    lines = [f"{key} = {value}" if (text.startswith(line) if " = " in line else text.startswith(key + " ")) else text
             for text in DEMO_RECIPE.read_text().splitlines()]
    (tmp_path / "recipe.toml").write_text("\n".join(lines))
    with pytest.raises(TrainingError, match=message):
        read_pair_recipe(tmp_path / "recipe.toml")


def test_training_steps_run_the_way_that_was_timed_fastest():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    tuner = StepTuner()
    torch.set_num_threads(threads)
    seconds = {(1, False): 1.0, (2, False): 2.0, (1, True): 0.5, (2, True): 0.8}
    for _ in range(4 * StepTuner.TRIES):
        way = tuner.next()
        tuner.record(way, seconds[way])
    assert tuner.next() == (1, True) and tuner.next() == (1, True)  # and it holds until the next round
    tuner.until = 0.0  # the hold ends: the next round times the thread counts only, in bf16
    tried = []
    for _ in range(2 * StepTuner.TRIES):
        tried.append(tuner.next())
        tuner.record(tried[-1], {1: 0.9, 2: 0.3}[tried[-1][0]])  # the machine got quieter
    assert set(tried) == {(1, True), (2, True)}
    assert tuner.next() == (2, True)


def test_the_demo_corpus_keeps_code_and_drops_comments_and_docstrings():
    source = 'x = 1  # one\n"""Doc."""\n\ndef f(a):\n    """Multi\n    line."""\n    # only\n    return "s"  # tail\n\n\nf("kept")\n'
    assert code_only(source) == 'x = 1\n\ndef f(a):\n    return "s"\n\n\nf("kept")\n'
    assert code_only("def broken(:\n    '''never closed\n") == "def broken(:\n    '''never closed\n"


def test_an_init_draft_that_would_shorten_the_pairs_context_is_refused_before_training(pair, tmp_path, monkeypatch):
    monkeypatch.setattr(distill_module, "train_model", lambda *a, **k: pytest.fail("refused only after training"))
    short = make_checkpoint(tmp_path / "short", "llama", make_tokenizer(), max_position_embeddings=16, **SMALLER)
    with pytest.raises(TrainingError, match="max_position_embeddings 16"):
        distill(pair[0], tmp_path / "draft", init=short, minutes=0.01)


def test_an_init_draft_larger_than_the_target_is_refused_before_training(pair, tmp_path, monkeypatch):
    """compile refuses such a pair (load.check_draft_smaller): the two were likely swapped. The advice names distill's
    options (it has no --draft)."""
    monkeypatch.setattr(distill_module, "train_model", lambda *a, **k: pytest.fail("refused only after training"))
    larger = make_checkpoint(tmp_path / "larger", "llama", make_tokenizer(), hidden_size=128, intermediate_size=256)
    with pytest.raises(PairMismatchError, match="more than the target.*a smaller one as --init$"):
        distill(pair[0], tmp_path / "draft", init=larger, minutes=0.01)
    with pytest.raises(PairMismatchError, match="more than the target.*smaller --draft-config values$"):
        distill(pair[0], tmp_path / "draft", draft_config={"hidden_size": 128, "intermediate_size": 256}, minutes=0.01)


def test_a_large_text_file_is_read_only_as_far_as_prompts_need(tmp_path, monkeypatch):
    """Read whole, a 28 MB --data file took 6 GB to tokenize."""
    from specbuild.train import prompts as prompts_module

    monkeypatch.setattr(prompts_module, "MAX_TEXT_CHARS", 1000)
    (tmp_path / "big.txt").write_text("int x;\n" * 10_000)
    assert [len(text) for text in read_texts(tmp_path / "big.txt")] == [1000]


def test_alpha_ignores_the_decoding_processors_a_targets_generation_config_asks_for(pair, tmp_path):
    """The runtime decodes the target's plain greedy choices; references made with the checkpoint's
    repetition_penalty and no_repeat_ngram_size gave the target, as its own draft, α 0.65."""
    target = tmp_path / "penalized"
    shutil.copytree(pair[0], target)
    config = json.loads((target / "generation_config.json").read_text())
    (target / "generation_config.json").write_text(json.dumps({**config, "repetition_penalty": 1.3, "no_repeat_ngram_size": 3}))
    report = distill(target, tmp_path / "draft", init=pair[0], minutes=0.01, heldout_prompts=4)
    assert report["alpha_before"] == 1.0


def short_gpt2(tmp_path, tokenizer, positions: int = 128):
    """A GPT-2 target of few positions (its table ends there) and a prompts file of prompts longer than that."""
    from transformers import GPT2Config, GPT2LMHeadModel

    target = tmp_path / "short"
    eos = tokenizer.eos_token_id
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=positions, vocab_size=len(tokenizer),
                               bos_token_id=eos, eos_token_id=eos)).save_pretrained(target, safe_serialization=True)
    tokenizer.save_pretrained(target)
    long = " ".join(f"w{i}" for i in range(400))
    (tmp_path / "long.jsonl").write_text("".join(json.dumps({"prompt": f"{long} end{n}"}) + "\n" for n in range(4)))
    return target, tmp_path / "long.jsonl"


def test_prompts_are_cut_to_what_the_targets_positions_hold_with_their_continuation(tmp_path, tokenizer):
    """GPT-2's position table ends at n_positions: a long prompt plus the continuation ran past it (an
    IndexError, reported as a bug in specbuild)."""
    target, prompts = short_gpt2(tmp_path, tokenizer)
    report = distill(target, tmp_path / "draft", prompts_file=prompts, minutes=0.01, force=True)
    assert report["heldout_drafted_tokens"] > 0


def test_every_kind_of_sequence_fits_the_targets_positions(tmp_path, tokenizer):
    """A greedy or draft sequence continues a prefix of a sampled one, which may already fill the positions: it
    ran NEW_TOKENS past GPT-2's table (an IndexError, reported as a bug in specbuild) in the second set made."""
    from specbuild.compile.load import load_config
    from specbuild.train.distill import DistillData, choose_prompts, new_draft

    folder, prompts_file = short_gpt2(tmp_path, tokenizer)
    target, target_tokenizer = load_model(folder, "target")
    prompts = choose_prompts(target, target_tokenizer, read_prompt_file(prompts_file), None, 1, 0)
    draft = new_draft(target, target_tokenizer, shrunk_config(load_config(folder, "target")), None, 0)
    made = DistillData(target, draft, prompts.train, len(target_tokenizer), kinds=("sampled", "greedy", "draft"),
                       share=1.0, batch_size=1)
    rng = np.random.default_rng(0)
    made.sampled = made.make("sampled", rng)  # as the first set leaves them
    for kind in ("greedy", "draft"):
        assert max(len(s.tokens) for s in made.make(kind, rng)) <= 128


def test_a_target_without_an_eos_token_is_distilled_as_compile_takes_it(pair, tmp_path):
    """compile accepts a target whose config names no eos (it decodes to max_new_tokens); distill padded
    its batches with min() of no eos ids (a ValueError, reported as a bug in specbuild)."""
    target = tmp_path / "no-eos"
    shutil.copytree(pair[0], target)
    (target / "generation_config.json").unlink()
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k not in ("eos_token_id", "pad_token_id")}))
    report = distill(target, tmp_path / "draft", init=pair[1], minutes=0.01, heldout_prompts=2, force=True)
    assert report["heldout_drafted_tokens"] > 0 and (tmp_path / "draft" / "config.json").is_file()


def test_a_target_whose_tokenizer_has_neither_bos_nor_eos_is_distilled_on_prompts_given(pair, tmp_path, monkeypatch):
    """compile takes such a target; distill's default source, the target's own samples, began them from a None
    token (a RuntimeError, reported as a bug in specbuild) instead of asking for --prompts or --data."""
    target = tmp_path / "no-specials"
    shutil.copytree(pair[0], target)
    config = json.loads((target / "tokenizer_config.json").read_text())
    (target / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if not k.endswith("_token")}))
    assert start_token(load_model(target, "target")[1]) is None
    monkeypatch.setattr(distill_module, "train_model", lambda *a, **k: pytest.fail("refused only after training"))
    with pytest.raises(TrainingError, match="no bos or eos token .* give --prompts or --data"):
        distill(target, tmp_path / "draft", minutes=0.01)
    assert not (tmp_path / "draft").exists()


def made_after(monkeypatch, trainings, cost: dict[str, float], share: float) -> tuple[dict, float]:
    """DistillData's sets on a clock of its own, a set of each kind taking cost[kind] seconds, with `trainings`
    seconds of training before each batch and a budget of 100 s: (sets made by kind, seconds at the end)."""
    from types import SimpleNamespace

    from specbuild.train import distill as module

    now = [1000.0]  # not 0: the clock's start is kept as `started or now`
    monkeypatch.setattr(module.time, "monotonic", lambda: now[0])
    made = module.DistillData(None, None, [[1]], 8, kinds=tuple(cost), share=share, batch_size=1, seconds=100)

    def make(kind, rng):
        now[0] += cost[kind]
        return [SimpleNamespace(top_ids=[1])]

    monkeypatch.setattr(made, "make", make)
    rng = np.random.default_rng(0)
    for training in trainings:
        now[0] += training
        made.next_batch(rng)
    return dict(made.made), now[0] - 1000


def test_a_set_of_sequences_that_would_end_past_the_budget_is_not_begun(monkeypatch):
    """On a large target one set of sequences takes minutes: started just before the budget ends, the run
    overshot --minutes by as much. The first set is always made (training needs data)."""
    made, end = made_after(monkeypatch, (0, 15, 50, 1), {"greedy": 10}, share=0.5)
    # sets at 0, 25 and 85 s; at 96 s one would end at 106, past the budget of 100
    assert made == {"greedy": 3} and end == 96


def test_a_set_is_judged_by_the_last_set_of_its_own_kind(monkeypatch):
    """Greedy sets took 7x the sampled ones: judged by the sampled set before it, a greedy one began 13 s before the
    budget's end and overran it by 15 s."""
    made, end = made_after(monkeypatch, (0, 1, 55, 1), {"sampled": 1, "greedy": 28}, share=0.9)
    # sampled at 0 s (1 s), greedy at 2 (28 s), sampled at 85; at 87 a greedy set would end at 115
    assert made == {"sampled": 2, "greedy": 1} and end == 87


def test_a_second_distill_to_an_output_being_trained_for_is_refused_at_once(pair, tmp_path, monkeypatch):
    """The first holds the output's lock while it trains (here: the lock held as its run holds it); the second
    is refused before loading anything, not after its minutes, and the first's output is not replaced."""
    from specbuild.staging import _locked

    monkeypatch.setattr(distill_module, "train_model", lambda *a, **k: pytest.fail("trained beside another distill"))
    output = tmp_path / "draft"
    with _locked(output.resolve()):
        with pytest.raises(OutputError, match=r"another process \(pid \d+\) is writing"):
            distill(pair[0], output, minutes=0.01, overwrite=True)
    assert not output.exists()


def test_teacher_data_holds_top_k_per_step_not_every_steps_logits():
    """continue_prompts kept generate()'s logits of every step ([B, V] each) and a stacked copy: 1.7 GB for 64
    rows x 64 steps of a 32k vocabulary (a 128k one, Llama 3's, four times that) where the top-k is 0.5 MB.
    Run apart, so that the process's peak is this call's."""
    import subprocess
    import sys

    code = """
import resource, torch
from transformers import LlamaConfig, LlamaForCausalLM
from specbuild.train.generate import continue_prompts
torch.manual_seed(0)
V = 32000
model = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=4, eos_token_id=0)).eval()
prompts = [[int(t) for t in torch.randint(1, V, (16,))] for _ in range(64)]
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
sequences = continue_prompts(model, prompts, 64, V, sample=True)
assert sequences[0].top_ids.shape[1] == 32
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert int(run.stdout.split()[-1]) < 1200  # MiB: 1724 before, 795 since (generate's own work)


def teacher_batch(vocab: int) -> list[Sequence]:
    """Sequences as distill trains on: contexts and continuations of different lengths (one ended early by
    eos), so rows are padded on the right, and a made-up top-8 teacher distribution at every known token."""
    rng = np.random.default_rng(0)
    batch = []
    for context, continuation in ((5, 9), (17, 3), (11, 12), (2, 7)):
        tokens = rng.integers(1, vocab, context + continuation).astype(np.int32)
        top_ids = np.stack([rng.choice(vocab, 8, replace=False) for _ in range(continuation - 1)]).astype(np.int32)
        top_logprobs = np.log(rng.dirichlet(np.ones(9), continuation - 1)[:, :8]).astype(np.float32)
        batch.append(Sequence(tokens, context - 1, top_ids, top_logprobs))
    return batch


def loss_at_every_position(draft, batch: list[Sequence], vocab: int, objective: str) -> torch.Tensor:
    """distill's loss as it was: the head over every position of every row, the known ones picked after."""
    logits = draft(input_ids=right_padded([s.tokens[:-1] for s in batch], 0)).logits
    rows = torch.cat([torch.full((len(s.top_ids),), row) for row, s in enumerate(batch)])
    positions = torch.cat([torch.arange(s.first, s.first + len(s.top_ids)) for s in batch])
    student = torch.nn.functional.log_softmax(logits[rows, positions, :vocab].float(), -1)
    top_ids = torch.from_numpy(np.concatenate([s.top_ids for s in batch])).long()
    top_logprobs = torch.from_numpy(np.concatenate([s.top_logprobs for s in batch]))
    return divergence.DIVERGENCES[objective](*divergence.buckets(student, top_ids, top_logprobs)).mean()


@pytest.mark.parametrize("masked", [True, False], ids=["logits_to_keep", "older-transformers"])
@pytest.mark.parametrize("architecture", ["llama", "llama3", "gemma2", "gemma3", "phi3", "gpt2"])
def test_the_loss_and_its_gradients_are_those_of_the_head_at_every_position(checkpoints, architecture, masked,
                                                                             monkeypatch):
    """The head runs only where the teacher's distribution is known, through each family's own forward (a
    tied table, Gemma 2's final softcapping, GPT-2's head and dropout); transformers before 5.21 take no mask
    and pick the positions after a full head."""
    monkeypatch.setattr(generate, "_masked_logits", lambda: masked)
    draft, _ = load_model(checkpoints(architecture), "draft")
    draft.train()
    vocab = draft.config.vocab_size - 16  # a padded table's rows past the tokenizer are left out
    batch = teacher_batch(vocab)
    for objective in ("tvd", "fkl"):
        results = []
        for loss_fn in (divergence.distill_loss(objective, vocab, pad=0),
                        lambda model, batch: loss_at_every_position(model, batch, vocab, objective)):
            torch.manual_seed(0)  # the same dropout masks
            loss = loss_fn(draft, batch)
            results.append([loss, *torch.autograd.grad(loss, list(draft.parameters()))])
        for new, old in zip(*results):
            torch.testing.assert_close(new, old, rtol=1e-5, atol=1e-7)


def test_distill_offers_exactly_the_divergences_training_computes():
    """The names live in recipe.py, where distill's --help reads them without importing torch; the table that
    computes them lives here. A name in one and not the other is a --loss that crashes training or a
    divergence no one can choose."""
    assert set(divergence.DIVERGENCES) == set(DISTILL_OBJECTIVES)


def test_the_drafts_head_runs_only_at_the_positions_the_loss_reads(checkpoints):
    """Not at prompts or padding: those rows of a [B, T, V] head were held with their gradient (1.5 GB
    for 16 rows of 160 tokens of a 152k vocabulary, of which the loss read 64 a row)."""
    draft, _ = load_model(checkpoints("llama"), "draft")
    vocab = draft.config.vocab_size
    batch = teacher_batch(vocab)
    rows = []
    draft.get_output_embeddings().register_forward_hook(lambda module, args, out: rows.append(out.shape[:-1].numel()))
    divergence.distill_loss("tvd", vocab, pad=0)(draft, batch)
    assert rows == [sum(len(s.top_ids) for s in batch)]


def test_alpha_and_scoring_run_the_head_only_where_the_continuations_are_read(models):
    """Not at the prompts: at 16 held-out prompts of 256 tokens and a 152k vocabulary α's head took 3.0 GiB,
    and scoring 64 on-policy rows of 160 tokens would take 5.8 GiB."""
    target, draft, tokenizer = models
    references = target_references(target, [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14]], len(tokenizer), new_tokens=8)
    continuations = sum(len(s.tokens) - 1 - s.first for s in references)
    for model, run in ((draft, lambda: acceptance(draft, references, 4, len(tokenizer), set())),
                       (target, lambda: score(target, references, len(tokenizer)))):
        rows = []
        hook = model.get_output_embeddings().register_forward_hook(lambda module, args, out: rows.append(out.shape[:-1].numel()))
        try:
            run()
        finally:
            hook.remove()
        assert rows == [continuations]


def test_a_checkpoint_whose_weights_alone_outgrow_the_machines_memory_is_refused_before_loading(pair, tmp_path,
                                                                                               monkeypatch):
    """In one line, not by the kernel killing distill some minutes into the load; the output stays as it was."""
    target = tmp_path / "target"
    shutil.copytree(pair[0], target)
    config = json.loads((target / "config.json").read_text())
    config.update(hidden_size=65536, intermediate_size=262144, num_hidden_layers=64)  # 4.4T parameters: 16 TiB
    (target / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(distill_module, "load_reference", lambda *a, **k: pytest.fail("loaded a model beyond memory"))
    with pytest.raises(TrainingError, match=r"target checkpoint .* takes [\d.]+ GiB as distill holds it \(fp32\), but this "
                                            r"(machine has|container may use) [\d.]+ GiB; run distill on a machine"):
        distill(target, tmp_path / "draft", minutes=0.01)
    assert not (tmp_path / "draft").exists()


class _Stepped(Exception):
    """Ends train_model after its first step: next_batch raises it when asked for a second batch."""


def one_step(model, batch, **settings) -> None:
    """train_model's first step on batch (the model's gradients are that step's)."""
    from specbuild.train.train import train_model

    batches = [(batch, sum(len(s.top_ids) for s in batch))]

    def next_batch(rng):
        if not batches:
            raise _Stepped
        return batches.pop()

    with pytest.raises(_Stepped):
        train_model(model, next_batch, minutes=60, **settings)


@pytest.mark.parametrize("architecture", ["llama", "gemma2"])
def test_a_batch_trained_in_parts_gets_the_gradients_of_the_whole_batch(checkpoints, architecture, monkeypatch):
    """Split as a 152k vocabulary's batch is, here in parts of two sequences and one: each part's mean weighted
    by its share of the positions, so the step's gradient is the whole batch's up to rounding."""
    draft, _ = load_model(checkpoints(architecture), "draft")
    vocab = draft.config.vocab_size
    batch = teacher_batch(vocab)
    monkeypatch.setattr(divergence, "PART_LOGITS_BYTES", 4 * vocab * 12)
    assert [len(part) for _, part in divergence.parts(vocab)(batch)] == [2, 1, 1]
    grads = []
    for parts in (None, divergence.parts(vocab)):
        model = copy.deepcopy(draft)
        one_step(model, batch, loss_fn=divergence.distill_loss("tvd", vocab, pad=0), parts=parts)
        grads.append([p.grad for p in model.parameters()])
    for whole, parted in zip(*grads):
        torch.testing.assert_close(parted, whole, rtol=1e-5, atol=1e-7)


def test_a_training_step_holds_a_part_of_its_batchs_logits_at_a_large_vocabulary():
    """16 rows of 64 positions of Qwen3's 152k vocabulary: the head's logits, their log-softmax and the gradients
    of both, 0.6 GiB each, were held for the whole batch at once. Run apart, so that the peak is this step's."""
    code = """
import re, numpy as np, torch
from transformers import Qwen3Config, Qwen3ForCausalLM
from test_distill import one_step
from specbuild.train.divergence import distill_loss, parts
from specbuild.train.generate import Sequence
torch.manual_seed(0)
V = 151936
model = Qwen3ForCausalLM(Qwen3Config(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16))
rng = np.random.default_rng(0)
batch = [Sequence(rng.integers(1, V, 80).astype(np.int32), 15, rng.integers(0, V, (64, 32)).astype(np.int32),
                  np.full((64, 32), -np.log(64), np.float32)) for _ in range(16)]
kib = lambda key: int(re.search(key + r":\\s+(\\d+)", open("/proc/self/status").read()).group(1))
before = kib("VmRSS")
open("/proc/self/clear_refs", "w").write("5")  # VmHWM from here: the model's initialisation peaked higher
one_step(model, batch, loss_fn=distill_loss("tvd", V, pad=0), parts=parts(V))
print((kib("VmHWM") - before) // 1024)
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": os.path.dirname(__file__)})
    assert run.returncode == 0, run.stderr
    assert int(run.stdout.split()[-1]) < 1200  # MiB: 1815 in one part, 772 in parts


def test_distill_refuses_a_target_without_tokenizer_files(tmp_path):
    """transformers 5 gives such a folder an empty tokenizer of its model_type's class (Qwen's here): distill trained
    on prompts it encoded to nothing."""
    target = make_checkpoint(tmp_path / "target", "qwen2", make_tokenizer())
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (target / name).unlink(missing_ok=True)
    with pytest.raises(CheckpointError, match="target checkpoint .* has no usable tokenizer"):
        distill(target, tmp_path / "draft", minutes=0.01)
    assert not (tmp_path / "draft").exists()
