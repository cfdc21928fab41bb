"""Does `specbuild distill` raise α where the user decodes, on a pair and a domain the project never trained on?

Builds (once, cached in --work) a C pair from the headers under /usr/include: a byte-level BPE tokenizer, a
target trained for --target-minutes and a draft of the same tokenizer pre-trained for --draft-minutes on the
same text (a generic small model, as a user would bring). Prompts of the domain are spans of headers the
pair never saw: eval.jsonl measures α; train.jsonl (other headers) is what --prompts gets.

Then, for each variant, distill the draft for --minutes and measure α at γ on eval.jsonl before and after
(the same exact greedy measurement distill uses). Variants: the defaults (the target's own samples), --prompts,
--data, and the divergences and data kinds DistillSpec compares. Prints a table and writes JSON.

    python benchmarks/distill_domains.py --variants default,prompts,data,fkl,rkl,jsd,on-policy --json c.json
    python benchmarks/distill_domains.py --work .cache/distill-c-py --mix-python --json c-py.json
    python benchmarks/distill_domains.py --pair .cache/demo/pair --eval specbuild/prompts/code.jsonl --variants default
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path

import numpy as np

from specbuild.texts import corpus_files, read_prompts, read_source
from specbuild.train.distill import acceptance, alpha, distill, load_model, target_references
from specbuild.train.generate import eos_ids
from specbuild.train.prompts import is_text, random_spans
from specbuild.train.train import encode_corpus, llama, save_checkpoint, train_model, train_tokenizer, windows

TARGET = {"hidden_size": 384, "intermediate_size": 1024, "num_hidden_layers": 6, "num_attention_heads": 6,
          "num_key_value_heads": 2}
DRAFT = {"hidden_size": 128, "intermediate_size": 344, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2}
VARIANTS = {  # name -> keyword arguments of distill() besides the defaults
    "default": {},
    "prompts": {"prompts_file": "train.jsonl"},
    "data": {"data": "train-files"},
    "fkl": {"objective": "fkl"},
    "rkl": {"objective": "rkl"},
    "jsd": {"objective": "jsd"},
    "sampled only": {"kinds": ("sampled",)},
    "greedy only": {"kinds": ("greedy",)},
    "on-policy": {"kinds": ("sampled", "greedy", "draft")},
    "share 0.25": {"generation_share": 0.25},
    "share 0.75": {"generation_share": 0.75},
}


def split_headers(root: Path, max_chars: int = 15_000_000) -> tuple[list[Path], list[Path]]:
    """(train, eval) headers: one in ten (by path hash) is for evaluation only; training takes a random
    subset of the rest up to max_chars (minutes of training read far less)."""
    files = sorted(p for p in root.rglob("*.h") if p.is_file() and is_text(p))
    held = [p for p in files if int(hashlib.sha1(str(p).encode()).hexdigest(), 16) % 10 == 0]
    train, total = [], 0
    for index in np.random.default_rng(0).permutation(len(files)):
        if files[index] not in held and total < max_chars:
            train.append(files[index])
            total += files[index].stat().st_size
    return train, held


def write_prompts(path: Path, tokenizer, files: list[Path], n: int, seed: int) -> None:
    """n spans of SPAN_TOKENS tokens from files, as a JSONL prompts file (decoded text)."""
    parts = tokenizer([read_source(f) for f in files], add_special_tokens=False)["input_ids"]
    spans = random_spans(parts, n, np.random.default_rng(seed))
    path.write_text("".join(json.dumps({"prompt": tokenizer.decode(s)}) + "\n" for s in spans))


def build_c_pair(work: Path, target_minutes: float, draft_minutes: float, mix_python: bool) -> Path:
    """With mix_python the pair also learns the Python standard library (as much text again): a target
    whose own samples are half off the domain, as a general model's are."""
    pair = work / "pair"
    if (pair / "draft" / "config.json").is_file():
        return pair
    train, held = split_headers(Path("/usr/include"))
    texts = [read_source(f) for f in train]
    if mix_python:
        texts += [read_source(p) for p in corpus_files()[0]]
        texts = [texts[i] for i in np.random.default_rng(0).permutation(len(texts))]
    tokenizer = train_tokenizer(texts, 4096)
    data = encode_corpus(tokenizer, texts)
    (work / "train-files.txt").write_text("\n".join(map(str, train)) + "\n")
    write_prompts(work / "eval.jsonl", tokenizer, held, 64, seed=1)
    write_prompts(work / "train.jsonl", tokenizer, train, 256, seed=2)
    for name, shape, minutes, seed in (("target", TARGET, target_minutes, 0), ("draft", DRAFT, draft_minutes, 1)):
        model = llama(shape, tokenizer, seed=seed)
        print(name, train_model(model, windows(data, 4, 256), minutes=minutes, lr=3e-3, desc=name, seed=seed))
        save_checkpoint(model, tokenizer, pair / name)
    return pair


