"""Requests and bundles are checked at the boundary: every bad value is a one-line error, nothing is coerced."""

import json
import math
import re
import shutil
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import PROMPTS
from specbuild_runtime import BundleError, RequestError, SpeculativeDecoder
from specbuild_runtime.validation import MAX_STOP_STRINGS, TokenSpan, check_request

V, MAX_LEN, MAX_GAMMA = 50, 16, 8


def encode(text):
    return [ord(c) % V for c in text]


def check(prompt=(1, 2, 3), encode=encode, **fields):
    return check_request(prompt, encode=encode, vocab_size=V, max_seq_len=MAX_LEN, max_gamma=MAX_GAMMA, **fields)


BAD = [  # (what, request fields, words the message must contain)
    ("negative token id", dict(prompt=[1, -1]), "-1"),
    ("token id = vocabulary size", dict(prompt=[V]), f"[0, {V})"),
    ("float token id", dict(prompt=[1, 2.0]), "whole numbers"),
    ("bool token id", dict(prompt=[True]), "whole numbers"),
    ("a batch of prompts, as vLLM takes them", dict(prompt=["def f():", "import os"]), "a call decodes one prompt"),
    ("a batch longer than the context", dict(prompt=["def f():"] * (MAX_LEN + 1)), "a call decodes one prompt"),
    ("bytes prompt", dict(prompt=b"abc"), "not bytes"),
    ("2-D NumPy prompt", dict(prompt=np.ones((1, 3), np.int64)), "1-D"),
    ("float NumPy prompt", dict(prompt=np.ones(3)), "integer"),
    ("lone surrogate", dict(prompt="ab\ud800"), "UTF-8"),
    ("empty prompt", dict(prompt=[]), "empty"),
    ("prompt longer than the context", dict(prompt=[1] * (MAX_LEN + 1)), "--max-seq-len"),
    ("max_new_tokens 0", dict(max_new_tokens=0), "max_new_tokens"),
    ("max_new_tokens 2.5", dict(max_new_tokens=2.5), "max_new_tokens"),
    ("max_new_tokens '8'", dict(max_new_tokens="8"), "max_new_tokens"),
    ("temperature NaN", dict(temperature=float("nan")), "finite"),
    ("temperature inf", dict(temperature=math.inf), "finite"),
    ("temperature beyond float32", dict(temperature=1e39), "finite number float32 holds (at most 3.4e+38"),
    ("temperature an int beyond any float", dict(temperature=10 ** 400), "finite"),  # JSON's 1 and 400 zeros
    ("top_p an int beyond any float", dict(top_p=-10 ** 400), "finite"),
    ("negative temperature", dict(temperature=-0.1), "temperature"),
    ("top_p 0", dict(top_p=0.0), "top_p"),
    ("top_p above 1", dict(top_p=1.5), "top_p"),
    ("top_k below -1", dict(top_k=-2), "top_k must be >= -1 (0 or -1 = no limit)"),
    ("negative min_p", dict(min_p=-0.1), "min_p must be in [0, 1]"),
    ("min_p above 1", dict(min_p=1.5), "min_p must be in [0, 1]"),
    ("min_p not a number", dict(min_p="0.1"), "min_p must be a number"),
    ("repetition_penalty 0", dict(repetition_penalty=0), "repetition_penalty must be above 0 (1 = none), not 0.0"),
    ("negative repetition_penalty", dict(repetition_penalty=-1.2), "repetition_penalty must be above 0"),
    ("presence_penalty below -2", dict(presence_penalty=-2.5), "presence_penalty must be in [-2, 2] (0 = none)"),
    ("frequency_penalty above 2", dict(frequency_penalty=2.01), "frequency_penalty must be in [-2, 2] (0 = none)"),
    ("frequency_penalty not finite", dict(frequency_penalty=float("nan")), "frequency_penalty must be a finite number"),
    ("presence_penalty not a number", dict(presence_penalty="1"), "presence_penalty must be a number"),
    ("min_tokens above max_new_tokens", dict(max_new_tokens=4, min_tokens=5), "min_tokens must be from 0 to 4"),
    ("negative min_tokens", dict(min_tokens=-1), "min_tokens must be from 0 to"),
    ("logit_bias not a dict", dict(logit_bias=[1, 2]), "logit_bias must map token ids to biases"),
    ("logit_bias key outside the vocabulary", dict(logit_bias={10**6: 1.0}), "logit_bias must be from 0 to"),
    ("logit_bias beyond 100", dict(logit_bias={3: -100.5}), "logit_bias must hold biases in [-100, 100]"),
    ("logit_bias not a number", dict(logit_bias={3: "1"}), "logit_bias must be a number"),
    ("float top_k", dict(top_k=1.0), "top_k"),
    ("float seed", dict(seed=1.5), "seed"),
    ("gamma above the bundle's", dict(gamma=MAX_GAMMA + 1), f"0 to {MAX_GAMMA}"),
    ("gamma 10**9", dict(gamma=10 ** 9), f"0 to {MAX_GAMMA}"),
    ("negative gamma", dict(gamma=-1), "gamma"),
    ("gamma 'fast'", dict(gamma="fast"), "auto"),
    ("seventeen stop strings", dict(stop=list("abcdefghijklmnopq")), f"at most {MAX_STOP_STRINGS}"),
    ("empty stop string", dict(stop=[""]), "empty"),
    ("stop not text", dict(stop=[1]), "stop"),
    ("ignore_eos 1", dict(ignore_eos=1), "ignore_eos must be true or false"),
    ("include_stop_str_in_output 'yes'", dict(include_stop_str_in_output="yes"), "include_stop_str_in_output"),
    ("skip_special_tokens None", dict(skip_special_tokens=None), "skip_special_tokens must be true or false"),
    ("stop_token_ids a number", dict(stop_token_ids=5), "stop_token_ids must be a list"),
    ("stop_token_id = vocabulary size", dict(stop_token_ids=[1, V]), f"stop_token_ids must be from 0 to {V - 1}"),
    ("float stop_token_id", dict(stop_token_ids=[1.0]), "stop_token_ids must be a whole number"),
]


