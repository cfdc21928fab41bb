"""Structured outputs (grammar.py): the output is the target's under the grammar's mask at each step, whatever the
drafts and γ (greedy: token for token; sampled: tests/test_sampling.py's χ² against the masked distribution)."""

import json
import re

import numpy as np
import pytest
import torch

from conftest import PROMPTS, counted_compiles
from specbuild.compile.reference import load_reference
from specbuild_runtime import RequestError, SpeculativeDecoder
from specbuild_runtime.grammar import Guide

NEW_TOKENS = 40
GAMMAS = (0, 1, 3, "auto")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "age", "ok"], "additionalProperties": False}
FORMATS = [{"json": SCHEMA}, {"json": SCHEMA, "disable_any_whitespace": True}, {"json_object": True},
           {"regex": r"(yes|no), [a-z]{2,5}\."},
           {"choice": ["return a + b", "pass", "raise ValueError"]}]
# grammars that force most of the reply (the rest of a choice's word, an enum's quotes), and one forcing the eos's text
FORCING = [{"choice": ["raise NotImplementedError", "return self"]}, {"json": {"enum": ["function", "class"]}}]
FORCED_EOS = {"regex": r"a<\|endoftext\|>b"}


def decoders(folder):
    """The engine graphs (greedy branch, the draft's steps graph) and the greedy-only graphs CUDA graphs capture."""
    return SpeculativeDecoder(folder, draft_steps=True), SpeculativeDecoder(folder, cuda_graphs=True)


def target_alone(model, guide, prompt: list[int], new_tokens: int, eos: set[int]) -> list[int]:
    """The target's greedy decoding under the grammar: transformers' logits, the matcher's mask, one token a step."""
    tokens = []
    with torch.no_grad():
        while len(tokens) < new_tokens:
            logits = model(torch.tensor([prompt + tokens])).logits[0, -1].float().numpy()
            token = int(np.where(guide.masks([])[0], logits, -np.inf).argmax())
            tokens.append(token)
            if token in eos:
                break
            guide.advance(token)
    return tokens


@pytest.mark.parametrize("structured", FORMATS, ids=lambda s: "-".join(s))
@pytest.mark.parametrize("draft", ["same", "unrelated"])
def test_greedy_structured_output_is_the_target_alone_under_the_grammar_mask(structured, draft, bundles, checkpoints,
                                                                            tokenizer):
    model = load_reference(checkpoints("llama"))
    for decoder in decoders(bundles("llama", draft_seed=0 if draft == "same" else 1)):
        checked, ended = decoder.request(PROMPTS[0], structured_outputs=structured).structured, 0
        for prompt in PROMPTS[:3]:
            ids = tokenizer(prompt)["input_ids"]
            expected = target_alone(model, decoder.grammars.guide(checked), ids, NEW_TOKENS, decoder.eos_token_ids)
            for gamma in GAMMAS:
                result = decoder.generate(ids, NEW_TOKENS, gamma, structured_outputs=structured)
                assert result.token_ids == expected, (decoder.cuda_graphs, gamma, prompt)
            ended += result.stats.finish_reason == "eos"
            if result.stats.finish_reason == "eos":
                if "json" in structured:
                    parsed = json.loads(result.text)
                    assert set(parsed) == {"name", "age", "ok"} and 0 <= parsed["age"] <= 99
                    assert " " not in result.text or "disable_any_whitespace" not in structured
                elif "json_object" in structured:
                    assert isinstance(json.loads(result.text), dict)
                elif "choice" in structured:
                    assert result.text in structured["choice"]
        # not hollow: the random target writes whitespace on and on where JSON allows it, but ends the others
        assert ended == 0 if "json" in structured and len(structured) == 1 else ended > 0


# Each token's mask depends on the bytes before it; long enough that no sample reaches its end (an eos) in 24 tokens.
ALTERNATING = {"regex": r"([ab][cd]){60}"}


def masked_distributions(model, guides, prompt: list[int], samples: list[list[int]], temperature: float):
    """[N, T, V] the target's distribution at each sampled position under the grammar's mask there, in float64."""
    tokens = torch.tensor(samples)
    with torch.no_grad():
        logits = model(torch.cat([torch.tensor(prompt).expand(len(samples), -1), tokens], 1)).logits
    logits = logits[:, len(prompt) - 1:-1].double() / temperature
    for n, sampled in enumerate(samples):
        guide = guides()
        for t, token in enumerate(sampled):
            logits[n, t, ~torch.from_numpy(guide.masks([])[0])] = -torch.inf
            guide.advance(token)
    return torch.softmax(logits, -1)


def chi2_p_value(p: torch.Tensor, q: torch.Tensor, samples: list[list[int]]) -> float:
    """χ² over every sampled token (tests/test_sampling.py's martingale test): categories by rank under p [N, T, V],
    crossed with whether p ≥ q."""
    from test_sampling import RANK_BINS, categories, martingale_chi2
    from scipy.stats import chi2

    category, count = categories(p, q), (len(RANK_BINS) + 1) * 2
    expected = torch.zeros(*p.shape[:-1], count, dtype=torch.float64).scatter_add_(-1, category, p)
    tokens = torch.tensor(samples)
    observed = torch.nn.functional.one_hot(category.gather(-1, tokens[..., None])[..., 0], count).double()
    statistic, df = martingale_chi2(observed.reshape(-1, count).numpy(), expected.reshape(-1, count).numpy())
    assert (p.gather(-1, tokens[..., None]) > 0).all(), "a token the grammar refuses"
    return chi2.sf(statistic, df)


def test_sampled_structured_output_follows_the_masked_target_distribution_and_a_wrong_sampler_is_caught(
        bundles, checkpoints, tokenizer):
    """χ² over every sampled token: categories by rank under the masked p, crossed with whether p ≥ q (q: the draft's
    masked distribution); a wrong acceptance rule must be caught."""
    from test_sampling import WrongAcceptanceRule

    folder = bundles("llama", draft_seed=1)
    decoder = SpeculativeDecoder(folder)
    target, draft = load_reference(checkpoints("llama")), load_reference(checkpoints("llama", 1))
    checked = decoder.request(PROMPTS[0], structured_outputs=ALTERNATING).structured
    ids, new_tokens, temperature = tokenizer(PROMPTS[0])["input_ids"], 24, 0.7

    def sample(count, seed=0):
        runs = [decoder.generate(ids, new_tokens, 4, temperature=temperature, seed=seed + s,
                                 structured_outputs=ALTERNATING) for s in range(count)]
        return [r.token_ids for r in runs], sum(r.stats.accepted for r in runs) / sum(r.stats.drafted for r in runs)

    def p_value(samples):
        p, q = (masked_distributions(model, lambda: decoder.grammars.guide(checked), ids, samples, temperature)
                for model in (target, draft))
        return chi2_p_value(p, q, samples)

    samples, acceptance = sample(80)
    assert all(len(s) == new_tokens for s in samples) and 0.1 < acceptance < 0.95, acceptance
    default_rng = np.random.default_rng
    np.random.default_rng = lambda seed=None: WrongAcceptanceRule(default_rng(seed))
    try:
        wrong, _ = sample(20, seed=1000)
    finally:
        np.random.default_rng = default_rng
    real, control = p_value(samples), p_value(wrong)
    print(f"p {real:.3g}, control {control:.3g}, acceptance {acceptance:.2f}")
    assert real > 1e-4 and control < 1e-12, (real, control)


