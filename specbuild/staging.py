"""Write a folder so that a crash, a full disk or a second writer never costs what was at its path.

The new folder is built in a staging folder beside its final path (`.NAME.partial-PID`, with scratch
space in `.NAME.partial-PID-scratch`: the same file system, so publishing is a rename) and published by
an atomic exchange with the folder it replaces, so the path always holds the old folder or the new one.
A lock file (`.NAME.lock`) makes a second writer to the same path refuse instead of both publishing.
A process killed mid-way leaves folders named after its dead PID; the next writer to that path removes
them, and puts back an old folder that a kill between two renames left aside (systems without the
exchange publish with two renames).

What may be replaced is decided by the caller through guarded_folder: never anything that is, holds or
lies inside one of the build's inputs, and only with `overwrite` a folder of the kind being written.

Used for engine bundles (`compile/bundle.py`) and checkpoints (`train/train.py`); replace_file writes one
file the same way (the demo pair's report).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import functools
import itertools
import os
import re
import shutil
import signal
import stat
import threading
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Callable, Iterator

# The names of what a killed writer leaves: defined with the bundle format, since the runtime reads them too (a killed
# compile's staging folder given where a bundle goes is told so), and it may not import the compiler.
from specbuild_runtime.manifest import LEFTOVER

from .errors import OutputError


def scratch_folder(staging: Path) -> Path:
    """Scratch space of a staged build (removed before publishing and with stale staging folders)."""
    return Path(f"{staging}-scratch")


def replace_file(path: Path, text: str) -> None:
    """Write text to path through `.NAME.partial-PID` beside it, renamed over it once whole: a kill mid-write
    leaves the old file (or none), never a cut-short one that readers would take for it. A symlink's target is
    replaced (the link stays); what is no regular file (/dev/null, a FIFO) is written in place, never replaced."""
    path = Path(os.path.realpath(path))
    if path.exists() and not path.is_file():
        path.write_text(text)
        return
    partial = path.parent / f".{path.name}.partial-{os.getpid()}"
    try:
        partial.write_text(text)
        os.replace(partial, path)
    finally:
        with suppress(FileNotFoundError):
            partial.unlink()


@contextmanager
def staged_folder(output: Path, check: Callable[[Path], None] = lambda output: None) -> Iterator[Path]:
    """Yields an empty staging folder beside `output`; on success it becomes `output`, on any failure
    it vanishes, with the empty folders made for it. check(output) runs while this process holds the output's
    lock, before anything is written, and raises to refuse (e.g. an existing folder that must not be replaced).
    An interrupt (Ctrl-C, or a TERMINATING signal) before publishing is re-raised as a KeyboardInterrupt that
    says what is at the output, once the staging folder is gone; the CLI prints it in place of "interrupted"."""
    output = resolved(output)
    staging = output.parent / f".{output.name}.partial-{os.getpid()}"
    scratch = scratch_folder(staging)
    published = False
    try:
        with _folders_made_for(output), _terminate_as_interrupt(), _locked(output):
            _remove_stale(output)
            check(output)
            free = shutil.disk_usage(output.parent).free  # what a full disk's message says the build needed more than
            try:
                shutil.rmtree(staging, ignore_errors=True)  # this process's own, from an earlier failed call
                staging.mkdir()
                yield staging
                shutil.rmtree(scratch, ignore_errors=True)
                _make_readable(staging)
                with _signals_ignored():
                    _publish(staging, output)
                    published = True
            except Exception as exc:  # noqa: BLE001 - a full disk is told apart from the rest, which goes on as raised
                full = _disk_full(exc)
                if full:
                    # A quota's limit is not the disk's free space, which then says nothing.
                    needed = ("" if full == errno.EDQUOT else
                              f": it needed more than the {amount(free)} free there when it began")
                    raise OutputError(f"no space left on the disk of {output.parent} while writing {output.name}{needed} "
                                      f"(nothing was written); free some space{_leftovers(output)} or "
                                      "choose another output") from None
                if isinstance(exc, OSError) and exc.errno == errno.EFBIG:  # free space would not help
                    raise OutputError(f"a file of {output.name} is larger than {output.parent} lets a file be (FAT32 "
                                      "stops at 4 GiB, `ulimit -f` sets a limit too) (nothing was written); choose "
                                      "an output on another file system") from None
                raise
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
                shutil.rmtree(staging, ignore_errors=True)
    except KeyboardInterrupt:
        # A second interrupt can cut the clean-up short: then the plain "interrupted", which claims nothing.
        if published or os.path.lexists(staging) or os.path.lexists(scratch):
            raise
        raise nothing_written(output) from None


def nothing_written(output: Path) -> KeyboardInterrupt:
    """The interrupt that says what is at output (resolved), for one that came before anything was written there;
    the CLI prints it in place of "interrupted"."""
    where = "holds what it held before" if os.path.lexists(output) else "was not made"
    return KeyboardInterrupt(f"interrupted: nothing was written ({output} {where}); run the command again to write it")


@contextmanager
def _folders_made_for(output: Path) -> Iterator[None]:
    """Makes output's missing parent folders; a failure that follows removes those this call made, innermost
    first, while they are empty (nothing is left behind, as for the output itself). Made one at a time: one
    another process made meanwhile is not this call's to remove."""
    missing = list(itertools.takewhile(lambda folder: not os.path.lexists(folder), output.parents))
    made = []
    try:
        for folder in reversed(missing):
            with suppress(FileExistsError):
                folder.mkdir()
                made.append(folder)
        output.parent.mkdir(parents=True, exist_ok=True)  # what stands in the way, as mkdir tells it
    except OSError as exc:
        _remove_empty(made)
        blocking = next((folder for folder in output.parents if os.path.lexists(folder) and not folder.is_dir()), None)
        if blocking:  # mkdir says "File exists" or "Not a directory", naming the folder it could not make
            raise OutputError(f"{blocking} is a file, so {output} cannot be made inside it; choose an output whose "
                              "parent folders are folders") from None
        raise OutputError(f"cannot make the folder {exc.filename} for {output} ({exc.strerror}); choose an output "
                          "inside a folder you can write") from None
    try:
        yield
    except BaseException:
        _remove_empty(made)
        raise


