"""The tail of every engine: the LM head on the last rows, then greedy or sampled verification of the
drafts. Logits are cast to fp32 before anything decides on them, whatever the engine's float type."""

from __future__ import annotations

from typing import Callable

import numpy as np
import onnx_ir as ir

from .builder import GraphBuilder

FLOAT = ir.DataType.FLOAT
DOUBLE = ir.DataType.DOUBLE
INT64 = ir.DataType.INT64
BOOL = ir.DataType.BOOL
LOGITS = "logits"  # the fp32 [D+1, V] logits every decision is made from (an output of every engine graph)
# next_token where the logits it is decided from hold NaN or +inf (an fp16 engine that overflows): no token is
# right there, and the sampling tail would draw token 0 from NaN probabilities without a word.
NOT_FINITE = -1


class SamplingInputs:
    def __init__(self, temperature: ir.Value, top_k: ir.Value, top_p: ir.Value, min_p: ir.Value,
                 draft_probs: ir.Value, uniforms: ir.Value):
        self.temperature, self.top_k, self.top_p, self.min_p = temperature, top_k, top_p, min_p
        self.draft_probs, self.uniforms = draft_probs, uniforms


class Penalties:
    """vLLM's logits processors that change which token wins (specbuild_runtime.manifest): the penalties, repetition
    over the prompt's and the generated tokens, presence and frequency over the generated ones (prompt_mask [V] bool:
    the prompt's tokens; output_counts [V]: how often each token was generated before the call's drafts), and
    min_tokens (stop_tokens [V] bool, the eos and stop tokens, are no choice for the next min_tokens_left tokens), and
    logit_bias [1 or D+1, V], added to each row's logits (one row: to every row): OpenAI's logit_bias, and a grammar's
    mask (-inf where row j's grammar state refuses the token: structured outputs)."""

    def __init__(self, repetition: ir.Value, presence: ir.Value, frequency: ir.Value, prompt_mask: ir.Value,
                 output_counts: ir.Value, min_tokens_left: ir.Value, stop_tokens: ir.Value, logit_bias: ir.Value):
        self.repetition, self.presence, self.frequency = repetition, presence, frequency
        self.prompt_mask, self.output_counts = prompt_mask, output_counts
        self.min_tokens_left, self.stop_tokens = min_tokens_left, stop_tokens
        self.logit_bias = logit_bias


def penalty_inputs(g: GraphBuilder, vocab) -> Penalties:
    """The processors' graph inputs (manifest.py), vocab: V's dimension (a number, or a name in the sampler)."""
    return Penalties(repetition=g.input("repetition_penalty", FLOAT, []),
                     presence=g.input("presence_penalty", FLOAT, []),
                     frequency=g.input("frequency_penalty", FLOAT, []),
                     prompt_mask=g.input("prompt_mask", BOOL, [vocab]),
                     output_counts=g.input("output_counts", FLOAT, [vocab]),
                     min_tokens_left=g.input("min_tokens_left", INT64, []),
                     stop_tokens=g.input("stop_tokens", BOOL, [vocab]),
                     logit_bias=logit_bias_input(g, vocab))


def logit_bias_input(g: GraphBuilder, vocab) -> ir.Value:
    """logit_bias [1 or D+1, V] (manifest.py), the one processing input a draft's engine graph takes alone."""
    return g.input("logit_bias", FLOAT, ["bias_rows", vocab])


def unprocessed(vocab: int) -> dict[str, np.ndarray]:
    """Feeds of the inputs penalty_inputs makes for a call that applies none (a check's, a test's, a benchmark's)."""
    return {"repetition_penalty": np.array(1, np.float32), "presence_penalty": np.array(0, np.float32),
            "frequency_penalty": np.array(0, np.float32), "prompt_mask": np.zeros(vocab, np.bool_),
            "output_counts": np.zeros(vocab, np.float32), "min_tokens_left": np.array(0, np.int64),
            "stop_tokens": np.zeros(vocab, np.bool_), "logit_bias": np.zeros((1, vocab), np.float32)}