def test_a_bundle_without_logit_bias_rows_decodes_as_before_and_refuses_structured_outputs_in_one_line(
        bundles, tokenizer, tmp_path):
    import shutil

    from conftest import compiled_before_penalties
    from specbuild_runtime.serve.protocol import invalid

    old = SpeculativeDecoder(compiled_before_penalties(shutil.copytree(bundles("llama", draft_seed=1), tmp_path / "old")))
    ids = tokenizer(PROMPTS[0])["input_ids"]
    assert old.generate(ids, 12, 3).token_ids == SpeculativeDecoder(bundles("llama", draft_seed=1)).generate(ids, 12, 3).token_ids
    with pytest.raises(RequestError, match=r"^structured_outputs needs a bundle compiled with logit_bias rows; \S+ was "
                                           r"compiled before them: recompile it with `specbuild compile`, or leave "
                                           r"structured_outputs out$") as refused:
        old.generate(ids, 8, structured_outputs={"json_object": True})
    assert invalid(refused.value).param == "structured_outputs"


def test_a_bundle_whose_logit_bias_has_one_row_for_all_is_refused_at_load_in_one_line(bundles, tmp_path):
    """Compiled between logit_bias ([V]) and grammars' rows ([rows, V]): binding rows would fail inside a call."""
    import shutil

    import onnx

    from specbuild_runtime import BundleError
    from specbuild_runtime.manifest import MANIFEST, sha256_file

    folder = shutil.copytree(bundles("llama", draft_seed=1), tmp_path / "one-row")
    data = json.loads((folder / MANIFEST).read_text())
    file = data["engines"]["target"]["file"]
    model = onnx.load(str(folder / file), load_external_data=False)
    bias = next(i for i in model.graph.input if i.name == "logit_bias")
    del bias.type.tensor_type.shape.dim[0]
    onnx.save(model, str(folder / file))
    data["files"][file] = sha256_file(folder / file)
    (folder / MANIFEST).write_text(json.dumps(data))
    with pytest.raises(BundleError, match=r"^engine \S+ does not match the bundle's manifest: its 'logit_bias' input has "
                                          r"one row for every decision, where the runtime gives each row its own; .*"
                                          r"rebuild it with `specbuild compile`$"):
        SpeculativeDecoder(folder)


@pytest.mark.parametrize("value, message", [
    ({"json": 3}, "json must be a JSON schema (an object), not int"),
    ({"regex": "("}, "invalid regex"),
    ({"json": SCHEMA, "regex": "a"}, "must set exactly one of json, regex, choice, grammar, json_object; it sets 2"),
    ({"guided_json": {}}, "it has 'guided_json'"),
    ({"choice": []}, "choice must be a non-empty list of strings"),
    ({"json_object": True, "disable_any_whitespace": "yes"}, "disable_any_whitespace must be true or false"),
    ({"json": {"type": "objec"}}, "Invalid type: objec"),
])
def test_a_bad_structured_outputs_is_refused_in_one_line_naming_it(value, message, bundles):
    decoder = SpeculativeDecoder(bundles("llama", draft_seed=1))
    with pytest.raises(RequestError, match=r"^structured_outputs") as refused:
        decoder.request(PROMPTS[0], structured_outputs=value)
    assert message in str(refused.value) and "\n" not in str(refused.value)
    for options in ({"ignore_eos": True}, {"min_tokens": 2}):
        with pytest.raises(RequestError, match=rf"^structured_outputs ends where its grammar does, at an eos: leave "
                                               rf"{next(iter(options))} out of such a request$"):
            decoder.request(PROMPTS[0], structured_outputs={"json_object": True}, **options)


# A grammar whose Earley row after its "x" holds more items than llguidance's limit (max_items_in_row, 2000), as an
# object schema of ~500 optional properties does at its first key; the drafts propose the "x" at γ >= 1.
PAST_LIMITS = ('start: ("a" | "b" | "c") ("d" | "e") ("f" | "g") "x" alt\nalt: ' + " | ".join(f"r{i}" for i in range(2100))
               + "\n" + "\n".join(f'r{i}: "k" "{i}"' for i in range(2100)))


@pytest.mark.parametrize("options", [{}, {"temperature": 0.8, "seed": 0}], ids=["greedy", "sampled"])
def test_a_grammar_past_llguidances_limits_mid_decoding_ends_the_request_in_one_line_naming_it(options, bundles):
    """The mask allows a token whose consumption takes the parser past its limits: the request raised RuntimeError
    (serve's 500), or, where a draft took it there, ended at an eos ("cdf", "stop") as though its output were complete."""
    decoder = SpeculativeDecoder(bundles("llama", draft_seed=0))
    for gamma in GAMMAS:
        with pytest.raises(RequestError, match=r"^structured_outputs stopped llguidance mid-decoding \(Parser Error: "
                                               r"Current row has 21\d\d items; max is 2000;.*\): simplify") as stopped:
            decoder.generate(PROMPTS[0], NEW_TOKENS, gamma, structured_outputs={"grammar": PAST_LIMITS}, **options)
        assert "\n" not in str(stopped.value)
        assert decoder.generate(PROMPTS[0], 8, gamma, structured_outputs={"regex": "[ab]+"}, **options).text, gamma


def test_sampled_structured_output_is_the_same_through_the_bundles_sampler_as_in_the_engine_graphs(bundles, tokenizer):
    """The greedy-only graphs (CUDA graphs') sample in the bundle's sampler, which takes the same logit_bias rows."""
    engine_graphs, greedy_only = decoders(bundles("llama", draft_seed=1))
    ids = tokenizer(PROMPTS[1])["input_ids"]
    for structured in ({"json": SCHEMA, "disable_any_whitespace": True}, ALTERNATING):
        for gamma in (0, 3, "auto"):
            options = dict(temperature=0.9, top_k=20, seed=11, structured_outputs=structured)
            expected = engine_graphs.generate(ids, 30, gamma, **options)
            assert greedy_only.generate(ids, 30, gamma, **options).token_ids == expected.token_ids, (structured, gamma)
            free = engine_graphs.generate(ids, 30, gamma, temperature=0.9, top_k=20, seed=11)
            assert free.token_ids != expected.token_ids  # it bites


