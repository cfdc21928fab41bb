"""Quantized and half-precision engines: speculative output still equals the (quantized) target's own greedy."""

from pathlib import Path

import numpy as np
import onnx
import pytest

from conftest import PROMPTS
from specbuild.cli import quality_line
from specbuild.compile import compile_bundle, quality
from specbuild.compile.quality import logits_engine, quality_report
from specbuild.compile.precision import FLOAT_TYPES, convert_into
from specbuild.compile.quantize import QuantizedRows, quantize_rows
from specbuild.errors import CheckpointError
from specbuild.recipe import CompileSettings
from specbuild_runtime import SpeculativeDecoder, load_manifest
from specbuild_runtime.logprobs import token_logprobs
from specbuild_runtime.slot import AS_FED, NEVER_ALONE, EngineSlot

NEW_TOKENS = 23
# hidden 128: MatMulNBits' K (the input width of every linear layer: 128 or the MLP's 256) is a multiple
# of the block size 32 (the quantizer would pad it otherwise), and the weights dominate the file.
WIDE = dict(hidden_size=128, intermediate_size=256)


def compiled(folder, target, draft=None, **settings):
    compile_bundle(CompileSettings(target=target, draft=draft or target, output=folder, max_seq_len=256,
                                   quality_report=False, **settings), show_progress=False)
    return folder


@pytest.fixture(scope="module")
def wide(checkpoints):
    return checkpoints("llama", 0, **WIDE)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory, wide):
    """bundle(**settings) -> a compiled bundle whose target and draft are the hidden-128 Llama (so a quantized
    target accepts most of the fp32 draft's drafts but not all, exercising both paths)."""
    made = {}

    def get(**settings):
        key = tuple(sorted(settings.items()))
        if key not in made:
            made[key] = compiled(tmp_path_factory.mktemp("quantize") / f"b{len(made)}", wide, **settings)
        return made[key]

    return get


VARIANTS = ["int4", "int8"]


@pytest.mark.parametrize("mode", VARIANTS)
def test_speculative_output_equals_the_quantized_targets_own_greedy(mode, bundle, tokenizer):
    decoder = SpeculativeDecoder(bundle(target_quantize=mode))
    assert decoder.manifest.engines["target"].quantization == mode
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        expected = decoder.generate(ids, NEW_TOKENS, gamma=0).token_ids
        for gamma in (1, 3, 8):
            assert decoder.generate(ids, NEW_TOKENS, gamma).token_ids == expected, (mode, gamma, prompt)


@pytest.mark.parametrize("mode", VARIANTS)
def test_a_quantized_targets_prompt_scores_the_bits_its_tokens_get_generated(mode, bundle, tokenizer):
    """Where a row computed apart from the others rounds otherwise (int8 compute, blocks of 128): no call is odd."""
    decoder = SpeculativeDecoder(bundle(target_quantize=mode, block_size=128))
    # Prompts of one token aside: the call deciding their first token has one row (none before it to pair with).
    for ids in (i for i in tokenizer(PROMPTS)["input_ids"] if len(i) > 1):
        generated = decoder.generate(ids, NEW_TOKENS, logprobs=0)
        scored = decoder.generate(ids + generated.token_ids, 0, prompt_logprobs=0)
        assert scored.prompt_logprobs[len(ids):] == generated.logprobs, (mode, ids)


@pytest.mark.parametrize("max_gamma", [{"gamma": 3}, {}], ids=["max-gamma-3", "max-gamma-8"])
def test_a_targets_fixed_row_head_leaves_every_cpu_rows_bits_at_every_gamma_and_prompt_length(max_gamma, bundle):
    """The LM head multiplies every row of a call of max γ + 1 (for GPUs, graphs/verification.py). On the CPU such a
    call is even (at max γ 3: a prompt's last 4 rows, where the head multiplied 2) or never made (at max γ 8: calls are
    even), so no row is an odd last one, which int4 at block size 128 computes apart: each prompt of 1 to 2(max γ + 1) + 2
    tokens decodes its target-only logprob bits at every γ, and scores them."""
    decoder = SpeculativeDecoder(bundle(target_quantize="int4", block_size=128, **max_gamma), prefix_reuse=False)
    rows = decoder.max_gamma + 1
    rng = np.random.default_rng(rows)
    for length in range(1, 2 * rows + 3):
        ids = rng.integers(1, 300, length).tolist()
        alone = decoder.generate(ids, NEW_TOKENS, gamma=0, logprobs=0)
        for gamma in (*range(1, rows), "auto"):
            assert decoder.generate(ids, NEW_TOKENS, gamma, logprobs=0).logprobs == alone.logprobs, (length, gamma)
        if length > 1:  # a one-token prompt's first token comes from its one row, computed alone
            scored = decoder.generate(ids + alone.token_ids, 0, prompt_logprobs=0).prompt_logprobs
            assert scored[length:] == alone.logprobs, length


