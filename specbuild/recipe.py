"""Recipes: the settings of a repeatable build, in TOML. Command-line options override them.

    [compile]
    target = "checkpoints/target"   # paths are relative to the recipe file
    draft = "checkpoints/draft"
    output = "bundles/demo"
    gamma = 8                       # most drafts per round in adaptive mode (1 to 32)
    max_seq_len = 1024
    quantize = "none"               # none | int8 | int4; target_quantize / draft_quantize override it
    precision = "fp32"              # fp16 / bf16 for GPU targets
    backend = "onnx"                # onnx | tensorrt-llm | all
    tp = 1                          # tensor-parallel ranks of the TensorRT-LLM checkpoints

Every setting is checked here, once, by the rule in RULES: recipe values name their key and line, the
CLI's options use the same rules (cli.py), and CompileSettings checks values given through the API.
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Callable

from specbuild_runtime.manifest import MAX_GAMMA, PRECISIONS

from .errors import MissingSettingsError, SettingsError

DEFAULT_GAMMA = 8
DEFAULT_MAX_SEQ_LEN = 2048
QUANTIZATIONS = ("none", "int8", "int4")
DEFAULT_BLOCK_SIZE = 32
DEFAULT_ACCURACY_LEVEL = 4  # MatMulNBits int8 compute: the fast one, exact row by row (see compile/quantize.py)
BACKENDS = ("onnx", "tensorrt-llm", "all")


@dataclass
class CompileSettings:
    target: Path
    draft: Path
    output: Path
    gamma: int = DEFAULT_GAMMA
    max_seq_len: int | None = None  # None: min(DEFAULT_MAX_SEQ_LEN, the longest the pair takes: pipeline._compile)
    quantize: str = "none"  # both engines, unless overridden per engine below
    target_quantize: str | None = None
    draft_quantize: str | None = None
    # None: the default (DEFAULT_BLOCK_SIZE, DEFAULT_ACCURACY_LEVEL, a report where an engine is quantized), kept unset
    # so that one given without quantization is refused, even at its default value
    block_size: int | None = None
    accuracy_level: int | None = None
    precision: str = "fp32"
    quality_report: bool | None = None
    overwrite: bool = False
    backend: str = "onnx"  # "onnx" | "tensorrt-llm" | "all"
    tp: int = 1  # tensor-parallel ranks of the TensorRT-LLM export
    recipe: Path | None = None  # the recipe file these came from: an input, like the checkpoints

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.default is None:
                continue
            if problem := setting_problem(f.name, value):
                raise SettingsError(f"compile setting {f.name} {problem}")
            if f.name in PATH_FIELDS:
                setattr(self, f.name, Path(value))
        # The default max_seq_len is checked so once the checkpoints say what it is (pipeline._max_seq_len)
        if self.max_seq_len is not None and (problem := round_problem(self.gamma, self.max_seq_len)):
            raise SettingsError(problem, key="max_seq_len")
        if self.tp > 1 and self.backend == "onnx":
            raise SettingsError(f"tp {self.tp} splits the TensorRT-LLM export; add --backend tensorrt-llm or all "
                                "(backend in a recipe)", key="tp")
        if self.quantize != "none" and self.target_quantize and self.draft_quantize:
            # it quantized nothing without a word under two "none"s, and is as dead under two others
            raise SettingsError(f"quantize {self.quantize} applies to neither engine: --target-quantize and "
                                "--draft-quantize (target_quantize, draft_quantize in a recipe) override it for both; "
                                "leave it out, or one of them", key="quantize")
        quantized = {self.quantization("target"), self.quantization("draft")} != {"none"}
        # quality_report false asks for no report where none is made: a recipe may keep it while quantize comes and goes
        shaping = [key for key in ("block_size", "accuracy_level") if getattr(self, key) is not None]
        if self.quality_report:
            shaping.append("quality_report")
        if not quantized and shaping:
            raise SettingsError("block_size and accuracy_level shape quantized engines, and quality_report measures "
                                "them; add --quantize int4|int8 (or --target-quantize / --draft-quantize; quantize in "
                                "a recipe), or leave them out",
                                key=shaping[0])
        if self.backend == "tensorrt-llm" and shaping:  # no ONNX engine for them to shape or measure
            raise SettingsError(f"{shaping[0]} applies to the ONNX engines, which backend tensorrt-llm does not build "
                                "(trtllm-build quantizes per output channel); add --backend all (backend in a recipe), "
                                "or leave it out", key=shaping[0])
        if self.backend != "onnx" and self.precision == "fp32":
            for role in ("target", "draft"):
                if (quantization := self.quantization(role)) != "none":
                    key = f"{role}_quantize" if getattr(self, f"{role}_quantize") else "quantize"
                    raise SettingsError(f"the {role}'s {quantization} quantization (--quantize or --{role}-quantize) "
                                        f"with --backend {self.backend} needs --precision fp16 or bf16 (precision in a "
                                        "recipe): TensorRT-LLM's weight-only kernels take 16-bit activations", key=key)

    def quantization(self, role: str) -> str:
        own = self.target_quantize if role == "target" else self.draft_quantize
        return own or self.quantize

    def inputs(self) -> dict[str, Path]:
        """What the build reads, which its output must not touch."""
        return {"target checkpoint": self.target, "draft checkpoint": self.draft,
                **({"recipe": self.recipe} if self.recipe else {})}


PATH_FIELDS = {"target", "draft", "output", "recipe"}


def _path(value) -> str | None:
    if not isinstance(value, (str, os.PathLike)):
        return f"must be a path (a string), not {_shown(value)}"
    # TOML strings may hold "\u0000", which no file name can: every OS call on the path would raise ValueError
    if "\0" in str(value):
        return f"must be a path, which cannot hold a NUL character (\\u0000), not {_shown(value)}"
    return None


def _boolean(value) -> str | None:
    return None if isinstance(value, bool) else f"must be true or false, not {_shown(value)}"


def _one_of(*choices: str) -> Callable[[object], str | None]:
    return lambda value: None if value in choices else f"must be one of {', '.join(choices)}; not {_shown(value)}"


def _precision(value) -> str | None:
    # int8 and int4 are precisions in onnxruntime-genai's model builder (-p int4): here they are quantize's
    if value in QUANTIZATIONS[1:]:
        return (f"must be a float type ({', '.join(PRECISIONS)}), not {_shown(value)}: {value} is a weight "
                f"quantization, quantize = \"{value}\"")
    return _one_of(*PRECISIONS)(value)


# The largest seed training takes: torch's generator takes up to 2**64 - 1 (the held-out samples draw with seed + 1),
# numpy's none below 0 (distill --seed, the demo recipe's seed).
MAX_SEED = 2**64 - 2

# distill's defaults (train/distill.py), here so that its --help states them without importing torch
DISTILL_MINUTES = 5.0
DISTILL_GAMMA = 4
DISTILL_OBJECTIVE = "tvd"
# distill --loss: the divergences train/divergence.py computes, in the order its --help names them
DISTILL_OBJECTIVES = ("tvd", "fkl", "rkl", "jsd")
DISTILL_BATCH_SIZE = 16
DISTILL_SEED = 0
# the sequences distill's training data may be made of (train/distill.py's DistillData)
DISTILL_KINDS = ("sampled", "greedy", "draft")


def whole_number(low: int, high: int | None = None, powers_of_two: bool = False) -> Callable[[object], str | None]:
    kind = "a power of two" if powers_of_two else "a whole number"
    wanted = f"{kind} from {low} to {high}" if high is not None else f"{kind}, {low} or more"

    def check(value) -> str | None:
        if isinstance(value, bool) or not isinstance(value, int):
            return f"must be {wanted}, not {_shown(value)}"
        if value < low or (high is not None and value > high) or (powers_of_two and value & (value - 1)):
            return f"must be {wanted}, not {value}"
        return None

    return check


def positive_number(value) -> str | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        return f"must be a positive number, not {_shown(value)}"
    return None


def fraction(value) -> str | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
        return f"must be a number between 0 and 1 (neither included), not {_shown(value)}"
    return None


def _kinds(value) -> str | None:
    if isinstance(value, (list, tuple)) and value and all(kind in DISTILL_KINDS for kind in value):
        return None
    return f"must be a non-empty list of {', '.join(DISTILL_KINDS)}; not {_shown(value)}"


RULES: dict[str, Callable[[object], str | None]] = {
    "target": _path,
    "draft": _path,
    "output": _path,
    "recipe": _path,
    "gamma": whole_number(1, MAX_GAMMA),
    "max_seq_len": whole_number(2),  # room for a prompt token and one generated token
    "quantize": _one_of(*QUANTIZATIONS),
    "target_quantize": _one_of(*QUANTIZATIONS),
    "draft_quantize": _one_of(*QUANTIZATIONS),
    "block_size": whole_number(16, 256, powers_of_two=True),  # what onnxruntime's block quantizer kernels take
    "accuracy_level": whole_number(0, 4),
    "precision": _precision,
    "quality_report": _boolean,
    "overwrite": _boolean,
    "backend": _one_of(*BACKENDS),
    "tp": whole_number(1),
}
RECIPE_KEYS = set(RULES) - {"recipe"}

# distill's arguments a caller can give wrong, by the rule each is checked by: the distill command's number options as
# they are parsed (--loss is a click.Choice of DISTILL_OBJECTIVES, as compile's choices are of theirs), a [pair] table's
# distill keys as it is read, and train/distill.py's distill() before it loads anything (an unknown objective was a
# KeyError once α had been measured before training, minutes in)
DISTILL_RULES: dict[str, Callable[[object], str | None]] = {
    "minutes": positive_number,
    "gamma": whole_number(1, MAX_GAMMA),
    "objective": _one_of(*DISTILL_OBJECTIVES),
    "batch_size": whole_number(1),
    "lr": positive_number,
    "seed": whole_number(0, MAX_SEED),
    # distill()'s alone (the command leaves them at their defaults): a kind it does not make failed once α had been
    # measured, a share of 0 trained all the minutes on one set of sequences (and of 1 or more, a few steps), and no
    # held-out prompts failed deep in the first measurement (max() of nothing) or, with data, held out nine
    "kinds": _kinds,
    "generation_share": fraction,
    "heldout_prompts": whole_number(1),
}

# distill's arguments that exclude each other: a draft starts from a checkpoint or from a config, and prompts come from
# a JSONL file or from text. Given both from Python, distill used the first and ignored the second.
DISTILL_EXCLUSIVE = (("init", "draft_config"), ("prompts_file", "data"))


def distill_conflict(given: dict, name: Callable[[str], str] = str) -> str | None:
    """"give either A or B, not both" for the first pair of DISTILL_EXCLUSIVE that given holds both of (an empty value
    is not given: the command's default --draft-config is ()), A and B as name calls them (an option, an argument);
    else None. The distill command checks with it as it parses, distill() before it loads anything."""
    for first, second in DISTILL_EXCLUSIVE:
        if given.get(first) and given.get(second):
            return f"give either {name(first)} or {name(second)}, not both"
    return None


def round_problem(gamma: int, max_seq_len: int) -> str | None:
    """Why a context of max_seq_len cannot hold a round of gamma drafts and the target's token, or None."""
    if gamma < max_seq_len:
        return None
    return (f"gamma {gamma} drafts a round but the context holds {max_seq_len} tokens; give a max_seq_len above "
            f"{gamma}, or a smaller gamma")


def setting_problem(key: str, value) -> str | None:
    """What is wrong with value for setting key ("must be ..., not ..."), or None."""
    return RULES[key](value)


def _shown(value) -> str:
    if isinstance(value, str):
        return f"the string {value!r}"
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value)


