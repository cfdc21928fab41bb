"""Every bad input a user can give is one line on stderr with the documented exit status, and changes nothing.

CASES is the table; the README's troubleshooting table is generated from it (`python
tests/test_bad_inputs.py` prints it) and a test checks the README holds exactly that. Command-line
cases run in the session's CLI process (tests/cli_driver.py), so the table costs no start-up of its own.
Cases that pass only once another engineer's branch is merged are marked with what they need.

Pickles: some cases plant a malicious `pytorch_model.bin` (unpickling it writes a marker file; the
control test shows it does) beside a checkpoint's safetensors or alone; compile, verify, bench's
transformers peer and distill's loader run on them, and no command may even open it.
"""

from __future__ import annotations

import fcntl
import json
import pickle
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


@dataclass
class Case:
    given: str  # what the user gave (the table's first column)
    args: list[str] | None  # CLI arguments with {placeholders}; None: a Python API case (call)
    status: int  # exit status (API cases: 1, a SpecbuildError)
    says: str  # a fragment the one-line error holds ("" with status 0: it works)
    fix: str  # what to do (the table's last column)
    setup: Callable[[dict], None] | None = None  # writes what the case needs into paths (may add paths)
    call: Callable | None = None  # API cases: call(decoder, bundle)
    id: str = field(default="")


def compile_args(output: str = "{tmp}/bundle", *extra: str) -> list[str]:
    return ["compile", "--target", "{target}", "--draft", "{draft}", "-o", output, "--max-seq-len", "64", *extra]


def recipe(body: str, output: str = '"bundle"') -> Callable[[dict], None]:
    """A recipe beside tmp with the tiny checkpoints and `body` in its [compile] table."""

    def write(paths: dict) -> None:
        paths["recipe"] = Path(paths["tmp"]) / "pair.toml"
        paths["recipe"].write_text(f'[compile]\ntarget = "{paths["target"]}"\ndraft = "{paths["draft"]}"\n'
                                   + (f"output = {output}\n" if output else "") + "max_seq_len = 64\n" + body)

    return write


def a_folder_with_a_file(paths: dict) -> None:
    (Path(paths["tmp"]) / "notes").mkdir()
    (Path(paths["tmp"]) / "notes" / "todo.txt").write_text("keep me")


def a_killed_compile(paths: dict) -> None:
    """What a compile to {tmp}/bundle killed mid-way leaves: its staging folder, part-written (specbuild/staging.py)."""
    staging = Path(paths["tmp"]) / ".bundle.partial-4242"
    staging.mkdir()
    (staging / "target.onnx").write_bytes(b"part of an engine")


def a_link_loop(paths: dict) -> None:
    (Path(paths["tmp"]) / "loop").symlink_to("loop")


def a_copy_of(what: str, damage: Callable[[Path], None]) -> Callable[[dict], None]:
    """paths[what] replaced by a damaged copy in tmp."""

    def setup(paths: dict) -> None:
        copy = Path(paths["tmp"]) / what
        shutil.copytree(paths[what], copy)
        damage(copy)
        paths[what] = copy

    return setup


def truncate_weights(folder: Path) -> None:
    weights = next(folder.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])


def garble_weights_header(folder: Path) -> None:
    weights = next(folder.glob("*.safetensors"))
    raw = bytearray(weights.read_bytes())
    raw[8:40] = b"{" * 32
    weights.write_bytes(bytes(raw))


def empty_weights(folder: Path) -> None:
    next(folder.glob("*.safetensors")).write_bytes(b"")


def garble_config(folder: Path) -> None:
    (folder / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], ')


def sharded_target(damage: Callable[[Path], None]) -> Callable[[dict], None]:
    """paths["target"] replaced by a copy in two shards with an index, as large checkpoints come, then damaged."""

    def setup(paths: dict) -> None:
        from conftest import save_bf16_shards

        copy = Path(paths["tmp"]) / "sharded"
        save_bf16_shards(Path(paths["target"]), copy)
        damage(copy)
        paths["target"] = copy

    return setup


def drop_a_shard(folder: Path) -> None:
    (folder / "model-00002-of-00002.safetensors").unlink()


def garble_index(folder: Path) -> None:
    (folder / "model.safetensors.index.json").write_text('{"weight_map": ')


def drop_a_tensor(folder: Path) -> None:
    from safetensors.numpy import load_file, save_file

    weights = next(folder.glob("*.safetensors"))
    tensors = load_file(weights)
    del tensors[next(name for name in tensors if "layers.1.mlp" in name)]
    save_file(tensors, weights, metadata={"format": "pt"})


def a_weight_beyond_fp16(folder: Path) -> None:
    """One bf16 weight of 1e5: bf16 holds it, fp16 (largest 65504) does not."""
    import torch
    from safetensors.torch import load_file, save_file

    weights = next(folder.glob("*.safetensors"))
    tensors = load_file(weights)
    name = next(name for name in tensors if "layers.0.mlp.down_proj" in name)
    tensors[name] = tensors[name].to(torch.bfloat16)
    tensors[name][0, 0] = 1e5
    save_file(tensors, weights, metadata={"format": "pt"})


def a_longrope_target(paths: dict) -> None:
    """A Llama target with LongRoPE whose original length (16) is below the case's --max-seq-len 64 (a Phi-3 one
    compiles: its engine switches tables there, as transformers' Phi-3 recomputes its cache)."""
    from conftest import make_checkpoint, make_tokenizer

    paths["target"] = make_checkpoint(Path(paths["tmp"]) / "llama-longrope", "llama", make_tokenizer(), rope_scaling=dict(
        rope_type="longrope", short_factor=[1.0 + 0.1 * i for i in range(8)], long_factor=[2.0 + 0.5 * i for i in range(8)],
        original_max_position_embeddings=16))


def a_gemma3_pair_windowed_apart(paths: dict) -> None:
    """A Gemma 3 pair whose sliding windows differ (8 and 4 positions), as a finetune's may from its partner's."""
    from conftest import make_checkpoint, make_tokenizer

    tokenizer = make_tokenizer()
    for role, seed, window in (("target", 0, 8), ("draft", 1, 4)):
        paths[role] = make_checkpoint(Path(paths["tmp"]) / f"gemma3-{role}", "gemma3", tokenizer, seed,
                                      sliding_window=window)


def a_phi3_longrope_target(paths: dict) -> None:
    """A Phi-3 target with LongRoPE whose original length (16) is below the case's --max-seq-len 64, without a
    sliding window (which the TensorRT-LLM export would refuse first)."""
    from conftest import make_checkpoint, make_tokenizer

    paths["target"] = make_checkpoint(
        Path(paths["tmp"]) / "phi3-longrope", "phi3", make_tokenizer(), sliding_window=None,
        original_max_position_embeddings=16, rope_scaling=dict(
            rope_type="longrope", short_factor=[1.0 + 0.1 * i for i in range(8)],
            long_factor=[2.0 + 0.5 * i for i in range(8)], original_max_position_embeddings=16))


def an_olmo2_pair(paths: dict) -> None:
    """A pair of a family TensorRT-LLM's checkpoint flow has no model for (vLLM serves it from its folders)."""
    from conftest import make_checkpoint, make_tokenizer

    tokenizer = make_tokenizer()
    for role, seed in (("target", 0), ("draft", 1)):
        paths[role] = make_checkpoint(Path(paths["tmp"]) / f"olmo2-{role}", "olmo2", tokenizer, seed)


def a_weight_in_float64(folder: Path) -> None:
    """One weight stored in a type specbuild does not read (float64; fp8 or int8 without a quantization_config too)."""
    from safetensors.torch import load_file, save_file

    weights = next(folder.glob("*.safetensors"))
    tensors = load_file(weights)
    name = next(name for name in tensors if "layers.0.mlp.down_proj" in name)
    tensors[name] = tensors[name].double()
    save_file(tensors, weights, metadata={"format": "pt"})


def a_nan_weight(folder: Path) -> None:
    """One NaN in a weight, as a diverged training run or a broken conversion leaves it."""
    from safetensors.torch import load_file, save_file

    weights = next(folder.glob("*.safetensors"))
    tensors = load_file(weights)
    name = next(name for name in tensors if "layers.0.mlp.down_proj" in name)
    tensors[name][0, 0] = float("nan")
    save_file(tensors, weights, metadata={"format": "pt"})


def a_larger_draft(paths: dict) -> None:
    """A draft of the target's shape with a wider MLP: the pair as given the wrong way round."""
    from conftest import make_checkpoint, make_tokenizer

    paths["draft"] = make_checkpoint(Path(paths["tmp"]) / "larger", "llama", make_tokenizer(), 1, intermediate_size=256)


def gemma_with_biases(paths: dict) -> None:
    """A target whose attention biases transformers reads and specbuild's Gemma graph does not."""
    from conftest import make_checkpoint, make_tokenizer

    paths["target"] = make_checkpoint(Path(paths["tmp"]) / "gemma", "gemma2", make_tokenizer(), attention_bias=True)


