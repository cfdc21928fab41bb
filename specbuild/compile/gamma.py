"""The draft length to recommend to engines that take a fixed one (TensorRT-LLM's max_draft_len,
vLLM's num_speculative_tokens), from the pair's measured acceptance α and draft/target cost ratio c.

With each draft accepted with probability α, a round of γ drafts yields (1 - α^(γ+1)) / (1 - α) tokens
and costs γ draft steps plus one target call, so decoding runs

    S(γ) = (1 - α^(γ+1)) / ((1 - α) (γ c + 1))

times faster than the target alone (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding", eq. 1 and Theorem 3.8). That takes the target's call of γ + 1 rows to cost one of its
one-token steps, as a memory-bound dense target's does; a mixture of experts' call reads every expert any row chose,
so for one the 1 becomes that call's cost over a step (expert_call_cost). The recommended γ maximises S over
1..max_gamma.

α is the share of positions where the draft's greedy token equals the target's along the target's own
greedy continuation of the packaged code prompts, up to its first eos (where a request ends): under the model
above that share estimates α.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from specbuild_runtime.engine import Engine
from specbuild_runtime.slot import AS_FED, NEVER_ALONE, EngineSlot
from specbuild_runtime.manifest import EngineInfo

from ..acceptance import expected_tokens_per_call, theoretical_speedup, until_eos
from ..progress import note, steps
from ..texts import measuring_prompts

NEW_TOKENS = 32
# Measuring decodes NEW_TOKENS per prompt on the CPU: transformers (fp32) when both models together have
# at most this many parameters (4 GB of weights; a 0.78B Qwen3-0.6B-shaped pair took 170-360 s on 2 cores, load
# 3-5), the ONNX engines when theirs weigh at most ENGINE_BYTES_LIMIT
# (memory-bound: ~0.4 s a step at 22 GB/s, two minutes in all); larger pairs would take many minutes.
TRANSFORMERS_PARAMETER_LIMIT = 1_000_000_000
ENGINE_BYTES_LIMIT = 8 << 30


CallCost = Callable[[int], float]  # rows of a target call -> its cost over a one-token step


def flat(rows: int) -> float:
    """A dense target's call: its weights are read once whatever the rows (memory-bound at these few rows)."""
    return 1.0


def expert_call_cost(step: float, experts: float, top_k: int, count: int) -> CallCost:
    """A mixture target's call of n rows over its one-token step, T(n)/T(1) = (dense + experts · f(n)) / (dense +
    experts · f(1)), from `step` (what a one-token step reads: all but the experts, and the experts at top_k / count)
    and `experts` (every expert's weights; bytes or parameters, as step), f(n) = 1 − (1 − top_k/count)^n the share of
    a layer's experts n rows read when each routes independently and uniformly. That routing is the one model needing
    nothing measured on the target, and since rows that route alike (a text's consecutive tokens often do) share
    experts, it bounds the share read from above: the truth lies between it and flat."""
    dense = step - experts * top_k / count

    def reads(rows: int) -> float:
        return dense + experts * (1 - (1 - top_k / count) ** rows)
    return lambda rows: reads(rows) / reads(1)


def expected_speedup(alpha: float, cost_ratio: float, gamma: int, call_cost: CallCost = flat) -> float:
    return theoretical_speedup(expected_tokens_per_call(alpha, gamma), gamma, cost_ratio, call_cost(gamma + 1))


def recommend(alpha: float | None, cost_ratio: float, max_gamma: int, method: str, call_cost: CallCost = flat) -> dict:
    """The manifest's record: the γ maximising S, what S it expects and how α and c were measured (and, in
    `method`, the call cost). Without a measured α the bundle's max γ stands (the record says so)."""
    if alpha is None:
        return {"gamma": max_gamma, "alpha": None, "cost_ratio": cost_ratio, "expected_speedup": None,
                "method": method}
    gamma = max(range(1, max_gamma + 1), key=lambda g: expected_speedup(alpha, cost_ratio, g, call_cost))
    return {"gamma": gamma, "alpha": round(alpha, 4), "cost_ratio": round(cost_ratio, 4),
            "expected_speedup": round(expected_speedup(alpha, cost_ratio, gamma, call_cost), 3), "method": method}


