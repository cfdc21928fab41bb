"""Tiny real checkpoints built in a tmp dir: random weights, a real byte-level BPE tokenizer."""

from __future__ import annotations

import io
import signal
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
import transformers as tf
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

# Tiny models gain nothing from a second thread, and on a busy machine torch's spinning OpenMP threads
# made a 2-layer forward pass 100x slower (260 ms vs 3 ms, measured here under load 8).
torch.set_num_threads(1)

# A shell without job control (a script's `make test &`) starts a background job with SIGINT ignored, and every
# process it starts inherits that: the tests of Ctrl-C sent it to commands that could not see it (six failed, one
# with status 3). A handler, unlike SIG_IGN, is not inherited: the commands these tests start get the default again.
signal.signal(signal.SIGINT, signal.default_int_handler)

VOCAB = 320
EOS = "<|endoftext|>"
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)

# name -> (config, model, settings over TINY): the families specbuild compiles, in tiny form. Windows of
# 8 positions so that short tests decode well past them.
ARCHITECTURES = {
    "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, {}),
    "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, {}),
    "mistral": (tf.MistralConfig, tf.MistralForCausalLM, {}),
    "llama3": (tf.LlamaConfig, tf.LlamaForCausalLM, dict(tie_word_embeddings=True, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16))),
    "mistral-window": (tf.MistralConfig, tf.MistralForCausalLM, dict(sliding_window=8)),
    "qwen2-window": (tf.Qwen2Config, tf.Qwen2ForCausalLM, dict(num_hidden_layers=3, use_sliding_window=True,
                                                                 sliding_window=8, max_window_layers=1)),
    "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, dict(head_dim=16)),
    "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM, dict(
        num_attention_heads=2, num_key_value_heads=1, partial_rotary_factor=0.5, sliding_window=12,
        original_max_position_embeddings=256, rope_scaling=dict(rope_type="longrope", short_factor=[1.0 + 0.1 * i for i in range(8)],
                                                               long_factor=[2.0 + 0.5 * i for i in range(8)]))),
    "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM, dict(num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=16,
                                                          sliding_window=8)),
    "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM, dict(num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=16,
                                                               sliding_window=8, sliding_window_pattern=2)),
    # granite-3.3-2b's multipliers (its attention's scale 1/head_dim, not head_dim^-0.5) and tied head
    "granite": (tf.GraniteConfig, tf.GraniteForCausalLM, dict(embedding_multiplier=12.0, residual_multiplier=0.22,
                                                              attention_multiplier=1 / 16, logits_scaling=8.0,
                                                              tie_word_embeddings=True)),
    "olmo2": (tf.Olmo2Config, tf.Olmo2ForCausalLM, {}),
    # Qwen3-30B-A3B's mixture in small (its renormalized top-8 of 128): top 2 of 8 experts, the middle layer's MLP dense
    "qwen3moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM, dict(
        num_hidden_layers=3, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        mlp_only_layers=[1], norm_topk_prob=True)),
    # Mixtral's top 2, of 4 experts, past Mistral's sliding window
    "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM, dict(num_local_experts=4, num_experts_per_tok=2,
                                                              intermediate_size=64, sliding_window=8)),
    # OLMo 3 Think's rope: YaRN in the full layers (rope_scaling reaches them alone), none in the sliding ones
    "olmo3": (tf.Olmo3Config, tf.Olmo3ForCausalLM, dict(
        sliding_window=8, layer_types=["sliding_attention", "full_attention"],
        rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=128))),
}

PROMPTS = [
    "def add(a, b):\n    return",
    "import os",
    "class Stack:\n    def __init__(self):\n        self.items = []\n",
    "x",
    "for i in range(10):\n    print(i)\n",
    "# Copyright 2024\n\"\"\"Utilities for parsing configuration files.\"\"\"\n\nimport json\nimport re\n",
    "while True:",
    "try:\n    import json\nexcept ImportError:\n    json = None\n",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n",
    "return self",
    "if __name__ == '__main__':\n    main()",
]


def make_tokenizer(vocab_size: int = VOCAB, text_files: tuple[str, ...] = ("textwrap.py", "shlex.py")):
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(stdlib / f) for f in text_files], trainer)
    return tf.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=EOS)


def make_checkpoint(folder: Path, architecture: str, tokenizer, seed: int = 0, **overrides) -> Path:
    torch.manual_seed(seed)
    vocab = overrides.pop("vocab_size", len(tokenizer))
    eos = tokenizer.eos_token_id
    if architecture == "gpt2":
        config = tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=512, vocab_size=vocab,
                               bos_token_id=eos, eos_token_id=eos, **overrides)
        model = tf.GPT2LMHeadModel(config)
    else:
        config_cls, model_cls, own = ARCHITECTURES[architecture]
        config = config_cls(**{**TINY, "vocab_size": vocab, "bos_token_id": eos, "eos_token_id": eos, "pad_token_id": eos,
                               **own, **overrides})
        model = model_cls(config)
    # Random init puts logits near zero; a larger scale gives decisive argmaxes, so float noise
    # (1e-7) between engines cannot flip a near-tie.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
            elif "norm" in name and architecture not in ("llama", "qwen2", "mistral", "gpt2"):
                p.add_(torch.randn_like(p) * 0.2)  # norms must visibly count (Gemma's start at zero)
    model.eval().save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