@pytest.mark.parametrize("fields,words", [case[1:] for case in BAD], ids=[case[0] for case in BAD])
def test_bad_request_is_one_line_naming_the_value(fields, words):
    with pytest.raises(RequestError) as error:
        check(**fields)
    assert words in str(error.value) and "\n" not in str(error.value)


def test_a_wrong_value_is_quoted_cut_short_not_whole():
    # a batch of long texts (vLLM's form) quoted its first text whole: a 100,000-character message
    for fields in (dict(prompt=["x" * 100_000, "y"]), dict(gamma="x" * 100_000), dict(stop={"x": "y" * 100_000}),
                   dict(seed="x" * 100_000), dict(temperature=["x"] * 100_000),
                   # Python writes no integer of over 4300 digits: a ValueError of its own, not the RequestError
                   dict(gamma=10 ** 5000), dict(max_new_tokens=-10 ** 5000), dict(temperature=10 ** 5000)):
        with pytest.raises(RequestError) as error:
            check(**fields)
        assert len(str(error.value)) < 300, str(error.value)[:300]


def test_numpy_values_and_seeds_of_any_size_are_accepted():
    request = check(np.array([3, 4], np.int32), max_new_tokens=np.int64(5), gamma=np.uint8(2), top_k=np.int16(10 ** 3),
                    temperature=np.float32(0.5), seed=2 ** 70)
    assert request.prompt_ids == [3, 4] and request.max_new_tokens == 5 and request.gamma == 2
    assert request.sampling.top_k == V  # above the vocabulary: every token, as 0
    assert type(request.prompt_ids[0]) is int
    # stop_token_ids in any form a prompt's ids come in (they were refused as an array: "must be a list")
    for ids in (np.array([3, 4], np.int64), {3, 4}, frozenset((3, 4))):
        assert check(stop_token_ids=ids).stop_token_ids == {3, 4}
    with pytest.raises(RequestError, match="stop_token_ids must be a whole number"):
        check(stop_token_ids=np.array([3.0]))


