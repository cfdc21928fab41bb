"""The arithmetic of speculative rounds, shared by the compiler's quality report, bench and distillation."""

from __future__ import annotations

from specbuild_runtime.policy import expected_tokens_per_call  # the runtime's adaptive γ sums the same series

__all__ = ["expected_tokens_per_call", "rounds", "theoretical_speedup", "until_eos"]


def rounds(agreement: list[bool], gamma: int, new_tokens: int | None = None, end: int | None = None) -> tuple[int, int]:
    """(accepted, drafted) as the runtime counts them (bench's and generate's α) when greedy speculative
    decoding produces a target continuation of new_tokens (None: len(agreement)) whose first eos is token
    end - 1 (None: none).

    agreement[i] says whether the draft's greedy choice equals the target's token i given the target's
    earlier tokens. Token 0 comes from the target's prompt pass, which no draft precedes. A round drafts
    min(gamma, tokens left - 1) tokens (the target always adds one of its own), accepts the leading
    agreements, and the next round starts after them and the target's token; the runtime learns of an eos
    only when the target emits it, so the round that does still counts the drafts it accepted past it.
    """
    new_tokens = len(agreement) if new_tokens is None else new_tokens
    # A continuation known past the request's end (references made longer) is read only as far as it.
    end = min(len(agreement) if end is None else end, new_tokens)
    accepted = drafted = 0
    produced = 1  # the prompt pass's token
    while produced < end:
        draft_length = min(gamma, new_tokens - produced - 1)
        run = 0
        while run < draft_length and produced + run < len(agreement) and agreement[produced + run]:
            run += 1
        accepted, drafted, produced = accepted + run, drafted + draft_length, produced + run + 1
    return accepted, drafted


def theoretical_speedup(tokens_per_call: float, gamma: int, cost_ratio: float, call_cost: float = 1) -> float:
    """Leviathan et al.'s speed-up bound τ / (γc + 1): a round costs γ draft steps and one target step and
    yields τ tokens, with c the cost of a draft step over a target step. Bench passes the measured τ, which
    needs no assumption about how acceptances are distributed. call_cost: the target's verification call over a
    one-token step where that call costs more (a mixture of experts' reads the experts all its rows chose)."""
    return tokens_per_call / (gamma * cost_ratio + call_cost)


def until_eos(tokens: list[int], stops) -> list[int]:
    """The tokens up to and including the first eos (one of stops): what a request decodes of a continuation
    known past its end (references made longer, a batch's rows padded after theirs)."""
    for i, token in enumerate(tokens):
        if token in stops:
            return tokens[: i + 1]
    return tokens
