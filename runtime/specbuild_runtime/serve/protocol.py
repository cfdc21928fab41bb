"""The OpenAI HTTP API's shapes: request bodies in, response bodies and stream chunks out.

This module only maps names and shapes (OpenAI's `max_tokens` is the runtime's `max_new_tokens`, a `stop`
string is a list of one, ...). Whether a value is acceptable (a temperature, a token id, a prompt that
fits the context) is decided by the runtime's request validation, the one place for it.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import cache
from typing import NamedTuple, TypeVar

from tokenizers import Tokenizer

from ..decode import Stats
from ..errors import RequestError
from ..grammar import Unchecked
from ..logprobs import TokenLogprobs, floored
from ..validation import GREEDY_BELOW, MAX_LOGPROBS, RANDOM_SEED, check_sampling, utf8, whole
from .tools import NO_PARAMETERS, PARSERS, REQUIRED, ToolParser, checked_tools, named_parser, required_schema

COMPLETIONS, CHAT = "completions", "chat"
DEFAULT_MAX_TOKENS = {COMPLETIONS: 16, CHAT: None}  # OpenAI's defaults; None: until the context is full

# Fields each endpoint reads. "gamma" is specbuild's own: draft tokens per round, "auto" by default. logit_bias,
# presence_penalty and frequency_penalty are OpenAI's; min_p, repetition_penalty, min_tokens and the last five are vLLM's
# SamplingParams' extras, which its server reads on both endpoints.
DECODING = ("temperature", "top_p", "top_k", "seed", "stop", "gamma", "min_p", "presence_penalty", "frequency_penalty",
            "repetition_penalty", "min_tokens", "logit_bias", "ignore_eos", "stop_token_ids", "include_stop_str_in_output",
            "skip_special_tokens", "structured_outputs")
RESPONSE_FORMAT = "response_format"  # OpenAI's structured outputs, read as the runtime's structured_outputs
# vLLM's extras whose only value here is the default: spaces_between_special_tokens false needs a decoder that
# tokenizers' decode lacks.
DEFAULT_ONLY = {"spaces_between_special_tokens": True}
# vLLM's fields that add to the response: the prompt's logprobs, the prompt's and the reply's token ids
TRACING = ("prompt_logprobs", "return_token_ids")
FIELDS = {
    COMPLETIONS: {"model", "prompt", "max_tokens", "stream", "stream_options", "n", "logprobs", "echo", *DECODING,
                  *DEFAULT_ONLY, "add_special_tokens", RESPONSE_FORMAT, *TRACING},
    CHAT: {"model", "messages", "max_tokens", "max_completion_tokens", "stream", "stream_options", "n", "logprobs",
           "top_logprobs", *DECODING, *DEFAULT_ONLY, "chat_template_kwargs", "add_generation_prompt",
           "continue_final_message", "tools", "tool_choice", "parallel_tool_calls", "add_special_tokens", RESPONSE_FORMAT,
           *TRACING},
}
STREAM_OPTIONS = {"include_usage", "continuous_usage_stats"}
# /tokenize's fields for chat messages besides model, add_special_tokens and return_token_strs (vLLM's, less the
# multimodal ones and chat_template, which vLLM takes only from a server that trusts requests' templates)
TOKENIZE_CHAT = ("messages", "add_generation_prompt", "continue_final_message", "chat_template_kwargs", "tools")
# Bookkeeping that does not change the output; safety_identifier and prompt_cache_key are what the openai
# client tells users of `user`, which it deprecates, to send instead.
IGNORED = {"user", "safety_identifier", "prompt_cache_key", "metadata", "store"}
# OpenAI parameters this server does not implement: refused unless left at their neutral value, never ignored
# (tools and tool_choice only on completions: chat reads them; echo only on chat, where vLLM echoes the last message).
UNSUPPORTED = {"echo", "best_of", "suffix", "tools", "tool_choice", "functions", "function_call",
               "parallel_tool_calls", "modalities", "audio", "prediction", "reasoning_effort", "web_search_options"}

FLAGS = {"echo", "parallel_tool_calls"}  # the unsupported parameters that are true/false
# chat_template_kwargs that are not template variables, refused as vLLM refuses them or fails on them: vLLM (and
# transformers) pass the request's object as keyword arguments of apply_chat_template, where these would choose
# another template, tokenize differently or clash with the messages. add_generation_prompt and
# continue_final_message are the request's own fields (see _template_variables).
RENDER_ARGUMENTS = {
    "chat_template": "the template is the server's (--chat-template chooses it)",
    "tokenize": "the prompt is always tokenized",
    "messages": "send the conversation as 'messages'",
    "conversation": "send the conversation as 'messages'",
    **dict.fromkeys(("padding", "truncation", "max_length", "return_tensors", "return_dict",
                     "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens"),
                    "it is an argument of transformers' tokenization, not a template variable, and this server does "
                    "not take it"),
}
# What a field of the other endpoint or of vLLM's server, unknown or unsupported here, is asked as instead: a client moving
# between them sends these.
INSTEAD = {
    (COMPLETIONS, "top_logprobs"): 'completions ask for the N most probable tokens with "logprobs": N',
    (CHAT, "echo"): 'send the rendered prompt to /v1/completions with "echo": true',
    (COMPLETIONS, "tools"): "send tools to /v1/chat/completions",
    (COMPLETIONS, "tool_choice"): "send tools and tool_choice to /v1/chat/completions",
    # vLLM's guided decoding fields before structured_outputs replaced them (its server no longer reads them)
    **{(endpoint, f"guided_{kind}"): f'send "structured_outputs": {{"{kind}": ...}}, as vLLM does now'
       for endpoint in (COMPLETIONS, CHAT) for kind in ("json", "regex", "choice", "grammar")},
}
# Values that ask for nothing beyond plain text (clients send them by default): as if absent.
NEUTRAL: dict[str, list] = {"tool_choice": ["none"], "modalities": [["text"]],
                             "parallel_tool_calls": [True]}

# The runtime's names for what the API calls otherwise, to name them back in error messages.
RUNTIME_NAMES = {"max_new_tokens": "max_tokens"}
FINISH_REASONS = {"eos": "stop", "stop": "stop", "stop_token": "stop", "max_new_tokens": "length", "context": "length"}
TOOL_CALLS = "tool_calls"  # the finish reason of a reply whose calls were parsed, whatever ended it (vLLM's)


# serve --generation-config: where a request that omits temperature, top_p, top_k, min_p or repetition_penalty gets
# them. vLLM's two modes ("auto": the bundle's generation_config, else OpenAI's defaults; "vllm": OpenAI's defaults alone) and
# "greedy", this server's earlier default (a request without a temperature decodes greedily).
GENERATION_CONFIG_MODES = ("auto", "vllm", "greedy")
# what a generation_config may set that this server has (vLLM's get_diff_sampling_param takes these, and max_new_tokens)
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
OPENAI_DEFAULTS = {"temperature": 1}  # top_p 1, top_k 0, min_p 0 (no limit) and repetition_penalty 1 are the runtime's own
# generation_config values that change nothing here or in vLLM, left out of the start-up line's "not applied"
NEUTRAL_GENERATION = {"do_sample": True, "repetition_penalty": 1, "min_p": 0}


@dataclass(frozen=True)
class Defaults:
    """The temperature, top_p, top_k, min_p and repetition_penalty of requests that omit them, and where they come from
    (in words)."""

    values: dict
    source: str  # e.g. "from the bundle's generation_config"
    ignored: tuple[str, ...] = ()  # generation_config fields not applied, as "name value"

    @property
    def greedy(self) -> bool:
        return self.values.get("temperature", 0) < GREEDY_BELOW

    def __str__(self) -> str:
        """For the start-up line: what requests that omit them get, from where, and what is not applied."""
        given = ", ".join(f"{name} {_json(value)}" for name, value in self.values.items()) or "greedy decoding"
        ignored = f"; generation_config fields not applied: {', '.join(self.ignored)}" if self.ignored else ""
        return f"requests without temperature/top_p/top_k/min_p/repetition_penalty get {given} ({self.source}){ignored}"


def sampling_defaults(generation_config: dict | None, mode: str, min_p: bool = True, penalties: bool = True) -> Defaults:
    """serve's Defaults under --generation-config `mode` for a bundle whose manifest records `generation_config`
    (None: compiled before manifests recorded it). As vLLM's server, a field the request omits (or sends null)
    comes from the model's generation_config, else from OpenAI's defaults; max_new_tokens, which vLLM takes from it
    too, this server does not, and vLLM ignores do_sample (a do_sample false with no temperature samples at 1 there
    too): those are named, never applied. min_p False: the bundle was compiled before min_p
    (SpeculativeDecoder.has_min_p), so its min_p is named too; penalties False, its repetition_penalty alike."""
    if mode == "greedy":
        return Defaults({}, "as --generation-config greedy asks")
    if mode == "vllm":
        return Defaults(dict(OPENAI_DEFAULTS), "OpenAI's defaults, as --generation-config vllm asks")
    if generation_config is None:
        return Defaults(dict(OPENAI_DEFAULTS), "OpenAI's defaults; this bundle was compiled before manifests recorded "
                                               "the generation_config: recompile it to apply its checkpoint's")
    taken, ignored = {}, []
    for name, value in generation_config.items():
        if _same(value, NEUTRAL_GENERATION.get(name, ...)):
            continue
        if name == "min_p" and not min_p:
            ignored.append(f"min_p {_json(value)} (this bundle was compiled before min_p: recompile it to apply it)")
        elif name == "repetition_penalty" and not penalties:
            ignored.append(f"repetition_penalty {_json(value)} (this bundle was compiled before sampling penalties: "
                           "recompile it to apply it)")
        elif name in SAMPLING:
            try:  # the runtime's checks: a value it refuses is named, as a request's would be
                check_sampling(**{name: value})
            except RequestError as exc:
                ignored.append(f"{name} {_json(value)} ({exc})")
                continue
            taken[name] = value
        else:
            ignored.append(f"{name} {_json(value)}")
    taken = {name: taken[name] for name in SAMPLING if name in taken}  # named in one order, whatever the file's
    if "temperature" in taken:
        return Defaults(taken, "from the bundle's generation_config", tuple(ignored))
    source = (f"{', '.join(taken)} from the bundle's generation_config, temperature OpenAI's default" if taken else
              "OpenAI's defaults; the bundle's generation_config sets none of them that apply")
    return Defaults({**OPENAI_DEFAULTS, **taken}, source, tuple(ignored))


def _runtime_value(name: str, value):
    """logit_bias's keys, token ids written as JSON strings, as ints (the runtime names any other key)."""
    if name == "logit_bias" and isinstance(value, dict):
        return {int(key) if isinstance(key, str) and key.isascii() and key.isdecimal() else key: bias
                for key, bias in value.items()}
    return value


