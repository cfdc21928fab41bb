"""The models as transformers runs them: what verify, bench's peers, the compiler's γ measurement and distill
compare with or learn from."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import SafetensorError
from specbuild_runtime.errors import DeviceError, first_line

from ..errors import CheckpointError
from .load import check_checkpoint_folder, checkpoint_digest, digest_of_shards_beside, indexed_files, load_config

TORCH_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def transformers_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_token_ids: list[int], **options) -> list[int]:
    """transformers' greedy generate on the model's device (options: e.g. assistant_model for assisted
    generation)."""
    import torch

    ids = torch.tensor([prompt_ids], device=model.device)
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
            eos_token_id=eos_token_ids or None, pad_token_id=eos_token_ids[0] if eos_token_ids else 0, **options,
        )
    return out[0, len(prompt_ids):].tolist()


def load_reference(path: Path, role: str = "target", device: str = "cpu", precision: str = "fp32", config=None):
    """A checkpoint as transformers runs it: safetensors only (never unpickled), local files only, no remote
    code; on device ("cpu" or "cuda") in precision (fp32, fp16 or bf16). fp32 on CUDA computes fp32 (TF32
    off, as the runtime's fp32 engines run), which switches TF32 off for the whole process. config: its config as
    load_config read it, where the caller holds it (config.json is then not read again)."""
    import torch
    from transformers import AutoModelForCausalLM

    if device == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError("transformers cannot run on CUDA here: this torch has no CUDA build or sees no GPU "
                              "(install a CUDA build of torch, or use --device cpu)")
        if precision == "fp32":
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    check_checkpoint_folder(Path(path), role)  # no folder (a typo), a bundle given as its source, no config.json
    # read before the weights, as transformers' own refusal would be followed by the "re-save" advice
    if config is None:
        config = load_config(Path(path), role)
    _check_index(Path(path), role)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=getattr(torch, TORCH_DTYPES[precision]),
                                                     use_safetensors=True, local_files_only=True, trust_remote_code=False,
                                                     **_attention(config))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{role} checkpoint {path} cannot be loaded from safetensors ({first_line(exc)}); specbuild "
                              "never unpickles weights: re-save it with `save_pretrained(dir, safe_serialization=True)`") from None
    except SafetensorError as exc:  # a truncated or garbled file (compile's reader says the same in its words)
        raise CheckpointError(f"{role} checkpoint {path} has a truncated or corrupt *.safetensors file ({first_line(exc)}); "
                              "download or copy the checkpoint again") from None
    return plainly_generating(model).to(device).eval()


def _attention(config) -> dict:
    """Gemma 2 soft-caps its attention scores, which sdpa cannot: transformers 5 runs it eagerly by itself, while
    transformers 4 (4.56, 4.57) picked sdpa and dropped the cap, and verify reported divergences of its own making."""
    return {"attn_implementation": "eager"} if config.model_type == "gemma2" else {}


def plainly_generating(model):
    """model, its generation_config reduced to its special token ids: generate() then decodes as the runtime
    does, greedy or sampled from the model's own distribution, with none of the logits processors a
    checkpoint may ask for (repetition_penalty, no_repeat_ngram_size, top_k, ...), which it applies for every
    setting a call leaves unset."""
    from transformers import GenerationConfig

    own = model.generation_config
    model.generation_config = GenerationConfig(bos_token_id=own.bos_token_id, eos_token_id=own.eos_token_id,
                                               pad_token_id=own.pad_token_id)
    return model


def _check_index(path: Path, role: str) -> None:
    """transformers reads a shard index's "metadata" without a default (a KeyError, reported as a bug in
    specbuild); the compiler needs only its weight_map, so such a checkpoint compiles and then fails here.
    Likewise shards without any index (a download that left out the JSON files), which the compiler reads
    and transformers does not: its error says no model.safetensors was found, and the line about pickles
    that would follow it is no help; as it is for an index that is not JSON or names a shard the folder lacks
    (an interrupted download), which compile's reader tells in its own words."""
    if (path / "model.safetensors").is_file():
        return  # read alone, as compile reads it: an index beside it is left from another save, never read
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        if any(path.glob("*.safetensors")):
            raise CheckpointError(f"{role} checkpoint {path} has safetensors shards but no {index.name}, without which "
                                  "transformers cannot load them; add the index from the model's repository")
        return  # no weights at all: transformers says so
    indexed_files(path)
    if "metadata" not in json.loads(index.read_bytes()):
        raise CheckpointError(f"{index} has no \"metadata\", without which transformers cannot load the checkpoint; "
                              "add \"metadata\": {} to it")


def recorded_source(engine, role: str, option: str | None = None) -> Path:
    """The checkpoint an engine was compiled from, as the manifest records it, refused if it is gone or
    has changed since: a peer would then run another model than the bundle's. option: the command's option that
    names the checkpoint instead (verify's --target), the shortest way on where it has only moved."""
    path = Path(engine.source["path"])
    if not path.is_dir():
        instead = f" or pass its folder as {option}" if option else ""
        raise CheckpointError(f"the bundle's {role} was compiled from {path}, which no longer exists; put the "
                              f"checkpoint back there{instead} (or recompile the bundle from where it is now)")
    if checkpoint_digest(path, role) != engine.source["sha256"]:
        if digest_of_shards_beside(path) == engine.source["sha256"]:  # nothing changed but which files are read
            raise CheckpointError(
                f"the bundle's {role} was compiled from the shards that {path}/model.safetensors.index.json names, but "
                f"{path} also holds a model.safetensors, which transformers reads instead (as compile does now); move "
                "whichever of the two is not the checkpoint's out of the folder (if the shards stay, the bundle is "
                "theirs; if model.safetensors stays, recompile the bundle)")
        raise CheckpointError(f"the bundle's {role} was compiled from {path}, whose config.json or weights have "
                              "changed since (sha256 differs); recompile the bundle from it")
    return path
