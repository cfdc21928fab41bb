"""`specbuild chat`: a conversation at the terminal, as llama.cpp's `llama-cli -cnv` holds one. Each turn renders the
whole conversation with the bundle's chat template (as a client of serve's /v1/chat/completions resends it); the
decoder's prefix reuse finds the conversation so far in its slot's cache, so a turn computes little more than its own
tokens (docs/runtime.md, *Prefix reuse*)."""

from __future__ import annotations

import importlib
import io
import signal
import sys
import threading
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager, suppress

import click

from specbuild_runtime import Stats
from specbuild_runtime.errors import RequestError
from specbuild_runtime.slot import Halt

RESET, EXIT = "/reset", "/exit"


def load_template(decoder, supplied, instead: str):
    """The bundle's chat template (or the one supplied, --chat-template); without one, an error that ends in
    `instead`, what to do other than giving one."""
    from specbuild_runtime.manifest import TOKENIZER_DIR

    try:
        from specbuild_runtime.serve.chat import load_chat_template
    except ImportError as exc:  # jinja2, in the runtime's serve extra: an install, as serve's, not a command line
        raise click.ClickException(f"chat templates render with jinja2 ({exc}): pip install "
                                   "'specbuild-runtime[serve]'") from None
    template = load_chat_template(decoder.root / TOKENIZER_DIR, supplied)
    if template is None:  # what the bundle lacks, as a --gamma above its maximum (exit 1), not a malformed command line
        raise click.ClickException("this bundle's tokenizer has no chat template; give one with --chat-template"
                                   + instead)
    return template


class _Outgrown(Exception):
    """The rendered conversation is longer than the bundle's context."""


def converse(decoder, template, system: str | None, max_new_tokens: int, gamma,
             stats_line: Callable[[Stats], str] | None, **options) -> None:
    """Reads turns from stdin until /exit, end of input or Ctrl-C at the prompt, and streams each reply to stdout,
    each decoded with the request options given (sampling, stop strings: a stop string ends the reply, not the
    conversation); stats_line(stats), where given, is printed on stderr after each."""
    if sys.stdin is None:  # the shell closed it (`<&-`): Python has no stdin object at all
        raise click.UsageError("chat reads your turns from stdin, which is closed; run it on a terminal or pipe them "
                               "in")
    # Refuses what the bundle cannot do (a --gamma above its own, penalties it was compiled before) before a turn
    decoder.request([0], max_new_tokens, gamma, **options)
    opening = [{"role": "system", "content": system}] if system is not None else []
    if opening:  # told now rather than after the first turn is typed, where it would end the conversation
        _check_opening(decoder, template, opening, max_new_tokens)
    if isinstance(sys.stdin, io.TextIOWrapper):
        # A line that is not UTF-8 (a terminal set to Latin-1, a file in it) comes as lone surrogates, told and skipped
        # below, instead of a UnicodeDecodeError that ends the conversation as a bug in specbuild.
        sys.stdin.reconfigure(errors="surrogateescape")
    terminal = sys.stdin.isatty()
    if terminal:
        with suppress(ImportError):  # line editing and history for input(); Windows' Python has no readline
            importlib.import_module("readline")
        click.echo(f"{RESET} starts a new conversation, {EXIT} or Ctrl-D ends; Ctrl-C stops a reply", err=True)
    messages = list(opening)
    while True:
        try:
            line = input("> ") if terminal else sys.stdin.readline()
        except (EOFError, KeyboardInterrupt):
            if terminal:  # the shell's prompt on a line of its own
                click.echo()
            return
        if not terminal and not line:  # end of input
            return
        turn = line.rstrip("\r\n")
        if turn.strip() == EXIT:
            return
        if turn.strip() == RESET:
            messages = list(opening)
            click.echo("(new conversation)", err=True)
            continue
        if not turn.strip():
            continue
        try:
            turn.encode("utf-8")
        except UnicodeEncodeError:
            click.echo("(this turn was not sent: it is not valid UTF-8 text; set the terminal, or the file piped in, "
                       "to UTF-8)", err=True)
            continue
        try:
            prompt = _conversation_ids(decoder, template, [*messages, {"role": "user", "content": turn}],
                                       max_new_tokens)
        except _Outgrown:  # in a new conversation, /reset would change nothing
            fix = f"{RESET} starts a new one" if len(messages) > len(opening) else "shorten the turn"
            click.echo(f"(this turn was not sent: the conversation would be longer than the bundle's context of "
                       f"{decoder.max_seq_len} tokens; {fix})", err=True)
            continue
        except RequestError as exc:  # the template's own refusal (raise_exception) of what this turn holds
            click.echo(f"(this turn was not sent: {exc})", err=True)
            continue
        stats, request = Stats(), decoder.request(prompt, max_new_tokens, gamma, **options)
        reply = _reply(lambda halt: decoder.stream_request(request, stats, halt=halt))
        messages += [{"role": "user", "content": turn}, {"role": "assistant", "content": reply}]
        if stats_line:
            click.echo(stats_line(stats), err=True)
        if stats.finish_reason == "context":  # a reply cut short, told whether or not stats are shown
            click.echo(f"(the reply stopped where the conversation filled the bundle's context of "
                       f"{decoder.max_seq_len} tokens; {RESET} starts a new one)", err=True)


