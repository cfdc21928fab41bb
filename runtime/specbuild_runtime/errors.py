"""Errors written for the person at the terminal: what went wrong, where, and what to do."""


class SpecbuildError(Exception):
    """Base of every error specbuild reports without a traceback."""


class BundleError(SpecbuildError):
    """A bundle is missing, corrupted, edited, or from an incompatible format version; or its fp16 engine
    overflows while decoding (NaN or infinite logits: see decode.SpeculativeDecoder._not_finite)."""


class RequestError(SpecbuildError, ValueError):
    """A generation request cannot be served (e.g. the prompt does not fit the context). Also a ValueError,
    so a service's handler of bad arguments catches it as it catches others."""


class DeviceError(SpecbuildError):
    """The device asked for is unknown, this onnxruntime cannot run on it, or an engine call failed on it
    (e.g. out of memory); or the process's onnxruntime refuses the engines' sessions (see engine._session)."""


def first_line(exc: BaseException) -> str:
    """What a library's exception says, in one line (its type when it says nothing): libraries such as
    onnxruntime raise untyped errors with pages of detail, which a one-line error quotes from."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
