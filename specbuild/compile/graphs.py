"""Stage 2: build ONNX decoder graphs straight from weights, with greedy verification in the tail.

One builder per architecture family reads top to bottom like the model. Attention is onnxruntime's
GroupQueryAttention with the KV buffers shared between past and present: the runtime allocates them
once for max_seq_len and the op writes new keys/values in place at positions past..total-1, so
rejecting drafts is only a smaller total_len on the next call.

Shapes: S = tokens fed this call, D = num_drafts, H = hidden, V = vocab, KV = kv heads, hd = head dim.
"""

from __future__ import annotations

import itertools

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from specbuild_runtime.manifest import ModelShape

from .load import ModelSpec

OPSET = 23  # RMSNormalization
IR_VERSION = 10  # onnxruntime 1.31 loads IR <= 13; onnx 1.23 would write 14
MS = "com.microsoft"
LOGITS_NODE = "logits"  # its output LOGITS is the [D+1, V] logits every decision is made from
LOGITS = f"{LOGITS_NODE}/out0"


class GraphBuilder:
    """Collects nodes and initializers; every op call returns its output name(s)."""

    def __init__(self, name: str, parent: "GraphBuilder | None" = None):
        self.name = name
        self.nodes: list[onnx.NodeProto] = []
        # A branch (If subgraph) keeps its constants in the main graph and shares its name counter.
        self.initializers: list[onnx.TensorProto] = parent.initializers if parent else []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self._counter = parent._counter if parent else itertools.count(1)

    def branch(self, name: str) -> "GraphBuilder":
        return GraphBuilder(name, parent=self)

    def graph(self) -> onnx.GraphProto:
        return helper.make_graph(self.nodes, self.name, self.inputs, self.outputs,
                                 [] if self._is_branch else self.initializers)

    @property
    def _is_branch(self) -> bool:
        return self.name.startswith("branch.")

    def weight(self, name: str, array: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def const(self, values, dtype=np.int64) -> str:
        return self.weight(f"const.{next(self._counter)}", np.asarray(values, dtype=dtype))

    def op(self, op_type: str, *inputs: str, outputs: int = 1, domain: str = "", name: str | None = None, **attrs):
        node_name = name or f"{op_type}.{next(self._counter)}"
        outs = [f"{node_name}/out{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=node_name, domain=domain, **attrs))
        return outs[0] if outputs == 1 else outs

    def input(self, name: str, elem_type: int, shape: list) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, elem_type, shape))
        return name

    def output(self, value: str, name: str, elem_type: int, shape: list) -> None:
        self.nodes.append(helper.make_node("Identity", [value], [name], name=f"output.{name}"))
        self.outputs.append(helper.make_tensor_value_info(name, elem_type, shape))

    def model(self) -> onnx.ModelProto:
        return helper.make_model(
            self.graph(),
            opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS, 1)],
            ir_version=IR_VERSION,
            producer_name="specbuild",
        )


