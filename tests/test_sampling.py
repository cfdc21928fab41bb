"""Speculative sampling has exactly the target's distribution (Leviathan et al. 2023), and seeds reproduce runs.

The distribution test reads every token of every sample, so it sees tokens reached after rounds of
several drafts. Each token is put in a category by what the reference says about it in its own context:
its rank under the target's distribution p (from transformers, with transformers' temperature, top-k and
top-p), crossed with whether p ≥ q, the draft's distribution. Under an exact sampler each token's
category is drawn from the category probabilities of its context, so observed minus expected counts,
summed over tokens, are a martingale with a known covariance, and d' Σ⁻¹ d is χ² (df = categories − 1).
Ranks catch a wrong temperature, top-k or top-p; p vs q catches a wrong acceptance rule or residual.

Power (60 samples × 48 tokens = 2880 tokens a case, 10 categories): a bias as small as the one a padded
draft vocabulary caused (the first real bug this test found: before the compiler cut a larger draft
table to the target's vocabulary, drafting stopped on a padding token; λ ≈ 0.022 per token, p ≈ 1e-12
at this size) gives λ ≈ 63, which the p > 1e-4 threshold rejects with probability 0.997. The negative
control, a wrong acceptance rule (accept iff p(x) ≥ q(x)), measured λ ≈ 0.55 per token, so a sixth of
the samples (λ ≈ 260) is rejected at p < 1e-12 with probability 1 − 1e-12; auto's control, sampling at
temperature 1.5 against the reference at 1, measured λ ≈ 340 on all of them.
"""

import importlib
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers as tf
from scipy.stats import chi2
from tokenizers import Tokenizer, models, pre_tokenizers

from conftest import PROMPTS, compiled_before_min_p
from specbuild.compile import compile_bundle
from specbuild.compile.graphs import unprocessed
from specbuild.recipe import CompileSettings
from specbuild_runtime import SpeculativeDecoder

VOCAB = 24
PADDING_ROWS = 8
PROMPT = [3, 7, 1]
SAMPLES, NEW_TOKENS = 60, 48
RANK_BINS = [1, 2, 4, 8]  # ranks 0 | 1 | 2-3 | 4-7 | 8+ under p
STOPPED = 22  # the min_tokens case holds back STOPPED and STOPPED + 1: 14% of the draws at temperature 1


