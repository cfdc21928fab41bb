"""Tool calling: the request's `tools` checked, and a reply's tool calls parsed out of its text.

Each parser reads a model family's format as vLLM's tool parser of the same name does, so a reply's calls,
content and finish reason are vLLM's:
- `hermes` (Qwen2.5, Qwen3, Hermes 2 Pro): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, as
  Hermes2ProToolParser.extract_tool_calls reads it;
- `llama3_json` (Llama 3.1, 3.2, 3.3 Instruct): `{"name": ..., "parameters": {...}}`, several joined by "; ",
  as Llama3JsonToolParser.extract_tool_calls reads it;
- `mistral` (Mistral and Mixtral Instruct): `[TOOL_CALLS]name[ARGS]{...}` from a tokenizer
  with an [ARGS] token (v11 on), else `[TOOL_CALLS] [{"name": ..., "arguments": {...}}]`, as MistralToolParser
  reads a Hugging Face tokenizer's text;
- `pythonic` (Llama 3.2 and 4, ToolACE): `[get_weather(city="Zürich"), add(a=2, b=2)]`, read with Python's ast
  (never run), as PythonicToolParser.extract_tool_calls reads it;
- `llama4_pythonic` (Llama 4): the same, where a reply opening with `<|python_start|>` is read without it and
  without its `<|python_end|>`, as Llama4PythonicToolParser.extract_tool_calls reads it.
Each stream answers what the same reply unstreamed answers: its content streams until a call can begin, and each
call goes out whole once nothing later in the reply can change it or the content: in `mistral`'s newer form when the
next `[TOOL_CALLS]` closes it; in every other format, at the end (see each stream for why).
"""

from __future__ import annotations

import ast
import json
import re
import uuid
import warnings
from collections.abc import Callable
from typing import NamedTuple, Protocol

START, END = "<tool_call>", "</tool_call>"
# Llama 3's "code follows" token, before some of its calls: a special token, so the runtime's text (special tokens
# skipped, as vLLM's skip_special_tokens default skips them) has none; a text that kept it parses the same.
PYTHON_TAG = "<|python_tag|>"
# A closed block, or one the reply ends inside (a call whose JSON is whole before the closing tag): vLLM's regex.
BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
# Mistral's tokens, special: kept in the text for this parser, as vLLM keeps them (skip_special_tokens false)
TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
# Llama 4's markers around its code (special tokens: the runtime's text, as vLLM's, has them only where the
# tokenizer lacks them)
PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
# PythonicToolParser.TOOL_CALL_REGEX, which a reply must match before it is parsed, rewritten to match the same
# strings (checked on millions) in linear time: vLLM's nested ".*" backtracks for over 30 s on a list of 24 calls
# ending ", ]", where vLLM's regex module times out and Python's re cannot.
NAME = r"[a-zA-Z]\w*"
PYTHONIC = re.compile(rf"\[(?:{NAME}\(\),\s*)*(?:{NAME}\(\)\s*)*{NAME}\((?:{NAME}=.*)?\)\s*\]", re.DOTALL)
PYTHONIC_START = re.compile(rf"\[{NAME}\(")  # a reply that begins so may be calls
PYTHONIC_UNDECIDED = re.compile(rf"(?:\[(?:{NAME})?)?")  # a reply that may still begin so
TOOL_SHAPE = "{\"type\": \"function\", \"function\": {\"name\": ..., \"description\": ..., \"parameters\": {...}}}"


