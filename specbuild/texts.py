"""Where text comes from: the prompts shipped with specbuild and the Python standard library's source.

Both the compiler (quality reports) and training (the demo pair, distillation) read text; this module
is the one place they get it from, so neither imports the other.
"""

from __future__ import annotations

import hashlib
import json
import re
import sysconfig
from pathlib import Path

from specbuild_runtime.errors import SpecbuildError
from specbuild_runtime.validation import utf8

CODE_PROMPTS = Path(__file__).resolve().parent / "prompts" / "code.jsonl"  # shipped with specbuild
EXCLUDED_DIRS = {"site-packages", "test", "tests", "idle_test"}
HELDOUT_EVERY = 20  # one file in twenty (by path hash) is held out: ~5%
MEASURING_PROMPTS = 8  # the code prompts the compiler and the demo measure α and speed on: a few seconds on 2 cores


def read_prompts(path: Path) -> list[str]:
    """The "prompt" field of every line of a JSONL file."""
    try:
        text = Path(path).read_text(encoding="utf-8-sig")  # a BOM, as some editors write
    except UnicodeDecodeError as exc:
        raise SpecbuildError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start}); save it as UTF-8") from None
    prompts = []
    # Lines end at \n, \r\n or \r only (no JSON string holds those raw), not where str.splitlines() also
    # splits: U+2028, U+0085 and the like, which json.dumps(..., ensure_ascii=False) writes unescaped.
    for number, line in enumerate(re.split(r"\r\n|\r|\n", text), 1):
        if not line.strip():
            continue
        try:
            prompt = json.loads(line)["prompt"]
        except (json.JSONDecodeError, KeyError, TypeError, RecursionError):
            raise SpecbuildError(f'{path}:{number} is not a JSON object with a "prompt" field') from None
        except ValueError as exc:  # an integer beyond Python's int-from-string digit limit
            raise SpecbuildError(f"{path}:{number} cannot be read as JSON ({exc.args[0].split(':')[0]})") from None
        if not isinstance(prompt, str) or not prompt:
            raise SpecbuildError(f'{path}:{number}: "prompt" must be a non-empty string, not {prompt!r:.40}')
        utf8(f'{path}:{number}: "prompt"', prompt)  # a \ud83d escape without its other half: no tokenizer takes it
        prompts.append(prompt)
    if not prompts:
        raise SpecbuildError(f"{path} has no prompts")
    return prompts


def measuring_prompts() -> list[str]:
    """The first MEASURING_PROMPTS shipped code prompts: where compile's γ and quality figures and the demo's
    speed-up are measured, the same prompts each time."""
    return read_prompts(CODE_PROMPTS)[:MEASURING_PROMPTS]


def corpus_files() -> tuple[list[Path], list[Path]]:
    """(train, held-out) .py files of the running Python's standard library, without its tests."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, heldout = [], []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if EXCLUDED_DIRS & set(relative.parts[:-1]) or not path.is_file():
            continue
        # Hashing the path (not the contents) keeps the split stable across Python patch releases.
        bucket = int(hashlib.sha1(relative.as_posix().encode()).hexdigest(), 16) % HELDOUT_EVERY
        (heldout if bucket == 0 else train).append(path)
    return train, heldout


def read_source(path: Path) -> str:
    # A few stdlib files hold deliberately odd bytes; replacing them beats dropping the file.
    return path.read_text(encoding="utf-8", errors="replace")
