"""Structured outputs (guided decoding), as vLLM's `guidance` backend does them: a request's JSON schema, JSON object,
regular expression, choice or grammar compiled by llguidance, whose matcher gives each step the tokens it allows.

Exact under speculative decoding: a verification call's row j decides the token after the accepted ones and drafts
0..j-1, so Guide.masks advances the matcher through the drafts on the host, takes the mask of each state, and rolls
back. A draft the grammar refuses gets -inf in its own row, so the target rejects it (greedy: it is no argmax;
sampled: p = 0), and the rows after it decide nothing. The draft proposes under the same grammar, one step a call
(decode.SpeculativeDecoder._draft): unmasked, it would propose what the grammar refuses, and fewer drafts would hold.
Either way the output is the target's under the mask: what q the draft samples from does not change it."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import llguidance
import llguidance.numpy
import numpy as np

from .errors import RequestError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

# vLLM's StructuredOutputsParams fields, one of which a request sets (its `json_object` is true or absent), and its
# option for JSON: no whitespace but what the JSON needs.
KINDS = ("json", "regex", "choice", "grammar", "json_object")
COMPACT = "disable_any_whitespace"


@dataclass(frozen=True)
class Structured:
    """A checked request's grammar: llguidance's serialized form, and which field asked for it (for messages). Its
    compiled matcher lives in the decoder's cache (Grammars), not here: a queued request holds its text alone."""

    grammar: str
    field: str


@dataclass(frozen=True)
class Unchecked:
    """A structured_outputs value sent under another field's name (serve's response_format, or the schema of a call
    its tool_choice forces), left for the request's check to compile: llguidance takes ~0.1 s a MB of schema (2 busy
    CPU cores), which on serve's event loop stalled every stream. parts: the values the whole is made of, each compiled
    alone only where the whole fails, so that the error names the one at fault (tools[i]) at no cost otherwise."""

    value: dict
    field: str
    parts: tuple[Unchecked, ...] = ()


def check_structured_outputs(value, field: str = "structured_outputs",
                             compile: Callable[[Structured], Structured] | None = None) -> Structured | None:
    """vLLM's structured_outputs ({"json": schema} or {"regex": ...}, {"choice": [...]}, {"grammar": lark or GBNF},
    {"json_object": true}) as llguidance compiles it, or a RequestError naming field (an Unchecked value's own). JSON
    allows any whitespace between tokens, as vLLM's default, unless disable_any_whitespace is true. compile: a
    decoder's (Grammars.compile), which compiles it for the decoder's tokenizer where it does not keep it already;
    without one (before a bundle loads), llguidance checks the grammar alone. A Structured value is taken as checked,
    and compiled."""
    if isinstance(value, Unchecked):
        try:
            return check_structured_outputs(value.value, value.field, compile)
        except RequestError:
            for part in value.parts:
                check_structured_outputs(part)
            raise
    if value is None:
        return None
    if isinstance(value, Structured):
        return compile(value) if compile else value
    if not isinstance(value, dict):
        raise RequestError(f"{field} must be an object with one of {', '.join(KINDS)}, not {type(value).__name__}")
    given = {key: spec for key, spec in value.items() if key != COMPACT and spec is not None and spec is not False}
    unknown = sorted(set(value) - {*KINDS, COMPACT})
    if unknown or len(given) != 1:
        what = f"has {unknown[0]!r}" if unknown else f"sets {len(given)} of them"
        raise RequestError(f"{field} must set exactly one of {', '.join(KINDS)}; it {what}")
    (kind, spec), = given.items()
    compact = value.get(COMPACT, False)
    if not isinstance(compact, bool):
        raise RequestError(f"{field}'s {COMPACT} must be true or false, not {type(compact).__name__}")
    try:
        if kind == "json_object":
            if spec is not True:
                raise ValueError(f"json_object must be true, not {json.dumps(spec)}")
            grammar = llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}',
                                                                    defaults={"whitespace_flexible": not compact})
        elif kind == "json":
            if not isinstance(spec, (dict, str)):
                raise ValueError(f"json must be a JSON schema (an object), not {type(spec).__name__}")
            grammar = llguidance.LLMatcher.grammar_from_json_schema(spec, defaults={"whitespace_flexible": not compact})
        elif kind == "choice":
            if not isinstance(spec, list) or not spec or not all(isinstance(c, str) for c in spec):
                raise ValueError("choice must be a non-empty list of strings")
            grammar = llguidance.grammar_from("choice", json.dumps(spec))
        else:
            if not isinstance(spec, str):
                raise ValueError(f"{kind} must be a string, not {type(spec).__name__}")
            grammar = llguidance.grammar_from(kind, spec)
    except (ValueError, TypeError) as exc:
        raise RequestError(f"{field} is not a grammar llguidance compiles: {_one_line(exc)}") from None
    if compile:
        return compile(Structured(grammar, field))
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise RequestError(f"{field} is not a grammar llguidance compiles: {_one_line(error)}")
    return Structured(grammar, field)