@pytest.mark.parametrize("mode, block_size", [("int4", 128), ("int4", 256), ("int8", 256)])
def test_an_embedding_is_quantized_where_a_gpu_reads_it_as_the_cpu_does_and_either_way_decodes(mode, block_size, bundle,
                                                                                               tokenizer):
    """GatherBlockQuantized returns rows padded to whole blocks (128 -> 256 at 256), which a Slice cuts to the
    width the first layer takes; MatMulNBits pads K itself. At 4 bits a table of an odd number of blocks a row (one
    here) stays float: onnxruntime's CUDA kernel would read its zero points from other rows' bytes (layers.embedding)."""
    decoder = SpeculativeDecoder(bundle(target_quantize=mode, block_size=block_size))
    ops = {node.op_type for node in onnx.load(decoder.root / "target.onnx", load_external_data=False).graph.node}
    assert "MatMulNBits" in ops and ("GatherBlockQuantized" in ops) == (mode == "int8")
    from specbuild.cli import quantized_line  # what `specbuild inspect` prints for it

    bits = mode.removeprefix("int")
    assert quantized_line(decoder.root / "target.onnx") == f"MatMulNBits {bits}-bit, block size {block_size}, accuracy level 4"
    ids = tokenizer(PROMPTS[0])["input_ids"]
    assert decoder.generate(ids, NEW_TOKENS, gamma=3).token_ids == decoder.generate(ids, NEW_TOKENS, gamma=0).token_ids


@pytest.mark.parametrize("mode", VARIANTS)
def test_a_tied_quantized_table_is_stored_once_for_the_lookup_and_the_head(mode, checkpoints, tmp_path, tokenizer):
    """A Qwen3-0.6B-shaped int8 bundle (152k vocabulary, tied) was larger than its fp16 one: the lookup kept the
    fp32 table beside the head's 8-bit copy, and int4 stored the table twice, 4 bit each."""
    decoder = SpeculativeDecoder(compiled(tmp_path / "b", checkpoints("llama3", 0, **WIDE), target_quantize=mode))
    graph = onnx.load(decoder.root / "target.onnx", load_external_data=False).graph
    table = sorted(t.name for t in graph.initializer if t.name.startswith("model.embed_tokens.weight"))
    bits = mode.removeprefix("int")
    assert table == [f"model.embed_tokens.weight.{part}" for part in (f"q{bits}", "scales", "zero_points")]
    for prompt in PROMPTS[:4]:
        ids = tokenizer(prompt)["input_ids"]
        assert decoder.generate(ids, NEW_TOKENS, gamma=3).token_ids == decoder.generate(ids, NEW_TOKENS, gamma=0).token_ids


def test_int4_data_file_is_under_30_percent_of_fp32(bundle):
    fp32_bytes = (bundle() / "target.onnx.data").stat().st_size
    folder = bundle(target_quantize="int4")
    int4_bytes = (folder / "target.onnx.data").stat().st_size
    assert int4_bytes < 0.3 * fp32_bytes
    assert load_manifest(folder).engines["target"].weight_bytes == int4_bytes


@pytest.mark.parametrize("mode", VARIANTS)
def test_quantized_engine_keeps_its_io_and_a_loadable_ir_version(mode, bundle):
    def io(path):
        graph = onnx.load(str(path), load_external_data=False).graph
        return [(v.name, v.type.tensor_type.elem_type) for v in [*graph.input, *graph.output]]

    path = bundle(target_quantize=mode) / "target.onnx"
    assert io(path) == io(bundle() / "target.onnx")
    model = onnx.load(str(path), load_external_data=False)
    assert model.ir_version <= 13  # the most onnxruntime 1.31 loads
    ops = {node.op_type for node in model.graph.node}
    assert not ops & {"Gemm", "MatMul"}  # every linear layer and the LM head are quantized
    assert {"MatMulNBits", "GatherBlockQuantized"} <= ops


