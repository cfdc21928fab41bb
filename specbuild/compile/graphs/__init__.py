"""Stage 2: ONNX decoder graphs built straight from a checkpoint's tensors, verification in the tail.

One builder per architecture family reads top to bottom like the model (llama.py, gemma.py, olmo2.py, gpt2.py);
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

import numpy as np
import onnx_ir as ir

from specbuild_runtime.manifest import LONG_ROPE, cache_names, step_presents, step_total_len

from ...errors import UnsupportedModelError
from ..load import Checkpoint
from ..precision import Numerics
from . import gemma, gpt2, llama, olmo2
from .builder import GraphBuilder
from .layers import Attention, linear
from .verification import (LOGITS, SamplingInputs, build_sampler, logit_bias_input, penalty_inputs, unprocessed,
                           verification_tail)

FAMILIES = {"llama": llama.body, "gemma": gemma.body, "olmo2": olmo2.body, "gpt2": gpt2.body}
INT64, INT32, FLOAT = ir.DataType.INT64, ir.DataType.INT32, ir.DataType.FLOAT

__all__ = ["LOGITS", "build_decoder", "build_draft_steps", "build_sampler", "check_every_tensor_used", "engine_vocab",
           "unprocessed"]


def build_decoder(ckpt: Checkpoint, numerics: Numerics, max_seq_len: int, vocab_size: int | None = None,
                  progress: Callable[[int], None] = lambda nbytes: None,
                  sampling: bool = True, tokens: int | None = None, rope_switch: int = 0,
                  penalties: bool = True, fixed_rows: int = 0) -> ir.Model:
    """The engine graph for one model (see specbuild_runtime.manifest for its I/O contract).

    vocab_size: cut the embedding table and LM head to this many rows (a draft's padding rows past the
    target's vocabulary). tokens: a draft's only: cut them further to the tokenizer's ids (engine_vocab).
    Every graph outputs the fp32 `logits` [D+1, V] its tail decides on: the runtime binds them for requests
    that ask for logprobs alone, and the bundle's sampler (build_sampler) decides from those of the greedy-only
    graph where a request samples or applies penalties, min_tokens or logit_bias (sampling False: no sampling,
    penalty or logit_bias inputs, no `probs`, no control flow). penalties False (a draft's, which proposes
    unpenalised): of the processing inputs, logit_bias alone (a grammar's mask), added to the logits it decides on.
    rope_switch: a LongRoPE target's original length, below max_seq_len (load.rope_switch_length): the graph
    then holds both rotary tables and an input `long_rope` (0 or 1) choosing one for the call.
    fixed_rows: a target's max γ + 1, the rows of its calls on a GPU: the LM head multiplies all of them at every
    num_drafts (verification).
    """
    spec = ckpt.spec
    vocab = engine_vocab(ckpt, vocab_size, tokens)
    g = GraphBuilder(f"specbuild-{spec.architecture}", ckpt, numerics, progress)
    input_ids, att = _engine_inputs(g, spec, numerics, max_seq_len)
    if rope_switch:
        att.long_rope = g.input(LONG_ROPE, INT64, [])
    num_drafts = g.input("num_drafts", INT64, [])
    sampling_inputs = SamplingInputs(
        temperature=g.input("temperature", FLOAT, []),
        top_k=g.input("top_k", INT64, []),
        top_p=g.input("top_p", FLOAT, []),
        min_p=g.input("min_p", FLOAT, []),
        draft_probs=g.input("draft_probs", FLOAT, ["D", vocab]),
        uniforms=g.input("uniforms", FLOAT, ["D+1"]),
    ) if sampling else None
    # sampling False: the greedy-only graph, which decides on the raw logits
    processing = (penalty_inputs(g, vocab) if penalties else logit_bias_input(g, vocab)) if sampling else None
    ids = _embeddable(g, g.op("Reshape", input_ids, g.const([-1])), vocab, vocab_size)  # [S]
    hidden, presents, head = FAMILIES[spec.family](g, spec, ids, att, max_seq_len, vocab)
    accepted, next_token, probs, logits = verification_tail(g, hidden, input_ids, num_drafts,
                                                            lambda x: linear(g, x, head), sampling_inputs,
                                                            spec.final_softcap, processing, fixed_rows,
                                                            spec.logits_scaling)
    g.output(logits, LOGITS, FLOAT, ["D+1", vocab])
    g.output(accepted, "accepted", INT64, [])
    g.output(next_token, "next_token", INT64, [])
    if sampling:
        g.output(probs, "probs", FLOAT, ["V or 0"])
    _cache_outputs(g, presents, step_presents(len(presents), 0), att, numerics, max_seq_len)
    return g.model()


def build_draft_steps(ckpt: Checkpoint, numerics: Numerics, max_seq_len: int, steps: int,
                      vocab_size: int | None = None, tokens: int | None = None) -> ir.Model:
    """A draft's greedy drafting of `steps` tokens in one call (see specbuild_runtime.manifest): the
    decoder unrolled, each step fed the previous step's argmax on the device, so drafting `steps` tokens
    costs one call, not one call per token, each waiting for its token on the host. Each step computes
    the rows and arithmetic of the greedy-only graph's call over the same tokens (step 0: the tokens fed;
    each later one: the token before it), so it drafts the tokens such calls would.

    All steps share the weights (one initializer each) and the KV buffers: each step's attention reads
    the past inputs and writes its own present outputs, which the runtime binds to the same buffers, as
    for one step. onnxruntime does not know the steps share a buffer; step j+1 still runs after step j
    has written its keys, because its input is step j's token.
    """
    spec = ckpt.spec
    vocab = engine_vocab(ckpt, vocab_size, tokens)
    g = GraphBuilder(f"specbuild-{spec.architecture}-steps", ckpt, numerics)
    input_ids, att = _engine_inputs(g, spec, numerics, max_seq_len)
    # Each step's total_len is an input of its own: GroupQueryAttention reads it on the host, where an
    # Add in the graph would not stay on the CUDA provider (nor its result).
    lengths = [att.total_len] + [g.input(step_total_len(j), INT32, []) for j in range(1, steps)]
    no_drafts = g.const(0)
    drafts = []
    for j in range(steps):
        step_att = att.step(j, g.op("Add", att.seqlens_k, g.const([j], np.int32)) if j else att.seqlens_k, lengths[j])
        ids = _embeddable(g, g.op("Reshape", input_ids, g.const([-1])), vocab, vocab_size)
        hidden, presents, head = FAMILIES[spec.family](g, spec, ids, step_att, max_seq_len, vocab)
        _, token, _, logits = verification_tail(g, hidden, input_ids, no_drafts, lambda x: linear(g, x, head), None,
                                                spec.final_softcap, logits_scaling=spec.logits_scaling)
        logits.name = f"{LOGITS}.step{j}"  # one name per value
        _cache_outputs(g, presents, step_presents(len(presents), j), att, numerics, max_seq_len)
        drafts.append(g.op("Reshape", token, g.const([1])))
        if j + 1 < steps:
            input_ids = g.op("Reshape", token, g.const([1, 1]))
    g.output(g.op("Concat", *drafts, axis=0), "drafts", INT64, [steps])
    return g.model()


def check_every_tensor_used(ckpt: Checkpoint, role: str, max_seq_len: int) -> None:
    """UnsupportedModelError unless the model's graph reads exactly the stored tensors transformers loads: a
    variant the graph builder does not know (Gemma with biases, say) would otherwise compute other logits
    than transformers without a word. What transformers ignores (rotary or mask buffers some checkpoints
    store) the graph ignores too. Builds the graph without reading a weight."""
    spec = ckpt.spec
    g = GraphBuilder(f"specbuild-{spec.architecture}", ckpt, Numerics())
    input_ids, att = _engine_inputs(g, spec, Numerics(), max_seq_len)
    *_, head = FAMILIES[spec.family](g, spec, g.op("Reshape", input_ids, g.const([-1])), att, max_seq_len,
                                     spec.shape.vocab_size)
    used = g.used | set(head.names)  # the head is read by the verification, not the body
    unread = sorted(ckpt.weights() - used)
    foreign = sorted(used - ckpt.loaded)
    for names, what in ((unread, "does not use"), (foreign, "reads, which transformers does not load,")):
        if names:
            more = f" and {len(names) - 3} more" if len(names) > 3 else ""
            raise UnsupportedModelError(
                f"{role} checkpoint {ckpt.path} has tensors specbuild's {spec.architecture} graph {what} "
                f"({', '.join(names[:3])}{more}): a variant of the architecture specbuild does not support; its "
                "engine would compute other logits than transformers")


def engine_vocab(ckpt: Checkpoint, vocab_size: int | None, tokens: int | None = None) -> int:
    """Rows of the engine's embedding table and LM head: the model's, cut to vocab_size (the target's) where
    a draft has padding rows past it; a smaller table stays as it is (_embeddable). tokens (a draft's only:
    the tokenizer's ids) cuts a draft's padding rows within the target's vocabulary too: rows no training
    reaches (distill trains the draft on the tokenizer's ids alone) keep their initial logits, which may
    outrank every real token's, and each padding id drafted is a round's certain rejection. A draft only
    proposes, so the cut never changes the output; the target's padding ids it then reads as its last row."""
    rows = ckpt.spec.shape.vocab_size
    return min(rows, vocab_size or rows, tokens or rows)


def _embeddable(g: GraphBuilder, ids: ir.Value, vocab: int, target_vocab: int | None) -> ir.Value:
    """ids a draft with a smaller table than the target's can embed: the target's tokens past it (padding
    rows: Qwen2.5-7B has 152064, its 0.5B draft 151936) read as its last row. A draft only proposes, so
    this can cost acceptance on such a token, never change the output; without it the draft's Gather
    fails on the first one the target emits."""
    if target_vocab is None or vocab >= target_vocab:
        return ids
    return g.op("Min", ids, g.const([vocab - 1], np.int64))


def _engine_inputs(g: GraphBuilder, spec, numerics: Numerics, max_seq_len: int) -> tuple[ir.Value, Attention]:
    """input_ids [1, S] and the attention inputs (lengths, KV buffers) every engine graph has."""
    shape = spec.shape
    input_ids = g.input("input_ids", INT64, [1, "S"])
    # GroupQueryAttention's two length inputs, both fed by the runtime: the CUDA provider wants them as
    # plain graph inputs (computed in the graph they would sit on the CPU, between GPU nodes).
    seqlens_k = g.input("seqlens_k", INT32, [1])  # = total_len - 1
    total_len = g.input("total_len", INT32, [])
    kv_shape = [1, shape.num_kv_heads, max_seq_len, shape.head_dim]
    inputs = [g.input(past, numerics.ir_type, kv_shape) for past, _ in cache_names(shape.num_layers)]
    past = list(zip(inputs[::2], inputs[1::2]))  # (key, value) per layer
    return input_ids, Attention(seqlens_k, total_len, past, shape.num_heads, shape.num_kv_heads, shape.head_dim)


def _cache_outputs(g: GraphBuilder, presents, names: list[str], att: Attention, numerics: Numerics,
                   max_seq_len: int) -> None:
    """Each layer's present K/V as the outputs `names` (in cache_names' order)."""
    written = [buffer for pair in presents for buffer in pair]  # key, value per layer: cache_names' order
    kv_shape = [1, att.num_kv_heads, max_seq_len, att.head_dim]
    for buffer, name in zip(written, names):
        g.output(buffer, name, numerics.ir_type, kv_shape)
