"""The TensorRT-LLM export, proven without TensorRT-LLM: every written checkpoint, read back by a numpy
forward pass that computes as TensorRT-LLM's layers do (all ranks recombined), gives transformers' logits."""

import copy
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
import transformers as tf
import yaml
from safetensors.numpy import load_file, save_file

from conftest import PROMPTS, make_checkpoint
from specbuild import cli
from specbuild.compile import compile_bundle, gamma
from specbuild.compile.load import ARCHITECTURES, load_checkpoint
from specbuild.compile.tensorrt_llm import families, reference
from specbuild.compile.tensorrt_llm.checkpoint import QUANTIZED_WEIGHTS, RankFile, write_checkpoint
from specbuild.compile.tensorrt_llm.gemma import gemma3_pattern
from specbuild.compile.tensorrt_llm.layout import Layout
from specbuild.compile.tensorrt_llm.plans import build_script, llm_api_yaml, run_script
from specbuild.compile.tensorrt_llm.support import check_exportable, check_pair, context_limit, exports, unexported
from specbuild.compile.tensorrt_llm.windows import attention_windows, window_limit
from specbuild.errors import ExternalToolError, SettingsError, UnsupportedModelError
from specbuild.recipe import CompileSettings, resolve_settings
from specbuild_runtime import SpeculativeDecoder
from specbuild_runtime.errors import BundleError, SpecbuildError
from specbuild_runtime.manifest import load_manifest

TARGET_VOCAB = 330  # the tokenizer's 320 tokens and padding rows; 330 is no multiple of 4 (lm_head pads for tp)
FAMILIES = {  # name -> (conftest architecture, config overrides); TINY has 4 heads and 2 KV heads
    "llama": ("llama", {}),
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {}),  # q/k/v biases
    "llama-biases": ("llama", {"attention_bias": True, "mlp_bias": True}),  # row-parallel biases too
    "qwen3": ("qwen3", {}),
    # conftest's llama3 (tied embeddings) with its rope given afresh: transformers writes rope_theta into the
    # rope_scaling dict it is passed, so a shared dict would carry the first model's base to the next
    "llama3-rope": ("llama3", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
                                                "rope_theta": 500000.0}}),
    "linear-rope": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    "granite": ("granite", {}),  # its multipliers, as TensorRT-LLM's LLaMA model reads them
    "gpt2": ("gpt2", {}),
    "gemma3": ("gemma3", {}),  # 3 layers: sliding, full, sliding; windows of 8, past which PROMPTS[5] runs
    # mixtures, every layer sparse (TensorRT-LLM's QWen model has no dense layers among sparse ones): conftest's
    # renormalized top 2 of 8 experts, and without the renormalization; Mixtral's top 2 of 4 without its window
    "qwen3moe": ("qwen3moe", {"mlp_only_layers": []}),
    "qwen3moe-unnormalized": ("qwen3moe", {"mlp_only_layers": [], "norm_topk_prob": False}),
    "mixtral": ("mixtral", {"sliding_window": None}),
    # Phi-3 (fused qkv_proj and gate_up_proj): conftest's LongRoPE, within its original 256 positions, and partial
    # rotary, on 4 heads of 32 dims and 2 KV heads, without its window; Phi-3-mini-4k's plain rope on whole heads of
    # as many KV heads, tied as Phi-4-mini's
    "phi3": ("phi3", {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "sliding_window": None,
                      "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
                                       "long_factor": [2.0 + 0.5 * i for i in range(8)],
                                       "original_max_position_embeddings": 256}}),
    "phi3-rope": ("phi3", {"num_attention_heads": 4, "num_key_value_heads": 4, "sliding_window": None,
                           "rope_scaling": None, "partial_rotary_factor": 1.0, "tie_word_embeddings": True}),
}
TOLERANCE = 1e-4
CONTEXT = 128  # the context run.sh's windows are given for: past PROMPTS[5]


def build(folder: Path, family: str, tokenizer, seed: int, **extra) -> Path:
    """A tiny checkpoint whose norms and biases are random too (zeros and ones would hide their layout)."""
    architecture, overrides = FAMILIES[family]
    make_checkpoint(folder, architecture, tokenizer, seed, **copy.deepcopy({**overrides, **extra}))
    model = tf.AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def pairs(tmp_path_factory, tokenizer):
    """pairs(family) -> (target, draft) folders: the target has padding rows, the draft fewer layers and
    exactly the tokenizer's rows (padded to the target's by the export)."""
    made = {}

    def get(family):
        if family not in made:
            root = tmp_path_factory.mktemp(family)
            smaller = {} if family == "gpt2" else {"num_hidden_layers": 1}  # (conftest fixes GPT-2's depth)
            made[family] = (build(root / "target", family, tokenizer, 0, vocab_size=TARGET_VOCAB),
                            build(root / "draft", family, tokenizer, 1, **smaller))
        return made[family]

    return get


def transformers_logits(folder: Path, ids: list[int], rounded_to: torch.dtype | None = None) -> np.ndarray:
    """rounded_to: the type the weights are rounded to first, as the export rounds them (a Gemma norm's 1 + w, which
    gemma3_tensors writes); the model still computes in float32."""
    model = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    gemma = model.config.model_type.startswith("gemma")
    with torch.no_grad():
        for name, p in model.named_parameters() if rounded_to else ():
            p.copy_((1 + p).to(rounded_to).float() - 1 if gemma and name.endswith("norm.weight") else p.to(rounded_to))
        return model(torch.tensor([ids])).logits[0].double().numpy()


def export(folder: Path, out: Path, tp: int, precision: str = "fp32", quantization: str = "none") -> Path:
    write_checkpoint(load_checkpoint(folder, "test"), out, out.parent / "scratch", tp, TARGET_VOCAB,
                     precision, quantization)
    return out


def plan_windows(source: Path) -> list[int] | None:
    """The per-layer windows run.sh gives a pair of two such models (None: no window within CONTEXT)."""
    ckpt = load_checkpoint(source, "test")
    return attention_windows(ckpt, ckpt, CONTEXT)


def deviation(checkpoint: Path, source: Path, tokenizer, whole_context: bool = False) -> float:
    ids = tokenizer(PROMPTS[5])["input_ids"]
    assert len(ids) <= CONTEXT
    windows = None if whole_context else plan_windows(source)
    ours, theirs = reference.logits(checkpoint, ids, windows), transformers_logits(source, ids)
    assert ours.shape == (len(ids), TARGET_VOCAB)
    # a draft's rows past its table: the mean of its rows, so the mean of its logits
    assert np.abs(ours[:, theirs.shape[1]:] - ours[:, :theirs.shape[1]].mean(-1, keepdims=True)).max(initial=0) <= TOLERANCE
    return float(np.abs(ours[:, :theirs.shape[1]] - theirs).max())


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("family", FAMILIES)
def test_reference_forward_of_the_exported_pair_matches_transformers(pairs, tokenizer, tmp_path, family, tp):
    for role, folder in zip(("target", "draft"), pairs(family)):
        checkpoint = export(folder, tmp_path / role, tp)
        assert deviation(checkpoint, folder, tokenizer) <= TOLERANCE, (role, family, tp)
        assert sorted(p.name for p in checkpoint.iterdir()) == ["config.json", *(f"rank{r}.safetensors" for r in range(tp))]


@pytest.mark.parametrize("family", FAMILIES)
def test_bias_flags_say_exactly_which_biases_are_written(pairs, tmp_path, family):
    """TensorRT-LLM builds its layers from the config's flags and drops a tensor no layer asks for with a
    warning; the reference adds every bias it finds: only agreeing flags keep the two alike."""
    checkpoint = export(pairs(family)[0], tmp_path / "t", 1)
    config = json.loads((checkpoint / "config.json").read_text())
    names = set(load_file(checkpoint / "rank0.safetensors"))
    written = {part for part in ("attention.qkv", "attention.dense", "mlp.fc", "mlp.gate", "mlp.proj")
               if f"transformer.layers.0.{part}.bias" in names}
    if "bias" in config:  # GPT: every linear layer
        expected = {"attention.qkv", "attention.dense", "mlp.fc", "mlp.proj"} if config["bias"] else set()
    else:  # LLaMA: attn_bias covers qkv and dense; QWen: qkv only (its Attention has dense_bias=False)
        attention = ({"attention.qkv"} if "qwen_type" in config else {"attention.qkv", "attention.dense"})
        expected = (attention if config.get("attn_bias") else set()) | (  # Phi-3: neither flag, no bias
            {"mlp.fc", "mlp.gate", "mlp.proj"} if config.get("mlp_bias") else set())
    assert written == expected, (config.get("attn_bias"), config.get("mlp_bias"), sorted(written))


def test_rope_scaling_is_exported_and_matters(pairs, tokenizer, tmp_path):
    target = pairs("llama3-rope")[0]
    checkpoint = export(target, tmp_path / "t", 2)
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["rotary_base"] == 500000.0 and config["rotary_scaling"]["type"] == "llama3"
    config["rotary_scaling"] = None  # negative control: the same weights without the scaling diverge
    (checkpoint / "config.json").write_text(json.dumps(config))
    assert deviation(checkpoint, target, tokenizer) > 100 * TOLERANCE


@pytest.mark.parametrize("key", ["embedding_multiplier", "residual_multiplier", "attention_multiplier",
                                 "output_multiplier_scale"])
def test_each_granite_multiplier_is_exported_and_matters(pairs, tokenizer, tmp_path, key):
    """Negative controls: the same weights without one of the multipliers (LLaMAConfig's default 1.0) diverge."""
    target = pairs("granite")[0]
    checkpoint = export(target, tmp_path / "t", 2)
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["architecture"] == "GraniteForCausalLM" and config[key] != 1.0
    del config[key]
    (checkpoint / "config.json").write_text(json.dumps(config))
    assert deviation(checkpoint, target, tokenizer) > 100 * TOLERANCE