@pytest.mark.parametrize("bits", [4, 8])
def test_quantizing_slices_of_rows_gives_onnxruntimes_bits_for_the_whole_tensor(bits):
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, DefaultWeightOnlyQuantizer

    weight = np.random.default_rng(0).standard_normal((300, 200)).astype(np.float32)  # [out, in]; K not a block multiple
    whole = DefaultWeightOnlyQuantizer(DefaultWeightOnlyQuantConfig(block_size=32, is_symmetric=False, bits=bits))
    expected = whole.qbits_block_quant(np.ascontiguousarray(weight.T))
    q = QuantizedRows(300, 200, bits, 32)
    packed, scales, zero_points = q.empty()
    for start in range(0, 300, 64):
        stop = min(start + 64, 300)
        quantize_rows(weight[start:stop], q, packed[start:stop], scales[start:stop], zero_points[start:stop])
    for got, want in zip((packed, scales, zero_points), expected):
        assert np.array_equal(got, want)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_a_checkpoints_nan_or_infinite_weight_is_refused_in_every_float_type(precision, bad):
    rows = np.ones((4, 64), np.float32)
    rows[2, 7] = bad
    with pytest.raises(CheckpointError, match="weight w holds (NaN|an infinite value): the checkpoint is damaged"):
        convert_into(rows, np.empty(rows.shape, FLOAT_TYPES[precision]), name="weight w")


@pytest.mark.parametrize("bits", [4, 8])
def test_a_checkpoints_nan_weight_is_refused_not_quantized(bits):
    rows = np.ones((4, 64), np.float32)
    rows[2, 7] = np.nan
    q = QuantizedRows(4, 64, bits, 32)
    with pytest.raises(CheckpointError, match="weight w holds NaN"):
        quantize_rows(rows, q, *q.empty(), name="weight w")


def test_quantizing_to_none_changes_nothing(bundle):
    """--quantize int4 --target-quantize none: the draft is quantized, the target's engine is the very
    bytes an unquantized compile writes."""
    mixed, fp32 = load_manifest(bundle(quantize="int4", target_quantize="none")), load_manifest(bundle())
    assert mixed.engines["target"].quantization == "none" and mixed.engines["draft"].quantization == "int4"
    for name in ("target.onnx", "target.onnx.data"):
        assert mixed.files[name] == fp32.files[name], name
    assert mixed.files["draft.onnx.data"] != fp32.files["draft.onnx.data"]


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_half_precision_engine_passes_the_onnx_checker_with_half_kv_cache(precision, bundle):
    folder = bundle(precision=precision)
    info = load_manifest(folder).engines["target"]
    assert info.precision == precision and info.source_dtype == "fp32"
    assert info.weight_bytes < 0.55 * (bundle() / "target.onnx.data").stat().st_size
    onnx.checker.check_model(str(folder / "target.onnx"))
    graph = onnx.load(str(folder / "target.onnx"), load_external_data=False).graph
    half = {"fp16": onnx.TensorProto.FLOAT16, "bf16": onnx.TensorProto.BFLOAT16}[precision]
    types = {v.name: v.type.tensor_type.elem_type for v in [*graph.input, *graph.output]}
    assert {types[n] for n in types if n.startswith(("past_", "present_"))} == {half}
    assert types["input_ids"] == onnx.TensorProto.INT64 and types["next_token"] == onnx.TensorProto.INT64
    assert types["probs"] == types["draft_probs"] == onnx.TensorProto.FLOAT


@pytest.mark.parametrize("quantize", ["none", "int4"])
def test_fp16_bundle_decodes_speculatively_like_its_own_target(quantize, bundle, tokenizer):
    decoder = SpeculativeDecoder(bundle(precision="fp16", target_quantize=quantize))
    assert {e.precision for e in decoder.manifest.engines.values()} == {"fp16"}
    for prompt in PROMPTS[:4]:
        ids = tokenizer(prompt)["input_ids"]
        expected = decoder.generate(ids, NEW_TOKENS, gamma=0).token_ids
        assert decoder.generate(ids, NEW_TOKENS, gamma=4).token_ids == expected


def test_quality_report_of_an_engine_against_itself_is_perfect(bundle, tokenizer):
    folder = bundle()
    info = load_manifest(folder).engines["target"]
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS[:2]]
    heldout = tokenizer(PROMPTS[5] * 3)["input_ids"]
    report = quality_report(folder, info, folder, info, prompts, heldout, new_tokens=16)
    assert report["fp32"]["perplexity"] == pytest.approx(report["quant"]["perplexity"])
    assert report["greedy_agreement"] == report["heldout_top1_agreement"] == report["teacher_forced_agreement"] == 1.0
    assert report["greedy_identical_prompts"] == 2 and report["size_ratio"] == 1.0


def test_quality_report_measures_an_int4_engine(bundle, tokenizer):
    fp32, folder = bundle(), bundle(target_quantize="int4")
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS[:2]]
    heldout = tokenizer(PROMPTS[5] * 3)["input_ids"]
    report = quality_report(fp32, load_manifest(fp32).engines["target"],
                            folder, load_manifest(folder).engines["target"], prompts, heldout, new_tokens=16)
    assert report["quant"]["quantization"] == "int4" and report["size_ratio"] < 0.4
    assert 1.0 < report["quant"]["perplexity"] < float("inf")
    assert 0.0 <= report["greedy_agreement"] <= 1.0 and report["quant"]["tokens_per_second"] > 0


