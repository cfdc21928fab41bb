"""Chat messages to a prompt, with the chat template the bundle's tokenizer ships (or an operator's, --chat-template).

Rendered as transformers' `apply_chat_template` renders it (its `_compile_jinja_template` and
`render_jinja_template`): a sandboxed jinja2 environment with trim_blocks/lstrip_blocks and loop controls,
the same helpers (`raise_exception`, `tojson`, `strftime_now`), the tokenizer's special tokens as
variables, a request's own variables over them (vLLM's chat_template_kwargs), `add_generation_prompt` and
`continue_final_message`. transformers itself is not imported: a server needs only the runtime.
tests/test_serve.py checks the rendering against transformers.
"""

from __future__ import annotations

import contextvars
import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..decode import encode_ids
from ..errors import BundleError, RequestError, first_line
from ..manifest import CHAT_TEMPLATE_FILE, TOKENIZER_CONFIG, TOKENIZER_DIR, chat_template_source, read_tokenizer_config
from ..validation import utf8

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# vLLM's test for a --chat-template value that was meant as a path: a template holds one of these, a path none.
TEMPLATE_CHARACTERS = "{}\n"
# continue_final_message as transformers' apply_chat_template does it: this after the last message's text, the
# chat rendered, then cut where it shows (so the cut falls at that message, not at an earlier copy of its text).
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# The names a message's reasoning comes under, the first given first (transformers' order)
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
MAX_TEMPLATE_BYTES = 1 << 20  # the largest templates shipped are tens of KB; more is the wrong file (or /dev/zero)
# Characters (or items) a render may build with `+`: a template that gathers messages by adding strings in a loop
# (DeepSeek-R1's system prompt) costs the square of their number, holding the GIL, and so the whole server: 60,000
# system messages of 100 characters (an 8 MB body) took 8 s. Requests that fit build much too: 1,700 such messages
# (173K characters) build 2^28, in 0.03 s; at 2^31, 4,500 (450K characters) render in 0.4 s on a 2-core machine, and
# the 60,000 are refused after 0.3 s.
MAX_ADDED = 1 << 31
_left_to_add: contextvars.ContextVar[list[int]] = contextvars.ContextVar("left_to_add")


