"""Make a real, small code-model pair (target + draft) from the Python standard library, with no download.

The pair shares one byte-level BPE tokenizer, so it compiles into a bundle like any Hugging Face pair,
and it is trained for minutes on a CPU, so demos and benchmarks need no model hub.
"""

from __future__ import annotations

import inspect
import json
import shutil
import time
from pathlib import Path

from ..recipe import read_table
from ..texts import corpus_files
from .distill import distill
from .train import encode_corpus, heldout_loss, llama, parameter_count, save_checkpoint, train_model, train_tokenizer

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


def read_pair_recipe(path: Path) -> dict:
    """The [pair] table of a recipe as keyword arguments of make_demo_pair."""
    return read_table(path, "pair", set(inspect.signature(make_demo_pair).parameters) - {"out_dir"})


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
