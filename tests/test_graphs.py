"""Each architecture's ONNX graph reproduces transformers' logits, through prefill, verification and rollback."""

import numpy as np
import onnxruntime as ort
import pytest
import torch

from specbuild.checkpoint import load_checkpoint
from specbuild.graphs import build_decoder

MAX_LEN = 64


def run_graph(model_proto, spec):
    session = ort.InferenceSession(model_proto.SerializeToString(), providers=["CPUExecutionProvider"])
    binding = session.io_binding()
    shape = spec.shape
    for i in range(shape.num_layers):
        for kind in ("key", "value"):
            buffer = ort.OrtValue.ortvalue_from_numpy(np.zeros((1, shape.num_kv_heads, MAX_LEN, shape.head_dim), np.float32))
            binding.bind_ortvalue_input(f"past_{kind}.{i}", buffer)
            binding.bind_ortvalue_output(f"present_{kind}.{i}", buffer)
    greedy = {"temperature": np.array(0.0, np.float32), "top_k": np.array(0), "top_p": np.array(1.0, np.float32),
              "draft_probs": np.zeros((0, shape.vocab_size), np.float32), "uniforms": np.zeros(1, np.float32)}
    for name, value in greedy.items():
        binding.bind_cpu_input(name, value)

    def step(tokens, total_len, num_drafts):
        for name in ("accepted", "next_token", "probs", "logits"):
            binding.bind_output(name)
        binding.bind_cpu_input("input_ids", np.array([tokens], np.int64))
        binding.bind_cpu_input("total_len", np.array(total_len, np.int32))
        binding.bind_cpu_input("num_drafts", np.array(num_drafts, np.int64))
        session.run_with_iobinding(binding)
        # IO binding returns outputs in the order they were first bound: the caches, then these four.
        accepted, next_token, _, logits = (o.numpy() for o in binding.get_outputs()[-4:])
        return int(accepted), int(next_token), logits

    return step


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "mistral", "gpt2"])
def test_graph_logits_match_transformers_through_prefill_verify_and_rollback(architecture, checkpoints):
    from transformers import AutoModelForCausalLM

    folder = checkpoints(architecture)
    ckpt = load_checkpoint(folder, "target")
    step = run_graph(build_decoder(ckpt.spec, ckpt.tensors(), ckpt.config, MAX_LEN, with_logits=True), ckpt.spec)
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
    step = run_graph(build_decoder(ckpt.spec, ckpt.tensors(), ckpt.config, MAX_LEN, with_logits=True), ckpt.spec)
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
