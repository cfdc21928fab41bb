"""`specbuild compile` as a straight line of stages: load & validate -> write each engine, its weights
streamed (read, converted or quantized, and written one tensor at a time) -> measure quantized engines ->
check each engine with onnxruntime -> write the bundle."""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from tqdm import tqdm

from specbuild_runtime.engine import session_options
from specbuild_runtime.errors import SpecbuildError, first_line
from specbuild_runtime.manifest import TOKENIZER_CONFIG, TOKENIZER_DIR, EngineInfo, Manifest, cache_names

from .. import __version__
from ..errors import CheckpointError, SettingsError
from ..progress import bar, shown, steps
from ..staging import scratch_folder
from ..recipe import DEFAULT_MAX_SEQ_LEN, CompileSettings
from . import tensorrt_llm
from .bundle import staged_bundle, write_manifest
from .export import export_engine, write_sampler
from .graphs import check_every_tensor_used, unprocessed
from .graphs.verification import NOT_FINITE
from .load import (Checkpoint, check_context, eos_token_ids, load_checkpoint, longest_context, rope_switch_length,
                   sampling_defaults, validate_pair)
from .precision import DEFAULT_ACCURACY_LEVEL, Numerics
from .quality import measure_quality, quality_texts


def compile_bundle(settings: CompileSettings, show_progress: bool | None = None) -> Manifest:
    """show_progress None: progress bars on a terminal only (build logs stay clean)."""
    stages = len(STAGES) - (settings.backend == "onnx")  # an ONNX-only compile writes no TensorRT-LLM checkpoints
    with shown(show_progress), bar(stages, "", "stage") as stage_bar:
        return _compile(settings, _Stages(stage_bar))


# Tokens the draft's steps graph drafts per call (a round of more drafts makes more calls, of fewer adds
# single steps): the fixed γ that decoded fastest on the H100 layer pair (README, GPU) and the demo pair.
DRAFT_STEPS = 4
STAGES = ("loading checkpoints", "writing engines", "measuring quantized engines", "checking each engine",
          "writing TensorRT-LLM checkpoints", "writing the bundle")


def _compile(settings: CompileSettings, stages: "_Stages") -> Manifest:
    stages.start("loading checkpoints")
    target = load_checkpoint(settings.target, "target")
    draft = load_checkpoint(settings.draft, "draft")
    validate_pair(target, draft)
    limits = [longest_context(target, "target"), longest_context(draft, "draft")]
    if settings.backend != "onnx":  # a window the export does not carry refuses a longer context (check_exportable)
        limits += [window for ckpt in (target, draft) if (window := tensorrt_llm.sliding_window(ckpt))]
    context_limit = min(limits)
    max_seq_len = _max_seq_len(settings, context_limit)
    for role, ckpt in (("target", target), ("draft", draft)):
        check_context(ckpt, role, max_seq_len)
        check_every_tensor_used(ckpt, role, max_seq_len)
    checkpoints: dict[str, Checkpoint] = {"target": target, "draft": draft}
    numerics = {role: Numerics(settings.precision, settings.quantization(role), settings.block_size,
                               DEFAULT_ACCURACY_LEVEL if settings.accuracy_level is None else settings.accuracy_level)
                for role in checkpoints}
    if settings.backend != "onnx":  # refused now rather than after the ONNX engines
        tensorrt_llm.check_pair(target, draft, max_seq_len, settings.tp, numerics, settings.backend)
    eos = eos_token_ids(target)  # read before the long stages: a malformed file fails here
    onnx = settings.backend != "tensorrt-llm"
    measured = onnx and settings.quality_report and any(n.quantization != "none" for n in numerics.values())
    texts = quality_texts(target.tokenizer) if measured else None

    with staged_bundle(settings.output, settings.overwrite, settings.inputs()) as folder:
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
            measure_quality(folder, scratch, engines, checkpoints, max_seq_len, texts, eos)

        stages.start("checking each engine")
        graphs = [(file, info) for info in engines.values() for file in (info.file, info.greedy_file, info.steps_file) if file]
        # each one loaded and (fp32) run: at 7B, seconds to a minute apiece
        for file, info in steps(graphs, "checking the engines' graphs", "graph"):
            check_engine(folder / file, info, max_seq_len)
        if sampler:
            check_sampler(folder / sampler, engines["target"].shape.vocab_size)

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


