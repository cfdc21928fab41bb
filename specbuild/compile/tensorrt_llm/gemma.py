"""Gemma 3's tensors, rope and config.json fields, and the Gemma 3 configs TensorRT-LLM would compute otherwise."""

from __future__ import annotations

from typing import Iterator

import numpy as np

from ..load import Checkpoint, ModelSpec
from .layout import COLUMN, EMBEDDING, QKV, REPLICATE, ROW, VOCAB, Out
from .windows import sliding_window


# Gemma 3 (text) as TensorRT-LLM's Gemma model builds it (tensorrt_llm/models/gemma/model.py, config.py and
# convert.py; tensorrt_llm/layers/attention.py, as stored from NVIDIA/TensorRT-LLM's main with Gemma 3 in MODEL_MAP,
# models/__init__.py at 02267d3d): GemmaConfig's Gemma3ConfigGroup fields in config.json, the layer i attending
# locally where (i + 1) % _sliding_window_pattern, with rope_local_base_freq for its rotary base and the window
# run.sh gives it; q/k norms, norms before and after each MLP, the embeddings times sqrt(hidden_size).


def gemma3_rope(ckpt: Checkpoint) -> tuple[dict, dict]:
    """(full, sliding) rope parameters: transformers 5 keeps one set per layer type, 4 the full layers' at the top
    level and the sliding layers' base in rope_local_base_freq."""
    config = ckpt.config
    params = getattr(config, "rope_parameters", None) or {}
    full = params.get("full_attention") or {"rope_theta": getattr(config, "rope_theta", 1e6),
                                            **(getattr(config, "rope_scaling", None) or {})}
    local = params.get("sliding_attention") or {"rope_theta": getattr(config, "rope_local_base_freq", 1e4)}
    return full, local


def gemma3_pattern(spec: ModelSpec) -> int | None:
    """The _sliding_window_pattern whose rule gives exactly the layers' types (None: no pattern does)."""
    types = spec.layer_types
    return next((p for p in range(1, len(types) + 2)
                 if all((kind == "sliding_attention") == bool((i + 1) % p) for i, kind in enumerate(types))), None)


def gemma3_unexported(ckpt: Checkpoint) -> str:
    """Why a Gemma 3 cannot be exported faithfully ("" where it can)."""
    kinds = {params.get("rope_type", params.get("type", "default")) for params in gemma3_rope(ckpt)}
    if kinds != {"default"}:
        # Attention.create_attention_const_params builds the local tables with the one rotary_scaling, and
        # GemmaConfig.from_hugging_face reads rotary_scaling, a key transformers' config has not, so its own
        # converter drops the scaling from both kinds of layer.
        scaled = ", ".join(sorted(kinds - {"default"}))
        return (f"this Gemma 3 scales the rope of its full-attention layers alone ({scaled}), where TensorRT-LLM's "
                "Gemma model applies one rotary scaling to its sliding-window layers as well")
    if gemma3_pattern(ckpt.spec) is None:
        return ("its layer_types do not follow TensorRT-LLM's Gemma rule, which makes layer i sliding-window where "
                "(i + 1) % _sliding_window_pattern is not 0")
    return ""


def gemma3_config(ckpt: Checkpoint, config: dict) -> dict:
    """GemmaConfig: Gemma3ConfigGroup's fields, and use_parallel_embedding, which GemmaConfig sets to tp > 1
    whatever config.json says."""
    spec = ckpt.spec
    full, local = gemma3_rope(ckpt)
    return {**config, "hidden_act": spec.hidden_act, "position_embedding_type": "rope_gpt_neox",
            "rotary_base": float(full["rope_theta"]), "rotary_scaling": None, "attn_bias": spec.attention_bias,
            "mlp_bias": False, "use_parallel_embedding": config["mapping"]["tp_size"] > 1, "inter_layernorms": True,
            "query_pre_attn_scalar": ckpt.config.query_pre_attn_scalar, "final_logit_softcapping": spec.final_softcap,
            "_sliding_window_pattern": gemma3_pattern(spec), "rope_local_base_freq": float(local["rope_theta"]),
            "sliding_window": sliding_window(ckpt) or spec.max_position_embeddings}


def gemma3_tensors(ckpt: Checkpoint, names: set[str]) -> Iterator[Out]:
    """models/gemma/convert.py (HfParser, load_gemma_weights): every norm, q/k norms included, written as 1 + weight
    (TensorRT-LLM's RmsNorm multiplies by its weight alone); the embedding table split by rows at tp > 1
    (use_parallel_embedding), lm_head a copy of it."""
    read, spec = ckpt.tensor, ckpt.spec

    def norm(name: str) -> np.ndarray:
        return read(name).astype(np.float32) + 1.0

    yield Out("transformer.vocab_embedding.weight", EMBEDDING, read("model.embed_tokens.weight"))
    for i in range(spec.shape.num_layers):
        hf, trt = f"model.layers.{i}.", f"transformer.layers.{i}."
        yield Out(trt + "input_layernorm.weight", REPLICATE, norm(hf + "input_layernorm.weight"))
        yield Out(trt + "attention.qkv.weight", QKV, tuple(read(f"{hf}self_attn.{p}_proj.weight") for p in "qkv"))
        if spec.attention_bias:
            yield Out(trt + "attention.qkv.bias", QKV, tuple(read(f"{hf}self_attn.{p}_proj.bias") for p in "qkv"))
            yield Out(trt + "attention.dense.bias", REPLICATE, read(hf + "self_attn.o_proj.bias"))
        yield Out(trt + "attention.dense.weight", ROW, read(hf + "self_attn.o_proj.weight"))
        yield Out(trt + "attention.q_layernorm.weight", REPLICATE, norm(hf + "self_attn.q_norm.weight"))
        yield Out(trt + "attention.k_layernorm.weight", REPLICATE, norm(hf + "self_attn.k_norm.weight"))
        for trt_norm, hf_norm in (("post_layernorm", "post_attention_layernorm"),
                                  ("pre_feedforward_layernorm", "pre_feedforward_layernorm"),
                                  ("post_feedforward_layernorm", "post_feedforward_layernorm")):
            yield Out(f"{trt}{trt_norm}.weight", REPLICATE, norm(f"{hf}{hf_norm}.weight"))
        yield Out(trt + "mlp.fc.weight", COLUMN, read(hf + "mlp.gate_proj.weight"))
        yield Out(trt + "mlp.gate.weight", COLUMN, read(hf + "mlp.up_proj.weight"))
        yield Out(trt + "mlp.proj.weight", ROW, read(hf + "mlp.down_proj.weight"))
    yield Out("transformer.ln_f.weight", REPLICATE, norm("model.norm.weight"))
    yield Out("lm_head.weight", VOCAB, read("lm_head.weight" if "lm_head.weight" in names else
                                            "model.embed_tokens.weight"))
