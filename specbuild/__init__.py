"""specbuild: compile a draft/target pair of Hugging Face checkpoints into a speculative-decoding bundle."""

__version__ = "0.1.0"

import specbuild_runtime  # noqa: E402,F401  first: it sets onnxruntime up before a compiler module loads it
