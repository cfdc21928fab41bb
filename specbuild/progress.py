"""Progress on stderr: every phase that can take minutes on a large model shows that it is working. On a terminal,
a bar (a silent terminal reads as a hang). Elsewhere (a build log, a pipeline reading stderr's one-line errors) a
phase says nothing for its first LOG_EVERY seconds, then a plain line, what its bar would read, each LOG_EVERY seconds
while it runs: CI systems kill a job silent for 10 minutes (CircleCI, Travis), and on a CPU the TensorRT-LLM export's
α measurement took 170-360 s at 0.6B, bench at its defaults an hour, both silent in a log. A run of short phases
leaves a log as clean as before. The bars compile draws, its stages and each engine's bytes, follow the same rule."""

from __future__ import annotations

import sys
import threading
from contextlib import contextmanager, suppress
from contextvars import ContextVar
from typing import Iterator

from tqdm import tqdm

# Seconds between a phase's lines off a terminal: a log gets at most a line a minute from each phase, none from one of
# under a minute (each stage of docs/compile-at-scale.md's 0.6-1B compiles but the TensorRT-LLM export's α), and
# CI's 10 silent minutes are ten of them.
LOG_EVERY = 60.0
# A phase with no steps to count (note): 'text...' on a terminal.
NOTE = "{desc}..."

# What a caller asked for every bar beneath it (compile_bundle's show_progress): the phases deep inside a compile
# (its quality report, digests, TensorRT-LLM writes) drew their bars on a terminal after show_progress=False.
_shown: ContextVar[bool | None] = ContextVar("shown", default=None)


def count(n: int, noun: str) -> str:
    """'1 round', '2 rounds': a count in a line people read (the commands' summaries, bench's table); here, beside the
    other lines for people, where both the command line and bench (which it imports) reach it."""
    return f"{n} {noun}" + ("" if n == 1 else "s")


@contextmanager
def shown(show: bool | None) -> Iterator[None]:
    """Bars made inside, on this thread, follow show unless given their own (None: on a terminal only)."""
    token = _shown.set(show)
    try:
        yield
    finally:
        _shown.reset(token)


def _progress(show: bool | None, iterable=None, **options) -> tqdm:
    """A bar on a terminal, lines now and then elsewhere (show None), or as show says."""
    show = _shown.get() if show is None else show
    if show is None and not (hasattr(sys.stderr, "isatty") and sys.stderr.isatty()):
        return _Logged(iterable, leave=False, **options)
    return tqdm(iterable, leave=False, disable=None if show is None else not show, **options)


def bar(total: float | None, desc: str, unit: str = "it", show: bool | None = None, **options) -> tqdm:
    """A bar over countable steps (update() as each is done), gone when closed. show None: on a terminal, else in
    lines now and then (see above)."""
    return _progress(show, total=total, desc=desc, unit=unit, **options)


def steps(iterable, desc: str, unit: str = "it", show: bool | None = None) -> tqdm:
    """iterable, with a bar that advances as each item is taken."""
    return _progress(show, iterable, desc=desc, unit=unit)


@contextmanager
def note(text: str, show: bool | None = None) -> Iterator[None]:
    """'text...' for a phase with no steps to count (a model's load, one long call), cleared when it ends."""
    with _progress(show, total=None, desc=text, bar_format=NOTE):
        yield


class _Discarded:
    """Where a logged phase's bar is drawn: nowhere (its counts and times are kept by tqdm all the same)."""

    def write(self, text: str) -> None:
        pass

    def flush(self) -> None:
        pass


_WRITING = threading.Lock()  # one phase's line at a time: two phases' lines never run into each other


class _Logged(tqdm):
    """A phase off a terminal: counted as a bar, drawn nowhere, and every LOG_EVERY seconds while it is open one
    line on stderr, without the bar or carriage returns: 'writing target (fp16, none): 1.20GB [01:00, 20.0MB/s]'.
    Its thread costs 0.24 ms a phase to start and join (0.01 ms disabled), and counting 0.11 µs a step (medians of 7,
    A/B/A interleaved, load 3-4 on 2 cores; the two A runs 6% apart): nothing beside a phase worth a line."""

    monitor_interval = 0  # tqdm's monitor thread redraws slow bars; these draw nothing

    def __init__(self, iterable=None, **options):
        super().__init__(iterable, file=_Discarded(), **options)
        self._closed = threading.Event()
        self._lines = threading.Thread(target=self._write_lines, name="specbuild-progress", daemon=True)
        self._lines.start()

    def _write_lines(self) -> None:
        while not self._closed.wait(LOG_EVERY):
            meter = {**self.format_dict, "ncols": 0}  # tqdm's default line, without its bar
            # A note counts nothing: how long it has run is its news. A bar's own format (train's time bar) is kept
            # without its {bar}, where ncols 0 would write the default instead: train's seconds counted as steps
            # ("59.96891888400023/60.0 [01:00<00:00, 1.00s/it, loss=...]" in distill's log).
            own = meter["bar_format"]
            if own == NOTE:
                meter["bar_format"] = NOTE + " [{elapsed}]"
            elif own:
                meter.update(bar_format=own.replace("|{bar}|", ""), ncols=None)
            with _WRITING, suppress(OSError, ValueError):  # stderr closed or gone: the phase goes on unseen
                sys.stderr.write(tqdm.format_meter(**meter) + "\n")
                sys.stderr.flush()

    def close(self) -> None:
        """Ends the lines before the phase: none comes after it (nor after the error that ended it)."""
        if hasattr(self, "_lines"):  # tqdm's __del__ closes a bar whose __init__ raised, before the thread was made
            self._closed.set()
            self._lines.join()
        super().close()
