"""The compiler's errors. They extend the runtime's SpecbuildError, so the CLI reports every one of them
the same way: one line, no traceback (`specbuild --debug` shows it)."""

from specbuild_runtime.errors import SpecbuildError


class CheckpointError(SpecbuildError):
    """A Hugging Face checkpoint folder cannot be used as given."""


class UnsupportedModelError(CheckpointError):
    """The checkpoint's architecture or one of its settings has no graph builder."""


class PairMismatchError(CheckpointError):
    """The draft and the target cannot be paired (different tokenizers)."""


class TrainingError(SpecbuildError):
    """Distillation or the demo pair cannot go on with the data or settings given."""
