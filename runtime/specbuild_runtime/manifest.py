"""The bundle format: the one place both the compiler and the runtime learn what a bundle holds.

A bundle is a folder:
    manifest.json           this schema, versioned by FORMAT_VERSION
    target.onnx(.data)      target engine: greedy verification built in
    draft.onnx(.data)       draft engine: same I/O, fed num_drafts = 0
    {role}.greedy.onnx      each engine's greedy-only graph, reading the weights from {role}.onnx.data:
                            the I/O below without the sampling, penalty, min_tokens and logit_bias
                            inputs and `probs` (and `logits` in every bundle that has one): it decides
                            on the raw logits, without control flow, so that onnxruntime can capture its
                            calls as CUDA graphs (those compiled before the sampler's greedy branch take
                            the penalty inputs and the rest, and decide with them)
    draft.steps.onnx        the draft's greedy drafting of K tokens in one call (K = the output's length),
                            reading draft.onnx.data: in input_ids, seqlens_k, total_len (step 0) and
                            total_len.{j} (step j, j = 1..K-1, each a call over one token), the past
                            buffers; out drafts int64 [K] (step j's argmax, fed to step j+1) and each step's
                            present buffers: present_*.{i} for step 0, present_*.{i}.step{j} after it, all
                            bound to the same buffers. No control flow.
    sampler.onnx            the deciding tail alone (no weights), for decoders running the greedy-only
                            graphs: in logits, input_ids, num_drafts, the sampling and penalty inputs below; out
                            accepted, next_token, probs; the same nodes as the engines' penalties and their
                            greedy and sampling branches (before the greedy branch: the sampling one alone),
                            run for a call that samples or applies penalties, min_tokens or logit_bias
    tokenizer/              the tokenizer both models share (tokenizer.json + HF side files)
    tensorrt-llm/, vllm/    compiled with --backend tensorrt-llm or all: TensorRT-LLM checkpoints and the
                            plans to build, run and serve them (TensorRTLLMPart); no .onnx files with
                            tensorrt-llm alone

Engine I/O, format version 2 (both engines; this docstring is the written contract between the compiler
and the runtime). S = tokens fed this call, D = num_drafts, V = the engine's vocabulary, F = the engine's
float type (fp32, fp16 or bf16; see EngineInfo.precision):
    in   input_ids      int64 [1, S]    last accepted token(s) followed by num_drafts draft tokens
         seqlens_k      int32 [1]       total_len - 1 (GroupQueryAttention's form; fed, not computed, so
                                        no length arithmetic sits between device nodes)
         total_len      int32 []        tokens in the cache after this call (past + S); a call over a cache
                                        may say any value from S + 1 to max_seq_len (its lengths come
                                        from seqlens_k; only S itself says a prompt's first call)
         num_drafts     int64 []        how many of the S tokens are drafts to verify
         temperature    f32 []          0 = greedy; above 0 sample from softmax(logits / temperature)
         top_k          int64 []        keep the k most probable tokens (0 = all)
         top_p          f32 []          keep the smallest nucleus with this mass (1 = all)
         min_p          f32 []          keep the tokens at least min_p times as probable as the most
                                        probable (0 = all), before top_k and top_p. Engines and samplers
                                        compiled before it lack it, and sample without min_p
         repetition_penalty, presence_penalty, frequency_penalty   f32 []   vLLM's penalties (1, 0, 0: none),
                                        applied to the raw logits before every decision, greedy or sampled
                                        (the `logits` output stays raw): repetition over the prompt's and
                                        the generated tokens, presence and frequency over the generated ones
         prompt_mask    bool [V]        the request's prompt tokens (repetition counts them as seen)
         output_counts  f32 [V]         each token's count among the tokens generated before this call's
                                        drafts; row j adds drafts 0..j-1 to it in the graph. These five
                                        are in the target's engine graph and the sampler (not the draft's
                                        engine graph, which proposes unpenalised, nor the greedy-only or
                                        steps graphs; drafts compiled before it took them too); graphs
                                        compiled before them lack all five, and decide without penalties
         min_tokens_left int64 []       vLLM's min_tokens: rows j < min_tokens_left (the tokens generated
                                        before min_tokens) give the stop_tokens -inf, in the same graphs
         stop_tokens    bool [V]        the eos and stop tokens min_tokens holds back. Graphs compiled
                                        before them lack both
         logit_bias     f32 [R, V]      added to the logits before the penalties, row j to row j (R = D+1;
                                        R = 1: to every row): OpenAI's logit_bias, and a grammar's mask
                                        (-inf) for row j's state (structured outputs), in the same graphs
                                        (absent in those compiled before it; [V] between the two: refused),
                                        and in the draft's engine graph, alone: a grammar's mask
         draft_probs    f32 [D, V]      the draft's distribution q at each draft (sampling; [0, V] greedy)
         uniforms       f32 [D+1]       random numbers: D to judge the drafts, one to draw the next token
         past_key.{i}, past_value.{i}   F [1, kv_heads, max_seq_len, head_dim], the KV buffers, bound
                                        in place (the same buffers as the present outputs)
         long_rope      int64 []        (a target whose EngineInfo.rope_switch_length is set, and only
                                        there; its engine and greedy-only graph) 1: rotate with LongRoPE's
                                        long factors, 0: the short ones; 1 for every call of a sequence
                                        longer than rope_switch_length (the runtime re-feeds the cache
                                        when decoding crosses that length), 0 for a shorter one
    out  accepted       int64 []        leading drafts accepted (greedy: equal to the model's argmax), each
                                        judged on a row of finite logits
         next_token     int64 []        the model's token after the accepted drafts, or not_finite_token (-1)
                                        where the logits it is decided from hold NaN or +inf
         probs          f32 [V] / [0]   the distribution next_token was drawn from; [0] when greedy
         logits         f32 [D+1, V]    the fp32 logits each decision is made from (row j judges draft j; row D
                                        gives the token after the drafts), bound only by requests that ask for
                                        logprobs. Engines compiled before it lack it, and give no logprobs
         present_key.{i}, present_value.{i}   the same buffers, written at positions past..total-1
Logits and every sampling decision are computed in fp32 whatever F is. No node reduces over an empty
tensor (a call without drafts runs on the CUDA provider too). A draft whose embedding table has padding
rows beyond the tokenizer's ids is cut to them by the compiler (the target never is); a smaller draft table
stays as is (its graph embeds the target's ids past it as its last row) and the runtime zero-pads its q
to the target's V.
"""