def with_stored_biases(folder: Path, *projections: str) -> Path:
    """folder's checkpoint with a random bias stored beside each projection's weight (e.g. "o_proj", "down_proj"),
    whatever its config.json says: biases some other framework trained, which transformers' model may not have."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    for name in [n for n in tensors if n.endswith(tuple(f"{p}.weight" for p in projections))]:
        tensors[name.removesuffix("weight") + "bias"] = torch.randn(tensors[name].shape[0])
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def save_bf16_shards(source: Path, folder: Path) -> dict:
    """Copy a checkpoint folder with its weights in bf16, split in two shards with an index, as large
    checkpoints come. Returns the bf16 tensors by name."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, folder)
    (folder / "model.safetensors").unlink()
    tensors = {k: v.to(torch.bfloat16) for k, v in load_file(source / "model.safetensors").items()}
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, members in shards.items():
        save_file({n: tensors[n] for n in members}, folder / file)
    weight_map = {n: file for file, members in shards.items() for n in members}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return tensors


def counted_compiles(monkeypatch) -> list[str]:
    """The grammar compiles llguidance does from now on in this test, in order: "LLMatcher" (for a tokenizer) or
    "validate_grammar" (without one)."""
    import llguidance

    real, compiles = llguidance.LLMatcher, []

    class Counted:
        grammar_from_json_schema = staticmethod(real.grammar_from_json_schema)

        @staticmethod
        def validate_grammar(grammar):
            compiles.append("validate_grammar")
            return real.validate_grammar(grammar)

        def __new__(cls, *args, **kwargs):
            compiles.append("LLMatcher")
            return real(*args, **kwargs)

    monkeypatch.setattr(llguidance, "LLMatcher", Counted)
    return compiles


class Terminal(io.StringIO):
    """A stderr that is a terminal, as tqdm asks (disable=None: bars where stderr.isatty() only)."""

    def isatty(self) -> bool:
        return True


def on_a_terminal(monkeypatch) -> Terminal:
    """stderr as a terminal for the rest of the test: what a user at one sees (tqdm reads sys.stderr per bar).
    Called in the test's body: pytest's capture sets sys.stderr again between a fixture and its test."""
    screen = Terminal()
    monkeypatch.setattr(sys, "stderr", screen)
    return screen


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory, tokenizer):
    """checkpoints(arch, seed) -> folder, cached for the session."""
    made = {}

    def get(architecture: str, seed: int = 0, **overrides) -> Path:
        key = (architecture, seed, tuple(sorted(overrides.items())))
        if key not in made:
            folder = tmp_path_factory.mktemp(f"{architecture}-{seed}")
            made[key] = make_checkpoint(folder, architecture, tokenizer, seed, **overrides)
        return made[key]

    return get


@pytest.fixture(scope="session")
def bundles(tmp_path_factory, checkpoints):
    """bundles(arch, draft_seed) -> compiled bundle folder; draft_seed 0 makes draft = target."""
    from specbuild.compile import compile_bundle
    from specbuild.recipe import CompileSettings

    made = {}

    def get(architecture: str, draft_seed: int = 0, max_seq_len: int = 256) -> Path:
        key = (architecture, draft_seed, max_seq_len)
        if key not in made:
            out = tmp_path_factory.mktemp("bundles") / f"{architecture}-{draft_seed}"
            settings = CompileSettings(target=checkpoints(architecture, 0), draft=checkpoints(architecture, draft_seed),
                                       output=out, max_seq_len=max_seq_len)
            compile_bundle(settings, show_progress=False)
            made[key] = out
        return made[key]

    return get


def compiled_before_min_p(folder: Path) -> Path:
    """The bundle in folder made as compiled before min_p: its engines and sampler without the min_p input (their nodes
    read a constant 0, so they never drop a token), the manifest's digests following them."""
    import numpy as np

    from specbuild_runtime.manifest import load_manifest

    manifest = load_manifest(folder, check_digests=False)
    files = (manifest.sampler_file, *(info.file for info in manifest.engines.values()))
    return without_inputs(folder, files, {"min_p": np.array(0, np.float32)})


def compiled_before_penalties(folder: Path) -> Path:
    """The bundle in folder made as compiled before the penalties, min_tokens and logit_bias: every graph without their inputs (its
    nodes read neutral constants, shaped [1] to broadcast over any vocabulary), the manifest's digests following them."""
    import numpy as np

    from specbuild_runtime.manifest import load_manifest

    manifest = load_manifest(folder, check_digests=False)
    files = (manifest.sampler_file, *(f for info in manifest.engines.values() for f in (info.file, info.greedy_file)))
    return without_inputs(folder, files, {"repetition_penalty": np.array(1, np.float32),
                                          "presence_penalty": np.array(0, np.float32),
                                          "frequency_penalty": np.array(0, np.float32),
                                          "prompt_mask": np.zeros(1, np.bool_), "output_counts": np.zeros(1, np.float32),
                                          "min_tokens_left": np.array(0, np.int64), "stop_tokens": np.zeros(1, np.bool_),
                                          "logit_bias": np.zeros(1, np.float32)})


