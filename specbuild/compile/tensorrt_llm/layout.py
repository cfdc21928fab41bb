"""How each tensor of a TensorRT-LLM checkpoint splits over the tensor-parallel ranks: the split kind each family's
writer tags it with (Out), the sizes of the model (Layout), and each rank's part (shard).

Tensor parallelism splits as the converters do (models/llama/convert.py, models/qwen/convert.py,
models/gpt/convert.py, all with models/convert_utils.py's split = torch.chunk):
  - column-parallel layers (attention.qkv, mlp.fc, mlp.gate, lm_head) split their output rows; the fused
    attention.qkv of rank r is the concatenation of that rank's q, k and v rows, and when there are fewer
    KV heads than ranks each KV head is first repeated tp/kv times (convert_utils.dup_kv_weight);
  - row-parallel layers (attention.dense, mlp.proj) split their input columns; each rank's partial sum is
    all-reduced and the bias, kept whole on every rank, added once after (layers/linear.py RowLinear);
  - norms and the embedding table are whole on every rank (use_parallel_embedding false); lm_head is
    zero-padded to a multiple of tp rows (_utils.pad_vocab_size) and split, its outputs gathered;
  - a mixture of experts (Qwen3-MoE, Mixtral) splits as mapping's default moe_tp_size = tp, moe_ep_size = 1 does
    (mapping.py MappingBase): every rank holds every expert, each expert's MLP split as a dense one is
    (moe_tp: the converters' split of w1/w3 on dim 1 and w2 on dim 2), and the float32 router is whole on each.
A draft with fewer rows than the target's vocabulary gets the missing ones (vocab_size is the target's, so
that both engines' logits line up). TensorRT-LLM samples over all vocab_size columns and masks only the tp
padding past it (kernels/decodingCommon.cu addBiasSoftMax), so a missing lm_head row is the mean of the
draft's rows, not zero: its logit is then the mean of the draft's logits, below their maximum (never a greedy
draft) and by Jensen worth at most 1/V of the probability, where a zero row scores 0 and outranks every real
token of a draft whose logits are all negative, making each greedy draft a padding id.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..load import ModelSpec
from ..precision import convert_into

REPLICATE, COLUMN, ROW, QKV, VOCAB, EMBEDDING = "replicate", "column", "row", "qkv", "vocab", "embedding"
EXPERT_FC, EXPERT_PROJ = "expert_fc", "expert_proj"  # a mixture's [experts, out, in] weights, split per expert
GATED_FC = "gated_fc"  # Phi-3's mlp.fc, [up; gate] on each rank (phi3_tensors)


@dataclass(frozen=True)
class Layout:
    """What splitting one model over tp ranks needs to know."""

    tp: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int  # rows of the exported tables: the target's vocabulary, for the draft as well
    tokens: int | None = None  # a draft's: lm_head rows past the tokenizer's ids (padding) score the mean logit
    experts: int = 0  # a mixture's; intermediate is then each expert's width

    @property
    def padded_vocab(self) -> int:
        return math.ceil(self.vocab / self.tp) * self.tp

    def ranks(self) -> list[dict]:
        """Which source rows each rank holds (the manifest's record of the mapping)."""
        tp, heads, kv = self.tp, self.heads // self.tp, max(self.kv_heads // self.tp, 1)
        ffn, vocab = self.intermediate // tp, self.padded_vocab // tp
        repeat = max(tp // self.kv_heads, 1)  # ranks sharing one (duplicated) KV head
        return [{
            "file": f"rank{r}.safetensors",
            "attention_heads": [r * heads, (r + 1) * heads],
            "kv_heads": [(r * kv + j) // repeat for j in range(kv)],
            "ffn_columns": [r * ffn, (r + 1) * ffn],  # of each expert, in a mixture
            "lm_head_rows": [r * vocab, (r + 1) * vocab],
            **({"experts": [0, self.experts]} if self.experts else {}),
        } for r in range(tp)]


@dataclass
class Out:
    """One tensor of every rank file: its name, how it splits and its source value (q, k, v for QKV; up, gate for
    EXPERT_FC and GATED_FC); dtype: its own float type, where not the export's."""

    name: str
    split: str
    value: np.ndarray | tuple[np.ndarray, ...]
    dtype: type | None = None


def ffn_width(spec: ModelSpec) -> int:
    """The MLP columns tensor parallelism splits: each expert's, in a mixture (the plans' backends split the same)."""
    return spec.expert_intermediate_size if spec.experts else spec.intermediate_size


def shard(tensor: Out, layout: Layout, dtype) -> list[np.ndarray]:
    """The tensor's part on each rank, in the export's float type."""
    tp = layout.tp
    if tensor.split == QKV:
        q, k, v = (_cast(part, dtype, tensor.name) for part in tensor.value)
        if layout.kv_heads < tp:  # convert_utils.dup_kv_weight: each KV head repeated for tp/kv ranks
            k, v = (np.repeat(x.reshape(layout.kv_heads, layout.head_dim, -1), tp // layout.kv_heads, axis=0)
                    .reshape(tp * layout.head_dim, *x.shape[1:]) for x in (k, v))
        return [np.concatenate(parts) for parts in zip(*(np.split(x, tp) for x in (q, k, v)))]
    if tensor.split in (EXPERT_FC, GATED_FC):  # each of up and gate split on its rows, then joined per rank
        up, gate = (np.split(_cast(part, dtype, tensor.name), tp, axis=-2) for part in tensor.value)
        return [np.concatenate(parts, axis=-2) for parts in zip(up, gate)]
    value = _cast(tensor.value, dtype, tensor.name)
    if tensor.name.endswith("vocab_embedding.weight"):
        value = rows(value, layout.vocab)  # the draft's table padded (or cut) to the target's vocabulary
    if tensor.split == EMBEDDING:  # layers/embedding.py Embedding with tp_size > 1: ceil(vocab / tp) rows a rank
        return np.split(rows(value, layout.padded_vocab), tp)
    if tensor.split == VOCAB:  # the draft's missing rows score the mean of its logits (module docstring)
        # so do its own padding rows, which no training reaches (distill trains the tokenizer's rows alone):
        # TensorRT-LLM would draft them, each a certain rejection, where they outrank every real token
        kept = min(len(value), layout.tokens or len(value))
        fill = tensor.value[:kept].mean(axis=0, dtype=np.float64).astype(dtype) if kept < layout.vocab else None
        value = rows(value[:kept], layout.vocab, fill)
        return np.split(rows(value, layout.padded_vocab), tp)
    if tensor.split == COLUMN:
        return np.split(value, tp, axis=0)
    if tensor.split == ROW:
        return np.split(value, tp, axis=1)
    if tensor.split == EXPERT_PROJ:
        return np.split(value, tp, axis=2)
    return [value] * tp


def _cast(value: np.ndarray, dtype, name: str) -> np.ndarray:
    """value in the export's float type, refused in one line where fp16 cannot hold it (convert_into)."""
    out = np.empty(value.shape, dtype)
    convert_into(value, out, name=f"weight {name}")
    return out


def rows(table: np.ndarray, count: int, fill: np.ndarray | None = None) -> np.ndarray:
    """The table with exactly `count` rows: extra rows cut, missing ones `fill` (zero by default)."""
    if len(table) >= count:
        return table[:count]
    missing = np.zeros((count - len(table), *table.shape[1:]), table.dtype)
    if fill is not None:
        missing[:] = fill
    return np.concatenate([table, missing])