def test_structured_output_with_logit_bias_and_penalties_is_the_target_alone_under_all_three_and_leaves_the_slot_plain(
        bundles, checkpoints, tokenizer):
    """One logit_bias input carries the request's bias and the grammar's mask: the bias is kept under the mask, the
    penalties apply after both (vLLM's order), and the next request on the slot (its prefix reused) has neither."""
    from collections import Counter

    model = load_reference(checkpoints("llama"))
    structured, ids = {"regex": r"[a-e ]{5,30}\."}, tokenizer(PROMPTS[1])["input_ids"]
    bias, (repetition, presence, frequency) = {tokenizer.convert_tokens_to_ids("c"): 4.0}, (1.3, 0.5, 0.3)
    for decoder in decoders(bundles("llama", draft_seed=1)):
        guide, tokens = decoder.grammars.guide(decoder.request(ids, structured_outputs=structured).structured), []
        with torch.no_grad():
            while len(tokens) < NEW_TOKENS:
                logits = model(torch.tensor([ids + tokens])).logits[0, -1].float().numpy()
                for token, value in bias.items():
                    logits[token] += value
                for token in {*ids, *tokens}:  # transformers' RepetitionPenaltyLogitsProcessor
                    logits[token] = logits[token] * repetition if logits[token] < 0 else logits[token] / repetition
                for token, count in Counter(tokens).items():
                    logits[token] -= frequency * count + presence
                tokens.append(int(np.where(guide.masks([])[0], logits, -np.inf).argmax()))
                if tokens[-1] in decoder.eos_token_ids:
                    break
                guide.advance(tokens[-1])
        plain = decoder.generate(ids, 12, 3).token_ids
        for gamma in GAMMAS:
            result = decoder.generate(ids, NEW_TOKENS, gamma, structured_outputs=structured, logit_bias=bias,
                                      repetition_penalty=repetition, presence_penalty=presence,
                                      frequency_penalty=frequency)
            assert result.token_ids == tokens, (decoder.cuda_graphs, gamma)
            assert decoder.generate(ids, 12, 3).token_ids == plain, (decoder.cuda_graphs, gamma)
        # not hollow: the bias and the penalties each change the structured output
        assert decoder.generate(ids, NEW_TOKENS, 3, structured_outputs=structured, logit_bias=bias).token_ids != tokens
        assert decoder.generate(ids, NEW_TOKENS, 3, structured_outputs=structured, repetition_penalty=repetition,
                                presence_penalty=presence, frequency_penalty=frequency).token_ids != tokens
        assert decoder.generate(ids, 12, 3).token_ids == plain, decoder.cuda_graphs  # after a grammar without a bias


def test_a_grammar_is_compiled_once_for_every_request_that_sends_it_and_each_decoding_starts_from_a_copy(
        bundles, tokenizer, monkeypatch):
    """llguidance's compile takes seconds for the largest schemas (docs/runtime.md, structured_outputs), and services send the
    same schema again and again: it ran once a request. Now the decoder keeps it, so a request that sends it again, or
    a request checked once and decoded again (serve's n choices), compiles nothing and decodes alike."""
    decoder = SpeculativeDecoder(bundles("llama", draft_seed=1))
    ids = tokenizer(PROMPTS[0])["input_ids"]
    expected = decoder.generate(ids, NEW_TOKENS, 3, structured_outputs={"json": SCHEMA}).token_ids
    compiles = counted_compiles(monkeypatch)
    assert decoder.generate(ids, NEW_TOKENS, 3, structured_outputs={"json": SCHEMA}).token_ids == expected
    checked = decoder.request(ids, structured_outputs={"json": SCHEMA}).structured
    for _ in range(2):
        assert decoder.generate(ids, NEW_TOKENS, 3, structured_outputs=checked).token_ids == expected
    assert compiles == []
    assert decoder.generate(ids, NEW_TOKENS, 3, structured_outputs={"regex": "[ab]+"}).token_ids != expected
    assert compiles == ["LLMatcher"]


def test_the_decoder_keeps_its_grammar_cache_most_recently_used_grammars_and_compiles_an_evicted_one_again(
        bundles, tokenizer, monkeypatch):
    decoder = SpeculativeDecoder(bundles("llama", draft_seed=1), grammar_cache=2)
    compiles = counted_compiles(monkeypatch)
    choices = [{"choice": [word]} for word in ("alpha", "beta", "gamma")]
    for index in (0, 1, 0, 2):  # alpha is used again before gamma arrives: beta is the least recently used
        decoder.request(PROMPTS[0], structured_outputs=choices[index])
    assert compiles == ["LLMatcher"] * 3
    decoder.request(PROMPTS[0], structured_outputs=choices[0])
    decoder.request(PROMPTS[0], structured_outputs=choices[2])
    assert compiles == ["LLMatcher"] * 3
    checked = decoder.request(PROMPTS[0], structured_outputs=choices[1]).structured  # evicts alpha
    assert compiles == ["LLMatcher"] * 4
    assert decoder.generate(PROMPTS[0], 8, structured_outputs=choices[0]).text == "alpha"
    assert compiles == ["LLMatcher"] * 5
    # a checked request whose grammar was evicted while it waited (serve's queue) compiles it again for its slot
    decoder.request(PROMPTS[0], structured_outputs=choices[2])
    guide = decoder.grammars.guide(checked)
    assert compiles == ["LLMatcher"] * 7
    assert set(np.flatnonzero(guide.masks([])[0])) == set(tokenizer("beta")["input_ids"][:1])
    with pytest.raises(RequestError, match="^grammar_cache must be >= 1, not 0$"):
        SpeculativeDecoder(bundles("llama", draft_seed=1), grammar_cache=0)


