"""Stage 4: write the bundle without ever losing what was at the output path.

The bundle is built in a staging folder beside the output and published atomically (see
`specbuild/staging.py`: lock, crash clean-up, exchange). What may be replaced is decided here: nothing
that is, holds or lies inside an input, and with --overwrite only a folder that is a specbuild bundle.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from specbuild_runtime.manifest import FORMAT, MANIFEST, Manifest, bundle_files

from ..errors import OutputError
from ..staging import staged_folder


@contextmanager
def staged_bundle(output: Path, overwrite: bool, inputs: dict[str, Path] | None = None) -> Iterator[Path]:
    """Yields an empty folder to build in; on success it replaces `output`, on any failure it vanishes.
    inputs: what the build reads ({"target": folder, "recipe": file, ...}), which output must not touch."""
    refuse_overlap(Path(output), inputs or {})
    with staged_folder(output, lambda resolved: check_replaceable(resolved, overwrite)) as staging:
        yield staging


def refuse_overlap(output: Path, inputs: dict[str, Path]) -> None:
    out = output.resolve()
    for role, path in inputs.items():
        path = Path(path).resolve()
        relation = "is" if out == path else "contains" if out in path.parents else "lies inside" if path in out.parents else None
        if relation:
            raise OutputError(f"output {output} {relation} the {role} {path}; writing there could destroy it: "
                              "choose an output outside every input")


def check_replaceable(output: Path, overwrite: bool) -> None:
    """Nothing there, or an empty folder: fine. A bundle: only with overwrite. Anything else: never."""
    if not os.path.lexists(output) or (output.is_dir() and not output.is_symlink() and not any(output.iterdir())):
        return
    if not is_bundle(output):
        raise OutputError(f"{output} exists and is not a specbuild bundle; --overwrite replaces only bundles: "
                          "move it away or choose another output")
    if not overwrite:
        raise OutputError(f"{output} already holds a bundle; pass --overwrite to replace it or choose another output")


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