def compiled_before_drafts_took_logit_bias_alone(folder: Path) -> Path:
    """The bundle in folder made as compiled before its draft's engine graph took logit_bias alone: it takes every
    penalty, min_tokens and logit_bias input and decides behind the penalties' If, as the target's graph does, over the
    same weights (an fp32 bundle without quantization), the manifest's digest following it."""
    import json

    from specbuild.compile.export import _write_sharing_weights
    from specbuild.compile.graphs import build_decoder
    from specbuild.compile.load import load_checkpoint
    from specbuild.compile.precision import Numerics
    from specbuild_runtime.manifest import MANIFEST, load_manifest, sha256_file

    manifest = load_manifest(folder, check_digests=False)
    info = manifest.engines["draft"]
    target = load_checkpoint(manifest.engines["target"].source["path"], "target")
    model = build_decoder(load_checkpoint(info.source["path"], "draft"), Numerics(), manifest.max_seq_len,
                          target.spec.shape.vocab_size, tokens=target.token_ids(), penalties=True)
    _write_sharing_weights(model, folder / info.file, folder / info.file)
    data = json.loads((folder / MANIFEST).read_text())
    data["files"][info.file] = sha256_file(folder / info.file)
    (folder / MANIFEST).write_text(json.dumps(data))
    return folder


def without_inputs(folder: Path, files, constants: dict) -> Path:
    """The bundle in folder with the graph inputs named in constants made those constants in each file of files."""
    import json

    import onnx
    from onnx import numpy_helper

    from specbuild_runtime.manifest import MANIFEST, sha256_file

    data = json.loads((folder / MANIFEST).read_text())
    for file in files:
        model = onnx.load(str(folder / file), load_external_data=False)
        kept = [value for value in model.graph.input if value.name not in constants]
        del model.graph.input[:]
        model.graph.input.extend(kept)
        model.graph.initializer.extend(numpy_helper.from_array(value, name) for name, value in constants.items())
        onnx.save(model, str(folder / file))
        data["files"][file] = sha256_file(folder / file)
    (folder / MANIFEST).write_text(json.dumps(data))
    return folder


def scale_head_beyond_fp16(folder):
    """A checkpoint with its LM head scaled 3e4-fold: every weight within fp16's range (65504), its logits
    (~5e4 a standard deviation) beyond it, as an fp16 engine of a model whose activations outgrow fp16 sees them."""
    from safetensors.torch import load_file, save_file

    weights = folder / "model.safetensors"
    tensors = load_file(weights)
    tensors["lm_head.weight"] *= 3e4
    save_file(tensors, weights, metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="session")
def overflowing(tmp_path_factory, checkpoints):
    """role -> an fp16 bundle of the llama pair whose `role` overflows fp16 in its logits."""
    import shutil

    from specbuild.compile import compile_bundle
    from specbuild.recipe import CompileSettings

    made = {}

    def get(role):
        if role not in made:
            tmp = tmp_path_factory.mktemp(f"overflowing-{role}")
            pair = {"target": checkpoints("llama", 0), "draft": checkpoints("llama", 1)}
            pair[role] = scale_head_beyond_fp16(shutil.copytree(pair[role], tmp / role))
            made[role] = tmp / "bundle"
            compile_bundle(CompileSettings(**pair, output=made[role], max_seq_len=64, precision="fp16",
                                           quality_report=False), show_progress=False)
        return made[role]

    return get


@pytest.fixture(scope="session")
def mypy_check(tmp_path_factory):
    """mypy_check(*files) -> (status, report): the files type-checked against this tree's runtime, whose hints a
    service's mypy reads (py.typed), with the project's config (pyproject's [tool.mypy]: its mypy_path is this tree's
    runtime, wherever one is installed). One cache for the session: the runtime's modules are analysed once (~10 s of
    CPU), not by each test. Skips the test where mypy is not installed (the test extras install it)."""
    api = pytest.importorskip("mypy.api")
    cache = tmp_path_factory.mktemp("mypy-cache")
    config = Path(__file__).resolve().parent.parent / "pyproject.toml"

    def check(*files: Path) -> tuple[int, str]:
        report, errors, status = api.run(["--config-file", str(config), "--follow-imports=silent", "--cache-dir",
                                          str(cache), *map(str, files)])
        return status, report + errors

    return check


@pytest.fixture(scope="session")
def cli():
    """One process that runs `specbuild` command lines for every test that asks: cli.run(entries, cwd,
    watch) (tests/cli_driver.py); the imports are paid once."""
    from cli_driver import Driver

    driver = Driver()
    yield driver
    driver.close()
