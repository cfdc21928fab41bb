"""Every family specbuild compiles decodes token for token like transformers (fp32, CPU), speculatively
and alone, past its sliding window; what it cannot compile is refused by name."""

import json
import shutil

import pytest

from conftest import PROMPTS, make_checkpoint
from specbuild.compile import compile_bundle
from specbuild.compile.load import ARCHITECTURES, load_checkpoint
from specbuild.errors import UnsupportedModelError
from specbuild.recipe import CompileSettings
from specbuild.reference import load_reference, transformers_greedy
from specbuild_runtime import SpeculativeDecoder

# The families test_exactness.py does not cover; windows of 8 positions, so 40 tokens pass them.
FAMILIES = ["llama3", "mistral-window", "qwen2-window", "qwen3", "phi3", "gemma2", "gemma3"]
NEW_TOKENS = 40


@pytest.mark.parametrize("family", FAMILIES)
def test_speculative_and_target_only_decoding_equal_transformers(family, checkpoints, tokenizer, tmp_path):
    target = checkpoints(family)
    out = tmp_path / "bundle"
    # An unrelated draft: most drafts are rejected, so rounds roll the cache back past the window.
    compile_bundle(CompileSettings(target=target, draft=checkpoints(family, seed=1), output=out, max_seq_len=128),
                   show_progress=False)
    decoder = SpeculativeDecoder(out)
    decoder.eos_token_ids = set()  # run every prompt to its full length, well past the window
    model = load_reference(target)
    for prompt in PROMPTS[:4]:
        ids = tokenizer(prompt)["input_ids"]
        expected = transformers_greedy(model, ids, NEW_TOKENS, [])
        for gamma in (0, 4):
            assert decoder.generate(ids, NEW_TOKENS, gamma).token_ids == expected, (family, gamma, prompt)


