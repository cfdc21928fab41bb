"""Gemma 2 and Gemma 3 (text): embeddings scaled by sqrt(H); RMS norms that scale by (1 + w); a norm
before and after both attention and MLP; GeGLU (tanh GELU); sliding-window layers alternating with
global ones; attention scaled by query_pre_attn_scalar^-0.5. Gemma 2 soft-caps attention scores and the
final logits, cap·tanh(x/cap); Gemma 3 instead norms each q and k head and gives its sliding layers their
own rope base."""

from __future__ import annotations

import copy
import inspect

import onnx_ir as ir

from ..load import ModelSpec, rotary_module
from .builder import GraphBuilder, w
from .layers import (Attention, attention, embedding, gated_mlp, head_norm, linear, rms_norm, rotary_by_layer_type,
                     skip_rms_norm, split_qkv, vocab_table)


def body(g: GraphBuilder, spec: ModelSpec, ids: ir.Value, att: Attention, max_seq_len: int, vocab_size: int):
    """ids [S] -> (final normed hidden [S, H], each layer's present K/V, the LM head's weight)."""
    shape, eps = spec.shape, spec.norm_eps
    norm = lambda name: w(name, plus_one=True)  # noqa: E731 (every Gemma norm scales by 1 + w)
    rotary = _rotary(g, spec, max_seq_len)
    embed = vocab_table(g, "model.embed_tokens.weight", vocab_size)
    # transformers scales by sqrt(H) rounded to the weights' type, as here to the engine's.
    x = g.op("Mul", embedding(g, ids, embed), g.const(shape.hidden_size**0.5, g.numerics.dtype))  # [S, H]
    normed, residual = rms_norm(g, x, norm("model.layers.0.input_layernorm.weight"), eps), x
    presents = []
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        qkv = linear(g, normed, w(*(p + f"self_attn.{n}_proj.weight" for n in "qkv")))
        options = dict(scale=spec.attention_scale, rotary=rotary[spec.layer_types[i]], window=spec.sliding_windows[i],
                       softcap=spec.attention_softcap)
        if spec.qk_norm:
            q, k, v = split_qkv(g, qkv, shape)
            q = head_norm(g, q, shape.num_heads, shape.head_dim, norm(p + "self_attn.q_norm.weight"), eps)
            k = head_norm(g, k, shape.num_kv_heads, shape.head_dim, norm(p + "self_attn.k_norm.weight"), eps)
            out, present = attention(g, att, i, q, k, v, **options)
        else:
            out, present = attention(g, att, i, qkv, **options)
        presents.append(present)
        attn = rms_norm(g, linear(g, out, w(p + "self_attn.o_proj.weight")), norm(p + "post_attention_layernorm.weight"), eps)
        normed, residual = skip_rms_norm(g, attn, residual, norm(p + "pre_feedforward_layernorm.weight"), eps)
        m = p + "mlp."
        mlp = gated_mlp(g, normed, w(m + "gate_proj.weight", m + "up_proj.weight"), w(m + "down_proj.weight"), spec.hidden_act)
        mlp = rms_norm(g, mlp, norm(p + "post_feedforward_layernorm.weight"), eps)
        last = i == shape.num_layers - 1
        normed, residual = skip_rms_norm(g, mlp, residual,
                                         norm("model.norm.weight" if last else f"model.layers.{i + 1}.input_layernorm.weight"), eps)
    head = embed if spec.tie_word_embeddings else vocab_table(g, "lm_head.weight", vocab_size)
    return normed, presents, head


def _rotary(g: GraphBuilder, spec: ModelSpec, max_seq_len: int) -> dict[str, tuple[ir.Value, ir.Value]]:
    """layer type -> cos/sin tables: one table for Gemma 2, one per layer type for Gemma 3 (its sliding
    layers have their own rope base, rope_local_base_freq)."""
    module = rotary_module(spec.architecture, g.ckpt.config)
    if spec.architecture == "Gemma2ForCausalLM" or "layer_type" in inspect.signature(module.forward).parameters:
        return rotary_by_layer_type(g, spec, max_seq_len)
    # transformers 4 (TensorRT-LLM pins 4.57): Gemma3TextModel makes its sliding layers' module from a copy of the
    # config with rope_local_base_freq as the base and no scaling (its rotary_emb_local)
    local = copy.deepcopy(g.ckpt.config)
    local.rope_theta, local.rope_scaling = local.rope_local_base_freq, {"rope_type": "default"}
    modules = {"full_attention": module, "sliding_attention": rotary_module(spec.architecture, local)}
    return rotary_by_layer_type(g, spec, max_seq_len, modules)