def verification_tail(g: GraphBuilder, hidden: ir.Value, input_ids: ir.Value, num_drafts: ir.Value,
                      head: Callable[[ir.Value], ir.Value], sampling: SamplingInputs | None,
                      softcap: float | None = None, processing: Penalties | ir.Value | None = None, fixed_rows: int = 0,
                      logits_scaling: float = 1.0):
    """The last D+1 hidden states -> (accepted drafts, next token, its distribution, logits).

    hidden [S, H]; head(x [R, H]) -> [R, V] is the model's LM head. Row j of the logits is the model's
    view after input position S-D-1+j, so it judges draft j (input position S-D+j). softcap: Gemma's
    final logit soft-capping, cap·tanh(logits/cap). temperature 0 takes the greedy branch, anything
    above the sampling branch. sampling None: the greedy tail alone on the raw logits, without an If (no
    distribution) and without the penalties' work over [D+1, V]: the greedy-only graph, which CUDA graphs can capture
    (the bundle's sampler decides a call that samples or applies penalties, min_tokens or logit_bias, on its logits).
    processing (with sampling): a target's Penalties: every decision is made on the penalised logits (_penalised,
    behind an If), the `logits` output stays the raw ones (logprobs are vLLM's raw_logprobs). A draft's: its logit_bias
    input alone, added without the If, as it proposes unpenalised (specbuild_runtime.slot.Slot.configure) and its bias
    is only ever a grammar's mask: the If's test of every input cost ~4 us of a ~60 us draft step (the demo draft, 2 CPU
    cores), and under a grammar the penalties' nodes, ~40 us.
    fixed_rows (a target's: max γ + 1, the rows of each of its calls on a GPU, specbuild_runtime.slot.fixed_rows): the
    head multiplies every row of a call of that many rows, whatever its D. logits_scaling: Granite's, which divides
    the logits.
    """
    drafts, drafts_1d = _drafts(g, input_ids, num_drafts)
    rows_1d = g.op("Add", drafts_1d, g.const([1]))
    # The head runs on an even number of rows, at least two (the first then dropped where D+1 is odd), as
    # the runtime groups a call's rows on the CPU (slot.NEVER_ALONE): no logit comes from a row computed
    # alone or as an odd last row, which some of onnxruntime's CPU kernels compute apart.
    head_rows = g.op("Max", g.op("Mul", g.op("Div", g.op("Add", rows_1d, g.const([1])), g.const([2])), g.const([2])),
                     g.const([2]))
    if fixed_rows:
        # A GPU library may round a row otherwise by how many rows its GEMM multiplies, so a fixed-row call's head
        # multiplies all of them at every D: else a row's logits would follow its call's drafts (auto γ mixes every
        # D). Other calls keep the rows above. The CPU's calls are even, so one of that many rows (max γ odd: a prompt's
        # last rows, whose head multiplied 2) multiplies an even count too: the same bits (tests/test_quantize.py).
        tokens = _tokens(g, input_ids)
        head_rows = g.op("Where", g.op("Equal", tokens, g.const([fixed_rows])), tokens, head_rows)
    # [D+1 or D+2, H] (a fixed-row call's: all), fewer in a 1-token call
    tail = g.op("Slice", hidden, g.op("Neg", head_rows), g.const([2**62]), g.const([0]))
    rows = g.op("Slice", head(tail), g.op("Neg", rows_1d), g.const([2**62]), g.const([0]))  # [D+1, V]
    logits = rows if g.numerics.dtype == np.float32 else g.op("Cast", rows, to=FLOAT)
    if logits_scaling != 1.0:
        logits = g.op("Div", logits, g.const(logits_scaling, np.float32))
    if softcap:
        cap = g.const(softcap, np.float32)
        logits = g.op("Mul", g.op("Tanh", g.op("Div", logits, cap)), cap)
    logits.name = LOGITS
    finite = _finite_rows(g, logits)
    if sampling is None:
        accepted, next_token = (_scalar(g, value) for value in _greedy_tail(g, logits, drafts, drafts_1d, finite))
        return accepted, next_token, None, logits
    if isinstance(processing, Penalties):
        decided = _penalised_if_any(g, logits, drafts, processing)
    else:
        decided = logits if processing is None else g.op("Add", logits, processing)
    return (*_greedy_or_sampled(g, decided, input_ids, drafts, drafts_1d, sampling, finite), logits)


