"""Prefix reuse: a request starts where its prompt leaves the tokens its slot's caches hold from earlier
requests, and decodes what a fresh decoder decodes."""

import pytest

from conftest import PROMPTS
from specbuild_runtime import DeviceError, SpeculativeDecoder, load_manifest
from specbuild_runtime.slot import EngineSlot, fixed_rows

NEW_TOKENS = 20
SETTINGS = [({}, 0), ({}, 4), ({}, "auto"), ({"temperature": 1.0, "seed": 3}, 0), ({"temperature": 1.0, "seed": 3}, 4),
            ({"temperature": 0.7, "top_k": 8, "seed": 5}, "auto")]
IDS = ["greedy-0", "greedy-4", "greedy-auto", "sampled-0", "sampled-4", "sampled-auto"]


@pytest.fixture(scope="module")
def bundle(bundles):
    return bundles("llama", draft_seed=1)  # a draft of its own: rounds with rejections


@pytest.fixture
def target_rows(monkeypatch):
    """[rows] of every target call: the work the target computes."""
    rows = []
    run = EngineSlot._compute_rows

    def spy(self, first, total_len, *args):
        if self.engine.info.role == "target":
            rows.append(total_len - first)
        return run(self, first, total_len, *args)

    monkeypatch.setattr(EngineSlot, "_compute_rows", spy)
    return rows


def second_turn(decoder, first) -> list[int]:
    """A chat's next request: the conversation so far, then a new message."""
    return [*first.prompt_token_ids, *first.token_ids, *decoder.encode(PROMPTS[1])]


@pytest.mark.parametrize("sampling, gamma", SETTINGS, ids=IDS)
def test_a_second_turn_decodes_what_a_fresh_decoder_decodes_computing_only_what_is_new(bundle, target_rows, sampling,
                                                                                       gamma):
    decoder = SpeculativeDecoder(bundle)
    first = decoder.generate(PROMPTS[0], NEW_TOKENS, gamma, **sampling)
    prompt = second_turn(decoder, first)
    target_rows.clear()
    reused = decoder.generate(prompt, NEW_TOKENS, gamma, **sampling)
    rows_reused, prompt_rows = sum(target_rows), target_rows[0]
    target_rows.clear()
    fresh = SpeculativeDecoder(bundle).generate(prompt, NEW_TOKENS, gamma, **sampling)
    assert reused.token_ids == fresh.token_ids
    # The target holds the first turn but its last token (and maybe drafts after it).
    assert reused.stats.cached_prompt_tokens >= len(first.prompt_token_ids) + len(first.token_ids) - 1
    assert fresh.stats.cached_prompt_tokens == 0
    assert rows_reused < sum(target_rows)
    assert prompt_rows <= len(prompt) - reused.stats.cached_prompt_tokens + 1  # a row re-fed for an even call, at most


@pytest.mark.parametrize("sampling, gamma", SETTINGS[1::2], ids=IDS[1::2])
def test_the_same_prompt_again_recomputes_only_its_last_token_and_decodes_the_same(bundle, target_rows, sampling, gamma):
    decoder = SpeculativeDecoder(bundle)
    ids = decoder.encode(PROMPTS[5])
    expected = decoder.generate(ids, NEW_TOKENS, gamma, **sampling)
    target_rows.clear()
    again = decoder.generate(ids, NEW_TOKENS, gamma, **sampling)
    assert again.token_ids == expected.token_ids
    assert again.stats.cached_prompt_tokens == len(ids) - 1  # one row left to compute: its logits give the first token
    assert target_rows[0] == 2  # re-feeding one row: never a row alone (slot.NEVER_ALONE)


def test_a_stream_closed_midway_leaves_what_it_computed_and_the_next_request_decodes_exactly(bundle):
    decoder = SpeculativeDecoder(bundle)
    stream = decoder.stream(PROMPTS[2], NEW_TOKENS, gamma=4)
    taken = [next(stream) for _ in range(5)]
    stream.close()
    prompt = [*decoder.encode(PROMPTS[2]), *taken, *decoder.encode(PROMPTS[6])]
    reused = decoder.generate(prompt, NEW_TOKENS, gamma=4)
    assert reused.stats.cached_prompt_tokens > len(decoder.encode(PROMPTS[2]))
    assert reused.token_ids == SpeculativeDecoder(bundle).generate(prompt, NEW_TOKENS, gamma=4).token_ids


