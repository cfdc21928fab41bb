"""The stage "loading checkpoints" (pipeline.STAGES): load and validate Hugging Face checkpoint folders
(config, safetensors, tokenizer).

Never unpickles (safetensors only) and never runs remote code.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import struct
import sys
from collections.abc import Callable
from importlib.util import find_spec
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from specbuild_runtime.errors import first_line
from specbuild_runtime.manifest import MANIFEST, ModelShape, nearest

from ..errors import CheckpointError, PairMismatchError, UnsupportedModelError

# architecture -> graph builder (specbuild/compile/graphs/<family>.py)
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",  # Llama 2, Llama 3.x (rope scaling, tied embeddings)
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "llama",
    "Qwen3MoeForCausalLM": "llama",  # Qwen3's layers, their MLPs (all or some: decoder_sparse_step) mixtures of experts
    "MixtralForCausalLM": "llama",  # Mistral's layers, every MLP a mixture of experts
    "Phi3ForCausalLM": "llama",  # Phi-3, Phi-3.5-mini, Phi-4-mini
    "Gemma2ForCausalLM": "gemma",
    "Gemma3ForCausalLM": "gemma",  # Gemma 3 text (1B; the larger ones are multimodal)
    "GraniteForCausalLM": "llama",  # Granite 3.x dense: Llama with µP multipliers
    "Olmo2ForCausalLM": "olmo2",
    "Olmo3ForCausalLM": "olmo2",  # OLMo 2's layers, some of them sliding-window ones
    "GPT2LMHeadModel": "gpt2",
}
SUPPORTED_ACTIVATIONS = {"silu", "gelu_new", "gelu_pytorch_tanh", "gelu"}
# What transformers' code of each architecture reads of a config.json: a key it ignores is ignored here too, as a Llama
# config's sliding_window or final_logit_softcapping is (a config.json may carry any key, which transformers keeps).
# Windowed attention (sliding_window), per layer where layer_types says so (transformers 5 runs a Mistral config.json
# with layer_types as a Ministral, which reads them; Phi-3 and Mixtral window every layer whatever layer_types says,
# Qwen3-MoE every layer where use_sliding_window, its config dropping the window otherwise).
WINDOWED = {"MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM", "Gemma2ForCausalLM",
            "Gemma3ForCausalLM", "Olmo3ForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM"}
LAYER_TYPED = WINDOWED - {"Phi3ForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM"}
# Biases: mlp_bias reaches Llama's and Granite's MLPs alone; attention_bias every attention but Mistral's and Phi-3's,
# which never have one (Qwen2's q, k and v always do).
MLP_BIASED = {"LlamaForCausalLM", "GraniteForCausalLM"}
ATTENTION_UNBIASED = {"MistralForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM"}
# Built as their Llama by vLLM (its registry; TensorRT-LLM's too for Mistral), which reads both keys all the same
RUN_AS_LLAMA = {"MistralForCausalLM", "Phi3ForCausalLM"}


@dataclass
class ModelSpec:
    """Everything the graph builders need to know about a model, as plain data."""

    architecture: str
    family: str
    shape: ModelShape
    intermediate_size: int
    norm_eps: float
    hidden_act: str
    attention_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    layer_types: list[str]  # per layer: "full_attention" or "sliding_attention"
    sliding_windows: list[int | None]  # per layer: positions a query sees, its own included (None: all)
    attention_scale: float  # of q·k before softmax
    rotary_dim: int  # leading dims of each head that rope rotates (0: no rope)
    qk_norm: bool = False  # an RMS norm on each q and k head (Qwen3, Gemma 3)
    attention_softcap: float | None = None  # cap·tanh(scores/cap) (Gemma 2)
    final_softcap: float | None = None  # the same on the logits (Gemma 2)
    # Granite's µP multipliers: of the embeddings, of each block's output before its residual add, and the logits'
    # divisor
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    # A mixture of experts (Qwen3-MoE, Mixtral): the layers whose MLP is one, each token's MLP the weighted sum of its
    # experts_per_token highest-scoring experts' gated MLPs (expert_intermediate_size wide), the weights renormalized
    # to sum to 1 where norm_topk_prob says so
    sparse_layers: tuple[int, ...] = ()
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    norm_topk_prob: bool = False


# safetensors dtype -> numpy dtype (bf16 and fp8 from ml_dtypes, which numpy lacks)
SAFETENSORS_DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
# Weights stored otherwise are refused at load: precision.py converts only these to an engine's type
WEIGHT_DTYPES = {SAFETENSORS_DTYPES[name] for name in ("F32", "F16", "BF16")}
INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies: its shard, stored dtype and shape, and its bytes' absolute offsets."""

    file: Path
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass
class Checkpoint:
    path: Path
    spec: ModelSpec
    config: object  # transformers.PretrainedConfig, kept for rotary tables
    tokenizer: object | None  # transformers.PreTrainedTokenizerFast; None: a draft without one speaks the target's
    weight_files: list[Path]
    entries: dict[str, TensorEntry]  # every stored tensor, from the shards' headers
    loaded: frozenset[str]  # the stored tensors transformers loads into this config's model (the rest it ignores)

    def tensor_names(self) -> list[str]:
        return list(self.entries)

    def weights(self) -> frozenset[str]:
        """The stored tensors the model computes with: what transformers loads, less a tied model's stored
        lm_head.weight (transformers loads it, then ties the head to the embeddings)."""
        return self.loaded - ({"lm_head.weight"} if self.spec.tie_word_embeddings else set())

    def token_ids(self) -> int:
        """How many ids its tokenizer gives (its largest + 1): embedding rows past them are padding."""
        return token_ids(self.tokenizer)

    def parameters(self) -> int:
        """The model's parameters as transformers holds them (a tied head counted once)."""
        return sum(int(np.prod(self.entries[name].shape)) for name in self.weights())

    def entry(self, name: str) -> TensorEntry:
        """The stored dtype and shape of a tensor without reading it."""
        entry = self.entries.get(name)
        if entry is None:
            single = self.path / "model.safetensors"
            where = (single if self.weight_files == [single] else
                     self.path / INDEX if (self.path / INDEX).is_file() else self.path)
            raise CheckpointError(
                f"{where} has no tensor {name!r}, which a {self.spec.architecture} needs; the checkpoint is "
                "incomplete or not the architecture its config.json names"
            )
        return entry

    def tensor(self, name: str, rows: tuple[int, int] | None = None) -> np.ndarray:
        """One tensor in its stored dtype, read from its shard on demand; rows=(start, stop) reads only
        those rows (along the first axis).

        Read with one read into a fresh array instead of through the safetensors library: the library
        maps the whole shard (its pages then count in this process's memory until the shard is closed)
        and its numpy reader has no bf16.
        """
        entry = self.entry(name)
        start, stop = rows if rows is not None else (0, entry.shape[0] if entry.shape else 1)
        row_bytes = (entry.end - entry.start) // max(entry.shape[0], 1) if entry.shape else entry.end - entry.start
        array = np.empty((stop - start, *entry.shape[1:]) if entry.shape else (), entry.dtype)
        view = memoryview(array.reshape(-1).view(np.uint8))
        with open(entry.file, "rb") as f:
            f.seek(entry.start + start * row_bytes)
            done = 0
            while done < len(view):
                count = f.readinto(view[done:])
                if not count:
                    raise CheckpointError(f"{entry.file} is truncated (tensor {name!r} ends past the end of the "
                                          "file); download or save the checkpoint again")
                done += count
        return array

    def float_dtype(self) -> np.dtype:
        """The type most of the weights' bytes are stored in: fp32, fp16 or bf16, the types load allows a weight.
        The weights alone: a tensor transformers ignores (a rotary or mask buffer some checkpoints store), in
        whatever type, is no part of the model."""
        totals: dict[np.dtype, int] = {}
        for entry in map(self.entries.__getitem__, self.weights()):
            totals[entry.dtype] = totals.get(entry.dtype, 0) + entry.end - entry.start
        return max(totals, key=totals.get)

    def digest(self) -> str:
        """sha256 over config.json and the weight files: identifies the source of an engine."""
        return _digest([self.path / "config.json", *self.weight_files])


