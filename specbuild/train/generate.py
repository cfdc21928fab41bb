"""Sequences to distill on, made by the models themselves, each with the target's next-token distribution.

The target continues prompts (sampled and greedy) and keeps its own top-k log-probabilities from the
logits generate() computes anyway, so teaching the draft costs no second target pass. On-policy sequences
come from the draft and are scored by one batched target pass.

Torch's batched generate() is the engine: on the 2-core machine it produced 4-20x the tokens per second of
the ONNX runtime, which decodes one sequence per slot (benchmarks/distill_engines.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ..acceptance import until_eos
from ..compile.load import with_tokenizer_eos

TEACHER_TOP_K = 32  # the target's distribution is kept as its 32 most likely tokens plus one bucket for the rest


@dataclass
class Sequence:
    """tokens[: first + 1] is the context; the target's top-k distribution of every later token is known.

    top_ids[i] / top_logprobs[i] describe the target's prediction of tokens[first + 1 + i], made at
    position first + i.
    """

    tokens: np.ndarray  # int32 [L]
    first: int
    top_ids: np.ndarray  # int32 [L - first - 1, k]
    top_logprobs: np.ndarray  # float32 [L - first - 1, k]


def left_padded(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of different lengths as one batch for generate(): padding on the left, masked out."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    return ids, mask


def right_padded(rows: list[np.ndarray], pad: int) -> torch.Tensor:
    """Sequences as one batch for a teacher-forced pass: causal attention never lets a position see the
    padding after it, so no mask is needed."""
    batch = torch.full((len(rows), max(map(len, rows))), pad, dtype=torch.long)
    for row, tokens in enumerate(rows):
        batch[row, : len(tokens)] = torch.from_numpy(np.asarray(tokens, dtype=np.int64))
    return batch


def _masked_logits() -> bool:
    """Whether this transformers' causal LMs take a boolean [B, T] logits_to_keep (5.21 on: its
    slice_logits_to_keep came with it, and every family specbuild compiles calls it before its head)."""
    import transformers.modeling_utils

    return hasattr(transformers.modeling_utils, "slice_logits_to_keep")


def continuation_logits(model, sequences: list["Sequence"], pad: int) -> torch.Tensor:
    """model's logits [N, V] at the positions each sequence's top_ids describe (first, first + 1, ...: its
    continuation), row after row, from one teacher-forced pass; split by len(s.top_ids) for each row's.

    Distillation reads continuations only (at most 64 positions a row); a head over the prompts and the
    padding too made a [B, T, V] tensor (1.4 GiB for 16 rows of 159 tokens of a 152k vocabulary) and, in
    training, a gradient of its size. One fp32 training step of a Qwen3-0.6B-shaped target's default
    draft, over its weights: 2.7 GiB at its peak, now 1.8; at 308 tokens, 4.3 and now 1.9 (2026-11-26).
    The model's own forward slices before its head (and Gemma's final softcapping), so every family's
    head stays transformers'.
    """
    ids = right_padded([s.tokens[:-1] for s in sequences], pad)
    keep = torch.zeros(ids.shape, dtype=torch.bool)
    for row, s in enumerate(sequences):
        keep[row, s.first : s.first + len(s.top_ids)] = True
    if _masked_logits():
        return model(input_ids=ids, logits_to_keep=keep).logits
    return model(input_ids=ids).logits[keep]


def eos_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    return set(eos if isinstance(eos, list) else [eos]) - {None}


def stop_at_tokenizer_eos(model, tokenizer) -> None:
    """Adds the tokenizer's eos to the model's generation_config, as compile adds it to a bundle's eos ids
    (compile.load.eos_token_ids): a fine-tune whose generation_config.json still names its base model's eos
    ends its turns with the tokenizer's, and generate() and α would run on past the end of every request."""
    ids = sorted(eos_ids(model))
    stops = with_tokenizer_eos(ids, tokenizer, model.config.vocab_size)
    if stops != ids:
        model.generation_config.eos_token_id = stops


def pad_id(model) -> int:
    """The id batches are padded with: an eos, or 0 for a model without one (compile takes such a target;
    padding is masked on the left and comes after every position read on the right, so any id does)."""
    return min(eos_ids(model), default=0)