def _greedy_or_sampled(g: GraphBuilder, logits: ir.Value, input_ids: ir.Value, drafts: ir.Value, drafts_1d: ir.Value,
                       sampling: SamplingInputs, finite: ir.Value) -> tuple[ir.Value, ir.Value, ir.Value]:
    """(accepted, next token, probs) from logits: the greedy tail at temperature 0, the sampling tail above."""
    greedy = g.branch("branch.greedy")
    _branch_outputs(greedy, *_greedy_tail(greedy, logits, drafts, drafts_1d, finite), greedy.const([], np.float32))
    sample = g.branch("branch.sampling")
    # top_k is made a host value here, in the graph: a node inside a branch reads it as an outer value,
    # which onnxruntime never leaves on the CPU for the node's sake.
    sampled = _sampling_tail(sample, logits, drafts, drafts_1d, _host_top_k(g, sampling, input_ids), finite)
    _branch_outputs(sample, *sampled)
    is_sampling = g.op("Greater", sampling.temperature, g.const(0.0, np.float32))
    return g.op("If", is_sampling, outputs=3, then_branch=sample.graph(), else_branch=greedy.graph())


def build_sampler() -> ir.Model:
    """The bundle's sampler: the engines' deciding tail (the penalties, then greedy or sampled) as a graph of its own,
    fed a call's fp32 `logits` [D+1, V] (an output of every greedy-only graph) and the call's input_ids and num_drafts,
    with the sampling, penalty and logit_bias inputs and the outputs of the engine contract (specbuild_runtime.manifest).
    It is how a decoder running the greedy-only graphs, which CUDA graphs can capture, samples or applies penalties,
    min_tokens or logit_bias (greedy too, at temperature 0): the same nodes on the same logits, so the same tokens as
    the engine graphs. No weights; V is symbolic, so one sampler serves the target and a draft with a smaller
    vocabulary."""
    g = GraphBuilder("specbuild-sampler", None, None)
    logits = g.input(LOGITS, FLOAT, ["D+1", "V"])
    input_ids = g.input("input_ids", INT64, [1, "S"])
    num_drafts = g.input("num_drafts", INT64, [])
    sampling = SamplingInputs(
        temperature=g.input("temperature", FLOAT, []),
        top_k=g.input("top_k", INT64, []),
        top_p=g.input("top_p", FLOAT, []),
        min_p=g.input("min_p", FLOAT, []),
        draft_probs=g.input("draft_probs", FLOAT, ["D", "V"]),
        uniforms=g.input("uniforms", FLOAT, ["D+1"]),
    )
    penalties = penalty_inputs(g, "V")
    drafts, drafts_1d = _drafts(g, input_ids, num_drafts)
    accepted, next_token, probs = _greedy_or_sampled(g, _penalised_if_any(g, logits, drafts, penalties), input_ids, drafts,
                                                     drafts_1d, sampling, _finite_rows(g, logits))
    g.output(accepted, "accepted", INT64, [])
    g.output(next_token, "next_token", INT64, [])
    g.output(probs, "probs", FLOAT, ["V or 0"])
    return g.model()


