"""specbuild/progress.py off a terminal: a phase longer than LOG_EVERY writes a plain line now and then, so that a CI
job is not killed as silent (CircleCI and Travis kill one after 10 minutes); a short one writes nothing. On a terminal
the bars are the commands' own tests' (test_every_phase_of_..._shows_progress_on_a_terminal)."""

import re
import sys
import threading

import pytest

from specbuild import progress


class Log:
    """stderr as a build log sees it: no terminal. wrote is set by each write, for a test to wait on a line (the
    phase's minute, LOG_EVERY, made a hundredth of a second) rather than sleep for one."""

    def __init__(self):
        self.text = ""
        self.wrote = threading.Event()

    def write(self, text: str) -> int:
        self.text += text
        self.wrote.set()
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


def as_a_log(monkeypatch, every: float = 0.01) -> Log:
    """stderr as a log for the rest of the test, a phase's lines every `every` seconds. Called in the test's body:
    pytest's capture sets sys.stderr again between a fixture and its test."""
    log = Log()
    monkeypatch.setattr(sys, "stderr", log)
    monkeypatch.setattr(progress, "LOG_EVERY", every)
    return log


def lines_of(log: Log) -> list[str]:
    assert log.text.endswith("\n") and "\r" not in log.text, repr(log.text)  # no bar redrawn in place
    return log.text.splitlines()


def test_a_long_phase_off_a_terminal_writes_what_its_bar_reads_as_plain_lines(monkeypatch):
    log = as_a_log(monkeypatch)
    with progress.bar(8, "measuring α for γ", "prompt", initial=3):
        assert log.wrote.wait(timeout=60)
    assert all(line.startswith("measuring α for γ:  38% 3/8 [") and "prompt/s]" in line for line in lines_of(log))


def test_a_time_bar_off_a_terminal_writes_its_own_format_without_the_bar_not_seconds_as_steps(monkeypatch):
    """distill's log read 'distill: 100% 59.96891888400023/60.0 [01:00<00:00, 1.00s/it, loss=0.002]'."""
    from specbuild.train.train import time_bar

    log = as_a_log(monkeypatch)
    with time_bar(60.0, "distill") as bar:
        bar.update(29.96891888400023)
        bar.set_postfix(loss=0.002)
        assert log.wrote.wait(timeout=60)
    line = r"distill:  50% \d\d:\d\d<\d\d:\d\d, loss=0\.002"
    assert all(re.fullmatch(line, text) for text in lines_of(log)), log.text


def test_a_long_phase_with_no_steps_off_a_terminal_writes_how_long_it_has_run(monkeypatch):
    log = as_a_log(monkeypatch)
    with progress.note("loading the pair in transformers"):
        assert log.wrote.wait(timeout=60)
    assert all(re.fullmatch(r"loading the pair in transformers\.\.\. \[\d\d:\d\d\]", line) for line in lines_of(log))


def test_a_phases_lines_end_with_it_before_the_error_that_ended_it(monkeypatch):
    """The error line a pipeline reads is stderr's last: no line of the phase comes after it."""
    log = as_a_log(monkeypatch)
    with pytest.raises(KeyError):
        for _ in progress.steps(range(2), "decoding with the bundle", "prompt"):
            assert log.wrote.wait(timeout=60)
            raise KeyError("the phase failed")
    assert not [thread for thread in threading.enumerate() if thread.name == "specbuild-progress"]


def test_a_phase_shorter_than_a_minute_writes_nothing_off_a_terminal(monkeypatch):
    log = as_a_log(monkeypatch, progress.LOG_EVERY)
    with progress.note("loading the bundle"):
        pass
    for _ in progress.steps(range(3), "decoding", "prompt"):
        pass
    assert log.text == ""


def test_progress_asked_off_is_off_everywhere(monkeypatch):
    """compile_bundle(show_progress=False): no bar on a terminal, no line in a log."""
    log = as_a_log(monkeypatch)
    with progress.shown(False), progress.note("checking each engine"):
        assert not [thread for thread in threading.enumerate() if thread.name == "specbuild-progress"]
    assert log.text == ""
