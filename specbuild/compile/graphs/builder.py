"""The graph under construction: nodes and inputs in onnx_ir, weights as lazy tensors.

A weight is never held here, only how to make it (`Weight`): which checkpoint tensors, read when the
engine file is written. onnx_ir's writer then streams the engine's external-data file one tensor at a
time: it evaluates a lazy tensor, writes it, and drops it before the next one (see export.py).
"""

from __future__ import annotations

import functools
import itertools
import threading
from dataclasses import dataclass
from typing import Callable

import numpy as np
import onnx_ir as ir

from ..load import Checkpoint
from ..precision import CHUNK_BYTES, Numerics, convert_into
from ..quantize import QUANTIZE_CHUNK_BYTES, QuantizedRows, quantize_rows

OPSET = 23  # RMSNormalization
IR_VERSION = 10  # onnxruntime 1.31 loads IR <= 13; onnx 1.23 would write 14
MS = "com.microsoft"


@dataclass(frozen=True)
class Weight:
    """A 2-D weight in torch's [out, in] layout, made from checkpoint tensors when it is written: the
    tensors `names` stacked along their first axis (q, k and v into one projection), cut to the first
    `rows` rows (a draft's table cut to the target's vocabulary), plus one (Gemma's norms scale by 1 + w),
    or transposed from a Conv1D's [in, out] (GPT-2); or, columns, the tensors side by side along their second axis
    (a mixture's experts' down projections, one [H, E·I] weight). A 1-D weight (a norm, a bias) is one row."""

    names: tuple[str, ...]
    rows: int | None = None
    plus_one: bool = False
    conv1d: bool = False
    columns: bool = False

    def shape(self, ckpt: Checkpoint) -> tuple[int, ...]:
        shapes = [ckpt.entry(name).shape for name in self.names]
        if len(shapes[0]) == 1:
            return (sum(s[0] for s in shapes),)
        if self.columns:
            return (shapes[0][0], sum(s[1] for s in shapes))
        if self.conv1d:
            shapes = [s[::-1] for s in shapes]
        rows = sum(s[0] for s in shapes)
        return (min(rows, self.rows or rows), shapes[0][1])

    def chunks(self, ckpt: Checkpoint, chunk_bytes: int = CHUNK_BYTES):
        """(start, stop, rows) over the whole weight, chunk_bytes of it at a time, each slice read straight
        from the one checkpoint tensor it lies in."""
        end = self.shape(ckpt)[0]
        if self.conv1d or len(self.shape(ckpt)) == 1:  # small: GPT-2's Conv1D weights, norms, biases
            yield 0, end, np.concatenate([ckpt.tensor(n).T if self.conv1d else ckpt.tensor(n) for n in self.names])
            return
        if self.columns:
            width = self.shape(ckpt)[1] * ckpt.entry(self.names[0]).dtype.itemsize
            step = max(1, chunk_bytes // width)
            for start in range(0, end, step):
                stop = min(start + step, end)
                yield start, stop, np.concatenate([ckpt.tensor(n, rows=(start, stop)) for n in self.names], axis=1)
            return
        offset = 0
        for name in self.names:
            entry = ckpt.entry(name)
            step = max(1, chunk_bytes // (entry.shape[1] * entry.dtype.itemsize))
            for start in range(0, min(entry.shape[0], end - offset), step):
                stop = min(start + step, entry.shape[0], end - offset)
                yield offset + start, offset + stop, ckpt.tensor(name, rows=(start, stop))
            offset += entry.shape[0]


def w(*names: str, **options) -> Weight:
    return Weight(tuple(names), **options)


class GraphBuilder:
    """Collects nodes, inputs, outputs and initializers; every op call returns its output value(s).

    `numerics` says how the engine computes (float type, quantization): the layer helpers read it.
    `progress(bytes)` is called as each lazy weight is made, to report the stream's speed.
    """

    def __init__(self, name: str, ckpt: Checkpoint, numerics: Numerics,
                 progress: Callable[[int], None] = lambda nbytes: None, parent: "GraphBuilder | None" = None):
        self.name, self.ckpt, self.numerics, self.progress = name, ckpt, numerics, progress
        self.nodes: list[ir.Node] = []
        self.inputs: list[ir.Value] = []
        self.outputs: list[ir.Value] = []
        # A branch (If subgraph) keeps its constants in the main graph and shares its name counter.
        self.initializers: dict[str, ir.Value] = parent.initializers if parent else {}
        self.used: set[str] = parent.used if parent else set()  # checkpoint tensors the graph reads
        self._counter = parent._counter if parent else itertools.count(1)
        self._is_branch = parent is not None

    def branch(self, name: str) -> "GraphBuilder":
        return GraphBuilder(name, self.ckpt, self.numerics, self.progress, parent=self)

    def graph(self) -> ir.Graph:
        return ir.Graph(
            self.inputs, self.outputs, nodes=self.nodes, name=self.name,
            initializers=[] if self._is_branch else list(self.initializers.values()),
            opset_imports=None if self._is_branch else {"": OPSET, MS: 1},
        )

    def model(self) -> ir.Model:
        return ir.Model(self.graph(), ir_version=IR_VERSION, producer_name="specbuild")

    def op(self, op_type: str, *inputs: ir.Value | None, outputs: int = 1, domain: str = "", name: str | None = None,
           **attrs) -> ir.Value | list[ir.Value]:
        node_name = name or f"{op_type}.{next(self._counter)}"
        node = ir.Node(domain, op_type, inputs, ir.convenience.convert_attributes(attrs), num_outputs=outputs,
                       name=node_name)
        for i, value in enumerate(node.outputs):
            value.name = f"{node_name}/out{i}"
        self.nodes.append(node)
        return node.outputs[0] if outputs == 1 else list(node.outputs)

    def input(self, name: str, dtype: ir.DataType, shape: list) -> ir.Value:
        value = ir.Value(name=name, type=ir.TensorType(dtype), shape=ir.Shape(shape))
        self.inputs.append(value)
        return value

    def output(self, value: ir.Value, name: str, dtype: ir.DataType, shape: list | None) -> None:
        """Make value a graph output called name (renamed if this graph makes it, else through an Identity)."""
        if value.name != name:
            if value.producer() in self.nodes:
                value.name = name
            else:
                value = self.op("Identity", value)
                value.name = name
        value.type, value.shape = ir.TensorType(dtype), None if shape is None else ir.Shape(shape)
        self.outputs.append(value)

    def const(self, values, dtype=np.int64) -> ir.Value:
        return self._initializer(f"const.{next(self._counter)}", WrittenWithErrno(np.asarray(values, dtype=dtype)))

    # -- weights (lazy): one initializer per weight and form, so a tied table is stored once ---------------

    def weight(self, weight: Weight) -> ir.Value:
        """The weight in the engine's float type."""
        name = _name(weight)
        self.used.update(weight.names)
        if name not in self.initializers:
            dtype = self.numerics.dtype
            shape = weight.shape(self.ckpt)

            def make() -> tuple[np.ndarray]:
                out = np.empty(shape, dtype)
                for start, stop, rows in weight.chunks(self.ckpt):
                    convert_into(rows, out[start:stop], weight.plus_one,
                                 f"weight {' / '.join(weight.names)} of {self.ckpt.path}")
                return (out,)

            self.computed([(name, self.numerics.ir_type, shape)], make)
        return self.initializers[name]

    def quantized(self, weight: Weight, table: bool = False) -> list[ir.Value]:
        """[packed weight, scales, zero points] of the weight quantized in blocks along its rows (see
        quantize.py): packed [N, blocks, blob] for MatMulNBits, or [N, blocks·blob] for
        GatherBlockQuantized (table=True).

        A weight asked for in both forms (a tied table) is stored once, in the form first asked for, and
        read in the other through a Reshape. The lookup comes first, so a tied head reads the table: at
        load onnxruntime folds the Reshape into a copy that MatMulNBits prepacks and drops, and the lookup
        goes on reading rows of the mapped file (a Reshape of the head's form would keep its copy)."""
        name = _name(weight)
        self.used.update(weight.names)
        n, k = weight.shape(self.ckpt)
        q = QuantizedRows(n, k, self.numerics.bits, self.numerics.block_size)
        form = (n, q.blocks * q.blob) if table else (n, q.blocks, q.blob)
        packed, scales, zero_points = self.computed(
            [(f"{name}.q{q.bits}", ir.DataType.UINT8, form),
             (f"{name}.scales", self.numerics.ir_type, (n, q.blocks)),
             (f"{name}.zero_points", ir.DataType.UINT8, q.zero_point_shape)],
            lambda: self._quantize(weight, q),
        )
        if tuple(packed.shape) != form:
            packed = self.op("Reshape", packed, self.const(list(form)))
        return [packed, scales, zero_points]

    def _quantize(self, weight: Weight, q: QuantizedRows) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        packed, scales, zero_points = q.empty()
        for start, stop, rows in weight.chunks(self.ckpt, QUANTIZE_CHUNK_BYTES):
            quantize_rows(rows, q, packed[start:stop], scales[start:stop], zero_points[start:stop],
                          f"weight {' / '.join(weight.names)} of {self.ckpt.path}")
        return packed, scales.astype(self.numerics.dtype), zero_points

    def computed(self, tensors: list[tuple[str, ir.DataType, tuple]], compute: Callable[[], tuple]) -> list[ir.Value]:
        """Initializers (name, type, shape) made together by one computation when the engine is written
        (numpy arrays, in that order): held only until each has been written."""
        if tensors[0][0] not in self.initializers:
            once = _Once(compute, parts=len(tensors))

            def part(index: int) -> ir.Tensor:
                array = np.ascontiguousarray(once.take(index)).reshape(tensors[index][2])
                self.progress(array.nbytes)
                return WrittenWithErrno(array)

            for index, (name, dtype, shape) in enumerate(tensors):
                self._initializer(name, ir.LazyTensor(functools.partial(part, index), dtype, ir.Shape(shape)))
        return [self.initializers[name] for name, _, _ in tensors]

    def _initializer(self, name: str, tensor) -> ir.Value:
        value = ir.Value(name=name, type=ir.TensorType(tensor.dtype), shape=tensor.shape, const_value=tensor)
        self.initializers[name] = value
        return value


def _name(weight: Weight) -> str:
    extra = f"(+{len(weight.names) - 1})" if len(weight.names) > 1 else ""
    return weight.names[0] + extra + ("+1" if weight.plus_one else "") + (f"[:{weight.rows}]" if weight.rows else "")


class WrittenWithErrno(ir.Tensor):
    """An ir.Tensor that onnx_ir writes with the file's own write. ir.Tensor's tofile is numpy's, which says a
    short write without its errno ("N requested and M written"), so a full disk, a quota and a file system's
    size limit (EFBIG) could not be told apart, and which drops the failure of its last buffered bytes (a
    400-byte tensor onto /dev/full raised nothing). The file's write raises OSError with the errno, and a tail
    it buffers fails at its flush or close, which onnx_ir does not swallow."""

    def tofile(self, file) -> None:
        file.write(np.ascontiguousarray(self.numpy()).reshape(-1).view(np.uint8).data)


class _Once:
    """A computation whose `parts` results are written as separate tensors: computed when one is first
    asked for, forgotten once each has been taken (so it is held only while its tensors are written)."""

    def __init__(self, compute: Callable[[], tuple], parts: int):
        self._compute, self._parts = compute, parts
        self._result, self._taken = None, set()
        self._lock = threading.Lock()  # the writer may make tensors on several threads

    def take(self, index: int):
        with self._lock:
            if self._result is None:
                self._result, self._taken = self._compute(), set()
            part = self._result[index]
            self._taken.add(index)
            if len(self._taken) == self._parts:
                self._result = None
            return part