def test_requests_in_many_threads_share_one_compiled_grammar_and_get_the_masks_of_a_fresh_compile(bundles, tokenizer,
                                                                                                 monkeypatch):
    """The kept matcher is only copied (llguidance's copies share its lexer behind a mutex, and build on it as they
    go); each thread's guide walks the same tokens, drafts pushed and rolled back, as one compiled for it alone."""
    from concurrent.futures import ThreadPoolExecutor

    from specbuild_runtime.grammar import Grammars

    decoder = SpeculativeDecoder(bundles("llama", draft_seed=1))
    structured = {"json": SCHEMA}
    decoder.request(PROMPTS[0], structured_outputs=structured)
    fresh = Grammars(tokenizer.backend_tokenizer, len(tokenizer), decoder.vocab_size,
                     sorted(decoder.eos_token_ids))
    guide = fresh.guide(decoder.request(PROMPTS[0], structured_outputs=structured).structured)
    path, expected = [], []
    while len(path) < 30:  # a walk through the grammar: a different allowed token each step, never an eos
        allowed = [t for t in np.flatnonzero(guide.masks([])[0]) if t not in decoder.eos_token_ids]
        if not allowed:
            break
        path.append(int(allowed[len(path) * 7 % len(allowed)]))
        guide.advance(path[-1])
    guide = fresh.guide(decoder.request(PROMPTS[0], structured_outputs=structured).structured)
    for step, token in enumerate(path):
        expected.append(guide.masks(path[step:step + 3]))
        guide.advance(token)
    compiles = counted_compiles(monkeypatch)

    def walk(_):
        guide = decoder.grammars.guide(decoder.request(PROMPTS[0], structured_outputs=structured).structured)
        masks = []
        for step, token in enumerate(path):
            masks.append(guide.masks(path[step:step + 3]))
            guide.advance(token)
        return masks

    with ThreadPoolExecutor(8) as pool:
        for masks in pool.map(walk, range(32)):
            assert all(np.array_equal(got, want) for got, want in zip(masks, expected, strict=True))
    assert compiles == [] and len(path) == 30


def test_a_kept_grammar_whose_shared_lexer_reached_llguidances_limit_is_compiled_again(bundles, monkeypatch):
    """The copies of a kept matcher build on the lexer they share, for as long as it is kept: once their walks take it
    to llguidance's max_lexer_states (250k; here 500, for speed), every later copy's mask allowed eos alone (a reply
    of "" ended at an eos, each request for that grammar until it was evicted), while the kept one's is_error stayed
    false. The request whose walk reached the limit ends (a RequestError); the next one compiles the grammar again."""
    import random

    import llguidance

    decoder, compiles = SpeculativeDecoder(bundles("llama", draft_seed=1)), counted_compiles(monkeypatch)
    counted = llguidance.LLMatcher
    monkeypatch.setattr(llguidance, "LLMatcher", lambda *args, **kwargs: counted(
        *args, limits=llguidance.LLParserLimits(max_lexer_states=500), **kwargs))
    structured, rng = {"regex": "[a-z]*a[a-z]{16}"}, random.Random(0)
    checked = decoder.request(PROMPTS[0], structured_outputs=structured).structured
    for walk in range(200):  # distinct walks, each a state of the lexer per byte, until one reaches the limit
        guide = decoder.grammars.guide(checked)
        try:
            for _ in range(30):
                guide.advance(int(rng.choice([t for t in np.flatnonzero(guide.mask()) if t not in guide.eos])))
        except RequestError as stopped:
            assert "lexer error: too many states" in str(stopped)
            break
    else:
        pytest.fail("200 walks did not reach the limit")
    assert compiles == ["LLMatcher"]
    result = decoder.generate(PROMPTS[0], 12, 3, structured_outputs=structured)
    assert result.stats.finish_reason == "max_new_tokens" and re.fullmatch("[a-z]+", result.text), result
    assert compiles == ["LLMatcher"] * 2


def test_an_eos_id_in_the_models_padding_rows_ends_a_structured_output_where_its_grammar_may_end(tokenizer, tmp_path):
    """A generation_config's eos past the tokenizer, in the rows the model pads its vocabulary with (as Qwen's): building
    llguidance's tokenizer raised ValueError (serve's 500). The grammar allows it where it may end, as the tokenizer's
    eos, and no other padding row ever."""
    from conftest import make_checkpoint
    from specbuild.compile import compile_bundle
    from specbuild.recipe import CompileSettings

    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    padded_eos = vocab + 5
    target, draft = (make_checkpoint(tmp_path / role, "llama", tokenizer, seed, vocab_size=vocab + 64,
                                     eos_token_id=[eos, padded_eos]) for role, seed in (("target", 0), ("draft", 1)))
    compile_bundle(CompileSettings(target=target, draft=draft, output=tmp_path / "bundle", max_seq_len=128),
                   show_progress=False)
    decoder = SpeculativeDecoder(tmp_path / "bundle")
    assert decoder.eos_token_ids == {eos, padded_eos}
    choice = {"choice": ["yes", "no"]}
    guide = decoder.grammars.guide(decoder.request(PROMPTS[0], structured_outputs=choice).structured)
    assert guide.masks([])[0][vocab:].sum() == 0
    for token in tokenizer("yes")["input_ids"]:
        guide.advance(token)
    assert set(np.flatnonzero(guide.masks([])[0])) == {eos, padded_eos}  # the grammar has ended: an eos alone
    result = decoder.generate(PROMPTS[0], 8, structured_outputs=choice)
    assert result.text in ("yes", "no") and result.stats.finish_reason == "eos"


def test_the_tokenizer_is_serialized_for_llguidance_once_at_the_first_grammar_when_two_threads_ask_at_once(tokenizer):
    """Not at load (0.1 s of CPU and 8.7 MB kept at a 152k vocabulary, for decoders that never see a grammar), and
    under Grammars' lock: two first grammars at once, in threads sharing a decoder, build one llguidance tokenizer."""
    import threading

    from specbuild_runtime.grammar import Grammars, check_structured_outputs

    class Counted:  # the tokenizer, counting its serializations
        def __init__(self):
            self.calls = 0

        def to_str(self) -> str:
            assert grammars._lock.locked()  # the other first grammar waits for this one's tokenizer
            self.calls += 1
            return tokenizer.backend_tokenizer.to_str()

    source = Counted()
    grammars = Grammars(source, len(tokenizer), len(tokenizer), [tokenizer.eos_token_id])
    assert source.calls == 0
    both, guides = threading.Barrier(2), []

    def first(words: list[str]) -> None:
        both.wait()
        guides.append(grammars.guide(check_structured_outputs({"choice": words}, compile=grammars.compile)))
    threads = [threading.Thread(target=first, args=(words,)) for words in (["yes", "no"], ["pass"])]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert source.calls == 1 and len(guides) == 2


@pytest.mark.parametrize("field", ["structured_outputs", "response_format", "tools"])
def test_structured_outputs_on_a_bundle_whose_eos_ids_are_all_past_its_tokenizer_are_refused_in_one_line_naming_the_field(
        tokenizer, field):
    """llguidance needs an eos within the tokenizer, which it allows where a grammar may end. The refusal begins with
    the field the request used, as the other refusals of a grammar do (serve's 400 takes it for its param)."""
    from specbuild_runtime.grammar import Grammars, Unchecked, check_structured_outputs

    vocab = len(tokenizer)
    grammars = Grammars(tokenizer.backend_tokenizer, vocab, vocab + 64, [vocab + 5])
    value = {"choice": ["yes"]} if field == "structured_outputs" else Unchecked({"json_object": True}, field)
    with pytest.raises(RequestError, match=rf"^{field} needs an eos token within the tokenizer's {vocab} tokens, and "
                                           rf"this bundle's eos ids \[{vocab + 5}\] are all past them .*: leave {field} "):
        check_structured_outputs(value, compile=grammars.compile)