def created_by() -> str:
    """The manifest's created_by: the transformers version too, since the bundle's tokenizer encodes prompts as
    that version does (transformers 5 rebuilds Llama 2's pre-tokenizer and adds Phi-3's BOS, where 4.57 did not)."""
    import importlib.metadata

    return f"specbuild {__version__} (transformers {importlib.metadata.version('transformers')})"


def save_tokenizer(tokenizer, folder: Path) -> None:
    """The target's tokenizer files, loadable by transformers 4 as well as 5.

    transformers 5 saves a plain tokenizers-backed tokenizer (what Llama 3 and others name
    PreTrainedTokenizerFast) as "TokenizersBackend", a class transformers 4 does not have, and TensorRT-LLM's
    examples/run.py (run.sh), on the transformers 4.57 TensorRT-LLM pins, then refuses the folder. Both
    versions load such a tokenizer by its old name; the runtime reads tokenizer.json alone.

    transformers 5 also saves the additional special tokens (Qwen's <|im_start|>, Gemma's <start_of_turn>,
    Mistral's empty list) as an "extra_special_tokens" list, where transformers 4 reads that key as a dict of
    named tokens and fails on a list ('list' object has no attribute 'keys'); both read the list under
    "additional_special_tokens", transformers 4's name for it."""
    tokenizer.save_pretrained(folder)
    path = folder / TOKENIZER_CONFIG
    # UTF-8, as transformers writes it, whatever the locale (the C locale without UTF-8 mode reads ASCII)
    saved = json.loads(path.read_bytes())
    config = dict(saved)
    if config.get("tokenizer_class") == "TokenizersBackend":
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
    if isinstance(config.get("extra_special_tokens"), list):
        config["additional_special_tokens"] = config.pop("extra_special_tokens")
    if config != saved:
        path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def check_engine(path: Path, info: EngineInfo, max_seq_len: int) -> None:
    """Prove the engine loads, and runs, before the bundle is published: onnxruntime's CPU provider loads
    an fp32 or fp16 engine graph (a kernel for every node, every weight where the file says), and runs an
    fp32 one (quantized or not) for a one-token prefill fed as specbuild_runtime.manifest's I/O contract
    says (the greedy-only graph: the inputs it has).
    A bf16 engine passed the ONNX checker when it was written; the CPU provider cannot even load it.

    fp16 engines are loaded, not run. The CPU provider has no fp16 (or bf16) Gemm: it casts
    each weight to fp32 on its way through, and onnxruntime keeps most of those casts alive at once
    (measured: a 1.2 GB fp16 engine peaked at 3.6 GB, 2.2 GB in priority order), beyond the compile's
    memory bound. They are for GPUs; the test suite decodes small fp16 bundles end to end. Graph
    optimizations are off, so loading maps the weights without reading them (and does not fold an fp32
    copy of every fp16 weight), and so is prepacking, which copies every weight into the kernels' own
    layout: worth it for the thousands of calls of decoding, not for one.
    """
    if info.precision == "bf16":
        return
    options = session_options()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.add_session_config_entry("session.disable_prepacking", "1")
    shape, vocab = info.shape, info.shape.vocab_size
    try:
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        if info.precision != "fp32":
            return
        cache = np.zeros((1, shape.num_kv_heads, max_seq_len, shape.head_dim), np.float32)
        feeds = {
            "input_ids": np.zeros((1, 1), np.int64), "seqlens_k": np.zeros(1, np.int32), "total_len": np.array(1, np.int32),
            "num_drafts": np.array(0, np.int64), "temperature": np.array(0, np.float32), "top_k": np.array(0, np.int64),
            "top_p": np.array(1, np.float32), "min_p": np.array(0, np.float32),
            "draft_probs": np.zeros((0, vocab), np.float32), "uniforms": np.zeros(1, np.float32),
            "long_rope": np.array(0, np.int64), **unprocessed(vocab),
            **{past: cache for past, _ in cache_names(shape.num_layers)},
        }
        feeds.update({i.name: np.array(1 + int(i.name.split(".")[1]), np.int32) for i in session.get_inputs()
                      if i.name.startswith("total_len.")})  # a steps graph's later steps
        steps = any(o.name == "drafts" for o in session.get_outputs())
        outputs = session.run(["drafts"] if steps else ["accepted", "next_token"],
                              {i.name: feeds[i.name] for i in session.get_inputs()})
    except Exception as exc:  # onnxruntime raises its own untyped errors
        raise SpecbuildError(f"the {info.role} engine {path.name} was written but fails to load or run ({first_line(exc)}); "
                             "this is a specbuild bug, please report it") from None
    tokens = outputs[0].tolist() if steps else [int(outputs[1])]
    if NOT_FINITE in tokens:
        raise CheckpointError(f"the {info.role} engine {path.name} computes logits that are NaN or infinite for a one-token "
                              f"prompt: the {info.role} checkpoint's numbers overflow {info.precision}; check it with "
                              "transformers")
    if (not steps and outputs[0] != 0) or not all(0 <= token < vocab for token in tokens):
        said = f"drafts={tokens}" if steps else f"accepted={outputs[0]}, next_token={outputs[1]}"
        raise SpecbuildError(f"the {info.role} engine {path.name} returned {said} for a one-token prefill; this is a "
                             "specbuild bug, please report it")


