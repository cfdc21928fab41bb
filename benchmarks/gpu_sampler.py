"""What a sampled call's tail costs at a released vocabulary, on a device: the bundle's sampler (the engines'
sampling branch as a graph of its own) against onnxruntime's CumSum over a whole vocabulary row alone.

onnxruntime's CUDA CumSum has each output add every element before it (cumsum_impl.cu): V²/2 additions a
row, 1.2e10 at Qwen's 151936. The sampler sums in blocks of 64 (verification._cumsum) and ranks top-p's 1024
most probable tokens before the whole vocabulary (verification._ranked). This times, per row count and
vocabulary: the plain CumSum (fp32 and fp64) over [rows, V]; the sampler without top-p, and with top_p 0.95
on peaked (Zipf, temperature 0.7) and flat logits. Inputs are bound on the device; each figure is the median
of --runs calls after warm-up.

    python benchmarks/gpu_sampler.py --device cuda --json sampler.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))

import onnx_ir as ir  # noqa: E402
import onnxruntime as ort  # noqa: E402

from specbuild.compile.graphs import build_sampler, unprocessed  # noqa: E402
from specbuild_runtime.engine import PROVIDERS, cuda_provider, session_options  # noqa: E402


def plain_cumsum(dtype: ir.DataType) -> bytes:
    x = ir.Value(name="x", type=ir.TensorType(dtype), shape=ir.Shape(["R", "V"]))
    axis = ir.Value(name="axis", const_value=ir.tensor(np.array(1, np.int64)))
    node = ir.Node("", "CumSum", [x, axis])
    node.outputs[0].name, node.outputs[0].type = "y", ir.TensorType(dtype)
    graph = ir.Graph([x], node.outputs, nodes=[node], initializers=[axis], opset_imports={"": 23})
    return ir.to_proto(ir.Model(graph, ir_version=10)).SerializeToString()


HOST_INPUTS = {"num_drafts", "top_k"}


def timed(session: ort.InferenceSession, feeds: dict, device: str, runs: int) -> float:
    """Median milliseconds of a call with every input bound on the device (outputs left to onnxruntime)."""
    binding = session.io_binding()
    for name, value in feeds.items():  # num_drafts and top_k on the host, where onnxruntime reads them (engine.py)
        where = "cpu" if name in HOST_INPUTS else device
        binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(value, where, 0))
    for output in session.get_outputs():
        binding.bind_output(output.name, device)
    for _ in range(3):
        session.run_with_iobinding(binding)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        session.run_with_iobinding(binding)
        binding.synchronize_outputs()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument("--vocabs", default="32000,151936", help="comma-separated vocabulary sizes")
    parser.add_argument("--rows", default="1,5", help="comma-separated row counts (drafts + 1)")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args()
    if args.device == "cuda" and not cuda_provider():
        sys.exit("error: this onnxruntime has no CUDA provider")
    providers = [PROVIDERS[args.device]]
    make = lambda model: ort.InferenceSession(model, session_options(), providers=providers)  # noqa: E731
    sampler = make(ir.to_proto(build_sampler()).SerializeToString())
    plain = {"fp32": make(plain_cumsum(ir.DataType.FLOAT)), "fp64": make(plain_cumsum(ir.DataType.DOUBLE))}
    rng, results = np.random.default_rng(0), []
    for vocab in map(int, args.vocabs.split(",")):
        for rows in map(int, args.rows.split(",")):
            row = {"vocab": vocab, "rows": rows}
            for name, session in plain.items():
                x = rng.random((rows, vocab)).astype(np.float64 if name == "fp64" else np.float32)
                row[f"plain_cumsum_{name}_ms"] = timed(session, {"x": x}, args.device, args.runs)
            zipf = -1.2 * np.log(np.stack([rng.permutation(vocab) + 1.0 for _ in range(rows)]))
            for case, logits, top_p in (("sampler", zipf, 1.0), ("sampler_top_p_peaked", zipf, 0.95),
                                        ("sampler_top_p_flat", rng.normal(size=(rows, vocab)) * 0.1, 0.95)):
                drafts = rows - 1
                q = np.full((drafts, vocab), 1 / vocab, np.float32)
                feeds = {"logits": logits.astype(np.float32), "num_drafts": np.array(drafts, np.int64),
                         "input_ids": rng.integers(0, vocab, (1, rows)).astype(np.int64),
                         "temperature": np.array(0.7, np.float32), "top_k": np.array(0, np.int64),
                         "top_p": np.array(top_p, np.float32), "min_p": np.array(0, np.float32), "draft_probs": q,
                         "uniforms": rng.random(rows, dtype=np.float32), **unprocessed(vocab)}
                row[f"{case}_ms"] = timed(sampler, feeds, args.device, args.runs)
            print(json.dumps(row), flush=True)
            results.append(row)
    if args.json:
        args.json.write_text(json.dumps({"device": args.device, "onnxruntime": ort.__version__, "results": results},
                                        indent=2))


if __name__ == "__main__":
    main()
