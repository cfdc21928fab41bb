"""specbuild runtime: load a specbuild bundle and decode speculatively. Needs onnxruntime, numpy, tokenizers; never torch."""

from .decode import Generation, SpeculativeDecoder, Stats
from .errors import BundleError, DeviceError, RequestError, SpecbuildError
from .manifest import Manifest, load_manifest

__all__ = [
    "BundleError",
    "DeviceError",
    "Generation",
    "Manifest",
    "RequestError",
    "SpecbuildError",
    "SpeculativeDecoder",
    "Stats",
    "load_manifest",
]