def mistral_with_biases(paths: dict) -> None:
    """A Mistral target storing the o_proj biases its config.json asks for, which transformers' Mistral never has."""
    from conftest import make_checkpoint, make_tokenizer, with_stored_biases

    folder = make_checkpoint(Path(paths["tmp"]) / "mistral", "mistral", make_tokenizer(), attention_bias=True)
    paths["target"] = with_stored_biases(folder, "o_proj")


class WritesMarker:
    """Unpickled, it writes a file named marker: what a malicious checkpoint would do."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('unpickled')",)


MARKER = "UNPICKLED"  # the file a planted pickle writes, beside the checkpoint, when something unpickles it


def plant_pickle(folder: Path) -> None:
    with open(folder / "pytorch_model.bin", "wb") as f:
        pickle.dump(WritesMarker(folder.parent / MARKER), f)


def only_a_pickle(folder: Path) -> None:
    next(folder.glob("*.safetensors")).unlink()
    plant_pickle(folder)


def beyond_memory(folder: Path) -> None:
    """config.json of a 3.3T-parameter model over the tiny weights: distill refuses it before loading a thing."""
    config = json.loads((folder / "config.json").read_text())
    config.update(hidden_size=65536, intermediate_size=262144, num_hidden_layers=64)
    (folder / "config.json").write_text(json.dumps(config))


def without_bos_or_eos(folder: Path) -> None:
    """A tokenizer that names no special tokens (compile takes it): nothing for the target's own samples to begin from."""
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if not k.endswith("_token")}))


def source_only_a_pickle(paths: dict) -> None:
    """The bundle's target checkpoint (which bench's peers load) now holds only a pickle."""
    a_copy_of("bundle", lambda folder: None)(paths)
    a_copy_of("target", only_a_pickle)(paths)
    manifest = json.loads((paths["bundle"] / "manifest.json").read_text())
    manifest["engines"]["target"]["source"]["path"] = str(paths["target"])
    (paths["bundle"] / "manifest.json").write_text(json.dumps(manifest))


def source_elsewhere(change: Callable[[Path], None] | None) -> Callable[[dict], None]:
    """The bundle's target source is a copy of the target, changed by `change`, or gone (None)."""
    def setup(paths: dict) -> None:
        a_copy_of("bundle", lambda folder: None)(paths)
        if change is None:
            source = Path(paths["tmp"]) / "moved-away"
        else:
            a_copy_of("target", change)(paths)
            source = paths["target"]
        manifest = json.loads((paths["bundle"] / "manifest.json").read_text())
        manifest["engines"]["target"]["source"]["path"] = str(source)
        (paths["bundle"] / "manifest.json").write_text(json.dumps(manifest))

    return setup


def config_edit(change: Callable[[dict], None]) -> Callable[[Path], None]:
    """A setup that changes a checkpoint folder's config.json."""
    def edit(folder: Path) -> None:
        config = json.loads((folder / "config.json").read_text())
        change(config)
        (folder / "config.json").write_text(json.dumps(config))

    return edit


add_a_config_key = config_edit(lambda config: config.update(edited=True))
falcon = config_edit(lambda config: config.update(architectures=["FalconForCausalLM"]))
without_architectures = config_edit(lambda config: config.pop("architectures"))
sliding_without_a_window = config_edit(lambda config: config.update(layer_types=["sliding_attention", "full_attention"]))
pre_quantized = config_edit(lambda config: config.update(quantization_config={"quant_method": "awq", "bits": 4}))
tied_beside_a_head = config_edit(lambda config: config.update(tie_word_embeddings=True))  # the head stays stored


def sentencepiece_only(folder: Path) -> None:
    """An older Llama 2 or Mistral repo: tokenizer.model, no tokenizer.json (this one is not even a valid model,
    which changes nothing without the sentencepiece package)."""
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer.model").write_bytes(b"\x0a\x04not a sentencepiece model")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "LlamaTokenizer"}))


def other_tokenizer(paths: dict) -> None:
    from conftest import make_checkpoint, make_tokenizer

    paths["draft"] = make_checkpoint(Path(paths["tmp"]) / "other", "llama", make_tokenizer(300, ("argparse.py",)))


def without_tokenizer_files(folder: Path) -> Path:
    """As save_pretrained of the model alone leaves a checkpoint (a pruned or layer-sliced draft, often)."""
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (folder / name).unlink(missing_ok=True)
    return folder


def a_target_without_tokenizer_files(paths: dict) -> None:
    """A Qwen-family one: transformers 5 gives the folder an empty tokenizer of its model_type's class instead of
    failing."""
    from conftest import make_checkpoint, make_tokenizer

    paths["target"] = without_tokenizer_files(make_checkpoint(Path(paths["tmp"]) / "qwen", "qwen2", make_tokenizer()))


def a_draft_of_another_vocabulary_without_tokenizer_files(paths: dict) -> None:
    from conftest import make_checkpoint, make_tokenizer

    other = make_checkpoint(Path(paths["tmp"]) / "other", "llama", make_tokenizer(300, ("argparse.py",)))
    paths["draft"] = without_tokenizer_files(other)


def malformed_generation_config(folder: Path) -> None:
    (folder / "generation_config.json").write_text('{"eos_token_id": ')


def corrupt_bundle_weights(folder: Path) -> None:
    data = folder / "target.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF
    data.write_bytes(bytes(raw))


def edit_manifest_vocab(folder: Path) -> None:
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["engines"]["target"]["shape"]["vocab_size"] += 7
    (folder / "manifest.json").write_text(json.dumps(manifest))


def write_file(name: str, content: bytes) -> Callable[[dict], None]:
    def setup(paths: dict) -> None:
        paths[name] = Path(paths["tmp"]) / name
        paths[name].write_bytes(content)

    return setup


