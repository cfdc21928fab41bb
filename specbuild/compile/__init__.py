"""The compiler: load & validate -> write each engine, streaming its weights (graph, precision or
quantization, one tensor at a time) -> measure quantized engines -> check each engine -> write bundle."""

from .pipeline import compile_bundle

__all__ = ["compile_bundle"]