def _one_line(error) -> str:
    return " ".join(str(error).split())


# Compiled grammars a decoder keeps (serve's --grammar-cache). At a 152k-token tokenizer a 1.8 KB schema's holds
# 0.24 MiB and a 726 KB one's 43 MiB (docs/runtime.md, structured_outputs): 32 of those hold 1.4 GB. Not fewer: a service
# cycling through more schemas than are kept would compile every one of them every time.
GRAMMAR_CACHE = 32


class Grammars:
    """A bundle's llguidance tokenizer (built on the first request with a grammar: ~1 s at a 150k vocabulary), for which
    it compiles its requests' grammars, and their guides. vocab_size: the target's, which may exceed the tokenizer's
    `tokens` (padding rows, which no grammar allows); eos: the tokens that end a request, which a grammar allows where
    it may end. llguidance takes eos ids within the tokenizer only: one in the padding rows (a generation_config's
    past a tokenizer without that token) is allowed where the grammar may end, as the others are, by Guide.mask.

    Compiled grammars are kept by their serialized grammar, the last `cache` used (LRU), as vLLM's xgrammar backend and
    SGLang keep theirs: services send the same schema again and again, and llguidance's compile takes seconds for the
    largest. Every request, on any thread, decodes from its own deep_copy of the kept matcher in its start state, which
    no one advances; the copies share the matcher's lexer, which llguidance guards with a mutex and builds on as they
    go, up to its limit (ParserLimits.max_lexer_states, 250k states of ~1-2 kB): a kept matcher whose lexer reached it
    is compiled again (_spent)."""

    def __init__(self, tokenizer: Tokenizer, tokens: int, vocab_size: int, eos: list[int], cache: int = GRAMMAR_CACHE):
        # Serialized for llguidance at the first grammar, not here: 0.1 s of each load, 8.7 MB kept (a 152k vocabulary)
        self._source, self._tokens, self.vocab_size, self._eos = tokenizer, tokens, vocab_size, sorted(eos)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._cache = cache
        # grammar -> its matcher in its start state, the latest used last
        self._kept: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()

    def compile(self, structured: Structured) -> Structured:
        """structured, checked: its grammar compiles for this tokenizer (or a RequestError naming its field), and is
        kept for its guides."""
        self._start(structured)
        return structured

    def guide(self, structured: Structured) -> Guide:
        """A guide from the grammar's start state: a copy of the kept matcher (compiled again where it was evicted)."""
        return Guide(self._start(structured).deep_copy(), self.vocab_size, set(self._eos),
                     tuple(e for e in self._eos if e >= self._tokens), structured.field)

    def _start(self, structured: Structured) -> llguidance.LLMatcher:
        tokenizer = self._built(structured.field)
        with self._lock:
            matcher = self._kept.get(structured.grammar)
            if matcher is not None:
                self._kept.move_to_end(structured.grammar)
        if matcher is None or self._spent(matcher):
            # Kept as compiled, errors too: a request that resends a bad grammar is refused without compiling it again.
            matcher = llguidance.LLMatcher(tokenizer, structured.grammar, log_level=0)
            with self._lock:
                self._kept[structured.grammar] = matcher
                self._kept.move_to_end(structured.grammar)
                while len(self._kept) > self._cache:
                    self._kept.popitem(last=False)
        if matcher.is_error():
            raise RequestError(f"{structured.field} is not a grammar llguidance compiles: {_one_line(matcher.get_error())}")
        return matcher

    def _spent(self, matcher: llguidance.LLMatcher) -> bool:
        """Whether the lexer the kept matcher shares with its copies reached llguidance's limit through their walks:
        every copy's mask then allows eos alone, while the kept matcher's is_error stays false. A copy's first mask
        (0.2-0.5 ms at 152k tokens) is the one call that reports it."""
        if matcher.is_error():
            return False
        probe = matcher.deep_copy()
        llguidance.numpy.fill_next_token_bitmask(probe, llguidance.numpy.allocate_token_bitmask(1, self.vocab_size))
        return probe.is_error()

    def _built(self, field: str) -> llguidance.LLTokenizer:
        """field: the request's name for its grammar, which begins a refusal (serve's 400 names it as its param)."""
        with self._lock:
            if self._tokenizer is None:
                within = [e for e in self._eos if e < self._tokens]
                if not within:  # llguidance needs one: it allows it where a grammar may end, the others after it
                    raise RequestError(f"{field} needs an eos token within the tokenizer's {self._tokens} tokens, and "
                                       f"this bundle's eos ids {self._eos} are all past them (padding rows): leave "
                                       f"{field} out, or recompile with an eos the tokenizer has")
                self._tokenizer = llguidance.LLTokenizer(self._source.to_str(), n_vocab=self.vocab_size,
                                                         eos_token=within)
            return self._tokenizer


