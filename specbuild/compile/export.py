"""Stage 2b: turn one validated checkpoint into an ONNX engine file inside the bundle being built."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import onnx

from specbuild_runtime.manifest import EngineInfo

from ..errors import UnsupportedModelError
from .graphs import build_decoder
from .load import Checkpoint

VOCAB_TABLES = ("model.embed_tokens.weight", "lm_head.weight", "transformer.wte.weight")  # rows = tokens


def check_context(ckpt: Checkpoint, role: str, max_seq_len: int) -> None:
    spec = ckpt.spec
    if max_seq_len > spec.max_position_embeddings:
        raise UnsupportedModelError(
            f"--max-seq-len {max_seq_len} exceeds the {role}'s max_position_embeddings "
            f"({spec.max_position_embeddings}); use --max-seq-len {spec.max_position_embeddings} or less"
        )
    if spec.sliding_window and max_seq_len > spec.sliding_window:
        raise UnsupportedModelError(
            f"--max-seq-len {max_seq_len} exceeds the {role}'s sliding window ({spec.sliding_window}); "
            f"sliding-window attention is not built yet, so use --max-seq-len {spec.sliding_window} or less"
        )


def export_engine(ckpt: Checkpoint, role: str, folder: Path, max_seq_len: int, vocab_size: int) -> EngineInfo:
    """Writes {role}.onnx (+ {role}.onnx.data with the weights) and describes it.

    vocab_size: the target's; a larger table (a draft's padding rows) is cut to it, so the draft never
    proposes a token the target does not have and its q is a distribution over the shared vocabulary.
    """
    weights = {name: ckpt.tensor(name).astype(np.float32) for name in ckpt.tensor_names()}
    parameters = sum(w.size for name, w in weights.items() if not name.endswith("rotary_emb.inv_freq"))
    spec = ckpt.spec
    if spec.shape.vocab_size > vocab_size:
        spec = dataclasses.replace(spec, shape=dataclasses.replace(spec.shape, vocab_size=vocab_size))
        for name in VOCAB_TABLES:
            if name in weights:
                weights[name] = weights[name][:vocab_size]
    model = build_decoder(spec, weights, ckpt.config, max_seq_len)
    del weights
    file = f"{role}.onnx"
    # External data keeps the graph file small and lifts protobuf's 2 GB limit on large targets.
    onnx.save_model(model, folder / file, save_as_external_data=True, all_tensors_to_one_file=True,
                    location=f"{file}.data")
    onnx.checker.check_model(str(folder / file))
    return EngineInfo(
        role=role,
        backend="onnx",
        file=file,
        architecture=ckpt.spec.architecture,
        precision="fp32",
        quantization="none",
        shape=spec.shape,
        parameters=int(parameters),
        weight_bytes=(folder / f"{file}.data").stat().st_size,
        source={"path": str(ckpt.path.resolve()), "sha256": ckpt.digest()},
    )