def test_swapping_fc_and_gate_fails_the_reference(pairs, tokenizer, tmp_path):
    """mlp.fc must hold gate_proj and mlp.gate up_proj (GatedMLP: proj(act(fc(x)) * gate(x)))."""
    target = pairs("llama")[0]
    checkpoint = export(target, tmp_path / "t", 2)
    for rank in checkpoint.glob("rank*.safetensors"):
        tensors = load_file(rank)
        for i in range(2):
            fc, gate = f"transformer.layers.{i}.mlp.fc.weight", f"transformer.layers.{i}.mlp.gate.weight"
            tensors[fc], tensors[gate] = tensors[gate], tensors[fc]
        save_file(tensors, rank)
    assert deviation(checkpoint, target, tokenizer) > 100 * TOLERANCE


def test_a_draft_whose_logits_are_all_negative_never_drafts_a_row_it_lacks(tokenizer, tmp_path):
    """TensorRT-LLM samples the draft over vocab_size (the target's) and masks only the tp padding past it.
    Rows the draft lacks scored 0 when zero-filled, above every real token of a draft whose logits are all
    negative (as GPT-2's are): each greedy draft was a padding id. Filled with the mean row they score the
    mean logit, so the engine's greedy token is the draft's own."""
    folder = make_checkpoint(tmp_path / "draft", "gpt2", tokenizer, 1, tie_word_embeddings=False)
    model = tf.AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():  # h[0] = -0.1 after ln_f and lm_head[:, 0] += 1000: every logit ~100 lower
        model.transformer.ln_f.weight[0], model.transformer.ln_f.bias[0] = 0.0, -0.1
        model.lm_head.weight[:, 0] += 1000.0
    model.save_pretrained(folder)
    ids = tokenizer(PROMPTS[5])["input_ids"]
    theirs = transformers_logits(folder, ids)
    assert theirs.max() < 0 and theirs.shape[1] < TARGET_VOCAB
    for tp in (1, 2):
        ours = reference.logits(export(folder, tmp_path / f"tp{tp}", tp), ids)
        assert (ours.argmax(-1) == theirs.argmax(-1)).all(), tp


def test_a_drafts_own_padding_rows_score_the_mean_logit_as_the_rows_it_lacks_do(tokenizer, tmp_path):
    """A draft padded alike to the target (distill's drafts are): its padding rows past the tokenizer's ids
    are rows no training reaches, here zero, beside logits all negative. TensorRT-LLM samples them as it
    samples the rows the draft lacks; each greedy draft was a padding id. Given the mean row, the engine's
    greedy token is the draft's own best real token."""
    vocab = len(tokenizer)
    folder = make_checkpoint(tmp_path / "draft", "gpt2", tokenizer, 1, tie_word_embeddings=False, vocab_size=TARGET_VOCAB)
    model = tf.AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():  # h[0] = -0.1 after ln_f and lm_head[:, 0] += 1000: every logit ~100 lower
        model.transformer.ln_f.weight[0], model.transformer.ln_f.bias[0] = 0.0, -0.1
        model.lm_head.weight[:, 0] += 1000.0
        model.lm_head.weight[vocab:] = 0.0
    model.save_pretrained(folder)
    ids = tokenizer(PROMPTS[5])["input_ids"]
    theirs = transformers_logits(folder, ids)
    assert theirs[:, :vocab].max() < 0 and (theirs.argmax(-1) >= vocab).all()
    for tp in (1, 2):
        out = tmp_path / f"tp{tp}"
        write_checkpoint(load_checkpoint(folder, "test"), out, out.parent / "scratch", tp, TARGET_VOCAB,
                         "fp32", "none", tokens=vocab)
        ours = reference.logits(out, ids)
        assert (ours.argmax(-1) == theirs[:, :vocab].argmax(-1)).all(), tp


def test_splitting_the_fused_qkv_in_plain_chunks_fails_the_reference(pairs, tokenizer, tmp_path):
    """Rank r's qkv is [q_r; k_r; v_r], not the r-th chunk of [q; k; v] (same shape, other rows)."""
    target = pairs("llama")[0]
    checkpoint = export(target, tmp_path / "t", 2)
    source = load_file(target / "model.safetensors")
    ranks = [load_file(checkpoint / f"rank{r}.safetensors") for r in range(2)]
    for i in range(2):
        fused = np.concatenate([source[f"model.layers.{i}.self_attn.{p}_proj.weight"] for p in "qkv"])
        for r, chunk in enumerate(np.split(fused, 2)):
            assert chunk.shape == ranks[r][f"transformer.layers.{i}.attention.qkv.weight"].shape
            ranks[r][f"transformer.layers.{i}.attention.qkv.weight"] = chunk
    for r, tensors in enumerate(ranks):
        save_file(tensors, checkpoint / f"rank{r}.safetensors")
    assert deviation(checkpoint, target, tokenizer) > 100 * TOLERANCE


def test_fewer_kv_heads_than_ranks_are_repeated_in_head_order(pairs, tmp_path):
    checkpoint = export(pairs("llama")[0], tmp_path / "t", 4)
    manifest_ranks = Layout(4, 4, 2, 16, 128, TARGET_VOCAB).ranks()
    assert [r["kv_heads"] for r in manifest_ranks] == [[0], [0], [1], [1]]
    qkv = [load_file(checkpoint / f"rank{r}.safetensors")["transformer.layers.0.attention.qkv.weight"] for r in range(4)]
    assert all(q.shape == (16 + 2 * 16, 64) for q in qkv)  # one query, one key and one value head per rank
    assert np.array_equal(qkv[0][16:], qkv[1][16:]) and not np.array_equal(qkv[1][16:], qkv[2][16:])


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_a_qk_normalised_model_with_as_many_kv_as_query_heads_per_rank_is_refused(tokenizer, tmp_path, family):
    """TensorRT-LLM's q/k-normalised attention reads such a rank's qkv as per-head (q, k, v) triples; its
    Qwen and Gemma converters write [q; k; v]. The reference, reading as TensorRT-LLM does, shows the mismatch."""
    folder = build(tmp_path / "mha", family, tokenizer, 0, num_key_value_heads=4, vocab_size=TARGET_VOCAB)
    ckpt = load_checkpoint(folder, "target")
    for tp in (1, 2):
        with pytest.raises(UnsupportedModelError, match=f"--tp {tp}.*choose a --tp"):
            check_exportable(ckpt, "target", tp, 64)
    check_exportable(ckpt, "target", 4, 64)  # one head per rank: both readings agree
    assert deviation(export(folder, tmp_path / "tp4", 4), folder, tokenizer) <= TOLERANCE
    assert deviation(export(folder, tmp_path / "tp1", 1), folder, tokenizer) > 100 * TOLERANCE


