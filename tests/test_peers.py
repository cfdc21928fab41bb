"""bench's peers measure what their rows say: transformers' assisted generation drafts a fixed γ."""

from conftest import PROMPTS
from specbuild.bench.peers import fixed_gamma
from specbuild.compile.reference import load_reference, transformers_greedy


def test_the_assisted_peer_drafts_gamma_tokens_every_round(checkpoints, tokenizer, monkeypatch):
    from transformers.generation.candidate_generator import AssistedCandidateGenerator

    drafted = []
    get_candidates = AssistedCandidateGenerator.get_candidates

    def counted(self, input_ids, *args, **kwargs):
        candidates, logits = get_candidates(self, input_ids, *args, **kwargs)
        drafted.append((candidates.shape[1] - input_ids.shape[1], input_ids.shape[1]))
        return candidates, logits

    monkeypatch.setattr(AssistedCandidateGenerator, "get_candidates", counted)
    target, draft = load_reference(checkpoints("llama")), load_reference(checkpoints("llama", 1), "draft")
    ids = tokenizer(PROMPTS[2])["input_ids"]
    runs = {}
    for threshold in ("off", 0.4):  # 0.4 is transformers' default: the control
        fixed_gamma(draft, 3)
        if threshold != "off":
            draft.generation_config.assistant_confidence_threshold = threshold
        drafted.clear()
        transformers_greedy(target, ids, 16, [], assistant_model=draft)
        # Drafting stops at 3 or at the tokens left before max_new_tokens, whichever comes first.
        runs[threshold] = [n == min(3, len(ids) + 16 - length - 1) for n, length in drafted]
    assert len(runs["off"]) > 5 and all(runs["off"]), runs
    assert not all(runs[0.4]), runs  # with the threshold on, unsure drafts stop early


def test_the_onnxruntime_genai_peer_missing_on_cuda_names_its_cuda_build(monkeypatch):
    """onnxruntime-genai requires the CPU onnxruntime, which would replace onnxruntime-gpu's module: on CUDA the
    peer asked for the package that takes CUDA away."""
    import sys
    from types import SimpleNamespace

    import pytest

    from specbuild.bench.peers import _onnxruntime_genai
    from specbuild_runtime import SpecbuildError

    monkeypatch.setitem(sys.modules, "onnxruntime_genai", None)
    for device, command in (("cpu", "pip install onnxruntime-genai`"), ("cuda", "pip install onnxruntime-genai-cuda`")):
        with pytest.raises(SpecbuildError, match=command) as error:
            _onnxruntime_genai(SimpleNamespace(device=device), None, [], 1, [])
        assert "\n" not in str(error.value)