def top_k(logits: torch.Tensor, vocab: int, k: int = TEACHER_TOP_K) -> tuple[np.ndarray, np.ndarray]:
    """The k most likely tokens and their log-probabilities over the tokenizer's vocab (a padded embedding
    table has rows beyond it that no text uses)."""
    logprobs, ids = F.log_softmax(logits[..., :vocab].float(), -1).topk(k, dim=-1)
    return ids.to(torch.int32).numpy(), logprobs.numpy()


class TopKPerStep:
    """A logits processor that keeps each step's top-k (top_k) and passes the scores on unchanged. generate()'s
    output_logits would hold every step's [B, V] logits until it returns, stacked as many again here (1.7 GB
    for 64 rows x 64 steps of a 32k vocabulary; four times that at Llama 3's 128k). After generate()'s own processors,
    it sees the logits after suppress_tokens only, which touches just the rows past vocab that top_k drops."""

    def __init__(self, vocab: int):
        self.vocab, self.steps = vocab, []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.steps.append(top_k(scores, self.vocab))
        return scores


class Ticks:
    """A logits processor that counts generate()'s steps on a progress bar and passes the scores on unchanged:
    a batch of 64 continuations is one call that runs for minutes on a large target."""

    def __init__(self, bar):
        self.bar = bar

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.bar.update()
        return scores


@torch.no_grad()
def continue_prompts(model, prompts: list[list[int]], new_tokens: int, vocab: int, sample: bool, keep_teacher: bool = True,
                     stop_at_eos: bool = True, bar=None):
    """Each prompt continued by model (sampled at temperature 1 from the whole distribution, or greedy),
    stopping at eos (or, without stop_at_eos, running past it to new_tokens), never choosing a padding row
    beyond vocab. With keep_teacher, the model's own top-k next-token log-probabilities come along.
    bar: a progress bar (progress.bar) that advances by one at each token step of the batch."""
    stops = eos_ids(model)
    pad = pad_id(model)
    ids, mask = left_padded(prompts, pad)
    # Sampling draws from the whole distribution: no top-k/top-p a generation_config might carry.
    sampling = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0} if sample else {"do_sample": False}
    teacher = TopKPerStep(vocab)
    # (No processor a checkpoint's generation_config asks for: reference.plainly_generating models only.)
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        **sampling,
        pad_token_id=pad,
        **({} if stop_at_eos else {"eos_token_id": None}),
        suppress_tokens=list(range(vocab, model.config.vocab_size)) or None,
        logits_processor=[teacher] * keep_teacher + [Ticks(bar)] * (bar is not None) or None,
        return_dict_in_generate=True,
    )
    continuations = out.sequences[:, ids.shape[1] :].tolist()
    if keep_teacher:
        step_ids, step_logprobs = np.stack([i for i, _ in teacher.steps], 1), np.stack([lp for _, lp in teacher.steps], 1)
    sequences = []
    for row, (prompt, continuation) in enumerate(zip(prompts, continuations)):
        continuation = until_eos(continuation, stops) if stop_at_eos else continuation
        tokens = np.asarray(prompt + continuation, dtype=np.int32)
        if keep_teacher:
            top_ids, top_logprobs = step_ids[row, : len(continuation)], step_logprobs[row, : len(continuation)]
        else:
            top_ids = top_logprobs = np.zeros((len(continuation), 0))
        sequences.append(Sequence(tokens, len(prompt) - 1, top_ids, top_logprobs))
    return sequences


@torch.no_grad()
def score(target, sequences: list[Sequence], vocab: int) -> list[Sequence]:
    """The same sequences with the target's top-k distributions, from one teacher-forced pass."""
    # the continuations only: over the prompts too, 64 rows of 160 tokens of a 152k vocabulary are 5.8 GiB
    logits = continuation_logits(target, sequences, pad_id(target)).split([len(s.top_ids) for s in sequences])
    return [Sequence(s.tokens, s.first, *top_k(rows, vocab)) for s, rows in zip(sequences, logits)]
