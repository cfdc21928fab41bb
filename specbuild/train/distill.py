"""Align a draft with its target by knowledge distillation, and measure how well they agree.

Speculative decoding only pays when the target accepts most drafted tokens, so the number that
matters is the greedy acceptance rate alpha, measured here exactly and cheaply with torch.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..acceptance import rounds
from ..errors import CheckpointError
from ..texts import corpus_files, read_source
from .train import encode_corpus, heldout_loss, parameter_count, save_checkpoint, train_model

DRAFT_SHARE = 0.1  # a default draft has at most this share of the target's parameters, where the vocabulary allows


@torch.no_grad()
def acceptance_rate(target, draft, prompts_ids: list[list[int]], gamma: int = 4, new_tokens: int = 64) -> float:
    """Greedy speculative acceptance rate alpha = accepted / drafted tokens over all prompts.

    Exact for greedy decoding: an accepted draft prefix equals the target's own tokens, so the
    draft's choices can be read off one teacher-forced pass over the target's continuation.
    """
    target.eval()
    draft.eval()
    eos = target.generation_config.eos_token_id
    by_length: dict[int, list[list[int]]] = {}
    for prompt in prompts_ids:
        by_length.setdefault(len(prompt), []).append(prompt)
    accepted = drafted = 0
    # Equal-length prompts batch without padding; a batch amortises generate()'s per-step overhead.
    for length, group in tqdm(by_length.items(), desc=f"alpha (gamma={gamma})", unit="batch", leave=False):
        ids = torch.tensor(group)
        sequences = target.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False, pad_token_id=eos
        )
        # Logits at position t predict token t + 1, so the prediction of continuation[i] sits at length + i - 1.
        predicted = draft(input_ids=sequences[:, :-1]).logits[:, length - 1 :].argmax(-1)
        for continuation, guesses in zip(sequences[:, length:], predicted):
            produced = _until_eos(continuation.tolist(), eos)
            agreement = (guesses[: len(produced)] == continuation[: len(produced)]).tolist()
            round_accepted, round_drafted = rounds(agreement, gamma)
            accepted += round_accepted
            drafted += round_drafted
    return accepted / drafted if drafted else 0.0


def _until_eos(tokens: list[int], eos) -> list[int]:
    """The tokens up to and including the first eos: generate() pads finished rows of a batch after it."""
    stops = set(eos if isinstance(eos, list) else [eos]) - {None}
    for i, token in enumerate(tokens):
        if token in stops:
            return tokens[: i + 1]
    return tokens


def heldout_prompts(tokenizer, files: list[Path], n: int = 32, prompt_tokens: int = 48) -> list[list[int]]:
    """n prompts of prompt_tokens tokens: windows at fixed fractions of each file, files round-robin."""
    encoded = [
        ids
        for ids in tokenizer([read_source(p) for p in files], add_special_tokens=False)["input_ids"]
        if len(ids) >= prompt_tokens
    ]
    if not encoded:
        raise ValueError(f"no held-out file has {prompt_tokens} tokens")
    prompts = []
    # Middles first: file heads are licence boilerplate that any model predicts.
    for fraction in (0.5, 0.25, 0.75, 0.125, 0.375, 0.625, 0.875):
        for ids in encoded:
            start = int(fraction * (len(ids) - prompt_tokens))
            prompts.append(ids[start : start + prompt_tokens])
            if len(prompts) == n:
                return prompts
    return prompts


def load_model(path: Path, role: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{role} checkpoint {path} is not a Hugging Face folder (no config.json)")
    try:
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{role} checkpoint {path} cannot be loaded ({exc})") from None
    return model.eval(), tokenizer


def shrunk_config(target_config, overrides: dict | None = None):
    """A config of the target's own model_type and vocabulary, shrunk to a draft, then overridden.

    The default is the largest of a few narrower, shallower shapes with at most DRAFT_SHARE of the
    target's parameters (the smallest one when the embedding table alone is over that share).
    """
    budget = DRAFT_SHARE * _meta_parameters(target_config)
    candidates = [_shaped(target_config, hidden, layers) for hidden, layers in _shapes(target_config)]
    sized = sorted((_meta_parameters(c), i) for i, c in enumerate(candidates))
    fitting = [i for params, i in sized if params <= budget]
    config = candidates[fitting[-1] if fitting else sized[0][1]]
    for key, value in (overrides or {}).items():
        setattr(config, key, value)
    if getattr(config, "head_dim", None) and "head_dim" not in (overrides or {}):
        config.head_dim = config.hidden_size // config.num_attention_heads
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[: config.num_hidden_layers]
    return config


def _shapes(target_config) -> list[tuple[int, int]]:
    layers = target_config.num_hidden_layers
    hiddens = {max(64, target_config.hidden_size // d // 32 * 32) for d in (2, 3, 4, 6, 8)}
    depths = {max(1, layers // d) for d in (2, 3, 4, 6)}
    return [(h, n) for h in sorted(hiddens) for n in sorted(depths)]


def _shaped(target_config, hidden: int, layers: int):
    config = copy.deepcopy(target_config)
    head_dim = 64 if hidden >= 512 else 32
    heads = hidden // head_dim
    # generic names reach GPT-2's n_embd / n_layer / n_head through its config's attribute_map
    config.hidden_size, config.num_hidden_layers, config.num_attention_heads = hidden, layers, heads
    if getattr(config, "num_key_value_heads", None):
        config.num_key_value_heads = max(k for k in range(1, heads + 1) if heads % k == 0 and k <= config.num_key_value_heads)
    if getattr(config, "intermediate_size", None):
        ratio = target_config.intermediate_size / target_config.hidden_size
        config.intermediate_size = int(ratio * hidden) // 8 * 8
    if hasattr(config, "n_inner"):
        config.n_inner = None  # GPT-2: 4 x hidden
    if getattr(config, "head_dim", None):
        config.head_dim = head_dim
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:layers]
    return config


def _meta_parameters(config) -> int:
    """Parameter count of a config's model without allocating its weights."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return parameter_count(AutoModelForCausalLM.from_config(config))