class Guide:
    """One request's grammar state: the tokens generated so far, consumed. field: the request's name for its grammar,
    which begins the RequestError that ends a decoding past llguidance's limits (_check)."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, eos: set[int], padding_eos: tuple[int, ...] = (),
                 field: str = "structured_outputs"):
        self.matcher, self.vocab_size, self.eos, self.field = matcher, vocab_size, eos, field
        self._padding_eos = list(padding_eos)  # eos ids past the tokenizer, which llguidance does not take (Grammars)
        self._bits = llguidance.numpy.allocate_token_bitmask(1, vocab_size)

    @property
    def ended(self) -> bool:
        """Whether the grammar allows only an eos next (llguidance's is_stopped: ~1 µs, no mask computed)."""
        return self.matcher.is_stopped()

    def masks(self, drafts: list[int]) -> np.ndarray:
        """[D+1, V] bool: row j, the tokens allowed after the tokens consumed and drafts 0..j-1. Rows after a draft the
        grammar refuses (or an eos, which ends the request) repeat its row: no decision reads them."""
        masks = np.empty((len(drafts) + 1, self.vocab_size), np.bool_)
        consumed = 0
        for j in range(len(drafts) + 1):
            masks[j] = self.mask()
            if j == len(drafts) or not self.push(drafts[j], masks[j]):
                masks[j + 1:] = masks[j]
                break
            consumed += 1
        self.pop(consumed)
        return masks

    def forced(self, count: int) -> list[int]:
        """Up to count tokens of the text the grammar forces next (llguidance's fast-forward tokens, ~5-70 µs): that
        text's own tokenization, each the one token llguidance's mask then allows (every one of ~1,900 forced under the
        tests' grammars and of 716 on the demo pair), which the target takes, greedy or sampled (p = 1 under every rule
        it applies: logit_bias is finite; min_tokens and ignore_eos are refused under a grammar). Still proposals, not
        decisions, verified like drafts: the output does not rest on llguidance's masks staying so. Not only text: where
        the forced text is an eos token's (a regex with a literal "<|endoftext|>", the tests' and the demo's eos),
        llguidance gives that eos, which masks consumes nothing past, as a draft eos."""
        tokens = self.matcher.compute_ff_tokens()[:count] if count > 0 else []
        self._check()
        return tokens

    def ends_after(self, tokens: list[int]) -> bool:
        """Whether the request ends within tokens, ones the grammar allows in turn (forced's): at an eos among them, or
        where only an eos may follow them. Consumed and rolled back, no mask computed (~µs a token)."""
        consumed = 0
        try:
            for token in tokens:
                if token in self.eos:
                    return True
                self.advance(token)
                consumed += 1
            return self.ended
        finally:
            self.pop(consumed)

    def mask(self) -> np.ndarray:
        """[V] bool: the tokens the grammar allows next."""
        llguidance.numpy.fill_next_token_bitmask(self.matcher, self._bits)
        self._check()
        bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")  # token 32w + b is bit b of word w
        allowed = bits[:self.vocab_size].astype(np.bool_)
        if self._padding_eos:  # allowed where llguidance allows its own eos: where the grammar may end
            allowed[self._padding_eos] = self.matcher.is_accepting()
        return allowed

    def push(self, token: int, mask: np.ndarray) -> bool:
        """Consume a proposed token (pop takes it back) where mask, the current state's, allows it and it is no eos
        (which ends the request: nothing follows it). Returns whether it did."""
        if not mask[token] or token in self.eos:
            return False
        self.matcher.consume_token(token)
        self._check()
        return True

    def pop(self, count: int) -> None:
        if count:
            self.matcher.rollback(count)

    def advance(self, token: int) -> None:
        """A token the target decided under the mask (an eos ends the request: not consumed)."""
        if token not in self.eos:
            self.matcher.consume_token(token)
            self._check()

    def _check(self) -> None:
        """llguidance stops a grammar that grows past its limits (ParserLimits: e.g. an Earley row of over 2000 items,
        which an object of ~500 optional properties reaches at its first key) where a token that its mask allowed is
        consumed, or where a mask is computed; a stopped matcher never recovers, and allows eos alone, which would end
        the request as though its output were complete. Its error's first line says which limit (the rest is its
        parser's state)."""
        if self.matcher.is_error():
            reason = self.matcher.get_error().strip().splitlines()[0]
            raise RequestError(f"{self.field} stopped llguidance mid-decoding ({reason}): simplify its grammar (a JSON "
                               f"schema: list more of an object's properties in its required)")
