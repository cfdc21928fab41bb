"""One mixture-of-experts layer two ways, on the CPU: as specbuild computes it (graphs/layers.mixture_of_experts: every
expert on every row, two Gemms) and as onnxruntime's com.microsoft MoE op does (the rows routed to each expert
multiplied together). For each: whether every row gets the bits it gets in a call of other rows (the exactness
speculative decoding needs), and the time of a call of S rows, A/B/A' interleaved (A' a second session of A: the
noise), medians.

    python benchmarks/moe_block.py --experts 128 --top-k 8 --hidden 2048 --width 768   # Qwen3-30B-A3B's layer

The graph here restates layers.mixture_of_experts with onnx.helper (fp32, random weights), router included.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper


def dense(experts: int, k: int, hidden: int, width: int, weights: dict) -> str:
    """specbuild's form: Softmax in fp32, TopK, renormalized, scattered to [S, E]; gate and up of every expert in
    one Gemm, the weighted activations through one down Gemm."""
    consts = [numpy_helper.from_array(np.array(v, np.int64), n) for n, v in (
        ("k", [k]), ("axis", [-1]), ("split", [1, 1]), ("by_expert", [-1, experts, 2, width]),
        ("weight_shape", [-1, experts, 1, 1]), ("flat", [-1, experts * width]))]
    consts.append(numpy_helper.from_array(np.zeros((1, 1), np.float32), "zero"))
    nodes = [
        helper.make_node("Gemm", ["x", "router"], ["logits"], transB=1),
        helper.make_node("Softmax", ["logits"], ["scores"], axis=-1),
        helper.make_node("TopK", ["scores", "k"], ["top", "chosen"], axis=-1),
        helper.make_node("ReduceSum", ["top", "axis"], ["total"], keepdims=1),
        helper.make_node("Div", ["top", "total"], ["normed"]),
        helper.make_node("Shape", ["logits"], ["shape"]),
        helper.make_node("Expand", ["zero", "shape"], ["zeros"]),
        helper.make_node("ScatterElements", ["zeros", "chosen", "normed"], ["routing"], axis=1),
        helper.make_node("Gemm", ["x", "gate_up"], ["projected"], transB=1),
        helper.make_node("Reshape", ["projected", "by_expert"], ["grouped"]),
        helper.make_node("Split", ["grouped", "split"], ["gate", "up"], axis=2),
        helper.make_node("Sigmoid", ["gate"], ["sigmoid"]),
        helper.make_node("Mul", ["gate", "sigmoid"], ["silu"]),
        helper.make_node("Mul", ["silu", "up"], ["gated"]),
        helper.make_node("Reshape", ["routing", "weight_shape"], ["per_expert"]),
        helper.make_node("Mul", ["gated", "per_expert"], ["weighted"]),
        helper.make_node("Reshape", ["weighted", "flat"], ["flattened"]),
        helper.make_node("Gemm", ["flattened", "down"], ["y"], transB=1),
    ]
    gate_up = weights["gate_up"].reshape(experts * 2 * width, hidden)  # each expert's gate rows, then its up rows
    down = weights["down"].transpose(1, 0, 2).reshape(hidden, experts * width)  # side by side
    return _model(nodes, hidden, [*consts, numpy_helper.from_array(weights["router"], "router"),
                                  numpy_helper.from_array(gate_up, "gate_up"), numpy_helper.from_array(down, "down")])


def moe_op(experts: int, k: int, hidden: int, width: int, weights: dict) -> str:
    """onnxruntime's MoE op: the router's logits in (it takes their softmax), swiglu with gate and up interleaved by
    row (its CPU kernel's only fused layout)."""
    interleaved = np.stack([weights["gate_up"][:, :width], weights["gate_up"][:, width:]], 2).reshape(
        experts, 2 * width, hidden)
    nodes = [helper.make_node("Gemm", ["x", "router"], ["logits"], transB=1),
             helper.make_node("MoE", ["x", "logits", "fc1", "", "fc2"], ["y"], domain="com.microsoft", k=k,
                              activation_type="swiglu", swiglu_fusion=1, activation_alpha=1.0, activation_beta=0.0,
                              normalize_routing_weights=1)]
    return _model(nodes, hidden, [numpy_helper.from_array(weights["router"], "router"),
                                  numpy_helper.from_array(np.ascontiguousarray(interleaved), "fc1"),
                                  numpy_helper.from_array(weights["down"], "fc2")])


def _model(nodes, hidden: int, initializers) -> str:
    """The model's path, its weights in a file beside it (a layer of Qwen3-30B-A3B's is past protobuf's 2 GB)."""
    graph = helper.make_graph(nodes, "moe", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["S", hidden])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["S", hidden])], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    path = os.path.join(tempfile.mkdtemp(prefix="moe_block-"), "model.onnx")
    onnx.save(model, path, save_as_external_data=True, location="model.onnx.data")
    return path


def rows_alike(session, x: np.ndarray, sizes: list[int]) -> tuple[bool, float]:
    """Whether each row of calls of `sizes` rows gets the bits of the same row in one call of all of x's rows, and
    the largest difference."""
    whole = session.run(None, {"x": x})[0]
    worst = 0.0
    for size in sizes:
        for start in range(0, len(x) - size + 1, max(size, 7)):
            part = session.run(None, {"x": x[start:start + size]})[0]
            worst = max(worst, float(np.abs(part - whole[start:start + size]).max()))
    return worst == 0.0, worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--width", type=int, default=768, help="each expert's intermediate size")
    parser.add_argument("--rows", default="2,6,64", help="rows of the timed calls")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    e, k, h, i = args.experts, args.top_k, args.hidden, args.width
    rng = np.random.default_rng(0)
    weights = {"router": rng.standard_normal((e, h), np.float32) * 0.02,
               "gate_up": rng.standard_normal((e, 2 * i, h), np.float32) * 0.02,
               "down": rng.standard_normal((e, h, i), np.float32) * 0.02}
    options = ort.SessionOptions()
    options.intra_op_num_threads = os.cpu_count() or 1
    paths = {"dense": dense(e, k, h, i, weights), "moe_op": moe_op(e, k, h, i, weights)}
    paths["dense_again"] = paths["dense"]  # a second session of the same file: A/A
    del weights
    sessions = {name: ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
                for name, path in paths.items()}
    x = rng.standard_normal((64, h), np.float32)
    report = {"shape": dict(experts=e, top_k=k, hidden=h, width=i), "load_before": os.getloadavg()}
    report["same_output"] = float(np.abs(sessions["dense"].run(None, {"x": x})[0]
                                         - sessions["moe_op"].run(None, {"x": x})[0]).max())
    for name in ("dense", "moe_op"):
        alike, worst = rows_alike(sessions[name], x, [1, 2, 3, 5, 6, 9, 16])
        report[f"{name}_rows_alike"] = {"alike": alike, "largest_difference": worst}
    for rows in map(int, args.rows.split(",")):
        times = {name: [] for name in sessions}
        for _ in range(args.repeats):
            for name, session in sessions.items():  # interleaved: the load reaches each alike
                started = time.perf_counter()
                session.run(None, {"x": x[:rows]})
                times[name].append(time.perf_counter() - started)
        report[f"ms_median_{rows}_rows"] = {name: round(1e3 * statistics.median(t), 2) for name, t in times.items()}
    report["load_after"] = os.getloadavg()
    print(json.dumps(report, indent=1))
    for path in set(paths.values()):
        shutil.rmtree(os.path.dirname(path))


if __name__ == "__main__":
    main()
