"""Align a draft with its target: distillation on sequences the target itself writes, judged by the greedy
acceptance rate α on held-out prompts of the same source, and never written out worse than it came in.

Speculative decoding only pays when the target accepts most drafted tokens, so α at the user's γ is the
number that decides; it is measured here exactly and cheaply with torch.
"""

from __future__ import annotations

import copy
import functools
import itertools
import json
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from specbuild_runtime.errors import first_line

from ..acceptance import expected_tokens_per_call, rounds, theoretical_speedup, until_eos
from ..compile.load import (check_architecture, check_checkpoint_folder, check_draft_smaller, check_draft_without_tokenizer,
                             check_embedding_rows, has_tokenizer_files, load_config, load_tokenizer, model_spec,
                             unpadded_parameters)
from ..compile.reference import load_reference, plainly_generating
from ..errors import CheckpointError, TrainingError
from ..progress import bar, note
from ..recipe import (DEFAULT_MAX_SEQ_LEN, DISTILL_BATCH_SIZE, DISTILL_GAMMA, DISTILL_MINUTES, DISTILL_OBJECTIVE,
                      DISTILL_RULES, DISTILL_SEED, distill_conflict)
from ..staging import guarded_folder
from .divergence import distill_loss, parts
from .generate import Sequence, continuation_logits, continue_prompts, eos_ids, pad_id, score, stop_at_tokenizer_eos
from .prompts import (MAX_PROMPT_TOKENS, SPAN_TOKENS, PromptFile, Prompts, from_file, from_target, from_text,
                      read_prompt_file, read_texts)
from .train import (CHECKPOINT, check_checkpoint_output, check_room, is_checkpoint, parameter_count, train_model,
                    write_checkpoint)

DRAFT_SHARE = 0.1  # a default draft has at most this share of the target's parameters, where the vocabulary allows
NEW_TOKENS = 64  # every generated sequence, and every held-out measurement, continues a prompt this far
GENERATION_BATCH = 64  # sequences per batched generate() call: the fastest per token on 2 cores
# Share of the minutes spent making sequences; the rest trains on them (each seen ~4 times). α at γ 4, one
# run each: demo target 0.58 at 0.5 -> 0.62 at 0.3 (4.5 min); C pair 0.589 at 0.5 -> 0.597 at 0.25 (4 min).
GENERATION_SHARE = 0.3


def load_model(path: Path, role: str, config=None):
    """A Hugging Face folder's model (fp32, eval mode, from safetensors only: never unpickled) and tokenizer (None for
    a draft saved without tokenizer files, which speaks the target's, as compile takes it). config: the folder's
    config where the caller has checked the folder and read it (checked_config), so that config.json is read once."""
    path = Path(path)
    if config is None:
        config = checked_config(path, role)
    check_memory(config, path, role)
    with note(f"loading the {role} checkpoint {path}"):  # an 8B target in fp32 is 32 GB to read and convert
        model = load_reference(path, role, config=config)
    return model, None if role == "draft" and not has_tokenizer_files(path) else load_tokenizer(path, role, config)


def checked_config(path: Path, role: str):
    """The checkpoint's config (load_config), or CheckpointError where path is no folder, or holds no config.json or
    no safetensors weights: distill checks --init so before it loads the target, which refused a wrong --init only
    after that load (minutes on a large target)."""
    check_checkpoint_folder(path, role)
    if not any(path.glob("*.safetensors")):
        raise CheckpointError(f"{role} checkpoint {path} has no *.safetensors weights (distill never unpickles "
                              "*.bin files; re-save it with save_pretrained(..., safe_serialization=True))")
    return load_config(path, role)


def check_memory(config, path: Path, role: str) -> None:
    """TrainingError where this machine (or container) cannot hold even the checkpoint's weights as distill
    holds them, in fp32: the kernel would kill distill while it loads them, saying nothing of why.

    The weights alone are a lower bound: on a target of 281M parameters (1.05 GiB in fp32) and its 26M-parameter
    draft with a 152k vocabulary, distill's peak was 4.5 GiB (/usr/bin/time -v, 2026-11-26), the draft's weights,
    gradients and AdamW state and a step's logits making the rest. A checkpoint refused here would surely be
    killed; one let through may still be, by what training adds or by other processes' memory.
    """
    from specbuild_runtime.pool import memory_limit

    try:
        need = 4 * _meta_parameters(config)
    except Exception:  # a config transformers cannot build a model of: loading it says why, in its own words
        return
    total, where = memory_limit()
    if need > total:
        raise TrainingError(f"{role} checkpoint {path} takes {need / 2**30:.1f} GiB as distill holds it (fp32), "
                            f"but {where} {total / 2**30:.1f} GiB; run distill on a machine with more memory")