def held_out_report(bundle, tokenizer, settings):
    """The quality report of the target built with settings against fp32, over a held-out text of 427 tokens:
    a window of 256 (the bundles' max_seq_len) and one of 171, whose last call of 43 rows is odd (the target re-feeds
    a row)."""
    fp32, folder = bundle(), bundle(**settings)
    heldout = tokenizer(" ".join(PROMPTS) * 8)["input_ids"][:427]
    assert len(heldout) == 427
    return quality_report(fp32, load_manifest(fp32).engines["target"], folder, load_manifest(folder).engines["target"],
                          [tokenizer(PROMPTS[0])["input_ids"]], heldout, new_tokens=16)


def test_a_quality_report_holds_the_logits_of_at_most_64_positions_whatever_its_window(bundle, tokenizer, monkeypatch):
    rows = []
    read = EngineSlot.logits
    monkeypatch.setattr(EngineSlot, "logits", lambda self: rows.append(len(logits := read(self))) or logits)
    report = held_out_report(bundle, tokenizer, {"target_quantize": "int8"})
    assert report["fp32"]["perplexity"] and min(256, quality.HELDOUT_WINDOW) > 64
    assert max(rows) == 64, rows  # [64, V] fp32: 39 MB at a 152k vocabulary, where a 512-token window held 311 MB


@pytest.mark.parametrize("settings", [{"target_quantize": "int8"}, {"target_quantize": "int4", "block_size": 128}],
                         ids=["int8", "int4-bs128"])
def test_a_quality_report_scored_in_pieces_reports_what_one_call_per_window_did(settings, bundle, tokenizer, monkeypatch):
    pieces = held_out_report(bundle, tokenizer, settings)
    monkeypatch.setattr(quality, "SCORED_ROWS", 1 << 20)  # each window in one call, as before (an odd one: two even)
    whole = held_out_report(bundle, tokenizer, settings)
    for report in (pieces, whole):
        for engine in ("fp32", "quant"):
            del report[engine]["tokens_per_second"]  # timed
    assert pieces == whole


def test_a_quality_reports_rows_are_the_bits_the_runtime_scores_a_prompt_with(bundle, checkpoints, tokenizer, tmp_path):
    """The report scores as decode's _score does, each row read (the last too: the teacher-forced agreement's last
    token): an int8 target (blocks of 128, where a row computed apart rounds otherwise) over an odd number of tokens
    under SCORED_ROWS, whose first call must stay even, and a Phi-3 target whose LongRoPE switch (16) falls inside a
    call of SCORED_ROWS, which must end there."""
    phi3 = compiled(tmp_path / "phi3", checkpoints("phi3", original_max_position_embeddings=16))
    text = tokenizer(" ".join(PROMPTS) * 4)["input_ids"]
    for folder, ids in ((bundle(target_quantize="int8", block_size=128), text[:24]), (phi3, text[:101])):
        engine, _ = logits_engine(folder, load_manifest(folder).engines["target"])
        rows = np.concatenate([logits for _, logits in quality.every_logit(engine, ids[:-1])])
        scored = SpeculativeDecoder(folder).generate(ids, 0, prompt_logprobs=20).prompt_logprobs[1:]
        assert [token_logprobs(row, token, 20) for row, token in zip(rows, ids[1:], strict=True)] == scored, folder


def test_compile_reports_quality_and_acceptance_of_a_quantized_draft(wide, tmp_path):
    """The draft is the target's own checkpoint, so the fp32 pair accepts every draft; int4 may cost some."""
    out = tmp_path / "bundle"
    manifest = compile_bundle(CompileSettings(target=wide, draft=wide, output=out, max_seq_len=256,
                                              draft_quantize="int4"), show_progress=False)
    quality = manifest.engines["draft"].quality
    assert manifest.engines["target"].quality == {} and quality["quant"]["quantization"] == "int4"
    assert quality["alpha"]["fp32"] == 1.0 and 0.0 < quality["alpha"]["quant"] <= 1.0
    assert load_manifest(out).engines["draft"].quality == quality
    assert [p.name for p in tmp_path.iterdir()] == ["bundle"]  # the fp32 reference lived in scratch, now gone