TABLES = ("compile", "pair")  # [pair]: the demo pair's training (train/demo_pair.py)


def read_table(path: Path, name: str, known: set[str]) -> dict:
    """Table [name] of a TOML recipe; unknown keys and tables are an error that lists the known ones
    (a misspelt [compiler] would otherwise build with defaults)."""
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8-sig"))  # a BOM, as some editors write
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise SettingsError(f"recipe {path} cannot be read: {exc}") from None
    except RecursionError:  # tomllib parses nested arrays and inline tables recursively
        raise SettingsError(f"recipe {path} cannot be read: arrays or tables nested too deep") from None
    unknown = sorted(set(data) - set(TABLES))
    if unknown:
        raise SettingsError(f"recipe {path}: unknown {'table' if isinstance(data[unknown[0]], dict) else 'key'} "
                            f"{unknown[0]!r} outside the tables; a recipe holds [{'] and ['.join(TABLES)}]")
    table = data.get(name, {})
    if isinstance(table, list):  # [[compile]]: an array of tables, as if a recipe held several builds
        raise SettingsError(f"recipe {path}: [[{name}]] makes an array of tables; a recipe holds one [{name}] table "
                            "(one build: write a recipe for each)")
    if not isinstance(table, dict):
        raise SettingsError(f"recipe {path}: {name} must be a table ([{name}]), not {_shown(table)}")
    unknown = set(table) - known
    if unknown:
        first = sorted(unknown)[0]
        raise SettingsError(f"recipe {path}{at_line(path, name, first)}: unknown [{name}] keys {sorted(unknown)}; "
                            f"known keys are {sorted(known)}")
    return table