def checkpoint_digest(path: Path, role: str) -> str:
    """Checkpoint.digest of a folder, without loading it (as bench and verify compare a checkpoint with
    the source a bundle records)."""
    return _digest([Path(path) / "config.json", *_weight_files(Path(path), role)])


def _digest(files: list[Path]) -> str:
    h = hashlib.sha256()
    for path in files:
        h.update(path.name.encode())
        with open(path, "rb") as f:
            while block := f.read(1 << 22):
                h.update(block)
    return h.hexdigest()


def check_checkpoint_folder(path: Path, role: str) -> Path:
    """path / "config.json", or CheckpointError where path is no folder (a Hub model id, a typo) or holds no
    config.json (a bundle given where its source goes): what compile and distill refuse before they read anything."""
    if not path.is_dir():
        # A checkpoint beside a typo (checkpoints/targt) is the likelier meaning; else a Hub id given where a folder
        # goes (transformers takes either; specbuild never downloads), even where its first part is a folder here:
        # `hf download --local-dir Qwen/Qwen3-1.7B` made one, and Qwen/Qwen3-0.6B beside it is another download.
        near = "" if path.exists() else nearest(path, "config.json")
        hub_id = (not near and not path.exists() and not path.is_absolute() and len(path.parts) == 2
                  and not str(path).startswith("."))
        raise CheckpointError(f"{role} checkpoint {path} is not a folder; pass a Hugging Face checkpoint folder" + (
            f"; if {path} is a Hub model id, download it first (`hf download {path} --local-dir DIR`) and pass DIR"
            if hub_id else near))
    config_path = path / "config.json"
    if not config_path.is_file():
        if (path / MANIFEST).is_file():  # the bundle compile wrote, given where its source goes
            raise CheckpointError(f"{role} checkpoint {path} is a specbuild bundle, not a checkpoint; pass the Hugging Face "
                                  f"checkpoint folder it was compiled from (`specbuild inspect {path}` names it)")
        raise CheckpointError(f"{role} checkpoint {path} has no config.json; pass a Hugging Face checkpoint folder")
    return config_path


def load_checkpoint(path: str | Path, role: str) -> Checkpoint:
    path = Path(path)
    config_path = check_checkpoint_folder(path, role)
    raw = read_config_json(config_path)
    if not raw.get("architectures"):
        raise UnsupportedModelError(f"{config_path} names no architecture (no \"architectures\" list); give the model's "
                                    f"class, e.g. \"architectures\": [\"LlamaForCausalLM\"] (supported: "
                                    f"{', '.join(sorted(ARCHITECTURES))})")
    architecture = raw["architectures"][0]
    check_architecture(architecture, f"{role} checkpoint {path}", raw)
    if (quantized := raw.get("quantization_config")) is not None:  # any value: transformers would quantize by it
        method = quantized.get("quant_method") if isinstance(quantized, dict) else None
        raise UnsupportedModelError(
            f"{role} checkpoint {path} is pre-quantized ({method or 'quantization_config'}); "
            "specbuild reads fp32, fp16 and bf16 checkpoints and quantizes them itself (--quantize int4|int8): "
            "pass the unquantized checkpoint")
    weight_files = _weight_files(path, role)
    entries = _entries(weight_files, path)
    config = load_config(path, role)
    _check_rope_settings_read(config, raw, path, role)
    loaded = _loaded_tensors(config, entries, path, role)
    # A pruned or layer-sliced draft is often saved without one (save_pretrained of the model alone): it speaks the
    # target's, as vLLM and TensorRT-LLM take it, and validate_pair checks it by what it has.
    tokenizer = None if role == "draft" and not has_tokenizer_files(path) else load_tokenizer(path, role)
    try:
        spec = model_spec(config, architecture, path, role)
    except AttributeError as exc:  # e.g. a multimodal config (its text model's settings under text_config)
        raise UnsupportedModelError(f"{role} checkpoint {path}: config.json (model_type {raw.get('model_type')!r}) has "
                                    f"no {exc.name!r}, which a {architecture} needs; use the config.json of the "
                                    "text model these weights belong to") from None
    ckpt = Checkpoint(path, spec, config, tokenizer, weight_files, entries, loaded)
    _check_tied_head(ckpt, role)
    _check_stored_biases(ckpt, role)
    return ckpt


def read_config_json(config_path: Path) -> dict:
    """config.json as a dict, or one line saying why it is not one."""
    try:
        raw = json.loads(config_path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{config_path} is not valid JSON ({exc}); download or copy the checkpoint again") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{config_path} holds a JSON {type(raw).__name__}, not an object; pass a Hugging Face "
                              "checkpoint folder")
    return raw


