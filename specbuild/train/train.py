"""Training with transformers on a CPU: tokenizer, training loop, held-out loss, checkpoint folders."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..staging import staged_folder
from ..texts import read_source

EOS = "<|endoftext|>"
def train_tokenizer(files: list[Path], vocab_size: int = 4096, max_chars: int = 6_000_000):
    """A byte-level BPE (GPT-2 style) tokenizer with <|endoftext|> as id 0 and as bos, eos and pad.

    Trained on at most max_chars of text: merges learned from a few MB of code barely change with more.
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
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
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
    for start in tqdm(range(0, len(files), chunk), desc="tokenize", unit="chunk", leave=False):
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
    """A progress bar over wall-clock seconds, so its ETA is the time budget's end."""
    return tqdm(total=seconds, desc=desc, bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed}<{remaining}{postfix}")


def train_model(
    model,
    data: np.ndarray,
    *,
    minutes: float,
    batch_size: int = 16,
    seq_len: int = 256,
    lr: float = 2e-3,
    desc: str = "train",
    warmup_steps: int = 20,
    seed: int = 0,
    loss_fn: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor] = next_token_loss,
) -> dict:
    """Train on random windows of data for a wall-clock budget; loss_fn(model, windows) -> scalar loss."""
    torch.set_num_threads(2)
    rng = np.random.default_rng(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    budget = minutes * 60
    model.train()
    steps = tokens = 0
    loss_value = float("nan")
    started = time.monotonic()
    with time_bar(budget, desc) as bar:
        while (elapsed := time.monotonic() - started) < budget:
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(lr, steps, elapsed / budget, warmup_steps)
            starts = rng.integers(0, len(data) - seq_len - 1, batch_size)
            batch = torch.from_numpy(np.stack([data[s : s + seq_len + 1] for s in starts]).astype(np.int64))
            loss = loss_fn(model, batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            steps += 1
            tokens += batch_size * seq_len
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
        raise ValueError(f"held-out data has {len(data)} tokens; need more than seq_len={seq_len}")
    total = 0.0
    for first in tqdm(range(0, windows, batch_size), desc="held-out loss", unit="batch", leave=False):
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
    with staged_folder(out_dir) as staging:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)


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
