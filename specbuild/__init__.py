"""specbuild: compile a draft/target pair of Hugging Face checkpoints into a speculative-decoding bundle."""

__version__ = "0.1.0"
