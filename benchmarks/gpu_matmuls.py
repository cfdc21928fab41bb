"""How close to the memory bandwidth onnxruntime's MatMuls alone run at a released model's shapes.

Issue 12: a 1.1B fp16 target call took 1.72 ms on an H100 under CUDA graphs where reading its weights takes
~0.78 ms (45% of the measured copy rate). This times only the weight-reading part of such a call: every
layer's q/k/v, o, gate/up and down projections and the LM head as one chain over R rows (R = 1, and max
γ + 1 as fixed-row target calls use), weights bound on the device, with and without CUDA graphs; each chain
twice: as the engines compute it (Gemm with transB=1 over the checkpoint's [out, in] weights) and as MatMul
over [in, out] weights (which would need the weights transposed as they are written). If a chain alone
runs near the bandwidth, the rest of the call (attention, norms, the tail, the host round trip) is where
the time goes; if not, the GEMMs are, and the two forms say whether the layout matters.

H200 (onnxruntime-gpu 1.31.1, 2026-11-26), under CUDA graphs: 0.90-0.96 ms a pass at rows 1, 5 and 9, 57-61%
of the 3.74 TB/s copy rate, Gemm and MatMul alike (uncaptured: 1.16-1.28 ms). So neither the layout nor the
fixed rows cost the bandwidth: cuBLAS's kernels at these shapes do (benchmarks/gpu_kernels.py: per GEMM).

    python benchmarks/gpu_matmuls.py --shape tinyllama-1.1b --rows 1,5,9 --json matmuls.json
    python benchmarks/gpu_matmuls.py ... --cuda-option tunable_op_enable=1 --cuda-option tunable_op_tuning_enable=1

Weights are random and fed as graph inputs (no 2 GB protobuf limit, nothing written to disk).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))

from specbuild.bench.bench import measure_bandwidth  # noqa: E402
from specbuild_runtime.engine import PROVIDERS, cuda_provider, session_options  # noqa: E402

CONFIGS = Path(__file__).parent / "configs"


def chain(config: dict, scale: float) -> tuple[list[tuple[str, list[int]]], int]:
    """(each weight's name and [in, out] shape in call order, the hidden size). scale shrinks every
    dimension (for a quick check on the CPU)."""
    dim = lambda n: max(8, int(n * scale))  # noqa: E731
    hidden, inner = dim(config["hidden_size"]), dim(config["intermediate_size"])
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    qkv, attn = dim((heads + 2 * kv_heads) * head_dim), dim(heads * head_dim)
    weights = []
    for i in range(config["num_hidden_layers"]):
        weights += [(f"qkv.{i}", [hidden, qkv]), (f"o.{i}", [attn, hidden]), (f"gate_up.{i}", [hidden, 2 * inner]),
                    (f"down.{i}", [inner, hidden])]
    return weights + [("lm_head", [hidden, dim(config["vocab_size"])])], hidden


OPS = ("gemm", "matmul")  # Gemm(transB=1) over [out, in] weights, as the engines; MatMul over [in, out]


def model(weights: list[tuple[str, list[int]]], hidden: int, dtype: int, op: str = "gemm") -> bytes:
    """x [R, hidden] through every weight; where the next weight takes fewer inputs than a product has
    columns, its first columns go on (as attention and the gated MLP narrow them), by a Slice."""
    from onnx import TensorProto, helper

    nodes, inputs, x = [], [helper.make_tensor_value_info("x", dtype, ["R", hidden])], "x"
    initializers = [helper.make_tensor("zero", TensorProto.INT64, [1], [0]),
                    helper.make_tensor("one", TensorProto.INT64, [1], [1])]
    for index, (name, (k, n)) in enumerate(weights):
        inputs.append(helper.make_tensor_value_info(name, dtype, layout([k, n], op)))
        if op == "gemm":
            nodes.append(helper.make_node("Gemm", [x, name], [f"{name}.out"], transB=1))
        else:
            nodes.append(helper.make_node("MatMul", [x, name], [f"{name}.out"]))
        x = f"{name}.out"
        following = weights[index + 1][1][0] if index + 1 < len(weights) else n
        if following != n:
            initializers.append(helper.make_tensor(f"{name}.cols", TensorProto.INT64, [1], [following]))
            nodes.append(helper.make_node("Slice", [x, "zero", f"{name}.cols", "one"], [f"{name}.narrow"]))
            x = f"{name}.narrow"
    graph = helper.make_graph(nodes, "matmuls", inputs, [helper.make_tensor_value_info(x, dtype, ["R", weights[-1][1][1]])],
                              initializer=initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10).SerializeToString()


def layout(shape: list[int], op: str) -> list[int]:
    """A weight's [in, out] shape as the op reads it."""
    return shape[::-1] if op == "gemm" else shape


def time_rows(weights, hidden: int, rows: list[int], device: str, graphs: bool, repeats: int,
              op: str = "gemm", cuda_options: dict[str, str] | None = None) -> dict[int, float]:
    """rows -> ms per pass of the chain (best of `repeats` after warm-ups)."""
    import onnxruntime as ort

    from onnx import TensorProto

    # fp16 as the GPU engines; the CPU provider has no fp16 MatMul on x86, so fp32 there (a check only)
    dtype, np_type = (TensorProto.FLOAT16, np.float16) if device == "cuda" else (TensorProto.FLOAT, np.float32)
    options = [{**(cuda_options or {}), **({"enable_cuda_graph": "1"} if graphs else {})}] if device == "cuda" else None
    session = ort.InferenceSession(model(weights, hidden, dtype, op), session_options(), providers=[PROVIDERS[device]],
                                   provider_options=options)
    rng = np.random.default_rng(0)
    tables = {}  # one host array per shape, uploaded once per weight: distinct device memory, quick to make
    binding = session.io_binding()
    for name, shape in weights:
        shape = layout(shape, op)
        if tuple(shape) not in tables:
            tables[tuple(shape)] = (rng.standard_normal(shape, np.float32) * 0.02).astype(np_type)
        binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(tables[tuple(shape)], device, 0))
    times = {}
    for count in rows:
        x = ort.OrtValue.ortvalue_from_numpy(rng.standard_normal((count, hidden), np.float32).astype(np_type), device, 0)
        out = ort.OrtValue.ortvalue_from_shape_and_type([count, weights[-1][1][1]], np_type, device, 0)
        binding.bind_ortvalue_input("x", x)
        binding.bind_ortvalue_output(session.get_outputs()[0].name, out)
        run = ort.RunOptions()
        if graphs:
            run.add_run_config_entry("gpu_graph_id", str(count))
        for _ in range(3):  # warm-up; onnxruntime captures after its own warm-up runs
            session.run_with_iobinding(binding, run)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            session.run_with_iobinding(binding, run)
            best = min(best, time.perf_counter() - start)
        times[count] = best * 1e3
    return times


