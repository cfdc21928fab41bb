"""Llama and the families TensorRT-LLM builds as its LLaMA or QWen model (Mistral, Qwen2, Qwen3, Granite, and the
mixtures Qwen3-MoE and Mixtral): their tensors, their rope and their config.json fields."""

from __future__ import annotations

import math
from typing import Iterator

import numpy as np

from ...errors import UnsupportedModelError
from ..load import MIXTURES, Checkpoint, ModelSpec
from .families import FAMILIES
from .layout import COLUMN, EXPERT_FC, EXPERT_PROJ, QKV, REPLICATE, ROW, VOCAB, Out

# MoeConfig.ExpertScaleNormalizationMode (layers/moe.py): RENORMALIZE takes the top-k router logits and softmaxes
# them, which is softmax, top-k, then renormalization (transformers' norm_topk_prob, and Mixtral always); NONE
# softmaxes all logits and keeps the top k as they are (norm_topk_prob false). QWenConfig.from_hugging_face writes
# NONE for every Qwen3-MoE, norm_topk_prob true or not (Qwen3-30B-A3B's is true); this export writes the model's own.
NONE, RENORMALIZE = 0, 1


def rotary(ckpt: Checkpoint) -> tuple[float, dict | None]:
    """(rotary_base, rotary_scaling) for config.json. TensorRT-LLM's converters read rope_theta, defaulting
    to 10000 (models/llama/config.py; the Qwen one to 100000), and transformers 5 keeps it inside
    rope_parameters: the base is always written. The scalings TensorRT-LLM computes as transformers does
    (functional.py RopeEmbeddingUtils.create_sinusoidal_positions_for_attention_plugin) are linear and
    llama3; its "dynamic" is another method than transformers' NTK one."""
    config = ckpt.config
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    base = params.pop("rope_theta", None) or getattr(config, "rope_theta", None) or 10000.0
    kind = params.pop("rope_type", params.pop("type", "default"))
    if kind == "default" or ckpt.spec.family == "gpt2":
        return float(base), None
    if kind not in ("linear", "llama3"):
        raise UnsupportedModelError(f"{ckpt.path}: rope scaling {kind!r}; --backend tensorrt-llm exports linear and "
                                    "llama3 scaling")
    return float(base), {"type": kind, **params}


def mixture(spec: ModelSpec) -> dict:
    """A mixture's config.json fields, as LLaMAConfig (Mixtral) and QWenConfig (qwen3_moe) from_hugging_face write
    them: hidden_act swiglu, which the MOE layer needs to read mlp.fc as a gated pair (layers/moe.py init_experts),
    and the moe dict (MoeConfig.from_dict; its other fields keep their defaults, which no converter changes for
    these two). QWenDecoderLayer sizes qwen3_moe's experts by moe_intermediate_size (models/qwen/model.py on main);
    intermediate_size is given the same width, which no layer of an all-sparse model reads otherwise, so that a
    release whose QWen layer sizes them by intermediate_size builds the same shapes."""
    return {"hidden_act": "swiglu", "intermediate_size": spec.expert_intermediate_size,
            "moe": {"num_experts": spec.experts, "top_k": spec.experts_per_token,
                    "normalization_mode": RENORMALIZE if spec.norm_topk_prob else NONE},
            **({"moe_intermediate_size": spec.expert_intermediate_size, "moe_shared_expert_intermediate_size": 0}
               if FAMILIES[spec.architecture] else {})}


def granite_multipliers(spec: ModelSpec) -> dict:
    """Granite's multipliers as TensorRT-LLM's LLaMA model applies them (models/llama/model.py, 04100fd): the
    embeddings times embedding_multiplier, each block's output times residual_multiplier before its residual add,
    attention with q_scaling = 1 / attention_multiplier, which its attention turns into a scale of
    1 / (sqrt(head_size) * q_scaling) (so the scale transformers' attention_multiplier is, times sqrt(head_size)), and
    the logits times output_multiplier_scale (models/modeling_utils.py DecoderModelForCausalLM). LLaMAConfig.
    from_hugging_face makes the same conversion, except that it leaves an attention_multiplier of exactly 1.0 unscaled
    (head_size^-0.5 instead of transformers' 1.0); written here, the checkpoint says the model's own scale. The
    residual multiplier is skipped where trtllm-build fuses the residual add into the all-reduce (--reduce_fusion
    enable, which build.sh leaves off)."""
    return {"embedding_multiplier": spec.embedding_multiplier, "residual_multiplier": spec.residual_multiplier,
            "attention_multiplier": spec.attention_scale * math.sqrt(spec.shape.head_dim),
            "output_multiplier_scale": 1.0 / spec.logits_scaling}


