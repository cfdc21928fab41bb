"""Stage 3: quantize and/or convert the precision of one freshly exported engine, with a quality report."""

from __future__ import annotations

import shutil
from pathlib import Path

from specbuild_runtime.manifest import EngineInfo

from .quantize import ALPHA_GAMMA, convert_precision, pair_acceptance, quality_report, quantize_engine
from .recipe import CompileSettings

QUALITY_HELDOUT_TOKENS = 4096
QualityTexts = tuple[list[list[int]], list[int]]  # code prompts, held-out token ids


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


def report_acceptance_change(folder: Path, engines: dict[str, EngineInfo], reference: Path,
                             fp32: dict[str, EngineInfo], prompts: list[list[int]]) -> None:
    """Add to each quantized engine's quality report the pair's greedy acceptance α with and without
    quantization (the other engine as built): what quantization did to the speed-up."""
    measured = [role for role, info in engines.items() if info.quality]
    if not measured:  # (a quantized engine cannot be converted to bf16: every measured pair runs here)
        return
    built = pair_acceptance(folder, engines["target"], folder, engines["draft"], prompts)
    for role in measured:
        other = "draft" if role == "target" else "target"
        places = {role: (reference, fp32[role]), other: (folder, engines[other])}
        before = pair_acceptance(*places["target"], *places["draft"], prompts)
        engines[role].quality["alpha"] = {"gamma": ALPHA_GAMMA, "fp32": before, "quant": built}


def quality_texts(tokenizer) -> QualityTexts:
    """Code prompts shipped with specbuild, and held-out Python source (the demo pair never trains on it)."""
    from .train import corpus_files, read_source
    from .verify import CODE_PROMPTS, read_prompts

    prompts = [tokenizer(p)["input_ids"] for p in read_prompts(CODE_PROMPTS)[:8]]
    heldout: list[int] = []
    for path in corpus_files()[1]:
        heldout += tokenizer(read_source(path))["input_ids"]
        if len(heldout) >= QUALITY_HELDOUT_TOKENS:
            break
    return prompts, heldout[:QUALITY_HELDOUT_TOKENS]
