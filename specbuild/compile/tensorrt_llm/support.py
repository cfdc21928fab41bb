"""What the TensorRT-LLM export takes, checked before anything is written: whether a pair gets checkpoints
(exports) or only the plans that serve its source folders (source_plans), the splits, attention and contexts it
refuses (check_pair), and the longest context it takes (context_limit)."""

from __future__ import annotations

from ...errors import UnsupportedModelError
from ..load import Checkpoint
from .families import (DENSE_AMONG_SPARSE, FAMILIES, LLM_API, NOT_EXPORTED, QK_NORM_CONVERTERS, SOURCE_PLANS,
                       VLLM)
from .gemma import gemma3_unexported
from .layout import ffn_width
from .llama import rotary
from .phi3 import phi3_check_context, phi3_longrope_limit, phi3_unexported
from .windows import attention_windows, sliding_window, window_limit


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


def context_limit(target: Checkpoint, draft: Checkpoint) -> int | None:
    """The longest context the export takes (None: any): window_limit's, and a Phi-3 LongRoPE target's original
    length (phi3_check_context)."""
    return min(filter(None, (window_limit(target, draft), phi3_longrope_limit(target))), default=None)
