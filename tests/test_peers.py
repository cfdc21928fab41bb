"""bench's peers measure what their rows say: transformers' assisted generation drafts a fixed γ."""

from conftest import PROMPTS
from specbuild.bench.peers import fixed_gamma
from specbuild.verify import load_reference, transformers_greedy


def test_the_assisted_peer_drafts_gamma_tokens_every_round(checkpoints, tokenizer, monkeypatch):
    from transformers.generation.candidate_generator import AssistedCandidateGenerator

    drafted = []
    get_candidates = AssistedCandidateGenerator.get_candidates

    def counted(self, input_ids, *args, **kwargs):
        candidates, logits = get_candidates(self, input_ids, *args, **kwargs)
        drafted.append(candidates.shape[1] - input_ids.shape[1])
        return candidates, logits

    monkeypatch.setattr(AssistedCandidateGenerator, "get_candidates", counted)
    target, draft = load_reference(checkpoints("llama")), load_reference(checkpoints("llama", 1), "draft")
    ids = tokenizer(PROMPTS[2])["input_ids"]
    fixed_gamma(draft, 3)
    transformers_greedy(target, ids, 40, [], assistant_model=draft)
    fixed = drafted[:-2]  # the last rounds draft no more than the tokens left
    drafted.clear()
    draft.generation_config.assistant_confidence_threshold = 0.4  # transformers' default: the control
    transformers_greedy(target, ids, 40, [], assistant_model=draft)
    assert len(fixed) > 5 and set(fixed) == {3}, fixed
    assert min(drafted[:-2]) < 3, drafted  # with the threshold on, unsure drafts stop early