def checked_tools(tools) -> list[dict] | None:
    """The request's `tools` as the chat template gets them: as sent (transformers' apply_chat_template(tools=...)
    passes dicts unchanged, and the model was trained on that rendering), with "type" added where left out (vLLM
    takes "function" as its default and renders it). None or [] is no tools. A ValueError names what is wrong."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ValueError(f"tools must be a list of {TOOL_SHAPE} objects")
    return [_tool(tool, index) for index, tool in enumerate(tools)] or None


def _tool(tool, index: int) -> dict:
    where = f"tools[{index}]"
    if not isinstance(tool, dict):
        raise ValueError(f"{where} must be an object, {TOOL_SHAPE}")
    kind = tool.get("type", "function")
    if kind != "function":  # OpenAI's "custom" tools take free text, which no Hermes-format model answers
        raise ValueError(f"{where}.type must be \"function\" (the only kind of tool this server calls), not "
                         f"{json.dumps(kind)}")
    function = tool.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise ValueError(f"{where}.function must be an object with a non-empty string 'name': {TOOL_SHAPE}")
    if function.get("description") is not None and not isinstance(function["description"], str):
        raise ValueError(f"{where}.function.description must be a string")
    if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
        raise ValueError(f"{where}.function.parameters must be a JSON Schema object, e.g. "
                         "{\"type\": \"object\", \"properties\": {...}}")
    # Where "type" was sent it keeps its place: the template's `tool | tojson` shows keys in the order sent.
    return tool if "type" in tool else {"type": "function", **tool}


def parse_hermes(text: str) -> tuple[str | None, list[dict]]:
    """A reply's content and tool calls, as vLLM's hermes parser reads them: every `<tool_call>` block becomes a
    call; the content is the text before the first block (None if empty). Where any block is not a call (JSON
    that is no object with a string "name" and an "arguments", e.g. one cut short by max_tokens), the whole text
    is content and there are no calls, as in vLLM."""
    if START not in text:
        return text, []
    try:
        found = [json.loads(closed or unclosed) for closed, unclosed in BLOCK.findall(text)]
        calls = [_call(found_call["name"], found_call["arguments"]) for found_call in found]
    except (ValueError, RecursionError, TypeError, KeyError):
        return text, []
    return text[:text.index(START)] or None, calls


def _call(name, arguments, mistral: bool = False) -> dict:
    # OpenAI's format: the arguments as JSON text, written as vLLM writes them
    return _written_call(name, json.dumps(arguments, ensure_ascii=False), mistral)


def _written_call(name, arguments: str, mistral: bool = False) -> dict:
    if not isinstance(name, str):
        raise TypeError("a call's name is a string")
    # Mistral's templates refuse a replayed call whose id is not 9 letters and digits; vLLM writes such ids for it
    return {"id": uuid.uuid4().hex[:9] if mistral else f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


class HeldStream:
    """A streamed reply's text split as `parse` splits the whole: content is passed on as it comes until calls may
    begin (text that may be the start of them is held back until a later delta tells), and from there the text is
    held to the end and parsed whole. So a stream answers the calls, content and finish reason of the same reply
    unstreamed, also where what began as a call turns out not to be one (vLLM streams the calls as they form, and
    cannot take back what it sent then). `_begins` says where calls may begin.

    hermes and pythonic hold every call to the end: the whole reply is content, and none of its calls is one, where
    any later block is no call (hermes), or any later element of the list is none or the list is cut short
    (pythonic), as vLLM reads the whole reply; a call sent before then could not be taken back."""

    def __init__(self, parse: Callable[[str], tuple[str | None, list[dict]]]):
        self.parse = parse
        self.held = ""
        self.calling = False

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        """The content and the calls to send now for this delta of the reply's text."""
        if self.calling:
            self.held += delta
            return "", []
        text = self.held + delta
        at, keep = self._begins(text)
        if at >= 0:
            self.calling, self.held = True, text[at:]
            return text[:at], []
        self.held = text[len(text) - keep:]
        return text[:len(text) - keep], []

    def _begins(self, text: str) -> tuple[int, int]:
        """Where calls begin in the text not yet sent (-1: nowhere yet), and else how much of its end to hold."""
        raise NotImplementedError

    def end(self) -> tuple[str, list[dict]]:
        """Once the reply has ended: the content and the calls still to send."""
        calls = self.parse(self.held)[1] if self.calling else []
        return ("", calls) if calls else (self.held, [])


def _partial(tag: str, text: str) -> int:
    """How much of text's end may be the start of tag."""
    return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-n:])), 0)


class TagStream(HeldStream):
    """For a format whose calls begin at a tag (the held text's content, before the tag, is empty)."""

    def __init__(self, tag: str, parse: Callable[[str], tuple[str | None, list[dict]]]):
        super().__init__(parse)
        self.tag = tag

    def _begins(self, text: str) -> tuple[int, int]:
        return text.find(self.tag), _partial(self.tag, text)


