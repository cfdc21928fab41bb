"""Speculative decoding over a bundle: the draft proposes γ tokens, the target's graph verifies them.

Token-for-token identical to the target's own decoding: greedy, every emitted token is the target's
argmax given the tokens before it; sampling, every token follows the target's distribution (Leviathan et
al. 2023). Drafts only decide how many tokens one target call produces.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import os
import threading
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing, closing
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import AsyncGenerator, Callable, ClassVar, Generator, cast, overload

import numpy as np
from tokenizers import Tokenizer

from .engine import CAPTURED_BY_DEFAULT, Engine, Sampler, Takes, requested_device, use_shared_thread_pool
from .errors import BundleError, DeviceError, RequestError, first_line
from .grammar import GRAMMAR_CACHE, Grammars, Guide, Structured, Unchecked, check_structured_outputs
from .logprobs import TokenLogprobs, token_logprobs
from .manifest import TOKENIZER_DIR, Manifest, digests_checked, load_manifest, read_tokenizer_config
from .policy import (FREE_GUESSES, GREEDY_DECAYS, MAX_PROBE_EVERY, SAMPLING_DECAYS, AdaptiveGamma, Costs, FixedGamma,
                     PriorCosts, prior_draft_cost)
from .pool import SlotPool, check_memory
from .relay import Relay
from .slot import (MAX_REUSED_IDS, NEVER_ALONE, WARM_UP_RUNS, Halt, Rows, Slot, check_gpu_total_len, fixed_rows,
                   unsteady_calls)
from .text import TextStream, token_span
from .validation import (AUTO, NO_PENALTIES, PENALTIES, Prompt, Request, check_request, check_text_fits, check_vocabularies,
                         flag, real, shown, utf8, whole)

# stream_request's items: text, or where the request asks for logprobs (text, the records of the tokens since the last)
TextItem = str | tuple[str, tuple[TokenLogprobs, ...]]


def load_tokenizer(path: Path) -> Tokenizer:
    """The bundle's tokenizer. tokenizers raises a bare Exception for a missing file and bad JSON alike, which
    the digest check catches first unless it is skipped (check_digests=False, serve --no-check-digests)."""
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:
        raise BundleError(f"bundle file {path} cannot be loaded as a tokenizer ({first_line(exc)}); rebuild the bundle "
                          "with `specbuild compile`") from None
    # A tokenizer.json saved with truncation or padding on (a fine-tune's training settings) would cut or pad every
    # prompt here; transformers turns both off for a call that asks for neither (set_truncation_and_padding), and so
    # encodes the whole prompt: the target's own output is that of the whole prompt.
    tokenizer.no_truncation()
    tokenizer.no_padding()
    # transformers keeps split_special_tokens in tokenizer_config.json (tokenizer.json cannot say it): a tokenizer
    # saved with it encodes special tokens written in the text as text, in prompts and rendered chat templates alike.
    settings = read_tokenizer_config(path.parent)
    tokenizer.encode_special_tokens = isinstance(settings, dict) and settings.get("split_special_tokens") is True
    return tokenizer


def tokenizer_eos(tokenizer: Tokenizer, tokenizer_dir: Path) -> int | None:
    """The id of tokenizer_config.json's eos_token (vLLM's model eos), None where it names none."""
    config = read_tokenizer_config(tokenizer_dir)
    token = config.get("eos_token") if isinstance(config, dict) else None
    text = token.get("content") if isinstance(token, dict) else token
    return tokenizer.token_to_id(text) if isinstance(text, str) else None


def encode_ids(tokenizer: Tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """tokenizer.encode(text).ids, computed without the GIL: tokenizers' encode holds it throughout (~2 s a MB here),
    so a long prompt checked in a thread (serve, the async API) froze the event loop and every other request's Python;
    encode_batch releases it (and gives the same ids)."""
    return tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids


@dataclass
class Stats:
    """What one request measured (what it asked for is its Request). α is over drafted tokens, τ over every
    round, those without drafts (γ 0, free guesses) included. accepted (and accepted_at, α) counts the drafts the
    target accepted, as vLLM's num_accepted_tokens and llama.cpp's n_draft_accepted do: in the round whose token ended
    the request (an eos, a stop token or string), those after that token too, which are never emitted. They judge the
    draft; generated_tokens (and τ) count what was emitted."""

    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # leading prompt tokens the slot's target cache held already (prefix reuse)
    generated_tokens: int = 0
    rounds: int = 0  # target calls after the prompt
    drafted: int = 0
    accepted: int = 0
    # Kept out of repr: one entry per position or token would bury the counts (a Generation's repr included).
    accepted_at: list[int] = field(default_factory=list, repr=False)  # rounds whose draft j was accepted
    proposed_at: list[int] = field(default_factory=list, repr=False)  # rounds that proposed a draft at j
    token_times: list[float] = field(default_factory=list, repr=False)  # seconds since the call began
    gamma_rounds: dict[int, int] = field(default_factory=dict)  # γ used -> rounds
    draft_seconds: float = 0.0
    # rounds whose target rows checked free proposals ahead of any drafts: a grammar's forced tokens, or free guesses in
    # rounds without drafts (see _speculate)
    guessed: int = 0
    guesses_accepted: int = 0  # free proposals the target accepted
    target_seconds: float = 0.0  # rounds only, the prompt's call excluded
    # "eos", "stop" (a stop string), "stop_token" (one of stop_token_ids), "max_new_tokens", "context", or "abort"
    # (closed before)
    finish_reason: str = ""
    # what ended it, as vLLM's: the stop string, or the stop token id (an eos besides the tokenizer's too); else None
    stop_reason: str | int | None = None

    # The class's, not a field: a Stats holding a lock could not be pickled or deep-copied.
    _claiming: ClassVar[threading.Lock] = threading.Lock()

    def claim(self, prompt_tokens: int) -> None:
        """Make these the figures of a request of prompt_tokens tokens (at least 1: request() refuses an empty prompt),
        or a RequestError where another request's are here: its counts would carry over into this one, which ended
        after one token, unsaid. Checked and set at once: two requests queued with one Stats each found it new."""
        with self._claiming:
            if self.prompt_tokens:
                raise RequestError("stats holds another request's figures (a Stats measures one request); pass a new "
                                   "Stats() to each call")
            self.prompt_tokens = prompt_tokens

    def record_round(self, drafted: int, accepted: int, draft_seconds: float, target_seconds: float) -> None:
        self.rounds += 1
        self.gamma_rounds[drafted] = self.gamma_rounds.get(drafted, 0) + 1
        self.drafted += drafted
        self.accepted += accepted
        self.draft_seconds += draft_seconds
        self.target_seconds += target_seconds
        for j in range(drafted):
            self.proposed_at[j] += 1
            self.accepted_at[j] += j < accepted

    @property
    def acceptance_rate(self) -> float:
        """α: accepted / proposed drafts; NaN where none were proposed (target-only, or auto at γ 0 throughout), as
        vLLM's spec-decode metrics give it: 0 would read as every draft rejected. to_dict writes it null."""
        return self.accepted / self.drafted if self.drafted else math.nan

    @property
    def mean_accepted_tokens(self) -> float:
        """τ: tokens emitted per target call after the prompt (accepted drafts + the target's own)."""
        return (self.generated_tokens - 1) / self.rounds if self.rounds else 0.0

    @property
    def ttft_ms(self) -> float:
        return 1e3 * self.token_times[0] if self.token_times else 0.0

    @property
    def tokens_per_second(self) -> float:
        """Decode speed, prompt excluded: tokens after the first over the time after the first."""
        if len(self.token_times) < 2:
            return 0.0
        return (len(self.token_times) - 1) / max(self.token_times[-1] - self.token_times[0], 1e-9)

    def itl_ms(self, q: float) -> float:
        """The q-th percentile (0 to 100) of the times between tokens, in ms; 0 with fewer than two tokens."""
        if not 0 <= real("q", q) <= 100:  # numpy's refusal came from deep inside it, and only with two tokens or more
            raise RequestError(f"q must be from 0 to 100 (a percentile), not {shown(q)}")
        gaps = np.diff(self.token_times)
        return float(1e3 * np.percentile(gaps, q)) if len(gaps) else 0.0

    def to_dict(self) -> dict:
        # JSON has no NaN: an α of nothing proposed, the request's or a position's, is null
        per_position = [round(a / p, 4) if p else None for a, p in zip(self.accepted_at, self.proposed_at)]
        return {
            "prompt_tokens": self.prompt_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "rounds": self.rounds,
            "acceptance_rate": round(self.acceptance_rate, 4) if self.drafted else None,
            "mean_accepted_tokens": round(self.mean_accepted_tokens, 4),
            "per_position_acceptance": per_position,
            "tokens_per_second": round(self.tokens_per_second, 2),
            "ttft_ms": round(self.ttft_ms, 3),
            "itl_ms_p50": round(self.itl_ms(50), 3),
            "itl_ms_p95": round(self.itl_ms(95), 3),
            "gamma_rounds": dict(sorted(self.gamma_rounds.items())),
            "guessed": self.guessed,
            "guesses_accepted": self.guesses_accepted,
            "draft_step_ms": round(1e3 * self.draft_seconds / self.drafted, 4) if self.drafted else 0.0,
            "target_step_ms": round(1e3 * self.target_seconds / self.rounds, 4) if self.rounds else 0.0,
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
        }


