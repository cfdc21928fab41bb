"""The stage "writing the bundle" (pipeline.STAGES): write the bundle without ever losing what was at the
output path.

The bundle is built in a staging folder beside the output and published atomically (see
`specbuild/staging.py`: lock, crash clean-up, exchange, and what may be replaced: nothing that is, holds
or lies inside an input, and with --overwrite only a folder that is a specbuild bundle).
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from specbuild_runtime.manifest import FORMAT, MANIFEST, Manifest, bundle_files

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
