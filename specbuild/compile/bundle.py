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

from ..staging import guarded_folder


@contextmanager
def staged_bundle(output: Path, overwrite: bool, inputs: dict[str, Path] | None = None) -> Iterator[Path]:
    """Yields an empty folder to build in; on success it replaces `output`, on any failure it vanishes.
    inputs: what the build reads ({"target": folder, "recipe": file, ...}), which output must not touch."""
    with guarded_folder(output, overwrite=overwrite, is_kind=is_bundle, kind="specbuild bundle", inputs=inputs) as staging:
        yield staging


def is_bundle(folder: Path) -> bool:
    """Whether folder's manifest says it is a specbuild bundle (of any format version, intact or not)."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(manifest, dict) and manifest.get("format") == FORMAT


def write_manifest(folder: Path, manifest: Manifest) -> None:
    manifest.files = bundle_files(folder)
    (folder / MANIFEST).write_text(manifest.to_json())