def build_decoder(
    spec: ModelSpec, weights: dict[str, np.ndarray], rotary, max_seq_len: int, with_logits: bool = False
) -> onnx.ModelProto:
    """The engine graph for one model (see specbuild_runtime.manifest for its I/O contract).

    with_logits adds a `logits` [D+1, V] output: for checking the graph against transformers only.
    """
    g = GraphBuilder(f"specbuild-{spec.architecture}")
    shape = spec.shape
    input_ids = g.input("input_ids", TensorProto.INT64, [1, "S"])
    # GroupQueryAttention's two length inputs, both fed by the runtime: the CUDA provider wants them as
    # plain graph inputs (computed in the graph they would sit on the CPU, between GPU nodes).
    seqlens_k = g.input("seqlens_k", TensorProto.INT32, [1])  # = total_len - 1
    total_len = g.input("total_len", TensorProto.INT32, [])
    num_drafts = g.input("num_drafts", TensorProto.INT64, [])
    sampling = SamplingInputs(
        temperature=g.input("temperature", TensorProto.FLOAT, []),
        top_k=g.input("top_k", TensorProto.INT64, []),
        top_p=g.input("top_p", TensorProto.FLOAT, []),
        draft_probs=g.input("draft_probs", TensorProto.FLOAT, ["D", shape.vocab_size]),
        uniforms=g.input("uniforms", TensorProto.FLOAT, ["D+1"]),
    )
    kv_shape = [1, shape.num_kv_heads, max_seq_len, shape.head_dim]
    past = [
        (g.input(f"past_key.{i}", TensorProto.FLOAT, kv_shape), g.input(f"past_value.{i}", TensorProto.FLOAT, kv_shape))
        for i in range(shape.num_layers)
    ]
    attention = AttentionInputs(seqlens_k, total_len, past)
    if spec.family == "gpt2":
        hidden, presents = _gpt2_body(g, spec, weights, input_ids, total_len, attention)
        lm_head = "transformer.wte.weight"
    else:
        hidden, presents = _llama_body(g, spec, weights, input_ids, attention, rotary, max_seq_len)
        lm_head = "model.embed_tokens.weight" if spec.tie_word_embeddings else g.weight(
            "lm_head.weight", weights["lm_head.weight"]
        )
    accepted, next_token, probs, logits = _verification(g, hidden, input_ids, num_drafts, lm_head, shape, sampling)
    if with_logits:
        g.output(logits, "logits", TensorProto.FLOAT, ["D+1", shape.vocab_size])
    g.output(accepted, "accepted", TensorProto.INT64, [])
    g.output(next_token, "next_token", TensorProto.INT64, [])
    g.output(probs, "probs", TensorProto.FLOAT, ["V or 0"])
    for i, (key, value) in enumerate(presents):
        g.output(key, f"present_key.{i}", TensorProto.FLOAT, kv_shape)
        g.output(value, f"present_value.{i}", TensorProto.FLOAT, kv_shape)
    return g.model()


class AttentionInputs:
    def __init__(self, seqlens_k: str, total_len: str, past: list[tuple[str, str]]):
        self.seqlens_k, self.total_len, self.past = seqlens_k, total_len, past


def _attention(g: GraphBuilder, qkv: str, layer: int, spec: ModelSpec, att: AttentionInputs, rotary_inputs=None):
    """Packed QKV [1,S,(H+2KV)·hd] -> attention output [1,S,H·hd] and the in-place present K/V."""
    shape = spec.shape
    rotary = list(rotary_inputs) if rotary_inputs else []
    attrs = dict(num_heads=shape.num_heads, kv_num_heads=shape.num_kv_heads, scale=float(shape.head_dim) ** -0.5)
    if rotary:
        attrs.update(do_rotary=1, rotary_interleaved=0)
    past_key, past_value = att.past[layer]
    out, present_key, present_value = g.op(
        "GroupQueryAttention",
        qkv, "", "", past_key, past_value, att.seqlens_k, att.total_len, *rotary,
        outputs=3, domain=MS, name=f"layers.{layer}.attention", **attrs,
    )
    return out, (present_key, present_value)


def _linear(g: GraphBuilder, x: str, name: str, weight: np.ndarray, bias: np.ndarray | None) -> str:
    """x @ weight.T (+ bias), weight in torch's [out, in] layout."""
    y = g.op("MatMul", x, g.weight(f"{name}.weight", weight.T))
    return g.op("Add", y, g.weight(f"{name}.bias", bias)) if bias is not None else y


