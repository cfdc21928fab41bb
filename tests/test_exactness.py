"""Speculative greedy output equals transformers' greedy generate(), token for token."""

import shutil

import pytest

from conftest import PROMPTS
from specbuild.compile.reference import load_reference, transformers_greedy
from specbuild_runtime import SpeculativeDecoder
from specbuild_runtime.decode import FREE_GUESSES
from specbuild_runtime.slot import EngineSlot

ARCHITECTURES = ["llama", "qwen2", "mistral", "gpt2", "granite", "olmo2", "olmo3", "qwen3moe", "mixtral"]
NEW_TOKENS = 23  # not a multiple of γ+1 for any γ tested: max-new-tokens lands inside a round


@pytest.fixture(scope="module")
def references():
    cache = {}

    def get(architecture, folder, tokenizer):
        if architecture not in cache:
            model = load_reference(folder)
            cache[architecture] = {
                p: transformers_greedy(model, tokenizer(p)["input_ids"], NEW_TOKENS, [tokenizer.eos_token_id])
                for p in PROMPTS
            }
        return cache[architecture]

    return get


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("draft", ["same", "unrelated"])
def test_speculative_greedy_equals_transformers(architecture, draft, bundles, checkpoints, tokenizer, references):
    decoder = SpeculativeDecoder(bundles(architecture, draft_seed=0 if draft == "same" else 1), draft_steps=True)
    expected = references(architecture, checkpoints(architecture), tokenizer)
    for gamma in (0, 1, 3, 5, 8, "auto"):  # 5 and 8: rounds with calls of the draft's steps graph
        for prompt in PROMPTS:
            result = decoder.generate(tokenizer(prompt)["input_ids"], NEW_TOKENS, gamma)
            assert result.token_ids == expected[prompt], (gamma, prompt)
            if gamma and result.stats.drafted and draft == "same":
                assert result.stats.acceptance_rate == 1.0


def test_unrelated_draft_is_mostly_rejected(bundles, tokenizer):
    decoder = SpeculativeDecoder(bundles("llama", draft_seed=1))
    result = decoder.generate(tokenizer(PROMPTS[2])["input_ids"], 40, gamma=4)
    assert result.stats.acceptance_rate < 0.3


@pytest.mark.parametrize("gamma", [1, 3, 8])
def test_eos_inside_a_round_stops_exactly_where_transformers_stops(gamma, bundles, checkpoints, tokenizer):
    decoder = SpeculativeDecoder(bundles("llama", draft_seed=0))
    model = load_reference(checkpoints("llama"))
    for prompt in PROMPTS[:4]:
        ids = tokenizer(prompt)["input_ids"]
        free = transformers_greedy(model, ids, 30, [])
        eos = free[5]  # a token the target emits mid-sequence, likely mid-round
        expected = transformers_greedy(model, ids, 30, [eos])
        decoder.eos_token_ids = {eos}
        result = decoder.generate(ids, 30, gamma)
        assert result.token_ids == expected
        assert result.token_ids[-1] == eos and result.stats.finish_reason == "eos"


@pytest.mark.parametrize("gamma", [0, 1, 3, 8, "auto"])
def test_ignore_eos_decodes_past_the_eos_exactly_as_transformers_does_without_one(gamma, bundles, checkpoints, tokenizer):
    decoder = SpeculativeDecoder(bundles("llama", draft_seed=0))
    model = load_reference(checkpoints("llama"))
    for prompt in PROMPTS[:4]:
        ids = tokenizer(prompt)["input_ids"]
        free = transformers_greedy(model, ids, 30, [])
        decoder.eos_token_ids = {free[5]}  # an eos the target emits mid-sequence, likely mid-round
        assert decoder.generate(ids, 30, gamma).stats.finish_reason == "eos"  # the case is what it claims
        result = decoder.generate(ids, 30, gamma, ignore_eos=True)
        assert result.token_ids == free and result.stats.finish_reason == "max_new_tokens"
        assert result.text == tokenizer.decode(free, skip_special_tokens=True)  # the eos's text too


