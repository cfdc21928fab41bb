"""specbuild runtime: load a specbuild bundle and decode speculatively. Needs onnxruntime, numpy, tokenizers; never torch."""

from importlib.util import find_spec

if find_spec("onnxruntime") is None:  # the package's extras choose it: onnxruntime and onnxruntime-gpu conflict
    raise ModuleNotFoundError("specbuild-runtime needs onnxruntime: pip install './runtime[cpu]', or './runtime[gpu]' "
                              "(onnxruntime-gpu) to run on CUDA")

from .decode import Generation, SpeculativeDecoder, Stats
from .errors import BundleError, DeviceError, RequestError, SpecbuildError
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
    "load_manifest",
]