def _penalised(g: GraphBuilder, logits: ir.Value, drafts: ir.Value, p: Penalties) -> ir.Value:
    """logits [D+1, V] with vLLM's penalties applied as vLLM v1 applies them, to the raw logits before temperature,
    min-p, top-k, top-p and the greedy argmax (vllm/v1/sample/sampler.py: apply_penalties; vllm/v1/sample/ops/
    penalties.py: apply_all_penalties; vllm/model_executor/layers/utils.py: apply_penalties): repetition first,
    transformers' RepetitionPenaltyLogitsProcessor (a seen token's logit times r where negative, else over r),
    then logit - frequency·count, then - presence·(count > 0). Row j judges draft j after drafts 0..j-1, which
    count as generated for it (vllm/v1/sample/rejection_sampler.py adds each position's earlier drafts to the
    output tokens alike): an exclusive running sum of the drafts' one-hot rows on top of output_counts. So a row's
    decision is the one the target alone makes at that position. logit_bias comes first, and min_tokens last, as
    vLLM applies both before the penalties (min_tokens' -inf is one in either order). Neutral values (1, 0, 0, no
    min_tokens left, no bias) leave the logits as they are: x·1, x/1, x - 0 and min(x, +inf) are exact, x + 0 too
    but for -0, which becomes +0 (the same argmax and probabilities)."""
    vocab = g.op("Shape", logits, start=1, end=2)  # [1] on the host: OneHot's depth and Expand's shape read it there
    logits = g.op("Add", logits, p.logit_bias)
    one_hot = g.op("OneHot", drafts, vocab, g.const([0.0, 1.0], np.float32), axis=-1)  # [D, V]
    no_draft = g.op("Expand", g.const(0.0, np.float32), g.op("Concat", g.const([1]), vocab, axis=0))  # [1, V]
    before = g.op("CumSum", g.op("Concat", one_hot, no_draft, axis=0), g.const(0), exclusive=1)  # [D+1, V]
    counts = g.op("Add", before, p.output_counts)
    generated = g.op("Greater", counts, g.const(0.0, np.float32))
    seen = g.op("Cast", g.op("Or", generated, p.prompt_mask), to=FLOAT)
    # Seen tokens' logits times r where negative (below), over r elsewhere (above), as x·times/over with each factor
    # r or exactly 1: the bits of transformers' x·r and x/r. Arithmetic, not Where: onnxruntime's CPU Where took
    # 12-30 ms on [9, 152k], 20-100x a Mul.
    below = g.op("Mul", seen, g.op("Cast", g.op("Less", logits, g.const(0.0, np.float32)), to=FLOAT))
    above = g.op("Sub", seen, below)
    one = g.const(1.0, np.float32)
    times = g.op("Max", g.op("Mul", below, p.repetition), g.op("Sub", one, below))
    over = g.op("Max", g.op("Mul", above, p.repetition), g.op("Sub", one, above))
    logits = g.op("Div", g.op("Mul", logits, times), over)
    logits = g.op("Sub", logits, g.op("Mul", counts, p.frequency))
    logits = g.op("Sub", logits, g.op("Mul", g.op("Cast", generated, to=FLOAT), p.presence))
    # min_tokens (vLLM's MinTokensLogitsProcessor): row j decides generated token min_tokens_left-before + j, so rows
    # j < min_tokens_left keep the stop tokens out, as -inf (Min with -inf there, +inf elsewhere: x's own bits).
    rows = g.op("Shape", logits, start=0, end=1)  # [1] on the host, Expand's shape
    index = g.op("CumSum", g.op("Expand", g.const(1.0, np.float32), rows), g.const(0), exclusive=1)  # [D+1]: 0, 1, ...
    early = g.op("Less", index, g.op("Cast", p.min_tokens_left, to=FLOAT))
    ceiling = g.op("Max", _infinities(g, g.op("Unsqueeze", early, g.const([1]))), _infinities(g, p.stop_tokens))
    return g.op("Min", logits, ceiling)


def _infinities(g: GraphBuilder, mask: ir.Value) -> ir.Value:
    """-inf where mask is true, +inf where false: log(1 - m) - log(m), exact (no Where: see _penalised)."""
    m = g.op("Cast", mask, to=FLOAT)
    return g.op("Sub", g.op("Log", g.op("Sub", g.const(1.0, np.float32), m)), g.op("Log", m))


def _penalised_if_any(g: GraphBuilder, logits: ir.Value, drafts: ir.Value, p: Penalties) -> ir.Value:
    """_penalised behind an If that skips its [D+1, V] work where every penalty is neutral, no min_tokens is left and
    no token biased (the graphs with control flow: the engine graphs and the sampler)."""
    neutral = g.op("And", g.op("And", g.op("Equal", p.repetition, g.const(1.0, np.float32)),
                               g.op("Equal", p.presence, g.const(0.0, np.float32))),
                   g.op("And", g.op("And", g.op("Equal", p.frequency, g.const(0.0, np.float32)),
                                    g.op("LessOrEqual", p.min_tokens_left, g.const(0))),
                        g.op("Equal", g.op("ReduceMax", g.op("Abs", p.logit_bias), keepdims=0), g.const(0.0, np.float32))))
    apply = g.branch("branch.penalties")
    apply.output(_penalised(apply, logits, drafts, p), "branch.penalties.logits", FLOAT, None)
    raw = g.branch("branch.no_penalties")
    raw.output(logits, "branch.no_penalties.logits", FLOAT, None)
    return g.op("If", neutral, then_branch=raw.graph(), else_branch=apply.graph())