@pytest.mark.parametrize("architecture,config,kind", [
    ("MixtralForCausalLM", {"num_local_experts": 8}, "mixture of experts"),
    ("Qwen3MoeForCausalLM", {"num_experts": 128}, "mixture of experts"),
    ("Gemma3ForConditionalGeneration", {"vision_config": {}}, "multimodal"),
    ("MambaForCausalLM", {}, "MambaForCausalLM"),
])
def test_an_unsupported_architecture_is_named_with_what_is_supported(architecture, config, kind, checkpoints, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(checkpoints("llama"), folder)
    (folder / "config.json").write_text(json.dumps({**config, "architectures": [architecture]}))
    with pytest.raises(UnsupportedModelError) as caught:
        load_checkpoint(folder, "target")
    message = str(caught.value)
    assert architecture in message and kind in message and "\n" not in message
    assert all(name in message for name in ARCHITECTURES)


def test_gpt2_with_a_head_of_its_own_decodes_like_transformers(checkpoints, tokenizer, tmp_path):
    target = checkpoints("gpt2", tie_word_embeddings=False)
    compile_bundle(CompileSettings(target=target, draft=checkpoints("gpt2", seed=1), output=tmp_path / "b", max_seq_len=64),
                   show_progress=False)
    decoder, model = SpeculativeDecoder(tmp_path / "b"), load_reference(target)
    for prompt in PROMPTS[:2]:
        ids = tokenizer(prompt)["input_ids"]
        expected = transformers_greedy(model, ids, 16, [])
        for gamma in (0, 4):
            assert decoder.generate(ids, 16, gamma).token_ids == expected, (gamma, prompt)


@pytest.mark.parametrize("family,config,unused", [
    ("gemma2", {"attention_bias": True}, "self_attn.q_proj.bias"),  # Gemma's graph has no biases
])
def test_a_checkpoint_with_tensors_its_graph_would_not_read_is_refused_before_anything_is_written(
        family, config, unused, checkpoints, tmp_path):
    out = tmp_path / "b"
    with pytest.raises(UnsupportedModelError) as caught:
        compile_bundle(CompileSettings(target=checkpoints(family, **config), draft=checkpoints(family, seed=1),
                                       output=out, max_seq_len=64), show_progress=False)
    assert unused in str(caught.value) and "\n" not in str(caught.value)
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_gpt2_attention_without_its_scale_is_refused(checkpoints):
    with pytest.raises(UnsupportedModelError, match="GPT-2 attention variants"):
        load_checkpoint(checkpoints("gpt2", scale_attn_weights=False), "target")


def test_tensors_transformers_ignores_are_ignored_too(checkpoints, tokenizer, tmp_path):
    """Buffers some checkpoints store (rotary tables) and biases their config says the model has not:
    transformers loads neither, and the bundle decodes as transformers does."""
    from safetensors.numpy import load_file, save_file

    target = tmp_path / "target"
    shutil.copytree(checkpoints("llama"), target)
    weights = next(target.glob("*.safetensors"))
    tensors = load_file(weights)
    norm = tensors["model.layers.0.input_layernorm.weight"]
    for name in ("self_attn.rotary_emb.cos_cached", "self_attn.rotary_emb.sin_cached", "self_attn.q_proj.bias",
                 "self_attn.o_proj.bias"):
        tensors[f"model.layers.0.{name}"] = norm + 1
    save_file(tensors, weights, metadata={"format": "pt"})
    compile_bundle(CompileSettings(target=target, draft=checkpoints("llama", seed=1), output=tmp_path / "b", max_seq_len=64),
                   show_progress=False)
    decoder, model = SpeculativeDecoder(tmp_path / "b"), load_reference(target)
    for prompt in PROMPTS[:2]:
        ids = tokenizer(prompt)["input_ids"]
        assert decoder.generate(ids, 16, 4).token_ids == transformers_greedy(model, ids, 16, [])


LONGROPE = dict(rope_type="longrope", short_factor=[1.0 + 0.1 * i for i in range(8)],
                long_factor=[2.0 + 0.5 * i for i in range(8)], original_max_position_embeddings=16)


@pytest.mark.parametrize("family,settings", [
    ("phi3", {}),  # Phi-3 recomputes its cache with the long factors when generation crosses the length
    ("llama", {"rope_scaling": LONGROPE}),  # Llama keeps the keys it cached with the short ones
])
def test_a_longrope_target_longer_than_its_original_length_is_refused_before_anything_is_written(
        family, settings, checkpoints, tokenizer, tmp_path):
    """transformers picks the short or long factors by the sequence's length, which one rotary table indexed by
    position cannot follow: with the long factors throughout, such a bundle decoded other tokens than
    transformers for every prompt of up to 16 tokens."""
    target = make_checkpoint(tmp_path / "target", family, tokenizer, original_max_position_embeddings=16, **settings)
    out = tmp_path / "b"
    with pytest.raises(UnsupportedModelError, match="LongRoPE original_max_position_embeddings \\(16\\)") as caught:
        compile_bundle(CompileSettings(target=target, draft=checkpoints(family, seed=1), output=out, max_seq_len=17),
                       show_progress=False)
    assert "--max-seq-len (or a recipe's max_seq_len) of 16 or less" in str(caught.value) and "\n" not in str(caught.value)
    assert not out.exists() and sorted(tmp_path.iterdir()) == [target]


def test_a_longrope_target_decodes_like_transformers_to_its_default_context_its_original_length(
        checkpoints, tokenizer, tmp_path):
    """The default context stops at the original length, where the short factors hold throughout. A draft may
    pass its own (its rotation only changes which drafts are proposed)."""
    target = checkpoints("phi3", original_max_position_embeddings=16)
    draft = checkpoints("phi3", seed=1, original_max_position_embeddings=8)
    compile_bundle(CompileSettings(target=target, draft=draft, output=tmp_path / "b"), show_progress=False)
    decoder, model = SpeculativeDecoder(tmp_path / "b"), load_reference(target)
    assert decoder.max_seq_len == 16
    decoder.eos_token_ids = set()
    for prompt in (PROMPTS[1], PROMPTS[3]):  # 8 tokens and 1
        ids = tokenizer(prompt)["input_ids"]
        expected = transformers_greedy(model, ids, 17 - len(ids), [])  # to the end of the context
        for gamma in (0, 4):
            assert decoder.generate(ids, 64, gamma).token_ids == expected, (gamma, prompt)
