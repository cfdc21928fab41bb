"""Where a target call's time goes on the GPU, kernel by kernel.

Issue 12: a 1.1B fp16 target call under CUDA graphs took 1.59 ms on an H200 where its MatMuls alone took
0.91 ms (benchmarks/gpu_matmuls.py) and reading its weights once takes 0.55 ms. This decodes target-only
(γ 0) with the runtime and records every CUDA kernel the process runs with torch's profiler (CUPTI sees
onnxruntime's kernels, captured or not: it traces the device, not the framework), then sums them per call
by kind (GEMM, attention, norms, elementwise, the greedy tail, copies and memsets) next to the call's wall
time: what is left between kernels is launch and host time.

H200, onnxruntime-gpu 1.31.1, the TinyLlama-shape fp16 layer pair (2026-11-26), under CUDA graphs: 1.64 ms a
call = 0.840 GEMMs (cuBLAS at 2.5 TB/s = 64% of the copy rate: gate/up 3.3 TB/s, the LM head 3.7, down 2.2,
q/k/v and o 1.6) + 0.216 attention (cuDNN's SDPA, rotary and cache append, lengths) + 0.085 norms + 0.168
elementwise (the MLP's Split, SiLU and Mul 0.135) + 0.030 copies, memsets and the tail + 0.305 idle between
347 kernels.

    python benchmarks/gpu_kernels.py BUNDLE --json kernels.json [-n 64]   # with CUDA graphs, then without

torch is imported here only (a benchmark, not the runtime).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))

from specbuild_runtime import SpeculativeDecoder, Stats  # noqa: E402

# First match wins; kernel names are mangled C++ (cuBLAS, CUTLASS, onnxruntime's own), so by substring.
KINDS = [  # attention first: flash-decoding's splitkv and the memory-efficient kernel's cutlass types
    ("attention", r"sdpa|flash|fmha|xqa|attention|mha|rope|rotary|sequencelengths|softmax"),
    # nvjet_*: cuBLAS's own kernels on sm90; MatMulNBits (int4) kernels by their names
    ("gemm", r"gemm|gemv|nvjet|cutlass|xmma|cublas|splitkreduce|matmulfloatint4|matmulnbits|dequantize"),
    ("norm", r"layernorm|layer_norm|rmsnorm"),
    ("tail", r"arg_min_max|argmax|reduce|topk"),
    ("elementwise", r"elementwise|split|concat|gather|fill|cast|transpose|slice|expand|where"),
]


def kind(name: str) -> str:
    lowered = name.lower()
    for label, pattern in KINDS:
        if re.search(pattern, lowered):
            return label
    return "other"


def profile(bundle: Path, prompt: str, new_tokens: int, cuda_graphs: bool, device: str = "cuda") -> dict:
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    # No digest check: a just-compiled bundle, and hashing an 8B one twice costs ~40 s of a GPU call.
    decoder = SpeculativeDecoder(bundle, device=device, cuda_graphs=cuda_graphs, check_digests=False)
    for _ in range(2):  # warm-up: allocations, kernel loading, captures
        decoder.generate(prompt, new_tokens, gamma=0)
    stats = Stats()
    tokens = decoder.stream(prompt, new_tokens, gamma=0, stats=stats)
    next(tokens)  # the prompt's call, not profiled: only rounds' calls below
    with torch_profile(activities=[ProfilerActivity.CUDA if device == "cuda" else ProfilerActivity.CPU]) as prof:
        list(tokens)
        if device == "cuda":
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as scratch:
        trace = Path(scratch) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    calls = stats.rounds
    if not calls:
        raise SystemExit("the prompt's call ended the request (EOS): no rounds to profile; pass another --prompt")
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    by_name, by_kind = defaultdict(lambda: [0.0, 0]), defaultdict(float)
    for e in kernels:
        label = "copy" if e["cat"] != "kernel" else kind(e["name"])
        by_name[e["name"]][0] += e["dur"]
        by_name[e["name"]][1] += 1
        by_kind[label] += e["dur"]
    per_call = lambda us: round(us / calls / 1e3, 4)  # noqa: E731  µs in all -> ms per call
    return {
        "cuda_graphs": cuda_graphs,
        "calls": calls,
        "wall_ms_per_call": round(1e3 * stats.target_seconds / calls, 4),
        "kernel_ms_per_call": per_call(sum(e["dur"] for e in kernels)),
        "kernels_per_call": round(len(kernels) / calls, 1),
        # between kernels: launch gaps (even in a CUDA graph, ~1 us each) and the host's part of the call
        "idle_ms_per_call": round(1e3 * stats.target_seconds / calls - sum(e["dur"] for e in kernels) / calls / 1e3, 4),
        "by_kind_ms_per_call": {k: per_call(v) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "top_kernels": [{"name": name[:160], "ms_per_call": per_call(us), "per_call": round(count / calls, 2)}
                        for name, (us, count) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:25]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bundle", type=Path)
    parser.add_argument("-n", "--max-new-tokens", type=int, default=64)
    parser.add_argument("--prompt", default="def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a check of this script only "
                        "(torch's profiler does not see onnxruntime's CPU kernels)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    report = {"bundle": str(args.bundle), "runs": []}
    for graphs in ((True, False) if args.device == "cuda" else (False,)):
        run = profile(args.bundle, args.prompt, args.max_new_tokens, graphs, args.device)
        report["runs"].append(run)
        print(f"{'CUDA graphs' if graphs else 'uncaptured'}: {run['wall_ms_per_call']:.3f} ms a call, kernels "
              f"{run['kernel_ms_per_call']:.3f} ms ({run['kernels_per_call']} a call): "
              + ", ".join(f"{k} {v:.3f}" for k, v in run["by_kind_ms_per_call"].items()) + f"; idle {run['idle_ms_per_call']:.3f}")
        for top in run["top_kernels"][:12]:
            print(f"    {top['ms_per_call']:.4f} ms  x{top['per_call']:<6} {top['name'][:110]}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