def _check_tied_head(ckpt: Checkpoint, role: str) -> None:
    """CheckpointError where config.json ties the LM head to the embeddings but the checkpoint also stores an
    lm_head.weight of other values. transformers 4 then ties (the stored head is dropped), transformers 5 does
    not (it keeps the stored head), and the engines would follow neither for sure (the ONNX graph reads the
    embeddings, the TensorRT-LLM export the stored head): config.json must say which."""
    if not ckpt.spec.tie_word_embeddings or "lm_head.weight" not in ckpt.loaded:
        return
    embed = "transformer.wte.weight" if ckpt.spec.family == "gpt2" else "model.embed_tokens.weight"
    rows = ckpt.entry("lm_head.weight").shape[0]
    for start in range(0, rows, 4096):  # a few MB at a time, not a second copy of the table
        stop = min(start + 4096, rows)
        a, b = ckpt.tensor("lm_head.weight", (start, stop)), ckpt.tensor(embed, (start, stop))
        same = ((a.view(np.uint8) == b.view(np.uint8)).all() if a.dtype == b.dtype
                else np.array_equal(a.astype(np.float32), b.astype(np.float32)))
        if not same:
            raise CheckpointError(
                f"{role} checkpoint {ckpt.path}: config.json ties the LM head to the embeddings "
                "(tie_word_embeddings) but the weights hold an lm_head.weight with other values, which transformers "
                "4 ignores and transformers 5 uses; set \"tie_word_embeddings\": false in config.json to use it, or "
                "remove lm_head.weight from the weights to use the embeddings")


def _check_stored_biases(ckpt: Checkpoint, role: str) -> None:
    """UnsupportedModelError where config.json asks for biases transformers' model of the architecture never has
    and the weights store them, in an architecture other loaders run as a Llama (RUN_AS_LLAMA): transformers drops
    them (its load report lists them as UNEXPECTED), those loaders add them, and the engine would be one of the two
    models without a word. Without such tensors the key is ignored, as transformers ignores it; with the key false,
    or in another architecture (Qwen's MLP), every loader drops the tensors alike."""
    spec = ckpt.spec
    if spec.architecture not in RUN_AS_LLAMA:
        return
    asked = {key: module for key, module, built in (("attention_bias", ".self_attn.", spec.attention_bias),
                                                    ("mlp_bias", ".mlp.", spec.mlp_bias))
             if getattr(ckpt.config, key, False) and not built}
    stems = {name.removesuffix(".weight") for name in ckpt.loaded}
    dropped = sorted(name for name in ckpt.entries if name not in ckpt.loaded and name.endswith(".bias")
                     and any(module in name for module in asked.values())
                     # a bias of a projection the model has, stored with or without the base model's prefix
                     and {name.removesuffix(".bias"), "model." + name.removesuffix(".bias")} & stems)
    if dropped:
        keys = [key for key, module in asked.items() if any(module in name for name in dropped)]
        more = f" and {len(dropped) - 2} more" if len(dropped) > 2 else ""
        unset = " and ".join(f'"{key}": false' for key in keys)
        raise UnsupportedModelError(
            f"{role} checkpoint {ckpt.path} stores biases ({', '.join(dropped[:2])}{more}) that config.json asks for "
            f"({' and '.join(keys)}) but transformers' {spec.architecture} never has: transformers drops them, "
            "vLLM (which runs it as its Llama) adds them, so which model is meant is unclear; remove those tensors, "
            f"or set {unset} in config.json, to compile the model transformers runs")


def check_architecture(architecture: str, what: str, config: dict | None = None) -> None:
    """UnsupportedModelError, naming what it is (mixture of experts, multimodal) and what is supported, for
    an architecture without a graph builder."""
    if architecture not in ARCHITECTURES:
        raise UnsupportedModelError(f"{what} is a {architecture}{_kind(architecture, config or {})}, which specbuild "
                                    f"does not compile; it supports {', '.join(sorted(ARCHITECTURES))}")


def _kind(architecture: str, config: dict) -> str:
    if "num_experts" in config or "num_local_experts" in config or "Moe" in architecture:
        return " (mixture of experts)"
    if "vision_config" in config or "audio_config" in config or "ConditionalGeneration" in architecture:
        return " (multimodal)"
    return ""


def _weight_files(path: Path, role: str) -> list[Path]:
    """model.safetensors, or else the shards model.safetensors.index.json names, or else every *.safetensors in
    the folder.

    model.safetensors first, as transformers reads a folder: save_pretrained leaves the other layout's files
    behind when a checkpoint is saved again over itself (the index of earlier shards beside a new
    model.safetensors, or an earlier model.safetensors beside new shards), and verify would otherwise compare
    the engine with weights other than the ones it was built from."""
    if (path / "model.safetensors").is_file():
        # Alone, as transformers reads it: Mistral's repos keep their own format beside it
        # (consolidated.safetensors), others an adapter or a copy in another dtype.
        return [path / "model.safetensors"]
    if (path / INDEX).is_file():
        return indexed_files(path)
    files = sorted(p for p in path.glob("*.safetensors") if p.is_file())
    if files:
        return files
    if list(path.glob("*.bin")) or list(path.glob("*.pt")):
        raise CheckpointError(
            f"{role} checkpoint {path} has only pickled weights (*.bin); specbuild reads safetensors only. "
            "Re-save it with `model.save_pretrained(dir, safe_serialization=True)`"
        )
    raise CheckpointError(f"{role} checkpoint {path} has no *.safetensors weights; download or copy the whole "
                          "checkpoint (config.json, tokenizer and *.safetensors) into one folder and pass that")


def indexed_files(path: Path) -> list[Path]:
    """The shards model.safetensors.index.json names."""
    index = path / INDEX
    try:
        weight_map = json.loads(index.read_bytes())["weight_map"]
        names = sorted(set(weight_map.values()))
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{index} is not a safetensors index ({type(exc).__name__}: {exc}); download or copy the "
                              "checkpoint again") from None
    missing = [n for n in names if not (path / n).is_file()]  # a folder of that name too
    if missing:
        raise CheckpointError(f"{index} names {missing[0]}, which is not in {path}; the download is incomplete: "
                              "download or copy the checkpoint again")
    return [path / n for n in names]


def digest_of_shards_beside(path: Path) -> str | None:
    """The digest compile recorded for a folder holding both a model.safetensors and indexed shards when it read the
    shards (as it did before it read model.safetensors first), or None without both."""
    if not ((path / "model.safetensors").is_file() and (path / INDEX).is_file()):
        return None
    try:
        return _digest([path / "config.json", *indexed_files(path)])
    except CheckpointError:
        return None