def word_tokenizer():
    words = ["<eos>"] + [f"w{i}" for i in range(VOCAB - 1)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # No eos here either (decoding ends at the tokenizer's too): every sample runs to NEW_TOKENS.
    return tf.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<eos>")


def llama(layers: int, vocab: int = VOCAB):
    # No eos: every sample runs to NEW_TOKENS, so every position is tested.
    config = tf.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=64,
                            bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return tf.LlamaForCausalLM(config)


def save(model, folder):
    model.eval().save_pretrained(folder)
    word_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A 4-layer target whose last three layers are damped, and a draft made of its first layer (plus
    its embeddings and head): they agree often but not always (α ≈ 0.56 at γ = 4, temperature 1).
    padded: the same draft with PADDING_ROWS more embedding rows than the tokenizer has tokens; "padded target"
    the target with as many, random, so that p gives its padding ids mass (transformers samples them)."""
    root = tmp_path_factory.mktemp("sampling")
    torch.manual_seed(0)
    target = llama(4)
    with torch.no_grad():
        for name, p in target.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.15)
                if "layers.0." not in name and name.endswith(("o_proj.weight", "down_proj.weight")):
                    p.mul_(0.3)
    drafts = {}
    for name, vocab in (("draft", VOCAB), ("padded", VOCAB + PADDING_ROWS)):
        draft = llama(1, vocab)
        with torch.no_grad():
            for key, p in draft.named_parameters():
                p.normal_(0, 0.15)
                source = target.state_dict()[key]
                p[: source.shape[0]] = source
        drafts[name] = draft
    padded_target = llama(4, VOCAB + PADDING_ROWS)
    with torch.no_grad():
        for key, p in padded_target.named_parameters():
            p.normal_(0, 0.15)
            p[: target.state_dict()[key].shape[0]] = target.state_dict()[key]
    models = {"target": target, "padded target": padded_target, **drafts}
    for name, model in models.items():
        save(model, root / name)
    for name, (target_name, draft_name) in BUNDLES.items():
        compile_bundle(CompileSettings(root / target_name, root / draft_name, root / f"bundle-{name}", max_seq_len=64),
                       show_progress=False)
    return {**{n: m.eval() for n, m in models.items()}, "bundles": {name: root / f"bundle-{name}" for name in BUNDLES}}


BUNDLES = {  # name: (target, draft)
    "draft": ("target", "draft"),
    "padded": ("target", "padded"),
    # a pair padded alike (as distill pads its drafts): the draft is cut to the tokenizer's ids, so its q is
    # zero where p is not, and the target's padding ids come from the residual alone
    "padded pair": ("padded target", "padded"),
}


WRONG_RULE = "wrong acceptance rule"
CASES = {  # name: (bundle, decoding options, negative control)
    "temperature 1, gamma 4, whole distribution": ("draft", dict(gamma=4, temperature=1.0, top_k=0, top_p=1.0), WRONG_RULE),
    "temperature 0.5, gamma 4": ("draft", dict(gamma=4, temperature=0.5), WRONG_RULE),
    "top-k 5": ("draft", dict(gamma=4, temperature=1.0, top_k=5), WRONG_RULE),
    "top-p 0.8": ("draft", dict(gamma=4, temperature=1.0, top_p=0.8), WRONG_RULE),
    # Both restrictions at once, below temperature 1: top-k then top-p on what is left, as transformers' warpers.
    "top-k 6 and top-p 0.85 at temperature 0.7": ("draft", dict(gamma=3, temperature=0.7, top_k=6, top_p=0.85), WRONG_RULE),
    # auto's γ follows measured timings: on a busy machine it may hardly speculate, so its control is a
    # wrong temperature, which the test must catch whatever γ auto picks.
    "auto gamma": ("draft", dict(gamma="auto", temperature=1.0), dict(temperature=1.5)),
    "padded draft vocabulary": ("padded", dict(gamma=4, temperature=1.0), WRONG_RULE),
    "target and draft padded alike": ("padded pair", dict(gamma=4, temperature=1.0), WRONG_RULE),
    "min-p 0.1": ("draft", dict(gamma=4, temperature=1.0, min_p=0.1), WRONG_RULE),
    # vLLM's order: min-p on the tempered distribution, then top-k, then top-p on what min-p left.
    "min-p 0.05, top-k 8 and top-p 0.9 at temperature 0.8": (
        "draft", dict(gamma=3, temperature=0.8, top_k=8, top_p=0.9, min_p=0.05), WRONG_RULE),
    # vLLM's penalties on the target's raw logits, before temperature and top-k; the draft proposes unpenalised.
    "repetition 1.5, presence 0.4 and frequency 0.3, top-k 10 at temperature 0.9": (
        "draft", dict(gamma=4, temperature=0.9, top_k=10, repetition_penalty=1.5, presence_penalty=0.4,
                      frequency_penalty=0.3), WRONG_RULE),
    # min_tokens holding back two stop tokens (which would end a sample) at every position
    "min_tokens over every token, two stop tokens": (
        "draft", dict(gamma=4, temperature=1.0, min_tokens=NEW_TOKENS, stop_token_ids=[STOPPED, STOPPED + 1]), WRONG_RULE),
    # min_tokens ending mid-sample, so that rounds straddle it: rows past it let the stop tokens end the sample
    "min_tokens ending mid-sample, two stop tokens": (
        "draft", dict(gamma=4, temperature=1.0, min_tokens=12, stop_token_ids=[STOPPED, STOPPED + 1]), WRONG_RULE),
    # OpenAI's logit_bias, before the penalties
    "logit_bias and a repetition penalty": (
        "draft", dict(gamma=4, temperature=1.0, logit_bias={STOPPED: -2.0, 5: 1.5, 9: 0.8}, repetition_penalty=1.3),
        WRONG_RULE),
}


class WrongAcceptanceRule:
    """A numpy Generator whose uniforms for judging drafts are `judging`, by default just below 1, so a draft x is
    accepted iff p(x) ≥ q(x): the classic mistake (accept the likelier, never the rest); at 0, every draft the target
    allows is accepted, right for greedy decoding only. The last uniform of a call, which draws the next token, and
    draft calls (one uniform) are left alone."""

    def __init__(self, rng, judging: float = np.float32(1 - 1e-7)):
        self.rng, self.judging = rng, judging

    def random(self, n, *args, **kwargs):
        u = self.rng.random(n, *args, **kwargs)
        if np.size(u) > 1:
            u[:-1] = self.judging
        return u

    def __getattr__(self, name):
        return getattr(self.rng, name)


def transformed(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
                min_p: float = 0.0) -> torch.Tensor:
    """The sampling distribution transformers' warpers define: [..., V] logits -> probabilities, min-p first after
    temperature, as vLLM's sampler applies it (transformers' own order puts it after top-p)."""
    shape = logits.shape
    scores = logits.reshape(-1, shape[-1]) / temperature
    if min_p:
        scores = tf.MinPLogitsWarper(min_p)(None, scores)
    if top_k:
        scores = tf.TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = tf.TopPLogitsWarper(top_p)(None, scores)
    return torch.softmax(scores, -1).reshape(shape)


def categories(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Each token's category in each context: rank bin under p, times 2, plus 1 where p < q."""
    order = torch.argsort(p, dim=-1, descending=True)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(p.shape[-1]).expand_as(order))
    return torch.bucketize(rank, torch.tensor(RANK_BINS), right=True) * 2 + (p < q).long()


