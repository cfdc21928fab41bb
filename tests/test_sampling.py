"""Speculative sampling has exactly the target's distribution (Leviathan et al. 2023), and seeds reproduce runs."""

import numpy as np
import pytest
import torch
import transformers as tf
from scipy.stats import chi2
from tokenizers import Tokenizer, models, pre_tokenizers

from conftest import PROMPTS
from specbuild.compile import compile_bundle
from specbuild.recipe import CompileSettings
from specbuild_runtime import SpeculativeDecoder

VOCAB = 24
TEMPERATURE = 1.0
SAMPLES = 4000


def small_vocab_checkpoint(folder, seed):
    words = ["<eos>"] + [f"w{i}" for i in range(VOCAB - 1)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = tf.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>")
    torch.manual_seed(seed)
    config = tf.LlamaConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, eos_token_id=0)
    model = tf.LlamaForCausalLM(config)
    with torch.no_grad():  # spread-out but not uniform distributions, so draft and target disagree
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.15)
    model.eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, model


@pytest.fixture(scope="module")
def small_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("small-vocab")
    target_dir, target = small_vocab_checkpoint(root / "target", 0)
    draft_dir, _ = small_vocab_checkpoint(root / "draft", 1)
    compile_bundle(CompileSettings(target_dir, draft_dir, root / "bundle", max_seq_len=64), show_progress=False)
    decoder = SpeculativeDecoder(root / "bundle")
    decoder.eos_token_ids = set()  # every sample must have all the tokens the test counts
    return decoder, target


PROMPT = [3, 7, 1]


def exact_joint(target) -> np.ndarray:
    """P(tokens 2 and 3 | prompt) under target-only sampling, from transformers: [V, V]."""
    with torch.no_grad():
        first = torch.softmax(target(torch.tensor([PROMPT])).logits[0, -1] / TEMPERATURE, -1)
        seqs = torch.tensor([PROMPT + [a] for a in range(VOCAB)])
        second = torch.softmax(target(seqs).logits[:, -1] / TEMPERATURE, -1)  # [a, b]
        seqs = torch.tensor([PROMPT + [a, b] for a in range(VOCAB) for b in range(VOCAB)])
        third = torch.softmax(target(seqs).logits[:, -1] / TEMPERATURE, -1).reshape(VOCAB, VOCAB, VOCAB)
    joint = (first[:, None, None] * second[:, :, None] * third).sum(0)  # marginalise token 1: [b, c]
    return joint.double().numpy()


def g_test(counts: np.ndarray, probs: np.ndarray) -> float:
    """p-value of a G-test of counts against probs, cells expected below 5 pooled into one."""
    expected = probs.ravel() * counts.sum()
    small = expected < 5
    observed = np.append(counts.ravel()[~small], counts.ravel()[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
    nonzero = observed > 0
    g = 2 * (observed[nonzero] * np.log(observed[nonzero] / expected[nonzero])).sum()
    return float(chi2.sf(g, len(observed) - 1))


def sample_counts(decoder, gamma) -> np.ndarray:
    counts = np.zeros((VOCAB, VOCAB))
    for seed in range(SAMPLES):
        ids = decoder.generate(PROMPT, 3, gamma, temperature=TEMPERATURE, seed=seed).token_ids
        counts[ids[1], ids[2]] += 1
    return counts


def test_speculative_samples_follow_the_target_distribution_and_a_wrong_rule_is_caught(small_pair, monkeypatch):
    decoder, target = small_pair
    joint = exact_joint(target)
    real = g_test(sample_counts(decoder, gamma=3), joint)
    # Negative control: uniforms just below 1 turn the rule into "accept iff p(x) >= q(x)".
    def wrong_rule(rng, n):
        u = rng.random(n, dtype=np.float32)
        u[:-1] = np.float32(1 - 1e-7)
        return u
    monkeypatch.setattr(decoder, "_uniforms", wrong_rule)
    wrong = g_test(sample_counts(decoder, gamma=3), joint)
    print(f"G-test p-values: real rule {real:.3g}, wrong rule {wrong:.3g}")
    assert real > 1e-3
    assert wrong < 1e-6


def test_drafts_are_both_accepted_and_rejected_in_the_distribution_test(small_pair):
    decoder, _ = small_pair
    result = decoder.generate(PROMPT, 40, 3, temperature=TEMPERATURE, seed=0)
    assert 0.05 < result.stats.acceptance_rate < 0.95


def test_target_only_sampling_follows_the_target_distribution(small_pair):
    decoder, target = small_pair
    assert g_test(sample_counts(decoder, gamma=0), exact_joint(target)) > 1e-3


def test_same_seed_reproduces_and_different_seeds_differ(bundles, tokenizer):
    decoder = SpeculativeDecoder(bundles("llama", draft_seed=1))
    ids = tokenizer(PROMPTS[0])["input_ids"]
    runs = [decoder.generate(ids, 30, 3, temperature=1.0, seed=s).token_ids for s in (7, 7, 8)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


@pytest.mark.parametrize("options", [{"temperature": 0.0}, {"temperature": 1.0, "top_k": 1},
                                     {"temperature": 0.7, "top_p": 1e-6}])
def test_degenerate_sampling_settings_equal_greedy(options, bundles, tokenizer):
    decoder = SpeculativeDecoder(bundles("qwen2", draft_seed=1))
    ids = tokenizer(PROMPTS[2])["input_ids"]
    greedy = decoder.generate(ids, 25, 0).token_ids
    for gamma in (0, 3):
        assert decoder.generate(ids, 25, gamma, seed=1, **options).token_ids == greedy


def test_top_p_one_keeps_the_whole_distribution(small_pair):
    decoder, _ = small_pair
    plain = decoder.generate(PROMPT, 20, 3, temperature=1.0, seed=5).token_ids
    assert decoder.generate(PROMPT, 20, 3, temperature=1.0, top_p=1.0, top_k=0, seed=5).token_ids == plain
    assert decoder.generate(PROMPT, 20, 3, temperature=1.0, top_k=VOCAB, seed=5).token_ids == plain