def test_a_gemma3_checkpoint_is_laid_out_as_tensorrt_llms_gemma_converter_writes_it(pairs, tmp_path):
    target = pairs("gemma3")[0]
    checkpoint = export(target, tmp_path / "t", 2)
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["use_parallel_embedding"] and config["_sliding_window_pattern"] == 2  # layers 0 and 2 slide
    assert {"query_pre_attn_scalar", "final_logit_softcapping", "rope_local_base_freq", "sliding_window"} <= set(config)
    source, ranks = load_file(target / "model.safetensors"), [load_file(checkpoint / f"rank{r}.safetensors")
                                                              for r in range(2)]
    assert ranks[1]["transformer.vocab_embedding.weight"].shape == (TARGET_VOCAB // 2, 64)  # split by rows
    for r in range(2):  # Gemma's RMSNorm scales by 1 + weight, TensorRT-LLM's by its weight
        assert np.array_equal(ranks[r]["transformer.layers.1.attention.k_layernorm.weight"],
                              source["model.layers.1.self_attn.k_norm.weight"] + 1)


@pytest.mark.parametrize("change", ["rope_local_base_freq", "_sliding_window_pattern", "norms"])
def test_each_gemma3_rewrite_is_exported_and_matters(pairs, tokenizer, tmp_path, change):
    """Negative controls: the local layers' rotary base, which layers are local, and the norms' added one."""
    target = pairs("gemma3")[0]
    checkpoint = export(target, tmp_path / "t", 2)
    config = json.loads((checkpoint / "config.json").read_text())
    if change == "norms":
        for rank in checkpoint.glob("rank*.safetensors"):
            tensors = load_file(rank)
            save_file({name: value - 1 if "layernorm" in name or "ln_f" in name else value
                       for name, value in tensors.items()}, rank)
    else:
        config[change] = config["rotary_base"] if change == "rope_local_base_freq" else 1  # 1: every layer global
        (checkpoint / "config.json").write_text(json.dumps(config))
    assert deviation(checkpoint, target, tokenizer) > 100 * TOLERANCE


def test_a_gemma3_query_scale_and_final_soft_cap_are_exported_and_matter(tokenizer, tmp_path):
    """The tiny gemma3 has query_pre_attn_scalar == head_dim and no soft-cap (as gemma-3-1b), where a wrong query
    scale or a dropped cap would compute the same: here both differ, and dropping either from config.json
    diverges."""
    folder = build(tmp_path / "g", "gemma3", tokenizer, 0, vocab_size=TARGET_VOCAB, query_pre_attn_scalar=64,
                   final_logit_softcapping=2.0)
    checkpoint = export(folder, tmp_path / "t", 2)
    assert deviation(checkpoint, folder, tokenizer) <= TOLERANCE
    config = json.loads((checkpoint / "config.json").read_text())
    for change in ({"query_pre_attn_scalar": 16}, {"final_logit_softcapping": None}):
        (checkpoint / "config.json").write_text(json.dumps({**config, **change}))
        assert deviation(checkpoint, folder, tokenizer) > 100 * TOLERANCE, change


def test_the_released_gemma_3_1b_shape_exports_and_with_gemma_3_4bs_rope_scaling_gets_the_serving_plans_only():
    """benchmarks/configs/gemma-3-1b.json (no weights needed: these read the config alone). gemma-3-4b's linear
    rope (factor 8, full-attention layers alone) and window of 1024 on the same shape: no checkpoints, so a 1b
    drafting it never reaches the one-list refusal of windows."""
    from types import SimpleNamespace

    from specbuild.compile.load import model_spec

    released = json.loads((Path(__file__).parents[1] / "benchmarks/configs/gemma-3-1b.json").read_text())

    def shape(**changes):
        config = tf.AutoConfig.for_model(**{**copy.deepcopy(released), **changes})
        return SimpleNamespace(spec=model_spec(config, config.architectures[0], Path("g"), "target"), config=config,
                               path=Path("g"))

    one, four = shape(), shape(sliding_window=1024, rope_scaling={"rope_type": "linear", "factor": 8.0})
    assert unexported(one) == "" and gemma3_pattern(one.spec) == 6
    for tp in (1, 2, 4):  # 4 query heads, 1 key/value head
        check_pair(one, one, 4096, tp)
    assert attention_windows(one, one, 4096) == [512] * 5 + [4096]
    assert "sliding-window layers as well" in unexported(four)
    assert not exports(four, one)
    check_pair(four, one, 4096, 1)


def test_gemma3_past_its_window_is_computed_only_with_the_windows_run_sh_gives(pairs, tokenizer, tmp_path):
    """TensorRT-LLM takes each layer's window at run time: the checkpoint read with the whole context at every
    layer diverges past the window of 8."""
    target = pairs("gemma3")[0]
    checkpoint = export(target, tmp_path / "t", 1)
    assert plan_windows(target) == [8, CONTEXT]
    assert deviation(checkpoint, target, tokenizer) <= TOLERANCE
    assert deviation(checkpoint, target, tokenizer, whole_context=True) > 100 * TOLERANCE


def test_run_plan_gives_each_gemma3_layer_its_window_past_it(pairs, tmp_path):
    target, draft = pairs("gemma3")  # the draft's one layer slides, as the target's first
    manifest = compile_bundle(CompileSettings(target=target, draft=draft, output=tmp_path / "b", max_seq_len=64,
                                              gamma=4, backend="tensorrt-llm", tp=2), show_progress=False)
    assert {"tensorrt-llm/target/rank1.safetensors", "tensorrt-llm/draft/rank1.safetensors"} <= set(manifest.files)
    run = (tmp_path / "b" / "tensorrt-llm" / "run.sh").read_text()
    assert "  --max_attention_window_size 8 64 \\\n" in run, run
    assert attention_windows(*(load_checkpoint(f, "x") for f in (target, draft)), 8) is None


def test_gemma3_windows_one_run_py_list_cannot_give_both_engines_are_refused(checkpoints):
    target = load_checkpoint(checkpoints("gemma3", 0), "target")
    draft = load_checkpoint(checkpoints("gemma3", 1, sliding_window=4), "draft")
    with pytest.raises(UnsupportedModelError, match="one --max_attention_window_size list; give --max-seq-len .* "
                                                    "of 4 or less"):
        check_pair(target, draft, 64, 1)
    check_pair(target, draft, 4, 1)


def test_the_default_context_passes_the_gemma3_windows_run_sh_carries_and_stops_at_those_it_cannot(checkpoints,
                                                                                                  tmp_path):
    target, draft = checkpoints("gemma3", 0), checkpoints("gemma3", 1)
    apart = checkpoints("gemma3", 1, sliding_window=4)
    assert window_limit(load_checkpoint(target, "t"), load_checkpoint(apart, "d")) == 4
    assert window_limit(load_checkpoint(target, "t"), load_checkpoint(draft, "d")) is None
    settings = CompileSettings(target=target, draft=draft, output=tmp_path / "b", backend="tensorrt-llm")
    assert compile_bundle(settings, show_progress=False).max_seq_len == 512  # max_position_embeddings, past 8


@pytest.mark.parametrize("windowed", ["mistral-window", "mixtral"])  # conftest's Mixtral keeps Mistral's window
def test_splits_tensorrt_llm_cannot_make_and_windows_shorter_than_the_context_are_refused(pairs, checkpoints,
                                                                                          windowed):
    with pytest.raises(UnsupportedModelError, match="--tp 3: .* 4 attention heads"):
        check_exportable(load_checkpoint(pairs("llama")[0], "target"), "target", 3, 64)
    window = load_checkpoint(checkpoints(windowed), "target")  # TensorRT-LLM sets windows at run time
    check_exportable(window, "target", 1, 8)
    with pytest.raises(UnsupportedModelError, match="max_seq_len 64 exceeds the target's sliding window \\(8\\)"):
        check_exportable(window, "target", 1, 64)


@pytest.mark.parametrize("family", ["qwen2", "gemma3", "phi3", "phi3-rope"])
def test_bf16_export_writes_bf16_weights_that_compute_the_model_with_its_weights_rounded(pairs, tokenizer, tmp_path,
                                                                                        family):
    """Against transformers with its weights rounded to bf16 as the export rounds them: what differs from the
    float32 model (phi3's 6.6% of the largest logit) is that rounding alone, and a layout slip still shows."""
    target = pairs(family)[0]
    checkpoint = export(target, tmp_path / "t", 2, precision="bf16")
    assert json.loads((checkpoint / "config.json").read_text())["dtype"] == "bfloat16"
    tensors = load_file(checkpoint / "rank1.safetensors")
    assert {t.dtype for t in tensors.values()} == {np.dtype(ml_dtypes.bfloat16)}
    ids = tokenizer(PROMPTS[5])["input_ids"]
    ours = reference.logits(checkpoint, ids, plan_windows(target))[:, :TARGET_VOCAB]
    assert np.abs(ours - transformers_logits(target, ids, torch.bfloat16)).max() <= TOLERANCE


@pytest.mark.parametrize("family", ["llama", "gemma3", "phi3"])
def test_weight_only_quantization_is_left_to_trtllm_build_on_float_weights(pairs, tmp_path, family):
    checkpoint = export(pairs(family)[0], tmp_path / "t", 1, precision="fp16", quantization="int4")
    assert json.loads((checkpoint / "config.json").read_text())["quantization"]["quant_algo"] == "W4A16"
    assert {t.dtype for t in load_file(checkpoint / "rank0.safetensors").values()} == {np.dtype(np.float16)}


@pytest.mark.parametrize("family", ["qwen3moe", "mixtral"])
def test_a_mixture_is_written_as_the_converters_write_it_with_a_float32_router_left_unquantized(pairs, tokenizer,
                                                                                                tmp_path, family):
    """mlp.fc [experts, 2 x inter / tp, hidden], mlp.proj [experts, hidden, inter / tp] in the export's type, which
    trtllm-build quantizes per expert (QUANTIZED_WEIGHTS); the router whole and float32, which it leaves alone."""
    target = pairs(family)[0]
    checkpoint = export(target, tmp_path / "t", 2, precision="fp16", quantization="int8")
    config = json.loads((checkpoint / "config.json").read_text())
    spec = load_checkpoint(target, "t").spec
    assert config["quantization"]["quant_algo"] == "W8A16" and config["hidden_act"] == "swiglu"
    assert config["mapping"]["moe_tp_size"] == 2 and config["mapping"]["moe_ep_size"] == 1
    experts, inter, hidden = spec.experts, spec.expert_intermediate_size, spec.shape.hidden_size
    # each expert's width, whichever of the two a release's QWenDecoderLayer reads (conftest's Qwen3-MoE has a wider
    # dense intermediate_size)
    assert config["intermediate_size"] == config.get("moe_intermediate_size", inter) == inter
    for r in range(2):
        tensors = load_file(checkpoint / f"rank{r}.safetensors")
        layer = "transformer.layers.0.mlp."
        assert tensors[layer + "router.weight"].dtype == np.float32 and tensors[layer + "router.weight"].shape == (
            experts, hidden)
        assert tensors[layer + "fc.weight"].shape == (experts, inter, hidden)  # half of 2 x inter
        assert tensors[layer + "proj.weight"].shape == (experts, hidden, inter // 2)
        assert {t.dtype for n, t in tensors.items() if not n.endswith("router.weight")} == {np.dtype(np.float16)}
        # weight_only_quantize_dict quantizes a weight whose name contains one of these
        assert not any(part in layer + "router.weight" for part in QUANTIZED_WEIGHTS)
    # fp16 rounding moves a token's top-k choice now and then, so transformers is given the same rounding: every
    # weight but the float32 router
    model = tf.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
                p.copy_(p.half().float())
        ids = tokenizer(PROMPTS[5])["input_ids"]
        theirs = model(torch.tensor([ids])).logits[0].double().numpy()
    assert np.abs(reference.logits(checkpoint, ids)[:, :TARGET_VOCAB] - theirs).max() <= TOLERANCE


@pytest.mark.parametrize("family,mode", [("qwen3moe", 1), ("qwen3moe-unnormalized", 0), ("mixtral", 1)])
def test_a_mixtures_routing_and_expert_halves_are_exported_and_matter(pairs, tokenizer, tmp_path, family, mode):
    """Negative controls: the other normalization_mode, or fc's halves swapped (gate rows first), diverge."""
    target = pairs(family)[0]
    checkpoint = export(target, tmp_path / "t", 1)
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["moe"]["normalization_mode"] == mode
    config["moe"]["normalization_mode"] = 1 - mode
    (checkpoint / "config.json").write_text(json.dumps(config))
    assert deviation(checkpoint, target, tokenizer) > 100 * TOLERANCE
    config["moe"]["normalization_mode"] = mode
    (checkpoint / "config.json").write_text(json.dumps(config))
    tensors = load_file(checkpoint / "rank0.safetensors")
    for name in [n for n in tensors if n.endswith("mlp.fc.weight")]:
        up, gate = np.split(tensors[name], 2, axis=1)
        tensors[name] = np.concatenate([gate, up], axis=1)
    save_file(tensors, checkpoint / "rank0.safetensors")
    assert deviation(checkpoint, target, tokenizer) > 100 * TOLERANCE


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_a_mixtures_step_bytes_count_its_experts_at_top_k_over_experts(pairs, tmp_path, quantization):
    """weight_bytes, the plans' c, is a one-token step's: the router and attention whole, each expert weight at
    top_k / experts (conftest's Qwen3-MoE: 2 of 8), the embedding table not at all."""
    target = pairs("qwen3moe")[0]
    spec = load_checkpoint(target, "t").spec
    written = write_checkpoint(load_checkpoint(target, "t"), tmp_path / "t", tmp_path / "scratch", 2,
                               TARGET_VOCAB, "fp16", quantization)
    bytes_of = {"none": 2, "int8": 1}[quantization]  # per element of a weight trtllm-build quantizes
    expected = 0.0
    for r in range(2):
        for name, t in load_file(tmp_path / "t" / f"rank{r}.safetensors").items():
            if name.endswith("embedding.weight"):
                continue
            size = t.size * (bytes_of if name.endswith(QUANTIZED_WEIGHTS) else t.itemsize)
            expected += size * (spec.experts_per_token / spec.experts if name.endswith(("mlp.fc.weight",
                                                                                        "mlp.proj.weight")) else 1)
    assert written["weight_bytes"] == int(expected)


def test_a_phi3_checkpoint_is_laid_out_as_tensorrt_llms_phi3_model_reads_it(pairs, tmp_path):
    """config.json as Phi3Config reads it (LongRoPE's factors, rotary_pct, swiglu); each rank's mlp.fc holds its rows
    of up_proj then its rows of gate_proj, the halves swiglu takes apart on that rank."""
    target = pairs("phi3")[0]
    checkpoint = export(target, tmp_path / "t", 2)
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["architecture"] == "Phi3ForCausalLM" and config["hidden_act"] == "swiglu"
    assert config["position_embedding_type"] == "long_rope" and config["rotary_pct"] == 0.5
    assert config["original_max_position_embeddings"] == 256 and len(config["longrope_scaling_long_factors"]) == 8
    source = load_file(target / "model.safetensors")
    for i in range(2):
        gate, up = np.split(source[f"model.layers.{i}.mlp.gate_up_proj.weight"], 2)
        for r in range(2):
            fc = load_file(checkpoint / f"rank{r}.safetensors")[f"transformer.layers.{i}.mlp.fc.weight"]
            assert np.array_equal(fc, np.concatenate([np.split(up, 2)[r], np.split(gate, 2)[r]])), (i, r)


@pytest.mark.parametrize("family,change", [("phi3", "fc halves swapped"), ("phi3", "fc split in plain chunks"),
                                           ("phi3", "short factors dropped"), ("phi3", "mscale dropped"),
                                           ("phi3-rope", "half of each head rotated")])
def test_each_phi3_rewrite_is_exported_and_matters(pairs, tokenizer, tmp_path, family, change):
    """Negative controls: each rank's fc as [gate; up], or the whole [up; gate] split in plain chunks as the
    converter's split_weights_tp splits it (rank 0 all up, rank 1 all gate); plain rope for LongRoPE's short table; no
    mscale (max_position_embeddings the original length); rotary_pct 0.5 for whole heads."""
    target = pairs(family)[0]
    checkpoint = export(target, tmp_path / "t", 2)
    config = json.loads((checkpoint / "config.json").read_text())
    if change.startswith("fc"):
        source = load_file(target / "model.safetensors")
        ranks = [load_file(checkpoint / f"rank{r}.safetensors") for r in range(2)]
        for i in range(2):
            gate, up = np.split(source[f"model.layers.{i}.mlp.gate_up_proj.weight"], 2)
            name = f"transformer.layers.{i}.mlp.fc.weight"
            for r, tensors in enumerate(ranks):
                tensors[name] = (np.concatenate(np.split(tensors[name], 2)[::-1]) if change == "fc halves swapped"
                                 else np.split(np.concatenate([up, gate]), 2)[r])
        for r, tensors in enumerate(ranks):
            save_file(tensors, checkpoint / f"rank{r}.safetensors")
    else:
        config.update({"short factors dropped": {"position_embedding_type": "rope_gpt_neox"},
                       "mscale dropped": {"max_position_embeddings": 256},
                       "half of each head rotated": {"rotary_pct": 0.5}}[change])
        (checkpoint / "config.json").write_text(json.dumps(config))
    assert deviation(checkpoint, target, tokenizer) > 100 * TOLERANCE


def test_a_phi3_longrope_target_is_exported_within_its_original_length_and_its_draft_past_it(tokenizer, tmp_path):
    """TensorRT-LLM rotates a step by the long table once the batch's longest sequence passes the original length,
    beside keys it cached with the short one, where transformers' Phi-3 recomputes them: a target past it is refused
    (and the default context stops there); a draft, whose rotation changes only its proposals, is not. One context
    pass past it computes as transformers does (the long table throughout, in both)."""
    folder = build(tmp_path / "long", "phi3", tokenizer, 0, vocab_size=TARGET_VOCAB,
                   original_max_position_embeddings=16,
                   rope_scaling={"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
                                 "long_factor": [2.0 + 0.5 * i for i in range(8)],
                                 "original_max_position_embeddings": 16})
    assert len(tokenizer(PROMPTS[5])["input_ids"]) > 16
    assert deviation(export(folder, tmp_path / "t", 2), folder, tokenizer) <= TOLERANCE
    ckpt = load_checkpoint(folder, "target")
    with pytest.raises(UnsupportedModelError, match=r"max_seq_len 64 exceeds the target's LongRoPE "
                                                    r"original_max_position_embeddings \(16\).* of 16 or less"):
        check_exportable(ckpt, "target", 1, 64)
    check_exportable(ckpt, "target", 1, 16)
    check_exportable(ckpt, "draft", 1, 64)
    assert context_limit(ckpt, ckpt) == 16


def test_a_phi3_pair_gets_checkpoints_every_plan_and_a_default_context_within_the_targets_original_length(pairs,
                                                                                                     tmp_path):
    """The ONNX engine switches LongRoPE tables as transformers does (max_position_embeddings 512 for --backend
    onnx); the TensorRT-LLM export stops at the original 256."""
    target, draft = pairs("phi3")
    manifest = compile_bundle(CompileSettings(target=target, draft=draft, output=tmp_path / "b", gamma=4, tp=2,
                                              backend="tensorrt-llm"), show_progress=False)
    assert manifest.max_seq_len == 256
    assert set(manifest.tensorrt_llm.plans) == {"build", "run", families.LLM_API, families.VLLM}
    assert {"tensorrt-llm/target/rank1.safetensors", "tensorrt-llm/draft/rank1.safetensors"} <= set(manifest.files)


@pytest.mark.parametrize("overrides,says", [
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                       "original_max_position_embeddings": 256, "attention_factor": 1.5}}, "attention factor 1.5"),
    ({"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "rope_scaling": None},
     "not hidden_size / num_attention_heads"),
])
def test_a_phi3_tensorrt_llms_phi3_model_would_compute_otherwise_gets_the_serving_plans_only(tokenizer, tmp_path,
                                                                                           overrides, says):
    """An attention factor other than the one its tables take from the lengths, heads not hidden_size /
    num_attention_heads wide (transformers reads head_dim; its Attention is given none)."""
    ckpt = load_checkpoint(make_checkpoint(tmp_path / "p", "phi3", tokenizer, **overrides), "target")
    assert says in unexported(ckpt) and not exports(ckpt, ckpt)