@dataclass
class Generation:
    # the tokens' text as it follows the prompt's (text.TextStream), cut before a stop string, the eos's or stop token's
    # left out (unless include_stop_str_in_output)
    text: str
    # every token generated, the one that completed a stop string (or the eos or stop token) included
    token_ids: list[int]
    prompt_token_ids: list[int]
    stats: Stats
    # (logprobs asked for) one per token of token_ids: its logprob under the target and the top alternatives
    logprobs: list[TokenLogprobs] | None = field(default=None, repr=False)
    # (prompt_logprobs asked for) one per token of prompt_token_ids, None for the first (nothing before it), as vLLM's
    prompt_logprobs: list[TokenLogprobs | None] | None = field(default=None, repr=False)


class SpeculativeDecoder:
    """Loads a bundle (checking its manifest, digests and engines) and decodes with it.

        decoder = SpeculativeDecoder("bundle/")
        result = decoder.generate("def fib(n):", max_new_tokens=64)        # γ adapts (gamma="auto")
        result = decoder.generate("def fib(n):", gamma=4, stop=["\\n\\n"])   # fixed γ, cut at a stop string
        for token_id in decoder.stream("def fib(n):", gamma=0): ...       # target only
        for delta in decoder.stream_text("def fib(n):"): ...              # text as it is decoded
        async for delta in decoder.astream_text("def fib(n):"): ...       # the same, for asyncio

    Threads: a decoder is safe to share. The engines' sessions (the weights) are loaded once; each
    generate/stream/stream_text call holds one of `parallel` slots (a KV cache and bindings per engine)
    from its first token to its last, and decodes exactly as it would alone. A call waits while every
    slot is busy (first come, first served), except in a thread that last advanced a stream holding one
    (two unfinished streams interleaved in one thread, as asyncio code does): there it raises RequestError
    after pool.SAME_THREAD_PATIENCE seconds unless another thread takes that stream over meanwhile (a thread
    pool running each next() on any worker), since otherwise only that thread could free one. A stream
    frees its slot when it ends, is closed, or is garbage-collected. One stream's generator must not be
    advanced from two threads at once (Python refuses that itself). astream/astream_text/agenerate decode in
    the decoder's own worker threads (`workers`, one per slot), so the event loop never waits for a decode step.

    device: "cpu", "cuda" (onnxruntime-gpu; an error if its CUDA provider is missing) or "auto" (CUDA if
    available). target_rows: how target calls group rows (see slot.Rows); by default NEVER_ALONE on the
    CPU and fixed_rows(γ max) on a GPU. cuda_graphs: load the engines' greedy-only graphs (no control
    flow) and, on CUDA, replay each call shape as a CUDA graph once captured (onnxruntime's
    enable_cuda_graph), which saves launching every kernel from the host; sampled requests sample with the
    bundle's sampler from each call's logits (uncaptured: top-k and top-p are control flow), drawing the
    same tokens, and the engines' calls take turns across threads (see engine._CUDA_GRAPH_CALLS). On the
    CPU the same graphs run as they are. None (the default): on where graphs_by_default says. draft_steps:
    greedy rounds draft with the draft's steps graph (manifest.py; bundles have one since it came), several
    tokens a call, where a round drafts that many (the same drafts as a call per token). It is a second
    session of the draft's weights, so it costs their memory again: None (the default) uses it on CUDA,
    where a call per token waits for the host each time, and not on the CPU, where it decoded 3-4% faster
    at fixed γ and no faster in auto (docs/gpu.md). prefix_reuse: a request starts where the prompt leaves
    the tokens its slot's caches hold from earlier requests (a chat resending its conversation computes only
    what is new), where that is exact by construction (see reuses_prefixes); False computes every prompt whole.
    grammar_cache: how many compiled grammars (structured_outputs) the decoder keeps for the requests that send them
    again, the least recently used evicted first (grammar.Grammars).
    """

    def __init__(self, bundle: str | Path, device: str = "cpu", parallel: int = 1, shared_thread_pool: bool = False,
                 check_digests: bool = True, target_rows: Rows | None = None, cuda_graphs: bool | None = None,
                 draft_steps: bool | None = None, prefix_reuse: bool = True, grammar_cache: int = GRAMMAR_CACHE):
        """shared_thread_pool: faster, but changes every onnxruntime session of the process
        (see engine.use_shared_thread_pool); for processes that only decode."""
        # Checked before use: cuda_graphs="no" counted as true, target_rows=5 failed as an AttributeError at load. And
        # before anything loads or changes: parallel=0 was refused after the shared pool had changed the process.
        parallel, grammar_cache = whole("parallel", parallel, low=1), whole("grammar_cache", grammar_cache, low=1)
        shared_thread_pool = flag("shared_thread_pool", shared_thread_pool)
        check_digests, prefix_reuse = flag("check_digests", check_digests), flag("prefix_reuse", prefix_reuse)
        cuda_graphs = None if cuda_graphs is None else flag("cuda_graphs", cuda_graphs)
        draft_steps = None if draft_steps is None else flag("draft_steps", draft_steps)
        if target_rows is not None and not isinstance(target_rows, Rows):
            raise RequestError(f"target_rows must be None or a slot.Rows (slot.fixed_rows(n)), not "
                               f"{shown(target_rows)}")
        if shared_thread_pool:
            use_shared_thread_pool()
        check_gpu_total_len()
        if not isinstance(bundle, (str, os.PathLike)):
            raise BundleError(f"bundle must be a path to a bundle folder, not {bundle!r:.40}")
        self.root = Path(bundle)
        folder = _identity(self.root)
        self.device = requested_device(device)
        self.manifest = load_manifest(self.root, check_digests=False, require_engines=True, device=self.device)
        self.max_seq_len = self.manifest.max_seq_len
        self.max_gamma = self.manifest.gamma
        if target_rows is not None and target_rows.fixed and target_rows.least <= self.max_gamma:
            # a verification of max γ drafts is max γ + 1 rows, which no call of fewer can hold (an onnxruntime Gather
            # failed at γ 5 and up under fixed_rows(4), "report it")
            raise RequestError(f"target_rows: fixed calls of {target_rows.least} rows cannot verify the "
                               f"{self.max_gamma} drafts this bundle's γ allows; pass slot.fixed_rows({self.max_gamma})")
        self.eos_token_ids = set(self.manifest.eos_token_ids)
        if draft_steps and not self.manifest.engines["draft"].steps_file:
            raise BundleError(f"{self.root} has no steps graph for its draft (compiled before it, or with max γ 1, where "
                              "a round drafts one token anyway): rebuild it with `specbuild compile`, or leave "
                              "draft_steps (--draft-steps) unset")
        if cuda_graphs and not self.manifest.has_greedy_graphs:
            raise BundleError(f"{self.root} lacks the greedy-only graphs or the sampler, which CUDA graphs need (it was "
                              "compiled by an older specbuild): rebuild it with `specbuild compile`")
        self.cuda_graphs = graphs_by_default(self.manifest, self.device, parallel) if cuda_graphs is None else cuda_graphs
        slot_bytes = self.max_seq_len * sum(e.kv_bytes_per_position for e in self.manifest.engines.values())
        if self.device == "cpu":
            check_memory(parallel, slot_bytes)
        replaced = BundleError(f"{self.root} was replaced while it loaded (a compile --overwrite finished meanwhile); "
                               "load it again")
        try:
            with digests_checked(self.root, self.manifest, check_digests):
                self.tokenizer = load_tokenizer(self.root / TOKENIZER_DIR / "tokenizer.json")
                # vLLM makes the generation_config's eos ids other than the tokenizer's stop_token_ids
                # (SamplingParams.update_from_generation_config): a reply one of them ends reports it as its stop_reason
                self.tokenizer_eos = tokenizer_eos(self.tokenizer, self.root / TOKENIZER_DIR)
                self.token_span = token_span(self.tokenizer)
                self.grammars = Grammars(self.tokenizer, self.tokenizer.get_vocab_size(with_added_tokens=True),
                                         self.manifest.engines["target"].shape.vocab_size, list(self.eos_token_ids),
                                         grammar_cache)
                try:
                    self.target, self.draft, self.steps_engine = self._engines(draft_steps)
                except DeviceError:
                    if device != "auto":
                        raise
                    self.device = "cpu"  # the CUDA provider is installed but could not start: "auto" takes the CPU
                    self.cuda_graphs = bool(cuda_graphs)
                    check_memory(parallel, slot_bytes)
                    self.target, self.draft, self.steps_engine = self._engines(draft_steps)
        except BundleError:
            # The weights are hashed while the engines load: a file gone or changed there, where a new bundle was
            # swapped in at the path meanwhile, is the swap's doing, not a damaged bundle's
            if _identity(self.root) != folder:
                raise replaced from None
            raise
        if _identity(self.root) != folder:  # the engines may be another bundle's than the manifest checked
            raise replaced
        self.vocab_size = self.target.vocab_size
        check_vocabularies(self.target, self.draft)
        rows = target_rows or (fixed_rows(self.max_gamma) if self.device == "cuda" else NEVER_ALONE)
        self.prefix_reuse = prefix_reuse and reuses_prefixes(self.target, rows)  # fixed per decoder: its engine and rows
        self.slots = SlotPool([Slot(i, self.target, self.draft, rows, self.max_gamma, self.steps_engine) for i in range(parallel)],
                              affinity=self.target.captures)
        # Adaptive γ: the costs of a round describe the machine and are shared; α follows the text a slot
        # decodes, so each slot keeps its own (carried over to its next request, as the pair's agreement
        # is). Both differ by the request's kind (_kind): one of each per kind.
        draft_bytes, target_bytes = self.draft.info.bytes_per_call, self.target.info.bytes_per_call
        self._draft_cost = draft_cost = draft_bytes / target_bytes
        self._prior_draft_cost = prior_draft_cost(draft_bytes, target_bytes)  # a seeded sampled request's (_policy)
        costs = {kind: Costs(self.max_gamma, draft_cost) for kind in KINDS}
        # Per slot, the last prompt it scored (see _score), whose records a prompt sharing its head reuses.
        self._scored: list[Scored | None] = [None] * parallel
        self._policies = [{kind: AdaptiveGamma(self.max_gamma, draft_cost, SAMPLING_DECAYS if kind[0] else GREEDY_DECAYS,
                                               costs[kind]) for kind in KINDS}
                          for _ in range(parallel)]
        # The threads the async API (and `specbuild serve`) decode in, started on first use: one per slot, and kept,
        # since onnxruntime keeps CUDA graphs per thread (SlotPool gives a thread its slot of last time again).
        self.workers = ThreadPoolExecutor(parallel, thread_name_prefix="specbuild-slot")
        _DECODERS.add(self)

    def _engines(self, draft_steps: bool | None) -> tuple[Engine, Engine, Engine | None]:
        """The target, the draft and (draft_steps) the draft's steps graph."""
        info = self.manifest.engines
        draft_steps = (self.device == "cuda" if draft_steps is None else draft_steps) and bool(info["draft"].steps_file)
        sampler = Sampler(self.root / self.manifest.sampler_file, self.device) if self.cuda_graphs else None
        target, draft = (Engine(self.root / (info[role].greedy_file if self.cuda_graphs else info[role].file), info[role],
                                self.max_seq_len, self.device, cuda_graphs=self.cuda_graphs, sampler=sampler)
                         for role in ("target", "draft"))
        steps = (Engine(self.root / info["draft"].steps_file, info["draft"], self.max_seq_len, self.device,
                        cuda_graphs=self.cuda_graphs, steps=True) if draft_steps else None)
        return target, draft, steps

    def encode(self, text: str) -> list[int]:
        """The token ids the bundle's tokenizer gives text, special tokens included (as generate reads a str)."""
        # tokenizers' refusal of another type, or of half a surrogate pair, named neither; it encoded a list as a pair
        if not isinstance(text, str):
            raise RequestError(f"text must be a str (encode takes one text), not {shown(text)} ({type(text).__name__})")
        utf8("text", text)
        return encode_ids(self.tokenizer, text)

    def warm_up(self) -> int:
        """Capture the calling thread's CUDA graphs now instead of in its first requests (vLLM captures at start-up
        too): a short greedy and a short seeded sampled request at every γ, each run WARM_UP_RUNS + 1 times (a
        shape is captured at its third run on a thread), in the slot this thread takes again later (SlotPool).
        Shapes these do not meet (a long catch-up; all of a γ's when a request ends at EOS first) are captured
        when first met. Returns the CUDA graphs captured, by other threads meanwhile too; does nothing where
        the engines do not capture."""
        if not self.target.captures:
            return 0
        before = self.graphs_captured
        # Room for the longest request below in the smallest context a bundle may have.
        prompt = self.encode("def warm_up(x):\n    return x\n")[: max(1, self.max_seq_len - 2 * self.max_gamma - 3)]
        try:
            for gamma in range(self.max_gamma + 1):
                for temperature, seed in ((0.0, None), (1.0, 0)):
                    for _ in range(WARM_UP_RUNS + 1):  # a fixed γ leaves the adaptive policies as they were
                        self.generate(prompt, max_new_tokens=2 * gamma + 3, gamma=gamma, temperature=temperature,
                                      seed=seed)
        except BundleError as exc:  # an fp16 target that overflows: serve would stop at start-up on a request nobody sent
            raise BundleError(f"warming up (a short code prompt, before any request): {exc}") from None
        return self.graphs_captured - before

    def warm_up_workers(self) -> int:
        """warm_up on each of the worker threads the async API decodes in (`specbuild serve` runs it at start-up),
        each in a slot of its own, which it then keeps. Returns the CUDA graphs captured."""
        if not self.target.captures:
            return 0
        before = self.graphs_captured
        # No task ends before all have begun, so each runs on a worker thread of its own.
        started = threading.Barrier(self.slots.size, timeout=60)

        def task() -> None:
            started.wait()
            self.warm_up()
        try:
            tasks = [self.workers.submit(task) for _ in range(self.slots.size)]
        except BaseException:
            started.abort()  # the tasks already started would wait for the others forever
            raise
        for future in tasks:
            future.result()
        return self.graphs_captured - before

    @property
    def has_min_p(self) -> bool:
        """Whether both engines sample with min_p (a bundle compiled before it has neither)."""
        return self.target.has_min_p and self.draft.has_min_p

    @property
    def has_penalties(self) -> bool:
        """Whether the target decides with vLLM's penalties (a bundle compiled before them does not; the draft never
        applies them: see slot.Slot.configure)."""
        return self.target.has_penalties

    @property
    def graphs_captured(self) -> int:
        """CUDA graphs this decoder's engines have captured so far, in every thread."""
        return sum(engine.graphs_captured for engine in (self.target, self.draft, self.steps_engine) if engine is not None)

    def fits(self, max_new_tokens: int) -> Callable[[str], None]:
        """A check refusing, before it is tokenized, text too long for the context with max_new_tokens (as request
        refuses a text prompt), for text tokenized elsewhere: a chat template's render (serve, generate --chat)."""
        return partial(check_text_fits, token_span=self.token_span, max_seq_len=self.max_seq_len,
                       max_new_tokens=max_new_tokens, context_limit=self.manifest.context_limit)

    def request(self, prompt: Prompt, max_new_tokens: int = 128, gamma: int | str = AUTO,
                temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                stop: str | list[str] | None = None, logprobs: int | None = None, *, ignore_eos: bool = False,
                stop_token_ids: list[int] | None = None, include_stop_str_in_output: bool = False,
                skip_special_tokens: bool = True, min_p: float = 0.0, prompt_logprobs: int | None = None,
                repetition_penalty: float = 1.0, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                min_tokens: int = 0, logit_bias: dict[int, float] | None = None,
                structured_outputs: dict | Structured | Unchecked | None = None) -> Request:
        """The checked request (validation.check_request against this bundle), or a RequestError. The keyword-only
        options (which generate, stream, stream_text and their async forms pass on) are vLLM's SamplingParams':
        ignore_eos decodes past eos tokens (to max_new_tokens or the context); a token of stop_token_ids ends the
        request (finish_reason "stop_token"), as an eos does; include_stop_str_in_output ends the text with the stop
        string, or the eos or stop token's text, instead of leaving it out; skip_special_tokens false shows special
        tokens in the text; min_p (as vLLM's and llama.cpp's) samples only tokens at least min_p times as probable as
        the most probable, after temperature and before top_k and top_p (0: all); prompt_logprobs (generate and
        agenerate) scores the prompt as logprobs scores the tokens generated, and max_new_tokens may then be 0;
        repetition_penalty (above 0; 1: none) divides the positive logits of tokens in the prompt or generated so far
        and multiplies their negative ones, as transformers' and vLLM's; presence_penalty and frequency_penalty (in
        [-2, 2]; 0: none) subtract, from each generated token's logit, the penalty once and the penalty times its
        count, as OpenAI's and vLLM's. Penalties apply greedy and sampled, before temperature; logprobs stay raw.
        min_tokens (up to max_new_tokens) keeps the eos tokens (unless ignore_eos) and stop_token_ids out of the first
        min_tokens tokens, and a stop string ends it only past their text, as vLLM's; logit_bias ({token id: bias in
        [-100, 100]}, OpenAI's) adds each bias to its token's logit, before the penalties, as vLLM. structured_outputs
        (vLLM's: one of {"json": a JSON schema}, {"json_object": True}, {"regex": ...}, {"choice": [strings]}, {"grammar":
        Lark or GBNF}) decodes only what the grammar allows (grammar.py), greedy or sampled: the target's output under its
        mask; it ends at an eos, so it refuses ignore_eos and min_tokens beside it."""
        if (logprobs is not None or prompt_logprobs is not None) and not self.target.has_logits:
            raise RequestError(f"{self.root} was compiled before its engines gave their logits, so it gives no logprobs: "
                               "recompile it with `specbuild compile`")
        request = check_request(prompt, encode=self.encode, vocab_size=self.vocab_size, max_seq_len=self.max_seq_len,
                                max_gamma=self.max_gamma, max_new_tokens=max_new_tokens, gamma=gamma,
                                temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, stop=stop,
                                logprobs=logprobs, ignore_eos=ignore_eos, stop_token_ids=stop_token_ids,
                                include_stop_str_in_output=include_stop_str_in_output,
                                skip_special_tokens=skip_special_tokens, token_span=self.token_span,
                                context_limit=self.manifest.context_limit, min_p=min_p, prompt_logprobs=prompt_logprobs,
                                repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                                frequency_penalty=frequency_penalty, min_tokens=min_tokens, logit_bias=logit_bias)
        # Begins with the field's name, as validation's messages do: serve's 400 names it as its `param`.
        if request.sampling.min_p and not self.has_min_p:
            raise RequestError(f"min_p needs a bundle compiled with min_p sampling; {self.root} was compiled before it: "
                               "recompile it with `specbuild compile`, or leave min_p out")
        if request.sampling.penalties != NO_PENALTIES and not self.has_penalties:
            name = next(name for name, value, neutral in zip(PENALTIES, request.sampling.penalties, NO_PENALTIES)
                        if value != neutral)
            raise RequestError(f"{name} needs a bundle compiled with sampling penalties; {self.root} was compiled before "
                               "them: recompile it with `specbuild compile`, or leave the penalties out")
        if request.sampling.min_tokens and not self.target.has_min_tokens:
            raise RequestError(f"min_tokens needs a bundle compiled with min_tokens; {self.root} was compiled before it: "
                               "recompile it with `specbuild compile`, or leave min_tokens out")
        if request.sampling.logit_bias and not self.target.has_logit_bias:
            raise RequestError(f"logit_bias needs a bundle compiled with logit_bias; {self.root} was compiled before it: "
                               "recompile it with `specbuild compile`, or leave logit_bias out")
        if structured_outputs is not None:
            request = replace(request, structured=self._structured(request, structured_outputs))
        return request

    def _structured(self, request: Request, structured_outputs: dict | Structured | Unchecked) -> Structured | None:
        """The grammar checked for this bundle's tokenizer, here (on serve's checking thread), where it is compiled
        unless the decoder keeps it already (grammar.Grammars): a grammar this tokenizer cannot follow is refused here,
        and the request's slot starts from a copy of the kept one."""
        field = getattr(structured_outputs, "field", "structured_outputs")
        if not self.target.has_logit_bias:
            raise RequestError(f"{field} needs a bundle compiled with logit_bias rows; {self.root} was compiled before "
                               f"them: recompile it with `specbuild compile`, or leave {field} out")
        # A grammar that has ended allows only an eos: past it, or with eos held back, no token would be left.
        if request.ignore_eos or request.sampling.min_tokens:
            raise RequestError(f"{field} ends where its grammar does, at an eos: leave "
                               f"{'ignore_eos' if request.ignore_eos else 'min_tokens'} out of such a request")
        return check_structured_outputs(structured_outputs, compile=self.grammars.compile)

    def generate(self, prompt: Prompt, max_new_tokens: int = 128, gamma: int | str = AUTO,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                 stop: str | list[str] | None = None, logprobs: int | None = None, **options) -> Generation:
        """Decode a prompt (text or token ids) to its end: max_new_tokens, an eos token, a stop string or the
        context. gamma: "auto" (adaptive), 0 (the target alone) or drafts per round; temperature 0 is greedy
        (the target's own output, token for token), above 0 samples the target's distribution exactly.
        logprobs: 0 to 20 gives the Generation's `logprobs`, one TokenLogprobs per token: its logprob under the
        target's raw distribution and that many most probable tokens'. options: request's keyword-only ones;
        prompt_logprobs=N gives the Generation's `prompt_logprobs` (None for the first token), to score text."""
        request = self.request(prompt, max_new_tokens, gamma, temperature, top_k, top_p, seed, stop, logprobs,
                               **_request_options("generate", options))
        *_, generation = self._generating(request)
        assert generation is not None  # _generating's last item
        return generation

    # A caller's type checker learns the items from logprobs: token ids without, TokenLogprobs with (astream too).
    @overload
    def stream(self, prompt: Prompt, max_new_tokens: int = ..., gamma: int | str = ..., temperature: float = ...,
               top_k: int = ..., top_p: float = ..., seed: int | None = ..., stop: str | list[str] | None = ...,
               stats: Stats | None = ..., logprobs: None = ..., **options) -> Generator[int, None, None]: ...

    @overload
    def stream(self, prompt: Prompt, max_new_tokens: int = ..., gamma: int | str = ..., temperature: float = ...,
               top_k: int = ..., top_p: float = ..., seed: int | None = ..., stop: str | list[str] | None = ...,
               stats: Stats | None = ..., *, logprobs: int, **options) -> Generator[TokenLogprobs, None, None]: ...

    @overload  # logprobs by position: every argument before it given too
    def stream(self, prompt: Prompt, max_new_tokens: int, gamma: int | str, temperature: float, top_k: int, top_p: float,
               seed: int | None, stop: str | list[str] | None, stats: Stats | None, logprobs: int,
               **options) -> Generator[TokenLogprobs, None, None]: ...

    def stream(self, prompt: Prompt, max_new_tokens: int = 128, gamma: int | str = AUTO,
               temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
               stop: str | list[str] | None = None, stats: Stats | None = None,
               logprobs: int | None = None, **options) -> Generator[int | TokenLogprobs, None, None]:
        """Yields generated token ids as the target accepts them (up to the one that completes a stop
        string), or with logprobs (0 to 20) each token's TokenLogprobs (see generate); pass a Stats to read
        measurements. The request is checked now, the slot taken at the first token."""
        request = self._streamed(prompt, max_new_tokens, gamma, temperature, top_k, top_p, seed, stop, logprobs,
                                 **_request_options("stream", options))
        return self._stream(request, Stats() if stats is None else stats)

    def _streamed(self, *args, **options) -> Request:
        """request(...) for a stream, whose items are the tokens generated: a prompt's logprobs would have no place."""
        if options.get("prompt_logprobs") is not None:
            raise RequestError("prompt_logprobs come with generate and agenerate (Generation.prompt_logprobs), not with a "
                               "stream: score the prompt with generate(prompt, 0, prompt_logprobs=N)")
        return self.request(*args, **options)

    def _streamed_text(self, caller: str, *args, **options) -> Request:
        """_streamed for stream_text and astream_text (caller), whose items are text alone: a token's logprobs would have
        no place (stream_request, the server's, pairs them with the text)."""
        if options.get("logprobs") is not None:
            raise RequestError(f"logprobs come with stream, astream and generate, not with {caller}: stream each token's "
                               "record with stream(..., logprobs=N), or (text, records) pairs with "
                               "stream_request(decoder.request(..., logprobs=N), stats)")
        return self._streamed(*args, **options)

    def _stream(self, request: Request, stats: Stats, halt: Halt | None = None) -> Generator:
        """stream's tokens, or their TokenLogprobs where the request asks for logprobs."""
        text = self._text(request) if request.stop else None
        if request.logprobs is None:
            return self._decode_request(request, stats, text, halt)
        records: list[TokenLogprobs] = []
        return _each_newest(self._decode_request(request, stats, text, halt, records), records)

    def stream_text(self, prompt: Prompt, max_new_tokens: int = 128, gamma: int | str = AUTO,
                    temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                    stop: str | list[str] | None = None, stats: Stats | None = None,
                    **options) -> Generator[str, None, None]:
        """Yields text as it is decoded: the deltas join to exactly generate(...).text (a character split
        across tokens, or text that may still become a stop string, waits for the tokens that settle it)."""
        request = self._streamed_text("stream_text", prompt, max_new_tokens, gamma, temperature, top_k, top_p, seed, stop,
                                      **_request_options("stream_text", options))
        # text alone: _streamed_text refused logprobs and prompt_logprobs, which pair records with it
        return cast(Generator[str, None, None], self.stream_request(request, Stats() if stats is None else stats))

    def stream_request(self, request: Request, stats: Stats, every_token: bool = False,
                       halt: Halt | None = None,
                       token_ids: list[int] | None = None) -> Generator[TextItem, None, None]:
        """stream_text for a request already checked by request() (the server checks before queueing).
        every_token: also yield "" for a token whose text is held back, so that the consumer can stop
        between any two tokens (a relay's stop: the async API's cancel, the server's deadlines). halt (slot.Halt): once
        set while the request waits for a slot, it stops waiting (a RequestError) instead of taking one; once set while
        a long prompt is scored or fed in chunks (the CPU's prefill, or the draft's catch-up on it), a RequestError
        before the next call, where the consumer would otherwise first see its stop at the first token.
        A request with logprobs yields (delta, the TokenLogprobs of the tokens decoded since the last) pairs, and
        one more at the end for tokens whose text never came (an eos, text a stop string cut). A request with
        prompt_logprobs first yields ("", the TokenLogprobs of each prompt token after the first) once they are known.
        token_ids: each token is appended to it before the item that holds its text (the server's return_token_ids)."""
        if not isinstance(request, Request):
            raise RequestError(f"stream_request streams what decoder.request(...) returns, not {shown(request)}")
        text = self._text(request)
        records: list[TokenLogprobs] | None = None if request.logprobs is None else []
        scored: list[TokenLogprobs] | None = None if request.prompt_logprobs is None else []
        given = 0
        with closing(self._decode_request(request, stats, text, halt, records, scored)) as tokens:
            for token in tokens:
                if scored is not None:  # before the token joins token_ids: this item holds none of its text
                    yield "", tuple(scored)
                    scored = None
                if token_ids is not None:
                    token_ids.append(token)
                if (delta := text.take()) or every_token:
                    if records is None:
                        yield delta
                    else:
                        yield delta, tuple(records[given:])
                        given = len(records)
        rest = _finish(text, stats)
        if scored is not None:  # nothing generated (max_new_tokens 0)
            yield "", tuple(scored)
        if records is None:
            if rest:
                yield rest
        elif rest or given < len(records):
            yield rest, tuple(records[given:])

    async def agenerate(self, prompt: Prompt, max_new_tokens: int = 128, gamma: int | str = AUTO,
                        temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                        stop: str | list[str] | None = None, logprobs: int | None = None, **options) -> Generation:
        """generate for asyncio: decodes in one of the decoder's worker threads (see astream), so cancelling the
        awaiting task stops it within the round in progress and frees its slot, which generate cannot."""
        check = partial(self.request, prompt, max_new_tokens, gamma, temperature, top_k, top_p, seed, stop, logprobs,
                        **_request_options("agenerate", options))
        async with aclosing(self._relay(check, self._generating, held=(None,))) as generation:
            return await anext(generation)

    @overload
    def astream(self, prompt: Prompt, max_new_tokens: int = ..., gamma: int | str = ..., temperature: float = ...,
                top_k: int = ..., top_p: float = ..., seed: int | None = ..., stop: str | list[str] | None = ...,
                stats: Stats | None = ..., logprobs: None = ..., **options) -> AsyncGenerator[int, None]: ...

    @overload
    def astream(self, prompt: Prompt, max_new_tokens: int = ..., gamma: int | str = ..., temperature: float = ...,
                top_k: int = ..., top_p: float = ..., seed: int | None = ..., stop: str | list[str] | None = ...,
                stats: Stats | None = ..., *, logprobs: int, **options) -> AsyncGenerator[TokenLogprobs, None]: ...

    @overload
    def astream(self, prompt: Prompt, max_new_tokens: int, gamma: int | str, temperature: float, top_k: int,
                top_p: float, seed: int | None, stop: str | list[str] | None, stats: Stats | None, logprobs: int,
                **options) -> AsyncGenerator[TokenLogprobs, None]: ...

    def astream(self, prompt: Prompt, max_new_tokens: int = 128, gamma: int | str = AUTO,
                temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                stop: str | list[str] | None = None, stats: Stats | None = None,
                logprobs: int | None = None, **options) -> AsyncGenerator[int | TokenLogprobs, None]:
        """stream for asyncio (`async for token_id in decoder.astream(...)`): the same tokens, decoded in one of
        the decoder's worker threads (relay.Relay), never on the event loop. The request is checked (off the loop)
        when iteration begins, and raises what stream would. Cancelling the consuming task, aclose(), or dropping
        the iterator stops decoding within the round in progress and frees the slot; a slow consumer does not
        hold the slot (decoding runs ahead of it, at most to the request's end)."""
        check = partial(self._streamed, prompt, max_new_tokens, gamma, temperature, top_k, top_p, seed, stop, logprobs,
                        **_request_options("astream", options))
        stats = Stats() if stats is None else stats
        return self._relay(check, lambda request, halt: self._stream(request, stats, halt))

    def astream_text(self, prompt: Prompt, max_new_tokens: int = 128, gamma: int | str = AUTO,
                     temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                     stop: str | list[str] | None = None, stats: Stats | None = None,
                     **options) -> AsyncGenerator[str, None]:
        """stream_text for asyncio, as astream is stream's."""
        check = partial(self._streamed_text, "astream_text", prompt, max_new_tokens, gamma, temperature, top_k, top_p,
                        seed, stop, **_request_options("astream_text", options))
        stats = Stats() if stats is None else stats
        return self._relay(check, lambda request, halt: self.stream_request(request, stats, True, halt), held=("",))

    async def _relay(self, check: Callable[[], Request], stream: Callable[[Request, threading.Event], Generator],
                     held: tuple = ()) -> AsyncGenerator:
        """The items of stream(check()) but `held`, decoded in a worker. The check runs in another thread: it
        tokenizes the prompt (milliseconds for a long one), and must not wait for a worker to come free."""
        request = await asyncio.to_thread(check)
        relay = Relay()
        relay.start(self.workers, partial(stream, request, relay.halt), held)  # a cancel stops its wait for a slot too
        try:
            async for item in relay:
                yield item
        finally:  # also when the consuming task is cancelled, or the iterator closed or collected
            await relay.close()

    def _generating(self, request: Request, halt: Halt | None = None) -> Generator[Generation | None, None, None]:
        """generate's decoding: None after every token (where a relay may stop it), then the Generation."""
        stats, text, tokens = Stats(), self._text(request), []
        records: list[TokenLogprobs] | None = None if request.logprobs is None else []
        scored: list[TokenLogprobs] | None = None if request.prompt_logprobs is None else []
        stopping = text if request.stop else None
        with closing(self._decode_request(request, stats, stopping, halt, records, scored)) as decoded:
            for token in decoded:
                tokens.append(token)
                yield None
        if not request.stop:  # nothing needs the text before the end: decoded once (~10 us a token saved)
            text.extend(tokens[:-1] if _leaves_out_last(request, stats) else tokens)
        _finish(text, stats)
        yield Generation(text.text, tokens, request.prompt_ids, stats, records, None if scored is None else [None, *scored])

    def _text(self, request: Request) -> TextStream:
        return TextStream(self.tokenizer, request.stop, request.prompt_ids, request.special_tokens, request.include_stop,
                          request.sampling.min_tokens)

    def _decode_request(self, request: Request, stats: Stats, text: TextStream | None,
                        halt: Halt | None = None, records: list[TokenLogprobs] | None = None,
                        scored: list[TokenLogprobs] | None = None) -> Generator[int, None, None]:
        """The request's tokens, decoded in a slot taken from the pool (text, where given, follows them and ends the
        request at a stop string); records (logprobs asked for) gets each one's TokenLogprobs before it is yielded, and
        scored (prompt_logprobs asked for) each prompt token's after the first, before the first token."""
        # Before the wait for a slot, which may be long. The class itself (stats=Stats) would pass _speculate's check that
        # a Stats is new, and the request would write its figure into the class.
        if not isinstance(stats, Stats):
            raise RequestError(f"stats must be a new Stats() for each call, not {shown(stats)}")
        with (self.slots.take(halt, self._cached(request)) as slot,
              closing(self._speculate(slot, request, stats, records, scored, halt)) as tokens):
            try:
                for token in tokens:
                    # An eos (or stop) token is no part of the text, as vLLM and OpenAI leave it out: a tokenizer need
                    # not mark it special (Phi-3's <|end|> first shipped unmarked), and decoding then shows it.
                    if text is not None and not _leaves_out_last(request, stats):
                        text.push(token)
                        if text.stopped:
                            stats.finish_reason, stats.stop_reason = "stop", text.stop_string
                    yield token
                    self.slots.claim(slot)  # the thread that resumed the stream is now the one that can finish it
                    if stats.finish_reason == "stop":
                        return
            except GeneratorExit:  # closed before its end (a consumer that stopped reading, a cancelled task)
                stats.finish_reason = stats.finish_reason or "abort"
                raise
            except RequestError:  # halted between a long prompt's calls (_score, slot.EngineSlot.step): as if closed
                if halt is not None and halt.is_set():
                    stats.finish_reason = stats.finish_reason or "abort"
                raise

    def _cached(self, request: Request) -> Callable[[Slot], int] | None:
        """The prompt tokens a slot's target cache would spare the request (as _speculate reuses them), for the
        pool to hand it the free slot that spares most: a chat's next turn finds its conversation in whichever slot
        decoded the last, not only where it happens to land."""
        if not self.prefix_reuse:
            return None
        ids = request.prompt_ids
        return lambda slot: slot.target.prefix(ids, len(ids) - 1)

    def _policy(self, slot: Slot, request: Request):
        """How the request's rounds choose γ. Greedy output is the target's whatever γ is; a sampled one
        depends on which random number judges which draft, so a seeded one under auto adapts to its own
        acceptance alone (policy.PriorCosts), not to timings and other requests: it reproduces. Fresh, it has no probe
        wait to carry over as a slot's policy does (MAX_PROBE_EVERY once the draft fails for long): where the prior
        keeps it at γ 0 from the start, probes after 8, 16, 32 rounds each caught the draft up on the prompt and the
        tokens since, 10% of the time (the demo pair at T 0.8 priced out of drafting, 2 CPU cores at load 9: 0.82x
        target-only, 0.93x without probes), so its first comes after MAX_PROBE_EVERY, as a warm policy's would."""
        sampling = request.sampling
        if isinstance(request.gamma, int):  # a fixed γ, not AUTO
            return FixedGamma(request.gamma)
        if sampling.seed is not None and not sampling.greedy:
            return AdaptiveGamma(self.max_gamma, self._prior_draft_cost, SAMPLING_DECAYS,
                                 PriorCosts(self.max_gamma, self._prior_draft_cost), probe_every=MAX_PROBE_EVERY)
        return self._policies[slot.index][_kind(request)]

    def _speculate(self, slot: Slot, request: Request, stats: Stats, records: list[TokenLogprobs] | None,
                   scored: list[TokenLogprobs] | None = None,
                   halt: Halt | None = None) -> Generator[int, None, None]:
        """The speculative loop over one slot. records, scored: see _decode_request; a token's comes from the row of
        the target's logits that decided it, computed alike whatever the round (slot.Rows), so γ and the draft change
        none. halt: see _score; a long prompt's chunks, the target's and the draft's, look at it too
        (slot.EngineSlot.step)."""
        sampling = request.sampling
        stats.claim(len(request.prompt_ids))
        clock = time.perf_counter
        start = clock()  # before scoring, which processes the prompt as the first call does where none is scored
        if scored is not None and request.prompt_logprobs is not None:  # scored: prompt_logprobs asked
            prompt_records, stats.cached_prompt_tokens = self._score(slot, request.prompt_ids, request.prompt_logprobs,
                                                                     halt)
            scored += prompt_records
            if not request.max_new_tokens:
                stats.finish_reason = "max_new_tokens"
                return
        slot.configure(sampling.temperature, sampling.top_k, sampling.top_p, logits=records is not None,
                       min_p=sampling.min_p, penalties=sampling.penalties, prompt=request.prompt_ids,
                       min_tokens=sampling.min_tokens,
                       stops=request.stop_token_ids | (set() if request.ignore_eos else self.eos_token_ids),
                       logit_bias=sampling.logit_bias)
        guide = self.grammars.guide(request.structured) if request.structured else None
        rng = sampling.generator()
        # n uniforms in [0, 1) a call: n-1 to judge drafts, the last to draw the next token.
        uniforms: Callable[[int], np.ndarray | None] = ((lambda n: None) if sampling.greedy else
                                                        (lambda n: rng.random(n, dtype=np.float32)))
        policy = self._policy(slot, request)
        target = slot.target
        max_len, max_new_tokens = self.max_seq_len, request.max_new_tokens
        switch = target.rope_switch
        positions = request.gamma if isinstance(request.gamma, int) else self.max_gamma
        ids = list(request.prompt_ids)
        stats.accepted_at = [0] * positions
        stats.proposed_at = [0] * positions
        not_finite = self.manifest.engines["target"].not_finite_token
        # Cache lengths: the target holds ids[:-1] after each round; the draft lags and catches up. Each starts
        # where the prompt leaves what the slot's cache holds (its target calls still re-feed what Rows asks for).
        # A sampled request's draft starts afresh: its distributions judge drafts, and its rows' bits depend on
        # how its calls grouped them (slot.AS_FED); greedy, drafts only decide how many tokens a round yields.
        # A scored prompt's calls left all of it but the last token in the cache, as a round leaves it.
        reused = len(ids) - 1 if scored is not None else target.prefix(ids, len(ids) - 1) if self.prefix_reuse else 0
        if scored is None:
            stats.cached_prompt_tokens = reused
        if guide:
            target.constrain(guide.masks([]))
        _, token = target.step(ids[reused:], total_len=len(ids), uniforms=uniforms(1), halt=halt)
        new_tokens = [token]
        logits = target.logits() if records is not None else None  # row j decided new_tokens[j]
        draft_len = slot.draft.prefix(ids, len(ids)) if self.prefix_reuse and sampling.greedy else 0
        # Auto mode, greedy: the token that last followed each token, for free guesses (see below; a
        # guess is verified like a draft, so it cannot change the output). Not under a grammar, where each guess
        # also costs a mask built on the host (guide.masks: 0.1 ms at the median, an eighth of a 2-row target call,
        # the demo pair under a JSON schema on 2 busy cores), and there they held 0.08 tokens a round: auto's rounds
        # without drafts, which should cost what target-only's do, cost more.
        follows = dict(zip(ids, ids[1:])) if request.gamma == AUTO and sampling.greedy and not guide else None
        while True:
            for j, token in enumerate(new_tokens):
                if token == not_finite:  # after the drafts judged on finite rows: where the target alone stops
                    raise self._not_finite(stats.generated_tokens + 1)
                if records is not None:
                    assert logits is not None and request.logprobs is not None  # records: logprobs asked, logits read
                    records.append(token_logprobs(logits[j], token, request.logprobs))
                if follows is not None:
                    follows[ids[-1]] = token
                ids.append(token)
                target.count(token)
                if guide:
                    guide.advance(token)
                stats.generated_tokens += 1
                stats.token_times.append(clock() - start)
                # Said before the token is yielded: a consumer may close the stream once it has the last one.
                if token in self.eos_token_ids and not request.ignore_eos:
                    stats.finish_reason, stats.stop_reason = "eos", None if token == self.tokenizer_eos else token
                elif token in request.stop_token_ids:
                    stats.finish_reason, stats.stop_reason = "stop_token", token
                elif stats.generated_tokens >= max_new_tokens:
                    stats.finish_reason = "max_new_tokens"
                elif len(ids) > max_len:  # only a round's last token gets here: rounds draft within the room left
                    stats.finish_reason = "context"
                yield token
                if stats.finish_reason:
                    return
            # No more drafts than the request or the cache has room for.
            room = min(max_new_tokens - stats.generated_tokens - 1, max_len - len(ids))
            if switch and len(ids) <= switch:
                # LongRoPE: a round up to the original length stops there, the next one begins past it, so that no
                # call has rows on both sides (slot.EngineSlot._choose_rope), and the first call past it begins at that
                # length (position O: the target's token of a round ending at O) in every mode.
                room = min(room, switch - len(ids))
            if guide and guide.ended:
                # Only an eos may follow: drafted, it would yield the one token the target's call yields anyway, for a
                # draft call that may catch up on the whole prompt first (26 of auto's 36 drafted rounds, greedy on the
                # demo pair under a yes/no regex, where most replies are a word and the eos).
                room = 0
            # Under a grammar, where it forces the next tokens (the rest of a choice's word, a schema's keys), a round
            # proposes them first, free (SGLang's jump-forward), then what the draft drafts after them, in one target
            # call: the draft reads them in its first call (docs/how-it-works.md, Forced tokens). In every mode, so a
            # fixed γ proposes γ tokens a round, f of them forced. Verified like drafts, they cannot change the output;
            # sampled, as drafts of a draft certain of them (slot.propose_certain).
            forced = guide.forced(min(room, positions)) if guide else []
            if forced and not sampling.greedy:
                slot.propose_certain(forced)
            # Auto drafts after a forced run only once the draft has read the prompt: its first call would catch up on
            # all of it (a sampled request's draft always starts afresh), which the policy prices against the room
            # max_new_tokens leaves, not the reply's, and replies of a few tokens never repay (on the demo pair under
            # an enum schema at T 0.8, drafting there decoded at 1.75-2.10x target-only, proposing the run alone
            # 2.29-2.50x: docs/how-it-works.md, Forced tokens); a round without forced tokens drafts first. A prompt
            # whose slot's draft held all but a round's worth of it (prefix reuse) counts as read. No mode drafts
            # after a forced eos or stop token, nor where only an eos may follow the run: the target's token after it
            # ends the reply, which a draft call would only propose.
            limit = min(room, positions) - len(forced)
            unread = request.gamma == AUTO and len(request.prompt_ids) - draft_len > 2
            if guide and forced and limit and (unread or not request.stop_token_ids.isdisjoint(forced)
                                               or guide.ends_after(forced)):
                limit = 0
            # A round of forced tokens alone is the grammar's, not the policy's: not asked (nor told, below). Both
            # checks come only where drafts could follow: choose and ends_after take ~3 and ~11 us, 1-3% of a round of
            # the tiny random pair's (0.4-1 ms, masks included).
            behind = len(ids) - draft_len + len(forced)  # what the draft's first call would read
            k = policy.choose(limit, behind, room) if limit or not forced else 0
            # A normal round feeds the draft the target's token (and the last accepted draft); more means
            # it is catching up on the prompt, on rounds without drafts or on forced tokens.
            catching_up = len(ids) - draft_len > 2 or bool(forced)
            unsteady = unsteady_calls()
            t0 = clock()
            drafts = self._draft(slot, ids[draft_len:], len(ids), k, uniforms, sampling.greedy, guide, forced, halt)
            t1 = clock()
            asked, k = k, len(drafts)  # fewer where the draft stopped short: logits not finite, a grammar (_draft)
            if drafts:
                draft_len = len(ids) + len(forced) + k - 1
            # A target call never computes one row alone (see slot.Rows), so a round without drafts pays for
            # two rows anyway: let them check free guesses instead, the grammar's forced tokens or what followed these
            # tokens last time, a chain of them or the first alone (policy.Costs.chain). A round that checks the first
            # alone tells of the second too (its token): no more are looked up.
            guesses = forced or (_guesses(follows, ids[-1], min(room, self.max_gamma,
                                                                 FREE_GUESSES if drafts or policy.chain else 2))
                                 if follows is not None else [])
            proposed = [*forced, *drafts] or (guesses[:1] if guesses and not policy.chain else guesses)
            # The target's masks, built on the host, are part of its call's cost, in rounds without drafts too
            # (auto's unit, policy.Costs): timed apart, they made γ 0 look cheap beside rounds with drafts.
            if guide:
                target.constrain(guide.masks(proposed))
            accepted, token = target.step([ids[-1], *proposed], total_len=len(ids) + len(proposed),
                                          num_drafts=len(proposed), uniforms=uniforms(len(proposed) + 1))
            t2 = clock()
            draft_len = min(draft_len, len(ids) + accepted)
            new_tokens = [*proposed[:accepted], token]
            logits = target.logits() if records is not None else None
            # How many of the chain held (would have, where it drafted or checked the first guess alone) of those the
            # round's tokens tell of.
            held = _leading_equal(guesses, new_tokens) if guesses else None
            # α judges the draft model, over its own drafts: those after the free proposals (forced tokens, or guesses
            # in a round without drafts), judged where all of those were accepted.
            free = len(proposed) - len(drafts)
            judged = accepted >= free
            if free:
                stats.guessed += 1
                stats.guesses_accepted += min(accepted, free)
                accepted = max(accepted - free, 0)
            # The drafts asked for: those that never came count as rejected. Told of none, auto γ kept its α and
            # called a draft whose logits always overflow every round, for nothing. But after an eos drafted under a
            # grammar (_draft stops there) no token could follow, so none was missed: counted rejected, the round that
            # ends nearly every request told α of a failure (on the demo pair under a JSON schema, γ priced by the
            # prior: α 0.75 rather than 0.78 at a request's start, 5% more target calls). Cut short either way, a
            # round costs less than one at the γ asked, whose cost it would lower.
            ended = bool(guide and drafts and drafts[-1] in guide.eos)
            # A round of forced tokens alone: the grammar chose it, not the policy. One with drafts after them tells α
            # of its drafts (unless a forced token was rejected, which llguidance's masks have never let happen,
            # Guide.forced: then none was judged), but prices no γ: it is no round at γ k (f more target rows and masks;
            # the draft's call read the f tokens), so a catch-up, untimed. Nor does it tell of guesses: the forced
            # tokens come at any γ.
            if not forced or (asked and judged):
                policy.observe(k if ended else asked, accepted, t1 - t0, t2 - t1, catching_up, None if forced else held,
                               timed=unsteady_calls() == unsteady and k == asked,
                               chained=not (forced or drafts) and len(proposed) > 1,
                               seen=min(len(guesses), len(new_tokens)), read=behind)
            stats.record_round(k, accepted, t1 - t0, t2 - t1)

    def _score(self, slot: Slot, ids: list[int], top: int,
               halt: Halt | None = None) -> tuple[list[TokenLogprobs], int]:
        """The TokenLogprobs of ids[1:], each from the target's row before it. A call returns the logits of its last
        D+1 rows, so the prompt goes in calls whose D drafts are its own next tokens: rows computed as a round's
        (slot.Rows), so a token scores the bits it gets generated. Fixed rows (GPUs) and greedy-only graphs (whose
        logits buffer a CUDA graph replays) take max γ drafts a call; the CPU's even calls any number: SCORED_ROWS
        rows scored 1.5x as fast as max γ + 1 = 9 (a 12.5 MB fp32 target, 2 CPU cores). LongRoPE: no call spans the
        switch, so each row rotates as decoding its prefix rotates it (slot.EngineSlot._choose_rope). The cache then
        holds ids[:-1] at least. Once `halt` is set, a RequestError before the next call: a long prompt's calls come
        before the first token, where a consumer's stop (a client gone, a deadline) is otherwise first seen.

        Prefix reuse (lm-evaluation-harness scores a context followed by each choice): where it holds, a row's bits
        depend on the tokens up to it alone, not on how calls grouped rows (reuses_prefixes), so the records of the
        last prompt the slot scored, at the same top, are this prompt's for the tokens both share, and its calls
        start at the first row those records lack (one before the first token that differs: that row scores it)
        or the slot's cache lacks. Returns the records and how many leading tokens that spared."""
        target = slot.target
        size = self.max_gamma + 1 if target.rows.fixed or target.engine.greedy_only else SCORED_ROWS
        slot.configure(0.0, 0, 1.0, logits=True)  # greedy: no random numbers drawn, the drafts' judgement read by nobody
        known, start, last = self._scored[slot.index] if self.prefix_reuse else None, 0, len(ids) - 1
        if known is not None and known.top == top:
            start = max(0, min(_leading_equal(known.ids, ids) - 1, target.prefix(ids, last)))
        records, spared = known.records[:start] if known is not None and start else [], start
        try:
            for start, end in target.scoring_calls(start, len(ids), size, until=last):
                if halt is not None and halt.is_set():
                    raise RequestError("the request was stopped while its prompt was scored")
                target.step(ids[start:end], total_len=end, num_drafts=end - start - 1)
                logits = target.logits()  # row j: after position start + j
                records += (token_logprobs(row, ids[start + 1 + j], top) for j, row in enumerate(logits[:last - start]))
        finally:
            target.release_logits()
        if self.prefix_reuse:
            self._scored[slot.index] = Scored(ids, top, records)
        return records, spared

    def _not_finite(self, token: int) -> BundleError:
        precision = self.manifest.engines["target"].precision
        why = ("its fp16 engine overflows (fp16 ends at 65504); compile the target with --precision bf16 (fp32's "
               "range) or fp32" if precision == "fp16" else
               f"the target computes beyond {precision}'s range here; check the checkpoint with transformers")
        return BundleError(f"the target's logits hold NaN or an infinity at generated token {token}: {why}")

    @staticmethod
    def _draft(slot: Slot, feed: list[int], total_len: int, k: int, uniforms, greedy: bool,
               guide: Guide | None = None, forced: Sequence[int] = (), halt: Halt | None = None) -> list[int]:
        """k draft tokens; when sampling, the draft leaves their distributions in the slot's rows. Greedy,
        each run of the steps graph's count of them is one call of it. guide: each draft step is masked by the
        request's grammar (one call a token: the steps graph takes no mask), and drafting stops after an eos or where
        the grammar leaves the draft's vocabulary nothing. forced: the grammar's forced tokens the round proposes first
        (no eos among them): the draft reads them after feed and drafts after them, and its distributions go in the rows
        after their one-hot ones (slot.propose_certain)."""
        drafts: list[int] = []
        steps, consumed = slot.draft_steps if greedy and not guide else None, 0
        feed, total_len, first_row = [*feed, *forced], total_len + len(forced), len(forced)
        try:
            if guide and k:
                for token in forced:  # allowed: the grammar forces them
                    guide.advance(token)
                    consumed += 1
            while len(drafts) < k:
                fed, j = feed if not drafts else [drafts[-1]], len(drafts)
                if guide:
                    mask = guide.mask()
                    if not mask[:slot.draft.engine.vocab_size].any():
                        break
                    slot.draft.constrain(mask[None])
                if steps and k - j >= steps.count and len(fed) <= MAX_REUSED_IDS:
                    drafts += steps.step(fed, total_len + j)
                else:
                    drafts.append(slot.draft.step(fed, total_len=total_len + j, uniforms=uniforms(1),
                                                  probs_row=first_row + j, halt=halt)[1])
                if (bad := slot.draft.engine.info.not_finite_token) in drafts:
                    # The draft's logits hold NaN or +inf (its fp16 engine overflows): it proposes what came before.
                    # The output is the target's either way; the drafts' cache is re-fed from the round's length.
                    return drafts[:drafts.index(bad)]
                if guide:
                    if not guide.push(drafts[-1], mask):  # an eos: the request would end there
                        break
                    consumed += 1
        finally:
            if guide:
                guide.pop(consumed)
        return drafts


