"""One ONNX engine with its KV cache: allocated once for max_seq_len, bound in place with IO binding."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from .errors import BundleError
from .manifest import EngineInfo

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}
MAX_REUSED_IDS = 64  # calls of up to this many tokens (drafting, verifying) reuse one buffer per length
CACHE_TYPES = {"fp32": np.float32, "fp16": np.float16}  # bf16 caches need a GPU binding numpy cannot express


def can_run(info: EngineInfo) -> bool:
    """Whether this runtime runs the engine: numpy has no bf16 to bind a bf16 engine's cache with."""
    return info.precision in CACHE_TYPES


def use_shared_thread_pool() -> bool:
    """Make every onnxruntime session in this process share one intra-op thread pool (opt-in).

    Fastest for a process that only decodes: the draft and the target run one after the other and
    one pool serves both (measured on 2 cores, demo pair: target-only 333 vs 273 tok/s, speculative
    744 vs 616 tok/s). It changes the whole process: must run before its first onnxruntime session, and
    every later session must set `use_per_session_threads = False`. False if it came too late.
    """
    global _SHARED_POOL
    if _SHARED_POOL is None:
        try:
            ort.capi._pybind_state.set_global_thread_pool_sizes(0, 1)  # 0: one thread per core
            _SHARED_POOL = True
        except Exception:  # an onnxruntime environment exists already
            _SHARED_POOL = False
    return _SHARED_POOL


_SHARED_POOL: bool | None = None


