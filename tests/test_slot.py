"""How target calls group rows (slot.Rows): the GPU's fixed-row calls decode exactly the CPU's tokens."""

import pytest

from conftest import PROMPTS
from specbuild_runtime import SpeculativeDecoder
from specbuild_runtime.slot import NEVER_ALONE, EngineSlot, fixed_rows

NEW_TOKENS = 30


@pytest.fixture(scope="module")
def bundle(bundles):
    return bundles("llama", draft_seed=0)  # draft = target: long runs of accepted drafts, and rejections


@pytest.fixture
def target_calls(monkeypatch):
    """(first position, total_len, num_drafts) of every target call."""
    calls = []
    run = EngineSlot._run

    def spy(self, first, total_len, num_drafts, *args):
        if self.engine.info.role == "target":
            calls.append((first, total_len, num_drafts))
        return run(self, first, total_len, num_drafts, *args)

    monkeypatch.setattr(EngineSlot, "_run", spy)
    return calls


@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "seed": 3}, {"temperature": 0.6, "top_k": 8, "seed": 4}])
def test_fixed_rows_decode_the_same_tokens_as_never_alone_for_every_gamma(bundle, sampling):
    """On the CPU both are exact, so equal tokens prove the fixed-row bookkeeping (re-fed rows, split
    prompts); on a GPU the same rule is what makes speculative output equal target-only output."""
    normal = SpeculativeDecoder(bundle)
    fixed = SpeculativeDecoder(bundle, target_rows=fixed_rows(normal.max_gamma))
    for prompt in (PROMPTS[3], PROMPTS[0], PROMPTS[5]):  # 1 token, shorter and longer than max γ + 1 rows
        for gamma in [*range(normal.max_gamma + 1), "auto"]:
            if gamma == "auto" and sampling:
                continue  # sampled auto runs differ by design with the rounds the policy picks
            expected = normal.generate(prompt, NEW_TOKENS, gamma, **sampling).token_ids
            assert fixed.generate(prompt, NEW_TOKENS, gamma, **sampling).token_ids == expected, (prompt, gamma)


def test_fixed_rows_calls_compute_max_gamma_plus_one_rows(bundle, target_calls, tokenizer):
    decoder = SpeculativeDecoder(bundle, target_rows=fixed_rows(4))
    rows = 4 + 1
    prompt = tokenizer(PROMPTS[5])["input_ids"]
    assert len(prompt) > rows + 1
    decoder.generate(prompt, NEW_TOKENS, gamma=3)
    (head_first, head_total, _), *calls = target_calls
    assert (head_first, head_total) == (0, len(prompt) - rows)  # the prompt: a head, then its last rows
    assert all(total - first == rows for first, total, _ in calls)
    assert any(drafts == 3 for _, _, drafts in calls)


def test_fixed_rows_after_a_short_prompt_recompute_from_the_start_until_the_cache_holds_enough(bundle, target_calls):
    decoder = SpeculativeDecoder(bundle, target_rows=fixed_rows(8))
    decoder.generate([5, 6], NEW_TOKENS, gamma=0)
    assert target_calls[:4] == [(0, 2, 0), (0, 3, 0), (0, 4, 0), (0, 5, 0)]
    assert all(total - first == 9 for first, total, _ in target_calls if total >= 9)


def test_never_alone_re_feeds_one_row_and_a_row_computed_alone(bundle, target_calls):
    decoder = SpeculativeDecoder(bundle, target_rows=NEVER_ALONE)
    decoder.generate([5], 6, gamma=2)
    assert target_calls[0] == (0, 1, 0)  # a one-token prompt has no row before it
    assert target_calls[1][0] == 0  # so the next call computes it again, with others
    assert all(total - first >= 2 for first, total, _ in target_calls[1:])
    target_calls.clear()
    decoder.generate([5, 6, 7], 6, gamma=0)
    assert [total - first for first, total, _ in target_calls] == [3] + [2] * (len(target_calls) - 1)


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "top_p": 0.9, "seed": 5}])
def test_the_device_data_flow_decodes_the_same_tokens_when_host_and_engine_memory_are_apart(bundle, sampling, monkeypatch):
    """On a GPU each per-call buffer is a host array plus a device copy: every value written on the host must
    be pushed before a call and every output pulled after it. On the CPU they share memory, which hides a
    missing push or pull; here they are kept apart (as on a device) with fixed-row calls, and the tokens
    must not change."""
    from specbuild_runtime import slot

    normal = SpeculativeDecoder(bundle)
    expected = {gamma: normal.generate(PROMPTS[5], NEW_TOKENS, gamma, **sampling).token_ids for gamma in (0, 1, 3)}

    def apart(self, host, device):
        self.host, self.device = host, device
        self.value = slot.ort.OrtValue.ortvalue_from_numpy(host.copy(), device, 0)
        self.shared = False

    monkeypatch.setattr(slot.Buffer, "__init__", apart)
    device_like = SpeculativeDecoder(bundle, target_rows=fixed_rows(normal.max_gamma))
    for gamma, tokens in expected.items():
        assert device_like.generate(PROMPTS[5], NEW_TOKENS, gamma, **sampling).token_ids == tokens, gamma