def martingale_chi2(observed: np.ndarray, expected: np.ndarray) -> tuple[float, int]:
    """observed: [tokens, C] one-hot categories; expected: [tokens, C] their probabilities in context.
    Categories expected fewer than 5 times in all are pooled. Returns (statistic, degrees of freedom)."""
    totals = expected.sum(0)
    small = totals < 5
    pool = np.eye(len(totals))[~small]
    if small.any():
        pool[np.argmin(np.where(small, np.inf, totals)[~small])] += small  # into the smallest kept category
    d = pool @ (observed - expected).sum(0)
    covariance = pool @ (np.diag(totals) - expected.T @ expected) @ pool.T
    df = len(d) - 1  # the counts sum to the number of tokens: one category is implied by the rest
    return float(d[:df] @ np.linalg.solve(covariance[:df, :df], d[:df])), df


def penalised(logits: torch.Tensor, tokens: torch.Tensor, repetition=1.0, presence=0.0, frequency=0.0) -> torch.Tensor:
    """logits [N, T, V] of the positions that drew tokens [N, T] after PROMPT, with vLLM's penalties: repetition
    (transformers' RepetitionPenaltyLogitsProcessor) over the prompt and the tokens before each position, presence and
    frequency over those tokens."""
    drawn = torch.nn.functional.one_hot(tokens, logits.shape[-1]).double()
    counts = drawn.cumsum(1) - drawn  # the tokens before each position
    seen = (counts > 0) | torch.isin(torch.arange(logits.shape[-1]), torch.tensor(PROMPT))
    logits = torch.where(seen, torch.where(logits < 0, logits * repetition, logits / repetition), logits)
    return logits - frequency * counts - presence * (counts > 0).double()


def distribution_test(pair, bundle: str, samples: list[list[int]], temperature, top_k=0, top_p=1.0, min_p=0.0,
                      repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0, min_tokens=0,
                      stop_token_ids=(), logit_bias=None, **_) -> dict:
    """p-value of the samples (each up to its stop token, if it has one) against the target's distribution, and how
    many had probability zero."""
    target, draft = BUNDLES[bundle]
    length = max(map(len, samples))
    tokens = torch.tensor([s + [0] * (length - len(s)) for s in samples])
    drew = torch.arange(length) < torch.tensor([[len(s)] for s in samples])  # [N, T]: not padding
    sequences = torch.cat([torch.tensor(PROMPT).expand(len(samples), -1), tokens], 1)
    with torch.no_grad():
        p_logits = pair[target](sequences).logits[:, len(PROMPT) - 1 : -1].double()
        for token, bias in (logit_bias or {}).items():
            p_logits[..., token] += bias
        p_logits = penalised(p_logits, tokens, repetition_penalty, presence_penalty, frequency_penalty)
        p_logits[:, :min_tokens, list(stop_token_ids)] = -torch.inf
        # the draft's engine has the tokenizer's ids alone (its padding rows cut): q is 0 past them, and it
        # reads the target's padding ids as its last row
        q_logits = pair[draft](sequences.clamp(max=VOCAB - 1)).logits[:, len(PROMPT) - 1 : -1, :VOCAB].double()
    p, q = (transformed(logits, temperature, top_k, top_p, min_p) for logits in (p_logits, q_logits))
    q = torch.nn.functional.pad(q, (0, p.shape[-1] - q.shape[-1]))
    category = categories(p, q)
    count = (len(RANK_BINS) + 1) * 2
    expected = torch.zeros(*p.shape[:-1], count, dtype=torch.float64).scatter_add_(-1, category, p)[drew]
    observed = torch.nn.functional.one_hot(category.gather(-1, tokens[..., None])[..., 0], count).double()[drew]
    statistic, df = martingale_chi2(observed.numpy(), expected.numpy())
    return {"p": float(chi2.sf(statistic, df)), "statistic": statistic, "df": df,
            "impossible": int((p.gather(-1, tokens[..., None])[..., 0] == 0)[drew].sum()),
            "tail": int(observed[:, -2:].sum())}  # tokens ranked 8th or lower