class Engine:
    """Runs one decoder call: feed tokens, get (accepted drafts, next token); the cache stays in place.

    A target never computes a row alone. onnxruntime's CPU kernels (MatMul, MatMulNBits at every
    accuracy level) give a row bitwise the same result in any call of two or more rows, but a different
    one (~1e-6, amplified to ~1e-2 by int8 compute) in a call of one. Verification runs many rows, and
    decoding without drafts one, so a one-token target call also re-feeds the token before it, which
    rewrites that position's cache with the same bits; the graph's head likewise runs on two rows or more.
    Then what the target says does not depend on how its rows were grouped into calls, and speculative
    output equals target-only output by construction (tests/test_quantize.py checks the bits). The
    first call of a one-token prompt has no row before it; the next call re-feeds that row instead.
    """

    def __init__(self, path: Path, info: EngineInfo, max_seq_len: int, device: str = "cpu",
                 model_bytes: bytes | None = None, extra_outputs: tuple[str, ...] = ()):
        """model_bytes: an in-memory variant of the engine file (e.g. with extra outputs to measure
        with) whose external weights stay next to `path`."""
        self.info = info
        self.vocab_size = info.shape.vocab_size
        if not can_run(info):
            raise BundleError(f"engine {path} is {info.precision}; this runtime runs {', '.join(CACHE_TYPES)} engines")
        options = ort.SessionOptions()
        if _SHARED_POOL:
            options.use_per_session_threads = False
        else:
            # Each engine has its own pool: stop its threads spinning once a call returns, or they steal
            # the cores from the other engine (speculative decoding measured 1.6x slower without this).
            options.add_session_config_entry("session.force_spinning_stop", "1")
        options.log_severity_level = 3
        source = str(path)
        if model_bytes is not None:
            options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(Path(path).parent))
            source = model_bytes
        try:
            self.session = ort.InferenceSession(source, options, providers=[PROVIDERS[device]])
        except Exception as exc:  # onnxruntime raises its own untyped exceptions
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise BundleError(f"cannot load engine {path}: {first_line}; rebuild the bundle with `specbuild compile`") from None
        self.binding = self.session.io_binding()
        self.extra_outputs = extra_outputs
        shape = info.shape
        kv_shape = (1, shape.num_kv_heads, max_seq_len, shape.head_dim)
        # Past and present name the same buffer: GroupQueryAttention writes new positions in place.
        self.cache = []
        for i in range(shape.num_layers):
            for kind in ("key", "value"):
                buffer = ort.OrtValue.ortvalue_from_shape_and_type(kv_shape, CACHE_TYPES[info.precision], device, 0)
                self.binding.bind_ortvalue_input(f"past_{kind}.{i}", buffer)
                self.binding.bind_ortvalue_output(f"present_{kind}.{i}", buffer)
                self.cache.append(buffer)
        # Per-call inputs live in buffers bound once and written in place: binding fresh numpy arrays
        # every call cost ~100 us, a third of a draft step.
        self._total_len = self._bound_input("total_len", np.zeros((), np.int32))
        self._seqlens_k = self._bound_input("seqlens_k", np.zeros(1, np.int32))  # total_len - 1
        self._num_drafts = self._bound_input("num_drafts", np.zeros((), np.int64))
        self._input_ids: dict[int, tuple[np.ndarray, ort.OrtValue]] = {}  # tokens per call -> buffer
        self._bound_ids = 0
        self._never_alone = info.role == "target"  # a draft's rows only decide acceptance: it keeps its speed
        self._fed = np.zeros(max_seq_len, np.int64)  # the token at each cache position, to re-feed one
        self._alone: int | None = None  # the position of a row computed alone, while it is the last one
        self._accepted = np.zeros((), np.int64)
        self._next_token = np.zeros((), np.int64)
        self.binding.bind_ortvalue_output("accepted", ort.OrtValue.ortvalue_from_numpy(self._accepted))
        self.binding.bind_ortvalue_output("next_token", ort.OrtValue.ortvalue_from_numpy(self._next_token))
        # The distribution the next token was sampled from ([V] when sampling, [0] when greedy).
        self.probs = np.zeros(self.vocab_size, np.float32)
        self._probs_value = ort.OrtValue.ortvalue_from_numpy(self.probs)
        self._no_probs = ort.OrtValue.ortvalue_from_numpy(np.zeros(0, np.float32))
        self._no_drafts = np.zeros((0, self.vocab_size), np.float32)
        self.configure(temperature=0.0)

    def configure(self, temperature: float, top_k: int = 0, top_p: float = 1.0) -> None:
        """Greedy at temperature 0; otherwise sampling from softmax(logits/temperature) within top-k/top-p."""
        self.sampling = temperature > 0
        self.binding.bind_cpu_input("temperature", np.array(temperature, dtype=np.float32))
        self.binding.bind_cpu_input("top_k", np.array(top_k, dtype=np.int64))
        self.binding.bind_cpu_input("top_p", np.array(top_p, dtype=np.float32))
        self.binding.bind_ortvalue_output("probs", self._probs_value if self.sampling else self._no_probs)
        self.binding.bind_cpu_input("draft_probs", self._no_drafts)
        self.binding.bind_cpu_input("uniforms", np.zeros(1, np.float32))

    def step(self, tokens: list[int], total_len: int, num_drafts: int = 0,
             draft_probs: np.ndarray | None = None, uniforms: np.ndarray | None = None) -> tuple[int, int]:
        """Feed tokens at positions total_len-len(tokens)..total_len-1; the last num_drafts are drafts.

        Greedy: returns (how many drafts equal this model's argmax, its argmax after them). Sampling:
        draft_probs [num_drafts, V] are the draft's distributions and uniforms [num_drafts+1] the random
        numbers; returns (accepted drafts, the token sampled after them), with `probs` its distribution.
        """
        start = total_len - len(tokens)
        if self._never_alone and start > 0 and (len(tokens) == 1 or self._alone == start - 1):
            start -= 1
            tokens = [int(self._fed[start]), *tokens]
        self._alone = start if len(tokens) == 1 else None
        self._fed[start:total_len] = tokens
        self._bind_tokens(tokens)
        for name in self.extra_outputs:  # their shapes change with the call: onnxruntime allocates them
            self.binding.bind_output(name)
        if self.sampling:
            self.binding.bind_cpu_input("uniforms", uniforms)
            self.binding.bind_cpu_input("draft_probs", self._no_drafts if draft_probs is None else draft_probs)
        self._total_len[()] = total_len
        self._seqlens_k[0] = total_len - 1
        self._num_drafts[()] = num_drafts
        self.session.run_with_iobinding(self.binding)
        return int(self._accepted), int(self._next_token)

    def _bound_input(self, name: str, buffer: np.ndarray) -> np.ndarray:
        """Bind buffer as input name; writes to it are what the next call reads (a CPU OrtValue shares it)."""
        self.binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(buffer))
        return buffer

    def _bind_tokens(self, tokens: list[int]) -> None:
        count = len(tokens)
        if count > MAX_REUSED_IDS:  # a prompt: one call, a buffer of its own
            self.binding.bind_cpu_input("input_ids", np.asarray(tokens, dtype=np.int64)[None])
            self._bound_ids = 0
            return
        if count not in self._input_ids:
            buffer = np.zeros((1, count), np.int64)
            self._input_ids[count] = (buffer, ort.OrtValue.ortvalue_from_numpy(buffer))
        buffer, value = self._input_ids[count]
        buffer[0] = tokens
        if self._bound_ids != count:
            self.binding.bind_ortvalue_input("input_ids", value)
            self._bound_ids = count

    def output(self, name: str) -> np.ndarray:
        """One of extra_outputs after the last step (bound last, so they come last, in binding order)."""
        outputs = self.binding.get_outputs()
        return outputs[len(outputs) - len(self.extra_outputs) + self.extra_outputs.index(name)].numpy()
