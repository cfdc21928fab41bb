"""GroupQueryAttention alone, called as the engines call it, against numpy attention.

A prompt, then calls of several rows over the cache (verification calls), a roll-back (a call that rewrites
positions whose drafts were rejected) and single rows; past and present bound to one buffer of max_seq_len
positions, seqlens_k = total − 1. On the CPU in CI; on CUDA (the `gpu` marker) it is the cheapest check of
the kernel the issue-12 divergence at the second generated token points at (multi-row calls over a cache).
"""

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from specbuild_runtime.engine import PROVIDERS, choose_attention_kernels, session_options
from specbuild_runtime.slot import total_len_buckets

HEADS, KV_HEADS, HEAD_DIM, MAX_LEN = 4, 2, 64, 32  # head_dim of Llama-class models
# (first position, total length) of each call: a prompt of 7, verification calls of 2 and 5 rows, a
# roll-back that rewrites 11..13, single rows, and rows that cross where the last call ended.
CALLS = [(0, 7), (7, 9), (9, 14), (11, 14), (14, 15), (15, 16), (13, 19)]
ELEMENT = {np.float32: TensorProto.FLOAT, np.float16: TensorProto.FLOAT16}


def gqa_model(dtype, window: int | None = None, packed: bool = False, kv_heads: int = KV_HEADS,
              head_dim: int = HEAD_DIM) -> bytes:
    """packed: query is [1, S, (H + 2·KV)·D], q, k and v side by side, and key and value are left out (as the
    engines call it)."""
    t = ELEMENT[dtype]
    kv_shape = [1, kv_heads, MAX_LEN, head_dim]
    qkv = [helper.make_tensor_value_info("query", t, [1, "S", (HEADS + 2 * kv_heads) * head_dim])] if packed else [
        helper.make_tensor_value_info("query", t, [1, "S", HEADS * head_dim]),
        helper.make_tensor_value_info("key", t, [1, "S", kv_heads * head_dim]),
        helper.make_tensor_value_info("value", t, [1, "S", kv_heads * head_dim])]
    inputs = [*qkv,
              helper.make_tensor_value_info("past_key", t, kv_shape),
              helper.make_tensor_value_info("past_value", t, kv_shape),
              helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
              helper.make_tensor_value_info("total_len", TensorProto.INT32, [])]
    outputs = [helper.make_tensor_value_info("output", t, [1, "S", HEADS * head_dim]),
               helper.make_tensor_value_info("present_key", t, kv_shape),
               helper.make_tensor_value_info("present_value", t, kv_shape)]
    names = [i.name for i in inputs]
    node = helper.make_node("GroupQueryAttention", names[:1] + ["", ""] + names[1:] if packed else names,
                            [o.name for o in outputs], domain="com.microsoft",
                            num_heads=HEADS, kv_num_heads=kv_heads, scale=head_dim ** -0.5,
                            **({"local_window_size": window} if window else {}))
    graph = helper.make_graph([node], "gqa", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)],
                               ir_version=10)
    return model.SerializeToString()


