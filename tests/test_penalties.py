"""vLLM's sampling penalties, repetition (transformers' processor), presence and frequency (OpenAI's), and min_tokens:
applied in every graph that decides a token, exact under speculative decoding (sampled: tests/test_sampling.py)."""

import numpy as np
import pytest
import torch

from conftest import PROMPTS, compiled_before_drafts_took_logit_bias_alone, compiled_before_penalties
from specbuild.compile.reference import load_reference, transformers_greedy
from specbuild_runtime import SpeculativeDecoder

NEW_TOKENS = 30
GAMMAS = (0, 1, 3, 8, "auto")


def decoders(folder):
    """The engine graphs (their greedy branch, with the draft's steps graph) and the greedy-only graphs (which CUDA
    graphs capture; on the CPU they run as they are)."""
    return SpeculativeDecoder(folder, draft_steps=True), SpeculativeDecoder(folder, cuda_graphs=True)


def penalised(logits: np.ndarray, prompt: list[int], generated: list[int], repetition=1.0, presence=0.0,
              frequency=0.0, bias=None) -> np.ndarray:
    """One row of logits with OpenAI's logit_bias ({token: bias}) and vLLM's penalties, in numpy: the reference the
    graphs must agree with."""
    logits = logits.copy()
    for token, value in (bias or {}).items():
        logits[token] += np.float32(value)
    counts = np.bincount(generated, minlength=len(logits)).astype(np.float32)
    seen = (counts > 0) | np.isin(np.arange(len(logits)), prompt)
    logits = np.where(seen, np.where(logits < 0, logits * np.float32(repetition), logits / np.float32(repetition)), logits)
    return logits - counts * np.float32(frequency) - (counts > 0).astype(np.float32) * np.float32(presence)


def target_alone(model, prompt: list[int], new_tokens: int, **penalties) -> list[int]:
    """The target's greedy decoding with penalties, one transformers forward pass a token (no eos: the bundles'
    tokenizer's eos ends both only where the reference reaches it too, and the tests pick prompts that run on)."""
    tokens = []
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(torch.tensor([prompt + tokens])).logits[0, -1].float().numpy()
            tokens.append(int(penalised(logits, prompt, tokens, **penalties).argmax()))
    return tokens


@pytest.mark.parametrize("penalty", [1.3, 0.7])
@pytest.mark.parametrize("draft", ["same", "unrelated"])
def test_speculative_greedy_with_a_repetition_penalty_equals_transformers(penalty, draft, bundles, checkpoints,
                                                                          tokenizer):
    model = load_reference(checkpoints("llama"))
    for decoder in decoders(bundles("llama", draft_seed=0 if draft == "same" else 1)):
        for prompt in PROMPTS[:4]:
            ids = tokenizer(prompt)["input_ids"]
            expected = transformers_greedy(model, ids, NEW_TOKENS, [tokenizer.eos_token_id], repetition_penalty=penalty)
            assert expected != transformers_greedy(model, ids, NEW_TOKENS, [tokenizer.eos_token_id])  # not hollow
            for gamma in GAMMAS:
                result = decoder.generate(ids, NEW_TOKENS, gamma, repetition_penalty=penalty)
                assert result.token_ids == expected, (decoder.cuda_graphs, gamma, prompt)


@pytest.mark.parametrize("penalties", [dict(presence_penalty=1.5), dict(frequency_penalty=0.8),
                                       dict(presence_penalty=-0.5, frequency_penalty=1.2, repetition_penalty=1.2)])
@pytest.mark.parametrize("draft", ["same", "unrelated"])
def test_speculative_greedy_with_presence_and_frequency_penalties_equals_the_target_alone(penalties, draft, bundles,
                                                                                         checkpoints, tokenizer):
    model = load_reference(checkpoints("llama"))
    reference = {name.removesuffix("_penalty"): value for name, value in penalties.items()}
    for decoder in decoders(bundles("llama", draft_seed=0 if draft == "same" else 1)):
        for prompt in PROMPTS[:3]:
            ids = tokenizer(prompt)["input_ids"]
            expected = target_alone(model, ids, NEW_TOKENS, **reference)
            assert expected != target_alone(model, ids, NEW_TOKENS)  # not hollow
            for gamma in GAMMAS:
                result = decoder.generate(ids, NEW_TOKENS, gamma, ignore_eos=True, **penalties)
                assert result.token_ids == expected, (decoder.cuda_graphs, gamma, prompt)


