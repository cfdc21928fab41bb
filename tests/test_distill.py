"""Distillation and acceptance-rate measurement on tiny models trained on nothing (fast, CPU only)."""

from __future__ import annotations

import pytest
import torch

from specbuild.acceptance import rounds
from specbuild.errors import CheckpointError
from specbuild.texts import corpus_files
from specbuild.train.distill import acceptance_rate, distill, heldout_prompts, load_model
from specbuild.train.train import llama, parameter_count, save_checkpoint, train_tokenizer

TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
SMALLER = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}


@pytest.fixture(scope="module")
def corpus():
    train, heldout = corpus_files()
    return train[:6], heldout[:2]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory, corpus):
    tokenizer = train_tokenizer(corpus[0], vocab_size=512)
    path = tmp_path_factory.mktemp("pair") / "target"
    save_checkpoint(llama(TINY, tokenizer, max_positions=512), tokenizer, path)
    return path


def test_rounds_follow_greedy_speculative_decoding():
    # round 1: drafts 4, accepts 2 (+ target token at 2); round 2 from 3: drafts 4, accepts 4 (+ target at 7)
    assert rounds([True, True, False, True, True, True, True, False], gamma=4) == (6, 8)
    # the last token is always the target's own: nothing is drafted for it
    assert rounds([True], gamma=4) == (0, 0)


def test_alpha_is_one_when_the_draft_is_the_target(target_dir, corpus):
    target, tokenizer = load_model(target_dir, "target")
    prompts = heldout_prompts(tokenizer, corpus[1], n=4, prompt_tokens=16)
    assert acceptance_rate(target, target, prompts, gamma=4, new_tokens=16) == 1.0


def test_distill_writes_a_smaller_draft_with_the_targets_tokenizer(tmp_path, target_dir, corpus):
    torch.manual_seed(0)
    report = distill(
        target_dir,
        tmp_path / "draft",
        draft_config=SMALLER,
        minutes=0.05,
        data_files=corpus[0],
        heldout_files=corpus[1],
        batch_size=4,
        seq_len=64,
        prompts=4,
    )
    assert {"alpha_before", "alpha_after", "draft_parameters", "target_parameters", "seconds", "tokens"} <= set(report)
    assert {"heldout_loss_before", "heldout_loss_after"} <= set(report)
    assert report["draft_parameters"] < report["target_parameters"]
    draft, draft_tokenizer = load_model(tmp_path / "draft", "draft")
    _, target_tokenizer = load_model(target_dir, "target")
    assert draft_tokenizer.get_vocab() == target_tokenizer.get_vocab()
    assert parameter_count(draft) == report["draft_parameters"]
    assert draft.config.model_type == "llama"


def test_distill_refuses_a_draft_with_another_tokenizer(tmp_path, target_dir, corpus):
    other_tokenizer = train_tokenizer(corpus[0], vocab_size=400)
    save_checkpoint(llama(SMALLER, other_tokenizer, max_positions=512), other_tokenizer, tmp_path / "other")
    with pytest.raises(CheckpointError, match="different tokenizer"):
        distill(target_dir, tmp_path / "draft", init=tmp_path / "other", minutes=0.01, data_files=corpus[0])


def test_distill_reports_a_missing_target(tmp_path):
    with pytest.raises(CheckpointError, match="not a Hugging Face folder"):
        distill(tmp_path / "missing", tmp_path / "draft", minutes=0.01)
