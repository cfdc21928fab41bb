"""specbuild runtime: load a specbuild bundle and decode speculatively. Needs onnxruntime, numpy, tokenizers; never torch."""

import os
from importlib import import_module

# onnxruntime's Linux wheels (1.32) send usage telemetry from the first session on, and print a warning where
# they cannot store a device id (a read-only HOME, as in many containers): a build step or an edge box should
# do neither unasked. Set before onnxruntime first loads; an ORT_DISABLE_TELEMETRY in the environment wins.
os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")

from typing import TYPE_CHECKING

from .errors import BundleError, DeviceError, RequestError, SpecbuildError

if TYPE_CHECKING:
    from .decode import Generation, SpeculativeDecoder, Stats
    from .logprobs import TokenLogprobs
    from .manifest import FORMAT_VERSION, Manifest, load_manifest

    __version__: str

__all__ = [
    "BundleError",
    "DeviceError",
    "FORMAT_VERSION",
    "Generation",
    "Manifest",
    "RequestError",
    "SpecbuildError",
    "SpeculativeDecoder",
    "Stats",
    "TokenLogprobs",
    "load_manifest",
]
# The module of each name loaded at its first use: the decoder's (numpy, onnxruntime: most of a second) and the
# manifest's (30 ms), so that the commands' entry points (serve/command.py) import this package in milliseconds,
# and a Ctrl-C while the rest loads is theirs to report.
_LAZY = {"Generation": "decode", "SpeculativeDecoder": "decode", "Stats": "decode", "TokenLogprobs": "logprobs",
         "FORMAT_VERSION": "manifest", "Manifest": "manifest", "load_manifest": "manifest", "runtime_version": "manifest"}


def __getattr__(name: str):
    if name == "__version__":
        value = __getattr__("runtime_version")()
    elif name in _LAZY:
        value = getattr(import_module(f".{_LAZY[name]}", __name__), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value
