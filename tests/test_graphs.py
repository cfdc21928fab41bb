"""Each architecture's ONNX graph reproduces transformers' logits, through prefill, verification and rollback."""

import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

import onnx_ir as ir

from conftest import ARCHITECTURES, make_checkpoint, with_stored_biases
from specbuild.compile.graphs import build_decoder
from specbuild.compile.load import load_checkpoint
from specbuild.compile.precision import Numerics
from specbuild_runtime.engine import Engine
from specbuild_runtime.slot import NEVER_ALONE, EngineSlot
from specbuild_runtime.manifest import EngineInfo

MAX_LEN = 64


def run_graph(ckpt):
    """The graph as the runtime runs a target (in-place KV cache), with the `logits` it decides on."""
    spec = ckpt.spec
    info = EngineInfo(role="target", backend="onnx", file="graph.onnx", architecture=spec.architecture,
                      precision="fp32", quantization="none", shape=spec.shape, parameters=0, weight_bytes=0, source={})
    with tempfile.TemporaryDirectory() as folder:  # the session holds the graph once made
        path = Path(folder) / info.file
        path.write_bytes(ir.serde.serialize_model(build_decoder(ckpt, Numerics(), MAX_LEN)).SerializeToString())
        engine = EngineSlot(Engine(path, info, MAX_LEN), NEVER_ALONE)
    engine.read_logits(True)

    def step(tokens, total_len, num_drafts):
        accepted, next_token = engine.step(tokens, total_len, num_drafts)
        return accepted, next_token, engine.logits()

    return step


@pytest.mark.parametrize("architecture", [*ARCHITECTURES, "gpt2"])
def test_graph_logits_match_transformers_through_prefill_verify_and_rollback(architecture, checkpoints):
    assert_logits_match_transformers(checkpoints(architecture))


@pytest.mark.parametrize("architecture,config", [
    ("llama", dict(final_logit_softcapping=0.5)),  # Gemma's alone
    ("llama", dict(sliding_window=8)),  # Mistral's, Qwen's, Phi-3's and Gemma's alone
    ("gemma3", dict(attn_logit_softcapping=0.5)),  # Gemma 2's alone: Gemma 3 keeps it but never applies it
    ("llama", dict(head_dim=32, partial_rotary_factor=0.5)),  # Phi-3's alone: Llama's default rope rotates whole heads
    ("llama", dict(head_dim=32, rope_scaling=dict(rope_type="proportional", partial_rotary_factor=0.5))),  # padded table
    ("llama", dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.5,
                   logits_scaling=8.0)),  # Granite's alone
    ("olmo2", dict(mlp_bias=True, logits_scaling=8.0)),  # Llama's and Granite's: OLMo 2's MLP has no biases
    ("mistral", dict(attention_bias=True, mlp_bias=True)),  # Mistral's attention and MLP never have biases
    ("qwen3", dict(mlp_bias=True)),  # Qwen's MLP neither
], ids=["llama-final_logit_softcapping", "llama-sliding_window", "gemma3-attn_logit_softcapping",
        "llama-partial_rotary_factor", "llama-proportional-partial_rotary_factor", "llama-granite_multipliers",
        "olmo2-mlp_bias-logits_scaling", "mistral-attention_bias-mlp_bias", "qwen3-mlp_bias"])
def test_config_keys_transformers_code_does_not_read_leave_the_logits_as_transformers_computes_them(
        architecture, config, tokenizer, tmp_path):
    """A config.json may carry any key (transformers keeps it as an attribute): a setting of another family, which
    the graph applied (a softcap, a window) or choked on (partial rotary: a reshape error; biases Mistral's or
    Qwen's model never has: "the checkpoint is incomplete") where transformers' model of this architecture ignores
    it."""
    assert_logits_match_transformers(make_checkpoint(tmp_path, architecture, tokenizer, **config))