def _entries(files: list[Path], folder: Path) -> dict[str, TensorEntry]:
    """Every tensor's entry, from the shards' headers (8-byte length, then JSON; see the safetensors spec).

    Checked against each file's size, so a truncated download fails here, before anything is built.
    """
    entries: dict[str, TensorEntry] = {}
    for file in files:
        size = file.stat().st_size
        try:
            if size < 8:  # a download cut before its header's length; struct's error would say only "error"
                raise ValueError(f"it has {size} bytes, fewer than the 8 of its header's length")
            with open(file, "rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                if length > size - 8:
                    raise ValueError(f"its header claims {length} bytes, the file has {size}")
                header = json.loads(f.read(length))
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                dtype = SAFETENSORS_DTYPES.get(info["dtype"])
                if dtype is None:
                    raise ValueError(f"tensor {name!r} has dtype {info['dtype']}, which specbuild does not read")
                begin, end = (8 + length + int(o) for o in info["data_offsets"])
                shape = tuple(int(d) for d in info["shape"])
                if end - begin != dtype.itemsize * math.prod(shape) or end > size:
                    raise ValueError(f"tensor {name!r} needs bytes {begin}..{end}, the file has {size}")
                if name in entries:  # two copies of the weights (no index says which files are the checkpoint's)
                    raise CheckpointError(f"{file.name} and {entries[name].file.name} in {folder} both hold tensor "
                                          f"{name!r}; move the files that are not this checkpoint's weights out of "
                                          f"the folder (or add the checkpoint's {INDEX})")
                entries[name] = TensorEntry(file, dtype, shape, begin, end)
        except (struct.error, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{file} is truncated or corrupt (unreadable header: {type(exc).__name__}); "
                                  "download or save the checkpoint again") from None
        except ValueError as exc:
            raise CheckpointError(f"{file} is truncated or corrupt ({exc}); download or save the checkpoint again") from None
    return entries


def load_config(path: Path, role: str):
    """The checkpoint's config as transformers reads it. A caller that needs it in several places reads it once here
    and passes it on (distill: to its memory check, its new draft's config and the model's and tokenizer's loads)."""
    from transformers import AutoConfig

    quiet_transformers()
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=False, local_files_only=True)
    except Exception as exc:  # transformers raises many types for a bad config
        read_config_json(path / "config.json")  # no JSON object at all: said in specbuild's one line, not transformers'
        raise CheckpointError(f"{role} checkpoint {path}: config.json cannot be read ({exc})") from None


def quiet_transformers() -> None:
    """No progress bar per load on stderr, where a pipeline reads one-line errors, and none of transformers' notes:
    its deprecation notes about its own internals (assisted generation calls the draft's generate in a way it
    warns about), and what it says of a config it reads (a Phi-3 config's original_max_position_embeddings)."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()


def _check_rope_settings_read(config, raw: dict, path: Path, role: str) -> None:
    """transformers 5 saves the rope settings (rope_theta, the scaling) in config.json's rope_parameters alone, a key
    transformers 4 keeps as an unknown attribute: it builds the model with its default rope_theta, so the engine and
    verify's reference alike would compute another model than the one saved, and verify would call them identical."""
    saved = raw.get("rope_parameters")
    if not isinstance(saved, dict) or "rope_parameters" in inspect.signature(type(config).__init__).parameters:
        return
    # Refused only where what it read differs: configs that also keep rope_theta (and rope_scaling) at the top level,
    # as some saved by both versions do, build the saved model on 4.x too.
    saved = saved.get("full_attention", saved)  # Gemma 3 keeps one set per layer type; the full layers' is rope_theta
    read = getattr(config, "rope_scaling", None) or {}
    kind = saved.get("rope_type", "default")
    if (saved.get("rope_theta") in (None, getattr(config, "rope_theta", None))
            and kind in ("default", read.get("rope_type", read.get("type")))):
        return
    import transformers

    raise UnsupportedModelError(
        f"{role} checkpoint {path} keeps its rope settings in config.json's rope_parameters (saved by transformers 5), "
        f"which transformers {transformers.__version__} does not read: it would use its default rope_theta instead; "
        "compile with transformers 5")