def test_a_bundle_compiled_before_penalties_decodes_as_before_and_refuses_them_in_one_line(bundles, tokenizer, tmp_path):
    import shutil

    from specbuild_runtime import RequestError
    from specbuild_runtime.serve.protocol import invalid

    folder = bundles("llama", draft_seed=1)
    old = compiled_before_penalties(shutil.copytree(folder, tmp_path / "old"))
    ids = tokenizer(PROMPTS[0])["input_ids"]
    for before, now in zip(decoders(old), decoders(folder)):
        assert not before.target.has_penalties and now.target.has_penalties
        assert not before.target.has_min_tokens and now.target.has_min_tokens
        for options in ({}, {"temperature": 0.8, "top_p": 0.9, "seed": 2}):
            for gamma in (0, 3, "auto"):
                assert (before.generate(ids, 20, gamma, **options).token_ids
                        == now.generate(ids, 20, gamma, repetition_penalty=1.0, presence_penalty=0.0, **options).token_ids)
        with pytest.raises(RequestError, match=r"^logit_bias needs a bundle compiled with logit_bias; \S+ was compiled "
                                               r"before it: recompile it with `specbuild compile`, or leave logit_bias out$"
                           ) as refused:
            before.generate(ids, 8, logit_bias={5: 3.0})
        assert invalid(refused.value).param == "logit_bias"
        with pytest.raises(RequestError, match=r"^min_tokens needs a bundle compiled with min_tokens; \S+ was compiled "
                                               r"before it: recompile it with `specbuild compile`, or leave min_tokens out$"
                           ) as refused:
            before.generate(ids, 8, min_tokens=2)
        assert invalid(refused.value).param == "min_tokens"
        for name, value in (("repetition_penalty", 1.1), ("presence_penalty", 0.5), ("frequency_penalty", -1.0)):
            with pytest.raises(RequestError, match=rf"^{name} needs a bundle compiled with sampling penalties; \S+ was "
                                                   r"compiled before them: recompile it with `specbuild compile`, or "
                                                   r"leave the penalties out$") as refused:
                before.generate(ids, 8, **{name: value})
            assert invalid(refused.value).param == name  # serve's 400 names the field


def test_logprobs_stay_the_raw_logits_under_penalties(bundles, tokenizer):
    """vLLM's raw_logprobs: a penalised request's tokens get the logprobs the target gives them unpenalised, as scoring
    the same text as a prompt does."""
    decoder = SpeculativeDecoder(bundles("llama", draft_seed=0))
    ids = tokenizer(PROMPTS[1])["input_ids"]
    penalised = decoder.generate(ids, 20, 3, logprobs=3, repetition_penalty=1.5, frequency_penalty=1.0)
    assert penalised.token_ids != decoder.generate(ids, 20, 3).token_ids  # they bite
    scored = decoder.generate(ids + penalised.token_ids, 0, prompt_logprobs=3).prompt_logprobs[len(ids):]
    assert [(r.token_id, r.logprob, r.top) for r in penalised.logprobs] == [(r.token_id, r.logprob, r.top) for r in scored]


