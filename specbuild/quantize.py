"""Stage 2c (optional): shrink an exported engine in place — weight quantization or a half-precision graph.

Each function rewrites `folder/info.file` and its `.data` file under the same names and returns the
updated EngineInfo; the caller rewrites the manifest (bundle.write_manifest) so the digests match.

Quantization policy (weights only; activations, norms, rotary tables and the KV cache stay fp32):

    mode    linear layers (MatMul)           LM head                          embedding Gather
    int4    MatMulNBits, 4 bit, asymmetric,  MatMulNBits, 4 bit (see below)   GatherBlockQuantized, 4 bit,
            block_size along K (default 32)                                   blocks along H
    int8    MatMulNBits, 8 bit (default) or  same as the linear layers        fp32 (unchanged)
            quantize_dynamic (int8_method)
    none    unchanged

  * The LM head is a Gemm(transB=1) over a [V, H] table; MatMulNBits and quantize_dynamic only take a
    MatMul, so it is rewritten as MatMul over a transposed [H, V] copy (`{table}.T`) and quantized like
    every other linear layer. Greedy verification needs only its argmax, which 4 bit weights keep for
    all but near-tied logits (see quality_report).
  * Tied embeddings (Llama with tie_word_embeddings, GPT-2's wte): the Gather and the LM head then read
    two copies of the table. At int4 both copies are 4 bit (MatMulNBits layout for the head,
    GatherBlockQuantized layout for the lookup): together ~1/4 of the one fp32 table. At int8 the lookup
    keeps the fp32 table (onnxruntime's quantizer packs Gather at 4 bit only) and the head adds an 8 bit
    copy: +25% of the table over fp32 for tied models, in exchange for a quantized (faster) LM head.
    An untied model's embedding and head are separate tables anyway.
  * MatMulNBits pads K up to a multiple of block_size, so any hidden size works; block_size must be a
    power of two >= 16 (the Gather packing asserts it).
  * int8 default is 8 bit MatMulNBits, although quantize_dynamic (int8_method="dynamic") was faster
    for the ~11M demo Llama (per call, 1 token: ~equal; 5 tokens: dynamic ~1.7x faster). quantize_dynamic
    quantizes the activations with ONE scale per tensor, i.e. over all S tokens of a call, so a token's
    logits depend on which other tokens share the call: the target's verification of γ drafts then
    differs from its own greedy steps, and speculative output stopped equalling greedy output (measured).
    Hence dynamic int8 is refused for the target and allowed for the draft, whose numbers only decide
    acceptance.
  * accuracy_level is MatMulNBits' compute type, default 4 (int8 compute, activations quantized per row
    and block) for both engines. It is the fast one on this AVX2 CPU: an int4 target decodes 2.2x faster
    than at level 0 (fp32 compute, slower than the fp32 model here). Row by row it is as exact as level 0:
    MatMulNBits at any level gives a row the same bits in every call of two or more rows, and the
    runtime never lets a target row be computed alone (see specbuild_runtime.engine.Engine), so
    speculative output equals the quantized target's own greedy output bit for bit at either level.
    (Without that rule level 4 was the risky one: a one-row call differs by ~1e-6 before rounding and
    int8 rounding turned it into logit jumps of up to ~1e-2.)
  * 8 bit MatMulNBits at level 0 runs a slow fallback on this CPU (~8x slower than fp32); at level 4 an
    int8 target decodes about as fast as fp32 here, at 44% of the size.

Half precision (convert_precision, for GPU targets): weights and activations become fp16 (bf16), and so
do the KV cache inputs/outputs `past_*`/`present_*` — they must, because GroupQueryAttention writes into
the bound buffer in place and a Cast at the graph edge would break that. input_ids/total_len/num_drafts
and accepted/next_token are integers and unchanged; every other float input/output (temperature, top_p,
draft_probs, uniforms, probs, and a test graph's logits) stays fp32 behind a Cast. ArgMax compares the
logits after a Cast to fp32. onnxruntime 1.31's CPU provider runs the fp16
graph (GroupQueryAttention, MatMul, Gemm, the norms all have fp16 CPU kernels); it has no bf16 MatMul,
so a bf16 engine passes the ONNX checker but loads only on a GPU provider.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from specbuild_runtime.engine import Engine
from specbuild_runtime.errors import SpecbuildError
from specbuild_runtime.manifest import EngineInfo

MODES = ("none", "int8", "int4")
PRECISIONS = ("fp32", "fp16", "bf16")
INT8_METHODS = ("matmulnbits", "dynamic")
DEFAULT_INT8_METHOD = "matmulnbits"
DEFAULT_ACCURACY_LEVEL = 4  # MatMulNBits int8 compute: the fast one, exact row by row (see module docstring)
MAX_IR_VERSION = 13  # onnxruntime 1.31 loads at most IR 13


# ---------------------------------------------------------------------------------------------------
# Loading and saving an engine with its external data under the same names
# ---------------------------------------------------------------------------------------------------


def _load(folder: Path, info: EngineInfo) -> onnx.ModelProto:
    return onnx.load(str(folder / info.file), load_external_data=True)


def _save(model: onnx.ModelProto, folder: Path, info: EngineInfo, ir_version: int) -> None:
    """Write model as folder/info.file + info.file.data, replacing both only once both are written.

    onnx appends to an existing data file, so the new pair is written in a scratch folder first.
    """
    model.ir_version = min(max(model.ir_version, ir_version), MAX_IR_VERSION)
    _sort_topologically(model.graph)  # quantizers and the fp16 converter append the nodes they add
    scratch = Path(tempfile.mkdtemp(prefix=".quantize-", dir=folder))
    try:
        path = scratch / info.file
        # onnx refuses a data file name that exists relative to the *working directory*: save from scratch.
        with contextlib.chdir(scratch):
            onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                            location=f"{info.file}.data")
        onnx.checker.check_model(str(path))
        data = scratch / f"{info.file}.data"
        if not data.exists():  # every tensor small enough to stay inline: keep the pair anyway
            data.touch()
        os.replace(data, folder / f"{info.file}.data")
        os.replace(path, folder / info.file)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _updated(folder: Path, info: EngineInfo, **changes) -> EngineInfo:
    return dataclasses.replace(info, weight_bytes=(folder / f"{info.file}.data").stat().st_size, **changes)


# ---------------------------------------------------------------------------------------------------
# Quantization
# ---------------------------------------------------------------------------------------------------


def quantize_engine(
    folder: Path,
    info: EngineInfo,
    mode: str,
    block_size: int = 32,
    accuracy_level: int | None = None,
    int8_method: str = DEFAULT_INT8_METHOD,
) -> EngineInfo:
    """Quantize one engine's weights in place (see the module docstring for what is quantized)."""
    folder = Path(folder)
    if mode not in MODES:
        raise SpecbuildError(f"unknown quantization {mode!r}; choose one of {', '.join(MODES)}")
    if mode == "none":
        return info
    if info.quantization != "none":
        raise SpecbuildError(f"the {info.role} engine is already quantized ({info.quantization}); quantize an fp32 engine")
    if info.precision != "fp32":
        raise SpecbuildError(f"the {info.role} engine is {info.precision}; quantize before any precision conversion, from fp32")
    if int8_method not in INT8_METHODS:
        raise SpecbuildError(f"unknown int8 method {int8_method!r}; choose one of {', '.join(INT8_METHODS)}")
    if mode == "int8" and int8_method == "dynamic" and info.role == "target":
        raise SpecbuildError(
            "dynamic int8 quantizes activations per call, so the target's verification would not match its "
            "own greedy decoding; use int8_method='matmulnbits' for the target (dynamic is fine for the draft)"
        )
    if block_size < 16 or block_size & (block_size - 1):
        raise SpecbuildError(f"block size {block_size} must be a power of two, 16 or more")

    model = _load(folder, info)
    ir_version = model.ir_version
    _lm_head_as_matmul(model)
    with _library_logging_kept_quiet():
        if mode == "int8" and int8_method == "dynamic":
            model = _quantize_dynamic(model)
        else:
            level = DEFAULT_ACCURACY_LEVEL if accuracy_level is None else accuracy_level
            model = _quantize_nbits(model, bits=4 if mode == "int4" else 8, block_size=block_size,
                                    accuracy_level=level)
    _save(model, folder, info, ir_version)
    return _updated(folder, info, quantization=mode)


