"""Crashes compiles for tests/test_staging.py: SIGKILLs an `--overwrite` compile before its file-system
changes, and fills the disk under one. One process, so the imports are paid once.

Imports once, then forks a child per kill point: the child counts every file-system change it makes
(mkdir, open for writing, rename, the exchange, unlink, rmdir, chmod) and kills itself with SIGKILL just
before change number K, so the kill lands between any two of them, e.g. between the two renames of an
overwrite. After each kill the next compile runs, one without --overwrite, which cleans up after the
dead one and is then refused (the output holds a bundle): what it leaves is what a crash costs once the
next compile has run.

Two passes: publishing by the atomic exchange, and (as on a system without it) by two renames, killed
only around publishing (the build before it is the same in both).

The disk: a 640 KiB tmpfs, which holds the target's engine but not the draft's, mounted when this runs
in its own mount namespace (`unshare -rm`); "disk_full" is null where it cannot be mounted.

argv: target draft folder. stdout: JSON {"exchange": [records], "rename": [records], "disk_full": ...}.
"""

import builtins
import contextlib
import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from specbuild import staging
from specbuild.cli import main as cli
from specbuild.compile import compile_bundle
from specbuild.recipe import CompileSettings
from specbuild_runtime.errors import SpecbuildError
from specbuild_runtime.manifest import load_manifest

target, draft, folder = map(Path, sys.argv[1:4])
OLD_GAMMA, NEW_GAMMA = 2, 3


def settings(output: Path, gamma: int, overwrite: bool) -> CompileSettings:
    return CompileSettings(target, draft, output, gamma=gamma, max_seq_len=32, overwrite=overwrite)


def count_changes(kill_at: int, mode: str) -> None:
    """Wrap the calls that change files so the kill_at-th of them is never made: the process dies first."""
    count = 0

    def tick():
        nonlocal count
        count += 1
        if count == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    def counted(function, changes=lambda *args, **kwargs: True):
        def wrapper(*args, **kwargs):
            if changes(*args, **kwargs):
                tick()
            return function(*args, **kwargs)

        return wrapper

    writes = lambda file, mode="r", *args, **kwargs: any(c in mode for c in "wax+")  # noqa: E731
    for name in ("mkdir", "rename", "replace", "unlink", "remove", "rmdir", "chmod"):
        setattr(os, name, counted(getattr(os, name)))
    os.open = counted(os.open, lambda path, flags, *args, **kwargs: flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
    builtins.open = io.open = counted(builtins.open, writes)
    exchange = staging._exchange
    staging._exchange = lambda a, b: (tick(), exchange(a, b), tick())[1]
    if mode == "rename":
        staging._exchange = lambda a, b: False  # a system without the atomic exchange


def in_child(job) -> int:
    """Run job() in a forked child; its exit status, or -9 when it was killed."""
    pid = os.fork()
    if pid == 0:
        try:
            job()
            code = 0
        except SpecbuildError:
            code = 1
        except BaseException:  # noqa: BLE001 - any other failure is the test's to see
            code = 2
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def state(output: Path) -> dict:
    """What is at the output path (the gamma of an intact bundle, or why not) and what lies beside it."""
    if not output.exists():
        at_output = "nothing"
    else:
        try:
            at_output = load_manifest(output).gamma  # checks every file's digest
        except SpecbuildError as exc:
            at_output = f"broken: {exc}"
    return {"output": at_output, "beside": sorted(p.name for p in output.parent.iterdir() if p.name != output.name)}


def kill_pass(output: Path, mode: str, first_point: int, stride: int) -> list[dict]:
    """Kill at every stride-th point until the new bundle is published, then at every point from the last
    one before that to the end (where the output path changes hands)."""
    compile_bundle(settings(output, OLD_GAMMA, False), show_progress=False)
    records: dict[int, dict] = {}

    def kill_at(point: int) -> dict:
        def overwrite():
            count_changes(point, mode)
            compile_bundle(settings(output, NEW_GAMMA, True), show_progress=False)

        status = in_child(overwrite)
        after_kill = state(output)
        try:  # the next compile, run here: the dead child's leftovers are for it to clean
            compile_bundle(settings(output, NEW_GAMMA, False), show_progress=False)
            refused = False
        except SpecbuildError:
            refused = True
        records[point] = {"point": point, "status": status, "after_kill": after_kill, "refused": refused,
                          "after_next_compile": state(output)}
        return records[point]

    point = first_point
    while (r := kill_at(point))["status"] == -signal.SIGKILL and r["after_kill"]["output"] == OLD_GAMMA:
        point += stride
    point = max(first_point, point - stride + 1)
    while (records.get(point) or kill_at(point))["status"] == -signal.SIGKILL:  # until the compile ends first
        point += 1
    return [records[p] for p in sorted(records)]


def fill_the_disk() -> dict | None:
    """`specbuild compile` onto a disk too small for the bundle: its exit status, stderr, what is left."""
    disk = folder / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=640k", "tmpfs", str(disk)], capture_output=True).returncode:
        return None
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            cli(["compile", "--target", str(target), "--draft", str(draft), "-o", str(disk / "bundle"), "--max-seq-len", "64"])
        except SystemExit as exc:
            status = exc.code
    return {"status": status, "stderr": stderr.getvalue(), "left": sorted(os.listdir(disk))}


def main() -> None:
    # Compiled here once first: every lazy import is then done before the children fork.
    compile_bundle(settings(folder / "warm-up", OLD_GAMMA, False), show_progress=False)
    exchange = kill_pass(folder / "exchange" / "bundle", "exchange", 1, stride=4)
    published = next(r["point"] for r in exchange if r["after_kill"]["output"] == NEW_GAMMA)
    rename = kill_pass(folder / "rename" / "bundle", "rename", published - 2, stride=1)
    json.dump({"exchange": exchange, "rename": rename, "disk_full": fill_the_disk()}, sys.stdout)


if __name__ == "__main__":
    main()