def test_numpy_half_floats_are_taken_without_a_warning():
    # NumPy 2 (NEP 50) casts the Python float a float16 is compared with to float16: FLOAT32_MAX overflowed there,
    # a RuntimeWarning (an exception where warnings are errors, as under pytest -W error)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sampling = check(temperature=np.float16(0.5), top_p=np.float16(0.25)).sampling
    assert (sampling.temperature, sampling.top_p) == (0.5, 0.25)
    with pytest.raises(RequestError, match="finite"):
        check(temperature=np.float16("inf"))


def test_seeds_of_any_size_reproduce_and_differ_from_each_other():
    draws = {seed: check(seed=seed).sampling.generator().random(4).tolist() for seed in (0, 1, 2 ** 64 + 1, 10 ** 40)}
    assert len({tuple(d) for d in draws.values()}) == len(draws)
    assert all(check(seed=seed).sampling.generator().random(4).tolist() == d for seed, d in draws.items())
    assert draws[1] == np.random.default_rng(1).random(4).tolist()  # numpy's own streams


@pytest.mark.parametrize("seed", [-1, np.int64(-1)], ids=["int", "numpy"])
def test_a_seed_of_minus_one_is_a_random_seed_as_llama_cpps(seed):
    """llama.cpp's -1 (LLAMA_DEFAULT_SEED, its --seed's and its server's default): a random seed, as no seed. It was a
    fixed seed of its own, which a llama.cpp user meant as random."""
    assert check(seed=seed, temperature=1.0).sampling == check(temperature=1.0).sampling


@pytest.mark.parametrize("seed", [-2, -(2 ** 70)])
def test_a_seed_below_minus_one_is_refused_saying_what_minus_one_means(seed):
    with pytest.raises(RequestError, match=r"^seed must be >= -1 \(-1: a random seed, as llama.cpp's\), not -"):
        check(seed=seed)


def is_int(x):
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def is_real(x):
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


def reference_valid(prompt, max_new_tokens, gamma, temperature, top_k, top_p, seed, stop):
    """The rules, written plainly."""
    def finite32(x):
        return is_real(x) and abs(x) <= float(np.finfo(np.float32).max) and math.isfinite(x)

    def utf8(text):
        try:
            return bool(text.encode("utf-8")) or True
        except UnicodeEncodeError:
            return False

    if isinstance(prompt, str):
        if not utf8(prompt):
            return False
        ids = encode(prompt)
    else:
        if not all(is_int(t) for t in prompt):
            return False
        ids = list(prompt)
    stops = [stop] if isinstance(stop, str) else stop
    return (0 < len(ids) <= MAX_LEN and all(0 <= t < V for t in ids)
            and is_int(max_new_tokens) and max_new_tokens >= 1
            and (gamma == "auto" or (is_int(gamma) and 0 <= gamma <= MAX_GAMMA))
            and finite32(temperature) and temperature >= 0
            and finite32(top_p) and 0 < top_p <= 1
            and is_int(top_k) and top_k >= -1
            and (seed is None or (is_int(seed) and seed >= -1))
            and (stops is None or (isinstance(stops, list) and len(stops) <= MAX_STOP_STRINGS
                                   and all(isinstance(s, str) and s and utf8(s) for s in stops))))


anything = st.one_of(st.none(), st.booleans(), st.integers(-5, 70), st.integers(), st.just(10 ** 400), st.floats(allow_nan=True),
                     st.text(max_size=3), st.just(np.int64(3)), st.just(np.float32(0.5)))
prompts = st.one_of(st.text(max_size=20), st.lists(st.one_of(st.integers(-3, V + 3), st.booleans(), st.floats(0, V),
                                                             st.just(np.int32(7))), max_size=20))