def test_a_qwen3_moe_with_dense_layers_among_sparse_ones_is_not_exported(checkpoints):
    """conftest's qwen3moe keeps its middle layer's MLP dense, which TensorRT-LLM's QWen model cannot build."""
    ckpt = load_checkpoint(checkpoints("qwen3moe", 0), "target")
    assert ckpt.spec.sparse_layers == (0, 2)
    assert unexported(ckpt) == families.DENSE_AMONG_SPARSE
    assert not exports(ckpt, ckpt)


def test_a_mixture_targets_gamma_counts_the_experts_its_verification_call_reads(pairs, tmp_path, monkeypatch):
    """S(γ) = tokens / (γc + T(γ+1)/T(1)), a call of n rows reading each layer's experts with 1 − (1 − k/E)^n of them
    (rows routed independently and uniformly), reckoned here from the written rank files' bytes alone."""
    target, draft = pairs("qwen3moe")
    monkeypatch.setattr(gamma, "measure_with_transformers", lambda *args: 0.87)  # an α at which the two differ
    manifest = compile_bundle(CompileSettings(target=target, draft=draft, output=tmp_path / "b", max_seq_len=64,
                                              gamma=8, backend="tensorrt-llm", tp=2), show_progress=False)
    k, e = 2, 8  # conftest's Qwen3-MoE

    def read(role):  # (bytes a one-token step reads besides the experts, every expert's bytes)
        sizes = [(name, t.nbytes) for r in range(2) for name, t in
                 load_file(tmp_path / "b" / "tensorrt-llm" / role / f"rank{r}.safetensors").items()
                 if not name.endswith("embedding.weight")]
        experts = sum(size for name, size in sizes if name.endswith(("mlp.fc.weight", "mlp.proj.weight")))
        return sum(size for _, size in sizes) - experts, experts
    (dense, experts), (draft_dense, draft_experts) = read("target"), read("draft")
    call = {n: dense + experts * (1 - (1 - k / e) ** n) for n in range(1, 10)}
    c = (draft_dense + draft_experts * k / e) / call[1]
    bound = {g: (1 - 0.87 ** (g + 1)) / 0.13 / (g * c + call[g + 1] / call[1]) for g in range(1, 9)}
    flat = {g: (1 - 0.87 ** (g + 1)) / 0.13 / (g * c + 1) for g in range(1, 9)}
    record = manifest.tensorrt_llm.gamma
    assert record["gamma"] == max(bound, key=bound.get) < max(flat, key=flat.get)  # here 2, flat 3
    assert record["expected_speedup"] == round(max(bound.values()), 3) and record["cost_ratio"] == round(c, 4)
    assert "the experts its gamma + 1 rows choose" in record["method"]
    assert f"--max_draft_len {record['gamma']}" in (tmp_path / "b" / manifest.tensorrt_llm.plans["build"]).read_text()