def test_measuring_quality_returns_its_reports_and_leaves_the_engines_it_reads_as_they_were(bundle, wide, tokenizer,
                                                                                           tmp_path):
    """A stage takes plain data and returns plain data (the pipeline puts the reports in the manifest): it wrote
    them into the EngineInfo objects it was given."""
    import copy

    from specbuild.compile.load import eos_token_ids, load_checkpoint

    folder = bundle(draft_quantize="int4")  # compiled without a report
    manifest = load_manifest(folder)
    given = copy.deepcopy(manifest.engines)
    checkpoints = {role: load_checkpoint(wide, role) for role in ("target", "draft")}
    (tmp_path / "scratch").mkdir()
    reports = quality.measure_quality(folder, tmp_path / "scratch", manifest.engines, checkpoints, manifest.max_seq_len,
                                      quality.quality_texts(tokenizer), eos_token_ids(checkpoints["target"]))
    assert manifest.engines == given
    assert list(reports) == ["draft"] and reports["draft"]["quant"]["quantization"] == "int4"
    assert reports["draft"]["alpha"]["fp32"] == 1.0  # the draft is the target's own checkpoint


def test_quality_report_is_skipped_above_its_size_limit(wide, tmp_path, monkeypatch):
    monkeypatch.setattr(quality, "QUALITY_MAX_REFERENCE_BYTES", 1000)
    manifest = compile_bundle(CompileSettings(target=wide, draft=wide, output=tmp_path / "b", max_seq_len=64,
                                              draft_quantize="int4"), show_progress=False)
    assert "fp32 reference would be" in manifest.engines["draft"].quality["skipped"]
    assert quality_line(manifest.engines["draft"].quality).startswith("not measured: its fp32 reference")


def test_a_small_quantized_draft_is_measured_without_decoding_a_large_target(checkpoints, wide, tmp_path, monkeypatch):
    small = checkpoints("llama")  # hidden 64: its fp32 reference is about a quarter of the wide target's
    limit = 4 * 150_000
    monkeypatch.setattr(quality, "QUALITY_MAX_REFERENCE_BYTES", limit)
    manifest = compile_bundle(CompileSettings(target=wide, draft=small, output=tmp_path / "b", max_seq_len=64,
                                              draft_quantize="int4"), show_progress=False)
    assert 4 * manifest.engines["target"].parameters > limit >= 4 * manifest.engines["draft"].parameters
    report = manifest.engines["draft"].quality
    assert report["quant"]["quantization"] == "int4" and "fp32 reference would be" in report["alpha"]["skipped"]
    assert "α not measured" in quality_line(report)


def test_a_context_shorter_than_every_measuring_prompt_leaves_agreement_and_alpha_unmeasured(wide, tokenizer, tmp_path):
    """Nothing decoded is no measurement: the draft is the target's own checkpoint, so an α of 0 would be
    wrong, and `inspect` formats what was measured only."""
    assert min(map(len, quality.quality_texts(tokenizer)[0])) > 32
    manifest = compile_bundle(CompileSettings(target=wide, draft=wide, output=tmp_path / "b", max_seq_len=32, gamma=4,
                                              draft_quantize="int4"), show_progress=False)
    report = manifest.engines["draft"].quality
    assert report["quant"]["perplexity"] > 1.0  # held-out windows shrink to the context: still measured
    assert report["greedy_agreement"] is None and report["prompts"] == 0
    assert report["alpha"]["fp32"] is None and report["alpha"]["quant"] is None
    line = quality_line(report)
    assert "greedy agreement and speed not measured" in line and "α not measured" in line


def test_compile_writes_a_bf16_bundle_it_cannot_run_here(wide, tmp_path):
    manifest = compile_bundle(CompileSettings(target=wide, draft=wide, output=tmp_path / "bf16", max_seq_len=64,
                                              precision="bf16"), show_progress=False)
    assert {info.precision for info in manifest.engines.values()} == {"bf16"}
    onnx.checker.check_model(str(tmp_path / "bf16" / "target.onnx"))


# int4 at block size 128 and int8 at 256 (accuracy level 4): onnxruntime computes an odd call's last row
# apart from the others (rows go in pairs), which NEVER_ALONE's even calls avoid.
GROUPINGS = [{}, {"target_quantize": "int4"}, {"target_quantize": "int4", "accuracy_level": 0}, {"target_quantize": "int8"},
             {"target_quantize": "int4", "block_size": 128}, {"target_quantize": "int8", "block_size": 256}]


def logits_batched_and_one_by_one(folder, prompt, rounds, never_alone=True):
    """The target's logits for every token of `rounds`, fed as verification calls (one per round) and
    fed one token per call, each from the same prompt."""
    info = load_manifest(folder).engines["target"]
    (batched, _), (one_by_one, _) = logits_engine(folder, info), logits_engine(folder, info)
    one_by_one.rows = NEVER_ALONE if never_alone else AS_FED
    for engine in (batched, one_by_one):
        engine.step(prompt, len(prompt))
    total, verified, single = len(prompt), [], []
    for tokens in rounds:
        batched.step(tokens, total + len(tokens), num_drafts=len(tokens) - 1)
        verified.append(batched.logits())
        for token in tokens:
            total += 1
            one_by_one.step([token], total)
            single.append(one_by_one.logits())
    return np.concatenate(verified), np.concatenate(single)


