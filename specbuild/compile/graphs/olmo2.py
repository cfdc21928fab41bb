"""OLMo 2: post-norm decoder layers, x + norm(attention(x)), then x + norm(mlp(x)), with no norm before either;
an RMS norm over the whole projected q and another over the whole projected k (over every head at once, where
Qwen3's and Gemma 3's norm each head), before rope. OLMo 3 is these layers with sliding-window layers among the full
ones (layer_types), each layer type rotated by its own rope parameters (its full layers' YaRN, its sliding ones'
none)."""

from __future__ import annotations

import onnx_ir as ir

from ..load import ModelSpec
from .builder import GraphBuilder, w
from .layers import (Attention, attention, embedding, gated_mlp, linear, rms_norm, rotary_by_layer_type, split_qkv,
                     vocab_table)


def body(g: GraphBuilder, spec: ModelSpec, ids: ir.Value, att: Attention, max_seq_len: int, vocab_size: int):
    """ids [S] -> (final normed hidden [S, H], each layer's present K/V, the LM head's weight)."""
    shape, eps = spec.shape, spec.norm_eps
    rotary = rotary_by_layer_type(g, spec, max_seq_len)
    embed = vocab_table(g, "model.embed_tokens.weight", vocab_size)
    x = embedding(g, ids, embed)  # [S, H]
    presents = []
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        # attention_bias gives q, k, v and o a bias each (the MLP never has one)
        bias = (lambda *names: w(*(p + f"self_attn.{n}_proj.bias" for n in names))) if spec.attention_bias else (
            lambda *names: None)
        qkv = linear(g, x, w(*(p + f"self_attn.{n}_proj.weight" for n in "qkv")), bias(*"qkv"))
        q, k, v = split_qkv(g, qkv, shape)
        q = rms_norm(g, q, w(p + "self_attn.q_norm.weight"), eps)
        k = rms_norm(g, k, w(p + "self_attn.k_norm.weight"), eps)
        out, present = attention(g, att, i, q, k, v, scale=spec.attention_scale, rotary=rotary[spec.layer_types[i]],
                                 window=spec.sliding_windows[i])
        presents.append(present)
        attn = linear(g, out, w(p + "self_attn.o_proj.weight"), bias("o"))
        x = g.op("Add", x, rms_norm(g, attn, w(p + "post_attention_layernorm.weight"), eps))
        m = p + "mlp."
        mlp = gated_mlp(g, x, w(m + "gate_proj.weight", m + "up_proj.weight"), w(m + "down_proj.weight"),
                        spec.hidden_act)
        x = g.op("Add", x, rms_norm(g, mlp, w(p + "post_feedforward_layernorm.weight"), eps))
    head = embed if spec.tie_word_embeddings else vocab_table(g, "lm_head.weight", vocab_size)
    return rms_norm(g, x, w("model.norm.weight"), eps), presents, head
