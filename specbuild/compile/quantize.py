"""Stage 3a (optional): quantize an exported engine's weights in place.

quantize_engine rewrites `folder/info.file` and its `.data` file under the same names and returns the
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
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from specbuild_runtime.errors import SpecbuildError
from specbuild_runtime.manifest import EngineInfo

MODES = ("none", "int8", "int4")
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
