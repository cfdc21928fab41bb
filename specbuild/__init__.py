"""specbuild: compile a draft/target pair of Hugging Face checkpoints into a speculative-decoding bundle."""

# The runtime first: importing it sets onnxruntime up (its telemetry) before a compiler module loads onnxruntime.
from specbuild_runtime import FORMAT_VERSION  # the bundle format this compiler writes

__version__ = "0.1.0"
__all__ = ["FORMAT_VERSION", "__version__"]