def shrunk_config(target_config, overrides: dict | None = None):
    """A config of the target's model_type (a mixture of experts': its dense sibling's, DENSE_SIBLINGS, unless the
    overrides name the target's own) and vocabulary, shrunk to a draft, then overridden.

    The default is the largest of a few narrower, shallower shapes with at most DRAFT_SHARE of the
    target's parameters (the smallest one when the embedding table alone is over that share).
    """
    base = _draft_base(target_config, (overrides or {}).get("model_type"))
    # Of a mixture's total parameters, not its active ones: the share keeps a draft step cheap next to a target call,
    # and specbuild's call computes every expert (layers.mixture_of_experts), so it costs the total
    budget = DRAFT_SHARE * _meta_parameters(target_config)
    candidates = [_shaped(base, hidden, layers) for hidden, layers in _shapes(base)]
    sized = sorted((_meta_parameters(c), i) for i, c in enumerate(candidates))
    fitting = [i for params, i in sized if params <= budget]
    default = candidates[fitting[-1] if fitting else sized[0][1]]
    # GPT-2's n_layer is also num_hidden_layers, ...
    overrides = {default.attribute_map.get(key, key): value for key, value in (overrides or {}).items()}
    draft = functools.partial(_overridden, default, base, target_config)  # _check_windows rebuilds it, keys moved
    config = draft(overrides)
    _check_windows(draft, overrides, config)
    return config


def _overridden(default, base, target_config, overrides: dict):
    """The default draft's config with the overrides set, its head_dim and layer_types following them."""
    config = copy.deepcopy(default)
    known = default.to_dict()
    own = base is target_config  # else a mixture's dense sibling, whose keys the messages must name as the draft's
    for key, value in overrides.items():
        if key not in known:
            shape = [k for k in ("hidden_size", "n_embd", "intermediate_size", "n_inner", "num_hidden_layers", "n_layer",
                                 "num_attention_heads", "n_head", "num_key_value_heads", "head_dim") if k in known]
            where = ("the target's config.json" if own else f"the draft's {base.model_type} config (the dense sibling "
                     f"of the target's {target_config.model_type}; model_type={target_config.model_type} gives a "
                     "mixture-of-experts draft)")
            raise TrainingError(f"--draft-config {key}: {where} has no such key (its shape keys: {', '.join(shape)})")
        current = known[key]
        mistyped = current is not None and type(value) is not type(current) and not (
            type(current) is float and type(value) is int)
        typed = (f"must be of type {type(current).__name__}, as the {'target' if own else 'draft'}'s {key} = "
                 f"{_typed(current)} is")
        if mistyped and value is not None:
            raise TrainingError(f"--draft-config {key}={_typed(value)}: {typed}")
        try:
            # transformers' strict config classes check some values themselves, null among them: it passes where the
            # field may be None, so that sliding_window=null turns a Mistral's, Phi-3's or Mixtral's window off
            setattr(config, key, value)
        except Exception as exc:
            reason = typed if mistyped else first_line(exc)
            raise TrainingError(f"--draft-config {key}={_typed(value)}: {reason}") from None
    _check_shape(config)
    if getattr(config, "head_dim", None) and "head_dim" not in overrides:
        config.head_dim = config.hidden_size // config.num_attention_heads
    if getattr(config, "layer_types", None) and "layer_types" not in overrides:
        # The class's rule read anew where the target follows it or an override moves it: Qwen2's and Qwen3's layers
        # read layer_types alone, which their classes make of max_window_layers (Gemma 3's of sliding_window_pattern)
        # only when a config is built, so that an override set later changed no layer, and a draft deeper than the
        # target repeated its list (full, slide, slide, full, ...) where Qwen's rule slides every layer from K on
        defaults = {key: known[key] for key in overrides if key in WINDOW_KEYS}
        rebuilt = _rebuilt(config)
        if _rebuilt(base).layer_types == base.layer_types or (
                rebuilt.layer_types != _rebuilt(config, defaults).layer_types):
            config = rebuilt
        else:
            # The target's own pattern (no rule's) as deep as the draft: the default shape's list is cut to its own
            # depth, and a deeper num_hidden_layers outgrew it (an IndexError in transformers)
            pattern = base.layer_types
            config.layer_types = [pattern[i % len(pattern)] for i in range(config.num_hidden_layers)]
    if "sliding_window" in overrides and overrides["sliding_window"] is None and hasattr(config, "layer_types") and (
            not hasattr(config, "use_sliding_window")):
        # Gemma's and OLMo 3's classes take the null, and their models fail on it in the first forward pass, all
        # layers full or not; Qwen's switch their window off with use_sliding_window, Mistral's have no layer_types
        raise TrainingError(f"--draft-config sliding_window=null: the draft's {config.model_type} layers need a "
                            "window; to turn it off, list full_attention layers alone in layer_types instead")
    # to the heads the overrides made, from the target's lists (the default shape's are already thinned), unless the
    # overrides gave their own; here, not after, as the window checks build each probe through its class, which
    # refuses factors of other heads (Phi-4-mini with 8 heads and sliding_window=4096: transformers' traceback)
    _fit_rope_factors(config, None if {"rope_parameters", "rope_scaling"} & set(overrides) else base)
    return config


def _typed(value) -> str:
    """value as typed after --draft-config KEY=: JSON (true, null, [...]) where the command line read it as JSON,
    else the text itself; Python's True and None are not what the user wrote."""
    return value if isinstance(value, str) else json.dumps(value, default=repr)