# Every live decoder (see _new_workers_in_child).
_DECODERS: weakref.WeakSet = weakref.WeakSet()


def _new_workers_in_child() -> None:
    """In a forked child (gunicorn --preload, os.fork): its decoders' worker pools are copies whose threads stayed
    in the parent, and a pool that started its threads there starts no more, so the child's astream and agenerate
    (and a server app's requests) waited for them forever. Each gets a pool of its own."""
    for decoder in list(_DECODERS):
        decoder.workers = ThreadPoolExecutor(decoder.slots.size, thread_name_prefix="specbuild-slot")


os.register_at_fork(after_in_child=_new_workers_in_child)


def reuses_prefixes(target: Engine, rows: Rows) -> bool:
    """Whether a request may start over what its slot's target cache holds and decode what a fresh cache decodes,
    bit for bit: where a row's bits do not depend on how calls group rows. So on the CPU under an even rule
    (slot.NEVER_ALONE: measured so, docs/how-it-works.md, Exactness), whose calls, prompts included, are all even. Not with
    fixed rows (GPUs): a prompt's head is one call of any size there, whose kernels may round otherwise than
    the max γ + 1-row calls that wrote the same positions in an earlier request."""
    return target.device == "cpu" and not (target.captures or target.gpu_attention) and rows.even and not rows.fixed