def llama_config(ckpt: Checkpoint, config: dict) -> dict:
    """LLaMAConfig (models/llama/config.py), or QWenConfig (models/qwen/config.py) for the families FAMILIES gives a
    qwen_type: the rope (rotary), a mixture's fields (mixture) and Granite's multipliers (granite_multipliers)."""
    spec = ckpt.spec
    base, scaling = rotary(ckpt)
    config = {**config, "hidden_act": spec.hidden_act, "position_embedding_type": "rope_gpt_neox",
              "rotary_base": base, "rotary_scaling": scaling, "mlp_bias": spec.mlp_bias,
              "tie_word_embeddings": spec.tie_word_embeddings}  # lm_head.weight is written regardless
    if spec.experts:
        config.update(mixture(spec))
    qwen_type = FAMILIES[spec.architecture]
    if qwen_type:  # models/qwen/config.py QWenConfig: qwen_type is required, qwen3 has no attention bias
        return {**config, "qwen_type": qwen_type, "attn_bias": qwen_type == "qwen2", "use_logn_attn": False,
                "seq_length": 8192}
    # models/llama/config.py LLaMAConfig
    multipliers = granite_multipliers(spec) if spec.architecture == "GraniteForCausalLM" else {}
    return {**config, "attn_bias": spec.attention_bias, **multipliers}


def llama_tensors(ckpt: Checkpoint, names: set[str]) -> Iterator[Out]:
    """Llama, Mistral, Qwen2, Qwen3, Granite, Qwen3-MoE, Mixtral (models/llama/convert.py
    get_prefix_and_param_name_map, models/qwen/convert.py). TensorRT-LLM's GatedMLP computes
    proj(act(fc(x)) * gate(x)) (layers/mlp.py), so mlp.fc holds gate_proj and mlp.gate holds up_proj; a mixture's
    layers hold experts instead (expert_tensors). Each source tensor is read when its Out is asked for."""
    read, spec = ckpt.tensor, ckpt.spec
    qwen3 = spec.architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
    qkv_bias = FAMILIES[spec.architecture] == "qwen2" or (spec.attention_bias and not qwen3)
    dense_bias = spec.attention_bias and not FAMILIES[spec.architecture]  # the QWen model has none
    yield Out("transformer.vocab_embedding.weight", REPLICATE, read("model.embed_tokens.weight"))
    for i in range(spec.shape.num_layers):
        hf, trt = f"model.layers.{i}.", f"transformer.layers.{i}."
        yield Out(trt + "input_layernorm.weight", REPLICATE, read(hf + "input_layernorm.weight"))
        yield Out(trt + "attention.qkv.weight", QKV, tuple(read(f"{hf}self_attn.{p}_proj.weight") for p in "qkv"))
        if qkv_bias:
            yield Out(trt + "attention.qkv.bias", QKV, tuple(read(f"{hf}self_attn.{p}_proj.bias") for p in "qkv"))
        yield Out(trt + "attention.dense.weight", ROW, read(hf + "self_attn.o_proj.weight"))
        if dense_bias:
            yield Out(trt + "attention.dense.bias", REPLICATE, read(hf + "self_attn.o_proj.bias"))
        if qwen3:
            yield Out(trt + "attention.q_layernorm.weight", REPLICATE, read(hf + "self_attn.q_norm.weight"))
            yield Out(trt + "attention.k_layernorm.weight", REPLICATE, read(hf + "self_attn.k_norm.weight"))
        yield Out(trt + "post_layernorm.weight", REPLICATE, read(hf + "post_attention_layernorm.weight"))
        if spec.experts:
            yield from expert_tensors(ckpt, hf, trt)
            continue
        for part, source in (("fc", "gate_proj"), ("gate", "up_proj")):
            yield Out(f"{trt}mlp.{part}.weight", COLUMN, read(f"{hf}mlp.{source}.weight"))
            if spec.mlp_bias:
                yield Out(f"{trt}mlp.{part}.bias", COLUMN, read(f"{hf}mlp.{source}.bias"))
        yield Out(trt + "mlp.proj.weight", ROW, read(hf + "mlp.down_proj.weight"))
        if spec.mlp_bias:
            yield Out(trt + "mlp.proj.bias", REPLICATE, read(hf + "mlp.down_proj.bias"))
    yield Out("transformer.ln_f.weight", REPLICATE, read("model.norm.weight"))
    # Tied embeddings: transformers saves no lm_head.weight; TensorRT-LLM is given one all the same.
    yield Out("lm_head.weight", VOCAB, read("lm_head.weight" if "lm_head.weight" in names else "model.embed_tokens.weight"))


def expert_tensors(ckpt: Checkpoint, hf: str, trt: str) -> Iterator[Out]:
    """One layer's mixture as the converters write it (models/llama/convert.py for Mixtral, models/qwen/convert.py
    for qwen3_moe, alike): mlp.router.weight [experts, hidden] in float32; mlp.fc.weight [experts, 2 x inter, hidden],
    each expert's up (w3) rows then its gate (w1) rows (torch.concat([w3, w1], dim=-2): the MOE layer's swiglu
    applies silu to the second half, layers/moe.py init_experts); mlp.proj.weight [experts, hidden, inter] (w2)."""
    module, gate, up, down = MIXTURES[ckpt.spec.architecture]
    experts = range(ckpt.spec.experts)

    def stacked(projection: str) -> np.ndarray:
        return np.stack([ckpt.tensor(f"{hf}{module}.experts.{e}.{projection}.weight") for e in experts])

    yield Out(trt + "mlp.router.weight", REPLICATE, ckpt.tensor(f"{hf}{module}.gate.weight"), np.float32)
    yield Out(trt + "mlp.fc.weight", EXPERT_FC, (stacked(up), stacked(gate)))
    yield Out(trt + "mlp.proj.weight", EXPERT_PROJ, stacked(down))
