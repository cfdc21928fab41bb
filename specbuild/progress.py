"""Progress on stderr, on a terminal only: every phase that can take minutes on a large model shows that it
is working (a silent terminal reads as a hang), while build logs and pipelines, which read stderr's
one-line errors, get nothing (tqdm's disable=None: off unless stderr is a terminal). The bars compile
draws, its stages and each engine's bytes, follow the same rule."""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator

from tqdm import tqdm

# What a caller asked for every bar beneath it (compile_bundle's show_progress): the phases deep inside a compile
# (its quality report, digests, TensorRT-LLM writes) drew their bars on a terminal after show_progress=False.
_shown: ContextVar[bool | None] = ContextVar("shown", default=None)


@contextmanager
def shown(show: bool | None) -> Iterator[None]:
    """Bars made inside, on this thread, follow show unless given their own (None: on a terminal only)."""
    token = _shown.set(show)
    try:
        yield
    finally:
        _shown.reset(token)


def _disable(show: bool | None) -> bool | None:
    show = _shown.get() if show is None else show
    return None if show is None else not show


def bar(total: float | None, desc: str, unit: str = "it", show: bool | None = None, **options) -> tqdm:
    """A bar over countable steps (update() as each is done), gone when closed. show None: on a terminal only."""
    return tqdm(total=total, desc=desc, unit=unit, leave=False, disable=_disable(show), **options)


def steps(iterable, desc: str, unit: str = "it", show: bool | None = None) -> tqdm:
    """iterable, with a bar that advances as each item is taken."""
    return tqdm(iterable, desc=desc, unit=unit, leave=False, disable=_disable(show))


@contextmanager
def note(text: str, show: bool | None = None) -> Iterator[None]:
    """'text...' for a phase with no steps to count (a model's load, one long call), cleared when it ends."""
    with tqdm(total=None, desc=text, bar_format="{desc}...", leave=False, disable=_disable(show)):
        yield
