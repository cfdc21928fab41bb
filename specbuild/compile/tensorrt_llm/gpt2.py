"""GPT-2's tensors and config.json fields."""

from __future__ import annotations

from typing import Iterator

import numpy as np

from ..load import Checkpoint
from .layout import COLUMN, QKV, REPLICATE, ROW, VOCAB, Out


def gpt2_config(ckpt: Checkpoint, config: dict) -> dict:
    """models/gpt/config.py GPTConfig.from_hugging_face's fields."""
    return {**config, "gpt_variant": "gpt2", "hidden_act": "gelu_new", "position_embedding_type": "learned_absolute",
            "bias": True, "q_scaling": 1.0, "apply_query_key_layer_scaling": False, "rotary_pct": 1.0,
            "qk_layernorm": False, "inner_layernorm": False, "norm_before_bmm1": False}


def gpt2_tensors(ckpt: Checkpoint, names: set[str]) -> Iterator[Out]:
    """GPT-2 (models/gpt/convert.py load_weights_from_hf_model, gpt_variant gpt2): HF's Conv1D weights are
    [in, out] and are transposed; c_attn holds q, k and v side by side (split_qkv)."""
    read = ckpt.tensor
    yield Out("transformer.vocab_embedding.weight", REPLICATE, read("transformer.wte.weight"))
    yield Out("transformer.position_embedding.weight", REPLICATE, read("transformer.wpe.weight"))
    for i in range(ckpt.spec.shape.num_layers):
        hf, trt = f"transformer.h.{i}.", f"transformer.layers.{i}."
        for kind in ("weight", "bias"):
            row = ROW if kind == "weight" else REPLICATE  # a row-parallel bias is added once, after the sum
            yield Out(f"{trt}input_layernorm.{kind}", REPLICATE, read(f"{hf}ln_1.{kind}"))
            yield Out(f"{trt}attention.qkv.{kind}", QKV, tuple(np.split(read(f"{hf}attn.c_attn.{kind}").T, 3)))
            yield Out(f"{trt}attention.dense.{kind}", row, read(f"{hf}attn.c_proj.{kind}").T)
            yield Out(f"{trt}post_layernorm.{kind}", REPLICATE, read(f"{hf}ln_2.{kind}"))
            yield Out(f"{trt}mlp.fc.{kind}", COLUMN, read(f"{hf}mlp.c_fc.{kind}").T)
            yield Out(f"{trt}mlp.proj.{kind}", row, read(f"{hf}mlp.c_proj.{kind}").T)
    yield Out("transformer.ln_f.weight", REPLICATE, read("transformer.ln_f.weight"))
    yield Out("transformer.ln_f.bias", REPLICATE, read("transformer.ln_f.bias"))
    yield Out("lm_head.weight", VOCAB, read("lm_head.weight" if "lm_head.weight" in names else "transformer.wte.weight"))
