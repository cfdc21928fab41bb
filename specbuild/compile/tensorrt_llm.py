"""The TensorRT-LLM stage (--backend tensorrt-llm|all): the pair as TensorRT-LLM checkpoints, tensor-parallel
ranks and all, and the plans that build, run and serve it with TensorRT-LLM, and with vLLM.

TensorRT-LLM cannot be installed here, so nothing here imports it. What is written follows its sources
(NVIDIA/TensorRT-LLM on GitHub; the files are named where each rule comes from), and
tensorrt_llm_reference.py reads a written checkpoint back the way TensorRT-LLM's layers compute, which
the tests check against transformers.

The unified checkpoint (tensorrt_llm/models/modeling_utils.py: PretrainedConfig, PretrainedModel.
from_checkpoint; docs/source/architecture/checkpoint.md) is a folder with config.json and one
rank{r}.safetensors per tensor-parallel rank; linear weights are [out_features, in_features] of the rank.
Tensor parallelism splits as the converters do (models/llama/convert.py, models/qwen/convert.py,
models/gpt/convert.py, all with models/convert_utils.py's split = torch.chunk):
  - column-parallel layers (attention.qkv, mlp.fc, mlp.gate, lm_head) split their output rows; the fused
    attention.qkv of rank r is the concatenation of that rank's q, k and v rows, and when there are fewer
    KV heads than ranks each KV head is first repeated tp/kv times (convert_utils.dup_kv_weight);
  - row-parallel layers (attention.dense, mlp.proj) split their input columns; each rank's partial sum is
    all-reduced and the bias, kept whole on every rank, added once after (layers/linear.py RowLinear);
  - norms and the embedding table are whole on every rank (use_parallel_embedding false); lm_head is
    zero-padded to a multiple of tp rows (_utils.pad_vocab_size) and split, its outputs gathered;
  - a mixture of experts (Qwen3-MoE, Mixtral) splits as mapping's default moe_tp_size = tp, moe_ep_size = 1 does
    (mapping.py MappingBase): every rank holds every expert, each expert's MLP split as a dense one is
    (moe_tp: the converters' split of w1/w3 on dim 1 and w2 on dim 2), and the float32 router is whole on each.
A draft with fewer rows than the target's vocabulary gets the missing ones (vocab_size is the target's, so
that both engines' logits line up). TensorRT-LLM samples over all vocab_size columns and masks only the tp
padding past it (kernels/decodingCommon.cu addBiasSoftMax), so a missing lm_head row is the mean of the
draft's rows, not zero: its logit is then the mean of the draft's logits, below their maximum (never a greedy
draft) and by Jensen worth at most 1/V of the probability, where a zero row scores 0 and outranks every real
token of a draft whose logits are all negative, making each greedy draft a padding id.
"""

from __future__ import annotations

import json
import math
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import ml_dtypes
import numpy as np

from specbuild_runtime.manifest import TOKENIZER_DIR, EngineInfo, TensorRTLLMPart

from ..errors import ExternalToolError, UnsupportedModelError
from ..progress import bar
from . import gamma as gamma_stage
from .load import MIXTURES, Checkpoint, ModelSpec, longrope_length, rotary_module
from .precision import Numerics, convert_into

FOLDER = "tensorrt-llm"
VLLM_PLAN = "vllm/serve.sh"
DTYPES = {"fp32": ("float32", np.float32), "fp16": ("float16", np.float16), "bf16": ("bfloat16", ml_dtypes.bfloat16)}
# Weight-only quantization is left to trtllm-build: with quant_algo set, PretrainedModel.from_checkpoint's
# preprocess_weights quantizes every float weight whose name has one of these parts per output channel
# (models/convert_utils.py weight_only_quantize_dict); lm_head and the embeddings stay in the float type. A mixture's
# mlp.fc and mlp.proj [experts, out, in] are quantized per expert and output channel (weight_only_quantize
# transposes the last two axes of a 3-D weight, the per_channel_scale [experts, out] layers/moe.py MOEWeightWrapper
# loads); its mlp.router matches none of these, and stays float32 as the converters write it ("Router should never be
# quantized", models/llama/convert.py).
QUANT_ALGOS = {"none": None, "int8": "W8A16", "int4": "W4A16"}
QUANTIZED_WEIGHTS = ("qkv.weight", "dense.weight", "fc.weight", "proj.weight", "gate.weight")
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
# MoeConfig.ExpertScaleNormalizationMode (layers/moe.py): RENORMALIZE takes the top-k router logits and softmaxes
# them, which is softmax, top-k, then renormalization (transformers' norm_topk_prob, and Mixtral always); NONE
# softmaxes all logits and keeps the top k as they are (norm_topk_prob false). QWenConfig.from_hugging_face writes
# NONE for every Qwen3-MoE, norm_topk_prob true or not (Qwen3-30B-A3B's is true); this export writes the model's own.
NONE, RENORMALIZE = 0, 1

# The tokens one engine step takes unless told otherwise: trtllm-build's --max_num_tokens (builder.py BuildConfig,
# 008b2b8d) and the LLM API's max_num_tokens (llmapi/llm_args.py BaseLlmArgs, 00043967). A longer prompt goes in
# chunks: trtllm-build leaves max_num_tokens below max_input_len when context FMHA is on, as
# --use_paged_context_fmha has it (_common.py check_max_num_tokens, 0fccc5b9), and the LLM API refuses a prompt
# past max_num_tokens unless chunked prefill is on (llmapi/llm.py _check_arguments).
MAX_NUM_TOKENS = 8192

# The families written with q/k norms (TensorRT-LLM's qk_layernorm) -> the converter whose layout this export writes.
QK_NORM_CONVERTERS = {"Qwen3ForCausalLM": "Qwen", "Qwen3MoeForCausalLM": "Qwen", "Gemma3ForCausalLM": "Gemma"}

REPLICATE, COLUMN, ROW, QKV, VOCAB, EMBEDDING = "replicate", "column", "row", "qkv", "vocab", "embedding"
EXPERT_FC, EXPERT_PROJ = "expert_fc", "expert_proj"  # a mixture's [experts, out, in] weights, split per expert
GATED_FC = "gated_fc"  # Phi-3's mlp.fc, [up; gate] on each rank (phi3_tensors)


