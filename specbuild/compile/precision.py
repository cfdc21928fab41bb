"""Part of "writing engines" (pipeline.STAGES): the engine's numbers — its float type, its weight quantization
— and the conversion of one checkpoint tensor to the engine's float type, as the tensor is written.

An engine is fp32, fp16 or bf16 throughout: weights, activations and the KV cache inputs/outputs
`past_*`/`present_*` (they must be: GroupQueryAttention writes into the bound buffer in place, and a Cast
at the graph edge would break that). Logits are cast to fp32 before anything decides on them (argmax,
softmax, sampling), and every other float input/output (temperature, top_p, draft_probs, uniforms,
probs) is fp32 whatever the engine's type. onnxruntime's CPU provider runs fp32 and fp16 engines; it has
no bf16 MatMul, so a bf16 engine is checked with the ONNX checker here and runs only on a GPU provider.

Half-precision weights come straight from the checkpoint's own type, a slice of rows at a time: a bf16
or fp16 checkpoint never exists in fp32, not even one whole tensor of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np
import onnx_ir as ir

from ..errors import CheckpointError, UnsupportedModelError
from ..recipe import DEFAULT_ACCURACY_LEVEL, DEFAULT_BLOCK_SIZE

FLOAT_TYPES = {"fp32": np.dtype(np.float32), "fp16": np.dtype(np.float16), "bf16": np.dtype(ml_dtypes.bfloat16)}
CHUNK_BYTES = 16 << 20  # stored bytes read at a time: what converting or quantizing a tensor holds beside its result


@dataclass(frozen=True)
class Numerics:
    """How one engine computes: its float type and its weight quantization (see quantize.py). Built from
    settings recipe.py has checked (CompileSettings), so it checks nothing again."""

    precision: str = "fp32"
    quantization: str = "none"
    block_size: int = DEFAULT_BLOCK_SIZE
    accuracy_level: int = DEFAULT_ACCURACY_LEVEL

    @property
    def dtype(self) -> np.dtype:
        return FLOAT_TYPES[self.precision]

    @property
    def ir_type(self) -> ir.DataType:
        return ir.DataType.from_numpy(self.dtype)

    @property
    def bits(self) -> int:
        return {"int8": 8, "int4": 4}[self.quantization]


def precision_name(dtype: np.dtype) -> str:
    """fp32 / fp16 / bf16 (the manifest's names) for one of FLOAT_TYPES: an engine's type, or the one its checkpoint's
    weights are stored in, which load holds to these (load.WEIGHT_DTYPES)."""
    return next(name for name, known in FLOAT_TYPES.items() if dtype == known)


def convert_into(rows: np.ndarray, out: np.ndarray, plus_one: bool = False, name: str = "a weight") -> None:
    """Write a slice of a stored tensor (the weight `name`) into out, the engine's float type: numpy casts
    element by element on assignment, with no temporary copy of the slice. plus_one adds 1 first (Gemma's
    norms scale by 1 + w, added in fp32 as transformers does; those are 1-D and small)."""
    with np.errstate(over="ignore"):  # said below, in one line
        out[...] = rows.astype(np.float32) + 1.0 if plus_one else rows
    if all_finite(out):
        return
    refuse_non_finite(rows, name)
    # fp16 ends at 65504, bf16 and fp32 do not: a larger weight would be written as inf, and the engine would
    # then decode NaN logits (token 0 at every step) without a word; the cast itself warns only from fp32.
    largest = float(np.abs(rows.astype(np.float32)).max())
    raise UnsupportedModelError(f"{name} holds {largest:.4g}, beyond {precision_name(out.dtype)}'s largest number "
                                f"({float(ml_dtypes.finfo(out.dtype).max):.6g}); compile with --precision bf16 (or fp32)")


def refuse_non_finite(values: np.ndarray, name: str) -> None:
    """CheckpointError where a stored weight holds NaN or an infinity. No model is trained to hold one (a
    diverged run or a broken conversion wrote it), and its engine would decode NaN logits, token 0 at every
    step, without a word; a quantized one would decode whatever the quantizer made of it."""
    if all_finite(values):
        return
    what = "NaN" if np.isnan(values.astype(np.float32)).any() else "an infinite value"
    raise CheckpointError(f"{name} holds {what}: the checkpoint is damaged; save or download it again "
                          "(or train it again from a checkpoint without one)")


# The exponent bits of the 16-bit float types: all set for inf and NaN only.
EXPONENT_BITS = {np.dtype(np.float16): 0x7C00, np.dtype(ml_dtypes.bfloat16): 0x7F80}


def all_finite(values: np.ndarray) -> bool:
    """Whether a float array holds no NaN and no infinity. Each weight passes through here as it is written:
    for the 16-bit types the largest exponent field is compared, ~5x faster than numpy's isfinite on them
    (which converts each element first)."""
    exponent = EXPONENT_BITS.get(values.dtype)
    if exponent is None:
        return bool(np.isfinite(values).all())
    return values.size == 0 or int((values.view(np.uint16) & 0x7FFF).max()) < exponent
