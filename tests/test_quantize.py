"""Quantized and half-precision engines: speculative output still equals the (quantized) target's own greedy."""

import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from conftest import PROMPTS
from specbuild.compile.bundle import write_manifest
from specbuild.compile import compile_bundle
from specbuild.compile.precision import convert_precision
from specbuild.compile.quality import _engine, quality_report
from specbuild.compile.quantize import MAX_IR_VERSION, quantize_engine
from specbuild.recipe import CompileSettings
from specbuild_runtime import SpecbuildError, SpeculativeDecoder, load_manifest

NEW_TOKENS = 23
# hidden 128: MatMulNBits' K (the input width of every linear layer: 128 or the MLP's 256) is a multiple
# of the block size 32 (the quantizer would pad it otherwise), and the weights dominate the file.
WIDE = dict(hidden_size=128, intermediate_size=256)


@pytest.fixture(scope="module")
def fp32_bundle(tmp_path_factory, checkpoints):
    """target: a hidden-128 Llama; draft: the same checkpoint, kept fp32 (so a quantized target
    accepts most drafts but not all, exercising both paths)."""
    out = tmp_path_factory.mktemp("quantize") / "fp32"
    target = checkpoints("llama", 0, **WIDE)
    compile_bundle(CompileSettings(target=target, draft=target, output=out, max_seq_len=256), show_progress=False)
    return out


def quantized_copy(source, folder, transform):
    """Copy a bundle, transform its target engine in place, rewrite the manifest (digests)."""
    shutil.copytree(source, folder)
    manifest = load_manifest(folder)
    manifest.engines["target"] = transform(folder, manifest.engines["target"])
    write_manifest(folder, manifest)
    return folder


@pytest.fixture(scope="module")
def quantized(fp32_bundle, tmp_path_factory):
    made = {}

    def get(mode, **options):
        key = (mode, tuple(sorted(options.items())))
        if key not in made:
            folder = tmp_path_factory.mktemp("quantize") / f"{mode}-{len(made)}"
            made[key] = quantized_copy(fp32_bundle, folder, lambda f, info: quantize_engine(f, info, mode, **options))
        return made[key]

    return get


VARIANTS = [("int4", {}), ("int8", {})]
IDS = ["int4", "int8"]


@pytest.mark.parametrize("mode,options", VARIANTS, ids=IDS)
def test_speculative_output_equals_the_quantized_targets_own_greedy(mode, options, quantized, tokenizer):
    decoder = SpeculativeDecoder(quantized(mode, **options))  # also checks the rewritten manifest's digests
    assert decoder.manifest.engines["target"].quantization == mode
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        expected = decoder.generate(ids, NEW_TOKENS, gamma=0).token_ids
        for gamma in (1, 3, 8):
            assert decoder.generate(ids, NEW_TOKENS, gamma).token_ids == expected, (mode, gamma, prompt)


def test_int4_data_file_is_under_30_percent_of_fp32(fp32_bundle, quantized):
    folder = quantized("int4")
    fp32_bytes = (fp32_bundle / "target.onnx.data").stat().st_size
    int4_bytes = (folder / "target.onnx.data").stat().st_size
    assert int4_bytes < 0.3 * fp32_bytes
    assert load_manifest(folder).engines["target"].weight_bytes == int4_bytes


@pytest.mark.parametrize("mode,options", VARIANTS, ids=IDS)
def test_quantized_engine_keeps_its_io_and_a_loadable_ir_version(mode, options, fp32_bundle, quantized):
    def io(path):
        graph = onnx.load(str(path), load_external_data=False).graph
        return [(v.name, v.type.tensor_type.elem_type) for v in [*graph.input, *graph.output]]

    path = quantized(mode, **options) / "target.onnx"
    assert io(path) == io(fp32_bundle / "target.onnx")
    model = onnx.load(str(path), load_external_data=False)
    assert model.ir_version <= MAX_IR_VERSION
    ops = {node.op_type for node in model.graph.node}
    assert "Gemm" not in ops  # the LM head is quantized too
    assert "MatMulNBits" in ops
    assert ("GatherBlockQuantized" in ops) == (mode == "int4")


def test_dynamic_int8_is_refused_for_the_target(fp32_bundle, tmp_path):
    shutil.copytree(fp32_bundle, tmp_path / "b")
    info = load_manifest(tmp_path / "b").engines["target"]
    with pytest.raises(SpecbuildError, match="dynamic int8"):
        quantize_engine(tmp_path / "b", info, "int8", int8_method="dynamic")


