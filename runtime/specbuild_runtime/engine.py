"""One engine's onnxruntime session: the weights, loaded once per process and shared by every request.

A session holds no request state (each request's KV cache and bindings live in a slot, see slot.py),
and onnxruntime's Run is safe to call from several threads at once, so one Engine serves them all (the
calls of engines that capture CUDA graphs take turns: see _CUDA_GRAPH_CALLS).
"""

from __future__ import annotations

import ctypes
import itertools
import os
import re
import threading
import warnings
import weakref
from collections.abc import Collection, Iterator
from contextlib import nullcontext
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path, PurePosixPath
from typing import NamedTuple

# The one import of onnxruntime (the runtime's other modules and the compiler's take `ort` from here), so that a
# missing or half-uninstalled one is the one line below whichever module is imported first.
try:
    import onnxruntime as ort
except ModuleNotFoundError as exc:  # the package's extras choose it: onnxruntime and onnxruntime-gpu conflict
    if exc.name != "onnxruntime":
        raise
    raise ModuleNotFoundError("specbuild-runtime needs onnxruntime: pip install './runtime[cpu]', or './runtime[gpu]' "
                              "(onnxruntime-gpu) to run on CUDA", name="onnxruntime") from None
if not hasattr(ort, "InferenceSession"):
    # Both installed, uninstalling one removes the files both wrote and leaves onnxruntime/capi/, an empty namespace
    # package: each use of it would be an AttributeError, reported as a bug in specbuild
    raise ModuleNotFoundError("onnxruntime is installed without its files (onnxruntime and onnxruntime-gpu write the "
                              "same ones, and uninstalling either removes them): pip uninstall -y onnxruntime "
                              "onnxruntime-gpu, then pip install './runtime[cpu]', or './runtime[gpu]' (onnxruntime-gpu) "
                              "to run on CUDA", name="onnxruntime")

from .errors import BundleError, DeviceError, first_line
from .manifest import EngineInfo, cache_names, can_run, cpu_refusal
from .validation import (LOGIT_BIAS_INPUTS, LOGITS, MIN_P, MIN_TOKENS_INPUTS, PENALTY_INPUTS, check_engine_io,
                         check_sampler_io)

DEVICES = ("cpu", "cuda", "auto")
PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}
# ONNX element types (onnx.TensorProto values; the runtime does not import onnx) of each cache precision.
# bf16 has no numpy type: caches are allocated from these, never from numpy arrays.
ELEMENT_TYPES = {"fp32": 1, "fp16": 10, "bf16": 16}


# Where /proc and the cgroup file systems are read (tests point it at a folder of made-up ones).
ROOT = Path("/")


def available_cpus() -> int:
    """CPUs this process can keep busy: those its affinity allows (as os.process_cpu_count counts them), or fewer
    where its cgroup's CPU quota grants fewer (see cpu_quota)."""
    affinity = _affinity_cpus()
    quota = cpu_quota()
    return min(affinity, quota) if quota else affinity


def quota_threads() -> int:
    """The threads to ask onnxruntime for where the project would take its default: 0 (onnxruntime's
    default, one per physical core) unless a CPU quota grants fewer CPUs than the affinity, then that many.
    Neither library reads a quota (onnxruntime 1.32 sizes its pools from the cores it sees, as its issue 29510
    says; on a 2-core machine a cgroup of 0.5 CPU got 2 threads, as no cgroup did), so a pod limited to 2 CPUs on
    a 64-core node ran a pool of 32 or 64 threads, which spends the quota early in each period (100 ms) and is
    throttled for the rest of it.
    Only a binding quota gives an explicit count: an explicit count also stops onnxruntime pinning its threads to
    cores, and elsewhere the default stays as measured. ORT_INTRA_OP_NUM_THREADS, which onnxruntime reads for a
    default pool, is an operator's choice that wins."""
    if os.environ.get("ORT_INTRA_OP_NUM_THREADS"):
        return 0
    quota = cpu_quota()
    return quota if quota and quota < _affinity_cpus() else 0


