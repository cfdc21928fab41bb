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

from .engine import Engine
from .errors import RequestError
from .manifest import TOKENIZER_DIR, load_manifest


@dataclass
class Stats:
    """What one generate() call measured. α and τ are over verification rounds (γ > 0) only."""

    gamma: int
    prompt_tokens: int = 0
    generated_tokens: int = 0
    rounds: int = 0  # target calls after the prompt
    drafted: int = 0
    accepted: int = 0
    accepted_at: list[int] = field(default_factory=list)  # rounds whose draft j was accepted
    proposed_at: list[int] = field(default_factory=list)  # rounds that proposed a draft at j
    token_times: list[float] = field(default_factory=list)  # seconds since the call began
    finish_reason: str = ""

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
            "finish_reason": self.finish_reason,
        }


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    stats: Stats


class SpeculativeDecoder:
    """Loads a bundle (checking its manifest and digests) and decodes with it.

        decoder = SpeculativeDecoder("bundle/")
        result = decoder.generate("def fib(n):", max_new_tokens=64)        # γ from the bundle
        for token_id in decoder.stream("def fib(n):", gamma=0): ...       # target only
    """

    def __init__(self, bundle: str | Path, device: str = "cpu", check_digests: bool = True):
        self.root = Path(bundle)
        self.manifest = load_manifest(self.root, check_digests=check_digests)
        self.max_seq_len = self.manifest.max_seq_len
        self.eos_token_ids = set(self.manifest.eos_token_ids)
        self.tokenizer = Tokenizer.from_file(str(self.root / TOKENIZER_DIR / "tokenizer.json"))
        engines = self.manifest.engines
        self.target = Engine(self.root / engines["target"].file, engines["target"], self.max_seq_len, device)
        self.draft = Engine(self.root / engines["draft"].file, engines["draft"], self.max_seq_len, device)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def generate(self, prompt: str | list[int], max_new_tokens: int = 128, gamma: int | None = None) -> Generation:
        stats = Stats(gamma=self.manifest.gamma if gamma is None else gamma)
        prompt_ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        tokens = list(self._decode(prompt_ids, max_new_tokens, stats))
        return Generation(self.tokenizer.decode(tokens), tokens, prompt_ids, stats)

    def stream(self, prompt: str | list[int], max_new_tokens: int = 128, gamma: int | None = None,
               stats: Stats | None = None) -> Iterator[int]:
        """Yields generated token ids as the target accepts them; pass a Stats to read measurements."""
        stats = stats or Stats(gamma=self.manifest.gamma if gamma is None else gamma)
        prompt_ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        return self._decode(prompt_ids, max_new_tokens, stats)

    def _decode(self, prompt: list[int], max_new_tokens: int, stats: Stats) -> Iterator[int]:
        self._check_request(prompt, max_new_tokens, stats.gamma)
        gamma, max_len = stats.gamma, self.max_seq_len
        stats.prompt_tokens = len(prompt)
        stats.accepted_at = [0] * gamma
        stats.proposed_at = [0] * gamma
        start = time.perf_counter()
        ids = list(prompt)
        # Cache lengths: the target holds ids[:-1] after each round; the draft lags and catches up.
        _, token = self.target.step(ids, total_len=len(ids))
        new_tokens = [token]
        draft_len = 0
        while True:
            for token in new_tokens:
                ids.append(token)
                stats.generated_tokens += 1
                stats.token_times.append(time.perf_counter() - start)
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
            k = min(gamma, max_new_tokens - stats.generated_tokens - 1, max_len - len(ids))
            drafts = []
            if k > 0:
                _, draft = self.draft.step(ids[draft_len:], total_len=len(ids))
                drafts.append(draft)
                for j in range(1, k):
                    _, draft = self.draft.step([draft], total_len=len(ids) + j)
                    drafts.append(draft)
                draft_len = len(ids) + k - 1
            accepted, token = self.target.step([ids[-1], *drafts], total_len=len(ids) + k, num_drafts=k)
            draft_len = min(draft_len, len(ids) + accepted)
            stats.rounds += 1
            stats.drafted += k
            stats.accepted += accepted
            for j in range(k):
                stats.proposed_at[j] += 1
                stats.accepted_at[j] += j < accepted
            new_tokens = [*drafts[:accepted], token]

    def _check_request(self, prompt: list[int], max_new_tokens: int, gamma: int) -> None:
        if not prompt:
            raise RequestError("the prompt is empty; give at least one token of text")
        if len(prompt) > self.max_seq_len:
            raise RequestError(
                f"the prompt has {len(prompt)} tokens but this bundle's context is {self.max_seq_len}; shorten "
                f"the prompt or recompile with --max-seq-len {len(prompt) + max_new_tokens}"
            )
        if max_new_tokens < 1:
            raise RequestError("max_new_tokens must be at least 1")
        if gamma < 0:
            raise RequestError("gamma must be 0 (target only) or more")
