"""How target calls group rows (slot.Rows): the GPU's fixed-row calls decode exactly the CPU's tokens; and
the CUDA graphs each call names."""

import json

import pytest

from conftest import PROMPTS
from specbuild_runtime import BundleError, DeviceError, SpeculativeDecoder
from specbuild_runtime import slot as slot_module
from specbuild_runtime.slot import MAX_REUSED_IDS, NEVER_ALONE, PREFILL_CHUNK, WARM_UP_RUNS, EngineSlot, fixed_rows

NEW_TOKENS = 30


@pytest.fixture(scope="module")
def bundle(bundles):
    return bundles("llama", draft_seed=0)  # draft = target: long runs of accepted drafts, and rejections


@pytest.fixture
def target_calls(monkeypatch):
    """(first position, total_len, num_drafts) of every target call."""
    calls = []
    run = EngineSlot._compute_rows

    def spy(self, first, total_len, num_drafts, *args):
        if self.engine.info.role == "target":
            calls.append((first, total_len, num_drafts))
        return run(self, first, total_len, num_drafts, *args)

    monkeypatch.setattr(EngineSlot, "_compute_rows", spy)
    return calls


@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "seed": 3}, {"temperature": 0.6, "top_k": 8, "seed": 4}])
def test_fixed_rows_decode_the_same_tokens_as_never_alone_for_every_gamma(bundle, sampling):
    """On the CPU both are exact, so equal tokens prove the fixed-row bookkeeping (re-fed rows, split
    prompts); on a GPU the same rule is what makes speculative output equal target-only output."""
    normal = SpeculativeDecoder(bundle)
    fixed = SpeculativeDecoder(bundle, target_rows=fixed_rows(normal.max_gamma))
    for prompt in (PROMPTS[3], PROMPTS[0], PROMPTS[5]):  # 1 token, shorter and longer than max γ + 1 rows
        for gamma in [*range(normal.max_gamma + 1), "auto"]:
            if gamma == "auto" and sampling:
                continue  # sampled auto runs differ by design with the rounds the policy picks
            expected = normal.generate(prompt, NEW_TOKENS, gamma, **sampling).token_ids
            assert fixed.generate(prompt, NEW_TOKENS, gamma, **sampling).token_ids == expected, (prompt, gamma)


def test_fixed_rows_calls_compute_max_gamma_plus_one_rows(bundle, target_calls, tokenizer):
    decoder = SpeculativeDecoder(bundle, target_rows=fixed_rows(8))  # the bundle's max γ
    rows = 8 + 1
    prompt = tokenizer(PROMPTS[5])["input_ids"]
    assert len(prompt) > rows + 1
    decoder.generate(prompt, NEW_TOKENS, gamma=3)
    (head_first, head_total, _), *calls = target_calls
    assert (head_first, head_total) == (0, len(prompt) - rows)  # the prompt: a head, then its last rows
    assert all(total - first == rows for first, total, _ in calls)
    assert any(drafts == 3 for _, _, drafts in calls)


def test_fixed_rows_after_a_short_prompt_recompute_from_the_start_until_the_cache_holds_enough(bundle, target_calls):
    decoder = SpeculativeDecoder(bundle, target_rows=fixed_rows(8))
    decoder.generate([5, 6], NEW_TOKENS, gamma=0)
    assert target_calls[:4] == [(0, 2, 0), (0, 3, 0), (0, 4, 0), (0, 5, 0)]
    assert all(total - first == 9 for first, total, _ in target_calls if total >= 9)


@pytest.mark.parametrize("prompt", [[5], [5, 6, 7]])
def test_fixed_rows_rewrite_a_short_prompts_cache_in_one_call_of_max_gamma_plus_one_rows_however_far_a_round_takes_it(
        bundle, target_calls, prompt):
    """Once the sequence holds R = max γ + 1 tokens, every position a call reads was last written by a call of R
    rows, as a round growing it by one token leaves it, also where one round takes a short prompt's cache past R
    (drafts or free guesses accepted: draft = target here). A head of the rows before the last R, re-fed in a call
    of its own, wrote position 0 alone: on an H100 the fp32 logprobs of auto γ then differed in their last bits."""
    rows = 9
    decoder = SpeculativeDecoder(bundle, target_rows=fixed_rows(rows - 1))
    for gamma in [*range(rows), "auto"]:
        target_calls.clear()
        decoder.generate(prompt, NEW_TOKENS, gamma)
        written_by = {}  # position -> rows of the call that last wrote it
        for first, total, _ in target_calls:
            written_by.update(dict.fromkeys(range(first, total), total - first))
            if total >= rows:
                assert {written_by[p] for p in range(total)} == {rows}, (gamma, target_calls)