def test_a_dense_targets_gamma_record_is_the_flat_bounds(pairs, tmp_path, monkeypatch):
    """A dense target's call of γ + 1 rows costs one step: the record main wrote before mixtures' calls were counted."""
    target, draft = pairs("llama")
    monkeypatch.setattr(gamma, "measure_with_transformers", lambda *args: 0.9)
    manifest = compile_bundle(CompileSettings(target=target, draft=draft, output=tmp_path / "b", max_seq_len=64,
                                              gamma=8, backend="tensorrt-llm"), show_progress=False)
    bytes_of = {role: manifest.tensorrt_llm.checkpoints[role]["weight_bytes"] for role in ("target", "draft")}
    c = bytes_of["draft"] / bytes_of["target"]
    flat = {g: (1 - 0.9 ** (g + 1)) / (0.1 * (c * g + 1)) for g in range(1, 9)}
    assert manifest.tensorrt_llm.gamma == {
        "gamma": max(flat, key=flat.get), "alpha": 0.9, "cost_ratio": round(c, 4),
        "expected_speedup": round(max(flat.values()), 3),
        "method": "alpha: transformers on CPU, greedy, packaged code prompts; c: weight bytes read per step"}
    assert all("expert_bytes" not in record for record in manifest.tensorrt_llm.checkpoints.values())


def test_a_plans_only_mixtures_step_counts_its_experts_at_top_k_over_experts(checkpoints, tmp_path, monkeypatch):
    """conftest's Qwen3-MoE (a dense middle layer: no checkpoints) costs as its checkpoints would: c's steps read
    each expert at top_k / experts, the call the experts its rows chose."""
    target, draft = checkpoints("qwen3moe", 0), checkpoints("qwen3moe", 1, num_hidden_layers=1)
    monkeypatch.setattr(gamma, "measure_with_transformers", lambda *args: 0.9)
    manifest = compile_bundle(CompileSettings(target=target, draft=draft, output=tmp_path / "b", max_seq_len=8,
                                              gamma=4, backend="tensorrt-llm"), show_progress=False)

    def read(folder):
        model = tf.AutoModelForCausalLM.from_pretrained(folder)
        experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
        return model.num_parameters() - model.get_input_embeddings().weight.numel() - experts * (1 - 2 / 8)
    assert manifest.tensorrt_llm.gamma["cost_ratio"] == pytest.approx(read(draft) / read(target), abs=1e-4)
    assert "the experts its gamma + 1 rows choose" in manifest.tensorrt_llm.gamma["method"]


def test_tp_without_a_tensorrt_llm_backend_is_refused(pairs):
    target, draft = pairs("llama")
    with pytest.raises(SpecbuildError, match="tp 2 splits the TensorRT-LLM export; add --backend"):
        resolve_settings(None, target=target, draft=draft, output=Path("b"), tp=2)


def test_recommended_gamma_maximises_the_speedup_bound():
    assert gamma.recommend(0.0, 0.1, 8, "m")["gamma"] == 1  # nothing accepted: the shortest draft
    best = gamma.recommend(0.8, 0.05, 8, "m")
    bound = {g: (1 - 0.8 ** (g + 1)) / (0.2 * (0.05 * g + 1)) for g in range(1, 9)}
    assert best["gamma"] == max(bound, key=bound.get) and best["expected_speedup"] == round(max(bound.values()), 3)
    assert gamma.recommend(0.8, 0.5, 8, "m")["gamma"] < best["gamma"]  # a costlier draft drafts less
    assert gamma.recommend(None, 0.1, 6, "m")["gamma"] == 6  # unmeasured: the bundle's max γ stands


def test_a_mixture_whose_every_call_reads_every_expert_has_the_flat_bound():
    """top_k = experts: a one-token step reads every expert already, so a call of any rows costs one step."""
    every = gamma.expert_call_cost(3000.0, 2000.0, 8, 8)
    for alpha, c in ((0.5, 0.3), (0.8, 0.05), (0.95, 0.2)):
        assert all(gamma.expected_speedup(alpha, c, g, every) == gamma.expected_speedup(alpha, c, g)
                   for g in range(1, 9))
        assert gamma.recommend(alpha, c, 8, "m", every) == gamma.recommend(alpha, c, 8, "m")


def specbuild(*args):
    return subprocess.run([sys.executable, "-m", "specbuild", *map(str, args)], capture_output=True, text=True)


def test_backend_all_writes_both_and_inspect_lists_the_tensorrt_llm_part(pairs, tokenizer, tmp_path):
    target, draft = pairs("llama")
    out = tmp_path / "b"
    compiled = specbuild("compile", "--target", target, "--draft", draft, "-o", out, "--max-seq-len", 64, "--gamma", 4,
                         "--backend", "all", "--tp", 2)
    assert compiled.returncode == 0, compiled.stderr
    assert "TensorRT-LLM checkpoints, tp 2" in compiled.stdout and "no trtllm-build on PATH" in compiled.stdout
    manifest = load_manifest(out)  # digests checked, the TensorRT-LLM part read back
    assert {"target.onnx", "draft.onnx", "tensorrt-llm/target/rank1.safetensors", "tensorrt-llm/draft/rank1.safetensors",
            "tensorrt-llm/build.sh", "tensorrt-llm/run.sh", "tensorrt-llm/llm-api.yaml", "vllm/serve.sh"} <= set(manifest.files)
    part = manifest.tensorrt_llm
    assert part.tp_size == 2 and 1 <= part.gamma["gamma"] <= 4 and "ONNX engines" in part.gamma["method"]
    assert "c: weight bytes read per step" in part.gamma["method"]  # not timed: the same inputs, the same plans
    build = (out / part.plans["build"]).read_text()
    assert f"--speculative_decoding_mode draft_tokens_external --max_draft_len {part.gamma['gamma']}" in build
    assert f'--draft_target_model_config "[{part.gamma["gamma"]},[0,1],[0,1],False]"' in (out / part.plans["run"]).read_text()
    assert "--tensor-parallel-size 2" in (out / "vllm/serve.sh").read_text()
    options = yaml.safe_load((out / part.plans["llm_api"]).read_text())
    assert options["speculative_config"] == {"decoding_type": "DraftTarget", "max_draft_len": part.gamma["gamma"],
                                             "speculative_model": str(draft.resolve())}
    assert options["tensor_parallel_size"] == 2 and options["max_seq_len"] == 64
    ids = tokenizer(PROMPTS[0])["input_ids"]  # the ONNX half still decodes
    decoder = SpeculativeDecoder(out)
    assert decoder.generate(ids, 8, gamma=2).token_ids == decoder.generate(ids, 8, gamma=0).token_ids
    shown = specbuild("inspect", out)
    assert shown.returncode == 0 and "TensorRT-LLM checkpoints, tp 2" in shown.stdout and "build.sh" in shown.stdout


def test_the_onnx_runtime_does_not_hash_the_tensorrt_llm_part_it_never_opens(pairs, tokenizer, tmp_path):
    """Loading a --backend all bundle read its TensorRT-LLM checkpoints for their digests, doubling the check at
    real sizes; `inspect` still checks them."""
    target, draft = pairs("llama")
    out = tmp_path / "b"
    manifest = compile_bundle(CompileSettings(target=target, draft=draft, output=out, max_seq_len=64, backend="all"),
                              show_progress=False)
    rank = out / manifest.tensorrt_llm.checkpoints["target"]["ranks"][0]["file"]
    raw = bytearray(rank.read_bytes())
    raw[-1] ^= 0xFF
    rank.write_bytes(bytes(raw))
    ids = tokenizer(PROMPTS[0])["input_ids"]
    decoder = SpeculativeDecoder(out)
    assert decoder.generate(ids, 8, gamma=2).token_ids == decoder.generate(ids, 8, gamma=0).token_ids
    with pytest.raises(BundleError, match=re.escape(f"{rank} is corrupted")):
        load_manifest(out)


def test_a_tensorrt_llm_only_bundle_has_no_onnx_and_the_runtime_refuses_it_in_one_line(pairs, tmp_path):
    target, draft = pairs("gpt2")
    out = tmp_path / "b"
    compiled = specbuild("compile", "--target", target, "--draft", draft, "-o", out, "--max-seq-len", 64,
                         "--backend", "tensorrt-llm")
    manifest = load_manifest(out)
    assert manifest.engines == {} and not list(out.glob("*.onnx"))
    # No runtime γ to state (inspect shows none either): the plans' draft length is the one γ said.
    assert compiled.stdout.startswith(f"wrote {out}: max-seq-len 64\n") and "max gamma" not in compiled.stdout
    assert "transformers" in manifest.tensorrt_llm.gamma["method"]
    with pytest.raises(BundleError, match="holds only a TensorRT-LLM export.*build.sh"):
        SpeculativeDecoder(out)
    result = specbuild("generate", out, "-p", "x")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1 and "run.sh" in lines[0]


def test_alpha_is_measured_for_a_tied_pair_within_the_limit_as_transformers_counts_it(pairs, tmp_path, monkeypatch):
    """The exported checkpoints write a tied head out as lm_head: counting those, Qwen3-0.6B with a 2-layer
    draft (0.78B) counted as 1.09B and went unmeasured."""
    target, draft = pairs("llama3-rope")  # tied embeddings
    checkpoints = [load_checkpoint(folder, role) for role, folder in (("target", target), ("draft", draft))]
    model = sum(int(np.prod(c.entries[name].shape)) for c in checkpoints for name in c.weights())
    monkeypatch.setattr(gamma, "TRANSFORMERS_PARAMETER_LIMIT", model)
    manifest = compile_bundle(CompileSettings(target=target, draft=draft, output=tmp_path / "b", max_seq_len=64,
                                              backend="tensorrt-llm"), show_progress=False)
    part = manifest.tensorrt_llm
    assert sum(c["parameters"] for c in part.checkpoints.values()) == model  # the heads written out, counted once
    assert part.gamma["alpha"] is not None and "transformers" in part.gamma["method"]