@pytest.mark.parametrize("gamma", [0, 1, 3, 8, "auto"])
def test_stop_token_ids_stop_exactly_where_transformers_stops_at_them(gamma, bundles, checkpoints, tokenizer):
    decoder = SpeculativeDecoder(bundles("llama", draft_seed=0))
    model = load_reference(checkpoints("llama"))
    for prompt in PROMPTS[:4]:
        ids = tokenizer(prompt)["input_ids"]
        free = transformers_greedy(model, ids, 30, [])
        stops = [free[7], free[4]]
        expected = transformers_greedy(model, ids, 30, stops)
        result = decoder.generate(ids, 30, gamma, stop_token_ids=stops)
        assert result.token_ids == expected and result.stats.finish_reason == "stop_token"
        # the stop token's text is left out, as vLLM leaves it out, unless include_stop_str_in_output
        assert result.text == tokenizer.decode(expected[:-1])
        assert decoder.generate(ids, 30, gamma, stop_token_ids=stops, include_stop_str_in_output=True).text == \
            tokenizer.decode(expected)


@pytest.mark.parametrize("gamma", [0, 2, 5])
def test_sampled_ignore_eos_and_stop_token_ids_only_move_where_a_seeded_run_ends(gamma, bundles, tokenizer):
    """Neither changes a token's distribution: a seeded run draws the tokens the run without them draws, up to where
    one of them ends it."""
    decoder = SpeculativeDecoder(bundles("llama", draft_seed=1))
    sampling = dict(temperature=1.0, top_p=0.95, seed=5)
    for prompt in PROMPTS[:3]:
        ids = tokenizer(prompt)["input_ids"]
        decoder.eos_token_ids = set()
        free = decoder.generate(ids, 40, gamma, **sampling).token_ids
        decoder.eos_token_ids = {free[9]}
        ended = decoder.generate(ids, 40, gamma, **sampling)
        assert ended.token_ids == free[:free.index(free[9]) + 1] and ended.stats.finish_reason == "eos"
        assert decoder.generate(ids, 40, gamma, ignore_eos=True, **sampling).token_ids == free
        decoder.eos_token_ids = set()
        stopped = decoder.generate(ids, 40, gamma, stop_token_ids=[free[12]], **sampling)
        assert stopped.token_ids == free[:free.index(free[12]) + 1] and stopped.stats.finish_reason == "stop_token"


def test_stream_yields_the_same_tokens_as_generate(bundles, tokenizer):
    decoder = SpeculativeDecoder(bundles("gpt2", draft_seed=0))
    ids = tokenizer(PROMPTS[0])["input_ids"]
    assert list(decoder.stream(ids, 17, gamma=3)) == decoder.generate(ids, 17, gamma=3).token_ids


def test_generation_stops_at_the_end_of_the_context(bundles, checkpoints, tokenizer):
    decoder = SpeculativeDecoder(bundles("llama", draft_seed=0, max_seq_len=64))
    ids = tokenizer(PROMPTS[2])["input_ids"]
    result = decoder.generate(ids, 200, gamma=8)
    assert result.stats.finish_reason == "context"
    assert len(ids) + len(result.token_ids) == 64 + 1  # the last token needs no cache slot
    expected = transformers_greedy(load_reference(checkpoints("llama")), ids, len(result.token_ids), [tokenizer.eos_token_id])
    assert result.token_ids == expected


def test_free_guesses_in_rounds_without_drafts_keep_the_targets_output(bundles, tokenizer):
    """An unrelated draft keeps auto at γ = 0, where the target's rows check free guesses (the tokens that
    followed the last token before, chained): accepted or not, the output stays the target's own."""
    decoder = SpeculativeDecoder(bundles("llama", draft_seed=1))
    guessed = accepted = 0
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        auto = decoder.generate(ids, 60, gamma="auto")
        assert auto.token_ids == decoder.generate(ids, 60, gamma=0).token_ids, prompt
        guessed, accepted = guessed + auto.stats.guessed, accepted + auto.stats.guesses_accepted
    assert guessed > 100 and 0 < accepted < FREE_GUESSES * guessed