def _loaded_tensors(config, entries: dict[str, TensorEntry], path: Path, role: str) -> frozenset[str]:
    """The stored tensors transformers loads into a model of this config.json, each checked to have the shape
    the config implies: weights of another config (vocab_size, key-value heads, intermediate_size) would
    otherwise build an engine that fails later with a message that blames specbuild. From transformers' own
    model, made on the meta device (no memory, under a second even at 8B).

    Names are the model's: a tensor stored without the base model's prefix (a checkpoint saved from
    LlamaModel or Qwen2Model, or GPT-2's original one), which transformers loads all the same, is renamed in
    entries, so that the graph builders read one set of names."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):  # eager: a config may name an attention kernel not installed here
            model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    except Exception as exc:  # transformers raises many types for a config it cannot build
        raise CheckpointError(f"{role} checkpoint {path}: config.json describes no model transformers can build "
                              f"({type(exc).__name__}: {first_line(exc)}); use the config.json that came with "
                              "these weights") from None
    prefix = model.base_model_prefix + "."
    parameters = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    loaded = set()
    for model_name, parameter in model.state_dict().items():
        for name, shape in stored_parts(type(model).__name__, model_name, tuple(parameter.shape), entries, prefix, path,
                                        role):
            stored = name if name in entries else name.removeprefix(prefix)
            if stored not in entries:
                continue
            if entries[stored].shape != shape:
                raise CheckpointError(
                    f"{role} checkpoint {path}: tensor {name!r} has shape {list(entries[stored].shape)} but "
                    f"config.json implies {list(shape)}; the weights and config.json do not belong together: use the "
                    "config.json that came with these weights"
                )
            # Refused here, naming the tensor, rather than when the engine writes it: minutes in at 8B, and a small
            # tensor (a norm) failed inside onnx_ir's serializer, reported as a bug in specbuild
            if model_name in parameters and entries[stored].dtype not in WEIGHT_DTYPES:
                raise UnsupportedModelError(
                    f"{role} checkpoint {path}: tensor {name!r} is stored as {entries[stored].dtype}; specbuild reads "
                    "weights stored as fp32, fp16 or bf16 (and quantizes them itself: --quantize int4|int8): save the "
                    "checkpoint in one of those, e.g. `model.to(torch.bfloat16).save_pretrained(dir)`"
                )
            entries[name] = entries.pop(stored)
            loaded.add(name)
    return frozenset(loaded)


# Where checkpoints (released ones and transformers 5's save_pretrained alike) store a mixture's router and experts: the
# layer's module, and each expert's gate, up and down projections (experts.{e}.gate_proj.weight [I, H] and so on).
# transformers 5 renames Mixtral's block_sparse_moe to mlp at load and holds the experts fused, gate_up_proj [E, 2I, H]
# (each expert's gate rows, then its up rows) and down_proj [E, H, I].
MIXTURES = {"Qwen3MoeForCausalLM": ("mlp", "gate_proj", "up_proj", "down_proj"),
            "MixtralForCausalLM": ("block_sparse_moe", "w1", "w3", "w2")}


def stored_parts(architecture: str, name: str, shape: tuple[int, ...], entries: dict[str, TensorEntry], prefix: str,
                 path: Path, role: str) -> list[tuple[str, tuple[int, ...]]]:
    """The stored tensors (name, shape) transformers loads into the model's tensor `name` of that shape: itself, or,
    in a mixture of experts, what MIXTURES says it is stored as."""
    if architecture not in MIXTURES:
        return [(name, shape)]
    module, gate, up, down = MIXTURES[architecture]
    stem, _, fused = name.replace(".mlp.", f".{module}.").rpartition(".")
    if not stem.endswith(".experts") or fused not in ("gate_up_proj", "down_proj"):
        return [(f"{stem}.{fused}", shape)]
    if name in entries or name.removeprefix(prefix) in entries:
        raise UnsupportedModelError(
            f"{role} checkpoint {path} stores its experts fused ({name!r}), as transformers 5 holds them in memory; "
            "specbuild reads them as released checkpoints and save_pretrained store them, one tensor per expert and "
            f"projection ({stem}.0.{gate}.weight, ...): save the model with save_pretrained")
    experts, rows, columns = shape
    projections = (gate, up) if fused == "gate_up_proj" else (down,)
    return [(f"{stem}.{e}.{projection}.weight", (rows // len(projections), columns))
            for e in range(experts) for projection in projections]


# The files a tokenizer is saved in (transformers' names: the fast form, its config, sentencepiece's, GPT-2's pair)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json",
                   "merges.txt")


def has_tokenizer_files(path: Path) -> bool:
    return any((path / name).is_file() for name in TOKENIZER_FILES)


def token_ids(tokenizer) -> int:
    """How many ids a tokenizer gives (its largest + 1)."""
    return max(tokenizer.get_vocab().values()) + 1


def load_tokenizer(path: Path, role: str, config=None):
    """config: the checkpoint's (load_config's), which transformers otherwise reads from config.json again."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, config=config, trust_remote_code=False, local_files_only=True)
    except Exception as exc:  # transformers raises many types for missing or broken tokenizer files
        if (path / "tokenizer.model").is_file() and not (path / "tokenizer.json").is_file():
            # Older Llama 2 and Mistral repos: transformers converts the sentencepiece model with the
            # sentencepiece package, which specbuild does not install (without it transformers tries tiktoken
            # and says to install that).
            if find_spec("sentencepiece"):
                why = (f"which transformers could not convert ({type(exc).__name__}: {first_line(exc)}); download it "
                       "again")
            else:
                why = ("which transformers converts with the sentencepiece package, not installed here; `pip install "
                       "sentencepiece` and compile again")
            raise CheckpointError(f"{role} checkpoint {path} has its tokenizer only as tokenizer.model (sentencepiece), "
                                  f"{why}, or add the tokenizer.json of the model's repository") from None
        raise _no_tokenizer(path, role) from None
    # transformers 5 gives a folder without tokenizer files an empty tokenizer (one token) of the class its
    # model_type maps to (Qwen's, Gemma's, GPT-2's): its bundle encoded every prompt to nothing.
    if not any((path / name).is_file() for name in tokenizer.vocab_files_names.values()):
        raise _no_tokenizer(path, role)
    if not getattr(tokenizer, "is_fast", False):
        raise CheckpointError(f"{role} checkpoint {path}: tokenizer has no fast (tokenizer.json) form")
    return tokenizer


def _no_tokenizer(path: Path, role: str) -> CheckpointError:
    # A draft's files are incomplete here (one without any speaks the target's: load_checkpoint)
    copy = "; a draft speaks its target's tokenizer: copy the target's tokenizer files into it" if role == "draft" else ""
    return CheckpointError(f"{role} checkpoint {path} has no usable tokenizer; it needs tokenizer.json "
                           f"or the tokenizer files its tokenizer_config.json names{copy}")