@pytest.mark.parametrize("tp", [1, 2])
def test_a_tied_head_is_written_out_as_lm_head_and_counted_once(pairs, tmp_path, tp):
    """TensorRT-LLM's converters write a tied head out as lm_head.weight (models/llama/convert.py), so this export
    does; its summary counted those rows twice: a 2-layer Qwen3-0.6B shape at 342.63M params, 187.0M in ONNX's."""
    target = pairs("llama3-rope")[0]  # tied embeddings
    ckpt = load_checkpoint(target, "test")
    written = write_checkpoint(ckpt, tmp_path / "t", tmp_path / "scratch", tp, TARGET_VOCAB, "fp32", "none")
    assert all("lm_head.weight" in load_file(tmp_path / "t" / f"rank{r}.safetensors") for r in range(tp))
    assert written["parameters"] == ckpt.parameters() == tf.AutoModelForCausalLM.from_pretrained(target).num_parameters()


def test_plans_that_serve_the_source_folders_say_they_are_not_quantized(pairs, tmp_path):
    target, draft = pairs("llama")
    for quantize in ("none", "int8"):
        out = tmp_path / quantize
        compile_bundle(CompileSettings(target=target, draft=draft, output=out, max_seq_len=64, backend="tensorrt-llm",
                                       precision="fp16", quantize=quantize), show_progress=False)
        for plan in ("tensorrt-llm/llm-api.yaml", "vllm/serve.sh"):
            text = (out / plan).read_text()
            assert ("Not quantized: this bundle's TensorRT-LLM checkpoints ask for the target int8 and the draft int8"
                    in text) == (
                quantize == "int8"), (plan, text)


def test_plans_do_not_call_an_unmeasured_gamma_measured(pairs, tmp_path, monkeypatch):
    target, draft = pairs("gpt2")
    monkeypatch.setattr(gamma, "TRANSFORMERS_PARAMETER_LIMIT", 0)  # as for a pair too large to decode here
    out = tmp_path / "b"
    manifest = compile_bundle(CompileSettings(target=target, draft=draft, output=out, max_seq_len=64, gamma=6,
                                              backend="tensorrt-llm"), show_progress=False)
    assert manifest.tensorrt_llm.gamma["alpha"] is None
    for plan in ("tensorrt-llm/build.sh", "vllm/serve.sh"):
        text = (out / plan).read_text()
        assert "measured" not in text.replace("could not measure", "") and "max gamma" in text, (plan, text)
    shown = "\n".join(cli.tensorrt_llm_lines(out, manifest.tensorrt_llm))
    assert shown.count("not measured") == 1, shown


def test_compile_runs_the_build_plan_when_trtllm_build_is_on_path(pairs, tmp_path, monkeypatch):
    """Proves only which command lines compile runs: a stand-in records its arguments. Whether TensorRT-LLM
    accepts them is not something this machine can show."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls"
    (bin_dir / "trtllm-build").write_text(f'#!/bin/sh\necho "$@" >> {log}\n')
    (bin_dir / "trtllm-build").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    target, draft = pairs("qwen2")
    manifest = compile_bundle(CompileSettings(target=target, draft=draft, output=tmp_path / "b", max_seq_len=64,
                                              backend="tensorrt-llm", tp=2), show_progress=False)
    calls = log.read_text().splitlines()
    assert [c.split()[:4] for c in calls] == [["--checkpoint_dir", "draft", "--output_dir", "engines/draft"],
                                              ["--checkpoint_dir", "target", "--output_dir", "engines/target"]]
    assert f"--max_draft_len {manifest.tensorrt_llm.gamma['gamma']}" in calls[1] and "max_draft_len" not in calls[0]
    assert manifest.tensorrt_llm.engines == "tensorrt-llm/engines"

    (bin_dir / "trtllm-build").write_text("#!/bin/sh\necho 'no GPU found' >&2\nexit 3\n")
    with pytest.raises(ExternalToolError, match="trtllm-build failed \\(exit 3\\).*no GPU found"):
        compile_bundle(CompileSettings(target=target, draft=draft, output=tmp_path / "c", max_seq_len=64,
                                       backend="tensorrt-llm"), show_progress=False)
    assert not (tmp_path / "c").exists()


def test_run_plan_feeds_the_prompt_as_given(pairs, tmp_path):
    """run.py wraps a Qwen2ForCausalLM's input text in a chat template unless told not to (examples/utils.py
    DEFAULT_PROMPT_TEMPLATES): the engines would continue another prompt than specbuild's runtime does."""
    target, draft = pairs("qwen2")
    out = tmp_path / "b"
    manifest = compile_bundle(CompileSettings(target=target, draft=draft, output=out, max_seq_len=64,
                                              backend="tensorrt-llm"), show_progress=False)
    assert "--no_prompt_template" in (out / manifest.tensorrt_llm.plans["run"]).read_text()


def run_plan_arguments(tmp_path: Path, script: str, **env) -> subprocess.CompletedProcess:
    """run.sh against an examples/run.py that prints the arguments it was given, one a line."""
    fake = tmp_path / "trtllm"
    (fake / "examples").mkdir(parents=True, exist_ok=True)
    (fake / "examples" / "run.py").write_text("import sys\nprint(*sys.argv[1:], sep='\\n')\n")
    (tmp_path / "run.sh").write_text(script)
    return subprocess.run(["bash", str(tmp_path / "run.sh"), "def f():"], capture_output=True, text=True,
                          env={**os.environ, "TRTLLM_DIR": str(fake), **env})


@pytest.mark.parametrize("max_seq_len", [48, 64, 256, 2048])
@pytest.mark.parametrize("gamma", [1, 4, 8])
def test_run_plan_gives_run_py_lengths_its_draft_target_loop_accepts(tmp_path, max_seq_len, gamma):
    """run_dtm_ngram.py hands ModelRunnerCpp.from_dir a max_input_len of prompt + max_output_len, from_dir adds
    max_output_len again and asserts the sum within the engine's max_seq_len, and each target call asks for
    gamma + 1 tokens after up to prompt + output - 1 (_check_inputs); run.py keeps the first
    --max_input_length tokens of a prompt (923 unless given). The default leaves the prompt half the context."""
    result = run_plan_arguments(tmp_path, run_script(gamma, 1, max_seq_len, [2], 2))
    arguments = result.stdout.splitlines()
    output = int(arguments[arguments.index("--max_output_len") + 1])
    prompt = int(arguments[arguments.index("--max_input_length") + 1])
    assert prompt + 2 * output == max_seq_len and output >= gamma and prompt >= max_seq_len // 2, arguments


def test_run_plan_refuses_an_output_length_run_py_has_no_room_for_in_one_line(tmp_path):
    script = run_script(4, 1, 64, [2], 2)
    for output in ("3", "32"):
        result = run_plan_arguments(tmp_path, script, MAX_OUTPUT_LEN=output)
        assert result.returncode == 2 and result.stdout == "", output
        assert result.stderr.strip().splitlines() == [
            f"run.sh: MAX_OUTPUT_LEN {output} leaves run.py no room; give one from 4 to 31"]
    assert run_plan_arguments(tmp_path, script, MAX_OUTPUT_LEN="31").returncode == 0


@pytest.mark.parametrize("max_seq_len", [8192, 8193, 32768])
def test_a_context_past_the_engines_tokens_a_step_is_fed_in_chunks(tmp_path, max_seq_len):
    """build.sh leaves trtllm-build's --max_num_tokens at its 8192 (builder.py BuildConfig), which context FMHA
    keeps below a longer max_input_len (_common.py check_max_num_tokens): a longer prompt runs only with
    run.py's --enable_chunked_context. The LLM API's max_num_tokens is 8192 too (llm_args.py BaseLlmArgs), and
    llm.py refuses a longer prompt without enable_chunked_prefill."""
    longer = max_seq_len > 8192
    arguments = run_plan_arguments(tmp_path, run_script(4, 1, max_seq_len, [2], 2)).stdout.splitlines()
    assert ("--enable_chunked_context" in arguments) == longer, arguments
    options = yaml.safe_load(llm_api_yaml(4, 1, max_seq_len, tmp_path / "target", tmp_path / "draft"))
    assert options["max_seq_len"] == max_seq_len and options.get("enable_chunked_prefill", False) == longer


def test_the_build_plan_gathers_generation_logits_and_says_why_trtllm_build_calls_that_deprecated():
    """trtllm-build warns on every build that --gather_generation_logits is deprecated (commands/build.py tests
    hasattr on an option it always parses), yet run.py's draft-target loop reads it from both engines when logits
    decide acceptance: build.sh said nothing of the warning, inviting a reader to drop the flag."""
    script = build_script(4, 64, "fp16")
    commands = [line for line in script.splitlines() if line.startswith("trtllm-build")]
    assert len(commands) == 2 and all("--gather_generation_logits" in command for command in commands)
    comments = " ".join(line.lstrip("# ") for line in script.splitlines() if line.startswith("# "))
    assert "--gather_generation_logits is deprecated on every build, given or not" in comments
    assert "reads it from both engines when logits decide acceptance" in comments


def test_the_llm_api_yaml_says_which_releases_read_its_decoding_type(tmp_path):
    """Releases up to 1.2.1 read the YAML through DecodingBaseConfig.from_dict, which knows only DraftTarget (the
    YAML's spelling); main's llm_args.py SpeculativeConfig knows only Draft_Target. The header says which line to
    change for which."""
    text = llm_api_yaml(4, 1, 64, tmp_path / "target", tmp_path / "draft")
    header = " ".join(line.lstrip("# ") for line in text.splitlines() if line.startswith("#"))
    assert yaml.safe_load(text)["speculative_config"]["decoding_type"] == "DraftTarget"
    assert "releases up to 1.2.1" in header and "write decoding_type: Draft_Target" in header


