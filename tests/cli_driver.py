"""Runs many `specbuild` command lines in one process (one start-up instead of one each) for the tests.

stdin: a JSON list of argument lists. stdout: a JSON list of {"status", "stdout", "stderr"}, stderr
captured at the file-descriptor level, so what libraries write there directly is seen too.
"""

import contextlib
import io
import json
import os
import sys
import tempfile

from specbuild.cli import main


def run(args: list[str]) -> dict:
    out = io.StringIO()
    with tempfile.TemporaryFile() as err:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(err.fileno(), 2)
        try:
            with contextlib.redirect_stdout(out):
                main(args)
            status = 0
        except SystemExit as exc:
            status = exc.code if isinstance(exc.code, int) else 1
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        err.seek(0)
        return {"status": status, "stdout": out.getvalue(), "stderr": err.read().decode(errors="replace")}


if __name__ == "__main__":
    results = [run(args) for args in json.load(sys.stdin)]
    json.dump(results, sys.__stdout__)