def _llama_body(g, spec: ModelSpec, w: dict, input_ids: str, att: AttentionInputs, rotary, max_seq_len: int):
    cos, sin = rotary_tables(rotary, max_seq_len)
    rotary_inputs = (g.weight("rotary.cos", cos), g.weight("rotary.sin", sin))
    embed = g.weight("model.embed_tokens.weight", w["model.embed_tokens.weight"])
    x = g.op("Gather", embed, input_ids)  # [1,S,H]
    eps = spec.norm_eps
    normed = g.op("RMSNormalization", x, g.weight("layers.0.input_norm", w["model.layers.0.input_layernorm.weight"]), axis=-1, epsilon=eps)
    residual = x
    presents = []
    for i in range(spec.shape.num_layers):
        p = f"model.layers.{i}."
        qkv_weight = np.concatenate([w[p + f"self_attn.{n}_proj.weight"] for n in "qkv"], axis=0)
        qkv_bias = np.concatenate([w[p + f"self_attn.{n}_proj.bias"] for n in "qkv"]) if spec.attention_bias else None
        qkv = _linear(g, normed, f"layers.{i}.qkv", qkv_weight, qkv_bias)
        attn, present = _attention(g, qkv, i, spec, att, rotary_inputs)
        presents.append(present)
        o_bias = w.get(p + "self_attn.o_proj.bias") if spec.attention_bias else None
        attn = _linear(g, attn, f"layers.{i}.o_proj", w[p + "self_attn.o_proj.weight"], o_bias)
        normed, _, _, residual = g.op(
            "SkipSimplifiedLayerNormalization", attn, residual,
            g.weight(f"layers.{i}.post_norm", w[p + "post_attention_layernorm.weight"]),
            outputs=4, domain=MS, epsilon=eps,
        )
        mlp = _llama_mlp(g, spec, w, normed, i)
        is_last = i == spec.shape.num_layers - 1
        norm_weight = w["model.norm.weight"] if is_last else w[f"model.layers.{i + 1}.input_layernorm.weight"]
        normed, _, _, residual = g.op(
            "SkipSimplifiedLayerNormalization", mlp, residual,
            g.weight("final_norm" if is_last else f"layers.{i + 1}.input_norm", norm_weight),
            outputs=4, domain=MS, epsilon=eps,
        )
    return normed, presents


def _llama_mlp(g, spec: ModelSpec, w: dict, x: str, i: int) -> str:
    p = f"model.layers.{i}.mlp."
    bias = (lambda n: w[p + f"{n}.bias"]) if spec.mlp_bias else (lambda n: None)
    gate_up_bias = np.concatenate([bias("gate_proj"), bias("up_proj")]) if spec.mlp_bias else None
    gate_up = _linear(
        g, x, f"layers.{i}.gate_up",
        np.concatenate([w[p + "gate_proj.weight"], w[p + "up_proj.weight"]], axis=0), gate_up_bias,
    )
    gate, up = g.op("Split", gate_up, g.const([spec.intermediate_size] * 2), outputs=2, axis=-1)
    hidden = g.op("Mul", _activation(g, spec.hidden_act, gate), up)
    return _linear(g, hidden, f"layers.{i}.down", w[p + "down_proj.weight"], bias("down_proj"))


def _activation(g, name: str, x: str) -> str:
    if name == "silu":
        return g.op("Mul", x, g.op("Sigmoid", x))
    if name == "gelu":
        return g.op("Gelu", x)
    return g.op("Gelu", x, approximate="tanh")  # gelu_new, gelu_pytorch_tanh


