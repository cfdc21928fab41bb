"""Llama and the models that are Llama with a twist: Llama 3.x (rope scaling, tied embeddings), Mistral
and Qwen2 (sliding windows), Qwen3 (an RMS norm on each q and k head), Phi-3 / Phi-4-mini (q, k, v and
gate, up stored fused; LongRoPE; partial rotary), Qwen3-MoE and Mixtral (Qwen3's and Mistral's attention; the MLP
of some or all layers a mixture of experts: layers.mixture_of_experts), Granite (µP multipliers: embeddings
scaled, each block's output scaled before its residual add, attention_multiplier as the attention's scale, logits
divided by logits_scaling in the verification tail). Pre-norm decoder layers: x + attention(norm(x)), then
x + mlp(norm(x))."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ..load import MIXTURES, ModelSpec, rotary_module
from .builder import GraphBuilder, w
from .layers import (Attention, attention, embedding, gated_mlp, head_norm, linear, mixture_of_experts, rms_norm, rope,
                     rotary_tables, skip_rms_norm, split_qkv, vocab_table)


def body(g: GraphBuilder, spec: ModelSpec, ids: ir.Value, att: Attention, max_seq_len: int, vocab_size: int):
    """ids [S] -> (final normed hidden [S, H], each layer's present K/V, the LM head's weight)."""
    shape, eps = spec.shape, spec.norm_eps
    fused = spec.architecture == "Phi3ForCausalLM"
    rotary = _rotary(g, spec, max_seq_len, att.long_rope)
    embed = vocab_table(g, "model.embed_tokens.weight", vocab_size)
    x = _scaled(g, embedding(g, ids, embed), spec.embedding_multiplier)  # [S, H]
    normed, residual = rms_norm(g, x, w("model.layers.0.input_layernorm.weight"), eps), x
    presents = []
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        if fused:
            qkv = linear(g, normed, w(p + "self_attn.qkv_proj.weight"))
        else:
            bias = w(*(p + f"self_attn.{n}_proj.bias" for n in "qkv")) if spec.attention_bias else None
            qkv = linear(g, normed, w(*(p + f"self_attn.{n}_proj.weight" for n in "qkv")), bias)
        if spec.qk_norm:
            q, k, v = split_qkv(g, qkv, shape)
            q = head_norm(g, q, shape.num_heads, shape.head_dim, w(p + "self_attn.q_norm.weight"), eps)
            k = head_norm(g, k, shape.num_kv_heads, shape.head_dim, w(p + "self_attn.k_norm.weight"), eps)
            out, present = attention(g, att, i, q, k, v, scale=spec.attention_scale, rotary=rotary,
                                     window=spec.sliding_windows[i])
        else:
            out, present = attention(g, att, i, qkv, scale=spec.attention_scale, rotary=rotary,
                                     window=spec.sliding_windows[i])
        presents.append(present)
        # Llama's attention_bias includes o_proj; Qwen2 has q/k/v biases only.
        o_bias = w(p + "self_attn.o_proj.bias") if p + "self_attn.o_proj.bias" in g.ckpt.loaded else None
        attn = _scaled(g, linear(g, out, w(p + "self_attn.o_proj.weight"), o_bias), spec.residual_multiplier)
        normed, residual = skip_rms_norm(g, attn, residual, w(p + "post_attention_layernorm.weight"), eps)
        m = p + "mlp."
        if i in spec.sparse_layers:
            module, gate, up, down = MIXTURES[spec.architecture]
            m, experts = p + module + ".", range(spec.experts)
            mlp = mixture_of_experts(g, normed, spec, w(m + "gate.weight"),
                                     w(*(f"{m}experts.{e}.{n}.weight" for e in experts for n in (gate, up))),
                                     w(*(f"{m}experts.{e}.{down}.weight" for e in experts), columns=True))
        elif fused:
            mlp = gated_mlp(g, normed, w(m + "gate_up_proj.weight"), w(m + "down_proj.weight"), spec.hidden_act)
        else:
            bias = (lambda *names: w(*(m + f"{n}.bias" for n in names))) if spec.mlp_bias else (lambda *names: None)
            mlp = gated_mlp(g, normed, w(m + "gate_proj.weight", m + "up_proj.weight"), w(m + "down_proj.weight"),
                            spec.hidden_act, bias("gate_proj", "up_proj"), bias("down_proj"))
        last = i == shape.num_layers - 1
        next_norm = "model.norm.weight" if last else f"model.layers.{i + 1}.input_layernorm.weight"
        normed, residual = skip_rms_norm(g, _scaled(g, mlp, spec.residual_multiplier), residual, w(next_norm), eps)
    head = embed if spec.tie_word_embeddings else vocab_table(g, "lm_head.weight", vocab_size)
    return normed, presents, head


def _scaled(g: GraphBuilder, x: ir.Value, multiplier: float) -> ir.Value:
    """x times Granite's multiplier, in the engine's type (transformers multiplies in the model's)."""
    return x if multiplier == 1.0 else g.op("Mul", x, g.const(multiplier, g.numerics.dtype))


def _rotary(g: GraphBuilder, spec: ModelSpec, max_seq_len: int, long_rope: ir.Value | None) -> tuple[ir.Value, ir.Value]:
    """The cos/sin tables, as transformers computes them for one call over max_seq_len tokens.

    LongRoPE (Phi) switches from short to long factors for a call longer than
    original_max_position_embeddings. A bundle whose max_seq_len is within the original length uses the
    short factors throughout, exactly as transformers decodes there. A longer one of a Phi-3 target
    (long_rope: its `long_rope` input, see load.rope_switch_length) holds both tables and each call uses
    the one the runtime chooses by the sequence's length, as transformers does (short for a sequence up to
    the original length, long for the whole of a longer one: the runtime re-feeds the cache once when
    decoding crosses it, as Phi-3's generate recomputes its cache there). Otherwise (a draft's, whose
    rotation only changes which drafts are proposed) the long factors throughout, as transformers
    rotates a prompt that long.
    """
    module = rotary_module(spec.architecture, g.ckpt.config)
    dtype = g.numerics.dtype
    if long_rope is None:
        return rotary_tables(g, ["all"], spec.rotary_dim, max_seq_len, lambda: rope(module, max_seq_len, dtype))

    def both() -> tuple[np.ndarray, np.ndarray]:  # [short, long] stacked; max_seq_len is past the original length,
        short = rope(rotary_module(spec.architecture, g.ckpt.config), max_seq_len, dtype, short=True)
        long = rope(module, max_seq_len, dtype)  # so one call over it gives the long factors
        return np.stack([short[0], long[0]]), np.stack([short[1], long[1]])

    shape = (2, max_seq_len, spec.rotary_dim // 2)
    tables = g.computed([(f"rotary.short_long.{part}", g.numerics.ir_type, shape) for part in ("cos", "sin")], both)
    # A Gather of the call's table (onnxruntime's CUDA Gather takes every float type; its Where no bf16)
    return tuple(g.op("Gather", table, long_rope, axis=0) for table in tables)
