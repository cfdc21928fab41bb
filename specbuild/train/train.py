"""Training with transformers on a CPU: tokenizer, training loop, held-out loss, checkpoint folders."""

from __future__ import annotations

import json
import math
import shutil
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from .. import progress
from ..errors import OutputError, TrainingError
from ..staging import amount, check_output, guarded_folder, nearest_folder

EOS = "<|endoftext|>"


def train_tokenizer(texts: list[str], vocab_size: int = 4096, max_chars: int = 6_000_000):
    """A byte-level BPE (GPT-2 style) tokenizer with <|endoftext|> as id 0 and as bos, eos and pad; every
    newline is a token of its own.

    GPT-2's split joins a newline to the indentation after it ("\n   " + " return"), so a prompt ending in
    a newline ends in a token that, in training, only ever came before a blank line or an unindented
    line: the demo target continued such prompts with blank lines. Split off, a newline means the same
    wherever a prompt ends. Trained on at most max_chars of text: merges barely change with more.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    sample, total = [], 0
    for text in texts:
        if total >= max_chars:
            break
        sample.append(text)
        total += len(text)
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
    bpe.train_from_iterator(sample, trainer=trainer, length=len(sample))
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=EOS, eos_token=EOS, pad_token=EOS)


def encode_corpus(tokenizer, texts: list[str], chunk: int = 64) -> np.ndarray:
    """All texts' token ids in one int32 array, each text followed by eos."""
    pieces = []
    for start in progress.steps(range(0, len(texts), chunk), "tokenize", "chunk"):
        for ids in tokenizer(texts[start : start + chunk], add_special_tokens=False)["input_ids"]:
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
    """A progress bar over wall-clock seconds, so its ETA is the time budget's end (on a terminal only, as every bar)."""
    return progress.bar(seconds, desc, bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed}<{remaining}{postfix}")


def windows(data: np.ndarray, batch_size: int, seq_len: int) -> Callable[[np.random.Generator], tuple[torch.Tensor, int]]:
    """Batches of random windows of data (seq_len + 1 tokens each) for next-token training."""

    def next_batch(rng: np.random.Generator) -> tuple[torch.Tensor, int]:
        starts = rng.integers(0, len(data) - seq_len - 1, batch_size)
        return torch.from_numpy(np.stack([data[s : s + seq_len + 1] for s in starts]).astype(np.int64)), batch_size * seq_len

    return next_batch


class StepTuner:
    """Runs each training step the fastest way timed on this machine now: on one thread or all of them,
    with matmuls in fp32 or in bf16 (autocast: weights and optimizer state stay fp32).

    Measured on this 2-core machine: bf16 made a step of the demo target 1.7x faster (the CPU has bf16
    instructions; where it has none, bf16 is slower and loses its timing). With a load of ~9, two threads
    took 4.5x longer per step than one, since a step's threads wait for each other whenever one is
    descheduled; on a quiet machine two are faster. So the first TRIES steps of each way are timed, the
    fastest holds for a while, and the thread count is timed again when the hold ends; a hold doubles
    (up to LONGEST_HOLD) each time the same count wins, so a steady machine is rarely disturbed.
    """

    TRIES = 2
    FIRST_HOLD, LONGEST_HOLD = 30.0, 480.0

    def __init__(self):
        self.thread_counts = sorted({1, torch.get_num_threads()})
        self.trying = [(threads, bf16) for bf16 in (False, True) for threads in self.thread_counts]
        self.times: dict[tuple[int, bool], list[float]] = {}
        self.chosen = (self.thread_counts[-1], False)
        self.hold, self.until = self.FIRST_HOLD, 0.0

    def next(self) -> tuple[int, bool]:
        """(threads, bf16) for the next step."""
        if time.monotonic() < self.until:
            return self.chosen
        for way in self.trying:
            if len(self.times.get(way, [])) < self.TRIES:
                return way
        best = min(self.trying, key=lambda way: min(self.times[way]))
        self.hold = min(2 * self.hold, self.LONGEST_HOLD) if best == self.chosen else self.FIRST_HOLD
        self.chosen, self.times, self.until = best, {}, time.monotonic() + self.hold
        # Later rounds time the thread counts only: the load changes, the CPU's bf16 speed does not.
        self.trying = [(threads, best[1]) for threads in self.thread_counts]
        return best

    def record(self, way: tuple[int, bool], seconds: float) -> None:
        if time.monotonic() >= self.until:
            self.times.setdefault(way, []).append(seconds)


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
    parts: Callable[[Any], list[tuple[float, Any]]] | None = None,
) -> dict:
    """Train for a wall-clock budget (whatever next_batch spends making a batch counts in it).

    next_batch(rng) -> (batch, tokens it trains on); loss_fn(model, batch) -> scalar loss. parts(batch) ->
    [(share, part), ...] whose share-weighted losses add up to the batch's: each part is back-propagated
    before the next is computed, so a step holds one part's activations, not the batch's.
    """
    rng = np.random.default_rng(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    budget = minutes * 60
    steps = tokens = 0
    loss_value = float("nan")
    tuner, threads_before, ways = StepTuner(), torch.get_num_threads(), Counter()
    started = time.monotonic()
    with time_bar(budget, desc) as bar:
        while (elapsed := time.monotonic() - started) < budget:
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(lr, steps, elapsed / budget, warmup_steps)
            batch, batch_tokens = next_batch(rng)
            model.train()  # next_batch may have generated with it (on-policy data)
            way = tuner.next()
            torch.set_num_threads(way[0])
            step_started = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            loss_value = 0.0
            for share, part in parts(batch) if parts else [(1.0, batch)]:
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=way[1]):
                    loss = share * loss_fn(model, part)
                loss.backward()
                loss_value += loss.item()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            tuner.record(way, time.perf_counter() - step_started)
            ways[f"{way[0]} thread{'s' * (way[0] > 1)} {'bf16' if way[1] else 'fp32'}"] += 1
            steps += 1
            tokens += batch_tokens
            bar.n = min(time.monotonic() - started, budget)
            bar.set_postfix(loss=f"{loss_value:.3f}", tok_s=f"{tokens / bar.n:.0f}")
    torch.set_num_threads(threads_before)
    model.eval()
    return {"steps": steps, "tokens": tokens, "seconds": round(time.monotonic() - started, 1), "final_loss": loss_value,
            "steps_by_way": dict(ways)}