def test_auto_gammas_round_costs_under_a_grammar_include_its_masks_and_are_kept_apart_from_plain_requests(
        bundles, tokenizer, monkeypatch):
    """A grammar builds a mask on the host for each row of a target call: part of that call's cost, in rounds without
    drafts too, where it was left out of auto's unit (policy.Costs). And rounds under a grammar cost otherwise than
    plain ones (drafts hold otherwise too): timed together, auto drafted under a JSON schema where it lost to target-only
    (the demo pair). Here the clock moves only while masks are built, a second each call."""
    from types import SimpleNamespace

    from specbuild_runtime import decode
    from specbuild_runtime.grammar import Guide

    now, masks = [0.0], Guide.masks

    def timed_masks(self, drafts):
        now[0] += 1.0
        return masks(self, drafts)

    monkeypatch.setattr(Guide, "masks", timed_masks)
    monkeypatch.setattr(decode.time, "perf_counter", lambda: now[0])
    decoder = SpeculativeDecoder(bundles("llama", draft_seed=1))
    ids = tokenizer(PROMPTS[0])["input_ids"]
    result = decoder.generate(ids, NEW_TOKENS, structured_outputs={"json": SCHEMA})
    slot = SimpleNamespace(index=0)
    costs = decoder._policy(slot, decoder.request(ids, structured_outputs={"json": SCHEMA})).costs
    assert result.stats.gamma_rounds.get(0) and costs.rounds[0] == 1.0
    assert all(costs.rounds[gamma] in (None, 1.0) for gamma in range(1, decoder.max_gamma + 1))
    plain = decoder._policy(slot, decoder.request(ids)).costs
    assert plain is not costs and plain.rounds[0] is None


def test_auto_checks_no_free_guesses_under_a_grammar(bundles, tokenizer):
    """Under a grammar each guess also costs a mask built on the host, and under the demo pair's JSON schema guesses held
    0.08 tokens a round: auto's rounds without drafts, which should cost what target-only's do, cost more. (The tokens a
    grammar forces it does propose: none here, where a, b or a space may follow any token.)"""
    decoder = SpeculativeDecoder(bundles("llama", draft_seed=1))
    ids = tokenizer(PROMPTS[0])["input_ids"]
    result = decoder.generate(ids, NEW_TOKENS, structured_outputs={"regex": r"[ab ]{8,200}\."})
    assert result.stats.gamma_rounds.get(0, 0) > 4 and result.stats.guessed == 0


@pytest.mark.parametrize("structured", FORCING, ids=lambda s: "-".join(s))
def test_auto_proposes_the_tokens_a_grammar_forces_without_a_draft_call(structured, bundles, tokenizer):
    """Where the grammar spells the reply out (the rest of a choice, an enum's quotes), auto proposes those tokens to the
    target with no draft call, and no catch-up on the prompt, which replies of a few tokens never repaid: on the demo pair
    auto decoded choices at 0.84x target-only. The output stays the target's alone. (Left to the policy, these rounds
    were a fresh policy's, at γ 0 without guesses under a grammar: a target call a token, as target-only.)"""
    decoder = SpeculativeDecoder(bundles("llama"))
    for prompt in PROMPTS[:3]:
        ids = tokenizer(prompt)["input_ids"]
        alone = decoder.generate(ids, NEW_TOKENS, 0, structured_outputs=structured)
        auto = decoder.generate(ids, NEW_TOKENS, "auto", structured_outputs=structured)
        assert auto.token_ids == alone.token_ids and alone.stats.finish_reason == "eos"
        assert auto.stats.drafted == 0 and auto.stats.guessed and auto.stats.rounds < alone.stats.rounds, prompt


def test_auto_proposes_an_eos_a_grammar_spells_out_and_ends_where_target_only_does(bundles, tokenizer):
    """Forced text that is the eos token's (a literal "<|endoftext|>") comes from llguidance as that eos, not as text:
    proposed, the target takes it where target-only takes it, and the request ends there."""
    decoder = SpeculativeDecoder(bundles("llama", draft_seed=1))
    structured = FORCED_EOS
    guide = decoder.grammars.guide(decoder.request(PROMPTS[0], structured_outputs=structured).structured)
    guide.advance(tokenizer("a")["input_ids"][0])
    assert guide.forced(8)[0] == tokenizer.eos_token_id
    ids = tokenizer(PROMPTS[0])["input_ids"]
    alone = decoder.generate(ids, NEW_TOKENS, 0, structured_outputs=structured)
    auto = decoder.generate(ids, NEW_TOKENS, "auto", structured_outputs=structured)
    assert auto.token_ids == alone.token_ids and auto.token_ids[-1] == tokenizer.eos_token_id
    assert auto.stats.guesses_accepted  # the eos was proposed, and taken


@pytest.mark.parametrize("gamma", GAMMAS)
def test_an_eos_tokens_text_in_a_schemas_const_is_that_eos_and_ends_the_reply_there(gamma, bundles):
    """llguidance spells the text a grammar forces as the tokenizer encodes it, special tokens included: a const holding
    "<|endoftext|>" allows that eos alone there, and the reply ends at it, its JSON unfinished (docs/runtime.md,
    structured_outputs; vLLM's guidance backend builds the same llguidance tokenizer)."""
    decoder = SpeculativeDecoder(bundles("llama", draft_seed=1))
    result = decoder.generate(PROMPTS[0], NEW_TOKENS, gamma, structured_outputs={"json": {"const": "x<|endoftext|>y"}})
    assert result.text == '"x' and result.stats.finish_reason == "eos"


def lowest_allowed(guide: Guide, count: int) -> list[int]:
    """Guide.forced's stand-in: up to count tokens, each the lowest id the mask allows after those before, which the
    grammar does not force. llguidance's own forced tokens are always the one token the mask allows (716 of 716
    proposals under structured_alpha's grammars on the demo pair), which the target accepts under any rule."""
    tokens: list[int] = []
    while len(tokens) < count:
        mask = guide.mask()
        if not guide.push(token := int(mask.argmax()), mask):
            break
        tokens.append(token)
    guide.pop(len(tokens))
    return tokens


def proposed_lowest_p_value(target, grammars, checked, prompt: list[int], samples: list[list[int]],
                            temperature: float) -> float:
    """chi2_p_value of samples against the target's masked distributions, where lowest_allowed's token was proposed as
    forced at each position (q one-hot there)."""
    p = masked_distributions(target, lambda: grammars.guide(checked), prompt, samples, temperature)
    q = torch.zeros_like(p)
    for n, sampled in enumerate(samples):
        guide = grammars.guide(checked)
        for t, token in enumerate(sampled):
            q[n, t, lowest_allowed(guide, 1)] = 1
            guide.advance(token)
    return chi2_p_value(p, q, samples)


