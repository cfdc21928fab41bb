"""Make a real, small code-model pair (target + draft) from the Python standard library, with no download.

The pair shares one byte-level BPE tokenizer, so it compiles into a bundle like any Hugging Face pair,
and it is trained for minutes on a CPU, so demos and benchmarks need no model hub.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import os
import shutil
import sysconfig
import time
import tomllib
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

EOS = "<|endoftext|>"
EXCLUDED_DIRS = {"site-packages", "test", "tests", "idle_test"}
HELDOUT_EVERY = 20  # one file in twenty (by path hash) is held out: ~5%
TARGET_EVAL_TOKENS = 50_000  # the target evaluates at ~2.5k tokens/s on 2 cores; this keeps it to ~20 s

# Shapes of the demo pair: a ~11M-parameter target and a draft with under a tenth of its parameters.
TARGET_SHAPE = {
    "hidden_size": 384,
    "intermediate_size": 1024,
    "num_hidden_layers": 6,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
}
DRAFT_SHAPE = {
    "hidden_size": 128,
    "intermediate_size": 344,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def corpus_files() -> tuple[list[Path], list[Path]]:
    """(train, held-out) .py files of the running Python's standard library, without its tests."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, heldout = [], []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if EXCLUDED_DIRS & set(relative.parts[:-1]) or not path.is_file():
            continue
        # Hashing the path (not the contents) keeps the split stable across Python patch releases.
        bucket = int(hashlib.sha1(relative.as_posix().encode()).hexdigest(), 16) % HELDOUT_EVERY
        (heldout if bucket == 0 else train).append(path)
    return train, heldout


def read_source(path: Path) -> str:
    # A few stdlib files hold deliberately odd bytes; replacing them beats dropping the file.
    return path.read_text(encoding="utf-8", errors="replace")


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


def read_pair_recipe(path: Path) -> dict:
    """The [pair] table of a recipe as keyword arguments of make_demo_pair."""
    from specbuild_runtime.errors import SpecbuildError

    try:
        table = tomllib.loads(Path(path).read_text()).get("pair", {})
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise SpecbuildError(f"recipe {path} cannot be read: {exc}") from None
    known = set(inspect.signature(make_demo_pair).parameters) - {"out_dir"}
    unknown = set(table) - known
    if unknown:
        raise SpecbuildError(f"recipe {path}: unknown [pair] keys {sorted(unknown)}; known keys are {sorted(known)}")
    return table


def make_demo_pair(
    out_dir: Path,
    *,
    target_minutes: float = 12.0,
    draft_minutes: float = 2.0,
    distill_minutes: float = 4.0,
    vocab_size: int = 4096,
    seq_len: int = 256,
    batch_size: int = 16,
    lr: float = 2e-3,
    distill_lr: float = 1e-3,
    gamma: int = 4,
    target: dict | None = None,
    draft: dict | None = None,
    seed: int = 0,
) -> dict:
    """Train a target, pre-train a draft, distill the draft from the target; write out_dir/{target,draft}.

    target and draft are LlamaConfig overrides of TARGET_SHAPE and DRAFT_SHAPE. Returns the report
    also written to out_dir/report.json.
    """
    # distill builds on this module's training loop, so it can only be imported once this module is.
    from .distill import distill

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    train_files, heldout_files = corpus_files()
    started = time.monotonic()
    tokenizer = train_tokenizer(train_files, vocab_size)
    train_ids, heldout_ids = encode_corpus(tokenizer, train_files), encode_corpus(tokenizer, heldout_files)
    report = {
        "corpus": {
            "train_files": len(train_files),
            "heldout_files": len(heldout_files),
            "train_tokens": int(len(train_ids)),
            "heldout_tokens": int(len(heldout_ids)),
            "vocab_size": len(tokenizer),
            "tokenizer_seconds": round(time.monotonic() - started, 1),
        }
    }
    common = {"batch_size": batch_size, "seq_len": seq_len, "seed": seed}

    target_model = llama({**TARGET_SHAPE, **(target or {})}, tokenizer, seed=seed)
    target_run = train_model(target_model, train_ids, minutes=target_minutes, lr=lr, desc="target", **common)
    report["target"] = {
        "parameters": parameter_count(target_model),
        "training": target_run,
        "tokens_per_second": round(target_run["tokens"] / target_run["seconds"]),
        "heldout_loss": heldout_loss(target_model, heldout_ids, seq_len, TARGET_EVAL_TOKENS),
    }
    save_checkpoint(target_model, tokenizer, out_dir / "target")
    del target_model

    draft_model = llama({**DRAFT_SHAPE, **(draft or {})}, tokenizer, seed=seed + 1)
    draft_run = train_model(draft_model, train_ids, minutes=draft_minutes, lr=lr, desc="draft", **common)
    pretrained = out_dir / ".draft-pretrained"
    save_checkpoint(draft_model, tokenizer, pretrained)
    distilled = distill(
        out_dir / "target",
        out_dir / "draft",
        init=pretrained,
        minutes=distill_minutes,
        data_files=train_files,
        heldout_files=heldout_files,
        lr=distill_lr,
        gamma=gamma,
        **common,
    )
    shutil.rmtree(pretrained)
    report["draft"] = {
        "parameters": parameter_count(draft_model),
        "parameter_ratio": round(parameter_count(draft_model) / report["target"]["parameters"], 4),
        "training": draft_run,
        "tokens_per_second": round(draft_run["tokens"] / draft_run["seconds"]),
        "distillation": distilled,
    }
    report["total_seconds"] = round(time.monotonic() - started, 1)
    (out_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report
