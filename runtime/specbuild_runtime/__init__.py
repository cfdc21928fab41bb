"""specbuild runtime: load a specbuild bundle and decode speculatively. Needs onnxruntime, numpy, tokenizers; never torch."""

import os
from importlib.util import find_spec

# onnxruntime's Linux wheels (1.32) send usage telemetry from the first session on, and print a warning where
# they cannot store a device id (a read-only HOME, as in many containers): a build step or an edge box should
# do neither unasked. Set before onnxruntime first loads; an ORT_DISABLE_TELEMETRY in the environment wins.
os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")

if find_spec("onnxruntime") is None:  # the package's extras choose it: onnxruntime and onnxruntime-gpu conflict
    raise ModuleNotFoundError("specbuild-runtime needs onnxruntime: pip install './runtime[cpu]', or './runtime[gpu]' "
                              "(onnxruntime-gpu) to run on CUDA")

from .decode import Generation, SpeculativeDecoder, Stats
from .errors import BundleError, DeviceError, RequestError, SpecbuildError
from .logprobs import TokenLogprobs
from .manifest import FORMAT_VERSION, Manifest, load_manifest, runtime_version

__version__ = runtime_version()

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
