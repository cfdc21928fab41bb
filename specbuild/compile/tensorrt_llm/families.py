"""Which families TensorRT-LLM's checkpoint flow takes, which it does not and why, and which plans serve each
family's source folders: the tables support.py checks a pair against, and llama.py (QWen's qwen_type) and plans.py
(the PyTorch backend's release) write by."""

from __future__ import annotations

# Families the ONNX path builds that this export does not, and why.
NOT_EXPORTED = {
    # Read at NVIDIA/TensorRT-LLM eea41b73 (common/attentionOp.cpp), 5b82ec07 (xqaParams.h), 89fd9b74
    # (decoderXQAImplJIT.cpp), c8b9bfc7 (xqaDispatcher.cpp); the kernels that do take the cap apply it as
    # transformers does (docs/tensorrt-llm.md, Gemma 2), so the refusal is XQA's alone.
    "Gemma2ForCausalLM": "TensorRT-LLM's decoding steps run XQA kernels whenever its run-time heuristic expects a "
                         "gain (AttentionOp::enqueueGeneration, XqaDispatcher::shouldUse), and XQA takes no "
                         "attention soft-cap (XQAParams has none), so Gemma 2's attn_logit_softcapping would be "
                         "dropped from some steps and kept in others",
    "Olmo2ForCausalLM": "TensorRT-LLM's checkpoint flow has no OLMo 2 model (no Olmo2ForCausalLM in "
                        "tensorrt_llm/models/__init__.py MODEL_MAP), and its LLaMA model has no post-norm layers "
                        "or whole-q/k norms to build one from",
    "Olmo3ForCausalLM": "TensorRT-LLM's checkpoint flow has no OLMo 3 model (no Olmo3ForCausalLM in "
                        "tensorrt_llm/models/__init__.py MODEL_MAP), and its LLaMA model has no post-norm layers, "
                        "whole-q/k norms or rope parameters per layer type to build one from",
}
# The plans that read the source Hugging Face folders (no TensorRT-LLM checkpoint), and the families each serves,
# exported or not (docs/tensorrt-llm.md's table). LLM_API: TensorRT-LLM's PyTorch backend builds only the
# architectures that register a model (tensorrt_llm/_torch/models/_arch_index.py MODEL_ARCH_TO_MODULE at 065ff9e9;
# AutoModelForCausalLM raises "Unknown architecture" for any other, modeling_auto.py): no Gemma 2, Granite, OLMo 2,
# OLMo 3 or GPT-2 (docs/source/models/supported-models.md at 00b6d5a2 lists Granite and OLMo 3 for its AutoDeploy
# backend alone); it has Qwen3-MoE (modeling_qwen3_moe) and Mixtral (modeling_mixtral), listed in 00b6d5a2's
# supported-models.md without the AutoDeploy note. VLLM: vLLM's registry has all thirteen
# (vllm/model_executor/models/registry.py at 0002bff0; OLMo 3 as its OLMo 2 model), and its draft_model method refuses
# no architecture of them (vllm/config/speculative.py SpeculativeConfig: equal vocabulary sizes, no multimodal or M-RoPE
# model; vllm_script says where it would refuse).
LLM_API, VLLM = "llm_api", "vllm"
SOURCE_PLANS = {
    "LlamaForCausalLM": (LLM_API, VLLM), "MistralForCausalLM": (LLM_API, VLLM), "Qwen2ForCausalLM": (LLM_API, VLLM),
    "Qwen3ForCausalLM": (LLM_API, VLLM), "Phi3ForCausalLM": (LLM_API, VLLM), "Gemma3ForCausalLM": (LLM_API, VLLM),
    "GraniteForCausalLM": (VLLM,), "GPT2LMHeadModel": (VLLM,), "Gemma2ForCausalLM": (VLLM,),
    "Olmo2ForCausalLM": (VLLM,), "Olmo3ForCausalLM": (VLLM,), "Qwen3MoeForCausalLM": (LLM_API, VLLM),
    "MixtralForCausalLM": (LLM_API, VLLM),
}
# Families the plans' TensorRT-LLM 1.0 lacks on the PyTorch backend: Phi3ForCausalLM is not in 1.0.0's model list
# (the docs site's 1.0.0/models/supported-models.html), and is in the later ones.
NEWER_PYTORCH_BACKEND = {"Phi3ForCausalLM": "Phi-3"}
# HF architecture -> the qwen_type TensorRT-LLM's QWen model needs (models/qwen/config.py), or None. MODEL_MAP
# builds GraniteForCausalLM as its LLaMA model, which reads Granite's multipliers from config.json
# (granite_multipliers), MixtralForCausalLM as its LLaMA model too, and Qwen3MoeForCausalLM as its QWen model.
FAMILIES = {"LlamaForCausalLM": None, "MistralForCausalLM": None, "Qwen2ForCausalLM": "qwen2",
            "Qwen3ForCausalLM": "qwen3", "GraniteForCausalLM": None, "GPT2LMHeadModel": None,
            "Gemma3ForCausalLM": None, "Qwen3MoeForCausalLM": "qwen3_moe", "MixtralForCausalLM": None,
            "Phi3ForCausalLM": None}
# A Qwen3-MoE whose mlp_only_layers or decoder_sparse_step leave some layers dense: QWenConfig keeps both fields
# (models/qwen/config.py on main, 2026), but QWenDecoderLayer builds a MOE in every layer once config.moe has
# experts and reads neither (models/qwen/model.py), so the checkpoint flow has no dense layer to put them in.
DENSE_AMONG_SPARSE = ("TensorRT-LLM's QWen model makes every layer's MLP a mixture of experts (QWenDecoderLayer reads "
                      "no mlp_only_layers or decoder_sparse_step), and this checkpoint has dense layers among them")

# The families written with q/k norms (TensorRT-LLM's qk_layernorm) -> the converter whose layout this export writes.
QK_NORM_CONVERTERS = {"Qwen3ForCausalLM": "Qwen", "Qwen3MoeForCausalLM": "Qwen", "Gemma3ForCausalLM": "Gemma"}