from __future__ import annotations

import difflib
import glob
import hashlib
import importlib.metadata
import json
import os
import re
import threading
import types
import typing
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path, PurePosixPath

from .errors import BundleError

FORMAT = "specbuild-bundle"
FORMAT_VERSION = 2
MANIFEST = "manifest.json"
SAMPLER = "sampler.onnx"
TOKENIZER_DIR = "tokenizer"
TOKENIZER_CONFIG = "tokenizer_config.json"  # transformers' settings beside tokenizer.json (chat template, flags)
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # transformers >= 4.47 saves the template here; older, in TOKENIZER_CONFIG
# The most drafts per round a bundle may ask for: the runtime keeps per-position lists and a [γ, vocab]
# buffer per request, and speculation stops paying long before (each draft must be accepted for the next
# to count).
MAX_GAMMA = 32
PRECISIONS = ("fp32", "fp16", "bf16")


LONG_ROPE = "long_rope"  # the input choosing a LongRoPE target's rotary table (EngineInfo.rope_switch_length)


def cache_names(num_layers: int) -> list[tuple[str, str]]:
    """The (past input, present output) name of each KV buffer of an engine, layer by layer, key first."""
    return [(f"past_{part}.{i}", f"present_{part}.{i}") for i in range(num_layers) for part in ("key", "value")]


def step_total_len(j: int) -> str:
    """The total_len input of step j of a draft's steps graph (step 0's is the engines' own)."""
    return f"total_len.{j}" if j else "total_len"


def step_presents(num_layers: int, j: int) -> list[str]:
    """The present outputs of step j of a draft's steps graph, in cache_names' order (step 0's are the
    engines' own)."""
    return [present + (f".step{j}" if j else "") for _, present in cache_names(num_layers)]


@dataclass
class ModelShape:
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int