def test_fixed_rows_write_every_position_of_a_call_feeding_more_than_twice_max_gamma_plus_one_after_a_short_cache(
        bundle, target_calls):
    """A call after a 1-token cache that feeds 29 more tokens (more than 2R, R = 9): its re-fed rows go in a call of R
    rows only where the call that decides overlaps it; otherwise the head writes every row before the last R, as a
    prompt's would (a head of R rows left positions 9..20 unwritten: another token, logits off by ~7)."""
    import numpy as np

    decoder, rows = SpeculativeDecoder(bundle), 9
    ids = list(range(5, 35))
    logits = []
    for feeds in ([(ids[:1], 1), (ids[1:], len(ids))], [(ids, len(ids))]):  # after a 1-token cache, and fresh
        target = EngineSlot(decoder.target, fixed_rows(rows - 1), max_drafts=rows - 1)
        target.read_logits(True)
        target_calls.clear()
        for tokens, total_len in feeds:
            target.step(tokens, total_len=total_len)
        assert set().union(*(range(first, total) for first, total, _ in target_calls)) == set(range(len(ids))), target_calls
        assert target_calls[-1][:2] == (len(ids) - rows, len(ids))
        logits.append(target.logits())
    np.testing.assert_allclose(*logits, atol=1e-4)


def test_cpu_calls_compute_an_even_number_of_rows_re_feeding_one_where_needed(bundle, target_calls):
    """NEVER_ALONE: no row alone, none as a call's odd last row; an odd prompt is an even head and its last two
    rows, re-feeding the head's last."""
    decoder = SpeculativeDecoder(bundle, target_rows=NEVER_ALONE, prefix_reuse=False)
    decoder.generate([5], 6, gamma=2)
    assert target_calls[0] == (0, 1, 0)  # a one-token prompt has no row before it
    assert target_calls[1][0] == 0  # so the next call computes it again, with others
    assert all((total - first) % 2 == 0 for first, total, _ in target_calls[1:])
    for prompt, gamma, head in (([5, 6, 7], 0, 2), ([5, 6, 7, 8], 2, None), ([5, 6, 7, 8, 9], 3, 4)):
        target_calls.clear()
        decoder.generate(prompt, 6, gamma=gamma)
        split = [(0, head, 0), (head - 1, len(prompt), 0)] if head else [(0, len(prompt), 0)]  # an even prompt: whole
        assert target_calls[:len(split)] == split
        rows = [total - first for first, total, _ in target_calls[1:]]
        assert all(n % 2 == 0 for n in rows) and (gamma == 0 or gamma + 2 in rows or gamma + 1 in rows), rows


def test_a_long_prompt_is_fed_in_calls_of_prefill_chunk_rows_and_decodes_what_one_call_decodes(bundle, target_calls,
                                                                                                 monkeypatch):
    """Chunked prefill (CPU): a prompt's leading rows go in calls of PREFILL_CHUNK rows, its rest by the usual
    rules (an odd prompt's last two rows re-feeding one), so speculative output still equals target-only output,
    which equals the tokens of the prompt fed in one call."""
    assert PREFILL_CHUNK > MAX_REUSED_IDS and PREFILL_CHUNK % 2 == 0  # even: the rest keeps the prompt's parity
    whole = SpeculativeDecoder(bundle, prefix_reuse=False)  # the prompts share prefixes: each fed whole here
    for slot in whole.slots._free:
        slot.target.chunk = slot.draft.chunk = 0
    monkeypatch.setattr(slot_module, "PREFILL_CHUNK", 8)
    chunked = SpeculativeDecoder(bundle, prefix_reuse=False)
    for length, calls in ((40, [(0, 8), (8, 16), (16, 24), (24, 32), (32, 40)]),
                          (43, [(0, 8), (8, 16), (16, 24), (24, 32), (32, 40), (40, 42), (41, 43)]),
                          (8, [(0, 8)]), (9, [(0, 8), (7, 9)]), (10, [(0, 8), (8, 10)]), (11, [(0, 8), (8, 10), (9, 11)]),
                          (7, [(0, 6), (5, 7)])):
        prompt = [(7 * i) % 300 + 1 for i in range(length)]
        target_calls.clear()
        expected = chunked.generate(prompt, NEW_TOKENS, gamma=0).token_ids
        assert [(first, total) for first, total, _ in target_calls[:len(calls)]] == calls, length
        assert max(total - first for first, total, drafts in target_calls if not drafts) <= 8
        assert all((total - first) % 2 == 0 for first, total, _ in target_calls[len(calls) - 1:])  # never a row alone
        assert whole.generate(prompt, NEW_TOKENS, gamma=0).token_ids == expected, length
        for gamma in (1, 2, 3, 8, "auto"):
            assert chunked.generate(prompt, NEW_TOKENS, gamma).token_ids == expected, (length, gamma)


