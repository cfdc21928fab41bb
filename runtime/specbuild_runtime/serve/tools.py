"""Tool calling: the request's `tools` checked, and a reply's tool calls parsed out of its text.

A model trained on Hermes' format (Qwen2.5, Qwen3, Hermes 2 Pro) answers a call as
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; the parser reads it as vLLM's `hermes` tool parser
(Hermes2ProToolParser.extract_tool_calls) does, so a reply's calls, content and finish reason are vLLM's.
"""

from __future__ import annotations

import json
import re
import uuid

PARSERS = ("hermes",)  # serve --tool-call-parser
START, END = "<tool_call>", "</tool_call>"
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