def _same(value, neutral) -> bool:
    return value == neutral and (type(value) is bool) == (type(neutral) is bool)  # True == 1, yet no penalty


def _json(value) -> str:
    return json.dumps(value) if isinstance(value, (bool, int, float, str)) or value is None else repr(value)


class ApiError(Exception):
    """An error answered as vLLM answers them: {"error": {"message", "type", "param", "code"}}, its type the name of
    the exception the openai client raises for the status (its _make_status_error), as vLLM's create_error_response
    names its own (BadRequestError, NotFoundError, InternalServerError), for every error alike: vLLM's routing and
    API key typed theirs otherwise ("Not Found", "Unauthorized"), so one status had two types."""

    TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError", 404: "NotFoundError",
             409: "ConflictError", 422: "UnprocessableEntityError", 429: "RateLimitError"}

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers or {}

    @property
    def type(self) -> str:
        return self.TYPES.get(self.status) or ("InternalServerError" if self.status >= 500 else "APIStatusError")

    def body(self) -> dict:
        return {"error": {"message": _utf8(self.message), "type": self.type,
                          "param": None if self.param is None else _utf8(self.param), "code": self.status}}


def _utf8(text: str) -> str:
    """Text that encodes as UTF-8: a message may quote a name from the body, and JSON carries lone surrogates
    ("\\ud800"), which no response can encode; those are written as their escapes."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def unknown_model(name, model: str) -> ApiError:
    return ApiError(404, f"model {name!r} is not served here; this server serves {model!r}", "model")


def invalid(exc: Exception) -> ApiError:
    """A 400 for the runtime's RequestError, its parameter named as the API names it."""
    message = str(exc)
    for runtime_name, api_name in RUNTIME_NAMES.items():
        if message.startswith(runtime_name):
            message = api_name + message[len(runtime_name):]
    # the longest name first: "stop_token_ids ..." is no message about "stop"
    names = sorted((*DECODING, "max_tokens", "logprobs", "prompt_logprobs", "prompt", RESPONSE_FORMAT, "tools"), key=len,
                   reverse=True)
    param = next((name for name in names if message.startswith((name, f"the {name}", f"a {name}"))), None)
    return ApiError(400, message, param)