def kd_loss(target):
    """KL(target || draft) per token at temperature 1; the target sees the same windows, without gradients."""

    def loss(draft, batch: torch.Tensor) -> torch.Tensor:
        inputs = batch[:, :-1]
        with torch.no_grad():
            teacher = F.log_softmax(target(input_ids=inputs).logits.float(), -1).flatten(0, 1)
        student = F.log_softmax(draft(input_ids=inputs).logits.float(), -1).flatten(0, 1)
        # A padded embedding table may give one model extra rows that no token ever uses.
        vocab = min(teacher.shape[-1], student.shape[-1])
        return F.kl_div(student[:, :vocab], teacher[:, :vocab], log_target=True, reduction="batchmean")

    return loss


def build_draft(target, tokenizer, draft_config: dict | None, init: Path | None, seed: int):
    from transformers import AutoModelForCausalLM

    if init is None:
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(shrunk_config(target.config, draft_config))
    draft, draft_tokenizer = load_model(init, "draft")
    if draft_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise CheckpointError(
            f"draft {init} has a different tokenizer from the target ({len(draft_tokenizer)} vs {len(tokenizer)} "
            "tokens); distillation compares distributions token by token, so the draft must use the target's"
        )
    return draft


def distill(
    target_dir: Path,
    output_dir: Path,
    *,
    draft_config: dict | None = None,
    init: Path | None = None,
    minutes: float = 5.0,
    data_files: list[Path] | None = None,
    heldout_files: list[Path] | None = None,
    batch_size: int = 16,
    seq_len: int = 256,
    lr: float = 1e-3,
    gamma: int = 4,
    prompts: int = 32,
    seed: int = 0,
) -> dict:
    """Distill a draft from the target at target_dir; write it (with the target's tokenizer) to output_dir.

    The draft starts from init (a checkpoint with the target's tokenizer) or from scratch with
    shrunk_config(target config, draft_config). Text defaults to the standard library split of
    corpus_files(). Returns alpha and held-out loss before and after.
    """
    target, tokenizer = load_model(target_dir, "target")
    if data_files is None or heldout_files is None:
        default_train, default_heldout = corpus_files()
        data_files = default_train if data_files is None else data_files
        heldout_files = default_heldout if heldout_files is None else heldout_files
    draft = build_draft(target, tokenizer, draft_config, init, seed)
    data, heldout = encode_corpus(tokenizer, data_files), encode_corpus(tokenizer, heldout_files)
    prompt_ids = heldout_prompts(tokenizer, heldout_files, prompts)

    started = time.monotonic()
    report = {
        "target_parameters": parameter_count(target),
        "draft_parameters": parameter_count(draft),
        "alpha_before": acceptance_rate(target, draft, prompt_ids, gamma),
        "heldout_loss_before": heldout_loss(draft, heldout, seq_len),
    }
    run = train_model(
        draft,
        data,
        minutes=minutes,
        batch_size=batch_size,
        seq_len=seq_len,
        lr=lr,
        desc="distill",
        seed=seed,
        loss_fn=kd_loss(target),
    )
    report.update(
        alpha_after=acceptance_rate(target, draft, prompt_ids, gamma),
        heldout_loss_after=heldout_loss(draft, heldout, seq_len),
        seconds=run["seconds"],
        tokens=run["tokens"],
        final_kl=run["final_loss"],
        gamma=gamma,
        evaluation_seconds=round(time.monotonic() - started - run["seconds"], 1),
    )
    save_checkpoint(draft, tokenizer, output_dir)
    return report
