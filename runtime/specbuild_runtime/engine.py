"""One ONNX engine with its KV cache: allocated once for max_seq_len, bound in place with IO binding."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from .errors import BundleError
from .manifest import EngineInfo

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}


class Engine:
    """Runs one decoder call: feed tokens, get (accepted drafts, next token); the cache stays in place."""

    def __init__(self, path: Path, info: EngineInfo, max_seq_len: int, device: str = "cpu", threads: int = 0):
        self.info = info
        self.vocab_size = info.shape.vocab_size
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.log_severity_level = 3
        try:
            self.session = ort.InferenceSession(str(path), options, providers=[PROVIDERS[device]])
        except Exception as exc:  # onnxruntime raises its own untyped exceptions
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise BundleError(f"cannot load engine {path}: {first_line}; rebuild the bundle with `specbuild compile`") from None
        self.binding = self.session.io_binding()
        shape = info.shape
        kv_shape = (1, shape.num_kv_heads, max_seq_len, shape.head_dim)
        # Past and present name the same buffer: GroupQueryAttention writes new positions in place.
        self.cache = []
        for i in range(shape.num_layers):
            for kind in ("key", "value"):
                buffer = ort.OrtValue.ortvalue_from_shape_and_type(kv_shape, np.float32, device, 0)
                self.binding.bind_ortvalue_input(f"past_{kind}.{i}", buffer)
                self.binding.bind_ortvalue_output(f"present_{kind}.{i}", buffer)
                self.cache.append(buffer)
        self._accepted = np.zeros((), np.int64)
        self._next_token = np.zeros((), np.int64)
        self.binding.bind_ortvalue_output("accepted", ort.OrtValue.ortvalue_from_numpy(self._accepted))
        self.binding.bind_ortvalue_output("next_token", ort.OrtValue.ortvalue_from_numpy(self._next_token))

    def step(self, tokens: list[int], total_len: int, num_drafts: int = 0) -> tuple[int, int]:
        """Feed tokens at positions total_len-len(tokens)..total_len-1; the last num_drafts are drafts.

        Returns (how many drafts match this model's greedy choice, its greedy token after them).
        """
        ids = np.minimum(np.asarray(tokens, dtype=np.int64), self.vocab_size - 1)[None]
        self.binding.bind_cpu_input("input_ids", ids)
        self.binding.bind_cpu_input("total_len", np.array(total_len, dtype=np.int32))
        self.binding.bind_cpu_input("num_drafts", np.array(num_drafts, dtype=np.int64))
        self.session.run_with_iobinding(self.binding)
        return int(self._accepted), int(self._next_token)