class MistralStream(TagStream):
    """For parse_mistral, whose calls each follow a [TOOL_CALLS]: a call goes out once the next [TOOL_CALLS] closes
    it. Nothing later changes a closed call (its name and arguments end at that tag), and once one call is made
    the reply has calls, so its content is the text before the first tag, already sent."""

    def __init__(self):
        super().__init__(TOOL_CALLS, parse_mistral)
        self.closed = 0  # where the held text's calls not yet sent begin: at a tag
        self.sent = 0  # calls sent

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        content, _ = super().feed(delta)
        last = self.held.rfind(TOOL_CALLS) if self.calling else -1
        if last <= self.closed:
            return content, []
        calls = parse_mistral(self.held[self.closed:last])[1]
        self.closed, self.sent = last, self.sent + len(calls)
        return content, calls

    def end(self) -> tuple[str, list[dict]]:
        content, calls = super().end()
        return content, calls[self.sent:]


class PythonicStream(HeldStream):
    """For parse_pythonic, whose calls are the whole reply: it is held while its start may begin a call, and once it
    cannot, streams as it comes."""

    def __init__(self):
        super().__init__(parse_pythonic)
        self.plain = False

    def _begins(self, text: str) -> tuple[int, int]:
        if not self.plain and PYTHONIC_START.match(text):
            return 0, 0
        self.plain = self.plain or not PYTHONIC_UNDECIDED.fullmatch(text)
        return -1, 0 if self.plain else len(text)


def parse_llama3_json(text: str) -> tuple[str | None, list[dict]]:
    """A reply's content and tool calls, as vLLM's llama3_json parser reads them: each JSON object in the text
    (searched from every "{" not inside one already read) with a "name" and an "arguments" or "parameters" is a
    call, whatever text surrounds them ("; " between calls, or prose); where there are calls the content is None,
    the surrounding text dropped, as in vLLM. Where any such object is no call, or a "{" begins no JSON (code, a
    call cut short by max_tokens), the whole text is content and there are no calls."""
    if PYTHON_TAG not in text and "{" not in text:
        return text, []
    decoder = json.JSONDecoder()
    calls, end = [], -1
    try:
        for brace in re.finditer(r"\{", text):
            at = brace.start()
            if at <= end:  # vLLM's test, "<=": a "{" right after a call's "}" is skipped too
                continue
            found, length = decoder.raw_decode(text[at:])
            end = at + length
            calls.append(_call(found["name"], found["arguments"] if "arguments" in found else found["parameters"]))
    except (ValueError, RecursionError, TypeError, KeyError):
        return text, []
    return (None, calls) if calls else (text, [])


class Llama3JsonStream:
    """A streamed reply's text split as parse_llama3_json splits the whole. Leading spaces (and a python tag) are
    held; text is passed on as it comes until its first "{", and from there held: a "{" that can begin no call
    (not followed by a JSON key, or an object that is no call) makes the whole reply content, so the text is
    released and streams on as it comes; a call holds the rest to the end, parsed whole. So a reply that is
    text, or that begins with its calls (as Llama 3 is prompted to answer), streams the unstreamed reply's
    content and calls; one with text before its calls sends that text before them, where the reply unstreamed
    has null content (vLLM's own stream answers such a reply as text alone, its calls unparsed)."""

    def __init__(self):
        self.text = ""  # the reply so far
        self.sent = 0  # how much of it has gone out as content
        self.plain = False  # no call can come: the rest streams as content
        self.calling = False  # the first "{" begins a call: the rest is held to the end

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        """The content and the calls to send now for this delta of the reply's text (the calls all come at the end:
        any later "{" that begins no call makes the whole reply content, as vLLM reads it)."""
        self.text += delta
        if self.calling:
            return "", []
        if not self.plain:
            first = self.text.find("{")
            if first >= 0:
                self._judge(first)
            if not self.plain:
                upto = len(self.text) if first < 0 else first
                return (self._release(upto) if _said(self.text[:upto]) else ""), []
        return self._release(len(self.text)), []

    def _judge(self, first: int) -> None:
        after = self.text[first + 1:].lstrip()
        if not after:
            return
        if after[0] != '"':  # raw_decode fails there, or reads {}, which has no name
            self.plain = True
            return
        try:
            found, _ = json.JSONDecoder().raw_decode(self.text[first:])
        except (ValueError, RecursionError):
            return  # cut short so far, or not JSON: the end tells
        if (isinstance(found, dict) and isinstance(found.get("name"), str)
                and ("arguments" in found or "parameters" in found)):
            self.calling = True
        else:
            self.plain = True

    def _release(self, upto: int) -> str:
        content, self.sent = self.text[self.sent:upto], max(self.sent, upto)
        return content

    def end(self) -> tuple[str, list[dict]]:
        """Once the reply has ended: the content and the calls still to send."""
        content, calls = (self.text, []) if self.plain else parse_llama3_json(self.text)
        return ("", calls) if calls else (self.text[self.sent:], [])