def eval_alpha(pair: Path, draft: Path, prompts: list[str], gamma: int) -> float:
    target, tokenizer = load_model(pair / "target", "target")
    model, _ = load_model(draft, "draft")
    references = target_references(target, tokenizer(prompts)["input_ids"], len(tokenizer))
    return alpha(acceptance(model, references, gamma, len(tokenizer), eos_ids(target)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=Path(".cache/distill-c-pair"), help="where the C pair and runs are kept")
    parser.add_argument("--pair", type=Path, help="an existing pair (target/, draft/) instead of the C pair")
    parser.add_argument("--eval", type=Path, help="prompts α is measured on  [default: the C pair's eval.jsonl]")
    parser.add_argument("--variants", default="default,prompts", help=f"comma-separated, of: {', '.join(VARIANTS)}")
    parser.add_argument("--minutes", type=float, default=4.0)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--target-minutes", type=float, default=10.0)
    parser.add_argument("--draft-minutes", type=float, default=2.0)
    parser.add_argument("--mix-python", action="store_true", help="the pair also learns Python (a general target)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    pair = args.pair or build_c_pair(args.work, args.target_minutes, args.draft_minutes, args.mix_python)
    eval_prompts = read_prompts(args.eval or args.work / "eval.jsonl")
    before = eval_alpha(pair, pair / "draft", eval_prompts, args.gamma)
    print(f"{pair}: alpha at gamma {args.gamma} on {len(eval_prompts)} domain prompts before distilling: {before:.3f}")
    results = {"pair": str(pair), "gamma": args.gamma, "minutes": args.minutes, "alpha_before": round(before, 4), "runs": {}}
    for name in args.variants.split(","):
        options = dict(VARIANTS[name])
        if "prompts_file" in options:
            options["prompts_file"] = args.work / options["prompts_file"]
        if "data" in options:
            options["data"] = [read_source(Path(p)) for p in (args.work / "train-files.txt").read_text().split()]
        out = args.work / f"draft-{name.replace(' ', '-')}"
        started = time.monotonic()
        report = distill(pair / "target", out, init=pair / "draft", minutes=args.minutes, gamma=args.gamma, force=True, **options)
        after = eval_alpha(pair, out, eval_prompts, args.gamma)
        # A time budget on a shared machine buys less work when others run: the load and the work done say
        # whether two runs are comparable.
        results["runs"][name] = {"alpha_after": round(after, 4), "gain": round(after - before, 4),
                                 "wall_seconds": round(time.monotonic() - started), "load_average": os.getloadavg()[0],
                                 "distill_report": report}
        print(f"{name:>14}: alpha {before:.3f} -> {after:.3f} ({after - before:+.3f}) on the domain prompts; "
              f"distill's own held-out {report['alpha_before']:.3f} -> {report['alpha_after']:.3f}; "
              f"{report['generation']['sequences']} sequences, {report['training']['steps']} steps, "
              f"load {os.getloadavg()[0]:.1f}", flush=True)
        if args.json:
            args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