def _remove_empty(folders: list[Path]) -> None:
    """rmdir each folder, innermost first, stopping at the first one that is not empty (or not there)."""
    for folder in reversed(folders):
        try:
            folder.rmdir()
        except OSError:
            return


@contextmanager
def guarded_folder(output: Path, *, overwrite: bool, is_kind: Callable[[Path], bool], kind: str,
                   inputs: dict[str, Path | None] | None = None) -> Iterator[Path]:
    """staged_folder for an output that may replace only an empty folder or, with overwrite, a folder
    for which is_kind holds (kind names it in errors), and never touches the inputs."""
    refuse_overlap(output, inputs or {})
    with staged_folder(output, lambda resolved: check_replaceable(resolved, overwrite, is_kind, kind)) as staging:
        yield staging


def check_output(output: Path, *, overwrite: bool, is_kind: Callable[[Path], bool], kind: str,
                 inputs: dict[str, Path | None] | None = None) -> None:
    """What guarded_folder will check, for callers to run before long work, so that a refusal comes
    before minutes of training rather than after."""
    refuse_overlap(output, inputs or {})
    existing = nearest_folder(output)
    if not existing.is_dir():
        raise OutputError(f"{existing} is a file, so {output} cannot be made inside it; choose another output")
    # The staging folder and the lock go there (or in a folder made there): refused now, not after the build.
    if not os.access(existing, os.W_OK | os.X_OK):
        raise OutputError(f"cannot write in {existing} (permission denied or a read-only file system), so {output} "
                          "cannot be written; choose an output inside a folder you can write")
    check_replaceable(resolved(output), overwrite, is_kind, kind)


