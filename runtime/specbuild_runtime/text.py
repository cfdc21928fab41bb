"""Token ids to text as they arrive: deltas that never split a character and never show a stop string. And the
other way, bounded: the most text one token stands for (token_span), which refuses a prompt too long for a
bundle's context before it is tokenized.

Written by hand rather than with tokenizers' DecodeStream, which cannot flush: text it holds back (a
real U+FFFD at the end, read as an incomplete character) would never be sent.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from functools import partial

from tokenizers import Tokenizer
from tokenizers.pre_tokenizers import ByteLevel

from .validation import TokenSpan

INCOMPLETE = "\ufffd"  # what the decoder shows for bytes that do not yet form a character
# Prompt tokens decoded with the first generated ones (vLLM's prefix offset does the same): SentencePiece
# decoders (Llama 2, Mistral, Phi-3: a Strip or Metaspace step) drop the space that begins whatever they
# decode, so the first generated word, decoded alone, would lose the space that parts it from the prompt.
PROMPT_CONTEXT = 5


class TextStream:
    """Feed token ids with `push`; `take()` returns the text that is safe to send. The concatenation of
    every `take()` and the final `finish()` is exactly `text`: the tokens' text as it follows the prompt's
    (given prompt_ids), cut before the earliest stop string (as OpenAI's API cuts it), or after it where
    `include_stop` (vLLM's include_stop_str_in_output). Text that could still become a stop string is held back
    until it cannot, unless it is to be sent anyway (`include_stop`). Special tokens are left out of the text
    unless `special_tokens`. min_tokens: a stop string counts only where it ends after the text of the first
    min_tokens tokens, as vLLM's detokenizer looks for one (vllm/v1/engine/detokenizer.py)."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = (), prompt_ids: Sequence[int] = (),
                 special_tokens: bool = False, include_stop: bool = False, min_tokens: int = 0):
        self.tokenizer = tokenizer
        self._text_of = partial(tokenizer.decode, skip_special_tokens=not special_tokens)
        self.stop = stop
        self.include_stop = include_stop
        self._held_back = min_tokens  # tokens still to push whose text no stop string may end in
        self._held_text = 0  # characters of text those pushed so far make
        # SentencePiece vocabularies with byte fallback hold all 256 byte tokens; others need no look per token.
        self._byte_fallback = tokenizer.token_to_id("<0x00>") is not None
        context = list(prompt_ids[-PROMPT_CONTEXT:])
        # Decoded alone, these tokens may begin inside a character (Llama 2 spells most emoji in byte tokens), and
        # ByteFallback then shows the whole run of bytes as U+FFFD, up to the prompt's end: the context reaches back
        # to the character's first byte (UTF-8 spells one in at most 4), else begins after the run. Where the
        # prompt's ids end inside a character, none is left: its text is no prefix of what follows.
        earlier = list(prompt_ids[:-PROMPT_CONTEXT][-3:])
        while earlier and self._text_of(context).endswith(INCOMPLETE):
            context.insert(0, earlier.pop())
        while context and self._text_of(context).endswith(INCOMPLETE):
            del context[0]
        self._ids = context  # the prompt's last tokens, then the generated ones
        self.text = ""
        self.stopped = False  # a stop string was found: text ends before it, push() no longer adds
        self.stop_string: str | None = None  # the stop string found (the earliest)
        self.finished = False  # no token will follow: nothing is held back any more
        self._window = 0  # _ids[_window:] are decoded together, so a character split across tokens decodes whole
        self._read = len(context)  # _ids[:_read] are in text (or the prompt's)
        self._sent = 0  # characters of text taken

    def push(self, token: int) -> None:
        self.extend([token])

    def extend(self, tokens: list[int]) -> None:
        """Several tokens at once: decoded in one call (a whole generation without stop strings)."""
        self._ids.extend(tokens)
        self._held_back -= len(tokens)
        if not self.stopped:
            self._decode(final=False)

    def take(self) -> str:
        """Text that is complete and cannot become part of a stop string."""
        done = self.stopped or self.finished or self.include_stop
        end = len(self.text) if done else len(self.text) - self._stop_prefix()
        delta, self._sent = self.text[self._sent:end], max(self._sent, end)
        return delta

    def finish(self) -> str:
        """The rest, once no token will follow (an incomplete character is sent as the decoder shows it).
        The last bytes may complete a stop string: `stopped` says so afterwards too."""
        if not self.stopped:
            self._decode(final=True)
        self.finished = True
        return self.take()

    def _decode(self, final: bool) -> None:
        before = self._text_of(self._ids[self._window:self._read])
        now = self._text_of(self._ids[self._window:])
        if len(now) <= len(before):
            return
        new = now[len(before):]
        if not final and (new.endswith(INCOMPLETE) or self._byte_fallback and self._in_byte_run()):
            # The last bytes begin a character still to come, or may still be followed by bytes that change
            # what they decode to: wait for them, but a stop string may be whole already in the text so far
            # (the request then ends at this token, not the next).
            self._cut(self.text + new.rstrip(INCOMPLETE))
            return
        self._window, self._read = self._read, len(self._ids)
        if not self._cut(self.text + new):
            self.text += new

    def _in_byte_run(self) -> bool:
        """Whether the last tokens not yet read end in SentencePiece byte tokens (<0x0A> is "\\n" in Llama 2 and
        Mistral). ByteFallback decodes a run of them, special tokens skipped, as one: a run that is not UTF-8
        becomes one U+FFFD per byte, so a "\\n" decoded so far turns into U+FFFD if a stray byte follows it."""
        for token in reversed(self._ids[self._read:]):
            if _byte_token(self.tokenizer.id_to_token(token)):
                return True
            if self._text_of([token]):  # not a skipped special token: it ends the run
                return False
        return False

    def _cut(self, text: str) -> bool:
        """If text (self.text and more) holds a stop string that self.text did not, end the text before the
        earliest one (after it, where include_stop) and stop."""
        if self._held_back >= 0:
            self._held_text = len(text)
            return False
        searched = max(0, len(self.text) - max((len(s) for s in self.stop), default=0) + 1)
        cuts = [(i, len(s) * self.include_stop, s) for i, s in
                ((text.find(s, max(searched, self._held_text - len(s) + 1)), s) for s in self.stop) if i >= 0]
        if cuts:
            at, kept, self.stop_string = min(cuts)
            self.text = text[:at + kept]
            self.stopped = True
        return self.stopped

    def _stop_prefix(self) -> int:
        """Length of the longest end of text that begins some stop string (tried only where the text holds the
        stop string's first character: a test per length made long stop strings cost their length squared)."""
        longest = 0
        for s in self.stop:
            tail = self.text[max(0, len(self.text) - len(s) + 1):] if len(s) > 1 else ""
            start = tail.find(s[0])
            while 0 <= start and len(tail) - start > longest:
                if s.startswith(tail[start:]):
                    longest = len(tail) - start
                    break
                start = tail.find(s[0], start + 1)
        return longest


def _byte_token(token: str | None) -> bool:
    """Whether a token is a byte token as ByteFallback reads them, <0xNN>."""
    return token is not None and len(token) == 6 and token.startswith("<0x") and token.endswith(">")


# Normalizers that never shorten text (each character becomes one or more), and NFC/NFKC, which join at most 4 into
# one: a composed character stands for its canonical decomposition, at most 4 long in Unicode (U+1F82).
LENGTHENING_NORMALIZERS = {"NFD", "NFKD", "Lowercase", "Prepend", "ByteLevel"}
COMPOSING_NORMALIZERS = {"NFC", "NFKC"}
# Pre-tokenizers that split text, or lengthen it (ByteLevel: a character per byte; Metaspace: "▁" for " "), dropping
# none of it; Split and Punctuation do unless their behavior is "Removed"; the others (Whitespace, UnicodeScripts...)
# drop spaces, UnicodeScripts those that begin the text.
SPLITTING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Split", "Punctuation"}


def token_span(tokenizer: Tokenizer) -> TokenSpan | None:
    """The most text that one token of a BPE tokenizer stands for, so that no text encodes to fewer than its length
    over that; None where no bound holds: a step that drops text (a Strip normalizer, a Whitespace pre-tokenizer,
    truncation), an added token that takes the spaces beside it (lstrip/rstrip), or unknown characters fused into one
    token, or dropped where there is no unk_token. Each added token is one token for its own text; the model's
    tokens spell the normalized text in vocabulary strings (ByteLevel's a character per byte, a byte-fallback token
    one byte): the longest stands for at most `shrink` times as many characters of the text, where normalizing
    shortens it that much; with ByteLevel and no normalizer, for as many bytes of it (a 4-byte emoji is 4 tokens or a
    part of one), and where ByteLevel reads the text's own bytes, each byte over the longest token that holds it
    (TokenSpan.by_byte). Post-processors and chat templates only add tokens."""
    config = json.loads(tokenizer.to_str())
    model = config["model"]
    shrink = _shrink(config.get("normalizer"))
    pre_tokenizers = _steps(config.get("pre_tokenizer"))
    if (config.get("truncation") or model["type"] != "BPE" or shrink is None or not all(
            step["type"] in SPLITTING_PRE_TOKENIZERS and step.get("behavior") != "Removed" for step in pre_tokenizers)):
        return None
    vocab = model["vocab"]
    # A character the vocabulary cannot spell is fused with its neighbours (fuse_unk), or, without an unk_token,
    # dropped: "é" * 1000 is no token at all. Byte fallback spells every one, as byte-level BPE does when its
    # vocabulary holds all 256 byte characters as they are looked up (without a continuing_subword_prefix...).
    if not (model.get("byte_fallback") and all(f"<0x{b:02X}>" in vocab for b in range(256))) and (
            model.get("fuse_unk") if model.get("unk_token") is not None else not _spells_bytes(model, pre_tokenizers)):
        return None
    added = config["added_tokens"]
    if any(token["lstrip"] or token["rstrip"] for token in added):
        return None
    normalize = tokenizer.normalizer.normalize_str if tokenizer.normalizer else str
    # each added token as it is matched, in the normalized text or the text
    added_text = [normalize(token["content"]) if token["normalized"] else token["content"] for token in added]
    # By byte, where ByteLevel reads the text's own bytes (a Metaspace step, or a second ByteLevel, spells one in
    # others) and they are not normalized, or are ASCII, which the Unicode normal forms keep as it is (Qwen's NFC); and
    # where the vocabulary looks each up as it is, not with an affix ("##b" unknown, the "b" a merge may drop).
    types = [step["type"] for step in pre_tokenizers]
    by_byte = _longest_by_byte(vocab, added_text) if types.count("ByteLevel") == 1 and "Metaspace" not in types and (
        _keeps_ascii(config.get("normalizer")) and not model.get("continuing_subword_prefix")
        and not model.get("end_of_word_suffix")) else ()
    if config.get("normalizer") is None and "ByteLevel" in types:
        return TokenSpan(max([*(len(text.encode()) for text in added_text), *map(len, vocab), 1]), in_bytes=True,
                         by_byte=by_byte)
    normalized = [len(text) for text, token in zip(added_text, added) if token["normalized"]]
    original = [len(text) for text, token in zip(added_text, added) if not token["normalized"]]
    return TokenSpan(max([*original, shrink * max([*normalized, *map(len, vocab), 1])]), by_byte=by_byte,
                     ascii_only=True)


def _keeps_ascii(normalizer: dict | None) -> bool:
    """Whether a normalizer leaves ASCII text as it is (none, or Unicode normal forms, which change no ASCII)."""
    if normalizer is None:
        return True
    if normalizer["type"] == "Sequence":
        return all(map(_keeps_ascii, normalizer["normalizers"]))
    return normalizer["type"] in ("NFC", "NFD", "NFKC", "NFKD")


# Text holding every byte UTF-8 writes (C0, C1 and F5 to FF never): ASCII, 2-byte characters' leads and continuations,
# then a character of each 3-byte and 4-byte lead.
EVERY_BYTE = "".join(map(chr, [*range(0x800), 0x800, *range(0x1000, 0x10000, 0x1000), 0x10000,
                                *range(0x40000, 0x110000, 0x40000)]))


def _longest_by_byte(vocab: dict[str, int], added: list[str]) -> tuple[int, ...]:
    """For each byte value, the longest token of a byte-level vocabulary (a character per byte) or added token (its
    UTF-8) that holds it. A byte whose character is no token is spelled by an unknown or byte-fallback token, which
    holds none of it, or a merge of one: it is given the longest token, as every byte was before."""
    # Longest tokens first, each length's characters as one set: a loop per token and character took 0.20 s of CPU
    # at a 152k vocabulary (Qwen3's), this 0.05 s.
    by_length: dict[int, list[str]] = {}
    for token in vocab:
        by_length.setdefault(len(token), []).append(token)
    longest_with: dict[str, int] = {}
    for length in sorted(by_length, reverse=True):
        for char in set().union(*by_length[length]):
            longest_with.setdefault(char, length)
    longest = max([*(len(text.encode()) for text in added), *longest_with.values(), 1])
    chars = dict(zip(EVERY_BYTE.encode(), ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(
        EVERY_BYTE)[0][0]))
    by_byte = [longest_with[chars[b]] if chars.get(b) in vocab else longest for b in range(256)]
    for text in added:
        for b in set(text.encode()):
            by_byte[b] = max(by_byte[b], len(text.encode()))
    return tuple(by_byte)


def _spells_bytes(model: dict, pre_tokenizers: list[dict]) -> bool:
    """Whether a BPE model's vocabulary spells every character its pre-tokenizers leave: ByteLevel's bytes (the steps
    token_span admits after it only split the text, or insert a "▁" that stood for none of it)."""
    return (any(step["type"] == "ByteLevel" for step in pre_tokenizers) and not model.get("continuing_subword_prefix")
            and not model.get("end_of_word_suffix") and all(c in model["vocab"] for c in ByteLevel.alphabet()))


def _shrink(normalizer: dict | None) -> int | None:
    """How many times shorter a normalizer can make text, or None where it can drop text (Strip, StripAccents...)."""
    if normalizer is None:
        return 1
    kind = normalizer["type"]
    if kind == "Sequence":
        factors = []
        for part in normalizer["normalizers"]:
            factor = _shrink(part)
            if factor is None:
                return None
            factors.append(factor)
        return math.prod(factors)
    if kind == "Replace" and "String" in normalizer["pattern"] and normalizer["content"]:
        # an empty pattern inserts the content between characters: no shorter, where a 0 would be no bound at all
        return max(1, -(-len(normalizer["pattern"]["String"]) // len(normalizer["content"])))
    return 1 if kind in LENGTHENING_NORMALIZERS else 4 if kind in COMPOSING_NORMALIZERS else None


def _steps(pre_tokenizer: dict | None) -> list[dict]:
    """A pre-tokenizer's steps, those of a Sequence in turn."""
    if pre_tokenizer is None:
        return []
    if pre_tokenizer["type"] == "Sequence":
        return [step for part in pre_tokenizer["pretokenizers"] for step in _steps(part)]
    return [pre_tokenizer]