@dataclass(frozen=True)
class Request:
    """One OpenAI request as the server decodes it."""

    endpoint: str  # COMPLETIONS or CHAT
    prompt: str | list | None  # completions: text or token ids; chat: None (see messages)
    messages: list | None  # chat: the conversation, rendered with the bundle's template
    max_tokens: int | None  # a whole number, checked here; None: until the context is full
    decoding: dict  # temperature, top_p, top_k, seed, stop, gamma, logprobs as the runtime names them
    stream: bool
    include_usage: bool
    # chat: ChatTemplate.render's add_generation_prompt, continue_final_message, variables and tools
    chat: dict = field(default_factory=dict)
    parse_tools: bool = False  # chat: the reply's text is parsed for tool calls (tool_choice "auto")
    parallel_tool_calls: bool = True  # false: the first call alone is answered, as vLLM filters them
    # chat: tool_choice "required" or a named function: how the reply, forced by its grammar, is read as calls
    forced_calls: ToolParser | None = None
    # completions: the reply begins with the prompt's text, and with logprobs its tokens' (decoding's prompt_logprobs)
    echo: bool = False
    # completions sent several prompts: each is `prompt` of a request of its own, answered as a choice each (vLLM's)
    batch: list | None = None
    n: int = 1  # choices for each prompt, each decoded as a request of its own (a seed's choice i: seed + i, as vLLM's)
    # a text prompt's tokens begin (and end) with the tokenizer's special tokens, a BOS say; vLLM's defaults: a
    # completion's yes, a chat's no (its template writes them)
    add_special_tokens: bool = True
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: every chunk carries the usage so far
    return_token_ids: bool = False  # the response carries the prompt's and the reply's token ids
    prompt_logprobs: bool = False  # the response carries the prompt's logprobs (decoding's prompt_logprobs: how many)

    def choices(self) -> list[Request]:
        """A request for each choice, by index: each prompt's n in turn, as vLLM numbers them."""
        seed = self.decoding.get("seed")
        # a seed that is no int (true, "7") is left as sent, for the runtime's check to refuse as with n 1; -1 (a
        # random seed) too, or choice 1 would be seeded 0
        if type(seed) is not int or seed == RANDOM_SEED:
            seed = None
        return [replace(self, prompt=prompt, batch=None, n=1,
                        decoding=self.decoding if seed is None else {**self.decoding, "seed": seed + i})
                for prompt in self.batch or [self.prompt] for i in range(self.n)]


def parse(endpoint: str, raw: bytes, model: str, defaults: Defaults, tool_parser: str | None = None) -> Request:
    """The request `raw` as this server decodes it; `tool_parser` is serve's --tool-call-parser (None: none)."""
    body = _json_object(raw)
    for name, value in body.items():
        instead = f"; {INSTEAD[endpoint, name]}" if (endpoint, name) in INSTEAD else ""
        if name in UNSUPPORTED - FIELDS[endpoint] and not _neutral(name, value):
            raise ApiError(400, f"'{name}' is not supported by this server{instead}", name)
        if name not in FIELDS[endpoint] | IGNORED | UNSUPPORTED:
            raise ApiError(400, f"unrecognized request argument: '{name}'{instead}", name)
    if body.get("model") not in (None, model):
        raise unknown_model(body["model"], model)
    n = 1 if body.get("n") is None else body["n"]
    if type(n) is not int or n < 1:
        raise ApiError(400, f"n must be a whole number of choices, 1 or more, not {_json(n)}", "n")
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict)):
        raise ApiError(400, "stream_options is an object, allowed only with stream: true", "stream_options")
    if unknown := sorted(set(options or {}) - STREAM_OPTIONS):
        raise ApiError(400, f"unrecognized stream_options argument: '{unknown[0]}'", "stream_options")
    # vLLM's StreamOptions: an object sent asks for the usage chunk unless it says otherwise (include_usage absent is
    # true, null false, as vLLM reads it), and its continuous_usage_stats (with that chunk only) for the usage so far
    # in every chunk
    include_usage = continuous_usage = False
    if options is not None:
        include_usage = _flag(options, "include_usage", "stream_options.include_usage", "include_usage" not in options)
        continuous_usage = include_usage and _flag(options, "continuous_usage_stats",
                                                   "stream_options.continuous_usage_stats")
    add_special_tokens = _flag(body, "add_special_tokens", default=endpoint == COMPLETIONS)
    tracing = {"return_token_ids": _flag(body, "return_token_ids"), **_prompt_logprobs(body, stream)}
    _default_only(body)
    decoding = {name: _runtime_value(name, body[name]) for name in DECODING if body.get(name) is not None}
    # Where the default temperature is greedy, a top_p, top_k or min_p that asks for a restriction would be ignored,
    # so it is refused, as the command line refuses it. (Values out of range are left to the runtime's checks,
    # which name the range.)
    top_p, top_k, min_p = decoding.get("top_p", 1), decoding.get("top_k", 0), decoding.get("min_p", 0)
    shaping = (["top_p"] * (type(top_p) in (int, float) and 0 < top_p < 1) + ["top_k"] * (type(top_k) is int and top_k > 0)
               + ["min_p"] * (type(min_p) in (int, float) and 0 < min_p <= 1))
    if "temperature" not in decoding and shaping and defaults.greedy:
        raise ApiError(400, f"{shaping[0]} shapes sampling, and without a temperature this server decodes greedily "
                            f"({defaults.source}; OpenAI's default is 1): send a temperature too, e.g. 1", shaping[0])
    decoding = {**defaults.values, **decoding, **_logprobs(endpoint, body), **_response_format(body)}
    if tracing["prompt_logprobs"]:
        decoding["prompt_logprobs"] = body["prompt_logprobs"]
    max_tokens = _first_given(body, *(["max_completion_tokens"] if endpoint == CHAT else []), "max_tokens")
    for name in ("max_completion_tokens", "max_tokens") if endpoint == CHAT else ():
        try:  # checked here, where its own name is known (the runtime's errors say max_tokens), both if both given
            if body.get(name) is not None:
                whole(name, body[name], low=1)
        except RequestError as exc:
            raise ApiError(400, str(exc), name) from None
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS[endpoint]
    if endpoint == CHAT:
        if "messages" not in body:
            raise ApiError(400, "'messages' is required", "messages")
        generation_prompt = _flag(body, "add_generation_prompt", default=True)
        continue_final = _flag(body, "continue_final_message")
        if generation_prompt and continue_final:  # transformers refuses both; vLLM answers that 400 too
            raise ApiError(400, "continue_final_message and add_generation_prompt cannot both be true (a new assistant "
                                "turn, or the last message continued); add_generation_prompt is true unless sent "
                                "false: send \"add_generation_prompt\": false with it", "continue_final_message")
        tools, parse_tools, forced, grammar = _tools(body, tool_parser)
        if grammar is not None:
            if "structured_outputs" in decoding:  # vLLM refuses both too
                asked = "structured_outputs" if body.get("structured_outputs") is not None else RESPONSE_FORMAT
                which = "\"required\"" if body["tool_choice"] == "required" else "naming a function"
                raise ApiError(400, f"tool_choice {which} forces the reply's format, and {asked} asks for another: "
                                    "send one of them", "tool_choice")
            decoding["structured_outputs"] = grammar
        chat = {"add_generation_prompt": generation_prompt, "continue_final_message": continue_final,
                "variables": _template_variables(body, generation_prompt, continue_final), "tools": tools}
        return Request(CHAT, None, body["messages"], max_tokens, decoding, stream, include_usage, chat, parse_tools,
                       _flag(body, "parallel_tool_calls", default=True), n=n, add_special_tokens=add_special_tokens,
                       forced_calls=forced, continuous_usage=continuous_usage, **tracing)
    echo = _flag(body, "echo")
    # checked here, not by the runtime: its bounds speak of its Python API, where prompt_logprobs allows 0 tokens,
    # which this endpoint's prompt_logprobs does not (echo does)
    try:
        whole("max_tokens", max_tokens)
    except RequestError as exc:
        raise ApiError(400, str(exc), "max_tokens") from None
    if max_tokens < (0 if echo else 1):
        raise ApiError(400, "max_tokens must be >= 1, or 0 with echo: true (the prompt alone, with logprobs scored), "
                            f"not {max_tokens}", "max_tokens")
    if echo and ("logprobs" in decoding or max_tokens == 0):  # max_tokens 0: the runtime's scoring, shown or not
        # vLLM's: a prompt_logprobs N sent scores the prompt (a stream's 0 too; its text's logprobs then hold N
        # alternatives at most), else the logprobs N, and a whole response shows them as prompt_logprobs too
        sent = body.get("prompt_logprobs")
        decoding.setdefault("prompt_logprobs", decoding.get("logprobs", 0) if sent is None else sent)
        tracing["prompt_logprobs"] |= "logprobs" in decoding and not stream
    prompts = _prompts(body)
    return Request(COMPLETIONS, prompts[0] if len(prompts) == 1 else None, None, max_tokens, decoding, stream,
                   include_usage, echo=echo, batch=prompts if len(prompts) > 1 else None, n=n,
                   add_special_tokens=add_special_tokens, continuous_usage=continuous_usage, **tracing)


