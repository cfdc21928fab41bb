"""The bundle format: the one place both the compiler and the runtime learn what a bundle holds.

A bundle is a folder:
    manifest.json           this schema, versioned by FORMAT_VERSION
    target.onnx(.data)      target engine: greedy verification built in
    draft.onnx(.data)       draft engine: same I/O, fed num_drafts = 0
    tokenizer/              the tokenizer both models share (tokenizer.json + HF side files)

Engine I/O (both engines; KV buffers are [1, kv_heads, max_seq_len, head_dim], bound in place):
    in   input_ids      int64 [1, S]    last accepted token(s) followed by num_drafts draft tokens
         total_len      int32 []        tokens in the cache after this call (past + S)
         num_drafts     int64 []        how many of the S tokens are drafts to verify
         past_key.{i}, past_value.{i}   the shared KV buffers
    out  accepted       int64 []        leading drafts that equal the model's own greedy choice
         next_token     int64 []        the model's greedy token after the accepted drafts
         present_key.{i}, present_value.{i}   the same buffers, written at positions past..total-1
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .errors import BundleError

FORMAT = "specbuild-bundle"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TOKENIZER_DIR = "tokenizer"


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


@dataclass
class Manifest:
    engines: dict[str, EngineInfo]
    max_seq_len: int
    gamma: int  # the most drafts per round the runtime's adaptive mode uses
    eos_token_ids: list[int]
    files: dict[str, str]  # relative path -> sha256
    created_by: str = ""
    format: str = FORMAT
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict) -> "Manifest":
        engines = {
            role: EngineInfo(**{**info, "shape": ModelShape(**info["shape"])})
            for role, info in data["engines"].items()
        }
        return cls(**{**data, "engines": engines})


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def bundle_files(root: Path) -> dict[str, str]:
    """sha256 of every file in the bundle except the manifest itself."""
    return {
        p.relative_to(root).as_posix(): sha256_file(p)
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }


def load_manifest(root: str | Path, check_digests: bool = True) -> Manifest:
    """Read and check a bundle's manifest; every failure is a one-line BundleError."""
    root = Path(root)
    path = root / MANIFEST
    if not path.is_file():
        raise BundleError(f"{root} is not a specbuild bundle: {MANIFEST} is missing (build one with `specbuild compile`)")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BundleError(f"{path} is not valid JSON ({exc}); rebuild the bundle with `specbuild compile`") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise BundleError(f"{path} is not a specbuild manifest; rebuild the bundle with `specbuild compile`")
    if data.get("format_version") != FORMAT_VERSION:
        raise BundleError(
            f"{root} has bundle format version {data.get('format_version')}, this runtime reads version "
            f"{FORMAT_VERSION}; rebuild the bundle with a matching `specbuild compile`"
        )
    try:
        manifest = Manifest.from_dict(data)
    except (KeyError, TypeError) as exc:
        raise BundleError(f"{path} is incomplete ({exc}); rebuild the bundle with `specbuild compile`") from None
    if check_digests:
        verify_digests(root, manifest)
    return manifest


def verify_digests(root: Path, manifest: Manifest) -> None:
    for rel, expected in manifest.files.items():
        path = root / rel
        if not path.is_file():
            raise BundleError(f"bundle file {path} is missing; rebuild the bundle with `specbuild compile`")
        if sha256_file(path) != expected:
            raise BundleError(
                f"bundle file {path} is corrupted (sha256 differs from the manifest); rebuild the bundle "
                "with `specbuild compile`"
            )