def test_run_plan_says_which_eos_ends_the_output_and_which_run_py_runs_past(pairs, tmp_path):
    """run.py's draft-target mode stops at one end id; Llama 3.1 Instruct's generation_config lists three."""
    target, draft = pairs("llama")
    folder = tmp_path / "target"
    shutil.copytree(target, folder)
    own = load_checkpoint(folder, "target").tokenizer.eos_token_id
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [own + 1, own + 2, own]}))
    manifest = compile_bundle(CompileSettings(target=folder, draft=draft, output=tmp_path / "b", max_seq_len=64,
                                              backend="tensorrt-llm"), show_progress=False)
    run = (tmp_path / "b" / manifest.tensorrt_llm.plans["run"]).read_text()
    assert f'--end_id "${{END_ID:-{own}}}"' in run and f"also ends at {own + 1}, {own + 2}" in run


@pytest.mark.parametrize("backend", ["tensorrt-llm", "all"])
def test_a_quantized_fp32_export_is_refused_by_its_settings(tmp_path, backend):
    """The settings alone make the conflict, so it is refused before a checkpoint is read (the CLI: exit 2); it was
    refused after both checkpoints had loaded, as if they were at fault (exit 1)."""
    with pytest.raises(SettingsError, match=rf"the draft's int8 quantization \(--quantize or --draft-quantize\) "
                                            f"with --backend {backend} needs --precision fp16"):
        CompileSettings(target=tmp_path / "none", draft=tmp_path / "none", output=tmp_path / "b", backend=backend,
                        draft_quantize="int8")


@pytest.mark.parametrize("max_seq_len", [None, 48], ids=["default", "given"])
@pytest.mark.parametrize("backend", ["tensorrt-llm", "all"])
def test_the_default_context_and_the_recorded_limit_stop_at_a_window_the_export_does_not_carry(backend, max_seq_len,
                                                                                                tokenizer, tmp_path):
    """The export refuses a context past a sliding window (TensorRT-LLM takes windows at run time): compile's default,
    min(2048, max positions), was refused, and an `all` bundle's context_limit, which the runtime's advice on a
    too-long prompt names, was the 512 positions that compile refuses for it."""
    target = make_checkpoint(tmp_path / "target", "mistral", tokenizer, 0, sliding_window=64)
    draft = make_checkpoint(tmp_path / "draft", "mistral", tokenizer, 1, sliding_window=48, num_hidden_layers=1)
    manifest = compile_bundle(CompileSettings(target=target, draft=draft, output=tmp_path / "b", backend=backend,
                                              max_seq_len=max_seq_len, quality_report=False), show_progress=False)
    assert manifest.max_seq_len == manifest.context_limit == 48  # the draft's window: the export refuses past it too


def test_an_fp16_export_refuses_a_weight_beyond_fp16_as_the_onnx_engines_do(pairs, tmp_path):
    """The rank files were cast with astype: a weight of 1e5 became inf without a word."""
    from test_bad_inputs import a_weight_beyond_fp16

    target, draft = pairs("llama")
    source = tmp_path / "target"
    shutil.copytree(target, source)
    a_weight_beyond_fp16(source)
    out = tmp_path / "b"
    with pytest.raises(UnsupportedModelError, match="beyond fp16's largest number"):
        compile_bundle(CompileSettings(target=source, draft=draft, output=out, max_seq_len=64, backend="tensorrt-llm",
                                       precision="fp16"), show_progress=False)
    assert not out.exists()


def test_the_bundle_tokenizer_names_a_class_transformers_4_has(pairs, tokenizer, tmp_path):
    """run.sh hands tokenizer/ to TensorRT-LLM's examples/run.py, which loads it with AutoTokenizer on the
    transformers 4.57 TensorRT-LLM pins; transformers 5 saves Llama 3's PreTrainedTokenizerFast as
    TokenizersBackend, a name transformers 4 does not know."""
    target, draft = pairs("gpt2")
    source = tmp_path / "target"
    shutil.copytree(target, source)
    config = json.loads((source / "tokenizer_config.json").read_text())
    (source / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "PreTrainedTokenizerFast"}))
    out = tmp_path / "b"
    compile_bundle(CompileSettings(target=source, draft=draft, output=out, max_seq_len=64, backend="tensorrt-llm"),
                   show_progress=False)
    saved = json.loads((out / "tokenizer/tokenizer_config.json").read_text())
    assert saved["tokenizer_class"] == "PreTrainedTokenizerFast"
    load_manifest(out)  # the digests cover the rewritten file
    reloaded = tf.AutoTokenizer.from_pretrained(out / "tokenizer")
    assert reloaded(PROMPTS[5])["input_ids"] == tokenizer(PROMPTS[5])["input_ids"]


def test_the_bundle_tokenizer_keeps_additional_special_tokens_where_transformers_4_reads_them(pairs, tmp_path):
    """Qwen, Gemma and Mistral list additional special tokens; transformers 5 saves them as an
    "extra_special_tokens" list, which transformers 4.57 (TensorRT-LLM's run.py) reads as a dict of named
    tokens, calling .keys() on it: it could not load the tokenizer of such a bundle at all."""
    target, draft = pairs("gpt2")
    source = tmp_path / "target"
    shutil.copytree(target, source)
    config = json.loads((source / "tokenizer_config.json").read_text())
    (source / "tokenizer_config.json").write_text(json.dumps({**config, "additional_special_tokens": ["<|endoftext|>"]}))
    out = tmp_path / "b"
    compile_bundle(CompileSettings(target=source, draft=draft, output=out, max_seq_len=64, backend="tensorrt-llm"),
                   show_progress=False)
    saved = json.loads((out / "tokenizer/tokenizer_config.json").read_text())
    assert isinstance(saved.get("extra_special_tokens", {}), dict)
    assert saved["additional_special_tokens"] == ["<|endoftext|>"]
    load_manifest(out)  # the digests cover the rewritten file
    reloaded = tf.AutoTokenizer.from_pretrained(out / "tokenizer")
    assert reloaded.extra_special_tokens == tf.AutoTokenizer.from_pretrained(source).extra_special_tokens == ["<|endoftext|>"]


def test_a_rank_file_on_a_full_disk_fails_with_the_disks_errno(tmp_path):
    """A quota's limit can come while the disk shows free space: only the errno tells the staging a full disk."""
    import errno

    rank = RankFile(tmp_path / "rank0.safetensors", Path("/dev/full"))  # every write: ENOSPC
    with pytest.raises(OSError) as failed:
        rank.add("w", np.zeros((64, 1024), ml_dtypes.bfloat16))
        rank.data.flush()
    assert failed.value.errno == errno.ENOSPC


# The plans each family gets from its source folders where TensorRT-LLM's checkpoint flow lacks it: the PyTorch
# backend's (llm-api.yaml) where it has a model for the family, vLLM's (serve.sh) for all.
SERVED_FROM_SOURCE = {"gemma2": {"vllm/serve.sh"}, "olmo2": {"vllm/serve.sh"}, "olmo3": {"vllm/serve.sh"},
                      "qwen3moe": {"tensorrt-llm/llm-api.yaml", "vllm/serve.sh"}}  # (its dense middle layer)


def test_every_family_says_whether_it_is_exported_and_which_plans_serve_its_source_folders():
    """A family added to load.ARCHITECTURES (a mixture of experts, say) is refused in one line until both are said."""
    assert set(ARCHITECTURES) == set(families.FAMILIES) | set(families.NOT_EXPORTED) == set(families.SOURCE_PLANS)
    assert not set(families.FAMILIES) & set(families.NOT_EXPORTED)


@pytest.mark.parametrize("family", SERVED_FROM_SOURCE)
def test_a_family_the_checkpoint_flow_lacks_gets_the_plans_that_serve_its_source_folders(checkpoints, tmp_path,
                                                                                          family):
    target, draft = checkpoints(family, 0), checkpoints(family, 1)
    out = tmp_path / "b"
    compiled = specbuild("compile", "--target", target, "--draft", draft, "-o", out, "--max-seq-len", 64,
                         "--backend", "tensorrt-llm")
    assert compiled.returncode == 0, compiled.stderr
    manifest = load_manifest(out)  # the digests checked
    part = manifest.tensorrt_llm
    assert set(part.plans.values()) == SERVED_FROM_SOURCE[family]
    assert {rel for rel in manifest.files if rel.startswith(("tensorrt-llm/", "vllm/"))} == SERVED_FROM_SOURCE[family]
    assert not (out / "tensorrt-llm" / "target").exists() and not (out / "tensorrt-llm" / "build.sh").exists()
    why = unexported(load_checkpoint(target, "target"))
    assert why and part.checkpoints["target"]["not_exported"] == why
    assert part.checkpoints["draft"]["source"]["path"] == str(draft.resolve())
    notice = [line for line in compiled.stdout.splitlines() if "no TensorRT-LLM checkpoints" in line]
    assert len(notice) == 1 and why in notice[0], compiled.stdout
    assert all(Path(plan).name in notice[0] for plan in SERVED_FROM_SOURCE[family])
    serve = (out / "vllm/serve.sh").read_text()
    assert f"vllm serve {target.resolve()}" in serve and f'"model": "{draft.resolve()}"' in serve
    shown = specbuild("inspect", out)
    assert shown.returncode == 0 and all(plan in shown.stdout for plan in SERVED_FROM_SOURCE[family]), shown.stdout


@pytest.mark.parametrize("family", ["granite", "gpt2"])
def test_the_pytorch_backend_plan_is_left_out_for_an_exported_family_it_has_no_model_for(pairs, tmp_path, family):
    """TensorRT-LLM's PyTorch backend refuses an architecture it registers no model for (Unknown architecture for
    AutoModelForCausalLM); the checkpoint flow and vLLM take Granite and GPT-2."""
    target, draft = pairs(family)
    manifest = compile_bundle(CompileSettings(target=target, draft=draft, output=tmp_path / "b", max_seq_len=64,
                                              backend="tensorrt-llm"), show_progress=False)
    assert set(manifest.tensorrt_llm.plans) == {"build", "run", "vllm"}
    assert not (tmp_path / "b" / "tensorrt-llm" / "llm-api.yaml").exists()
    assert "tensorrt-llm/target/rank0.safetensors" in manifest.files


