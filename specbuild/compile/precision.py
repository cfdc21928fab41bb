"""Stage 3b (optional): convert an exported engine to half precision in place, for GPU targets.

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

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from specbuild_runtime.errors import SpecbuildError
from specbuild_runtime.manifest import EngineInfo

from .quantize import _library_logging_kept_quiet, _load, _nodes, _save, _updated

PRECISIONS = ("fp32", "fp16", "bf16")

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
