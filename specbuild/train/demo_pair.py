"""Make a real, small code-model pair (target + draft) from the Python standard library, with no download.

The pair shares one byte-level BPE tokenizer, so it compiles into a bundle like any Hugging Face pair, and
it is trained for minutes on a CPU, so demos and benchmarks need no model hub. Every setting comes from a
recipe's [pair] table (specbuild/recipes/demo.toml): the one place the demo's defaults live.
"""

from __future__ import annotations

import io
import json
import time
import tokenize
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from ..errors import TrainingError
from ..recipe import DISTILL_RULES, at_line, positive_number, read_table, whole_number
from ..staging import replace_file
from ..texts import corpus_files, read_source
from .distill import SHAPE_KEYS, distill
from .train import encode_corpus, heldout_loss, llama, parameter_count, save_checkpoint, train_model, train_tokenizer, windows

TARGET_EVAL_TOKENS = 50_000  # the target evaluates at ~2.5k tokens/s on 2 cores; this keeps it to ~20 s


@dataclass(frozen=True)
class PairRecipe:
    """The [pair] table of a recipe; every key is required (specbuild/recipes/demo.toml documents each)."""

    skip_dirs: list[str]
    vocab_size: int
    seq_len: int
    batch_size: int
    lr: float
    target_minutes: float
    distill_minutes: float
    distill_lr: float
    gamma: int
    seed: int
    target: dict
    draft: dict

    @property
    def minutes(self) -> float:
        return self.target_minutes + self.distill_minutes


def _model_problem(table) -> str | None:
    if not isinstance(table, dict) or sorted(set(SHAPE_KEYS) - set(table)):
        return f"must be a table with {', '.join(SHAPE_KEYS)}"
    return next((f"{key} {problem}" for key in SHAPE_KEYS if (problem := whole_number(1)(table[key]))), None)


PAIR_RULES = {
    "skip_dirs": lambda v: None if isinstance(v, list) and all(isinstance(d, str) for d in v) else "must be a list of folder names",
    "vocab_size": whole_number(256), "seq_len": whole_number(2), "batch_size": whole_number(1), "lr": positive_number,
    "target_minutes": positive_number,
    # what make_demo_pair passes distill, by distill's own rules (the seed seeds the target's training too)
    "distill_minutes": DISTILL_RULES["minutes"], "distill_lr": DISTILL_RULES["lr"], "gamma": DISTILL_RULES["gamma"],
    "seed": DISTILL_RULES["seed"],
    # LlamaConfig fields; a table without them would build LlamaConfig's defaults, a 7B model
    "target": _model_problem, "draft": _model_problem,
}


def read_pair_recipe(path: Path) -> PairRecipe:
    """The [pair] table, every key present and of its kind, checked before minutes of training."""
    names = {f.name for f in fields(PairRecipe)}
    table = read_table(path, "pair", names)
    missing = sorted(names - set(table))
    if missing:
        raise TrainingError(f"recipe {path}: [pair] lacks {', '.join(missing)} (specbuild/recipes/demo.toml has every key)")
    for key, rule in PAIR_RULES.items():
        if problem := rule(table[key]):
            # with its line, as [compile]'s values are named (README, Recipes)
            raise TrainingError(f"recipe {path}{at_line(path, 'pair', key)}: [pair] {key} {problem}")
    return PairRecipe(**table)


def corpus(recipe: PairRecipe) -> tuple[list[str], list[str]]:
    """(train, held-out) code of the standard library's files outside skip_dirs, without comments and
    docstrings (~1.5M tokens: more than the target reads in its minutes).

    A third of the library's text is English in comments and docstrings. Trained on the code alone for the
    same minutes, the demo target continued the demo prompts with statements instead of docstrings that
    repeat a phrase ("Return a list of the file.") or comments of "the the the".
    """
    return tuple([code_only(read_source(p)) for p in files if not set(recipe.skip_dirs) & set(p.parts)]
                 for files in corpus_files())


def code_only(source: str) -> str:
    """Python source without its comments and docstrings (strings that are statements of their own), and
    without the lines they leave empty; source that does not tokenize is returned as it is."""
    try:
        tokens = [t for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type != tokenize.NL]
    except (tokenize.TokenError, SyntaxError):
        return source
    edges = {tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    cuts = [
        (token.start, token.end)
        for i, token in enumerate(tokens)
        if token.type == tokenize.COMMENT
        or token.type == tokenize.STRING  # a statement of its own: after an edge and before one (or a comment)
        and (i == 0 or tokens[i - 1].type in edges)
        and tokens[i + 1].type in edges | {tokenize.COMMENT}
    ]
    lines = source.splitlines(keepends=True)
    emptied = set()
    for (first_row, first_col), (last_row, last_col) in reversed(cuts):  # from the end: columns stay valid
        lines[first_row - 1] = lines[first_row - 1][:first_col] + lines[last_row - 1][last_col:]
        for row in range(first_row, last_row):
            lines[row] = ""
        emptied.update(range(first_row, last_row + 1))
    kept = [line for row, line in enumerate(lines, 1) if line.strip() or row not in emptied]
    return "".join(line.rstrip() + "\n" if line.endswith("\n") else line.rstrip() for line in kept)


def make_demo_pair(out_dir: Path, recipe: PairRecipe) -> dict:
    """Train a target on the corpus, then distill a draft from what the target writes; write
    out_dir/{target,draft} and the report (also returned) to out_dir/report.json."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    train_texts, heldout_texts = corpus(recipe)
    tokenizer = train_tokenizer(train_texts, recipe.vocab_size)
    train_ids, heldout_ids = encode_corpus(tokenizer, train_texts), encode_corpus(tokenizer, heldout_texts)
    report = {
        "recipe": asdict(recipe),
        "corpus": {
            "train_files": len(train_texts),
            "heldout_files": len(heldout_texts),
            "train_tokens": int(len(train_ids)),
            "heldout_tokens": int(len(heldout_ids)),
            "vocab_size": len(tokenizer),
            "seconds": round(time.monotonic() - started, 1),
        },
    }

    target = llama(recipe.target, tokenizer, seed=recipe.seed)
    run = train_model(target, windows(train_ids, recipe.batch_size, recipe.seq_len), minutes=recipe.target_minutes,
                      lr=recipe.lr, desc="target", seed=recipe.seed)
    report["target"] = {
        "parameters": parameter_count(target),
        "training": run,
        "tokens_per_second": round(run["tokens"] / run["seconds"]),
        "heldout_loss": heldout_loss(target, heldout_ids, recipe.seq_len, TARGET_EVAL_TOKENS),
    }
    save_checkpoint(target, tokenizer, out_dir / "target", overwrite=True)  # a killed run's half pair

    # A new draft learns what the target writes after spans of the corpus: the demo prompts are code, and
    # from code the draft reached α 0.57 at γ 4 on them where the target's own samples as prompts gave 0.52
    # (3 minutes each, one trial).
    report["draft"] = distill(out_dir / "target", out_dir / "draft", data=train_texts, draft_config=recipe.draft,
                              minutes=recipe.distill_minutes, lr=recipe.distill_lr, gamma=recipe.gamma, seed=recipe.seed,
                              overwrite=True)
    if not report["draft"]["written"]:
        raise TrainingError(f"the demo draft did not learn (alpha {report['draft']['alpha_after']}); delete {out_dir} and run again")
    report["total_seconds"] = round(time.monotonic() - started, 1)
    # Its recipe is what a later demo checks the cached pair against: never left cut short by a kill.
    replace_file(out_dir / "report.json", json.dumps(report, indent=2) + "\n")
    return report
