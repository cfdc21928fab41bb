"""Sliding windows, which TensorRT-LLM takes at run time, not from the checkpoint: the longest context they leave
the export (window_limit), and the per-layer list run.sh gives both engines (attention_windows)."""

from __future__ import annotations

from ...errors import UnsupportedModelError
from ..load import Checkpoint


def sliding_window(ckpt: Checkpoint) -> int | None:
    """The shortest window of ckpt's layers (None: none), the longest context the export takes: TensorRT-LLM takes
    sliding windows at run time (max_attention_window_size), not from the checkpoint."""
    return min((w for w in ckpt.spec.sliding_windows if w), default=None)


def attention_windows(target: Checkpoint, draft: Checkpoint, max_seq_len: int) -> list[int] | None:
    """run.sh's --max_attention_window_size, the positions each layer attends to (None: the whole context at every
    layer). TensorRT-LLM takes a layer's window at run time, not from the checkpoint; a list shorter than the layers
    repeats over them (the executor's KvCacheConfig max_attention_window), and run.py gives both engines the same
    list (examples/ngram/run_dtm_ngram.py common_runner_kwargs, 77bcb5a5): the shortest list whose repetition is
    both models' layers, refused where none is."""
    per = [[min(w or max_seq_len, max_seq_len) for w in ckpt.spec.sliding_windows] for ckpt in (target, draft)]
    if all(w == max_seq_len for windows in per for w in windows):
        return None
    both = _cycle(*per)
    if both is None:
        raise UnsupportedModelError(f"max_seq_len {max_seq_len} goes past the sliding windows of a pair whose layers "
                                    f"window differently (the target's cycle {_cycle(per[0])}, the draft's "
                                    f"{_cycle(per[1])}), where run.py gives both TensorRT-LLM engines one "
                                    "--max_attention_window_size list; give --max-seq-len (or a recipe's max_seq_len) "
                                    f"of {min(min(windows) for windows in per)} or less for the TensorRT-LLM export")
    return both


def _cycle(*models: list[int]) -> list[int] | None:
    """The shortest list whose repetition is every model's per-layer windows (None: none is)."""
    cycles = [windows[:n] for windows in models for n in range(1, len(windows) + 1)]
    fitting = (cycle for cycle in cycles if all(w == cycle[i % len(cycle)] for ws in models for i, w in enumerate(ws)))
    return min(fitting, key=len, default=None)


def window_limit(target: Checkpoint, draft: Checkpoint) -> int | None:
    """The longest context the export takes (None: any): the shortest window, unless run.sh carries the pair's
    windows, as for a Gemma 3 pair that one list windows (attention_windows)."""
    windows = [window for ckpt in (target, draft) if (window := sliding_window(ckpt))]
    if not windows:
        return None
    past = max(windows) + 1
    carried = all(ckpt.spec.architecture == "Gemma3ForCausalLM" for ckpt in (target, draft)) and _cycle(
        *([min(w or past, past) for w in ckpt.spec.sliding_windows] for ckpt in (target, draft))) is not None
    return None if carried else min(windows)