def at_line(path: Path, table: str, key: str) -> str:
    """ " line N" where key is set in [table] of the TOML file, or "" if not found (tomllib keeps no
    positions, so the text is searched: a key = value line after the table's header)."""
    current = None
    # As read_table reads it: in the locale's encoding (ASCII in the C locale without UTF-8 mode) a non-ASCII
    # comment raised UnicodeDecodeError
    for number, line in enumerate(Path(path).read_text(encoding="utf-8-sig").splitlines(), 1):
        if header := re.match(r"\s*\[\s*([^\[\]]+?)\s*\]", line):
            current = header[1]
        elif current == table and re.match(rf"""\s*["']?{re.escape(key)}["']?\s*=""", line):
            return f" line {number}"
    return ""


def read_recipe(path: Path) -> dict:
    """The [compile] table of a recipe, checked, with paths resolved against the recipe's folder."""
    table = read_table(path, "compile", RECIPE_KEYS)
    for key, value in table.items():
        if problem := setting_problem(key, value):
            raise SettingsError(f"recipe {path}{at_line(path, 'compile', key)}: {key} {problem}")
    return {k: (path.parent / _expanded(path, k, v) if k in PATH_FIELDS else v) for k, v in table.items()}


def _expanded(recipe: Path, key: str, value: str) -> Path:
    """value with ~ or ~user expanded; a user this machine lacks (or ~ with neither HOME nor a passwd
    entry: a container's arbitrary uid) is a recipe error, not a crash. $NAME and ${NAME} are refused: a recipe does
    not expand them (a shell does, on the command line), and `output = "$OUT/bundle"` built into a folder named $OUT."""
    if variable := re.search(r"\$(\w+|\{[^}]*\})", value):
        raise SettingsError(f"recipe {recipe}{at_line(recipe, 'compile', key)}: {key} {value!r} names the environment "
                            f"variable {variable[0]}, which recipes do not expand; write the path out, or give it on the "
                            f"command line (--{key} \"{value}\")")
    try:
        return Path(value).expanduser()
    except RuntimeError:
        raise SettingsError(f"recipe {recipe}{at_line(recipe, 'compile', key)}: {key} {value!r} names a home folder "
                            "this machine cannot find (no such user, or no HOME); write the path out") from None