def _draft_steps(gamma: int) -> int:
    """Tokens the draft's steps graph drafts a call (0: no steps graph, where γ allows no more than one)."""
    steps = min(DRAFT_STEPS, gamma)
    return steps if steps >= 2 else 0


def check_sampler(path: Path, vocab: int) -> None:
    """Prove the sampler runs before the bundle is published: one call judging a draft of token 0 that the
    target gives no mass (rejected), then drawing from the rest."""
    logits = np.zeros((2, vocab), np.float32)
    logits[:, 0] = -np.inf
    feeds = {"logits": logits, "input_ids": np.zeros((1, 2), np.int64), "num_drafts": np.array(1, np.int64),
             "temperature": np.array(1, np.float32), "top_k": np.array(0, np.int64), "top_p": np.array(1, np.float32),
             "min_p": np.array(0, np.float32), "draft_probs": np.eye(1, vocab, dtype=np.float32),
             "uniforms": np.full(2, 0.5, np.float32), **unprocessed(vocab)}
    try:
        session = ort.InferenceSession(str(path), session_options(), providers=["CPUExecutionProvider"])
        accepted, next_token = session.run(["accepted", "next_token"], feeds)
    except Exception as exc:  # onnxruntime raises its own untyped errors
        raise SpecbuildError(f"the sampler {path.name} was written but fails to load or run ({first_line(exc)}); "
                             "this is a specbuild bug, please report it") from None
    if accepted != 0 or not 0 < next_token < vocab:
        raise SpecbuildError(f"the sampler {path.name} returned accepted={accepted}, next_token={next_token} for a "
                             "draft without mass; this is a specbuild bug, please report it")


def _max_seq_len(settings: CompileSettings, context_limit: int) -> int:
    # The default stops where check_context would refuse a longer one (a short draft, a LongRoPE target's original
    # length, a window transformers' cache keeps)
    max_seq_len = settings.max_seq_len or min(DEFAULT_MAX_SEQ_LEN, context_limit)
    if settings.gamma >= max_seq_len:  # a round of γ drafts and the target's token must fit in the context
        raise SettingsError(f"gamma {settings.gamma} drafts a round but the context holds {max_seq_len} tokens; "
                            f"give a max_seq_len above {settings.gamma}, or a smaller gamma")
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
