"""Stage 2: ONNX decoder graphs built straight from a checkpoint's tensors, verification in the tail.

One builder per architecture family reads top to bottom like the model (llama.py, gemma.py, gpt2.py);
layers.py holds the math they share, verification.py the tail. Attention is onnxruntime's
GroupQueryAttention with the KV buffers shared between past and present: the runtime allocates them once
for max_seq_len and the op writes new keys/values in place at positions past..total-1, so rejecting
drafts is only a smaller seqlens_k on the next call. The engine's I/O contract is written in
specbuild_runtime.manifest.

Weights are not read here: the graph holds lazy tensors that read, convert or quantize each weight as
the engine file is written (export.py).

Shapes: S = tokens fed this call, D = num_drafts, H = hidden, V = vocab, KV = kv heads, hd = head dim.
"""

from __future__ import annotations

from typing import Callable

import onnx_ir as ir

from specbuild_runtime.manifest import cache_names

from ..load import Checkpoint
from ..precision import Numerics
from . import gemma, gpt2, llama
from .builder import GraphBuilder
from .layers import Attention, linear
from .verification import LOGITS, SamplingInputs, build_sampler, verification

FAMILIES = {"llama": llama.body, "gemma": gemma.body, "gpt2": gpt2.body}
INT64, INT32, FLOAT = ir.DataType.INT64, ir.DataType.INT32, ir.DataType.FLOAT

__all__ = ["LOGITS", "build_decoder", "build_sampler"]


def build_decoder(ckpt: Checkpoint, numerics: Numerics, max_seq_len: int, vocab_size: int | None = None,
                  with_logits: bool = False, progress: Callable[[int], None] = lambda nbytes: None,
                  sampling: bool = True) -> ir.Model:
    """The engine graph for one model (see specbuild_runtime.manifest for its I/O contract).

    vocab_size: cut the embedding table and LM head to this many rows (a draft's padding rows past the
    target's vocabulary). with_logits adds the fp32 `logits` [D+1, V] as an output, for tests.
    sampling False: the greedy-only graph (no sampling inputs, no `probs`, no control flow), with the fp32
    `logits` [D+1, V] as an output, from which the bundle's sampler (build_sampler) samples.
    """
    spec = ckpt.spec
    shape = spec.shape
    vocab = min(shape.vocab_size, vocab_size or shape.vocab_size)
    g = GraphBuilder(f"specbuild-{spec.architecture}", ckpt, numerics, progress)
    input_ids = g.input("input_ids", INT64, [1, "S"])
    # GroupQueryAttention's two length inputs, both fed by the runtime: the CUDA provider wants them as
    # plain graph inputs (computed in the graph they would sit on the CPU, between GPU nodes).
    seqlens_k = g.input("seqlens_k", INT32, [1])  # = total_len - 1
    total_len = g.input("total_len", INT32, [])
    num_drafts = g.input("num_drafts", INT64, [])
    sampling_inputs = SamplingInputs(
        temperature=g.input("temperature", FLOAT, []),
        top_k=g.input("top_k", INT64, []),
        top_p=g.input("top_p", FLOAT, []),
        draft_probs=g.input("draft_probs", FLOAT, ["D", vocab]),
        uniforms=g.input("uniforms", FLOAT, ["D+1"]),
    ) if sampling else None
    kv_shape = [1, shape.num_kv_heads, max_seq_len, shape.head_dim]
    names = cache_names(shape.num_layers)
    inputs = [g.input(past, numerics.ir_type, kv_shape) for past, _ in names]
    past = list(zip(inputs[::2], inputs[1::2]))  # (key, value) per layer
    att = Attention(seqlens_k, total_len, past, shape.num_heads, shape.num_kv_heads, shape.head_dim)
    ids = g.op("Reshape", input_ids, g.const([-1]))  # [S]
    hidden, presents, head = FAMILIES[spec.family](g, spec, ids, att, max_seq_len, vocab)
    accepted, next_token, probs, logits = verification(g, hidden, input_ids, num_drafts, lambda x: linear(g, x, head),
                                                       sampling_inputs, spec.final_softcap)
    if with_logits or not sampling:
        g.output(logits, LOGITS, FLOAT, ["D+1", vocab])
    g.output(accepted, "accepted", INT64, [])
    g.output(next_token, "next_token", INT64, [])
    if sampling:
        g.output(probs, "probs", FLOAT, ["V or 0"])
    written = [buffer for pair in presents for buffer in pair]  # key, value per layer: cache_names' order
    for buffer, (_, present) in zip(written, names):
        g.output(buffer, present, numerics.ir_type, kv_shape)
    return g.model()
