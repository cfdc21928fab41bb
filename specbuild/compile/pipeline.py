"""`specbuild compile` as a straight line of stages: load & validate -> build graphs -> quantize/precision
-> verify -> write bundle."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from tqdm import tqdm

from specbuild_runtime.engine import Engine, can_run
from specbuild_runtime.manifest import TOKENIZER_DIR, EngineInfo, Manifest

from .. import __version__
from ..recipe import DEFAULT_MAX_SEQ_LEN, CompileSettings
from . import tensorrt_llm
from .bundle import staged_bundle, write_manifest
from .export import check_context, export_engine
from .load import eos_token_ids, load_checkpoint, validate_pair
from .precision import convert_precision
from .quality import QualityTexts, quality_report, quality_texts, report_acceptance_change
from .quantize import quantize_engine


def compile_bundle(settings: CompileSettings, show_progress: bool | None = None) -> Manifest:
    """show_progress None: a progress bar on a terminal only (build logs stay clean)."""
    with tqdm(total=5, unit="stage", disable=None if show_progress is None else not show_progress, leave=False) as stages:
        return _compile(settings, stages)


def _compile(settings: CompileSettings, stages: tqdm) -> Manifest:
    def stage(name: str) -> None:
        stages.set_description(name)

    stage("loading checkpoints")
    target = load_checkpoint(settings.target, "target")
    draft = load_checkpoint(settings.draft, "draft")
    validate_pair(target, draft)
    max_seq_len = settings.max_seq_len or min(DEFAULT_MAX_SEQ_LEN, target.spec.max_position_embeddings)
    check_context(target, "target", max_seq_len)
    check_context(draft, "draft", max_seq_len)
    if settings.backend != "onnx":
        tensorrt_llm.check_pair(settings, target, draft)
    stages.update()

    onnx = settings.backend != "tensorrt-llm"
    measured = onnx and settings.quality_report and any(settings.quantization(role) != "none" for role in ("target", "draft"))
    texts = quality_texts(target.tokenizer) if measured else None
    with staged_bundle(settings.output, settings.overwrite) as folder, tempfile.TemporaryDirectory() as scratch:
        engines, exported, fp32_copies = {}, {}, Path(scratch)
        for role, ckpt in (("target", target), ("draft", draft)) if onnx else ():
            stage(f"building {role} engine")
            exported[role] = export_engine(ckpt, role, folder, max_seq_len, target.spec.shape.vocab_size)
            engines[role] = shrink_engine(folder, exported[role], settings, texts, stage, fp32_copies)
            stages.update()
        if texts:
            report_acceptance_change(folder, engines, fp32_copies, exported, texts[0])
        target.tokenizer.save_pretrained(folder / TOKENIZER_DIR)

        stage("verifying engines")
        for info in filter(can_run, engines.values()):
            # A one-token prefill proves each engine loads and runs before the bundle is published (a
            # bf16 one passed the ONNX checker when it was written; it runs only on a GPU runtime).
            Engine(folder / info.file, info, max_seq_len).step([0], total_len=1)
        stages.update()
        trtllm = (tensorrt_llm.export_pair(settings, target, draft, folder, Path(scratch), engines, max_seq_len)
                  if settings.backend != "onnx" else None)

        stage("writing bundle")
        manifest = Manifest(
            engines=engines,
            max_seq_len=max_seq_len,
            gamma=settings.gamma,
            eos_token_ids=eos_token_ids(target),
            files={},
            created_by=f"specbuild {__version__}",
            tensorrt_llm=trtllm,
        )
        write_manifest(folder, manifest)
        stages.update()
    return manifest


def shrink_engine(folder: Path, info: EngineInfo, settings: CompileSettings, texts: QualityTexts | None, stage,
                  reference: Path) -> EngineInfo:
    """texts: what the quality report measures on (None: no report); reference: where the fp32 engine is
    kept aside to measure what quantization changed."""
    mode = settings.quantization(info.role)
    if mode != "none":
        stage(f"quantizing {info.role} engine ({mode})")
        fp32 = info
        if texts:
            for name in (info.file, f"{info.file}.data"):
                shutil.copy2(folder / name, reference / name)
        info = quantize_engine(folder, info, mode, settings.block_size, settings.accuracy_level)
        if texts:
            stage(f"measuring {info.role} engine quality")
            info.quality = quality_report(reference, fp32, folder, info, *texts)
    if settings.precision != "fp32":
        stage(f"converting {info.role} engine to {settings.precision}")
        info = convert_precision(folder, info, settings.precision)
    return info
