"""`specbuild bench`: speculative vs target-only decoding and peers, side by side in one process."""

from .bench import bench, format_table, plot, run_ours

__all__ = ["bench", "format_table", "plot", "run_ours"]