@pytest.mark.parametrize("family,mixed", [("gemma2", True), ("gemma3", True), ("olmo3", True), ("olmo2", False),
                                          ("phi3", False), ("mistral-window", False), ("mixtral", False)])
def test_the_vllm_plan_keeps_a_pair_that_mixes_window_and_full_layers_in_one_kv_cache_group(checkpoints, tmp_path,
                                                                                              family, mixed):
    """vLLM's draft path asserts that a draft's layers share one KV cache group, which its hybrid KV cache manager
    splits by window kind; Phi-3 and Mistral window every layer."""
    target, draft = checkpoints(family, 0), checkpoints(family, 1)
    compile_bundle(CompileSettings(target=target, draft=draft, output=tmp_path / "b", max_seq_len=8, gamma=4,
                                   backend="tensorrt-llm"), show_progress=False)
    serve = (tmp_path / "b" / "vllm/serve.sh").read_text()
    assert ("--disable-hybrid-kv-cache-manager" in serve) == mixed, serve


@pytest.mark.parametrize("family,newer", [("phi3", True), ("gemma3", False)])
def test_the_llm_api_plan_says_where_the_family_needs_a_release_after_1_0(checkpoints, tmp_path, family, newer):
    target, draft = checkpoints(family, 0), checkpoints(family, 1)
    compile_bundle(CompileSettings(target=target, draft=draft, output=tmp_path / "b", max_seq_len=8, gamma=4,
                                   backend="tensorrt-llm"), show_progress=False)
    text = (tmp_path / "b" / "tensorrt-llm/llm-api.yaml").read_text()
    assert ("# Phi-3 needs a TensorRT-LLM release after 1.0.x" in text) == newer, text
    assert yaml.safe_load(text)["speculative_config"]["speculative_model"] == str(draft.resolve())


def test_a_pair_no_backend_serves_from_its_folders_is_refused_in_one_line(checkpoints, tmp_path, monkeypatch):
    monkeypatch.setitem(families.SOURCE_PLANS, "Olmo2ForCausalLM", ())
    target, draft = checkpoints("olmo2", 0), checkpoints("olmo2", 1)
    with pytest.raises(UnsupportedModelError) as refused:
        compile_bundle(CompileSettings(target=target, draft=draft, output=tmp_path / "b", max_seq_len=8, gamma=4,
                                       backend="all"), show_progress=False)
    assert "\n" not in str(refused.value) and str(refused.value).endswith(
        "neither TensorRT-LLM's PyTorch backend nor vLLM serves both of the pair's families; use --backend onnx")
    assert not (tmp_path / "b").exists()


def test_a_tp_the_serving_plans_cannot_split_an_unexported_family_over_is_refused(checkpoints, tmp_path):
    target, draft = checkpoints("olmo2", 0), checkpoints("olmo2", 1)  # 4 attention heads
    with pytest.raises(UnsupportedModelError, match="--tp 3: the target .* has 4 attention heads, which vLLM or "
                                                    "TensorRT-LLM's PyTorch backend cannot split over 3 ranks"):
        compile_bundle(CompileSettings(target=target, draft=draft, output=tmp_path / "b", max_seq_len=8, gamma=4,
                                       backend="tensorrt-llm", tp=3), show_progress=False)


def test_a_plans_only_export_keeps_the_context_past_a_window_the_serving_backends_carry(checkpoints, tmp_path):
    """The checkpoint export caps the context at a window it does not carry; vLLM and the PyTorch backend read the
    windows from config.json."""
    target, draft = checkpoints("gemma2", 0), checkpoints("gemma2", 1)  # windows of 8, 512 positions
    manifest = compile_bundle(CompileSettings(target=target, draft=draft, output=tmp_path / "b",
                                              backend="tensorrt-llm"), show_progress=False)
    assert manifest.max_seq_len == 512


def test_backend_all_writes_the_onnx_engines_and_the_serving_plans_of_an_unexported_gemma3(tokenizer, tmp_path):
    """gemma-3-4b's linear rope scaling, of its full-attention layers alone: TensorRT-LLM would scale the
    sliding-window layers too, so the pair gets the serving plans (and the ONNX engines) only."""
    target, draft = (make_checkpoint(tmp_path / role, "gemma3", tokenizer, seed,
                                     rope_scaling={"rope_type": "linear", "factor": 8.0})
                     for seed, role in enumerate(("target", "draft")))
    out = tmp_path / "b"
    manifest = compile_bundle(CompileSettings(target=target, draft=draft, output=out, max_seq_len=64, backend="all"),
                              show_progress=False)
    assert set(manifest.engines) == {"target", "draft"}
    assert set(manifest.tensorrt_llm.plans.values()) == {"tensorrt-llm/llm-api.yaml", "vllm/serve.sh"}
    assert "sliding-window layers as well" in manifest.tensorrt_llm.checkpoints["target"]["not_exported"]
    ids = tokenizer(PROMPTS[0])["input_ids"]
    decoder = SpeculativeDecoder(out)
    assert decoder.generate(ids, 8, gamma=2).token_ids == decoder.generate(ids, 8, gamma=0).token_ids


def test_a_serving_plans_only_bundle_is_refused_by_the_runtime_naming_its_plans(checkpoints, tmp_path):
    target, draft = checkpoints("olmo2", 0), checkpoints("olmo2", 1)
    out = tmp_path / "b"
    compile_bundle(CompileSettings(target=target, draft=draft, output=out, max_seq_len=64, backend="tensorrt-llm"),
                   show_progress=False)
    said = "holds only plans that serve its source folders with TensorRT-LLM or vLLM, which this runtime does not run: "
    with pytest.raises(BundleError, match=re.escape(f"{said}{out / 'vllm/serve.sh'} (")):
        SpeculativeDecoder(out)


def test_quantizing_only_the_checkpoints_of_a_pair_that_gets_none_is_refused_in_one_line(checkpoints, tmp_path):
    """Nothing would be quantized: the plans serve the source folders' float weights."""
    target, draft = checkpoints("olmo2", 0), checkpoints("olmo2", 1)
    with pytest.raises(UnsupportedModelError) as refused:
        compile_bundle(CompileSettings(target=target, draft=draft, output=tmp_path / "b", max_seq_len=8, gamma=4,
                                       backend="tensorrt-llm", precision="bf16", draft_quantize="int8"),
                       show_progress=False)
    assert "\n" not in str(refused.value) and "writes no TensorRT-LLM checkpoints to quantize" in str(refused.value)
    assert families.NOT_EXPORTED["Olmo2ForCausalLM"] in str(refused.value)  # why, not just which family
    assert not (tmp_path / "b").exists()


def test_the_serving_plans_of_a_quantized_pair_without_checkpoints_say_the_onnx_engines_hold_it(checkpoints,
                                                                                               tmp_path):
    target, draft = checkpoints("olmo2", 0), checkpoints("olmo2", 1)
    compile_bundle(CompileSettings(target=target, draft=draft, output=tmp_path / "b", max_seq_len=8, gamma=4,
                                   backend="all", precision="bf16", draft_quantize="int8", quality_report=False),
                   show_progress=False)
    serve = (tmp_path / "b" / "vllm/serve.sh").read_text()
    assert ("# Not quantized: this bundle's ONNX engines hold the draft int8, and no TensorRT-LLM\n# checkpoints, but "
            "this plan serves the source folders' float weights.\n") in serve, serve


@pytest.mark.parametrize("target_family,draft_family", [("olmo2", "olmo2"), ("gemma2", "gemma2"), ("gpt2", "olmo2")])
def test_a_pair_without_checkpoints_costs_the_weights_a_step_reads_not_the_rows_it_gathers(checkpoints, tmp_path,
                                                                                        target_family, draft_family):
    """c for the plans that serve the source folders: every weight but the embedding tables a step reads one row
    of (an untied token table, GPT-2's positions); a tied token table is read whole as the head."""
    target, draft = checkpoints(target_family, 0), checkpoints(draft_family, 1, num_hidden_layers=1)
    manifest = compile_bundle(CompileSettings(target=target, draft=draft, output=tmp_path / "b", max_seq_len=8,
                                              gamma=4, backend="tensorrt-llm"), show_progress=False)

    def read(folder):
        model = tf.AutoModelForCausalLM.from_pretrained(folder)
        tokens = 0 if model.config.tie_word_embeddings else model.get_input_embeddings().weight.numel()
        positions = model.transformer.wpe.weight.numel() if model.config.model_type == "gpt2" else 0
        return model.num_parameters() - tokens - positions
    assert manifest.tensorrt_llm.gamma["cost_ratio"] == pytest.approx(read(draft) / read(target), abs=1e-4)


def test_a_mixed_pairs_notice_names_the_family_without_checkpoints_and_why(checkpoints, tmp_path):
    """A Llama target (exported) with an OLMo 2 draft (not): no checkpoints for either, the OLMo 2's reason said."""
    target, draft = checkpoints("llama", 0), checkpoints("olmo2", 1)
    manifest = compile_bundle(CompileSettings(target=target, draft=draft, output=tmp_path / "b", max_seq_len=8,
                                              gamma=4, backend="tensorrt-llm"), show_progress=False)
    assert manifest.tensorrt_llm.checkpoints["target"]["not_exported"] == ""
    notice = cli.tensorrt_llm_lines(tmp_path / "b", manifest.tensorrt_llm)[0]
    assert notice.startswith(f"no TensorRT-LLM checkpoints (draft Olmo2ForCausalLM: "
                             f"{families.NOT_EXPORTED['Olmo2ForCausalLM']}); wrote serve.sh"), notice
