"""Runs `specbuild` command lines for the tests in one long-lived process: one start-up (imports, lazy
imports of the first compile: ~8 s) for the whole session instead of one per command.

Each request is a JSON line {"entries": [...], "cwd": folder or null, "watch": folder or null}; an entry
is an argument list, or {"python": source} to exec (a README example). The reply is a JSON line: one
{"status", "stdout", "stderr", "opened"} per entry. stderr is captured at the file-descriptor level, so
what libraries write there directly is seen too; "opened" lists the files under "watch" the entry opened
(Python's audit hook), e.g. a pickle no command may touch.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
import traceback

from specbuild.cli import main

watched: str | None = None
opened: list[str] = []


def watch(event: str, args: tuple) -> None:
    if (event == "open" and watched and isinstance(args[0], (str, bytes, os.PathLike))
            and os.fsdecode(args[0]).startswith(watched)):
        opened.append(os.fsdecode(args[0]))


def run(entry: list[str] | dict) -> dict:
    opened.clear()
    out = io.StringIO()
    with tempfile.TemporaryFile() as err:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(err.fileno(), 2)
        try:
            with contextlib.redirect_stdout(out):
                if isinstance(entry, dict):
                    exec(compile(entry["python"], "<example>", "exec"), {"__name__": "__example__"})
                else:
                    main(entry)
            status = 0
        except SystemExit as exc:
            status = exc.code if isinstance(exc.code, int) else 1
        except Exception:  # a Python example that failed: its traceback is the report
            traceback.print_exc()
            status = 1
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        err.seek(0)
        return {"status": status, "stdout": out.getvalue(), "stderr": err.read().decode(errors="replace"),
                "opened": list(opened)}


class Driver:
    """The tests' handle on a driver process (conftest's session fixture `cli`)."""

    def __init__(self):
        self.process = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false",
                                                                      "OMP_NUM_THREADS": "1"})  # as conftest

    def run(self, entries: list, cwd=None, watch=None) -> list[dict]:
        request = {"entries": entries, "cwd": str(cwd) if cwd else None, "watch": str(watch) if watch else None}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        reply = self.process.stdout.readline()
        assert reply, "the CLI driver died (see the test's stderr)"
        return json.loads(reply)

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


def serve() -> None:
    global watched
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what anything writes to fd 1 goes to stderr, not into the replies
    sys.addaudithook(watch)
    home = os.getcwd()
    for line in sys.stdin:
        request = json.loads(line)
        watched = request["watch"]
        os.chdir(request["cwd"] or home)
        replies.write(json.dumps([run(entry) for entry in request["entries"]]) + "\n")
        replies.flush()


if __name__ == "__main__":
    serve()