@torch.no_grad()
def heldout_loss(model, data: np.ndarray, seq_len: int = 256, max_tokens: int = 200_000, batch_size: int = 8) -> float:
    """Mean next-token cross-entropy (nats) over consecutive non-overlapping windows of data."""
    model.eval()
    windows = min(len(data) - 1, max_tokens) // seq_len
    if windows == 0:
        raise TrainingError(f"held-out text has {len(data)} tokens; it needs more than seq_len={seq_len}")
    total = 0.0
    for first in progress.steps(range(0, windows, batch_size), "held-out loss", "batch"):
        count = min(batch_size, windows - first)
        rows = [data[(first + i) * seq_len : (first + i + 1) * seq_len + 1] for i in range(count)]
        batch = torch.from_numpy(np.stack(rows).astype(np.int64))
        total += next_token_loss(model, batch).item() * count
    return total / windows


def is_checkpoint(folder: Path) -> bool:
    """A Hugging Face model folder: its config.json names a model type or architecture (a project of the
    user's may have a config.json of its own)."""
    try:
        config = json.loads((folder / "config.json").read_bytes())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(config, dict) and bool(config.get("model_type") or config.get("architectures"))


CHECKPOINT = dict(is_kind=is_checkpoint, kind="checkpoint")  # what guarded outputs of checkpoints may replace


def check_checkpoint_output(out_dir: Path, overwrite: bool, inputs: dict[str, Path | None]) -> None:
    """Refuse (OutputError) an output that writing a checkpoint there would lose: an input, or a folder
    that is neither empty nor (with overwrite) a checkpoint. Run before training, so a refusal costs nothing."""
    check_output(out_dir, overwrite=overwrite, inputs=inputs, **CHECKPOINT)


def check_room(model, out_dir: Path) -> None:
    """OutputError where out_dir's disk lacks room for the model's weights as save_pretrained writes them (a tied
    tensor once): run before training, which a full disk would otherwise cost whole, found only when writing."""
    weights = sum({t.data_ptr(): t.numel() * t.element_size() for t in model.state_dict().values()}.values())
    disk = nearest_folder(out_dir)
    free = shutil.disk_usage(disk).free
    if weights > free:
        raise OutputError(f"the draft's weights take {amount(weights)} and the disk of {disk} has {amount(free)} free; "
                          f"free some space or choose another output for {out_dir} (refused before training)")


def save_checkpoint(model, tokenizer, out_dir: Path, *, overwrite: bool = False,
                    inputs: dict[str, Path | None] | None = None) -> None:
    """Write a Hugging Face folder (safetensors, tokenizer, generation_config) atomically, where
    check_checkpoint_output allows."""
    with guarded_folder(Path(out_dir), overwrite=overwrite, inputs=inputs, **CHECKPOINT) as staging:
        write_checkpoint(model, tokenizer, staging)


def write_checkpoint(model, tokenizer, folder: Path) -> None:
    """The checkpoint's files into folder (a staging folder of guarded_folder)."""
    from transformers import GenerationConfig

    from ..compile.bundle import save_tokenizer  # as a bundle's: loadable by transformers 4 too

    eos = tokenizer.eos_token_id
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=eos, pad_token_id=eos)
    model.save_pretrained(folder, safe_serialization=True)
    save_tokenizer(tokenizer, folder)


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
