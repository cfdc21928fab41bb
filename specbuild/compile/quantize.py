"""Part of "writing engines" (pipeline.STAGES): weight quantization, one tensor at a time, with onnxruntime's
own block quantizer kernels.

The graph builders emit the quantized nodes directly (graphs/layers.py); this module makes their weights
as the engine file is written, a slice of rows at a time, so a quantized compile keeps the streaming
memory bound. Policy (weights only; activations, norms, rotary tables and the KV cache keep the
engine's float type):

    mode    linear layers and the LM head            embedding lookup
    int4    MatMulNBits, 4 bit                       GatherBlockQuantized, 4 bit (even blocks a row, else float)
    int8    MatMulNBits, 8 bit                       GatherBlockQuantized, 8 bit
    none    Gemm in the engine's float type          Gather in the engine's float type

    A mixture of experts' experts are linear layers like the others (graphs/layers.mixture_of_experts: all experts'
    gate and up rows one weight, their down projections another); its router stays in the float type.

  * Blocks run along each output row's inputs (K), `block_size` (default 32) values each; asymmetric:
    a scale and a uint8 zero point per block, packed as MatMulNBits expects ([N, blocks, blob]). The
    numbers come from onnxruntime's C++ quantizer (`quantize_matmul_4bits` / `_8bits`), the kernels its
    MatMulNBitsQuantizer calls. Each row's blocks are independent, so quantizing a slice of rows gives
    the same bits as quantizing the whole tensor.
  * The embedding table is quantized the same way and stored as [V, blocks·blob] uint8, the form
    GatherBlockQuantized reads (blocks along H). A tied table (the LM head is the embedding) is stored
    once: the head's MatMulNBits reads it through a Reshape (graphs/builder.py, GraphBuilder.quantized).
    (An int8 lookup used to keep the float table beside the head's 8-bit copy, and int4 stored a tied
    table twice: a Qwen3-0.6B-shaped int8 bundle was larger than its fp16 one.)
  * MatMulNBits pads K up to a multiple of block_size, so any hidden size works; block_size is a power
    of two from 16 to 256 (onnxruntime's quantizer kernels take no other). GatherBlockQuantized returns
    the padded rows, and a Slice cuts them to H. At 4 bit a row of an odd number of blocks keeps the float
    table: onnxruntime's CUDA kernel reads 4-bit zero points as one run, not row by row (graphs/layers.py).
  * accuracy_level is MatMulNBits' compute type, default 4 (int8 compute, activations quantized per row
    and block). It is the fast one on this AVX2 CPU: an int4 target decodes 2.2x faster than at level 0
    (fp32 compute, slower than the fp32 model here). Row by row it is as exact as level 0: MatMulNBits
    at any level gives a row the same bits in every call of an even number of rows (a one-row call, and at
    level 4 with large blocks an odd call's last row, are computed apart), and the runtime's target calls
    on the CPU are even (specbuild_runtime.slot.NEVER_ALONE), so speculative output equals the quantized
    target's own greedy output bit for bit at either level. (Without that rule level 4 was
    the risky one: a one-row call differs by ~1e-6 before rounding and int8 rounding turned it into
    logit jumps of up to ~1e-2.)
  * 8 bit MatMulNBits at level 0 runs a slow fallback on this CPU (~8x slower than fp32); at level 4 an
    int8 target decodes about as fast as fp32 here, at 44% of the size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .precision import refuse_non_finite

# Rows quantized per kernel call: onnxruntime's kernel walks the [k, m] layout column by column, and ran
# 2x faster on 2 MB slices than on 64 MB ones here (45 vs 22 M parameters/s).
QUANTIZE_CHUNK_BYTES = 2 << 20


@dataclass(frozen=True)
class QuantizedRows:
    """The quantized form of an [n, k] weight: n rows of k inputs, in blocks of block_size."""

    n: int
    k: int
    bits: int
    block_size: int

    @property
    def blocks(self) -> int:
        return -(-self.k // self.block_size)

    @property
    def blob(self) -> int:
        return self.block_size * self.bits // 8

    @property
    def zero_point_shape(self) -> tuple[int, int]:
        return self.n, -(-self.blocks * self.bits // 8)

    def empty(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Zeroed (packed, scales, zero points) for quantize_rows to fill."""
        return (np.zeros((self.n, self.blocks, self.blob), np.uint8), np.zeros((self.n, self.blocks), np.float32),
                np.zeros(self.zero_point_shape, np.uint8))


def quantize_rows(rows: np.ndarray, q: QuantizedRows, packed: np.ndarray, scales: np.ndarray,
                  zero_points: np.ndarray, name: str = "a weight") -> None:
    """Quantize rows [m, k] (any float type) of the weight `name` into the matching slices of
    packed/scales/zero_points."""
    from specbuild_runtime.engine import ort

    rows = rows.astype(np.float32, copy=False)
    # The kernel turns a NaN into ordinary numbers (a 4-bit engine then decodes text transformers never would).
    refuse_non_finite(rows, name)

    kernels = ort.capi._pybind_state
    kernel = kernels.quantize_matmul_4bits if q.bits == 4 else kernels.quantize_matmul_8bits
    # The kernel takes the [k, m] (MatMul) layout in fp32; the tail of a last, partial block stays as the
    # caller zeroed it (QuantizedRows.empty), as with onnxruntime's MatMulNBitsQuantizer.
    kernel(packed, np.ascontiguousarray(rows.T), scales, zero_points, q.block_size, rows.shape[0], q.k, False)
