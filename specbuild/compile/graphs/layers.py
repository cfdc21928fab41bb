"""Layers whose math is the same across families. Hidden states are 2-D, [S, H]: linear layers are one
Gemm over weights in the checkpoint's own [out, in] layout (nothing is transposed while streaming), or
MatMulNBits when the engine is quantized (see quantize.py)."""

from __future__ import annotations

import functools
import inspect

import numpy as np
import onnx_ir as ir

from specbuild_runtime.manifest import ModelShape

from ..load import ModelSpec, rotary_module
from ..quantize import QuantizedRows
from .builder import MS, GraphBuilder, Weight, w


def vocab_table(g: GraphBuilder, name: str, vocab_size: int) -> Weight:
    """A [V, H] table (embedding or LM head), cut to vocab_size rows when it has more (a draft's padding)."""
    return w(name, rows=vocab_size if g.ckpt.entry(name).shape[0] > vocab_size else None)


def embedding(g: GraphBuilder, ids: ir.Value, table: Weight) -> ir.Value:
    """ids [S] -> rows of the table [S, H]."""
    numerics = g.numerics
    q = None if numerics.quantization == "none" else QuantizedRows(*table.shape(g.ckpt), numerics.bits,
                                                                    numerics.block_size)
    # onnxruntime's CUDA kernel (gather_block_quantized.cu, 1.31) reads 4-bit zero points as one run of nibbles,
    # block i of the table at nibble i; MatMulNBits' layout, which the CPU kernel reads, starts each row on a
    # whole byte. They agree only for an even number of blocks a row: an odd one would decode other rows on a GPU.
    if q is None or (q.bits == 4 and q.blocks % 2):
        return g.op("Gather", g.weight(table), ids)
    data, scales, zero_points = g.quantized(table, table=True)
    rows = g.op("GatherBlockQuantized", data, ids, scales, zero_points, domain=MS, gather_axis=0, quantize_axis=1,
                block_size=q.block_size, bits=q.bits)
    if q.k % q.block_size:  # the rows come back padded to whole blocks
        rows = g.op("Slice", rows, g.const([0]), g.const([q.k]), g.const([1]))
    return rows


def linear(g: GraphBuilder, x: ir.Value, weight: Weight, bias: Weight | None = None) -> ir.Value:
    """x [S, in] -> x @ weight.T + bias [S, out], weight in torch's [out, in] layout."""
    numerics = g.numerics
    if numerics.quantization == "none":
        return g.op("Gemm", x, g.weight(weight), g.weight(bias) if bias else None, transB=1)
    n, k = weight.shape(g.ckpt)
    packed, scales, zero_points = g.quantized(weight)
    attrs = dict(K=k, N=n, bits=numerics.bits, block_size=numerics.block_size)
    if numerics.accuracy_level:  # left out at 0, as onnxruntime's quantizer does: not every provider knows it
        attrs["accuracy_level"] = numerics.accuracy_level
    return g.op("MatMulNBits", x, packed, scales, zero_points, None, g.weight(bias) if bias else None,
                domain=MS, **attrs)


def rms_norm(g: GraphBuilder, x: ir.Value, weight: Weight, eps: float) -> ir.Value:
    return g.op("RMSNormalization", x, g.weight(weight), axis=-1, epsilon=eps)


def skip_rms_norm(g: GraphBuilder, x: ir.Value, residual: ir.Value, weight: Weight, eps: float) -> tuple[ir.Value, ir.Value]:
    """(rms_norm(x + residual), x + residual) in one op."""
    normed, _, _, total = g.op("SkipSimplifiedLayerNormalization", x, residual, g.weight(weight), outputs=4,
                               domain=MS, epsilon=eps)
    return normed, total


