"""Every family specbuild compiles decodes token for token like transformers (fp32, CPU), speculatively
and alone, past its sliding window; what it cannot compile is refused by name."""

import json
import shutil

import pytest

from conftest import PROMPTS, make_checkpoint, with_stored_biases
from specbuild.compile import compile_bundle
from specbuild.compile.load import ARCHITECTURES, load_checkpoint
from specbuild.errors import UnsupportedModelError
from specbuild.recipe import CompileSettings
from specbuild.compile.reference import load_reference, transformers_greedy
from specbuild_runtime import BundleError, SpeculativeDecoder

# The families test_exactness.py does not cover; windows of 8 positions, so 40 tokens pass them.
FAMILIES = ["llama3", "mistral-window", "qwen2-window", "qwen3", "phi3", "gemma2", "gemma3", "granite", "olmo2",
            "olmo3", "qwen3moe", "mixtral"]
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
    ("OlmoeForCausalLM", {"num_experts": 64}, "mixture of experts"),
    ("Qwen2MoeForCausalLM", {"num_experts": 60}, "mixture of experts"),
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


@pytest.mark.parametrize("family", ["qwen3moe", "mixtral"])
def test_experts_stored_fused_as_transformers_holds_them_are_refused_in_one_line(family, checkpoints, tmp_path):
    """Released checkpoints and save_pretrained store each expert's projections; a state_dict saved as it is holds
    transformers 5's fused [E, 2I, H] and [E, H, I] tensors instead."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "fused"
    shutil.copytree(checkpoints(family), folder)
    save_file(AutoModelForCausalLM.from_pretrained(folder).state_dict(), folder / "model.safetensors")
    with pytest.raises(UnsupportedModelError, match="stores its experts fused .*save the model with save_pretrained"
                       ) as caught:
        load_checkpoint(folder, "target")
    assert "\n" not in str(caught.value)


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


@pytest.mark.parametrize("family", ["llama", "granite", "olmo2"])
def test_an_activation_the_graphs_do_not_compute_is_refused_in_one_line(family, tokenizer, tmp_path):
    """hidden_act, which transformers reads (its ACT2FN has relu): an engine with another MLP would compute another
    model."""
    with pytest.raises(UnsupportedModelError, match="activation 'relu' is not supported; specbuild's graphs compute "
                                                    "gelu, gelu_new, gelu_pytorch_tanh, silu") as caught:
        load_checkpoint(make_checkpoint(tmp_path, family, tokenizer, hidden_act="relu"), "target")
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("family,config,projections,named", [
    ("mistral", {"attention_bias": True}, ("q_proj", "o_proj"), "attention_bias"),
    ("mistral", {"mlp_bias": True}, ("down_proj",), "mlp_bias"),
    ("phi3", {"attention_bias": True}, ("qkv_proj",), "attention_bias"),
])
def test_biases_stored_where_config_json_asks_for_ones_its_architecture_never_has_are_refused(
        family, config, projections, named, tokenizer, tmp_path):
    """transformers drops them (UNEXPECTED in its load report) and vLLM, which runs these as its Llama, adds them: two
    models. The key without the tensors compiles as transformers runs it, as do the tensors with the key false
    (test_graphs)."""
    folder = with_stored_biases(make_checkpoint(tmp_path / family, family, tokenizer, **config), *projections)
    said = f"stores biases .*{projections[0]}.bias.* asks for \\({named}\\) but transformers' .* \"{named}\": false"
    with pytest.raises(UnsupportedModelError, match=said) as caught:
        load_checkpoint(folder, "target")
    assert "\n" not in str(caught.value)


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


def test_a_llama_longrope_target_longer_than_its_original_length_is_refused_before_anything_is_written(
        checkpoints, tokenizer, tmp_path):
    """transformers' Llama rotates a sequence up to the original length with the short factors and later positions
    with the long ones, keeping the keys it cached with the short ones: no engine reproduces that mix (Phi-3, which
    recomputes its cache there, compiles: below)."""
    target = make_checkpoint(tmp_path / "target", "llama", tokenizer, rope_scaling=LONGROPE)
    out = tmp_path / "b"
    with pytest.raises(UnsupportedModelError, match="LongRoPE original_max_position_embeddings \\(16\\)") as caught:
        compile_bundle(CompileSettings(target=target, draft=checkpoints("llama", seed=1), output=out, max_seq_len=17),
                       show_progress=False)
    assert "--max-seq-len (or a recipe's max_seq_len) of 16 or less" in str(caught.value) and "\n" not in str(caught.value)
    assert not out.exists() and sorted(tmp_path.iterdir()) == [target]


@pytest.mark.parametrize("key", ["sliding_window", "attention_chunk_size"])
def test_a_llama_target_with_a_sliding_window_transformers_does_not_apply_is_refused_past_it(key, checkpoints,
                                                                                            tmp_path):
    """transformers' Llama attention ignores a sliding_window in config.json, but its cache keeps only that many
    positions: past the window its decoding differs from its own forward (the engine's, unwindowed). Its cache
    windows an attention_chunk_size (Llama 4's key) alike, which compiled."""
    out = tmp_path / "b"
    with pytest.raises(UnsupportedModelError, match=f"{key} \\(8\\).*\"{key}\": null.*of 8 or less") as caught:
        compile_bundle(CompileSettings(target=checkpoints("llama", **{key: 8}), draft=checkpoints("llama", seed=1),
                                       output=out, max_seq_len=64), show_progress=False)
    assert "\n" not in str(caught.value) and not out.exists()


def test_a_llama_target_whose_layer_types_keep_its_sliding_window_out_of_the_cache_decodes_as_transformers(
        checkpoints, tokenizer, tmp_path):
    """Where config.json's layer_types say every layer attends fully, transformers' cache keeps every position
    whatever sliding_window says, and its Llama decodes unwindowed, as the engine does: it was refused."""
    target = make_checkpoint(tmp_path / "target", "llama", tokenizer, sliding_window=8,
                             layer_types=["full_attention"] * 2)
    compile_bundle(CompileSettings(target=target, draft=checkpoints("llama", seed=1), output=tmp_path / "b", max_seq_len=64),
                   show_progress=False)
    decoder, model = SpeculativeDecoder(tmp_path / "b"), load_reference(target)
    ids = tokenizer(PROMPTS[0])["input_ids"]
    assert len(ids) + 16 > 8 and decoder.generate(ids, 16, 4).token_ids == transformers_greedy(model, ids, 16, [])


def test_a_longrope_target_past_its_positions_is_told_the_length_it_can_have(checkpoints, tokenizer, tmp_path):
    """Past max_position_embeddings the error named that length, which the LongRoPE check then refused in turn (a
    Llama longrope at 128k: "131072 or less", then "4096 or less")."""
    target = make_checkpoint(tmp_path / "target", "llama", tokenizer, rope_scaling=LONGROPE)
    positions = load_checkpoint(target, "target").spec.max_position_embeddings
    with pytest.raises(UnsupportedModelError, match="LongRoPE original_max_position_embeddings \\(16\\)"):
        compile_bundle(CompileSettings(target=target, draft=checkpoints("llama", seed=1), output=tmp_path / "b",
                                       max_seq_len=positions + 1), show_progress=False)


def test_a_longrope_target_decodes_like_transformers_to_its_default_context_its_original_length(
        checkpoints, tokenizer, tmp_path):
    """A Llama LongRoPE target's default context stops at the original length, where the short factors hold
    throughout. A draft may pass its own (its rotation only changes which drafts are proposed)."""
    target = make_checkpoint(tmp_path / "target", "llama", tokenizer, rope_scaling=LONGROPE)
    compile_bundle(CompileSettings(target=target, draft=checkpoints("phi3", seed=1, original_max_position_embeddings=8),
                                   output=tmp_path / "b"), show_progress=False)
    decoder, model = SpeculativeDecoder(tmp_path / "b"), load_reference(target)
    assert decoder.max_seq_len == 16
    decoder.eos_token_ids = set()
    for prompt in (PROMPTS[1], PROMPTS[3]):  # 8 tokens and 1
        ids = tokenizer(prompt)["input_ids"]
        expected = transformers_greedy(model, ids, 17 - len(ids), [])  # to the end of the context
        for gamma in (0, 4):
            assert decoder.generate(ids, 64, gamma).token_ids == expected, (gamma, prompt)


# A Phi-3 LongRoPE target of original length 16 in a context of 64: prompts short of it, ending at it and past it.
PHI3_CONTEXT, PHI3_PROMPTS = 64, (5, 15, 16, 17, 30)


@pytest.fixture(scope="module")
def phi3_longrope(checkpoints, tokenizer, tmp_path_factory):
    """(bundle, target checkpoint): the draft a Phi-3 of original length 8, on its own long table."""
    target = checkpoints("phi3", original_max_position_embeddings=16)
    draft = checkpoints("phi3", seed=1, original_max_position_embeddings=8)
    out = tmp_path_factory.mktemp("phi3-longrope") / "b"
    compile_bundle(CompileSettings(target=target, draft=draft, output=out, max_seq_len=PHI3_CONTEXT), show_progress=False)
    return out, target


def phi3_prompt(tokenizer, length: int) -> list[int]:
    ids = tokenizer("".join(PROMPTS))["input_ids"][:length]
    assert len(ids) == length
    return ids


def test_a_phi3_longrope_target_decodes_like_transformers_through_its_original_length(phi3_longrope, tokenizer):
    """transformers' Phi-3 rotates with the short factors while the sequence fits the original length (16) and
    recomputes its whole cache with the long ones once it passes it, so each token is what one cache-less
    forward over the tokens before it gives (checked here too). The bundle switches tables there, re-feeding its
    cache once: the same tokens at every γ, from prompts short of, at and past the length, to the end of the
    context; with the GPU's fixed-row calls and the CUDA-graph path's greedy-only graphs too."""
    import torch

    from specbuild_runtime.slot import fixed_rows

    bundle, target = phi3_longrope
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["engines"]["target"]["rope_switch_length"] == 16
    assert manifest["engines"]["draft"]["rope_switch_length"] == 0
    model = load_reference(target)
    normal = SpeculativeDecoder(bundle)
    fixed = SpeculativeDecoder(bundle, target_rows=fixed_rows(normal.max_gamma))
    graphs = SpeculativeDecoder(bundle, cuda_graphs=True, target_rows=fixed_rows(normal.max_gamma))
    for engine in (graphs.target, graphs.draft):
        engine.captures = True  # graph ids named as on CUDA
    for length in PHI3_PROMPTS:
        ids = phi3_prompt(tokenizer, length)
        expected = transformers_greedy(model, ids, PHI3_CONTEXT + 1 - length, [])  # to the end of the context
        if length == PHI3_PROMPTS[0]:  # transformers' generate is cache-less forwards, short then long
            context = list(ids)
            with torch.no_grad():
                for _ in expected:
                    context.append(int(model(torch.tensor([context]), use_cache=False).logits[0, -1].argmax()))
            assert context[length:] == expected
        for decoder in (normal, fixed, graphs):
            decoder.eos_token_ids = set()
            for gamma in (0, 1, 3, 4, 8, "auto"):
                result = decoder.generate(ids, PHI3_CONTEXT, gamma)
                assert result.token_ids == expected, (length, gamma, decoder.target.path.name, decoder.slots.size)
                assert result.stats.finish_reason == "context"


def test_a_phi3_longrope_targets_prompt_logprobs_are_each_prefixs_own_through_its_original_length(phi3_longrope,
                                                                                                   tokenizer):
    """Each prompt token scores what a cache-less forward over the tokens before it gives (short factors up to the
    original length, long past it), as decoding it would: no scoring call spans the switch."""
    import torch

    from specbuild_runtime.slot import fixed_rows

    bundle, target = phi3_longrope
    model = load_reference(target)
    normal = SpeculativeDecoder(bundle)
    ids = phi3_prompt(tokenizer, PHI3_CONTEXT)
    with torch.no_grad():
        expected = [float(torch.log_softmax(model(torch.tensor([ids[:j]]), use_cache=False).logits[0, -1].float(), -1)[ids[j]])
                    for j in range(1, len(ids))]
    for decoder in (normal, SpeculativeDecoder(bundle, target_rows=fixed_rows(normal.max_gamma))):
        for length in (16, 17, 30, PHI3_CONTEXT):
            scored = decoder.generate(ids[:length], 0, prompt_logprobs=0).prompt_logprobs[1:]
            assert [r.logprob for r in scored] == pytest.approx(expected[:length - 1], abs=1e-5), length


def test_a_phi3_longrope_targets_prompts_scored_over_each_other_get_the_bits_of_each_scored_whole(phi3_longrope,
                                                                                                 tokenizer):
    """Scoring's prefix reuse where the rotary table switches at 16 tokens: prompts sharing their head, longer and
    shorter than the one scored before, on either side of the switch."""
    bundle, _ = phi3_longrope
    decoder, whole = SpeculativeDecoder(bundle), SpeculativeDecoder(bundle, prefix_reuse=False)
    ids = phi3_prompt(tokenizer, PHI3_CONTEXT)
    spared = []
    for length in (30, 20, PHI3_CONTEXT, 12, 15, 16, 17):
        scored = decoder.generate(ids[:length], 0, prompt_logprobs=2)
        assert scored.prompt_logprobs == whole.generate(ids[:length], 0, prompt_logprobs=2).prompt_logprobs, length
        spared.append(scored.stats.cached_prompt_tokens)
    # Nothing across the switch: a cache written with one table holds no prefix of a prompt rotated with the other.
    assert spared == [0, 19, 19, 0, 11, 14, 0]


def test_a_phi3_longrope_target_samples_as_its_own_distribution_through_its_original_length(phi3_longrope, tokenizer):
    """Target-only sampling draws each token from the target's distribution given the tokens before it, short
    factors then long, with the run's uniforms (the graph's rule: the first token whose running sum passes u);
    speculative rounds at every γ draw the same tokens with the full graphs, the GPU's fixed-row calls and the
    greedy-only graphs with the bundle's sampler (each verified row is the target's row, as greedy proves)."""
    import numpy as np
    import torch

    from specbuild_runtime.slot import fixed_rows

    bundle, target = phi3_longrope
    model = load_reference(target)
    normal = SpeculativeDecoder(bundle)
    others = [SpeculativeDecoder(bundle, target_rows=fixed_rows(normal.max_gamma)), SpeculativeDecoder(bundle, cuda_graphs=True)]
    for decoder in (normal, *others):
        decoder.eos_token_ids = set()
    for seed, length in enumerate((5, 16, 17)):
        ids = phi3_prompt(tokenizer, length)
        tokens = normal.generate(ids, PHI3_CONTEXT, 0, temperature=0.8, seed=seed).token_ids
        rng, context = np.random.default_rng(seed), list(ids)
        with torch.no_grad():
            for token in tokens:
                logits = model(torch.tensor([context]), use_cache=False).logits[0, -1].double().numpy() / 0.8
                p = np.exp(logits - logits.max())
                cdf = np.cumsum(p / p.sum())
                u = float(rng.random(1, dtype=np.float32)[0])
                assert token == min(int((cdf <= u * cdf[-1]).sum()), len(cdf) - 1), (length, len(context))
                context.append(token)
        for gamma in (1, 3, 4, 8):
            expected = normal.generate(ids, PHI3_CONTEXT, gamma, temperature=0.8, seed=seed).token_ids
            assert len(expected) == PHI3_CONTEXT + 1 - length
            for decoder in others:
                assert decoder.generate(ids, PHI3_CONTEXT, gamma, temperature=0.8, seed=seed).token_ids == expected, (length, gamma)


def test_a_phi3_longrope_targets_table_choice_reaches_the_engine_when_host_and_engine_memory_are_apart(
        phi3_longrope, tokenizer, monkeypatch):
    """On a GPU `long_rope` is a device buffer written in place when the sequence passes the length (as a CUDA
    graph replays it): kept apart from its host array here, a missing push would decode the short table's tokens."""
    from specbuild_runtime import slot
    from specbuild_runtime.slot import fixed_rows

    bundle, _ = phi3_longrope
    normal = SpeculativeDecoder(bundle)
    ids = phi3_prompt(tokenizer, 5)
    expected = {gamma: normal.generate(ids, PHI3_CONTEXT, gamma).token_ids for gamma in (0, 4)}

    def apart(self, host, device):
        self.host, self.device = host, device
        self.value = slot.ort.OrtValue.ortvalue_from_numpy(host.copy(), device, 0)
        self.shared = False

    monkeypatch.setattr(slot.Buffer, "__init__", apart)
    device_like = SpeculativeDecoder(bundle, target_rows=fixed_rows(normal.max_gamma), cuda_graphs=True, draft_steps=True)
    for gamma, tokens in expected.items():
        assert device_like.generate(ids, PHI3_CONTEXT, gamma).token_ids == tokens, gamma
        assert device_like.generate(ids, PHI3_CONTEXT, gamma).token_ids == tokens, gamma  # the slot again, from long


def test_a_re_feed_across_a_phi3_longrope_switch_that_failed_midway_leaves_no_long_positions_to_a_short_prompt(
        phi3_longrope, tokenizer, monkeypatch):
    """The first call past the switch re-feeds the cache with the long table, in chunks (a Phi-3's 4096 positions: 16
    calls of 256). One that failed midway (a DeviceError: out of memory) left the chunks before it, long-rotated, in
    what the slot keeps while it still said its cache was short: a short prompt over them reused them (other tokens
    than a fresh decoder's from the 4th)."""
    from specbuild_runtime import DeviceError
    from specbuild_runtime import slot as slot_module
    from specbuild_runtime.slot import EngineSlot

    bundle, _ = phi3_longrope
    monkeypatch.setattr(slot_module, "PREFILL_CHUNK", 4)  # the re-feed of 16 positions in chunks
    decoder = SpeculativeDecoder(bundle)
    refeed, call, refeeding = EngineSlot._refeed, EngineSlot._call, []

    def watched_refeed(self, end):
        refeeding.append(end)
        try:
            return refeed(self, end)
        finally:
            refeeding.pop()

    def failing_call(self, first, total_len, *args):
        if refeeding and first > 0:
            raise DeviceError("onnxruntime failed: out of memory")
        return call(self, first, total_len, *args)

    monkeypatch.setattr(EngineSlot, "_refeed", watched_refeed)
    monkeypatch.setattr(EngineSlot, "_call", failing_call)
    with pytest.raises(DeviceError, match="out of memory"):
        decoder.generate(phi3_prompt(tokenizer, 12), 10, gamma=0)  # past the switch (16)
    monkeypatch.setattr(EngineSlot, "_call", call)
    short = phi3_prompt(tokenizer, 6)
    assert decoder.generate(short, 10, gamma=0).token_ids == SpeculativeDecoder(bundle).generate(short, 10, gamma=0).token_ids


def test_the_cache_a_phi3_longrope_target_re_feeds_holds_the_same_bits_at_every_gamma(checkpoints, tokenizer, tmp_path):
    """The re-feed at the crossing writes positions 0..O-1, and the round after it re-feeds the last of them or not
    as its drafts leave (γ 0: position O-1 again, γ 1: none): those must hold the bits an even call gives, as a
    prompt's do. An int4 target (accuracy level 4, block 128: an odd call's last row is computed apart) of odd
    original length 17: one re-feed call of 17 rows left position 16 other bits at γ 1 and 3 than at γ 0."""
    import numpy as np

    target = checkpoints("phi3", original_max_position_embeddings=17, hidden_size=128, intermediate_size=256,
                         num_attention_heads=4)
    out = tmp_path / "b"
    compile_bundle(CompileSettings(target=target, draft=checkpoints("phi3", seed=1), output=out, max_seq_len=64,
                                   target_quantize="int4", block_size=128), show_progress=False)
    decoder = SpeculativeDecoder(out)
    decoder.eos_token_ids = set()
    ids, length = phi3_prompt(tokenizer, 5), 40
    caches = {}
    for gamma in (0, 1, 2, 3):
        decoder.generate(ids, length - len(ids), gamma)
        with decoder.slots.take() as slot:
            caches[gamma] = [buffer.numpy()[..., :length - 1, :].copy() for buffer in slot.target.cache]
    for gamma in (1, 2, 3):
        assert all(np.array_equal(a, b) for a, b in zip(caches[0], caches[gamma])), gamma


def test_inspect_says_where_a_phi3_longrope_target_switches_rotary_tables(phi3_longrope, cli):
    bundle, _ = phi3_longrope
    shown, as_json = cli.run([["inspect", str(bundle)], ["inspect", str(bundle), "--json"]])
    assert shown["status"] == 0 and as_json["status"] == 0, shown["stderr"]
    assert shown["stdout"].count("rotary: LongRoPE short factors up to 16 tokens, long ones past it") == 1  # not the draft's
    assert json.loads(as_json["stdout"])["engines"]["target"]["rope_switch_length"] == 16


def test_a_phi3_longrope_engine_and_a_manifest_that_disagree_on_its_switch_are_refused_at_load(phi3_longrope, tmp_path):
    bundle, _ = phi3_longrope
    edited = tmp_path / "b"
    shutil.copytree(bundle, edited)
    manifest = json.loads((edited / "manifest.json").read_text())
    manifest["engines"]["target"]["rope_switch_length"] = 0
    (edited / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="'long_rope' input"):
        SpeculativeDecoder(edited, check_digests=False)


def test_a_phi3_longrope_targets_default_context_is_the_usual_one_past_its_original_length(checkpoints, tmp_path):
    """min(2048, max_position_embeddings) as for other targets (512 here): its engine switches tables at 16."""
    from specbuild.compile.load import longest_context, rope_switch_length
    from specbuild.compile.pipeline import _max_seq_len

    path = checkpoints("phi3", original_max_position_embeddings=16)
    target = load_checkpoint(path, "target")
    assert _max_seq_len(CompileSettings(target=path, draft=path, output=tmp_path / "b"),
                        longest_context(target, "target")) == 512
    assert rope_switch_length(target, "target", 512) == 16
    assert rope_switch_length(target, "target", 16) == rope_switch_length(target, "draft", 512) == 0