def test_sampled_proposals_of_a_certain_draft_follow_the_masked_target_distribution_and_accepting_them_is_caught(
        bundles, checkpoints, tokenizer, monkeypatch):
    """Sampled under auto, the tokens a grammar forces are judged as drafts of a draft certain of them (q one-hot at each):
    accepted with probability p(x), else resampled from p without x. Proposed where the mask allows others too, the
    output must follow the target's masked distribution (the χ² above, q the one-hot rows), and accepting them all, right
    for greedy decoding, must be caught."""
    from test_sampling import WrongAcceptanceRule

    monkeypatch.setattr(Guide, "forced", lowest_allowed)
    decoder = SpeculativeDecoder(bundles("llama", draft_seed=1))
    target = load_reference(checkpoints("llama"))
    checked = decoder.request(PROMPTS[0], structured_outputs=ALTERNATING).structured
    ids, new_tokens, temperature = tokenizer(PROMPTS[0])["input_ids"], 24, 0.7

    def sample(count, seed=0):
        runs = [decoder.generate(ids, new_tokens, "auto", temperature=temperature, seed=seed + s,
                                 structured_outputs=ALTERNATING) for s in range(count)]
        assert not any(r.stats.drafted for r in runs)
        return [r.token_ids for r in runs], sum(r.stats.guesses_accepted for r in runs) / sum(r.stats.rounds for r in runs)

    def p_value(samples):
        return proposed_lowest_p_value(target, decoder.grammars, checked, ids, samples, temperature)

    samples, held = sample(80)
    with monkeypatch.context() as patched:
        patched.setattr(np.random, "default_rng",  # proposals judged by uniforms of 0: each the mask allows accepted
                        lambda seed=None, rng=np.random.default_rng: WrongAcceptanceRule(rng(seed), judging=0))
        wrong, _ = sample(20, seed=1000)
    real, control = p_value(samples), p_value(wrong)
    print(f"p {real:.3g}, control {control:.3g}, proposals accepted a round {held:.2f}")
    assert 0.2 < held < 2 and real > 1e-4 and control < 1e-12, (real, control, held)


@pytest.mark.parametrize("gamma", [2, 3])
def test_a_fixed_gamma_proposes_the_forced_tokens_then_drafts_after_them_in_one_target_call_as_target_only_decodes(
        gamma, bundles, tokenizer, monkeypatch):
    """A round proposes the tokens the grammar forces (a schema's keys and quotes), then the drafts the draft makes
    after them (its first call reads them), all in one target call: a fixed γ proposes γ tokens a round, f of them
    forced (but where the request ends within the forced run, or only an eos may follow it). Rounds that mix the two
    decode what target-only does, the draft unrelated (its drafts rejected too)."""
    from specbuild_runtime.slot import EngineSlot

    decoder = SpeculativeDecoder(bundles("llama", draft_seed=1))
    rounds, verified = [], []
    draft, step = decoder._draft, EngineSlot.step

    def recording(slot, feed, total_len, k, uniforms, greedy, guide=None, forced=(), halt=None):
        drafts = draft(slot, feed, total_len, k, uniforms, greedy, guide, forced, halt)
        rounds.append((len(forced), k, len(drafts), guide.ends_after(forced)))
        return drafts

    def verifying(self, tokens, total_len, num_drafts=0, *args, **kwargs):
        if self.engine is decoder.target:
            verified.append(num_drafts)
        return step(self, tokens, total_len, num_drafts, *args, **kwargs)

    monkeypatch.setattr(decoder, "_draft", recording)
    monkeypatch.setattr(EngineSlot, "step", verifying)
    structured, mixed = {"json": SCHEMA, "disable_any_whitespace": True}, 0
    for prompt in PROMPTS[:3]:
        ids = tokenizer(prompt)["input_ids"]
        alone = decoder.generate(ids, NEW_TOKENS, 0, structured_outputs=structured)
        rounds.clear(), verified.clear()
        result = decoder.generate(ids, NEW_TOKENS, gamma, structured_outputs=structured)
        assert result.token_ids == alone.token_ids and result.stats.finish_reason == "eos", prompt
        assert verified[1:] == [forced + drafted for forced, _, drafted, _ in rounds], prompt  # [0]: the prompt's call
        assert all(forced + asked == gamma or ends for forced, asked, _, ends in rounds), (prompt, rounds)
        assert result.stats.guessed and result.stats.drafted and result.stats.rounds < alone.stats.rounds
        # the mask allows a forced token alone: the target takes each (Guide.forced)
        assert result.stats.guesses_accepted == sum(forced for forced, *_ in rounds), prompt
        mixed += sum(bool(forced and drafted) for forced, _, drafted, _ in rounds)
    assert mixed


def test_auto_drafts_after_a_forced_run_only_once_the_draft_has_read_the_prompt(bundles, tokenizer, monkeypatch):
    """A draft call that first catches up on the whole prompt (a sampled request's draft always starts afresh) costs
    more than a reply of a few tokens repays: auto proposes forced runs alone until the draft has read the prompt, in a
    round that drafted without forced tokens, and drafts after them from then on. Here the policy drafts wherever it
    may; the output stays target-only's."""
    from specbuild_runtime.policy import FixedGamma

    decoder = SpeculativeDecoder(bundles("llama", draft_seed=1), prefix_reuse=False)
    rounds = []
    draft = decoder._draft

    def recording(slot, feed, total_len, k, uniforms, greedy, guide=None, forced=(), halt=None):
        rounds.append((total_len - len(feed), len(forced), k))  # the draft's cache's length, forced tokens, k
        return draft(slot, feed, total_len, k, uniforms, greedy, guide, forced, halt)

    structured, mixed = {"json": SCHEMA, "disable_any_whitespace": True}, 0
    for prompt in PROMPTS[:3]:
        ids = tokenizer(prompt)["input_ids"]
        alone = decoder.generate(ids, NEW_TOKENS, 0, structured_outputs=structured)
        rounds.clear()
        with monkeypatch.context() as patched:
            patched.setattr(decoder, "_draft", recording)
            patched.setattr(decoder, "_policy", lambda slot, request: FixedGamma(decoder.max_gamma))
            auto = decoder.generate(ids, NEW_TOKENS, "auto", structured_outputs=structured)
        assert auto.token_ids == alone.token_ids, prompt
        assert rounds[0][1] and not rounds[0][2], (prompt, rounds)  # a forced run first, the prompt unread
        assert all(held >= len(ids) for held, forced, asked in rounds if forced and asked), (prompt, rounds)
        mixed += sum(bool(forced and asked) for held, forced, asked in rounds)
    assert mixed