@pytest.mark.parametrize("draft", ["same", "unrelated"])
def test_min_tokens_keeps_the_eos_and_stop_tokens_out_exactly_as_transformers_min_new_tokens(draft, bundles, checkpoints,
                                                                                           tokenizer):
    """vLLM's min_tokens masks the eos and stop_token_ids in the rows deciding the first min_tokens tokens, drafts'
    rows included: transformers' min_new_tokens with those tokens as its eos."""
    model = load_reference(checkpoints("llama"))
    for decoder in decoders(bundles("llama", draft_seed=0 if draft == "same" else 1)):
        for prompt in PROMPTS[:3]:
            ids = tokenizer(prompt)["input_ids"]
            free = transformers_greedy(model, ids, NEW_TOKENS, [])
            eos, stop = free[3], free[6]  # tokens the target emits early, mid-round
            decoder.eos_token_ids = {eos}
            expected = transformers_greedy(model, ids, NEW_TOKENS, [eos, stop], min_new_tokens=12)
            assert len(expected) > 12 and expected[:7] != free[:7]  # not hollow: it held both back
            for gamma in GAMMAS:
                result = decoder.generate(ids, NEW_TOKENS, gamma, stop_token_ids=[stop], min_tokens=12)
                assert result.token_ids == expected, (decoder.cuda_graphs, gamma, prompt)
                assert result.token_ids[-1] in (eos, stop) or len(result.token_ids) == NEW_TOKENS


@pytest.mark.parametrize("draft", ["same", "unrelated"])
def test_logit_bias_decodes_as_the_target_alone_with_the_biases_added(draft, bundles, checkpoints, tokenizer):
    """OpenAI's logit_bias, before the penalties as vLLM adds it; a bias of -100 keeps a token out, +100 takes it."""
    model = load_reference(checkpoints("llama"))
    for decoder in decoders(bundles("llama", draft_seed=0 if draft == "same" else 1)):
        for prompt in PROMPTS[:3]:
            ids = tokenizer(prompt)["input_ids"]
            for penalties in ({}, {"repetition_penalty": 1.3, "frequency_penalty": 0.4}):
                reference = {name.removesuffix("_penalty"): value for name, value in penalties.items()}
                free = target_alone(model, ids, NEW_TOKENS, **reference)
                bias = {free[2]: -100.0, free[5]: -2.5, 40: 1.5}
                expected = target_alone(model, ids, NEW_TOKENS, bias=bias, **reference)
                assert free[2] not in expected and expected != free  # not hollow
                for gamma in GAMMAS:
                    result = decoder.generate(ids, NEW_TOKENS, gamma, ignore_eos=True, logit_bias=bias, **penalties)
                    assert result.token_ids == expected, (decoder.cuda_graphs, gamma, prompt, penalties)
        taken = decoder.generate(PROMPTS[0], 6, 3, logit_bias={7: 100.0}).token_ids
        assert taken == [7] * 6


def test_min_tokens_keeps_stop_strings_out_of_the_text_of_its_tokens_as_vllm(bundles, tokenizer):
    """vLLM's detokenizer looks for a stop string only once more than min_tokens tokens are generated, and finds one
    that ends in the text after theirs (vllm/v1/engine/detokenizer.py; tests/detokenizer/test_min_tokens.py there)."""
    decoder = SpeculativeDecoder(bundles("llama", draft_seed=1))
    ids = tokenizer(PROMPTS[0])["input_ids"]
    free = decoder.generate(ids, NEW_TOKENS, 3, ignore_eos=True).text
    head = decoder.generate(ids, 10, 3, ignore_eos=True).text  # the text of the first 10 tokens
    stop = next(c for c in head if c.strip() and free.find(c, len(head)) >= 0)
    assert decoder.generate(ids, NEW_TOKENS, 3, ignore_eos=True, stop=stop).text == free[:free.find(stop)]
    assert free.find(stop) < len(head)  # not hollow: without min_tokens it stops within the 10 tokens' text
    for gamma in (0, 3, "auto"):
        result = decoder.generate(ids, NEW_TOKENS, gamma, ignore_eos=True, stop=stop, min_tokens=10)
        assert result.text == free[:free.find(stop, len(head))] and result.stats.finish_reason == "stop", gamma


