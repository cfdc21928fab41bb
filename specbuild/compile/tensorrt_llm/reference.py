"""A numpy forward pass over a TensorRT-LLM checkpoint, computed the way TensorRT-LLM's layers compute it:
the proof of an export that was written without TensorRT-LLM (the modules beside it).

It reads config.json and every rank{r}.safetensors and runs the prompt through the model TensorRT-LLM
builds from them (models/llama, qwen, gpt, gemma and phi3 model.py), rank by rank as tensor parallelism
computes: a column-parallel layer (layers/linear.py ColumnLinear) gives each rank its own slice of the
outputs; a row-parallel one (RowLinear) gives each rank a partial sum of all outputs, which the all-reduce
adds, and adds its bias once after; lm_head's slices are gathered. Attention follows layers/attention.py
(the fused qkv of a rank holds that rank's q, k then v heads) with the gpt_attention plugin's rotary
embedding (rope_gpt_neox: the two halves of each head's rotary part rotate together) and causal
softmax(q k^T / sqrt(d)).
All arithmetic is float64 so that what is compared is the layout, not rounding.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

# layers/attention.py Attention(eps=1e-05): QWenDecoderLayer gives Qwen3's q/k norms no other eps.
ATTENTION_NORM_EPS = 1e-5
GATED = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",  # GatedMLP, RmsNorm
         "GraniteForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM"}  # (the last two: MOE, moe_experts)
LAYER_NORM = {"GPT2LMHeadModel"}  # models/gpt: MLP, LayerNorm, learned absolute positions
GEMMA = {"Gemma3ForCausalLM"}  # models/gemma: GatedMLP, RmsNorm, norms around attention and MLP (gemma_layer)
PHI3 = {"Phi3ForCausalLM"}  # models/phi3: MLP with swiglu (fc holds up and gate), RmsNorm, partial and LongRoPE rotary


def logits(folder: str | Path, input_ids: list[int], windows: list[int] | None = None) -> np.ndarray:
    """[len(input_ids), vocab_size] logits of a context pass from an empty cache (TensorRT-LLM's decoder
    samples over vocab_size; lm_head's tp padding rows are dropped). windows: the engines' run-time
    max_attention_window_size, repeated over the layers (None: the whole context at every layer)."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_bytes())
    if config["architecture"] not in GATED | LAYER_NORM | GEMMA | PHI3:
        raise ValueError(f"{folder}: no reference for {config['architecture']}")
    model = Ranks([load_file(folder / f"rank{r}.safetensors") for r in range(config["mapping"]["tp_size"])])
    if config["architecture"] in GEMMA:
        return gemma_logits(model, config, input_ids, windows)
    if config["architecture"] in PHI3:  # Phi3DecoderLayer gives its Attention no head size: hidden_size / heads
        config = {**config, "head_size": config["hidden_size"] // config["num_attention_heads"]}
    gpt = config["architecture"] in LAYER_NORM
    positions = np.arange(len(input_ids))
    # LLaMAConfig's multipliers (Granite's; 1.0 by default): models/llama/model.py LLaMAModel, LLaMADecoderLayer
    residual = config.get("residual_multiplier", 1.0)
    x = model.whole("transformer.vocab_embedding.weight")[input_ids] * config.get("embedding_multiplier", 1.0)
    if gpt:
        x = x + model.whole("transformer.position_embedding.weight")[positions]
    rope = None if gpt else rotary_tables(config, positions)
    for i in range(config["num_hidden_layers"]):
        layer = f"transformer.layers.{i}."
        x = x + attention(model.norm(x, layer + "input_layernorm", config), model, layer + "attention.", config,
                          rope) * residual
        x = x + mlp(model.norm(x, layer + "post_layernorm", config), model, layer + "mlp.", config, gpt) * residual
    x = model.norm(x, "transformer.ln_f", config)
    # models/modeling_utils.py DecoderModelForCausalLM: the logits times the config's output_multiplier_scale, if any
    logits = np.concatenate(model.column(x, "lm_head"), axis=-1) * config.get("output_multiplier_scale", 1.0)
    return logits[:, :config["vocab_size"]]


def gemma_logits(model: Ranks, config: dict, input_ids: list[int], windows: list[int] | None) -> np.ndarray:
    """models/gemma/model.py GemmaModel and GemmaDecoderLayer with inter_layernorms (no reduce fusion): the
    embeddings times sqrt(hidden_size); post_layernorm normalises the attention's output before its residual add,
    pre/post_feedforward_layernorm the MLP's input and output; layer i local where (i + 1) %
    _sliding_window_pattern, rotating by rope_local_base_freq with the same rotary_scaling (Attention.
    create_attention_const_params); the logits soft-capped by final_logit_softcapping (modeling_utils.py
    DecoderModelForCausalLM)."""
    positions = np.arange(len(input_ids))
    parallel = config["use_parallel_embedding"]
    x = model.embedding("transformer.vocab_embedding.weight", input_ids, parallel) * math.sqrt(config["hidden_size"])
    ropes = {False: rotary_tables(config, positions),
             True: rotary_tables({**config, "rotary_base": config["rope_local_base_freq"]}, positions)}
    for i in range(config["num_hidden_layers"]):
        layer = f"transformer.layers.{i}."
        local = bool((i + 1) % config["_sliding_window_pattern"])
        window = windows[i % len(windows)] if windows else None
        h = attention(model.norm(x, layer + "input_layernorm", config), model, layer + "attention.", config,
                      ropes[local], window)
        x = x + model.norm(h, layer + "post_layernorm", config)
        h = mlp(model.norm(x, layer + "pre_feedforward_layernorm", config), model, layer + "mlp.", config, False)
        x = x + model.norm(h, layer + "post_feedforward_layernorm", config)
    logits = np.concatenate(model.column(model.norm(x, "transformer.ln_f", config), "lm_head"), axis=-1)
    if cap := config.get("final_logit_softcapping"):
        logits = np.tanh(logits / cap) * cap
    return logits[:, :config["vocab_size"]]


class Ranks:
    """The tensors of every rank, and the collectives that combine what each rank computes."""

    def __init__(self, ranks: list[dict[str, np.ndarray]]):
        names = set(ranks[0])
        for r, tensors in enumerate(ranks):
            if set(tensors) != names:
                raise ValueError(f"rank {r} holds other tensors than rank 0: {sorted(set(tensors) ^ names)[:4]}")
        self.ranks = [{name: value.astype(np.float64) for name, value in tensors.items()} for tensors in ranks]

    def has(self, name: str) -> bool:
        return name in self.ranks[0]

    def whole(self, name: str) -> np.ndarray:
        """A tensor every rank holds in full (each loads its own copy: they must agree)."""
        value = self.ranks[0][name]
        if any(not np.array_equal(tensors[name], value) for tensors in self.ranks[1:]):
            raise ValueError(f"{name} differs between ranks although TensorRT-LLM holds it whole on each")
        return value

    def embedding(self, name: str, ids: list[int], parallel: bool) -> np.ndarray:
        """layers/embedding.py Embedding: whole on every rank, or (parallel, sharding dim 0) each rank looks up the
        ids within its rows, zero for the others, and the all-reduce sums them."""
        if not parallel:
            return self.whole(name)[ids]
        wanted = np.asarray(ids)
        total = 0.0
        for r, tensors in enumerate(self.ranks):
            table = tensors[name]
            local = wanted - r * len(table)
            inside = (local >= 0) & (local < len(table))
            total = total + np.where(inside[:, None], table[np.clip(local, 0, len(table) - 1)], 0.0)
        return total

    def column(self, x: np.ndarray, name: str) -> list[np.ndarray]:
        """ColumnLinear: rank r computes its output slice x W_r^T + b_r."""
        return [x @ t[name + ".weight"].T + t.get(name + ".bias", 0.0) for t in self.ranks]

    def row(self, parts: list[np.ndarray], name: str) -> np.ndarray:
        """RowLinear: rank r multiplies its input slice by its columns; the all-reduce sums the partial
        products, then the (whole) bias is added once."""
        total = sum(part @ t[name + ".weight"].T for part, t in zip(parts, self.ranks))
        return total + self.whole(name + ".bias") if self.has(name + ".bias") else total

    def norm(self, x: np.ndarray, name: str, config: dict) -> np.ndarray:
        weight = self.whole(name + ".weight")
        if self.has(name + ".bias"):  # layers/normalization.py LayerNorm
            return layer_norm(x, weight, self.whole(name + ".bias"), config["norm_epsilon"])
        return rms_norm(x, weight, config["norm_epsilon"])  # RmsNorm


def attention(x: np.ndarray, model: Ranks, prefix: str, config: dict, rope, window: int | None = None) -> np.ndarray:
    tp = config["mapping"]["tp_size"]
    head_dim = config.get("head_size") or config["hidden_size"] // config["num_attention_heads"]
    heads = config["num_attention_heads"] // tp
    kv_heads = (config.get("num_key_value_heads", config["num_attention_heads"]) + tp - 1) // tp
    contexts = []
    for r, qkv in enumerate(model.column(x, prefix + "qkv")):
        tokens = len(qkv)
        # models/qwen/model.py and models/gemma/model.py: qk_layernorm (Gemma's Attention given no eps either)
        if config.get("qwen_type") in ("qwen3", "qwen3_moe") or config["architecture"] in GEMMA:
            q, k, v = qk_normalised(qkv.reshape(tokens, -1, head_dim), heads, kv_heads, model.ranks[r], prefix)
        else:
            q, k, v = np.split(qkv.reshape(tokens, -1, head_dim), [heads, heads + kv_heads], axis=1)
        if rope is not None:
            q, k = rotate(q, *rope), rotate(k, *rope)
        # GPT's config gives q_scaling; Gemma's Attention sqrt(query_pre_attn_scalar / head_size); LLaMA's
        # 1 / attention_multiplier (1.0 unless Granite's)
        q_scaling = (config["q_scaling"] if "q_scaling" in config else
                     math.sqrt(config["query_pre_attn_scalar"] / head_dim) if "query_pre_attn_scalar" in config else
                     1 / config.get("attention_multiplier", 1.0))
        k, v = np.repeat(k, heads // kv_heads, axis=1), np.repeat(v, heads // kv_heads, axis=1)  # GQA groups
        scores = np.einsum("shd,thd->hst", q, k) / (math.sqrt(head_dim) * q_scaling)
        scores += np.triu(np.full((tokens, tokens), -np.inf), 1)
        if window:  # row - W < col <= row: the context kernels' sliding mask (fmhaPackedMask.cu), as transformers'
            scores += np.tril(np.full((tokens, tokens), -np.inf), -window)
        contexts.append(np.einsum("hst,thd->shd", _softmax(scores), v).reshape(tokens, -1))
    return model.row(contexts, prefix + "dense")


def qk_normalised(qkv: np.ndarray, heads: int, kv_heads: int, tensors: dict, prefix: str):
    """layers/attention.py, qk_layernorm: RmsNorm over each head's dims. With as many query as KV heads
    on the rank, TensorRT-LLM reads the fused qkv as per-head (q, k, v) triples; otherwise as q, k, v."""
    if heads == kv_heads:
        q, k, v = (qkv.reshape(len(qkv), heads, 3, -1)[:, :, j] for j in range(3))
    else:
        q, k, v = np.split(qkv, [heads, heads + kv_heads], axis=1)
    q = rms_norm(q, tensors[prefix + "q_layernorm.weight"], ATTENTION_NORM_EPS)
    k = rms_norm(k, tensors[prefix + "k_layernorm.weight"], ATTENTION_NORM_EPS)
    return q, k, v


def rotary_tables(config: dict, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [S, 1, d/2] as functional.py RopeEmbeddingUtils.create_sinusoidal_positions_for_attention_
    plugin computes them (in float32) from rotary_base and rotary_scaling, d the rotary part of a head (rotary_pct)."""
    head = config.get("head_size") or config["hidden_size"] // config["num_attention_heads"]
    dim = int(head * config.get("rotary_pct", 1.0))
    base, scaling = config.get("rotary_base", 10000.0), config.get("rotary_scaling") or {}
    if config.get("position_embedding_type") == "long_rope":
        return long_rope_tables(config, positions, dim)
    kind = scaling.get("type", scaling.get("rope_type", "none"))
    scale = 1.0 / scaling["factor"] if kind == "linear" else 1.0
    inv_freq = scale / (base ** (np.arange(0, dim, 2) / dim)).astype(np.float32)
    if kind == "llama3":
        inv_freq = llama3_scaling(inv_freq, scaling)
    elif kind not in ("none", "linear"):
        raise ValueError(f"no reference for rotary scaling {kind!r}")
    angles = np.einsum("i,j->ij", positions.astype(np.float32), inv_freq, dtype=np.float32)[:, None, :]
    return np.cos(angles).astype(np.float64), np.sin(angles).astype(np.float64)


def long_rope_tables(config: dict, positions: np.ndarray, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """RopeEmbeddingUtils.create_sinusoidal_positions_long_rope_for_attention_plugin: inv_freq 1 / (factor *
    base^(2i/d)) in float32, cos and sin times its _calc_mscale of max_position_embeddings / original (no mscale in
    config.json: Phi3ForCausalLM gives its Attention none). Attention.forward takes the short table while the batch's
    longest sequence is within original_max_position_embeddings, the long one past it: in a context pass from an
    empty cache, the prompt's length."""
    original = config["original_max_position_embeddings"]
    scale = config["max_position_embeddings"] / original
    mscale = np.float32(1.0 if scale <= 1.0 else math.sqrt(1 + math.log(scale) / math.log(original)))
    kind = "short" if len(positions) <= original else "long"
    factors = np.asarray(config[f"longrope_scaling_{kind}_factors"], np.float32)
    inv_freq = 1 / (factors * (config["rotary_base"] ** (np.arange(0, dim, 2) / dim)).astype(np.float32))
    angles = np.einsum("i,j->ij", positions.astype(np.float32), inv_freq, dtype=np.float32)[:, None, :]
    return (np.cos(angles) * mscale).astype(np.float64), (np.sin(angles) * mscale).astype(np.float64)


def llama3_scaling(inv_freq: np.ndarray, scaling: dict) -> np.ndarray:
    """functional.py RopeEmbeddingUtils.apply_llama3_scaling."""
    factor = scaling.get("factor", 8.0)
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old = scaling.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv_freq
    smooth = (old / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = np.where(wavelen > old / low, inv_freq / factor, blended)
    return np.where(wavelen < old / high, inv_freq, scaled).astype(inv_freq.dtype)


def rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """rope_gpt_neox: dims i and i + d/2 of each head's first d (the rotary part) rotate by the same angle; the
    others pass."""
    dim = 2 * cos.shape[-1]
    first, second = np.split(x[..., :dim], 2, axis=-1)
    return np.concatenate([first * cos - second * sin, second * cos + first * sin, x[..., dim:]], axis=-1)


def mlp(x: np.ndarray, model: Ranks, prefix: str, config: dict, gpt: bool) -> np.ndarray:
    if config.get("moe", {}).get("num_experts", 0) > 1:  # MoeConfig.has_moe: the layer is a MOE (every layer)
        return moe_experts(x, model, prefix, config["moe"])
    if config["hidden_act"] == "swiglu":  # MLP: each rank's fc output halved, silu(second half) * first
        inter = [up * ACTIVATIONS["silu"](gate) for up, gate in
                 (np.split(h, 2, axis=-1) for h in model.column(x, prefix + "fc"))]
        return model.row(inter, prefix + "proj")
    act = ACTIVATIONS[config["hidden_act"]]
    if gpt:  # layers/mlp.py MLP: proj(act(fc(x)))
        inter = [act(h) for h in model.column(x, prefix + "fc")]
    else:  # GatedMLP: proj(act(fc(x)) * gate(x))
        inter = [act(f) * g for f, g in zip(model.column(x, prefix + "fc"), model.column(x, prefix + "gate"))]
    return model.row(inter, prefix + "proj")


def moe_experts(x: np.ndarray, model: Ranks, prefix: str, moe: dict) -> np.ndarray:
    """layers/moe.py MixtureOfExperts: the router (a float32 RowLinear, whole on each rank) scores every expert;
    RENORMALIZE (1) softmaxes the top_k logits, NONE (0) keeps the top_k of the softmax over all. Each rank runs
    every expert on its moe_tp slice: fc's first half of rows is the linear part, the second the gate that swiglu
    passes through silu; proj's partial sums are all-reduced, each expert's output weighted by its score."""
    logits = x @ model.whole(prefix + "router.weight").T
    chosen = np.argsort(-logits, axis=-1, kind="stable")[:, :moe["top_k"]]
    if moe["normalization_mode"] == 1:
        scores = _softmax(np.take_along_axis(logits, chosen, -1))
    elif moe["normalization_mode"] == 0:
        scores = np.take_along_axis(_softmax(logits), chosen, -1)
    else:
        raise ValueError(f"no reference for MoE normalization_mode {moe['normalization_mode']}")
    weights = np.zeros_like(logits)  # [tokens, experts]: 0 for an expert a token did not choose
    np.put_along_axis(weights, chosen, scores, -1)
    total = 0.0
    for tensors in model.ranks:
        linear, gate = np.split(np.einsum("th,eoh->teo", x, tensors[prefix + "fc.weight"]), 2, axis=-1)
        total = total + np.einsum("teo,eho,te->th", ACTIVATIONS["silu"](gate) * linear,
                                  tensors[prefix + "proj.weight"], weights)
    return total


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * weight


def layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    centred = x - x.mean(-1, keepdims=True)
    return centred / np.sqrt((centred * centred).mean(-1, keepdims=True) + eps) * weight + bias


def _gelu(x: np.ndarray) -> np.ndarray:  # functional.py gelu: the tanh approximation, for every GELU name
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


ACTIVATIONS = {"silu": lambda x: x / (1 + np.exp(-x)), "gelu": _gelu, "gelu_new": _gelu, "gelu_fast": _gelu,
               "gelu_pytorch_tanh": _gelu}
