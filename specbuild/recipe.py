"""Recipes: the settings of a repeatable build, in TOML. Command-line options override them.

    [compile]
    target = "checkpoints/target"   # paths are relative to the recipe file
    draft = "checkpoints/draft"
    output = "bundles/demo"
    gamma = 8                       # most drafts per round in adaptive mode
    max_seq_len = 1024
    quantize = "none"               # none | int8 | int4; target_quantize / draft_quantize override it
    precision = "fp32"              # fp16 / bf16 for GPU targets
    backend = "onnx"                # onnx | tensorrt-llm | all
    tp = 1                          # tensor-parallel ranks of the TensorRT-LLM checkpoints
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, fields
from pathlib import Path

from specbuild_runtime.errors import SpecbuildError

DEFAULT_GAMMA = 8
DEFAULT_MAX_SEQ_LEN = 2048
BACKENDS = ("onnx", "tensorrt-llm", "all")


@dataclass
class CompileSettings:
    target: Path
    draft: Path
    output: Path
    gamma: int = DEFAULT_GAMMA
    max_seq_len: int | None = None  # None: min(DEFAULT_MAX_SEQ_LEN, the target's max positions)
    quantize: str = "none"  # both engines, unless overridden per engine below
    target_quantize: str | None = None
    draft_quantize: str | None = None
    block_size: int = 32
    accuracy_level: int | None = None
    precision: str = "fp32"
    quality_report: bool = True
    overwrite: bool = False
    backend: str = "onnx"  # "onnx" | "tensorrt-llm" | "all"
    tp: int = 1  # tensor-parallel ranks of the TensorRT-LLM export

    def quantization(self, role: str) -> str:
        own = self.target_quantize if role == "target" else self.draft_quantize
        return own or self.quantize


PATH_FIELDS = {"target", "draft", "output"}


def read_table(path: Path, name: str, known: set[str]) -> dict:
    """Table [name] of a TOML recipe; unknown keys are an error that lists the known ones."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise SpecbuildError(f"recipe {path} cannot be read: {exc}") from None
    table = data.get(name, {})
    unknown = set(table) - known
    if unknown:
        raise SpecbuildError(f"recipe {path}: unknown [{name}] keys {sorted(unknown)}; known keys are {sorted(known)}")
    return table


def read_recipe(path: Path) -> dict:
    """The [compile] table of a recipe, with paths resolved against the recipe's folder."""
    table = read_table(path, "compile", {f.name for f in fields(CompileSettings)})
    return {k: (path.parent / v if k in PATH_FIELDS else v) for k, v in table.items()}


def resolve_settings(recipe: Path | None, **options) -> CompileSettings:
    """Recipe values first, then every command-line option that was given."""
    values = read_recipe(recipe) if recipe else {}
    values.update({k: v for k, v in options.items() if v is not None})
    missing = [k for k in ("target", "draft", "output") if k not in values]
    if missing:
        raise SpecbuildError(f"missing {', '.join('--' + m for m in missing)} (give them as options or in a recipe)")
    settings = CompileSettings(**{**values, **{k: Path(values[k]) for k in PATH_FIELDS}})
    if settings.gamma < 1:
        raise SpecbuildError("--gamma must be at least 1 (the bundle's default draft length)")
    if settings.backend not in BACKENDS:
        raise SpecbuildError(f"backend {settings.backend!r} is not one of {', '.join(BACKENDS)}")
    if settings.tp < 1:
        raise SpecbuildError(f"--tp must be at least 1, not {settings.tp}")
    if settings.tp > 1 and settings.backend == "onnx":
        raise SpecbuildError(f"--tp {settings.tp} splits the TensorRT-LLM export; add --backend tensorrt-llm or all")
    return settings