class ChatRequestError(RequestError):
    """A RequestError about a chat request field other than the messages, named as `param` (the API error's)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SuppliedTemplate:
    """A template given on the command line (--chat-template), rendered in place of the bundle's."""

    source: str
    origin: str  # where it came from, for the start-up line: "--chat-template FILE" or "--chat-template (inline)"


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str], origin: str = f"{TOKENIZER_DIR}/{CHAT_TEMPLATE_FILE}"):
        self.source = source
        self.special_tokens = special_tokens
        self.origin = origin
        env = _environment()
        try:
            self.template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise BundleError(f"the bundle's chat template ({origin}) does not compile ({_syntax_error(exc)}); fix it, "
                              "or give one with --chat-template") from None
        self.takes_parts = _loops_over_content(env.parse(source))

    def render(self, messages: object, add_generation_prompt: bool = True, continue_final_message: bool = False,
               variables: dict | None = None, tools: list[dict] | None = None) -> str:
        """The prompt for `messages` (OpenAI chat format, checked here), ending where the assistant speaks: a new
        turn's header (add_generation_prompt), or inside the last message (continue_final_message). `variables`
        are more for the template (Qwen3's enable_thinking); `tools` (checked by tools.checked_tools) it shows as
        the functions the model may call."""
        if not isinstance(messages, list) or not messages:
            raise RequestError("'messages' must be a non-empty list of {'role': ..., 'content': ...} objects")
        messages = [_reasoning_aliased(_message(m, i, self.takes_parts)) for i, m in enumerate(messages)]
        parsed = [_arguments_parsed(m) for m in messages]
        try:
            return self._render(parsed, add_generation_prompt, continue_final_message, variables, tools)
        except RequestError as exc:
            if parsed == messages:
                raise
            first = exc
        # DeepSeek's templates (R1's, V3's) join a call's arguments to their text as the model writes them, JSON
        # text, and fail on the object: they get the calls as sent (vLLM answers them 400).
        try:
            return self._render(messages, add_generation_prompt, continue_final_message, variables, tools)
        except ChatRequestError:  # the template took the calls as sent: what fails is the request's other field
            raise
        except RequestError:
            raise first from None

    def _render(self, messages: list[dict], add_generation_prompt: bool, continue_final_message: bool,
                variables: dict | None, tools: list[dict] | None) -> str:
        messages = list(messages)
        if continue_final_message:
            if "content" not in self.source:  # transformers' test, on the template's text
                raise ChatRequestError("continue_final_message: the chat template never shows a message's 'content', "
                                       "so there is none to continue", "continue_final_message")
            messages[-1], final = _tagged(messages[-1])
        context = {"tools": None, "documents": None, **self.special_tokens, **(variables or {}), "messages": messages,
                   "add_generation_prompt": add_generation_prompt}
        if tools:
            context["tools"] = tools
        budget = _left_to_add.set([MAX_ADDED])
        try:
            text = self.template.render(context)
        except _Overspent:
            raise RequestError(f"the chat template built over {MAX_ADDED} characters by adding text to text rendering "
                               "these messages (its cost grows with the square of their number); send fewer messages, "
                               "or join them") from None
        except jinja2.TemplateError as exc:  # the template's own raise_exception, e.g. roles must alternate
            raise RequestError(f"the chat template rejected the messages: {exc}") from None
        except (TypeError, ValueError, LookupError, AttributeError, ArithmeticError, RecursionError) as exc:
            # The template's expressions over what the request sent (arithmetic on a field, an index past a
            # list, a macro that recurses over a nested field): the bundle's data failing on these messages, not a
            # server bug.
            raise RequestError(f"the chat template failed on these messages ({type(exc).__name__}: "
                               f"{first_line(exc)}); send the fields it expects") from None
        finally:
            _left_to_add.reset(budget)
        if continue_final_message:
            text = _cut_at_tag(text, final)
        # any other field a template shows (a name, tool calls, a variable)
        utf8("the prompt rendered from 'messages'" + (" and 'tools'" if tools else "") +
             (" and 'chat_template_kwargs'" if variables else ""), text)
        return text

    def prompt_ids(self, tokenizer, messages: object, fits: Callable[[str], None] | None = None,
                   add_special_tokens: bool = False, **options) -> list[int]:
        """The rendered prompt's token ids (a `tokenizers.Tokenizer`; `options` as render takes them): special
        tokens come from the template's text, as transformers' apply_chat_template encodes it, none added unless
        `add_special_tokens` (vLLM's field). `fits` may refuse the rendered text before it is tokenized
        (validation.check_text_fits)."""
        text = self.render(messages, **options)
        if fits:
            fits(text)
        return encode_ids(tokenizer, text, add_special_tokens=add_special_tokens)


def _tagged(message: dict) -> tuple[dict, str]:
    """The last message with CONTINUE_TAG after its text (the last text part's, for parts), and that text."""
    content = message["content"]
    if not isinstance(content, list):
        return {**message, "content": content + CONTINUE_TAG}, content
    if not content:
        raise ChatRequestError("continue_final_message: the last message has no text to continue", "continue_final_message")
    *before, last = content
    return {**message, "content": [*before, {**last, "text": last["text"] + CONTINUE_TAG}]}, last["text"]


def _cut_at_tag(text: str, final: str) -> str:
    """The rendered chat up to where the tagged message's text ends, so that the model continues it: what the
    template puts after it (an end-of-turn token) is cut, and so is the message's trailing space where the
    template trimmed it (the tag then lost its own)."""
    if final.strip() not in text or CONTINUE_TAG.strip() not in text:
        raise ChatRequestError("continue_final_message: the last message's text does not appear in the prompt the chat "
                               "template renders (the template changes or drops it), so it cannot be continued",
                               "continue_final_message")
    end = text.rindex(CONTINUE_TAG.strip())
    return text[:end] if text.startswith(CONTINUE_TAG, end) else text[:end].rstrip()


class _Overspent(Exception):
    """A render built more than MAX_ADDED with `+`."""


class _Sandbox(ImmutableSandboxedEnvironment):
    """jinja's sandbox, counting what `+` builds in a render against MAX_ADDED."""

    intercepted_binops = frozenset({"+"})

    def call_binop(self, context, operator, left, right):
        result = super().call_binop(context, operator, left, right)
        left_to_add = _left_to_add.get(None)
        if left_to_add is not None and isinstance(result, (str, list, tuple)):
            left_to_add[0] -= len(result)
            if left_to_add[0] < 0:
                raise _Overspent
        return result