def graphs_by_default(manifest: Manifest, device: str, parallel: int = 1) -> bool:
    """CUDA graphs unless asked otherwise: on CUDA, for bundles of the kind measured to replay exactly what
    uncaptured calls decode (tests/test_gpu.py on an H200 and an H100: unquantized engines of the architectures
    and precisions in engine.CAPTURED_BY_DEFAULT, with the greedy-only graphs; fp16 target-only decoded 1.4x as
    fast), with one slot; nor on the CPU, where the greedy-only graphs gain little (docs/gpu.md). Several slots
    decode uncaptured: captured calls take turns across slots (engine._CUDA_GRAPH_CALLS), and `serve --parallel 4`
    on an H100 (2026-11-27, 16 clients, the 1.1B pair) served 571 tok/s captured against 1092 uncaptured (one
    slot captured: 594)."""
    return device == "cuda" and parallel == 1 and not uncaptured_because(manifest)


def uncaptured_because(manifest: Manifest) -> str:
    """Why a bundle decodes uncaptured by default on CUDA ("" when it replays CUDA graphs), for people."""
    if not manifest.has_greedy_graphs:
        return "compiled before the greedy-only graphs CUDA graphs run (recompile it)"
    for role, e in sorted(manifest.engines.items(), key=lambda item: item[0] != "target"):  # the target's first
        if e.precision == "fp32":
            return f"the {role} is fp32, whose attention onnxruntime runs on the CPU (none can be captured)"
        if e.quantization != "none" or e.precision not in CAPTURED_BY_DEFAULT.get(e.architecture, ()):
            what = f"{e.quantization} engines" if e.quantization != "none" else f"{e.architecture} {e.precision}"
            return f"{what} not yet run captured on a GPU (--cuda-graphs asks for them)"
        if e.rope_switch_length:  # Phi-3's replays were measured before its engine switched tables (long_rope)
            return "a LongRoPE target switching rotary tables not yet run captured on a GPU (--cuda-graphs asks for them)"
    return ""