def _gpt2_body(g, spec: ModelSpec, w: dict, input_ids: str, total_len: str, att: AttentionInputs):
    w = {k.removeprefix("transformer."): v for k, v in w.items()}
    # GPT-2's learned positions: rows past_len .. total_len-1 of wpe.
    total = g.op("Reshape", g.op("Cast", total_len, to=TensorProto.INT64), g.const([1]))
    past_len = g.op("Sub", total, g.op("Shape", input_ids, start=1, end=2))
    positions = g.op("Unsqueeze", g.op("Slice", g.weight("wpe", w["wpe.weight"]), past_len, total), g.const([0]))
    tokens = g.op("Gather", g.weight("transformer.wte.weight", w["wte.weight"]), input_ids)  # [1,S,H]
    eps = spec.norm_eps
    # SkipLayerNormalization adds the two embeddings and normalizes in one op; a plain Add+LayerNorm here
    # matches onnxruntime's EmbedLayerNormalization fusion, which breaks on this graph's dynamic positions.
    normed, _, _, residual = g.op(
        "SkipLayerNormalization", tokens, positions,
        g.weight("h.0.ln_1.weight", w["h.0.ln_1.weight"]), g.weight("h.0.ln_1.bias", w["h.0.ln_1.bias"]),
        outputs=4, domain=MS, epsilon=eps,
    )
    presents = []
    for i in range(spec.shape.num_layers):
        p = f"h.{i}."
        # GPT-2's Conv1D stores weights [in, out]: transpose to the torch Linear layout _linear expects.
        qkv = _linear(g, normed, f"h.{i}.c_attn", w[p + "attn.c_attn.weight"].T, w[p + "attn.c_attn.bias"])
        attn, present = _attention(g, qkv, i, spec, att)
        presents.append(present)
        attn = _linear(g, attn, f"h.{i}.attn.c_proj", w[p + "attn.c_proj.weight"].T, w[p + "attn.c_proj.bias"])
        normed, _, _, residual = g.op(
            "SkipLayerNormalization", attn, residual,
            g.weight(f"h.{i}.ln_2.weight", w[p + "ln_2.weight"]), g.weight(f"h.{i}.ln_2.bias", w[p + "ln_2.bias"]),
            outputs=4, domain=MS, epsilon=eps,
        )
        hidden = _linear(g, normed, f"h.{i}.c_fc", w[p + "mlp.c_fc.weight"].T, w[p + "mlp.c_fc.bias"])
        mlp = _linear(g, _activation(g, spec.hidden_act, hidden), f"h.{i}.mlp.c_proj",
                      w[p + "mlp.c_proj.weight"].T, w[p + "mlp.c_proj.bias"])
        nxt = "ln_f" if i == spec.shape.num_layers - 1 else f"h.{i + 1}.ln_1"
        normed, _, _, residual = g.op(
            "SkipLayerNormalization", mlp, residual,
            g.weight(f"{nxt}.weight", w[f"{nxt}.weight"]), g.weight(f"{nxt}.bias", w[f"{nxt}.bias"]),
            outputs=4, domain=MS, epsilon=eps,
        )
    return normed, presents


class SamplingInputs:
    def __init__(self, temperature: str, top_k: str, top_p: str, draft_probs: str, uniforms: str):
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.draft_probs, self.uniforms = draft_probs, uniforms


def _verification(g, hidden: str, input_ids: str, num_drafts: str, lm_head: str, shape: ModelShape,
                  sampling: SamplingInputs):
    """The last D+1 hidden states -> (accepted drafts, next token, its distribution); logits stay inside.

    Row j of the logits is the model's view after input position S-D-1+j, so it judges draft j (input
    position S-D+j). temperature 0 takes the greedy branch, anything above the sampling branch.
    """
    drafts_1d = g.op("Reshape", num_drafts, g.const([1]))
    seq_1d = g.op("Shape", input_ids, start=1, end=2)
    rows_1d = g.op("Add", drafts_1d, g.const([1]))
    # The head never runs on one row alone (see the runtime's Engine): at least two, the first then
    # dropped, so every logit comes from the same multi-row kernel.
    head_rows = g.op("Max", rows_1d, g.const([2]))
    tail = g.op("Slice", hidden, g.op("Neg", head_rows), g.const([2**62]), g.const([1]))
    tail_2d = g.op("Reshape", tail, g.const([-1, shape.hidden_size]))  # [max(D+1, 2), H], fewer in a 1-token call
    head = g.op("Gemm", tail_2d, lm_head, transB=1)
    logits = g.op("Slice", head, g.op("Neg", rows_1d), g.const([2**62]), g.const([0]), name=LOGITS_NODE)  # [D+1, V]
    drafts = g.op("Slice", g.op("Reshape", input_ids, g.const([-1])), g.op("Sub", seq_1d, drafts_1d), seq_1d)  # [D]
    greedy = g.branch("branch.greedy")
    _greedy_tail(greedy, logits, drafts, drafts_1d)
    sample = g.branch("branch.sampling")
    _sampling_tail(sample, logits, drafts, drafts_1d, num_drafts, sampling)
    is_sampling = g.op("Greater", sampling.temperature, g.const(0.0, np.float32))
    accepted, next_token, probs = g.op("If", is_sampling, outputs=3, then_branch=sample.graph(), else_branch=greedy.graph())
    return accepted, next_token, probs, logits


