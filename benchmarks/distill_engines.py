"""Which engine should make distillation's data: torch's batched generate() or the ONNX runtime?

For each target (the demo pair's, and a larger random-weight Llama), tokens per second of
  - the runtime decoding target-only (gamma 0), greedy and sampled, one sequence per call;
  - torch generate() with a KV cache, batches of 1, 16 and 64 prompts, greedy and sampled, keeping logits.
Prints ratios to the runtime's greedy rate and writes JSON.

    python benchmarks/distill_engines.py --pair .cache/demo/pair --json engines.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from specbuild.compile import compile_bundle
from specbuild.recipe import CompileSettings
from specbuild.train.distill import load_model
from specbuild.train.generate import continue_prompts
from specbuild.train.train import llama, parameter_count, save_checkpoint
from specbuild_runtime import SpeculativeDecoder

NEW_TOKENS = 64
LARGER = {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12, "num_attention_heads": 12,
          "num_key_value_heads": 4}  # ~90M parameters at a 4096-token vocabulary: 360 MB fp32, 11x the L3 cache
TINY_DRAFT = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2,
              "num_key_value_heads": 1}


def runtime_rates(bundle: Path, prompts: list[list[int]]) -> dict:
    decoder = SpeculativeDecoder(bundle, check_digests=False, shared_thread_pool=True)
    decoder.generate(prompts[0], 8, gamma=0)  # warm-up
    rates = {}
    for name, temperature in (("greedy", 0.0), ("sampled", 1.0)):
        tokens, started = 0, time.perf_counter()
        for seed, prompt in enumerate(prompts):
            tokens += len(decoder.generate(prompt, NEW_TOKENS, gamma=0, temperature=temperature, seed=seed).token_ids)
        rates[f"runtime {name}"] = tokens / (time.perf_counter() - started)
    return rates


def torch_rates(model, prompts: list[list[int]], vocab: int) -> dict:
    rates = {}
    for batch in (1, 16, 64):
        for name, sample in (("greedy", False), ("sampled", True)):
            rows = (prompts * (batch // len(prompts) + 1))[:batch]
            started = time.perf_counter()
            made = continue_prompts(model, rows, NEW_TOKENS, vocab, sample=sample)
            rates[f"torch batch {batch} {name}"] = sum(len(s.top_ids) for s in made) / (time.perf_counter() - started)
    return rates


def measure(target: Path, draft: Path, scratch: Path) -> dict:
    model, tokenizer = load_model(target, "target")
    bundle = scratch / f"{target.parent.name}-bundle"
    compile_bundle(CompileSettings(target=target, draft=draft, output=bundle, max_seq_len=512, quality_report=False,
                                   overwrite=True))
    prompts = [tokenizer(text)["input_ids"] for text in ("def main():\n", "#include <stdio.h>\n", "The ", "import os\n")]
    rates = {**runtime_rates(bundle, prompts * 2), **torch_rates(model, prompts, len(tokenizer))}
    base = rates["runtime greedy"]
    print(f"{target}: {parameter_count(model) / 1e6:.1f}M parameters")
    for name, rate in rates.items():
        print(f"  {name:<28} {rate:8.0f} tok/s  {rate / base:6.2f}x")
    return {"target": str(target), "tokens_per_second": {k: round(v, 1) for k, v in rates.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", type=Path, required=True, help="a demo pair folder (target/ and draft/)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(dir=args.pair.parent) as scratch:
        scratch = Path(scratch)
        results.append(measure(args.pair / "target", args.pair / "draft", scratch))
        _, tokenizer = load_model(args.pair / "target", "target")
        for name, shape in (("target", LARGER), ("draft", TINY_DRAFT)):
            save_checkpoint(llama(shape, tokenizer), tokenizer, scratch / "larger" / name)
        results.append(measure(scratch / "larger" / "target", scratch / "larger" / "draft", scratch))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