@pytest.mark.parametrize("settings", GROUPINGS, ids=["fp32", "int4", "int4-level0", "int8", "int4-bs128", "int8-bs256"])
def test_target_logits_are_the_same_bits_however_rows_are_grouped_into_calls(settings, bundle):
    folder = bundle(**settings)
    rng = np.random.default_rng(0)
    # 1: the prompt's row is computed alone, then re-fed; 33: GroupQueryAttention's 33rd row, alone in its block
    for prompt_len in (1, 2, 9, 33, 40):
        prompt = rng.integers(1, 300, prompt_len).tolist()
        rounds = [rng.integers(1, 300, n).tolist() for n in (3, 5, 2, 9)]
        verified, single = logits_batched_and_one_by_one(folder, prompt, rounds)
        assert np.array_equal(verified, single), (settings, prompt_len)


@pytest.mark.parametrize("settings", GROUPINGS, ids=["fp32", "int4", "int4-level0", "int8", "int4-bs128", "int8-bs256"])
def test_a_prompt_over_what_an_earlier_request_left_gets_the_logits_bits_of_a_fresh_cache(settings, bundle):
    """Prefix reuse's exactness: a request that feeds its prompt from the position where it leaves what the slot's
    cache holds (written by an earlier request's prompt and rounds) gets the bits a fresh cache's prompt gets, in
    its first call and in the round after it, prompts and reused prefixes of either parity."""
    folder = bundle(**settings)
    info = load_manifest(folder).engines["target"]
    (used, _), (fresh, _) = logits_engine(folder, info), logits_engine(folder, info)
    rng = np.random.default_rng(1)
    for prompt_len, rounds, new in ((9, (3, 5, 2), 7), (40, (2, 9), 6), (2, (3,), 1), (33, (5, 4), 2), (11, (2,), 40),
                                    (200, (3,), 31)):
        prompt = rng.integers(1, 300, prompt_len).tolist()  # differs from the cache from its first token
        assert used.prefix(prompt, prompt_len - 1) < prompt_len - 1
        used.step(prompt, prompt_len)
        total = prompt_len
        for n in rounds:
            total += n
            used.step(rng.integers(1, 300, n).tolist(), total, num_drafts=n - 1)
        second = [*used._fed[:total - 1], *rng.integers(1, 300, new).tolist()]
        held = used.prefix(second, len(second) - 1)
        assert held == total - 1
        used.step(second[held:], len(second))
        fresh.step(second, len(second))
        assert np.array_equal(used.logits(), fresh.logits()), (settings, prompt_len)
        round_ = rng.integers(1, 300, 4).tolist()
        for engine in (used, fresh):
            engine.step(round_, len(second) + 4, num_drafts=3)
        assert np.array_equal(used.logits(), fresh.logits()), (settings, prompt_len)


@pytest.mark.parametrize("settings", GROUPINGS, ids=["fp32", "int4", "int4-level0", "int8", "int4-bs128", "int8-bs256"])
def test_choices_scored_after_their_context_get_the_bits_of_prompts_scored_whole(settings, bundle):
    """Scoring's prefix reuse (decode._score) rests on a row's bits not depending on how calls grouped rows: contexts
    of either parity, up to past two 64-row calls, each followed by choices of 1 to 9 tokens."""
    folder = bundle(**settings)
    decoder, whole = SpeculativeDecoder(folder), SpeculativeDecoder(folder, prefix_reuse=False)
    rng = np.random.default_rng(2)
    for context_len in (33, 100, 151):
        context = rng.integers(1, 300, context_len).tolist()
        for n in (1, 4, 9):
            prompt = context + rng.integers(1, 300, n).tolist()
            scored = decoder.generate(prompt, 0, prompt_logprobs=2)
            assert scored.prompt_logprobs == whole.generate(prompt, 0, prompt_logprobs=2).prompt_logprobs, (context_len, n)
            assert scored.stats.cached_prompt_tokens >= (context_len - 1 if n > 1 else 0)