def test_a_call_that_failed_midway_is_not_reused(bundle, monkeypatch):
    """A call that raised after writing the cache (here: K/V of other tokens than the slot records) leaves only the
    positions before it to reuse."""
    decoder = SpeculativeDecoder(bundle)
    call, failed = EngineSlot._call, []

    def failing(self, first, total_len, *args):
        if self.engine.info.role != "target" or first == 0 or failed:
            return call(self, first, total_len, *args)
        failed.append((first, total_len, self._fed[:total_len]))
        recorded = self._fed[first:total_len]
        self._fed[first:total_len] = [1] * (total_len - first)  # what the cache then holds
        try:
            call(self, first, total_len, *args)
        finally:
            self._fed[first:total_len] = recorded
        raise DeviceError("onnxruntime failed midway")

    monkeypatch.setattr(EngineSlot, "_call", failing)
    with pytest.raises(DeviceError, match="midway"):
        decoder.generate(PROMPTS[0], NEW_TOKENS, gamma=4)
    first, total_len, fed = failed[0]
    prompt = [*fed, *decoder.encode(PROMPTS[1])]  # the tokens the slot records, past the failed call's first
    reused = decoder.generate(prompt, NEW_TOKENS, gamma=4)
    assert reused.stats.cached_prompt_tokens <= first
    assert reused.token_ids == SpeculativeDecoder(bundle).generate(prompt, NEW_TOKENS, gamma=4).token_ids


def test_a_prompt_that_differs_from_the_first_token_reuses_nothing(bundle):
    decoder = SpeculativeDecoder(bundle)
    first = decoder.generate(PROMPTS[0], NEW_TOKENS)
    prompt = second_turn(decoder, first)
    prompt[0] = (prompt[0] + 1) % decoder.vocab_size
    other = decoder.generate(prompt, NEW_TOKENS)
    assert other.stats.cached_prompt_tokens == 0
    assert other.token_ids == SpeculativeDecoder(bundle).generate(prompt, NEW_TOKENS).token_ids


def test_a_request_reuses_only_what_the_slot_it_lands_on_holds(bundle):
    decoder = SpeculativeDecoder(bundle, parallel=2)
    first = decoder.generate(PROMPTS[0], NEW_TOKENS)  # slot A, which the stream below holds meanwhile
    prompt = second_turn(decoder, first)
    held = decoder.stream(PROMPTS[0], NEW_TOKENS)
    next(held)
    elsewhere = decoder.generate(prompt, NEW_TOKENS)  # slot B: it held nothing
    held.close()
    assert elsewhere.stats.cached_prompt_tokens == 0
    assert elsewhere.token_ids == SpeculativeDecoder(bundle).generate(prompt, NEW_TOKENS).token_ids


def test_fixed_row_calls_and_the_opt_out_feed_every_prompt_whole(bundle):
    """GPUs' fixed rows: a prompt's head is one call of any size, whose kernels may round otherwise than the
    calls that wrote those positions before, so nothing is reused there."""
    fixed = SpeculativeDecoder(bundle, target_rows=fixed_rows(load_manifest(bundle).gamma))
    for decoder in (fixed, SpeculativeDecoder(bundle, prefix_reuse=False)):
        first = decoder.generate(PROMPTS[0], NEW_TOKENS)
        assert decoder.generate(second_turn(decoder, first), NEW_TOKENS).stats.cached_prompt_tokens == 0


def two_chats(decoder):
    """Chats A and B decoded at once over two slots, A's slot freed first: [(prompt ids, output ids)] of each."""
    chats = [decoder.encode(PROMPTS[0]), decoder.encode(PROMPTS[2])]
    streams = [decoder.stream(ids, NEW_TOKENS) for ids in chats]
    outputs = [[next(stream)] for stream in streams]  # each holds a slot of its own meanwhile
    for stream, output in zip(streams, outputs):
        output.extend(stream)
    return list(zip(chats, outputs))


def test_a_chat_turn_takes_the_free_slot_that_holds_its_conversation(bundle):
    """Two chats interleaved over two slots: each next turn lands on the slot that decoded its last, though the
    other chat's slot came free last."""
    decoder = SpeculativeDecoder(bundle, parallel=2)
    for ids, output in two_chats(decoder):
        prompt = [*ids, *output, *decoder.encode(PROMPTS[1])]
        turn = decoder.generate(prompt, NEW_TOKENS)
        assert turn.stats.cached_prompt_tokens >= len(ids) + len(output) - 1
        assert turn.token_ids == SpeculativeDecoder(bundle).generate(prompt, NEW_TOKENS).token_ids


def test_a_new_chat_takes_the_slot_answered_longest_ago_among_equals(bundle):
    """A new chat sharing nothing with two cached ones takes A's slot (freed first), so B, answered last and the
    likeliest to send its next turn, keeps its cache (it took B's: the last freed)."""
    decoder = SpeculativeDecoder(bundle, parallel=2)
    (_, _), (ids, output) = two_chats(decoder)
    assert decoder.generate(decoder.encode(PROMPTS[3]), NEW_TOKENS).stats.cached_prompt_tokens == 0
    turn = decoder.generate([*ids, *output, *decoder.encode(PROMPTS[1])], NEW_TOKENS)
    assert turn.stats.cached_prompt_tokens >= len(ids) + len(output) - 1