def test_resident_memory_after_concurrent_long_prompts_stays_near_the_kv_caches(checkpoints, tmp_path):
    """onnxruntime's CPU memory arena keeps the peak of every call running at once, for good: a prompt fed in
    one call would leave its activations (here the MLP's, ~100 KB a row) resident. Measured here: +420..510 MiB
    after two concurrent 1900-token prompts fed in one call each, +135..138 MiB in calls of PREFILL_CHUNK rows
    (KV caches: 4 MiB)."""
    import threading

    import numpy as np

    from specbuild.compile import compile_bundle
    from specbuild.recipe import CompileSettings

    wide = checkpoints("llama", 0, intermediate_size=4096, max_position_embeddings=2048)
    compile_bundle(CompileSettings(target=wide, draft=wide, output=tmp_path / "b", max_seq_len=2048, quality_report=False),
                   show_progress=False)
    decoder = SpeculativeDecoder(tmp_path / "b", parallel=2)
    decoder.generate([5, 6, 7], 4, gamma=2)

    def resident_mib() -> float:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) / 1024 for line in status if line.startswith("VmRSS"))

    before = resident_mib()
    rng = np.random.default_rng(0)
    threads = [threading.Thread(target=decoder.generate, args=(rng.integers(1, 300, 1900 - i).tolist(), 4, 2))
               for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert resident_mib() - before < 256


# vLLM's penalties, min_tokens and OpenAI's logit_bias at once: per-request inputs, some updated every token
PENALISED = {"repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.3, "min_tokens": 10,
             "logit_bias": {5: 2.0, 40: -1.0}}


def apart(self, host, device):
    """slot.Buffer's __init__ with the engine's copy apart from the host array, as on a device."""
    self.host, self.device = host, device
    self.value = slot_module.ort.OrtValue.ortvalue_from_numpy(host.copy(), device, 0)
    self.shared = False


@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["full-graphs", "greedy-only-graphs"])
@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "top_p": 0.9, "seed": 5}, PENALISED,
                                      {"temperature": 0.8, "seed": 5, **PENALISED}], ids=["greedy", "sampled",
                                      "greedy-penalised", "sampled-penalised"])
def test_the_device_data_flow_decodes_the_same_tokens_when_host_and_engine_memory_are_apart(bundle, sampling, cuda_graphs,
                                                                                            monkeypatch):
    """On a GPU each per-call buffer is a host array plus a device copy: every value written on the host must
    be pushed before a call and every output pulled after it. On the CPU they share memory, which hides a
    missing push or pull; here they are kept apart (as on a device) with fixed-row calls, and the tokens
    must not change (with the greedy-only graphs too, whose sampler writes the outputs after the call)."""
    normal = SpeculativeDecoder(bundle)
    expected = {gamma: normal.generate(PROMPTS[5], NEW_TOKENS, gamma, **sampling).token_ids for gamma in (0, 1, 3, 4)}
    expected_plain = {gamma: normal.generate(PROMPTS[5], NEW_TOKENS, gamma).token_ids for gamma in expected}
    monkeypatch.setattr(slot_module.Buffer, "__init__", apart)
    device_like = SpeculativeDecoder(bundle, target_rows=fixed_rows(normal.max_gamma), cuda_graphs=cuda_graphs,
                                     draft_steps=True)  # as on CUDA: γ 4 drafts in one call of the steps graph
    for gamma, tokens in expected.items():
        assert device_like.generate(PROMPTS[5], NEW_TOKENS, gamma, **sampling).token_ids == tokens, gamma
        # the slot's next request, without penalties: the last one's tallies are cleared on the device too
        assert device_like.generate(PROMPTS[5], NEW_TOKENS, gamma).token_ids == expected_plain[gamma], gamma


@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["full-graphs", "greedy-only-graphs"])
def test_a_request_without_penalties_pushes_none_of_their_vocabulary_sized_inputs_after_another_alike(bundle, cuda_graphs,
                                                                                                       monkeypatch):
    """prompt_mask, output_counts, stop_tokens and logit_bias are 0.15-0.6 MB each per binding at a 152k vocabulary:
    a slot whose last request used none of them already holds their neutral values on the device."""
    monkeypatch.setattr(slot_module.Buffer, "__init__", apart)
    decoder = SpeculativeDecoder(bundle, cuda_graphs=cuda_graphs)
    vocab = decoder.target.vocab_size
    pushed, previous = [], None
    push = slot_module.Buffer.push
    monkeypatch.setattr(slot_module.Buffer, "push", lambda self: (pushed.append(self.host.shape), push(self)))
    sampled = {"temperature": 0.8, "seed": 5}  # after PENALISED: the greedy-only graphs' sampler runs, and is pushed to
    for options in ({}, sampled, PENALISED, sampled, {}, {}):
        pushed.clear()
        decoder.generate(PROMPTS[5], 12, 3, **options)
        widest = any(shape[-1:] == (vocab,) for shape in pushed)  # logit_bias's rows are [D+1, V]
        assert widest == (options is PENALISED or previous is PENALISED), options
        previous = options


