"""Chat messages to a prompt, with the chat template the bundle's tokenizer ships.

Rendered as transformers' `apply_chat_template` renders it (its `_compile_jinja_template` and
`render_jinja_template`): a sandboxed jinja2 environment with trim_blocks/lstrip_blocks and loop controls,
the same helpers (`raise_exception`, `tojson`, `strftime_now`), the tokenizer's special tokens as
variables, and `add_generation_prompt=True`. transformers itself is not imported: a server needs only
the runtime. tests/test_serve.py checks the rendering against transformers.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import BundleError, RequestError, first_line
from ..manifest import TOKENIZER_CONFIG, read_tokenizer_config
from ..validation import utf8

TEMPLATE_FILE = "chat_template.jinja"  # transformers >= 4.47 saves the template here; older, in tokenizer_config.json
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str]):
        self.source = source
        self.special_tokens = special_tokens
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols, _GenerationBlock])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self.template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise BundleError(f"the bundle's chat template does not compile ({exc}); fix tokenizer/{TEMPLATE_FILE}") from None
        self.takes_parts = _loops_over_content(env.parse(source))

    def render(self, messages: list[dict]) -> str:
        """The prompt for `messages` (OpenAI chat format, checked here), ending where the assistant speaks."""
        if not isinstance(messages, list) or not messages:
            raise RequestError("'messages' must be a non-empty list of {'role': ..., 'content': ...} objects")
        messages = [_message(m, i, self.takes_parts) for i, m in enumerate(messages)]
        try:
            text = self.template.render(messages=messages, tools=None, documents=None, add_generation_prompt=True,
                                        **self.special_tokens)
        except jinja2.TemplateError as exc:  # the template's own raise_exception, e.g. roles must alternate
            raise RequestError(f"the chat template rejected the messages: {exc}") from None
        except (TypeError, ValueError, LookupError, AttributeError, ArithmeticError) as exc:
            # The template's expressions over what the request sent (arithmetic on a field, an index past a
            # list): the bundle's data failing on these messages, not a server bug.
            raise RequestError(f"the chat template failed on these messages ({type(exc).__name__}: "
                               f"{first_line(exc)}); send the fields it expects") from None
        utf8("the prompt rendered from 'messages'", text)  # any other field a template shows (a name, tool calls)
        return text

    def prompt_ids(self, tokenizer, messages: list[dict]) -> list[int]:
        """The rendered prompt's token ids (a `tokenizers.Tokenizer`): special tokens come from the template's
        text, as transformers' apply_chat_template encodes it, none added."""
        return tokenizer.encode(self.render(messages), add_special_tokens=False).ids


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


def load_chat_template(tokenizer_dir: Path) -> ChatTemplate | None:
    """The template of a bundle's tokenizer folder, or None when it has none."""
    config = read_tokenizer_config(tokenizer_dir)
    if not isinstance(config, dict):
        raise BundleError(f"bundle file {tokenizer_dir / TOKENIZER_CONFIG} is not a JSON object; rebuild the bundle "
                          "with `specbuild compile`")
    source = (tokenizer_dir / TEMPLATE_FILE).read_text(encoding="utf-8") if (tokenizer_dir / TEMPLATE_FILE).exists() else config.get("chat_template")
    if isinstance(source, list):  # named templates: [{"name": "default", "template": ...}, ...]
        source = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}.get("default")
    if not isinstance(source, str) or not source:
        return None
    special = {name: _token_text(config[name]) for name in SPECIAL_TOKENS if config.get(name) is not None}
    return ChatTemplate(source, special)


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
    if "content" not in message:
        raise RequestError(f"messages[{index}] has no 'content'")
    content = message["content"]
    if isinstance(content, list):  # content parts: text only
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise RequestError(f"messages[{index}].content: only text parts are supported ({{'type': 'text', 'text': ...}})")
        if takes_parts:  # as transformers passes them (and vLLM, to such a template): the template joins them
            return {**message, "content": [{"type": "text", "text": p["text"]} for p in content]}
        content = "\n".join(p["text"] for p in content)  # as vLLM joins them for a template that takes a string
    elif content is None:  # OpenAI allows it (an assistant turn that only called tools): no text
        content = ""
    elif not isinstance(content, str):
        raise RequestError(f"messages[{index}].content must be a string or a list of text parts")
    utf8(f"messages[{index}].content", content)  # JSON can carry lone surrogates ("\ud800"), which no tokenizer takes
    return {**message, "content": content}


def _token_text(token) -> str:
    return token["content"] if isinstance(token, dict) else str(token)  # AddedToken as saved, or a plain string


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers overrides jinja's tojson, which escapes HTML characters
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
