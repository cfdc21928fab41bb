"""Phi-3's tensors, rope and config.json fields, and the Phi-3 configs and contexts TensorRT-LLM would compute
otherwise."""

from __future__ import annotations

import math
from typing import Iterator

import numpy as np

from ...errors import UnsupportedModelError
from ..load import Checkpoint, longrope_length, rotary_module
from .layout import GATED_FC, QKV, REPLICATE, ROW, VOCAB, Out


# Phi-3 (Phi3ForCausalLM: Phi-3-mini and -medium, Phi-3.5-mini, Phi-4, Phi-4-mini) as TensorRT-LLM's Phi-3 model
# builds it (tensorrt_llm/models/phi3/model.py at 1479eaf5, config.py at 033f4067, convert.py at 89fd9b74,
# split_weights.py at 7dfda15a; layers/attention.py, layers/mlp.py, functional.py RopeEmbeddingUtils): RmsNorms, no
# biases, an MLP whose fc holds both halves of the gated pair (hidden_act swiglu), whole-rank embeddings; the rotary
# part of each head (rotary_pct) rotates as rope_gpt_neox, by LongRoPE's short or long factors (long_rope) where the
# config has them.


def phi3_rope(ckpt: Checkpoint) -> dict:
    """Phi3Config's rope fields, as from_hugging_face writes them, but long_rope for every LongRoPE config: the
    converter keeps LongRoPE only where max_position_embeddings >= 128000 and rotates one with fewer positions without
    its factors, as transformers does not; the model takes long_rope wherever config.json has the factors
    (Phi3DecoderLayer asks hasattr(config, "longrope_scaling_short_factors"))."""
    config, spec = ckpt.config, ckpt.spec
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    fields = {"position_embedding_type": "rope_gpt_neox", "rotary_scaling": None,
              "rotary_base": float(params.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0),
              # Attention rotates int(head_size * rotary_pct) dims, as load.py reads partial_rotary_factor
              "rotary_pct": spec.rotary_dim / spec.shape.head_dim}
    if (original := longrope_length(config)) is not None:
        fields.update(position_embedding_type="long_rope", original_max_position_embeddings=original,
                      longrope_scaling_short_factors=list(params["short_factor"]),
                      longrope_scaling_long_factors=list(params["long_factor"]))
    return fields


def phi3_mscale(max_positions: int, original: int) -> float:
    """The factor Attention scales both LongRoPE tables by, when Phi3ForCausalLM gives it no mscale
    (RopeEmbeddingUtils.create_sinusoidal_positions_long_rope_for_attention_plugin, _calc_mscale)."""
    scale = max_positions / original
    return 1.0 if scale <= 1.0 else math.sqrt(1 + math.log(scale) / math.log(original))


def phi3_unexported(ckpt: Checkpoint) -> str:
    """Why TensorRT-LLM's Phi-3 model would compute a Phi-3 otherwise than transformers ("" where it would not)."""
    shape = ckpt.spec.shape
    if shape.head_dim * shape.num_heads != shape.hidden_size:
        return (f"its heads of {shape.head_dim} dims are not hidden_size / num_attention_heads, which TensorRT-LLM's "
                "Phi-3 model sizes them by (Phi3DecoderLayer gives its Attention no head size)")
    # transformers' Phi3Config takes no rope scaling but LongRoPE (validate_rope), the one Phi3DecoderLayer hands on
    if (original := longrope_length(ckpt.config)) is not None:
        # transformers takes an attention_factor or factor from the config where given; TensorRT-LLM's table always
        # derives its factor from the lengths
        theirs = rotary_module(ckpt.spec.architecture, ckpt.config).attention_scaling
        ours = phi3_mscale(ckpt.spec.max_position_embeddings, original)
        if not math.isclose(theirs, ours, rel_tol=1e-6):
            return (f"its LongRoPE attention factor {theirs:g}, where TensorRT-LLM's Phi-3 model scales its rotary "
                    f"tables by {ours:g}, from max_position_embeddings / original_max_position_embeddings alone")
    return ""


