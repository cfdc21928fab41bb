"""A request's state: its KV caches, IO bindings and per-call buffers on each engine, taken from a pool.

Everything a call reads or writes lives in buffers created once per slot, where the engine reads them
(the device, but the host for the few numbers onnxruntime reads there: total_len, num_drafts, top_k), and
updated in place: the caches, token ids, sampling settings, the draft's distributions (written by the
draft straight into the rows the target reads) and the verification outputs. Per call, only the new
token ids and numbers go to the device and only `next_token` and (with drafts) `accepted` come back (from
a call of the draft's steps graph: its drafts).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from .engine import Engine, ort
from .errors import BundleError, DeviceError, RequestError, first_line
from .manifest import LONG_ROPE, step_presents, step_total_len
from .validation import LOGIT_BIAS, MIN_P, MIN_TOKENS_INPUTS, NO_PENALTIES, PENALTIES, PENALTY_INPUTS

MAX_REUSED_IDS = 64  # calls of up to this many tokens (drafting, verifying) reuse one buffer per length
# onnxruntime counts the runs before a capture per thread, not per graph: once a thread has run twice it
# would capture a new call shape at that shape's first run, while the memory arena may still have to grow
# for it (an allocation, which a capture forbids). So each shape first runs uncaptured this often per thread.
WARM_UP_RUNS = 2
# Chunked prefill (CPU): a call without drafts (a prompt, a draft catching up) of at least this many rows plus
# Rows.least feeds its leading rows in calls of this many. A call's intermediates grow with its rows (the MLP's
# ~5 x intermediate_size floats a row: a 1900-token prompt of a 2816-wide MLP, ~110 MB), and onnxruntime's CPU
# memory arena keeps, for the session's life, the peak of all the calls that ran at once: unchunked, every
# concurrent long prompt left its activations resident. Even, so the rows left keep the prompt's parity (see
# Rows); the leading rows are never re-fed and no decision reads their call, in every mode alike. 0: one call.
PREFILL_CHUNK = 256


class Halt(Protocol):
    """A consumer's stop, looked at between a long call's chunks (and by a request waiting for a slot, or scoring its
    prompt): a relay's threading.Event, or anything that says without taking a lock, as chat's Ctrl-C handler must,
    which may run between any two bytecodes, Event.set's own included."""

    def is_set(self) -> bool: ...


# The total_len a call over a cache is fed where it is not the real one (CUDA; see fed_total_len): "max" (the
# cache's max_seq_len) or "bucket" (the smallest of TOTAL_LEN_BUCKETS lengths that holds the call). Set
# SPECBUILD_GPU_TOTAL_LEN=bucket to try the latter. Checked where a decoder starts (check_gpu_total_len): raised at
# import, a typo made every command a traceback.
GPU_TOTAL_LEN = os.environ.get("SPECBUILD_GPU_TOTAL_LEN") or "max"
# "bucket" feeds max_seq_len >> k for k < TOTAL_LEN_BUCKETS (2048: 256, 512, 1024, 2048), each with CUDA graphs of
# its own: more buckets, more captures a call shape.
TOTAL_LEN_BUCKETS = 4

# What onnxruntime's messages say when a call found no memory (CUDA, the CPU allocator, the BFC arena).
OUT_OF_MEMORY = ("out of memory", "bad_alloc", "bad allocation", "failed to allocate")


def run_session(session: ort.InferenceSession, binding: ort.IOBinding, path: Path,
                options: ort.RunOptions | None = None) -> None:
    """session.run_with_iobinding; a failure (onnxruntime raises untyped errors, with pages of detail) as one
    DeviceError naming the engine file `path`, with advice when the device ran out of memory."""
    try:
        session.run_with_iobinding(binding, options)
    except Exception as exc:
        # onnxruntime's own exception types, and what pybind11 makes of its C++ ones (std::bad_alloc is a
        # MemoryError); anything else is a bug of ours, reported as one.
        if not (type(exc).__module__.startswith("onnxruntime") or isinstance(exc, (RuntimeError, MemoryError))):
            raise
        said = first_line(exc)
        advice = ("the device ran out of memory: decode fewer requests at once (--parallel), or use a bundle with a "
                  "shorter --max-seq-len or quantized weights" if any(s in said.lower() for s in OUT_OF_MEMORY)
                  else "if `specbuild inspect` finds the bundle intact, rerun with --debug and report it")
        raise DeviceError(f"onnxruntime failed running {path}: {said}; {advice}") from exc


@dataclass(frozen=True)
class Rows:
    """How a target call's rows are grouped, so that a row's arithmetic never depends on how decoding
    grouped tokens into calls, and speculative output equals target-only output by construction.

    least: every call computes at least this many rows (all the cache has, early on): the rows before
        the new tokens are re-fed from the tokens the cache already holds, rewriting the same positions.
        A row computed in a call of fewer rows is re-fed by the next call too.
    fixed: calls compute exactly `least` rows; a longer call (a prompt) is split so that its last part
        does, so every row any decision reads was computed in a call of that size. A short prompt's rows,
        written by calls of fewer, are re-fed in one of that size when a round takes the cache past it,
        as rounds growing it a token at a time re-feed them.
    even: calls compute an even number of rows (one more re-fed row where the cache has it), and a call
        of an odd number without drafts (a prompt) is split into a head of all its rows but the last and a
        call of its last `least` (made even) rows, which re-feeds the head's last: every row of a prompt is
        computed in an even call too, so the cache holds what any grouping of the same tokens would write
        (what prefix reuse relies on: EngineSlot.kept).
    """

    least: int
    fixed: bool = False
    even: bool = False


AS_FED = Rows(1)  # the draft: its rows only decide which drafts to propose, so it keeps its speed
# The CPU: onnxruntime's CPU kernels give a row a different result (~1e-6, amplified to ~1e-2 by int8
# compute) where it is computed apart from the others: in a call of one row (MatMul, MatMulNBits at every
# accuracy level); as the odd last row of a call (MatMulNBits at accuracy level 4 with blocks of 64 or more
# at int4, 128 or more at int8: rows go in pairs); as the 33rd, 65th, ... row (GroupQueryAttention: rows
# go in blocks of 32). In calls of an even number of rows each row's bits are the same (measured exact,
# tests/test_quantize.py) and cheaper than fixed rows there.
NEVER_ALONE = Rows(2, even=True)


def fixed_rows(max_gamma: int) -> Rows:
    """GPUs: libraries may pick different kernels for different row counts, so every target call computes
    max γ + 1 rows, as many as the largest verification (exact but for prompts shorter than that, whose
    first calls compute fewer rows). The target's LM head multiplies all of them too, whatever the call's drafts
    (specbuild/compile/graphs/verification.py; in bundles compiled before 2026-11-27 the last D+1 made even)."""
    return Rows(max_gamma + 1, fixed=True)


class Buffer:
    """A host array and the OrtValue an engine reads or writes. On the CPU they share memory; on a device
    the OrtValue is a copy that push() updates in place and pull() reads back."""

    def __init__(self, host: np.ndarray, device: str):
        self.host, self.device = host, device
        self.value = ort.OrtValue.ortvalue_from_numpy(host, device, 0)
        self.shared = device == "cpu"

    def push(self) -> None:
        if not self.shared:
            self.value.update_inplace(self.host)

    def pull(self) -> np.ndarray:
        if not self.shared:
            self.host[...] = self.value.numpy()
        return self.host


