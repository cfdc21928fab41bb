"""Tool calling: the request's `tools` checked, and a reply's tool calls parsed out of its text.

Each parser reads a model family's format as vLLM's tool parser of the same name does, so a reply's calls,
content and finish reason are vLLM's:
- `hermes` (Qwen2.5, Qwen3, Hermes 2 Pro): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, as
  Hermes2ProToolParser.extract_tool_calls reads it;
- `llama3_json` (Llama 3.1, 3.2, 3.3 Instruct): `{"name": ..., "parameters": {...}}`, several joined by "; ",
  as Llama3JsonToolParser.extract_tool_calls reads it.
"""

from __future__ import annotations

import json
import re
import uuid

START, END = "<tool_call>", "</tool_call>"
# Llama 3's "code follows" token, before some of its calls: a special token, so the runtime's text (special tokens
# skipped, as vLLM's skip_special_tokens default skips them) has none; a text that kept it parses the same.
PYTHON_TAG = "<|python_tag|>"
# A closed block, or one the reply ends inside (a call whose JSON is whole before the closing tag): vLLM's regex.
BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
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


def _call(name, arguments) -> dict:
    if not isinstance(name, str):
        raise TypeError("a call's name is a string")
    # OpenAI's format: the arguments as JSON text, written as vLLM writes them
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


class HermesStream:
    """A streamed reply's text split as parse_hermes splits the whole: content is passed on as it comes until a
    `<tool_call>` begins (text that may be the start of that tag is held back until the next delta tells), and
    from there the text is held to the end and parsed whole. So a stream answers the calls, content and finish
    reason of the same reply unstreamed, also where a later block turns out not to be a call (vLLM streams the
    calls as they form, and cannot take back what it sent then)."""

    def __init__(self):
        self.held = ""
        self.calling = False

    def feed(self, delta: str) -> str:
        """The content to send now for this delta of the reply's text."""
        if self.calling:
            self.held += delta
            return ""
        text = self.held + delta
        if (at := text.find(START)) >= 0:
            self.calling, self.held = True, text[at:]
            return text[:at]
        keep = next((n for n in range(min(len(START) - 1, len(text)), 0, -1) if START.startswith(text[-n:])), 0)
        self.held = text[len(text) - keep:]
        return text[:len(text) - keep]

    def end(self) -> tuple[str, list[dict]]:
        """Once the reply has ended: the content still to send, and the calls."""
        if not self.calling:
            return self.held, []
        content, calls = parse_hermes(self.held)
        return content or "", calls


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

    def feed(self, delta: str) -> str:
        """The content to send now for this delta of the reply's text."""
        self.text += delta
        if self.calling:
            return ""
        if not self.plain:
            first = self.text.find("{")
            if first >= 0:
                self._judge(first)
            if not self.plain:
                upto = len(self.text) if first < 0 else first
                return self._release(upto) if _said(self.text[:upto]) else ""
        return self._release(len(self.text))

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
        """Once the reply has ended: the content still to send, and the calls."""
        content, calls = (self.text, []) if self.plain else parse_llama3_json(self.text)
        return ("", calls) if calls else (self.text[self.sent:], [])


def _said(text: str) -> bool:
    """Whether `text`, the start of a reply, says more than the spaces and python tag a call may come after."""
    text = text.lstrip()
    if text.startswith(PYTHON_TAG):
        text = text[len(PYTHON_TAG):].lstrip()
    return bool(text) and not PYTHON_TAG.startswith(text)


# serve --tool-call-parser: each format's parser of a whole reply, and of a streamed one
PARSERS = {"hermes": (parse_hermes, HermesStream), "llama3_json": (parse_llama3_json, Llama3JsonStream)}