def test_a_full_chain_of_free_guesses_computes_no_target_row_beyond_its_tokens(bundles, tokenizer, monkeypatch):
    """On the CPU a target call computes an even number of rows (slot.NEVER_ALONE), re-feeding one more row where its
    tokens are odd: a round without drafts that checks a full chain of guesses feeds an even count, so that no row
    is computed for evenness alone."""
    decoder = SpeculativeDecoder(bundles("llama", draft_seed=1))
    rounds: list[list[int]] = []  # per round: its drafts, then its target call's verified tokens and rows
    draft, run = SpeculativeDecoder._draft, EngineSlot._compute_rows

    def drafting(*args, **kwargs):
        drafts = draft(*args, **kwargs)
        rounds.append([len(drafts)])
        return drafts

    def running(self, first, total_len, num_drafts, uniforms, probs_row, decides=False):
        if decides and self.engine is decoder.target and rounds and len(rounds[-1]) == 1:
            rounds[-1] += [num_drafts, total_len - first]
        return run(self, first, total_len, num_drafts, uniforms, probs_row, decides)

    monkeypatch.setattr(SpeculativeDecoder, "_draft", staticmethod(drafting))
    monkeypatch.setattr(EngineSlot, "_compute_rows", running)
    for prompt in PROMPTS:
        decoder.generate(tokenizer(prompt)["input_ids"], 60, gamma="auto")
    full = [rows for drafted, guesses, rows in rounds if not drafted and guesses == FREE_GUESSES]
    assert full and set(full) == {FREE_GUESSES + 1}


def test_every_round_of_auto_without_drafts_checks_a_guess_where_a_token_may_follow(bundles, tokenizer, monkeypatch):
    """A round without drafts computes two target rows anyway (slot.NEVER_ALONE): where no token has followed the last
    one yet, it guesses that token again (a run of it) rather than re-feed the one before, so that a call's rows stay as
    they were (a call of other rows binds its inputs anew: alternating calls of 2 rows without and with a guess took ~9%
    longer on the tiny random pair). Only a request's first call (its prompt) and a last round without room check
    none."""
    decoder = SpeculativeDecoder(bundles("llama", draft_seed=1))
    unguessed = []  # per request: its target calls that decided a token with no draft or guess among their rows
    run = EngineSlot._compute_rows

    def running(self, first, total_len, num_drafts, uniforms, probs_row, decides=False):
        if decides and self.engine is decoder.target and not num_drafts:
            unguessed[-1] += 1
        return run(self, first, total_len, num_drafts, uniforms, probs_row, decides)

    monkeypatch.setattr(EngineSlot, "_compute_rows", running)
    for prompt in PROMPTS:
        unguessed.append(0)
        result = decoder.generate(tokenizer(prompt)["input_ids"], 40, gamma="auto", ignore_eos=True)
        assert result.stats.gamma_rounds.get(0, 0) > 20
    assert max(unguessed) <= 2


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_a_layer_sliced_draft_saved_without_tokenizer_files_decodes_exactly(architecture, checkpoints, tokenizer,
                                                                            references, tmp_path):
    """save_pretrained of a pruned or layer-sliced draft writes the model alone; vLLM and TensorRT-LLM give such a
    draft the target's tokenizer, and compile refused it ('has no usable tokenizer')."""
    import json

    from safetensors.numpy import load_file, save_file

    target, draft = checkpoints(architecture), tmp_path / "draft"
    draft.mkdir()
    config = json.loads((target / "config.json").read_text())
    sliced = {"num_hidden_layers": 1, **({"layer_types": config["layer_types"][:1]} if "layer_types" in config else {})}
    (draft / "config.json").write_text(json.dumps({**config, **sliced}))
    weights = load_file(target / "model.safetensors")
    save_file({name: t for name, t in weights.items() if ".layers." not in name or ".layers.0." in name},
              draft / "model.safetensors", metadata={"format": "pt"})
    decoder = _pair_bundle(tmp_path, target, draft)
    expected = references(architecture, target, tokenizer)
    drafted = 0
    for prompt in PROMPTS:
        for gamma in (3, "auto"):
            result = decoder.generate(tokenizer(prompt)["input_ids"], NEW_TOKENS, gamma)
            assert result.token_ids == expected[prompt], (gamma, prompt)
            drafted += result.stats.drafted
    assert drafted, "the draft never drafted: this test is hollow"