def model_spec(config, architecture: str, path: Path, role: str) -> ModelSpec:
    """What the graph builders need of a transformers config, or UnsupportedModelError."""
    family = ARCHITECTURES[architecture]
    if family == "gpt2":
        if config.scale_attn_by_inverse_layer_idx or config.reorder_and_upcast_attn or not config.scale_attn_weights:
            raise UnsupportedModelError(f"{role} checkpoint {path}: GPT-2 attention variants are not supported")
        hidden, heads, layers = config.n_embd, config.n_head, config.n_layer
        spec = ModelSpec(
            architecture=architecture,
            family=family,
            shape=ModelShape(layers, hidden, heads, heads, hidden // heads, config.vocab_size),
            intermediate_size=config.n_inner or 4 * hidden,
            norm_eps=config.layer_norm_epsilon,
            hidden_act=config.activation_function,
            attention_bias=True,
            mlp_bias=True,
            tie_word_embeddings=config.tie_word_embeddings,
            max_position_embeddings=config.n_positions,
            layer_types=["full_attention"] * layers,
            sliding_windows=[None] * layers,
            attention_scale=(hidden // heads) ** -0.5,
            rotary_dim=0,
        )
    else:
        spec = _rope_model_spec(config, architecture, family, path, role)
    if spec.hidden_act not in SUPPORTED_ACTIVATIONS:
        raise UnsupportedModelError(f"{role} checkpoint {path}: activation {spec.hidden_act!r} is not supported; "
                                    f"specbuild's graphs compute {', '.join(sorted(SUPPORTED_ACTIVATIONS))}")
    return spec


def _rope_model_spec(config, architecture: str, family: str, path: Path, role: str) -> ModelSpec:
    """Llama, Mistral, Qwen2/3, Phi-3, Gemma 2/3, Granite, OLMo 2/3: config.json names the same things alike, almost."""
    heads, layers = config.num_attention_heads, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    rope = getattr(config, "rope_parameters", None) or {}
    ropes = [r for r in rope.values() if isinstance(r, dict)] or [rope]  # Gemma 3 keeps one set per layer type
    rotary_dim = head_dim
    if architecture == "Phi3ForCausalLM":
        # transformers 4 keeps Phi-3's partial_rotary_factor in the config itself; 5 moved it into rope_parameters
        rotary_dim = int(head_dim * (rope.get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", None) or 1.0))
    elif partial := next((r["partial_rotary_factor"] for r in ropes if r.get("partial_rotary_factor", 1.0) != 1.0), None):
        # The others rotate whole heads: their default rope ignores the factor, "proportional" pads its table with
        # unrotated dims, the other scalings shorten it (which transformers then fails to apply)
        tables = rotary_module(architecture, config).named_buffers()
        if widths := {2 * len(t) for name, t in tables if name.endswith("inv_freq")} - {head_dim}:
            raise UnsupportedModelError(
                f"{role} checkpoint {path}: config.json's partial_rotary_factor {partial} gives rotary tables of "
                f"{min(widths)} dims, which transformers' {architecture} cannot apply to heads of {head_dim}; remove "
                "partial_rotary_factor from config.json")
    if head_dim % 16 or rotary_dim % 16:
        raise UnsupportedModelError(
            f"{role} checkpoint {path}: head_dim {head_dim} (rotary part {rotary_dim}) is not a multiple of 16, "
            "which onnxruntime's rotary attention kernel requires"
        )
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedModelError(f"{role} checkpoint {path}: bidirectional attention (an embedding model) cannot decode")
    # layer_types (Qwen2/3, Gemma, OLMo 3) says which layers slide; Mistral and Phi-3 slide everywhere if they slide,
    # Llama nowhere (check_context refuses a target whose window, ignored here, transformers' cache would apply).
    window = getattr(config, "sliding_window", None) if architecture in WINDOWED else None
    typed = getattr(config, "layer_types", None) if architecture in LAYER_TYPED else None
    layer_types = list(typed or ["sliding_attention" if window else "full_attention"] * layers)
    gemma, granite = family == "gemma", architecture == "GraniteForCausalLM"
    moe, qwen3_moe = architecture in MIXTURES, architecture == "Qwen3MoeForCausalLM"
    return ModelSpec(
        architecture=architecture,
        family=family,
        shape=ModelShape(layers, config.hidden_size, heads, getattr(config, "num_key_value_heads", None) or heads,
                         head_dim, config.vocab_size),
        intermediate_size=config.intermediate_size,
        norm_eps=config.rms_norm_eps,
        hidden_act=config.hidden_activation if gemma else config.hidden_act,
        attention_bias=architecture == "Qwen2ForCausalLM" or (
            architecture not in ATTENTION_UNBIASED and bool(getattr(config, "attention_bias", False))),
        mlp_bias=architecture in MLP_BIASED and bool(getattr(config, "mlp_bias", False)),
        tie_word_embeddings=bool(config.tie_word_embeddings),
        max_position_embeddings=config.max_position_embeddings,
        layer_types=layer_types,
        sliding_windows=[window if kind == "sliding_attention" and window else None for kind in layer_types],
        attention_scale=(config.attention_multiplier if granite else
                         (config.query_pre_attn_scalar if gemma else head_dim) ** -0.5),
        rotary_dim=rotary_dim,
        qk_norm=architecture in ("Qwen3ForCausalLM", "Gemma3ForCausalLM", "Qwen3MoeForCausalLM"),
        # transformers' Gemma 3 keeps attn_logit_softcapping but never passes it to its attention
        attention_softcap=config.attn_logit_softcapping if architecture == "Gemma2ForCausalLM" else None,
        final_softcap=config.final_logit_softcapping if gemma else None,
        # transformers' Granite alone reads its multipliers (another family's config.json may carry them)
        embedding_multiplier=config.embedding_multiplier if granite else 1.0,
        residual_multiplier=config.residual_multiplier if granite else 1.0,
        logits_scaling=config.logits_scaling if granite else 1.0,
        # transformers' Qwen3MoeDecoderLayer's rule, restated: which layers hold its sparse block (Mixtral's: every one)
        sparse_layers=tuple(i for i in range(layers) if not qwen3_moe or (
            i not in config.mlp_only_layers and config.num_experts > 0 and (i + 1) % config.decoder_sparse_step == 0)
        ) if moe else (),
        experts=config.num_local_experts if moe else 0,  # Qwen3-MoE's num_experts too (its config's attribute_map)
        experts_per_token=config.num_experts_per_tok if moe else 0,
        expert_intermediate_size=(config.moe_intermediate_size if qwen3_moe else config.intermediate_size) if moe
        else 0,
        norm_topk_prob=bool(config.norm_topk_prob) if qwen3_moe else moe,  # Mixtral's router always renormalizes
    )


def rotary_module(architecture: str, config):
    """transformers' own rotary embedding module of this architecture (they differ: Phi-3's rotates part of
    each head, Gemma 3's has a table per layer type)."""
    import transformers

    module = sys.modules[getattr(transformers, architecture).__module__]
    return getattr(module, architecture.removesuffix("ForCausalLM") + "RotaryEmbedding")(config)


def check_context(ckpt: Checkpoint, role: str, max_seq_len: int) -> None:
    """UnsupportedModelError unless the model's positions reach max_seq_len, and, for the target, unless its engine
    decodes as transformers does at every length up to max_seq_len (see longrope_length). Of the limits max_seq_len
    passes, the refusal names the shortest: a context within it meets the others too."""
    exceeded = [(limit, refusal) for limit, refusal in _context_limits(ckpt, role) if limit < max_seq_len]
    if exceeded:
        raise UnsupportedModelError(min(exceeded, key=lambda pair: pair[0])[1](max_seq_len))


def longest_context(ckpt: Checkpoint, role: str) -> int:
    """The longest max_seq_len check_context accepts: what the default stops at and the runtime's advice names at most."""
    return min(limit for limit, _ in _context_limits(ckpt, role))


def _context_limits(ckpt: Checkpoint, role: str) -> list[tuple[int, Callable[[int], str]]]:
    """Each length max_seq_len must not pass, with its refusal of a longer one; on equal limits the first is named."""
    spec, limits = ckpt.spec, []
    original = longrope_length(ckpt.config)
    # The draft's rotation only changes which drafts are proposed, never the output. A Phi-3 target switches
    # tables at runtime (rope_switch_length).
    if role == "target" and original is not None and not _switches_rope(ckpt):
        limits.append((original, lambda n: (
            f"max_seq_len {n} exceeds the target's LongRoPE original_max_position_embeddings ({original}): "
            f"transformers' {spec.architecture} rotates a sequence up to that length with the short factors and "
            "later positions with the long ones, keeping the keys it cached with the short ones (only Phi-3 recomputes "
            "its cache there, which specbuild reproduces), so the bundle would decode other tokens; give --max-seq-len "
            f"(or a recipe's max_seq_len) of {original} or less")))
    # Asked of the draft too: a config.json transformers cannot build a cache for is refused in either role
    window = cached_window(ckpt, role)
    if window is not None and role == "target" and spec.architecture not in WINDOWED:
        key = next((k for k in ("sliding_window", "attention_chunk_size") if getattr(ckpt.config, k, None) == window),
                   "sliding_window")
        limits.append((window, lambda n: (
            f"max_seq_len {n} exceeds the {key} ({window}) the target's config.json sets, which "
            f"transformers' {spec.architecture} attention ignores while its cache keeps only that many positions, so "
            f"its decoding past them follows no model; set \"{key}\": null in config.json, or give "
            f"--max-seq-len (or a recipe's max_seq_len) of {window} or less")))
    positions = spec.max_position_embeddings
    limits.append((positions, lambda n: (
        f"max_seq_len {n} exceeds the {role}'s max_position_embeddings ({positions}); give --max-seq-len (or a "
        f"recipe's max_seq_len) of {positions} or less")))
    return limits


def cached_window(ckpt: Checkpoint, role: str) -> int | None:
    """The fewest positions transformers' generate keeps in the cache of any layer (None: all of them). Its
    DynamicCache windows the layers config.json says (sliding_window or attention_chunk_size, per layer where
    layer_types says so), whether or not the architecture's attention reads the window: asked of it, not restated."""
    from transformers import DynamicCache

    try:
        layers = DynamicCache(config=ckpt.config).layers
    except (AttributeError, TypeError, ValueError, KeyError) as exc:  # e.g. sliding layer_types without a window
        raise UnsupportedModelError(
            f"{role} checkpoint {ckpt.path}: transformers cannot build its cache from its config.json "
            f"({type(exc).__name__}: {first_line(exc)}), so "
            "its own generate fails on it too: check layer_types, sliding_window and attention_chunk_size") from None
    return min((layer.sliding_window for layer in layers if getattr(layer, "sliding_window", None)), default=None)


def rope_switch_length(ckpt: Checkpoint, role: str, max_seq_len: int) -> int:
    """The length past which a target's engine rotates with LongRoPE's long factors (0: one rotary table).

    transformers' Phi-3 rotates a sequence of up to original_max_position_embeddings tokens with the short
    factors and a longer one with the long factors at every position: its generate drops the cache when the
    sequence first passes that length and recomputes it, so each token is what one forward over the tokens
    before it gives. The engine holds both tables and the runtime chooses per call, re-feeding the cache
    there (specbuild_runtime.slot.EngineSlot._choose_rope). Only where the length that recomputes (the
    config's own original_max_position_embeddings) is the length that switches factors. Llama with
    longrope keeps the keys it cached with the short factors, which no re-feed reproduces: refused."""
    original = longrope_length(ckpt.config)
    return original if role == "target" and _switches_rope(ckpt) and max_seq_len > original else 0


def _switches_rope(ckpt: Checkpoint) -> bool:
    """Whether a target's engine may switch LongRoPE tables (rope_switch_length says why only Phi-3's)."""
    original = longrope_length(ckpt.config)
    return (original is not None and ckpt.spec.architecture == "Phi3ForCausalLM"
            and getattr(ckpt.config, "original_max_position_embeddings", None) == original)


def longrope_length(config) -> int | None:
    """The original_max_position_embeddings of a LongRoPE model, None for other ropes.

    transformers picks LongRoPE's factors per forward call by the sequence's length: short up to this length,
    long past it. A bundle's rotary table is indexed by position alone (so that speculation cannot change the
    output): with the long factors throughout, a bundle longer than this decoded other tokens than transformers
    for every prompt of up to this length."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    per_type = rope and all(isinstance(v, dict) for v in rope.values())  # Gemma 3: one set per layer type
    for params in rope.values() if per_type else [rope]:
        if params.get("rope_type", params.get("type")) == "longrope":
            # transformers 4 keeps Phi-3's in the config itself (without one, the original length is max_position_embeddings)
            return params.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings", None)
    return None


SWAPPED_ABOVE = 1.25  # a draft over this many times the target's parameters: the pair was given swapped


def validate_pair(target: Checkpoint, draft: Checkpoint) -> None:
    """The draft must speak the target's tokenizer: the same token-to-id map. Its own bos and eos may differ
    (an instruct target's eos is <|im_end|> or <|eot_id|>, its base draft's <|endoftext|>): prompts are
    encoded with the target's tokenizer and decoding stops at the target's eos ids, so the draft's are
    never read. A draft without tokenizer files speaks the target's (check_draft_without_tokenizer).

    Embedding tables may differ in padding rows (Qwen2.5 0.5B has 151936, 7B 152064) as long as
    every token of the shared tokenizer has a row in both.
    """
    t_vocab = target.tokenizer.get_vocab()
    if draft.tokenizer is None:
        check_draft_without_tokenizer(draft.path, draft.spec.shape.vocab_size, target.tokenizer,
                                      target.spec.shape.vocab_size, target.config)
    elif t_vocab != (d_vocab := draft.tokenizer.get_vocab()):
        differing = sorted(set(t_vocab) ^ set(d_vocab) | {k for k in t_vocab.keys() & d_vocab.keys() if t_vocab[k] != d_vocab[k]})
        example = differing[0]
        raise PairMismatchError(
            f"draft {draft.path} and target {target.path} have different tokenizers ({len(d_vocab)} vs "
            f"{len(t_vocab)} tokens; {len(differing)} differ, e.g. {example!r} is {d_vocab.get(example, 'missing')} in "
            f"the draft, {t_vocab.get(example, 'missing')} in the target); use a draft trained with the target's tokenizer"
        )
    for ckpt in (target, draft):
        check_embedding_rows(ckpt.path, ckpt.spec.shape.vocab_size, t_vocab)
    tokens = target.token_ids()  # the draft's too: it speaks the same tokenizer
    check_draft_smaller(f"the draft {draft.path}", unpadded_parameters(draft.parameters(), draft.spec, tokens),
                        f"the target {target.path}", unpadded_parameters(target.parameters(), target.spec, tokens))


# Tables padded past a tokenizer's ids round up to a multiple of 64 or 128 (Qwen2.5's 151936 and 152064 rows for
# 151665 ids, nanoGPT's GPT-2 of 50304 for 50257)
PADDED_TO = 128
SPECIAL_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def check_draft_without_tokenizer(path: Path, rows: int, target_tokenizer, target_rows: int, target_config) -> None:
    """PairMismatchError unless a draft saved without tokenizer files can speak the target's tokenizer, as vLLM's (its
    draft's ModelConfig takes the target's tokenizer) and TensorRT-LLM's (one tokenizer for both engines) drafts do.
    Judged by what it has, as vLLM compares vocabulary sizes: a row for every id of the target's tokenizer and no more
    than padding adds (up to the target's rows, or its ids rounded up to PADDED_TO), and bos, eos and pad ids in its
    config.json that are special tokens of the target's or ids the target's config names (a base draft's eos is not
    an instruct target's). distill checks an --init so."""
    ids = token_ids(target_tokenizer)
    padded = max(target_rows, -(-ids // PADDED_TO) * PADDED_TO)
    taken = f"draft {path} has no tokenizer files, so it is taken to speak the target's tokenizer"
    fix = "use a draft trained with the target's tokenizer"
    if not ids <= rows <= padded:
        raise PairMismatchError(f"{taken}, but its {rows} embedding rows do not fit that tokenizer's {ids} ids (the "
                                f"target has {target_rows} rows): a draft of another vocabulary; {fix}")
    special = {i for i, token in target_tokenizer.added_tokens_decoder.items() if token.special}
    special |= set(target_tokenizer.all_special_ids)
    special |= set(_special_ids({key: getattr(target_config, key, None) for key in SPECIAL_ID_KEYS}).values())
    for key, value in _special_ids(json.loads((path / "config.json").read_bytes())).items():
        if value not in special:
            what = (f"that tokenizer's {target_tokenizer.convert_ids_to_tokens(value)!r}, no special token" if value < ids
                    else "no id of that tokenizer")
            raise PairMismatchError(f"{taken}, but its config.json's {key} {value} is {what}: a draft of another "
                                    f"tokenizer; {fix}")


def _special_ids(config: dict) -> dict[str, int]:
    """The bos, eos and pad ids a config states, as "key" (or "key[i]" in a list of eos ids) -> id."""
    found = {}
    for key in SPECIAL_ID_KEYS:
        value = config.get(key)
        for i, item in enumerate(value) if isinstance(value, list) else [(None, value)]:
            if isinstance(item, int) and not isinstance(item, bool) and item >= 0:
                found[key if i is None else f"{key}[{i}]"] = item
    return found


def check_draft_smaller(draft: str, draft_size: int, target: str, target_size: int,
                        smaller: str = "a smaller one as --draft") -> None:
    """A draft larger than the target only slows decoding, whose output is the target's: given so, the two were most
    likely swapped, and the bundle would serve the smaller model's text (distill checks its draft so too). Pairs of
    about one size (a draft with biases the target lacks, a tiny target's default shrink) are left alone: only a
    clearly larger draft tells of a swap. smaller: how the command at hand takes a smaller draft."""
    if draft_size > SWAPPED_ABOVE * target_size:
        raise PairMismatchError(
            f"{draft} has {draft_size:,} parameters, more than {target} ({target_size:,}): the bundle decodes the "
            "target's text, here the smaller model's, slower than that model alone; give the model whose output you "
            f"want as --target and {smaller}")


def unpadded_parameters(parameters: int, spec: ModelSpec, token_ids: int) -> int:
    """parameters (a tied head counted once) but the embedding (and untied head) rows past the tokenizer's ids, which
    pad tables of one family to other sizes (Qwen2.5 0.5B's 151936 rows, 7B's 152064)."""
    padding = max(spec.shape.vocab_size - token_ids, 0)
    return parameters - padding * spec.shape.hidden_size * (1 if spec.tie_word_embeddings else 2)


def check_embedding_rows(path: Path, rows: int, vocab: dict[str, int], role: str = "") -> None:
    """Every token of the tokenizer has a row in the checkpoint's embedding table (distill checks its target so too)."""
    needed = max(vocab.values()) + 1
    if rows < needed:
        raise PairMismatchError(f"{role + ' checkpoint ' if role else ''}{path} has {rows} embedding rows but its tokenizer "
                                f"has ids up to {needed - 1}; the checkpoint and its tokenizer do not belong together")


def generation_config(ckpt: Checkpoint) -> dict:
    """The checkpoint's generation_config.json as written ({} without one)."""
    path = ckpt.path / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path} is not a JSON object ({type(exc).__name__}: {exc}); fix or remove it") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} is not a JSON object (a JSON {type(config).__name__}); fix or remove it")
    return config


# The generation_config.json fields vLLM's OpenAI server takes as the defaults of requests that omit them
# (ModelConfig.get_diff_sampling_param), and do_sample, which it does not read: serve applies those it has
# (temperature, top_p, top_k, min_p, repetition_penalty) and names the others at start (runtime: serve.protocol.sampling_defaults).
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens", "do_sample")


def sampling_defaults(ckpt: Checkpoint) -> dict:
    """The sampling fields the checkpoint's generation_config.json sets, as written: values transformers' own
    GenerationConfig would fill in for absent fields are not the model author's and are not taken."""
    config = generation_config(ckpt)
    return {name: config[name] for name in SAMPLING_FIELDS if config.get(name) is not None}


def eos_token_ids(ckpt: Checkpoint) -> list[int]:
    """End-of-sequence ids as transformers' generate() would use them (generation_config first), and the
    tokenizer's eos after them, as vLLM stops at it too: a fine-tune whose generation_config still names its
    base model's eos ends its turns with the tokenizer's, and would otherwise run on to max_new_tokens."""
    eos = generation_config(ckpt).get("eos_token_id")
    if eos is None:
        eos = getattr(ckpt.config, "eos_token_id", None)
    ids = [] if eos is None else eos if isinstance(eos, list) else [eos]
    if not all(isinstance(e, int) and not isinstance(e, bool) and 0 <= e < ckpt.spec.shape.vocab_size for e in ids):
        raise CheckpointError(f"{ckpt.path}: eos_token_id {eos!r} is not a token id (0 to {ckpt.spec.shape.vocab_size - 1}) "
                              "or a list of them; fix generation_config.json or config.json")
    return with_tokenizer_eos(ids, ckpt.tokenizer, ckpt.spec.shape.vocab_size)


def with_tokenizer_eos(ids: list[int], tokenizer, vocab_size: int) -> list[int]:
    """ids and, after them, the tokenizer's eos where it is not among them: the eos ids decoding stops at
    (a bundle's, and distill's generation and α, which must stop where the bundle's requests do)."""
    own = tokenizer.eos_token_id
    return [*ids, own] if own is not None and own not in ids and own < vocab_size else list(ids)
