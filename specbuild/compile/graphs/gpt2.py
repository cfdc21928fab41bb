"""GPT-2: learned positions, LayerNorm with bias, Conv1D weights stored [in, out], a GELU MLP, tied head."""

from __future__ import annotations

import onnx_ir as ir

from ..load import ModelSpec
from .builder import GraphBuilder, w
from .layers import Attention, activation, attention, embedding, linear, skip_layer_norm


def body(g: GraphBuilder, spec: ModelSpec, ids: ir.Value, att: Attention, max_seq_len: int, vocab_size: int):
    """ids [S] -> (final normed hidden [S, H], each layer's present K/V, the LM head's weight)."""
    eps = spec.norm_eps
    # Checkpoints saved from GPT2LMHeadModel prefix every name with "transformer."; the original ones do not.
    t = "transformer." if "transformer.wte.weight" in g.ckpt.entries else ""
    # Learned positions: rows past_len .. total_len-1 of wpe.
    total = g.op("Reshape", g.op("Cast", att.total_len, to=ir.DataType.INT64), g.const([1]))
    past_len = g.op("Sub", total, g.op("Shape", ids))
    positions = g.op("Slice", g.weight(w(t + "wpe.weight")), past_len, total)  # [S, H]
    wte = w(t + "wte.weight", rows=vocab_size)
    # SkipLayerNormalization adds the two embeddings and normalizes in one op.
    normed, residual = skip_layer_norm(g, embedding(g, ids, wte), positions, w(t + "h.0.ln_1.weight"),
                                       w(t + "h.0.ln_1.bias"), eps)
    presents = []
    for i in range(spec.shape.num_layers):
        p = f"{t}h.{i}."
        conv = lambda name: (w(p + name + ".weight", conv1d=True), w(p + name + ".bias"))  # noqa: E731
        out, present = attention(g, att, i, linear(g, normed, *conv("attn.c_attn")), scale=spec.attention_scale)
        presents.append(present)
        normed, residual = skip_layer_norm(g, linear(g, out, *conv("attn.c_proj")), residual, w(p + "ln_2.weight"),
                                           w(p + "ln_2.bias"), eps)
        hidden = activation(g, spec.hidden_act, linear(g, normed, *conv("mlp.c_fc")))
        nxt = f"{t}ln_f" if i == spec.shape.num_layers - 1 else f"{t}h.{i + 1}.ln_1"
        normed, residual = skip_layer_norm(g, linear(g, hidden, *conv("mlp.c_proj")), residual, w(f"{nxt}.weight"),
                                           w(f"{nxt}.bias"), eps)
    return normed, presents, wte
