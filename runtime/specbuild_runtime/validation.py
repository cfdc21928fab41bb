"""Validation at the boundary: every request, and every bundle's engines, are checked here before use.

A value that is wrong is refused with a one-line RequestError or BundleError naming it; nothing is
coerced silently (a float token id is not truncated, a negative one is not read from the end, NaN is
not a temperature). The API, the CLI and the server all come through `check_request`.
"""

from __future__ import annotations

import math
import reprlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Union

import numpy as np

from .errors import BundleError, RequestError
from .grammar import Structured
from .manifest import LONG_ROPE, cache_names, step_presents, step_total_len

AUTO = "auto"
# OpenAI's API takes 4, vLLM any number; editors' completion plugins send more than 4 (their file and
# fence markers). Each is searched at every token, so the bound keeps that to ~16,000 characters.
MAX_STOP_STRINGS = 16
# Text that may still become a stop string is held back and searched at every token: a bound keeps that
# cheap (four 40,000-character stops made each token cost milliseconds); real stops are a few characters.
MAX_STOP_CHARS = 1000
# The most alternatives a request may ask logprobs of: OpenAI's top_logprobs limit, vLLM's default max_logprobs.
MAX_LOGPROBS = 20
FLOAT32_MAX = float(np.finfo(np.float32).max)
# A top_p this small keeps only the most likely token, as any below it does; float32 (the engines' type) rounds
# one below ~7e-46 to 0, which keeps none (and GPUs flush float32 subnormals to 0): such a top_p is read as this.
FLOAT32_TINY = float(np.finfo(np.float32).tiny)
# A temperature below this decodes greedily, as vLLM's _SAMPLING_EPS: sampling there is greedy but for
# near-exact ties, and logits divided by a far tinier one (below ~1e-37) overflow float32 to NaN.
GREEDY_BELOW = 1e-5
Prompt = Union[str, Sequence[int], np.ndarray]


# A seed of -1 samples with a random seed, as llama.cpp's -1 (its LLAMA_DEFAULT_SEED, 0xFFFFFFFF, the default of its
# --seed and of its server's "seed") and as no seed (vLLM's None). Other negatives are refused: llama.cpp and vLLM
# (torch's Generator.manual_seed) wrap them into unsigned seeds, which would not draw their numbers here all the same,
# and seed + i (n's choices, bench's prompts) would reach -1 from below.
RANDOM_SEED = -1
SEED_HINT = " (-1: a random seed, as llama.cpp's)"

PENALTIES = ("repetition_penalty", "presence_penalty", "frequency_penalty")
NO_PENALTIES = (1.0, 0.0, 0.0)  # the values of PENALTIES that change no logit