def skip_layer_norm(g: GraphBuilder, x: ir.Value, residual: ir.Value, weight: Weight, bias: Weight,
                    eps: float) -> tuple[ir.Value, ir.Value]:
    normed, _, _, total = g.op("SkipLayerNormalization", x, residual, g.weight(weight), g.weight(bias), outputs=4,
                               domain=MS, epsilon=eps)
    return normed, total


def activation(g: GraphBuilder, name: str, x: ir.Value) -> ir.Value:
    if name == "silu":
        return g.op("Mul", x, g.op("Sigmoid", x))
    if name == "gelu":
        return g.op("Gelu", x, domain=MS)
    return g.op("FastGelu", x, domain=MS)  # gelu_new, gelu_pytorch_tanh: the tanh approximation


def gated_mlp(g: GraphBuilder, x: ir.Value, gate_up: Weight, down: Weight, act: str, gate_up_bias: Weight | None = None,
              down_bias: Weight | None = None) -> ir.Value:
    """down(act(gate(x)) * up(x)) with gate and up in one projection (gate rows first)."""
    half = gate_up.shape(g.ckpt)[0] // 2
    gate, up = g.op("Split", linear(g, x, gate_up, gate_up_bias), g.const([half, half]), outputs=2, axis=-1)
    return linear(g, g.op("Mul", activation(g, act, gate), up), down, down_bias)


def mixture_of_experts(g: GraphBuilder, x: ir.Value, spec: ModelSpec, router: Weight, gate_up: Weight,
                       down: Weight) -> ir.Value:
    """x [S, H] -> [S, H]: each row through its spec.experts_per_token highest-scoring experts' gated MLPs, each
    weighted by its score, summed. Scores are the softmax of the router's logits (a Gemm in the engine's type, as
    transformers' router's) over all experts in fp32, the chosen ones renormalized to sum to 1 where
    spec.norm_topk_prob says so, then in the engine's type (Qwen3-MoE's router; Mixtral's keeps them in fp32 and
    scales each expert's output in fp32: in an fp16 engine keeping them in fp32 here brought the prompts' logprobs no
    nearer transformers fp16's, at most 0.0167 apart against 0.0155). Exactly equal scores (a router of zeros) choose
    the lowest-numbered experts, as ONNX's TopK specifies; torch.topk's choice among them is unspecified (on the CPU,
    scores .1 .3 .3 .3 give experts 1 and 3), which changes the output only where the tied experts differ.
    gate_up: every expert's gate and up rows, expert after expert ([E·2I, H]); down: their down projections side by
    side ([H, E·I]).

    Computed densely: every expert's MLP on every row, its gated activations scaled by the row's weight for it
    (0 for the experts not chosen), and one down projection over all of them. Two Gemms (MatMulNBits when quantized)
    whose rows are computed alone whatever the call's other rows, as every other linear layer's, so a row's output
    does not depend on how rows are grouped into a call (on a GPU, whose calls have a fixed number of rows, by
    construction). onnxruntime's MoE op, which multiplies the rows routed to each expert together, does not keep
    that: on its CPU kernel (1.32, fp32, swiglu) a row of Qwen3-30B-A3B's layer got other bits, up to 2.8e-7 apart,
    in calls of 1 to 16 rows than in one of 64 (benchmarks/moe_block.py), which speculative decoding's calls of γ + 1
    rows would turn into other tokens at near ties. The price is E / experts_per_token times a sparse kernel's expert
    arithmetic (16 there) and every expert's weights read at every call: that layer took 240, 261 and 581 ms a call
    of 2, 6 and 64 rows against the MoE op's 48, 120 and 163 (medians of 5, interleaved, load 3.3-4.0; a second
    session of this form, the noise: 222, 281 and 491).
    The router stays in the float type in a quantized engine, as transformers' fp32 softmax and the choice it makes
    are the model's: quantized, a near tie between two experts would be decided by the quantization noise."""
    experts, width = spec.experts, spec.expert_intermediate_size
    logits = g.op("Gemm", x, g.weight(router), transB=1)  # [S, E]
    scores = g.op("Softmax", g.op("Cast", logits, to=ir.DataType.FLOAT), axis=-1)
    top, chosen = g.op("TopK", scores, g.const([spec.experts_per_token]), outputs=2, axis=-1)  # [S, k]
    if spec.norm_topk_prob:
        top = g.op("Div", top, g.op("ReduceSum", top, g.const([-1]), keepdims=1))
    zeros = g.op("Expand", g.const([[0]], g.numerics.dtype), g.op("Shape", logits))
    weights = g.op("ScatterElements", zeros, chosen, g.op("Cast", top, to=g.numerics.ir_type), axis=1)  # [S, E]
    projected = g.op("Reshape", linear(g, x, gate_up), g.const([-1, experts, 2, width]))
    gate, up = g.op("Split", projected, g.const([1, 1]), outputs=2, axis=2)  # [S, E, 1, I] each
    gated = g.op("Mul", g.op("Mul", activation(g, spec.hidden_act, gate), up),
                 g.op("Reshape", weights, g.const([-1, experts, 1, 1])))
    return linear(g, g.op("Reshape", gated, g.const([-1, experts * width])), down)