@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["full-graphs", "greedy-only-graphs"])
def test_only_penalties_push_the_counts_each_token_not_logit_bias_or_min_tokens_alone(bundle, cuda_graphs, monkeypatch):
    """output_counts (0.6 MB a binding at a 152k vocabulary) changes nothing the graphs decide without a penalty: a
    request with logit_bias or min_tokens alone pushes its vocabulary-sized inputs once, whatever its length."""
    monkeypatch.setattr(slot_module.Buffer, "__init__", apart)
    decoder = SpeculativeDecoder(bundle, cuda_graphs=cuda_graphs)
    vocab = decoder.target.vocab_size
    pushed = []
    push = slot_module.Buffer.push
    monkeypatch.setattr(slot_module.Buffer, "push", lambda self: (pushed.append(self.host.shape), push(self)))

    def pushes(new_tokens: int, **options) -> int:
        # the slot back to neutral values, pushed (sampled: the greedy-only graphs' sampler, which alone takes them, runs)
        decoder.generate(PROMPTS[5], 16, 0, stop_token_ids=[3], temperature=0.5, seed=0)
        pushed.clear()
        decoder.generate(PROMPTS[5], new_tokens, 0, ignore_eos=True, **options)
        return sum(shape[-1:] == (vocab,) for shape in pushed)  # logit_bias's rows are [D+1, V]

    for options in ({"logit_bias": {5: 2.0}}, {"min_tokens": 3}):
        assert pushes(4, **options) == pushes(16, **options) > 0, options
    assert pushes(4, repetition_penalty=1.2) < pushes(16, repetition_penalty=1.2)  # the counts: each call


@pytest.mark.parametrize("fed", ["max", "bucket"])
def test_cuda_graph_calls_decode_the_tokens_of_the_full_graphs_and_each_graph_id_names_one_call_shape(bundle, tokenizer,
                                                                                                     monkeypatch, fed):
    """cuda_graphs=True runs the engines' greedy-only graphs with fixed-row target calls, each call naming the
    CUDA graph it replays as on a GPU (onnxruntime's CPU provider ignores the ids, so the bookkeeping runs
    here). A replay reads nothing on the host, so an id must always name the same slot, row count,
    num_drafts, input buffer and total_len, one that holds the call's length (max_seq_len, or the bucket
    that holds it: slot.GPU_TOTAL_LEN); a prompt's first call (fed its own length, total_len == rows) and a
    call too long for a reused buffer name none (-1), and every id runs uncaptured first (WARM_UP_RUNS)."""
    monkeypatch.setattr(slot_module, "GPU_TOTAL_LEN", fed)
    calls = []
    choose = EngineSlot._graph

    def spy(self, rows, num_drafts, fed_len):
        options = choose(self, rows, num_drafts, fed_len)
        if not self.engine.captures:  # the decoder without CUDA graphs: its options name none
            return options
        total_len = int(self._seqlens_k.host[0]) + 1
        assert self._total_len.host[()] == fed_len >= total_len, (fed_len, total_len)
        buffer = self._ids[rows].value.data_ptr() if rows <= MAX_REUSED_IDS else None
        graph = slot_module.graph_id(self.engine, self.index, rows, num_drafts, fed_len)
        calls.append((self.engine.info.role, graph, (self.index, rows, num_drafts, buffer, fed_len), total_len,
                      int(options.get_run_config_entry("gpu_graph_id"))))
        return options

    monkeypatch.setattr(EngineSlot, "_graph", spy)
    normal = SpeculativeDecoder(bundle)
    graphs = SpeculativeDecoder(bundle, cuda_graphs=True, target_rows=fixed_rows(normal.max_gamma), parallel=2)
    for engine in (graphs.target, graphs.draft):
        engine.captures = True  # as on CUDA
    long_prompt = "".join(PROMPTS[:6])
    assert len(tokenizer(long_prompt)["input_ids"]) > MAX_REUSED_IDS
    held = graphs.stream(PROMPTS[1], NEW_TOKENS)  # slot 0 busy for a while: the runs below take slot 1
    next(held)
    for prompt in (PROMPTS[3], PROMPTS[5], long_prompt):
        for gamma in [*range(normal.max_gamma + 1), "auto"]:
            expected = normal.generate(prompt, NEW_TOKENS, gamma).token_ids
            assert graphs.generate(prompt, NEW_TOKENS, gamma).token_ids == expected, (prompt, gamma)
        if prompt == PROMPTS[5]:
            list(held)  # slot 0 free again: the long prompt decodes in it
    shapes, runs = {}, {}
    for role, graph, shape, total_len, used in calls:
        if shape[1] == total_len or shape[3] is None:
            assert graph == used == -1, (role, shape, total_len)
        if graph >= 0:
            assert shapes.setdefault((role, graph), shape) == shape, (role, graph, shapes[role, graph], shape)
            runs[role, graph] = runs.get((role, graph), 0) + 1
            assert used == (graph if runs[role, graph] > WARM_UP_RUNS else -1), (role, graph, runs[role, graph], used)
    assert {index for (index, *_) in shapes.values()} == {0, 1}
    assert {role for role, _ in shapes} == {"target", "draft"}
    assert any(count > WARM_UP_RUNS for count in runs.values())  # some were replayed
    fed_lens = {shape[-1] for shape in shapes.values()}
    if fed == "max":
        assert fed_lens == {graphs.max_seq_len}
    else:  # calls in several buckets, each with graphs of its own
        assert len(fed_lens) > 1 and fed_lens <= set(slot_module.total_len_buckets(graphs.max_seq_len)), fed_lens