def _prompt_logprobs(body: dict, stream: bool) -> dict:
    """{"prompt_logprobs": whether the response shows them}: vLLM's prompt_logprobs N (checked by the runtime), refused
    on a stream but for 0, which a stream answers without them as vLLM's does."""
    value = body.get("prompt_logprobs")
    if value is not None and stream and not (type(value) is int and value == 0):
        raise ApiError(400, "prompt_logprobs are not available with stream: true (as in vLLM): send the request "
                            "unstreamed", "prompt_logprobs")
    return {"prompt_logprobs": value is not None and not stream}


def _response_format(body: dict) -> dict:
    """OpenAI's response_format as the runtime's structured_outputs (grammar.py), as vLLM reads it, compiled by the
    request's check on the checking thread:
    {"type": "json_object"} any JSON object, {"type": "json_schema", "json_schema": {"name", "schema", "strict"}} that
    schema; {"type": "text"} (or none) nothing."""
    value = body.get(RESPONSE_FORMAT)
    kind = value.get("type") if isinstance(value, dict) else None
    if value is None or kind == "text" and len(value) == 1:
        return {}
    spec = value.get("json_schema") if kind == "json_schema" else None
    if kind == "json_object" and len(value) == 1:
        structured = {"json_object": True}
    elif isinstance(spec, dict) and isinstance(spec.get("schema"), dict):
        structured = {"json": spec["schema"]}
    else:
        raise ApiError(400, 'response_format must be {"type": "text"}, {"type": "json_object"} or {"type": '
                            '"json_schema", "json_schema": {"name": ..., "schema": {...}}}, not ' + _json(value),
                       RESPONSE_FORMAT)
    if body.get("structured_outputs") is not None:
        raise ApiError(400, "response_format and structured_outputs both ask for a format: send one of them",
                       RESPONSE_FORMAT)
    return {"structured_outputs": Unchecked(structured, RESPONSE_FORMAT)}


def _known_fields(body: dict, fields: set[str], model: str) -> None:
    """Refuses a field outside `fields` and another model's name."""
    if unknown := sorted(set(body) - fields):
        raise ApiError(400, f"unrecognized request argument: '{unknown[0]}'", unknown[0])
    if body.get("model") not in (None, model):
        raise unknown_model(body["model"], model)


@dataclass(frozen=True)
class Tokenize:
    """A /tokenize request, as vLLM's: a prompt (special tokens added unless add_special_tokens is false), or chat
    messages rendered as a chat completion's (special tokens from the template alone unless it is true)."""

    prompt: str | None
    messages: list | None
    add_special_tokens: bool
    token_strs: bool  # return_token_strs: each token's vocabulary entry too
    chat: dict = field(default_factory=dict)  # ChatTemplate.render's options, as Request.chat


def parse_tokenize(raw: bytes, model: str) -> Tokenize:
    body = _json_object(raw)
    chat = "messages" in body
    fields = {"model", "add_special_tokens", "return_token_strs", *(TOKENIZE_CHAT if chat else ("prompt",))}
    if chat and "prompt" in body:
        raise ApiError(400, "send 'prompt' or 'messages', not both", "prompt")
    if body.get("chat_template") is not None:  # vLLM takes it only from a server started --trust-request-chat-template
        raise ApiError(400, "a request's chat_template is not taken: the server's is rendered (its --chat-template)",
                       "chat_template")
    _known_fields({name: value for name, value in body.items() if name != "chat_template"}, fields, model)
    add_special_tokens = _flag(body, "add_special_tokens", default=not chat)
    token_strs = _flag(body, "return_token_strs")
    if not chat:
        if not isinstance(body.get("prompt"), str):
            raise ApiError(400, "prompt must be a string (or send 'messages' to tokenize a chat)", "prompt")
        try:  # half a surrogate pair, which JSON carries, no tokenizer takes
            utf8("prompt", body["prompt"])
        except RequestError as exc:
            raise invalid(exc) from None
        return Tokenize(body["prompt"], None, add_special_tokens, token_strs)
    generation_prompt = _flag(body, "add_generation_prompt", default=True)
    continue_final = _flag(body, "continue_final_message")
    if generation_prompt and continue_final:
        raise ApiError(400, "continue_final_message and add_generation_prompt cannot both be true; send "
                            "\"add_generation_prompt\": false with it", "continue_final_message")
    try:
        tools = checked_tools(body.get("tools"))
    except ValueError as exc:
        raise ApiError(400, str(exc), "tools") from None
    return Tokenize(None, body["messages"], add_special_tokens, token_strs,
                    {"add_generation_prompt": generation_prompt, "continue_final_message": continue_final,
                     "variables": _template_variables(body, generation_prompt, continue_final), "tools": tools})


