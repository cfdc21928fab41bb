"""GPT-2: learned positions, LayerNorm with bias, Conv1D weights stored [in, out], a GELU MLP, a head tied to
the embeddings or its own."""

from __future__ import annotations

import onnx_ir as ir

from ..load import ModelSpec
from .builder import GraphBuilder, w
from .layers import Attention, activation, attention, embedding, linear, skip_layer_norm, vocab_table


def body(g: GraphBuilder, spec: ModelSpec, ids: ir.Value, att: Attention, max_seq_len: int, vocab_size: int):
    """ids [S] -> (final normed hidden [S, H], each layer's present K/V, the LM head's weight)."""
    eps = spec.norm_eps
    t = "transformer."  # the original checkpoints' unprefixed names too: load.py renames them
    # Learned positions: rows total-S .. total-1 of wpe, i.e. total minus [S, S-1, .., 1], computed on the
    # device from seqlens_k (= total - 1): positions from the host input total_len would be read once by a
    # CUDA graph's capture and replayed at every later length.
    countdown = g.op("CumSum", g.op("ConstantOfShape", g.op("Shape", ids), value=ir.tensor([1], dtype=ir.DataType.INT64)),
                     g.const(0), reverse=1)  # [S, S-1, .., 1]
    total = g.op("Add", g.op("Cast", att.seqlens_k, to=ir.DataType.INT64), g.const([1]))  # [1]
    positions = g.op("Gather", g.weight(w(t + "wpe.weight")), g.op("Sub", total, countdown))  # [S, H]
    wte = vocab_table(g, t + "wte.weight", vocab_size)
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
    head = wte if spec.tie_word_embeddings else vocab_table(g, "lm_head.weight", vocab_size)
    return normed, presents, head
