"""`specbuild chat`: turns read from stdin, each rendered with the whole conversation before it, replies streamed.

The tiny llama pair has no chat template of its own: --chat-template gives one, as a user of such a bundle would."""

from __future__ import annotations

import io
import os
import pty
import re
import shutil
import signal
import subprocess
import sys

import pytest
from click.testing import CliRunner

TEMPLATE = ("{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] | trim }}\n"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
N = 12  # tokens a reply


@pytest.fixture(scope="module")
def bundle(bundles):
    return bundles("llama", 1)


@pytest.fixture(scope="module")
def reference(bundle):
    """reply(messages, n): what the decoder alone, in a fresh slot, answers the conversation with; ids(messages)."""
    from specbuild_runtime import SpeculativeDecoder
    from specbuild_runtime.manifest import TOKENIZER_DIR
    from specbuild_runtime.serve.chat import load_chat_template, supplied_chat_template

    decoder = SpeculativeDecoder(bundle, prefix_reuse=False)
    template = load_chat_template(bundle / TOKENIZER_DIR, supplied_chat_template(TEMPLATE))

    class Reference:
        @staticmethod
        def ids(messages):
            return template.prompt_ids(decoder.tokenizer, messages)

        @staticmethod
        def generation(messages, n=N, **options):
            return decoder.generate(template.prompt_ids(decoder.tokenizer, messages), n, **options)

        @staticmethod
        def replies(turns, **options):
            """The reply to each turn, each rendered after the turns and replies before it."""
            messages, replies = [], []
            for turn in turns:
                messages.append(user(turn))
                replies.append(Reference.generation(messages, **options).text)
                messages.append(assistant(replies[-1]))
            return replies

    return Reference


def chat(bundle, turns, *options, n=N):
    from specbuild.cli import cli

    return CliRunner().invoke(cli, ["chat", str(bundle), "--chat-template", TEMPLATE, "-n", str(n), *options],
                              input=turns)


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def flags(options: dict) -> list[str]:
    """The command line's flags for the decoder's options (a list: the flag repeated)."""
    return [f"--{name.replace('_', '-')}={each}" for name, value in options.items()
            for each in (value if isinstance(value, list) else [value])]


def prompts(stderr: str) -> list[tuple[int, int]]:
    """(prompt tokens, of them cached) of each --stats line."""
    return [(int(total), int(cached)) for total, cached in re.findall(r"^prompt (\d+) tokens \((\d+) cached\)", stderr,
                                                                      re.MULTILINE)]


def test_each_turn_renders_the_whole_conversation_and_finds_the_turns_before_in_the_cache(bundle, reference):
    result = chat(bundle, "Write fib\nnow in C\n", "--stats")
    assert result.exit_code == 0, result.output
    first = reference.generation([user("Write fib")]).text
    second = reference.generation([user("Write fib"), assistant(first), user("now in C")]).text
    assert result.stdout == f"{first}\n{second}\n"
    (first_prompt, none), (second_prompt, cached) = prompts(result.stderr)
    assert none == 0 and first_prompt == len(reference.ids([user("Write fib")]))
    assert first_prompt <= cached < second_prompt, result.stderr


def test_reset_starts_a_new_conversation(bundle, reference):
    result = chat(bundle, "Write fib\n/reset\nWrite fib\n", "--stats")
    assert result.exit_code == 0, result.output
    first = reference.generation([user("Write fib")]).text
    assert result.stdout == f"{first}\n{first}\n"
    assert "(new conversation)" in result.stderr
    (first_prompt, _), (again, _) = prompts(result.stderr)
    assert again == first_prompt


def test_the_system_message_opens_the_conversation_and_survives_reset(bundle, reference):
    result = chat(bundle, "Write fib\n/reset\nWrite fib\n", "--system", "Be brief.")
    assert result.exit_code == 0, result.output
    first = reference.generation([{"role": "system", "content": "Be brief."}, user("Write fib")]).text
    assert result.stdout == f"{first}\n{first}\n"


@pytest.mark.parametrize("option, others", [
    (dict(repetition_penalty=1.4), {}), (dict(presence_penalty=2.0), {}), (dict(frequency_penalty=-2.0), {}),
    (dict(min_p=0.5), dict(temperature=1.5, seed=2)),
], ids=["repetition-penalty", "presence-penalty", "frequency-penalty", "min-p"])
def test_generates_sampling_options_decode_every_reply_as_the_decoder_given_them(bundle, reference, option, others):
    """Each reply is the decoder's own, given the option, on the conversation rendered so far; and the option bites
    (without it the replies differ), so that one left out of the request would be seen."""
    expected = reference.replies(["Write fib", "now in C"], **others, **option)
    assert expected != reference.replies(["Write fib", "now in C"], **others)
    result = chat(bundle, "Write fib\nnow in C\n", *flags({**others, **option}))
    assert result.exit_code == 0, result.output
    assert result.stdout == "".join(f"{reply}\n" for reply in expected)


def test_a_stop_string_ends_the_reply_and_the_conversation_goes_on_with_the_reply_it_ended(bundle, reference):
    full = reference.generation([user("Write fib")]).text
    stop = full[len(full) // 2:len(full) // 2 + 2]
    expected = reference.replies(["Write fib", "now in C"], stop=[stop, "never there"])
    assert stop not in expected[0] and len(expected[0]) < len(full)
    result = chat(bundle, "Write fib\nnow in C\n", "--stop", stop, "--stop", "never there")
    assert result.exit_code == 0 and result.stderr == "", result.output
    assert result.stdout == f"{expected[0]}\n{expected[1]}\n"


def test_min_tokens_keeps_a_stop_string_from_ending_a_reply_before_that_many_tokens(bundle, reference):
    stop = reference.generation([user("Write fib")]).text[1:2]  # without --min-tokens, it ends the first reply at once
    expected = reference.replies(["Write fib", "now in C"], stop=[stop], min_tokens=6)
    assert expected != reference.replies(["Write fib", "now in C"], stop=[stop])
    result = chat(bundle, "Write fib\nnow in C\n", "--stop", stop, "--min-tokens", "6")
    assert result.exit_code == 0, result.output
    assert result.stdout == f"{expected[0]}\n{expected[1]}\n"


@pytest.mark.parametrize("options, says", [
    (["--min-p", "0.5"], "--min-p applies to sampling: give --temperature too"),
    (["--repetition-penalty", "0"], "'--repetition-penalty': 0.0 is not in the range x>0"),
    (["--presence-penalty", "2.5"], "'--presence-penalty': 2.5 is not in the range -2<=x<=2"),
    (["--frequency-penalty=-3"], "'--frequency-penalty': -3.0 is not in the range -2<=x<=2"),
    (["--min-tokens", "13"], f"--min-tokens 13 is above --max-new-tokens {N}"),
    (["--stop", ""], "must not be empty"),
], ids=["min-p-greedy", "repetition-penalty", "presence-penalty", "frequency-penalty", "min-tokens", "stop"])
def test_a_bad_sampling_or_stop_option_is_a_malformed_command_line_refused_before_a_turn(bundle, options, says):
    result = chat(bundle, "Write fib\n", *options)
    assert result.exit_code == 2 and says in result.stderr and result.stdout == "", result.output


def test_penalties_a_bundle_was_compiled_before_are_refused_before_a_turn(bundle, tmp_path):
    from conftest import compiled_before_penalties
    from specbuild_runtime.errors import RequestError

    before = compiled_before_penalties(shutil.copytree(bundle, tmp_path / "before-penalties"))
    result = chat(before, "Write fib\n", "--repetition-penalty", "1.2")  # main() makes it one line, exit 1
    assert isinstance(result.exception, RequestError) and result.stdout == "", result.output
    assert "repetition_penalty needs a bundle compiled with sampling penalties" in str(result.exception)


def test_a_system_message_the_template_refuses_ends_the_command_before_a_turn(bundle):
    refusing = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
                + TEMPLATE)
    result = chat(bundle, "Write fib\n", "--system", "Be brief.", "--chat-template", refusing)
    assert result.exit_code == 1, result.output
    assert result.stderr.startswith("Error: --system: the chat template rejected the messages: System role not "
                                    "supported; leave --system out"), result.stderr


def test_a_system_message_that_is_not_utf8_is_a_malformed_command_line(bundle):
    result = chat(bundle, "Write fib\n", "--system", "caf\udce9")  # as Python passes an undecodable argument on
    assert result.exit_code == 2 and "'--system': is not valid UTF-8 text" in result.stderr, result.output


def test_a_system_message_the_context_cannot_hold_ends_the_command_before_a_turn(bundle):
    result = chat(bundle, "Write fib\n", "--system", " ".join(["word"] * 300))
    assert result.exit_code == 1, result.output
    assert result.stderr == ("Error: --system leaves no room for a turn in the bundle's context of 256 tokens; "
                             "shorten it\n")


def test_a_turn_the_template_refuses_is_not_sent_and_the_conversation_goes_on(bundle, reference):
    refusing = ("{% if 'secret' in messages[-1]['content'] %}{{ raise_exception('no secrets') }}{% endif %}"
                + TEMPLATE)
    result = chat(bundle, "a secret\nWrite fib\n", "--chat-template", refusing)
    assert result.exit_code == 0, result.output
    assert result.stderr == "(this turn was not sent: the chat template rejected the messages: no secrets)\n"
    assert result.stdout == reference.generation([user("Write fib")]).text + "\n"


def test_a_turn_the_context_cannot_hold_is_not_sent_and_says_to_reset(bundle, reference):
    long = " ".join(["word"] * 60)
    assert len(reference.ids([user(long)])) + N < 256 < 2 * len(reference.ids([user(long)]))  # the bundle's context
    result = chat(bundle, f"{long}\n{long}\n/reset\nWrite fib\n")
    assert result.exit_code == 0, result.output
    lines = result.stderr.splitlines()
    assert lines == ["(this turn was not sent: the conversation would be longer than the bundle's context of 256 "
                     "tokens; /reset starts a new one)", "(new conversation)"], result.stderr
    replies = [reference.generation([user(text)]).text for text in (long, "Write fib")]
    assert result.stdout == f"{replies[0]}\n{replies[1]}\n"


def test_a_first_turn_the_context_cannot_hold_says_to_shorten_it(bundle, reference):
    result = chat(bundle, " ".join(["word"] * 300) + "\nWrite fib\n")
    assert result.exit_code == 0, result.output
    assert result.stderr == ("(this turn was not sent: the conversation would be longer than the bundle's context of "
                             "256 tokens; shorten the turn)\n")
    assert result.stdout == reference.generation([user("Write fib")]).text + "\n"


def test_a_reply_the_context_cuts_short_says_so(bundle, reference):
    long = " ".join(["word"] * 60)
    expected = reference.generation([user(long)], 256)
    assert expected.stats.finish_reason == "context"  # the reply would run past the context: it stops there
    result = chat(bundle, f"{long}\n", n=256)
    assert result.exit_code == 0, result.output
    assert result.stdout == expected.text + "\n"
    assert result.stderr == ("(the reply stopped where the conversation filled the bundle's context of 256 tokens; "
                             "/reset starts a new one)\n")


@pytest.mark.parametrize("turns", ["", "Write fib", "Write fib\n/exit\nnow in C\n"],
                         ids=["nothing", "no-newline", "exit"])
def test_end_of_input_or_exit_ends_the_conversation_with_status_0(bundle, reference, turns):
    result = chat(bundle, turns)
    assert result.exit_code == 0 and result.stderr == "", result.output
    assert result.stdout == ("" if not turns else reference.generation([user("Write fib")]).text + "\n")


def test_a_turn_that_is_not_utf8_is_not_sent_and_the_conversation_goes_on(bundle, reference):
    result = chat(bundle, b"caf\xe9\nWrite fib\n")
    assert result.exit_code == 0, result.output
    assert result.stderr == ("(this turn was not sent: it is not valid UTF-8 text; set the terminal, or the file piped "
                             "in, to UTF-8)\n")
    assert result.stdout == reference.generation([user("Write fib")]).text + "\n"


def test_empty_and_blank_lines_are_no_turns(bundle, reference):
    result = chat(bundle, "\n  \t\nWrite fib\n\n")
    assert result.exit_code == 0 and result.stderr == "", result.output
    assert result.stdout == reference.generation([user("Write fib")]).text + "\n"


def test_ctrl_c_during_a_reply_stops_it_and_keeps_what_was_shown(bundle, reference, monkeypatch):
    """As llama-cli: the reply stops, the conversation goes on with it as far as it was shown."""
    from specbuild_runtime import SpeculativeDecoder

    stream_request = SpeculativeDecoder.stream_request

    def interrupted_after_the_first_text(self, *args, **kwargs):
        deltas = stream_request(self, *args, **kwargs)
        if interrupted:
            yield from deltas
            return
        interrupted.append(True)
        yield next(deltas)
        signal.raise_signal(signal.SIGINT)  # its handler runs before raise_signal returns
        yield from deltas

    interrupted: list[bool] = []
    monkeypatch.setattr(SpeculativeDecoder, "stream_request", interrupted_after_the_first_text)
    handler = signal.getsignal(signal.SIGINT)
    result = chat(bundle, "Write fib\nnow in C\n", "--stats")
    assert result.exit_code == 0, result.output
    shown = result.stdout.split("\n")[0]
    full = reference.generation([user("Write fib")]).text
    assert shown and full.startswith(shown) and len(shown) < len(full)
    second = reference.generation([user("Write fib"), assistant(shown), user("now in C")]).text
    assert result.stdout == f"{shown}\n{second}\n"
    assert interrupted and signal.getsignal(signal.SIGINT) is handler  # put back


def test_ctrl_c_during_a_long_prompts_prefill_stops_the_turn_before_its_next_chunk(bundle, reference, monkeypatch):
    """A long conversation or a pasted text on a CPU is seconds of prefill in chunks (slot.PREFILL_CHUNK) before the
    reply's first text, where Ctrl-C acted: it stops the turn before the next chunk, as a reply stopped before its
    text (the slot free, its cache keeping the chunk computed, the turn in the conversation with an empty reply)."""
    from specbuild_runtime import slot

    chunk, calls, compute_rows = 16, [], slot.EngineSlot._compute_rows

    def interrupted_after_the_first_chunk(self, first, total_len, *args, **kwargs):
        calls.append((first, total_len))
        result = compute_rows(self, first, total_len, *args, **kwargs)
        if len(calls) == 1:
            signal.raise_signal(signal.SIGINT)  # its handler runs before raise_signal returns
        return result

    monkeypatch.setattr(slot, "PREFILL_CHUNK", chunk)
    monkeypatch.setattr(slot.EngineSlot, "_compute_rows", interrupted_after_the_first_chunk)
    pasted = " ".join(["word"] * 40)
    handler = signal.getsignal(signal.SIGINT)
    result = chat(bundle, f"{pasted}\nnow in C\n", "--stats")
    assert result.exit_code == 0, result.output
    assert calls[0] == (0, chunk) and len(reference.ids([user(pasted)])) > 3 * chunk
    second = reference.generation([user(pasted), assistant(""), user("now in C")]).text
    assert result.stdout == f"\n{second}\n"
    (first_prompt, none), (_, cached) = prompts(result.stderr)
    assert none == 0 and cached == chunk, result.stderr  # the next turn found the one chunk computed, and nothing more
    assert signal.getsignal(signal.SIGINT) is handler


def test_a_second_ctrl_c_during_a_reply_interrupts_the_command_and_puts_the_handler_back(bundle, monkeypatch):
    from specbuild.cli import cli
    from specbuild_runtime import SpeculativeDecoder

    stream_request = SpeculativeDecoder.stream_request

    def interrupted_twice(self, *args, **kwargs):
        deltas = stream_request(self, *args, **kwargs)
        yield next(deltas)
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)  # before the reply's next text: the first has not stopped it yet
        yield from deltas

    monkeypatch.setattr(SpeculativeDecoder, "stream_request", interrupted_twice)
    handler = signal.getsignal(signal.SIGINT)
    result = CliRunner().invoke(cli, ["chat", str(bundle), "--chat-template", TEMPLATE], input="Write fib\nnow in C\n",
                                standalone_mode=False)
    # click's Abort from the KeyboardInterrupt: run_command's exit 130, "interrupted"; the second turn never ran
    assert isinstance(result.exception.__cause__, KeyboardInterrupt) and result.stdout.count("\n") == 1, result.output
    assert signal.getsignal(signal.SIGINT) is handler


