"""Compile at scale: random-weight checkpoints in released models' shapes (benchmarks/configs/), compiled by
specbuild and by onnxruntime-genai's model builder on the same checkpoint and precision in the same run;
peak resident memory and wall time of each, as JSON.

    flock /tmp/specbuild-heavy.lock nice -n 5 python benchmarks/compile_scale.py --scratch /work/scratch/compile \
        --shapes tinyllama-1.1b,qwen2.5-7b --precisions fp16,int4 --json benchmarks/results/compile_scale.json

Checkpoints are bf16, sharded safetensors with an index, written one tensor at a time (so making them is
bounded too). The draft of each compile is a 2-layer model of the same family and vocabulary. Every compile
runs in a process of its own; its peak is the kernel's count for that process (os.wait4's ru_maxrss), its
time the process's wall time. The builder targets CUDA for fp16 (as specbuild's fp16 engines do) and the
CPU for int4; specbuild's compile includes the draft and the one call that checks each engine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import resource
import shutil
import struct
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Callable

import ml_dtypes
import numpy as np

CONFIGS = Path(__file__).parent / "configs"
SHARD_BYTES = 4 << 30
TOKENIZER_VOCAB = 512  # the tokenizer only needs ids inside every model's vocabulary


def parameter_shapes(config: dict, folder: Path) -> list[tuple[str, tuple[int, ...]]]:
    """Parameter names and shapes of this config, from transformers' own model built on the meta device
    (no memory), as checkpoints store them (a mixture's experts one tensor per expert and projection); tied tables
    appear once. Writes config.json into folder."""
    import torch
    import transformers

    from specbuild.compile.load import stored_parts

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(folder))
    return [part for name, p in model.named_parameters()
            for part in stored_parts(type(model).__name__, name, tuple(p.shape), {}, "", folder, "target")]


def random_checkpoint(tensors: list[tuple[str, tuple[int, ...]]], folder: Path, tokenizer, seed: int = 0,
                      scale: Callable[[str], float] = lambda name: 1.0, zero: bool = False) -> None:
    """Random bf16 weights for these tensors (sharded, with an index) and a tokenizer, beside config.json.

    Values are drawn from one 64 MB pool of N(0, 0.02) bf16 numbers at an offset drawn from (seed, name):
    realistic numbers at the speed of a copy, and a tensor of the same name and seed has the same values in
    every checkpoint (layer_pair.py's draft is its target's first layers). scale(name) multiplies a tensor.
    The safetensors files are written by hand, header first and then tensor after tensor, because the
    safetensors library only writes a shard from tensors all held in memory. zero: every weight 0, each shard a
    sparse file (its data a hole: no disk for a checkpoint of 30B parameters; the compile's time is not a real one's).
    """
    rng = np.random.default_rng(seed)
    pool = (rng.standard_normal(32 << 20, dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16)
    shards, current, size = [], [], 0
    for name, shape in tensors:
        nbytes = 2 * math.prod(shape)
        if current and size + nbytes > SHARD_BYTES:
            shards.append(current)
            current, size = [], 0
        current.append((name, shape))
        size += nbytes
    shards.append(current)
    weight_map = {}
    for index, members in enumerate(shards, 1):
        file = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, shape in members:
            header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + 2 * math.prod(shape)]}
            offset += 2 * math.prod(shape)
            weight_map[name] = file
        encoded = json.dumps(header).encode()
        encoded += b" " * (-len(encoded) % 8)
        with open(folder / file, "wb") as f:
            f.write(struct.pack("<Q", len(encoded)) + encoded)
            if zero:
                f.truncate(f.tell() + offset)
                continue
            for name, shape in members:
                left = math.prod(shape)
                start = int.from_bytes(hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()) % len(pool)
                factor = scale(name)
                while left:  # wrapping around the pool
                    part = pool[start:start + left]
                    if factor != 1.0:
                        part = (part.astype(np.float32) * factor).astype(ml_dtypes.bfloat16)
                    f.write(part.tobytes())
                    left, start = left - len(part), 0
    total = sum(2 * math.prod(shape) for _, shape in tensors)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                     "weight_map": weight_map}))
    tokenizer.save_pretrained(folder)


def draft_config(config: dict) -> dict:
    """A 2-layer model of the same family and vocabulary, to pair with the target."""
    small = dict(config)
    if config["model_type"] == "gpt2":
        return {**small, "n_embd": 256, "n_head": 4, "n_layer": 2}
    small.update(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64)
    if "query_pre_attn_scalar" in config:
        small["query_pre_attn_scalar"] = 64
    rope = config.get("rope_scaling") or {}
    if rope.get("long_factor"):  # one factor per rotated pair
        pairs = int(64 * config.get("partial_rotary_factor", 1.0)) // 2
        small["rope_scaling"] = {**rope, "long_factor": rope["long_factor"][:pairs], "short_factor": rope["short_factor"][:pairs]}
    small.pop("max_window_layers", None)
    if "layer_types" in config:  # one per layer (OLMo 3's, from the target's first layers)
        small["layer_types"] = config["layer_types"][:2]
    if config["model_type"] == "qwen3_moe":  # the pair users run: a dense Qwen3 draft of its vocabulary
        small.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3")
    return small


def tokenizer(vocab_size: int | None = None):
    """A small byte-level BPE tokenizer (ids < 512 fit every vocabulary), trained on the standard library.

    vocab_size: pad it to the model's vocabulary with tokens "‹id›", so that every id a random model
    outputs decodes to text (a server streams text: ids without any would never reach its clients)."""
    import transformers
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(stdlib / "textwrap.py")], trainer)
    if vocab_size:
        tok.add_tokens([AddedToken(f"‹{i}›", normalized=False) for i in range(tok.get_vocab_size(), vocab_size)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>")


def measured(command: list[str], log: Path, memory_limit: int | None = None) -> dict:
    """Run command in a process of its own: wall seconds, peak RSS (the kernel's ru_maxrss), exit code,
    the load average around it. memory_limit caps its address space, so a run that would not fit this
    shared machine fails by itself instead of waking the OOM killer."""
    def limit():
        if memory_limit:
            resource.setrlimit(resource.RLIMIT_AS, (memory_limit, memory_limit))

    load_before, started = os.getloadavg()[0], time.perf_counter()
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, preexec_fn=limit)
        _, status, usage = os.wait4(process.pid, 0)
    return {"seconds": round(time.perf_counter() - started, 1), "peak_rss_bytes": usage.ru_maxrss * 1024,
            "exit_code": os.waitstatus_to_exitcode(status), "load_average": [load_before, os.getloadavg()[0]],
            "log": str(log), **({"address_space_limit_bytes": memory_limit} if memory_limit else {})}


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def run(shape: str, precision: str, scratch: Path, builder: bool, keep: bool, tok, builder_limit: int | None,
        zero: bool = False) -> dict:
    config = json.loads((CONFIGS / f"{shape}.json").read_text())
    target, draft = scratch / f"{shape}-target", scratch / f"{shape}-draft"
    made = time.perf_counter()
    tensors = parameter_shapes(config, target)
    if not (target / "model.safetensors.index.json").exists():  # else made by this run for another precision
        random_checkpoint(tensors, target, tok, zero=zero)
    if not (draft / "model.safetensors.index.json").exists():
        random_checkpoint(parameter_shapes(draft_config(config), draft), draft, tok, seed=1)
    largest = max(2 * math.prod(s) for _, s in tensors)
    result = {"shape": shape, "architecture": config["architectures"][0], "precision": precision,
              "parameters": sum(math.prod(s) for _, s in tensors), "checkpoint_bytes": 2 * sum(math.prod(s) for _, s in tensors),
              "largest_tensor_bytes": largest, "checkpoint_seconds": round(time.perf_counter() - made, 1),
              # the goal: 1 GB + 2x the largest tensor for the streaming stages (+ the engine while it runs once)
              "streaming_bound_bytes": (1 << 30) + 2 * largest}

    out = scratch / f"{shape}-{precision}-specbuild"
    # Quantized runs quantize the target only, as the builder does its one model (a quantized draft would
    # add its quality report, which the builder has no counterpart of).
    quantize = ["--target-quantize", precision] if precision in ("int4", "int8") else ["--precision", precision]
    ours = measured([sys.executable, "-m", "specbuild", "compile", "--target", str(target), "--draft", str(draft),
                     "--output", str(out), *quantize], scratch / f"{shape}-{precision}-specbuild.log")
    if ours["exit_code"] == 0:
        manifest = json.loads((out / "manifest.json").read_text())
        ours.update(bundle_bytes=folder_bytes(out), target_bytes=manifest["engines"]["target"]["weight_bytes"],
                    stages=manifest["build"]["stages"])
    result["specbuild"] = ours
    if not keep:
        shutil.rmtree(out, ignore_errors=True)

    if builder:
        out = scratch / f"{shape}-{precision}-builder"
        provider = "cuda" if precision in ("fp16", "bf16") else "cpu"
        theirs = measured([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(target), "-o", str(out),
                           "-p", precision, "-e", provider, "-c", str(scratch / "builder-cache")],
                          scratch / f"{shape}-{precision}-builder.log", builder_limit)
        theirs["execution_provider"] = provider
        if theirs["exit_code"] == 0:
            theirs["output_bytes"] = folder_bytes(out)
        result["builder"] = theirs
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(scratch / "builder-cache", ignore_errors=True)
        if theirs["exit_code"] == 0 and ours["exit_code"] == 0:
            result["time_ratio"] = round(ours["seconds"] / theirs["seconds"], 2)
            result["peak_rss_ratio"] = round(ours["peak_rss_bytes"] / theirs["peak_rss_bytes"], 2)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scratch", type=Path, required=True, help="where checkpoints and outputs go (many GB)")
    parser.add_argument("--shapes", default="tinyllama-1.1b", help=f"comma-separated, of {sorted(p.stem for p in CONFIGS.glob('*.json'))}")
    parser.add_argument("--precisions", default="fp16", help="comma-separated: fp32, fp16, bf16, int8, int4")
    parser.add_argument("--builder", action=argparse.BooleanOptionalAction, default=True,
                        help="also run onnxruntime-genai's model builder on the same checkpoint")
    parser.add_argument("--builder-memory-limit-gb", type=float,
                        help="cap the builder's address space (it holds whole models in memory)")
    parser.add_argument("--keep", action="store_true", help="keep checkpoints and bundles (default: delete them)")
    parser.add_argument("--zero", action="store_true", help="targets of all-zero weights in sparse files (no disk)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()

    args.scratch.mkdir(parents=True, exist_ok=True)
    tok = tokenizer()
    results = []
    for shape in args.shapes.split(","):
        for precision in args.precisions.split(","):
            limit = int(args.builder_memory_limit_gb * 2**30) if args.builder_memory_limit_gb else None
            result = run(shape, precision, args.scratch, args.builder, args.keep, tok, limit, args.zero)
            results.append(result)
            print(json.dumps(result), flush=True)
        if not args.keep:
            for role in ("target", "draft"):
                shutil.rmtree(args.scratch / f"{shape}-{role}", ignore_errors=True)
    report = {"machine": {"cpus": os.cpu_count(), "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
                          "python": platform.python_version(), "load_average_at_end": os.getloadavg()},
              "runs": results}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    for r in results:
        ours, theirs = r["specbuild"], r.get("builder", {})
        print(f"{r['shape']:>16} {r['precision']:>5}  specbuild {ours['seconds']:7.1f} s {ours['peak_rss_bytes'] / 1e9:6.2f} GB"
              + (f"  builder {theirs['seconds']:7.1f} s {theirs['peak_rss_bytes'] / 1e9:6.2f} GB (exit {theirs['exit_code']})"
                 if theirs else ""))


if __name__ == "__main__":
    main()
