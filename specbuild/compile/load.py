"""Stage 1: load and validate Hugging Face checkpoint folders (config, safetensors, tokenizer).

Never unpickles (safetensors only) and never runs remote code.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specbuild_runtime.manifest import ModelShape

from ..errors import CheckpointError, PairMismatchError, UnsupportedModelError

# architecture -> graph family; the Llama family differs only in flags read from config.json.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "GPT2LMHeadModel": "gpt2",
}
SUPPORTED_ACTIVATIONS = {"silu", "gelu_new", "gelu_pytorch_tanh", "gelu"}


@dataclass
class ModelSpec:
    """Everything the graph builder needs to know about a model, as plain data."""

    architecture: str
    family: str
    shape: ModelShape
    intermediate_size: int
    norm_eps: float
    hidden_act: str
    attention_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    sliding_window: int | None


@dataclass
class Checkpoint:
    path: Path
    spec: ModelSpec
    config: object  # transformers.PretrainedConfig, kept for rotary tables
    tokenizer: object  # transformers.PreTrainedTokenizerFast
    weight_files: list[Path]

    def digest(self) -> str:
        """sha256 over config.json and the weight files: identifies the source of an engine."""
        h = hashlib.sha256()
        for path in [self.path / "config.json", *self.weight_files]:
            h.update(path.name.encode())
            with open(path, "rb") as f:
                while block := f.read(1 << 22):
                    h.update(block)
        return h.hexdigest()

    def tensor_names(self) -> list[str]:
        from safetensors import safe_open

        names = []
        for path in self.weight_files:
            with safe_open(str(path), framework="numpy") as f:
                names += f.keys()
        return names

    def tensor(self, name: str) -> np.ndarray:
        """One tensor in its stored dtype (bf16 as ml_dtypes.bfloat16), read on demand."""
        from safetensors import safe_open

        for path in self.weight_files:
            with safe_open(str(path), framework="numpy") as f:
                if name in f.keys():
                    return f.get_tensor(name)
        raise CheckpointError(f"{self.path} has no tensor {name!r}")

    def tensors(self) -> dict[str, np.ndarray]:
        """All weights as float32 numpy arrays, read with safetensors (bf16 goes through torch)."""
        from safetensors import safe_open

        out = {}
        for path in self.weight_files:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    out[name] = f.get_tensor(name).float().numpy()
        return out


def load_checkpoint(path: str | Path, role: str) -> Checkpoint:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{role} checkpoint {path} is not a folder; pass a Hugging Face checkpoint folder")
    config_path = path / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{role} checkpoint {path} has no config.json; pass a Hugging Face checkpoint folder")
    try:
        raw = json.loads(config_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{config_path} is not valid JSON ({exc})") from None
    architecture = (raw.get("architectures") or ["<none>"])[0]
    if architecture not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"{role} checkpoint {path} is a {architecture}; specbuild supports {', '.join(sorted(ARCHITECTURES))}"
        )
    weight_files = _weight_files(path, role)
    config = _load_config(path, role)
    tokenizer = _load_tokenizer(path, role)
    return Checkpoint(path, _spec(config, architecture, path, role), config, tokenizer, weight_files)


def _weight_files(path: Path, role: str) -> list[Path]:
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    if list(path.glob("*.bin")) or list(path.glob("*.pt")):
        raise CheckpointError(
            f"{role} checkpoint {path} has only pickled weights (*.bin); specbuild reads safetensors only. "
            "Re-save it with `model.save_pretrained(dir, safe_serialization=True)`"
        )
    raise CheckpointError(f"{role} checkpoint {path} has no *.safetensors weights")


def _load_config(path: Path, role: str):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=False, local_files_only=True)
    except Exception as exc:  # transformers raises many types for a bad config
        raise CheckpointError(f"{role} checkpoint {path}: config.json cannot be read ({exc})") from None


def _load_tokenizer(path: Path, role: str):
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False, local_files_only=True)
    except Exception as exc:
        raise CheckpointError(
            f"{role} checkpoint {path} has no usable tokenizer ({type(exc).__name__}); it needs tokenizer.json "
            "or the tokenizer files its tokenizer_config.json names"
        ) from None
    if not getattr(tokenizer, "is_fast", False):
        raise CheckpointError(f"{role} checkpoint {path}: tokenizer has no fast (tokenizer.json) form")
    return tokenizer


def _spec(config, architecture: str, path: Path, role: str) -> ModelSpec:
    family = ARCHITECTURES[architecture]
    if family == "gpt2":
        hidden, heads = config.n_embd, config.n_head
        spec = ModelSpec(
            architecture=architecture,
            family=family,
            shape=ModelShape(config.n_layer, hidden, heads, heads, hidden // heads, config.vocab_size),
            intermediate_size=config.n_inner or 4 * hidden,
            norm_eps=config.layer_norm_epsilon,
            hidden_act=config.activation_function,
            attention_bias=True,
            mlp_bias=True,
            tie_word_embeddings=True,
            max_position_embeddings=config.n_positions,
            sliding_window=None,
        )
        if config.scale_attn_by_inverse_layer_idx or config.reorder_and_upcast_attn:
            raise UnsupportedModelError(f"{role} checkpoint {path}: GPT-2 attention variants are not supported")
    else:
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        use_sliding = getattr(config, "use_sliding_window", True)
        spec = ModelSpec(
            architecture=architecture,
            family=family,
            shape=ModelShape(
                config.num_hidden_layers,
                config.hidden_size,
                heads,
                getattr(config, "num_key_value_heads", None) or heads,
                head_dim,
                config.vocab_size,
            ),
            intermediate_size=config.intermediate_size,
            norm_eps=config.rms_norm_eps,
            hidden_act=config.hidden_act,
            # Qwen2 always has q/k/v biases; Llama and Mistral say so in attention_bias.
            attention_bias=architecture == "Qwen2ForCausalLM" or bool(getattr(config, "attention_bias", False)),
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            tie_word_embeddings=bool(config.tie_word_embeddings),
            max_position_embeddings=config.max_position_embeddings,
            sliding_window=getattr(config, "sliding_window", None) if use_sliding else None,
        )
        if head_dim % 16:
            raise UnsupportedModelError(
                f"{role} checkpoint {path}: head_dim {head_dim} is not a multiple of 16, which onnxruntime's "
                "rotary attention kernel requires"
            )
        if architecture == "Qwen2ForCausalLM" and any(
            t != "full_attention" for t in (getattr(config, "layer_types", None) or [])
        ):
            raise UnsupportedModelError(f"{role} checkpoint {path}: Qwen2 per-layer sliding windows are not supported")
    if spec.hidden_act not in SUPPORTED_ACTIVATIONS:
        raise UnsupportedModelError(f"{role} checkpoint {path}: activation {spec.hidden_act!r} is not supported")
    return spec


def validate_pair(target: Checkpoint, draft: Checkpoint) -> None:
    """The draft must speak the target's tokenizer: same token-to-id map and special tokens.

    Embedding tables may differ in padding rows (Qwen2.5 0.5B has 151936, 7B 152064) as long as
    every token of the shared tokenizer has a row in both.
    """
    t, d = target.tokenizer, draft.tokenizer
    t_vocab, d_vocab = t.get_vocab(), d.get_vocab()
    if t_vocab != d_vocab:
        differing = sorted(set(t_vocab.items()) ^ set(d_vocab.items()))[:3]
        raise PairMismatchError(
            f"draft {draft.path} and target {target.path} have different tokenizers "
            f"({len(d_vocab)} vs {len(t_vocab)} tokens; e.g. {differing}); use a draft trained with the "
            "target's tokenizer"
        )
    if _special_tokens(t) != _special_tokens(d):
        raise PairMismatchError(
            f"draft {draft.path} and target {target.path} have different special tokens "
            f"({_special_tokens(d)} vs {_special_tokens(t)}); use a draft with the target's tokenizer"
        )
    needed = max(t_vocab.values()) + 1
    for ckpt in (target, draft):
        if ckpt.spec.shape.vocab_size < needed:
            raise PairMismatchError(
                f"{ckpt.path} has {ckpt.spec.shape.vocab_size} embedding rows but its tokenizer has ids up to "
                f"{needed - 1}; the checkpoint and its tokenizer do not belong together"
            )


def _special_tokens(tokenizer) -> dict:
    return {
        "bos": tokenizer.bos_token_id,
        "eos": tokenizer.eos_token_id,
        "pad": tokenizer.pad_token_id,
        "unk": tokenizer.unk_token_id,
    }


def eos_token_ids(ckpt: Checkpoint) -> list[int]:
    """End-of-sequence ids as transformers' generate() would use them (generation_config first)."""
    gen_path = ckpt.path / "generation_config.json"
    eos = None
    if gen_path.is_file():
        eos = json.loads(gen_path.read_text()).get("eos_token_id")
    if eos is None:
        eos = getattr(ckpt.config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, list) else [eos])]