def _said(text: str) -> bool:
    """Whether `text`, the start of a reply, says more than the spaces and python tag a call may come after."""
    text = text.lstrip()
    if text.startswith(PYTHON_TAG):
        text = text[len(PYTHON_TAG):].lstrip()
    return bool(text) and not PYTHON_TAG.startswith(text)


def parse_mistral(text: str) -> tuple[str | None, list[dict]]:
    """A reply's content and tool calls, as vLLM's mistral parser reads a v11-or-later tokenizer's text: each
    `[TOOL_CALLS]` begins a call, its name up to the first "{" ([ARGS] left out) and its arguments the text from
    there, sent as written even where it is no JSON (vLLM keeps them so, for the model to see what it wrote); a
    part with no "{" is no call. The content is the text before the first `[TOOL_CALLS]` (None if empty); where
    no part is a call, the whole text is content."""
    content, *parts = text.split(TOOL_CALLS)
    calls = [_written_call(part[:part.index("{")].replace(ARGS, ""), part[part.index("{"):], mistral=True)
             for part in parts if "{" in part]
    return (content or None, calls) if calls else (text, [])


def parse_mistral_list(text: str) -> tuple[str | None, list[dict]]:
    """A reply's content and tool calls, as vLLM's mistral parser reads an older tokenizer's text (no [ARGS] token:
    Mistral 7B Instruct v0.3, Mixtral 8x22B Instruct): one `[TOOL_CALLS]`, then a JSON list of {"name", "arguments"}
    objects (arguments left out: {}), read from its start or else from its first "[{" to its last "}]". The content
    is the text before `[TOOL_CALLS]` (None if empty). Where the list is no list of calls, or the reply holds
    several `[TOOL_CALLS]`, the whole text is content (vLLM answers the text after the token alone, or fails)."""
    content, *parts = text.split(TOOL_CALLS)
    if len(parts) != 1:
        return text, []
    listed = parts[0].strip()
    try:
        try:  # raw_decode: text the model writes after the list is left out
            found, _ = json.JSONDecoder().raw_decode(listed)
        except ValueError:  # vLLM's regex \[{.*}\], greedy, found without its quadratic search
            start, end = listed.find("[{"), listed.rfind("}]") + 2
            found = json.loads(listed[start:end] if 0 <= start < end - 3 else "")
        calls = [_call(call["name"], call.get("arguments", {}), mistral=True) for call in found]
    except (ValueError, RecursionError, TypeError, KeyError, AttributeError):
        return text, []
    return (content or None, calls) if calls else (text, [])


def parse_pythonic(text: str) -> tuple[str | None, list[dict]]:
    """A reply's content and tool calls, as vLLM's pythonic parser reads them: a reply that is a Python list of
    calls, `[name(key=value, ...), ...]`, from its first character (text after it is a syntax error; a later
    statement is left out), is read with ast, never run. The values are literals: constants, and lists and dicts of
    them (-1 is an expression, as in vLLM); positional arguments are left out. The content is then None; a reply
    that is not such a list is all content."""
    if not PYTHONIC.match(text):
        return text, []
    try:
        with warnings.catch_warnings(action="ignore"):  # Python 3.12 warns of each "\d" in the model's strings
            listed = getattr(ast.parse(text).body[0], "value", None)
        if not isinstance(listed, ast.List):
            raise ValueError("a pythonic reply is a list of calls")
        calls = []
        for call in listed.elts:
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)):
                raise ValueError("a pythonic reply is a list of calls")
            calls.append(_call(call.func.id, {keyword.arg: _literal(keyword.value) for keyword in call.keywords}))
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return text, []
    return None, calls


def _literal(node: ast.expr):
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Dict):
        keys = [key for key in node.keys if isinstance(key, ast.Constant)]  # None: a **spread
        if len(keys) == len(node.keys):
            return {key.value: _literal(value) for key, value in zip(keys, node.values)}
    if isinstance(node, ast.List):
        return [_literal(element) for element in node.elts]
    raise ValueError("a call's arguments are literals")


