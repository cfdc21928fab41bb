"""The compile pipeline end to end: what it writes into the bundle and what it refuses."""

from conftest import PROMPTS
from specbuild.compile import compile_bundle
from specbuild.recipe import CompileSettings
from specbuild_runtime import SpeculativeDecoder


def test_a_draft_with_padding_rows_is_cut_to_the_targets_vocabulary(checkpoints, tokenizer, tmp_path):
    target = checkpoints("llama")
    vocab = len(tokenizer)
    padded = checkpoints("llama", 1, vocab_size=vocab + 16)
    manifest = compile_bundle(CompileSettings(target=target, draft=padded, output=tmp_path / "b", max_seq_len=64),
                              show_progress=False)
    assert manifest.engines["draft"].shape.vocab_size == manifest.engines["target"].shape.vocab_size == vocab
    decoder = SpeculativeDecoder(tmp_path / "b")
    ids = tokenizer(PROMPTS[0])["input_ids"]
    assert decoder.generate(ids, 12, gamma=4).token_ids == decoder.generate(ids, 12, gamma=0).token_ids
    sampled = decoder.generate(ids, 12, gamma=4, temperature=1.0, seed=0).token_ids
    assert all(0 <= t < vocab for t in sampled)
