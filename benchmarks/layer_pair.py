"""A target/draft pair at a released model's size whose agreement is dialled, benchmarked per setting.

The draft is the target's own first K layers (same embeddings, final norm and LM head, same values); the
target's later layers write `scale` times their usual output into the residual stream (their o_proj and
down_proj weights are scaled). At scale 0 the draft computes exactly the target's logits (α = 1); the
larger the scale, the more the later layers move the argmax and the lower α. Random weights in the
shape of benchmarks/configs/<shape>.json (llama-family configs: llama, qwen2, qwen3, mistral).

compile_scale draws every tensor from N(0, 0.02), the final norm's weights too, which leaves logits of std
~0.02: near-uniform distributions, over which a sampled round accepts almost every draft whatever the
agreement (α 1.00 at temperature 0.8 on the H200, 2026-11-26). So the final norm (shared by both models) is
scaled to give logits of std `--logit-std`, peaked as a trained model's are; greedy argmaxes do not change.

For each scale: write the target checkpoint (the draft once), `specbuild compile`, `specbuild bench`, and
one line per γ: α, speed-up over target-only in the same run, the bound τ / (γc + 1) with the measured τ
and c (Leviathan et al.'s (1 − α^(γ+1)) / ((1 − α)(γc + 1)) when acceptances are independent), and the
efficiency against it (bench computes them; this collects them).

    python benchmarks/layer_pair.py --scratch /tmp/pairs --scales 0.05,0.2 --precision fp16 --device cuda --json pairs.json
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

from compile_scale import CONFIGS, parameter_shapes, random_checkpoint, tokenizer

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
OUTPUT_PROJECTIONS = re.compile(r"model\.layers\.(\d+)\.(self_attn\.o_proj|mlp\.down_proj)\.weight")


def first_layers(config: dict, layers: int) -> dict:
    """The config of the model made of config's first `layers` layers."""
    draft = dict(config, num_hidden_layers=layers)
    if isinstance(config.get("layer_types"), list):
        draft["layer_types"] = config["layer_types"][:layers]
    if "max_window_layers" in config:
        draft["max_window_layers"] = min(config["max_window_layers"], layers)
    return draft


def tail_scale(layers: int, scale: float):
    """scale(name) for the target: the output projections of every layer from `layers` on."""
    def factor(name: str) -> float:
        match = OUTPUT_PROJECTIONS.fullmatch(name)
        return scale if match and int(match.group(1)) >= layers else 1.0
    return factor


def peaked(config: dict, logit_std: float):
    """scale(name) for both models: the final norm's weights, so that logits have std logit_std (each logit sums
    hidden_size products of a normed value, std = the norm weight's, and an LM head weight, std 0.02)."""
    factor = logit_std / (0.02 * 0.02 * math.sqrt(config["hidden_size"]))
    return lambda name: factor if name == "model.norm.weight" else 1.0