class Attention:
    """What every layer's attention shares: the length inputs, each layer's KV buffers, the model's shape."""

    def __init__(self, seqlens_k: ir.Value, total_len: ir.Value, past: list[tuple[ir.Value, ir.Value]],
                 num_heads: int, num_kv_heads: int, head_dim: int, prefix: str = "", long_rope: ir.Value | None = None):
        self.seqlens_k, self.total_len, self.past = seqlens_k, total_len, past
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.prefix = prefix  # of the attention nodes' names
        self.long_rope = long_rope  # the input choosing LongRoPE's short (0) or long (1) factors (None: one table)

    def step(self, j: int, seqlens_k: ir.Value, total_len: ir.Value) -> "Attention":
        """The same buffers at other lengths: step j of a graph that runs the decoder several times."""
        return Attention(seqlens_k, total_len, self.past, self.num_heads, self.num_kv_heads, self.head_dim,
                         f"step{j}." if j else "", self.long_rope)


def attention(g: GraphBuilder, att: Attention, layer: int, q: ir.Value, k: ir.Value | None = None,
              v: ir.Value | None = None, *, scale: float, rotary: tuple[ir.Value, ir.Value] | None = None,
              window: int | None = None, softcap: float | None = None) -> tuple[ir.Value, tuple[ir.Value, ir.Value]]:
    """GroupQueryAttention over the layer's KV buffers, written in place: q [S, H·hd] and k, v [S, KV·hd]
    (or q alone: packed [S, (H+2KV)·hd]) -> [S, H·hd] and the present K/V.

    rotary: cos/sin tables [max_seq_len, rotary_dim/2], applied inside the op (rotate-half, to the first
    rotary_dim of each head). window: transformers' sliding window (a query sees the `window` positions
    up to and including its own). onnxruntime 1.32's local_window_size is the same number: measured
    against transformers past the window (tests/test_graphs.py), window - 1 and window + 1 are both wrong.
    """
    batched = [g.op("Unsqueeze", t, g.const([0])) if t is not None else None for t in (q, k, v)]  # GQA wants [1, S, ·]
    attrs = dict(num_heads=att.num_heads, kv_num_heads=att.num_kv_heads, scale=float(scale))
    if rotary:
        attrs.update(do_rotary=1, rotary_interleaved=0)
    if window:
        attrs["local_window_size"] = window
    if softcap:
        attrs["softcap"] = float(softcap)
    past_key, past_value = att.past[layer]
    out, present_key, present_value = g.op(
        "GroupQueryAttention", *batched, past_key, past_value, att.seqlens_k, att.total_len, *(rotary or ()),
        outputs=3, domain=MS, name=f"{att.prefix}layers.{layer}.attention", **attrs,
    )
    return g.op("Squeeze", out, g.const([0])), (present_key, present_value)