def test_dynamic_int8_draft_keeps_speculative_output_equal_to_greedy(fp32_bundle, tmp_path, tokenizer):
    folder = tmp_path / "b"
    shutil.copytree(fp32_bundle, folder)
    manifest = load_manifest(folder)
    manifest.engines["draft"] = quantize_engine(folder, manifest.engines["draft"], "int8", int8_method="dynamic")
    write_manifest(folder, manifest)
    decoder = SpeculativeDecoder(folder)
    assert decoder.manifest.engines["draft"].quantization == "int8"
    for prompt in PROMPTS[:4]:
        ids = tokenizer(prompt)["input_ids"]
        assert decoder.generate(ids, NEW_TOKENS, 3).token_ids == decoder.generate(ids, NEW_TOKENS, 0).token_ids


def test_quantizing_to_none_changes_nothing(fp32_bundle, checkpoints, tmp_path):
    """--quantize int4 --target-quantize none: the draft is quantized, the target's engine is the very
    bytes an unquantized compile writes."""
    target = checkpoints("llama", 0, **WIDE)
    manifest = compile_bundle(CompileSettings(target=target, draft=target, output=tmp_path / "b", max_seq_len=256,
                                              quantize="int4", target_quantize="none", quality_report=False),
                              show_progress=False)
    fp32 = load_manifest(fp32_bundle)
    assert manifest.engines["target"].quantization == "none" and manifest.engines["draft"].quantization == "int4"
    for name in ("target.onnx", "target.onnx.data"):
        assert manifest.files[name] == fp32.files[name], name
    assert manifest.files["draft.onnx.data"] != fp32.files["draft.onnx.data"]


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_half_precision_engine_passes_the_onnx_checker_with_half_kv_cache(precision, fp32_bundle, tmp_path):
    folder = quantized_copy(fp32_bundle, tmp_path / precision, lambda f, info: convert_precision(f, info, precision))
    info = load_manifest(folder).engines["target"]
    assert info.precision == precision
    assert info.weight_bytes < 0.55 * (fp32_bundle / "target.onnx.data").stat().st_size
    onnx.checker.check_model(str(folder / "target.onnx"))
    graph = onnx.load(str(folder / "target.onnx"), load_external_data=False).graph
    half = {"fp16": onnx.TensorProto.FLOAT16, "bf16": onnx.TensorProto.BFLOAT16}[precision]
    types = {v.name: v.type.tensor_type.elem_type for v in [*graph.input, *graph.output]}
    assert {types[n] for n in types if n.startswith(("past_", "present_"))} == {half}
    assert types["input_ids"] == onnx.TensorProto.INT64 and types["next_token"] == onnx.TensorProto.INT64


def test_fp16_engine_runs_on_the_cpu_provider(fp32_bundle, tmp_path):
    folder = quantized_copy(fp32_bundle, tmp_path / "fp16", lambda f, info: convert_precision(f, info, "fp16"))
    session = ort.InferenceSession(str(folder / "target.onnx"), providers=["CPUExecutionProvider"])
    feeds = {"input_ids": np.array([[1, 2, 3]], np.int64), "total_len": np.array(3, np.int32),
             "num_drafts": np.array(2, np.int64)}
    greedy = {"temperature": np.array(0.0, np.float32), "top_k": np.array(0, np.int64),
              "top_p": np.array(1.0, np.float32), "uniforms": np.zeros(1, np.float32),
              "draft_probs": np.zeros((0, 320), np.float32)}
    feeds.update({v.name: greedy[v.name] for v in session.get_inputs() if v.name in greedy})
    for value in session.get_inputs():
        if value.name.startswith("past_"):
            feeds[value.name] = np.zeros(value.shape, np.float16)
    accepted, next_token = session.run(["accepted", "next_token"], feeds)
    assert 0 <= accepted <= 2 and 0 <= next_token < 320


def test_quality_report_of_an_engine_against_itself_is_perfect(fp32_bundle, tokenizer):
    info = load_manifest(fp32_bundle).engines["target"]
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS[:2]]
    heldout = tokenizer(PROMPTS[5] * 3)["input_ids"]
    report = quality_report(fp32_bundle, info, fp32_bundle, info, prompts, heldout, new_tokens=16)
    assert report["fp32"]["perplexity"] == pytest.approx(report["quant"]["perplexity"])
    assert report["greedy_agreement"] == report["heldout_top1_agreement"] == report["teacher_forced_agreement"] == 1.0
    assert report["greedy_identical_prompts"] == 2 and report["size_ratio"] == 1.0


