"""Where distillation's prompts come from, each source split into training and held-out prompts.

α is measured on held-out prompts of the very source the draft trains on, so the number a user reads is
the agreement where they will decode: on their prompts, on continuations of their text, or, with neither,
on what the target writes by itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import TrainingError
from ..progress import bar, note
from ..texts import read_prompts
from .generate import continue_prompts, eos_ids

HELDOUT_EVERY = 4  # a prompts file: every fourth prompt is held out
HELDOUT_SHARE = 0.1  # text: the last tenth of every file is held out
SPAN_TOKENS = 32  # a prompt cut from text, or sampled from the target, is this long
MAX_PROMPT_TOKENS = 256  # longer prompts keep their end: what the draft continues from
MAX_TEXT_CHARS = 8_000_000  # a large --data folder is sampled down to this much text (prompts need little)
TRAIN_SPANS = 4096


@dataclass
class Prompts:
    source: str  # said in the report
    train: list[list[int]]
    heldout: list[list[int]]


def start_token(tokenizer) -> int:
    """The token a document starts from: bos, or eos where the tokenizer has no bos (it separates documents)."""
    return tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id


@dataclass(frozen=True)
class PromptFile:
    """The prompts of a JSONL file (the format bench and verify read), two or more. distill reads them before it loads
    the target: a file it cannot use (not JSONL, one prompt) was refused once the target had loaded (minutes on a
    large one)."""

    path: Path
    texts: list[str]


def read_prompt_file(path: Path) -> PromptFile:
    texts = read_prompts(path)
    if len(texts) < 2:
        raise TrainingError(f"{path} has one prompt; distill needs two or more (some are held out to measure alpha)")
    return PromptFile(Path(path), texts)


def from_file(tokenizer, file: PromptFile, max_heldout: int, max_tokens: int = MAX_PROMPT_TOKENS) -> Prompts:
    """A prompt file's prompts; every fourth is held out."""
    path, texts = file.path, file.texts
    # Encoded as the runtime encodes a prompt (special tokens included), cut to the end the draft continues.
    encoded = [(ids or [start_token(tokenizer)])[-max_tokens:] for ids in tokenizer(texts)["input_ids"]]
    heldout = set(list(range(HELDOUT_EVERY - 1, len(texts), HELDOUT_EVERY))[:max_heldout]) or {len(texts) - 1}
    # A prompt repeated in the file trains only where none of its copies is held out: α measured on a prompt
    # the draft trained on would promise more agreement than users see.
    held = {tuple(encoded[i]) for i in heldout}
    train = [ids for i, ids in enumerate(encoded) if i not in heldout and tuple(ids) not in held]
    if not train:
        raise TrainingError(f"{path} leaves no prompt to train on once the held-out ones and their copies are set "
                            "aside; distill needs two or more distinct prompts (some are held out to measure alpha)")
    return Prompts(f"prompts of {path}", train, [encoded[i] for i in sorted(heldout)])


def read_texts(root: Path, seed: int = 0) -> list[str]:
    """The text files at or under root (a file or a folder); a large folder is sampled, files in random
    order, down to about MAX_TEXT_CHARS (prompts need little text), and a large file is read only that far
    (whole, a 28 MB file took 6 GB to tokenize)."""
    candidates = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    files = [path for path in candidates if is_text(path)]
    if not files:
        raise TrainingError(f"--data {root} holds no text files")
    texts, total = [], 0
    for index in np.random.default_rng(seed).permutation(len(files)):
        with open(files[index], encoding="utf-8", errors="replace") as file:
            texts.append(file.read(MAX_TEXT_CHARS - total))
        total += len(texts[-1])
        if total >= MAX_TEXT_CHARS:
            break
    return texts


def is_text(path: Path) -> bool:
    """No NUL byte in the first 4 KB, and it decodes as UTF-8 (a character cut at 4 KB may not)."""
    try:
        with open(path, "rb") as file:
            head = file.read(4096)
    except OSError:
        return False
    return b"\0" not in head and head.decode("utf-8", errors="replace").count("\ufffd") <= 3


def from_text(tokenizer, texts: list[str], n_heldout: int, seed: int) -> Prompts:
    """Spans of texts: training spans from the first nine tenths of every text, held-out spans from the
    last tenth, so both come from the same documents and never share text."""
    train_parts, heldout_parts = [], []
    with note(f"tokenizing {len(texts)} texts"):  # up to MAX_TEXT_CHARS in one call
        encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    for ids in encoded:
        cut = int(len(ids) * (1 - HELDOUT_SHARE))
        train_parts.append(ids[:cut])
        heldout_parts.append(ids[cut:])
    heldout = evenly_spaced_spans(heldout_parts, n_heldout)
    train = random_spans(train_parts, TRAIN_SPANS, np.random.default_rng(seed))
    if not heldout or not train:
        raise TrainingError(f"the --data text is too small ({sum(map(len, texts))} characters); "
                            "distill needs a few thousand tokens or more")
    return Prompts(f"spans of {len(texts)} texts", train, heldout)


def random_spans(parts: list[list[int]], n: int, rng: np.random.Generator) -> list[list[int]]:
    """n spans at random places, a part chosen in proportion to the spans it holds."""
    room = np.array([max(0, len(p) - SPAN_TOKENS + 1) for p in parts])
    if room.sum() == 0:
        return []
    spans = []
    for part in rng.choice(len(parts), size=n, p=room / room.sum()):
        start = int(rng.integers(room[part]))
        spans.append(parts[part][start : start + SPAN_TOKENS])
    return spans


def evenly_spaced_spans(parts: list[list[int]], n: int) -> list[list[int]]:
    """n spans, parts in turn, at fixed fractions of each part (middles first)."""
    parts = [p for p in parts if len(p) >= SPAN_TOKENS]
    spans = []
    for fraction in (0.5, 0.25, 0.75, 0.125, 0.375, 0.625, 0.875, 0.0, 1.0):
        for part in parts:
            start = int(fraction * (len(part) - SPAN_TOKENS))
            spans.append(part[start : start + SPAN_TOKENS])
            if len(spans) == n:
                return spans
    return spans


def from_target(target, tokenizer, n_heldout: int, seed: int) -> Prompts:
    """What the target writes by itself: it trains from the start of a document, and is held out on the
    first SPAN_TOKENS tokens of the target's own samples (then measured on what it writes next)."""
    start = [start_token(tokenizer)]
    if start[0] is None:  # compile takes such a target; its samples have no token to begin from
        raise TrainingError("the target's tokenizer has no bos or eos token to begin its own samples from; give "
                            "--prompts or --data to distill on")
    torch.manual_seed(seed + 1)  # held-out samples are not the training samples (those use seed)
    with bar(SPAN_TOKENS, f"the target samples {n_heldout} held-out prompts", "token") as progress:
        samples = continue_prompts(target, [start] * n_heldout, SPAN_TOKENS, len(tokenizer), sample=True,
                                   keep_teacher=False, bar=progress)
    # A sample that ended is no prompt, even at its last token: α would be measured on a new document after an eos,
    # which no request decodes.
    stops = eos_ids(target)
    heldout = [s.tokens.tolist() for s in samples if len(s.tokens) > SPAN_TOKENS and s.tokens[-1] not in stops]
    if not heldout:
        raise TrainingError("the target ends every sample within a few tokens; give --prompts or --data to distill on")
    return Prompts("the target's own samples", [start], heldout)