@pytest.mark.parametrize("sampling", [{"temperature": 0.8}, {"temperature": 1.0, "top_k": 20},
                                      {"temperature": 0.7, "top_p": 0.9}, {"temperature": 1.2, "min_p": 0.1},
                                      {"temperature": 0.9, "repetition_penalty": 1.3, "presence_penalty": 0.5,
                                       "frequency_penalty": 0.4, "min_tokens": 6, "logit_bias": {5: 2.0}}],
                         ids=["plain", "top_k", "top_p", "min_p", "processed"])
def test_a_cuda_graph_decoder_samples_the_full_graphs_tokens_with_the_bundles_sampler(bundle, sampling):
    """The greedy-only graphs cannot sample; their logits go to the bundle's sampler, the same nodes as the
    full graphs' sampling branch: the same tokens for every seed and γ (graph ids named as on CUDA)."""
    normal = SpeculativeDecoder(bundle)
    graphs = SpeculativeDecoder(bundle, cuda_graphs=True)
    for engine in (graphs.target, graphs.draft):
        engine.captures = True  # as on CUDA
    for gamma in range(normal.max_gamma + 1):
        for seed, prompt in enumerate(PROMPTS[:3]):
            expected = normal.generate(prompt, NEW_TOKENS, gamma, seed=seed, **sampling).token_ids
            assert graphs.generate(prompt, NEW_TOKENS, gamma, seed=seed, **sampling).token_ids == expected, (gamma, seed)


def test_a_cuda_graph_decoder_runs_the_sampler_only_for_requests_that_sample_or_process_their_logits(bundle,
                                                                                                       monkeypatch):
    """The greedy-only graphs decide on the raw logits, without the penalties' work over [D+1, V]: a plain greedy
    request runs them alone, while the sampler decides each call of a request with penalties, min_tokens, logit_bias
    or a grammar (greedy too), and of a sampled one (its tokens: the tests with cuda_graphs=True)."""
    graphs = SpeculativeDecoder(bundle, cuda_graphs=True)
    calls = []
    run = slot_module.run_session
    monkeypatch.setattr(slot_module, "run_session",
                        lambda session, *args: (calls.append(session), run(session, *args))[1])
    for options in ({}, {"repetition_penalty": 1.3}, {"min_tokens": 5}, {"logit_bias": {5: 2.0}},
                    {"structured_outputs": {"choice": ["yes", "no"]}}, {"temperature": 0.8, "seed": 1}, {}):
        calls.clear()
        graphs.generate(PROMPTS[5], 8, 2, **options)
        sampler_calls = sum(session is graphs.target.sampling_session for session in calls)
        assert (sampler_calls > 0) == bool(options) and len(calls) > sampler_calls, options


