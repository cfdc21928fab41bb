"""The compiler: load & validate -> build graphs -> quantize/precision -> verify -> write bundle."""

from .pipeline import compile_bundle

__all__ = ["compile_bundle"]
