"""Runs many `specbuild` command lines in one process (one start-up instead of one each) for the tests.

stdin: a JSON list of argument lists (or {"python": source} to exec, e.g. a README example). stdout: a
JSON list of {"status", "stdout", "stderr", "opened"},
stderr captured at the file-descriptor level, so what libraries write there directly is seen too;
"opened": the files under $WATCH_OPENS (if set) that the command opened, as Python's audit hook saw it.
"""

import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
import traceback

from specbuild.cli import main

WATCHED = os.environ.get("WATCH_OPENS")
opened: list[str] = []


def watch(event: str, args: tuple) -> None:
    if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)) and os.fsdecode(args[0]).startswith(WATCHED):
        opened.append(os.fsdecode(args[0]))


def run(args: list[str] | dict) -> dict:
    opened.clear()
    out = io.StringIO()
    with tempfile.TemporaryFile() as err:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(err.fileno(), 2)
        try:
            with contextlib.redirect_stdout(out):
                if isinstance(args, dict):
                    exec(compile(args["python"], "<example>", "exec"), {"__name__": "__example__"})
                else:
                    main(args)
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


def run_in_one_process(argument_lists: list, watch_opens: str | None = None, cwd=None) -> list[dict]:
    """For the tests: run this driver on argument_lists in a fresh process."""
    env = {**os.environ, **({"WATCH_OPENS": watch_opens} if watch_opens else {})}
    result = subprocess.run([sys.executable, __file__], input=json.dumps(argument_lists), capture_output=True,
                            text=True, env=env, cwd=cwd)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


if __name__ == "__main__":
    if WATCHED:
        sys.addaudithook(watch)
    results = [run(args) for args in json.load(sys.stdin)]
    json.dump(results, sys.__stdout__)