def parse_llama4_pythonic(text: str) -> tuple[str | None, list[dict]]:
    """A reply's content and tool calls, as vLLM's llama4_pythonic parser reads them: as parse_pythonic reads the
    reply, or, where it opens with <|python_start|>, the text after it with every <|python_end|> left out (then
    also the content, where it is no list of calls, as in vLLM)."""
    if text.startswith(PYTHON_START):
        text = text[len(PYTHON_START):].replace(PYTHON_END, "")
    return parse_pythonic(text)


class Llama4PythonicStream(PythonicStream):
    """For parse_llama4_pythonic: a PythonicStream fed the text that parser reads, the opening <|python_start|> and
    every <|python_end|> after it left out; what may still be the start of either is held until a delta tells."""

    def __init__(self) -> None:
        super().__init__()
        self.raw = ""  # the reply's text not yet passed on
        self.wrapped: bool | None = None  # whether the reply opens with <|python_start|> (None: not yet told)

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        self.raw += delta
        if self.wrapped is None:
            if len(self.raw) < len(PYTHON_START) and PYTHON_START.startswith(self.raw):
                return "", []
            self.wrapped = self.raw.startswith(PYTHON_START)
            self.raw = self.raw[len(PYTHON_START):] if self.wrapped else self.raw
        *before, rest = self.raw.split(PYTHON_END) if self.wrapped else [self.raw]
        keep = _partial(PYTHON_END, rest) if self.wrapped else 0
        self.raw = rest[len(rest) - keep:]
        return super().feed("".join(before) + rest[:len(rest) - keep])

    def end(self) -> tuple[str, list[dict]]:
        content, _ = super().feed(self.raw)  # a marker's start that the reply ended in is text
        rest, calls = super().end()
        return content + rest, calls


class DeltaStream(Protocol):
    """A streamed reply's parser: the content and calls each delta completes, then those the end does."""

    def feed(self, delta: str) -> tuple[str, list[dict]]: ...

    def end(self) -> tuple[str, list[dict]]: ...


class ToolParser(NamedTuple):
    parse: Callable[[str], tuple[str | None, list[dict]]]  # a whole reply's content and calls
    stream: Callable[[], DeltaStream]  # a streamed reply's, from its deltas
    special_tokens: bool = False  # the reply's text keeps its special tokens, the format's tags among them
    # a reply with calls finishes "tool_calls"; false: as it ended ("stop"), as vLLM and OpenAI answer a named function
    calls_finish: bool = True


# serve --tool-call-parser: each format's parser
PARSERS = {"hermes": ToolParser(parse_hermes, lambda: TagStream(START, parse_hermes)),
           "llama3_json": ToolParser(parse_llama3_json, Llama3JsonStream),
           "llama4_pythonic": ToolParser(parse_llama4_pythonic, Llama4PythonicStream),
           "mistral": ToolParser(parse_mistral, MistralStream, special_tokens=True),
           "pythonic": ToolParser(parse_pythonic, PythonicStream)}
# The older form's calls are one JSON list after one [TOOL_CALLS], held to the end: the list may continue, a later
# element that is no call makes the whole reply content, and so does a second [TOOL_CALLS].
MISTRAL_LIST = ToolParser(parse_mistral_list, lambda: TagStream(TOOL_CALLS, parse_mistral_list), special_tokens=True)
# vLLM's other --tool-call-parser names (vllm/tool_parsers/__init__.py, 2026): refused by name, with the ones here.
VLLM_ONLY = {"deepseek_v3", "deepseek_v31", "deepseek_v32", "ernie45", "functiongemma", "gigachat3", "glm45", "glm47",
             "granite", "granite-20b-fc", "hunyuan_a13b", "internlm", "jamba", "kimi_k2", "llama4_json", "longcat",
             "minimax", "minimax_m2", "olmo3", "openai", "phi4_mini_json", "qwen3_coder", "qwen3_xml", "seed_oss",
             "step3", "step3p5", "xlam"}


# The tokens that mark each format's calls, which vLLM's parser of that name looks up in the tokenizer's vocabulary and
# refuses to start without: a model whose tokenizer lacks them was not taught the format, so every reply would be text.
MARKERS = {"hermes": (START, END), "mistral": (TOOL_CALLS,)}


