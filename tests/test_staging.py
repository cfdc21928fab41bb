"""Writing a folder never loses what was at its path: kill -9 at any point, leftovers of dead writers, a
full disk, a second writer; and what it publishes is readable by other users."""

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from specbuild.staging import check_output, guarded_folder, replace_file, scratch_folder, staged_folder
from specbuild_runtime import SpecbuildError

CRASH_DRIVER = Path(__file__).resolve().parent / "crash_driver.py"


def dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


@pytest.fixture(scope="module")
def crashes(checkpoints, tmp_path_factory):
    """tests/crash_driver.py's report, run in a private mount namespace where unshare(1) allows one."""
    command = [sys.executable, str(CRASH_DRIVER), str(checkpoints("llama")), str(checkpoints("llama", 1)),
               str(tmp_path_factory.mktemp("crashes"))]
    if shutil.which("unshare") and subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode == 0:
        command = ["unshare", "-rm", *command]
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout)


def test_a_compile_killed_at_any_point_leaves_a_whole_bundle_and_the_next_compile_cleans_up(crashes):
    """An --overwrite compile (old bundle γ 2, new γ 3) SIGKILLed before one of its file-system changes
    (every 4th while it builds, every one from just before it publishes); after each kill the next compile
    runs (one without --overwrite, refused)."""
    passes = crashes
    exchange, rename = passes["exchange"], passes["rename"]
    assert len(exchange) >= 15 and exchange[-1]["status"] == 0  # killed at many changes, then ran through
    for record in exchange[:-1] + rename[:-1]:
        assert record["status"] == -9, record
    for record in exchange:  # the atomic exchange: the output path always holds a whole bundle, old then new
        assert record["after_kill"]["output"] in (2, 3), record
    gammas = [r["after_kill"]["output"] for r in exchange]
    assert gammas == sorted(gammas) and gammas[0] == 2 and gammas[-1] == 3
    # Two renames: killed between them, the path is empty and the old bundle lies aside ...
    between = [r for r in rename if r["after_kill"]["output"] == "nothing"]
    assert between and all(any(n.startswith(".bundle.old-") for n in r["after_kill"]["beside"]) for r in between)
    for record in rename:
        assert record["after_kill"]["output"] in (2, 3, "nothing"), record
    # ... and the next compile puts it back. After any kill, the next compile leaves nothing else.
    assert all(r["after_next_compile"]["output"] == 2 for r in between)
    for record in exchange + rename:
        assert record["refused"] and record["after_next_compile"]["output"] in (2, 3), record
        assert record["after_next_compile"]["beside"] == [], record


def test_leftovers_of_earlier_writers_are_removed_and_nothing_else(tmp_path):
    """Whatever their PIDs: the next writer holds the output's lock, so none of them writes (pid 1 runs here,
    as a writer's PID may in another container sharing the volume)."""
    out, dead, running = tmp_path / "out", dead_pid(), 1
    out.mkdir()
    (out / "old.txt").write_text("the folder being replaced")
    for name in (f".out.partial-{dead}", f".out.partial-{dead}-scratch", f".out.old-{dead}", f".out.partial-{running}",
                 f".other.partial-{dead}", f".out.partial-{dead}x", "notes"):  # the last three are kept
        (tmp_path / name).mkdir()
        (tmp_path / name / "f").write_text("x")
    with staged_folder(out) as staging:
        (staging / "new.txt").write_text("new")
        assert scratch_folder(staging) == Path(f"{staging}-scratch")
        scratch_folder(staging).mkdir()  # scratch is removed before publishing
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out", f".other.partial-{dead}", f".out.partial-{dead}x", "notes"])
    assert [p.name for p in out.iterdir()] == ["new.txt"]


def test_a_disk_too_full_for_the_lock_files_pid_is_told_as_a_full_disk(tmp_path, monkeypatch):
    """On a disk with nothing free, compile and distill said "error: No space left on device" alone: neither
    which disk nor what to do (writing the PID into the lock file failed, before anything was staged). Still refused
    there: distill, which holds the lock while it trains, would otherwise train for nothing."""
    import errno

    write = os.write

    def full_for_the_lock(fd, data):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".lock"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(fd, data)

    monkeypatch.setattr(os, "write", full_for_the_lock)
    with pytest.raises(SpecbuildError, match="^no space left on the disk of .*, not even for the lock file of out"):
        with staged_folder(tmp_path / "out"):
            pytest.fail("the build began, on a disk that has no space for it")
    assert [p.name for p in tmp_path.iterdir()] == []