@settings(max_examples=400, deadline=None)
@given(prompt=prompts, max_new_tokens=anything, gamma=st.one_of(anything, st.just("auto")), temperature=anything,
       top_k=anything, top_p=anything, seed=anything,
       stop=st.one_of(st.none(), st.text(max_size=3), st.lists(st.one_of(st.text(max_size=3), st.integers()), max_size=6)))
def test_a_request_is_refused_exactly_when_a_rule_is_broken(prompt, max_new_tokens, gamma, temperature, top_k, top_p,
                                                           seed, stop):
    fields = dict(max_new_tokens=max_new_tokens, gamma=gamma, temperature=temperature, top_k=top_k, top_p=top_p,
                  seed=seed, stop=stop)
    try:
        request = check(prompt, **fields)
    except RequestError as error:
        assert not reference_valid(prompt, **fields), error
        assert "\n" not in str(error)
        return
    assert reference_valid(prompt, **fields)
    assert all(type(t) is int for t in request.prompt_ids)
    assert request.sampling.temperature == (float(temperature) if temperature >= 1e-5 else 0.0)


@pytest.mark.parametrize("temperature", [1.2e-38, 1e-45, 9.9e-6])
def test_a_temperature_too_small_to_sample_with_decodes_greedily(bundles, temperature):
    """Logits divided by 1.2e-38 overflow float32; sampling at 1e-5 is greedy but for exact ties (as vLLM)."""
    decoder = SpeculativeDecoder(bundles("llama"))
    greedy = decoder.generate(PROMPTS[0], 24, gamma=3)
    tiny = decoder.generate(PROMPTS[0], 24, gamma=3, temperature=temperature, seed=1)
    assert tiny.token_ids == greedy.token_ids and tiny.stats.finish_reason == greedy.stats.finish_reason


def test_top_k_minus_1_keeps_every_token_as_0_does_as_vllm_takes_it(bundles):
    """vLLM's "no limit": its clients send it; generate(top_k=-1) was refused."""
    decoder = SpeculativeDecoder(bundles("llama"))
    assert check(top_k=-1, temperature=1.0).sampling.top_k == 0
    unlimited = decoder.generate(PROMPTS[0], 24, gamma=3, temperature=1.0, top_k=0, seed=1)
    assert decoder.generate(PROMPTS[0], 24, gamma=3, temperature=1.0, top_k=-1, seed=1).token_ids == unlimited.token_ids


@pytest.mark.parametrize("top_p", [1e-46, 5e-324])
def test_a_top_p_too_small_for_float32_keeps_the_most_likely_token(bundles, top_p):
    """In (0, 1] but 0 in float32, which kept no token (every request ended at once with token 0)."""
    decoder = SpeculativeDecoder(bundles("llama"))
    top_1 = decoder.generate(PROMPTS[0], 24, gamma=3, temperature=1.0, top_p=1e-30, seed=1)
    tiny = decoder.generate(PROMPTS[0], 24, gamma=3, temperature=1.0, top_p=top_p, seed=1)
    assert tiny.token_ids == top_1.token_ids and tiny.stats.finish_reason == top_1.stats.finish_reason
    assert len(top_1.token_ids) == 24


EDITS = [("engines.target.shape.num_layers", 3), ("engines.draft.shape.num_layers", 1),
         ("engines.target.shape.vocab_size", 500), ("engines.draft.shape.head_dim", 8),
         ("engines.target.shape.num_kv_heads", 4), ("engines.target.precision", "fp16"), ("max_seq_len", 512)]