def _environment() -> ImmutableSandboxedEnvironment:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationBlock])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _syntax_error(exc: jinja2.TemplateError) -> str:
    # from_string's error is its message alone: the line is where a template file needs fixing
    line = getattr(exc, "lineno", None)
    return f"line {line}: {exc.message}" if line else str(exc.message)


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`, which templates made for training put around the assistant's
    turns: transformers' AssistantTracker parses it (to mark those tokens) and renders the body unchanged;
    without it such a template does not compile here."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


def load_chat_template(tokenizer_dir: Path, supplied: SuppliedTemplate | None = None) -> ChatTemplate | None:
    """The template of a bundle's tokenizer folder, or None when it has none; a supplied one in its place,
    rendered with the bundle's special tokens (as vLLM's --chat-template is, with its tokenizer's)."""
    config = read_tokenizer_config(tokenizer_dir)
    if not isinstance(config, dict):
        raise BundleError(f"bundle file {tokenizer_dir / TOKENIZER_CONFIG} is not a JSON object; rebuild the bundle "
                          "with `specbuild compile`")
    special = {name: _token_text(config[name]) for name in SPECIAL_TOKENS if config.get(name) is not None}
    if supplied is not None:  # the bundle's own is not even compiled: a broken one is what this may replace
        return ChatTemplate(supplied.source, special, supplied.origin)
    found = chat_template_source(tokenizer_dir, config)
    if found is None:
        return None
    source, origin = found
    return ChatTemplate(source, special, origin)


def supplied_chat_template(value: str) -> SuppliedTemplate:
    """--chat-template as vLLM's load_chat_template reads it: the file `value` names where one opens, else the
    template text itself, unless `value` holds none of a template's characters ('{', '}', newline): then it was
    meant as a path, and a mistyped one is an error rather than a template that renders its own name. Unlike
    vLLM, this refuses (a one-line ValueError) a file that is not UTF-8 and a template that does not compile at
    start-up, not at the first chat request."""
    if not value:  # vLLM takes it for a path that does not exist
        raise ValueError("must not be empty; give a file, or the template text itself")
    try:
        with open(value, "rb") as file:  # not only a regular file: a pipe (`--chat-template <(...)`) reads too
            raw = file.read(MAX_TEMPLATE_BYTES + 1)
    except OSError as exc:
        if not any(c in value for c in TEMPLATE_CHARACTERS):
            raise ValueError(f"{value!r} looks like a file path (it holds no '{{', '}}' or newline, as a template "
                             f"would), but it cannot be read ({exc.strerror or exc}); give an existing file, or the "
                             "template text itself") from None
        source, origin, where = value, "--chat-template (inline)", "the template given inline"
        try:
            source.encode("utf-8")
        except UnicodeEncodeError:  # bytes from the shell that are not UTF-8 (Python holds them as surrogates)
            raise ValueError(f"{where} is not valid UTF-8; pass UTF-8 text, or a file") from None
    else:
        origin, where = f"--chat-template {value}", f"the template in file {value!r}"
        if len(raw) > MAX_TEMPLATE_BYTES:
            raise ValueError(f"file {value!r} is over {MAX_TEMPLATE_BYTES >> 20} MiB: not a chat template")
        try:
            source = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"file {value!r} is not UTF-8 ({exc.reason} at byte {exc.start}); save it as UTF-8") from None
    if not source.strip():  # the bundle's empty template counts as none; one given on purpose is a mistake
        raise ValueError(f"{where} is empty")
    try:
        _environment().from_string(source)
    except jinja2.TemplateError as exc:
        raise ValueError(f"{where} does not compile ({_syntax_error(exc)})") from None
    return SuppliedTemplate(source, origin)


def _loops_over_content(template: jinja2.nodes.Template) -> bool:
    """Whether the template iterates over a message's content (`{% for item in message['content'] %}`), as
    templates made for content parts do (Gemma 3's): vLLM's test for passing them a list of parts (its "openai"
    content format) rather than their text joined. Messages are also looked for under the names they are set to
    (`{% set loop_messages = messages[1:] %}`)."""
    lists, grew = {"messages"}, True
    while grew:
        named = {node.target.name for node in template.find_all(jinja2.nodes.Assign)
                 if isinstance(node.target, jinja2.nodes.Name) and _name_in(node.node, lists)}
        grew, lists = not named <= lists, lists | named
    loops = list(template.find_all(jinja2.nodes.For))
    messages = {loop.target.name for loop in loops if isinstance(loop.target, jinja2.nodes.Name) and _name_in(loop.iter, lists)}
    return any(_content_of(loop.iter, messages) for loop in loops)


def _unwrapped(node):
    """The expression under filters, tests and slices (`messages[1:] | reverse`)."""
    while isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)) or (
            isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice)):
        node = node.node
    return node


def _name_in(node, names: set[str]) -> bool:
    node = _unwrapped(node)
    return isinstance(node, jinja2.nodes.Name) and node.name in names


def _content_of(node, messages: set[str]) -> bool:
    """Whether `node` is `message['content']` or `message.content` for a message variable."""
    node = _unwrapped(node)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == "content":
        return _name_in(node.node, messages)
    return isinstance(node, jinja2.nodes.Getattr) and node.attr == "content" and _name_in(node.node, messages)


def _message(message, index: int, takes_parts: bool = False) -> dict:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise RequestError(f"messages[{index}] must be an object with a string 'role'")
    utf8(f"messages[{index}].role", message["role"])
    if "content" not in message and message["role"] != "assistant":  # OpenAI's may leave it out (tool calls alone)
        raise RequestError(f"messages[{index}] has no 'content'")
    content = message.get("content")
    if isinstance(content, list):  # content parts: text only
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise RequestError(f"messages[{index}].content: only text parts are supported ({{'type': 'text', 'text': ...}})")
        if takes_parts:  # as transformers passes them (and vLLM, to such a template): the template joins them
            return {**_present(message), "content": [{"type": "text", "text": p["text"]} for p in content]}
        content = "\n".join(p["text"] for p in content)  # as vLLM joins them for a template that takes a string
    elif content is None:  # OpenAI allows it, or its absence (an assistant turn that only called tools): no text
        content = ""
    elif not isinstance(content, str):
        raise RequestError(f"messages[{index}].content must be a string or a list of text parts")
    utf8(f"messages[{index}].content", content)  # JSON can carry lone surrogates ("\ud800"), which no tokenizer takes
    return {**_present(message), "content": content}


def _present(message: dict) -> dict:
    """The message without the fields sent null, as transformers' apply_chat_template and vLLM pass it, and
    without an empty "tool_calls", as vLLM passes it: templates test for a field's presence (Llama 3.1's and
    DeepSeek-R1's `'tool_calls' in message`, and Llama 3.1's then refuses any count of calls but one), and a client
    replaying an assistant turn as it was answered sends "tool_calls": null (OpenAI's) or [] (vLLM's)."""
    return {name: value for name, value in message.items()
            if value is not None and not (name == "tool_calls" and value == [])}


def _arguments_parsed(message: dict) -> dict:
    """An assistant turn's tool calls as vLLM passes them to the template: OpenAI sends each call's arguments as
    JSON text, which templates (Llama 3.1's `arguments | tojson`, Mistral's, Qwen3-Coder's `arguments | items`)
    take as an object, and would otherwise show as a quoted string; no arguments are {}. Text that is no JSON
    stays text (vLLM answers it 400), for the templates that show it as it is (Qwen3's)."""
    calls = message.get("tool_calls")
    if message["role"] != "assistant" or not isinstance(calls, list):
        return message
    return {**message, "tool_calls": [_call_parsed(call) for call in calls]}


def _call_parsed(call):
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):  # not OpenAI's shape: the template's to read as it does
        return call
    arguments = function.get("arguments")
    if not arguments:
        arguments = {}
    elif isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            pass
    return {**call, "function": {**function, "arguments": arguments}}


def _reasoning_aliased(message: dict) -> dict:
    """The message with its reasoning under each name templates read it by, as transformers' apply_chat_template
    copies it: a client sends it as vLLM answered it ("reasoning"), Qwen3's template reads "reasoning_content" and
    gpt-oss's "thinking"; a template would otherwise drop the reasoning of the turns it shows it for."""
    reasoning = next((message[name] for name in REASONING_FIELDS if message.get(name) is not None), None)
    return message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _token_text(token) -> str:
    return token["content"] if isinstance(token, dict) else str(token)  # AddedToken as saved, or a plain string


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers overrides jinja's tojson, which escapes HTML characters
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