def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer(p)["input_ids"] for p in measuring_prompts()]


def measure_with_engines(folder: Path, engines: dict[str, EngineInfo], prompt_ids: list[list[int]],
                         max_seq_len: int, eos_token_ids: list[int]) -> float | None:
    """α through the runtime's engines (draft_agreement). None unless both are fp32 (quantized or not;
    onnxruntime's CPU provider casts fp16 weights to fp32 on the way, holding many copies at once, see
    check.check_engine) and within ENGINE_BYTES_LIMIT."""
    if (any(info.precision != "fp32" for info in engines.values())
            or sum(info.weight_bytes for info in engines.values()) > ENGINE_BYTES_LIMIT):
        return None
    target = EngineSlot(Engine(folder / engines["target"].file, engines["target"], max_seq_len), NEVER_ALONE)
    draft = EngineSlot(Engine(folder / engines["draft"].file, engines["draft"], max_seq_len), AS_FED)
    agreements, continuations = draft_agreement(target, draft, prompt_ids, NEW_TOKENS, "measuring α for γ")
    agree = [a for prompt, tokens in zip(agreements, continuations) for a in prompt[:len(until_eos(tokens, eos_token_ids))]]
    return sum(agree) / len(agree) if agree else None


def draft_agreement(target: EngineSlot, draft: EngineSlot, prompt_ids: list[list[int]],
                    new_tokens: int, desc: str = "measuring α") -> tuple[list[list[bool]], list[list[int]]]:
    """Per prompt, whether the draft's greedy token equals the target's at each position of the target's
    greedy continuation (up to new_tokens; it ends at a token of the target's padding rows, which the draft
    cannot read), the draft following token by token as decoding feeds it; and per prompt that continuation,
    position for position. Prompts leaving no room for two new tokens are skipped. desc: its progress bar's (a
    pair of 8 GB decodes for minutes on a CPU)."""
    agreements, continuations = [], []
    for prompt in steps(prompt_ids, desc, "prompt"):
        budget = min(new_tokens, target.engine.max_seq_len - len(prompt))
        if budget < 2:
            continue
        token = target.step(prompt, total_len=len(prompt))[1]
        guess = draft.step(prompt, total_len=len(prompt))[1]
        agree, continuation = [], []
        for length in range(len(prompt) + 1, len(prompt) + budget):
            agree.append(guess == token)
            continuation.append(token)
            if token >= draft.engine.vocab_size:
                break
            guess = draft.step([token], total_len=length)[1]
            token = target.step([token], total_len=length)[1]
        else:  # the last token, which no step follows
            agree.append(guess == token)
            continuation.append(token)
        agreements.append(agree)
        continuations.append(continuation)
    return agreements, continuations


def measure_with_transformers(target_path: Path, draft_path: Path, prompt_ids: list[list[int]],
                              max_seq_len: int, eos_token_ids: list[int], tokenizer_ids: int | None = None) -> float | None:
    """α with transformers on CPU: the draft's argmax (over the tokenizer's ids, `tokenizer_ids`, as the exported draft
    drafts) along the target's greedy continuation; None when no prompt leaves room in the context for two new
    tokens."""
    import torch

    from .reference import load_reference, transformers_greedy

    with note("loading the pair in transformers to measure α for γ"):
        target, draft = load_reference(target_path), load_reference(draft_path)
    agree = []
    for prompt in steps(prompt_ids, "measuring α for γ", "prompt"):
        budget = min(NEW_TOKENS, max_seq_len - len(prompt))
        if budget < 2:
            continue
        tokens = transformers_greedy(target, prompt, budget, eos_token_ids)  # ends at an eos, as requests do
        # the draft reads the continuation up to the first of the target's padding rows it lacks
        readable = next((i for i, t in enumerate(tokens) if t >= draft.config.vocab_size), len(tokens) - 1)
        with torch.no_grad():
            logits = draft(torch.tensor([prompt + tokens[:readable]])).logits[0, len(prompt) - 1:, :tokenizer_ids]
        agree += (logits.argmax(-1) == torch.tensor(tokens[:readable + 1])).tolist()
    return sum(agree) / len(agree) if agree else None
