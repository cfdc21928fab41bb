"""How far the draft's next-token distribution is from the target's: the losses DistillSpec (Zhou et al.
2023) compares, on the target's top-k tokens plus one bucket holding the rest of both distributions.

Bucketing keeps the teacher's data small (k numbers a token instead of the vocabulary) and loses nothing
greedy decoding needs: the target's choice is always in its top-k. Each divergence on the buckets is a
lower bound of the full one (coarser distributions are closer) and equals it when the rest is empty.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from .generate import Sequence, continuation_logits

EPS = 1e-9  # keeps log() finite where a bucket is empty
# A training step's fp32 logits per part of its batch (one sequence's at least). The head's logits, their
# log-softmax and the gradients of both were held for the whole batch at once: a step of 16 rows of 64 positions
# of the default draft of a Qwen3-0.6B-shaped target (152k vocabulary) peaked 2.4 GiB over its start, 1.3 GiB
# in parts of this size for 3% more CPU time (0.9 GiB and 9% at half of it; 2026-11-26).
PART_LOGITS_BYTES = 256 << 20


def buckets(student_logprobs: torch.Tensor, top_ids: torch.Tensor, top_logprobs: torch.Tensor):
    """(p, q): the target's and the draft's probabilities of the target's top-k tokens and of the rest."""
    p_top = top_logprobs.exp()
    q_top = student_logprobs.gather(-1, top_ids).exp()
    p = torch.cat([p_top, (1 - p_top.sum(-1, keepdim=True)).clamp_min(0)], -1)
    q = torch.cat([q_top, (1 - q_top.sum(-1, keepdim=True)).clamp_min(0)], -1)
    return p, q


def kl(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a * ((a + EPS).log() - (b + EPS).log())).sum(-1)


# The names are recipe.DISTILL_OBJECTIVES, which distill --help lists without importing torch
DIVERGENCES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "fkl": lambda p, q: kl(p, q),  # forward KL(target || draft): what classic distillation minimises
    "rkl": lambda p, q: kl(q, p),  # reverse KL(draft || target): mode-seeking
    "jsd": lambda p, q: 0.5 * kl(p, (p + q) / 2) + 0.5 * kl(q, (p + q) / 2),
    "tvd": lambda p, q: 0.5 * (p - q).abs().sum(-1),  # total variation: sampling accepts a draft token with chance 1 - TVD
}


def distill_loss(objective: str, vocab: int, pad: int) -> Callable[[torch.nn.Module, list[Sequence]], torch.Tensor]:
    """loss(draft, sequences): the mean divergence over every token whose target distribution is known."""
    divergence = DIVERGENCES[objective]

    def loss(draft, batch: list[Sequence]) -> torch.Tensor:
        # [N, V]: row by row, each row's positions in order, as the teacher's top-k are concatenated below
        student = F.log_softmax(continuation_logits(draft, batch, pad)[:, :vocab].float(), -1)
        top_ids = torch.from_numpy(np.concatenate([s.top_ids for s in batch])).long()
        top_logprobs = torch.from_numpy(np.concatenate([s.top_logprobs for s in batch]))
        return divergence(*buckets(student, top_ids, top_logprobs)).mean()

    return loss


def parts(vocab: int) -> Callable[[list[Sequence]], list[tuple[float, list[Sequence]]]]:
    """parts(batch): the batch's sequences in runs whose logits over vocab take at most PART_LOGITS_BYTES, each
    with its share of the batch's positions, so that distill_loss's mean over the batch is the shares' sum of
    its means over the parts (train_model's parts: a default batch of a 64k vocabulary is one part)."""
    most = max(1, PART_LOGITS_BYTES // (4 * vocab))

    def split(batch: list[Sequence]) -> list[tuple[float, list[Sequence]]]:
        runs, positions = [[]], [0]
        for s in batch:
            if runs[-1] and positions[-1] + len(s.top_ids) > most:
                runs.append([])
                positions.append(0)
            runs[-1].append(s)
            positions[-1] += len(s.top_ids)
        return [(count / sum(positions), run) for count, run in zip(positions, runs)]

    return split