@pytest.mark.parametrize("missing", ["greedy_file", "sampler_file"])
def test_cuda_graphs_of_a_bundle_compiled_before_them_say_to_recompile(bundle, tmp_path, missing):
    import shutil

    old = tmp_path / "old"
    shutil.copytree(bundle, old)
    manifest = json.loads((old / "manifest.json").read_text())
    if missing == "sampler_file":
        del manifest["sampler_file"]
    else:
        for info in manifest["engines"].values():
            del info["greedy_file"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    SpeculativeDecoder(old, check_digests=False)  # decodes as before
    with pytest.raises(BundleError, match="lacks the greedy-only graphs or the sampler.*rebuild it with `specbuild compile`"):
        SpeculativeDecoder(old, check_digests=False, cuda_graphs=True)


@pytest.fixture
def steps_calls(monkeypatch):
    """(rows fed, total_len, total_len fed to each step) of every call of a draft's steps graph."""
    from specbuild_runtime.slot import DraftSteps

    calls = []
    step = DraftSteps.step

    def spy(self, tokens, total_len):
        drafts = step(self, tokens, total_len)
        lengths = [int(self._lengths["total_len" + (f".{j}" if j else "")].host) for j in range(self.count)]
        calls.append((len(tokens), total_len, lengths))
        return drafts

    monkeypatch.setattr(DraftSteps, "step", spy)
    return calls


@pytest.mark.parametrize("architecture", ["llama", "gpt2", "gemma3", "phi3", "qwen2-window"])
def test_the_drafts_steps_graph_drafts_what_a_call_per_token_drafts(architecture, bundles, steps_calls):
    """The steps graph (draft.steps.onnx) runs the draft's own graph once per step inside one call: the same
    drafts, so the same rounds, for every γ (rounds of fewer drafts than it makes use single calls)."""
    folder = bundles(architecture, draft_seed=1)
    one_by_one = SpeculativeDecoder(folder)  # the CPU's default
    steps = SpeculativeDecoder(folder, draft_steps=True)
    assert steps.steps_engine.steps_per_call == 4 and one_by_one.steps_engine is None
    for prompt in (PROMPTS[3], PROMPTS[0], PROMPTS[5]):
        for gamma in (1, 4, 6, 8, "auto"):
            expected = one_by_one.generate(prompt, NEW_TOKENS, gamma)
            result = steps.generate(prompt, NEW_TOKENS, gamma)
            assert result.token_ids == expected.token_ids, (prompt, gamma)
            if gamma != "auto":  # auto's choices follow the rounds' timings
                assert result.stats.to_dict()["per_position_acceptance"] == expected.stats.to_dict()["per_position_acceptance"]
                assert (result.stats.drafted, result.stats.accepted) == (expected.stats.drafted, expected.stats.accepted)
    assert steps_calls and all(lengths == [total + j for j in range(4)] for _, total, lengths in steps_calls)


@pytest.mark.parametrize("fed", ["max", "bucket"])
def test_steps_graph_calls_feed_every_step_the_length_that_holds_their_last_as_on_cuda(bundle, steps_calls, monkeypatch, fed):
    """As on CUDA (captures forced on; the CPU provider ignores graph ids): a steps call over a cache feeds
    every step total_len = max_seq_len (a replay keeps its capture's total_len), or every step the bucket that
    holds its last step (slot.GPU_TOTAL_LEN "bucket"), and decodes the same tokens."""
    monkeypatch.setattr(slot_module, "GPU_TOTAL_LEN", fed)
    normal = SpeculativeDecoder(bundle)
    graphs = SpeculativeDecoder(bundle, cuda_graphs=True, target_rows=fixed_rows(normal.max_gamma), draft_steps=True)
    for engine in (graphs.target, graphs.draft, graphs.steps_engine):
        engine.captures = True
    for prompt in (PROMPTS[3], PROMPTS[5], PROMPTS[4]):  # PROMPTS[4], γ 4: a call over 31..34, across 32
        for gamma in (4, 8):
            assert graphs.generate(prompt, NEW_TOKENS, gamma).token_ids == normal.generate(prompt, NEW_TOKENS, gamma).token_ids
    assert steps_calls
    buckets = slot_module.total_len_buckets(graphs.max_seq_len)

    def held(total_len: int) -> int:
        return graphs.max_seq_len if fed == "max" else min(b for b in buckets if b >= total_len)

    for rows, total_len, lengths in steps_calls:
        first = [total_len] if rows == total_len else [held(total_len + 3)]  # a prompt's first call: its own length
        assert lengths == first + [held(total_len + 3)] * 3
    if fed == "bucket":
        assert any(held(total_len) < held(total_len + 3) for rows, total_len, _ in steps_calls if rows < total_len)


@pytest.mark.parametrize("steps_file", [None, "draft.greedy.onnx"], ids=["compiled-before-it", "not-a-steps-graph"])
def test_a_bundle_without_a_steps_graph_drafts_a_call_per_token_and_a_wrong_one_is_one_line(bundle, tmp_path, steps_file):
    import shutil

    old = tmp_path / "old"
    shutil.copytree(bundle, old)
    manifest = json.loads((old / "manifest.json").read_text())
    if steps_file is None:
        del manifest["engines"]["draft"]["steps_file"]
    else:
        manifest["engines"]["draft"]["steps_file"] = steps_file
    (old / "manifest.json").write_text(json.dumps(manifest))
    if steps_file is None:
        decoder = SpeculativeDecoder(old, check_digests=False)  # as on CUDA, where it would be used
        assert decoder.steps_engine is None
        assert decoder.generate(PROMPTS[0], NEW_TOKENS, 4).token_ids == SpeculativeDecoder(bundle).generate(
            PROMPTS[0], NEW_TOKENS, 4).token_ids
        with pytest.raises(BundleError, match=r"has no steps graph for its draft.*rebuild it with `specbuild compile`"):
            SpeculativeDecoder(old, check_digests=False, draft_steps=True)  # asked for it
        return
    with pytest.raises(BundleError, match=r"draft.greedy.onnx does not match.*no 'drafts' output.*rebuild it") as error:
        SpeculativeDecoder(old, check_digests=False, draft_steps=True)
    assert "\n" not in str(error.value)


def test_a_thread_gets_back_the_slot_it_had_and_a_new_thread_a_slot_no_thread_had():
    """With CUDA graphs (kept per thread and per slot) a server's worker that changed slots would capture every
    slot's graphs in turn (P² sets for P workers), long after its first requests. Without them, the slot freed
    last, whichever thread asks: light traffic keeps to one slot (and its adaptive γ)."""
    import threading
    from types import SimpleNamespace

    from specbuild_runtime.pool import SlotPool

    pool = SlotPool([SimpleNamespace(index=i, allow_calls=lambda: None) for i in range(3)], affinity=True)  # as for engines that capture
    lifo = SlotPool([SimpleNamespace(index=i, allow_calls=lambda: None) for i in range(3)])
    done = threading.Event()  # workers stay alive until the end: a finished thread's ident may be reused
    workers = []

    def take_in_a_thread(pool: SlotPool) -> list[int]:
        taken, finished = [], threading.Event()

        def run():
            for _ in range(2):
                with pool.take() as slot:
                    taken.append(slot.index)
            finished.set()
            done.wait()
        workers.append(threading.Thread(target=run))
        workers[-1].start()
        finished.wait()
        return taken

    try:
        with pool.take() as mine:
            assert mine.index == 0
        assert take_in_a_thread(pool) == [1, 1]  # not slot 0, free but this thread's
        assert take_in_a_thread(pool) == [2, 2]
        with pool.take() as held:  # this thread's own again, though slot 2 was freed last
            assert held.index == 0
            with pool.take() as second:  # every slot had: the last freed
                assert second.index == 2
        with lifo.take() as mine:
            assert mine.index == 0
        assert take_in_a_thread(lifo) == [0, 0]
    finally:
        done.set()
        for worker in workers:
            worker.join()


def forced_captures(bundle, parallel: int = 1) -> SpeculativeDecoder:
    """A decoder as on CUDA with CUDA graphs (greedy-only graphs, fixed-row target calls, the draft's steps
    graph, calls taking turns, slots kept to threads), its graph ids named though the CPU provider ignores them."""
    import threading

    from specbuild_runtime.manifest import load_manifest

    decoder = SpeculativeDecoder(bundle, cuda_graphs=True, draft_steps=True, parallel=parallel,
                                 target_rows=fixed_rows(load_manifest(bundle).gamma))
    calls = threading.Lock()
    for engine in (decoder.target, decoder.draft, decoder.steps_engine):
        engine.captures, engine.calls = True, calls
    decoder.slots.affinity = True
    return decoder


def test_warm_up_captures_the_shapes_that_requests_of_a_fixed_gamma_meet(bundle):
    """A server's first requests should not wait for captures (decoder.warm_up runs on each worker at start-up).
    Auto γ's free guesses can make the draft catch up on more tokens than warm-up meets: captured when met."""
    assert SpeculativeDecoder(bundle).warm_up() == 0  # nothing to capture
    decoder = forced_captures(bundle)
    assert decoder.warm_up() == decoder.graphs_captured > 0
    before = decoder.graphs_captured
    for gamma in range(decoder.max_gamma + 1):
        for sampling in ({}, {"temperature": 0.8, "seed": 2}):
            for prompt in PROMPTS[:3]:
                decoder.generate(prompt, NEW_TOKENS, gamma, **sampling)
    assert decoder.graphs_captured == before


def test_a_new_thread_warms_up_its_own_graphs_even_under_an_ended_threads_id(bundle, monkeypatch):
    """onnxruntime keeps CUDA graphs per thread; Python reuses an ended thread's id for a new thread (often,
    not always: here every thread has the same id)."""
    import threading

    from specbuild_runtime.slot import CallOptions

    monkeypatch.setattr(threading, "get_ident", lambda: 1)

    decoder = forced_captures(bundle)
    graphs, graph = CallOptions(decoder.target), 7
    named = []

    def runs():
        named.extend(graphs.options(graph).get_run_config_entry("gpu_graph_id") for _ in range(WARM_UP_RUNS + 2))

    for _ in range(2):
        thread = threading.Thread(target=runs)
        thread.start()
        thread.join()
    assert named == 2 * (["-1"] * WARM_UP_RUNS + [str(graph)] * 2)
    assert decoder.target.graphs_captured == 2


def test_every_engine_call_names_a_graph_id_so_onnxruntime_never_raises_looking_it_up(bundle, monkeypatch):
    """onnxruntime 1.32's run_with_iobinding reads gpu_graph_id from the run options of every call, on the CPU too, and
    where it is missing raises and catches a RuntimeError: ~32 µs a call, a quarter of a tiny target's round."""
    named = []
    run = slot_module.run_session

    def recorded(session, binding, path, options=None):
        named.append(options.get_run_config_entry("gpu_graph_id"))  # raises where missing
        run(session, binding, path, options)

    monkeypatch.setattr(slot_module, "run_session", recorded)
    decoder = SpeculativeDecoder(bundle)
    for gamma, sampling in ((0, {}), (2, {}), (2, {"temperature": 0.8, "seed": 1})):  # the sampler's calls too
        decoder.generate(PROMPTS[0], 8, gamma, **sampling)
    assert named and set(named) == {"-1"}


def test_unsteady_calls_count_every_threads_warm_up_and_capture_runs_and_no_replay(bundle):
    """What auto γ leaves out of its costs (test_decode mocks this count): each graph id's first WARM_UP_RUNS + 1
    runs in a thread, which take tens of replays' time on a GPU. Another thread warms up its own graphs
    (onnxruntime keeps them per thread), and its runs count too: captured calls take turns across threads."""
    import threading

    from specbuild_runtime.slot import unsteady_calls

    decoder = forced_captures(bundle)

    def counted() -> int:
        before = unsteady_calls()
        decoder.generate(PROMPTS[0], NEW_TOKENS, gamma=2)  # the same calls each time: each id run at least once
        return unsteady_calls() - before

    here = [counted() for _ in range(WARM_UP_RUNS + 2)]
    assert sum(here) == (WARM_UP_RUNS + 1) * decoder.graphs_captured > 0 and here[-1] == 0, here
    mine, there = unsteady_calls(), []
    thread = threading.Thread(target=lambda: there.append(counted()))
    thread.start()
    thread.join()
    assert there == [here[0]] and unsteady_calls() == mine + here[0]


def test_an_engine_call_onnxruntime_fails_is_one_device_error_and_the_decoder_decodes_exactly_after(bundle, monkeypatch):
    """onnxruntime's own failure (here its terminate flag) surfaces as a DeviceError naming the engine, not as
    an untyped error the CLI reports as a bug; the slot goes back and the next request decodes as before."""
    import onnxruntime as ort

    decoder = SpeculativeDecoder(bundle)
    ids = decoder.encode(PROMPTS[0])
    before = decoder.generate(ids, 12, gamma=3).token_ids
    graph = EngineSlot._graph

    def terminated(self, *args):
        options = ort.RunOptions()
        options.terminate = True
        return options

    monkeypatch.setattr(EngineSlot, "_graph", terminated)
    with pytest.raises(DeviceError, match=r"onnxruntime failed running .*target.*\.onnx: .*terminate.*; if `specbuild inspect`"):
        decoder.generate(ids, 12, gamma=3)
    monkeypatch.setattr(EngineSlot, "_graph", graph)
    assert decoder.generate(ids, 12, gamma=3).token_ids == before


def test_terminate_calls_fails_the_engine_calls_of_the_slots_in_use_until_each_is_given_back(bundle):
    """A server's shutdown stops the engine calls in flight (SlotPool.terminate_calls: onnxruntime's terminate flag, on
    the slot's run options, set from another thread) so that a stuck call cannot hold it. Every later call of that
    request fails too; the slot given back decodes exactly again, its kept prefix (a later prompt's reuse) included,
    and a slot that was free is untouched."""
    decoder = SpeculativeDecoder(bundle, parallel=2)
    ids = decoder.encode(PROMPTS[0])
    expected = decoder.generate(ids, 12, gamma=3).token_ids
    held = decoder.stream(ids, 12, gamma=3)
    next(held)  # in the slot that decoded the prompt before (prefix reuse prefers it)
    decoder.slots.terminate_calls()
    with pytest.raises(DeviceError, match="terminate"):
        list(held)
    assert decoder.generate(ids, 12, gamma=3).token_ids == expected
    both = [decoder.stream(ids, 12, gamma=3) for _ in range(2)]
    firsts = [next(stream) for stream in both]  # each in a slot of its own: the one terminated and the one free then
    assert [[first, *stream] for first, stream in zip(firsts, both)] == [expected] * 2


def test_terminate_calls_also_stops_the_samplers_call_in_progress(bundle, monkeypatch):
    """The greedy-only graphs' sampler (CUDA graphs) decides a sampled call in a call of its own, after the engine's:
    it ran without run options, so one stuck there (a stuck device) held a server's shutdown as a stuck engine call did
    before terminate_calls, till SIGKILL."""
    import threading
    import time

    import onnxruntime as ort

    decoder = SpeculativeDecoder(bundle, cuda_graphs=True)
    sampler, run = decoder.target.sampling_session, ort.InferenceSession.run_with_iobinding
    assert sampler is not None and sampler is not decoder.target.session
    reached, failed = threading.Event(), []

    def stuck_sampler(self, binding, options=None):
        if self is sampler:
            reached.set()
            given_up = time.monotonic() + 30
            while not (options is not None and options.terminate) and time.monotonic() < given_up:
                time.sleep(0.01)
        return run(self, binding, options)

    def decode() -> None:
        try:
            decoder.generate(PROMPTS[0], 12, gamma=3, temperature=0.8, seed=1)
        except DeviceError as error:
            failed.append(error)

    monkeypatch.setattr(ort.InferenceSession, "run_with_iobinding", stuck_sampler)
    worker = threading.Thread(target=decode)
    worker.start()
    assert reached.wait(60)
    began = time.monotonic()
    decoder.slots.terminate_calls()
    worker.join(60)
    assert failed and time.monotonic() - began < 10, time.monotonic() - began


def test_an_engine_call_out_of_memory_says_what_to_decode_less_of():
    class OutOfMemory:
        def run_with_iobinding(self, binding, options):
            raise RuntimeError("[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : CUDA failure 2: out of memory\nfile ...")

    with pytest.raises(DeviceError, match=r"CUDA failure 2: out of memory; the device ran out of memory: decode fewer"):
        slot_module.run_session(OutOfMemory(), None, "bundle/target.onnx")


def test_a_python_error_inside_an_engine_call_stays_a_bug_not_a_device_error():
    class Broken:
        def run_with_iobinding(self, binding, options):
            raise TypeError("run_with_iobinding(): incompatible function arguments")

    with pytest.raises(TypeError):
        slot_module.run_session(Broken(), None, "bundle/target.onnx")


def test_penalties_configured_without_a_prompt_count_no_token_as_the_prompts(bundle):
    """configure's prompt defaults to (): as a NumPy index, () is the whole mask, so every token counted as seen."""
    slot = EngineSlot(SpeculativeDecoder(bundle).target)
    slot.configure(0.0, penalties=(1.5, 0.0, 0.0))
    assert not slot._penalty_values["prompt_mask"].any()