def parse_detokenize(raw: bytes, model: str, vocab_size: int) -> list[int]:
    """The token ids of a /detokenize request, each one of the vocabulary's."""
    body = _json_object(raw)
    _known_fields(body, {"model", "tokens"}, model)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t < vocab_size for t in tokens):
        raise ApiError(400, f"tokens must be a list of token ids, each from 0 to {vocab_size - 1}", "tokens")
    return tokens


def _json_object(raw: bytes) -> dict:
    """The request body, a JSON object, or a 400 that says what is wrong with it."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON ({exc})") from None
    except ValueError:  # int() refuses a literal longer than Python's limit (sys.get_int_max_str_digits)
        raise ApiError(400, f"the request body holds a number of more than {sys.get_int_max_str_digits()} digits, "
                            "far beyond what any field takes; send a smaller number") from None
    except RecursionError:
        raise ApiError(400, "the request body nests JSON too deeply; send a flatter body") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def _default_only(body: dict) -> None:
    """Refuses a DEFAULT_ONLY field given any value but its default (null is absent)."""
    value = body.get("spaces_between_special_tokens")
    if value is not None and value is not True:
        raise ApiError(400, f"spaces_between_special_tokens {_json(value)} is not supported by this server (its "
                            "tokenizer decodes special tokens one way); send true or leave it out",
                       "spaces_between_special_tokens")


def _logprobs(endpoint: str, body: dict) -> dict:
    """{"logprobs": the alternatives to show beside each token} where the request asks for logprobs, else {}:
    completions' `logprobs` N (checked by the runtime), chat's `logprobs: true` with `top_logprobs` N (0 if absent)."""
    if endpoint == COMPLETIONS:  # false (0 == False: by identity), which this server took for none before, stays none
        value = body.get("logprobs")
        return {} if value is None or value is False else {"logprobs": value}
    if type(body.get("logprobs")) is int:  # completions' form, N alternatives, which chat spells otherwise
        raise ApiError(400, f"chat's logprobs is true or false, not {body['logprobs']}: send \"logprobs\": true, "
                            f"\"top_logprobs\": {body['logprobs']} for the {body['logprobs']} most probable tokens", "logprobs")
    wanted, top = _flag(body, "logprobs"), body.get("top_logprobs")
    if top is not None:
        try:
            whole("top_logprobs", top, low=0, high=MAX_LOGPROBS)
        except RequestError as exc:
            raise ApiError(400, str(exc), "top_logprobs") from None
        if not wanted:  # vLLM's refusal: top_logprobs alone would be ignored
            raise ApiError(400, "top_logprobs needs logprobs: send \"logprobs\": true with it", "top_logprobs")
    return {"logprobs": top or 0} if wanted else {}


def _tools(body: dict, tool_parser: str | None) -> tuple[list[dict] | None, bool, ToolParser | None, Unchecked | None]:
    """The tools the chat template shows, whether the reply is parsed for calls by --tool-call-parser, and the parser
    and grammar of a call the request forces, as vLLM decides them: tool_choice is "auto" where tools are sent
    without one (else "none"); "none" shows the tools all the same (vLLM's default) and leaves the reply as text;
    "auto" parses it, which needs the server's --tool-call-parser. "required" and a named function force the reply
    with a JSON schema made from the tools (tools.required_schema, or the function's parameters), which the request's
    check compiles, and read it as JSON, which needs no parser ("required" with tools [] is "none", as vLLM and OpenAI take it)."""
    try:
        tools = checked_tools(body.get("tools"))
    except ValueError as exc:
        raise ApiError(400, str(exc), "tools") from None
    choice = body.get("tool_choice")
    if choice in (None, "", [], {}):  # as absent, as the other fields' empty values are (clients send them)
        choice = "auto" if tools else "none"
    if choice == "none" or choice == "required" and body.get("tools") == []:
        return tools, False, None, None
    function = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    named = isinstance(function, dict)
    if choice not in ("auto", "required") and not named:
        raise ApiError(400, f"tool_choice must be \"none\", \"auto\", \"required\" or {{\"type\": \"function\", "
                            f"\"function\": {{\"name\": ...}}}}, not {_json(choice)}", "tool_choice")
    if not tools:
        raise ApiError(400, f"tool_choice {_json(choice)} needs tools: send them as 'tools' (a list of functions), "
                            "as vLLM asks", "tool_choice")
    if choice == "required":
        try:
            schema = required_schema(tools)
        except ValueError as exc:
            raise ApiError(400, str(exc), "tools") from None
        parts = tuple(_forced_grammar(tool["function"]["parameters"], f"tools[{index}].function.parameters")
                      for index, tool in enumerate(tools) if tool["function"].get("parameters"))
        return tools, False, REQUIRED, Unchecked({"json": schema}, "tools", parts)
    if isinstance(function, dict):  # named
        return tools, False, *_named(function.get("name"), tools)
    if tool_parser is None:
        raise ApiError(400, "\"auto\" tool choice (the default where tools are sent) needs the server to parse the "
                            f"reply's tool calls: start it with --tool-call-parser {'|'.join(PARSERS)}, the "
                            "model's format (vLLM's --enable-auto-tool-choice --tool-call-parser ...), or send "
                            "\"tool_choice\": \"none\" to show the tools and get text, or \"required\" to force a call",
                     "tool_choice" if "tool_choice" in body else "tools")
    return tools, True, None, None


def _named(name, tools: list[dict]) -> tuple[ToolParser, Unchecked]:
    """A tool_choice naming function `name`: its parser, and the grammar of its parameters."""
    names = [tool["function"]["name"] for tool in tools]
    if name not in names:
        raise ApiError(400, f"tool_choice names the function {_json(name)}, which is not among the tools "
                            f"({', '.join(names)}): name one of them", "tool_choice")
    index = names.index(name)
    parameters = tools[index]["function"].get("parameters") or NO_PARAMETERS
    return named_parser(name), _forced_grammar(parameters, f"tools[{index}].function.parameters")


def _forced_grammar(schema: dict, field: str) -> Unchecked:
    """The grammar of a forced call, for the request's check to compile; a schema llguidance cannot compile is a 400
    that names `field` (invalid: its param "tools")."""
    return Unchecked({"json": schema}, field)


def _first_given(body: dict, *names: str):
    return next((body[name] for name in names if body.get(name) is not None), None)


def _neutral(name: str, value) -> bool:
    """Whether an unsupported parameter is left as if absent (`"echo": null`, `"best_of": 1`, ...)."""
    if value in NEUTRAL.get(name, []) and type(value) not in (int, float):  # True == 1 == 1.0: only the values listed
        return True
    if type(value) in (int, float):
        return value == (1 if name == "best_of" else 0)
    if type(value) is bool:  # false is absent only where the parameter is a flag; a number given false is wrong
        return not value and name in FLAGS
    return value in (None, "", [], {})


def _prompts(body: dict) -> list:
    """The prompts, each text or token ids: `prompt` is one of those or a list of them (a batch, as lm-evaluation-harness
    sends batch_size of them), as OpenAI's and vLLM's APIs take it."""
    prompt = body.get("prompt")
    prompts = prompt if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt) else [prompt]
    if not all(isinstance(p, str) or (isinstance(p, list) and not any(isinstance(t, (str, list)) for t in p))
               for p in prompts):
        raise ApiError(400, "prompt must be a string or a list of token ids, or a list of those", "prompt")
    return prompts


def _flag(body: dict, name: str, param: str | None = None, default: bool = False) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise ApiError(400, f"{param or name} must be true or false, not {value!r}", param or name)
    return default if value is None else value


def _template_variables(body: dict, generation_prompt: bool, continue_final: bool) -> dict:
    """chat_template_kwargs: variables the chat template sees besides the messages (Qwen3's enable_thinking), as
    vLLM takes them; over the special tokens', as transformers lets them. A variable the template does not read
    changes nothing (vLLM drops those)."""
    variables = body.get("chat_template_kwargs")
    if variables is None:
        return {}
    if not isinstance(variables, dict):
        raise ApiError(400, "chat_template_kwargs must be an object of chat template variables, e.g. "
                            "{\"enable_thinking\": false}", "chat_template_kwargs")
    flags = {"add_generation_prompt": generation_prompt, "continue_final_message": continue_final}
    for name, value in variables.items():
        if name in RENDER_ARGUMENTS:
            raise ApiError(400, f"chat_template_kwargs may not set '{name}': {RENDER_ARGUMENTS[name]}",
                           "chat_template_kwargs")
        # vLLM renders with the request's own field (its default where absent) whatever this says: a value that
        # agrees changes nothing, one that differs would be ignored there, so it is refused here.
        if name in flags and not (type(value) is bool and value == flags[name]):
            raise ApiError(400, f"chat_template_kwargs.{name} is {_json(value)}, but the request's {name} is "
                                f"{_json(flags[name])} and wins, as in vLLM: send \"{name}\": {_json(value)} as a "
                                "request field instead", "chat_template_kwargs")
        if name == "tools" and value not in (None, []):  # unchecked there, and the reply's calls would go unparsed
            raise ApiError(400, "chat_template_kwargs.tools is not taken: send the tools as the request's 'tools' "
                                "field", "chat_template_kwargs")
    return {name: value for name, value in variables.items() if name not in flags}


T = TypeVar("T")


def never() -> None:
    """The halt() of a build nobody stops: see dumps."""


class Logprobs:
    """A request's TokenLogprobs in OpenAI's shapes, as vLLM writes them: each token's text is its id decoded alone,
    special tokens as written, and each logprob floored (-inf and NaN written -9999.0, logprobs.floored), so that a
    stream's chunks are valid JSON as a whole response is. Completions: the legacy object, whose top_logprobs map the
    N most probable tokens' texts (N: the request's) and the chosen token's (up to N + 1, as OpenAI's API says) to
    their logprobs, and text_offset says where each token's text begins, counted over the tokens' texts from `offset`
    (a stream's chunk: the text sent before it). Chat: `content` entries with each token's UTF-8 bytes, whose
    top_logprobs are the N most probable tokens, the most probable first (vLLM lists the chosen token first, then
    fewer of the others: OpenAI's shape is taken)."""

    def __init__(self, endpoint: str, tokenizer: Tokenizer):
        self.endpoint = endpoint
        # the tokens' N most probable repeat the same ids, each decoded once a response (N + 1 texts a token)
        self._text = cache(lambda token: tokenizer.decode([token], skip_special_tokens=False))

    def of(self, records: Sequence[TokenLogprobs], offset: int = 0, unscored: Sequence[int] = (),
           halt: Callable[[], None] = never) -> dict:
        """unscored: token ids before the records', without logprobs (an echoed prompt's first: nothing precedes it),
        whose entries are null as vLLM writes them. halt() is called before each token's texts (see dumps)."""
        if self.endpoint == CHAT:
            return {"content": [{**self._entry(r.token_id, r.logprob),
                                 "top_logprobs": [self._entry(token, logprob) for token, logprob in r.top]}
                                for r in halting(records, halt)]}
        tokens = [self._text(token) for token in halting((*unscored, *(r.token_id for r in records)), halt)]
        return {"tokens": tokens,
                "token_logprobs": [None] * len(unscored) + [floored(r.logprob) for r in records],
                "top_logprobs": [None] * len(unscored) + [{self._text(token): floored(logprob)
                                                         for token, logprob in ((r.token_id, r.logprob), *r.top)}
                                                        for r in halting(records, halt)],
                "text_offset": list(itertools.accumulate(map(len, tokens), initial=offset))[:len(tokens)]}

    def prompt(self, records: Sequence[TokenLogprobs], halt: Callable[[], None] = never) -> list:
        """vLLM's prompt_logprobs: null for the first prompt token, then for each other one an object from token ids
        to their {"logprob", "rank", "decoded_token"}: the prompt's token first, then the N most probable (ranks 1 to
        N; the prompt's token once, where it is among them). halt(): as of's."""
        def entry(token: int, logprob: float, rank: int) -> dict:
            return {"logprob": floored(logprob), "rank": rank, "decoded_token": self._text(token)}
        return [None, *({str(r.token_id): entry(r.token_id, r.logprob, r.rank),
                         **{str(token): entry(token, logprob, rank) for rank, (token, logprob) in enumerate(r.top, 1)}}
                        for r in halting(records, halt))]

    def _entry(self, token: int, logprob: float) -> dict:
        text = self._text(token)
        return {"token": text, "logprob": floored(logprob), "bytes": list(text.encode("utf-8", "replace"))}


class Answer(NamedTuple):
    """One choice's reply, whole: what Reply.batch answers for it."""

    text: str
    stats: Stats
    records: Sequence[TokenLogprobs] = ()  # its tokens' logprobs, where asked for
    unscored: Sequence[int] = ()  # see Logprobs.of
    token_ids: Sequence[int] | None = None  # its tokens' ids (return_token_ids)
    prompt_ids: Sequence[int] | None = None  # its prompt's token ids (return_token_ids)
    prompt_records: Sequence[TokenLogprobs] | None = None  # its prompt's tokens' after the first (prompt_logprobs)


class Reply:
    """Builds the bodies of one request's response: a whole one, or stream chunks. With `tool_parser` (a chat whose
    tool_choice is "auto": serve's --tool-call-parser), the text's tool calls are parsed out of it by that parser
    (see tools.py); a stream's text goes through `tool_stream`, and its calls come as tool_calls_chunk. Without
    `parallel_tool_calls`, the first call alone is answered (a model asked for one may write more: vLLM keeps the
    first). With `logprobs` (the request asks for them), each choice carries the logprobs of its tokens. With
    `token_ids` (return_token_ids), a response carries its prompt's and its tokens' ids (see traced), and with
    `prompt_logprobs` (asked for, unstreamed) its prompt's logprobs (Logprobs.prompt), as vLLM's; every whole response
    has those fields, null where not asked for, as vLLM's."""

    def __init__(self, endpoint: str, model: str, tool_parser: ToolParser | None = None,
                 parallel_tool_calls: bool = True, logprobs: Logprobs | None = None, token_ids: bool = False,
                 prompt_logprobs: Logprobs | None = None):
        self.endpoint, self.model = endpoint, model
        self.id = ("chatcmpl-" if endpoint == CHAT else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.tool_parser = tool_parser
        self.calls_finish = tool_parser is not None and tool_parser.calls_finish  # see ToolParser
        self.index = 0  # the choice a stream's chunks are of (see choice)
        self.parse_calls = tool_parser.parse if tool_parser else None
        self.tool_stream = tool_parser.stream() if tool_parser else None
        self.most_calls = None if parallel_tool_calls else 1
        self.logprobs = logprobs
        self.token_ids = token_ids
        self.prompt_logprobs = prompt_logprobs
        self.sent = 0  # characters of text streamed so far (completions' text_offset)
        self.calls_sent = 0  # a stream's calls so far, those past most_calls counted too

    def choice(self, index: int) -> Reply:
        """The chunks of choice `index` of the same stream, with its own text offsets and tool calls."""
        other = Reply(self.endpoint, self.model, self.tool_parser, self.most_calls is None, self.logprobs, self.token_ids,
                      self.prompt_logprobs)
        other.id, other.created, other.index = self.id, self.created, index
        return other

    def whole(self, text: str, stats: Stats, records: Sequence[TokenLogprobs] = (), unscored: Sequence[int] = ()) -> dict:
        """unscored: see Logprobs.of."""
        return self.batch([Answer(text, stats, records, unscored)])

    def batch(self, answers: Sequence[Answer], n: int = 1, halt: Callable[[], None] = never) -> dict:
        """The response to several prompts (completions) or choices (n of each prompt in turn): a choice each, by index,
        and the usage of them all, as vLLM's. A chat's prompt fields are its first answer's (every choice has its
        prompt). halt() is called before each token's logprobs texts (see Logprobs.of)."""
        choices = [self._choice(index, answer, halt) for index, answer in enumerate(answers)]
        prompt = {} if self.endpoint != CHAT else {"prompt_logprobs": self._scores(answers[0].prompt_records, halt),
                                                   "prompt_token_ids": self._ids(answers[0].prompt_ids)}
        return {**self._head("chat.completion" if self.endpoint == CHAT else "text_completion"),
                "choices": choices, "usage": usage(*(answer.stats for answer in answers), n=n), **prompt}

    def _choice(self, index: int, answer: Answer, halt: Callable[[], None]) -> dict:
        stats = answer.stats
        finish = FINISH_REASONS[stats.finish_reason]
        logprobs = self.logprobs.of(answer.records, unscored=answer.unscored, halt=halt) if self.logprobs else None
        traced = {"token_ids": self._ids(answer.token_ids)}
        if self.endpoint == CHAT:
            # No "tool_calls" where there are none, as vLLM since vllm-project/vllm#44105: the openai client reads
            # an empty list as a reply that calls tools, and its callers index it
            content, calls = self.parse_calls(answer.text) if self.parse_calls else (answer.text, [])
            message = {"role": "assistant", "content": content, **({TOOL_CALLS: calls[:self.most_calls]} if calls else {})}
            if calls and self.calls_finish:
                finish = TOOL_CALLS
            return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish,
                    "stop_reason": stats.stop_reason, **traced}
        return {"index": index, "text": answer.text, "logprobs": logprobs, "finish_reason": finish,
                "stop_reason": stats.stop_reason, **traced, "prompt_logprobs": self._scores(answer.prompt_records, halt),
                "prompt_token_ids": self._ids(answer.prompt_ids)}

    def _ids(self, ids: Sequence[int] | None) -> list[int] | None:
        return list(ids) if self.token_ids and ids is not None else None

    def _scores(self, records: Sequence[TokenLogprobs] | None, halt: Callable[[], None]) -> list | None:
        """None where not asked for: an echo's prompt is scored for its text's logprobs alone with max_tokens 0."""
        return None if records is None or self.prompt_logprobs is None else self.prompt_logprobs.prompt(records, halt)

    def traced(self, chunk: dict, token_ids: Sequence[int] = (), prompt_ids: Sequence[int] | None = None) -> dict:
        """A stream's chunk with return_token_ids' fields, as vLLM's: the ids of the tokens read since the last chunk,
        and the prompt's (`prompt_ids`: this is the first chunk of its choice) at the top of a chat's first chunk,
        in a completion's choice; null where not asked for, as vLLM writes them (a chat's first chunk has no
        token_ids)."""
        if prompt_ids is not None and self.endpoint == CHAT:
            return {**chunk, "prompt_token_ids": self._ids(prompt_ids)}  # its role's chunk, before any token
        [choice] = chunk["choices"]
        choice["token_ids"] = self._ids(token_ids)
        if prompt_ids is not None:
            choice["prompt_token_ids"] = self._ids(prompt_ids)
        return chunk

    def chunk(self, text: str | None = None, stats: Stats | None = None, first: bool = False,
              called: bool = False, records: Sequence[TokenLogprobs] = (), unscored: Sequence[int] = (),
              halt: Callable[[], None] = never) -> dict:
        """A delta of text and the logprobs of the tokens `records` (those decoded since the last chunk; unscored and
        halt: see Logprobs.of); with `stats`, the closing chunk that carries the finish reason ("tool_calls" where
        `called`: tool calls were sent)."""
        called = called and self.calls_finish
        finish = (TOOL_CALLS if called else FINISH_REASONS[stats.finish_reason]) if stats else None
        stop_reason = stats.stop_reason if stats else None
        logprobs = self.logprobs.of(records, self.sent, unscored, halt) if self.logprobs and not first else None
        if self.endpoint == CHAT:
            delta = {"role": "assistant", "content": ""} if first else {} if text is None else {"content": text}
            choice = {"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            # vLLM sets a chat chunk's stop_reason on its closing chunk alone, and writes no field it did not set
            return {**self._head("chat.completion.chunk"),
                    "choices": [{**choice, "stop_reason": stop_reason} if stats else choice]}
        self.sent += len(text or "")
        # vLLM writes its stream choice's every field, return_token_ids' null where not asked for or not this chunk's
        choice = {"index": self.index, "text": text or "", "logprobs": logprobs, "finish_reason": finish,
                  "stop_reason": stop_reason, "prompt_token_ids": None, "token_ids": None}
        return {**self._head("text_completion"), "choices": [choice]}

    def tool_calls_chunk(self, calls: list[dict], records: Sequence[TokenLogprobs] = ()) -> dict | None:
        """A chat stream's next tool calls, each a call (with its id) or more arguments of the call before it (without
        one), in one delta whose "index", counted over the stream, tells the client's accumulator which call, with
        the logprobs of the tokens `records` (those whose text the calls hold); None where none is to be sent."""
        deltas = []
        for call in calls:
            self.calls_sent += "id" in call
            if self.most_calls is None or self.calls_sent <= self.most_calls:
                deltas.append({"index": self.calls_sent - 1, **call})
        if not deltas:
            return None
        delta = {TOOL_CALLS: deltas}
        logprobs = self.logprobs.of(records) if self.logprobs else None
        return {**self._head("chat.completion.chunk"),
                "choices": [{"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": None}]}

    def usage_chunk(self, *stats: Stats, n: int = 1) -> dict:
        """stream_options.include_usage: a last chunk with no choices and the usage of every choice (see usage)."""
        kind = "chat.completion.chunk" if self.endpoint == CHAT else "text_completion"
        return {**self._head(kind), "choices": [], "usage": usage(*stats, n=n)}

    def _head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}


def usage(*stats: Stats, n: int = 1) -> dict:
    """OpenAI's usage of one request's choices, `n` a prompt in turn: each prompt counted once, as vLLM counts it;
    prompt_tokens_details.cached_tokens as OpenAI and vLLM report a prompt's cached prefix (its first choice's)."""
    prompts, generated = stats[::n], sum(s.generated_tokens for s in stats)
    prompt = sum(s.prompt_tokens for s in prompts)
    return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated,
            "prompt_tokens_details": {"cached_tokens": sum(s.cached_prompt_tokens for s in prompts)}}


# Characters str.splitlines() breaks at that JSON leaves raw: clients that read events with it (httpx's
# iter_lines, and httpx-sse over it) would cut an event inside a string holding one.
LINE_BREAKS = {"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"}


def sse(payload: dict | str, encode: Callable[..., str] = json.dumps) -> bytes:
    """One server-sent event: `data: <json>` (or `data: [DONE]`) and a blank line. encode: dumps for a chunk built off
    the event loop; on it, a piece at a time only costs more (a token's chunk with logprobs 5: 115 µs vs 12.5)."""
    data = payload if isinstance(payload, str) else encode(payload, ensure_ascii=False)
    # str.replace, not str.translate: translate took ~0.15 s, the GIL held, for an echoed prompt's 3 MB of logprobs
    for line_break, escaped in LINE_BREAKS.items():
        data = data.replace(line_break, escaped)
    return f"data: {data}\n\n".encode()


LONG_LIST = 64  # a list that dumps encodes an item a call: a response's tokens', a prompt's (an item each)
SCALARS_A_CALL = 4096  # a long list of numbers or strings (/tokenize's), encoded this many a call: ~1 ms each


def dumps(value, halt: Callable[[], None] = never, **options) -> str:
    """json.dumps(value, **options), a list of LONG_LIST items or more encoded an item a call,
    the dicts and lists around it taken apart to reach it: json's C encoder holds the GIL through a call, so a
    response's logprobs (megabytes: ~0.1 s for a 4096-token prompt's at prompt_logprobs 20) encoded in another thread
    stalled the event loop all the same. Between calls the loop gets its turn, and halt() is called: it raises to stop
    the encoding of a response whose client has left (app.Server._off_loop)."""
    halt()
    between, colon = options.get("separators") or (", ", ": ")
    if isinstance(value, dict):
        return "{" + between.join(_key(key, options) + colon + dumps(inner, halt, **options)
                                  for key, inner in value.items()) + "}"
    if isinstance(value, list):
        if len(value) < LONG_LIST:
            return "[" + between.join(dumps(item, halt, **options) for item in value) + "]"
        if not any(isinstance(item, (dict, list)) for item in value):
            # an item a call took 14 times as long as one call (1.7 s for a 291k-token prompt's ids and texts)
            pieces = (json.dumps(value[start:start + SCALARS_A_CALL], **options)[1:-1]
                      for start in range(0, len(value), SCALARS_A_CALL))
        else:
            pieces = (json.dumps(item, **options) for item in value)
        return "[" + between.join(halting(pieces, halt)) + "]"
    return json.dumps(value, **options)


def halting(items: Iterable[T], halt: Callable[[], None]) -> Iterator[T]:
    """items, halt() called before each: a build's loop that its client leaving stops (see dumps)."""
    for item in items:
        halt()
        yield item


def _key(key, options: dict) -> str:
    """A dict's key as json.dumps writes it: a number, true, false or null as a string of its JSON ({1: x} as
    {"1": x}, not the invalid {1: x})."""
    if key is None or isinstance(key, (int, float)):
        key = json.dumps(key, allow_nan=options.get("allow_nan", True))
    elif not isinstance(key, str):
        raise TypeError(f"keys must be str, int, float, bool or None, not {type(key).__name__}")  # json.dumps's words
    return json.dumps(key, **options)