@pytest.mark.parametrize("mode", ["none", *VARIANTS])
def test_a_mixture_of_experts_targets_rows_are_the_same_bits_however_grouped_and_its_experts_quantized(
        mode, checkpoints, tokenizer, tmp_path):
    """Which experts a row reaches depends on the row alone, and so do their arithmetic's bits: every expert computes
    every row (layers.mixture_of_experts), so speculative output is the quantized target's own greedy output too."""
    folder = compiled(tmp_path / "b", checkpoints("qwen3moe", 0, hidden_size=128, moe_intermediate_size=64),
                      target_quantize=mode)
    rng = np.random.default_rng(0)
    for prompt_len in (1, 2, 9, 33):
        prompt = rng.integers(1, 300, prompt_len).tolist()
        rounds = [rng.integers(1, 300, n).tolist() for n in (3, 5, 2, 9)]
        verified, single = logits_batched_and_one_by_one(folder, prompt, rounds)
        assert np.array_equal(verified, single), prompt_len
    decoder = SpeculativeDecoder(folder)
    for prompt in PROMPTS[:4]:
        ids = tokenizer(prompt)["input_ids"]
        expected = decoder.generate(ids, NEW_TOKENS, gamma=0).token_ids
        for gamma in (1, 3, 8):
            assert decoder.generate(ids, NEW_TOKENS, gamma).token_ids == expected, (gamma, prompt)
    graph = onnx.load(folder / "target.onnx", load_external_data=False).graph
    float_experts = [i.name for i in graph.initializer if ".experts." in i.name and ".scales" not in i.name
                     and i.data_type == onnx.TensorProto.FLOAT]
    assert bool(float_experts) == (mode == "none"), float_experts


def test_one_token_calls_without_a_re_fed_row_would_differ(bundle):
    """The control: onnxruntime's one-row kernels round differently, so the rule above is needed."""
    prompt, rounds = list(range(5, 45)), [list(range(50, 55)), list(range(60, 69))]
    verified, single = logits_batched_and_one_by_one(bundle(target_quantize="int4"), prompt, rounds, never_alone=False)
    assert not np.array_equal(verified, single)


def test_draft_agreement_compares_every_token_of_the_continuation(bundles):
    """new_tokens tokens along the target's greedy continuation, the first (the prompt pass's) to the last."""
    from specbuild.compile.gamma import draft_agreement
    from specbuild_runtime import SpeculativeDecoder
    from specbuild_runtime.slot import AS_FED, NEVER_ALONE, EngineSlot

    decoder = SpeculativeDecoder(bundles("llama", 1))
    target, draft = EngineSlot(decoder.target, NEVER_ALONE), EngineSlot(decoder.draft, AS_FED)
    ids = decoder.encode("def f(x):")
    agreements, continuations = draft_agreement(target, draft, [ids], 16)
    alone = decoder.generate(ids, 16, gamma=0).token_ids
    assert len(agreements[0]) == len(alone) == 16 and continuations[0] == alone


def test_the_plans_gamma_measures_agreement_only_as_far_as_requests_decode(bundles, tokenizer):
    """The α behind the TensorRT-LLM and vLLM plans' γ: positions past the target's first eos are no
    request's text (a chat target ends its turn early on the measuring prompts)."""
    from specbuild.compile import gamma
    from specbuild_runtime import SpeculativeDecoder
    from specbuild_runtime.slot import AS_FED, NEVER_ALONE, EngineSlot

    folder = bundles("llama", 1)
    decoder = SpeculativeDecoder(folder)
    prompts = gamma.prompts(tokenizer)
    target, draft = EngineSlot(decoder.target, NEVER_ALONE), EngineSlot(decoder.draft, AS_FED)
    agreements, continuations = gamma.draft_agreement(target, draft, prompts, gamma.NEW_TOKENS)
    eos = continuations[0][3]  # the target writes it early in the first prompt's continuation
    expected = [a for agree, tokens in zip(agreements, continuations)
                for a in agree[:next((i + 1 for i, t in enumerate(tokens) if t == eos), len(tokens))]]
    assert len(expected) < sum(map(len, agreements))
    alpha = gamma.measure_with_engines(folder, decoder.manifest.engines, prompts, decoder.max_seq_len, [eos])
    assert alpha == sum(expected) / len(expected)


def test_quality_reports_the_acceptance_the_runtime_decodes_when_requests_end_at_eos(checkpoints, tokenizer, tmp_path):
    """The runtime ends a request at the target's first eos; rounds along the continuation after it are
    no request's. The target's eos here is a token it writes early on most measuring prompts."""
    from specbuild.compile.quality import quality_texts
    from specbuild.compile.reference import load_reference, transformers_greedy

    prompts = quality_texts(tokenizer)[0]
    reference = load_reference(checkpoints("llama", 0, **WIDE))
    early = [set(transformers_greedy(reference, p, 16, [])) for p in prompts]
    eos = max(range(len(tokenizer)), key=lambda t: sum(t in tokens for tokens in early))
    target = checkpoints("llama", 0, **WIDE, eos_token_id=eos)
    out = tmp_path / "bundle"
    manifest = compile_bundle(CompileSettings(target=target, draft=target, output=out, max_seq_len=256,
                                              draft_quantize="int4"), show_progress=False)
    decoder = SpeculativeDecoder(out)
    stats = [decoder.generate(p, 64, gamma=quality.ALPHA_GAMMA).stats for p in prompts]
    assert manifest.eos_token_ids[0] == eos and sum(s.finish_reason == "eos" for s in stats) > len(prompts) / 2
    runtime_alpha = sum(s.accepted for s in stats) / sum(s.drafted for s in stats)
    assert manifest.engines["draft"].quality["alpha"]["quant"] == pytest.approx(runtime_alpha)