def request_features(target: Takes, draft: Takes) -> dict[str, bool]:
    """Whether engines that take target's and draft's serve each request option a graph input carries, by the name
    request's refusals give it (each False one it refuses): so `specbuild inspect` says beforehand what a bundle lacks."""
    return {"logprobs": target.logits, "min_p": target.min_p and draft.min_p, "penalties": target.penalties,
            "min_tokens": target.min_tokens, "logit_bias": target.logit_bias, "structured outputs": target.logit_bias}


@dataclass(frozen=True)
class Scored:
    """A prompt a slot scored: records[i] is the TokenLogprobs of ids[i + 1], with the `top` most probable tokens.
    Kept per slot for the next prompt to score (see _score): ~0.3 KB a token at top 1, ~2 KB at top 20 (measured)."""

    ids: list[int]
    top: int
    records: list[TokenLogprobs]


REQUEST_OPTIONS = frozenset(inspect.signature(SpeculativeDecoder.request).parameters) - {"self"}


def _request_options(caller: str, options: dict) -> dict:
    """The options caller passes on to request(), where a keyword it does not take would be a TypeError naming
    request(), which the person never called: it names caller, and for generate's stats where they are."""
    unknown = next((name for name in options if name not in REQUEST_OPTIONS), None)
    if unknown is not None:
        where = ("; read the stats of the Generation it returns (generation.stats)" if unknown == "stats" else
                 "; its keyword options are request()'s")
        raise TypeError(f"{caller}() got an unexpected keyword argument {unknown!r}{where}")
    return options


