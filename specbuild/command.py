"""The `specbuild` command's entry point, light to import: the command line's module imports numpy,
onnxruntime and click (most of a second), and a Ctrl-C meanwhile printed a traceback and ended the process by
the signal (exit -2, or 1) instead of the one line and status 130 of a Ctrl-C anywhere later."""

from specbuild_runtime.serve.command import run_main


def main() -> None:
    run_main("specbuild.cli")