def test_a_bundle_whose_greedy_only_graphs_take_the_penalties_decodes_under_cuda_graphs_and_refuses_them(bundles, tokenizer,
                                                                                                          tmp_path):
    """Bundles compiled with the penalties and before the sampler decided greedy calls: their greedy-only graphs take
    the penalty, min_tokens and logit_bias inputs (here added unread, as onnxruntime still wants each bound) and their
    sampler has no greedy branch: plain requests decode as before, these are refused in one line."""
    import json
    import shutil

    import onnx

    from specbuild_runtime import RequestError
    from specbuild_runtime.manifest import MANIFEST, load_manifest, sha256_file

    folder = bundles("llama", draft_seed=1)
    old = compiled_before_drafts_took_logit_bias_alone(shutil.copytree(folder, tmp_path / "old"))
    data = json.loads((old / MANIFEST).read_text())
    for info in load_manifest(old).engines.values():
        taken = [value for value in onnx.load(str(old / info.file), load_external_data=False).graph.input
                 if value.name in ("repetition_penalty", "presence_penalty", "frequency_penalty", "prompt_mask",
                                   "output_counts", "min_tokens_left", "stop_tokens", "logit_bias")]
        assert len(taken) == 8
        greedy = onnx.load(str(old / info.greedy_file), load_external_data=False)
        greedy.graph.input.extend(taken)
        onnx.save(greedy, str(old / info.greedy_file))
        data["files"][info.greedy_file] = sha256_file(old / info.greedy_file)
    (old / MANIFEST).write_text(json.dumps(data))
    ids = tokenizer(PROMPTS[0])["input_ids"]
    before, now = SpeculativeDecoder(old, cuda_graphs=True), SpeculativeDecoder(folder)
    assert before.target.processes and not before.target.has_penalties and not before.draft.has_logit_bias
    for options in ({}, {"temperature": 0.8, "top_p": 0.9, "seed": 2}):
        for gamma in (0, 3):
            assert before.generate(ids, 20, gamma, **options).token_ids == now.generate(ids, 20, gamma, **options).token_ids
    for options in ({"repetition_penalty": 1.2}, {"min_tokens": 2}, {"logit_bias": {5: 3.0}},
                    {"structured_outputs": {"choice": ["yes", "no"]}}):
        with pytest.raises(RequestError, match="recompile it with `specbuild compile`"):
            before.generate(ids, 8, **options)


def test_the_draft_binds_logit_bias_alone_and_a_draft_taking_every_processing_input_proposes_the_same(bundles, tokenizer,
                                                                                                    tmp_path):
    """The draft proposes unpenalised (slot.Slot.configure): of the processing inputs it is fed a grammar's mask alone,
    as logit_bias, added without the penalties' If, whose test of every input cost ~4 us of a ~60 us draft step (the demo
    draft, 2 CPU cores) and which ran the penalties' nodes under a grammar (~40 us). A bundle compiled before, whose draft
    takes them all, decodes as before: the same drafts (α per position) and tokens, greedy and sampled, with and without
    a grammar."""
    import shutil

    from test_structured import SCHEMA

    folder = bundles("llama", draft_seed=1)
    old = compiled_before_drafts_took_logit_bias_alone(shutil.copytree(folder, tmp_path / "old"))
    before, now = SpeculativeDecoder(old), SpeculativeDecoder(folder)
    assert before.draft.has_penalties and before.draft.has_min_tokens  # not hollow: the old graph takes them
    assert now.draft.has_logit_bias and not now.draft.has_penalties and not now.draft.has_min_tokens
    ids = tokenizer(PROMPTS[1])["input_ids"]
    for structured in (None, {"json": SCHEMA, "disable_any_whitespace": True}):
        for options in ({}, {"temperature": 0.9, "top_k": 20, "seed": 11}):
            for gamma in (3, "auto"):
                old_result, new_result = (decoder.generate(ids, 30, gamma, structured_outputs=structured, **options)
                                          for decoder in (before, now))
                assert new_result.token_ids == old_result.token_ids, (structured, options, gamma)
                assert new_result.stats.accepted_at == old_result.stats.accepted_at, (structured, options, gamma)
                assert new_result.stats.proposed_at == old_result.stats.proposed_at, (structured, options, gamma)
