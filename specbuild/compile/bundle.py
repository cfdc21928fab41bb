"""The stage "writing the bundle" (pipeline.STAGES): the target's tokenizer and the manifest, written without
ever losing what was at the output path.

The bundle is built in a staging folder beside the output and published atomically (see
`specbuild/staging.py`: lock, crash clean-up, exchange, and what may be replaced: nothing that is, holds
or lies inside an input, and with --overwrite only a folder that is a specbuild bundle).
"""

from __future__ import annotations

import importlib.metadata
import json
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from specbuild_runtime.manifest import FORMAT, MANIFEST, TOKENIZER_CONFIG, Manifest, bundle_files

from .. import __version__
from ..errors import OutputError
from ..progress import bar
from ..staging import guarded_folder
from . import tensorrt_llm


@contextmanager
def staged_bundle(output: Path, overwrite: bool, inputs: dict[str, Path] | None = None) -> Iterator[Path]:
    """Yields an empty folder to build in; on success it replaces `output`, on any failure it vanishes.
    inputs: what the build reads ({"target": folder, "recipe": file, ...}), which output must not touch."""
    with guarded_folder(output, overwrite=overwrite, is_kind=only_a_bundle, kind="specbuild bundle",
                        inputs=inputs) as staging:
        yield staging


# Engines the bundle's TensorRT-LLM build plan makes inside it: built from the old checkpoints, stale once
# the bundle is replaced, so they go with it.
BUILT_ENGINES = f"{tensorrt_llm.FOLDER}/engines/"


def only_a_bundle(folder: Path) -> bool:
    """is_bundle, and OutputError where the folder also holds files the bundle did not have (a bench report,
    notes): replacing the folder would delete them."""
    if not is_bundle(folder):
        return False
    files = json.loads((folder / MANIFEST).read_bytes()).get("files")
    if not isinstance(files, dict):  # a damaged manifest cannot tell its files from others: replaced as before
        return True
    listed = set(files) | {MANIFEST}
    added = [name for p in sorted(folder.rglob("*")) if p.is_file() and (name := p.relative_to(folder).as_posix())
             not in listed and not name.startswith(BUILT_ENGINES)]
    if added:
        more = f" and {len(added) - 1} more" if len(added) > 1 else ""
        raise OutputError(f"{folder} holds a specbuild bundle and files it did not have ({added[0]}{more}), which "
                          "replacing it would delete; move them out of the folder or choose another output")
    return True


def is_bundle(folder: Path) -> bool:
    """Whether folder's manifest says it is a specbuild bundle (of any format version, intact or not)."""
    try:
        manifest = json.loads((folder / MANIFEST).read_bytes())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(manifest, dict) and manifest.get("format") == FORMAT


def write_manifest(folder: Path, manifest: Manifest) -> None:
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    with bar(size, "hashing the bundle's files", "B", unit_scale=True) as progress:
        manifest.files = bundle_files(folder, progress.update)
    (folder / MANIFEST).write_text(manifest.to_json())


def created_by() -> str:
    """The manifest's created_by: the transformers version too, since the bundle's tokenizer encodes prompts as
    that version does (transformers 5 rebuilds Llama 2's pre-tokenizer and adds Phi-3's BOS, where 4.57 did not)."""
    return f"specbuild {__version__} (transformers {importlib.metadata.version('transformers')})"


def save_tokenizer(tokenizer, folder: Path) -> None:
    """The target's tokenizer files, loadable by transformers 4 as well as 5.

    transformers 5 saves a plain tokenizers-backed tokenizer (what Llama 3 and others name
    PreTrainedTokenizerFast) as "TokenizersBackend", a class transformers 4 does not have, and TensorRT-LLM's
    examples/run.py (run.sh), on the transformers 4.57 TensorRT-LLM pins, then refuses the folder. Both
    versions load such a tokenizer by its old name; the runtime reads tokenizer.json alone.

    transformers 5 also saves the additional special tokens (Qwen's <|im_start|>, Gemma's <start_of_turn>,
    Mistral's empty list) as an "extra_special_tokens" list, where transformers 4 reads that key as a dict of
    named tokens and fails on a list ('list' object has no attribute 'keys'); both read the list under
    "additional_special_tokens", transformers 4's name for it."""
    tokenizer.save_pretrained(folder)
    path = folder / TOKENIZER_CONFIG
    # UTF-8, as transformers writes it, whatever the locale (the C locale without UTF-8 mode reads ASCII)
    saved = json.loads(path.read_bytes())
    config = dict(saved)
    if config.get("tokenizer_class") == "TokenizersBackend":
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
    if isinstance(config.get("extra_special_tokens"), list):
        config["additional_special_tokens"] = config.pop("extra_special_tokens")
    if config != saved:
        path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