def split_qkv(g: GraphBuilder, qkv: ir.Value, shape: ModelShape) -> tuple[ir.Value, ir.Value, ir.Value]:
    """A fused projection [S, (H+2KV)·hd] -> q [S, H·hd], k and v [S, KV·hd], for the norms some families apply
    to q and k before attention."""
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    return g.op("Split", qkv, g.const([q, kv, kv]), outputs=3, axis=-1)


def head_norm(g: GraphBuilder, x: ir.Value, heads: int, head_dim: int, weight: Weight, eps: float) -> ir.Value:
    """RMS norm of each head of x [S, heads·hd] (Qwen3's and Gemma 3's q/k norms)."""
    per_head = g.op("Reshape", x, g.const([-1, heads, head_dim]))
    return g.op("Reshape", rms_norm(g, per_head, weight, eps), g.const([-1, heads * head_dim]))


def rope(rotary_module, length: int, dtype: np.dtype, short: bool = False, **forward_kwargs) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [length, rotary_dim/2] from the model's own transformers rotary module (so every rope
    scaling it knows is covered), as one forward call over `length` tokens computes them.

    short: LongRoPE's short factors at every position, as its forward computes them for a call of up to
    original_max_position_embeddings tokens (its forward picks the factors by the call's length; this runs
    the forward beneath that choice, on the frequencies it starts from, the short ones)."""
    import torch

    forward = rotary_module
    if short:
        rotary_module.inv_freq.copy_(rotary_module.original_inv_freq)
        forward = functools.partial(type(rotary_module).forward.__wrapped__, rotary_module)
    with torch.no_grad():
        cos, sin = forward(torch.zeros(1, dtype=torch.float32), torch.arange(length)[None], **forward_kwargs)
    half = cos.shape[-1] // 2
    return cos[0, :, :half].numpy().astype(dtype), sin[0, :, :half].numpy().astype(dtype)


def rotary_tables(g: GraphBuilder, names: list[str], rotary_dim: int, length: int, compute) -> list[ir.Value]:
    """cos and sin initializers [length, rotary_dim/2] for each name, made by compute() -> (cos, sin, ...)
    in that order when the engine is written."""
    shape = (length, rotary_dim // 2)
    return g.computed([(f"rotary.{name}.{part}", g.numerics.ir_type, shape) for name in names for part in ("cos", "sin")],
                      compute)


def rotary_by_layer_type(g: GraphBuilder, spec: ModelSpec, max_seq_len: int,
                         modules: dict | None = None) -> dict[str, tuple[ir.Value, ir.Value]]:
    """layer type -> cos/sin tables, as transformers' rotary module computes them: one per layer type where its forward
    takes a layer_type (Gemma 3's and OLMo 3's in transformers 5, whose sliding layers rotate by rope parameters of
    their own; OLMo 3's rope_scaling reaches its full layers alone), else one table for every layer. modules: a rotary
    module per layer type, where transformers made one each (Gemma 3 in transformers 4)."""
    module, dtype = rotary_module(spec.architecture, g.ckpt.config), g.numerics.dtype
    types = sorted(set(spec.layer_types))
    if modules:
        per_type = lambda kind: rope(modules[kind], max_seq_len, dtype)  # noqa: E731
    elif "layer_type" in inspect.signature(module.forward).parameters:
        per_type = lambda kind: rope(module, max_seq_len, dtype, layer_type=kind)  # noqa: E731
    else:
        cos, sin = rotary_tables(g, ["all"], spec.rotary_dim, max_seq_len, lambda: rope(module, max_seq_len, dtype))
        return {kind: (cos, sin) for kind in types}
    tables = rotary_tables(g, types, spec.rotary_dim, max_seq_len,
                           lambda: tuple(t for kind in types for t in per_type(kind)))
    return {kind: (tables[2 * n], tables[2 * n + 1]) for n, kind in enumerate(types)}