def _drafts(g: GraphBuilder, input_ids: ir.Value, num_drafts: ir.Value) -> tuple[ir.Value, ir.Value]:
    """(the last num_drafts input ids [D], num_drafts as [1] on the host: see _on_host)."""
    seq_1d = _tokens(g, input_ids)
    drafts_1d = _on_host(g, num_drafts, seq_1d)
    return g.op("Slice", g.op("Reshape", input_ids, g.const([-1])), g.op("Sub", seq_1d, drafts_1d), seq_1d), drafts_1d


def _host_top_k(g: GraphBuilder, s: SamplingInputs, input_ids: ir.Value) -> SamplingInputs:
    """s with top_k as [1] on the host (TopK's k reads it there, and in the sampler so do the top-k If's
    conditions; in the engines' sampling branch they run on the device): see _on_host."""
    top_k = _on_host(g, s.top_k, _tokens(g, input_ids))
    return SamplingInputs(s.temperature, top_k, s.top_p, s.min_p, s.draft_probs, s.uniforms)


def _tokens(g: GraphBuilder, input_ids: ir.Value) -> ir.Value:
    """S, the call's token count, as [1] (Shape's output: on the host)."""
    return g.op("Shape", input_ids, start=1, end=2)


def _on_host(g: GraphBuilder, scalar: ir.Value, tokens: ir.Value) -> ir.Value:
    """An int64 scalar input as [1], computed where onnxruntime computes shapes: on the host.

    Slice bounds, TopK's k and If conditions are read on the host. Derived on the GPU they would each
    need a copy back (a wait for the device mid-call, and a Memcpy node, which onnxruntime refuses to
    capture as a CUDA graph). Its CUDA provider leaves a node on the CPU only when it reads a value
    already there, such as Shape's output (fallback_cpu_capability.cc): hence 0·S + value, S = tokens
    (from _tokens: dynamic, so never constant-folded). The input is then bound on the host.
    """
    zero = g.op("Mul", tokens, g.const([0]))
    return g.op("Add", zero, scalar)


def _leading_true(g: GraphBuilder, flags: ir.Value) -> ir.Value:
    """How many leading elements of a bool vector are true (0 for an empty one).

    The first false element of flags + [false] (ArgMax returns the first maximum): no reduction over
    the empty vector of a call without drafts, which the CUDA provider refuses.
    """
    failures = g.op("Cast", g.op("Concat", g.op("Not", flags), g.const([True], np.bool_), axis=0), to=FLOAT)
    return g.op("ArgMax", failures, axis=0, keepdims=0)


def _finite_rows(g: GraphBuilder, logits: ir.Value) -> ir.Value:
    """[D+1] bool: whether each row of logits is free of NaN and +inf, the values that leave no token to decide
    on (an argmax among infinities or NaNs, NaN probabilities). One sum a row, which is NaN or +inf exactly
    then (-inf alone is a token of probability 0: the sum stays -inf), and one comparison: NaN < inf is false
    too. Finite logits beyond ~1e33 would overflow the sum, which no model's head comes near."""
    return g.op("Less", g.op("ReduceSum", logits, g.const([1]), keepdims=0), g.const(np.inf, np.float32))


def _decided(g: GraphBuilder, finite: ir.Value, accepted: ir.Value, next_token: ir.Value) -> ir.Value:
    """next_token, or NOT_FINITE where the row it was decided from is not finite. The drafts before that row
    were judged on finite rows (see the callers' acceptance), so a decoder keeps them and stops there, where
    the target alone would have stopped too."""
    return g.op("Where", g.op("Gather", finite, accepted), next_token, g.const(NOT_FINITE))


def _scalar(g: GraphBuilder, value: ir.Value) -> ir.Value:
    # Outputs are scalars (and both branches must agree); some reductions here come out as [1] in onnxruntime.
    return g.op("Reshape", value, g.const([], np.int64))


