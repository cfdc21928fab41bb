"""The stage "writing engines" (pipeline.STAGES): write one checkpoint as an ONNX engine inside the bundle
being built, streaming its weights.

The graph holds lazy tensors (graphs/builder.py); onnx_ir's writer evaluates them one at a time,
appends each to `{role}.onnx.data` and drops it, so the memory a compile needs is set by its largest
tensor, not by the model (onnx_ir 1.1+: `ir.save` with external data writes tensor by tensor).
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import onnx
import onnx_ir as ir

from specbuild_runtime.errors import SpecbuildError
from specbuild_runtime.manifest import SAMPLER, EngineInfo

from .. import progress
from .graphs import build_decoder, build_draft_steps, build_sampler, engine_vocab
from .graphs.verification import NOT_FINITE
from .load import Checkpoint
from .precision import Numerics, precision_name

# Large tensors start at a multiple of 64 KiB in the data file, so onnxruntime can map them from the
# file instead of copying them (it maps external data only at an allocation-granularity offset).
ALIGNMENT = 1 << 16
# Two writer threads: one makes the next tensor (numpy casts and onnxruntime's quantizer release the GIL)
# while the other writes one; the tensors made and not yet written stay within IN_FLIGHT_BYTES (plus
# one larger than that, alone).
WORKERS = 2
IN_FLIGHT_BYTES = 256 << 20


def export_engine(ckpt: Checkpoint, role: str, folder: Path, max_seq_len: int, numerics: Numerics,
                  vocab_size: int | None = None, draft_steps: int = 0, tokens: int | None = None,
                  rope_switch: int = 0, fixed_rows: int = 0) -> EngineInfo:
    """Writes {role}.onnx (+ {role}.onnx.data with the weights), {role}.greedy.onnx, the greedy-only graph
    over the same data file, and (draft_steps > 0) {role}.steps.onnx, which drafts that many tokens in one
    call, over it too; and describes them.

    vocab_size: the target's; a larger table (a draft's padding rows) is cut to it, so the draft never
    proposes a token the target does not have and its q is a distribution over the shared vocabulary; a
    smaller one embeds the target's tokens past it as its last row (graphs._embeddable). tokens: a draft's
    only, the tokenizer's ids, to which its table is cut as well (graphs.engine_vocab).
    rope_switch: a LongRoPE target's original length, below max_seq_len (load.rope_switch_length): both
    rotary tables, chosen per call (manifest: rope_switch_length).
    fixed_rows: a target's max γ + 1, the rows of its calls on a GPU, all of which its LM head then multiplies
    (graphs.build_decoder).
    A bar per engine shows bytes/s and ETA (where progress shows: progress.shown).
    """
    spec = ckpt.spec
    vocab = engine_vocab(ckpt, vocab_size, tokens)
    file = f"{role}.onnx"
    # The checkpoint's digest reads every weight file once more: on a thread of its own it overlaps the
    # stream (hashlib and file reads release the GIL) instead of adding to it.
    with ThreadPoolExecutor(1) as pool, progress.bar(None, f"writing {role} ({numerics.precision}, {numerics.quantization})",
                                                     "B", unit_scale=True) as bar:
        digest = pool.submit(ckpt.digest)
        model = build_decoder(ckpt, numerics, max_seq_len, vocab_size, progress=bar.update, tokens=tokens,
                              rope_switch=rope_switch, penalties=role == "target", fixed_rows=fixed_rows)
        bar.total = sum(value.const_value.nbytes for value in model.graph.initializers.values()
                        if isinstance(value.const_value, ir.LazyTensor))
        gathered = _gathered_bytes(model)
        try:
            ir.save(model, folder / file, external_data=f"{file}.data", alignment=ALIGNMENT, max_workers=WORKERS,
                    max_in_flight_bytes=IN_FLIGHT_BYTES)
        except ir.serde.SerdeError as exc:
            if (own := _checkpoints_error(exc)) is None:
                raise  # a bug: raised as it is, so that specbuild --debug shows what raised inside it
            raise own from None
    graphs = {f"{role}.greedy.onnx": build_decoder(ckpt, numerics, max_seq_len, vocab_size, sampling=False, tokens=tokens,
                                                   rope_switch=rope_switch, fixed_rows=fixed_rows)}
    if draft_steps:
        graphs[f"{role}.steps.onnx"] = build_draft_steps(ckpt, numerics, max_seq_len, draft_steps, vocab_size, tokens)
    for name, model in graphs.items():
        _write_sharing_weights(model, folder / file, folder / name)
    for written in (file, *graphs):
        onnx.checker.check_model(str(folder / written))
    weight_bytes = (folder / f"{file}.data").stat().st_size
    return EngineInfo(
        role=role,
        backend="onnx",
        file=file,
        greedy_file=f"{role}.greedy.onnx",
        steps_file=f"{role}.steps.onnx" if draft_steps else "",
        architecture=spec.architecture,
        precision=numerics.precision,
        quantization=numerics.quantization,
        shape=dataclasses.replace(spec.shape, vocab_size=vocab),
        parameters=ckpt.parameters(),
        weight_bytes=weight_bytes,
        read_bytes=weight_bytes - gathered,
        not_finite_token=NOT_FINITE,
        source={"path": str(ckpt.path.resolve()), "sha256": digest.result()},
        source_dtype=precision_name(ckpt.float_dtype()),
        rope_switch_length=rope_switch,
    )


def _checkpoints_error(exc: ir.serde.SerdeError) -> SpecbuildError | None:
    """What a weight's computation raised, out of the SerdeErrors onnx_ir wraps it in where it writes the weight
    into the graph's file itself (one of at most 256 bytes: a tiny model's norm, Qwen3's q and k norms in fp16):
    a NaN weight was reported as a bug in specbuild, not as the checkpoint's. None where it raised no SpecbuildError."""
    cause: BaseException | None = exc
    while isinstance(cause, ir.serde.SerdeError):
        cause = cause.__cause__
    return cause if isinstance(cause, SpecbuildError) else None


def _gathered_bytes(model: ir.Model) -> int:
    """Bytes of the weights a call only gathers rows from (Gather's data; GatherBlockQuantized's data, scales
    and zero points): a call reads a few rows of them, not all."""
    def gathered(use) -> bool:
        return use.node.op_type in ("Gather", "GatherBlockQuantized") and use.idx != 1  # input 1: the indices
    return sum(value.const_value.nbytes for value in model.graph.initializers.values()
               if value.uses() and all(gathered(use) for use in value.uses()))


def write_sampler(folder: Path) -> str:
    """Writes the bundle's sampler (manifest.SAMPLER), with which decoders running the greedy-only graphs sample."""
    ir.save(build_sampler(), folder / SAMPLER)
    onnx.checker.check_model(str(folder / SAMPLER))
    return SAMPLER


def _write_sharing_weights(model: ir.Model, written: Path, path: Path) -> None:
    """Save model (built from the same checkpoint as the engine at `written`) with every weight read from
    that engine's data file: a second graph costs no weight bytes on disk, and none are made again."""
    weights = ir.load(written).graph.initializers  # external tensors: references, nothing is read
    for name, value in model.graph.initializers.items():
        if isinstance(value.const_value, ir.LazyTensor):
            value.const_value = weights[name].const_value
    ir.save(model, path)  # external tensors keep their file and offset