def _check_opening(decoder, template, opening: list[dict], max_new_tokens: int) -> None:
    """Refuses a --system message that no turn could follow: one the template rejects (Gemma's has no system role),
    or one that leaves no room in the context."""
    try:
        _conversation_ids(decoder, template, [*opening, {"role": "user", "content": "Hi"}], max_new_tokens)
    except _Outgrown:
        raise click.ClickException(f"--system leaves no room for a turn in the bundle's context of "
                                   f"{decoder.max_seq_len} tokens; shorten it") from None
    except RequestError as exc:
        raise click.ClickException(f"--system: {exc}; leave --system out, or give a chat template that takes a system "
                                   "message with --chat-template") from None


def _conversation_ids(decoder, template, messages: list[dict], max_new_tokens: int) -> list[int]:
    """The conversation rendered as the prompt of the assistant's next turn, as token ids; _Outgrown where it leaves
    no room in the context for a token of reply (refused before tokenizing where the text alone is too long)."""
    too_long = decoder.fits(max_new_tokens)

    def fits(text: str) -> None:
        try:
            too_long(text)
        except RequestError:  # told as a turn that does not fit, not as an error that ends the conversation
            raise _Outgrown from None

    ids = template.prompt_ids(decoder.tokenizer, messages, fits)
    if len(ids) > decoder.max_seq_len:
        raise _Outgrown
    return ids


def _reply(stream: Callable[[Halt], Generator[str, None, None]]) -> str:
    """Streams the reply's text, stream(halt)'s, to stdout and returns it (what was shown, where Ctrl-C stopped it)."""
    shown = []
    with _ctrl_c_presses() as presses:
        deltas = stream(presses)
        try:
            for delta in deltas:
                click.echo(delta, nl=False)
                shown.append(delta)
                if presses:
                    break
        except RequestError:  # the decoder halted between a long prompt's chunks: stopped before its next text
            if not presses:
                raise
        finally:  # a decode that fails mid-way: its error begins a line of its own
            deltas.close()  # aborts a reply Ctrl-C stopped: its slot is free, and its cache keeps what was decoded
            click.echo()
    return "".join(shown)


class _Presses(list):
    """Each Ctrl-C's signal number, and the decoder's halt (slot.Halt): it looks between a long prompt's chunks,
    which on a CPU take seconds before the reply's first text."""

    def is_set(self) -> bool:
        return bool(self)


@contextmanager
def _ctrl_c_presses() -> Iterator[_Presses]:
    """A list each Ctrl-C adds to, for the reply to stop at its next text or the prompt's next chunk, rather than a
    KeyboardInterrupt raised wherever the decoder is; a second Ctrl-C before then interrupts as usual. A list, not a
    threading.Event: the handler runs in the main thread between any two bytecodes, Event.set's own included, and a
    second Ctrl-C there would wait forever for the lock the first holds. The handler can only be set in the main
    thread, and one the process ignores stays ignored."""
    presses = _Presses()
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        yield presses
        return

    def interrupt(signum, frame):
        if presses:
            raise KeyboardInterrupt
        presses.append(signum)

    previous = signal.signal(signal.SIGINT, interrupt)
    try:
        yield presses
    finally:  # None: a handler set outside Python, which cannot be put back; the default is the nearest
        signal.signal(signal.SIGINT, signal.SIG_DFL if previous is None else previous)
