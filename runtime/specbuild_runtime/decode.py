"""Greedy speculative decoding over a bundle: the draft proposes γ tokens, the target's graph verifies them.

Token-for-token identical to the target's own greedy decoding: every emitted token is the target's
argmax given the tokens before it; drafts only decide how many of them one target call produces.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
from tokenizers import Tokenizer

from .engine import Engine, use_shared_thread_pool
from .errors import RequestError
from .manifest import TOKENIZER_DIR, load_manifest
from .policy import GREEDY_DECAY, SAMPLING_DECAY, AdaptiveGamma, FixedGamma

AUTO = "auto"


@dataclass
class Stats:
    """What one generate() call measured. α and τ are over verification rounds (γ > 0) only."""

    gamma: int | str  # a fixed γ, or "auto"
    prompt_tokens: int = 0
    generated_tokens: int = 0
    rounds: int = 0  # target calls after the prompt
    drafted: int = 0
    accepted: int = 0
    rejected: int = 0  # rounds that ended on a rejected draft (drafts after it were never judged)
    accepted_at: list[int] = field(default_factory=list)  # rounds whose draft j was accepted
    proposed_at: list[int] = field(default_factory=list)  # rounds that proposed a draft at j
    token_times: list[float] = field(default_factory=list)  # seconds since the call began
    gamma_rounds: dict[int, int] = field(default_factory=dict)  # γ used -> rounds
    draft_seconds: float = 0.0
    draft_steps: int = 0
    guessed: int = 0  # rounds without drafts whose second target row checked a free guess (see _decode)
    guesses_accepted: int = 0
    target_seconds: float = 0.0  # rounds only, the prompt's call excluded
    finish_reason: str = ""

    def record_round(self, drafted: int, accepted: int, draft_seconds: float, target_seconds: float) -> None:
        self.rounds += 1
        self.gamma_rounds[drafted] = self.gamma_rounds.get(drafted, 0) + 1
        self.drafted += drafted
        self.accepted += accepted
        self.rejected += accepted < drafted
        self.draft_seconds += draft_seconds
        self.draft_steps += drafted
        self.target_seconds += target_seconds
        for j in range(drafted):
            self.proposed_at[j] += 1
            self.accepted_at[j] += j < accepted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

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
        gaps = np.diff(self.token_times)
        return float(1e3 * np.percentile(gaps, q)) if len(gaps) else 0.0

    def to_dict(self) -> dict:
        per_position = [a / p if p else 0.0 for a, p in zip(self.accepted_at, self.proposed_at)]
        return {
            "gamma": self.gamma,
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "rounds": self.rounds,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_tokens": round(self.mean_accepted_tokens, 4),
            "per_position_acceptance": [round(x, 4) for x in per_position],
            "tokens_per_second": round(self.tokens_per_second, 2),
            "ttft_ms": round(self.ttft_ms, 3),
            "itl_ms_p50": round(self.itl_ms(50), 3),
            "itl_ms_p95": round(self.itl_ms(95), 3),
            "gamma_rounds": dict(sorted(self.gamma_rounds.items())),
            "guessed": self.guessed,
            "guesses_accepted": self.guesses_accepted,
            "draft_step_ms": round(1e3 * self.draft_seconds / self.draft_steps, 4) if self.draft_steps else 0.0,
            "target_step_ms": round(1e3 * self.target_seconds / self.rounds, 4) if self.rounds else 0.0,
            "finish_reason": self.finish_reason,
        }


@dataclass(frozen=True)
class Sampling:
    """temperature 0 is greedy; a seed makes a sampled run reproducible (with a fixed γ)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def check(self) -> None:
        if self.temperature < 0:
            raise RequestError(f"temperature must be >= 0 (0 = greedy), not {self.temperature}")
        if self.top_k < 0:
            raise RequestError(f"top_k must be >= 0 (0 = no limit), not {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], not {self.top_p}")


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    stats: Stats


