"""The TensorRT-LLM stage (--backend tensorrt-llm|all): the pair as TensorRT-LLM checkpoints, tensor-parallel
ranks and all, and the plans that build, run and serve it with TensorRT-LLM, and with vLLM.

TensorRT-LLM cannot be installed here, so nothing here imports it. What is written follows its sources
(NVIDIA/TensorRT-LLM on GitHub; the files are named where each rule comes from), and
reference.py reads a written checkpoint back the way TensorRT-LLM's layers compute, which
the tests check against transformers.

One module per job, each importing only those above it here:
  families.py   the tables: the families the checkpoint flow takes, those it does not and why, the plans of each
  layout.py     how each tensor splits over the tensor-parallel ranks (Layout, Out and its split kinds, shard)
  windows.py    sliding windows: the longest context they leave the export, and run.sh's per-layer list
  llama.py      Llama, Mistral, Qwen2, Qwen3, Granite and the mixtures (Qwen3-MoE, Mixtral): tensors, rope, config
  gpt2.py       GPT-2's tensors
  gemma.py      Gemma 3's tensors, rope and config, and the configs its TensorRT-LLM model would compute otherwise
  phi3.py       Phi-3's tensors, rope and config, and what its TensorRT-LLM model would compute otherwise
  support.py    what the export takes, checked before anything is written (check_pair, exports, context_limit)
  checkpoint.py config.json and the rank files, one source tensor at a time (write_checkpoint)
  plans.py      γ and the plans: build.sh and run.sh, llm-api.yaml and vLLM's serve.sh; build.sh run (run_build)
  reference.py  a written checkpoint run as TensorRT-LLM's layers compute, in float64 (the tests' proof)
This package runs them for the pipeline (export_pair).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from specbuild_runtime.manifest import EngineInfo, TensorRTLLMPart

from ..load import Checkpoint
from ..precision import Numerics
from .checkpoint import FOLDER, source, write_checkpoint
from .plans import measure_gamma, run_build, step_parameters, write_plans
from .support import check_pair, context_limit, exports, source_plans, unexported

__all__ = ["FOLDER", "check_pair", "context_limit", "export_pair", "exports"]


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
    # what a step reads (and of it a mixture's experts), as trtllm-build will quantize them, or as the source folders
    # are served
    steps = {role: (checkpoints[role]["weight_bytes"], checkpoints[role].get("expert_bytes", 0)) if exported else
             step_parameters(ckpt) for role, ckpt in (("target", target), ("draft", draft))}
    recommended = measure_gamma(folder, engines, target, draft, steps, max_seq_len, max_gamma, eos)
    quantized = " and ".join(f"the {role} {numerics[role].quantization}" for role in ("target", "draft")
                          if numerics[role].quantization != "none")
    kinds = [*(("build", "run") if exported else ()), *source_plans(target, draft)]
    plans = write_plans(folder, recommended["gamma"], tp, max_seq_len, precision, target, draft, eos, quantized,
                        measured=recommended["alpha"] is not None, kinds=kinds)
    built = run_build(folder / plans["build"]) if "build" in plans and shutil.which("trtllm-build") else None
    return TensorRTLLMPart(tp_size=tp, checkpoints=checkpoints, plans=plans, gamma=recommended, engines=built)