@pytest.mark.parametrize("key,value", EDITS, ids=[key for key, _ in EDITS])
def test_an_edited_manifest_fails_at_load_in_one_line(key, value, bundles, tmp_path):
    """The manifest is not among the files its digests cover: it is checked against the engines instead."""
    folder = tmp_path / "bundle"
    shutil.copytree(bundles("llama", draft_seed=1), folder)
    data = json.loads((folder / "manifest.json").read_text())
    *path, field = key.split(".")
    place = data
    for part in path:
        place = place[part]
    place[field] = value
    (folder / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(BundleError, match="does not match the bundle's manifest") as error:
        SpeculativeDecoder(folder)
    assert "\n" not in str(error.value)


DELETE = object()
DAMAGE = [
    ("engines.target", DELETE, "engines are ['draft'], not a target and a draft"),
    ("gamma", "x", "gamma must be a whole number"), ("gamma", True, "gamma must be a whole number"),
    ("gamma", 0, "from 1 to 32"), ("gamma", 99, "from 1 to 32"), ("max_seq_len", 1, "2 or more"),
    ("files", [], "files must be an object"), ("files", {}, "is not among the files"),
    ("files", {"../outside.onnx": "0" * 64}, "not a path inside the bundle"),
    ("files", {"/etc/passwd": "0" * 64}, "not a path inside the bundle"),
    ("eos_token_ids", [-1], "eos_token_ids"), ("eos_token_ids", [10**6], "eos_token_ids"),
    ("eos_token_ids", "2", "eos_token_ids must be a list"), ("sampler_file", "elsewhere.onnx", "is not among the files"),
    ("engines.draft.steps_file", "elsewhere.onnx", "is not among the files"),
    ("surprise", 1, "surprise is a key this runtime does not know"),
    ("engines", {"target": {"role": "target"}}, "lacks engines.target."), ("engines.target", None, "engines.target must be an object"),
    ("engines.target.source", {"path": "x"}, "source lacks its path or sha256"),
    ("engines.target.precision", "fp8", "precision"), ("engines.target.shape.num_layers", "3", "num_layers must be"),
    ("context_limit", 100, "context_limit is 100, below max_seq_len (256)"),
]


@pytest.mark.parametrize("key, value, message", DAMAGE, ids=[f"{k}={'(deleted)' if v is DELETE else repr(v)}" for k, v, _ in DAMAGE])
def test_a_damaged_manifest_is_one_line_naming_what_is_wrong(key, value, message, bundles, tmp_path):
    folder = tmp_path / "bundle"
    shutil.copytree(bundles("llama"), folder)
    data = json.loads((folder / "manifest.json").read_text())
    *path, field = key.split(".")
    place = data
    for part in path:
        place = place[part]
    if value is DELETE:
        del place[field]
    else:
        place[field] = value
    (folder / "manifest.json").write_text(json.dumps(data))
    for check_digests in (True, False):
        with pytest.raises(BundleError, match=re.escape(message)) as error:
            SpeculativeDecoder(folder, check_digests=check_digests)
        assert "\n" not in str(error.value) and "rebuild the bundle" in str(error.value)


@pytest.mark.parametrize("file, says", [("manifest.json", "manifest.json is a folder where a file should be"),
                                        ("tokenizer/tokenizer.json", "tokenizer.json is a folder where a file should be")])
def test_a_folder_where_a_bundle_file_should_be_is_named_as_such_not_missing(file, says, bundles, tmp_path):
    """A copy or unpack gone wrong can leave a folder in a file's place: "missing" sent users looking for a file
    that was there."""
    folder = tmp_path / "bundle"
    shutil.copytree(bundles("llama"), folder)
    (folder / file).unlink()
    (folder / file).mkdir()
    with pytest.raises(BundleError, match=re.escape(says)) as error:
        SpeculativeDecoder(folder)
    assert "\n" not in str(error.value) and "missing" not in str(error.value)


@pytest.mark.parametrize("file, damage", [("tokenizer.json", "{bad"), ("tokenizer.json", None),
                                          ("tokenizer_config.json", "{bad"), ("tokenizer_config.json", "[]")])
def test_a_damaged_tokenizer_file_with_digests_unchecked_is_a_bundle_error(file, damage, bundles, tmp_path):
    """serve --no-check-digests skips the check that names a damaged file; the tokenizer's load then raised a bare
    Exception (and a tokenizer_config.json, JSONDecodeError): specbuild called it a bug (exit 3), specbuild-serve
    printed a traceback."""
    from specbuild_runtime.manifest import TOKENIZER_DIR
    from specbuild_runtime.serve.chat import load_chat_template

    folder = tmp_path / "bundle"
    shutil.copytree(bundles("llama"), folder)
    path = folder / TOKENIZER_DIR / file
    path.unlink() if damage is None else path.write_text(damage)
    with pytest.raises(BundleError, match=re.escape(file)) as error:
        load_chat_template(folder / TOKENIZER_DIR) if file == "tokenizer_config.json" else \
            SpeculativeDecoder(folder, check_digests=False)
    assert "\n" not in str(error.value) and "rebuild the bundle" in str(error.value)


@pytest.mark.parametrize("version, advice", [(3, "upgrade specbuild-runtime to one that reads version 3"),
                                             (1, "rebuild the bundle"),
                                             ("2", "has bundle format version '2' ")])  # not "version 2 ... reads 2"
def test_a_bundle_of_another_format_version_says_which_side_to_upgrade(version, advice, bundles, tmp_path):
    """A service loading a bundle from a newer specbuild must learn to upgrade its runtime, not to rebuild the
    bundle (with what it has, it cannot); an older bundle is rebuilt."""
    import specbuild_runtime

    folder = tmp_path / "bundle"
    shutil.copytree(bundles("llama"), folder)
    data = json.loads((folder / "manifest.json").read_text())
    (folder / "manifest.json").write_text(json.dumps({**data, "format_version": version}))
    with pytest.raises(BundleError, match=re.escape(advice)) as error:
        SpeculativeDecoder(folder)
    assert f"made by {data['created_by']}" in str(error.value) and "\n" not in str(error.value)
    assert specbuild_runtime.FORMAT_VERSION == data["format_version"] and specbuild_runtime.__version__


def test_the_decoder_checks_every_request_before_taking_a_slot(bundles):
    decoder = SpeculativeDecoder(bundles("llama", draft_seed=1))
    with pytest.raises(RequestError, match="vocabulary"):
        decoder.stream([1, 10 ** 6])  # at the call, not at the first token
    with pytest.raises(RequestError, match="gamma"):
        decoder.generate(PROMPTS[0], gamma=decoder.max_gamma + 1)
    assert decoder.slots.in_use == 0


def test_slots_beyond_a_containers_memory_limit_are_refused(bundles, tmp_path, monkeypatch):
    """A service in a container (or a systemd unit) is killed at its cgroup's limit, which may sit on an ancestor
    of the process's cgroup, not at the machine's memory: the check reads them."""
    from specbuild_runtime import engine

    (tmp_path / "proc" / "self").mkdir(parents=True)
    (tmp_path / "proc" / "self" / "cgroup").write_text("0::/system.slice/app.service\n")
    (tmp_path / "proc" / "self" / "mountinfo").write_text(
        "30 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate\n")
    monkeypatch.setattr(engine, "ROOT", tmp_path)
    limit = tmp_path / "sys" / "fs" / "cgroup" / "system.slice" / "memory.max"  # the parent's
    limit.parent.mkdir(parents=True)
    limit.write_text("max\n")  # no limit: the machine's memory decides
    SpeculativeDecoder(bundles("llama"), parallel=2)
    limit.write_text("4096\n")
    with pytest.raises(RequestError, match=r"parallel 2 needs [\d.]+ KiB of KV caches .* this container may use 4.0 KiB"):
        SpeculativeDecoder(bundles("llama"), parallel=2)


def test_a_bundle_replaced_while_it_loads_is_refused_not_mixed(bundles, tmp_path, monkeypatch):
    """compile --overwrite publishing between the digest check and the engines' loading (a service restarting
    during a deploy) would pair the new engines with the old manifest."""
    from specbuild_runtime import decode

    folder = tmp_path / "bundle"
    shutil.copytree(bundles("llama"), folder)
    shutil.copytree(folder, tmp_path / "new")
    engine = decode.Engine

    def swapped_first(*args, **kwargs):
        if (tmp_path / "new").exists():
            folder.rename(tmp_path / "old")
            (tmp_path / "new").rename(folder)
        return engine(*args, **kwargs)

    monkeypatch.setattr(decode, "Engine", swapped_first)
    with pytest.raises(BundleError, match="was replaced while it loaded"):
        SpeculativeDecoder(folder)
    SpeculativeDecoder(folder)  # loaded again: one folder throughout


def test_a_bundle_file_gone_between_its_check_and_its_read_is_one_line(bundles, monkeypatch):
    """A swap at the path between is_file and open (the weights are hashed while the engines load) raised the
    digest thread's FileNotFoundError from the constructor, where a swap is refused as replaced (1 run in ~60)."""
    from specbuild_runtime import manifest

    def gone(path, stop=None):
        raise FileNotFoundError(2, "No such file or directory", str(path))

    monkeypatch.setattr(manifest, "sha256_file", gone)
    with pytest.raises(BundleError, match=r"^bundle file .* cannot be read \(No such file or directory\); rebuild"):
        SpeculativeDecoder(bundles("llama"))


def test_a_stop_string_longer_than_any_real_one_is_refused(bundles):
    from specbuild_runtime.validation import MAX_STOP_CHARS

    decoder = SpeculativeDecoder(bundles("llama"))
    assert decoder.generate("x", 2, stop=["y" * MAX_STOP_CHARS]).token_ids
    with pytest.raises(RequestError, match=f"at most {MAX_STOP_CHARS} are taken"):
        decoder.generate("x", 2, stop=["y" * (MAX_STOP_CHARS + 1)])


def test_a_bad_request_is_a_value_error_as_bad_arguments_are(bundles):
    with pytest.raises(ValueError, match="temperature"):
        SpeculativeDecoder(bundles("llama")).generate("x", 4, temperature=-1.0)


def test_a_text_prompt_longer_than_any_tokenization_fits_is_refused_without_tokenizing():
    """No token stands for more than token_span characters, so a longer text than token_span * max_seq_len cannot fit:
    refused before `encode` (tokenizing costs seconds a MB) in the words of the tokenized refusal, its count a lower
    bound. A text at the bound is tokenized."""
    span, text = TokenSpan(4), "x" * (4 * MAX_LEN + 1)

    def never(text):
        raise AssertionError("tokenized")

    with pytest.raises(RequestError) as early:
        check(text, encode=never, token_span=span, max_new_tokens=3)
    with pytest.raises(RequestError) as tokenized:
        check(text, encode=lambda text: [1] * -(-len(text) // span.longest), max_new_tokens=3)
    tokens = MAX_LEN + 1
    assert str(early.value) == str(tokenized.value).replace(f"has {tokens}", f"has at least {tokens}").replace(
        f"({tokens + 3} would fit", f"(at least {tokens + 3} to fit")
    assert len(check(text[1:], encode=lambda text: [1] * MAX_LEN, token_span=span).prompt_ids) == MAX_LEN


def test_the_decoder_refuses_a_prompt_longer_than_any_tokenization_fits_without_tokenizing(bundles, monkeypatch):
    decoder = SpeculativeDecoder(bundles("llama"))
    monkeypatch.setattr(decoder, "encode", lambda text: pytest.fail("tokenized"))
    text = "x" * (decoder.token_span.longest * decoder.max_seq_len + 1)
    fewest = decoder.token_span.fewest_tokens(text)  # by byte, more than the context's tokens + 1
    for call in (decoder.generate, decoder.stream, decoder.stream_text):
        with pytest.raises(RequestError, match=f"the prompt has at least {fewest} tokens"):
            call(text)


def test_a_list_of_token_ids_longer_than_the_context_is_refused_without_looking_at_each():
    """Each id is a token, so the list's length refuses it, as it would once every id was checked (2.7M ids, an 8 MB
    body, took 0.8 s holding the GIL: serve's event loop stood still meanwhile)."""
    class Unread(list):
        def __iter__(self):
            raise AssertionError("each id was looked at")

    with pytest.raises(RequestError) as refused:
        check(Unread([1] * (MAX_LEN + 1)), max_new_tokens=3)
    with pytest.raises(RequestError) as checked:
        check([1] * (MAX_LEN + 1), max_new_tokens=3)
    assert str(refused.value) == str(checked.value) == (
        f"the prompt has {MAX_LEN + 1} tokens but this bundle's context is {MAX_LEN}; shorten the prompt, or recompile "
        f"with a larger --max-seq-len ({MAX_LEN + 4} would fit this request) within the model's max_position_embeddings")


LIMIT = 2 * MAX_LEN


@pytest.mark.parametrize("prompt_tokens, max_new_tokens, advice", [
    (MAX_LEN + 1, 3, f"recompile with a larger --max-seq-len ({MAX_LEN + 4} would fit this request; these models "
                     f"take up to {LIMIT})"),
    (MAX_LEN + 1, LIMIT, f"recompile with --max-seq-len {LIMIT}, the most these models take ({MAX_LEN} new tokens "
                         "after this prompt)"),
    (LIMIT + 1, 3, f"no context of these models can hold it (compile takes --max-seq-len {LIMIT} at most); shorten "
                   f"the prompt to {MAX_LEN} tokens or fewer to fit this bundle, or to {LIMIT} or fewer after "
                   f"recompiling with --max-seq-len {LIMIT}"),
], ids=["request-fits-the-limit", "request-passes-the-limit", "prompt-passes-the-limit"])
def test_a_prompt_too_long_is_never_told_to_recompile_past_the_longest_context_compile_takes(
        prompt_tokens, max_new_tokens, advice):
    """The advice named the context the request needed, past the models' max_position_embeddings too, where compile
    refuses: with the manifest's context_limit it names at most that, or says no context of these models fits."""
    with pytest.raises(RequestError) as refused:
        check([1] * prompt_tokens, max_new_tokens=max_new_tokens, context_limit=LIMIT)
    assert str(refused.value) == (f"the prompt has {prompt_tokens} tokens but this bundle's context is {MAX_LEN}"
                                  f"{'; shorten the prompt, or ' if prompt_tokens <= LIMIT else ', and '}{advice}")


def test_a_prompt_past_the_models_limit_is_told_the_length_this_bundle_takes():
    """A prompt past the longest context of these models was told to shorten to that longest, which a bundle compiled
    shorter still refused: it is told this bundle's context, and the models' limit only as a recompile's."""
    with pytest.raises(RequestError) as refused:
        check([1] * (MAX_LEN + 1), max_new_tokens=3, context_limit=MAX_LEN)
    assert str(refused.value) == (f"the prompt has {MAX_LEN + 1} tokens but this bundle's context is {MAX_LEN}, and no "
                                  f"context of these models can hold it (compile takes --max-seq-len {MAX_LEN} at most); "
                                  f"shorten the prompt to {MAX_LEN} tokens or fewer to fit this bundle")


def test_a_bundle_made_before_its_context_limit_was_recorded_loads_and_hedges_its_advice(bundles, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(bundles("llama"), old)
    manifest = json.loads((old / "manifest.json").read_text())
    assert manifest.pop("context_limit") == 512  # the models' max_position_embeddings
    (old / "manifest.json").write_text(json.dumps(manifest))
    prompt = [1] * 300  # past the bundles' context of 256
    with pytest.raises(RequestError, match=r"\(600 would fit this request\) within the model's max_position_embeddings$"):
        SpeculativeDecoder(old).request(prompt, max_new_tokens=300)
    with pytest.raises(RequestError, match=r"--max-seq-len 512, the most these models take \(213 new tokens after"):
        SpeculativeDecoder(bundles("llama")).request(prompt, max_new_tokens=300)