def key_value(text: str) -> tuple[str, str]:
    key, equals, value = text.partition("=")
    if not equals or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE (e.g. tunable_op_enable=1)")
    return key, value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="tinyllama-1.1b", help="a config in benchmarks/configs/")
    parser.add_argument("--rows", default="1,5,9", help="comma-separated row counts per call")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--scale", type=float, default=1.0, help="shrink every dimension (a quick CPU check)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--cuda-option", action="append", default=[], metavar="KEY=VALUE", type=key_value,
                        help="a CUDA provider option for every session, e.g. tunable_op_enable=1 (repeatable)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    cuda_options = dict(args.cuda_option)
    if args.device == "cuda" and not cuda_provider():
        sys.exit("this onnxruntime has no CUDA provider: install onnxruntime-gpu, or pass --device cpu")
    config = json.loads((CONFIGS / f"{args.shape}.json").read_text())
    weights, hidden = chain(config, args.scale)
    read = sum(k * n for _, (k, n) in weights) * (2 if args.device == "cuda" else 4)
    bandwidth = measure_bandwidth(args.device)
    rows = [int(r) for r in args.rows.split(",")]
    report = {"shape": args.shape, "scale": args.scale, "device": args.device, "cuda_options": cuda_options, "weight_mb": read / 1e6,
              "bandwidth_gbs": round(bandwidth, 1), "ms": {}}
    print(f"{args.shape} x{args.scale}: {read / 1e6:.0f} MB of weights; measured copy rate {bandwidth:.0f} GB/s "
          f"(reading them once: {read / bandwidth / 1e6:.3f} ms)")
    for op in OPS:
        for graphs in ((False, True) if args.device == "cuda" else (False,)):
            label = f"{op} {'CUDA graphs' if graphs else 'uncaptured'}"
            times = time_rows(weights, hidden, rows, args.device, graphs, args.repeats, op, cuda_options)
            report["ms"][label] = times
            for count, ms in times.items():
                print(f"  {label:<19} rows {count:>3}: {ms:.3f} ms a pass, {read / ms / 1e6:.0f} GB/s = "
                      f"{read / ms / 1e6 / bandwidth:.0%} of the copy rate")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