@dataclass
class EngineInfo:
    role: str  # "target" | "draft"
    backend: str  # "onnx" (others, e.g. "tensorrt-llm", are listed but not run by this runtime)
    file: str
    architecture: str
    precision: str  # "fp32" | "fp16" | "bf16"
    quantization: str  # "none" | "int8" | "int4"
    shape: ModelShape
    parameters: int
    weight_bytes: int
    source: dict  # {"path": ..., "sha256": digest over the checkpoint's config+weights}
    quality: dict = field(default_factory=dict)
    source_dtype: str = ""  # the checkpoint's float type ("fp32" | "fp16" | "bf16"); precision is the engine's
    greedy_file: str = ""  # the greedy-only graph over the same weights ("" in bundles made before it)
    steps_file: str = ""  # (draft) the graph drafting several tokens in one call ("" in bundles made before it)
    # What a call reads of weight_bytes: all but the tables it only gathers rows from (an untied embedding,
    # GPT-2's positions), the bytes a memory-bound step is measured against (0 in bundles made before it).
    read_bytes: int = 0
    # next_token where the logits hold NaN or +inf (an fp16 engine that overflows); None in bundles made before
    # it, whose engines then decode token 0 from NaN probabilities (and an older runtime refuses the key).
    not_finite_token: int | None = None
    # (target) LongRoPE's original_max_position_embeddings where max_seq_len is beyond it (Phi-3 128k, Phi-4-mini): a
    # sequence up to this length rotates with the short factors, a longer one with the long factors at every
    # position, chosen per call by the `long_rope` input (0: one table, no such input; bundles made before it).
    rope_switch_length: int = 0

    @property
    def bytes_per_call(self) -> int:
        return self.read_bytes or self.weight_bytes

    @property
    def kv_bytes_per_position(self) -> int:
        """Bytes of KV cache one position takes (keys and values of every layer, in the engine's float type)."""
        s = self.shape
        return 2 * s.num_layers * s.num_kv_heads * s.head_dim * (4 if self.precision == "fp32" else 2)


@dataclass
class TensorRTLLMPart:
    """What `specbuild compile --backend tensorrt-llm|all` adds (this runtime does not run it): TensorRT-LLM
    checkpoints under tensorrt-llm/{target,draft}/ (config.json, rank{r}.safetensors) and the plans that
    build, run and serve them, with the draft length measured for this pair."""

    tp_size: int
    checkpoints: dict[str, dict]  # role -> {"dir", "architecture", "dtype", "quant_algo", "vocab_size",
    #   "parameters", "weight_bytes", a mixture's "expert_bytes", "source", "ranks": [{"file", "attention_heads",
    #   "kv_heads", "ffn_columns", "lm_head_rows", and a mixture's "experts"}]}: which source heads/columns/rows
    #   (each expert's columns, in a mixture) and experts each rank holds. A pair whose family
    #   the export does not take: {"architecture", "not_exported" (why, "" for the exported one), "source"} alone,
    #   no "dir", and plans only those that serve the source folders
    plans: dict[str, str]  # "build" | "run" | "llm_api" | "vllm" -> bundle-relative path
    gamma: dict  # {"gamma", "alpha", "cost_ratio", "expected_speedup", "method"} (older bundles: "weight_byte_ratio" too)
    engines: str | None = None  # where trtllm-build wrote the engines, when compile ran it


@dataclass
class Manifest:
    engines: dict[str, EngineInfo]  # the ONNX engines; empty in a TensorRT-LLM-only bundle
    max_seq_len: int
    gamma: int  # the most drafts per round the runtime's adaptive mode uses
    eos_token_ids: list[int]
    files: dict[str, str]  # relative path -> sha256
    created_by: str = ""
    # how the compile went: {"seconds", "peak_rss_bytes", "stages": {stage: {"seconds", "peak_rss_bytes_so_far"}}}
    build: dict = field(default_factory=dict)
    tensorrt_llm: TensorRTLLMPart | None = None
    sampler_file: str = ""  # SAMPLER with ONNX engines ("" in bundles made before it)
    # The sampling fields the target's generation_config.json sets, as written ({"temperature": 0.6, ...}; {}
    # for none): `serve` takes temperature, top_p, top_k and min_p from it for requests that omit them, as vLLM does.
    # None in bundles made before it.
    generation_config: dict | None = None
    # The longest max_seq_len compile accepts for this pair (the models' positions, a LongRoPE target's original
    # length, a window transformers' cache keeps): a too-long prompt's advice names no more. 0 in bundles made before it.
    # Written in every bundle since, it also makes a runtime from before it refuse them ("upgrade"): their sampling
    # graphs take a min_p input such a runtime does not bind (its sampled requests failed as a device fault).
    context_limit: int = 0
    format: str = FORMAT
    format_version: int = FORMAT_VERSION

    @property
    def has_greedy_graphs(self) -> bool:
        """Whether every engine has its greedy-only graph and the bundle its sampler, which CUDA graphs run
        (bundles compiled before them have neither)."""
        return bool(self.sampler_file) and all(engine.greedy_file for engine in self.engines.values())

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict) -> "Manifest":
        """The manifest of a parsed manifest.json; ValueError names the first thing that is wrong."""
        manifest = _typed(cls, data, "")
        _check_values(manifest)
        return manifest


