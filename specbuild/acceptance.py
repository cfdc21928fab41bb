"""The arithmetic of speculative rounds, shared by the compiler's quality report, bench and distillation."""

from __future__ import annotations

from specbuild_runtime.policy import expected_tokens_per_call  # the runtime's adaptive γ uses it too

__all__ = ["expected_tokens_per_call", "rounds", "theoretical_speedup"]


def rounds(agreement: list[bool], gamma: int) -> tuple[int, int]:
    """(accepted, drafted) when greedy speculative decoding produces these tokens.

    agreement[i] says whether the draft's greedy choice equals the target's token i given the
    target's earlier tokens. A round at position p drafts min(gamma, remaining - 1) tokens (the
    target always adds one token of its own), accepts the leading agreements, and the next round
    starts after the accepted tokens and the target's own token.
    """
    accepted = drafted = position = 0
    while position < len(agreement):
        draft_length = min(gamma, len(agreement) - position - 1)
        run = 0
        while run < draft_length and agreement[position + run]:
            run += 1
        accepted += run
        drafted += draft_length
        position += run + 1
    return accepted, drafted


def theoretical_speedup(tokens_per_call: float, gamma: int, cost_ratio: float) -> float:
    """Leviathan et al.'s speed-up bound τ / (γc + 1): a round costs γ draft steps and one target step and
    yields τ tokens, with c the cost of a draft step over a target step. Bench passes the measured τ, which
    needs no assumption about how acceptances are distributed."""
    return tokens_per_call / (gamma * cost_ratio + 1)
