"""`specbuild-serve`'s entry point, and the guard `specbuild`'s (specbuild/command.py) shares: light to import, so
that a Ctrl-C while the command's modules load (numpy, onnxruntime, click: most of a second) is one line and status
130, as anywhere later, not a traceback and the process ended by the signal."""

from __future__ import annotations

import importlib
import sys


def interrupted(exc: BaseException | None) -> bool:
    """Whether exc is a Ctrl-C or rose from one: an extension module whose loading a KeyboardInterrupt stopped
    (pybind11's, as onnxruntime's) raises ImportError("initialization failed") from it."""
    while exc is not None:
        if isinstance(exc, KeyboardInterrupt):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def run_main(module: str) -> None:
    """Import `module` and call its main(), reporting a Ctrl-C during the import as main() reports one later."""
    try:
        # numpy first: onnxruntime's extension imports it from C, which prints a Ctrl-C there as a traceback of its
        # own and raises ImportError("import numpy failed") with nothing to tell it from a broken install.
        importlib.import_module("numpy")
        main_of = importlib.import_module(module).main
    except ModuleNotFoundError as exc:
        # Installed without the cpu or gpu extra (they pick onnxruntime or onnxruntime-gpu): engine.py's message says
        # in one line which to install, a traceback would only bury it.
        if exc.name != "onnxruntime":
            raise
        sys.exit(f"error: {exc}")
    except BaseException as exc:
        if not interrupted(exc):
            raise
        sys.stderr.write("error: interrupted\n")
        sys.exit(130)
    main_of()


def main() -> None:
    run_main("specbuild_runtime.serve.cli")