def _branch_outputs(g: GraphBuilder, accepted: ir.Value, next_token: ir.Value, probs: ir.Value) -> None:
    g.output(_scalar(g, accepted), f"{g.name}.accepted", INT64, [])
    g.output(_scalar(g, next_token), f"{g.name}.next_token", INT64, [])
    g.output(probs, f"{g.name}.probs", FLOAT, None)


def _greedy_tail(g: GraphBuilder, logits: ir.Value, drafts: ir.Value, drafts_1d: ir.Value,
                 finite: ir.Value) -> tuple[ir.Value, ir.Value]:
    """(accepted, next token): draft j is accepted while it equals the argmax of a finite row j (and every
    earlier one did too); the next token is the argmax of the row after the accepted ones (NOT_FINITE where
    that row is not finite)."""
    preds = g.op("ArgMax", logits, axis=-1, keepdims=0)  # [D+1]
    agree = g.op("Equal", g.op("Slice", preds, g.const([0]), drafts_1d), drafts)
    accepted = _leading_true(g, g.op("And", agree, g.op("Slice", finite, g.const([0]), drafts_1d)))
    return accepted, _decided(g, finite, accepted, g.op("Gather", preds, accepted))


def _sampling_tail(g: GraphBuilder, logits: ir.Value, drafts: ir.Value, drafts_1d: ir.Value,
                   s: SamplingInputs, finite: ir.Value) -> tuple[ir.Value, ir.Value, ir.Value]:
    """Speculative sampling (Leviathan et al. 2023): accept draft x with probability min(1, p(x)/q(x)),
    i.e. when u·q(x) < p(x); resample the first rejected position from norm(max(0, p − q)), or sample
    the bonus token from p when every draft is accepted. uniforms[:D] judge the drafts, uniforms[D]
    draws the next token; q rows (draft_probs) come from the draft engine's own `probs` output. A row
    that is not finite accepts no draft and draws NOT_FINITE (finite: _finite_rows).
    """
    probs = _transformed_probs(g, logits, s)  # [D+1, V]
    p_drafts = g.op("Slice", probs, g.const([0]), drafts_1d, g.const([0]))  # [D, V]
    index = g.op("Unsqueeze", drafts, g.const([1]))  # [D, 1]
    p_x = g.op("Reshape", g.op("GatherElements", p_drafts, index, axis=1), g.const([-1]))
    q_x = g.op("Reshape", g.op("GatherElements", s.draft_probs, index, axis=1), g.const([-1]))
    u_accept = g.op("Slice", s.uniforms, g.const([0]), drafts_1d)
    judged = g.op("Less", g.op("Mul", u_accept, q_x), p_x)
    accepted = _leading_true(g, g.op("And", judged, g.op("Slice", finite, g.const([0]), drafts_1d)))
    # Row `accepted` of [max(0, p − q) for each draft; p after the last draft] is where the next token comes from.
    residual = g.op("Relu", g.op("Sub", p_drafts, s.draft_probs))
    rows = g.op("Concat", residual, g.op("Slice", probs, drafts_1d, g.const([2**62]), g.const([0])), axis=0)
    row = g.op("Gather", rows, accepted)  # [V]
    p_row = g.op("Gather", probs, accepted)
    # Float rounding can leave a rejected row with no mass; p itself is then the only sensible choice.
    row = g.op("Where", g.op("Greater", g.op("ReduceSum", row, keepdims=0), g.const(0.0, np.float32)), row, p_row)
    # The running sum in float64: in float32 a token below half a step of the sum so far adds nothing to it
    # (p < 3e-8 once it passes 0.5) and was never drawn; over 150k-260k tokens such tokens hold up to ~0.1% of the
    # mass. Drawn by a float32 uniform, each token's chance is still rounded to its grid (2^-24 near 1), as
    # torch.multinomial's on CUDA is.
    cdf = g.op("Reshape", _cumsum(g, g.op("Unsqueeze", g.op("Cast", row, to=DOUBLE), g.const([0])), np.float64),
               g.const([-1]))
    u_last = g.op("Slice", s.uniforms, drafts_1d, g.const([2**62]))  # uniforms[D:] = [u_D], bounds on the host
    u_next = g.op("Mul", g.op("Cast", u_last, to=DOUBLE), g.op("Gather", cdf, g.const(-1)))
    vocab_last = g.op("Sub", g.op("Squeeze", g.op("Shape", cdf), g.const([0])), g.const(1))
    next_token = g.op("Min", g.op("ReduceSum", g.op("Cast", g.op("LessOrEqual", cdf, u_next), to=INT64), keepdims=0), vocab_last)
    return accepted, _decided(g, finite, accepted, next_token), p_row


