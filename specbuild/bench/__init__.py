"""`specbuild bench`: speculative vs target-only decoding and peers, side by side in one process."""