@pytest.mark.parametrize("architecture,config", [
    ("granite", dict(attention_bias=True, mlp_bias=True)),  # q, k, v, o and the MLP's three
    ("olmo2", dict(attention_bias=True)),  # q, k, v and o
    ("olmo3", dict(attention_bias=True)),
])
def test_the_biases_config_json_asks_for_reach_the_logits(architecture, config, tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    folder = make_checkpoint(tmp_path, architecture, tokenizer, **config)
    model = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():  # transformers starts them at zero, which a graph without them computes as well
        biases = [p.normal_(0, 0.2) for name, p in model.named_parameters() if name.endswith("bias")]
    assert len(biases) == (7 if config.get("mlp_bias") else 4) * 2  # per layer, 2 layers
    model.save_pretrained(folder)
    assert_logits_match_transformers(folder)


@pytest.mark.parametrize("architecture,config,projections", [
    ("mistral", {}, ("q_proj", "o_proj", "down_proj")),  # Mistral's attention and MLP never have biases
    ("qwen2", {"attention_bias": True}, ("o_proj",)),  # Qwen2's o_proj neither (its q, k and v always do)
    ("qwen3", {"mlp_bias": True}, ("down_proj",)),  # nor Qwen3's MLP, in vLLM's Qwen3 too
])
def test_stored_biases_the_model_never_has_are_dropped_as_transformers_drops_them(architecture, config, projections,
                                                                                  tokenizer, tmp_path):
    """Where no loader reads them either (a Mistral whose config.json asks for them is refused: test_architectures)."""
    folder = make_checkpoint(tmp_path, architecture, tokenizer, **config)
    assert_logits_match_transformers(with_stored_biases(folder, *projections))


@pytest.mark.parametrize("config,sparse", [
    (dict(norm_topk_prob=False), (0, 2)),  # the chosen experts' scores as the softmax over all of them gives them
    (dict(decoder_sparse_step=2, mlp_only_layers=[]), (1,)),  # every second layer's MLP a mixture
    (dict(num_experts_per_tok=3, mlp_only_layers=[0]), (1, 2)),
], ids=["norm_topk_prob-false", "decoder_sparse_step-2", "top-3-mlp_only_layers-0"])
def test_a_mixture_of_experts_routes_and_places_its_sparse_layers_as_transformers(config, sparse, tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    folder = make_checkpoint(tmp_path, "qwen3moe", tokenizer, **config)
    built = AutoModelForCausalLM.from_pretrained(folder).model.layers
    assert load_checkpoint(folder, "target").spec.sparse_layers == sparse == tuple(
        i for i, layer in enumerate(built) if hasattr(layer.mlp, "experts"))
    assert_logits_match_transformers(folder)


@pytest.mark.parametrize("use_sliding_window", [True, False])
def test_a_qwen3_moe_windows_every_layer_where_use_sliding_window_says(use_sliding_window, tokenizer, tmp_path):
    """Its config drops sliding_window unless use_sliding_window; its attention then windows every layer (no
    max_window_layers or layer_types, unlike Qwen2's and Qwen3's)."""
    folder = make_checkpoint(tmp_path, "qwen3moe", tokenizer, use_sliding_window=use_sliding_window, sliding_window=6)
    kind = "sliding_attention" if use_sliding_window else "full_attention"
    assert load_checkpoint(folder, "target").spec.layer_types == [kind] * 3
    assert_logits_match_transformers(folder)


def assert_logits_match_transformers(folder):
    from transformers import AutoModelForCausalLM

    ckpt = load_checkpoint(folder, "target")
    step = run_graph(ckpt)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.randint(0, ckpt.spec.shape.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = model(ids).logits[0].numpy()
    tokens = ids[0].tolist()

    _, next_token, logits = step(tokens[:10], 10, 0)  # prefill: logits of the last position only
    assert np.abs(logits[-1] - reference[9]).max() <= 1e-4
    assert next_token == reference[9].argmax()
    _, _, logits = step(tokens[10:15], 15, 4)  # verify 4 drafts: 5 rows of logits
    assert np.abs(logits - reference[10:15]).max() <= 1e-4
    _, _, logits = step(tokens[12:20], 20, 7)  # roll back to 12 and continue: stale rows are overwritten
    assert np.abs(logits - reference[12:20]).max() <= 1e-4


def test_verification_counts_leading_matching_drafts(checkpoints):
    ckpt = load_checkpoint(checkpoints("llama"), "target")
    step = run_graph(ckpt)
    prompt = [5, 17, 42]
    greedy = []
    total = 3
    _, token, _ = step(prompt, total, 0)
    for _ in range(5):  # the model's own greedy continuation
        greedy.append(token)
        total += 1
        _, token, _ = step([token], total, 0)
    # Re-verify from the prompt: drafts 0..1 agree, draft 2 is wrong, draft 3 agrees again (must not count).
    wrong = (greedy[3] + 1) % ckpt.spec.shape.vocab_size
    accepted, next_token, _ = step([greedy[0], greedy[1], greedy[2], wrong, greedy[4]], 3 + 5, 4)
    assert accepted == 2
    assert next_token == greedy[3]


# Inputs the CUDA provider's kernels read on the host (OrtMemTypeCPUInput in their kernel definitions).
HOST_READS = {"TopK": (1,), "Slice": (1, 2, 3, 4), "Reshape": (1,), "Expand": (1,), "Unsqueeze": (1,), "Squeeze": (1,),
              "ConstantOfShape": (0,), "Tile": (1,), "If": (0,), "Range": (0, 1, 2), "Split": (1,), "ReduceSum": (1,),
              "ReduceMax": (1,), "ReduceMin": (1,), "ReduceMean": (1,), "GroupQueryAttention": (6,), "OneHot": (1, 2),
              "CumSum": (1,)}


def device_values_read_on_the_host(graph, outer_host=frozenset(), outer_small=frozenset(), path=""):
    """["path/op node: input i value"] for each input a CUDA kernel reads on the host that onnxruntime would compute
    on the device, so copy back mid-call (a Memcpy node, which also rules CUDA graphs out). Its rule, emulated here
    because the test needs no GPU (fallback_cpu_capability.cc, GetCpuPreferredNodes): within one (sub)graph, a node
    goes to the CPU when it reads a Shape/Size output or another such node's, and otherwise only small
    initializers, the graph's own inputs and those values; a value from an outer graph never starts that. On an
    H100 (2026-11-27) this gave exactly the copies onnxruntime made: a top-p TopK's k computed inside its branch."""
    found = []
    small = set(outer_small) | {i.name for i in graph.initializer if np.prod(list(i.dims) or [1]) <= 100}
    small |= {n.output[0] for n in graph.node if n.op_type == "Constant" and np.prod(list(n.attribute[0].t.dims) or [1]) <= 100}
    inputs = {i.name for i in graph.input}
    host = set()
    for n in graph.node:
        reads = [(i, x) for i, x in enumerate(n.input) if x]
        if n.op_type in ("Shape", "Size") or (any(x in host for _, x in reads) and all(
                (x in host and i not in HOST_READS.get(n.op_type, ())) or x in small or x in inputs for i, x in reads)):
            host.update(n.output)
    for n in graph.node:
        found += [f"{path}/{n.op_type} {n.name}: input {i} {n.input[i]}" for i in HOST_READS.get(n.op_type, ())
                  if i < len(n.input) and n.input[i] and n.input[i] not in host | outer_host | small | inputs]
        for attribute in n.attribute:
            if attribute.type == attribute.GRAPH:
                found += device_values_read_on_the_host(attribute.g, host | outer_host, small, f"{path}/{n.name}")
    return found


def test_no_engine_graph_reads_a_device_value_on_the_host(bundles):
    """The CPU's share of test_gpu's placement tests, for sessions without a GPU: nothing in the greedy-only and
    steps graphs (which CUDA graphs capture), and in the full graphs and the sampler only the If conditions that
    decide on sampling, top-k and top-p (test_gpu allows those)."""
    import onnx

    from specbuild_runtime import load_manifest

    folder = bundles("llama", 1)
    manifest = load_manifest(folder)
    files = {f for info in manifest.engines.values() for f in (info.file, info.greedy_file, info.steps_file) if f}
    for file in sorted(files | {manifest.sampler_file}):
        found = device_values_read_on_the_host(onnx.load(str(folder / file), load_external_data=False).graph)
        decisions = [f for f in found if "/If " in f] if file in (manifest.sampler_file, *(i.file for i in manifest.engines.values())) else []
        assert found == decisions, f"{file}: {[f for f in found if f not in decisions]}"


def test_the_targets_lm_head_multiplies_every_row_of_a_fixed_row_call_whatever_its_drafts(bundles):
    """On a GPU every target call has max γ + 1 rows (slot.fixed_rows), and a GEMM may round a row otherwise by how
    many rows it multiplies: so the head's row count must not follow num_drafts either (test_gpu checks the bits)."""
    import onnx
    import onnxruntime as ort

    from specbuild.compile.graphs import unprocessed
    from specbuild_runtime import load_manifest
    from specbuild_runtime.engine import session_options
    from specbuild_runtime.manifest import cache_names

    folder = bundles("llama", 1)
    manifest = load_manifest(folder)
    info, rows = manifest.engines["target"], manifest.gamma + 1
    shape, vocab = info.shape, info.shape.vocab_size
    feeds = {"input_ids": np.arange(1, rows + 1, dtype=np.int64)[None], "seqlens_k": np.array([rows - 1], np.int32),
             "total_len": np.array(rows, np.int32), "temperature": np.array(0, np.float32),
             "top_k": np.array(0, np.int64), "top_p": np.array(1, np.float32), "min_p": np.array(0, np.float32),
             **unprocessed(vocab), **{past: np.zeros((1, shape.num_kv_heads, manifest.max_seq_len, shape.head_dim),
                                                      np.float32) for past, _ in cache_names(shape.num_layers)}}
    for file in (info.file, info.greedy_file):
        model = onnx.load(str(folder / file))
        made = {out: node for node in model.graph.node for out in node.output}
        head = made[made["logits"].input[0]]  # logits: the head's last D+1 rows (a Slice; fp32, no softcap)
        assert head.op_type == "Gemm", head.op_type
        model.graph.output.append(onnx.ValueInfoProto(name=head.input[0]))
        session = ort.InferenceSession(model.SerializeToString(), session_options(), providers=["CPUExecutionProvider"])
        names = {i.name for i in session.get_inputs()}
        multiplied = {}
        for drafts in range(rows):
            feeds.update(num_drafts=np.array(drafts, np.int64), draft_probs=np.zeros((drafts, vocab), np.float32),
                         uniforms=np.zeros(drafts + 1, np.float32))
            multiplied[drafts] = len(session.run([head.input[0]], {n: feeds[n] for n in names})[0])
        assert set(multiplied.values()) == {rows}, f"{file}: num_drafts -> rows the head multiplies: {multiplied}"


def test_every_initializer_written_onto_a_full_disk_fails_with_the_disks_errno(checkpoints):
    """onnx_ir writes an ir.Tensor with numpy's tofile, whose short write says no errno ("1048576 requested and 0
    written"), so the staging could not tell a full disk from a quota or a size limit (EFBIG), and whose last
    buffered bytes fail unreported: a small tensor (a norm, a constant) onto a full disk raised nothing."""
    import errno

    model = build_decoder(load_checkpoint(checkpoints("llama"), "target"), Numerics(), MAX_LEN)
    tensors = [value.const_value for value in model.graph.initializers.values() if value.const_value.nbytes]
    assert min(t.nbytes for t in tensors) < 4096 < max(t.nbytes for t in tensors)  # buffered tails and direct writes
    for tensor in tensors:
        with pytest.raises(OSError) as failed:
            with open("/dev/full", "r+b") as full:  # every write: ENOSPC
                tensor.tofile(full)
        assert failed.value.errno == errno.ENOSPC, (tensor.name, failed.value)