@dataclass(frozen=True)
class Sampling:
    """temperature 0 is greedy (check_request makes any below GREEDY_BELOW 0); a seed makes a sampled run
    reproducible (at any γ, auto included: decode.SpeculativeDecoder._policy)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    min_p: float = 0.0
    # vLLM's penalties, greedy or sampled (manifest.py): 1, 0 and 0 apply none
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0  # the first min_tokens tokens are no eos or stop token (vLLM's)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit): OpenAI's

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalties(self) -> tuple[float, float, float]:
        return self.repetition_penalty, self.presence_penalty, self.frequency_penalty

    def generator(self) -> np.random.Generator:
        """numpy's generator for the seed (>= 0: check_request's), or a random one without a seed."""
        return np.random.default_rng(self.seed)


@dataclass(frozen=True)
class TokenSpan:
    """The most text one token of a tokenizer stands for (text.token_span): characters, or UTF-8 bytes where the
    tokenizer reads bytes unnormalized (byte-level BPE without a normalizer: GPT-2's, Llama 3's). by_byte: for each
    byte value, the longest token that holds it, where that bounds the tokens which take it from the text; for ASCII
    text only where `ascii_only`: a Unicode normal form (Qwen's NFC) changes no ASCII, but may compose other text."""

    longest: int
    in_bytes: bool = False
    by_byte: tuple[int, ...] = ()
    ascii_only: bool = False

    def fewest_tokens(self, text: str) -> int:
        """No text encodes to fewer tokens than this. By byte, a token of n bytes takes at most n of the text, each
        one it holds, whose longest token is n or more: at most 1 in all of 1/by_byte over the bytes it takes. A
        vocabulary's few long runs of spaces or "=" then bound only those bytes, not the letters, by their length."""
        if self.by_byte and (text.isascii() or not self.ascii_only):
            counts = np.bincount(np.frombuffer(text.encode(), np.uint8), minlength=256)
            return math.ceil(sum(Fraction(int(count), self.by_byte[b]) for b, count in enumerate(counts) if count))
        return -(-(len(text.encode()) if self.in_bytes else len(text)) // self.longest)


@dataclass(frozen=True)
class Request:
    """What was asked, checked: the measurements of serving it go to a separate `Stats`."""

    prompt_ids: list[int]
    max_new_tokens: int
    gamma: int | str  # a fixed γ, or "auto"
    sampling: Sampling
    stop: tuple[str, ...] = ()
    special_tokens: bool = False  # the text shows special tokens (vLLM's skip_special_tokens false)
    logprobs: int | None = None  # each token's logprob and this many alternatives' (logprobs.py); None: none
    ignore_eos: bool = False  # an eos token ends nothing: decoding goes on to max_new_tokens or the context
    stop_token_ids: frozenset[int] = frozenset()  # tokens that end the request when generated ("stop_token")
    # the stop string, or the eos or stop token (decoded as any other), ends the text instead of being cut (vLLM's)
    include_stop: bool = False
    prompt_logprobs: int | None = None  # logprobs' records for each prompt token after the first (vLLM's)
    structured: Structured | None = None  # the grammar the output follows (vLLM's structured_outputs; grammar.py)


def check_request(prompt: Prompt, *, encode: Callable[[str], list[int]], vocab_size: int, max_seq_len: int,
                  max_gamma: int, max_new_tokens=128, gamma=AUTO, temperature=0.0, top_k=0, top_p=1.0,
                  seed=None, stop=None, logprobs=None, ignore_eos=False, stop_token_ids=None,
                  include_stop_str_in_output=False, skip_special_tokens=True, token_span: TokenSpan | None = None,
                  context_limit: int = 0, min_p=0.0, prompt_logprobs=None, repetition_penalty=1.0, presence_penalty=0.0,
                  frequency_penalty=0.0, min_tokens=0, logit_bias=None) -> Request:
    """The request as plain checked values, or a RequestError naming the first value that is wrong. ignore_eos,
    stop_token_ids, include_stop_str_in_output, skip_special_tokens and prompt_logprobs mean what vLLM's SamplingParams
    says. token_span: the most text one token of `encode`'s tokenizer stands for, where a bound holds (text.token_span).
    context_limit: the longest context compile accepts for the bundle's models (Manifest.context_limit; 0 where
    unknown)."""
    # 0 tokens: the prompt scored, nothing generated (as vLLM's echo with max_tokens 0)
    max_new_tokens = whole("max_new_tokens", max_new_tokens, low=0 if prompt_logprobs is not None else 1,
                           hint="" if prompt_logprobs is not None else " (0 only with prompt_logprobs, to score the prompt)")
    if gamma != AUTO:
        if isinstance(gamma, str):
            raise RequestError(f"gamma must be {AUTO!r} or a whole number from 0 to {max_gamma}, not {shown(gamma)}")
        gamma = whole("gamma", gamma, low=0, high=max_gamma,
                      hint=f" (this bundle's most drafts per round; 0 = target only, {AUTO!r} adapts)")
    (temperature, top_k, top_p, min_p, repetition_penalty, presence_penalty,
     frequency_penalty) = check_sampling(temperature, top_k, top_p, vocab_size, min_p, repetition_penalty,
                                         presence_penalty, frequency_penalty)
    seed = check_seed(seed)
    min_tokens = whole("min_tokens", min_tokens, low=0, high=max_new_tokens,
                       hint=" (the tokens generated before an eos or stop token may end the request, at most max_new_tokens)")
    if logprobs is not None:
        logprobs = whole("logprobs", logprobs, low=0, high=MAX_LOGPROBS, hint=" (the most probable tokens to show beside "
                                                                            "each token's own; None: no logprobs)")
    ignore_eos = flag("ignore_eos", ignore_eos)
    include_stop = flag("include_stop_str_in_output", include_stop_str_in_output)
    special_tokens = not flag("skip_special_tokens", skip_special_tokens)
    stop_token_ids = token_ids("stop_token_ids", stop_token_ids, vocab_size)
    if prompt_logprobs is not None:
        prompt_logprobs = whole("prompt_logprobs", prompt_logprobs, low=0, high=MAX_LOGPROBS,
                                hint=" (the most probable tokens to show beside each prompt token's own; None: none)")
    # Each id is a token: the list's length refuses it before a look at each id (2.7M of them, an 8 MB body, held the
    # GIL, and so serve's event loop, for 0.8 s); a batch of texts is told what a call takes (prompt_token_ids)
    if isinstance(prompt, (list, tuple)) and len(prompt) > max_seq_len and isinstance(prompt[0], (int, np.integer)):
        raise too_long(len(prompt), max_seq_len, max_new_tokens, context_limit=context_limit)
    prompt_ids = prompt_token_ids(prompt, encode, vocab_size, lambda text: check_text_fits(
        text, token_span, max_seq_len, max_new_tokens, context_limit=context_limit))
    if len(prompt_ids) > max_seq_len:
        raise too_long(len(prompt_ids), max_seq_len, max_new_tokens, context_limit=context_limit)
    sampling = Sampling(temperature, top_k, top_p, seed, min_p, repetition_penalty, presence_penalty, frequency_penalty,
                        min_tokens, check_logit_bias(logit_bias, vocab_size))
    return Request(prompt_ids, max_new_tokens, gamma, sampling, stop_strings(stop), special_tokens, logprobs, ignore_eos,
                   stop_token_ids, include_stop, prompt_logprobs)


def check_text_fits(text: str, token_span: TokenSpan | None, max_seq_len: int, max_new_tokens: int,
                    context_limit: int = 0) -> None:
    """Refuses, before it is tokenized, text too long to encode to max_seq_len tokens or fewer, as no token stands for
    more than token_span of it. Tokenizing costs seconds a MB, and serve checks requests one at a time: an 8 MB prompt
    (a 128K context's body limit admits it) held every other request for 13 s, only to be refused."""
    fewest = token_span.fewest_tokens(text) if token_span else 0
    if fewest > max_seq_len:
        raise too_long(fewest, max_seq_len, max_new_tokens, at_least=True, context_limit=context_limit)


def too_long(tokens: int, max_seq_len: int, max_new_tokens: int, at_least: bool = False,
             context_limit: int = 0) -> RequestError:
    """The refusal of a prompt of `tokens` tokens (`at_least`: of that many or more), longer than the context. The
    recompile it advises stays within context_limit, the longest context compile accepts for these models (0: a bundle
    made before the manifest recorded it, whose models' limit is unknown here)."""
    said = f"the prompt has {'at least ' * at_least}{tokens} tokens but this bundle's context is {max_seq_len}"
    need = tokens + max_new_tokens
    if not context_limit:
        fit = f"at least {need} to fit this request" if at_least else f"{need} would fit this request"
        return RequestError(f"{said}; shorten the prompt, or recompile with a larger --max-seq-len ({fit}) within the "
                            "model's max_position_embeddings")
    if tokens > context_limit:
        # The models' limit alone would still be too long for a bundle compiled shorter than it.
        recompile = (f", or to {context_limit} or fewer after recompiling with --max-seq-len {context_limit}"
                     if max_seq_len < context_limit else "")
        return RequestError(f"{said}, and no context of these models can hold it (compile takes --max-seq-len "
                            f"{context_limit} at most); shorten the prompt to {max_seq_len} tokens or fewer to fit this "
                            f"bundle{recompile}")
    if need > context_limit:
        room = f"{'at most ' * at_least}{context_limit - tokens + 1} new tokens"
        return RequestError(f"{said}; shorten the prompt, or recompile with --max-seq-len {context_limit}, the most "
                            f"these models take ({room} after this prompt)")
    fit = f"at least {need} to fit this request" if at_least else f"{need} would fit this request"
    return RequestError(f"{said}; shorten the prompt, or recompile with a larger --max-seq-len ({fit}; these models "
                        f"take up to {context_limit})")


def check_sampling(temperature=0.0, top_k=0, top_p=1.0, vocab_size: int = 1, min_p=0.0, repetition_penalty=1.0,
                   presence_penalty=0.0, frequency_penalty=0.0) -> tuple[float, int, float, float, float, float, float]:
    """(temperature, top_k, top_p, min_p, repetition_penalty, presence_penalty, frequency_penalty) as the engines take
    them, or a RequestError naming the first that is wrong. min_p in [0, 1], repetition_penalty above 0, presence and
    frequency penalties in [-2, 2], as vLLM's SamplingParams takes them."""
    temperature = real("temperature", temperature)
    if temperature < 0:
        raise RequestError(f"temperature must be 0 (greedy) or more, not {temperature}")
    if temperature < GREEDY_BELOW:
        temperature = 0.0
    top_p = real("top_p", top_p)
    if not 0 < top_p <= 1:
        raise RequestError(f"top_p must be in (0, 1], not {top_p}")
    top_p = max(top_p, FLOAT32_TINY)
    # A top_k above the vocabulary keeps every token, as 0 does, and so does vLLM's -1 (its clients send it,
    # generation_configs hold it); capping it keeps it an int64.
    top_k = min(max(whole("top_k", top_k, low=-1, hint=" (0 or -1 = no limit)"), 0), vocab_size)
    min_p = real("min_p", min_p)
    if not 0 <= min_p <= 1:
        raise RequestError(f"min_p must be in [0, 1] (0 = no limit), not {min_p}")
    repetition_penalty = real("repetition_penalty", repetition_penalty)
    if not repetition_penalty > 0:
        raise RequestError(f"repetition_penalty must be above 0 (1 = none), not {repetition_penalty}")
    additive = []
    for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        additive.append(real(name, value))
        if not -2 <= additive[-1] <= 2:
            raise RequestError(f"{name} must be in [-2, 2] (0 = none), not {additive[-1]}")
    return temperature, top_k, top_p, min_p, repetition_penalty, *additive


def prompt_token_ids(prompt: Prompt, encode: Callable[[str], list[int]], vocab_size: int,
                     fits: Callable[[str], None] | None = None) -> list[int]:
    """Text (valid UTF-8, and passed by `fits`, which may refuse it before it is encoded) is encoded; a sequence of
    whole numbers in [0, vocab_size) is taken as token ids."""
    if isinstance(prompt, str):
        utf8("prompt", prompt)
        if fits:
            fits(prompt)
        ids = encode(prompt)
    elif isinstance(prompt, (bytes, bytearray, memoryview)):
        raise RequestError("a prompt is text (str) or a list of token ids, not bytes: decode it first "
                           "(prompt.decode('utf-8'))")
    elif isinstance(prompt, np.ndarray):
        if prompt.ndim != 1 or prompt.dtype.kind not in "iu":
            raise RequestError(f"a NumPy prompt must be a 1-D array of integer token ids, not {prompt.ndim}-D "
                               f"{prompt.dtype}")
        ids = prompt.tolist()
    elif isinstance(prompt, Sequence):
        ids = []
        for index, token in enumerate(prompt):
            if isinstance(token, (bool, np.bool_)) or not isinstance(token, (int, np.integer)):
                batch = ("; a call decodes one prompt: for several at once, call from threads (decoder with parallel "
                         "slots, see Threads in docs/runtime.md)" if isinstance(token, (str, list, tuple)) else "")
                raise RequestError(f"prompt token ids must be whole numbers; item {index} is {shown(token)} "
                                   f"({type(token).__name__}){batch}")
            ids.append(int(token))
    else:
        raise RequestError(f"a prompt is text (str) or a list of token ids, not {type(prompt).__name__}")
    if not ids:
        raise RequestError("the prompt is empty; give at least one token of text")
    bad = next((i for i, token in enumerate(ids) if not 0 <= token < vocab_size), None)
    if bad is not None:
        raise RequestError(f"prompt token id {ids[bad]} (item {bad}) is outside this bundle's vocabulary "
                           f"[0, {vocab_size})")
    return ids


def shown(value) -> str:
    """A wrong value as a message quotes it: its repr, cut short (a batch's first prompt text was quoted whole, a
    100,000-character line). Python refuses to write an integer of over 4300 digits at all (a ValueError)."""
    if isinstance(value, (int, np.integer)) and abs(int(value)).bit_length() > 14000:
        return f"an integer of about {int(abs(int(value)).bit_length() * math.log10(2))} digits"
    return reprlib.repr(value)


def stop_strings(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    strings = (stop,) if isinstance(stop, str) else stop
    if not isinstance(strings, (list, tuple)) or not all(isinstance(s, str) for s in strings):
        raise RequestError(f"stop must be a string or a list of up to {MAX_STOP_STRINGS} strings, not {shown(stop)}")
    if len(strings) > MAX_STOP_STRINGS:
        raise RequestError(f"stop takes at most {MAX_STOP_STRINGS} strings, not {len(strings)}")
    for s in strings:
        if not s:
            raise RequestError("a stop string must not be empty")
        if len(s) > MAX_STOP_CHARS:
            raise RequestError(f"a stop string has {len(s)} characters; at most {MAX_STOP_CHARS} are taken")
        utf8("stop string", s)
    return tuple(strings)


def check_logit_bias(logit_bias, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias ({token id: bias}; None: none) as sorted (id, bias) pairs, each bias in [-100, 100]."""
    if logit_bias is None:
        return ()
    if not isinstance(logit_bias, dict):
        raise RequestError(f"logit_bias must map token ids to biases, not {shown(logit_bias)}")
    pairs = []
    for token, bias in logit_bias.items():
        token = whole("logit_bias", token, low=0, high=vocab_size - 1, hint=" (a key: token ids of this bundle's vocabulary)")
        bias = real("logit_bias", bias)
        if not -100 <= bias <= 100:
            raise RequestError(f"logit_bias must hold biases in [-100, 100], as OpenAI's, not {bias} (token {token})")
        pairs.append((token, bias))
    return tuple(sorted(pairs))


def token_ids(name: str, ids, vocab_size: int) -> frozenset[int]:
    """A list of token ids (None: none), each a whole number in [0, vocab_size)."""
    if ids is None:
        return frozenset()
    if isinstance(ids, np.ndarray) and ids.ndim == 1:  # as a prompt may be; its floats are refused one by one below
        ids = ids.tolist()
    if not isinstance(ids, (list, tuple, set, frozenset)):
        raise RequestError(f"{name} must be a list of token ids, not {shown(ids)}")
    for token in ids:
        whole(name, token, low=0, high=vocab_size - 1, hint=" (token ids of this bundle's vocabulary)")
    return frozenset(int(token) for token in ids)


def flag(name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise RequestError(f"{name} must be true or false, not {shown(value)}")
    return bool(value)


def check_seed(seed) -> int | None:
    """A seed as the runtime takes it: a whole number >= 0, or None or -1 (RANDOM_SEED) for a random one (None)."""
    seed = None if seed is None else whole("seed", seed, low=RANDOM_SEED, hint=SEED_HINT)
    return None if seed == RANDOM_SEED else seed


def whole(name: str, value, low: int | None = None, high: int | None = None, hint: str = "") -> int:
    """A Python or NumPy integer (not a bool, not a float that happens to be whole) within [low, high]."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise RequestError(f"{name} must be a whole number{hint}, not {shown(value)} ({type(value).__name__})")
    value = int(value)
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"from {low} to {high}"
        raise RequestError(f"{name} must be {bounds}{hint}, not {shown(value)}")
    return value


def real(name: str, value) -> float:
    """A finite real number that float32 (the engines' type for it) can hold."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise RequestError(f"{name} must be a number, not {shown(value)} ({type(value).__name__})")
    if isinstance(value, np.generic):  # NumPy 2 compares a float16 with FLOAT32_MAX in float16: an overflow warning
        value = value.item()
    # abs() first: math.isfinite raises OverflowError for an int beyond any float (JSON's 1 and 400 zeros)
    if abs(value) > FLOAT32_MAX or not math.isfinite(value):  # 1e39 is finite, yet float32 makes it inf: say why
        raise RequestError(f"{name} must be a finite number float32 holds (at most {FLOAT32_MAX:.3g} in size), "
                           f"not {shown(value)}")
    return float(value)


def utf8(name: str, text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RequestError(f"{name} is not valid UTF-8: {exc.reason} at character {exc.start} (an escape of half a "
                           "surrogate pair); escape both halves or write the character itself") from None


# The engine I/O contract (see manifest.py) beyond the KV buffers: name -> ONNX type. A greedy-only graph
# has neither the sampling inputs nor `probs`, and outputs the logits the sampler reads.
INPUTS = {"input_ids": "tensor(int64)", "seqlens_k": "tensor(int32)", "total_len": "tensor(int32)",
          "num_drafts": "tensor(int64)"}
SAMPLING_INPUTS = {"temperature": "tensor(float)", "top_k": "tensor(int64)", "top_p": "tensor(float)",
                   "draft_probs": "tensor(float)", "uniforms": "tensor(float)"}
# Engines and samplers compiled before min_p lack its input; they still load, and sample without it.
MIN_P = "min_p"
LATER_SAMPLING_INPUTS = {MIN_P: "tensor(float)"}
# vLLM's penalties (manifest.py), in the target's engine graph and the sampler (not the draft's engine graph, which takes
# logit_bias alone, nor the greedy-only or steps graphs); graphs compiled before them lack all five, and decide without
# penalties.
PENALTY_INPUTS = {"repetition_penalty": "tensor(float)", "presence_penalty": "tensor(float)",
                  "frequency_penalty": "tensor(float)", "prompt_mask": "tensor(bool)", "output_counts": "tensor(float)"}
# vLLM's min_tokens (manifest.py), where the penalties are, in graphs compiled since (before: all absent).
MIN_TOKENS_INPUTS = {"min_tokens_left": "tensor(int64)", "stop_tokens": "tensor(bool)"}
LOGIT_BIAS = "logit_bias"  # [1 or D+1, V]: OpenAI's logit_bias and a grammar's mask, alike
LOGIT_BIAS_INPUTS = {LOGIT_BIAS: "tensor(float)"}
OUTPUTS = {"accepted": "tensor(int64)", "next_token": "tensor(int64)"}
SAMPLING_OUTPUTS = {"probs": "tensor(float)"}
LOGITS = "logits"  # the fp32 logits an engine graph decides on (manifest.py): a greedy-only graph's sampler reads them
GREEDY_OUTPUTS = {LOGITS: "tensor(float)"}
CACHE_TYPES = {"fp32": "tensor(float)", "fp16": "tensor(float16)", "bf16": "tensor(bfloat16)"}


def check_engine_io(path, inputs: dict, outputs: dict, info, max_seq_len: int, graph: str) -> int:
    """The manifest's description of an engine against one of its graphs' own inputs/outputs (name ->
    (ONNX type, shape)): an edited manifest fails here, at load, instead of inside a call. graph: "engine"
    (the engine file), "greedy" (its greedy-only graph) or "steps" (a draft's steps graph). Returns the
    tokens a steps graph drafts per call (0 for the others)."""
    def fail(what: str) -> None:
        raise BundleError(f"engine {path} does not match the bundle's manifest: {what}; the manifest was edited "
                          "or the bundle is damaged: rebuild it with `specbuild compile`")

    shape = info.shape
    steps = 0
    if graph == "steps":
        drafts = outputs.get("drafts", (None, []))[1]
        steps = drafts[0] if len(drafts) == 1 and isinstance(drafts[0], int) else 0
        if steps < 1:
            fail("it has no 'drafts' output of a fixed length")
    cache = [name for pair in cache_names(shape.num_layers) for name in pair]
    cache += [name for j in range(1, steps) for name in step_presents(shape.num_layers, j)]
    io = {"engine": {**INPUTS, **OUTPUTS, **SAMPLING_INPUTS, **SAMPLING_OUTPUTS},
          "greedy": {**INPUTS, **OUTPUTS, **GREEDY_OUTPUTS},
          "steps": {"input_ids": INPUTS["input_ids"], "seqlens_k": INPUTS["seqlens_k"], "drafts": "tensor(int64)",
                    **{step_total_len(j): INPUTS["total_len"] for j in range(steps)}}}[graph]
    if graph == "engine":
        io.update({name: onnx_type for name, onnx_type in LATER_SAMPLING_INPUTS.items() if name in inputs})
    for later in (PENALTY_INPUTS, MIN_TOKENS_INPUTS, LOGIT_BIAS_INPUTS):
        if graph != "steps" and later.keys() & inputs.keys():
            io.update(later)
    if graph != "steps" and info.rope_switch_length:
        io[LONG_ROPE] = "tensor(int64)"
    elif LONG_ROPE in inputs:
        fail(f"it has a {LONG_ROPE!r} input, which the manifest's engine (no rope_switch_length) lacks")
    expected = {**io, **{name: CACHE_TYPES[info.precision] for name in cache}}
    found = {**inputs, **outputs}
    for name, onnx_type in expected.items():
        if name not in found:
            fail(f"it has no {name!r} (the manifest says {shape.num_layers} layers)")
        if found[name][0] != onnx_type:
            fail(f"{name!r} is {found[name][0]}, the manifest's {info.precision} engine needs {onnx_type}")
    if LOGIT_BIAS in inputs and len(inputs[LOGIT_BIAS][1]) != 2:  # [V]: compiled before grammars' per-row masks
        fail(f"its {LOGIT_BIAS!r} input has one row for every decision, where the runtime gives each row its own")
    extra_layers = [name for name in inputs if name.startswith("past_") and name not in expected]
    if extra_layers:
        fail(f"it has {extra_layers[0]!r} beyond the manifest's {shape.num_layers} layers")
    unknown = [name for name in inputs if name not in expected]
    if graph == "steps" and unknown:  # it would fail in its first call, in onnxruntime's words
        fail(f"its steps graph has an input {unknown[0]!r} the contract does not know")
    kv = [1, shape.num_kv_heads, max_seq_len, shape.head_dim]
    for name in cache:
        if found[name][1] != kv:
            fail(f"{name!r} has shape {found[name][1]}, the manifest says {kv} "
                 "(1, kv heads, max-seq-len, head dim)")
    if graph == "engine" and inputs["draft_probs"][1][-1] != shape.vocab_size:
        fail(f"'draft_probs' has {inputs['draft_probs'][1][-1]} columns, the manifest's vocabulary is {shape.vocab_size}")
    return steps


def check_sampler_io(path, inputs: dict, outputs: dict) -> None:
    """The sampler's inputs/outputs (name -> ONNX type) against the contract (manifest.py)."""
    expected = {**GREEDY_OUTPUTS, "input_ids": INPUTS["input_ids"], "num_drafts": INPUTS["num_drafts"],
                **SAMPLING_INPUTS, **OUTPUTS, **SAMPLING_OUTPUTS,
                **{name: onnx_type for name, onnx_type in LATER_SAMPLING_INPUTS.items() if name in inputs},
                **{name: onnx_type for later in (PENALTY_INPUTS, MIN_TOKENS_INPUTS, LOGIT_BIAS_INPUTS)
                   if later.keys() & inputs.keys()
                   for name, onnx_type in later.items()}}
    found = {**inputs, **outputs}
    wrong = next((name for name, onnx_type in expected.items() if found.get(name) != onnx_type), None)
    if wrong:
        raise BundleError(f"the sampler {path} has no {wrong!r} of type {expected[wrong]}; the bundle is damaged: "
                          "rebuild it with `specbuild compile`")


def check_vocabularies(target, draft) -> None:
    """A draft proposes only tokens the target has: the compiler cuts a larger draft table to the
    target's vocabulary (format 2), so a larger one means an edited or foreign bundle."""
    if draft.vocab_size > target.vocab_size:
        raise BundleError(f"the draft engine {draft.path} has a vocabulary of {draft.vocab_size}, larger than the "
                          f"target's {target.vocab_size}; rebuild the bundle with `specbuild compile`")