def _lm_head_as_matmul(model: onnx.ModelProto) -> None:
    """Gemm(x, W[V,H], transB=1) -> MatMul(x, W.T[H,V]) over a new transposed initializer."""
    graph = model.graph
    initializers = {t.name: t for t in graph.initializer}
    for index, node in enumerate(graph.node):
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if (node.op_type != "Gemm" or len(node.input) != 2 or node.input[1] not in initializers
                or attrs.get("transB") != 1 or attrs.get("transA", 0) or attrs.get("alpha", 1.0) != 1.0):
            continue
        table = numpy_helper.to_array(initializers[node.input[1]])
        transposed = numpy_helper.from_array(np.ascontiguousarray(table.T), f"{node.input[1]}.T")
        graph.initializer.append(transposed)
        matmul = helper.make_node("MatMul", [node.input[0], transposed.name], list(node.output), name="lm_head")
        graph.node.remove(node)
        graph.node.insert(index, matmul)
        _drop_unused_initializers(graph)
        return
    raise SpecbuildError("no LM head Gemm(transB=1) found in the engine graph; was it built by specbuild?")


def _nodes(graph: onnx.GraphProto):
    """Every node of graph, including those inside If branches (which read the main graph's tensors)."""
    for node in graph.node:
        yield node
        for attr in node.attribute:
            for sub in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else attr.graphs):
                yield from _nodes(sub)