def _rebuilt(config, changes: dict | None = None):
    """config (with changes) as its class builds it anew, its layer_types made of its window keys (use_sliding_window,
    sliding_window, max_window_layers for Qwen2 and Qwen3, whose window is None where use_sliding_window is not;
    Gemma 3's sliding_window_pattern)."""
    return type(config).from_dict({**config.to_dict(), **(changes or {}), "layer_types": None})


# The keys, in any family's config, that decide which layers slide and how far: each with the advice that names it and
# a value of it that lets windows in (Gemma 3's pattern is every k-th layer full; a layer_types list, all sliding, is
# made at the draft's depth). An override of one that changes none of the compiled draft's windows is refused
# (_check_windows), e.g. Qwen2's use_sliding_window=true where its max_window_layers, the target's, is at least the
# draft's depth, which transformers' rule (layer i slides where i >= max_window_layers) leaves all full.
WINDOW_KEYS = {"use_sliding_window": ("use_sliding_window=true", True),
               "sliding_window": ("sliding_window=N", 4096),
               "max_window_layers": ("max_window_layers=K (layers from K on slide)", 0),
               "sliding_window_pattern": ("sliding_window_pattern=K (every K-th layer full)", 2),
               "layer_types": ('layer_types listing "sliding_attention" layers', "sliding_attention")}


def _check_windows(draft, overrides: dict, config) -> None:
    """TrainingError for an override of a window key that changes no layer's window as compile reads the draft,
    naming the keys that would make it count. Refused rather than completed: which layers slide (Qwen's
    max_window_layers=K) is the user's to choose, and transformers, vLLM and TGI would run the same config.json with
    no window in those layers either, so a guess here would be a draft that reads differently from its config."""
    windows = _windows(config) if WINDOW_KEYS.keys() & overrides.keys() else None
    if windows is None:
        return  # no window key given, or a draft compile cannot read (_check_pair says why)
    known = config.to_dict()
    for key, value in overrides.items():
        off = value is None or value is False  # 0 is a max_window_layers
        if key not in WINDOW_KEYS or (off and not any(windows)):
            continue  # no window where none was asked for
        # what the draft has without it, the other overrides applied: Gemma 2's rule gives a 4-layer draft the
        # layer_types s f s f that a user may also write out
        without = draft(_without(overrides, key))
        if value == getattr(without, key, None) or windows != _windows(without):
            continue
        depth = config.num_hidden_layers
        others = [k for k in WINDOW_KEYS if k in known and k != key]
        fix = next((keys for n in range(1, len(others) + 1) for keys in itertools.combinations(others, n)
                    if _counts(draft, overrides, key, keys, depth)), None)
        done = f"{'changes no window' if any(windows) else 'slides no layer'} of the {depth}-layer draft"
        advice = (f"add {' and '.join(WINDOW_KEYS[k][0] for k in fix)}" if fix else
                  f"remove it (no other window key of the draft's {(config.architectures or [config.model_type])[0]} "
                  "makes it count)")
        raise TrainingError(f"--draft-config {key}={_typed(value)} {done}; {advice}")


def _counts(draft, overrides: dict, key: str, keys: tuple[str, ...], depth: int) -> bool:
    """Whether the override of key changes the draft's windows once keys are given values that let windows in."""
    enabling = {k: [WINDOW_KEYS[k][1]] * depth if k == "layer_types" else WINDOW_KEYS[k][1] for k in keys}
    given = {**overrides, **enabling}
    try:
        return _windows(draft(given)) != _windows(draft(_without(given, key)))
    except TrainingError:  # a value this config class refuses
        return False


def _without(overrides: dict, key: str) -> dict:
    return {k: v for k, v in overrides.items() if k != key}


def _windows(config) -> list[int | None] | None:
    """Each layer's window as compile reads the draft's config.json (its class builds it anew, dropping a Qwen3-MoE's
    window without use_sliding_window), or None where compile would refuse the draft."""
    architecture = (config.architectures or [None])[0]
    try:
        read = type(config).from_dict(config.to_dict())
    except Exception as exc:  # the class's checks of the whole config (a layer_types of another depth), in its cause
        raise TrainingError(f"--draft-config: {first_line(exc.__cause__ or exc)}") from None
    try:
        return model_spec(read, architecture, Path("draft"), "draft").sliding_windows
    except (CheckpointError, KeyError):
        return None


# A mixture of experts' model_type -> the dense one its default draft is: the pairs users run (Qwen3-30B-A3B with
# Qwen3-0.6B, Mixtral with Mistral 7B), their attention the same. A shrunk mixture would cost a draft step what a
# dense draft of its total parameters costs (every expert computes every row) while a token uses k of its experts.
DENSE_SIBLINGS = {"qwen3_moe": "qwen3", "mixtral": "mistral"}
# Dense siblings whose head is tied to their embeddings, as the family's releases of a draft's size are (Qwen3 0.6B,
# 1.7B and 4B; Mistral's smallest, 7B, is untied), where the mixture's never is. A step reads the same head either way,
# and Qwen3-30B-A3B's draft keeps its shape (1024 wide, 24 layers: the largest, far under its budget) with 445M
# parameters for 601M, the 156M-parameter table and its training state no longer held twice. A dense target's draft
# keeps the target's own choice: untying, or tying an untied one, moves a table's worth of the budget to or from the
# layers (tied, 6 of the 8 untied released configs' drafts change shape, Llama 3.1 8B's from 5 layers to 8, its step
# reading 699M parameters for 535M), a costlier or cheaper step whose α nothing here measured.
TIED_SIBLINGS = {"qwen3"}


