"""Each token's logprobs: the target's raw log-softmax for the row that decided it, whatever γ, the draft or the
grouping of rows into calls, and only for requests that ask."""

import asyncio
import math
import threading
import time
from contextlib import closing

import numpy as np
import onnx
import pytest

from conftest import PROMPTS
from specbuild.compile.reference import load_reference
from specbuild_runtime import RequestError, SpeculativeDecoder, Stats, TokenLogprobs
from specbuild_runtime.decode import SCORED_ROWS
from specbuild_runtime.logprobs import LOGPROB_FLOOR, floored, token_logprobs
from specbuild_runtime.manifest import load_manifest
from specbuild_runtime.slot import fixed_rows

NEW_TOKENS = 23  # not a multiple of γ+1 for any γ tested: max-new-tokens lands inside a round


def transformers_log_softmax(model, ids: list[int], tokens: list[int]) -> np.ndarray:
    """torch.log_softmax of transformers' fp32 logits at the rows that predict each of tokens after ids."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([ids + tokens])).logits[0, len(ids) - 1:-1].float()
    return torch.log_softmax(logits, dim=-1).numpy()


@pytest.mark.parametrize("sampling", [{}, dict(temperature=0.7, top_k=5, top_p=0.9, seed=3)], ids=["greedy", "sampled"])
def test_logprobs_are_transformers_log_softmax_before_temperature_top_k_and_top_p(sampling, bundles, checkpoints,
                                                                                    tokenizer):
    decoder = SpeculativeDecoder(bundles("llama", draft_seed=1))
    model = load_reference(checkpoints("llama"))
    for prompt in PROMPTS[:3]:
        ids = tokenizer(prompt)["input_ids"]
        result = decoder.generate(ids, NEW_TOKENS, gamma=3, logprobs=5, **sampling)
        expected = transformers_log_softmax(model, ids, result.token_ids)
        assert [r.token_id for r in result.logprobs] == result.token_ids
        for record, row in zip(result.logprobs, expected):
            assert record.logprob == pytest.approx(row[record.token_id], abs=1e-5)
            assert [token for token, _ in record.top] == np.argsort(-row, kind="stable")[:5].tolist()
            assert np.allclose([logprob for _, logprob in record.top], np.sort(row)[::-1][:5], atol=1e-5)


@pytest.mark.parametrize("draft_seed", [0, 1], ids=["same draft", "unrelated draft"])
def test_logprobs_are_the_same_bits_at_every_gamma_as_the_target_alone(draft_seed, bundles, tokenizer):
    decoder = SpeculativeDecoder(bundles("llama", draft_seed=draft_seed), draft_steps=True)
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        alone = decoder.generate(ids, NEW_TOKENS, gamma=0, logprobs=20)
        for gamma in (1, 2, 3, 5, 8, "auto"):
            assert decoder.generate(ids, NEW_TOKENS, gamma=gamma, logprobs=20).logprobs == alone.logprobs, (gamma, prompt)


def test_a_seeded_sampled_request_gets_the_same_logprobs_with_or_without_asking_for_them_at_any_gamma(bundles, tokenizer):
    decoder = SpeculativeDecoder(bundles("llama", draft_seed=1))
    ids = tokenizer(PROMPTS[1])["input_ids"]
    for gamma in (0, 2, "auto"):
        plain = decoder.generate(ids, NEW_TOKENS, gamma=gamma, temperature=0.8, seed=5)
        asked = decoder.generate(ids, NEW_TOKENS, gamma=gamma, temperature=0.8, seed=5, logprobs=0)
        assert asked.token_ids == plain.token_ids and plain.logprobs is None
        assert [r.token_id for r in asked.logprobs] == asked.token_ids and all(r.top == () for r in asked.logprobs)


def test_a_request_after_one_with_logprobs_binds_the_outputs_a_fresh_slot_binds(bundles, tokenizer):
    """A request that does not ask runs as before logprobs existed: the target's calls fetch no logits."""
    fresh, used = (SpeculativeDecoder(bundles("llama", draft_seed=1)) for _ in range(2))
    ids = tokenizer(PROMPTS[0])["input_ids"]
    used.generate(ids, 8, gamma=3, logprobs=2)
    outputs = []
    for decoder in (fresh, used):
        assert decoder.generate(ids, 8, gamma=3).token_ids == fresh.generate(ids, 8, gamma=3).token_ids
        with decoder.slots.take() as slot:
            outputs.append(len(slot.target.binding.get_outputs()))
    assert outputs[0] == outputs[1]