def missing_markers(name: str, tokenizer) -> list[str]:
    """The tokens --tool-call-parser NAME reads calls by that the bundle's tokenizer (a tokenizers.Tokenizer) lacks."""
    return [token for token in MARKERS.get(name, ()) if tokenizer.token_to_id(token) is None]


def tool_parser(name: str, tokenizer) -> ToolParser:
    """--tool-call-parser NAME for the bundle's tokenizer (a tokenizers.Tokenizer): mistral's format is the one its
    vocabulary tells, as vLLM tells it (no [ARGS] token: the JSON list of older models)."""
    return MISTRAL_LIST if name == "mistral" and tokenizer.token_to_id(ARGS) is None else PARSERS[name]


# tool_choice "required" or a named function: the reply is forced into calls by a JSON schema made from the tools
# (vLLM's get_json_schema_from_tools), and read as JSON by the server, whatever --tool-call-parser says (vLLM's
# serving_chat reads these replies without its tool parser).
# A function without parameters is called with an empty object: vLLM's schema for it, less its leave to add any
# property (JSON Schema's default), which a model would use to invent arguments.
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def required_schema(tools: list[dict]) -> dict:
    """tool_choice "required": a JSON list of one or more {"name", "parameters"} objects, each one of the tools'.
    Each tool's $defs move to the list's, where its "#/$defs/..." references point from; a ValueError names two
    tools whose $defs give one name two schemas, which vLLM refuses too."""
    calls: list[dict] = []
    defs: dict[str, object] = {}
    defined_by: dict[str, int] = {}
    for index, tool in enumerate(tools):
        function = tool["function"]
        parameters = dict(function.get("parameters") or NO_PARAMETERS)
        own = parameters.pop("$defs", {})
        if not isinstance(own, dict):
            raise ValueError(f"tools[{index}].function.parameters.$defs must be an object of named schemas")
        for name, schema in own.items():
            if defs.setdefault(name, schema) != schema:
                raise ValueError(f"tools[{defined_by[name]}] and tools[{index}] define $defs.{name} differently, which "
                                 "one schema for tool_choice \"required\" cannot hold: rename one of them")
            defined_by.setdefault(name, index)
        calls.append({"properties": {"name": {"type": "string", "enum": [function["name"]]}, "parameters": parameters},
                      "required": ["name", "parameters"]})
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": calls}}
    return {**schema, "$defs": defs} if defs else schema


def parse_required(text: str) -> tuple[str | None, list[dict]]:
    """A tool_choice "required" reply: each {"name", "parameters"} of its list a call, with the parameters as its
    arguments, as vLLM reads it. A reply cut short (max_tokens) is no list: it is content, with no calls."""
    try:
        calls = [_call(found["name"], found["parameters"]) for found in json.loads(text)]
    except (ValueError, RecursionError, TypeError, KeyError):
        return text, []
    return (None, calls) if calls else (text, [])


def named_parser(name: str) -> ToolParser:
    """A tool_choice naming function `name`: the whole reply is its arguments, as vLLM answers it (also where
    max_tokens cut them short)."""
    def parse(text: str) -> tuple[str | None, list[dict]]:
        return None, [_written_call(name, text)]
    return ToolParser(parse, lambda: NamedStream(name), calls_finish=False)


class NamedStream:
    """A reply forced into the arguments of function `name`, streamed as vLLM streams it: the call (its id, type,
    name, and the reply's first text as its arguments' beginning), then each later text as more of its arguments
    (a delta without an id: the call before it continues). Nothing later changes what went out, as the whole
    reply is the arguments."""

    def __init__(self, name: str):
        self.name = name
        self.begun = False

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        if self.begun:
            return "", [{"function": {"arguments": delta}}]
        self.begun = True
        return "", [_written_call(self.name, delta)]

    def end(self) -> tuple[str, list[dict]]:
        """A reply without text still calls the function, with empty arguments, as unstreamed."""
        return "", ([] if self.begun else [_written_call(self.name, "")])


class WholeStream(HeldStream):
    """A reply forced into "required" calls is held whole and parsed at its end. vLLM streams each call as its name
    and arguments form, but a reply max_tokens cuts short is content unstreamed, which calls sent could not take
    back."""

    def _begins(self, text: str) -> tuple[int, int]:
        return 0, 0


REQUIRED = ToolParser(parse_required, lambda: WholeStream(parse_required))
