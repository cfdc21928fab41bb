"""Each architecture's ONNX graph reproduces transformers' logits, through prefill, verification and rollback."""

from pathlib import Path

import numpy as np
import pytest
import torch

import onnx_ir as ir

from conftest import ARCHITECTURES
from specbuild.compile.graphs import build_decoder
from specbuild.compile.load import load_checkpoint
from specbuild.compile.precision import Numerics
from specbuild_runtime.engine import Engine
from specbuild_runtime.slot import NEVER_ALONE, EngineSlot
from specbuild_runtime.manifest import EngineInfo

MAX_LEN = 64


def run_graph(ckpt):
    """The graph as the runtime runs a target (in-place KV cache), with the test-only `logits` output."""
    spec = ckpt.spec
    model_bytes = ir.serde.serialize_model(build_decoder(ckpt, Numerics(), MAX_LEN, with_logits=True)).SerializeToString()
    info = EngineInfo(role="target", backend="onnx", file="graph.onnx", architecture=spec.architecture,
                      precision="fp32", quantization="none", shape=spec.shape, parameters=0, weight_bytes=0, source={})
    engine = EngineSlot(Engine(Path("graph.onnx"), info, MAX_LEN, graph=model_bytes), NEVER_ALONE)

    def step(tokens, total_len, num_drafts):
        accepted, next_token = engine.step(tokens, total_len, num_drafts)
        return accepted, next_token, engine.output("logits")

    return step


@pytest.mark.parametrize("architecture", [*ARCHITECTURES, "gpt2"])
def test_graph_logits_match_transformers_through_prefill_verify_and_rollback(architecture, checkpoints):
    from transformers import AutoModelForCausalLM

    folder = checkpoints(architecture)
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