def phi3_check_context(ckpt: Checkpoint, role: str, max_seq_len: int) -> None:
    """Refuse a LongRoPE target past its original length: TensorRT-LLM rotates each step by the short or long
    table as the batch's longest sequence is within original_max_position_embeddings or past it (layers/attention.py,
    Attention.forward's select), keeping the keys it cached with the short one, where transformers' Phi-3 recomputes
    its cache with the long one (load.rope_switch_length). A draft's rotation changes only its proposals."""
    original = phi3_longrope_limit(ckpt)
    if role == "target" and original is not None and original < max_seq_len:
        raise UnsupportedModelError(
            f"max_seq_len {max_seq_len} exceeds the target's LongRoPE original_max_position_embeddings ({original}), "
            "past which TensorRT-LLM's Phi-3 model rotates new tokens with the long factors beside keys it cached with "
            "the short ones, where transformers recomputes them; give --max-seq-len (or a recipe's max_seq_len) of "
            f"{original} or less for the TensorRT-LLM export")


def phi3_longrope_limit(ckpt: Checkpoint) -> int | None:
    """A Phi-3's LongRoPE original length (None: another family, or no LongRoPE)."""
    return longrope_length(ckpt.config) if ckpt.spec.architecture == "Phi3ForCausalLM" else None


def phi3_config(ckpt: Checkpoint, config: dict) -> dict:
    """Phi3Config: the rope fields (phi3_rope), hidden_act swiglu for silu (MLP then makes fc twice
    intermediate_size wide), tie_word_embeddings (the converter writes lm_head.weight either way)."""
    return {**config, "hidden_act": "swiglu", "tie_word_embeddings": ckpt.spec.tie_word_embeddings, **phi3_rope(ckpt)}


def phi3_tensors(ckpt: Checkpoint, names: set[str]) -> Iterator[Out]:
    """models/phi3/convert.py load_weights_from_hf_model: qkv_proj ([q; k; v]) is attention.qkv, split per rank as
    every fused qkv is (split_weights_tp's split of q, k and v; each KV head repeated where there are fewer than
    ranks, which its converter cannot split and the Attention layer reads as LLaMA's); gate_up_proj ([gate; up]) is
    mlp.fc with its halves swapped to [up; gate], which MLP's swiglu reads on each rank as silu(second half) times the
    first (layers/mlp.py, functional.py swiglu). split_weights_tp splits that fc in plain chunks, so that at tp 2 rank 0
    would hold all of up and rank 1 all of gate, which that swiglu misreads; each rank gets its own rows of both
    (GATED_FC) instead, as a mixture's fc is split."""
    read, shape = ckpt.tensor, ckpt.spec.shape
    q_rows, kv_rows = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    yield Out("transformer.vocab_embedding.weight", REPLICATE, read("model.embed_tokens.weight"))
    for i in range(shape.num_layers):
        hf, trt = f"model.layers.{i}.", f"transformer.layers.{i}."
        yield Out(trt + "input_layernorm.weight", REPLICATE, read(hf + "input_layernorm.weight"))
        qkv = read(hf + "self_attn.qkv_proj.weight")
        yield Out(trt + "attention.qkv.weight", QKV, tuple(np.split(qkv, [q_rows, q_rows + kv_rows])))
        yield Out(trt + "attention.dense.weight", ROW, read(hf + "self_attn.o_proj.weight"))
        yield Out(trt + "post_layernorm.weight", REPLICATE, read(hf + "post_attention_layernorm.weight"))
        gate, up = np.split(read(hf + "mlp.gate_up_proj.weight"), 2)
        yield Out(trt + "mlp.fc.weight", GATED_FC, (up, gate))
        yield Out(trt + "mlp.proj.weight", ROW, read(hf + "mlp.down_proj.weight"))
    yield Out("transformer.ln_f.weight", REPLICATE, read("model.norm.weight"))
    yield Out("lm_head.weight", VOCAB, read("lm_head.weight" if "lm_head.weight" in names else
                                            "model.embed_tokens.weight"))