def check_gpu_total_len() -> None:
    if GPU_TOTAL_LEN not in ("max", "bucket"):
        raise DeviceError(f"SPECBUILD_GPU_TOTAL_LEN={GPU_TOTAL_LEN!r} is neither max nor bucket: set it to one of "
                          "them, or unset it")


def total_len_buckets(max_seq_len: int) -> list[int]:
    """What a call over a cache may be fed as total_len under GPU_TOTAL_LEN "bucket", longest first."""
    return [max_seq_len >> k for k in range(TOTAL_LEN_BUCKETS)]


def fed_total_len(engine: Engine, first: int, total_len: int, reach: int = 0) -> int:
    """The total_len a call feeding positions first..total_len-1 is fed; reach: the longest total_len of the
    call (a steps call feeds all its steps that of its last), if longer.

    GroupQueryAttention reads total_len on the host and sizes its kernels by it; the lengths it attends
    over come from seqlens_k on the device. A CUDA graph replays its capture's total_len (replays at
    later lengths gave other tokens on an H100), so a call over a cache is fed one that holds many
    lengths: max_seq_len (one kernel shape at every length), or under GPU_TOTAL_LEN "bucket" the smallest
    of total_len_buckets that holds the call (graph_id: a graph per bucket). On the GPU uncaptured calls are
    fed the same, so that both run the same kernels (measured so on the H100 fed max_seq_len: the same
    tokens, the same speed uncaptured).

    Any value from the call's real total_len up attends the same (tests/test_attention.py), but not less on
    CUDA: fed its rows + 1 (right on the CPU), a 2-row call over positions 7..8 was off by ~2 on an H100
    (2026-11-27, onnxruntime 1.31.1, flash and memory-efficient attention alike), and a call at context 1024
    cost what one at 64 did, as if it attended rows + 1 keys (suspected: 1.31.1's GetSequenceLengths takes
    the fed total_len as max_total_sequence_length and bounds the lengths by it).
    Flash attention splits each layer's keys by it (num_splits_heuristic: 4 ways at 2048 for 32 heads of 64
    on 132 SMs, keys in blocks of 256), which costs two memsets and a combine kernel a layer; fed a bucket,
    a call at 2048 does not split up to 256 keys (one block) and splits 2 ways up to 512 (heads of 128: blocks
    of 128 keys). onnxruntime's unfused fallback (heads over 256 wide) would take it as the key count, as it
    would max_seq_len.
    """
    if not first or not (engine.gpu_attention or engine.captures):  # a prompt's first call, or attention on the CPU
        return total_len
    if GPU_TOTAL_LEN == "max":
        return engine.max_seq_len
    return min(bucket for bucket in total_len_buckets(engine.max_seq_len) if bucket >= max(total_len, reach))


def graph_id(engine: Engine, index: int, rows: int, num_drafts: int, fed_len: int) -> int:
    """The CUDA graph that slot `index`'s call of `rows` tokens (num_drafts of them drafts), fed total_len
    fed_len, replays on the engine, or -1: none, it runs as usual. Ids are per session: a slot's engine and
    steps graph may reuse them.

    A replay runs the kernels its capture recorded, at the same addresses, and reads nothing on the
    host. So each (slot, rows, num_drafts, fed_len) has a graph of its own: the rows and num_drafts set
    shapes (and the host values computed from num_drafts), each row count has its own input buffer (a
    call of more than MAX_REUSED_IDS tokens gets a new one: never captured), and GroupQueryAttention
    reads total_len on the host. A prompt's first call (fed its own length, total_len == rows: no cache
    before it) is never captured; every later one is fed one of total_len_buckets (see fed_total_len),
    whose graph serves every length it holds.
    """
    if not engine.captures or rows > MAX_REUSED_IDS or fed_len == rows:
        return -1
    call = (index * (MAX_REUSED_IDS + 1) + rows) * MAX_REUSED_IDS + num_drafts  # > 0: onnxruntime reserves 0
    return call * TOTAL_LEN_BUCKETS + total_len_buckets(engine.max_seq_len).index(fed_len)


# The calls so far, in every thread, that warmed a CUDA graph up or captured it (see unsteady_calls).
_unsteady = 0
_UNSTEADY_LOCK = threading.Lock()  # CPU tests emulate captures without engine._CUDA_GRAPH_CALLS around them


def unsteady_calls() -> int:
    """How many calls, in any thread, ran a CUDA graph's warm-up runs or its capture: tens of times a replay's time
    (allocations, cuBLAS plans, the capture itself). Auto γ times rounds without them: on an H100 (2026-11-27) a
    one-shot generate priced every γ it had first timed during those calls so high that it kept γ 1 for 69 of
    72 rounds, and decoded slower captured (611 tok/s) than uncaptured (626, γ 7 in most rounds). Counted across
    threads, not per thread: captured calls take turns (engine._CUDA_GRAPH_CALLS), so a round in one slot also
    waits out another slot's warm-ups and captures, and the costs auto γ times are shared by every slot."""
    return _unsteady


def _count_unsteady() -> None:
    global _unsteady
    with _UNSTEADY_LOCK:
        _unsteady += 1


class CallOptions:
    """The run options of one slot's calls on one engine: where the engine captures CUDA graphs, one per graph id (each
    names its graph, and runs uncaptured WARM_UP_RUNS times per thread first), else one for every call.

    terminate() makes the call in progress fail (a DeviceError) between two of its nodes (onnxruntime's
    RunOptions.terminate, set from another thread), and each call after it at once, until clear(): a stuck or very long
    call need not hold a server's shutdown. onnxruntime may not stop a CUDA graph's replay (one launch) nor a node
    midway; neither was tried on a GPU."""

    def __init__(self, engine: Engine):
        self.engine = engine
        # by the CUDA graph id its calls name (-1: none, as every call of an engine that captures none names)
        self._run_options: dict[int, ort.RunOptions] = {}
        # Per thread, graph id -> runs so far, the capturing one included. A thread-local, not a dict keyed by
        # thread id: ids are reused once a thread ends, and a new thread must warm up its own graphs.
        self._warm_up = threading.local()
        self._terminated = False

    def options(self, graph: int) -> ort.RunOptions:
        """graph: graph_id's, or -1 for a call that names none (the sampler's: a session that captures none)."""
        key = self._graph(graph) if self.engine.captures else -1
        if key not in self._run_options:
            self._run_options[key] = options = ort.RunOptions()
            # An engine that captures runs a call without a graph id as graph 0: uncaptured say -1. So does every
            # other call: onnxruntime 1.32's run_with_iobinding looks the id up each call, and a missing one raises and
            # catches a RuntimeError, ~32 µs (the tiny pair's target call took ~120 µs of CPU a round with it, ~90
            # without).
            options.add_run_config_entry("gpu_graph_id", str(key))
            # read after it is stored: a terminate() meanwhile either sees it there or has set _terminated before
            options.terminate = self._terminated
        return self._run_options[key]

    def terminate(self) -> None:
        """From any thread: stop the call in progress, and refuse the calls after it until clear()."""
        self._terminated = True
        for options in list(self._run_options.values()):
            options.terminate = True

    def clear(self) -> None:
        """Let calls run again, once none runs (the options are shared by every later call of theirs)."""
        if self._terminated:
            self._terminated = False
            for options in self._run_options.values():
                options.terminate = False

    def _graph(self, graph: int) -> int:
        """The graph id a call runs as: -1 (uncaptured) for its thread's first WARM_UP_RUNS runs of it."""
        if graph < 0:
            return graph
        counts = self._warm_up.__dict__.setdefault("runs", {})
        runs = counts.get(graph, 0)
        if runs > WARM_UP_RUNS:
            return graph
        counts[graph] = runs + 1
        _count_unsteady()
        if runs < WARM_UP_RUNS:
            return -1
        self.engine.graphs_captured += 1  # this run captures it
        return graph