def refuse_overlap(output: Path, inputs: dict[str, Path | None]) -> None:
    """OutputError if output is an input, holds one or lies inside one, or is the current folder (or holds
    it): a folder is replaced whole, which would leave the shell in a deleted folder that looks empty."""
    out = resolved(output)
    cwd = Path.cwd().resolve()
    if out == cwd or out in cwd.parents:
        raise OutputError(f"output {output} is {'the' if out == cwd else 'above the'} current folder, which the "
                          "output replaces whole; run from another folder or choose another output")
    for role, path in inputs.items():
        if path is None:
            continue
        path = Path(path).resolve()
        relation = "is" if out == path else "contains" if out in path.parents else "lies inside" if path in out.parents else None
        if relation:
            raise OutputError(f"output {output} {relation} the {role} {path}; writing there could destroy it: "
                              "choose an output outside every input")


def nearest_folder(output: Path) -> Path:
    """The closest of output's parents that exists: where its staging folder and lock go (or a folder made
    there), on the disk the output will take."""
    return next(folder for folder in resolved(output).parents if folder.exists())


def resolved(output: Path) -> Path:
    """output as an absolute path with its links followed; OutputError where they lead back to themselves (a
    link to itself, two links to each other), which pathlib raises as RuntimeError before Python 3.13."""
    try:
        return Path(output).resolve()
    except (RuntimeError, OSError) as exc:
        if isinstance(exc, OSError) and exc.errno != errno.ELOOP:
            raise
        raise OutputError(f"output {output} is, or lies inside, a symbolic link that leads back to itself; remove "
                          "the link or choose another output") from None


def check_replaceable(output: Path, overwrite: bool, is_kind: Callable[[Path], bool], kind: str) -> None:
    """Nothing there, or an empty folder: fine. A folder of the kind: only with overwrite. Anything else: never.
    Nor a mount point (a container's volume, `docker run -v ...:/out`): it cannot be swapped for a new folder,
    so publishing would fail after the whole build, which would have been staged on the parent's disk."""
    if _is_mount_point(output):
        raise OutputError(f"{output} is a mount point, which cannot be replaced by a new folder; choose a folder "
                          f"inside it as the output (e.g. {output / ('bundle' if 'bundle' in kind else 'draft')})")
    if not os.path.lexists(output):
        return
    if output.exists() and not output.is_dir():  # "is not a bundle" would send one looking for a folder's contents
        raise OutputError(f"{output} is a file, and a {kind} is a folder: move the file away or choose another output")
    if not (output.is_dir() and not output.is_symlink() and not any(output.iterdir())):  # an empty folder: fine
        if output.is_symlink() or not output.is_dir() or not is_kind(output):
            raise OutputError(f"{output} exists and is not a {kind}; --overwrite replaces only a {kind}: "
                              "move it away or choose another output")
        if not overwrite:
            raise OutputError(f"{output} already holds a {kind}; pass --overwrite to replace it or choose another "
                              "output")
    if _sticky_and_not_ours(output):  # an empty folder too: it is swapped out all the same
        raise OutputError(f"{output} belongs to another user, and {output.parent} lets only a file's owner replace "
                          "it (the sticky bit, as /tmp has); have its owner remove it or choose another output")


def _sticky_and_not_ours(path: Path) -> bool:
    """Whether path lies in a sticky folder (/tmp, a shared /scratch) that lets only its owner, the folder's
    owner or a process with CAP_FOWNER (root's) rename it: publishing would fail (EPERM) after the whole build."""
    folder, entry = path.parent.stat(), path.lstat()
    return (bool(folder.st_mode & stat.S_ISVTX) and os.geteuid() not in (entry.st_uid, folder.st_uid)
            and not _owns_every_file())


CAP_FOWNER = 3