def test_auto_counts_a_prompt_its_slots_draft_held_but_for_a_rounds_worth_as_read_and_drafts_after_a_forced_run(
        bundles, tokenizer, monkeypatch):
    """Prefix reuse: a chat's next turn finds all but its last tokens in the slot's draft cache, so its first forced
    run is followed by drafts (the catch-up is a round's), not proposed alone as for a prompt the draft never read."""
    from specbuild_runtime.policy import FixedGamma

    decoder = SpeculativeDecoder(bundles("llama", draft_seed=1))
    rounds = []
    draft = decoder._draft

    def recording(slot, feed, total_len, k, uniforms, greedy, guide=None, forced=(), halt=None):
        rounds.append((len(feed), len(forced), k))  # tokens the draft's call reads, forced tokens, k
        return draft(slot, feed, total_len, k, uniforms, greedy, guide, forced, halt)

    structured = {"json": SCHEMA, "disable_any_whitespace": True}
    ids = tokenizer(PROMPTS[0])["input_ids"]
    alone = decoder.generate(ids, NEW_TOKENS, 0, structured_outputs=structured)
    monkeypatch.setattr(decoder, "_draft", recording)
    monkeypatch.setattr(decoder, "_policy", lambda slot, request: FixedGamma(decoder.max_gamma))
    decoder.generate(ids[:-2], 4, 3)  # the draft's cache holds all but the prompt's last 2 tokens, no grammar
    rounds.clear()
    auto = decoder.generate(ids, NEW_TOKENS, "auto", structured_outputs=structured)
    assert auto.token_ids == alone.token_ids
    assert rounds[0][1] and rounds[0][2] and rounds[0][0] <= 3, rounds  # the prompt's last 2 and its first token


@pytest.mark.parametrize("gamma", [4, "auto"])
def test_no_round_drafts_after_a_forced_run_holding_a_stop_token(gamma, bundles, tokenizer, monkeypatch):
    """A stop token among the forced tokens ends the reply there: a draft call after them would only be wasted."""
    from specbuild_runtime.policy import FixedGamma

    decoder = SpeculativeDecoder(bundles("llama", draft_seed=1), prefix_reuse=False)
    rounds = []
    draft = decoder._draft

    def recording(slot, feed, total_len, k, uniforms, greedy, guide=None, forced=(), halt=None):
        rounds.append((total_len, list(forced), k))
        return draft(slot, feed, total_len, k, uniforms, greedy, guide, forced, halt)

    structured = {"json": SCHEMA, "disable_any_whitespace": True}
    ids = tokenizer(PROMPTS[0])["input_ids"]
    monkeypatch.setattr(decoder, "_draft", recording)
    monkeypatch.setattr(decoder, "_policy", lambda slot, request: FixedGamma(decoder.max_gamma))
    reply = decoder.generate(ids, NEW_TOKENS, gamma, structured_outputs=structured).token_ids
    # a token of a run drafts followed, not in the reply before it: the rounds up to that run come again
    stop = next(token for total, forced, k in rounds if k for token in forced if token not in reply[:total - len(ids)])
    alone = decoder.generate(ids, NEW_TOKENS, 0, structured_outputs=structured, stop_token_ids=[stop])
    rounds.clear()
    result = decoder.generate(ids, NEW_TOKENS, gamma, structured_outputs=structured, stop_token_ids=[stop])
    assert result.token_ids == alone.token_ids and result.stats.finish_reason == "stop_token"
    assert any(stop in forced for _, forced, _ in rounds) and not any(k for _, forced, k in rounds if stop in forced)


def test_sampled_forced_tokens_then_drafts_follow_the_masked_target_distribution_and_misplaced_draft_rows_are_caught(
        bundles, checkpoints, tokenizer, monkeypatch):
    """Sampled, a round's forced tokens are judged by one-hot q rows (slot.propose_certain: rows 0..f-1) and the drafts
    after them by the draft's own distributions, rows f..f+k-1. Here a token the mask allows but does not force is
    proposed as forced each round (lowest_allowed), then 2 drafts at γ 3: the output must follow the target's masked
    distribution (the χ² above), and the draft's rows written from row 0 (over the forced one's) must be caught, as must
    accepting every proposal. A seeded request decodes the same tokens again."""
    from test_sampling import WrongAcceptanceRule

    from specbuild_runtime.slot import EngineSlot

    monkeypatch.setattr(Guide, "forced", lambda guide, count: lowest_allowed(guide, min(count, 1)))
    decoder = SpeculativeDecoder(bundles("llama", draft_seed=1))
    target = load_reference(checkpoints("llama"))
    checked = decoder.request(PROMPTS[0], structured_outputs=ALTERNATING).structured
    ids, new_tokens, temperature = tokenizer(PROMPTS[0])["input_ids"], 24, 0.7

    def sample(count, seed=0):
        runs = [decoder.generate(ids, new_tokens, 3, temperature=temperature, seed=seed + s,
                                 structured_outputs=ALTERNATING) for s in range(count)]
        return [r.token_ids for r in runs], runs

    def p_value(samples):
        return proposed_lowest_p_value(target, decoder.grammars, checked, ids, samples, temperature)

    samples, runs = sample(80)
    drafted, accepted = sum(r.stats.drafted for r in runs), sum(r.stats.accepted for r in runs)
    assert all(r.stats.guessed for r in runs) and 0.05 < accepted / drafted < 0.95, (accepted, drafted)
    assert sample(1)[0] == samples[:1]
    step = EngineSlot.step

    def misplaced(self, tokens, total_len, num_drafts=0, uniforms=None, probs_row=0, halt=None):  # rows 0..k-1: before
        return step(self, tokens, total_len, num_drafts, uniforms, max(probs_row - 1, 0), halt)

    with monkeypatch.context() as patched:
        patched.setattr(EngineSlot, "step", misplaced)
        overwritten, _ = sample(20, seed=1000)
    with monkeypatch.context() as patched:
        patched.setattr(np.random, "default_rng",  # every proposal the mask allows accepted
                        lambda seed=None, rng=np.random.default_rng: WrongAcceptanceRule(rng(seed), judging=0))
        wrong, _ = sample(20, seed=2000)
    real, control, rule = p_value(samples), p_value(overwritten), p_value(wrong)
    print(f"p {real:.3g}, misplaced rows {control:.3g}, accepting all {rule:.3g}, α {accepted / drafted:.2f}")
    assert real > 1e-4 and control < 1e-12 and rule < 1e-12, (real, control, rule)