def test_an_old_folder_left_aside_by_a_dead_writer_is_put_back_first(tmp_path):
    """Killed between its two renames (no atomic exchange), a writer leaves the path empty; the next one
    restores the old folder before anything else, so its check sees it (and may refuse to replace it)."""
    out, old = tmp_path / "out", tmp_path / f".out.old-{dead_pid()}"
    old.mkdir()
    (old / "kept.txt").write_text("the old folder")
    seen = []
    with pytest.raises(SpecbuildError, match="refused"):
        with staged_folder(out, check=lambda path: seen.append(sorted(os.listdir(path))) or _refuse()):
            pass
    assert seen == [["kept.txt"]] and (out / "kept.txt").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def _refuse():
    raise SpecbuildError("refused")


def test_a_failure_inside_the_folder_leaves_the_old_one_and_nothing_beside(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(RuntimeError):
        with staged_folder(out) as staging:
            (staging / "half.txt").write_text("half")
            scratch_folder(staging).mkdir()
            raise RuntimeError("build failed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and [p.name for p in out.iterdir()] == ["old.txt"]


def test_a_failure_removes_the_empty_folders_made_for_the_output_and_none_that_were_there(tmp_path):
    """--output a/b/c/bundle made b and c; a failed or interrupted write said nothing was left behind, and left them."""
    (tmp_path / "a").mkdir()
    with pytest.raises(RuntimeError):
        with staged_folder(tmp_path / "a" / "b" / "c" / "out") as staging:
            (staging / "half.txt").write_text("half")
            raise RuntimeError("build failed")
    assert [p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")] == ["a"]
    with pytest.raises(RuntimeError):  # a made folder something else wrote in meanwhile stays, and those above it
        with staged_folder(tmp_path / "a" / "b" / "c" / "out"):
            (tmp_path / "a" / "b" / "notes.txt").write_text("keep me")
            raise RuntimeError("build failed")
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == ["a", "a/b", "a/b/notes.txt"]


@pytest.mark.parametrize("number", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_or_sighup_while_writing_unwinds_like_ctrl_c_and_leaves_the_old_folder_alone(number, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    before = signal.getsignal(number)
    with pytest.raises(KeyboardInterrupt):
        with staged_folder(out) as staging:
            (staging / "half.txt").write_text("half")
            os.kill(os.getpid(), number)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and [p.name for p in out.iterdir()] == ["old.txt"]
    assert signal.getsignal(number) is before


def test_a_sighup_ignored_as_nohup_does_stays_ignored_while_writing(tmp_path):
    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with staged_folder(tmp_path / "out") as staging:
            (staging / "new.txt").write_text("new")
            os.kill(os.getpid(), signal.SIGHUP)
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, before)
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["new.txt"]


@pytest.mark.parametrize("number", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_an_interrupt_while_the_new_folder_is_swapped_in_is_dropped_it_is_done(number, tmp_path, monkeypatch):
    """Reported as interrupted (exit 130, "nothing left behind"), the replaced folder would be a lie."""
    import specbuild.staging as staging_module

    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    exchange = staging_module._exchange

    def exchange_then_interrupt(a, b):
        swapped = exchange(a, b)
        os.kill(os.getpid(), number)
        return swapped

    monkeypatch.setattr(staging_module, "_exchange", exchange_then_interrupt)
    before = {n: signal.getsignal(n) for n in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    with staged_folder(out) as staging:
        (staging / "new.txt").write_text("new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and [p.name for p in out.iterdir()] == ["new.txt"]
    assert {n: signal.getsignal(n) for n in before} == before


def as_a_user(command: list[str]) -> list[str]:
    """command as an ordinary user would run it: as root, without the capabilities that override file
    permissions (setpriv); skipped where that cannot be done."""
    if os.geteuid() != 0:
        return command
    drop = "-dac_override,-dac_read_search,-fowner"
    wrapped = ["setpriv", f"--bounding-set={drop}", f"--inh-caps={drop}", *command]
    if not shutil.which("setpriv") or subprocess.run(wrapped[:3] + ["true"], capture_output=True).returncode:
        pytest.skip("running as root and cannot drop the capabilities that override permissions (setpriv)")
    return wrapped


def test_a_read_only_old_folder_is_replaced_and_removed(tmp_path):
    """`chmod -R a-w bundle` to protect a release, then compile --overwrite: the new bundle was published, yet
    the command failed ("Permission denied: draft.onnx.data", exit 1), left the old one beside it, and every
    later compile to that output failed the same way."""
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    (out / "sub" / "old.txt").write_text("old")
    for folder in (out / "sub", out):
        folder.chmod(0o555)
    write = ("import sys; from pathlib import Path; from specbuild.staging import staged_folder\n"
             "with staged_folder(Path(sys.argv[1])) as staging: (staging / sys.argv[2]).write_text('new')\n")
    for name in ("new.txt", "newer.txt"):
        result = subprocess.run(as_a_user([sys.executable, "-c", write, str(out), name]), capture_output=True, text=True)
        assert result.returncode == 0, result.stderr[-1000:]
        assert [p.name for p in out.iterdir()] == [name] and [p.name for p in tmp_path.iterdir()] == ["out"]


def test_a_second_writer_is_refused_while_the_first_writes(tmp_path):
    out = tmp_path / "out"
    with staged_folder(out) as staging:
        (staging / "first.txt").write_text("first")
        with pytest.raises(SpecbuildError, match=rf"another process \(pid {os.getpid()}\) is writing"):
            with staged_folder(out):
                pass
    assert [p.name for p in out.iterdir()] == ["first.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # the lock file goes with its holder


@pytest.mark.parametrize("old", ["old.txt", None])  # a bundle, or an empty folder
def test_another_users_folder_in_a_sticky_folder_is_refused_before_anything_is_written(old, tmp_path, monkeypatch):
    """compile --overwrite of a colleague's bundle in /tmp or a shared 1777 /scratch built the whole bundle, then
    failed to swap it in: "Operation not permitted: .../.bundle.partial-PID" (the sticky bit lets only a file's
    owner rename it). Another user is simulated: making a folder someone else's needs root."""
    import specbuild.staging as staging_module

    shared = tmp_path / "shared"
    (shared / "bundle").mkdir(parents=True)
    if old:
        (shared / "bundle" / old).write_text("old")
    shared.chmod(0o1777)
    owner = (shared / "bundle").stat().st_uid
    monkeypatch.setattr(staging_module.os, "geteuid", lambda: owner + 1)
    monkeypatch.setattr(staging_module, "_owns_every_file", lambda: False, raising=False)  # a user, not root
    with pytest.raises(SpecbuildError, match="belongs to another user"):
        with guarded_folder(shared / "bundle", overwrite=True, is_kind=lambda folder: True, kind="bundle"):
            pytest.fail("the build began")
    assert [p.name for p in shared.iterdir()] == ["bundle"]
    assert [p.name for p in (shared / "bundle").iterdir()] == ([old] if old else [])


@pytest.mark.parametrize("umask,expected", [(0o022, 0o644), (0o027, 0o640)])
def test_published_files_are_readable_as_the_umask_allows_whatever_mode_they_were_written_with(umask, expected, tmp_path):
    previous = os.umask(umask)
    try:
        with staged_folder(tmp_path / "out") as staging:
            (staging / "sub").mkdir(mode=0o700)
            for path in (staging / "weights.data", staging / "sub" / "f"):
                path.write_text("x")
                path.chmod(0o600)  # as onnx writes external data
    finally:
        os.umask(previous)
    files = [tmp_path / "out" / "weights.data", tmp_path / "out" / "sub" / "f"]
    assert {p.stat().st_mode & 0o777 for p in files} == {expected}
    assert (tmp_path / "out" / "sub").stat().st_mode & 0o777 == expected | (expected & 0o444) >> 2


def test_bundle_files_are_as_readable_as_the_bundle_folder(bundles):
    """`*.onnx.data` used to be 0600, unreadable by a service running as another user."""
    bundle = bundles("llama", 1)
    readable = (bundle.stat().st_mode & 0o777) & 0o666
    assert {p.name: p.stat().st_mode & 0o777 for p in bundle.rglob("*") if p.is_file()} == {
        p.name: readable for p in bundle.rglob("*") if p.is_file()}


def test_a_full_disk_is_one_line_and_leaves_nothing(crashes):
    """The disk fills inside the build: the target's engine fits, the draft's does not."""
    if crashes["disk_full"] is None:
        pytest.skip("cannot mount a small tmpfs here (needs unshare -rm)")
    status, stderr, left = crashes["disk_full"].values()
    assert status == 1 and stderr.startswith("error: no space left on the disk of") and stderr.count("\n") == 1, stderr
    assert left == [], "the full disk kept a partial bundle, staging or lock file"


def rust_write_error(library: str, code: int) -> Exception:
    """What tokenizers' Tokenizer.save and safetensors' save_file raise when a write fails (their Rust
    io::Error as text; tokenizers' is a plain Exception). Simulated: safetensors replaces a file it writes
    by a rename, so writing /dev/full as root would replace the device."""
    text = f"{os.strerror(code)} (os error {code})"
    if library == "tokenizers":
        return Exception(text)
    from safetensors import SafetensorError

    return SafetensorError(f"Error while serializing: I/O error: {text}")


@pytest.mark.parametrize("library", ["tokenizers", "safetensors"])
def test_a_full_disk_met_by_a_rust_writer_is_one_line_and_leaves_nothing(library, tmp_path):
    """Saving the bundle's tokenizer or a distilled checkpoint onto a full disk was "internal error ... this is
    a bug in specbuild" (exit 3) where every other write said the disk was full."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(SpecbuildError, match="^no space left on the disk of"):
        with staged_folder(out) as staging:
            (staging / "half.txt").write_text("half")
            raise rust_write_error(library, errno.ENOSPC)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and [p.name for p in out.iterdir()] == ["old.txt"]
    with pytest.raises(type(rust_write_error(library, errno.EACCES)), match=r"\(os error 13\)"):  # others as raised
        with staged_folder(out):
            raise rust_write_error(library, errno.EACCES)


def test_a_full_disk_says_the_build_needed_more_than_the_space_free_when_it_began(tmp_path, monkeypatch):
    """"no space left" alone leaves a pipeline to guess whether freeing a little will do (a quantized compile's
    scratch, its fp32 references, needs more than the bundle's own size)."""
    import specbuild.staging as staging_module

    disk_usage = staging_module.shutil.disk_usage
    monkeypatch.setattr(staging_module.shutil, "disk_usage", lambda path: disk_usage(path)._replace(free=1_234_000_000))
    with pytest.raises(SpecbuildError) as raised:
        with staged_folder(tmp_path / "out") as staging:
            (staging / "target.onnx.data").write_text("half")
            raise OSError(errno.ENOSPC, "No space left on device")
    assert "while writing out: it needed more than the 1.23 GB free there when it began" in str(raised.value)
    assert [p.name for p in tmp_path.iterdir()] == []


@pytest.mark.parametrize("mount", ["-t tmpfs none", "--bind {host}"])  # another file system; a bind mount of this one
def test_an_output_that_is_a_mount_point_is_refused_before_the_build(mount, checkpoints, tmp_path):
    """`docker run -v $PWD/out:/out ... -o /out`: the mount point cannot be exchanged for the staging folder
    (EBUSY), which a compile used to find after building the whole bundle on the parent's disk."""
    if not (shutil.which("unshare") and subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode == 0):
        pytest.skip("cannot mount here (needs unshare -rm)")
    volume, host = tmp_path / "out", tmp_path.parent / f"{tmp_path.name}-host"
    volume.mkdir()
    host.mkdir()
    command = (f'mount {mount.format(host=host)} {volume} && {sys.executable} -m specbuild compile --target {checkpoints("llama")} '
               f'--draft {checkpoints("llama", 1)} -o {volume} --max-seq-len 32; echo "status $?"; ls -A {volume}')
    result = subprocess.run(["unshare", "-rm", "sh", "-c", command], capture_output=True, text=True)
    assert "status 1" in result.stdout and result.stdout.split("status 1")[1].strip() == "", result.stdout
    assert "is a mount point" in result.stderr and result.stderr.count("\n") == 1, result.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # nothing staged beside it


def test_a_full_disk_names_what_killed_builds_of_other_outputs_left_there(tmp_path):
    """Only the next write to the same output removes a killed build's staging folder: outputs named per
    version (bundle-v1, bundle-v2, ...) leave theirs to fill a CI disk."""
    left = tmp_path / ".bundle-v1.partial-4242"
    left.mkdir()
    (left / "target.onnx.data").write_bytes(b"x" * 3_000_000)
    with pytest.raises(SpecbuildError) as raised:
        with staged_folder(tmp_path / "bundle-v2"):
            raise OSError(errno.ENOSPC, "No space left on device")
    assert "free some space (a killed build left .bundle-v1.partial-4242 there, 3.0 MB: remove it if no build is " \
           "running) or choose another output" in str(raised.value)
    assert left.is_dir()  # named, never removed: it may be a running build's


def test_a_file_replaced_is_the_old_or_the_new_never_cut_short(tmp_path, monkeypatch):
    """The demo pair's report.json, written in place, was cut short by a kill mid-write."""
    report = tmp_path / "report.json"
    report.write_text('{"old": 1}')
    write_text = Path.write_text

    def killed_midway(self, data, *args, **kwargs):
        write_text(self, data[: len(data) // 2], *args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(Path, "write_text", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        replace_file(report, '{"new": 2}')
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"] and report.read_text() == '{"old": 1}'
    replace_file(report, '{"new": 2}')
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"] and report.read_text() == '{"new": 2}'


def test_a_report_written_through_a_symlink_or_to_a_fifo_leaves_them_what_they_are(tmp_path):
    """bench --json /dev/null (as root, /dev is writable) or a link to a shared report: the rename that makes a
    report whole must not put a regular file in their place."""
    import threading

    (tmp_path / "real.json").write_text("old")
    (tmp_path / "link.json").symlink_to("real.json")
    replace_file(tmp_path / "link.json", "new")
    assert (tmp_path / "link.json").is_symlink() and (tmp_path / "real.json").read_text() == "new"
    fifo, got = tmp_path / "fifo", []
    os.mkfifo(fifo)
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()), daemon=True)
    reader.start()
    replace_file(fifo, "to the reader")
    reader.join(10)
    assert fifo.is_fifo() and got == ["to the reader"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "link.json", "real.json"]


@pytest.mark.parametrize("overwrite", [False, True])
def test_an_output_that_is_a_file_is_called_a_file(tmp_path, overwrite):
    """-o notes.txt (or a recipe's output = "notes.txt") said "exists and is not a specbuild bundle; --overwrite
    replaces only a specbuild bundle", which reads as a folder holding the wrong things."""
    notes = tmp_path / "notes.txt"
    notes.write_text("keep me")
    said = r"^.*notes\.txt is a file, and a specbuild bundle is a folder: move the file away or choose another output$"
    with pytest.raises(SpecbuildError, match=said):
        check_output(notes, overwrite=overwrite, is_kind=lambda path: True, kind="specbuild bundle")
    with pytest.raises(SpecbuildError, match=said):
        with guarded_folder(notes, overwrite=overwrite, is_kind=lambda path: True, kind="specbuild bundle"):
            pass
    assert notes.read_text() == "keep me" and sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_a_file_larger_than_the_file_system_allows_is_not_a_full_disk(tmp_path):
    """EFBIG (a FAT32 stick's 4 GiB, a `ulimit -f`) came out as numpy's "N requested and M written", which the
    staging read as a full disk; its errno now reaches the staging, which says that freeing space will not help."""
    with pytest.raises(SpecbuildError, match=r"^a file of out is larger than .* lets a file be \(FAT32 stops at 4 GiB.*"
                                             r"\(nothing was written\); choose an output on another file system$"):
        with staged_folder(tmp_path / "out") as staging:
            (staging / "target.onnx.data").write_text("half")
            raise OSError(errno.EFBIG, "File too large")
    assert [p.name for p in tmp_path.iterdir()] == []