@dataclass(frozen=True)
class Layout:
    """What splitting one model over tp ranks needs to know."""

    tp: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int  # rows of the exported tables: the target's vocabulary, for the draft as well
    tokens: int | None = None  # a draft's: lm_head rows past the tokenizer's ids (padding) score the mean logit
    experts: int = 0  # a mixture's; intermediate is then each expert's width

    @property
    def padded_vocab(self) -> int:
        return math.ceil(self.vocab / self.tp) * self.tp

    def ranks(self) -> list[dict]:
        """Which source rows each rank holds (the manifest's record of the mapping)."""
        tp, heads, kv = self.tp, self.heads // self.tp, max(self.kv_heads // self.tp, 1)
        ffn, vocab = self.intermediate // tp, self.padded_vocab // tp
        repeat = max(tp // self.kv_heads, 1)  # ranks sharing one (duplicated) KV head
        return [{
            "file": f"rank{r}.safetensors",
            "attention_heads": [r * heads, (r + 1) * heads],
            "kv_heads": [(r * kv + j) // repeat for j in range(kv)],
            "ffn_columns": [r * ffn, (r + 1) * ffn],  # of each expert, in a mixture
            "lm_head_rows": [r * vocab, (r + 1) * vocab],
            **({"experts": [0, self.experts]} if self.experts else {}),
        } for r in range(tp)]


@dataclass
class Out:
    """One tensor of every rank file: its name, how it splits and its source value (q, k, v for QKV; up, gate for
    EXPERT_FC and GATED_FC); dtype: its own float type, where not the export's."""

    name: str
    split: str
    value: np.ndarray | tuple[np.ndarray, ...]
    dtype: type | None = None


def check_exportable(ckpt: Checkpoint, role: str, tp: int, max_seq_len: int) -> None:
    """Refuse before anything is written, for a family the checkpoint flow takes (exports; the others get only the
    serving plans, check_pair): a split TensorRT-LLM cannot make, or attention it would compute differently."""
    architecture = ckpt.spec.architecture
    check_split(ckpt, role, tp, "TensorRT-LLM")
    heads, kv = ckpt.spec.shape.num_heads, ckpt.spec.shape.num_kv_heads
    if architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM") and ckpt.spec.attention_bias:
        raise UnsupportedModelError(f"{role} checkpoint {ckpt.path}: a Qwen3 with attention biases; TensorRT-LLM's "
                                    "QWen model builds Qwen3 without them (models/qwen/config.py)")
    converter = QK_NORM_CONVERTERS.get(architecture)
    if converter and heads // tp == max(kv // tp, 1) > 1:
        # layers/attention.py, Attention.forward with qk_layernorm: when a rank has as many query as
        # KV heads it reads the fused qkv as per-head (q, k, v) triples, the interleaved layout of
        # models whose converters write it so; the QWen and Gemma converters write [q; k; v] as for GQA.
        raise UnsupportedModelError(f"--tp {tp}: the {role} ({ckpt.path}) would have {heads // tp} query and key/value "
                                    "heads per rank, where TensorRT-LLM's q/k-normalised attention reads the fused "
                                    f"qkv in another layout than its {converter} converter writes; choose a --tp that "
                                    "leaves fewer key/value than query heads per rank")
    # functional.py ACT2FN: every GELU is the tanh approximation; the gated families' converters pass silu.
    activations = ("gelu_new", "gelu_pytorch_tanh") if ckpt.spec.family in ("gpt2", "gemma") else ("silu",)
    if ckpt.spec.hidden_act not in activations:
        raise UnsupportedModelError(f"{role} checkpoint {ckpt.path}: activation {ckpt.spec.hidden_act!r}; --backend "
                                    f"tensorrt-llm exports {architecture} with {' or '.join(activations)}")
    if architecture == "Gemma3ForCausalLM":
        return  # its windows reach run.sh (attention_windows); its rope is unscaled (gemma3_unexported)
    window = sliding_window(ckpt)
    if window and window < max_seq_len:
        raise UnsupportedModelError(f"max_seq_len {max_seq_len} exceeds the {role}'s sliding window ({window}), which "
                                    "the TensorRT-LLM export does not carry over; give --max-seq-len (or a recipe's "
                                    f"max_seq_len) of {window} or less for the TensorRT-LLM export")
    if architecture == "Phi3ForCausalLM":
        phi3_check_context(ckpt, role, max_seq_len)  # its rope: phi3_unexported
    else:
        rotary(ckpt)  # refuses a rope scaling TensorRT-LLM would compute differently


def check_split(ckpt: Checkpoint, role: str, tp: int, who: str) -> None:
    """Refuse a --tp that does not divide the heads or the MLP: TensorRT-LLM's converters split them so
    (convert_utils.dup_kv_weight / split), and vLLM's and the PyTorch backend's parallel layers as well."""
    spec, shape = ckpt.spec, ckpt.spec.shape
    heads, kv = shape.num_heads, shape.num_kv_heads
    # each expert's MLP, and a dense layer's where any layer is dense (a Qwen3-MoE's mlp_only_layers)
    widths = {ffn_width(spec)} | ({spec.intermediate_size} if len(spec.sparse_layers) < shape.num_layers else set())
    problem = None
    if heads % tp:
        problem = f"{heads} attention heads"
    elif (kv < tp and tp % kv) or (kv >= tp and kv % tp):
        problem = f"{kv} key/value heads (TensorRT-LLM repeats them only when they divide tp)"
    elif ffn := next((width for width in sorted(widths) if width % tp), None):
        problem = f"an MLP of {ffn} columns" + (" per expert" if ffn == ffn_width(spec) and spec.experts else "")
    if problem:
        raise UnsupportedModelError(f"--tp {tp}: the {role} ({ckpt.path}) has {problem}, which {who} cannot "
                                    f"split over {tp} ranks; choose a --tp that divides it")


def ffn_width(spec: ModelSpec) -> int:
    """The MLP columns tensor parallelism splits: each expert's, in a mixture (the plans' backends split the same)."""
    return spec.expert_intermediate_size if spec.experts else spec.intermediate_size


def unexported(ckpt: Checkpoint) -> str:
    """Why the checkpoint flow does not take ckpt ("" where it does): its family, a mixture's dense layers, or a
    Gemma 3's config."""
    spec = ckpt.spec
    if spec.architecture not in FAMILIES:
        return NOT_EXPORTED[spec.architecture]
    if spec.experts and len(spec.sparse_layers) < spec.shape.num_layers:
        return DENSE_AMONG_SPARSE
    return (gemma3_unexported(ckpt) if spec.architecture == "Gemma3ForCausalLM" else
            phi3_unexported(ckpt) if spec.architecture == "Phi3ForCausalLM" else "")


def exports(target: Checkpoint, draft: Checkpoint) -> bool:
    """Whether the pair gets TensorRT-LLM checkpoints (both exported); otherwise only the plans that serve its
    source folders (source_plans)."""
    return not any(unexported(ckpt) for ckpt in (target, draft))


def source_plans(target: Checkpoint, draft: Checkpoint) -> list[str]:
    """The plans that serve the pair from its source folders: those whose backend serves both families."""
    return [plan for plan in (LLM_API, VLLM)
            if all(plan in SOURCE_PLANS.get(ckpt.spec.architecture, ()) for ckpt in (target, draft))]


def not_exported(target: Checkpoint, draft: Checkpoint) -> tuple[str, Checkpoint, str]:
    """The role and checkpoint of the first of the pair the checkpoint flow does not take (exports is False), and
    why."""
    return next((role, ckpt, why) for role, ckpt in (("target", target), ("draft", draft))
                if (why := unexported(ckpt)))


def sliding_window(ckpt: Checkpoint) -> int | None:
    """The shortest window of ckpt's layers (None: none), the longest context the export takes: TensorRT-LLM takes
    sliding windows at run time (max_attention_window_size), not from the checkpoint."""
    return min((w for w in ckpt.spec.sliding_windows if w), default=None)


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


def check_pair(target: Checkpoint, draft: Checkpoint, max_seq_len: int, tp: int, quantized: bool = False) -> None:
    """Refuse what cannot be exported before any engine is built (a quantized fp32 export, which the settings
    alone make, CompileSettings refuses). A family the checkpoint flow lacks still gets the plans that serve
    its source folders; refused only where no backend serves the pair, or where quantized (--quantize asked
    of the TensorRT-LLM checkpoints alone, --backend tensorrt-llm) would quantize nothing."""
    if exports(target, draft):
        for role, ckpt in (("target", target), ("draft", draft)):
            check_exportable(ckpt, role, tp, max_seq_len)
        attention_windows(target, draft, max_seq_len)  # refuses windows one run.py list cannot give both
        return
    role, ckpt, why = not_exported(target, draft)
    if not source_plans(target, draft):
        architecture = ckpt.spec.architecture
        raise UnsupportedModelError(f"{role} checkpoint {ckpt.path} is a {architecture}, which --backend tensorrt-llm "
                                    f"does not export: {why}; and neither TensorRT-LLM's "
                                    "PyTorch backend nor vLLM serves both of the pair's families; use --backend onnx")
    if quantized:  # the serving plans read the source folders' float weights
        raise UnsupportedModelError(f"--quantize: --backend tensorrt-llm writes no TensorRT-LLM checkpoints to "
                                    f"quantize for the {role} ({ckpt.path}; {why}), only plans that serve the source "
                                    "folders' float weights; leave --quantize out, or use --backend all to quantize "
                                    "the ONNX engines")
    for role, ckpt in (("target", target), ("draft", draft)):
        check_split(ckpt, role, tp, "vLLM or TensorRT-LLM's PyTorch backend")


def export_pair(target: Checkpoint, draft: Checkpoint, folder: Path, scratch: Path, engines: dict[str, EngineInfo],
                max_seq_len: int, tp: int, numerics: dict[str, Numerics], max_gamma: int,
                eos: list[int]) -> TensorRTLLMPart:
    """Writes tensorrt-llm/{target,draft}/ and the plans into the bundle being built (check_pair has passed),
    and runs trtllm-build when it is on PATH; for a pair the checkpoint flow does not take (exports), the plans
    that serve its source folders alone, each role's checkpoints entry then saying why (no "dir"). engines: the
    ONNX engines built beside (they measure γ), or none; eos: the bundle's eos ids (load.eos_token_ids), where
    γ's agreement ends and run.sh's output does."""
    vocab, precision = target.spec.shape.vocab_size, numerics["target"].precision
    checkpoints = {}
    exported = exports(target, draft)
    for role, ckpt in (("target", target), ("draft", draft)):
        architecture = ckpt.spec.architecture
        checkpoints[role] = write_checkpoint(ckpt, folder / FOLDER / role, scratch, tp, vocab, precision,
                                             numerics[role].quantization,
                                             target.token_ids() if role == "draft" else None) if exported else {
            "architecture": architecture, "not_exported": unexported(ckpt)}
        # the ONNX engine hashed the same source already
        checkpoints[role]["source"] = engines[role].source if role in engines else source(ckpt)
    # c: the bytes a step reads, as trtllm-build will quantize them, or as the source folders are served
    byte_ratio = (checkpoints["draft"]["weight_bytes"] / checkpoints["target"]["weight_bytes"] if exported else
                  step_parameters(draft) / step_parameters(target))
    recommended = measure_gamma(folder, engines, target, draft, byte_ratio, max_seq_len, max_gamma, eos)
    quantized = " and ".join(f"the {role} {numerics[role].quantization}" for role in ("target", "draft")
                          if numerics[role].quantization != "none")
    kinds = [*(("build", "run") if exported else ()), *source_plans(target, draft)]
    plans = write_plans(folder, recommended["gamma"], tp, max_seq_len, precision, target, draft, eos, quantized,
                        measured=recommended["alpha"] is not None, kinds=kinds)
    built = run_build(folder / plans["build"]) if "build" in plans and shutil.which("trtllm-build") else None
    return TensorRTLLMPart(tp_size=tp, checkpoints=checkpoints, plans=plans, gamma=recommended, engines=built)


def step_parameters(ckpt: Checkpoint) -> int:
    """The parameters a decoding step reads: all but the embedding tables it gathers a row from (GPT-2's
    positions, and an untied token table; a tied one is read whole as the head)."""
    gathered = ("wpe.weight",) if ckpt.spec.tie_word_embeddings else ("embed_tokens.weight", "wte.weight", "wpe.weight")
    return sum(int(np.prod(ckpt.entries[name].shape)) for name in ckpt.weights() if not name.endswith(gathered))


def write_checkpoint(ckpt: Checkpoint, out: Path, scratch: Path, tp: int, vocab: int, precision: str,
                     quantization: str, tokens: int | None = None) -> dict:
    """config.json and rank{r}.safetensors in `out`, reading the source one tensor at a time. tokens: a
    draft's, the tokenizer's ids (Layout.tokens)."""
    spec, shape = ckpt.spec, ckpt.spec.shape
    layout = Layout(tp, shape.num_heads, shape.num_kv_heads, shape.head_dim, ffn_width(spec), vocab, tokens,
                    spec.experts)
    dtype_name, dtype = DTYPES[precision]
    config = trtllm_config(ckpt, layout, dtype_name, QUANT_ALGOS[quantization])
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    files = [RankFile(out / f"rank{r}.safetensors", scratch / f"{out.name}-rank{r}.data") for r in range(tp)]
    names = set(ckpt.tensor_names())
    step_bytes = 0.0
    # Bytes without a total (a tied head is written twice, the vocabulary padded): at 7B, minutes of a stage
    # whose bar would otherwise stand still.
    with bar(None, f"writing TensorRT-LLM {out.name} ({dtype_name})", "B", unit_scale=True) as progress:
        tensors = (gemma3_tensors if spec.architecture == "Gemma3ForCausalLM" else
                   phi3_tensors if spec.architecture == "Phi3ForCausalLM" else
                   gpt2_tensors if spec.family == "gpt2" else llama_tensors)
        for tensor in tensors(ckpt, names):
            quantized = QUANT_ALGOS[quantization] and tensor.name.endswith(QUANTIZED_WEIGHTS)
            # c's denominator, the target decoding alone, is a one-token step, which reads its top-k experts' weights
            # alone (the MoE plugin computes no other). gamma's S(γ) takes a verification call of γ+1 rows to cost
            # one such step, though it reads every expert any row chose, up to min(experts, (γ+1)·top_k): for a
            # mixture target its γ and expected speedup are optimistic (figures in docs/tensorrt-llm.md).
            read = spec.experts_per_token / spec.experts if tensor.split in (EXPERT_FC, EXPERT_PROJ) else 1
            for file, part in zip(files, shard(tensor, layout, tensor.dtype or dtype)):
                file.add(tensor.name, part)
                progress.update(part.nbytes)
                if not tensor.name.endswith("embedding.weight"):  # a step reads one row of these
                    step_bytes += part.size * read * (
                        {"int8": 1, "int4": 0.5}[quantization] if quantized else part.itemsize)
        for file in files:
            file.close()
    return {
        "dir": f"{FOLDER}/{out.name}",
        "architecture": config["architecture"],
        "dtype": dtype_name,
        "quant_algo": config["quantization"]["quant_algo"],
        "vocab_size": vocab,
        "source_vocab_size": shape.vocab_size,
        "lm_head_rows": layout.padded_vocab,
        # as transformers counts them, as the ONNX engines' summary does: a tied head once, though written out
        # as lm_head.weight (as TensorRT-LLM's own converters write it, models/llama/convert.py)
        "parameters": ckpt.parameters(),
        # what a decoding step reads over all ranks once trtllm-build has quantized: the cost ratio
        # the plans use when no engine was timed
        "weight_bytes": int(step_bytes),
        "ranks": [{**rank, "file": f"{FOLDER}/{out.name}/{rank['file']}"} for rank in layout.ranks()],
    }


def source(ckpt: Checkpoint) -> dict:
    return {"path": str(ckpt.path.resolve()), "sha256": ckpt.digest()}


def trtllm_config(ckpt: Checkpoint, layout: Layout, dtype: str, quant_algo: str | None) -> dict:
    spec, shape = ckpt.spec, ckpt.spec.shape
    config = {
        "architecture": spec.architecture,  # models/__init__.py MODEL_MAP keys on the HF name
        "dtype": dtype,
        "logits_dtype": "float32",
        "vocab_size": layout.vocab,
        "hidden_size": shape.hidden_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_size": shape.head_dim,
        "intermediate_size": spec.intermediate_size,
        "norm_epsilon": spec.norm_eps,
        "max_position_embeddings": spec.max_position_embeddings,
        "mapping": {"world_size": layout.tp, "tp_size": layout.tp, "pp_size": 1,
                    **({"moe_tp_size": layout.tp, "moe_ep_size": 1} if spec.experts else {})},
        "quantization": {"quant_algo": quant_algo, "kv_cache_quant_algo": None},
        "use_parallel_embedding": False,
        "embedding_sharding_dim": 0,
    }
    if spec.family == "gpt2":  # models/gpt/config.py GPTConfig.from_hugging_face
        return {**config, "gpt_variant": "gpt2", "hidden_act": "gelu_new", "position_embedding_type": "learned_absolute",
                "bias": True, "q_scaling": 1.0, "apply_query_key_layer_scaling": False, "rotary_pct": 1.0,
                "qk_layernorm": False, "inner_layernorm": False, "norm_before_bmm1": False}
    if spec.architecture == "Gemma3ForCausalLM":
        return gemma3_config(ckpt, config)
    if spec.architecture == "Phi3ForCausalLM":
        return phi3_config(ckpt, config)
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


def gpt2_tensors(ckpt: Checkpoint, names: set[str]) -> Iterator[Out]:
    """GPT-2 (models/gpt/convert.py load_weights_from_hf_model, gpt_variant gpt2): HF's Conv1D weights are
    [in, out] and are transposed; c_attn holds q, k and v side by side (split_qkv)."""
    read = ckpt.tensor
    yield Out("transformer.vocab_embedding.weight", REPLICATE, read("transformer.wte.weight"))
    yield Out("transformer.position_embedding.weight", REPLICATE, read("transformer.wpe.weight"))
    for i in range(ckpt.spec.shape.num_layers):
        hf, trt = f"transformer.h.{i}.", f"transformer.layers.{i}."
        for kind in ("weight", "bias"):
            row = ROW if kind == "weight" else REPLICATE  # a row-parallel bias is added once, after the sum
            yield Out(f"{trt}input_layernorm.{kind}", REPLICATE, read(f"{hf}ln_1.{kind}"))
            yield Out(f"{trt}attention.qkv.{kind}", QKV, tuple(np.split(read(f"{hf}attn.c_attn.{kind}").T, 3)))
            yield Out(f"{trt}attention.dense.{kind}", row, read(f"{hf}attn.c_proj.{kind}").T)
            yield Out(f"{trt}post_layernorm.{kind}", REPLICATE, read(f"{hf}ln_2.{kind}"))
            yield Out(f"{trt}mlp.fc.{kind}", COLUMN, read(f"{hf}mlp.c_fc.{kind}").T)
            yield Out(f"{trt}mlp.proj.{kind}", row, read(f"{hf}mlp.c_proj.{kind}").T)
    yield Out("transformer.ln_f.weight", REPLICATE, read("transformer.ln_f.weight"))
    yield Out("transformer.ln_f.bias", REPLICATE, read("transformer.ln_f.bias"))
    yield Out("lm_head.weight", VOCAB, read("lm_head.weight" if "lm_head.weight" in names else "transformer.wte.weight"))


# Gemma 3 (text) as TensorRT-LLM's Gemma model builds it (tensorrt_llm/models/gemma/model.py, config.py and
# convert.py; tensorrt_llm/layers/attention.py, as stored from NVIDIA/TensorRT-LLM's main with Gemma 3 in MODEL_MAP,
# models/__init__.py at 02267d3d): GemmaConfig's Gemma3ConfigGroup fields in config.json, the layer i attending
# locally where (i + 1) % _sliding_window_pattern, with rope_local_base_freq for its rotary base and the window
# run.sh gives it; q/k norms, norms before and after each MLP, the embeddings times sqrt(hidden_size).


def gemma3_rope(ckpt: Checkpoint) -> tuple[dict, dict]:
    """(full, sliding) rope parameters: transformers 5 keeps one set per layer type, 4 the full layers' at the top
    level and the sliding layers' base in rope_local_base_freq."""
    config = ckpt.config
    params = getattr(config, "rope_parameters", None) or {}
    full = params.get("full_attention") or {"rope_theta": getattr(config, "rope_theta", 1e6),
                                            **(getattr(config, "rope_scaling", None) or {})}
    local = params.get("sliding_attention") or {"rope_theta": getattr(config, "rope_local_base_freq", 1e4)}
    return full, local


def gemma3_pattern(spec: ModelSpec) -> int | None:
    """The _sliding_window_pattern whose rule gives exactly the layers' types (None: no pattern does)."""
    types = spec.layer_types
    return next((p for p in range(1, len(types) + 2)
                 if all((kind == "sliding_attention") == bool((i + 1) % p) for i, kind in enumerate(types))), None)


def gemma3_unexported(ckpt: Checkpoint) -> str:
    """Why a Gemma 3 cannot be exported faithfully ("" where it can)."""
    kinds = {params.get("rope_type", params.get("type", "default")) for params in gemma3_rope(ckpt)}
    if kinds != {"default"}:
        # Attention.create_attention_const_params builds the local tables with the one rotary_scaling, and
        # GemmaConfig.from_hugging_face reads rotary_scaling, a key transformers' config has not, so its own
        # converter drops the scaling from both kinds of layer.
        scaled = ", ".join(sorted(kinds - {"default"}))
        return (f"this Gemma 3 scales the rope of its full-attention layers alone ({scaled}), where TensorRT-LLM's "
                "Gemma model applies one rotary scaling to its sliding-window layers as well")
    if gemma3_pattern(ckpt.spec) is None:
        return ("its layer_types do not follow TensorRT-LLM's Gemma rule, which makes layer i sliding-window where "
                "(i + 1) % _sliding_window_pattern is not 0")
    return ""


def attention_windows(target: Checkpoint, draft: Checkpoint, max_seq_len: int) -> list[int] | None:
    """run.sh's --max_attention_window_size, the positions each layer attends to (None: the whole context at every
    layer). TensorRT-LLM takes a layer's window at run time, not from the checkpoint; a list shorter than the layers
    repeats over them (the executor's KvCacheConfig max_attention_window), and run.py gives both engines the same
    list (examples/ngram/run_dtm_ngram.py common_runner_kwargs, 77bcb5a5): the shortest list whose repetition is
    both models' layers, refused where none is."""
    per = [[min(w or max_seq_len, max_seq_len) for w in ckpt.spec.sliding_windows] for ckpt in (target, draft)]
    if all(w == max_seq_len for windows in per for w in windows):
        return None
    both = _cycle(*per)
    if both is None:
        raise UnsupportedModelError(f"max_seq_len {max_seq_len} goes past the sliding windows of a pair whose layers "
                                    f"window differently (the target's cycle {_cycle(per[0])}, the draft's "
                                    f"{_cycle(per[1])}), where run.py gives both TensorRT-LLM engines one "
                                    "--max_attention_window_size list; give --max-seq-len (or a recipe's max_seq_len) "
                                    f"of {min(min(windows) for windows in per)} or less for the TensorRT-LLM export")
    return both


def _cycle(*models: list[int]) -> list[int] | None:
    """The shortest list whose repetition is every model's per-layer windows (None: none is)."""
    cycles = [windows[:n] for windows in models for n in range(1, len(windows) + 1)]
    fitting = (cycle for cycle in cycles if all(w == cycle[i % len(cycle)] for ws in models for i, w in enumerate(ws)))
    return min(fitting, key=len, default=None)


def window_limit(target: Checkpoint, draft: Checkpoint) -> int | None:
    """The longest context the export takes (None: any): the shortest window, unless run.sh carries the pair's
    windows, as for a Gemma 3 pair that one list windows (attention_windows)."""
    windows = [window for ckpt in (target, draft) if (window := sliding_window(ckpt))]
    if not windows:
        return None
    past = max(windows) + 1
    carried = all(ckpt.spec.architecture == "Gemma3ForCausalLM" for ckpt in (target, draft)) and _cycle(
        *([min(w or past, past) for w in ckpt.spec.sliding_windows] for ckpt in (target, draft))) is not None
    return None if carried else min(windows)


def context_limit(target: Checkpoint, draft: Checkpoint) -> int | None:
    """The longest context the export takes (None: any): window_limit's, and a Phi-3 LongRoPE target's original
    length (phi3_check_context)."""
    return min(filter(None, (window_limit(target, draft), phi3_longrope_limit(target))), default=None)


def gemma3_config(ckpt: Checkpoint, config: dict) -> dict:
    """GemmaConfig: Gemma3ConfigGroup's fields, and use_parallel_embedding, which GemmaConfig sets to tp > 1
    whatever config.json says."""
    spec = ckpt.spec
    full, local = gemma3_rope(ckpt)
    return {**config, "hidden_act": spec.hidden_act, "position_embedding_type": "rope_gpt_neox",
            "rotary_base": float(full["rope_theta"]), "rotary_scaling": None, "attn_bias": spec.attention_bias,
            "mlp_bias": False, "use_parallel_embedding": config["mapping"]["tp_size"] > 1, "inter_layernorms": True,
            "query_pre_attn_scalar": ckpt.config.query_pre_attn_scalar, "final_logit_softcapping": spec.final_softcap,
            "_sliding_window_pattern": gemma3_pattern(spec), "rope_local_base_freq": float(local["rope_theta"]),
            "sliding_window": sliding_window(ckpt) or spec.max_position_embeddings}


def gemma3_tensors(ckpt: Checkpoint, names: set[str]) -> Iterator[Out]:
    """models/gemma/convert.py (HfParser, load_gemma_weights): every norm, q/k norms included, written as 1 + weight
    (TensorRT-LLM's RmsNorm multiplies by its weight alone); the embedding table split by rows at tp > 1
    (use_parallel_embedding), lm_head a copy of it."""
    read, spec = ckpt.tensor, ckpt.spec

    def norm(name: str) -> np.ndarray:
        return read(name).astype(np.float32) + 1.0

    yield Out("transformer.vocab_embedding.weight", EMBEDDING, read("model.embed_tokens.weight"))
    for i in range(spec.shape.num_layers):
        hf, trt = f"model.layers.{i}.", f"transformer.layers.{i}."
        yield Out(trt + "input_layernorm.weight", REPLICATE, norm(hf + "input_layernorm.weight"))
        yield Out(trt + "attention.qkv.weight", QKV, tuple(read(f"{hf}self_attn.{p}_proj.weight") for p in "qkv"))
        if spec.attention_bias:
            yield Out(trt + "attention.qkv.bias", QKV, tuple(read(f"{hf}self_attn.{p}_proj.bias") for p in "qkv"))
            yield Out(trt + "attention.dense.bias", REPLICATE, read(hf + "self_attn.o_proj.bias"))
        yield Out(trt + "attention.dense.weight", ROW, read(hf + "self_attn.o_proj.weight"))
        yield Out(trt + "attention.q_layernorm.weight", REPLICATE, norm(hf + "self_attn.q_norm.weight"))
        yield Out(trt + "attention.k_layernorm.weight", REPLICATE, norm(hf + "self_attn.k_norm.weight"))
        for trt_norm, hf_norm in (("post_layernorm", "post_attention_layernorm"),
                                  ("pre_feedforward_layernorm", "pre_feedforward_layernorm"),
                                  ("post_feedforward_layernorm", "post_feedforward_layernorm")):
            yield Out(f"{trt}{trt_norm}.weight", REPLICATE, norm(f"{hf}{hf_norm}.weight"))
        yield Out(trt + "mlp.fc.weight", COLUMN, read(hf + "mlp.gate_proj.weight"))
        yield Out(trt + "mlp.gate.weight", COLUMN, read(hf + "mlp.up_proj.weight"))
        yield Out(trt + "mlp.proj.weight", ROW, read(hf + "mlp.down_proj.weight"))
    yield Out("transformer.ln_f.weight", REPLICATE, norm("model.norm.weight"))
    yield Out("lm_head.weight", VOCAB, read("lm_head.weight" if "lm_head.weight" in names else
                                            "model.embed_tokens.weight"))


# Phi-3 (Phi3ForCausalLM: Phi-3-mini and -medium, Phi-3.5-mini, Phi-4, Phi-4-mini) as TensorRT-LLM's Phi-3 model
# builds it (tensorrt_llm/models/phi3/model.py at 1479eaf5, config.py at 033f4067, convert.py at 89fd9b74,
# split_weights.py at 7dfda15a; layers/attention.py, layers/mlp.py, functional.py RopeEmbeddingUtils): RmsNorms, no
# biases, an MLP whose fc holds both halves of the gated pair (hidden_act swiglu), whole-rank embeddings; the rotary
# part of each head (rotary_pct) rotates as rope_gpt_neox, by LongRoPE's short or long factors (long_rope) where the
# config has them.


def phi3_rope(ckpt: Checkpoint) -> dict:
    """Phi3Config's rope fields, as from_hugging_face writes them, but long_rope for every LongRoPE config: the
    converter keeps LongRoPE only where max_position_embeddings >= 128000 and rotates one with fewer positions without
    its factors, as transformers does not; the model takes long_rope wherever config.json has the factors
    (Phi3DecoderLayer asks hasattr(config, "longrope_scaling_short_factors"))."""
    config, spec = ckpt.config, ckpt.spec
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    fields = {"position_embedding_type": "rope_gpt_neox", "rotary_scaling": None,
              "rotary_base": float(params.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0),
              # Attention rotates int(head_size * rotary_pct) dims, as load.py reads partial_rotary_factor
              "rotary_pct": spec.rotary_dim / spec.shape.head_dim}
    if (original := longrope_length(config)) is not None:
        fields.update(position_embedding_type="long_rope", original_max_position_embeddings=original,
                      longrope_scaling_short_factors=list(params["short_factor"]),
                      longrope_scaling_long_factors=list(params["long_factor"]))
    return fields


def phi3_mscale(max_positions: int, original: int) -> float:
    """The factor Attention scales both LongRoPE tables by, when Phi3ForCausalLM gives it no mscale
    (RopeEmbeddingUtils.create_sinusoidal_positions_long_rope_for_attention_plugin, _calc_mscale)."""
    scale = max_positions / original
    return 1.0 if scale <= 1.0 else math.sqrt(1 + math.log(scale) / math.log(original))


def phi3_unexported(ckpt: Checkpoint) -> str:
    """Why TensorRT-LLM's Phi-3 model would compute a Phi-3 otherwise than transformers ("" where it would not)."""
    shape = ckpt.spec.shape
    if shape.head_dim * shape.num_heads != shape.hidden_size:
        return (f"its heads of {shape.head_dim} dims are not hidden_size / num_attention_heads, which TensorRT-LLM's "
                "Phi-3 model sizes them by (Phi3DecoderLayer gives its Attention no head size)")
    # transformers' Phi3Config takes no rope scaling but LongRoPE (validate_rope), the one Phi3DecoderLayer hands on
    if (original := longrope_length(ckpt.config)) is not None:
        # transformers takes an attention_factor or factor from the config where given; TensorRT-LLM's table always
        # derives its factor from the lengths
        theirs = rotary_module(ckpt.spec.architecture, ckpt.config).attention_scaling
        ours = phi3_mscale(ckpt.spec.max_position_embeddings, original)
        if not math.isclose(theirs, ours, rel_tol=1e-6):
            return (f"its LongRoPE attention factor {theirs:g}, where TensorRT-LLM's Phi-3 model scales its rotary "
                    f"tables by {ours:g}, from max_position_embeddings / original_max_position_embeddings alone")
    return ""


def phi3_check_context(ckpt: Checkpoint, role: str, max_seq_len: int) -> None:
    """Refuse a LongRoPE target past its original length: TensorRT-LLM rotates each step by the short or long
    table as the batch's longest sequence is within original_max_position_embeddings or past it (layers/attention.py,
    Attention.forward's select), keeping the keys it cached with the short one, where transformers' Phi-3 recomputes
    its cache with the long one (load.rope_switch_length). A draft's rotation changes only its proposals."""
    original = phi3_longrope_limit(ckpt)
    if role == "target" and original is not None and original < max_seq_len:
        raise UnsupportedModelError(
            f"max_seq_len {max_seq_len} exceeds the target's LongRoPE original_max_position_embeddings ({original}), "
            "past which TensorRT-LLM's Phi-3 model rotates new tokens with the long factors beside keys it cached with "
            "the short ones, where transformers recomputes them; give --max-seq-len (or a recipe's max_seq_len) of "
            f"{original} or less for the TensorRT-LLM export")


def phi3_longrope_limit(ckpt: Checkpoint) -> int | None:
    """A Phi-3's LongRoPE original length (None: another family, or no LongRoPE)."""
    return longrope_length(ckpt.config) if ckpt.spec.architecture == "Phi3ForCausalLM" else None


def phi3_config(ckpt: Checkpoint, config: dict) -> dict:
    """Phi3Config: the rope fields (phi3_rope), hidden_act swiglu for silu (MLP then makes fc twice
    intermediate_size wide), tie_word_embeddings (the converter writes lm_head.weight either way)."""
    return {**config, "hidden_act": "swiglu", "tie_word_embeddings": ckpt.spec.tie_word_embeddings, **phi3_rope(ckpt)}


def phi3_tensors(ckpt: Checkpoint, names: set[str]) -> Iterator[Out]:
    """models/phi3/convert.py load_weights_from_hf_model: qkv_proj ([q; k; v]) is attention.qkv, split per rank as
    every fused qkv is (split_weights_tp's split of q, k and v; each KV head repeated where there are fewer than
    ranks, which its converter cannot split and the Attention layer reads as LLaMA's); gate_up_proj ([gate; up]) is
    mlp.fc with its halves swapped to [up; gate], which MLP's swiglu reads on each rank as silu(second half) times the
    first (layers/mlp.py, functional.py swiglu). split_weights_tp splits that fc in plain chunks, so that at tp 2 rank 0
    would hold all of up and rank 1 all of gate, which that swiglu misreads; each rank gets its own rows of both
    (GATED_FC) instead, as a mixture's fc is split."""
    read, shape = ckpt.tensor, ckpt.spec.shape
    q_rows, kv_rows = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    yield Out("transformer.vocab_embedding.weight", REPLICATE, read("model.embed_tokens.weight"))
    for i in range(shape.num_layers):
        hf, trt = f"model.layers.{i}.", f"transformer.layers.{i}."
        yield Out(trt + "input_layernorm.weight", REPLICATE, read(hf + "input_layernorm.weight"))
        qkv = read(hf + "self_attn.qkv_proj.weight")
        yield Out(trt + "attention.qkv.weight", QKV, tuple(np.split(qkv, [q_rows, q_rows + kv_rows])))
        yield Out(trt + "attention.dense.weight", ROW, read(hf + "self_attn.o_proj.weight"))
        yield Out(trt + "post_layernorm.weight", REPLICATE, read(hf + "post_attention_layernorm.weight"))
        gate, up = np.split(read(hf + "mlp.gate_up_proj.weight"), 2)
        yield Out(trt + "mlp.fc.weight", GATED_FC, (up, gate))
        yield Out(trt + "mlp.proj.weight", ROW, read(hf + "mlp.down_proj.weight"))
    yield Out("transformer.ln_f.weight", REPLICATE, read("model.norm.weight"))
    yield Out("lm_head.weight", VOCAB, read("lm_head.weight" if "lm_head.weight" in names else
                                            "model.embed_tokens.weight"))


def shard(tensor: Out, layout: Layout, dtype) -> list[np.ndarray]:
    """The tensor's part on each rank, in the export's float type."""
    tp = layout.tp
    if tensor.split == QKV:
        q, k, v = (_cast(part, dtype, tensor.name) for part in tensor.value)
        if layout.kv_heads < tp:  # convert_utils.dup_kv_weight: each KV head repeated for tp/kv ranks
            k, v = (np.repeat(x.reshape(layout.kv_heads, layout.head_dim, -1), tp // layout.kv_heads, axis=0)
                    .reshape(tp * layout.head_dim, *x.shape[1:]) for x in (k, v))
        return [np.concatenate(parts) for parts in zip(*(np.split(x, tp) for x in (q, k, v)))]
    if tensor.split in (EXPERT_FC, GATED_FC):  # each of up and gate split on its rows, then joined per rank
        up, gate = (np.split(_cast(part, dtype, tensor.name), tp, axis=-2) for part in tensor.value)
        return [np.concatenate(parts, axis=-2) for parts in zip(up, gate)]
    value = _cast(tensor.value, dtype, tensor.name)
    if tensor.name.endswith("vocab_embedding.weight"):
        value = rows(value, layout.vocab)  # the draft's table padded (or cut) to the target's vocabulary
    if tensor.split == EMBEDDING:  # layers/embedding.py Embedding with tp_size > 1: ceil(vocab / tp) rows a rank
        return np.split(rows(value, layout.padded_vocab), tp)
    if tensor.split == VOCAB:  # the draft's missing rows score the mean of its logits (module docstring)
        # so do its own padding rows, which no training reaches (distill trains the tokenizer's rows alone):
        # TensorRT-LLM would draft them, each a certain rejection, where they outrank every real token
        kept = min(len(value), layout.tokens or len(value))
        fill = tensor.value[:kept].mean(axis=0, dtype=np.float64).astype(dtype) if kept < layout.vocab else None
        value = rows(value[:kept], layout.vocab, fill)
        return np.split(rows(value, layout.padded_vocab), tp)
    if tensor.split == COLUMN:
        return np.split(value, tp, axis=0)
    if tensor.split == ROW:
        return np.split(value, tp, axis=1)
    if tensor.split == EXPERT_PROJ:
        return np.split(value, tp, axis=2)
    return [value] * tp


def _cast(value: np.ndarray, dtype, name: str) -> np.ndarray:
    """value in the export's float type, refused in one line where fp16 cannot hold it (convert_into)."""
    out = np.empty(value.shape, dtype)
    convert_into(value, out, name=f"weight {name}")
    return out


def rows(table: np.ndarray, count: int, fill: np.ndarray | None = None) -> np.ndarray:
    """The table with exactly `count` rows: extra rows cut, missing ones `fill` (zero by default)."""
    if len(table) >= count:
        return table[:count]
    missing = np.zeros((count - len(table), *table.shape[1:]), table.dtype)
    if fill is not None:
        missing[:] = fill
    return np.concatenate([table, missing])


class RankFile:
    """One rank{r}.safetensors written tensor by tensor.

    The safetensors library writes a whole dict at once (save_file), which would hold a rank's weights in
    memory. The format is small: an 8-byte little-endian header length, a JSON header naming each
    tensor's dtype, shape and byte range, then the bytes. So the bytes go to a scratch file as they come
    and the header is put in front when the rank is complete (tensorrt_llm_reference reads it back with
    the library).
    """

    SAFETENSORS_DTYPES = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(ml_dtypes.bfloat16): "BF16"}

    def __init__(self, path: Path, scratch: Path):
        self.path, self.scratch = path, scratch
        self.scratch.parent.mkdir(parents=True, exist_ok=True)
        self.data = open(scratch, "wb")
        self.header: dict = {"__metadata__": {"format": "pt"}}

    def add(self, name: str, value: np.ndarray) -> None:
        start = self.data.tell()
        # Not tofile(): its short write carries no errno, so a full quota (whose disk may show free space) would
        # not read as a full disk (staging._disk_full).
        self.data.write(np.ascontiguousarray(value).reshape(-1).view(np.uint8).data)
        self.header[name] = {"dtype": self.SAFETENSORS_DTYPES[value.dtype], "shape": list(value.shape),
                             "data_offsets": [start, self.data.tell()]}

    def close(self) -> None:
        self.data.close()
        header = json.dumps(self.header, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)  # the tensors start 8-byte aligned, as the library writes them
        with open(self.path, "wb") as out, open(self.scratch, "rb") as data:
            out.write(len(header).to_bytes(8, "little"))
            out.write(header)
            shutil.copyfileobj(data, out, 1 << 24)
        self.scratch.unlink()


def measure_gamma(folder: Path, engines: dict[str, EngineInfo], target: Checkpoint, draft: Checkpoint,
                  byte_ratio: float, max_seq_len: int, max_gamma: int, eos: list[int]) -> dict:
    """γ for the plans: α through the ONNX engines when fp32 ones were built, otherwise with transformers on
    CPU for pairs small enough; c from the weight bytes each step reads. Not c timed on this CPU: a GPU's
    step times are not its, and a timed c moved γ between identical builds (a pipeline caches the plans)."""
    prompt_ids = gamma_stage.prompts(target.tokenizer)
    alpha = gamma_stage.measure_with_engines(folder, engines, prompt_ids, max_seq_len, eos) if engines else None
    how = "the ONNX engines on this CPU"
    if alpha is None and target.parameters() + draft.parameters() <= gamma_stage.TRANSFORMERS_PARAMETER_LIMIT:
        how = "transformers on CPU"
        alpha = gamma_stage.measure_with_transformers(target.path, draft.path, prompt_ids, max_seq_len, eos,
                                                      target.token_ids())
    if alpha is None:
        return gamma_stage.recommend(None, byte_ratio, max_gamma, "not measured (pair too large to decode on "
                                     "this CPU, no fp32 ONNX engines, or a context too short for the measuring "
                                     "prompts): the bundle's max gamma")
    return gamma_stage.recommend(alpha, byte_ratio, max_gamma, f"alpha: {how}, greedy, packaged code prompts; "
                                 "c: weight bytes read per step")


def write_plans(folder: Path, gamma: int, tp: int, max_seq_len: int, precision: str,
                target: Checkpoint, draft: Checkpoint, eos: list[int], quantized: str = "",
                measured: bool = True, kinds: Sequence[str] = ("build", "run", LLM_API, VLLM)
                ) -> dict[str, str]:
    """kinds: the plans to write (build and run need the checkpoints; source_plans says which others serve the
    pair). quantized: the bundle's quantization ("the target int4 and ..."; "" for none), which the checkpoints
    ask trtllm-build for, or without checkpoints (--backend all) the ONNX engines hold; the plans that serve the
    source folders (LLM API, vLLM) do not get it. measured: whether α was measured, so that gamma is the pair's
    own rather than the bundle's max gamma."""
    origin = ("the gamma specbuild measured for this pair" if measured else
              "the bundle's max gamma: specbuild could not measure this pair's acceptance, see specbuild inspect")
    held = (f"this bundle's TensorRT-LLM checkpoints ask for {quantized} (trtllm-build\n# quantizes them)"
            if "build" in kinds else f"this bundle's ONNX engines hold {quantized}, and no TensorRT-LLM\n# checkpoints")
    unquantized = (f"# Not quantized: {held}, but this plan serves the source folders' float weights.\n"
                   if quantized else "")
    paths = {"build": f"{FOLDER}/build.sh", "run": f"{FOLDER}/run.sh", LLM_API: f"{FOLDER}/llm-api.yaml",
             VLLM: VLLM_PLAN}
    plans = {key: path for key, path in paths.items() if key in kinds}
    newer = sorted({NEWER_PYTORCH_BACKEND[c.spec.architecture] for c in (target, draft)
                    if c.spec.architecture in NEWER_PYTORCH_BACKEND})
    release = (f"# {' and '.join(newer)} needs a TensorRT-LLM release after 1.0.x, whose PyTorch backend has no "
               "model for it.\n") if newer else ""
    write = {
        "build": lambda: build_script(gamma, max_seq_len, precision, origin),
        "run": lambda: run_script(gamma, tp, max_seq_len, eos, target.tokenizer.eos_token_id,
                                  attention_windows(target, draft, max_seq_len)),
        LLM_API: lambda: llm_api_yaml(gamma, tp, max_seq_len, target.path.resolve(), draft.path.resolve(),
                                      release + unquantized),
        VLLM: lambda: vllm_script(gamma, tp, max_seq_len, DTYPES[precision][0], target, draft, unquantized, origin),
    }
    texts = {key: write[key]() for key in plans}
    for key, text in texts.items():
        path = folder / plans[key]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        if path.suffix == ".sh":
            path.chmod(0o755)
    return plans


def build_script(gamma: int, max_seq_len: int, precision: str,
                 origin: str = "the gamma specbuild measured for this pair") -> str:
    """Both trtllm-build commands (examples/draft_target_model/README.md): the target built to verify
    `gamma` external draft tokens per step. --gather_generation_logits on both: run.py's draft-target loop asserts
    that both engines were built with it when logits decide acceptance (examples/ngram/run_dtm_ngram.py, 77bcb5a5:
    the True that run.sh's --draft_target_model_config takes instead of False), reading it from the engine's own
    config (ModelRunnerCpp.gather_generation_logits, runtime/model_runner_cpp.py 03832911), not from a runtime
    option; examples/prompt_lookup/run_dtm_pld.py at c3a2348d asserted it when tokens decide (46ea5256 turned the
    test round). trtllm-build calls the option deprecated in favour of the runtime's --output_generation_logits
    on every build, given or not (commands/build.py 008b2b8d tests hasattr on an option parsed with a default),
    and still builds it into the engine (BuildConfig gather_generation_logits)."""
    note = ("# These checkpoints are float32: TensorRT-LLM's fused attention kernels take fp16 or bf16, so if\n"
            "# trtllm-build refuses them, compile again with --precision fp16 or bf16.\n") if precision == "fp32" else ""
    common = (f"--gemm_plugin auto --use_paged_context_fmha enable --gather_generation_logits "
              f'--max_batch_size "$MAX_BATCH_SIZE" --max_input_len {max_seq_len} --max_seq_len {max_seq_len}')
    return f"""#!/usr/bin/env bash
# Builds this bundle's TensorRT-LLM engines for draft-target speculative decoding (written by specbuild).
# Needs TensorRT-LLM (trtllm-build) and an NVIDIA GPU. Engines go to engines/draft and engines/target here;
# the target verifies up to {gamma} draft tokens a step ({origin}).
# trtllm-build warns that --gather_generation_logits is deprecated on every build, given or not; run.py's
# draft-target loop reads it from both engines when logits decide acceptance (run.sh's False set to True).
{note}set -euo pipefail
cd "$(dirname "$0")"
MAX_BATCH_SIZE="${{MAX_BATCH_SIZE:-1}}"
trtllm-build --checkpoint_dir draft --output_dir engines/draft {common}
trtllm-build --checkpoint_dir target --output_dir engines/target {common} \\
  --speculative_decoding_mode draft_tokens_external --max_draft_len {gamma}
"""


def run_script(gamma: int, tp: int, max_seq_len: int, eos: list[int], tokenizer_eos: int | None,
               windows: list[int] | None = None) -> str:
    """examples/run.py's draft-target mode (examples/draft_target_model/README.md): [draft_len, draft GPUs,
    target GPUs, use_logits]; each device list is as long as that engine's tp. run.py starts both engines
    itself (ModelRunnerCpp in orchestrator mode, examples/run_dtm_pld.py), so no mpirun. Its draft-target loop
    (examples/ngram/run_dtm_ngram.py) hands ModelRunnerCpp.from_dir a max_input_len of prompt + max_output_len,
    to which from_dir adds max_output_len again and asserts the sum fits the engine's max_seq_len
    (tensorrt_llm/runtime/model_runner_cpp.py), and each target call asks for γ + 1 tokens after up to
    prompt + max_output_len - 1 (ModelRunnerCpp._check_inputs): the output must be at least γ, and prompt + twice
    the output at most max_seq_len. The default output, a quarter of max_seq_len (at least γ, at most 128),
    leaves the prompt half of it; --max_input_length says so to run.py, which otherwise keeps the first 923
    tokens of a prompt (examples/run.py parse_input) however many fit. --no_prompt_template: run.py otherwise wraps
    the text of some families (Qwen2ForCausalLM: examples/utils.py DEFAULT_PROMPT_TEMPLATES) in a chat
    template, so the engines would continue another prompt than the one given, as specbuild does not.

    eos: the bundle's eos ids. run.py ends a request at one id, --end_id (default: the tokenizer's eos, read
    from tokenizer/): its draft-target loop (examples/ngram/run_dtm_ngram.py, run_dtm_pld.py before) stops a
    request only at that id or its length, and checks --stop_words within each target call, not between
    rounds ("TODO: Check bad words and stop words criteria"), so no flag stops it at a second id (Llama 3.1
    Instruct's generation_config lists 128001, 128008 and 128009): the script says which id ends it and
    which others it runs past. (run.py reads `if args.end_id`, so an END_ID of 0 falls back to the tokenizer's.)

    Past MAX_NUM_TOKENS, --enable_chunked_context: the engines take that many tokens a step, and run.py hands the
    flag to both runners (examples/ngram/run_dtm_ngram.py, 77bcb5a5).

    windows: the per-layer attention windows (attention_windows), as --max_attention_window_size, which run.py
    hands both runners alike (run_dtm_ngram.py's common_runner_kwargs and common_generaion_kwargs)."""
    devices = "[" + ",".join(map(str, range(tp))) + "]"
    window_flag = "" if windows is None else f"  --max_attention_window_size {' '.join(map(str, windows))} \\\n"
    chunked = " --enable_chunked_context" if max_seq_len > MAX_NUM_TOKENS else ""
    output = min(128, max(gamma, max_seq_len // 4))
    end_id = tokenizer_eos if tokenizer_eos in eos else eos[0] if eos else None
    others = [e for e in eos if e != end_id]
    which = "the tokenizer's eos" if end_id == tokenizer_eos else "generation_config.json's first eos"
    stops = "" if end_id is None else (
        f"# run.py ends the output at one token id, END_ID (default {end_id}, {which}).\n" + (
            f"# The target also ends at {', '.join(map(str, others))} (its generation_config.json), which run.py's "
            "draft-target\n# loop does not stop at (its --stop_words cut one target call short, and the next round "
            "goes on):\n# the output runs on past the first of them until END_ID or --max_output_len; cut it "
            "there.\n" if others else ""))
    return f"""#!/usr/bin/env bash
# Runs the engines build.sh made with TensorRT-LLM's examples/run.py in draft-target mode (written by
# specbuild): the draft proposes {gamma} tokens, the target accepts those equal to its own greedy tokens.
# Usage: TRTLLM_DIR=/path/to/TensorRT-LLM ./run.sh "def fibonacci(n):"
# run.py's draft-target loop needs prompt + 2 x MAX_OUTPUT_LEN <= {max_seq_len} (the engines' max_seq_len) and
# MAX_OUTPUT_LEN >= {gamma}; it keeps the first --max_input_length tokens of a prompt, which this script sets
# to what fits: {max_seq_len - 2 * output} with the default MAX_OUTPUT_LEN, {output}.
{stops}set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
: "${{TRTLLM_DIR:?set TRTLLM_DIR to a TensorRT-LLM source checkout (for examples/run.py)}}"
output="${{MAX_OUTPUT_LEN:-{output}}}"
if (( output < {gamma} || 2 * output >= {max_seq_len} )); then
  echo "run.sh: MAX_OUTPUT_LEN $output leaves run.py no room; give one from {gamma} to {(max_seq_len - 1) // 2}" >&2
  exit 2
fi
python3 "$TRTLLM_DIR/examples/run.py" \\
  --engine_dir "$here/engines/target" --draft_engine_dir "$here/engines/draft" \\
  --tokenizer_dir "$here/../{TOKENIZER_DIR}" \\
  --draft_target_model_config "[{gamma},{devices},{devices},False]" \\
  --kv_cache_enable_block_reuse --kv_cache_free_gpu_memory_fraction 0.4 --no_prompt_template{chunked} \\
  --max_output_len "$output" --max_input_length "$(({max_seq_len} - 2 * output))" \\
{window_flag}  --input_text "${{1:-def fibonacci(n):}}"{
  "" if end_id is None else f' --end_id "${{END_ID:-{end_id}}}"'}
"""


def llm_api_yaml(gamma: int, tp: int, max_seq_len: int, target: Path, draft: Path, note: str = "") -> str:
    """TensorRT-LLM 1.x's LLM API / trtllm-serve on the PyTorch backend, which runs draft-target from the
    Hugging Face folders (docs/source/features/speculative-decoding.md), to the bundle's context as the other
    plans are. On main, speculative_config is a pydantic union told apart by decoding_type, whose tag for
    draft-target is "Draft_Target" (llmapi/llm_args.py DraftTargetDecodingConfig and SpeculativeConfig, 00043967;
    the docs site's latest build, from 69de4a6, the same); llm_args.py maps no other spelling to it (it declares a
    _decoding_type_alias that nothing in it sets). Releases up to 1.2.1 read the YAML through
    update_llm_args_with_extra_dict, which hands speculative_config to DecodingBaseConfig.from_dict, whose table
    names the class "DraftTarget" and refuses any other name (the docs site's 1.0.0/, 1.2.0/ and
    1.2.1/_modules/tensorrt_llm/llmapi/llm_args.html, built from ae8270b, dbdb13b and 376f7e1); 1.0.0's
    DecodingBaseConfig has speculative_model_dir and no speculative_model. The YAML takes the releases' spelling:
    pip installs the latest release, not a pre-release."""
    chunked = "enable_chunked_prefill: true\n" if max_seq_len > MAX_NUM_TOKENS else ""
    return f"""# TensorRT-LLM LLM API options for draft-target speculative decoding (written by specbuild).
# The PyTorch backend reads the source Hugging Face folders, not this bundle's checkpoints:
#   trtllm-serve {shlex.quote(str(target))} --backend pytorch --extra_llm_api_options llm-api.yaml
# (newer releases also call the option --config), or in Python: LLM(model=..., **yaml.safe_load(...)).
# decoding_type DraftTarget is the spelling of the releases up to 1.2.1 (DecodingBaseConfig.from_dict);
# TensorRT-LLM's main branch (and pre-releases built from it) knows only Draft_Target: with it, write
# decoding_type: Draft_Target. With 1.0.x write speculative_model_dir for speculative_model.
{note}tensor_parallel_size: {tp}
max_seq_len: {max_seq_len}
{chunked}disable_overlap_scheduler: true
speculative_config:
  decoding_type: DraftTarget
  max_draft_len: {gamma}
  speculative_model: {json.dumps(str(draft))}
"""


def vllm_script(gamma: int, tp: int, max_seq_len: int, dtype: str, target: Checkpoint, draft: Checkpoint,
                note: str = "", origin: str = "the gamma specbuild measured for this pair") -> str:
    """vLLM's draft-model speculation (vllm/config/speculative.py SpeculativeConfig: method "draft_model",
    num_speculative_tokens; docs features/speculative_decoding/draft_model.md). V1 gained it with
    vllm-project/vllm#24322, after v0.13.0 (which still refused draft models).

    A model whose layers mix sliding-window and full attention (Gemma 2 and 3, OLMo 3) gets a KV cache group per
    kind from vLLM's hybrid KV cache manager (v1/core/kv_cache_utils.py), and its draft path asserts "All drafting
    layers should belong to the same kv cache group" (SpecDecodeBaseProposer; vllm-project/vllm#33133, #49112:
    gemma-3-1b with gemma-3-270m fails so; #33318, which lifted it, was closed unmerged). With the manager
    disabled, unify_hybrid_kv_cache_specs keeps every layer's cache whole in one group (its test in
    tests/v1/core/test_kv_cache_utils.py, "full + sliding, but disable_hybrid_kv_cache_manager"); the sliding
    layers still attend within their windows. Such a pair's script disables it."""
    config = json.dumps({"model": str(draft.path.resolve()), "num_speculative_tokens": gamma, "method": "draft_model"})
    warning = note
    if target.spec.shape.vocab_size != draft.spec.shape.vocab_size:
        warning += (f"# The pair's embedding tables differ ({target.spec.shape.vocab_size} vs "
                   f"{draft.spec.shape.vocab_size} rows): vLLM's draft_model method\n# requires equal sizes "
                   "(SpeculativeConfig.verify_equal_vocab_size_if_draft_model) and will refuse them.\n")
    hybrid = ""
    if any(len({window is None for window in c.spec.sliding_windows}) > 1 for c in (target, draft)):
        warning += ("# The pair mixes sliding-window and full-attention layers: vLLM's draft path takes a model's "
                    "layers in one KV\n# cache group, which --disable-hybrid-kv-cache-manager makes (each layer's "
                    "cache kept whole; the\n# sliding layers still attend within their windows).\n")
        hybrid = " --disable-hybrid-kv-cache-manager"
    return f"""#!/usr/bin/env bash
# Serves the pair with vLLM's draft-model speculative decoding (written by specbuild): {gamma} speculative
# tokens ({origin}), tensor parallelism {tp}, on the source Hugging Face folders.
# Needs a vLLM release whose --speculative-config takes "method": "draft_model" (after v0.13.0).
{warning}set -euo pipefail
exec vllm serve {shlex.quote(str(target.path.resolve()))} --tensor-parallel-size {tp} --dtype {dtype} \\
  --max-model-len {max_seq_len}{hybrid} --speculative-config {shlex.quote(config)} "$@"
"""


def run_build(script: Path) -> str:
    """Runs build.sh (trtllm-build is on PATH); the engines land in the bundle, beside the checkpoints."""
    result = subprocess.run(["bash", str(script)], capture_output=True, text=True)
    if result.returncode:
        last = (result.stderr.strip() or result.stdout.strip() or "no output").splitlines()[-1]
        raise ExternalToolError(f"trtllm-build failed (exit {result.returncode}) running {script.name}: {last}; "
                                "compile again with --backend onnx, or fix TensorRT-LLM and rerun")
    return f"{FOLDER}/engines"