def _leading_true(g, flags: str) -> str:
    """How many leading elements of a bool vector are true (0 for an empty one).

    The first false element of flags + [false] (ArgMax returns the first maximum): no reduction over
    the empty vector of a call without drafts, which the CUDA provider refuses.
    """
    failures = g.op("Cast", g.op("Concat", g.op("Not", flags), g.const([True], np.bool_), axis=0), to=TensorProto.FLOAT)
    return g.op("ArgMax", failures, axis=0, keepdims=0)


def _branch_outputs(g, accepted: str, next_token: str, probs: str) -> None:
    # Both branches must agree on scalar outputs; some reductions here come out as [1] in onnxruntime.
    scalar = g.const([], np.int64)
    g.output(g.op("Reshape", accepted, scalar), f"{g.name}.accepted", TensorProto.INT64, [])
    g.output(g.op("Reshape", next_token, scalar), f"{g.name}.next_token", TensorProto.INT64, [])
    g.output(probs, f"{g.name}.probs", TensorProto.FLOAT, None)


def _greedy_tail(g, logits: str, drafts: str, drafts_1d: str) -> None:
    """Draft j is accepted while it equals the argmax of row j (and every earlier one did too)."""
    preds = g.op("ArgMax", logits, axis=-1, keepdims=0)  # [D+1]
    accepted = _leading_true(g, g.op("Equal", g.op("Slice", preds, g.const([0]), drafts_1d), drafts))
    _branch_outputs(g, accepted, g.op("Gather", preds, accepted), g.const([], np.float32))


def _sampling_tail(g, logits: str, drafts: str, drafts_1d: str, num_drafts: str, s: SamplingInputs) -> None:
    """Speculative sampling (Leviathan et al. 2023): accept draft x with probability min(1, p(x)/q(x)),
    i.e. when u·q(x) < p(x); resample the first rejected position from norm(max(0, p − q)), or sample
    the bonus token from p when every draft is accepted. uniforms[:D] judge the drafts, uniforms[D]
    draws the next token; q rows (draft_probs) come from the draft engine's own `probs` output.
    """
    probs = _transformed_probs(g, logits, s)  # [D+1, V]
    p_drafts = g.op("Slice", probs, g.const([0]), drafts_1d, g.const([0]))  # [D, V]
    index = g.op("Unsqueeze", drafts, g.const([1]))  # [D, 1]
    p_x = g.op("Reshape", g.op("GatherElements", p_drafts, index, axis=1), g.const([-1]))
    q_x = g.op("Reshape", g.op("GatherElements", s.draft_probs, index, axis=1), g.const([-1]))
    u_accept = g.op("Slice", s.uniforms, g.const([0]), drafts_1d)
    accepted = _leading_true(g, g.op("Less", g.op("Mul", u_accept, q_x), p_x))
    # Row `accepted` of [max(0, p − q) for each draft; p after the last draft] is where the next token comes from.
    residual = g.op("Relu", g.op("Sub", p_drafts, s.draft_probs))
    rows = g.op("Concat", residual, g.op("Slice", probs, drafts_1d, g.const([2**62]), g.const([0])), axis=0)
    row = g.op("Gather", rows, accepted)  # [V]
    p_row = g.op("Gather", probs, accepted)
    # Float rounding can leave a rejected row with no mass; p itself is then the only sensible choice.
    row = g.op("Where", g.op("Greater", g.op("ReduceSum", row, keepdims=0), g.const(0.0, np.float32)), row, p_row)
    cdf = g.op("CumSum", row, g.const(0))
    u_next = g.op("Mul", g.op("Gather", s.uniforms, num_drafts), g.op("Gather", cdf, g.const(-1)))
    vocab_last = g.op("Sub", g.op("Squeeze", g.op("Shape", cdf), g.const([0])), g.const(1))
    next_token = g.op("Min", g.op("ReduceSum", g.op("Cast", g.op("LessOrEqual", cdf, u_next), to=TensorProto.INT64), keepdims=0), vocab_last)
    _branch_outputs(g, accepted, next_token, p_row)


