"""specbuild: compile a draft/target pair of Hugging Face checkpoints into a speculative-decoding bundle."""

import os

# As the runtime's import does (specbuild_runtime/__init__.py says why), before any compiler module loads
# onnxruntime: this package is imported without the runtime, so that the command's entry point is light
# (specbuild/command.py).
os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")

__version__ = "0.1.0"
__all__ = ["FORMAT_VERSION", "__version__"]


def __getattr__(name: str):
    if name == "FORMAT_VERSION":  # the bundle format this compiler writes
        from specbuild_runtime import FORMAT_VERSION

        return FORMAT_VERSION
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