def _drop_unused_initializers(graph: onnx.GraphProto) -> None:
    used = {name for node in _nodes(graph) for name in node.input}
    keep = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(keep)


@contextlib.contextmanager
def _library_logging_kept_quiet():
    """onnxruntime's quantizers configure the root logger as a side effect (the nbits module calls
    logging.basicConfig(level=INFO) on import, the others log through logging.warning(), which does the
    same), after which every log line of the process prints. A placeholder handler on the root logger
    makes those calls no-ops and swallows their chatter; the root logger is left as it was."""
    root = logging.getLogger()
    placeholder = logging.NullHandler()
    root.addHandler(placeholder)
    try:
        yield
    finally:
        root.removeHandler(placeholder)


def _quantize_nbits(model: onnx.ModelProto, bits: int, block_size: int, accuracy_level: int | None) -> onnx.ModelProto:
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    # The library packs Gather (embedding) tables at 4 bit only.
    op_types = ("MatMul", "Gather") if bits == 4 else ("MatMul",)
    quantizer = MatMulNBitsQuantizer(model, bits=bits, block_size=block_size, is_symmetric=False,
                                     accuracy_level=accuracy_level, op_types_to_quantize=op_types)
    quantizer.process()
    out = quantizer.model.model
    _drop_unused_initializers(out.graph)
    return out