def run(command: list[str], log: Path) -> None:
    with open(log, "w") as out:
        if subprocess.run(command, stdout=out, stderr=subprocess.STDOUT).returncode:
            sys.exit(f"failed: {' '.join(command)} (see {log})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scratch", type=Path, required=True, help="where checkpoints and bundles go (GBs per scale)")
    parser.add_argument("--shape", default="tinyllama-1.1b", help="a llama-family config in benchmarks/configs/ (or "
                        "a config.json's path)")
    parser.add_argument("--draft-layers", type=int, default=2, help="K: the draft is the target's first K layers")
    parser.add_argument("--scales", default="0.05,0.2,0.5", help="comma-separated scales of the later layers' outputs")
    parser.add_argument("--logit-std", type=float, default=8.0, help="std of the logits (the final norm is scaled "
                        "to it): the higher, the more peaked the distributions a sampled round compares")
    parser.add_argument("--precision", default="fp16", choices=["fp32", "fp16", "bf16"])
    parser.add_argument("--quantize", default="none", choices=["none", "int8", "int4"], help="compile's --quantize")
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    parser.add_argument("--no-cuda-graphs", action="store_true", help="bench uncaptured (CUDA graphs are its default "
                        "on cuda for fp16/bf16)")
    parser.add_argument("--gamma", default="1,2,4,8", help="fixed γs for bench (beside target-only and auto)")
    parser.add_argument("-n", "--max-new-tokens", type=int, default=128)
    parser.add_argument("--prompts", type=Path, help="JSONL prompts for bench (default: its bundled code prompts)")
    parser.add_argument("--peers", default="", help="bench's --peers, for the first scale only")
    parser.add_argument("--json", type=Path, help="write every bench report and the summary here")
    args = parser.parse_args()

    path = Path(args.shape) if args.shape.endswith(".json") else CONFIGS / f"{args.shape}.json"
    config = json.loads(path.read_text())
    args.shape = path.stem if args.shape.endswith(".json") else args.shape
    if config["model_type"] not in FAMILIES:
        sys.exit(f"{args.shape} is a {config['model_type']} config; layer pairs are made for {', '.join(FAMILIES)}")
    if not 0 < args.draft_layers < config["num_hidden_layers"]:
        sys.exit(f"--draft-layers must be 1 to {config['num_hidden_layers'] - 1} for {args.shape}")
    args.scratch.mkdir(parents=True, exist_ok=True)
    tok = tokenizer(config["vocab_size"])
    peak = peaked(config, args.logit_std)
    # Checkpoints are kept for a next run; their names say every setting of their values.
    draft = args.scratch / f"{args.shape}-first{args.draft_layers}-logits{args.logit_std:g}"
    if not (draft / "model.safetensors.index.json").exists():
        random_checkpoint(parameter_shapes(first_layers(config, args.draft_layers), draft), draft, tok, scale=peak)
    reports = []
    for index, scale in enumerate(float(s) for s in args.scales.split(",")):
        target = args.scratch / f"{args.shape}-x{scale:g}-logits{args.logit_std:g}"
        kind = args.precision if args.quantize == "none" else f"{args.precision}-{args.quantize}"
        bundle = args.scratch / f"{args.shape}-x{scale:g}-logits{args.logit_std:g}-first{args.draft_layers}-{kind}"
        if not (target / "model.safetensors.index.json").exists():
            tail = tail_scale(args.draft_layers, scale)
            random_checkpoint(parameter_shapes(config, target), target, tok, scale=lambda name: tail(name) * peak(name))
        started = time.perf_counter()
        run([sys.executable, "-m", "specbuild", "compile", "--target", str(target), "--draft", str(draft),
             "--output", str(bundle), "--precision", args.precision, "--quantize", args.quantize, "--overwrite"], bundle.parent / f"{bundle.name}.compile.log")
        compile_seconds = time.perf_counter() - started
        report_file = bundle.parent / f"{bundle.name}.bench.json"
        peers = ["--peers", args.peers] if args.peers and index == 0 else []
        prompts = ["--prompts", str(args.prompts)] if args.prompts else []
        run([sys.executable, "-m", "specbuild", "bench", str(bundle), "--device", args.device, "-n", str(args.max_new_tokens),
             "--gamma", args.gamma, "--json", str(report_file), *prompts, *peers,
             *(["--no-cuda-graphs"] if args.no_cuda_graphs else [])], bundle.parent / f"{bundle.name}.bench.log")
        report = json.loads(report_file.read_text())
        report.update(scale=scale, draft_layers=args.draft_layers, shape=args.shape, compile_seconds=round(compile_seconds, 1))
        reports.append(report)
        print(f"{args.shape} {kind} on {report['device']}, later layers x{scale:g}, draft = first "
              f"{args.draft_layers} layers: target-only {report['results'][0]['tokens_per_second']:.1f} tok/s "
              f"({100 * report['target_bandwidth_fraction']:.0f}% of {report['machine_bandwidth_gbs']} GB/s), a draft step "
              f"{report.get('draft_step_ms', 0):.3f} ms ({100 * report.get('draft_bandwidth_fraction', 0):.0f}%)", flush=True)
        for row in report["results"][1:] + report.get("peers", []):
            bound = f" bound {row['theoretical_speedup']:.2f}x eff {row['efficiency']:.2f}" if "efficiency" in row else ""
            alpha = row.get("acceptance_rate")  # none where nothing was drafted
            print(f"  {row['system']:<30} γ {str(row['gamma']):>4}  α {'-' if alpha is None else f'{alpha:.2f}'}  "
                  f"{row.get('speedup', 0):.2f}x{bound}  exact {row.get('matches_target')}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(reports, indent=1))


if __name__ == "__main__":
    main()