def test_stream_and_astream_yield_each_tokens_record_and_stream_request_pairs_them_with_their_text(bundles, tokenizer):
    decoder = SpeculativeDecoder(bundles("llama", draft_seed=1))
    ids = tokenizer(PROMPTS[3])["input_ids"]
    whole = decoder.generate(ids, NEW_TOKENS, logprobs=4)
    assert list(decoder.stream(ids, NEW_TOKENS, logprobs=4)) == whole.logprobs

    async def collected():
        return [record async for record in decoder.astream(ids, NEW_TOKENS, logprobs=4)]
    assert asyncio.run(collected()) == whole.logprobs
    assert asyncio.run(decoder.agenerate(ids, NEW_TOKENS, logprobs=4)).logprobs == whole.logprobs
    for every_token in (False, True):
        pairs = list(decoder.stream_request(decoder.request(ids, NEW_TOKENS, logprobs=4), Stats(), every_token))
        assert "".join(delta for delta, _ in pairs) == whole.text
        assert [record for _, records in pairs for record in records] == whole.logprobs
        if every_token:  # a pair after each token, then the text held back to the end, if any
            assert [len(records) for _, records in pairs[:NEW_TOKENS]] == [1] * NEW_TOKENS
        else:
            assert all(delta for delta, _ in pairs)