def _pair_bundle(tmp_path, target, draft, **settings):
    from specbuild.compile import compile_bundle
    from specbuild.recipe import CompileSettings

    compile_bundle(CompileSettings(target, draft, tmp_path / "bundle", max_seq_len=128, **settings), show_progress=False)
    return SpeculativeDecoder(tmp_path / "bundle")


def test_a_mixture_of_experts_target_with_a_dense_qwen3_draft_decodes_as_transformers(checkpoints, tokenizer, tmp_path,
                                                                                       references):
    """Qwen3-30B-A3B's pairing in small: a dense Qwen3 draft of its vocabulary, its own architecture."""
    decoder = _pair_bundle(tmp_path, checkpoints("qwen3moe"), checkpoints("qwen3", seed=1))
    assert decoder.manifest.engines["draft"].architecture == "Qwen3ForCausalLM"
    expected = references("qwen3moe", checkpoints("qwen3moe"), tokenizer)
    for gamma in (0, 1, 3, 5, "auto"):
        for prompt in PROMPTS:
            assert decoder.generate(tokenizer(prompt)["input_ids"], NEW_TOKENS, gamma).token_ids == expected[prompt], (
                gamma, prompt)


def transformers_argmax(model, prompt_ids: list[int], tokens: list[int]) -> list[int]:
    """transformers' greedy choice after the prompt and each prefix of tokens, in one forward pass (its
    generate() costs ~40 ms a token here): tokens are its greedy output iff this returns them."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + tokens])).logits[0, len(prompt_ids) - 1 : -1]
    return logits.argmax(-1).tolist()


def test_tied_embeddings_decode_like_transformers(checkpoints, tokenizer, tmp_path):
    """The demo pair's Llamas tie the LM head to the embeddings: the checkpoint then has no lm_head."""
    from safetensors import safe_open

    target, draft = checkpoints("llama", 0, tie_word_embeddings=True), checkpoints("llama", 1, tie_word_embeddings=True)
    with safe_open(str(target / "model.safetensors"), "np") as f:
        assert not [name for name in f.keys() if name.startswith("lm_head")]
    decoder, model = _pair_bundle(tmp_path, target, draft), load_reference(target)
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        for gamma in (0, 3, "auto"):
            tokens = decoder.generate(ids, NEW_TOKENS, gamma).token_ids
            assert transformers_argmax(model, ids, tokens) == tokens, (gamma, prompt)


@pytest.mark.parametrize("architecture, prefix", [("llama", "model."), ("gpt2", "transformer.")])
def test_a_checkpoint_saved_from_the_base_model_decodes_like_transformers(checkpoints, tokenizer, tmp_path,
                                                                         architecture, prefix):
    """Saved from LlamaModel (or Qwen2Model), a checkpoint's names lack the "model." prefix, and transformers
    loads them into LlamaForCausalLM all the same; compile refused such a checkpoint as incomplete. GPT-2's
    original checkpoints lack "transformer." likewise."""
    from safetensors.numpy import load_file, save_file

    target = tmp_path / "target"
    shutil.copytree(checkpoints(architecture, 0, tie_word_embeddings=True), target)
    weights = target / "model.safetensors"
    save_file({name.removeprefix(prefix): t for name, t in load_file(weights).items()}, weights,
              metadata={"format": "pt"})
    decoder = _pair_bundle(tmp_path, target, checkpoints(architecture, 1, tie_word_embeddings=True))
    model = load_reference(target)
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        tokens = decoder.generate(ids, NEW_TOKENS, 3).token_ids
        assert transformers_argmax(model, ids, tokens) == tokens, prompt


