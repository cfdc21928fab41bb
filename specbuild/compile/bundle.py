"""Stage 4: write the bundle atomically — build in a temporary sibling folder, then rename into place."""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from specbuild_runtime.errors import SpecbuildError
from specbuild_runtime.manifest import MANIFEST, Manifest, bundle_files


@contextmanager
def staged_bundle(output: Path, overwrite: bool) -> Iterator[Path]:
    """Yields an empty folder to build in; on success it replaces `output`, on any failure it vanishes."""
    output = output.resolve()
    if output.exists() and not overwrite:
        raise SpecbuildError(f"{output} already exists; pass --overwrite to replace it or choose another --output")
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = output.parent / f".{output.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        yield staging
        if output.exists():
            retired = output.parent / f".{output.name}.old-{os.getpid()}"
            output.rename(retired)
            staging.rename(output)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            staging.rename(output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def write_manifest(folder: Path, manifest: Manifest) -> None:
    manifest.files = bundle_files(folder)
    (folder / MANIFEST).write_text(manifest.to_json())