def _owns_every_file() -> bool:
    """CAP_FOWNER in the effective set (Linux); elsewhere, being root."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return os.geteuid() == 0
    effective = re.search(r"^CapEff:\s*([0-9a-f]+)", status, re.MULTILINE)
    return bool(effective) and bool(int(effective[1], 16) >> CAP_FOWNER & 1)


def _is_mount_point(path: Path) -> bool:
    """os.path.ismount, which compares devices, misses a bind mount of a folder on the parent's own file
    system; Linux lists every mount point in /proc/self/mountinfo (field 5, with octal escapes)."""
    if os.path.ismount(path):
        return True
    try:
        lines = Path("/proc/self/mountinfo").read_text(errors="surrogateescape").splitlines()
    except OSError:
        return False
    return any(len(fields) > 4 and _unescape(fields[4]) == str(path) for fields in map(str.split, lines))


def _unescape(field: str) -> str:
    """mountinfo writes a space, tab, newline or backslash in a path as an octal escape (\\040)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), field)


# Signals that end a process by default and that pipelines and terminals send: SIGTERM (a job cancelled,
# `timeout`, `docker stop`), SIGHUP (an SSH session or terminal closed).
TERMINATING = (signal.SIGTERM, signal.SIGHUP)


@contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """TERMINATING signals unwind like Ctrl-C while a folder is written, so the staging folder and the lock go
    with it; by default they would end the process at once. One the process ignores (`nohup` ignores
    SIGHUP) stays ignored. Python runs the handler between bytecodes: during a long call into C (saving an
    engine) it waits."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = {number: signal.getsignal(number) for number in TERMINATING}
    for number, handler in previous.items():
        if handler is not signal.SIG_IGN:
            signal.signal(number, interrupt)
    try:
        yield
    finally:  # None: a handler set outside Python, which cannot be put back; the default is the nearest
        for number, handler in previous.items():
            signal.signal(number, signal.SIG_DFL if handler is None else handler)


@contextmanager
def _signals_ignored() -> Iterator[None]:
    """Ctrl-C and TERMINATING signals are dropped while the new folder replaces the old: once swapped in, the
    job is done, and an interrupt raised while the old folder is removed would report "interrupted" (exit
    130: nothing left behind) over a folder already replaced. One before the swap still unwinds as usual."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {number: signal.signal(number, lambda signum, frame: None) for number in (signal.SIGINT, *TERMINATING)}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, signal.SIG_DFL if handler is None else handler)


# What the writers built in Rust (tokenizers' save, safetensors' save_file, which write the tokenizer and
# a distilled checkpoint) raise for a failed write: a plain Exception whose text ends in Rust's io::Error,
# "No space left on device (os error 28)", the errno being only in the text.
RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def _disk_full(exc: Exception) -> int | None:
    """ENOSPC or EDQUOT where exc says the disk (or a quota) is full, else None: the errno, or a Rust writer's.
    Engines are written with the file's write (graphs/builder.py WrittenWithErrno), never numpy's tofile,
    whose short write says no errno."""
    if isinstance(exc, OSError):
        code = exc.errno
    else:
        rust = RUST_OS_ERROR.search(str(exc))
        code = int(rust[1]) if rust else None
    return code if code in (errno.ENOSPC, errno.EDQUOT) else None


def amount(size: int) -> str:
    """A size on disk as messages give it."""
    return f"{size / 1e9:.2f} GB" if size >= 1e9 else f"{size / 1e6:.1f} MB"


def _leftovers(output: Path) -> str:
    """A note naming other outputs' staging folders beside output, or "": a killed build's are removed only by
    the next write to the same output, so outputs named per version fill a CI disk with them (they may also
    be a running build's: named, never removed)."""
    found = [entry for entry in output.parent.iterdir()
             if (match := LEFTOVER.fullmatch(entry.name)) and match["name"] != output.name]
    if not found:
        return ""
    size = amount(sum(f.stat().st_size for entry in found for f in entry.rglob("*") if f.is_file() and not f.is_symlink()))
    if len(found) == 1:
        return f" (a killed build left {found[0].name} there, {size}: remove it if no build is running)"
    return (f" (killed builds left {len(found)} folders there, e.g. {found[0].name}, {size} in all: remove them if "
            "no build is running)")