def mixed_rounds(decoder, monkeypatch, temperature: float):
    """Decodes PROMPTS[:3] at γ 3 under ALTERNATING, each round proposing as forced one token the mask allows but does
    not force (lowest_allowed: the target may reject it, as it never rejects llguidance's), then 2 drafts of an
    unrelated draft. Returns, per request: its prompt and tokens; each round's first draft call's first position fed
    and the positions the draft's cache held then, as fed; each round's forced tokens, drafts asked, drafts, tokens the
    target accepted, and what the policy was told (None, or observe's arguments)."""
    from specbuild_runtime.policy import FixedGamma
    from specbuild_runtime.slot import EngineSlot

    monkeypatch.setattr(Guide, "forced", lambda guide, count: lowest_allowed(guide, min(count, 1)))

    class Told(FixedGamma):
        def observe(self, *args, **kwargs):
            rounds[-1][-1] = (args, kwargs)

    draft, step = decoder._draft, EngineSlot.step
    calls, rounds, cache, first = [], [], [], [False]

    def recording(slot, feed, total_len, k, uniforms, greedy, guide=None, forced=(), halt=None):
        first[0] = True
        drafts = draft(slot, feed, total_len, k, uniforms, greedy, guide, forced, halt)
        rounds.append([len(forced), k, len(drafts), None, None])
        return drafts

    def stepping(self, tokens, total_len, num_drafts=0, *args, **kwargs):
        result = step(self, tokens, total_len, num_drafts, *args, **kwargs)
        if self.engine is decoder.target:
            if rounds and rounds[-1][3] is None:
                rounds[-1][3] = result[0]
        else:
            start = total_len - len(tokens)
            if first[0]:  # a round's first: its later ones read its drafts
                calls.append((start, list(cache)))
                first[0] = False
            cache[start:] = tokens
        return result

    monkeypatch.setattr(decoder, "_draft", recording)
    monkeypatch.setattr(EngineSlot, "step", stepping)
    monkeypatch.setattr(decoder, "_policy", lambda slot, request: Told(3))
    requests = []
    for n, prompt in enumerate(PROMPTS[:3]):
        calls, rounds = [], []
        cache.clear()
        result = decoder.generate(prompt, NEW_TOKENS, 3, temperature=temperature, seed=n,
                                  structured_outputs=ALTERNATING)
        requests.append((result.prompt_token_ids + result.token_ids, calls, rounds))
    return requests


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_after_a_round_whose_forced_token_or_draft_was_rejected_the_draft_is_fed_exactly_what_its_cache_lacks(
        temperature, bundles, monkeypatch):
    """A round's draft reads the forced tokens and all but its last draft; the target keeps those it accepts. The next
    draft call must start at the first position where the draft's cache differs from the reply: later, and the draft
    drafts from tokens the reply does not hold; earlier, it computes again what it has."""

    decoder = SpeculativeDecoder(bundles("llama", draft_seed=1), prefix_reuse=False)
    seen = set()
    for reply, calls, rounds in mixed_rounds(decoder, monkeypatch, temperature):
        for start, cache in calls:
            held = next((i for i, (a, b) in enumerate(zip(cache, reply)) if a != b), min(len(cache), len(reply)))
            assert start == held, (start, held, reply, calls)
        seen |= {"forced" if accepted < forced else "draft" for forced, _, drafted, accepted, _ in rounds
                 if drafted and accepted < forced + drafted}
    assert seen == {"forced", "draft"}  # rejected in rounds that drafted


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_a_round_with_forced_tokens_tells_the_policy_of_its_drafts_as_a_catch_up_and_nothing_where_one_was_rejected(
        temperature, bundles, monkeypatch):
    """The policy judges the draft: a round that drafted after forced tokens tells it of the drafts alone, as a catch-up
    (the draft's call also read the forced tokens) with no guesses; one whose forced token was rejected judged no draft,
    and one of forced tokens alone was the grammar's: neither tells it anything."""

    decoder = SpeculativeDecoder(bundles("llama", draft_seed=1), prefix_reuse=False)
    seen = set()
    for _, _, rounds in mixed_rounds(decoder, monkeypatch, temperature):
        for forced, asked, drafted, accepted, told in rounds:
            if forced and not (asked and accepted >= forced):
                assert told is None, (forced, asked, accepted, told)
                seen.add("rejected" if asked else "forced alone")
            elif forced:
                (told_drafted, told_accepted, _, _, catching_up, held), _ = told
                assert (told_drafted, told_accepted, catching_up, held) == (asked, accepted - forced, True, None)
                seen.add("told")
    assert seen == {"rejected", "forced alone", "told"}


@pytest.mark.parametrize("structured", FORCING + [FORCED_EOS], ids=lambda s: "-".join(s))
def test_auto_sampled_proposes_the_tokens_a_grammar_forces_without_a_draft_call_and_a_seed_reproduces(
        structured, bundles, tokenizer, monkeypatch):
    """Sampled, as greedy, auto proposes the tokens a grammar forces (an eos it spells out too) with no draft call, judged
    as a certain draft's (slot.propose_certain): fewer target calls than tokens. A seeded request decodes the same
    tokens again."""
    asked = []
    draft = SpeculativeDecoder._draft

    def counted(slot, feed, total_len, k, *rest):
        asked.append(k)
        return draft(slot, feed, total_len, k, *rest)

    monkeypatch.setattr(SpeculativeDecoder, "_draft", staticmethod(counted))
    decoder = SpeculativeDecoder(bundles("llama"))
    for prompt in PROMPTS[:3]:
        ids = tokenizer(prompt)["input_ids"]
        seeded, again, unseeded = (decoder.generate(ids, NEW_TOKENS, "auto", temperature=0.8, seed=seed,
                                                    structured_outputs=structured) for seed in (7, 7, None))
        assert seeded.token_ids == again.token_ids, prompt
        for result in (seeded, unseeded):
            assert result.stats.finish_reason == "eos" and result.stats.drafted == 0, prompt
            assert result.stats.guessed and result.stats.rounds < result.stats.generated_tokens, prompt
    assert not any(asked)


def test_auto_sampled_copies_the_rows_of_forced_tokens_to_the_device_in_its_turn_among_captured_calls(bundles, monkeypatch):
    """onnxruntime captures CUDA graphs in global mode: a copy to the device from another thread during a capture breaks
    it, so each copy of a slot whose engines capture holds engine.calls, the forced tokens' q rows (propose_certain) too."""
    from test_slot import forced_captures

    from specbuild_runtime.slot import Buffer

    decoder = forced_captures(bundles("llama"))
    turn, outside = decoder.target.calls, []
    push = Buffer.push

    def checked(buffer):
        if not turn.locked():
            outside.append(buffer.host.shape)
        push(buffer)

    monkeypatch.setattr(Buffer, "push", checked)
    result = decoder.generate(PROMPTS[0], NEW_TOKENS, "auto", temperature=0.8, seed=3,
                              structured_outputs=FORCING[0])
    assert result.stats.guessed and not outside, outside