def _affinity_cpus() -> int:
    if hasattr(os, "sched_getaffinity"):  # Linux
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def cpu_quota() -> int | None:
    """The CPUs this process's cgroup CPU quota grants (a container's `--cpus`, a pod's cpu limit), rounded up
    (1.5 CPUs: 2), the tightest of its cgroup's and its ancestors'; None where no quota applies or none can be read.
    A quota leaves the affinity alone: the process sees every core of the host. v2's cpu.max ("max": no limit),
    v1's cpu.cfs_quota_us (-1: no limit) over cpu.cfs_period_us."""
    quotas = []
    for folder, v2 in cgroup_folders("cpu"):
        try:
            if v2:
                max_quota, _, max_period = (folder / "cpu.max").read_text().strip().partition(" ")
                if max_quota == "max":
                    continue
                quota, period = int(max_quota), int(max_period or 100_000)
            else:
                quota = int((folder / "cpu.cfs_quota_us").read_text())
                period = int((folder / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError, UnicodeDecodeError):  # no quota file at this level (v2's root), or unreadable
            continue
        if quota > 0 and period > 0:  # v1's -1: no limit
            quotas.append(max(1, -(-quota // period)))
    return min(quotas, default=None)


def cgroup_folders(controller: str) -> list[tuple[Path, bool]]:
    """(folder, whether cgroup v2) of this process's cgroup for `controller` ("cpu", "memory") and of each ancestor
    up to its mount: a parent's limit bounds its children's (a pod's sits on the pod's cgroup, above each
    container's). Found as Go's automaxprocs finds them: the cgroup from /proc/self/cgroup, under its mount in
    /proc/self/mountinfo (a container's namespace mounts its own cgroup as the root). [] where none can be read."""
    try:
        cgroups = (ROOT / "proc/self/cgroup").read_text().splitlines()
        mounts = (ROOT / "proc/self/mountinfo").read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return []
    folders = []
    for line in cgroups:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        v2 = hierarchy == "0" and not controllers
        if not (v2 or controller in controllers.split(",")):
            continue
        for kind, options, mount_root, mount_point in _cgroup_mounts(mounts):
            if (kind == "cgroup2") if v2 else (kind == "cgroup" and controller in options):
                folders += [(folder, v2) for folder in _ancestors(ROOT / mount_point.lstrip("/"), mount_root, path)]
    return folders


def _cgroup_mounts(lines: list[str]) -> Iterator[tuple[str, list[str], str, str]]:
    """(file system type, super options, root, mount point) of each cgroup mount in mountinfo lines."""
    for line in lines:
        before, _, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        if len(fields) >= 5 and len(tail) >= 3 and tail[0] in ("cgroup", "cgroup2"):
            # mountinfo writes a space in a path as \040 (octal), as it does a tab, a newline and a backslash
            root, point = (re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), f) for f in fields[3:5])
            yield tail[0], tail[2].split(","), root, point


def _ancestors(mounted: Path, mount_root: str, path: str) -> list[Path]:
    """The folders of the cgroup at path and of its ancestors up to the mount, the cgroup's first."""
    try:
        parts = PurePosixPath(path).relative_to(mount_root).parts
    except ValueError:  # a cgroup outside what this mount shows (another namespace's)
        return []
    if ".." in parts:
        return []
    return [mounted.joinpath(*parts[:depth]) for depth in range(len(parts), -1, -1)]


def use_shared_thread_pool(threads: int = 0) -> None:
    """Make every onnxruntime session this process makes from now on share one intra-op thread pool (opt-in) of
    `threads` threads (0: onnxruntime's default, one per physical core, or a CPU quota's CPUs where that is fewer:
    quota_threads; a server decoding several requests at once wants fewer).

    Fastest for a process that only decodes: the draft and the target run one after the other and
    one pool serves both (measured on 2 cores, demo pair: target-only 333 vs 273 tok/s, speculative
    744 vs 616 tok/s), while the cores are free: its threads spin and onnxruntime's Python API cannot stop them, so
    where other work takes the cores one thread decodes faster (docs/performance.md, "On a busy machine"). It
    changes the whole process: every later session must set `use_per_session_threads =
    False` (session_options does). Sessions made before keep their own pools. onnxruntime (1.32) makes the pool
    once per process and never resizes it: where one exists (an earlier call's, or other code's
    onnxruntime.set_global_thread_pool_sizes), the sessions share it, and a size asked that it may not have is a
    RuntimeWarning (the tokens are the same; only the threads differ).
    """
    global _SHARED_POOL
    if _SHARED_POOL is None:
        try:
            size = threads or quota_threads()
            ort.capi._pybind_state.set_global_thread_pool_sizes(size, 1)
            _SHARED_POOL = size  # a quota's CPUs too: a later call asking for as many gets them, with no warning
        except Exception as exc:  # onnxruntime raises its own untyped exceptions
            if "already been created" not in str(exc):
                raise
            _SHARED_POOL = MADE_ELSEWHERE
    if threads and threads != _SHARED_POOL:
        made = {MADE_ELSEWHERE: "sized by other code", 0: "the default size"}.get(_SHARED_POOL, f"{_SHARED_POOL} threads")
        warnings.warn(f"onnxruntime's shared thread pool exists already ({made}) and cannot be resized, so it does "
                      f"not get the {threads} threads asked: ask for them before anything in the process makes it",
                      RuntimeWarning, stacklevel=2)


MADE_ELSEWHERE = -1  # the _SHARED_POOL of a pool other code made (onnxruntime.set_global_thread_pool_sizes)
# The threads the process's shared pool was made with here (0: onnxruntime's default size, where no CPU quota binds:
# quota_threads), or None while it has none.
_SHARED_POOL: int | None = None
# onnxruntime captures CUDA graphs in cudaStreamCaptureModeGlobal ("for now cuda graph can only work with a
# single thread", cuda_graph.cc): a CUDA call from any other thread during a capture (a copy, an allocation)
# breaks it. Every call of an engine that captures, with its copies, holds this lock, so these calls take
# turns; other CUDA work in the process (an engine without CUDA graphs, torch, loading a decoder) is not
# held back by it.
# (Captured graphs are kept per thread, so each decoding thread captures its own.)
_CUDA_GRAPH_CALLS = threading.Lock()
# Architectures (and precisions) whose replayed calls were measured to give the tokens of uncaptured ones on a
# GPU (tests/test_gpu.py: Llama fp16 and bf16 on an H200 and an H100; Qwen2 with a sliding window, Gemma 3, Phi-3
# and GPT-2 fp16 on an H100, 2026-11-26, once cuDNN's attention was off, see choose_attention_kernels): CUDA
# graphs are their default on CUDA (decode.graphs_by_default). The others replay only when asked (--cuda-graphs)
# until that test has run for them too.
CAPTURED_BY_DEFAULT = {"LlamaForCausalLM": ("fp16", "bf16"), "Qwen2ForCausalLM": ("fp16",), "Gemma3ForCausalLM": ("fp16",),
                       "Phi3ForCausalLM": ("fp16",), "GPT2LMHeadModel": ("fp16",)}  # architecture: precisions run


def session_options() -> ort.SessionOptions:
    """Options every onnxruntime session of this process must start from (the engines', and any other,
    such as the compiler's check): with the shared pool on, a session with threads of its own fails."""
    options = ort.SessionOptions()
    if _SHARED_POOL is not None:
        options.use_per_session_threads = False
    else:
        # Each engine has its own pool: stop its threads spinning once a call returns, or they steal
        # the cores from the other engine (speculative decoding measured 1.6x slower without this).
        options.add_session_config_entry("session.force_spinning_stop", "1")
        options.intra_op_num_threads = quota_threads()  # 0: onnxruntime's default
    options.log_severity_level = 3
    return options


_CUDA_LOADED = False


def cuda_provider() -> bool:
    """Whether this onnxruntime has its CUDA provider; loads CUDA and cuDNN first (once), as
    onnxruntime-gpu needs before its first CUDA session."""
    global _CUDA_LOADED
    if PROVIDERS["cuda"] not in ort.get_available_providers():
        return False
    if not _CUDA_LOADED:
        ort.preload_dlls()
        _CUDA_LOADED = True
    return True


def requested_device(device: str) -> str:
    """'cpu' or 'cuda' for a device argument; 'auto' is 'cuda' where this onnxruntime has the provider.
    A missing CUDA provider is an error, never a silent fallback to the CPU (except under 'auto')."""
    if device not in DEVICES:
        raise DeviceError(f"device {device!r} is not one of {', '.join(DEVICES)}")
    if device == "cpu":
        return "cpu"
    if cuda_provider():
        return "cuda"
    if device == "auto":
        return "cpu"
    try:
        version("onnxruntime-gpu")
    except PackageNotFoundError:
        pass
    else:  # whose module lists CUDA with or without a GPU: another onnxruntime wrote over it, installed after it
        raise DeviceError("device 'cuda' needs onnxruntime's CUDA provider, which onnxruntime-gpu has but the CPU "
                          "onnxruntime installed beside it (as onnxruntime-genai's requirement, say) replaced: pip "
                          "uninstall -y onnxruntime onnxruntime-gpu, then pip install './runtime[gpu]' "
                          "(onnxruntime-genai-cuda in place of onnxruntime-genai)")
    raise DeviceError(f"device 'cuda' needs onnxruntime's CUDA provider, which onnxruntime {ort.__version__} here "
                      "lacks: install onnxruntime-gpu with `pip install './runtime[gpu]'` (in place of onnxruntime)")


class Takes(NamedTuple):
    """What a graph decides with, with the session that samples its logits: its fp32 logits (logprobs), min_p, vLLM's
    penalties (PENALTY_INPUTS), min_tokens (MIN_TOKENS_INPUTS) and OpenAI's logit_bias (structured outputs' masks too);
    graphs compiled before one lack it."""

    logits: bool
    min_p: bool
    penalties: bool
    min_tokens: bool
    logit_bias: bool


def graph_takes(inputs: Collection[str], outputs: Collection[str], sampling_inputs: Collection[str] | None,
                greedy_only: bool = False) -> Takes:
    """A graph's Takes from the names of its inputs and outputs, and of the inputs of the session that samples its
    logits (its own; a greedy-only graph's sampler; None where nothing does: a steps graph, or no sampler). From names
    alone, so `specbuild inspect` tells it without loading the weights. A greedy-only graph decides on its raw logits:
    its sampler decides the calls that apply the penalties, min_tokens or logit_bias (greedy ones too), so those are
    the sampler's; one that takes them itself was compiled before the sampler had that greedy branch: refused."""
    refused = sampling_inputs is None or (greedy_only and processes(inputs))
    sampling = sampling_inputs or ()
    return Takes(LOGITS in outputs, MIN_P in sampling,
                 *(not refused and all(name in sampling for name in names)
                   for names in (PENALTY_INPUTS, MIN_TOKENS_INPUTS, LOGIT_BIAS_INPUTS)))


def processes(inputs: Collection[str]) -> bool:
    """Whether a graph takes any of the penalty, min_tokens and logit_bias inputs (decides with them itself)."""
    return any(name in inputs for name in (*PENALTY_INPUTS, *MIN_TOKENS_INPUTS, *LOGIT_BIAS_INPUTS))


class Engine:
    """An engine file's session on a device, with what a slot needs to bind it.

    device: "cpu" or "cuda" (see requested_device). has_logits: its graph outputs the fp32 logits its
    decisions are made from (EngineSlot.logits reads them; engines compiled before that lack them).
    has_min_p: it samples with a `min_p` input (engines and samplers compiled before min_p lack it).
    has_penalties, has_min_tokens, has_logit_bias: the graph that decides a call applying them (the engine graph, or
    for a greedy-only graph the sampler) takes vLLM's penalties (PENALTY_INPUTS), its min_tokens (MIN_TOKENS_INPUTS),
    OpenAI's logit_bias; graphs compiled before them, and a draft's steps graph, lack them, and a draft's engine graph
    all but logit_bias (it proposes unpenalised, under a grammar's mask). processes: its own graph
    takes them (an engine graph with them; no greedy-only graph this compiler writes).
    cuda_graphs: path is the engine's greedy-only graph (no sampling, no control flow); on CUDA, calls
    that name a graph id are captured once and replayed as CUDA graphs (see slot.graph_id).
    Such an engine samples with `sampler` (the bundle's), fed each call's logits; without one it cannot.
    steps: path is a draft's steps graph (manifest.py), which drafts `self.steps_per_call` tokens a call, greedily.
    """

    def __init__(self, path: Path, info: EngineInfo, max_seq_len: int, device: str = "cpu",
                 cuda_graphs: bool = False, sampler: Sampler | None = None, steps: bool = False):
        self.path, self.info, self.max_seq_len, self.device = Path(path), info, max_seq_len, device
        self.greedy_only = cuda_graphs or steps
        self.captures = cuda_graphs and device == "cuda"
        self.calls = _CUDA_GRAPH_CALLS if self.captures else nullcontext()  # held around each call and its copies
        self.graphs_captured = 0  # CUDA graphs captured so far (bench: timed runs should replay, not capture)
        self._slots = itertools.count()
        self.vocab_size = info.shape.vocab_size
        # Made alone, or under "auto" once CUDA failed to start: load_manifest refused such a bundle otherwise.
        if not can_run(info, device):
            raise cpu_refusal(f"engine {path}", info.precision)
        if self.captures and info.precision == "fp32":
            raise BundleError(f"engine {path} is fp32, whose attention onnxruntime runs on the CPU (docs/gpu.md), so its "
                              "calls cannot be captured as CUDA graphs: rebuild with --precision fp16 or bf16, or run "
                              "without CUDA graphs")
        self.session = _session(path, device, self.captures)
        inputs = {i.name: (i.type, i.shape) for i in self.session.get_inputs()}
        outputs = {o.name: (o.type, o.shape) for o in self.session.get_outputs()}
        self.steps_per_call = check_engine_io(path, inputs, outputs, info, max_seq_len,
                                     "steps" if steps else "greedy" if cuda_graphs else "engine")
        self.element_type = ELEMENT_TYPES[info.precision]
        self.cache_names = cache_names(info.shape.num_layers)
        self.input_devices = _input_devices(self.session)
        # Attention runs where its cache is bound: the device, but the CPU for fp32 engines (docs/gpu.md).
        self.gpu_attention = self.input_devices[self.cache_names[0][0]] == "cuda"
        # The session that samples, and where it reads its inputs: the engine graph's own sampling branch, or
        # for a greedy-only graph the sampler (None: this engine cannot sample).
        if not self.greedy_only:
            self.sampling_session, self.sampling_devices = self.session, self.input_devices
        elif sampler is not None and not steps:
            self.sampling_session, self.sampling_devices = sampler.session, sampler.input_devices
        else:
            self.sampling_session, self.sampling_devices = None, {}
        self.processes = processes(self.input_devices)
        self.has_logits, self.has_min_p, self.has_penalties, self.has_min_tokens, self.has_logit_bias = graph_takes(
            self.input_devices, outputs, None if self.sampling_session is None else self.sampling_devices, self.greedy_only)

    def new_slot_index(self) -> int:
        """A number no other slot of this engine has: the slot's CUDA graphs are its own."""
        return next(self._slots)


class Sampler:
    """The bundle's sampler (manifest.SAMPLER) as a session on a device: the engines' sampling tail, fed the
    logits of an engine running its greedy-only graph. Its min-p, top-k and top-p choices are control flow, so its
    calls are never captured (each engine call still is); it has no weights and serves both engines."""

    def __init__(self, path: Path, device: str = "cpu"):
        self.session = _session(path, device, captures=False)
        check_sampler_io(path, {i.name: i.type for i in self.session.get_inputs()},
                         {o.name: o.type for o in self.session.get_outputs()})
        self.input_devices = _input_devices(self.session)


# Every live session this process made (see _keep_sessions_in_child).
_SESSIONS: weakref.WeakSet = weakref.WeakSet()


def _keep_sessions_in_child() -> None:
    """In a forked child (gunicorn --preload, os.fork): it inherits the sessions but not their thread pools' threads,
    and onnxruntime (1.32) destroys a session with a pool of its own by waiting for those threads, for good: a child
    that dropped a decoder loaded before the fork, or merely exited (sys.exit, as a gunicorn worker leaves), hung.
    The child keeps each inherited session, a reference nothing drops, so none is destroyed (the process's exit
    frees their memory, shared with the parent's until written). Decoding with them works: the calling thread
    does a call's work alone."""
    for session in list(_SESSIONS):
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(session))


os.register_at_fork(after_in_child=_keep_sessions_in_child)


def _session(path: Path, device: str, captures: bool) -> ort.InferenceSession:
    """An onnxruntime session of the file at path on device, or a one-line error."""
    options = session_options()
    # fp32 engines compute fp32 (the CUDA provider would use TF32 matmuls otherwise).
    cuda_options = {"use_tf32": "0", **({"enable_cuda_graph": "1"} if captures else {})}
    provider = (PROVIDERS[device], cuda_options if device == "cuda" else {})
    if device == "cuda":
        choose_attention_kernels()
    try:
        # enable_fallback=0: onnxruntime would otherwise move a failing session to the CPU, silently.
        session = ort.InferenceSession(str(path), options, providers=[provider], enable_fallback=0)
    except Exception as exc:  # onnxruntime raises its own untyped exceptions
        if "use_per_session_threads" in str(exc):  # other code made the process's pool (use_shared_thread_pool's doc)
            raise DeviceError("onnxruntime's shared thread pool was made in this process (set_global_thread_pool_sizes), "
                              "and every later session must use it: load the decoder with shared_thread_pool=True "
                              "(or call specbuild_runtime.engine.use_shared_thread_pool() first)") from None
        if captures:  # e.g. onnxruntime refusing to capture a graph with copies between host and device
            raise BundleError(f"onnxruntime cannot run engine {path} as CUDA graphs: {first_line(exc)}; run with "
                              "--no-cuda-graphs (cuda_graphs=False)") from None
        raise BundleError(f"cannot load {path}: {first_line(exc)}; rebuild the bundle with `specbuild compile`") from None
    if session.get_providers()[0] != PROVIDERS[device]:  # the provider failed to start (e.g. no driver)
        raise DeviceError(f"onnxruntime could not start its {PROVIDERS[device]} for {path} (see its log "
                          "with log_severity_level 0); is a GPU and its driver present?")
    _SESSIONS.add(session)
    return session


def choose_attention_kernels() -> None:
    """Before a CUDA session is made: GroupQueryAttention through cuDNN's SDPA (onnxruntime's first choice on an
    H100 or H200) decoded token 0 at times on an H100 (threads, Gemma 3 replays, a seeded request's second run;
    not on every run) and GPT-2's replays other tokens; with it off (flash attention instead) every GPU test
    passed there (2026-11-26). onnxruntime reads the variable as it builds a session's kernels; one set by the
    user is kept. It holds for the whole process (a peer such as onnxruntime-genai too)."""
    os.environ.setdefault("ORT_ENABLE_CUDNN_FLASH_ATTENTION", "0")


def _input_devices(session: ort.InferenceSession) -> dict[str, str]:
    """Where the session reads each input ("Cuda" is onnxruntime's name for CUDA device memory): CPU-side
    kernels (shape arithmetic, GroupQueryAttention's total length) read theirs from host memory, and
    binding those on the device would add a copy back each call."""
    return {value.name: "cuda" if memory.name == "Cuda" else "cpu"
            for value, memory in zip(session.get_inputs(), session.get_input_memory_infos())}
