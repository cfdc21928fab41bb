"""The TensorRT-LLM checkpoints: config.json (trtllm_config, with each family's fields) and the rank files
(RankFile), written one source tensor at a time (write_checkpoint).

The unified checkpoint (tensorrt_llm/models/modeling_utils.py: PretrainedConfig, PretrainedModel.
from_checkpoint; docs/source/architecture/checkpoint.md) is a folder with config.json and one
rank{r}.safetensors per tensor-parallel rank; linear weights are [out_features, in_features] of the rank.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np

from ...progress import bar
from ..load import Checkpoint
from .gemma import gemma3_config, gemma3_tensors
from .gpt2 import gpt2_config, gpt2_tensors
from .layout import EXPERT_FC, EXPERT_PROJ, Layout, ffn_width, shard
from .llama import llama_config, llama_tensors
from .phi3 import phi3_config, phi3_tensors

FOLDER = "tensorrt-llm"

DTYPES = {"fp32": ("float32", np.float32), "fp16": ("float16", np.float16), "bf16": ("bfloat16", ml_dtypes.bfloat16)}
# Weight-only quantization is left to trtllm-build: with quant_algo set, PretrainedModel.from_checkpoint's
# preprocess_weights quantizes every float weight whose name has one of these parts per output channel
# (models/convert_utils.py weight_only_quantize_dict); lm_head and the embeddings stay in the float type. A mixture's
# mlp.fc and mlp.proj [experts, out, in] are quantized per expert and output channel (weight_only_quantize
# transposes the last two axes of a 3-D weight, the per_channel_scale [experts, out] layers/moe.py MOEWeightWrapper
# loads); its mlp.router matches none of these, and stays float32 as the converters write it ("Router should never be
# quantized", models/llama/convert.py).
QUANT_ALGOS = {"none": None, "int8": "W8A16", "int4": "W4A16"}
QUANTIZED_WEIGHTS = ("qkv.weight", "dense.weight", "fc.weight", "proj.weight", "gate.weight")
# Each family's tensors and config.json fields as TensorRT-LLM's model for it reads them; every other family FAMILIES
# takes is built as its LLaMA or QWen model.
WRITERS = {"GPT2LMHeadModel": (gpt2_tensors, gpt2_config), "Gemma3ForCausalLM": (gemma3_tensors, gemma3_config),
           "Phi3ForCausalLM": (phi3_tensors, phi3_config)}
LLAMA = (llama_tensors, llama_config)


def write_checkpoint(ckpt: Checkpoint, out: Path, scratch: Path, tp: int, vocab: int, precision: str,
                     quantization: str, tokens: int | None = None) -> dict:
    """config.json and rank{r}.safetensors in `out`, reading the source one tensor at a time. tokens: a
    draft's, the tokenizer's ids (Layout.tokens)."""
    spec, shape = ckpt.spec, ckpt.spec.shape
    layout = Layout(tp, shape.num_heads, shape.num_kv_heads, shape.head_dim, ffn_width(spec), vocab, tokens,
                    spec.experts)
    dtype_name, dtype = DTYPES[precision]
    config = trtllm_config(ckpt, layout, dtype_name, QUANT_ALGOS[quantization])
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    files = [RankFile(out / f"rank{r}.safetensors", scratch / f"{out.name}-rank{r}.data") for r in range(tp)]
    names = set(ckpt.tensor_names())
    step_bytes = expert_bytes = 0.0
    # Bytes without a total (a tied head is written twice, the vocabulary padded): at 7B, minutes of a stage
    # whose bar would otherwise stand still.
    with bar(None, f"writing TensorRT-LLM {out.name} ({dtype_name})", "B", unit_scale=True) as progress:
        for tensor in WRITERS.get(spec.architecture, LLAMA)[0](ckpt, names):
            quantized = QUANT_ALGOS[quantization] and tensor.name.endswith(QUANTIZED_WEIGHTS)
            # c's denominator, the target decoding alone, is a one-token step, which reads its top-k experts' weights
            # alone (the MoE plugin computes no other); a verification call reads every expert any of its rows
            # chose, which gamma.expert_call_cost reckons from the experts' bytes apart.
            expert = tensor.split in (EXPERT_FC, EXPERT_PROJ)
            read = spec.experts_per_token / spec.experts if expert else 1
            for file, part in zip(files, shard(tensor, layout, tensor.dtype or dtype)):
                file.add(tensor.name, part)
                progress.update(part.nbytes)
                if not tensor.name.endswith("embedding.weight"):  # a step reads one row of these
                    stored = part.size * ({"int8": 1, "int4": 0.5}[quantization] if quantized else part.itemsize)
                    step_bytes += stored * read
                    expert_bytes += stored if expert else 0
        for file in files:
            file.close()
    return {
        "dir": f"{FOLDER}/{out.name}",
        "architecture": config["architecture"],
        "dtype": dtype_name,
        "quant_algo": config["quantization"]["quant_algo"],
        "vocab_size": vocab,
        "source_vocab_size": shape.vocab_size,
        "lm_head_rows": layout.padded_vocab,
        # as transformers counts them, as the ONNX engines' summary does: a tied head once, though written out
        # as lm_head.weight (as TensorRT-LLM's own converters write it, models/llama/convert.py)
        "parameters": ckpt.parameters(),
        # what a decoding step reads over all ranks once trtllm-build has quantized: the cost ratio
        # the plans use when no engine was timed
        "weight_bytes": int(step_bytes),
        # a mixture's: every expert's weights, as quantized (the bytes a call whose rows chose them all reads)
        **({"expert_bytes": int(expert_bytes)} if spec.experts else {}),
        "ranks": [{**rank, "file": f"{FOLDER}/{out.name}/{rank['file']}"} for rank in layout.ranks()],
    }


def source(ckpt: Checkpoint) -> dict:
    return {"path": str(ckpt.path.resolve()), "sha256": ckpt.digest()}


def trtllm_config(ckpt: Checkpoint, layout: Layout, dtype: str, quant_algo: str | None) -> dict:
    """config.json: PretrainedConfig's fields, then the family's own (WRITERS)."""
    spec, shape = ckpt.spec, ckpt.spec.shape
    config = {
        "architecture": spec.architecture,  # models/__init__.py MODEL_MAP keys on the HF name
        "dtype": dtype,
        "logits_dtype": "float32",
        "vocab_size": layout.vocab,
        "hidden_size": shape.hidden_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_size": shape.head_dim,
        "intermediate_size": spec.intermediate_size,
        "norm_epsilon": spec.norm_eps,
        "max_position_embeddings": spec.max_position_embeddings,
        "mapping": {"world_size": layout.tp, "tp_size": layout.tp, "pp_size": 1,
                    **({"moe_tp_size": layout.tp, "moe_ep_size": 1} if spec.experts else {})},
        "quantization": {"quant_algo": quant_algo, "kv_cache_quant_algo": None},
        "use_parallel_embedding": False,
        "embedding_sharding_dim": 0,
    }
    return WRITERS.get(spec.architecture, LLAMA)[1](ckpt, config)


class RankFile:
    """One rank{r}.safetensors written tensor by tensor.

    The safetensors library writes a whole dict at once (save_file), which would hold a rank's weights in
    memory. The format is small: an 8-byte little-endian header length, a JSON header naming each
    tensor's dtype, shape and byte range, then the bytes. So the bytes go to a scratch file as they come
    and the header is put in front when the rank is complete (reference.py reads it back with
    the library).
    """

    SAFETENSORS_DTYPES = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(ml_dtypes.bfloat16): "BF16"}

    def __init__(self, path: Path, scratch: Path):
        self.path, self.scratch = path, scratch
        self.scratch.parent.mkdir(parents=True, exist_ok=True)
        self.data = open(scratch, "wb")
        self.header: dict = {"__metadata__": {"format": "pt"}}

    def add(self, name: str, value: np.ndarray) -> None:
        start = self.data.tell()
        # Not tofile(): its short write carries no errno, so a full quota (whose disk may show free space) would
        # not read as a full disk (staging._disk_full).
        self.data.write(np.ascontiguousarray(value).reshape(-1).view(np.uint8).data)
        self.header[name] = {"dtype": self.SAFETENSORS_DTYPES[value.dtype], "shape": list(value.shape),
                             "data_offsets": [start, self.data.tell()]}

    def close(self) -> None:
        self.data.close()
        header = json.dumps(self.header, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)  # the tensors start 8-byte aligned, as the library writes them
        with open(self.path, "wb") as out, open(self.scratch, "rb") as data:
            out.write(len(header).to_bytes(8, "little"))
            out.write(header)
            shutil.copyfileobj(data, out, 1 << 24)
        self.scratch.unlink()