def hold_the_lock(paths: dict) -> None:
    """Another compile to {tmp}/bundle is running: this process holds its lock until the cases are run."""
    lock = open(Path(paths["tmp"]) / ".bundle.lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX)
    lock.write("4242")
    lock.flush()
    paths["held"] = lock


def bf16_bundle(paths: dict) -> None:
    """paths["bundle"]: the target's bundle in bf16, which onnxruntime's CPU provider cannot load."""
    from specbuild.compile import compile_bundle
    from specbuild.recipe import CompileSettings

    paths["bundle"] = Path(paths["tmp"]) / "bf16"
    compile_bundle(CompileSettings(target=paths["target"], draft=paths["target"], output=paths["bundle"],
                                   max_seq_len=64, precision="bf16"), show_progress=False)


def existing_bundle(paths: dict) -> None:
    shutil.copytree(paths["bundle"], Path(paths["tmp"]) / "bundle")


NEW = compile_args()
SAFE = "Re-save it with `model.save_pretrained(dir, safe_serialization=True)`: specbuild never unpickles."
PROMPT = b'{"prompt": "def add(a, b):"}\n'
VERIFY = ["verify", "{bundle}", "--target", "{target}", "--prompts", "{prompts}", "-n", "4"]
CHAT_TEMPLATE = b"{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}<|assistant|>\n"
NO_SYSTEM_ROLE = (b"{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
                  b"{% endif %}" + CHAT_TEMPLATE)  # as Gemma's
CASES = [
    # --- where a compile writes ---------------------------------------------------------------------
    Case("`--output` is the target checkpoint", compile_args("{target}", "--overwrite"), 1,
         "is the target checkpoint", "Choose an output outside the checkpoints and the recipe."),
    Case("`--output` holds a checkpoint (e.g. its parent folder)", compile_args("{target_parent}", "--overwrite"), 1,
         "contains the target checkpoint", "Choose an output outside the checkpoints and the recipe."),
    Case("`--output` inside a checkpoint folder", compile_args("{target}/bundle"), 1,
         "lies inside the target checkpoint", "Choose an output outside the checkpoints and the recipe."),
    Case('recipe with `output = "."` (its own folder)', ["compile", "--recipe", "{recipe}", "--overwrite"], 1,
         "contains the recipe", "Write the bundle to a folder of its own.", setup=recipe("", output='"."')),
    Case("`--overwrite` on a folder that is not a bundle", compile_args("{tmp}/notes", "--overwrite"), 1,
         "is not a specbuild bundle", "Move the folder away or choose another `--output`: `--overwrite` replaces only bundles.",
         setup=a_folder_with_a_file),
    Case("an existing bundle without `--overwrite`", NEW, 1, "already holds a specbuild bundle",
         "Pass `--overwrite` to replace it, or choose another `--output`.", setup=existing_bundle),
    Case("`--output .` (the current folder)", compile_args("."), 1, "current folder",
         "Run from the folder above, or choose another output."),
    Case("`--output` a symbolic link that leads back to itself (`ln -s bundle bundle`)", compile_args("{tmp}/loop"), 1,
         "leads back to itself", "Remove the link (`rm`), or choose another output.", setup=a_link_loop),
    Case("`--output` inside a file (`-o notes.txt/bundle`)", compile_args("{tmp}/notes.txt/bundle"), 1,
         "notes.txt is a file, so", "Choose an output whose parent folders are folders.",
         setup=write_file("notes.txt", b"keep me")),
    Case("`--output` (or a recipe's `output`) a file (`-o notes.txt`)", ["compile", "--recipe", "{recipe}", "--overwrite"], 1,
         "notes.txt is a file, and a specbuild bundle is a folder", "Move the file away or choose another output.",
         setup=lambda paths: (write_file("notes.txt", b"keep me")(paths), recipe("", output='"notes.txt"')(paths))),
    Case("a second compile to the same output while one runs", NEW, 1, "is writing",
         "Wait for the other compile to finish (the lock file `.NAME.lock` beside the output is released when it ends).",
         setup=hold_the_lock),
    # --- compile settings -----------------------------------------------------------------------------
    Case("`--gamma 1000000000`", compile_args("{tmp}/bundle", "--gamma", "1000000000"), 2, "from 1 to 32",
         "γ is the most drafts per round: 1 to 32 (speculation stops paying long before)."),
    Case("`--gamma 0`", compile_args("{tmp}/bundle", "--gamma", "0"), 2, "from 1 to 32",
         "Give 1 to 32; target-only decoding is `generate --gamma 0`."),
    Case("`--max-seq-len 0` or `-5`", compile_args("{tmp}/bundle", "--max-seq-len", "-5"), 2, "2 or more",
         "Give the context length to allocate, or leave it out for min(2048, the longest the pair takes)."),
    Case("`--max-seq-len` not above `--gamma`", compile_args("{tmp}/bundle", "--max-seq-len", "3", "--gamma", "4"), 2,
         "context holds 3 tokens", "Give a `--max-seq-len` above `--gamma` (contexts are hundreds of tokens or more)."),
    Case("`--max-seq-len` beyond the model's positions", compile_args("{tmp}/bundle", "--max-seq-len", "4096"), 1,
         "max_position_embeddings", "Use the largest length the message names, or less."),
    Case("`--max-seq-len` beyond a LongRoPE target's original length (a Llama with rope_type longrope; Phi-3 compiles, "
         "but for `--backend tensorrt-llm`: below)",
         compile_args(), 1,
         "LongRoPE original_max_position_embeddings", "Use the length the message names, or less (the default stops there).",
         setup=a_longrope_target),
    Case("`--backend tensorrt-llm` (or `all`) with a context too short for the measuring prompts",
         compile_args("{tmp}/bundle", "--backend", "tensorrt-llm", "--max-seq-len", "32"), 0, "",
         "Nothing: the plans' draft length is then the bundle's max gamma (α not measured), as `inspect` says."),
    Case("`--block-size 17`", compile_args("{tmp}/bundle", "--block-size", "17"), 2, "power of two",
         "Use a power of two from 16 to 256 (32 is the default; larger blocks trade accuracy for size)."),
    Case("`--precision fp16` over a weight beyond fp16's range (65504)", compile_args("{tmp}/bundle", "--precision", "fp16"), 1,
         "beyond fp16's largest number", "Compile with `--precision bf16` (fp32's range) or fp32.",
         setup=a_copy_of("target", a_weight_beyond_fp16)),
    Case("a checkpoint with a NaN or infinite weight", compile_args("{tmp}/bundle"), 1,
         "holds NaN: the checkpoint is damaged", "Save or download the checkpoint again; no model is trained to hold one.",
         setup=a_copy_of("target", a_nan_weight)),
    Case("`--block-size`, `--accuracy-level` or `--quality-report` without quantizing, even at their defaults",
         compile_args("{tmp}/bundle", "--block-size", "64"), 2,
         "shape quantized engines", "Add `--quantize int4|int8` (or per engine), or leave them out."),
    Case("`--backend tensorrt-llm` (or `all`) with a Gemma 2, OLMo 2 or OLMo 3 pair, a Gemma 3 with rope "
         "scaling (4b, 12b, 27b), a Phi-3 with its own LongRoPE attention factor or a Qwen3-MoE with dense layers "
         "among its sparse ones",
         compile_args("{tmp}/bundle", "--backend", "tensorrt-llm"), 0, "",
         "Nothing: the TensorRT-LLM checkpoint export does not take the model, so the bundle holds only the plans that "
         "serve the source folders (vLLM's, and for Gemma 3, Phi-3 and Qwen3-MoE the PyTorch backend's), as "
         "compile says in one line.", setup=an_olmo2_pair),
    Case("`--backend tensorrt-llm` (or `all`) with a Phi-3 LongRoPE target (Phi-3-mini-128k, Phi-3.5-mini, "
         "Phi-4-mini) past its original length",
         compile_args("{tmp}/bundle", "--backend", "tensorrt-llm"), 1,
         "past which TensorRT-LLM's Phi-3 model rotates new tokens with the long factors",
         "Give `--max-seq-len` of the length the message names or less (the default stops there), or use "
         "`--backend onnx`, whose engine recomputes its cache there as transformers does.",
         setup=a_phi3_longrope_target),
    Case("`--backend tensorrt-llm` (or `all`) with a Gemma 3 pair whose sliding windows differ (a finetune's own "
         "window: the released 270m and 1b share 512), past the shorter",
         compile_args("{tmp}/bundle", "--backend", "tensorrt-llm"), 1,
         "one --max_attention_window_size list",
         "Give `--max-seq-len` of the shorter window or less (run.py gives both engines one list of windows), or use "
         "`--backend onnx`.", setup=a_gemma3_pair_windowed_apart),
    Case("`--quantize` (or per engine) with `--backend tensorrt-llm` and a Gemma 2, OLMo 2 or OLMo 3 pair, a "
         "Gemma 3 with rope scaling, a Phi-3 with its own LongRoPE attention factor or a Qwen3-MoE with dense layers "
         "among its sparse ones",
         compile_args("{tmp}/bundle", "--backend", "tensorrt-llm", "--precision", "bf16", "--quantize", "int8"),
         1, "writes no TensorRT-LLM checkpoints to quantize",
         "Leave `--quantize` out (the plans serve the source folders' float weights), or use `--backend all` to "
         "quantize the ONNX engines.", setup=an_olmo2_pair),
    Case("`--block-size`, `--accuracy-level` or `--quality-report` with `--backend tensorrt-llm`",
         compile_args("{tmp}/bundle", "--quantize", "int8", "--backend", "tensorrt-llm", "--quality-report"), 2,
         "applies to the ONNX engines, which backend tensorrt-llm does not build",
         "Leave them out (trtllm-build quantizes per output channel), or add `--backend all` to build the ONNX engines too."),
    Case("`--quantize` (or per engine) with `--backend tensorrt-llm` (or `all`) at fp32, the default precision",
         compile_args("{tmp}/bundle", "--quantize", "int4", "--backend", "tensorrt-llm"), 2,
         "needs --precision fp16 or bf16",
         "Add `--precision fp16` or `bf16`: TensorRT-LLM's weight-only kernels take 16-bit activations."),
    Case('`--precision int8` or `int4` (or a recipe\'s `precision = "int8"`)',
         compile_args("{tmp}/bundle", "--precision", "int8"), 2, "'int8' is a weight quantization, not a float type",
         "Give `--quantize int8` (`quantize` in a recipe); `--precision` is the float type: fp32, fp16 or bf16."),
    Case("`--quantize` with both `--target-quantize` and `--draft-quantize`",
         compile_args("{tmp}/bundle", "--quantize", "int4", "--target-quantize", "none", "--draft-quantize", "none"),
         2, "quantize int4 applies to neither engine", "Leave `--quantize` out, or one of the per-engine ones."),
    Case("`compile` without `--draft` (and no recipe)", ["compile", "--target", "{target}", "-o", "{tmp}/bundle"], 2,
         "missing --draft (give it", "Give `--target`, `--draft` and `--output`, or a recipe with them."),
    Case("an unknown option", compile_args("{tmp}/bundle", "--gama", "4"), 2, "No such option",
         "See `specbuild COMMAND --help`."),
    Case("`compile --device cuda` (a device, as where the bundle runs)",
         compile_args("{tmp}/bundle", "--device", "cuda"), 2,
         "--device is not compile's: its engines run on a CPU or a CUDA GPU",
         "Leave it out, and give `--device cuda` to generate, chat, bench, verify or serve; for a GPU compile with "
         "`--precision fp16` (or bf16)."),
    Case("vLLM's `--dtype` or `--num-speculative-tokens` to `compile`",
         compile_args("{tmp}/bundle", "--dtype", "fp16"), 2,
         "--dtype is vLLM's name for --precision here",
         "Give `--precision` for `--dtype`, `--gamma` for `--num-speculative-tokens`."),
    Case("vLLM's `--dtype`, `--max-model-len`, `--quantization`, `--enforce-eager` or `--num-speculative-tokens` to "
         "generate, chat, bench or verify", ["generate", "{bundle}", "-p", "x", "--max-model-len", "4096"], 2,
         "--max-model-len is vLLM's option, which specbuild generate does not take",
         "Do what the message says: the context, precision and quantization are the bundle's (set by `compile`), "
         "`--no-cuda-graphs` is `--enforce-eager`, and `--gamma` is the draft length."),
    Case("llama.cpp's `-ngl`, `-c`/`--ctx-size`, `-m`/`--model` or `--draft-max` to generate, chat, bench, verify or "
         "serve", ["generate", "{bundle}", "-p", "x", "-ngl", "99"], 2,
         "-ngl is llama.cpp's option, which specbuild generate does not take",
         "Do what the message says: a bundle runs whole where `--device` says, its context is set by `compile`, it "
         "is the first argument, and `--gamma` is the draft length."),
    Case("`distill --dtype bf16` (the draft's float type)", ["distill", "--target", "{target}", "-o", "{tmp}/draft",
                                                            "--dtype", "bf16"], 2, "--dtype is not distill's",
         "Leave it out: distill trains and writes the draft in fp32; give `compile --precision` for the bundle's."),
    Case("a prompt with spaces, unquoted (`-p def fib(n):`), or several values after one option (`--choice yes no`)",
         ["generate", "{bundle}", "-p", "def", "fib(n):"], 2, "an option takes one value, so quote",
         'Quote the value (`-p "def fib(n):"`); repeat the option for each value (`--choice yes --choice no`).'),
    Case("`specbuild compile --recipe R` where R has no `output`", ["compile", "--recipe", "{recipe}"], 1,
         "missing --output", "Add `output = ...` to the recipe's `[compile]` table or pass `--output`.",
         setup=recipe("", output="")),
    Case('recipe `overwrite = "false"` (a string)', ["compile", "--recipe", "{recipe}"], 1,
         "line 6: overwrite must be true or false, not the string 'false'", "Write TOML booleans bare: `overwrite = false`.",
         setup=recipe('overwrite = "false"\n')),
    Case('recipe `gamma = "8"` (a string)', ["compile", "--recipe", "{recipe}"], 1,
         "line 6: gamma must be a whole number from 1 to 32, not the string '8'", "Write numbers bare: `gamma = 8`.",
         setup=recipe('gamma = "8"\n')),
    Case("recipe with an unknown key", ["compile", "--recipe", "{recipe}"], 1, "unknown [compile] keys ['gama']",
         "Use one of the keys the message lists (the options' names with `_`).", setup=recipe("gama = 4\n")),
    Case("recipe `tp = 2` without a TensorRT-LLM backend", ["compile", "--recipe", "{recipe}"], 1,
         "pair.toml line 6: tp 2 splits the TensorRT-LLM export",
         'Add `backend = "tensorrt-llm"` (or `"all"`) to the recipe, or leave `tp` out.', setup=recipe("tp = 2\n")),
    Case("recipe `block_size = 64` (or `accuracy_level`, or `quality_report = true`) without quantization",
         ["compile", "--recipe", "{recipe}"], 1,
         "pair.toml line 6: block_size and accuracy_level shape quantized engines",
         'Add `quantize = "int4"` (or `"int8"`) to the recipe, or leave that key out (`quality_report = false` may stay).',
         setup=recipe("block_size = 64\n")),
    Case("recipe with `[[compile]]` tables (several builds)", ["compile", "--recipe", "{recipe}"], 1,
         "[[compile]] makes an array of tables; a recipe holds one [compile] table", "Write a recipe for each build.",
         setup=write_file("recipe", b'[[compile]]\noutput = "a"\n[[compile]]\noutput = "b"\n')),
    Case("recipe with an unknown table (`[compiler]`)", ["compile", "--recipe", "{recipe}"], 1,
         "unknown table 'compiler'", "Put compile settings in `[compile]` (the demo pair's in `[pair]`).",
         setup=recipe("[compiler]\ngamma = 4\n")),
    Case("a recipe path `~user/...` for a user this machine lacks (or `~` with neither HOME nor a passwd entry)",
         ["compile", "--recipe", "{recipe}"], 1, "line 4: output '~no-such-user-specbuild/bundle'",
         "Write the path out, or relative to the recipe's folder.",
         setup=recipe("", output='"~no-such-user-specbuild/bundle"')),
    Case('a recipe path naming an environment variable (`output = "$OUT/bundle"`)', ["compile", "--recipe", "{recipe}"], 1,
         "line 4: output '$OUT/bundle' names the environment variable $OUT, which recipes do not expand",
         'Write the path out, or pass it on the command line, where the shell expands it: `--output "$OUT/bundle"`.',
         setup=recipe("", output='"$OUT/bundle"')),
    Case('a recipe path holding a NUL character (`output = "bundle\\u0000"`)', ["compile", "--recipe", "{recipe}"], 1,
         "line 4: output must be a path, which cannot hold a NUL character",
         "Remove the `\\u0000` escape from the path.", setup=recipe("", output='"bundle\\u0000x"')),
    Case("a recipe that is not TOML", ["compile", "--recipe", "{recipe}"], 1, "cannot be read",
         "Fix the TOML at the line and column named.", setup=recipe("gamma = = 4\n")),
    Case("a recipe nested thousands of arrays or tables deep", ["compile", "--recipe", "{recipe}"], 1, "cannot be read",
         "Write a recipe of plain keys (see Recipes).", setup=recipe("x = " + "[" * 3000 + "]" * 3000 + "\n")),
    # --- checkpoints ------------------------------------------------------------------------------------
    Case("a checkpoint with only pickled weights (`*.bin`)", compile_args(), 1, "reads safetensors only",
         SAFE, setup=a_copy_of("target", only_a_pickle)),
    Case("`verify --target` a checkpoint with only pickled weights",
         ["verify", "{bundle}", "--target", "{target}", "--prompts", "{prompts}", "-n", "4"], 1,
         "cannot be loaded from safetensors", SAFE, setup=lambda paths: (a_copy_of("target", only_a_pickle)(paths),
                                                                        write_file("prompts", PROMPT)(paths))),
    Case("`bench --peers transformers` on a bundle whose source holds only pickled weights",
         ["bench", "{bundle}", "--peers", "transformers", "--prompts", "{prompts}", "-n", "4", "--gamma", "1"], 1,
         "reads safetensors only", SAFE,
         setup=lambda paths: (source_only_a_pickle(paths), write_file("prompts", PROMPT)(paths))),
    Case("`verify --target` a checkpoint of another model (a smaller vocabulary)",
         ["verify", "{bundle}", "--target", "{draft}", "--prompts", "{prompts}", "-n", "4"], 1, "embedding rows",
         "Pass the checkpoint the bundle was compiled from (`specbuild inspect` shows its path).",
         setup=lambda paths: (other_tokenizer(paths), write_file("prompts", PROMPT)(paths))),
    Case('a prompts file with `{"prompt": 5}`', ["bench", "{bundle}", "--prompts", "{prompts}", "-n", "4"], 1,
         '"prompt" must be a non-empty string', 'Give each line as `{"prompt": "text"}`.',
         setup=write_file("prompts", b'{"prompt": 5}\n')),
    Case("a prompts file with a prompt longer than the bundle's context", ["bench", "{bundle}", "--prompts", "{prompts}",
         "-n", "4"], 1, "prompt 2 of 2", "Shorten that prompt, or recompile with the `--max-seq-len` the message names.",
         setup=write_file("prompts", PROMPT + b'{"prompt": "' + b"x " * 300 + b'"}\n')),
    Case("`bench --plot out.txt` (a format matplotlib does not write)", ["bench", "{bundle}", "--plot", "{tmp}/out.txt"],
         2, "does not end in a format matplotlib writes", "Name the plot `.png` (or `.svg`, `.pdf`): checked before the run."),
    Case("`bench --json` into a folder that does not exist", ["bench", "{bundle}", "--json", "{tmp}/no/such/report.json"],
         2, "does not exist", "Create the folder or write elsewhere: checked before the run."),
    Case("`bench --peers transformers` when the bundle's source checkpoint has moved",
         ["bench", "{bundle}", "--peers", "transformers", "--prompts", "{prompts}", "-n", "4", "--gamma", "1"], 1,
         "which no longer exists", "Put the checkpoint back where the message says, or recompile the bundle from "
         "where it is now.", setup=lambda paths: (source_elsewhere(None)(paths), write_file("prompts", PROMPT)(paths))),
    Case("`verify` without `--target` when the bundle's source checkpoint has moved",
         ["verify", "{bundle}", "--prompts", "{prompts}", "-n", "4"], 1, "or pass its folder as --target",
         "Pass the checkpoint's new folder as `--target`, or put it back where the message says.",
         setup=lambda paths: (source_elsewhere(None)(paths), write_file("prompts", PROMPT)(paths))),
    Case("`bench --peers transformers` when the bundle's source checkpoint has changed",
         ["bench", "{bundle}", "--peers", "transformers", "--prompts", "{prompts}", "-n", "4", "--gamma", "1"], 1,
         "have changed since", "Recompile the bundle from the checkpoint as it is now (peers would run another model).",
         setup=lambda paths: (source_elsewhere(add_a_config_key)(paths), write_file("prompts", PROMPT)(paths))),
    Case("`distill --target` a checkpoint with only pickled weights",
         ["distill", "--target", "{target}", "--output", "{tmp}/draft", "--minutes", "0.01"], 1, "safetensors", SAFE,
         setup=a_copy_of("target", only_a_pickle)),
    Case("`distill --target` a checkpoint whose fp32 weights alone outgrow the machine's (or container's) memory",
         ["distill", "--target", "{target}", "--output", "{tmp}/draft", "--minutes", "0.01"], 1,
         "as distill holds it (fp32)", "Run distill on a machine with more memory (refused before loading).",
         setup=a_copy_of("target", beyond_memory)),
    Case("`distill` without `--prompts` or `--data`, of a target whose tokenizer has no bos or eos token",
         ["distill", "--target", "{target}", "--output", "{tmp}/draft", "--minutes", "0.01"], 1, "no bos or eos token",
         "Give `--prompts` or `--data`: the target's own samples have no token to begin from.",
         setup=a_copy_of("target", without_bos_or_eos)),
    Case("`distill --output` its own target (or a folder holding it, or one inside it)",
         ["distill", "--target", "{target}", "--output", "{target}", "--minutes", "0.01", "--overwrite"], 1,
         "is the target", "Choose an output outside the target, `--init`, `--prompts` and `--data`."),
    Case("`distill --output` inside a file", ["distill", "--target", "{target}", "--output", "{tmp}/notes/todo.txt/draft",
                                            "--minutes", "0.01"], 1, "is a file",
         "Choose an output whose parent folders are folders (refused before any training).", setup=a_folder_with_a_file),
    Case("`distill --output` a folder that is not a checkpoint", ["distill", "--target", "{target}", "--output",
                                                                   "{tmp}/notes", "--minutes", "0.01", "--overwrite"], 1,
         "is not a checkpoint", "Move the folder away or choose another `--output`: `--overwrite` replaces only "
         "checkpoints (folders with a model's `config.json`).", setup=a_folder_with_a_file),
    Case("a checkpoint with a `pytorch_model.bin` beside its safetensors", compile_args(), 0, "",
         "Nothing: specbuild reads the safetensors and never opens the pickle.", setup=a_copy_of("target", plant_pickle)),
    Case("`verify --target` a checkpoint with a `pytorch_model.bin` beside its safetensors",
         ["verify", "{bundle}", "--target", "{target}", "--prompts", "{prompts}", "-n", "4"], 0, "",
         "Nothing: the pickle is never opened.",
         setup=lambda paths: (a_copy_of("target", plant_pickle)(paths), write_file("prompts", PROMPT)(paths))),
    Case("a checkpoint folder that does not exist", compile_args(), 1, "is not a folder",
         "Pass a Hugging Face checkpoint folder.", setup=lambda paths: shutil.rmtree(paths["target"])),
    Case("a typo in a checkpoint's path, beside the checkpoint (`checkpoints/targt` for `checkpoints/target`)",
         ["compile", "--target", "{target_parent}/targt", "--draft", "{draft}", "-o", "{tmp}/bundle"], 1,
         "targt is not a folder; pass a Hugging Face checkpoint folder; did you mean ",
         "Pass the folder the message names, if it is the one you meant."),
    Case("a Hugging Face Hub model id as `--target` (`meta-llama/Llama-3.2-1B`)",
         ["compile", "--target", "meta-llama/Llama-3.2-1B", "--draft", "{draft}", "-o", "{tmp}/bundle"], 1,
         "hf download meta-llama/Llama-3.2-1B --local-dir DIR", "Download the model first and pass its folder: specbuild "
         "reads local folders only."),
    Case("a specbuild bundle as `--target` (or `--draft`)",
         ["compile", "--target", "{bundle}", "--draft", "{draft}", "-o", "{tmp}/bundle"], 1, "is a specbuild bundle, not a "
         "checkpoint", "Pass the checkpoint folder the bundle was compiled from (`specbuild inspect` names it)."),
    Case("a checkpoint without `config.json`", compile_args(), 1, "has no config.json",
         "Pass a Hugging Face checkpoint folder.", setup=a_copy_of("target", lambda f: (f / "config.json").unlink())),
    Case("a checkpoint without weights", compile_args(), 1, "has no *.safetensors weights; download or copy the whole",
         "Pass a complete checkpoint folder.",
         setup=a_copy_of("target", lambda f: next(f.glob("*.safetensors")).unlink())),
    Case("an architecture without a graph builder", compile_args(), 1, "which specbuild does not compile",
         "Use a checkpoint of an architecture the message lists (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Mixtral, "
         "Phi-3, Gemma 2, Gemma 3, Granite, OLMo 2, OLMo 3 or GPT-2).", setup=a_copy_of("target", falcon)),
    Case("`config.json` without `architectures`", compile_args(), 1, "names no architecture",
         "Add the model's class to config.json, e.g. `\"architectures\": [\"LlamaForCausalLM\"]`.",
         setup=a_copy_of("target", without_architectures)),
    Case("a pre-quantized checkpoint (AWQ, GPTQ, FP8)", compile_args(), 1, "pre-quantized",
         "Pass the fp32, fp16 or bf16 checkpoint; `--quantize int4|int8` quantizes it.",
         setup=a_copy_of("target", pre_quantized)),
    Case("a checkpoint with weights stored in another type (float64; fp8, int8 or bool without a "
         "`quantization_config`)", compile_args(), 1,
         "is stored as float64; specbuild reads weights stored as fp32, fp16 or bf16",
         "Save the checkpoint in fp32, fp16 or bf16 (`model.to(torch.bfloat16).save_pretrained(dir)`); `--quantize "
         "int4|int8` quantizes it.", setup=a_copy_of("target", a_weight_in_float64)),
    Case("`tie_word_embeddings: true` beside a stored `lm_head.weight` of other values", compile_args(), 1,
         "ties the LM head to the embeddings", "Say which head is meant: `\"tie_word_embeddings\": false` keeps the stored "
         "one, removing `lm_head.weight` keeps the embeddings (transformers 4 and 5 differ here).",
         setup=a_copy_of("target", tied_beside_a_head)),
    Case("tensors the architecture's graph would not read (a variant not supported)", compile_args(), 1,
         "does not use", "Use a checkpoint of a supported variant (the message names the first tensors left over).",
         setup=gemma_with_biases),
    Case("biases stored in a Mistral or Phi-3 checkpoint whose config.json asks for them (`attention_bias`, "
         "`mlp_bias`)", compile_args(), 1, "stores biases", "Remove those tensors, or set the key false in "
         "config.json: transformers' model has no such biases and drops them (vLLM, running it as a Llama, adds "
         "them).", setup=mistral_with_biases),
    Case("a tokenizer only as `tokenizer.model` (sentencepiece), no `tokenizer.json`", compile_args(), 1,
         "only as tokenizer.model", "`pip install sentencepiece` (transformers converts the file with it), or add the "
         "model's `tokenizer.json`.", setup=a_copy_of("target", sentencepiece_only)),
    Case("target and draft swapped (a draft of over 1.25× the target's parameters)", compile_args(), 1, "more than the target",
         "Give the model whose output you want as `--target` and a smaller one as `--draft`.", setup=a_larger_draft),
    Case("a draft saved without tokenizer files (a pruned or layer-sliced one: `save_pretrained` of the model alone)",
         compile_args(), 0, "", "Nothing: it speaks the target's tokenizer, as in vLLM and TensorRT-LLM (compile checks its "
         "embedding rows, and the bos, eos and pad ids of its config.json, against that tokenizer).",
         setup=a_copy_of("draft", without_tokenizer_files)),
    Case("a target saved without tokenizer files", compile_args(), 1, "has no usable tokenizer",
         "Copy the model's tokenizer files (`tokenizer.json`, `tokenizer_config.json`) into the folder the message names.",
         setup=a_target_without_tokenizer_files),
    Case("a draft saved without tokenizer files whose embedding rows (or bos, eos, pad ids) do not fit the target's "
         "tokenizer", compile_args(), 1, "has no tokenizer files",
         "Use a draft trained with the target's tokenizer (one without tokenizer files is taken to speak the target's).",
         setup=a_draft_of_another_vocabulary_without_tokenizer_files),
    Case("a draft with another tokenizer", compile_args(), 1, "different tokenizers",
         "Use a draft trained with the target's tokenizer (`specbuild distill` makes one).", setup=other_tokenizer),
    Case("a draft (or target) whose `layer_types` slide without a `sliding_window`", compile_args(), 1,
         "transformers cannot build its cache from its config.json", "Fix `layer_types`, `sliding_window` and "
         "`attention_chunk_size` in the config.json the message names: transformers' own generate fails on it too.",
         setup=a_copy_of("draft", sliding_without_a_window)),
    Case("truncated `*.safetensors`", compile_args(), 1, "model.safetensors",
         "Download or copy the checkpoint again.", setup=a_copy_of("draft", truncate_weights)),
    Case("`verify --target` (or `distill --target`) a checkpoint with a truncated `*.safetensors`",
         ["verify", "{bundle}", "--target", "{target}", "--prompts", "{prompts}", "-n", "4"], 1, "truncated or corrupt",
         "Download or copy the checkpoint again.",
         setup=lambda paths: (a_copy_of("target", truncate_weights)(paths), write_file("prompts", PROMPT)(paths))),
    Case("corrupt `*.safetensors` header", compile_args(), 1, "model.safetensors",
         "Download or copy the checkpoint again.", setup=a_copy_of("draft", garble_weights_header)),
    Case("an empty `*.safetensors` (a copy cut short before its first byte)", compile_args(), 1, "it has 0 bytes",
         "Download or copy the checkpoint again.", setup=a_copy_of("draft", empty_weights)),
    Case("a sharded checkpoint without a shard its index names (compile, or `verify`/`distill --target`)", VERIFY, 1,
         "names model-00002-of-00002.safetensors, which is not in", "Download or copy the checkpoint again.",
         setup=lambda paths: (sharded_target(drop_a_shard)(paths), write_file("prompts", PROMPT)(paths))),
    Case("a `model.safetensors.index.json` that is not JSON (compile, or `verify`/`distill --target`)", VERIFY, 1,
         "is not a safetensors index (JSONDecodeError", "Download or copy the checkpoint again.",
         setup=lambda paths: (sharded_target(garble_index)(paths), write_file("prompts", PROMPT)(paths))),
    Case("a `config.json` that is not JSON (compile, or `verify`/`distill --target`)", VERIFY, 1,
         "config.json is not valid JSON", "Download or copy the checkpoint again.",
         setup=lambda paths: (a_copy_of("target", garble_config)(paths), write_file("prompts", PROMPT)(paths))),
    Case("a tensor missing from the checkpoint", compile_args(), 1, "layers.1.mlp",
         "The checkpoint does not match its config.json: get a complete one.",
         setup=a_copy_of("draft", drop_a_tensor)),
    Case("malformed `generation_config.json`", compile_args(), 1, "generation_config.json",
         "Fix or delete the file (the eos ids then come from config.json).",
         setup=a_copy_of("target", malformed_generation_config)),
    # --- bundles and requests ---------------------------------------------------------------------------
    Case("a folder that is not a bundle", ["generate", "{tmp}", "-p", "x"], 1, "manifest.json is missing",
         "Pass the folder `specbuild compile` wrote."),
    Case("a file of a bundle (`bundle/target.onnx`, as llama.cpp takes a `.gguf`) where the bundle goes",
         ["generate", "{bundle}/target.onnx", "-p", "x"], 1, "is a file, not a bundle folder; pass the bundle folder "
         "that holds it", "Pass the bundle's folder, the one holding `manifest.json`."),
    Case("a bundle path that does not exist (a typo)", ["generate", "{tmp}/bundel", "-p", "x"], 1, "bundel does not exist",
         "Pass the folder `specbuild compile --output` wrote."),
    Case("a typo in a bundle's path, beside the bundle (`bundlex` for `bundle`)", ["generate", "{bundle}x", "-p", "x"],
         1, "wrote; did you mean ",
         "Pass the folder the message names, if it is the one you meant."),
    Case("the output of a compile still running, or killed mid-way", ["generate", "{tmp}/bundle", "-p", "x"], 1,
         "bundle does not exist yet: a compile to it has not finished (it runs still, or was killed) and left "
         ".bundle.partial-4242 beside it",
         "Wait for that compile, or rerun it if it was killed (it removes the folder it left); delete that folder only "
         "once no compile to it runs.",
         setup=a_killed_compile),
    Case("the staging folder of a compile still running or killed (`.bundle.partial-PID`) where a bundle goes",
         ["generate", "{tmp}/.bundle.partial-4242", "-p", "x"], 1,
         "is the staging folder of an unfinished compile to", "Pass that compile's `--output` once it finished, "
         "rerunning it if it was killed (it removes the folder); delete the folder only once no compile to that output "
         "runs.", setup=a_killed_compile),
    Case("a checkpoint folder where a bundle goes", ["generate", "{target}", "-p", "x"], 1, "is a Hugging Face checkpoint",
         "Compile it with a draft first; pass the folder `specbuild compile` wrote."),
    Case("a bundle file changed after compiling", ["generate", "{bundle}", "-p", "x", "-n", "4"], 1, "corrupted",
         "Rebuild the bundle with `specbuild compile`.", setup=a_copy_of("bundle", corrupt_bundle_weights)),
    Case("a bundle whose `manifest.json` is not JSON", ["generate", "{bundle}", "-p", "x"], 1, "is not valid JSON",
         "Rebuild the bundle into a new folder, or delete this one first (`--overwrite` replaces only a readable bundle).",
         setup=a_copy_of("bundle", lambda f: (f / "manifest.json").write_text("{ not json"))),
    Case("a bundle missing an engine file", ["generate", "{bundle}", "-p", "x"], 1, "draft.onnx is missing",
         "Rebuild the bundle with `specbuild compile`.", setup=a_copy_of("bundle", lambda f: (f / "draft.onnx").unlink())),
    Case("a bf16 bundle on the CPU (`generate`, `bench`, `serve`, `verify`)", ["generate", "{bundle}", "-p", "x"], 1,
         "is bf16, which onnxruntime's CPU provider cannot run", "Run it on a CUDA GPU (`--device cuda`), or compile "
         "it with `--precision fp32` for a CPU (`inspect` and compile's summary say where a bundle runs).",
         setup=bf16_bundle),
    Case("an edited `manifest.json` (shapes that do not match the engines)", ["generate", "{bundle}", "-p", "x", "-n", "4"],
         1, "manifest", "Rebuild the bundle; never edit a manifest by hand.",
         setup=a_copy_of("bundle", edit_manifest_vocab)),
    Case("`generate --chat` on a bundle whose tokenizer has no chat template", ["generate", "{bundle}", "-p", "x", "--chat"],
         1, "has no chat template", "Give one with `--chat-template` (as `serve` takes it), or the prompt as text, without "
         "`--chat` (the bundle is fine; its target has no chat template)."),
    Case("`chat` on a bundle whose tokenizer has no chat template", ["chat", "{bundle}"], 1, "has no chat template",
         "Give one with `--chat-template` (as `serve` takes it; the bundle is fine, its target has no chat template)."),
    Case("`chat --system` with a chat template that has no system role (Gemma's)",
         ["chat", "{bundle}", "--chat-template", "{template}", "--system", "Be brief."], 1,
         "--system: the chat template rejected the messages: System role not supported",
         "Leave `--system` out (say it in your first turn), or give a template that takes a system message with "
         "`--chat-template` (checked before the first turn).", setup=write_file("template", NO_SYSTEM_ROLE)),
    Case("`chat --system` too long to leave room for a turn in the bundle's context",
         ["chat", "{bundle}", "--chat-template", "{template}", "--system", "word " * 300], 1,
         "--system leaves no room for a turn in the bundle's context of 256 tokens",
         "Shorten it, or recompile with a larger `--max-seq-len` (checked before the first turn).",
         setup=write_file("template", CHAT_TEMPLATE)),
    Case("`--chat-template` a file that does not exist (`serve` or `generate --chat`)",
         ["serve", "{bundle}", "--chat-template", "{tmp}/templates/chatml.jinja"], 2, "looks like a file path",
         "Give the template's file, or the template text itself: a value without `{`, `}` or a newline is taken for a "
         "path, as in vLLM (checked before the bundle loads)."),
    Case("`--chat-template` a file that is not UTF-8", ["serve", "{bundle}", "--chat-template", "{template}"], 2,
         "is not UTF-8", "Save the template as UTF-8.", setup=write_file("template", b"{{ bos_token }}\xff")),
    Case("`--chat-template` a template jinja2 cannot parse",
         ["generate", "{bundle}", "-p", "x", "--chat", "--chat-template", "{{% for m in messages %}}{{{{ m }}}}"], 2,
         "does not compile", "Fix the template at the line the message names (a file's or the text given)."),
    Case("`generate --chat-template` without `--chat`", ["generate", "{bundle}", "-p", "x", "--chat-template", "{{{{ x }}}}"],
         2, "give --chat too", "Add `--chat`: the template renders the prompt as a chat message; a plain prompt is sent "
         "as it is."),
    Case("a prompt longer than the bundle's context", ["generate", "{bundle}", "-p", "x " * 300, "-n", "4"], 1,
         "--max-seq-len", "Shorten the prompt or recompile with the `--max-seq-len` the message names (at most the "
         "longest context compile takes for these models)."),
    Case("a prompt longer than any context of the bundle's models", ["generate", "{bundle}", "-p", "x " * 600, "-n", "4"],
         1, "no context of these models can hold it", "Shorten the prompt to the bundle's context the message names, "
         "or to the models' longest after recompiling with it: compile refuses a longer context for these models."),
    Case("`--max-new-tokens 0`", ["generate", "{bundle}", "-p", "x", "-n", "0"], 2, "x>=1",
         "Ask for at least one token."),
    Case("`--temperature nan`", ["generate", "{bundle}", "-p", "x", "--temperature", "nan"], 2, "not a finite number",
         "Give 0 (greedy) or a positive number."),
    Case("`--temperature 1e39` (beyond float32, where it is inf)",
         ["generate", "{bundle}", "-p", "x", "--temperature", "1e39"], 2, "beyond float32's largest number",
         "Give 0 (greedy) or a positive number up to 3.4e38."),
    Case("`--top-p 0` or above 1", ["generate", "{bundle}", "-p", "x", "--top-p", "0"], 2, "--top-p",
         "Give a number in (0, 1]; 1 keeps the whole distribution."),
    Case("`--presence-penalty` or `--frequency-penalty` outside [-2, 2]",
         ["generate", "{bundle}", "-p", "x", "--presence-penalty", "3"], 2, "--presence-penalty",
         "Give a number in [-2, 2], as OpenAI's API takes it; 0 applies none."),
    Case("`--repetition-penalty 0` (or below)", ["generate", "{bundle}", "-p", "x", "--repetition-penalty", "0"], 2,
         "--repetition-penalty", "Give a number above 0; 1 applies none, above 1 discourages repeats."),
    Case("`--min-tokens` above `--max-new-tokens`", ["generate", "{bundle}", "-p", "x", "-n", "2", "--min-tokens", "5"], 2,
         "--min-tokens 5 is above --max-new-tokens 2", "Give at most `--max-new-tokens` as `--min-tokens`."),
    Case("`--stop ''` (an empty stop string; also a seventeenth `--stop`)", ["generate", "{bundle}", "-p", "x", "--stop", ""], 2,
         "must not be empty", "Give each stop string some text, at most 16 of them."),
    Case("`--gamma` above the bundle's maximum", ["generate", "{bundle}", "-p", "x", "--gamma", "9"], 1, "gamma",
         "Give at most the bundle's max gamma (`specbuild inspect`) or recompile with a larger `--gamma`."),
    Case("`--gamma ²` (a digit-like character that is not a number)", ["generate", "{bundle}", "-p", "x", "--gamma", "²"], 2,
         "is not 'auto' or a whole number", "Give `auto` or a whole number in digits."),
    Case("`--top-p` or `--top-k` without `--temperature`", ["generate", "{bundle}", "-p", "x", "--top-p", "0.9"], 2,
         "give --temperature too", "Add `--temperature` (1 samples from the model as it is); without it decoding is greedy."),
    Case("`--top-k` (or `--top-p`, `--min-p`) with `--temperature 0`",
         ["generate", "{bundle}", "-p", "x", "--temperature", "0", "--top-k", "5"], 2,
         "--temperature 0 decodes greedily: give a larger one",
         "Give a positive `--temperature` (1 samples from the model as it is), or leave `--top-k` out to decode "
         "greedily."),
    Case("`--seed` without `--temperature` (generate or bench)",
         ["generate", "{bundle}", "-p", "x", "-n", "4", "--seed", "1"], 0, "",
         "Nothing: greedy decoding (the default) draws no random numbers, so the seed changes nothing (as in vLLM and "
         "`serve`); add `--temperature` to sample with it."),
    Case("`--top-k -1` (vLLM's no limit)",
         ["generate", "{bundle}", "-p", "x", "-n", "4", "--temperature", "1", "--top-k", "-1"], 0, "",
         "Nothing: -1 keeps every token, as 0 does (also `top_k=-1` in the Python API and the server)."),
    Case("`--seed -1`", ["generate", "{bundle}", "-p", "x", "-n", "4", "--temperature", "1", "--seed", "-1"], 0, "",
         "Nothing: -1 samples with a random seed, as llama.cpp's `--seed -1` and as no `--seed` (also `seed=-1` in "
         "the Python API and a server request)."),
    Case("`--seed` below -1", ["generate", "{bundle}", "-p", "x", "--temperature", "1", "--seed", "-2"], 2,
         "is not a seed: give a whole number >= 0, or -1 for a random seed",
         "Give a seed of 0 or more to reproduce a run, or -1 for a random one."),
    Case("a prompt that is not UTF-8", ["generate", "{bundle}", "-p", "\udcff\udcfe"], 2, "not valid UTF-8",
         "Pass text in UTF-8."),
    Case('demo recipe `[pair] lr = "fast"` (a string)', ["demo", "--cache", "{tmp}/cache", "--recipe", "{recipe}"], 1,
         "line 12: [pair] lr must be a positive number, not the string 'fast'", "Write numbers bare: `lr = 3e-3`.",
         setup=write_file("recipe", (README.parent / "specbuild" / "recipes" / "demo.toml").read_bytes().replace(
             b"lr = 3e-3 ", b'lr = "fast"'))),
    Case("`demo --prompt` that is not UTF-8", ["demo", "--cache", "{tmp}/cache", "--recipe", "{recipe}", "-p", "\udcff\udcfe"],
         2, "not valid UTF-8", "Pass text in UTF-8 (checked before the demo pair is made or loaded).",
         setup=write_file("recipe", b"[pair]\n")),  # no pair to train: without the check, a one-line error
    Case("`bench -n 1`", ["bench", "{bundle}", "-n", "1"], 2, "x>=2",
         "Give at least 2 tokens: decoding speed is measured after the first."),
    Case("`bench --peers` with an unknown peer", ["bench", "{bundle}", "--peers", "vllm"], 2, "is not one of",
         "Use transformers, onnxruntime-genai and/or llama.cpp."),
    Case("`bench --gamma ''` (no fixed γ)", ["bench", "{bundle}", "--gamma", ""], 2, "give at least one γ",
         "Give the fixed γ values to measure, e.g. `--gamma 1,2,4,8` (target-only and auto are measured anyway)."),
    Case("a prompts file that is not JSONL", ["bench", "{bundle}", "--prompts", "{prompts}"], 1,
         'is not a JSON object with a "prompt" field', 'Write one `{"prompt": "..."}` per line.',
         setup=write_file("prompts", b"def f():\n")),
    Case("a prompts file with a number of over 4300 digits", ["bench", "{bundle}", "--prompts", "{prompts}", "-n", "4"], 1,
         "cannot be read as JSON", "Write the number as a string, or leave it out: only \"prompt\" is read.",
         setup=write_file("prompts", b'{"prompt": "x", "id": ' + b"1" * 5000 + b"}\n")),
    Case("a prompts file that is not UTF-8", ["bench", "{bundle}", "--prompts", "{prompts}"], 1, "not UTF-8",
         "Save the file as UTF-8.", setup=write_file("prompts", b'{"prompt": "\xff"}\n')),
    Case("`serve --host` with an empty or over-long name label (`127.0.0..1`)", ["serve", "{bundle}", "--host", "127.0.0..1"],
         1, "cannot listen on 127.0.0..1", "Give an address or a host name this machine has (checked before loading)."),
    Case("`serve --api-key` with spaces around it or characters beyond ASCII", ["serve", "{bundle}", "--api-key", " key"],
         2, "printable ASCII", "Give the key as clients send it in their `Authorization: Bearer` header."),
    Case("`serve --model-name ''` (empty or only spaces)", ["serve", "{bundle}", "--model-name", ""], 2, "must not be empty",
         "Give the name clients send, or leave `--model-name` out to serve under the bundle folder's name."),
    Case("a `vllm serve` option with no counterpart here (`serve --tensor-parallel-size 2`; also `-tp`, "
         "`--max-model-len`, `--gpu-memory-utilization`, `--dtype`, `--quantization`, `--enforce-eager`)",
         ["serve", "{bundle}", "--tensor-parallel-size", "2"], 2, "is vLLM's option, which this server does not take",
         "Do what the message says instead: the context, precision and quantization are the bundle's (set by "
         "`compile`), a bundle runs on one device, and `--no-cuda-graphs` is `--enforce-eager`."),
    Case("a prompts file with a `\\ud83d` escape (half of a surrogate pair, e.g. a cut emoji)",
         ["bench", "{bundle}", "--prompts", "{prompts}", "-n", "4"], 1, "is not valid UTF-8",
         "Escape both halves of the pair (`\\ud83d\\ude00`) or write the character itself.",
         setup=write_file("prompts", b'{"prompt": "def f(): \\ud83d"}\n')),
    Case("a prompts file whose prompts hold U+2028 or U+0085 unescaped (`json.dumps(..., ensure_ascii=False)`)",
         ["verify", "{bundle}", "--target", "{target}", "--prompts", "{prompts}", "-n", "4"], 0, "",
         "Nothing: a line ends at `\\n` (or `\\r\\n`) only, as in JSON Lines.",
         setup=write_file("prompts", '{"prompt": "x = 1\u2028y = 2"}\n{"prompt": "caf\x85"}\n'.encode())),
    # --- the Python API (one place validates requests for the API, the CLI and the server) ----------------
    Case("token id -1 in a prompt", None, 1, "-1", "Token ids are 0 to the vocabulary size - 1.",
         call=lambda d, b: d.generate([5, -1], 4)),
    Case("a token id at or above the vocabulary size", None, 1, "vocab",
         "Token ids are 0 to the vocabulary size - 1.", call=lambda d, b: d.generate([5, 10**6], 4)),
    Case("float token ids", None, 1, "whole numbers", "Pass a list of ints (or a str).",
         call=lambda d, b: d.generate([5.0, 7.9], 4)),
    Case("a `bytes` prompt", None, 1, "bytes", "Decode it to str first (or pass token ids).",
         call=lambda d, b: d.generate(b"def f():", 4)),
    Case("`parallel=` more slots than memory holds (also `serve --parallel`)", None, 1, "of KV caches",
         "Use fewer slots, or compile with a shorter `--max-seq-len`.", call=lambda d, b: type(d)(b, parallel=10**7)),
    Case("a stop string of over 1000 characters", None, 1, "at most 1000 are taken",
         "Stop strings are a few characters: cut it (text is held back while it may become one).",
         call=lambda d, b: d.generate("x", 4, stop=["y" * 1001])),
    Case("`max_new_tokens=2.5`", None, 1, "max_new_tokens", "Pass a positive int.",
         call=lambda d, b: d.generate("x", 2.5)),
    Case("`temperature=float('nan')`", None, 1, "temperature", "Pass 0 (greedy) or a positive finite number.",
         call=lambda d, b: d.generate("x", 4, temperature=float("nan"))),
    Case("`repetition_penalty=1.2` on a bundle compiled before penalties", None, 1,
         "repetition_penalty needs a bundle compiled with sampling penalties",
         "Recompile the bundle with `specbuild compile`, or leave the penalties at 1, 0 and 0.",
         call=lambda d, b: type(d)(before_penalties(b)).generate("x", 4, repetition_penalty=1.2)),
    Case('`structured_outputs={"regex": "("}` (a grammar llguidance cannot compile; `serve` answers a 400)', None, 1,
         "structured_outputs is not a grammar llguidance compiles",
         "Fix the grammar at the place the message names (JSON schema, regex, Lark or GBNF).",
         call=lambda d, b: d.generate("x", 4, structured_outputs={"regex": "("})),
    Case("`structured_outputs` with `ignore_eos=True` or `min_tokens`", None, 1, "ends where its grammar does",
         "Leave `ignore_eos` and `min_tokens` out: a grammar that has ended allows only an eos.",
         call=lambda d, b: d.generate("x", 4, ignore_eos=True, structured_outputs={"choice": ["yes", "no"]})),
    Case("`gamma=10**9`", None, 1, "gamma", "Pass `auto` or 0 to the bundle's max gamma.",
         call=lambda d, b: d.generate("x", 4, gamma=10**9)),
    Case("one `Stats` passed to a second call (`stream(..., stats=stats)` in a loop)", None, 1,
         "pass a new Stats() to each call", "Pass a new `Stats()` to each call: one measures one request.",
         call=lambda d, b: stream_twice(d)),
    Case('`device="gpu"`', None, 1, "device", 'Use "cpu", "cuda" or "auto".',
         call=lambda d, b: type(d)(b, device="gpu")),
]
for case in CASES:
    case.id = re.sub(r"[^a-z0-9]+", "-", case.given.lower()).strip("-")


def params(kind_is_cli: bool):
    return [pytest.param(c, id=c.id) for c in CASES if (c.args is not None) == kind_is_cli]


@pytest.fixture(scope="module")
def cli_results(tmp_path_factory, checkpoints, bundles, cli):
    """Every CLI case prepared in its own folder, then all run in the CLI process: {case id: result}."""
    cases, held = [], []
    for case in (c for c in CASES if c.args is not None):
        tmp = tmp_path_factory.mktemp(case.id[:40])
        target = tmp_path_factory.mktemp("ckpt") / "target"
        shutil.copytree(checkpoints("llama"), target)
        paths = {"tmp": tmp, "target": target, "target_parent": target.parent, "draft": checkpoints("llama", 1),
                 "bundle": bundles("llama", 1)}
        if case.setup:
            case.setup(paths)
        held += [paths.pop("held")] if "held" in paths else []
        before = snapshot(paths)
        cases.append((case, [a.format(**paths) for a in case.args], paths, before))
    try:
        results = cli.run([args for _, args, _, _ in cases], watch=tmp_path_factory.getbasetemp())
    finally:
        for lock in held:
            lock.close()
    return {case.id: {**result, "changed": snapshot(paths) != before,
                      "unpickled": (Path(paths["target"]).parent / MARKER).exists()}
            for (case, _, paths, before), result in zip(cases, results)}


def snapshot(paths: dict) -> dict:
    """Every file under the case's folders with its size and mtime: what a failed command must not change."""
    files = {}
    for key in ("tmp", "target", "draft", "bundle"):
        root = Path(paths[key])
        for path in sorted(root.rglob("*")) if root.is_dir() else []:
            if path.is_file() and path.name != ".bundle.lock":
                stat = path.stat()
                files[str(path)] = (stat.st_size, stat.st_mtime_ns)
    return files


@pytest.mark.parametrize("case", params(kind_is_cli=True))
def test_bad_command_line_input_is_one_line_with_its_exit_status_and_changes_nothing(case, cli_results):
    result = cli_results[case.id]
    if case.status == 0:
        assert result["status"] == 0, result
        return
    lines = [line for line in result["stderr"].splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result["stderr"]
    assert case.says in lines[0], lines[0]
    assert result["status"] == case.status, result
    assert not result["changed"], "a failed command changed files"


@pytest.mark.parametrize("case", params(kind_is_cli=True))
def test_no_command_opens_a_pickled_checkpoint(case, cli_results):
    result = cli_results[case.id]
    assert not [path for path in result["opened"] if path.endswith(".bin")] and not result["unpickled"], result


def test_the_planted_pickle_runs_code_when_unpickled(tmp_path):
    """The control: what no command above may do."""
    (tmp_path / "checkpoint").mkdir()
    plant_pickle(tmp_path / "checkpoint")
    with open(tmp_path / "checkpoint" / "pytorch_model.bin", "rb") as f:
        pickle.load(f)  # noqa: S301 - the point of the control
    assert (tmp_path / MARKER).read_text() == "unpickled"


def before_penalties(bundle: Path) -> Path:
    """A copy of the bundle as compiled before the sampling penalties (conftest.compiled_before_penalties)."""
    from conftest import compiled_before_penalties

    return compiled_before_penalties(Path(shutil.copytree(bundle, bundle.parent / "before-penalties", dirs_exist_ok=True)))


def stream_twice(decoder) -> None:
    """Two requests measured into one Stats: the second ended after one token, its finish_reason the first's."""
    from specbuild_runtime import Stats

    stats = Stats()
    for _ in range(2):
        list(decoder.stream("x", 4, gamma=0, stats=stats))


@pytest.mark.parametrize("case", params(kind_is_cli=False))
def test_bad_api_request_is_a_one_line_specbuild_error(case, bundles):
    from specbuild_runtime import SpecbuildError, SpeculativeDecoder

    bundle = bundles("llama", 1)
    decoder = SpeculativeDecoder(bundle)
    with pytest.raises(SpecbuildError) as raised:
        case.call(decoder, bundle)
    message = str(raised.value)
    assert "\n" not in message and case.says in message, message


def test_a_manifest_this_user_cannot_read_says_so_not_that_it_is_broken(bundles, monkeypatch):
    """A bundle copied with restrictive permissions (another user's build artefact): fixing the permissions
    is the remedy, not rebuilding. (Root reads any file, so the refusal is simulated.)"""
    from specbuild_runtime import SpecbuildError, load_manifest

    read_bytes = Path.read_bytes

    def denied(self, *args, **kwargs):
        if self.name == "manifest.json":
            raise PermissionError(13, "Permission denied", str(self))
        return read_bytes(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_bytes", denied)
    with pytest.raises(SpecbuildError) as raised:
        load_manifest(bundles("llama", 1))
    message = str(raised.value)
    assert "Permission denied" in message and "not valid JSON" not in message and "rebuild" not in message, message


def test_a_staging_folders_name_where_no_folder_is_does_not_exist(tmp_path):
    """`.bundle.partial-4243` given where nothing is (its PID mistyped, or removed by the compile rerun since) was
    called the staging folder of an unfinished compile, which sent the user looking for a folder there is not."""
    from specbuild_runtime import SpecbuildError, load_manifest

    with pytest.raises(SpecbuildError) as raised:
        load_manifest(tmp_path / ".bundle.partial-4243")
    assert str(raised.value) == f"{tmp_path / '.bundle.partial-4243'} does not exist; pass the folder `specbuild compile " \
                                "--output` wrote"


def test_a_bundle_path_whose_first_compile_still_runs_says_to_wait_for_it(tmp_path):
    """While a first compile to it runs, its output is absent and its staging folder there, as after a kill: the
    message said the compile did not finish and to rerun it, which a compile running beside it refuses."""
    from specbuild.staging import staged_folder
    from specbuild_runtime import SpecbuildError, load_manifest

    with staged_folder(tmp_path / "bundle") as staging:
        for given, advice in ((tmp_path / "bundle", "wait for it"), (staging, "once that compile finished")):
            with pytest.raises(SpecbuildError) as raised:
                load_manifest(given)
            assert advice in str(raised.value), raised.value


def troubleshooting_table() -> str:
    rows = ["| You gave | specbuild says | Exit | What to do |", "|---|---|---|---|"]
    for case in CASES:
        says = (f"`…{case.says}…`" if case.says else "(works)").replace("|", "\\|")
        exit_status = "raises SpecbuildError" if case.args is None else str(case.status)
        rows.append(f"| {case.given} | {says} | {exit_status} | {case.fix} |")
    return "\n".join(rows)


def test_the_readmes_troubleshooting_table_is_built_from_these_cases():
    text = README.read_text()
    start, end = "<!-- troubleshooting: generated by tests/test_bad_inputs.py -->\n", "\n<!-- /troubleshooting -->"
    assert start in text and end in text, "README lacks the troubleshooting markers"
    shown = text[text.index(start) + len(start) : text.index(end)]
    assert shown == troubleshooting_table(), "run `python tests/test_bad_inputs.py` and paste its output into the README"


if __name__ == "__main__":
    print(troubleshooting_table())