def sample(decoder, options: dict, samples: int = SAMPLES) -> tuple[list[list[int]], dict]:
    runs = [decoder.generate(PROMPT, NEW_TOKENS, seed=seed, **options) for seed in range(samples)]
    per_position = [r.stats.to_dict()["per_position_acceptance"] for r in runs]
    return [r.token_ids for r in runs], {
        "acceptance": sum(r.stats.accepted for r in runs) / max(sum(r.stats.drafted for r in runs), 1),
        "runs_accepting_a_second_draft": sum(len(a) > 1 and bool(a[1]) for a in per_position),  # None: never proposed
    }


@pytest.fixture(scope="module")
def sampled(pair):
    """sampled(case) -> (samples, what the runs saw); control=True: the case's negative control, the wrong
    rule on a sixth of the samples (its λ is ~20x what rejection needs, so fewer samples suffice)."""
    cache = {}

    def get(case: str, control: bool = False):
        if (case, control) not in cache:
            draft, options, wrong = CASES[case]
            decoder = SpeculativeDecoder(pair["bundles"][draft])
            if not control:
                cache[case, control] = sample(decoder, options)
            elif wrong == WRONG_RULE:
                default_rng = np.random.default_rng
                np.random.default_rng = lambda seed=None: WrongAcceptanceRule(default_rng(seed))
                try:
                    cache[case, control] = sample(decoder, options, SAMPLES // 6)
                finally:
                    np.random.default_rng = default_rng
            else:
                cache[case, control] = sample(decoder, {**options, **wrong})
        return cache[case, control]

    return get


@pytest.mark.parametrize("case", CASES)
def test_speculative_samples_follow_the_target_distribution_and_a_wrong_sampler_is_caught(case, pair, sampled):
    draft, options, _ = CASES[case]
    samples, seen = sampled(case)
    real = distribution_test(pair, draft, samples, **options)
    control = distribution_test(pair, draft, sampled(case, control=True)[0], **options)
    print(f"{case}: p {real['p']:.3g}, control {control['p']:.3g}; {seen}")
    if options["gamma"] != "auto":
        assert 0.1 < seen["acceptance"] < 0.95 and seen["runs_accepting_a_second_draft"] > SAMPLES // 4, seen
    assert real["impossible"] == 0, "sampled tokens the reference gives probability 0"
    if BUNDLES[draft][0] == "padded target":  # not hollow: the target's padding ids were sampled
        assert max(map(max, samples)) >= VOCAB
    if options.get("min_tokens", NEW_TOKENS) < NEW_TOKENS:  # not hollow: stop tokens ended samples past min_tokens
        assert sum(len(s) < NEW_TOKENS for s in samples) > SAMPLES // 2
    assert real["p"] > 1e-4, real
    assert control["p"] < 1e-12, control


def test_top_p_one_and_top_k_zero_keep_the_whole_distribution(pair, sampled):
    """Tokens ranked 8th or lower in their context carry ~12% of the mass: they must be sampled, about as
    often as the reference says (a trimmed tail would leave them out)."""
    case = "temperature 1, gamma 4, whole distribution"
    draft, options, _ = CASES[case]
    result = distribution_test(pair, draft, sampled(case)[0], **options)
    assert result["tail"] > 100 and result["p"] > 1e-4, result


def test_min_p_samples_the_same_distribution_target_only_as_speculatively(pair, sampled):
    """gamma 0 (the target alone) and gamma 4 each follow the target's min-p distribution; min-p left out
    (the old bundles' sampling) samples tokens that distribution gives probability 0."""
    case = "min-p 0.1"
    draft, options, _ = CASES[case]
    decoder = SpeculativeDecoder(pair["bundles"][draft])
    alone = distribution_test(pair, draft, sample(decoder, {**options, "gamma": 0})[0], **options)
    speculative = distribution_test(pair, draft, sampled(case)[0], **options)
    without = distribution_test(pair, draft, sample(decoder, {**options, "min_p": 0.0}, SAMPLES // 6)[0], **options)
    assert alone["impossible"] == speculative["impossible"] == 0 and alone["p"] > 1e-4 and speculative["p"] > 1e-4
    assert without["impossible"] > 0, without


def test_penalties_sample_the_same_distribution_target_only_as_speculatively(pair, sampled):
    """gamma 0 (the target alone) and gamma 4 each follow the target's penalised distribution, which samples drawn
    without the penalties do not."""
    case = "repetition 1.5, presence 0.4 and frequency 0.3, top-k 10 at temperature 0.9"
    draft, options, _ = CASES[case]
    decoder = SpeculativeDecoder(pair["bundles"][draft])
    alone = distribution_test(pair, draft, sample(decoder, {**options, "gamma": 0})[0], **options)
    speculative = distribution_test(pair, draft, sampled(case)[0], **options)
    unpenalised = {**options, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}
    without = distribution_test(pair, draft, sample(decoder, unpenalised, SAMPLES // 6)[0], **options)
    assert alone["impossible"] == speculative["impossible"] == 0 and alone["p"] > 1e-4 and speculative["p"] > 1e-4
    assert without["p"] < 1e-12, without


@pytest.mark.parametrize("options", [{"temperature": 1.0}, {"temperature": 0.8, "top_k": 12, "top_p": 0.9}])
def test_min_p_zero_samples_the_tokens_of_no_min_p(options, bundles, tokenizer):
    decoder = SpeculativeDecoder(bundles("llama", draft_seed=1))
    ids = tokenizer(PROMPTS[0])["input_ids"]
    for gamma in (0, 3):
        assert (decoder.generate(ids, 30, gamma, seed=4, min_p=0.0, **options).token_ids
                == decoder.generate(ids, 30, gamma, seed=4, **options).token_ids)


def test_a_bundle_compiled_before_min_p_decodes_and_refuses_min_p_in_one_line(bundles, tokenizer, tmp_path):
    import shutil

    from specbuild_runtime import RequestError

    old = compiled_before_min_p(Path(shutil.copytree(bundles("llama", draft_seed=1), tmp_path / "old")))
    before, now = SpeculativeDecoder(old), SpeculativeDecoder(bundles("llama", draft_seed=1))
    assert not before.has_min_p and now.has_min_p
    ids = tokenizer(PROMPTS[0])["input_ids"]
    for options in ({}, {"temperature": 0.8, "top_p": 0.9, "seed": 2}):
        assert before.generate(ids, 12, 3, **options).token_ids == now.generate(ids, 12, 3, **options).token_ids
    from specbuild_runtime.serve.protocol import invalid

    with pytest.raises(RequestError, match=r"^min_p needs a bundle compiled with min_p sampling; \S+ was compiled before "
                                           r"it: recompile it with `specbuild compile`, or leave min_p out$") as refused:
        before.generate(ids, 8, temperature=1.0, min_p=0.1)
    assert invalid(refused.value).param == "min_p"  # serve's 400 names the field, as for any other min_p
    with pytest.raises(RequestError, match=r"^min_p must be a number"):  # checked as on any bundle, then refused
        before.generate(ids, 8, temperature=1.0, min_p="0.1")


def test_same_seed_reproduces_and_different_seeds_differ(bundles, tokenizer):
    decoder = SpeculativeDecoder(bundles("llama", draft_seed=1))
    ids = tokenizer(PROMPTS[0])["input_ids"]
    for options in ({}, {"min_p": 0.05}):
        runs = [decoder.generate(ids, 30, 3, temperature=1.0, seed=s, **options).token_ids for s in (7, 7, 8)]
        assert runs[0] == runs[1]
        assert runs[0] != runs[2]


@pytest.mark.parametrize("options", [{"temperature": 0.0}, {"temperature": 1.0, "top_k": 1},
                                     {"temperature": 0.7, "top_p": 1e-6}])
def test_degenerate_sampling_settings_equal_greedy(options, bundles, tokenizer):
    decoder = SpeculativeDecoder(bundles("qwen2", draft_seed=1))
    ids = tokenizer(PROMPTS[2])["input_ids"]
    greedy = decoder.generate(ids, 25, 0).token_ids
    for gamma in (0, 3):
        assert decoder.generate(ids, 25, gamma, seed=1, **options).token_ids == greedy


def sampler_session():
    import onnx_ir as ir
    import onnxruntime as ort

    from specbuild.compile.graphs import build_sampler
    from specbuild_runtime.engine import session_options

    # session_options: an earlier test may have made the process share one thread pool
    return ort.InferenceSession(ir.to_proto(build_sampler()).SerializeToString(), session_options(),
                                providers=["CPUExecutionProvider"])


def kept(sampler, p: np.ndarray, temperature: float = 1.0, top_p: float = 1.0, min_p: float = 0.0) -> list[int]:
    """The tokens the sampler's distribution keeps from p (no drafts)."""
    inputs = {"logits": np.log(p).astype(np.float32)[None], "input_ids": np.zeros((1, 1), np.int64),
              "num_drafts": np.array(0, np.int64), "temperature": np.array(temperature, np.float32),
              "top_k": np.array(0, np.int64), "top_p": np.array(top_p, np.float32), "min_p": np.array(min_p, np.float32),
              "draft_probs": np.zeros((0, len(p)), np.float32), "uniforms": np.array([0.5], np.float32),
              **unprocessed(len(p))}
    return np.flatnonzero(sampler.run(["probs"], inputs)[0]).tolist()


def row_judged(sampler, logits: np.ndarray, drafts: list[int], row: int, processing: dict) -> np.ndarray:
    """The distribution the sampler decides row `row` of a call with drafts from (its `probs` output): drafts before
    it accepted (u = 0), draft `row` rejected (q = 1 at it, u just below 1; past the last draft: the bonus row)."""
    vocab = logits.shape[1]
    q = np.eye(vocab, dtype=np.float32)[drafts]
    uniforms = np.array([0.0] * row + [1 - 1e-7] * (len(drafts) + 1 - row), np.float32)
    inputs = {"logits": logits, "input_ids": np.array([[1, *drafts]], np.int64),
              "num_drafts": np.array(len(drafts), np.int64), "temperature": np.array(0.8, np.float32),
              "top_k": np.array(0, np.int64), "top_p": np.array(1.0, np.float32), "min_p": np.array(0.0, np.float32),
              "draft_probs": q, "uniforms": uniforms, **unprocessed(vocab), **processing}
    accepted, probs = sampler.run(["accepted", "probs"], inputs)
    assert accepted == row
    return probs


def test_each_sampled_row_is_judged_with_the_drafts_before_it_counted_as_the_target_alone_counts_them(monkeypatch):
    """Leviathan et al.'s rule is exact when row j's p is the target-alone distribution after drafts 0..j-1: with
    penalties, min_tokens and logit_bias, row j of a call with drafts (the p that judges draft j and that a rejection's
    residual comes from; the bonus row after the last) is the distribution a call without drafts gives once those drafts
    were generated (output_counts and min_tokens_left moved on by them). The greedy tests check argmaxes alone; here
    every row's whole distribution, in the sampling branch. A sampler whose rows leave the drafts out is caught."""
    vocab, drafts, stops = 16, [5, 9, 5, 12], [3, 11]
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 1.5, (len(drafts) + 1, vocab)).astype(np.float32)
    bias = np.zeros((1, vocab), np.float32)
    bias[0, [5, 11]] = 1.2, 0.7
    counts = np.zeros(vocab, np.float32)
    counts[[9, 2]] = 1, 2  # generated before the call

    def processing(generated: list[int], left: int) -> dict:
        return {"repetition_penalty": np.array(1.7, np.float32), "presence_penalty": np.array(0.6, np.float32),
                "frequency_penalty": np.array(0.9, np.float32), "prompt_mask": np.isin(np.arange(vocab), [1, 7, 12]),
                "output_counts": counts + np.bincount(generated, minlength=vocab).astype(np.float32),
                "min_tokens_left": np.array(left, np.int64), "stop_tokens": np.isin(np.arange(vocab), stops),
                "logit_bias": bias}

    def rows(sampler) -> list[tuple[np.ndarray, np.ndarray]]:
        # min_tokens 2 left: the stop tokens are held back in rows 0 and 1 alone
        return [(row_judged(sampler, logits, drafts, j, processing([], 2)),
                 row_judged(sampler, logits[j:j + 1], [], 0, processing(drafts[:j], 2 - j)))
                for j in range(len(drafts) + 1)]

    for j, (speculative, alone) in enumerate(rows(sampler_session())):
        np.testing.assert_allclose(speculative, alone, rtol=1e-6, atol=1e-9, err_msg=f"row {j}")  # measured bit for bit
        assert (speculative[stops] == 0).all() == (j < 2), j
    verification = importlib.import_module("specbuild.compile.graphs.verification")
    penalised = verification._penalised
    monkeypatch.setattr(verification, "_penalised", lambda g, logits, drafts, p: penalised(
        g, logits, g.op("Slice", drafts, g.const([0]), g.const([0])), p))
    wrong = rows(sampler_session())
    assert all(not np.allclose(speculative, alone, rtol=1e-3) for speculative, alone in wrong[1:])


def test_min_p_drops_what_vllm_drops_after_temperature_and_before_top_p():
    """min_p keeps the tokens at least min_p times as probable as the most probable, of the tempered distribution;
    top-p then takes its mass from what min-p kept (vLLM's order: transformers' min-p after top-p keeps 1, 3, 4)."""
    sampler = sampler_session()
    p = np.array([0.05, 0.5, 0.1, 0.2, 0.15])
    assert kept(sampler, p, min_p=0.25) == [1, 3, 4]  # at least 0.125
    assert kept(sampler, p, min_p=0.25, temperature=2.0) == [0, 1, 2, 3, 4]  # tempered: sqrt(0.05 / 0.5) > 0.25
    assert kept(sampler, p, min_p=0.25, top_p=0.8) == [1, 3]  # 0.5 / 0.85 < 0.8 <= 0.7 / 0.85
    assert kept(sampler, p, min_p=1.0) == [1]
    assert kept(sampler, p, min_p=0.0) == [0, 1, 2, 3, 4]


def draw(sampler, p: np.ndarray, u: float, top_p: float = 1.0) -> int:
    """The token the sampler draws from p with uniform u (no drafts, temperature 1)."""
    inputs = {"logits": np.log(p).astype(np.float32)[None], "input_ids": np.zeros((1, 1), np.int64),
              "num_drafts": np.array(0, np.int64), "temperature": np.array(1, np.float32),
              "top_k": np.array(0, np.int64), "top_p": np.array(top_p, np.float32), "min_p": np.array(0, np.float32),
              "draft_probs": np.zeros((0, len(p)), np.float32), "uniforms": np.array([u], np.float32),
              **unprocessed(len(p))}
    return int(sampler.run(["next_token"], inputs)[0])


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_drafts_stand_up_to_a_row_of_logits_that_is_not_finite_which_draws_no_token(bad):
    """Logits holding NaN or +inf (an fp16 engine that overflows) made NaN probabilities, from which the inverse
    CDF drew token 0 without a word. Drafts judged on finite rows stand (the target alone would have emitted
    them); the first row that is not finite draws NOT_FINITE, which the runtime reports."""
    from specbuild.compile.graphs.verification import NOT_FINITE

    sampler, vocab = sampler_session(), 8
    for row, accepted in ((2, 2), (1, 1), (0, 0)):
        logits = np.zeros((3, vocab), np.float32)
        logits[:, 3] = 10  # both drafts (token 3) near-certain: accepted where the row is finite
        logits[row, 5] = bad
        inputs = {"logits": logits, "input_ids": np.array([[1, 3, 3]], np.int64), "num_drafts": np.array(2, np.int64),
                  "temperature": np.array(1, np.float32), "top_k": np.array(0, np.int64), "top_p": np.array(1, np.float32),
                  "min_p": np.array(0, np.float32), "draft_probs": np.eye(2, vocab, 3, dtype=np.float32), "uniforms": np.full(3, 0.5, np.float32),
                  **unprocessed(vocab)}
        assert [int(x) for x in sampler.run(["accepted", "next_token"], inputs)] == [accepted, NOT_FINITE]


def test_a_token_whose_logit_is_minus_infinity_is_one_of_probability_0_not_an_error():
    p = np.array([0.5, 0.0, 0.5])
    with np.errstate(divide="ignore"):  # log 0 = -inf, the logit
        assert [draw(sampler_session(), p, u) for u in (0.25, 0.75)] == [0, 2]


def test_a_run_of_tokens_below_a_float32_step_of_the_running_sum_is_drawn_at_its_rate():
    """The next token is drawn by inverse CDF in vocabulary order. 40,000 tokens of p = 2.5e-8 (0.1% of the mass,
    as a large vocabulary's tail holds) after one of 0.9: each is below half a float32 step at 0.9 (3e-8), so a
    float32 running sum left them out and the uniforms in [0.9, 0.901) drew the token after them instead."""
    sampler, tail = sampler_session(), 40_000
    p = np.concatenate([[0.9], np.full(tail, 2.5e-8), [0.1 - 2.5e-8 * tail]])
    uniforms = 0.899 + (np.arange(300) + 0.5) * 1e-5  # 100 below the tail's interval, 100 in it, 100 above
    drawn = [draw(sampler, p, u) for u in uniforms]
    assert drawn[:100] == [0] * 100 and drawn[200:] == [tail + 1] * 100
    assert all(0 < token <= tail for token in drawn[100:200]) and drawn[100:200] == sorted(drawn[100:200])


@pytest.mark.parametrize("vocab", [1, 5, 63, 64, 65, 1000])
def test_the_blocked_running_sum_draws_what_a_plain_one_draws(vocab):
    """The running sums are summed in blocks (onnxruntime's CUDA CumSum is quadratic in the vocabulary): every
    vocabulary size, a multiple of the block or not, draws the token a float64 inverse CDF draws, and the top-p
    nucleus keeps what its plain running sum keeps."""
    rng = np.random.default_rng(vocab)
    p = rng.dirichlet(np.full(vocab, 0.3)).astype(np.float32).astype(np.float64)
    p /= p.sum()
    sampler = sampler_session()
    for u in rng.random(40, dtype=np.float32):
        probs = np.exp(np.log(p).astype(np.float32) - np.log(p).astype(np.float32).max())
        cdf = np.cumsum((probs / probs.sum()).astype(np.float32).astype(np.float64))
        assert draw(sampler, p, float(u)) == min(int((cdf <= float(u) * cdf[-1]).sum()), vocab - 1)
    nucleus = np.sort(p)[::-1]
    top = nucleus[0] if vocab == 1 else nucleus[min(vocab - 1, int(np.searchsorted(np.cumsum(nucleus), 0.5)))]
    assert p[draw(sampler, p, 0.999, top_p=0.5)] >= top * (1 - 1e-5)


@pytest.mark.parametrize("flat", [False, True])
def test_the_nucleus_is_the_whole_rankings_whether_its_top_candidates_hold_it_or_not(flat):
    """top-p ranks the 1024 most probable tokens first, and the whole vocabulary only when they hold less than
    top_p (sorting all of it cost ~18 ms a row at 152k): both ways keep the tokens a full sort keeps."""
    rng = np.random.default_rng(1)
    vocab = 3000
    logits = rng.normal(size=vocab) * (0.1 if flat else 4.0)
    p = np.exp(logits - logits.max())
    p /= p.sum()
    sampler = sampler_session()
    inputs = {"logits": logits.astype(np.float32)[None], "input_ids": np.zeros((1, 1), np.int64),
              "num_drafts": np.array(0, np.int64), "temperature": np.array(1, np.float32),
              "top_k": np.array(0, np.int64), "top_p": np.array(0.9, np.float32), "min_p": np.array(0, np.float32),
              "draft_probs": np.zeros((0, vocab), np.float32), "uniforms": np.array([0.5], np.float32),
              **unprocessed(vocab)}
    trimmed = sampler.run(["probs"], inputs)[0]
    ranked = np.sort(p)[::-1]
    kept = int(((np.cumsum(ranked) - ranked) < 0.9).sum())
    assert (kept > 1024) == flat
    assert int((trimmed > 0).sum()) == kept and np.allclose(trimmed[trimmed > 0].sum(), 1, atol=1e-5)
    assert set(np.flatnonzero(trimmed)) == set(np.argsort(-p)[:kept])