def reference(q: np.ndarray, keys: np.ndarray, values: np.ndarray, first: int, window: int | None = None) -> np.ndarray:
    """Causal attention of q [S, H, D] at positions first.. over keys/values [T, KV, D] (each query head
    reads KV head h // (H / KV)), in float64; with a window, a query sees the `window` positions up to
    and including its own (transformers' sliding window)."""
    heads, head_dim = q.shape[1:]
    group = heads // keys.shape[1]
    out = np.empty(q.shape, np.float64)
    for row in range(q.shape[0]):
        seen = first + row + 1
        start = max(0, seen - window) if window else 0
        for h in range(heads):
            scores = keys[start:seen, h // group] @ q[row, h] * head_dim ** -0.5
            weights = np.exp(scores - scores.max())
            out[row, h] = weights @ values[start:seen, h // group] / weights.sum()
    return out.reshape(q.shape[0], -1)


DEVICES = [pytest.param("cpu", np.float32, id="cpu-fp32"), pytest.param("cpu", np.float16, id="cpu-fp16")] + [
    pytest.param("cuda", np.float16, id="cuda-fp16", marks=[
        pytest.mark.gpu, pytest.mark.skipif(PROVIDERS["cuda"] not in ort.get_available_providers(),
                                            reason="onnxruntime has no CUDA provider here")])]


@pytest.mark.parametrize("window", [None, 5], ids=["causal", "window-5"])
@pytest.mark.parametrize("fed", ["real", "max", "bucket"], ids=["total-len", "total-len-max", "total-len-bucket"])
@pytest.mark.parametrize("device,dtype", DEVICES)
def test_group_query_attention_over_a_shared_cache_matches_numpy(device, dtype, fed, window):
    """fed: what every call over the cache is fed as total_len: its real length, max_seq_len or the bucket
    that holds it, as the runtime feeds it on a GPU (slot.fed_total_len, GPU_TOTAL_LEN), the lengths then
    coming from seqlens_k alone; no less than the real length: fed its rows + 1, the call over positions 7..8
    was off by ~2 on an H100 (2026-11-27, right on the CPU). window: local_window_size, as the engines of
    sliding-window models set it (on CUDA not checked against transformers otherwise)."""
    attend_as_the_engines(device, dtype, fed, window)


@pytest.mark.parametrize("cudnn", [pytest.param("0", id="flash"), pytest.param("1", id="cudnn", marks=pytest.mark.xfail(
    strict=False, reason="suspected: cuDNN's SDPA, which the runtime switches off (engine._session), reads positions "
    "past seqlens_k"))])
@pytest.mark.gpu
@pytest.mark.skipif(PROVIDERS["cuda"] not in ort.get_available_providers(), reason="onnxruntime has no CUDA provider here")
def test_group_query_attention_on_cuda_ignores_what_the_cache_holds_past_its_length(cudnn, monkeypatch):
    """The runtime's caches are device memory never cleared (slot.py): past a request's length they hold
    whatever was there, NaN included. On an H100 (2026-11-26) decodes with cuDNN's SDPA gave token 0 at
    times (NaN logits?) and never with it off: this tells whether the kernel reads the unwritten positions.
    Not yet run."""
    monkeypatch.setenv("ORT_ENABLE_CUDNN_FLASH_ATTENTION", cudnn)
    attend_as_the_engines("cuda", np.float16, "max", None, unwritten=np.nan)


def fed_total_len(fed: str, first: int, total: int) -> int:
    """What a call over positions first..total-1 is fed as total_len (see slot.fed_total_len): with a cache of
    32, buckets of 4, 8, 16 and 32."""
    if not first or fed == "real":
        return total
    return MAX_LEN if fed == "max" else min(bucket for bucket in total_len_buckets(MAX_LEN) if bucket >= total)


def attend_as_the_engines(device: str, dtype, fed: str, window: int | None, unwritten: float = 0.0) -> None:
    """CALLS through one GroupQueryAttention session against numpy, the cache buffer holding `unwritten`
    where no call wrote yet."""
    if device == "cuda":
        ort.preload_dlls()
        choose_attention_kernels()  # the runtime's
    session = ort.InferenceSession(gqa_model(dtype, window), session_options(), providers=[PROVIDERS[device]])
    rng = np.random.default_rng(0)
    keys, values = np.zeros((MAX_LEN, KV_HEADS, HEAD_DIM)), np.zeros((MAX_LEN, KV_HEADS, HEAD_DIM))  # what the cache should hold
    binding = session.io_binding()
    for part in ("key", "value"):  # one buffer as past and present, written in place (as the runtime's slots bind them)
        buffer = ort.OrtValue.ortvalue_from_numpy(np.full((1, KV_HEADS, MAX_LEN, HEAD_DIM), unwritten, dtype), device, 0)
        binding.bind_ortvalue_input(f"past_{part}", buffer)
        binding.bind_ortvalue_output(f"present_{part}", buffer)
    tolerance = 1e-5 if dtype == np.float32 else 3e-3
    for first, total in CALLS:
        rows = total - first
        q = rng.standard_normal((rows, HEADS, HEAD_DIM)).astype(dtype)
        k, v = (rng.standard_normal((rows, KV_HEADS, HEAD_DIM)).astype(dtype) for _ in range(2))
        keys[first:total], values[first:total] = k, v
        for name, array in (("query", q), ("key", k), ("value", v)):
            binding.bind_cpu_input(name, array.reshape(1, rows, -1))
        binding.bind_cpu_input("seqlens_k", np.array([total - 1], np.int32))
        binding.bind_cpu_input("total_len", np.array(fed_total_len(fed, first, total), np.int32))
        out = ort.OrtValue.ortvalue_from_shape_and_type([1, rows, HEADS * HEAD_DIM], dtype, device, 0)
        binding.bind_ortvalue_output("output", out)
        session.run_with_iobinding(binding)
        got = out.numpy()[0].astype(np.float64)
        expected = reference(q.astype(np.float64), keys, values, first, window)
        error = np.abs(got - expected).max()
        assert error < tolerance, (f"{device} {dtype.__name__} (total_len {fed}, window {window}): "
                                   f"call over positions {first}..{total - 1} off by {error:.2e}")


# Calls over the cache of one row count, as a CUDA graph replays one shape: 2 rows each (a verification of
# one draft), rolling back once (rewriting 10..11), at lengths a capture never saw, crossing from the bucket
# of 16 to that of 32.
CAPTURED_CALLS = [(7, 9), (9, 11), (11, 13), (10, 12), (12, 14), (14, 16), (16, 18), (18, 20)]


@pytest.mark.gpu
@pytest.mark.skipif(PROVIDERS["cuda"] not in ort.get_available_providers(), reason="onnxruntime has no CUDA provider here")
@pytest.mark.parametrize("packed, kv_heads, head_dim", [(False, KV_HEADS, HEAD_DIM), (True, KV_HEADS, HEAD_DIM),
                                                      (True, HEADS, HEAD_DIM), (True, HEADS, 16)],
                         ids=["q-k-v", "packed-qkv", "mha", "mha-head-dim-16"])
@pytest.mark.parametrize("fed", ["max", "bucket"], ids=["total-len-max", "total-len-bucket"])
def test_group_query_attention_replayed_as_a_cuda_graph_matches_numpy(packed, kv_heads, head_dim, fed):
    """GroupQueryAttention alone without rotary (as GPT-2's engines call it) captured once per total_len fed
    and replayed as a CUDA graph, fed total_len = max_seq_len (or the bucket that holds the call, a graph
    each: slot.GPU_TOTAL_LEN) as the runtime feeds every call over a cache: each replay must attend over
    seqlens_k's length. Passed on an H100 (2026-11-26,
    cuDNN's SDPA still on) fed max_seq_len: 4 query heads over 2 KV heads of 64, q, k and v apart and packed
    (those two on an H200 too), as many KV heads as query heads (mha, as GPT-2's) and the tests' tiny GPT-2's
    heads of 16. Since it was parametrized it had checked nothing: on the H100 (2026-11-27) every case stopped
    at a TypeError before its first check, a list of inputs named `fed` hiding the parameter (now `feeds`)."""
    ort.preload_dlls()
    choose_attention_kernels()
    dtype, device = np.float16, "cuda"
    session = ort.InferenceSession(gqa_model(dtype, packed=packed, kv_heads=kv_heads, head_dim=head_dim), session_options(),
                                   providers=[(PROVIDERS[device], {"enable_cuda_graph": "1"})])
    rng = np.random.default_rng(0)
    keys, values = np.zeros((MAX_LEN, kv_heads, head_dim)), np.zeros((MAX_LEN, kv_heads, head_dim))
    binding = session.io_binding()
    for part in ("key", "value"):
        buffer = ort.OrtValue.ortvalue_from_numpy(np.zeros((1, kv_heads, MAX_LEN, head_dim), dtype), device, 0)
        binding.bind_ortvalue_input(f"past_{part}", buffer)
        binding.bind_ortvalue_output(f"present_{part}", buffer)
    # Every input and output at one address for every call of a shape: a replay reads what the capture bound.
    shapes = {7: "prompt", 2: "captured"}
    widths = [("query", (HEADS + 2 * kv_heads) * head_dim)] if packed else [
        ("query", HEADS * head_dim), ("key", kv_heads * head_dim), ("value", kv_heads * head_dim)]
    inputs = {(rows, name): ort.OrtValue.ortvalue_from_numpy(np.zeros((1, rows, width), dtype), device, 0)
              for rows in shapes for name, width in widths}
    outputs = {rows: ort.OrtValue.ortvalue_from_shape_and_type([1, rows, HEADS * head_dim], dtype, device, 0) for rows in shapes}
    seqlens_k = ort.OrtValue.ortvalue_from_numpy(np.zeros(1, np.int32), device, 0)
    total_len = ort.OrtValue.ortvalue_from_numpy(np.zeros((), np.int32), "cpu", 0)
    binding.bind_ortvalue_input("seqlens_k", seqlens_k)
    binding.bind_ortvalue_input("total_len", total_len)
    for index, (first, total) in enumerate([(0, 7), *CAPTURED_CALLS]):
        rows = total - first
        q = rng.standard_normal((rows, HEADS, head_dim)).astype(dtype)
        k, v = (rng.standard_normal((rows, kv_heads, head_dim)).astype(dtype) for _ in range(2))
        keys[first:total], values[first:total] = k, v
        feeds = [("query", np.concatenate([a.reshape(rows, -1) for a in (q, k, v)], axis=1))] if packed else [
            ("query", q), ("key", k), ("value", v)]
        for name, array in feeds:
            inputs[rows, name].update_inplace(np.ascontiguousarray(array.reshape(1, rows, -1)))
            binding.bind_ortvalue_input(name, inputs[rows, name])
        seqlens_k.update_inplace(np.array([total - 1], np.int32))
        fed_len = fed_total_len(fed, first, total)
        total_len.update_inplace(np.array(fed_len, np.int32))
        binding.bind_ortvalue_output("output", outputs[rows])
        run = ort.RunOptions()
        # A graph for each total_len fed (a replay keeps its capture's); the prompt's call is never captured.
        run.add_run_config_entry("gpu_graph_id", str(fed_len) if first else "-1")
        session.run_with_iobinding(binding, run)
        got = outputs[rows].numpy()[0].astype(np.float64)
        expected = reference(q.astype(np.float64), keys, values, first)
        error = np.abs(got - expected).max()
        assert error < 3e-3, (f"call {index} over positions {first}..{total - 1} fed total_len {fed_len} (captured calls "
                              f"from the 2nd of 2 rows on) off by {error:.2e}")