def _quantize_dynamic(model: onnx.ModelProto) -> onnx.ModelProto:
    """onnxruntime's dynamic int8: per-tensor int8 weights, activations quantized per call (uint8)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with tempfile.TemporaryDirectory(prefix="specbuild-quantize-") as scratch:
        source, target = Path(scratch) / "in.onnx", Path(scratch) / "out.onnx"
        # Files, not protos: the quantizer then runs shape inference on disk (no 2 GB proto limit).
        with contextlib.chdir(scratch):  # see _save
            onnx.save_model(model, str(source), save_as_external_data=True, location="in.onnx.data")
        quantize_dynamic(source, target, op_types_to_quantize=["MatMul"], weight_type=QuantType.QInt8,
                         use_external_data_format=True,
                         extra_options={"MatMulConstBOnly": True, "DefaultTensorType": TensorProto.FLOAT})
        out = onnx.load(str(target), load_external_data=True)
    _drop_unused_initializers(out.graph)  # _save sorts the nodes it appends for the LM head
    return out


def _sort_topologically(graph: onnx.GraphProto) -> None:
    """Reorder graph's nodes so each comes after the producers of what it (or its If branches) reads;
    otherwise keeps the existing order."""
    producer = {name: index for index, node in enumerate(graph.node) for name in node.output}
    needs = [{producer[name] for sub in _nodes_of(node) for name in sub.input if name in producer} - {index}
             for index, node in enumerate(graph.node)]
    order, placed = [], set()

    def place(index: int) -> None:
        stack = [(index, iter(sorted(needs[index])))]
        while stack:
            current, pending = stack[-1]
            nxt = next((n for n in pending if n not in placed), None)
            if nxt is None:
                stack.pop()
                if current not in placed:
                    placed.add(current)
                    order.append(current)
            else:
                stack.append((nxt, iter(sorted(needs[nxt]))))

    for index in range(len(graph.node)):
        place(index)
    nodes = [graph.node[i] for i in order]
    del graph.node[:]
    graph.node.extend(nodes)


def _nodes_of(node: onnx.NodeProto):
    yield node
    for attr in node.attribute:
        for sub in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else attr.graphs):
            yield from _nodes(sub)


# ---------------------------------------------------------------------------------------------------
# Half precision
# ---------------------------------------------------------------------------------------------------


def convert_precision(folder: Path, info: EngineInfo, precision: str) -> EngineInfo:
    """Convert an fp32 engine's weights and graph to fp16 or bf16 in place (for GPU targets).

    The KV cache inputs/outputs past_*/present_* become the new float type (see the module docstring).
    """
    folder = Path(folder)
    if precision not in PRECISIONS:
        raise SpecbuildError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    if precision == info.precision:
        return info
    if info.precision != "fp32" or info.quantization != "none":
        raise SpecbuildError(
            f"the {info.role} engine is {info.precision}/{info.quantization}; convert precision from an "
            "unquantized fp32 engine"
        )
    from onnxruntime.transformers.float16 import convert_float_to_float16

    model = _load(folder, info)
    ir_version = model.ir_version
    fp32 = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer if t.data_type == TensorProto.FLOAT}
    # The KV buffers must be half (bound in place); every other float input/output (sampling controls,
    # draft_probs, probs, logits) stays fp32 behind a Cast, so the runtime feeds them unchanged.
    keep = [v.name for v in [*model.graph.input, *model.graph.output]
            if v.type.tensor_type.elem_type == TensorProto.FLOAT and not v.name.startswith(("past_", "present_"))]
    with _library_logging_kept_quiet():
        # No shape inference: onnx does not know the com.microsoft ops, and it caps protos at 2 GB.
        model = convert_float_to_float16(model, keep_io_types=keep, disable_shape_infer=True)
    _argmax_in_fp32(model)
    if precision == "bf16":
        _float16_to_bfloat16(model, fp32)
    _save(model, folder, info, ir_version)
    return _updated(folder, info, precision=precision)


def _argmax_in_fp32(model: onnx.ModelProto) -> None:
    """ArgMax decides every token: compare the (half precision) logits in fp32."""
    for graph in _graphs(model.graph):
        for node in list(graph.node):
            if node.op_type == "ArgMax":
                cast = helper.make_node("Cast", [node.input[0]], [f"{node.name}/fp32"], name=f"{node.name}/fp32",
                                        to=TensorProto.FLOAT)
                node.input[0] = cast.output[0]
                graph.node.insert(list(graph.node).index(node), cast)


def _graphs(graph: onnx.GraphProto):
    """graph and every If branch inside it."""
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            for sub in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else attr.graphs):
                yield from _graphs(sub)


def _float16_to_bfloat16(model: onnx.ModelProto, fp32: dict[str, np.ndarray]) -> None:
    """Turn a graph the fp16 converter made into bf16: same structure, every FLOAT16 becomes BFLOAT16.

    Weights are rounded from their fp32 originals (not from fp16, which would clip them to ±65504).
    """
    import ml_dtypes

    for index, tensor in enumerate(model.graph.initializer):
        if tensor.data_type != TensorProto.FLOAT16:
            continue
        source = fp32.get(tensor.name)
        if source is None:
            source = numpy_helper.to_array(tensor).astype(np.float32)
        bf16 = helper.make_tensor(tensor.name, TensorProto.BFLOAT16, source.shape,
                                  source.astype(ml_dtypes.bfloat16).view(np.uint16).tobytes(), raw=True)
        model.graph.initializer[index].CopyFrom(bf16)
    for graph in _graphs(model.graph):
        for value in [*graph.input, *graph.output, *graph.value_info]:
            if value.type.tensor_type.elem_type == TensorProto.FLOAT16:
                value.type.tensor_type.elem_type = TensorProto.BFLOAT16
    for node in _nodes(model.graph):
        for attr in node.attribute:
            if node.op_type == "Cast" and attr.name == "to" and attr.i == TensorProto.FLOAT16:
                attr.i = TensorProto.BFLOAT16


# ---------------------------------------------------------------------------------------------------
# Quality report: what a quantized (or half precision) engine costs against its fp32 original
# ---------------------------------------------------------------------------------------------------


def quality_report(
    fp32_folder: Path,
    fp32_info: EngineInfo,
    quant_folder: Path,
    quant_info: EngineInfo,
    prompts_ids: list[list[int]],
    heldout_ids: list[int],
    new_tokens: int = 64,
) -> dict:
    """Size, held-out perplexity, greedy agreement and decode speed of `quant` next to `fp32`.

    perplexity: teacher-forced over heldout_ids in windows of the engine's max_seq_len (each window
        from an empty cache; its first token is context only).
    heldout_top1_agreement: share of held-out positions where both engines' argmax agree.
    greedy_agreement: per prompt, the first `new_tokens` greedy tokens of each engine compared position
        by position (free running: after the first divergence the two continue from different text),
        averaged over prompts; greedy_identical_prompts counts prompts with identical continuations.
    teacher_forced_agreement: the quantized engine's argmax along the fp32 engine's continuation
        (does not compound divergences).
    tokens_per_second: greedy decode of `new_tokens` tokens, prompt excluded, median over prompts.
    """
    ref = _engine(Path(fp32_folder), fp32_info)
    quant = _engine(Path(quant_folder), quant_info)
    ref_logits, quant_logits = _engine(Path(fp32_folder), fp32_info, logits=True), _engine(Path(quant_folder), quant_info, logits=True)
    max_seq_len = _max_seq_len(ref)

    report = {"new_tokens": new_tokens, "prompts": len(prompts_ids), "heldout_tokens": len(heldout_ids)}
    nll = {"fp32": [], "quant": []}
    same_top1 = []
    window = max_seq_len
    for start in range(0, max(len(heldout_ids) - 1, 0), window):
        chunk = heldout_ids[start:start + window]
        if len(chunk) < 2:
            break
        targets = np.asarray(chunk[1:])
        argmaxes = []
        for key, runner in (("fp32", ref_logits), ("quant", quant_logits)):
            logits = _logits(runner, chunk)[:-1].astype(np.float64)  # [S-1, V]: predictions of chunk[1:]
            logits -= logits.max(axis=-1, keepdims=True)
            log_probs = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
            nll[key].extend(-log_probs[np.arange(len(targets)), targets])
            argmaxes.append(logits.argmax(-1))
        same_top1.extend(argmaxes[0] == argmaxes[1])

    agreement, identical, teacher_forced, speeds = [], 0, [], {"fp32": [], "quant": []}
    for prompt in prompts_ids:
        budget = min(new_tokens, max_seq_len - len(prompt) + 1)
        if budget < 1:
            continue
        ref_tokens, ref_speed = _greedy(ref, prompt, budget)
        quant_tokens, quant_speed = _greedy(quant, prompt, budget)
        speeds["fp32"].append(ref_speed)
        speeds["quant"].append(quant_speed)
        agreement.append(float(np.mean(np.asarray(ref_tokens) == np.asarray(quant_tokens))))
        identical += ref_tokens == quant_tokens
        if len(prompt) + budget - 1 <= max_seq_len:
            along = _logits(quant_logits, prompt + ref_tokens[:-1])[len(prompt) - 1:].argmax(-1)
            teacher_forced.extend(along == np.asarray(ref_tokens))

    for key, folder, info in (("fp32", fp32_folder, fp32_info), ("quant", quant_folder, quant_info)):
        folder = Path(folder)
        report[key] = {
            "precision": info.precision,
            "quantization": info.quantization,
            "bytes_on_disk": sum((folder / name).stat().st_size for name in (info.file, f"{info.file}.data")
                                 if (folder / name).exists()),
            "perplexity": float(np.exp(np.mean(nll[key]))) if nll[key] else None,
            "tokens_per_second": float(np.median(speeds[key])) if speeds[key] else None,
        }
    report["size_ratio"] = report["quant"]["bytes_on_disk"] / report["fp32"]["bytes_on_disk"]
    report["heldout_top1_agreement"] = float(np.mean(same_top1)) if same_top1 else None
    report["greedy_agreement"] = float(np.mean(agreement)) if agreement else None
    report["greedy_identical_prompts"] = int(identical)
    report["teacher_forced_agreement"] = float(np.mean(teacher_forced)) if teacher_forced else None
    return report


ALPHA_GAMMA = 4  # drafts per round at which a quality report measures acceptance


def pair_acceptance(target_folder: Path, target: EngineInfo, draft_folder: Path, draft: EngineInfo,
                    prompts_ids: list[list[int]], gamma: int = ALPHA_GAMMA, new_tokens: int = 64) -> float:
    """Greedy speculative acceptance α (accepted / drafted) of this pair at a fixed γ, exactly as decoding
    would see it: the draft's argmax along the target's own greedy continuation of each prompt."""
    from .distill import rounds  # exact greedy round accounting; the compiler may import torch

    target_engine = _engine(Path(target_folder), target)
    draft_logits = _engine(Path(draft_folder), draft, logits=True)
    max_seq_len = _max_seq_len(target_engine)
    accepted = drafted = 0
    for prompt in prompts_ids:
        budget = min(new_tokens, max_seq_len - len(prompt))
        if budget < 2:
            continue
        tokens, _ = _greedy(target_engine, prompt, budget)
        guesses = _logits(draft_logits, prompt + tokens[:-1])[len(prompt) - 1:].argmax(-1)
        a, d = rounds(list(guesses == np.asarray(tokens)), gamma)
        accepted, drafted = accepted + a, drafted + d
    return accepted / drafted if drafted else 0.0


def _engine(folder: Path, info: EngineInfo, logits: bool = False) -> Engine:
    """A runtime Engine over an engine file; with logits=True its graph gains an fp32 `logits` [D+1, V]
    output (a Cast of ArgMax's input), built in memory with the weights read from the folder."""
    path = folder / info.file
    model = onnx.load(str(path), load_external_data=False)
    max_seq_len = next(i for i in model.graph.input if i.name.startswith("past_key.")).type.tensor_type.shape.dim[2].dim_value
    if not logits:
        return Engine(path, info, max_seq_len)
    argmax = next(node for node in _nodes(model.graph) if node.op_type == "ArgMax")
    model.graph.node.append(helper.make_node("Cast", [argmax.input[0]], ["logits"], name="logits", to=TensorProto.FLOAT))
    model.graph.output.append(helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["D+1", info.shape.vocab_size]))
    return Engine(path, info, max_seq_len, model_bytes=model.SerializeToString(), extra_outputs=("logits",))


def _max_seq_len(engine: Engine) -> int:
    return engine.cache[0].shape()[2]


def _logits(engine: Engine, ids: list[int]) -> np.ndarray:
    """[S, V] fp32 logits at every position of ids, from an empty cache."""
    engine.step(ids, total_len=len(ids), num_drafts=len(ids) - 1)
    return engine.output("logits")


def _greedy(engine: Engine, prompt: list[int], count: int) -> tuple[list[int], float]:
    """count greedy tokens after prompt, and the decode speed (tokens/s after the first token)."""
    tokens = [engine.step(prompt, total_len=len(prompt))[1]]
    first = time.perf_counter()
    while len(tokens) < count:
        tokens.append(engine.step([tokens[-1]], total_len=len(prompt) + len(tokens))[1])
    elapsed = time.perf_counter() - first
    return tokens, (len(tokens) - 1) / elapsed if len(tokens) > 1 else 0.0