def test_quality_report_measures_an_int4_engine(fp32_bundle, quantized, tokenizer):
    folder = quantized("int4")
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS[:2]]
    heldout = tokenizer(PROMPTS[5] * 3)["input_ids"]
    report = quality_report(fp32_bundle, load_manifest(fp32_bundle).engines["target"],
                            folder, load_manifest(folder).engines["target"], prompts, heldout, new_tokens=16)
    assert report["quant"]["quantization"] == "int4" and report["size_ratio"] < 0.4
    assert 1.0 < report["quant"]["perplexity"] < float("inf")
    assert 0.0 <= report["greedy_agreement"] <= 1.0 and report["quant"]["tokens_per_second"] > 0


def test_compile_reports_quality_and_acceptance_of_a_quantized_draft(checkpoints, tmp_path):
    """The draft is the target's own checkpoint, so the fp32 pair accepts every draft; int4 may cost some."""
    target = checkpoints("llama", 0, **WIDE)
    out = tmp_path / "bundle"
    manifest = compile_bundle(CompileSettings(target=target, draft=target, output=out, max_seq_len=256,
                                              draft_quantize="int4"), show_progress=False)
    quality = manifest.engines["draft"].quality
    assert manifest.engines["target"].quality == {} and quality["quant"]["quantization"] == "int4"
    assert quality["alpha"]["fp32"] == 1.0 and 0.0 < quality["alpha"]["quant"] <= 1.0
    assert load_manifest(out).engines["draft"].quality == quality


def test_compile_writes_a_bf16_bundle_it_cannot_run_here(checkpoints, tmp_path):
    target = checkpoints("llama", 0, **WIDE)
    manifest = compile_bundle(CompileSettings(target=target, draft=target, output=tmp_path / "bf16", max_seq_len=64,
                                              precision="bf16"), show_progress=False)
    assert {info.precision for info in manifest.engines.values()} == {"bf16"}
    onnx.checker.check_model(str(tmp_path / "bf16" / "target.onnx"))


GROUPINGS = [("none", {}), ("int4", {}), ("int4", {"accuracy_level": 0}), ("int8", {})]


def logits_batched_and_one_by_one(folder, prompt, rounds, never_alone=True):
    """The target's logits for every token of `rounds`, fed as verification calls (one per round) and
    fed one token per call, each from the same prompt."""
    info = load_manifest(folder).engines["target"]
    batched, one_by_one = _engine(folder, info, logits=True), _engine(folder, info, logits=True)
    one_by_one._never_alone = never_alone
    for engine in (batched, one_by_one):
        engine.step(prompt, len(prompt))
    total, verified, single = len(prompt), [], []
    for tokens in rounds:
        batched.step(tokens, total + len(tokens), num_drafts=len(tokens) - 1)
        verified.append(batched.output("logits"))
        for token in tokens:
            total += 1
            one_by_one.step([token], total)
            single.append(one_by_one.output("logits"))
    return np.concatenate(verified), np.concatenate(single)


@pytest.mark.parametrize("mode,options", GROUPINGS, ids=["fp32", "int4", "int4-level0", "int8"])
def test_target_logits_are_the_same_bits_however_rows_are_grouped_into_calls(mode, options, fp32_bundle, quantized):
    folder = fp32_bundle if mode == "none" else quantized(mode, **options)
    rng = np.random.default_rng(0)
    for prompt_len in (1, 2, 9, 40):  # 1: the prompt's row is computed alone, then re-fed
        prompt = rng.integers(1, 300, prompt_len).tolist()
        rounds = [rng.integers(1, 300, 5).tolist(), rng.integers(1, 300, 9).tolist()]
        verified, single = logits_batched_and_one_by_one(folder, prompt, rounds)
        assert np.array_equal(verified, single), (mode, options, prompt_len)


def test_one_token_calls_without_a_re_fed_row_would_differ(quantized):
    """The control: onnxruntime's one-row kernels round differently, so the rule above is needed."""
    prompt, rounds = list(range(5, 45)), [list(range(50, 55)), list(range(60, 69))]
    verified, single = logits_batched_and_one_by_one(quantized("int4"), prompt, rounds, never_alone=False)
    assert not np.array_equal(verified, single)