def _transformed_probs(g, logits: str, s: SamplingInputs) -> str:
    """softmax(logits / temperature) restricted to the top_k tokens (0 = all) and the top_p nucleus (1 = all).

    Each restriction sorts the vocabulary, so each sits behind an If and costs nothing when it is off.
    """
    scaled = g.op("Div", logits, s.temperature)
    vocab = g.op("Shape", logits, start=1, end=2)
    top_k = g.op("Reshape", s.top_k, g.const([1]))
    use_top_k = g.op("Squeeze", g.op("And", g.op("Greater", top_k, g.const([0])), g.op("Less", top_k, vocab)), g.const([0]))
    keep_k = g.branch("branch.top_k")
    kth = keep_k.op("Slice", keep_k.op("TopK", scaled, top_k, outputs=2, axis=-1)[0], keep_k.const([-1]),
                    keep_k.const([2**62]), keep_k.const([1]))
    masked = keep_k.op("Where", keep_k.op("Less", scaled, kth), keep_k.const(-np.inf, np.float32), scaled)
    keep_k.output(masked, "branch.top_k.scaled", TensorProto.FLOAT, None)
    all_k = g.branch("branch.all_k")
    all_k.output(scaled, "branch.all_k.scaled", TensorProto.FLOAT, None)
    scaled = g.op("If", use_top_k, then_branch=keep_k.graph(), else_branch=all_k.graph())
    probs = g.op("Softmax", scaled, axis=-1)
    # Nucleus: keep the most probable tokens until the mass before a token reaches top_p.
    nucleus = g.branch("branch.top_p")
    ranked = nucleus.op("TopK", probs, vocab, outputs=2, axis=-1)[0]
    mass_before = nucleus.op("Sub", nucleus.op("CumSum", ranked, nucleus.const(1)), ranked)
    kept = nucleus.op("Less", mass_before, s.top_p)
    threshold = nucleus.op("ReduceMin", nucleus.op("Where", kept, ranked, nucleus.const(2.0, np.float32)),
                           nucleus.const([1]), keepdims=1)
    trimmed = nucleus.op("Where", nucleus.op("Less", probs, threshold), nucleus.const(0.0, np.float32), probs)
    trimmed = nucleus.op("Div", trimmed, nucleus.op("ReduceSum", trimmed, nucleus.const([1]), keepdims=1))
    nucleus.output(trimmed, "branch.top_p.probs", TensorProto.FLOAT, None)
    everything = g.branch("branch.all_p")
    everything.output(probs, "branch.all_p.probs", TensorProto.FLOAT, None)
    use_top_p = g.op("Less", s.top_p, g.const(1.0, np.float32))
    return g.op("If", use_top_p, then_branch=nucleus.graph(), else_branch=everything.graph())


def rotary_tables(config, max_seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [max_seq_len, hd/2] from transformers' own rotary module (covers every rope_scaling it knows)."""
    import torch
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = LlamaRotaryEmbedding(config)
    positions = torch.arange(max_seq_len)[None]
    dummy = torch.zeros(1, dtype=torch.float32)
    with torch.no_grad():
        cos, sin = rotary(dummy, positions)
    half = cos.shape[-1] // 2
    return cos[0, :, :half].numpy().astype(np.float32), sin[0, :, :half].numpy().astype(np.float32)