class EngineSlot:
    """One request's state on one engine: the KV cache (allocated once for max_seq_len; rolling back is
    just feeding a smaller seqlens_k), its IO binding and per-call buffers.

    probs_rows: (draft) where its sampling distributions go, one row per draft step. draft_probs: (target)
    those same rows, read when judging drafts. max_drafts: the most drafts a call verifies (the rows of
    the logits a greedy-only graph writes). Not safe to use from two threads at once.
    """

    def __init__(self, engine: Engine, rows: Rows = AS_FED, probs_rows: Buffer | None = None,
                 draft_probs: Buffer | None = None, max_drafts: int = 0):
        self.engine, self.rows = engine, rows
        self.chunk = PREFILL_CHUNK if engine.device == "cpu" else 0  # rows per call of a long prompt (0: one call)
        self.index = engine.new_slot_index()  # tells this slot's CUDA graphs from the engine's other slots'
        self.binding = engine.session.io_binding()
        self.cache = self._bind_cache()
        self._bind_call_values()
        self._fed = [0] * engine.max_seq_len  # the token at each cache position, to re-feed (a list: cheaper per call)
        # A LongRoPE target past its original length (manifest: rope_switch_length): the table the next call rotates
        # with (its `long_rope` input) and the one the cache was written with (see step).
        self.rope_switch = engine.info.rope_switch_length if not engine.steps_per_call else 0
        self._long_rope = self._input(LONG_ROPE, np.zeros((), np.int64)) if self.rope_switch else None
        self._use_long = self._cache_long = False
        self._redo_from = engine.max_seq_len  # the next call starts no later than this (see Rows)
        # Prefix reuse: the cache's leading positions that hold the K/V of _fed[:kept], each written by a call that
        # completed and whose rows' bits do not depend on grouping (with an even rule: an even call; otherwise any
        # call, which is all the draft needs) over positions that held them too. A later request whose prompt
        # begins with those tokens starts there (see prefix). Lowered before every call to its first position, so a
        # call that failed midway (a DeviceError) leaves only what was written before it.
        self.kept = 0
        self.call_options = CallOptions(engine)
        # Every call writes its logits into the first D+1 rows: one address, as a CUDA graph replays it. A greedy-only
        # graph's sampler reads them, so they are bound to every call; an engine graph's only while logits are read
        # (read_logits), and its buffer is made then.
        self._max_drafts = max_drafts
        self._logits = self._logits_buffer(max_drafts + 1) if engine.greedy_only else None
        self._reading_logits = engine.greedy_only
        self.sampling = False
        self._tail = self._sampling_binding()
        if self._tail is not None:
            self._bind_sampling(self._tail, probs_rows, draft_probs)
            self._set_sampling(temperature=0.0)  # greedy until configured
        self._bind_processing(max_drafts)

    def _bind_cache(self) -> list[ort.OrtValue]:
        """The KV cache's OrtValues, each bound as a layer's past and present: the same buffer, as GroupQueryAttention
        writes new positions in place. It sits where attention reads it: the device, but host memory for fp32 engines
        on CUDA, whose attention runs on the CPU provider (docs/gpu.md); elsewhere it would be copied whole both ways
        every call."""
        engine, shape = self.engine, self.engine.info.shape
        kv_shape = [1, shape.num_kv_heads, engine.max_seq_len, shape.head_dim]
        cache = []
        for past, present in engine.cache_names:
            buffer = ort.OrtValue.ortvalue_from_shape_and_type(kv_shape, engine.element_type, engine.input_devices[past], 0)
            self.binding.bind_ortvalue_input(past, buffer)
            self.binding.bind_ortvalue_output(present, buffer)
            cache.append(buffer)
        return cache

    def _bind_call_values(self) -> None:
        """The numbers every call feeds and returns, bound once and written in place: binding fresh arrays every call
        cost ~100 us on the CPU, a third of a draft step. Token ids are bound per call length (_bind_ids)."""
        self._total_len = self._input("total_len", np.zeros((), np.int32))
        self._seqlens_k = self._input("seqlens_k", np.zeros(1, np.int32))  # total_len - 1
        self._num_drafts = self._input("num_drafts", np.zeros((), np.int64))
        self._accepted = self._output("accepted", np.zeros((), np.int64))
        self._next_token = self._output("next_token", np.zeros((), np.int64))
        # On the CPU each buffer is its OrtValue's memory: nothing is copied per call.
        self._copies = not all(b.shared for b in (self._total_len, self._seqlens_k, self._num_drafts,
                                                   self._accepted, self._next_token))
        self._ids: dict[int, Buffer] = {}  # tokens per call -> buffer
        # What each is bound for, so that a call rebinds only what changed: input_ids and uniforms their length (0: none
        # yet, or input_ids a prompt's own buffer), the others num_drafts (-1: none yet, or draft_probs greedy's empty one).
        self._bound = {"input_ids": 0, "uniforms": 0, "draft_probs": -1, "logits": -1, "logit_bias": -1}

    def _sampling_binding(self) -> ort.IOBinding | None:
        """Where the sampling inputs and outputs are bound: the engine graph's own binding (its sampling branch), for
        a greedy-only graph the bundle's sampler's, run after it on the call's logits; None where nothing samples."""
        engine = self.engine
        if engine.sampling_session is engine.session:
            return self.binding
        if engine.sampling_session is None:
            return None
        tail = engine.sampling_session.io_binding()
        if engine.sampling_devices["logits"] != engine.device:  # a view is copied once when bound, not each call
            raise BundleError(f"the bundle's sampler reads logits from {engine.sampling_devices['logits']} memory, the "
                              f"engine {engine.path} writes them on {engine.device}: rebuild it with `specbuild compile`")
        # Its own token ids and num_drafts: onnxruntime copies an input bound on another device than its
        # session reads it from when it is bound, not at each call, so sharing the engine's (whose devices
        # may differ) could leave the sampler reading stale values. It reads only the last D+1 ids.
        self._sampler_ids: dict[int, Buffer] = {}  # drafts + 1 -> buffer
        self._sampler_num_drafts = self._input("num_drafts", np.zeros((), np.int64), tail)
        tail.bind_ortvalue_output("accepted", self._accepted.value)
        tail.bind_ortvalue_output("next_token", self._next_token.value)
        return tail

    def _bind_sampling(self, tail: ort.IOBinding, probs_rows: Buffer | None, draft_probs: Buffer | None) -> None:
        """The sampling settings' inputs and the sampled distribution's output, on the binding that samples."""
        engine = self.engine
        self._temperature = self._input("temperature", np.zeros((), np.float32), tail)
        self._top_k = self._input("top_k", np.zeros((), np.int64), tail)
        self._top_p = self._input("top_p", np.ones((), np.float32), tail)
        self._min_p = self._input(MIN_P, np.zeros((), np.float32), tail) if engine.has_min_p else None
        self._uniforms: dict[int, Buffer] = {}  # drafts + 1 -> buffer
        # The sampled distribution ([V] when sampling, [0] when greedy): the target's is not read back;
        # the draft's goes into row j of probs_rows at draft step j.
        self._probs = {True: Buffer(np.zeros(engine.vocab_size, np.float32), engine.device),
                       False: Buffer(np.zeros(0, np.float32), engine.device)}
        self._probs_rows, self._draft_probs = probs_rows, draft_probs
        self._no_drafts = Buffer(np.zeros((0, engine.vocab_size), np.float32), engine.sampling_devices["draft_probs"])

    def _bind_processing(self, max_drafts: int) -> None:
        """vLLM's penalties, min_tokens and logit_bias (manifest.py), where the graphs take them: one set of host arrays,
        bound to each binding whose graph takes them (the engine graph, or a greedy-only graph's sampler, which then
        decides every call of a request that applies them: see _call), each a copy of its own where the device holds
        it. They change only for a request that asks for them, and those changed (configure: all; count: the counts)
        are pushed before the next call that applies them: the [V] ones are 0.15-0.6 MB each at a 152k vocabulary."""
        engine = self.engine
        self._penalty_values: dict[str, np.ndarray] = {
            "repetition_penalty": np.ones((), np.float32), "presence_penalty": np.zeros((), np.float32),
            "frequency_penalty": np.zeros((), np.float32), "prompt_mask": np.zeros(engine.vocab_size, np.bool_),
            "output_counts": np.zeros(engine.vocab_size, np.float32), "min_tokens_left": np.zeros((), np.int64),
            "stop_tokens": np.zeros(engine.vocab_size, np.bool_)}
        # A greedy-only graph compiled before its sampler decided such calls takes them too (engine.processes): bound,
        # as its sampler's, to their neutral values, which the engine's has_* keep them at.
        self._sampler_decides = self._tail not in (None, self.binding) and not engine.processes
        bindings = ([(None, engine.input_devices)] if engine.processes else []) + (
            [(self._tail, engine.sampling_devices)] if self._tail not in (None, self.binding) else [])
        self._penalty_buffers = [(name, self._input(name, self._penalty_values[name], binding)) for binding, devices in bindings
                                 for name in (*PENALTY_INPUTS, *MIN_TOKENS_INPUTS) if name in devices]
        self._penalties_changed: set[str] = set()
        self._tallied = False
        # logit_bias [rows, V]: row j is added to the call's row j of logits (OpenAI's logit_bias in every row; a
        # grammar's mask too, for a request with one: constrain). Each call binds a view of its D+1 rows, one address
        # per binding, as its CUDA graphs replay them; the rows are pushed only after they change.
        self._bias = np.zeros((max_drafts + 1, engine.vocab_size), np.float32)
        self._bias_buffers = [(binding or self.binding, Buffer(self._bias, devices[LOGIT_BIAS])) for binding, devices in bindings
                              if LOGIT_BIAS in devices]
        self._bias_views: dict[tuple[int, int], ort.OrtValue] = {}  # (buffer, drafts): its CPU rows (_bind_bias)
        self._logit_bias = np.zeros(engine.vocab_size, np.float32)  # the request's OpenAI logit_bias
        self._bias_changed, self._constrained = False, False  # each Buffer's copy was made from these zeros
        self._biased = False  # the request has a logit_bias
        self._counting: set[str] = set()  # the inputs count() changes: only those the request's processing reads

    def configure(self, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                  penalties: tuple[float, float, float] = NO_PENALTIES, prompt: Sequence[int] = (), min_tokens: int = 0,
                  stops: frozenset[int] = frozenset(), logit_bias: tuple[tuple[int, float], ...] = ()) -> None:
        """Greedy at temperature 0; otherwise sampling from softmax(logits/temperature) within min-p/top-k/top-p.
        penalties: (repetition, presence, frequency), applied to the logits first (neutral: NO_PENALTIES, the only
        values an engine without has_penalties takes); prompt: the request's prompt ids, which repetition counts as
        seen. min_tokens (0 where not has_min_tokens): the next tokens that may not be one of stops. logit_bias: (token,
        bias) pairs (none where not has_logit_bias). The tokens generated are told with count."""
        with self.engine.calls:  # its copies to the device too (see engine._CUDA_GRAPH_CALLS)
            self._set_processing(penalties, prompt, min_tokens, stops, logit_bias)
            self._set_sampling(temperature, top_k, top_p, min_p)

    def _set_processing(self, penalties: tuple[float, float, float], prompt: Sequence[int], min_tokens: int,
                        stops: frozenset[int], logit_bias: tuple[tuple[int, float], ...]) -> None:
        """The host values of the penalties, min_tokens and logit_bias (pushed before the next call that applies them)."""
        values, last = self._penalty_values, self._tallied
        if last:  # the last request's tokens
            values["prompt_mask"][:] = False
            values["output_counts"][:] = 0
            values["stop_tokens"][:] = False
        self._tallied = penalties != NO_PENALTIES or min_tokens > 0
        self._counting = {name for name, read in (("output_counts", penalties != NO_PENALTIES),
                                                  ("min_tokens_left", min_tokens > 0)) if read}
        if logit_bias or self._logit_bias.any() or self._constrained:
            self._logit_bias[:] = 0
            for token, bias in logit_bias:
                self._logit_bias[token] = bias
            self._bias[:] = self._logit_bias
            self._bias_changed, self._constrained = True, False
        self._biased = bool(logit_bias)
        if not (last or self._tallied):  # all neutral before and after: the device's copies hold them already
            return
        if penalties != NO_PENALTIES:
            values["prompt_mask"][list(prompt)] = True  # a tuple index, () included, would be one element or all
        if min_tokens:
            values["stop_tokens"][list(stops)] = True
        values["min_tokens_left"][()] = min_tokens
        for name, value in zip(PENALTIES, penalties):
            values[name][()] = value
        self._penalties_changed = set(values)

    def constrain(self, mask: np.ndarray) -> None:
        """A grammar's mask for the next deciding call's rows (a request with structured outputs): mask [D+1, V] bool,
        true where row j may decide the token, applied as -inf bias where false (with the request's logit_bias). The
        prompt's head calls bind row 0 too; nothing reads their decisions."""
        rows, mask = len(mask), mask[:, :self.engine.vocab_size]  # a draft's vocabulary may be the smaller
        if rows > len(self._bias):
            self._grow_bias(rows)
        np.copyto(self._bias[:rows], self._logit_bias)
        self._bias[:rows][~mask] = -np.inf
        self._bias_changed = self._constrained = True

    def _grow_bias(self, rows: int) -> None:
        """Room for calls of more rows than drafts + 1 (a scored prompt's, on engines that do not capture)."""
        if self.engine.greedy_only:  # its CUDA graphs replay reads of the buffer's address
            raise RuntimeError(f"{rows - 1} drafts, but this slot holds logit_bias rows for at most {len(self._bias) - 1}")
        self._bias = np.concatenate([self._bias, np.broadcast_to(self._logit_bias, (rows - len(self._bias),
                                                                                     self.engine.vocab_size))])
        self._bias_buffers = [(binding, Buffer(self._bias, buffer.device)) for binding, buffer in self._bias_buffers]
        self._bias_views = {}
        self._bound["logit_bias"] = -1
        self._bias_changed = True

    def count(self, token: int) -> None:
        """One more generated token, which the penalties of the next calls count and min_tokens counts down (a request
        that asks for either: see configure)."""
        values = self._penalty_values
        if "output_counts" in self._counting:
            values["output_counts"][token] += 1
        if "min_tokens_left" in self._counting:
            values["min_tokens_left"][()] -= 1
        self._penalties_changed |= self._counting
        if not values["min_tokens_left"]:
            self._counting.discard("min_tokens_left")

    def _set_sampling(self, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> None:
        if self._tail is None:
            if temperature > 0:
                raise RequestError(f"engine {self.engine.path} runs its greedy-only graph without the bundle's sampler: "
                                   "it cannot sample; use temperature 0")
            return
        self.sampling = temperature > 0
        # An engine compiled before min_p has no such input; decode refuses min_p > 0 there (has_min_p).
        settings = [(self._temperature, temperature), (self._top_k, top_k), (self._top_p, top_p)]
        if self._min_p is not None:
            settings.append((self._min_p, min_p))
        for buffer, value in settings:
            buffer.host[()] = value
            buffer.push()
        self._tail.bind_ortvalue_output("probs", self._probs[self.sampling].value)
        # Greedy calls read neither uniforms nor drafts' distributions: bind empty ones once.
        self._bind_uniforms(self._tail, 1)
        self._tail.bind_ortvalue_input("draft_probs", self._no_drafts.value)
        self._bound["draft_probs"] = -1

    def step(self, tokens: list[int], total_len: int, num_drafts: int = 0, uniforms: np.ndarray | None = None,
             probs_row: int = 0, halt: Halt | None = None) -> tuple[int, int]:
        """Feed tokens at positions total_len-len(tokens)..total_len-1; the last num_drafts are drafts.

        Greedy: returns (how many drafts equal this model's argmax, its argmax after them). Sampling:
        uniforms [num_drafts+1] are the random numbers, the drafts' distributions are rows 0..num_drafts-1
        of draft_probs; returns (accepted drafts, the token sampled after them), and a draft engine writes
        the distribution it sampled from into row probs_row of probs_rows. halt: once set, a RequestError before
        the next chunk of a chunked prefill (a long prompt on the CPU, seconds of calls before a token): the cache
        keeps the chunks computed, as after a call that failed.
        """
        start = total_len - len(tokens)
        self._fed[start:total_len] = tokens
        self.kept = min(self.kept, start)
        if self.rope_switch:
            self._choose_rope(start, total_len)
        least = self.rows.least
        first = max(0, min(start, total_len - least, self._redo_from))
        if self.rows.even and (total_len - first) % 2 and first > 0:
            first -= 1
        first = self._head(first, total_len, num_drafts, probs_row, start, halt)
        self._redo_from = first if total_len - first < least else self.engine.max_seq_len
        return self._compute_rows(first, total_len, num_drafts, uniforms, probs_row, True)  # the call that decides

    def _head(self, first: int, total_len: int, num_drafts: int, probs_row: int, start: int,
              halt: Halt | None = None) -> int:
        """The calls before the one whose rows a decision reads (a prompt's chunks and head); returns its first row.
        start: the first position fed new tokens (rows before it are re-fed). halt: see step; a long prompt's chunks
        come before its first token, where a consumer's stop (a client gone, a deadline) is otherwise first seen (a
        1388-token prompt of a 66M target held its slot 5 s after its client left, 2 loaded cores)."""
        least = self.rows.least
        if self.chunk and not num_drafts:  # chunked prefill, leaving at least `least` rows to the calls below
            while total_len - first >= self.chunk + least:
                if halt is not None and halt.is_set():
                    # The rows before `first` are chunks' now: a short call's that a prompt of one token left re-fed
                    # (Rows), it would have the next request re-feed the chunks, all of its cached prompt
                    self._redo_from = first
                    raise RequestError("the request was stopped while a long prompt was fed to the model")
                self._compute_rows(first, first + self.chunk, 0, None, probs_row)
                first += self.chunk
        odd = (total_len - first) % 2
        if total_len - first > least and self.rows.fixed:
            # A prompt's head: no decision reads its rows' call, and no later call re-feeds them. Rows re-fed (first <
            # start: a short prompt's, which calls of fewer rows wrote) go in a call of `least` rows that the next one
            # overlaps, as rounds growing the cache a token at a time leave them: a head of those before the last
            # `least` alone would write them in a call of fewer rows (one row, where a round took the cache one past).
            # Past 2 `least` rows from first (a step of more new tokens than `least` after a short cache: a caller's,
            # never a round's), a call of `least` would leave rows before the last `least` unwritten: the head writes
            # them all, as a prompt's.
            end = total_len - least
            self._compute_rows(first, max(end, first + least) if first < start else end, 0, None, probs_row)
            first = end
        elif total_len - first > least and self.rows.even and odd and not num_drafts:
            # An odd prompt: an even head, then its last rows in an even call that re-feeds the head's last
            # (rewriting its bits): no row of it computed apart, so a cache any request wrote holds the same bits.
            self._compute_rows(first, total_len - 1, 0, None, probs_row)
            first = total_len - least - least % 2
        elif self.rows.even and odd and num_drafts and first == 0 and total_len >= num_drafts + 2:
            # A round that re-feeds a one-token prompt's row (computed alone) has no row before position 0 to re-feed:
            # an even call of the rows before those a decision reads, then those in an even call that re-feeds the
            # last of them, so that no row's bits come from an odd call (its last row computed apart).
            decided = total_len - num_drafts - 1  # the first row a decision reads
            first = decided if decided % 2 else decided - 1
            self._compute_rows(0, first + 1, 0, None, probs_row)
        return first

    def _choose_rope(self, start: int, total_len: int) -> None:
        """LongRoPE as transformers decodes with it: a sequence of up to rope_switch_length tokens rotates with
        the short factors, a longer one with the long factors at every position (Phi-3's generate recomputes
        its whole cache when the sequence first passes that length). So every call of a longer sequence
        rotates with the long table, and the first one over a cache written with the short table re-feeds
        positions 0..start-1 first, as a prompt's head (no decision reads those calls), rewriting the cache
        (and the other way round for a sequence cut back to the length, which only a caller rolling back
        as bench's context timing does makes).

        A call's rows all use one table: the decoder keeps each round's rows on one side of the length
        (decode.SpeculativeDecoder._speculate), so that every row a decision reads is rotated as
        transformers rotates the sequence that row predicts after."""
        self._use_long = total_len > self.rope_switch
        refeed = start and self._use_long != self._cache_long
        # Said before the re-feed: one that fails midway (a DeviceError in a later chunk) leaves positions written with
        # this table that the slot keeps (EngineSlot.kept), which prefix must not offer to the other side.
        self._cache_long = self._use_long
        if refeed:
            self._refeed(start)

    def _refeed(self, end: int) -> None:
        """Positions 0..end-1 again from the tokens the cache holds, no decision read, in the calls a prompt of
        them makes: the next call re-feeds its last rows in some modes and not in others (as many as its drafts
        leave), so those must hold the bits a call of the Rows' kind gives them, not an odd or a long call's."""
        first = self._head(0, end, 0, 0, 0)
        self._compute_rows(first, end, 0, None, 0)
        if end - first < self.rows.least:  # as a prompt's: re-fed by the next call
            self._redo_from = first

    def read_logits(self, on: bool) -> None:
        """Whether the next calls write their fp32 logits where logits() reads them (an engine with has_logits). An
        engine graph's output is bound only while on: a call that does not read them fetches what it did before
        logits were read. A greedy-only graph writes them in every call (its sampler reads them)."""
        if self.engine.greedy_only or on == self._reading_logits:
            return
        if self._logits is None:
            self._logits = self._logits_buffer(self._max_drafts + 1)
        self._reading_logits = on
        if not on:  # onnxruntime unbinds outputs all together: the others are bound again as they were
            self.binding.clear_binding_outputs()
            for (_, present), buffer in zip(self.engine.cache_names, self.cache):
                self.binding.bind_ortvalue_output(present, buffer)
            self.binding.bind_ortvalue_output("accepted", self._accepted.value)
            self.binding.bind_ortvalue_output("next_token", self._next_token.value)
            if self.engine.sampling_session is self.engine.session:  # the engine graph samples itself
                self.binding.bind_ortvalue_output("probs", self._probs[self.sampling].value)
            self._bound["logits"] = -1

    def release_logits(self) -> None:
        """Shrink an engine graph's logits buffer back to max drafts + 1 rows: scoring a prompt grows it (see
        _bind_logits), and at 64 rows of a 152k vocabulary it would hold ~39 MB per slot for good. A greedy-only
        graph's keeps its size and address, which its CUDA graphs replay."""
        if self.engine.greedy_only or self._logits is None or len(self._logits.host) <= self._max_drafts + 1:
            return
        self._logits = self._logits_buffer(self._max_drafts + 1)
        self._bound["logits"] = -1  # the next call reading logits binds the new buffer before it writes

    def _logits_buffer(self, rows: int) -> Buffer:
        return Buffer(np.zeros((rows, self.engine.vocab_size), np.float32), self.engine.device)

    def logits(self) -> np.ndarray:
        """A copy of the fp32 logits [D+1, V] of the last call (read_logits on): row j after input position S-D-1+j."""
        assert self._logits is not None  # made by read_logits(True), which reading logits takes
        with self.engine.calls:  # a copy back from the device (see engine._CUDA_GRAPH_CALLS)
            return self._logits.pull()[:self._bound["logits"] + 1].copy()

    def scoring_calls(self, start: int, length: int, size: int, until: int | None = None) -> Iterator[tuple[int, int]]:
        """The calls (first, end) that feed positions start.. of a length-token sequence whose every row is read
        (scoring a prompt, a quality report), at most size rows each, none starting at or past until (default
        length); grouped so that each row gets the bits decoding gives it: no call spans the LongRoPE switch (one
        that did would rotate its rows before the switch with the long table, _choose_rope), and with even rows a
        first call of an odd count, having no row before it to re-feed, leaves its last row to the next call."""
        until = length if until is None else until
        while start < until:
            end = min(length, start + size)
            if self.rope_switch and start < self.rope_switch < end:
                end = self.rope_switch
            if start == 0 and self.rows.even and end % 2 and end > 1:
                end -= 1
            yield start, end
            start = end

    def prefix(self, ids: list[int], limit: int) -> int:
        """How many leading tokens of ids (at most limit) this slot's cache holds as any call feeding them from
        the start would write them (see kept), so that a request may start feeding there. 0 where its LongRoPE
        table differs from the one the cache was written with: re-feeding it (_choose_rope) would group the
        rows otherwise than a fresh prompt does."""
        if self.rope_switch and (len(ids) > self.rope_switch) != self._cache_long:
            return 0
        fed, count = self._fed, min(self.kept, limit, len(ids))
        held = 0
        while held < count and fed[held] == ids[held]:
            held += 1
        return held

    def _compute_rows(self, first: int, total_len: int, num_drafts: int, uniforms: np.ndarray | None, probs_row: int,
                      decides: bool = False):
        """One call over positions first..total_len-1, taking its turn where the engine's calls do (engine.calls),
        with kept lowered first and raised once it completes. decides: a call whose token is read (not a prompt's
        head or chunk, nor a re-feed)."""
        self.kept = min(self.kept, first)
        with self.engine.calls:
            result = self._call(first, total_len, num_drafts, uniforms, probs_row, decides)
        if self.kept == first and not (self.rows.even and (total_len - first) % 2):
            self.kept = total_len
        return result

    def _call(self, first: int, total_len: int, num_drafts: int, uniforms: np.ndarray | None, probs_row: int,
              decides: bool):
        self._bind_ids(self._fed[first:total_len])
        fed_len = self._total_len.host[()] = fed_total_len(self.engine, first, total_len)
        self._seqlens_k.host[0] = total_len - 1
        self._num_drafts.host[()] = num_drafts
        if self._copies:
            for buffer in (self._total_len, self._seqlens_k, self._num_drafts):
                buffer.push()
        # A greedy-only graph decides on its raw logits: its sampler decides a call that samples or applies penalties,
        # min_tokens or logit_bias (a grammar's rows too), which alone reads (and is pushed) their inputs then.
        processed = self._tallied or (self._biased or self._constrained) and bool(self._bias_buffers)
        sampler = decides and (self.sampling or processed and self._sampler_decides)
        if not self._sampler_decides:
            self._push_processing(num_drafts)
        if self._long_rope is not None and self._long_rope.host[()] != self._use_long:  # changes once a sequence, at most
            self._long_rope.host[()] = int(self._use_long)
            self._long_rope.push()
        if self.sampling:
            assert self._tail is not None  # only a slot with a tail samples (_set_sampling)
            self._bind_uniforms(self._tail, num_drafts + 1, uniforms)
            if self._draft_probs is not None:
                self._bind_rows(self._tail, "draft_probs", self._draft_probs, num_drafts)
            if self._probs_rows is not None:
                self._bind_row(self._tail, "probs", self._probs_rows, probs_row)
        if self._reading_logits:
            self._bind_logits(num_drafts)
        graph = self._graph(total_len - first, num_drafts, fed_len)
        run_session(self.engine.session, self.binding, self.engine.path, graph)
        # The sampler's turn: the same nodes on the same logits.
        if sampler and self._tail is not None and self._tail is not self.binding:
            self._feed_sampler(self._tail, self._fed[total_len - num_drafts - 1:total_len], num_drafts)
            if self._sampler_decides:
                self._push_processing(num_drafts)
            run_session(self.engine.sampling_session, self._tail, self.engine.path, self.call_options.options(-1))
        if not self._copies:
            return int(self._accepted.host), int(self._next_token.host)
        # A call without drafts accepts none: one copy back (a wait for the device) fewer per draft step.
        return (int(self._accepted.pull()) if num_drafts else 0), int(self._next_token.pull())

    def _graph(self, rows: int, num_drafts: int, fed_len: int) -> ort.RunOptions:
        return self.call_options.options(graph_id(self.engine, self.index, rows, num_drafts, fed_len))

    def _input(self, name: str, host: np.ndarray, binding: ort.IOBinding | None = None) -> Buffer:
        """A buffer bound as input name of the engine graph (binding None) or of the sampling binding."""
        devices = self.engine.input_devices if binding is None else self.engine.sampling_devices
        buffer = Buffer(host, devices[name])
        (binding or self.binding).bind_ortvalue_input(name, buffer.value)
        return buffer

    def _output(self, name: str, host: np.ndarray) -> Buffer:
        buffer = Buffer(host, self.engine.device)
        self.binding.bind_ortvalue_output(name, buffer.value)
        return buffer

    def _bind_ids(self, tokens: list[int]) -> None:
        count = len(tokens)
        if count > MAX_REUSED_IDS:  # a prompt: one call, a buffer of its own (kept while it is bound)
            self._prompt = Buffer(np.array([tokens], np.int64), self.engine.input_devices["input_ids"])
            self.binding.bind_ortvalue_input("input_ids", self._prompt.value)
            self._bound["input_ids"] = 0
            return
        buffer = self.ids_buffer(tokens)
        if self._bound["input_ids"] != count:
            self.binding.bind_ortvalue_input("input_ids", buffer.value)
            self._bound["input_ids"] = count

    def ids_buffer(self, tokens: list[int]) -> Buffer:
        """The buffer of calls of len(tokens) <= MAX_REUSED_IDS tokens, holding tokens on the engine's side."""
        count = len(tokens)
        if count not in self._ids:
            self._ids[count] = Buffer(np.zeros((1, count), np.int64), self.engine.input_devices["input_ids"])
        buffer = self._ids[count]
        buffer.host[0] = tokens
        if self._copies:
            buffer.push()
        return buffer

    def _feed_sampler(self, tail: ort.IOBinding, tokens: list[int], num_drafts: int) -> None:
        """The sampler's input_ids (the call's last D+1 tokens) and num_drafts."""
        count = len(tokens)
        if count not in self._sampler_ids:
            self._sampler_ids[count] = Buffer(np.zeros((1, count), np.int64), self.engine.sampling_devices["input_ids"])
        buffer = self._sampler_ids[count]
        buffer.host[0] = tokens
        buffer.push()
        tail.bind_ortvalue_input("input_ids", buffer.value)
        self._sampler_num_drafts.host[()] = num_drafts
        self._sampler_num_drafts.push()

    def _bind_logits(self, num_drafts: int) -> None:
        """Bind the graph's logits output (and a greedy-only graph's sampler's input) to the first D+1 rows."""
        assert self._logits is not None  # made by read_logits(True), which reading logits takes
        if self._bound["logits"] != num_drafts:
            if num_drafts >= len(self._logits.host):  # a view past the buffer: memory the call must not write
                if self.engine.greedy_only:  # its CUDA graphs replay writes to this buffer's address
                    raise RuntimeError(f"{num_drafts} drafts, but this slot holds logits for at most "
                                       f"{len(self._logits.host) - 1}")
                self._logits = self._logits_buffer(num_drafts + 1)
            shape, pointer = [num_drafts + 1, self.engine.vocab_size], self._logits.value.data_ptr()
            self.binding.bind_output("logits", self._logits.device, 0, np.float32, shape, pointer)
            if self._tail is not None and self._tail is not self.binding:
                self._tail.bind_input("logits", self._logits.device, 0, np.float32, shape, pointer)
            self._bound["logits"] = num_drafts

    def _push_processing(self, num_drafts: int) -> None:
        """The penalty and min_tokens inputs that changed, pushed; logit_bias bound (see _bind_bias)."""
        if self._penalties_changed:
            for name, buffer in self._penalty_buffers:
                if name in self._penalties_changed:
                    buffer.push()
            self._penalties_changed = set()
        if self._bias_buffers:
            self._bind_bias(num_drafts)

    def _bind_bias(self, num_drafts: int) -> None:
        """Bind logit_bias to the first D+1 rows (see __init__), pushed first where they changed."""
        if num_drafts >= len(self._bias):
            self._grow_bias(num_drafts + 1)
        for i, (binding, buffer) in enumerate(self._bias_buffers):
            if self._bias_changed:
                buffer.push()
            if self._bound["logit_bias"] != num_drafts and buffer.shared:
                # a view of the host's rows, made once: bind_input took 6-10 µs on 2 CPU cores, this 0.5, and auto's
                # calls change their rows from round to round (γ, guesses): calls of 2 rows alternating without and
                # with a guess took 106-108 µs on the tiny random pair, 97-99 either alone, 100-102 so
                if (i, num_drafts) not in self._bias_views:
                    self._bias_views[i, num_drafts] = ort.OrtValue.ortvalue_from_numpy(buffer.host[:num_drafts + 1])
                binding.bind_ortvalue_input(LOGIT_BIAS, self._bias_views[i, num_drafts])
            elif self._bound["logit_bias"] != num_drafts:
                binding.bind_input(LOGIT_BIAS, buffer.device, 0, np.float32, [num_drafts + 1, self.engine.vocab_size],
                                   buffer.value.data_ptr())
        self._bias_changed = False
        self._bound["logit_bias"] = num_drafts

    def _bind_uniforms(self, tail: ort.IOBinding, count: int, values: np.ndarray | None = None) -> None:
        if count not in self._uniforms:
            self._uniforms[count] = Buffer(np.zeros(count, np.float32), self.engine.sampling_devices["uniforms"])
        buffer = self._uniforms[count]
        if values is not None:
            buffer.host[:] = values
            buffer.push()
        if self._bound["uniforms"] != count:
            tail.bind_ortvalue_input("uniforms", buffer.value)
            self._bound["uniforms"] = count

    def _bind_rows(self, tail: ort.IOBinding, name: str, rows: Buffer, count: int) -> None:
        """Bind input name to the first count rows of rows (a view: no copy, on any device)."""
        if self._bound[name] != count:
            width = rows.host.shape[1]
            tail.bind_input(name, rows.device, 0, np.float32, [count, width], rows.value.data_ptr())
            self._bound[name] = count

    def _bind_row(self, tail: ort.IOBinding, name: str, rows: Buffer, row: int) -> None:
        """Bind output name ([V] of this engine's vocabulary) to the start of row `row` of rows."""
        row_bytes = rows.host.shape[1] * rows.host.itemsize
        tail.bind_output(name, rows.device, 0, np.float32, [self.engine.vocab_size], rows.value.data_ptr() + row * row_bytes)


class DraftSteps:
    """A draft slot's calls of the draft's steps graph (manifest: draft.steps.onnx), which drafts `count`
    tokens in one call, over that slot's KV buffers: every step's present outputs are bound to them, as
    the one step's are in the slot's own binding. The steps graph proposes the tokens `count` calls of
    the draft's own graph would (its steps compute the same rows), without the host between steps."""

    def __init__(self, engine: Engine, draft: EngineSlot):
        self.engine, self.draft, self.count = engine, draft, engine.steps_per_call
        for name in ("input_ids", engine.cache_names[0][0]):
            # It reads the draft slot's token buffers and caches; bound on another device than the session reads
            # them from, they would be copied once, when bound, and then read stale.
            if engine.input_devices[name] != draft.engine.input_devices[name]:
                raise BundleError(f"{engine.path} reads {name} on {engine.input_devices[name]}, the draft engine on "
                                  f"{draft.engine.input_devices[name]}: rebuild the bundle with `specbuild compile`")
        self.index = engine.new_slot_index()
        self.binding = engine.session.io_binding()
        for (past, _), buffer in zip(engine.cache_names, draft.cache):
            self.binding.bind_ortvalue_input(past, buffer)
        for j in range(self.count):
            for present, buffer in zip(step_presents(engine.info.shape.num_layers, j), draft.cache):
                self.binding.bind_ortvalue_output(present, buffer)
        names = ["seqlens_k", *(step_total_len(j) for j in range(self.count))]
        self._lengths = {name: Buffer(np.zeros(1 if name == "seqlens_k" else (), np.int32), engine.input_devices[name])
                         for name in names}
        for name, buffer in self._lengths.items():
            self.binding.bind_ortvalue_input(name, buffer.value)
        self._drafts = Buffer(np.zeros(self.count, np.int64), engine.device)
        self.binding.bind_ortvalue_output("drafts", self._drafts.value)
        self._bound_ids = 0
        self.call_options = CallOptions(engine)

    def step(self, tokens: list[int], total_len: int) -> list[int]:
        """Feed tokens (at most MAX_REUSED_IDS) at positions total_len-len(tokens)..total_len-1, then draft
        `count` tokens after them; the cache then holds all but the last."""
        draft, rows = self.draft, len(tokens)
        if rows > MAX_REUSED_IDS:  # the draft slot's own calls take those (a buffer of their own)
            raise ValueError(f"a steps call feeds at most {MAX_REUSED_IDS} tokens, not {rows}")
        first = total_len - rows
        draft.kept = min(draft.kept, first)
        with self.engine.calls:
            buffer = draft.ids_buffer(tokens)  # the draft slot's own buffer of this length: one address per shape
            if self._bound_ids != rows:
                self.binding.bind_ortvalue_input("input_ids", buffer.value)
                self._bound_ids = rows
            self._lengths["seqlens_k"].host[0] = total_len - 1
            last = total_len + self.count - 1
            # step j > 0 feeds one token, at position total_len + j - 1
            fed = [fed_total_len(self.engine, total_len + j - 1 if j else first, total_len + j, last)
                   for j in range(self.count)]
            for j, length in enumerate(fed):
                self._lengths[step_total_len(j)].host[()] = length
            for buffer in self._lengths.values():
                buffer.push()
            graph = graph_id(self.engine, self.index, rows, 0, fed[0])
            run_session(self.engine.session, self.binding, self.engine.path, self.call_options.options(graph))
            drafts = self._drafts.pull().tolist()
        draft._fed[first:total_len + self.count - 1] = [*tokens, *drafts[:-1]]
        if draft.kept == first:
            draft.kept = total_len + self.count - 1
        return drafts


class Slot:
    """What one in-flight request owns: its state on the target and the draft, and the rows in which the
    draft leaves its distributions for the target to judge (sampling)."""

    def __init__(self, index: int, target: Engine, draft: Engine, target_rows: Rows, max_gamma: int,
                 steps_engine: Engine | None = None):
        self.index = index
        # Columns past the draft's vocabulary (when smaller than the target's) stay zero: q is a proper
        # distribution over the target's vocabulary.
        q = (Buffer(np.zeros((max(max_gamma, 1), target.vocab_size), np.float32), target.sampling_devices["draft_probs"])
             if target.sampling_session is not None else None)
        self._q = q
        self.target = EngineSlot(target, target_rows, draft_probs=q, max_drafts=max_gamma)
        self.draft = EngineSlot(draft, AS_FED, probs_rows=q)
        self.draft_steps = DraftSteps(steps_engine, self.draft) if steps_engine else None

    def propose_certain(self, tokens: list[int]) -> None:
        """Sampling: proposals that no draft sampled (a grammar's forced text), for the target's next call to judge as
        drafts of a draft certain of them: q's first rows one-hot at them. Judged so (Leviathan et al.'s rule), each is
        accepted with probability p(x) and the first rejected position resampled from p without x, so the output stays
        the target's. The tokens are the tokenizer's ids, all within the draft's vocabulary (compile refuses a table
        that lacks one: load.check_embedding_rows), whose columns the draft rewrites in each row it writes: q stays 0
        past them."""
        assert self._q is not None  # a sampled request's target samples (engine.sampling_session)
        rows = self._q.host[:len(tokens)]
        rows[:] = 0
        rows[np.arange(len(tokens)), tokens] = 1
        # On a device the draft writes its rows there, not into the host copy, whose stale rows this copies over them:
        # harmless, as the draft writes each row a round's target reads first. The copy takes its turn among captured
        # calls (engine._CUDA_GRAPH_CALLS): made during another slot's capture, it would break that capture.
        with self.target.engine.calls:
            self._q.push()

    def configure(self, temperature: float, top_k: int, top_p: float, logits: bool = False, min_p: float = 0.0,
                  penalties: tuple[float, float, float] = NO_PENALTIES, prompt: Sequence[int] = (), min_tokens: int = 0,
                  stops: frozenset[int] = frozenset(), logit_bias: tuple[tuple[int, float], ...] = ()) -> None:
        """A request's sampling settings; logits: the target's calls leave their logits for it to read. penalties
        (with the prompt's ids): the target's alone. The draft proposes from its unpenalised logits, and samples
        from (and reports as q) the distribution it drew from: the target's judgement keeps the output exact. min_tokens
        (with the stop tokens it holds back) and logit_bias: the target's alone, alike."""
        self.target.configure(temperature, top_k, top_p, min_p, penalties, prompt, min_tokens, stops, logit_bias)
        self.draft.configure(temperature, top_k, top_p, min_p)
        self.target.read_logits(logits)

    def terminate_calls(self) -> None:
        """From any thread: fail its engine call in progress and those after it, until allow_calls() (CallOptions)."""
        for calls in self._calls():
            calls.terminate()

    def allow_calls(self) -> None:
        for calls in self._calls():
            calls.clear()

    def _calls(self) -> list[CallOptions]:
        steps = [self.draft_steps.call_options] if self.draft_steps else []
        return [self.target.call_options, self.draft.call_options, *steps]
