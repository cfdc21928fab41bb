"""Each generated token's log-probability under the target, and the most probable alternatives, as vLLM reports
them by default (logprobs_mode "raw_logprobs"): the log-softmax of the target's own logits for that token's row,
before temperature, top-k and top-p shape the distribution a token is drawn from."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# vLLM's floor for a logprob it writes out: -inf (a token the logits rule out) is no JSON number, OpenAI writes -9999.
LOGPROB_FLOOR = -9999.0


def floored(logprob: float) -> float:
    """logprob as written out: at least LOGPROB_FLOOR, and the floor for NaN too. NaN comes from a row that holds NaN
    or +inf (an fp16 target overflowing), which a scored prompt's rows may (only a generated token stops there); the
    floor keeps OpenAI's number, and a client summing a prompt's logprobs reads the row as improbable, not NaN."""
    return LOGPROB_FLOOR if math.isnan(logprob) else max(logprob, LOGPROB_FLOOR)


@dataclass(frozen=True)
class TokenLogprobs:
    token_id: int
    logprob: float  # log p(token_id); -inf for a token the logits rule out
    top: tuple[tuple[int, float], ...]  # (token id, logprob) of the most probable tokens, most probable first
    rank: int  # the tokens at least as probable as token_id, it among them (vLLM's rank: 1 for the most probable)


def token_logprobs(logits: np.ndarray, token: int, top: int) -> TokenLogprobs:
    """The record of `token` drawn after a row of fp32 logits [V], with its `top` most probable tokens (ties: the lower
    id first). The normalizer is the float32 exponentials' sum in float64 (float64 throughout took 4 ms a 152k row
    here, this under 1 ms); each logprob is its logit less it, rounded to float32. A row's numbers depend on its
    logits alone, which the target computes bit for bit alike however rows are grouped into calls (slot.Rows)."""
    peak = logits.max()
    with np.errstate(invalid="ignore"):  # a row holding +inf or NaN gives NaN logprobs, as documented: no warning
        log_z = float(peak) + math.log(np.exp(logits - peak).sum(dtype=np.float64))
    best: tuple[tuple[int, float], ...] = ()
    top = min(top, len(logits))
    if top:
        # The top-th largest logit, then every id at or above it (ties at the cut all taken, before the ids choose)
        cut = np.partition(logits, len(logits) - top)[len(logits) - top]
        ids = np.flatnonzero(logits >= cut)
        best = tuple((int(i), _less(logits[i], log_z)) for i in ids[np.lexsort((ids, -logits[ids]))][:top])
    rank = int(np.count_nonzero(logits >= logits[token]))
    return TokenLogprobs(token, _less(logits[token], log_z), best, rank)


def _less(logit: np.float32, log_z: float) -> float:
    return float(np.float32(float(logit) - log_z))