class SpeculativeDecoder:
    """Loads a bundle (checking its manifest and digests) and decodes with it.

        decoder = SpeculativeDecoder("bundle/")
        result = decoder.generate("def fib(n):", max_new_tokens=64)        # γ adapts (gamma="auto")
        result = decoder.generate("def fib(n):", gamma=4)                  # fixed γ
        for token_id in decoder.stream("def fib(n):", gamma=0): ...       # target only
    """

    def __init__(self, bundle: str | Path, device: str = "cpu", check_digests: bool = True,
                 shared_thread_pool: bool = False):
        """shared_thread_pool: faster, but changes every onnxruntime session of the process
        (see engine.use_shared_thread_pool); for processes that only decode."""
        if shared_thread_pool:
            use_shared_thread_pool()
        self.root = Path(bundle)
        self.manifest = load_manifest(self.root, check_digests=check_digests, require_engines=True)
        self.max_seq_len = self.manifest.max_seq_len
        self.eos_token_ids = set(self.manifest.eos_token_ids)
        self.tokenizer = Tokenizer.from_file(str(self.root / TOKENIZER_DIR / "tokenizer.json"))
        engines = self.manifest.engines
        self.target = Engine(self.root / engines["target"].file, engines["target"], self.max_seq_len, device)
        self.draft = Engine(self.root / engines["draft"].file, engines["draft"], self.max_seq_len, device)
        self._draft_width = min(self.target.vocab_size, self.draft.vocab_size)  # columns of q a draft fills
        # Adaptive policies live as long as the decoder: what they learn about this pair carries over to
        # later requests. Greedy and sampled decoding accept drafts differently, so each has its own.
        draft_cost = engines["draft"].weight_bytes / engines["target"].weight_bytes
        self.policies = {sampling: AdaptiveGamma(self.manifest.gamma, draft_cost,
                                                 SAMPLING_DECAY if sampling else GREEDY_DECAY)
                         for sampling in (False, True)}

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def generate(self, prompt: str | list[int], max_new_tokens: int = 128, gamma: int | str = AUTO,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None) -> Generation:
        stats = Stats(gamma=gamma)
        prompt_ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        sampling = Sampling(temperature, top_k, top_p, seed)
        tokens = list(self._decode(prompt_ids, max_new_tokens, stats, sampling))
        return Generation(self.tokenizer.decode(tokens), tokens, prompt_ids, stats)

    def stream(self, prompt: str | list[int], max_new_tokens: int = 128, gamma: int | str = AUTO,
               stats: Stats | None = None, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
               seed: int | None = None) -> Iterator[int]:
        """Yields generated token ids as the target accepts them; pass a Stats to read measurements."""
        stats = stats or Stats(gamma=gamma)
        prompt_ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        return self._decode(prompt_ids, max_new_tokens, stats, Sampling(temperature, top_k, top_p, seed))

    def _decode(self, prompt: list[int], max_new_tokens: int, stats: Stats, sampling: Sampling) -> Iterator[int]:
        self._check_request(prompt, max_new_tokens, stats.gamma)
        sampling.check()
        for engine in (self.target, self.draft):
            engine.configure(sampling.temperature, sampling.top_k, sampling.top_p)
        rng = np.random.default_rng(sampling.seed)
        uniforms = (lambda n: self._uniforms(rng, n)) if sampling.temperature > 0 else (lambda n: None)
        policy = self.policies[sampling.temperature > 0] if stats.gamma == AUTO else FixedGamma(stats.gamma)
        max_len = self.max_seq_len
        positions = self.manifest.gamma if stats.gamma == AUTO else stats.gamma
        stats.prompt_tokens = len(prompt)
        stats.accepted_at = [0] * positions
        stats.proposed_at = [0] * positions
        q = np.zeros((positions, self.target.vocab_size), np.float32) if sampling.temperature > 0 else None
        clock = time.perf_counter
        start = clock()
        ids = list(prompt)
        # Cache lengths: the target holds ids[:-1] after each round; the draft lags and catches up.
        _, token = self.target.step(ids, total_len=len(ids), uniforms=uniforms(1))
        new_tokens = [token]
        draft_len = 0
        # Auto mode, greedy: the token that last followed each token, for free guesses (see below).
        follows = dict(zip(ids, ids[1:])) if stats.gamma == AUTO and sampling.temperature == 0 else None
        while True:
            for token in new_tokens:
                if follows is not None:
                    follows[ids[-1]] = token
                ids.append(token)
                stats.generated_tokens += 1
                stats.token_times.append(clock() - start)
                yield token
                if token in self.eos_token_ids:
                    stats.finish_reason = "eos"
                    return
                if stats.generated_tokens >= max_new_tokens:
                    stats.finish_reason = "max_new_tokens"
                    return
            if len(ids) > max_len:
                stats.finish_reason = "context"
                return
            # No more drafts than the request or the cache has room for.
            room = min(max_new_tokens - stats.generated_tokens - 1, max_len - len(ids))
            k = policy.choose(room)
            # A normal round feeds the draft the target's token (and the last accepted draft); more means
            # it is catching up on the prompt or on rounds without drafts.
            caught_up = len(ids) - draft_len > 2
            t0 = clock()
            drafts, draft_probs = self._draft(ids[draft_len:], len(ids), k, uniforms, q)
            if drafts:
                draft_len = len(ids) + len(drafts) - 1
            k = len(drafts)
            # A target call never computes one row alone (see Engine), so a round without drafts pays for
            # two rows anyway: let the second check a free guess, the token that followed this one last time.
            guess = follows.get(ids[-1]) if follows is not None and not drafts and room > 0 else None
            proposed = drafts if guess is None else [guess]
            t1 = clock()
            accepted, token = self.target.step([ids[-1], *proposed], total_len=len(ids) + len(proposed),
                                               num_drafts=len(proposed), draft_probs=draft_probs,
                                               uniforms=uniforms(len(proposed) + 1))
            t2 = clock()
            draft_len = min(draft_len, len(ids) + accepted)
            new_tokens = [*proposed[:accepted], token]
            if guess is not None:  # the policy and α judge the draft model, which drafted nothing
                stats.guessed += 1
                stats.guesses_accepted += accepted
                accepted = 0
            policy.observe(k, accepted, t1 - t0, t2 - t1, caught_up)
            stats.record_round(k, accepted, t1 - t0, t2 - t1)

    @staticmethod
    def _uniforms(rng: np.random.Generator, n: int) -> np.ndarray:
        """n uniforms in [0, 1): n-1 to judge drafts, the last to draw the next token."""
        return rng.random(n, dtype=np.float32)

    def _draft(self, feed: list[int], total_len: int, k: int, uniforms, q: np.ndarray | None):
        """Up to k draft tokens and, when sampling, their distributions q[:drafts] (q: [γ, target V],
        zeros past the draft's vocabulary, reused every round)."""
        drafts = []
        for j in range(k):
            _, token = self.draft.step(feed if j == 0 else [drafts[-1]], total_len=total_len + j, uniforms=uniforms(1))
            if token >= self.target.vocab_size:  # a padding row of a larger draft table: the target has no such token
                break
            drafts.append(token)
            if q is not None:
                q[j, :self._draft_width] = self.draft.probs[:self._draft_width]  # the engine reuses its buffer
        return drafts, (None if q is None else q[: len(drafts)])

    def _check_request(self, prompt: list[int], max_new_tokens: int, gamma: int | str) -> None:
        if not prompt:
            raise RequestError("the prompt is empty; give at least one token of text")
        if len(prompt) > self.max_seq_len:
            raise RequestError(
                f"the prompt has {len(prompt)} tokens but this bundle's context is {self.max_seq_len}; shorten "
                f"the prompt or recompile with --max-seq-len {len(prompt) + max_new_tokens}"
            )
        if max_new_tokens < 1:
            raise RequestError("max_new_tokens must be at least 1")
        if gamma != AUTO and not (isinstance(gamma, int) and gamma >= 0):
            raise RequestError(f"gamma must be {AUTO!r} or a whole number >= 0 (0 = target only), not {gamma!r}")