@contextmanager
def _locked(output: Path) -> Iterator[None]:
    """Hold `.NAME.lock` beside output (flock: the kernel releases it when its holder dies).

    The file is removed on release, so a finished writer leaves nothing behind; a writer that opened
    it just before that removal finds the path now names another file (or none) and tries again.
    """
    path = output.parent / f".{output.name}.lock"
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise OutputError(f"cannot write in {output.parent} ({exc.strerror}); choose an output inside a folder "
                              "you can write") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise OutputError(f"another process (pid {holder}) is writing {output}; wait for it to finish "
                              "or choose another output") from None
        try:
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        try:
            os.write(fd, str(os.getpid()).encode())
        except OSError as exc:  # refused now: distill would otherwise train for its minutes first
            if _disk_full(exc):
                raise OutputError(f"no space left on the disk of {output.parent}, not even for the lock file of "
                                  f"{output.name} (nothing was written); free some space or choose another "
                                  "output") from None
            raise
        yield
    finally:
        with suppress(FileNotFoundError):
            os.unlink(path)
        os.close(fd)


def _remove_stale(output: Path) -> None:
    """Remove what earlier writers to output left beside it (only names of our own pattern); put back an old
    folder a kill between the two renames of _publish left aside. Called holding output's lock, so no
    writer of these is alive, whatever their PIDs say (a PID alive in another container proves nothing)."""
    for entry in output.parent.iterdir():
        match = LEFTOVER.fullmatch(entry.name)
        if not match or match["name"] != output.name:
            continue
        if match["kind"] == "old" and not os.path.lexists(output):
            entry.rename(output)
            continue
        try:
            _remove(entry)
        except OSError as exc:
            raise OutputError(f"cannot remove {entry}, which an earlier writer to {output} left ({exc.strerror or exc}); "
                              "remove it (or have its owner remove it) and try again") from None


def _make_readable(folder: Path) -> None:
    """Give every file and folder the staging folder's own permissions (which follow the umask):
    some writers create files 0600, but a bundle is a build artefact other users' services load."""
    mode = folder.stat().st_mode & 0o777
    for root, dirs, files in os.walk(folder):
        for name in dirs:
            os.chmod(os.path.join(root, name), mode)
        for name in files:
            os.chmod(os.path.join(root, name), mode & 0o666)


def _publish(staging: Path, output: Path) -> None:
    if not os.path.lexists(output):
        staging.rename(output)
        return
    if _exchange(staging, output):
        old = staging  # which now holds the old folder
    else:  # no atomic exchange here: the path is empty between the two renames (_remove_stale recovers)
        old = output.parent / f".{output.name}.old-{os.getpid()}"
        output.rename(old)
        staging.rename(output)
    # The new folder is in place: the job is done. An old folder that cannot be removed (another user's)
    # stays aside, and the next writer says so.
    with suppress(OSError):
        _remove(old)


def _remove(path: Path) -> None:
    """shutil.rmtree, also of a tree whose folders are read-only (a bundle made read-only to protect it, or
    copied from a read-only place), whose owner may make them writable again."""
    try:
        shutil.rmtree(path)
    except PermissionError:
        _owner_writable(path)
        for root, dirs, _ in os.walk(path):  # top-down: each folder is made writable before it is listed
            for name in dirs:
                _owner_writable(os.path.join(root, name))
        shutil.rmtree(path)


def _owner_writable(folder: str | Path) -> None:
    if not os.path.islink(folder):  # chmod would follow a link out of the tree
        with suppress(OSError):
            os.chmod(folder, stat.S_IMODE(os.stat(folder).st_mode) | stat.S_IRWXU)


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_NO_EXCHANGE = {errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP}


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically with Linux's renameat2(RENAME_EXCHANGE) (glibc 2.28+); False where the
    OS, libc or file system has no such call. Written by hand: Python's os module has rename and
    replace but no exchange, and no maintained package offers one."""
    renameat2 = getattr(_libc(), "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in _NO_EXCHANGE:
        return False
    raise OSError(code, os.strerror(code), str(a), None, str(b))


@functools.cache
def _libc():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    if hasattr(libc, "renameat2"):
        libc.renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        libc.renameat2.restype = ctypes.c_int
    return libc
