"""The compiler's errors. They extend the runtime's SpecbuildError, so the CLI reports every one of them
the same way: one line, no traceback (`specbuild --debug` shows it)."""

from specbuild_runtime.errors import SpecbuildError


class CheckpointError(SpecbuildError):
    """A Hugging Face checkpoint folder cannot be used as given."""


class UnsupportedModelError(CheckpointError):
    """The checkpoint's architecture or one of its settings has no graph builder."""


class PairMismatchError(CheckpointError):
    """The draft and the target cannot be paired (different tokenizers)."""


class OutputError(SpecbuildError):
    """An output folder cannot be written as asked (it holds something else, is an input, is locked, or
    the disk is full); nothing at the output path was changed."""


class SettingsError(SpecbuildError):
    """A compile setting (a recipe value, an option given through the API) is invalid; key names the setting at
    fault where one is (a recipe's error then names its line)."""

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key


class MissingSettingsError(SettingsError):
    """A compile lacks a required setting (the CLI: a usage error when no recipe was given)."""


class ExternalToolError(SpecbuildError):
    """A tool the compiler runs (trtllm-build) failed."""


class TrainingError(SpecbuildError):
    """Distillation or the demo pair cannot go on with the data or settings given."""