class UnknownKey(ValueError):
    """A manifest key this runtime does not know: most likely a bundle from a newer specbuild."""


def _typed(cls, data, where: str):
    """data (parsed JSON) as the dataclass cls, every field checked against its annotation. Written by
    hand: the runtime's only dependencies are onnxruntime, numpy and tokenizers, and a schema library for
    one small file would be a fourth."""
    if not isinstance(data, dict):
        raise ValueError(f"{where or 'the manifest'} must be an object")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(known))
    missing = [name for name, f in known.items() if name not in data and f.default is MISSING
               and f.default_factory is MISSING]
    if unknown:
        raise UnknownKey(f"{_joined(where, unknown[0])} is a key this runtime does not know")
    if missing:
        raise ValueError(f"it lacks {_joined(where, missing[0])}")
    return cls(**{name: _value(hints[name], value, _joined(where, name)) for name, value in data.items()})


def _joined(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


def _value(hint, value, where: str):
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        return _value(next(a for a in args if a is not type(None)), value, where)
    if hint is int:
        if type(value) is not int:
            raise ValueError(f"{where} must be a whole number, not {value!r}")
        return value
    if hint in (str, bool):
        if type(value) is not hint:
            raise ValueError(f"{where} must be a {hint.__name__}, not {value!r}")
        return value
    if origin is list or hint is list:
        if not isinstance(value, list):
            raise ValueError(f"{where} must be a list, not {value!r}")
        return [_value(args[0], v, f"{where}[{i}]") for i, v in enumerate(value)] if args else value
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{where} must be an object, not {value!r}")
        return {k: _value(args[1], v, f"{where}.{k}") for k, v in value.items()} if args else value
    return _typed(hint, value, where)


def _check_values(manifest: "Manifest") -> None:
    """What the types cannot say: ranges, and that every file the runtime opens is one the digests cover."""
    if manifest.max_seq_len < 2:
        raise ValueError(f"max_seq_len is {manifest.max_seq_len}; it must be 2 or more")
    if manifest.context_limit and manifest.context_limit < manifest.max_seq_len:
        raise ValueError(f"context_limit is {manifest.context_limit}, below max_seq_len ({manifest.max_seq_len})")
    if not 1 <= manifest.gamma <= MAX_GAMMA:
        raise ValueError(f"gamma is {manifest.gamma}; it must be from 1 to {MAX_GAMMA}")
    for rel in manifest.files:
        path = PurePosixPath(rel)
        if path.is_absolute() or ".." in path.parts or "\\" in rel:
            raise ValueError(f"files lists {rel!r}, which is not a path inside the bundle")
    if manifest.engines and set(manifest.engines) != {"target", "draft"}:
        raise ValueError(f"engines are {sorted(manifest.engines)}, not a target and a draft")
    opened = [manifest.sampler_file] if manifest.sampler_file else []
    for role, engine in manifest.engines.items():
        if not {"path", "sha256"} <= set(engine.source):
            raise ValueError(f"engines.{role}.source lacks its path or sha256")
        if engine.precision not in PRECISIONS:
            raise ValueError(f"engines.{role}.precision is {engine.precision!r}, not one of {', '.join(PRECISIONS)}")
        if any(n < 1 for n in vars(engine.shape).values()):
            raise ValueError(f"engines.{role}.shape has a size below 1")
        if engine.rope_switch_length and not (role == "target" and 1 <= engine.rope_switch_length < manifest.max_seq_len):
            raise ValueError(f"engines.{role}.rope_switch_length is {engine.rope_switch_length}; a target's must be from 1 "
                             f"to below max_seq_len ({manifest.max_seq_len}), a draft's 0")
        opened += [name for name in (engine.file, engine.greedy_file, engine.steps_file) if name]
    for name in opened:
        if name not in manifest.files:
            raise ValueError(f"{name!r} is not among the files whose digests it lists")
    vocab = manifest.engines["target"].shape.vocab_size if "target" in manifest.engines else None
    if any(t < 0 or (vocab is not None and t >= vocab) for t in manifest.eos_token_ids):
        raise ValueError(f"eos_token_ids {manifest.eos_token_ids} are not token ids of the target's vocabulary")


def can_run(info: EngineInfo, device: str = "cpu") -> bool:
    """Whether onnxruntime runs the engine on the device: its CPU provider (1.32) has no bf16 Gemm or MatMul, so a bf16
    graph fails to load there (NOT_IMPLEMENTED), where fp32, fp16 and quantized ones load and decode."""
    return not (device == "cpu" and info.precision == "bf16")


def cpu_refusal(what: str, precision: str) -> BundleError:
    """The one line for an engine (what) the CPU provider cannot run, naming both ways out."""
    return BundleError(f"{what} is {precision}, which onnxruntime's CPU provider cannot run (it has no {precision} "
                       "Gemm): run it on a CUDA GPU (--device cuda; device='cuda' in Python), or compile it with "
                       "--precision fp32 for a CPU")


def where_it_runs(manifest: Manifest) -> str:
    """Where the bundle's ONNX engines run, for compile's summary and inspect."""
    precisions = {info.precision for info in manifest.engines.values()}
    if not all(can_run(info) for info in manifest.engines.values()):
        return ("a CUDA GPU only: bf16, which onnxruntime's CPU provider cannot run (compile with --precision fp32 for "
                "a CPU)")
    if "fp16" in precisions:
        return ("a CUDA GPU, or a CPU (fp16 is for GPUs: the CPU provider has no fp16 Gemm and casts each weight to "
                "fp32 as it reads it)")
    return "a CPU or a CUDA GPU"


def require_onnx_engines(root: Path, manifest: Manifest) -> None:
    """This runtime runs the ONNX engines; a bundle compiled with --backend tensorrt-llm alone has none."""
    if not manifest.engines:
        plans = manifest.tensorrt_llm.plans if manifest.tensorrt_llm else {}
        if plans and "build" not in plans:  # a family TensorRT-LLM's checkpoint flow lacks
            raise BundleError(f"{root} holds only plans that serve its source folders with TensorRT-LLM or vLLM, which "
                              f"this runtime does not run: {' or '.join(str(root / path) for path in plans.values())} "
                              "(docs/tensorrt-llm.md), or compile with --backend onnx or all")
        raise BundleError(f"{root} holds only a TensorRT-LLM export, which this runtime does not run: build and run it "
                          f"with {root / plans.get('build', '')} and {root / plans.get('run', '')} (docs/tensorrt-llm.md), "
                          "or compile with --backend onnx or all")


class HashingStopped(Exception):
    """sha256_file's stop was set: the load it hashed for has failed, and no one will read the digest."""


def sha256_file(path: Path, stop: threading.Event | None = None) -> str:
    """The file's sha256, read a MiB at a time (hashlib.file_digest's loop, which cannot be stopped): stop, once another
    thread sets it, ends the hashing at the next MiB (HashingStopped), where the load it was for failed meanwhile
    (digests_checked) and the rest of a file of gigabytes would cost seconds of CPU for nothing."""
    digest = hashlib.sha256()
    buffer = bytearray(1 << 20)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while size := f.readinto(buffer):
            if stop is not None and stop.is_set():
                raise HashingStopped(path)
            digest.update(view[:size])
    return digest.hexdigest()


def bundle_files(root: Path, hashed: typing.Callable[[int], None] | None = None) -> dict[str, str]:
    """sha256 of every file in the bundle except the manifest itself; hashed(bytes) after each file (the
    compiler's progress: a 7B bundle is tens of GB to read)."""
    digests = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            digests[p.relative_to(root).as_posix()] = sha256_file(p)
            if hashed:
                hashed(p.stat().st_size)
    return digests


def nearest(path: Path, holds: str) -> str:
    """'; did you mean FOLDER?' for a path that does not exist where one folder beside it, named much as it, holds
    the file `holds` (a bundle's manifest, a checkpoint's config.json): a typo is the likeliest reason; else ''.
    Not a name whose digits differ: another model, not a typo (Qwen3-1.7B for Qwen3-0.6B, bundle-int8 for
    bundle-int4); not one of two: the user chooses. Names alone are compared; only the few near ones are looked
    into, so a folder of thousands costs no stat (or unreadable folder's error) for each."""
    try:
        names = os.listdir(path.parent)
    except OSError:  # no such parent, or one this user cannot list
        return ""
    # 0.8, not difflib's 0.6: one letter left out, added, changed or swapped in a name of 5 or more is 0.8 and up,
    # where 0.6 took qwen3-draft for qwen3-target (0.61): it asked a compile's --target whether it meant the draft.
    near = [name for name in difflib.get_close_matches(path.name, names, n=5, cutoff=0.8)
            if _digits(name) == _digits(path.name) and os.path.isfile(path.parent / name / holds)]
    return f"; did you mean {path.parent / near[0]}?" if len(near) == 1 else ""


def _digits(name: str) -> str:
    return re.sub(r"\D", "", name)


def load_manifest(root: str | Path, check_digests: bool = True, require_engines: bool = False,
                  device: str | None = None) -> Manifest:
    """Read and check a bundle's manifest; every failure is a one-line BundleError. require_engines: the
    caller runs the ONNX engines (a TensorRT-LLM-only bundle is refused). device: the caller runs them there (an
    engine it cannot run is refused before the digests, which read every byte: 2.2 s of CPU for 2.5 GB)."""
    root = Path(root)
    path = root / MANIFEST
    if not path.is_file():
        if path.exists():  # not missing: compile --overwrite would refuse this folder as no bundle's
            raise BundleError(f"{root} is not a specbuild bundle: {MANIFEST} {_not_a_file(path)}; {UNREADABLE_ADVICE}")
        if (root / "config.json").is_file():  # the checkpoint a bundle is compiled from, given in its place
            raise BundleError(f"{root} is a Hugging Face checkpoint, not a specbuild bundle; compile it with a draft "
                              f"first: specbuild compile --target {root} --draft DRAFT_DIR --output BUNDLE")
        if unfinished := _unfinished_compile(root):
            raise BundleError(unfinished)
        if not root.exists():  # a typo: "manifest.json is missing" sent users looking inside a folder there is not
            raise BundleError(f"{root} does not exist; pass the folder `specbuild compile --output` wrote"
                              + nearest(root, MANIFEST))
        if root.is_file():  # one of a bundle's files, as llama.cpp takes a .gguf: "manifest.json is missing" misled
            where = (f"the bundle folder that holds it, {root.parent}" if (root.parent / MANIFEST).is_file() else
                     "the folder `specbuild compile --output` wrote")
            raise BundleError(f"{root} is a file, not a bundle folder; pass {where}")
        raise BundleError(f"{root} is not a specbuild bundle: {MANIFEST} is missing (build one with `specbuild compile`)")
    try:
        data = json.loads(path.read_bytes())
    except OSError as exc:  # permissions (a bundle copied from another user), an I/O error: not a broken manifest
        raise BundleError(f"{path} cannot be read ({exc.strerror}); give this user read access to the bundle's "
                          f"files (e.g. chmod -R a+rX {root})") from None
    except ValueError as exc:  # not UTF-8, or not JSON
        raise BundleError(f"{path} is not valid JSON ({exc}); {UNREADABLE_ADVICE}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise BundleError(f"{path} is not a specbuild manifest; {UNREADABLE_ADVICE}")
    version = data.get("format_version")
    if version != FORMAT_VERSION:
        made_by = data.get("created_by") if isinstance(data.get("created_by"), str) else ""
        newer = type(version) is int and version > FORMAT_VERSION
        advice = (f"upgrade specbuild-runtime to one that reads version {version}, or rebuild the bundle with the "
                  "`specbuild compile` that matches this runtime" if newer else
                  "rebuild the bundle with the `specbuild compile` that matches this runtime")
        raise BundleError(f"{root} has bundle format version {version!r}{f' (made by {made_by})' if made_by else ''}, "
                          f"this runtime (specbuild-runtime {runtime_version()}) reads version {FORMAT_VERSION}; "
                          f"{advice}")
    try:
        manifest = Manifest.from_dict(data)
    except ValueError as exc:
        advice = ("upgrade specbuild-runtime, or rebuild the bundle with this version's `specbuild compile`"
                  if isinstance(exc, UnknownKey) else "rebuild the bundle with `specbuild compile`")
        raise BundleError(f"{path} cannot be used: {exc}; {advice}") from None
    if require_engines:
        require_onnx_engines(root, manifest)
    refused = [role for role, info in manifest.engines.items() if device and not can_run(info, device)]
    if refused:
        role = "target" if "target" in refused else refused[0]
        raise cpu_refusal(f"{root}'s {role} engine", manifest.engines[role].precision)
    if check_digests:
        # A caller that runs the ONNX engines never opens the TensorRT-LLM part: hashing it doubled the digest check
        # of a --backend all bundle (Qwen3-0.6B fp32: 2.5 GB of engines, 3.3 GB of TensorRT-LLM checkpoints; 2.2 ->
        # 4.7 s of CPU). `inspect` (require_engines False) still checks every file.
        verify_digests(root, manifest, skip=tensorrt_llm_files(manifest) if require_engines else frozenset())
    return manifest


def runtime_version() -> str:
    """The installed specbuild-runtime's version (said when a bundle's format is not this runtime's)."""
    try:
        return importlib.metadata.version("specbuild-runtime")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        return "0+unknown"


# What a writer of an output NAME (specbuild/staging.py: a compile's bundle) leaves beside it when killed: the staging
# folder it builds in until it publishes it with a rename (`.NAME.partial-PID`), its scratch space (`-scratch`), and the
# old folder it set aside while publishing (`.NAME.old-PID`). The next writer to NAME removes them.
LEFTOVER = re.compile(r"\.(?P<name>.+)\.(?P<kind>partial|old)-\d+(-scratch)?")


def _unfinished_compile(root: Path) -> str | None:
    """Why root holds no bundle where an unfinished compile explains it (root is one's staging folder, or its output
    and only the staging folder is there), or None. "not a bundle" or "does not exist" alone left a user with a
    killed compile's folder nowhere to go."""
    if root.exists():  # a staging folder's name where nothing is was mistyped, or removed by a compile since
        if not (match := LEFTOVER.fullmatch(root.name)) or match["kind"] != "partial":  # an old folder is a bundle
            return None
        output = root.parent / match["name"]
        return (f"{root} is the staging folder of an unfinished compile to {output} (running still, or killed), not a "
                f"bundle: pass {output} once that compile finished, rerunning it if it was killed (it removes the "
                f"folder); deleting the folder is safe once no compile to {output} runs")
    left = sorted(entry.name for entry in root.parent.glob(f".{glob.escape(root.name)}.partial-*")
                  if (match := LEFTOVER.fullmatch(entry.name)) and match["name"] == root.name)
    if not left:
        return None
    # While a compile runs, its output is absent too (on a first compile): "did not finish; rerun it" sent a user who
    # ran generate beside it to start a second, which is refused.
    return (f"{root} does not exist yet: a compile to it has not finished (it runs still, or was killed) and left "
            f"{left[0]} beside it; wait for it, or rerun it if it was killed (it removes the folder); deleting the "
            f"folder is safe once no compile to {root} runs")


# compile --overwrite replaces only a folder whose manifest says it is a bundle: not this one.
UNREADABLE_ADVICE = "rebuild the bundle with `specbuild compile` into a new folder (or delete this one first)"


def read_tokenizer_config(tokenizer_dir: Path):
    """The bundle's tokenizer_config.json as parsed (empty without one), or a one-line BundleError where it is no
    JSON: the digest check catches a damaged file first, unless it is skipped (serve --no-check-digests)."""
    path = tokenizer_dir / TOKENIZER_CONFIG
    try:
        return json.loads(path.read_bytes()) if path.is_file() else {}
    except ValueError as exc:
        raise BundleError(f"bundle file {path} is not valid JSON ({exc}); rebuild the bundle with "
                          "`specbuild compile`") from None


def chat_template_source(tokenizer_dir: Path, config: dict) -> tuple[str, str] | None:
    """The bundle's chat template and the file it is in (as "tokenizer/NAME"), or None where its tokenizer has
    none; `config` is its tokenizer_config.json (read_tokenizer_config). Here, not beside the renderer: inspect
    names the file without jinja2."""
    source: object  # what the config holds: a template, named templates, or anything
    if (tokenizer_dir / CHAT_TEMPLATE_FILE).exists():
        source, name = (tokenizer_dir / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8"), CHAT_TEMPLATE_FILE
    else:
        source, name = config.get("chat_template"), TOKENIZER_CONFIG
    if isinstance(source, list):  # named templates: [{"name": "default", "template": ...}, ...]
        source = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}.get("default")
    return (source, f"{TOKENIZER_DIR}/{name}") if isinstance(source, str) and source else None


def _not_a_file(path: Path) -> str:
    """What is wrong where a file should be: a folder in its place (a copy or unpack gone wrong) is no missing file."""
    if path.is_dir():
        return "is a folder where a file should be"
    return "is not a regular file" if path.exists() else "is missing"


def tensorrt_llm_files(manifest: Manifest) -> frozenset[str]:
    """The files of the TensorRT-LLM and vLLM part (checkpoints and plans), which the ONNX runtime never opens."""
    part = manifest.tensorrt_llm
    if part is None:
        return frozenset()
    folders = tuple(f"{PurePosixPath(c['dir']).as_posix()}/" for c in part.checkpoints.values() if isinstance(c.get("dir"), str))
    return frozenset(rel for rel in manifest.files if rel.startswith(folders) or rel in part.plans.values())


def weight_files(manifest: Manifest) -> frozenset[str]:
    """The engines' external data (each {file}.data, shared by its greedy-only and steps graphs): nearly every byte of
    a bundle, which onnxruntime reads as numbers and never parses."""
    return frozenset(f"{info.file}.data" for info in manifest.engines.values()) & manifest.files.keys()


@contextmanager
def digests_checked(root: Path, manifest: Manifest, check: bool = True) -> Iterator[None]:
    """load_manifest's digest check (check_digests) for a caller that runs the ONNX engines and loads them in the body:
    every file but the weights (weight_files) before it, the weights in a thread meanwhile, all by its end: Qwen3-0.6B
    fp32's 1.95 s of hashing cost 0.84 s to the first token on 2 cores it nearly had to itself, beside a session
    prepacking on one (docs/runtime.md, Cold start). What loading parses (graphs, tokenizer) is checked first;
    onnxruntime reads the weights while they are hashed, and a damaged one is a wrong number, never a crash: the body's
    result is refused in verify_digests' words all the same, which also replace a BundleError of the body's (a truncated
    weights file that onnxruntime could not load). Any other exception of the body's (Ctrl-C, a DeviceError) stops the
    hashing, and the thread is joined before the exception leaves."""
    if not check:
        yield
        return
    weights = weight_files(manifest)
    verify_digests(root, manifest, skip=tensorrt_llm_files(manifest) | weights)
    stop = threading.Event()
    failed: list[BaseException] = []

    def hash_weights() -> None:
        try:
            verify_digests(root, manifest, skip=frozenset(manifest.files.keys() - weights), stop=stop)
        except BaseException as exc:  # raised in the caller's thread once joined
            failed.append(exc)
    thread = threading.Thread(target=hash_weights, name="specbuild-digests")
    thread.start()
    try:
        try:
            yield
        except BundleError:
            thread.join()  # a damaged file explains the load's failure
            if failed:
                raise failed[0] from None
            raise
        thread.join()
        if failed:
            raise failed[0]
    finally:
        # Where the body raised anything else (Ctrl-C, a DeviceError) or a join above was interrupted, the hashing
        # ends with the load instead of reading on for seconds after the constructor raised.
        stop.set()
        thread.join()


def verify_digests(root: Path, manifest: Manifest, skip: frozenset[str] = frozenset(),
                   stop: threading.Event | None = None) -> None:
    for rel, expected in manifest.files.items():
        if rel in skip:
            continue
        path = root / rel
        if not path.is_file():
            raise BundleError(f"bundle file {path} {_not_a_file(path)}; rebuild the bundle with `specbuild compile`")
        try:
            digest = sha256_file(path, stop)
        except OSError as exc:  # gone since is_file (a bundle swapped in at its path) or unreadable
            raise BundleError(f"bundle file {path} cannot be read ({exc.strerror}); rebuild the bundle with "
                              "`specbuild compile`") from None
        if digest != expected:
            raise BundleError(
                f"bundle file {path} is corrupted (sha256 differs from the manifest); rebuild the bundle "
                "with `specbuild compile`"
            )