# fp16 rounding changes how far a token's logit trails the top one by at most 0.059 here (transformers fp16 against
# fp32, tokens within 3 of the top, teacher-forced on the engine's output: Llama; OLMo 2 0.020, OLMo 3 0.019, Granite
# 0.0016; the fp16 engine's at most 0.029), so fp16 may order two tokens fp32 puts closer than 0.1 either way. Graph
# bugs tried (OLMo 2's q_norm dropped or its eps 1e-2, Granite's MLP residual_multiplier dropped) diverge at 0.35-1.06.
FP16_NEAR_TIE = 0.1
# A mixture of experts' fp16 rounding may also choose another expert where fp32's router scores two of them nearly
# alike (its k-th and k+1-th logits), which then moves the logits by units: here transformers fp16 itself left fp32
# by 4.1 and 5.1 on two prompts' tokens, where a router's two logits at some position before them were 0.0004 and
# 0.0015 apart (fp16 spaces numbers of 2 to 8 0.002 to 0.008 apart).
ROUTING_NEAR_TIE = 0.01


def _routing_gaps(model, ids: list[int]) -> list[float]:
    """At each position of ids, the least gap between a router's k-th and k+1-th logit over the sparse layers, in the
    fp32 model (inf for a model without routers)."""
    import torch

    k = getattr(model.config, "num_experts_per_tok", None)
    if k is None:
        return [float("inf")] * len(ids)
    with torch.no_grad():
        routers = model(torch.tensor([ids]), output_router_logits=True).router_logits
    tops = [torch.topk(r.float(), k + 1, -1).values for r in routers]
    return torch.stack([top[:, k - 1] - top[:, k] for top in tops]).min(0).values.tolist()


@pytest.mark.parametrize("architecture", ["llama", "granite", "olmo2", "olmo3", "qwen3moe", "mixtral"])
def test_an_fp16_bundle_decodes_through_the_runtime_like_transformers_in_fp16(architecture, checkpoints, tokenizer,
                                                                              tmp_path):
    """Granite's multipliers and OLMo 2's norms in fp16 too; the prompt's logprobs are transformers' (its argmax
    alone would not see Granite's logits left undivided). The tokens are transformers fp16's up to the first that
    differs, which must be a near tie in fp32 (issue 12: rounding told apart from a bug); after it the two continue
    different texts."""
    import copy

    import torch

    decoder = _pair_bundle(tmp_path, checkpoints(architecture), checkpoints(architecture, 1), precision="fp16")
    assert {info.precision for info in decoder.manifest.engines.values()} == {"fp16"}
    exact = load_reference(checkpoints(architecture))
    model = copy.deepcopy(exact).half()
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        for gamma in (0, 1, 3, "auto"):
            tokens = decoder.generate(ids, NEW_TOKENS, gamma).token_ids
            theirs = transformers_argmax(model, ids, tokens)
            at = next((i for i, (a, b) in enumerate(zip(tokens, theirs)) if a != b), None)
            if at is not None:
                with torch.no_grad():
                    row = exact(torch.tensor([ids + tokens[:at]])).logits[0, -1]
                gap = max(float(row.max() - row[t]) for t in (tokens[at], theirs[at]))
                routing = min(_routing_gaps(exact, ids + tokens[:at]))
                assert gap < FP16_NEAR_TIE or routing < ROUTING_NEAR_TIE, (
                    f"{gamma=} {prompt=}: token {at} is {tokens[at]}, transformers fp16's {theirs[at]}; fp32's top "
                    f"logit leads one of them by {gap:.4f}, beyond a rounding near tie ({FP16_NEAR_TIE}), and no "
                    f"router's choice was as near ({routing:.4f})")
        scored = [p.logprob for p in decoder.generate(ids, 1, 0, prompt_logprobs=0).prompt_logprobs[1:]]
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), -1)
        expected = logprobs[range(len(ids) - 1), ids[1:]].tolist()
        # up to the first position where fp16 may route otherwise (each position's experts reach every later one)
        routed = next((i for i, gap in enumerate(_routing_gaps(exact, ids)) if gap < ROUTING_NEAR_TIE), len(ids))
        # fp16 against fp16: at most 0.011 apart here (Llama; OLMo 3 0.0063, OLMo 2 0.0055, Granite 0.001), undivided
        # logits O(1)
        assert max((abs(a - b) for a, b in zip(scored[:routed], expected)), default=0) < 0.05, prompt