def scoring(decoder: SpeculativeDecoder, ids: list[int], top: int = 1):
    return decoder.generate(ids, 0, prompt_logprobs=top)


def context_and_choices(decoder) -> tuple[list[int], list[list[int]]]:
    """A multiple-choice question as lm-evaluation-harness scores it: a context (odd, 150 tokens), then each choice
    (choices that differ from their first token, of 1 to 9 tokens)."""
    context = decoder.encode("\n".join(PROMPTS * 3))[:151]
    choices = [decoder.encode(text) for text in ("import os", "x", "while True:", PROMPTS[4])]
    assert len(context) == 151 and len({choice[0] for choice in choices}) == len(choices)
    return context, choices


@pytest.mark.parametrize("graphs", [False, True], ids=["engine graphs", "greedy-only graphs (max γ + 1-row calls)"])
def test_a_choice_scored_after_its_context_computes_only_its_own_rows_and_the_bits_of_one_scored_whole(bundle, graphs,
                                                                                                     target_rows):
    decoder = SpeculativeDecoder(bundle, cuda_graphs=graphs)
    whole = SpeculativeDecoder(bundle, cuda_graphs=graphs, prefix_reuse=False)
    context, choices = context_and_choices(decoder)
    for n, choice in enumerate(choices):
        target_rows.clear()
        scored, rows = scoring(decoder, context + choice), sum(target_rows)
        assert scored.prompt_logprobs == scoring(whole, context + choice).prompt_logprobs
        if n:  # the context but its last token, whose row scores the choice's first token
            assert scored.stats.cached_prompt_tokens == len(context) - 1
            assert rows <= 2 * (len(choice) + 1)  # a row re-fed for an even call, at most, per call


def test_a_prompt_equal_to_or_within_the_scored_one_computes_no_row_it_holds(bundle, target_rows):
    decoder, whole = SpeculativeDecoder(bundle), SpeculativeDecoder(bundle, prefix_reuse=False)
    context, choices = context_and_choices(decoder)
    scoring(decoder, context + choices[0])
    for prompt in (context + choices[0], context, context[:100] + choices[1]):
        target_rows.clear()
        scored, rows = scoring(decoder, prompt), sum(target_rows)
        assert scored.prompt_logprobs == scoring(whole, prompt).prompt_logprobs
        if prompt[-1] != choices[1][-1]:  # every row held: no target call
            assert rows == 0 and scored.stats.cached_prompt_tokens == len(prompt) - 1
        else:  # the choice's rows after the first 100 tokens
            assert scored.stats.cached_prompt_tokens == 99 and rows <= len(choices[1]) + 2


def test_another_prompt_or_top_scores_whole_and_a_generation_between_leaves_what_the_cache_still_holds(bundle,
                                                                                                       target_rows):
    """Records hold for the same tokens at the same top alone; rows they give are fed from where the cache (here
    rewritten past the context by a generation) stops holding the prompt."""
    decoder, whole = SpeculativeDecoder(bundle), SpeculativeDecoder(bundle, prefix_reuse=False)
    context, choices = context_and_choices(decoder)
    other = decoder.encode(PROMPTS[7])  # from its first token on another text
    steps = [(context + choices[0], 1, 0), (other, 1, 0), (context + choices[1], 1, 0), (context + choices[1], 3, 0)]
    for prompt, top, cached in steps:
        scored = scoring(decoder, prompt, top)
        assert scored.prompt_logprobs == scoring(whole, prompt, top).prompt_logprobs
        assert scored.stats.cached_prompt_tokens == cached
    decoder.generate(context + choices[0], NEW_TOKENS)
    target_rows.clear()
    scored, rows = scoring(decoder, context + choices[1], 3), sum(target_rows)
    assert scored.prompt_logprobs == scoring(whole, context + choices[1], 3).prompt_logprobs
    assert scored.stats.cached_prompt_tokens == len(context) and rows <= len(choices[1]) + 1


def test_threads_scoring_choices_over_two_slots_get_the_bits_of_prompts_scored_whole(bundle):
    from concurrent.futures import ThreadPoolExecutor

    decoder, whole = SpeculativeDecoder(bundle, parallel=2), SpeculativeDecoder(bundle, prefix_reuse=False)
    context, choices = context_and_choices(decoder)
    questions = [context, context[40:], decoder.encode("\n".join(PROMPTS[::-1]))[:120]]
    prompts = [question + choice for question in questions for choice in choices]

    def question(q: int) -> list:
        return [scoring(decoder, prompt).prompt_logprobs for prompt in prompts[q * len(choices):(q + 1) * len(choices)]]

    with ThreadPoolExecutor(len(questions)) as threads:
        scored = [records for each in threads.map(question, range(len(questions))) for records in each]
    assert scored == [scoring(whole, prompt).prompt_logprobs for prompt in prompts]