# Rows a call scoring a prompt computes on the CPU (see _score): even, and as many as a call's token buffer is reused for.
SCORED_ROWS = MAX_REUSED_IDS

# Request kinds, as _kind gives them: auto γ learns costs and α for each apart.
KINDS = [(sampled, processing) for sampled in (False, True) for processing in ("plain", "processed", "structured")]


def _kind(request: Request) -> tuple[bool, str]:
    """Whether the request samples, and what its target's calls do beyond a plain one: penalties, min_tokens or
    logit_bias process every row (with the bundle's sampler, where it decides); a grammar also builds a mask on the
    host for every draft and target row. Rounds of each kind cost otherwise, and drafts hold otherwise (the draft
    proposes unpenalised): shared with plain requests, costs and α timed there led auto to draft under penalties
    and grammars where it lost to target-only."""
    sampling = request.sampling
    processed = sampling.penalties != NO_PENALTIES or sampling.min_tokens or sampling.logit_bias
    return not sampling.greedy, "structured" if request.structured else "processed" if processed else "plain"


def _guesses(follows: dict[int, int], token: int, count: int) -> list[int]:
    """Up to count tokens, each the one that followed the one before it last time (prompt lookup, by token); the token
    itself where none has followed it yet (a run of it)."""
    guesses: list[int] = []
    guess: int | None = follows.get(token, token)
    while len(guesses) < count and guess is not None:
        guesses.append(guess)
        guess = follows.get(guess)
    return guesses


def _each_newest(tokens: Generator[int, None, None], records: list[TokenLogprobs]) -> Generator[TokenLogprobs, None, None]:
    """For each token, the record `tokens` appended for it; closing this closes `tokens` (frees its slot)."""
    with closing(tokens):
        for _ in tokens:
            yield records[-1]


def _leading_equal(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _identity(folder: Path) -> tuple[int, int] | None:
    """The folder a path names now: compile publishes a bundle by swapping a new folder in at its path."""
    try:
        stat = os.stat(folder)
    except OSError:
        return None
    return stat.st_dev, stat.st_ino


def _leaves_out_last(request: Request, stats: Stats) -> bool:
    """Whether the text leaves out the last token: the eos or stop token that ended the request, as vLLM leaves it
    out unless include_stop_str_in_output."""
    return stats.finish_reason in ("eos", "stop_token") and not request.include_stop


def _finish(text: TextStream, stats: Stats) -> str:
    """The stream's rest; its last bytes may have completed a stop string, which ends the request as "stop"."""
    rest = text.finish()
    if text.stopped:
        stats.finish_reason, stats.stop_reason = "stop", text.stop_string
    return rest