def resolve_settings(recipe: Path | None, **options) -> CompileSettings:
    """Recipe values first, then every command-line option that was given."""
    values = read_recipe(recipe) if recipe else {}
    from_recipe = set(values)
    if options.get("quantize") is not None:  # --quantize names both engines' quantization: a recipe's per-engine one loses
        for key in ("target_quantize", "draft_quantize"):
            values.pop(key, None)
    values.update({k: v for k, v in options.items() if v is not None})
    per_engine = ("target_quantize", "draft_quantize")
    if (options.get("quantize") is None and any(options.get(key) for key in per_engine)
            and all(values.get(key) for key in per_engine)):
        # --target-quantize and --draft-quantize (one may be the recipe's) override a recipe's quantize for both
        # engines, and win as the command line does: quantize dead beside both is refused where one place sets all three
        values.pop("quantize", None)
    missing = [k for k in ("target", "draft", "output") if k not in values]
    if missing:
        where = f"in [compile] of {recipe}" if recipe else "in a recipe"
        raise MissingSettingsError(f"missing {', '.join('--' + m for m in missing)} (give "
                                   f"{'it as an option' if len(missing) == 1 else 'them as options'} or {where})")
    try:
        return CompileSettings(**values, recipe=recipe)
    except SettingsError as exc:
        # A setting that clashes with another (tp without a TensorRT-LLM backend): where the recipe set it, the
        # error names the recipe and line, as a wrong value does, not only options the recipe does not use.
        if exc.key not in from_recipe or options.get(exc.key) is not None:
            raise
        raise SettingsError(f"recipe {recipe}{at_line(recipe, 'compile', exc.key)}: {exc}", key=exc.key) from None
