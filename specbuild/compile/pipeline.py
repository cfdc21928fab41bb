"""`specbuild compile` as a straight line of stages: load & validate -> write each engine, its weights
streamed, read, converted or quantized and written one tensor at a time -> measure quantized engines ->
run each engine once -> write the bundle."""

from __future__ import annotations

import contextlib
import resource
import shutil
import time
from pathlib import Path
from typing import Iterator

from tqdm import tqdm

from specbuild_runtime.engine import Engine, can_run
from specbuild_runtime.errors import SpecbuildError
from specbuild_runtime.manifest import TOKENIZER_DIR, Manifest

from .. import __version__
from ..recipe import DEFAULT_MAX_SEQ_LEN, CompileSettings
from . import tensorrt_llm
from .bundle import staged_bundle, write_manifest
from .export import check_context, export_engine
from .load import Checkpoint, eos_token_ids, load_checkpoint, validate_pair
from .precision import DEFAULT_ACCURACY_LEVEL, Numerics
from .quality import measure_quality, quality_texts


def compile_bundle(settings: CompileSettings, show_progress: bool | None = None) -> Manifest:
    """show_progress None: progress bars on a terminal only (build logs stay clean)."""
    with tqdm(total=len(STAGES), unit="stage", disable=None if show_progress is None else not show_progress,
              leave=False) as bar:
        return _compile(settings, _Stages(bar), show_progress)


STAGES = ("loading checkpoints", "writing engines", "measuring quantized engines", "running each engine once",
          "writing TensorRT-LLM checkpoints", "writing the bundle")


def _compile(settings: CompileSettings, stages: "_Stages", show_progress: bool | None) -> Manifest:
    stages.start("loading checkpoints")
    target = load_checkpoint(settings.target, "target")
    draft = load_checkpoint(settings.draft, "draft")
    validate_pair(target, draft)
    max_seq_len = _max_seq_len(settings, target)
    check_context(target, "target", max_seq_len)
    check_context(draft, "draft", max_seq_len)
    if settings.backend != "onnx":  # refused now rather than after the ONNX engines
        tensorrt_llm.check_pair(settings, target, draft, max_seq_len)
    eos = eos_token_ids(target)  # read before the long stages: a malformed file fails here
    checkpoints: dict[str, Checkpoint] = {"target": target, "draft": draft}
    numerics = {role: Numerics(settings.precision, settings.quantization(role), settings.block_size,
                               DEFAULT_ACCURACY_LEVEL if settings.accuracy_level is None else settings.accuracy_level)
                for role in checkpoints}
    onnx = settings.backend != "tensorrt-llm"
    measured = onnx and settings.quality_report and any(n.quantization != "none" for n in numerics.values())
    texts = quality_texts(target.tokenizer) if measured else None

    with staged_bundle(settings.output, settings.overwrite) as folder, _scratch(folder) as scratch:
        stages.start("writing engines")
        engines = {role: export_engine(ckpt, role, folder, max_seq_len, numerics[role],
                                       vocab_size=target.spec.shape.vocab_size, show_progress=show_progress)
                   for role, ckpt in checkpoints.items() if onnx}

        stages.start("measuring quantized engines")
        if texts:
            measure_quality(folder, scratch, engines, checkpoints, max_seq_len, texts)

        stages.start("running each engine once")
        for info in filter(can_run, engines.values()):
            # A one-token prefill proves each engine loads and runs before the bundle is published (a
            # bf16 one passed the ONNX checker when it was written; it runs only on a GPU runtime).
            Engine(folder / info.file, info, max_seq_len).step([0], total_len=1)

        trtllm = None
        if settings.backend != "onnx":
            stages.start("writing TensorRT-LLM checkpoints")
            trtllm = tensorrt_llm.export_pair(settings, target, draft, folder, scratch, engines, max_seq_len)

        stages.start("writing the bundle")
        target.tokenizer.save_pretrained(folder / TOKENIZER_DIR)
        manifest = Manifest(engines=engines, max_seq_len=max_seq_len, gamma=settings.gamma, eos_token_ids=eos,
                            files={}, created_by=f"specbuild {__version__}", tensorrt_llm=trtllm)
        manifest.build = stages.finish()  # all but the bundle's digests, which write_manifest takes next
        write_manifest(folder, manifest)
    return manifest


def _max_seq_len(settings: CompileSettings, target: Checkpoint) -> int:
    if settings.max_seq_len is None:
        return min(DEFAULT_MAX_SEQ_LEN, target.spec.max_position_embeddings)
    if settings.max_seq_len < 2:
        raise SpecbuildError(f"--max-seq-len {settings.max_seq_len} leaves no room to generate; give 2 tokens or more")
    return settings.max_seq_len


@contextlib.contextmanager
def _scratch(staging: Path) -> Iterator[Path]:
    """The compile's scratch folder, beside the staging folder (never the system temp dir, which may be
    small or shared), gone before the bundle is published. A crash leaves it to the next compile, which
    cleans it with the stale staging folder (bundle.staged_bundle)."""
    scratch = Path(f"{staging}-scratch")
    scratch.mkdir()
    try:
        yield scratch
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


class _Stages:
    """The progress bar's stage names, and each stage's seconds and peak resident memory for the manifest.

    The peak is the process's own high-water mark (VmHWM), started afresh at each stage where the OS
    allows it (Linux: /proc/self/clear_refs), so the figures are this compile's even in a process that did
    other work before it; elsewhere it is the process's lifetime peak (ru_maxrss).
    """

    def __init__(self, bar: tqdm):
        self.bar, self.started = bar, time.perf_counter()
        self.current: tuple[str, float] | None = None
        self.record: dict[str, dict] = {}

    def start(self, name: str) -> None:
        self._close()
        self.bar.set_description(name)
        with contextlib.suppress(OSError):
            Path("/proc/self/clear_refs").write_text("5")
        self.current = (name, time.perf_counter())

    def finish(self) -> dict:
        self._close()
        return {"seconds": round(time.perf_counter() - self.started, 1),
                "peak_rss_bytes": max(stage["peak_rss_bytes"] for stage in self.record.values()),
                "stages": self.record}

    def _close(self) -> None:
        if self.current:
            name, began = self.current
            self.record[name] = {"seconds": round(time.perf_counter() - began, 1), "peak_rss_bytes": _peak_memory()}
            self.bar.update()
        self.current = None


def _peak_memory() -> int:
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
