"""`specbuild compile` as a straight line of stages: load & validate -> write each engine, its weights
streamed (read, converted or quantized, and written one tensor at a time) -> measure quantized engines ->
check each engine with onnxruntime -> write the bundle."""

from __future__ import annotations

import resource
import time
from pathlib import Path

from tqdm import tqdm

from specbuild_runtime.manifest import TOKENIZER_DIR, Manifest

from ..errors import SettingsError
from ..progress import bar, shown
from ..staging import scratch_folder
from ..recipe import DEFAULT_ACCURACY_LEVEL, DEFAULT_BLOCK_SIZE, DEFAULT_MAX_SEQ_LEN, CompileSettings, round_problem
from . import tensorrt_llm
from .bundle import created_by, save_tokenizer, staged_bundle, write_manifest
from .check import check_engines
from .export import export_engine, write_sampler
from .graphs import check_every_tensor_used
from .load import (Checkpoint, check_context, eos_token_ids, load_checkpoint, longest_context, rope_switch_length,
                   sampling_defaults, validate_pair)
from .precision import Numerics
from .quality import measure_quality, quality_texts


def compile_bundle(settings: CompileSettings, show_progress: bool | None = None) -> Manifest:
    """show_progress None: progress bars on a terminal, a line a minute from a longer phase elsewhere (progress.py)."""
    stages = len(STAGES) - (settings.backend == "onnx")  # an ONNX-only compile writes no TensorRT-LLM checkpoints
    with shown(show_progress), bar(stages, "", "stage") as stage_bar:
        return _compile(settings, _Stages(stage_bar))


# Tokens the draft's steps graph drafts per call (a round of more drafts makes more calls, of fewer adds
# single steps): the fixed γ that decoded fastest on the H100 layer pair (docs/gpu.md) and the demo pair.
DRAFT_STEPS = 4
STAGES = ("loading checkpoints", "writing engines", "measuring quantized engines", "checking each engine",
          "writing TensorRT-LLM checkpoints", "writing the bundle")