CUMSUM_BLOCK = 64
NUCLEUS_CANDIDATES = 1024


def _ranked(g: GraphBuilder, probs: ir.Value, candidates: ir.Value, vocab: ir.Value,
            top_p: ir.Value) -> tuple[ir.Value, ir.Value]:
    """(each row's probabilities from the largest down, their running sums), as far as the nucleus needs: the top
    `candidates` (min(V, NUCLEUS_CANDIDATES), on the host) where they hold top_p of every row (the token after them
    then has top_p before it, so no nucleus reaches it, and the sums of a prefix are the whole ranking's), else the
    whole vocabulary (`vocab`). Sorting
    all of a 152k vocabulary cost ~18 ms a row on the CPU (over 90% of a sampled call with top-p), and
    generation_config.json's top_p (Qwen 3's 0.95) made it every served request's."""
    candidates = g.op("TopK", probs, candidates, outputs=2, axis=-1)[0]
    summed = _cumsum(g, candidates)
    held = g.op("ReduceMin", g.op("Slice", summed, g.const([-1]), g.const([2**62]), g.const([1])), keepdims=0)
    # A decision like the tail's others (Less, then If; test_gpu allows their copies to the host). A vocabulary of
    # at most NUCLEUS_CANDIDATES whose sum rounds below top_p is sorted again: the same ranking.
    short = g.op("Less", held, top_p)
    few = g.branch(f"{g.name}.candidates")
    few.output(candidates, f"{g.name}.candidates.ranked", FLOAT, None)
    few.output(summed, f"{g.name}.candidates.summed", FLOAT, None)
    every = g.branch(f"{g.name}.vocabulary")
    ranked = every.op("TopK", probs, vocab, outputs=2, axis=-1)[0]
    every.output(ranked, f"{g.name}.vocabulary.ranked", FLOAT, None)
    every.output(_cumsum(every, ranked), f"{g.name}.vocabulary.summed", FLOAT, None)
    return g.op("If", short, outputs=2, then_branch=every.graph(), else_branch=few.graph())


def _cumsum(g: GraphBuilder, x: ir.Value, dtype=np.float32) -> ir.Value:
    """CumSum of x [R, V] along V, in blocks of CUMSUM_BLOCK. onnxruntime's CUDA CumSum has each output add
    every element before it (cumsum_impl.cu): V²/2 additions a row, 1.2e10 at a 152k vocabulary. Blocked: a
    CumSum within each block (V·B/2) plus one over the block totals ((V/B)²/2), 8e6 at 152k with B = 64 (about
    (2V)^(1/3), which minimises the sum). The CPU's CumSum is linear either way. dtype: x's. Zeros are appended
    by Expand and Concat, not Pad, whose newer opsets the CUDA provider may not register."""
    vocab = g.op("Shape", x, start=1, end=2)
    pad = g.op("Mod", g.op("Sub", g.const([CUMSUM_BLOCK]), g.op("Mod", vocab, g.const([CUMSUM_BLOCK]))),
               g.const([CUMSUM_BLOCK]))
    zeros = g.op("Expand", g.const(0, dtype), g.op("Concat", g.op("Shape", x, start=0, end=1), pad, axis=0))
    blocks = g.op("Reshape", g.op("Concat", x, zeros, axis=1),
                  g.const([0, -1, CUMSUM_BLOCK]))  # [R, V/B, B], zeros after the last token
    within = g.op("CumSum", blocks, g.const(2))
    before = g.op("CumSum", g.op("ReduceSum", blocks, g.const([2]), keepdims=1), g.const(1), exclusive=1)
    summed = g.op("Reshape", g.op("Add", within, before), g.const([0, -1]))
    return g.op("Slice", summed, g.const([0]), vocab, g.const([1]))


def _transformed_probs(g: GraphBuilder, logits: ir.Value, s: SamplingInputs) -> ir.Value:
    """softmax(logits / temperature) restricted to the tokens at least min_p times as probable as the most
    probable (0 = all), then to the top_k tokens (0 = all), then to the top_p nucleus (1 = all): vLLM's order
    (vllm/v1/sample/sampler.py: temperature, then min_p among the argmax-invariant logits processors, then
    top-k and top-p), where min_p's tokens are taken from the whole vocabulary, and top-p's mass after min_p.

    Each restriction sits behind an If and costs nothing when it is off (top-k and top-p sort the vocabulary).
    """
    scaled = g.op("Div", logits, s.temperature)
    vocab = g.op("Shape", logits, start=1, end=2)
    # min_p as vLLM's MinPLogitsProcessor: a token whose probability is below min_p times its row's largest is dropped.
    keep_min_p = g.branch("branch.min_p")
    probs = keep_min_p.op("Softmax", scaled, axis=-1)
    floor = keep_min_p.op("Mul", keep_min_p.op("ReduceMax", probs, keep_min_p.const([1]), keepdims=1), s.min_p)
    dropped = keep_min_p.op("Where", keep_min_p.op("Less", probs, floor), keep_min_p.const(-np.inf, np.float32), scaled)
    keep_min_p.output(dropped, "branch.min_p.scaled", FLOAT, None)
    all_min_p = g.branch("branch.all_min_p")
    all_min_p.output(scaled, "branch.all_min_p.scaled", FLOAT, None)
    use_min_p = g.op("Greater", s.min_p, g.const(0.0, np.float32))
    scaled = g.op("If", use_min_p, then_branch=keep_min_p.graph(), else_branch=all_min_p.graph())
    top_k = s.top_k  # [1], on the host (see _host_top_k)
    use_top_k = g.op("Squeeze", g.op("And", g.op("Greater", top_k, g.const([0])), g.op("Less", top_k, vocab)), g.const([0]))
    keep_k = g.branch("branch.top_k")
    kth = keep_k.op("Slice", keep_k.op("TopK", scaled, top_k, outputs=2, axis=-1)[0], keep_k.const([-1]),
                    keep_k.const([2**62]), keep_k.const([1]))
    masked = keep_k.op("Where", keep_k.op("Less", scaled, kth), keep_k.const(-np.inf, np.float32), scaled)
    keep_k.output(masked, "branch.top_k.scaled", FLOAT, None)
    all_k = g.branch("branch.all_k")
    all_k.output(scaled, "branch.all_k.scaled", FLOAT, None)
    scaled = g.op("If", use_top_k, then_branch=keep_k.graph(), else_branch=all_k.graph())
    probs = g.op("Softmax", scaled, axis=-1)
    # Nucleus: keep the most probable tokens until the mass before a token reaches top_p.
    nucleus = g.branch("branch.top_p")
    # TopK's k, on the host beside Shape's output: computed inside the branch from the outer `vocab`, the CUDA
    # provider ran the Min on the device and copied k back on every top-p call (an H100, 2026-11-27; see _on_host).
    candidates = g.op("Min", vocab, g.const([NUCLEUS_CANDIDATES]))
    ranked, summed = _ranked(nucleus, probs, candidates, vocab, s.top_p)
    mass_before = nucleus.op("Sub", summed, ranked)
    kept = nucleus.op("Less", mass_before, s.top_p)
    threshold = nucleus.op("ReduceMin", nucleus.op("Where", kept, ranked, nucleus.const(2.0, np.float32)),
                           nucleus.const([1]), keepdims=1)
    trimmed = nucleus.op("Where", nucleus.op("Less", probs, threshold), nucleus.const(0.0, np.float32), probs)
    trimmed = nucleus.op("Div", trimmed, nucleus.op("ReduceSum", trimmed, nucleus.const([1]), keepdims=1))
    nucleus.output(trimmed, "branch.top_p.probs", FLOAT, None)
    everything = g.branch("branch.all_p")
    everything.output(probs, "branch.all_p.probs", FLOAT, None)
    use_top_p = g.op("Less", s.top_p, g.const(1.0, np.float32))
    return g.op("If", use_top_p, then_branch=nucleus.graph(), else_branch=everything.graph())