@pytest.mark.parametrize("settings", GROUPINGS, ids=["fp32", "int4", "int4-level0", "int8", "int4-bs128", "int8-bs256"])
def test_a_round_of_an_odd_number_of_rows_over_a_one_token_prompt_gets_the_bits_of_rounds_of_one_token(settings, bundle):
    """A one-token prompt's row is computed alone and re-fed by the next call, which starts at position 0: no row
    before it to re-feed. A round of one draft there is 3 rows; as one call its last row was computed apart (int4 at
    block size 128: another greedy token at γ 1 than at γ 0 for the one-token prompt [115] of the wide pair)."""
    folder = bundle(**settings)
    info = load_manifest(folder).engines["target"]
    (rounds, _), (tokens, _) = logits_engine(folder, info), logits_engine(folder, info)
    rng = np.random.default_rng(0)
    for drafts in (1, 3, 1, 5):
        prompt, token, *proposed = rng.integers(1, 300, 2 + drafts).tolist()
        for engine in (rounds, tokens):
            engine.step([prompt], 1)
        rounds.step([token, *proposed], 2 + drafts, num_drafts=drafts)
        verified = rounds.logits()
        single = []
        for total, fed in enumerate([token, *proposed], 2):
            tokens.step([fed], total)
            single.append(tokens.logits())
        assert np.array_equal(verified, np.concatenate(single)), (settings, drafts)
        assert rounds.kept == tokens.kept == 2 + drafts  # every position written by an even call: reusable


def test_compiles_check_runs_a_quantized_engine_once_and_loads_its_other_graphs(bundle, monkeypatch):
    """Each run of a quantized graph dequantizes every weight to fp32 (1.8-3 s at 0.6B); the greedy-only and steps
    graphs hold the same weights and layers, so loading them proves what their runs would add. fp32 graphs all run."""
    import specbuild.compile.check as check

    ran, loaded = [], []

    class Recorded(check.ort.InferenceSession):
        def __init__(self, path, *args, **options):
            super().__init__(path, *args, **options)
            self.name = Path(path).name
            loaded.append(self.name)

        def run(self, *args, **options):
            ran.append(self.name)
            return super().run(*args, **options)

    folder = bundle(target_quantize="int8")  # before the patch: compiling it runs the check too
    monkeypatch.setattr(check.ort, "InferenceSession", Recorded)
    manifest = load_manifest(folder)
    check.check_engines(folder, manifest.engines, "", manifest.max_seq_len)
    target, draft = manifest.engines["target"], manifest.engines["draft"]
    assert (target.quantization, draft.quantization) == ("int8", "none")
    assert sorted(loaded) == sorted([draft.file, draft.greedy_file, draft.steps_file, target.file, target.greedy_file])
    assert sorted(ran) == sorted([target.file, draft.file, draft.greedy_file, draft.steps_file])


@pytest.mark.parametrize("mode", VARIANTS)
def test_a_quantized_pairs_greedy_only_and_steps_graphs_decode_as_its_engine_graphs(mode, bundle, tokenizer):
    """compile's check only loads a quantized engine's greedy-only and steps graphs (check_engine), and a CPU decodes
    with neither by default: here they run over quantized weights off a GPU. The steps graph drafts what the draft's
    greedy-only calls would (the same accepted drafts); the target's greedy-only graph decodes the target's greedy."""
    folder = bundle(target_quantize=mode, draft_quantize=mode)
    plain, stepped = (SpeculativeDecoder(folder, cuda_graphs=True, draft_steps=steps) for steps in (False, True))
    assert stepped.target.greedy_only and stepped.steps_engine is not None
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        expected = SpeculativeDecoder(folder).generate(ids, NEW_TOKENS, gamma=0).token_ids
        for gamma in (1, 4):  # a round of 4 drafts or more calls the steps graph (pipeline.DRAFT_STEPS)
            a, b = (decoder.generate(ids, NEW_TOKENS, gamma) for decoder in (plain, stepped))
            assert a.token_ids == b.token_ids == expected, (mode, gamma, prompt)
            assert a.stats.accepted == b.stats.accepted and b.stats.drafted > 0, (mode, gamma, prompt)