def _compile(settings: CompileSettings, stages: "_Stages") -> Manifest:
    # Staged first, so that an output it may not replace (or another writer's) is refused before the checkpoints
    # load (7 s at 0.6B, minutes at 8B), a refused compile too clearing what a killed one left there.
    with staged_bundle(settings.output, settings.overwrite, settings.inputs()) as folder:
        stages.start("loading checkpoints")
        target = load_checkpoint(settings.target, "target")
        draft = load_checkpoint(settings.draft, "draft")
        validate_pair(target, draft)
        limits = [longest_context(target, "target"), longest_context(draft, "draft")]
        # a window the export does not carry, or a Phi-3 target's LongRoPE switch, refuses a longer context
        # (check_exportable); the plans that serve the source folders alone carry the windows in config.json
        if settings.backend != "onnx" and tensorrt_llm.exports(target, draft):
            limits += [limit] if (limit := tensorrt_llm.context_limit(target, draft)) else []
        context_limit = min(limits)
        max_seq_len = _max_seq_len(settings, context_limit)
        for role, ckpt in (("target", target), ("draft", draft)):
            check_context(ckpt, role, max_seq_len)
            check_every_tensor_used(ckpt, role, max_seq_len)
        checkpoints: dict[str, Checkpoint] = {"target": target, "draft": draft}
        numerics = {role: Numerics(settings.precision, settings.quantization(role),
                                   DEFAULT_BLOCK_SIZE if settings.block_size is None else settings.block_size,
                                   DEFAULT_ACCURACY_LEVEL if settings.accuracy_level is None
                                   else settings.accuracy_level)
                    for role in checkpoints}
        if settings.backend != "onnx":  # refused now rather than after the ONNX engines
            quantized = any(n.quantization != "none" for n in numerics.values())
            tensorrt_llm.check_pair(target, draft, max_seq_len, settings.tp,
                                    quantized=quantized and settings.backend == "tensorrt-llm")
        eos = eos_token_ids(target)  # read before the long stages: a malformed file fails here
        onnx = settings.backend != "tensorrt-llm"
        measured = (onnx and settings.quality_report is not False
                    and any(n.quantization != "none" for n in numerics.values()))
        texts = quality_texts(target.tokenizer) if measured else None
        # Scratch (quality references, the TensorRT-LLM export's pieces) beside the staging folder, never in
        # the system temp dir; staging removes it before publishing, and the next compile after a crash.
        scratch = scratch_folder(folder)
        scratch.mkdir()
        stages.start("writing engines")
        # the draft is cut to the tokenizer's ids (graphs.engine_vocab); the target never is: its padding
        # ids keep the share of p that transformers gives them
        tokens = target.token_ids()
        engines = {role: export_engine(ckpt, role, folder, max_seq_len, numerics[role],
                                       vocab_size=target.spec.shape.vocab_size,
                                       draft_steps=_draft_steps(settings.gamma) if role == "draft" else 0,
                                       fixed_rows=settings.gamma + 1 if role == "target" else 0,
                                       tokens=tokens if role == "draft" else None,
                                       rope_switch=rope_switch_length(ckpt, role, max_seq_len))
                   for role, ckpt in checkpoints.items() if onnx}
        sampler = write_sampler(folder) if onnx else ""

        stages.start("measuring quantized engines")
        if texts:
            for role, report in measure_quality(folder, scratch, engines, checkpoints, max_seq_len, texts, eos).items():
                engines[role].quality = report

        stages.start("checking each engine")
        check_engines(folder, engines, sampler, max_seq_len)

        trtllm = None
        if settings.backend != "onnx":
            stages.start("writing TensorRT-LLM checkpoints")
            trtllm = tensorrt_llm.export_pair(target, draft, folder, scratch, engines, max_seq_len, settings.tp, numerics,
                                              settings.gamma, eos)

        stages.start("writing the bundle")
        save_tokenizer(target.tokenizer, folder / TOKENIZER_DIR)
        manifest = Manifest(engines=engines, max_seq_len=max_seq_len, gamma=settings.gamma, eos_token_ids=eos,
                            files={}, created_by=created_by(), tensorrt_llm=trtllm, sampler_file=sampler,
                            generation_config=sampling_defaults(target), context_limit=context_limit)
        manifest.build = stages.finish()  # all but the bundle's digests, which write_manifest takes next
        write_manifest(folder, manifest)
    return manifest


def _draft_steps(gamma: int) -> int:
    """Tokens the draft's steps graph drafts a call (0: no steps graph, where γ allows no more than one)."""
    steps = min(DRAFT_STEPS, gamma)
    return steps if steps >= 2 else 0


def _max_seq_len(settings: CompileSettings, context_limit: int) -> int:
    # The default stops where check_context would refuse a longer one (a short draft, a LongRoPE target's original
    # length, a window transformers' cache keeps)
    max_seq_len = settings.max_seq_len or min(DEFAULT_MAX_SEQ_LEN, context_limit)
    if problem := round_problem(settings.gamma, max_seq_len):
        raise SettingsError(problem)
    return max_seq_len


class _Stages:
    """The progress bar's stage names, and for the manifest each stage's seconds and the peak resident
    memory when it ended (a running maximum, so the stage that raised it is the one that set the compile's
    peak). The maximum starts afresh with the compile where Linux allows: `specbuild demo` trains in the
    same process first, and its training peak is not the compile's."""

    def __init__(self, bar: tqdm):
        self.bar, self.started = bar, time.perf_counter()
        _reset_peak_memory()
        self.current: tuple[str, float] | None = None
        self.record: dict[str, dict] = {}

    def start(self, name: str) -> None:
        self._close()
        self.bar.set_description(name)
        self.current = (name, time.perf_counter())

    def finish(self) -> dict:
        self._close()
        return {"seconds": round(time.perf_counter() - self.started, 1), "peak_rss_bytes": _peak_memory(),
                "stages": self.record}

    def _close(self) -> None:
        if self.current:
            name, began = self.current
            self.record[name] = {"seconds": round(time.perf_counter() - began, 1), "peak_rss_bytes_so_far": _peak_memory()}
            self.bar.update()
        self.current = None


def _reset_peak_memory() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # Linux 4.0+: the peak (ru_maxrss too) restarts from now
    except OSError:
        pass


def _peak_memory() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux
