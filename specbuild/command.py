"""The `specbuild` command's entry point, light to import: the command line's module imports numpy,
onnxruntime and click (most of a second), and a Ctrl-C meanwhile printed a traceback and ended the process by
the signal (exit -2, or 1) instead of the one line and status 130 of a Ctrl-C anywhere later."""

import sys


def main() -> None:
    try:
        from .cli import main as run
    except KeyboardInterrupt:
        sys.stderr.write("error: interrupted\n")
        sys.exit(130)
    run()