def test_a_stop_string_keeps_the_logprobs_of_the_tokens_up_to_the_one_that_completed_it(bundles, tokenizer):
    decoder = SpeculativeDecoder(bundles("llama", draft_seed=1))
    ids = tokenizer(PROMPTS[2])["input_ids"]
    free = decoder.generate(ids, NEW_TOKENS, logprobs=1)
    stop = free.text[len(free.text) // 2:][:3]
    cut = decoder.generate(ids, NEW_TOKENS, stop=[stop], logprobs=1)
    assert cut.stats.finish_reason == "stop" and len(cut.token_ids) < len(free.token_ids)
    assert cut.logprobs == free.logprobs[:len(cut.token_ids)]
    pairs = list(decoder.stream_request(decoder.request(ids, NEW_TOKENS, stop=[stop], logprobs=1), Stats()))
    assert [record for _, records in pairs for record in records] == cut.logprobs


def test_a_bundle_compiled_before_engines_gave_logits_decodes_and_refuses_logprobs_in_one_line(bundles, tokenizer,
                                                                                               tmp_path):
    import shutil

    old = tmp_path / "old"
    shutil.copytree(bundles("llama", draft_seed=1), old)
    for file in ("target.onnx", "draft.onnx"):  # as compiled before: no logits output
        model = onnx.load(str(old / file), load_external_data=False)
        kept = [output for output in model.graph.output if output.name != "logits"]
        del model.graph.output[:]
        model.graph.output.extend(kept)
        onnx.save(model, str(old / file))
    decoder = SpeculativeDecoder(old, check_digests=False)
    ids = tokenizer(PROMPTS[0])["input_ids"]
    assert decoder.generate(ids, 8, gamma=3).token_ids == SpeculativeDecoder(bundles("llama", 1)).generate(ids, 8, gamma=3).token_ids
    with pytest.raises(RequestError, match=r"^\S+ was compiled before its engines gave their logits, so it gives no "
                                           r"logprobs: recompile it with `specbuild compile`$"):
        decoder.generate(ids, 8, logprobs=0)


@pytest.mark.parametrize("logprobs,message", [
    (21, "logprobs must be from 0 to 20"), (-1, "logprobs must be from 0 to 20"), (True, "logprobs must be a whole number"),
    (2.0, "logprobs must be a whole number"),
])
def test_logprobs_beyond_twenty_or_not_a_whole_number_are_refused(logprobs, message, bundles):
    decoder = SpeculativeDecoder(bundles("llama", draft_seed=1))
    with pytest.raises(RequestError, match=message):
        decoder.request("def f():", logprobs=logprobs)


def test_a_records_top_breaks_ties_by_the_lower_id_and_a_ruled_out_token_is_minus_infinity():
    logits = np.array([1.0, 3.0, 3.0, -np.inf, 3.0, 0.5], np.float32)
    record = token_logprobs(logits, 3, top=2)
    z = math.log(math.exp(1) + 3 * math.exp(3) + math.exp(0.5))
    assert record == TokenLogprobs(3, -math.inf, ((1, pytest.approx(3 - z)), (2, pytest.approx(3 - z))), 6)
    assert token_logprobs(logits, 2, top=0).rank == 3  # ties count, as vLLM ranks them
    assert token_logprobs(logits, 0, top=20).top[-1][0] == 3  # every token, however few


@pytest.mark.filterwarnings("error::RuntimeWarning")  # a server would print numpy's warning for each such row
def test_a_row_holding_nan_or_plus_infinity_gives_nan_logprobs_written_as_the_floor_as_minus_infinity_is():
    for row in ([1.0, np.nan, 3.0], [1.0, np.inf, 3.0]):
        record = token_logprobs(np.array(row, np.float32), 0, top=1)
        assert math.isnan(record.logprob) and floored(record.logprob) == LOGPROB_FLOOR
    assert floored(-math.inf) == LOGPROB_FLOOR and floored(-1.5) == -1.5 and floored(-1e5) == LOGPROB_FLOOR


def test_a_rows_logprobs_are_the_same_bits_wherever_the_row_sits_in_memory():
    """Rows of a call's logits start at any offset where the vocabulary is no multiple of 16 (GPT-2's 50257): no
    numpy kernel may round them by their alignment."""
    row = (np.random.default_rng(0).standard_normal(50257) * 4).astype(np.float32)
    expected = token_logprobs(row, 11, top=20)
    for offset in range(1, 17):
        buffer = np.zeros(offset + len(row), np.float32)
        buffer[offset:] = row
        assert token_logprobs(buffer[offset:], 11, top=20) == expected


def prompt_of(tokenizer, length: int) -> list[int]:
    """The first `length` token ids of the test prompts joined."""
    ids = tokenizer("\n".join(PROMPTS * 20))["input_ids"][:length]
    assert len(ids) == length
    return ids


@pytest.mark.parametrize("rows", ["cpu", "fixed", "graphs"], ids=["even calls (CPU)", "fixed rows (GPUs)",
                                                                  "fixed rows, greedy-only graphs (CUDA graphs)"])
def test_prompt_logprobs_are_transformers_log_softmax_for_prompts_short_long_and_near_the_context(rows, bundles,
                                                                                                checkpoints, tokenizer):
    bundle = bundles("llama", draft_seed=1)
    decoder = SpeculativeDecoder(bundle, target_rows=fixed_rows(load_manifest(bundle).gamma) if rows != "cpu" else None,
                                 cuda_graphs=rows == "graphs")
    for engine in (decoder.target, decoder.draft) if rows == "graphs" else ():
        engine.captures = True  # graph ids named as on CUDA
    model = load_reference(checkpoints("llama"))
    # one token (nothing to score), fewer rows than a call, one call's, one more (a GPU's, the CPU's), and up to the end
    for length in (1, 2, 3, *(n + k for n in (decoder.max_gamma + 1, SCORED_ROWS) for k in (-1, 0, 1)), decoder.max_seq_len):
        ids = prompt_of(tokenizer, length)
        result = decoder.generate(ids, 0, prompt_logprobs=3)
        assert result.token_ids == [] and result.stats.finish_reason == "max_new_tokens"
        assert result.prompt_logprobs[0] is None and len(result.prompt_logprobs) == length
        expected = transformers_log_softmax(model, ids[:1], ids[1:])
        for record, token, row in zip(result.prompt_logprobs[1:], ids[1:], expected):
            assert record.token_id == token
            assert record.logprob == pytest.approx(row[token], abs=1e-5), length
            assert [t for t, _ in record.top] == np.argsort(-row, kind="stable")[:3].tolist()
            assert np.allclose([logprob for _, logprob in record.top], np.sort(row)[::-1][:3], atol=1e-5)


@pytest.mark.parametrize("graphs", [False, True], ids=["engine graphs", "greedy-only graphs and the sampler, fixed rows"])
@pytest.mark.parametrize("sampling", [{}, dict(temperature=0.8, seed=5)], ids=["greedy", "sampled"])
def test_a_prompt_scores_the_bits_its_tokens_get_generated_and_generation_after_it_is_unchanged(sampling, graphs,
                                                                                                 bundles, tokenizer):
    bundle = bundles("llama", draft_seed=1)
    rows = fixed_rows(load_manifest(bundle).gamma) if graphs else None
    decoder = SpeculativeDecoder(bundle, cuda_graphs=graphs, target_rows=rows)
    for engine in (decoder.target, decoder.draft) if graphs else ():
        engine.captures = True  # graph ids named as on CUDA
    for prompt in PROMPTS[:4]:
        ids = tokenizer(prompt)["input_ids"]
        plain = decoder.generate(ids, NEW_TOKENS, logprobs=2, **sampling)
        scored = decoder.generate(ids, NEW_TOKENS, logprobs=2, prompt_logprobs=2, **sampling)
        assert scored.token_ids == plain.token_ids and scored.logprobs == plain.logprobs
        again = decoder.generate(ids + plain.token_ids, 0, prompt_logprobs=2)
        assert again.prompt_logprobs[len(ids):] == plain.logprobs, prompt


def test_a_scored_prompt_leaves_the_logits_buffer_a_logprobs_request_makes_and_later_requests_unchanged(bundles,
                                                                                                       tokenizer):
    """Scoring on the CPU grows the buffer to SCORED_ROWS rows (~39 MB a slot at a 152k vocabulary): given back."""
    fresh, scored = (SpeculativeDecoder(bundles("llama", draft_seed=1)) for _ in range(2))
    ids = prompt_of(tokenizer, min(scored.max_seq_len, 2 * SCORED_ROWS + 1))
    scored.generate(ids, 0, prompt_logprobs=1)
    fresh_result = fresh.generate(ids, NEW_TOKENS, logprobs=2)
    sizes = []
    for decoder in (fresh, scored):
        with decoder.slots.take() as slot:
            sizes.append(slot.target._logits.host.nbytes)
    assert sizes[0] == sizes[1]
    for sampling in ({}, dict(temperature=0.8, seed=5)):
        after = scored.generate(ids, NEW_TOKENS, logprobs=2, **sampling)
        expected = fresh_result if not sampling else fresh.generate(ids, NEW_TOKENS, logprobs=2, **sampling)
        assert after.token_ids == expected.token_ids and after.logprobs == expected.logprobs


def test_a_halt_stops_scoring_a_long_prompt_before_its_next_call(bundles, tokenizer, monkeypatch):
    """A prompt's scoring is many target calls before its first token: a consumer's stop (the async API's cancel, the
    server's client gone or deadline) is seen between them, as between tokens, and the slot comes back."""
    from specbuild_runtime.slot import EngineSlot

    decoder = SpeculativeDecoder(bundles("llama", draft_seed=1))
    ids = prompt_of(tokenizer, min(decoder.max_seq_len, 3 * SCORED_ROWS + 1))
    halt, calls, step = threading.Event(), [], EngineSlot.step

    def halting_in_the_first_call(slot, *args, **kwargs):
        calls.append(args)
        halt.set()  # as a relay's stop does, from another thread, while the call computes
        return step(slot, *args, **kwargs)

    monkeypatch.setattr(EngineSlot, "step", halting_in_the_first_call)
    with pytest.raises(RequestError, match="stopped while its prompt was scored"):
        list(decoder.stream_request(decoder.request(ids, 0, prompt_logprobs=1), Stats(), halt=halt))
    assert len(calls) == 1
    monkeypatch.undo()
    assert len(decoder.generate(ids, 0, prompt_logprobs=1).prompt_logprobs) == len(ids)  # its slot is back


def test_stream_requests_first_item_holds_the_prompt_logprobs_of_generate_but_the_first_tokens_none(bundles, tokenizer):
    """Generation.prompt_logprobs, as vLLM's, begins with None for the first prompt token, which has nothing before it;
    stream_request's first item leaves it out (docs/runtime.md): its records are those of prompt tokens 1 onwards."""
    decoder = SpeculativeDecoder(bundles("llama", draft_seed=1))
    ids = prompt_of(tokenizer, 20)
    expected = decoder.generate(ids, 2, prompt_logprobs=3).prompt_logprobs
    with closing(decoder.stream_request(decoder.request(ids, 2, prompt_logprobs=3), Stats())) as items:
        delta, records = next(items)
    assert expected[0] is None and delta == "" and list(records) == expected[1:]


def test_max_new_tokens_0_is_refused_without_prompt_logprobs(bundles):
    decoder = SpeculativeDecoder(bundles("llama", draft_seed=1))
    with pytest.raises(RequestError, match="max_new_tokens must be >= 1 .0 only with prompt_logprobs"):
        decoder.generate("x", 0)


def test_streams_refuse_prompt_logprobs_which_generate_gives(bundles):
    decoder = SpeculativeDecoder(bundles("llama", draft_seed=1))
    refusal = r"^prompt_logprobs come with generate and agenerate"
    for stream in (decoder.stream, decoder.stream_text):
        with pytest.raises(RequestError, match=refusal):
            stream("x", prompt_logprobs=1)
    for astream in (decoder.astream, decoder.astream_text):  # checked as iteration begins
        with pytest.raises(RequestError, match=refusal):
            asyncio.run(anext(astream("x", prompt_logprobs=1)))


def test_text_streams_refuse_logprobs_which_their_str_items_cannot_hold(bundles):
    """stream_text and astream_text are typed to yield str: with logprobs they yielded stream_request's (text, records)
    pairs instead, so a caller joining the deltas failed deep in its own code."""
    decoder = SpeculativeDecoder(bundles("llama", draft_seed=1))
    refusal = r"^logprobs come with stream, astream and generate, not with {}: .*stream_request"
    with pytest.raises(RequestError, match=refusal.format("stream_text")):
        decoder.stream_text("x", logprobs=0)
    with pytest.raises(RequestError, match=refusal.format("astream_text")):  # checked as iteration begins
        asyncio.run(anext(decoder.astream_text("x", logprobs=0)))


def test_a_scored_prompts_time_to_first_token_counts_its_scoring(bundles, tokenizer, monkeypatch):
    """Scoring is the prompt's processing, which ttft_ms counts for a prompt not scored."""
    decoder = SpeculativeDecoder(bundles("llama", draft_seed=1))
    score = decoder._score
    monkeypatch.setattr(decoder, "_score", lambda *args: time.sleep(0.3) or score(*args))
    assert decoder.generate(prompt_of(tokenizer, 20), 2, prompt_logprobs=0).stats.ttft_ms >= 300