def test_a_reply_that_fails_puts_the_ctrl_c_handler_back(bundle, monkeypatch):
    from specbuild_runtime import SpeculativeDecoder

    def failing(self, *args, **kwargs):
        yield "x"
        raise RuntimeError("the engine failed")

    monkeypatch.setattr(SpeculativeDecoder, "stream_request", failing)
    handler = signal.getsignal(signal.SIGINT)
    result = chat(bundle, "Write fib\nnow in C\n")
    assert isinstance(result.exception, RuntimeError) and result.stdout == "x\n", result.output
    assert signal.getsignal(signal.SIGINT) is handler


class Interrupted(io.RawIOBase):
    """stdin on which Ctrl-C is pressed at the prompt."""

    def readable(self):
        return True

    def readinto(self, buffer):
        if len(buffer):
            raise KeyboardInterrupt
        return 0


def test_ctrl_c_at_the_prompt_ends_the_conversation_with_status_0(bundle):
    from specbuild.cli import cli

    result = CliRunner().invoke(cli, ["chat", str(bundle), "--chat-template", TEMPLATE], input=Interrupted())
    assert result.exit_code == 0 and result.output == "", result.output


def test_on_a_terminal_it_prompts_and_ctrl_d_ends_it(bundle, reference):
    """The process itself, its stdin a terminal: the prompt "> " before each turn, and Ctrl-D (end of input there)
    ends it."""
    main, terminal = pty.openpty()
    os.write(main, b"Write fib\n\x04")  # the terminal holds them until read: Ctrl-D at a line's start is its end
    run = subprocess.run([sys.executable, "-m", "specbuild", "chat", str(bundle), "--chat-template", TEMPLATE, "-n",
                          str(N)], stdin=terminal, capture_output=True, text=True)
    os.close(terminal)
    os.close(main)
    assert run.returncode == 0, run.stderr
    assert run.stdout == f"> {reference.generation([user('Write fib')]).text}\n> \n"
    assert "/reset starts a new conversation" in run.stderr
