"""Errors written for the person at the terminal: what went wrong, where, and what to do."""


class SpecbuildError(Exception):
    """Base of every error specbuild reports without a traceback."""


class BundleError(SpecbuildError):
    """A bundle is missing, corrupted or from an incompatible format version."""


class CheckpointError(SpecbuildError):
    """A Hugging Face checkpoint folder cannot be used as given."""


class UnsupportedModelError(CheckpointError):
    """The checkpoint's architecture or one of its settings has no graph builder."""


class PairMismatchError(CheckpointError):
    """The draft and the target cannot be paired (different tokenizers)."""


class RequestError(SpecbuildError):
    """A generation request cannot be served (e.g. the prompt does not fit the context)."""
