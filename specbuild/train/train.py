"""Training with transformers on a CPU: tokenizer, training loop, held-out loss, checkpoint folders."""

from __future__ import annotations

import math
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..errors import TrainingError
from ..texts import read_source

EOS = "<|endoftext|>"
def train_tokenizer(files: list[Path], vocab_size: int = 4096, max_chars: int = 6_000_000):
    """A byte-level BPE (GPT-2 style) tokenizer with <|endoftext|> as id 0 and as bos, eos and pad; every
    newline is a token of its own.

    GPT-2's split joins a newline to the indentation after it ("\n   " + " return"), so a prompt ending in
    a newline ends in a token that, in training, only ever came before a blank line or an unindented
    line: the demo target continued such prompts with blank lines. Split off, a newline means the same
    wherever a prompt ends. Trained on at most max_chars of text: merges barely change with more.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts, total = [], 0
    for path in files:
        if total >= max_chars:
            break
        texts.append(read_source(path))
        total += len(texts[-1])
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split("\n", behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=EOS, eos_token=EOS, pad_token=EOS)


def encode_corpus(tokenizer, files: list[Path], chunk: int = 64) -> np.ndarray:
    """All files' token ids in one int32 array, each file followed by eos."""
    pieces = []
    for start in tqdm(range(0, len(files), chunk), desc="tokenize", unit="chunk", leave=False, disable=None):
        texts = [read_source(p) for p in files[start : start + chunk]]
        for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
            pieces.append(np.asarray(ids + [tokenizer.eos_token_id], dtype=np.int32))
    return np.concatenate(pieces)


def parameter_count(model) -> int:
    """Parameters including embeddings; a tied input/output table counts once."""
    return sum(p.numel() for p in model.parameters())


def next_token_loss(model, batch: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=batch[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())


def learning_rate(peak: float, step: int, fraction: float, warmup_steps: int) -> float:
    """Linear warmup by steps, then cosine decay to a tenth of the peak over the time budget."""
    warmup = min(1.0, (step + 1) / warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(fraction, 1.0)))
    return peak * warmup * (0.1 + 0.9 * cosine)


def time_bar(seconds: float, desc: str) -> tqdm:
    """A progress bar over wall-clock seconds, so its ETA is the time budget's end. Like every bar here it
    shows on a terminal only (disable=None), so logs and one-line errors stay clean."""
    return tqdm(total=seconds, desc=desc, bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed}<{remaining}{postfix}",
                disable=None)


def windows(data: np.ndarray, batch_size: int, seq_len: int) -> Callable[[np.random.Generator], tuple[torch.Tensor, int]]:
    """Batches of random windows of data (seq_len + 1 tokens each) for next-token training."""

    def next_batch(rng: np.random.Generator) -> tuple[torch.Tensor, int]:
        starts = rng.integers(0, len(data) - seq_len - 1, batch_size)
        return torch.from_numpy(np.stack([data[s : s + seq_len + 1] for s in starts]).astype(np.int64)), batch_size * seq_len

    return next_batch


def train_model(
    model,
    next_batch: Callable[[np.random.Generator], tuple[Any, int]],
    *,
    minutes: float,
    lr: float = 2e-3,
    desc: str = "train",
    warmup_steps: int = 20,
    seed: int = 0,
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor] = next_token_loss,
) -> dict:
    """Train for a wall-clock budget (whatever next_batch spends making a batch counts in it).

    next_batch(rng) -> (batch, tokens it trains on); loss_fn(model, batch) -> scalar loss.
    """
    rng = np.random.default_rng(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    budget = minutes * 60
    steps = tokens = 0
    loss_value = float("nan")
    started = time.monotonic()
    with time_bar(budget, desc) as bar:
        while (elapsed := time.monotonic() - started) < budget:
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(lr, steps, elapsed / budget, warmup_steps)
            batch, batch_tokens = next_batch(rng)
            model.train()  # next_batch may have generated with it (on-policy data)
            loss = loss_fn(model, batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            steps += 1
            tokens += batch_tokens
            loss_value = loss.item()
            bar.n = min(time.monotonic() - started, budget)
            bar.set_postfix(loss=f"{loss_value:.3f}", tok_s=f"{tokens / bar.n:.0f}")
    model.eval()
    return {"steps": steps, "tokens": tokens, "seconds": round(time.monotonic() - started, 1), "final_loss": loss_value}


@torch.no_grad()
def heldout_loss(model, data: np.ndarray, seq_len: int = 256, max_tokens: int = 200_000, batch_size: int = 8) -> float:
    """Mean next-token cross-entropy (nats) over consecutive non-overlapping windows of data."""
    model.eval()
    windows = min(len(data) - 1, max_tokens) // seq_len
    if windows == 0:
        raise TrainingError(f"held-out text has {len(data)} tokens; it needs more than seq_len={seq_len}")
    total = 0.0
    for first in tqdm(range(0, windows, batch_size), desc="held-out loss", unit="batch", leave=False, disable=None):
        count = min(batch_size, windows - first)
        rows = [data[(first + i) * seq_len : (first + i + 1) * seq_len + 1] for i in range(count)]
        batch = torch.from_numpy(np.stack(rows).astype(np.int64))
        total += next_token_loss(model, batch).item() * count
    return total / windows


def save_checkpoint(model, tokenizer, out_dir: Path) -> None:
    """Write a Hugging Face folder (safetensors, tokenizer, generation_config) atomically."""
    from transformers import GenerationConfig

    out_dir = Path(out_dir)
    eos = tokenizer.eos_token_id
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=eos, pad_token_id=eos)
    staging = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    replace_dir(staging, out_dir)


def replace_dir(staging: Path, out_dir: Path) -> None:
    """Rename staging to out_dir; a reader sees the old folder or the new one, never half of one."""
    old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
    if out_dir.exists():
        out_dir.rename(old)
    staging.rename(out_dir)
    shutil.rmtree(old, ignore_errors=True)


def llama(shape: dict, tokenizer, max_positions: int = 2048, seed: int = 0):
    """A freshly initialised LlamaForCausalLM over tokenizer's vocabulary, with tied embeddings."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **shape,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)