def _draft_base(target_config, model_type):
    """The config a new draft is shrunk from: the target's, or its dense sibling's where it is a mixture of experts
    and model_type (--draft-config's, None where not given) does not name the target's own; TrainingError for a
    model_type that is neither."""
    own = target_config.model_type
    sibling = DENSE_SIBLINGS.get(own)
    if model_type not in (None, own, sibling):  # the config's class would stay the one chosen here: a mislabeled draft
        either = (f"the target's model_type ({own}) or its dense sibling's ({sibling}, the default)" if sibling else
                  f"the target's model_type ({own})")
        raise TrainingError(f"--draft-config model_type={_typed(model_type)}: a new draft is of {either}; to draft "
                            "with another architecture, pass its checkpoint with --init")
    return target_config if sibling is None or model_type == own else _dense_sibling(target_config, sibling)


def _dense_sibling(target_config, model_type: str):
    """target_config as a config of model_type: its every key that model_type's config has (vocabulary, special
    tokens, head_dim, rope, window; Qwen3's q/k norms come with its class), none of the mixture's (experts, router),
    the mixture's window in every layer where it has one (Mixtral always, Qwen3-MoE where use_sliding_window),
    which a dense Qwen3 would give only to the layers from max_window_layers on, and its head tied where
    TIED_SIBLINGS says."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    keys = AutoConfig.for_model(model_type).to_dict()
    kept = {key: value for key, value in target_config.to_dict().items() if key in keys and key != "model_type"}
    kept["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]]
    kept["tie_word_embeddings"] = model_type in TIED_SIBLINGS
    windowed = getattr(target_config, "sliding_window", None) is not None
    if "layer_types" in keys:
        kept["layer_types"] = ["sliding_attention" if windowed else "full_attention"] * target_config.num_hidden_layers
        if windowed:
            kept["max_window_layers"] = 0
    return AutoConfig.for_model(model_type, **kept)


# A Llama-style config's shape (GPT-2 reaches them through its config's attribute_map).
SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")


def _check_shape(config) -> None:
    """TrainingError for a shape no model has (transformers builds some of them and fails only in the first
    forward pass, minutes later, or never: a draft without layers that compile then refuses)."""
    sizes = {key: getattr(config, key, None) for key in SHAPE_KEYS}
    for key, value in sizes.items():
        if value is not None and value < 1:
            raise TrainingError(f"--draft-config {key}={value}: must be 1 or more")
    heads, kv_heads = sizes["num_attention_heads"], sizes["num_key_value_heads"]
    if kv_heads and heads % kv_heads:
        raise TrainingError(f"--draft-config: num_attention_heads {heads} is no multiple of num_key_value_heads {kv_heads}")


def _check_pair(draft, target, tokenizer, where: str, smaller: str) -> None:
    """What compile will check of the pair, checked before the minutes of training: a draft it supports,
    embedding rows for every token, a draft smaller than the target, and the context compile gives the pair by
    default. smaller: how to give a smaller draft (distill has no --draft)."""
    architecture = (draft.config.architectures or ["<none>"])[0]
    check_architecture(architecture, where)
    try:
        spec = model_spec(draft.config, architecture, Path(where), "draft")
    except CheckpointError as exc:
        raise TrainingError(f"{exc}; choose another draft") from None
    if spec.shape.vocab_size < len(tokenizer):
        raise TrainingError(f"{where} has {spec.shape.vocab_size} embedding rows for the tokenizer's {len(tokenizer)} "
                            "tokens; give it at least as many")
    target_spec = model_spec(target.config, target.config.architectures[0], Path(where), "target")
    token_ids = max(tokenizer.get_vocab().values()) + 1
    check_draft_smaller(f"the draft ({where})", unpadded_parameters(parameter_count(draft), spec, token_ids), "the target",
                        unpadded_parameters(parameter_count(target), target_spec, token_ids), smaller)
    # compile would take the draft's positions as the pair's context: a draft shorter than the target makes a bundle
    # of a shorter context than the target's own
    context = min(DEFAULT_MAX_SEQ_LEN, target_spec.max_position_embeddings)
    if spec.max_position_embeddings < context:
        raise TrainingError(f"{where} has max_position_embeddings {spec.max_position_embeddings}, so a bundle of the "
                            f"pair would hold at most that many tokens, not the {context} compile gives the target by "
                            "default; give it at least as many")


def _shapes(target_config) -> list[tuple[int, int]]:
    layers = target_config.num_hidden_layers
    # A multiple of its heads' width (_head_dim), as shrunk_config takes the width to be hidden // heads: 672, a
    # multiple of 32 only, was 10 heads of 67, which rotary embeddings cannot pair (OLMo 3's YaRN table failed while
    # the candidates were sized) nor compile take (a multiple of 16: Llama 3.2 1B's default draft was refused)
    hiddens = {max(64, hidden // _head_dim(hidden) * _head_dim(hidden))
               for hidden in (target_config.hidden_size // d for d in (2, 3, 4, 6, 8))}
    depths = {max(1, layers // d) for d in (2, 3, 4, 6)}
    return [(h, n) for h in sorted(hiddens) for n in sorted(depths)]


def _shaped(target_config, hidden: int, layers: int):
    config = copy.deepcopy(target_config)
    head_dim = _head_dim(hidden)
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
    _fit_rope_factors(config)
    return config


def _head_dim(hidden: int) -> int:
    return 64 if hidden >= 512 else 32


def _fit_rope_factors(config, source=None) -> None:
    """LongRoPE's per-frequency factors (Phi-3.5, Phi-4-mini) taken at the draft's own frequencies: the target's
    lists hold one factor for each of its rotary pairs, and transformers cannot apply them to a draft's narrower heads
    (a RuntimeError while distill sized its default draft, reported as a bug in specbuild). Frequency i of n is
    theta^(-i/n) at any width, so the factor of the target's pair at the same fraction of its list is kept. The lists
    are taken from `source` (the target's config) where given, else from config's own."""
    # transformers 5 keeps them in rope_parameters; 4 (4.56, 4.57: TensorRT-LLM's pin) in rope_scaling, whose "type"
    # names the kind
    name = "rope_parameters" if isinstance(getattr(config, "rope_parameters", None), dict) else "rope_scaling"
    rope = getattr(config, name, None)
    if not isinstance(rope, dict) or rope.get("rope_type", rope.get("type")) != "longrope":
        return
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    pairs = int(head_dim * rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))) // 2
    lists = getattr(source, name, None) if source is not None else rope
    lists = lists if isinstance(lists, dict) else rope
    fitted = {key: [factors[i * len(factors) // pairs] for i in range(pairs)]
              for key in ("short_factor", "long_factor") if (factors := lists.get(key)) and pairs}
    fitted = {key: factors for key, factors in fitted.items() if factors != rope.get(key)}
    if fitted:
        setattr(config, name, {**rope, **fitted})


def _meta_parameters(config) -> int:
    """Parameter count of a config's model without allocating its weights."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return parameter_count(AutoModelForCausalLM.from_config(config))


def new_draft(target, tokenizer, config, draft_config: dict | None, seed: int):
    """A new draft of config (shrunk_config of the target's config and the draft_config overrides), checked as compile
    will check the pair."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    try:
        with note("initialising the draft"):  # random init of a target's tenth: seconds per billion parameters
            # config is config.json's, not the loaded target's: its dtype (bf16 for most targets) and attention
            # are taken from the target as load_model holds it (fp32; eager for Gemma 2's soft-capped scores)
            draft = AutoModelForCausalLM.from_config(config, dtype=target.dtype,
                                                     attn_implementation=target.config._attn_implementation)
    except Exception as exc:  # transformers raises many types for a config it cannot build
        raise TrainingError(f"the draft's config ({draft_config or 'the default shrink of the target'}) gives no "
                            f"model transformers can build ({first_line(exc)}); choose other --draft-config values") from None
    # a draft that specbuild could not compile would be minutes of training for nothing
    _check_pair(draft, target, tokenizer, f"the draft of --draft-config {draft_config or '(default)'}",
                "smaller --draft-config values")
    return plainly_generating(draft)  # as load_reference leaves a loaded one (the "draft" sequences)


def init_draft(target, tokenizer, init: Path, config):
    """The checkpoint at init as the draft to train, checked as compile will check the pair. config: its config, as
    _distill read it before the target loaded (checked_config)."""
    draft, draft_tokenizer = load_model(init, "draft", config)
    # Only the token-to-id map, as compile checks a pair (load.validate_pair): the draft is written with the
    # target's tokenizer, so its own bos and eos (a base model's, for an instruct target) are never read.
    if draft_tokenizer is None:
        check_draft_without_tokenizer(Path(init), draft.config.vocab_size, tokenizer, target.config.vocab_size,
                                      target.config)
    elif draft_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise CheckpointError(
            f"draft {init} has a different tokenizer from the target ({len(draft_tokenizer)} vs {len(tokenizer)} "
            "tokens); distillation compares distributions token by token, so the draft must use the target's"
        )
    _check_pair(draft, target, tokenizer, f"--init {init}", "a smaller one as --init")
    return draft


class DistillData:
    """The sequences the draft learns from, made while it learns: next_batch generates a chunk whenever
    generation is behind its share of the time so far, and otherwise draws a batch from all made so far.

    Chunks take turns by kind: "sampled" (the target samples from training prompts), "greedy" (the target
    decodes greedily from a random point of a sampled sequence: the prefixes α is measured on are the
    target's own, and greedy decoding is what the draft must predict) and "draft" (on-policy: the draft
    samples from such a point and the target scores every token).
    """

    def __init__(self, target, draft, prompts: list[list[int]], vocab: int, *, kinds: tuple[str, ...],
                 share: float, batch_size: int, seconds: float = float("inf")):
        self.target, self.draft, self.prompts, self.vocab = target, draft, prompts, vocab
        self.kinds, self.share, self.batch_size, self.budget = kinds, share, batch_size, seconds
        self.sequences: list[Sequence] = []
        self.sampled: list[Sequence] = []
        self.made = Counter()
        self.seconds = 0.0
        # seconds the last set of each kind took: a greedy set (from longer prompts, the teacher's top-k kept) took
        # 7x a sampled one, and judged by the sampled set before it, one began near the end overran --minutes 2x
        self.took: dict[str, float] = {}
        self.started: float | None = None

    def next_batch(self, rng: np.random.Generator) -> tuple[list[Sequence], int]:
        self.started = self.started or time.monotonic()
        elapsed = time.monotonic() - self.started
        # A set that would end past the budget is not begun (on a large target one takes minutes): the
        # training loop stops at the budget, and would wait for it.
        kind = self.kinds[sum(self.made.values()) % len(self.kinds)]
        # a kind not made yet is judged by the slowest made so far
        expected = self.took.get(kind, max(self.took.values(), default=0.0))
        if not self.sequences or (self.seconds < self.share * elapsed and elapsed + expected < self.budget):
            began = time.monotonic()
            self.sequences += self.make(kind, rng)
            self.made[kind] += 1
            self.took[kind] = time.monotonic() - began
            self.seconds += self.took[kind]
        batch = [self.sequences[i] for i in rng.integers(len(self.sequences), size=self.batch_size)]
        return batch, sum(len(s.top_ids) for s in batch)

    def make(self, kind: str, rng: np.random.Generator) -> list[Sequence]:
        # a set takes minutes on a large target, while the training bar above it stands still
        writer = "the draft" if kind == "draft" else "the target"
        with bar(NEW_TOKENS, f"{writer} writes {GENERATION_BATCH} {kind} sequences", "token") as progress:
            if kind == "sampled":
                prompts = [self.prompts[i] for i in rng.integers(len(self.prompts), size=GENERATION_BATCH)]
                made = continue_prompts(self.target, prompts, NEW_TOKENS, self.vocab, sample=True, bar=progress)
                self.sampled += made
                return made
            if kind == "greedy":
                return continue_prompts(self.target, self.branch_points(rng), NEW_TOKENS, self.vocab, sample=False,
                                        bar=progress)
            if kind == "draft":
                drafted = continue_prompts(self.draft, self.branch_points(rng), NEW_TOKENS, self.vocab, sample=True,
                                           keep_teacher=False, bar=progress)
                return score(self.target, drafted, self.vocab)
        raise ValueError(f"unknown kind of sequence {kind!r}")

    def branch_points(self, rng: np.random.Generator) -> list[list[int]]:
        """Prefixes of sampled sequences cut at random points of their continuation (training prompts until
        there are sampled sequences), each its end that leaves the target's positions room to be continued."""
        if not self.sampled:
            return [self.prompts[i] for i in rng.integers(len(self.prompts), size=GENERATION_BATCH)]
        # A prompt and its sampled continuation may fill the positions (choose_prompts), and a prefix of that
        # is continued NEW_TOKENS further: past GPT-2's table (an IndexError), or past what others learned.
        room = self.target.config.max_position_embeddings - NEW_TOKENS
        prefixes = []
        for i in rng.integers(len(self.sampled), size=GENERATION_BATCH):
            s = self.sampled[i]
            cut = int(rng.integers(s.first + 1, len(s.tokens)))
            prefixes.append(s.tokens[max(0, cut - room) : cut].tolist())
        return prefixes

    def report(self) -> dict:
        return {
            "chunks": dict(self.made),
            "sequences": len(self.sequences),
            "tokens": sum(len(s.top_ids) for s in self.sequences),
            "seconds": round(self.seconds, 1),
        }


@torch.no_grad()
def target_references(target, prompts: list[list[int]], vocab: int, new_tokens: int = NEW_TOKENS) -> list[Sequence]:
    """The target's greedy continuations of prompts, computed once: the target never changes. They run
    past eos to new_tokens: the runtime's last round can draft, and count accepted, tokens past an eos."""
    references = []
    batches = range(0, len(prompts), GENERATION_BATCH)
    with bar(len(batches) * new_tokens, f"the target continues {len(prompts)} held-out prompts", "token") as progress:
        for first in batches:
            chunk = prompts[first : first + GENERATION_BATCH]
            references += continue_prompts(target, chunk, new_tokens, vocab, sample=False, keep_teacher=False,
                                           stop_at_eos=False, bar=progress)
    return references


@torch.no_grad()
def acceptance(draft, references: list[Sequence], gamma: int, vocab: int, stops: set[int], batch_size: int = 16,
               new_tokens: int = NEW_TOKENS, desc: str = "measuring α") -> tuple[int, int]:
    """(accepted, drafted) when greedy speculative decoding at gamma produces the references, counted as
    the runtime counts them (bench's and generate's α) for requests of new_tokens that end at any of stops:
    the target's eos ids, which a compiled bundle stops at (a draft's may be fewer: its config.json's alone
    for a new draft, a base model's for an instruct target).

    Exact for greedy decoding: an accepted draft prefix equals the target's own tokens, so the draft's
    choices are read off one teacher-forced pass over the target's continuation.
    """
    draft.eval()
    pad = pad_id(draft)
    accepted = drafted = 0
    with bar(len(references), desc, "prompt") as progress:
        for first in range(0, len(references), batch_size):
            chunk = references[first : first + batch_size]
            # only where the draft's choices are read: over the prompts too, 16 held-out prompts of 256 tokens and a
            # 152k vocabulary took 3.0 GiB here (0.7 GiB since)
            guesses = continuation_logits(draft, chunk, pad)[:, :vocab].argmax(-1).split([len(s.top_ids) for s in chunk])
            for row, s in enumerate(chunk):
                continuation = torch.from_numpy(s.tokens[s.first + 1 :].astype(np.int64))
                agreement = guesses[row] == continuation
                end = len(until_eos(continuation.tolist(), stops))  # decoding stops after the round that emits eos
                round_accepted, round_drafted = rounds(agreement.tolist(), gamma, new_tokens, end)
                accepted += round_accepted
                drafted += round_drafted
            progress.update(len(chunk))
    return accepted, drafted


def replaced_acceptance(output_dir: Path, tokenizer, references: list[Sequence], gamma: int, vocab: int,
                        stops: set[int]) -> tuple[int, int] | None:
    """acceptance() of the draft that --overwrite would replace at output_dir, on the same references; None where
    output_dir holds no checkpoint that loads as a draft of the target's tokenizer (nothing to compare with)."""
    if not is_checkpoint(output_dir):
        return None
    try:
        standing, standing_tokenizer = load_model(output_dir, "output")
    except (CheckpointError, TrainingError):
        return None
    if standing_tokenizer.get_vocab() != tokenizer.get_vocab():
        return None
    return acceptance(standing, references, gamma, vocab, stops, desc=f"measuring α of the draft at {output_dir}")


def alpha(counts: tuple[int, int]) -> float:
    accepted, drafted = counts
    return accepted / drafted if drafted else 0.0


def choose_prompts(target, tokenizer, prompt_file: PromptFile | None, data: list[str] | None, heldout: int,
                   seed: int) -> Prompts:
    # A prompt and its NEW_TOKENS continuation must fit the target's positions: GPT-2's table ends there
    # (an IndexError past it), and other models write what they were never trained to.
    context = target.config.max_position_embeddings
    if context < SPAN_TOKENS + NEW_TOKENS + 1:
        raise TrainingError(f"the target's max_position_embeddings {context} leaves no room for a prompt and the "
                            f"{NEW_TOKENS} tokens distill continues it by; it needs {SPAN_TOKENS + NEW_TOKENS + 1} or more")
    if prompt_file is not None:
        return from_file(tokenizer, prompt_file, heldout, max_tokens=min(MAX_PROMPT_TOKENS, context - NEW_TOKENS))
    if data is not None:
        return from_text(tokenizer, data, heldout, seed)
    return from_target(target, tokenizer, heldout, seed)


def distill(
    target_dir: Path,
    output_dir: Path,
    *,
    draft_config: dict | None = None,
    init: Path | None = None,
    minutes: float = DISTILL_MINUTES,
    prompts_file: Path | None = None,
    data: list[str] | Path | None = None,
    gamma: int = DISTILL_GAMMA,
    force: bool = False,
    overwrite: bool = False,
    objective: str = DISTILL_OBJECTIVE,
    kinds: tuple[str, ...] = ("sampled", "greedy"),
    generation_share: float = GENERATION_SHARE,
    heldout_prompts: int = 32,
    batch_size: int = DISTILL_BATCH_SIZE,
    lr: float = 1e-3,
    seed: int = DISTILL_SEED,
) -> dict:
    """Distill a draft from the target at target_dir; write it (with the target's tokenizer) to output_dir
    only if its α at gamma on held-out prompts rose, and beats the draft it would replace there, or with force.

    The draft starts from init (a checkpoint of the target's tokenizer, saved with it or without tokenizer files) or
    from scratch with shrunk_config(target config, draft_config). Prompts come from prompts_file (JSONL), else from
    spans of the data texts (or of the text files at a data path), else from the target's own samples. minutes
    bounds generation and training together; measuring α before and after comes on top. output_dir may
    replace only an empty folder or, with overwrite, a checkpoint, and none of the inputs (checked first,
    so a refusal costs no training). Returns the report.
    """
    settings = dict(draft_config=draft_config, init=init, minutes=minutes, prompts_file=prompts_file, data=data,
                    gamma=gamma, force=force, objective=objective, kinds=kinds, generation_share=generation_share,
                    heldout_prompts=heldout_prompts, batch_size=batch_size, lr=lr, seed=seed)
    for key, rule in DISTILL_RULES.items():
        if problem := rule(settings[key]):
            raise TrainingError(f"distill setting {key} {problem}")
    if problem := distill_conflict(settings):
        raise TrainingError(problem)
    inputs = {"target": target_dir, "init": init, "prompts": prompts_file, "data": data if isinstance(data, Path) else None}
    check_checkpoint_output(output_dir, overwrite, inputs)
    try:
        # The output's lock is held while the draft trains: a second distill to it is refused at once, not after
        # its minutes (and SIGTERM unwinds as Ctrl-C does). A draft not written leaves the output as it was.
        with guarded_folder(output_dir, overwrite=overwrite, inputs=inputs, **CHECKPOINT) as staging:
            report, draft, tokenizer = _distill(target_dir, output_dir, **settings)
            if not report["written"]:
                raise _Unwritten
            with note(f"writing the draft to {output_dir}"):
                write_checkpoint(draft, tokenizer, staging)
    except _Unwritten:
        pass
    return report


class _Unwritten(Exception):
    """The draft is not written: guarded_folder then discards its staging folder and leaves the output."""


def _distill(target_dir: Path, output_dir: Path, *, draft_config, init, minutes, prompts_file, data, gamma, force,
             objective, kinds, generation_share, heldout_prompts, batch_size, lr, seed) -> tuple[dict, object, object]:
    """distill's work, its output locked: (report, draft, tokenizer)."""
    if isinstance(data, Path):
        data = read_texts(data, seed)
    prompt_file = None if prompts_file is None else read_prompt_file(prompts_file)
    # An --init that is no checkpoint, and a --draft-config key the target lacks or a value of the wrong type, are
    # refused before the target's weights load (minutes on a large target).
    if init is not None:
        init_config = checked_config(Path(init), "draft")  # its one read too: a config.json that is no config refused here
    target_config = checked_config(Path(target_dir), "target")  # the one read of its config.json: passed on from here
    config = shrunk_config(target_config, draft_config) if init is None else None
    torch.manual_seed(seed)
    target, tokenizer = load_model(target_dir, "target", target_config)
    stop_at_tokenizer_eos(target, tokenizer)
    # its draft could not be compiled with it: refused before the minutes
    check_architecture((target.config.architectures or ["<none>"])[0], f"target checkpoint {target_dir}")
    # as compile refuses it (load.validate_pair); the draft's check below blamed the draft, and a draft given the rows
    # it asked for trained for minutes beside a target compile then refused
    check_embedding_rows(target_dir, target.config.vocab_size, tokenizer.get_vocab(), "target")
    draft = (new_draft(target, tokenizer, config, draft_config, seed) if init is None else
             init_draft(target, tokenizer, init, init_config))
    check_room(draft, output_dir)
    vocab = len(tokenizer)
    prompts = choose_prompts(target, tokenizer, prompt_file, data, heldout_prompts, seed)

    started = time.monotonic()
    references = target_references(target, prompts.heldout, vocab)
    stops = eos_ids(target)
    before = acceptance(draft, references, gamma, vocab, stops, desc="measuring α before training")
    # A draft of the output that this run would replace (--overwrite) is the one to beat as well: the rise is
    # over the draft's own start, and a fresh draft rising from 0.00 to 0.01 replaced one of 1.00.
    replaced = replaced_acceptance(output_dir, tokenizer, references, gamma, vocab, stops)
    evaluation_seconds = time.monotonic() - started

    made = DistillData(target, draft, prompts.train, vocab, kinds=kinds, share=generation_share, batch_size=batch_size,
                       seconds=minutes * 60)
    loss = distill_loss(objective, vocab, pad=pad_id(target))
    run = train_model(draft, made.next_batch, minutes=minutes, lr=lr, desc="distill", seed=seed, loss_fn=loss,
                      parts=parts(vocab))

    started = time.monotonic()
    after = acceptance(draft, references, gamma, vocab, stops, desc="measuring α after training")
    evaluation_seconds += time.monotonic() - started

    cost_ratio = parameter_count(draft) / parameter_count(target)
    report = {
        "prompts": prompts.source,
        "train_prompts": len(prompts.train),
        "heldout_prompts": len(prompts.heldout),
        "heldout_drafted_tokens": after[1],
        "gamma": gamma,
        "alpha_before": round(alpha(before), 4),
        "alpha_after": round(alpha(after), 4),
        "alpha_gain": round(alpha(after) - alpha(before), 4),
        "alpha_replaced": None if replaced is None else round(alpha(replaced), 4),
        "target_parameters": parameter_count(target),
        "draft_parameters": parameter_count(draft),
        "cost_ratio": round(cost_ratio, 4),
        "theoretical_speedup_before": round(theoretical_speedup(expected_tokens_per_call(alpha(before), gamma), gamma, cost_ratio), 3),
        "theoretical_speedup_after": round(theoretical_speedup(expected_tokens_per_call(alpha(after), gamma), gamma, cost_ratio), 3),
        "objective": objective,
        "generation": made.report(),
        "training": run,
        "evaluation_seconds": round(evaluation_seconds, 1),
        "written": alpha(after) > max(alpha(before), alpha(replaced or (0, 0))) or force,
        "output": str(output_dir),
    }
    return report, draft, tokenizer
