"""The `specbuild` command's entry point, light to import: the command line's module imports numpy,
onnxruntime and click (most of a second), and a Ctrl-C meanwhile printed a traceback and ended the process by
the signal (exit -2, or 1) instead of the one line and status 130 of a Ctrl-C anywhere later."""

import sys


def main() -> None:
    try:
        from specbuild_runtime.serve.command import run_main
    except ModuleNotFoundError as exc:
        # Installed without the cpu or gpu extra (pyproject.toml: they pick onnxruntime or onnxruntime-gpu): the
        # runtime's import says in one line which to install, a traceback would only bury it.
        if exc.name != "onnxruntime":
            raise
        sys.exit(f"error: {exc}")
    run_main("specbuild.cli")
