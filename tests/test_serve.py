"""`specbuild serve` as its clients meet it: a real server on loopback, the official openai client, raw HTTP.

Most tests talk to one `specbuild serve` subprocess. Those about a busy server (a full queue, a client that
leaves, a timeout, shutdown mid-stream) run the same app in-process on a decoder whose streams pause
after their first delta until the test lets them go on, so that a slot is busy for exactly as long as the
test says: no test waits on a clock to find the server in the state it checks.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import json
import math
import re
import signal
import shutil
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import PROMPTS, compiled_before_min_p, compiled_before_penalties, counted_compiles, make_checkpoint
from specbuild_runtime import runtime_version

MODEL = "demo"  # the name the README's examples use
MAX_SEQ_LEN = 256
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] | trim }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# Another markup than CHAT_TEMPLATE's, for --chat-template: the special tokens it shows come from the bundle.
OTHER_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}[{{ message['role'] | upper }}] {{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}[ASSISTANT] {% endif %}"
)
# OpenAI's example tool, its keys in the order clients send them
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
GREEDY = {"temperature": 0}  # sent: a request without one samples (serve --generation-config auto, OpenAI's default)
SAMPLED = [dict(temperature=0.8, top_p=0.9, seed=7, gamma=2), dict(temperature=1.0, top_k=20, seed=3, gamma=3)]
MIN_P = dict(temperature=1.2, min_p=0.1, seed=5, gamma=3)
# OpenAI's presence and frequency penalties, vLLM's repetition_penalty (an extra), greedy and sampled
PENALISED = [dict(temperature=0, presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.3, min_tokens=8, gamma=3),
             dict(temperature=0.9, presence_penalty=-0.5, frequency_penalty=0.8, repetition_penalty=0.8, seed=4, gamma=3)]
FINISH = {"eos": "stop", "stop": "stop", "stop_token": "stop", "max_new_tokens": "length", "context": "length"}


def with_template(folder: Path, form: str) -> Path:
    """Give a checkpoint's tokenizer CHAT_TEMPLATE in one of the two forms checkpoints ship it in."""
    config_file, template_file = folder / "tokenizer_config.json", folder / "chat_template.jinja"
    template_file.unlink(missing_ok=True)
    if form == "chat_template.jinja":
        template_file.write_text(CHAT_TEMPLATE)
    else:
        config = json.loads(config_file.read_text())
        config_file.write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    return folder


def compile_pair(target: Path, draft: Path, output: Path) -> Path:
    from specbuild.compile import compile_bundle
    from specbuild.recipe import CompileSettings

    compile_bundle(CompileSettings(target=target, draft=draft, output=output, max_seq_len=MAX_SEQ_LEN), show_progress=False)
    return output


@pytest.fixture(scope="module")
def bundle(tmp_path_factory, tokenizer, checkpoints):
    """A llama pair whose target's tokenizer keeps its chat template in tokenizer_config.json (the older form)."""
    root = tmp_path_factory.mktemp("serve")
    target = with_template(make_checkpoint(root / "target", "llama", tokenizer, seed=0), "tokenizer_config.json")
    return compile_pair(target, checkpoints("llama", 1), root / "bundle")


@pytest.fixture(scope="module")
def reference(bundle):
    from specbuild_runtime import SpeculativeDecoder

    return SpeculativeDecoder(bundle)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(condition, what: str, deadline: float = 60.0, process: subprocess.Popen | None = None, log=None):
    """Poll `condition` until it holds; fail after `deadline` seconds or if `process` dies."""
    end = time.monotonic() + deadline
    while not condition():
        if process is not None and process.poll() is not None:
            pytest.fail(f"the server exited ({process.returncode}) before {what}:\n{log.read_text() if log else ''}")
        if time.monotonic() > end:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health").status_code == 200
    except httpx.TransportError:
        return False


@contextmanager
def specbuild_serve(bundle: Path, log: Path, *options, command: tuple[str, ...] = (sys.executable, "-m", "specbuild", "serve")):
    """`specbuild serve` (or `command`) in a subprocess on a free loopback port, ready once /health answers."""
    port = free_port()
    with log.open("w") as out:
        process = subprocess.Popen([*command, str(bundle), "--port", str(port), "--model-name", MODEL, *map(str, options)],
                                   stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: healthy(url), "/health answered", process=process, log=log)
        yield process, url
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(60)
            finally:
                process.kill()  # one that did not exit (a no-op once it did)


@pytest.fixture(scope="module")
def server(bundle, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-log") / "server.log"
    with specbuild_serve(bundle, log, "--parallel", 4, "--max-queue", 32) as (_, url):
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def api_settings(settings: dict) -> dict:
    """The openai client's arguments for runtime settings: top_k, min_p, repetition_penalty, min_tokens and gamma travel
    in extra_body."""
    extra = {k: settings[k] for k in ("top_k", "min_p", "repetition_penalty", "min_tokens", "gamma") if k in settings}
    return {**{k: v for k, v in settings.items() if k not in extra}, **({"extra_body": extra} if extra else {})}


@pytest.mark.parametrize("settings", [GREEDY, *SAMPLED, MIN_P, *PENALISED],
                         ids=["greedy", "top-p", "top-k", "min-p", "greedy-penalties", "sampled-penalties"])
def test_completions_equal_generate_streamed_or_not(client, reference, settings):
    for prompt in PROMPTS[:3]:
        expected = reference.generate(prompt, max_new_tokens=24, **settings)
        whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, **api_settings(settings))
        assert whole.choices[0].text == expected.text
        assert whole.choices[0].finish_reason == FINISH[expected.stats.finish_reason]
        assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(expected.prompt_token_ids),
                                                                                len(expected.token_ids))
        chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, stream=True,
                                                stream_options={"include_usage": True}, **api_settings(settings)))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
        assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason
        assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_chat_renders_the_bundle_template_as_transformers_does(client, reference, bundle):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(bundle / "tokenizer")
    conversation = [{"role": "user", "content": "def add(a, b):"}, {"role": "assistant", "content": "  return a + b "},
                    {"role": "user", "content": [{"type": "text", "text": "and"}, {"type": "text", "text": "sub?"}]}]
    as_hf_sees_it = [*conversation[:2], {"role": "user", "content": "and\nsub?"}]  # text parts joined as vLLM joins them
    ids = hf.apply_chat_template(as_hf_sees_it, add_generation_prompt=True, tokenize=True, return_dict=False)
    for settings in (GREEDY, SAMPLED[0], *PENALISED):
        expected = reference.generate(ids, max_new_tokens=20, **settings)
        whole = client.chat.completions.create(model=MODEL, messages=conversation, max_tokens=20, **api_settings(settings))
        assert whole.choices[0].message.content == expected.text and whole.choices[0].message.role == "assistant"
        assert whole.usage.prompt_tokens == len(ids)
        chunks = list(client.chat.completions.create(model=MODEL, messages=conversation, max_tokens=20, stream=True,
                                                     **api_settings(settings)))
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
        assert chunks[-1].choices[0].finish_reason == FINISH[expected.stats.finish_reason]


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_stream_options_add_the_usage_chunk_unless_told_not_to_and_continuous_usage_stats_the_usage_to_every_chunk(
        server, endpoint):
    """vLLM's StreamOptions: include_usage is true unless sent false, and continuous_usage_stats (with it) gives each
    chunk the usage of its choice so far: the prompt's tokens, the tokens decoded, their sum."""
    ask = {"prompt": PROMPTS[0]} if endpoint == "completions" else {"messages": [{"role": "user", "content": PROMPTS[0]}]}

    def chunks(options: dict) -> list[dict]:
        body = {**ask, "max_tokens": 12, "temperature": 0, "stream": True, "stream_options": options}
        with httpx.stream("POST", f"{server}/v1/{endpoint}", json=body) as response:
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        return [json.loads(event) for event in events[:-1]]

    assert chunks({})[-1]["choices"] == [] and "usage" not in chunks({})[-2]
    assert all(chunk["choices"] and "usage" not in chunk
               for chunk in chunks({"include_usage": False, "continuous_usage_stats": True}))
    *counted, last = chunks({"continuous_usage_stats": True})
    usage = last["usage"]
    decoded = [chunk["usage"]["completion_tokens"] for chunk in counted]
    assert decoded == sorted(decoded) and decoded[-1] == usage["completion_tokens"] > 1
    assert all(chunk["usage"] == {"prompt_tokens": usage["prompt_tokens"], "completion_tokens": tokens,
                                  "total_tokens": usage["prompt_tokens"] + tokens}
               for chunk, tokens in zip(counted, decoded))
    if endpoint == "chat/completions":  # the role's chunk, before any token
        assert decoded[0] == 0


def test_stream_options_include_usage_sent_null_adds_no_usage_as_in_vllm():
    """vLLM's StreamOptions default include_usage to true only where it is absent: a null sent is read as false."""
    from specbuild_runtime.serve import protocol

    def asked(options: dict) -> tuple[bool, bool]:
        body = {"prompt": "x", "stream": True, "stream_options": options}
        request = protocol.parse(protocol.COMPLETIONS, json.dumps(body).encode(), MODEL,
                                 protocol.sampling_defaults(None, "greedy"))
        return request.include_usage, request.continuous_usage

    assert asked({"include_usage": None, "continuous_usage_stats": True}) == (False, False)
    assert asked({"continuous_usage_stats": True}) == (True, True)


def legacy_logprobs(decoder, records, offset: int = 0) -> dict:
    """OpenAI's completions logprobs for records, as vLLM writes them: each token's text decoded alone."""
    text = [decoder.tokenizer.decode([r.token_id], skip_special_tokens=False) for r in records]
    return {"tokens": text, "token_logprobs": [r.logprob for r in records],
            "top_logprobs": [{decoder.tokenizer.decode([t], skip_special_tokens=False): lp for t, lp in
                              ((r.token_id, r.logprob), *r.top)} for r in records],
            "text_offset": [offset + sum(map(len, text[:i])) for i in range(len(text))]}


@pytest.mark.parametrize("settings", [GREEDY, SAMPLED[0]], ids=["greedy", "sampled"])
def test_completions_logprobs_are_generates_in_openais_legacy_shape_streamed_or_not(server, reference, settings):
    free = reference.generate(PROMPTS[2], max_new_tokens=24, **settings).text
    for prompt, stop in ((PROMPTS[0], None), (PROMPTS[2], free[10:12])):  # a stop string: the tokens up to the one that
        expected = reference.generate(prompt, max_new_tokens=24, logprobs=3, stop=stop, **settings)  # completed it
        assert (expected.stats.finish_reason == "stop") == bool(stop)  # the case is what it claims
        body = {"prompt": prompt, "max_tokens": 24, "logprobs": 3, "stop": stop, **settings}
        whole = httpx.post(f"{server}/v1/completions", json=body).json()["choices"][0]
        assert whole["text"] == expected.text and whole["logprobs"] == legacy_logprobs(reference, expected.logprobs)
        assert len(whole["logprobs"]["tokens"]) == len(expected.token_ids)
        chunks = stream_events(server, "completions", body)
        assert "".join(c["text"] for c in chunks) == expected.text
        for key in ("tokens", "token_logprobs", "top_logprobs"):
            assert [x for c in chunks for x in c["logprobs"][key]] == whole["logprobs"][key]
        sent = 0
        for chunk in chunks:  # each chunk's offsets begin where its text does, as vLLM's
            tokens = chunk["logprobs"]["tokens"]
            assert chunk["logprobs"]["text_offset"] == [sent + sum(map(len, tokens[:i])) for i in range(len(tokens))]
            sent += len(chunk["text"])


def stream_events(server: str, endpoint: str, body: dict) -> list[dict]:
    """The choices of a stream's chunks."""
    with httpx.stream("POST", f"{server}/v1/{endpoint}", json={**body, "stream": True}) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(event)["choices"][0] for event in events[:-1]]


def test_chat_logprobs_are_generates_with_their_bytes_and_top_alternatives_streamed_or_not(server, reference, bundle):
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "def add(a, b):"}]
    ids = AutoTokenizer.from_pretrained(bundle / "tokenizer").apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    expected = reference.generate(ids, max_new_tokens=16, logprobs=2, temperature=0)

    def entry(token, logprob):
        text = reference.tokenizer.decode([token], skip_special_tokens=False)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
    content = [{**entry(r.token_id, r.logprob), "top_logprobs": [entry(*top) for top in r.top]} for r in expected.logprobs]
    body = {"messages": messages, "max_tokens": 16, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    whole = httpx.post(f"{server}/v1/chat/completions", json=body).json()["choices"][0]
    assert whole["message"]["content"] == expected.text and whole["logprobs"] == {"content": content}
    chunks = stream_events(server, "chat/completions", body)
    assert chunks[0]["logprobs"] is None  # the role's chunk
    assert [e for c in chunks[1:] for e in c["logprobs"]["content"]] == content
    assert all(c["logprobs"]["content"] for c in chunks[1:] if c["delta"].get("content"))
    plain = httpx.post(f"{server}/v1/chat/completions", json={**body, "logprobs": False, "top_logprobs": None}).json()
    assert plain["choices"][0]["logprobs"] is None and plain["choices"][0]["message"]["content"] == expected.text


def test_completions_logprobs_0_gives_the_chosen_tokens_alone_and_false_or_null_none(server):
    body = {"prompt": PROMPTS[1], "max_tokens": 6, "temperature": 0}
    chosen = httpx.post(f"{server}/v1/completions", json={**body, "logprobs": 0}).json()["choices"][0]["logprobs"]
    assert len(chosen["tokens"]) == 6 and all(len(top) == 1 for top in chosen["top_logprobs"])  # the chosen token's
    for none in (False, None):
        assert httpx.post(f"{server}/v1/completions", json={**body, "logprobs": none}).json()["choices"][0]["logprobs"] is None


def sampled_past_an_eos(reference, prompt: str, sampling: dict) -> int:
    """A seed whose sampled reply, run past eos tokens, holds one before its end."""
    eos = reference.tokenizer.token_to_id("<|endoftext|>")
    return next(seed for seed in range(200) if eos in reference.generate(prompt, seed=seed, ignore_eos=True,
                                                                          **sampling).token_ids[:-1])


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_vllms_ignore_eos_and_skip_special_tokens_answer_what_generate_does_streamed_or_not(server, reference, bundle,
                                                                                         endpoint):
    from transformers import AutoTokenizer

    prompt = PROMPTS[1]
    messages = [{"role": "user", "content": prompt}]
    ids = (reference.encode(prompt) if endpoint == "completions" else AutoTokenizer.from_pretrained(
        bundle / "tokenizer").apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
    sampling = dict(max_new_tokens=60, temperature=1.5, gamma=3)
    seed = sampled_past_an_eos(reference, ids, sampling)
    asked = {"prompt": prompt} if endpoint == "completions" else {"messages": messages}
    asked |= {"max_tokens": 60, "temperature": 1.5, "gamma": 3, "seed": seed}
    for options in ({}, {"ignore_eos": True}, {"ignore_eos": True, "skip_special_tokens": False, "logprobs": 0},
                    {"include_stop_str_in_output": True, "skip_special_tokens": False}):
        expected = reference.generate(ids, seed=seed, **options, **sampling)
        body = {**asked, **options}
        if endpoint == "chat/completions" and "logprobs" in options:
            body |= {"logprobs": True, "top_logprobs": 0}
        whole = httpx.post(f"{server}/v1/{endpoint}", json=body).json()
        choice = whole["choices"][0]
        text = choice["text"] if endpoint == "completions" else choice["message"]["content"]
        assert (text, choice["finish_reason"]) == (expected.text, FINISH[expected.stats.finish_reason]), options
        assert whole["usage"]["completion_tokens"] == len(expected.token_ids)
        if "logprobs" in options:  # one per returned token, the eos decoded past included
            count = len(choice["logprobs"]["tokens" if endpoint == "completions" else "content"])
            assert count == len(expected.token_ids)
        chunks = stream_events(server, endpoint, body)
        streamed = "".join(c["text"] if endpoint == "completions" else c["delta"].get("content") or "" for c in chunks)
        assert streamed == expected.text and chunks[-1]["finish_reason"] == choice["finish_reason"]
    assert expected.stats.finish_reason == "eos" and expected.text.endswith("<|endoftext|>")  # the cases are as claimed


def test_stop_token_ids_end_the_reply_with_stop_and_include_stop_str_in_output_keeps_the_stop(server, reference):
    free = reference.generate(PROMPTS[0], max_new_tokens=30, temperature=0)
    stops = [free.token_ids[6], free.token_ids[9]]
    body = {"prompt": PROMPTS[0], "max_tokens": 30, "temperature": 0, "stop_token_ids": stops}
    for options in ({}, {"include_stop_str_in_output": True}, {"include_stop_str_in_output": True,
                                                               "stop": [free.text[3:5]]}):
        expected = reference.generate(PROMPTS[0], 30, temperature=0, stop_token_ids=stops, **options)
        assert len(expected.token_ids) < len(free.token_ids)  # the case is what it claims
        whole = httpx.post(f"{server}/v1/completions", json={**body, **options}).json()
        assert whole["choices"][0]["text"] == expected.text and whole["choices"][0]["finish_reason"] == "stop"
        assert whole["usage"]["completion_tokens"] == len(expected.token_ids)
        chunks = stream_events(server, "completions", {**body, **options})
        assert "".join(c["text"] for c in chunks) == expected.text and chunks[-1]["finish_reason"] == "stop"


def test_lm_evals_loglikelihood_request_scores_the_continuation_as_transformers_does(server, bundle, tokenizer):
    """lm-evaluation-harness's local-completions model: its request (token ids, echo, max_tokens 1, logprobs 1) and
    its parse_logprobs, which sums token_logprobs[ctxlen:-1] and calls the continuation greedy where each of its
    tokens' logprob is its top_logprobs' highest."""
    import torch

    from specbuild.compile.reference import load_reference

    model = load_reference(bundle.parent / "target")
    for context, continuation in (("def add(a, b):\n", "    return a + b"), ("x", " = 1"), (PROMPTS[5], "import os")):
        context_ids = tokenizer(context)["input_ids"]
        ids = context_ids + tokenizer(continuation, add_special_tokens=False)["input_ids"]
        body = {"model": MODEL, "prompt": [ids], "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
                "echo": True}
        choice = httpx.post(f"{server}/v1/completions", json=body).json()["choices"][0]
        ctxlen = len(context_ids)
        chosen, tops = choice["logprobs"]["token_logprobs"][ctxlen:-1], choice["logprobs"]["top_logprobs"][ctxlen:-1]
        with torch.no_grad():
            rows = torch.log_softmax(model(torch.tensor([ids])).logits[0, ctxlen - 1:-1].float(), dim=-1)
        expected = rows[torch.arange(len(ids) - ctxlen), torch.tensor(ids[ctxlen:])]
        assert sum(chosen) == pytest.approx(float(expected.sum()), abs=1e-4)
        assert all(tok == max(top.values()) for tok, top in zip(chosen, tops)) == bool(
            (rows.argmax(-1) == torch.tensor(ids[ctxlen:])).all())
        assert len(choice["logprobs"]["tokens"]) == len(ids) + 1  # the prompt's, then the generated one


def echoed_logprobs(decoder, ids: list[int]) -> dict:
    """The completions logprobs of a prompt echoed with logprobs 1 and max_tokens 0, scored whole."""
    records = decoder.generate(ids, 0, prompt_logprobs=1).prompt_logprobs
    first = decoder.tokenizer.decode(ids[:1], skip_special_tokens=False)
    rest = legacy_logprobs(decoder, records[1:], len(first))
    return {"tokens": [first, *rest["tokens"]], "token_logprobs": [None, *rest["token_logprobs"]],
            "top_logprobs": [None, *rest["top_logprobs"]], "text_offset": [0, *rest["text_offset"]]}


@pytest.mark.parametrize("parallel", [1, 2])
def test_choices_after_their_context_score_from_the_cache_the_logprobs_of_prompts_scored_whole(parallel, bundle,
                                                                                              tmp_path):
    """lm-evaluation-harness's multiple choice: the context followed by each choice, one prompt a request or a batch of
    them; each choice after the first computes only its own rows (prefix reuse), the bits of a prompt scored whole."""
    from specbuild_runtime import SpeculativeDecoder

    whole = SpeculativeDecoder(bundle, prefix_reuse=False)
    contexts = [whole.encode("\n".join(PROMPTS * 3))[:151], whole.encode("\n".join(PROMPTS[::-1]))[:120]]
    choices = [whole.encode(text) for text in ("import os", "x", "while True:", PROMPTS[4])]
    prompts = [context + choice for context in contexts for choice in choices]
    expected = [echoed_logprobs(whole, prompt) for prompt in prompts]
    body = {"max_tokens": 0, "echo": True, "logprobs": 1, **GREEDY}
    with specbuild_serve(bundle, tmp_path / "server.log", "--parallel", parallel) as (_, url):
        alone = [httpx.post(f"{url}/v1/completions", json={**body, "prompt": prompt}).json() for prompt in prompts]
        batch = httpx.post(f"{url}/v1/completions", json={**body, "prompt": prompts}).json()
    assert [reply["choices"][0]["logprobs"] for reply in alone] == expected
    assert [choice["logprobs"] for choice in batch["choices"]] == expected
    cached = [reply["usage"]["prompt_tokens_details"]["cached_tokens"] for reply in alone]
    assert cached == [held for context in contexts for held in (0, *[len(context) - 1] * 3)]
    if parallel == 1:  # the batch's prompts in turn on one slot, which held the last of them
        assert batch["usage"]["prompt_tokens_details"]["cached_tokens"] == sum(cached)


def test_a_batch_of_prompts_gets_a_choice_each_as_its_own_request_would_with_the_usage_of_all(server, tokenizer):
    """lm-evaluation-harness's batch_size=16 (its README's example): its requests hold that many prompts, as vLLM takes
    them; more than the slots, so that some wait in the queue."""
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS[:6]] + [PROMPTS[6]]
    for body in ({"echo": True, "max_tokens": 1, "logprobs": 1, "seed": 1234, **GREEDY},  # its loglikelihood request
                 {"max_tokens": 8, "stop": ["\n\n"], **SAMPLED[0]}):
        batch = httpx.post(f"{server}/v1/completions", json={**body, "prompt": prompts}).json()
        alone = [httpx.post(f"{server}/v1/completions", json={**body, "prompt": p}).json() for p in prompts]
        assert batch["choices"] == [{**a["choices"][0], "index": i} for i, a in enumerate(alone)]
        for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
            assert batch["usage"][key] == sum(a["usage"][key] for a in alone)


def test_a_streamed_batch_interleaves_each_prompts_chunks_which_join_to_its_unstreamed_choice(server, tokenizer):
    """vLLM streams a batch's choices interleaved, each chunk naming its index, then one usage chunk for them all."""
    prompts = [tokenizer(PROMPTS[0])["input_ids"], PROMPTS[1], PROMPTS[2]]
    for body in ({"echo": True, "max_tokens": 3, "logprobs": 1, **GREEDY},
                 {"max_tokens": 8, "stop": ["\n\n"], "n": 2, **SAMPLED[0]}):
        whole = httpx.post(f"{server}/v1/completions", json={**body, "prompt": prompts}).json()
        with httpx.stream("POST", f"{server}/v1/completions", json={
                **body, "prompt": prompts, "stream": True, "stream_options": {"include_usage": True}}) as response:
            events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
        assert events[-1]["choices"] == []
        for key in ("prompt_tokens", "completion_tokens", "total_tokens"):  # the cache's share depends on the slots
            assert events[-1]["usage"][key] == whole["usage"][key]
        assert len(whole["choices"]) == len(prompts) * body.get("n", 1)
        for expected in whole["choices"]:
            chunks = [c for e in events[:-1] for c in e["choices"] if c["index"] == expected["index"]]
            assert "".join(c["text"] for c in chunks) == expected["text"]
            assert chunks[-1]["finish_reason"] == expected["finish_reason"]
            if expected["logprobs"]:
                for key in ("tokens", "token_logprobs"):
                    assert [x for c in chunks for x in c["logprobs"][key]] == expected["logprobs"][key]


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_return_token_ids_gives_the_prompts_and_the_replys_token_ids_streamed_or_not_as_vllms(server, endpoint):
    """A whole response's choice has its tokens' ids (the eos among them, as usage counts it), the prompt's ids in a
    completion's choice, at a chat's top; a stream sends the prompt's in its first chunk (a chat's top, a completion's
    choice) and each chunk's tokens' ids; unasked, a whole response's fields are null, as vLLM's."""
    ask = {"prompt": PROMPTS[2]} if endpoint == "completions" else {"messages": [{"role": "user", "content": PROMPTS[2]}]}
    body = {**ask, "max_tokens": 12, "temperature": 0, "return_token_ids": True}
    whole = httpx.post(f"{server}/v1/{endpoint}", json=body).json()
    [choice] = whole["choices"]
    tokens = choice["token_ids"]
    prompt = choice["prompt_token_ids"] if endpoint == "completions" else whole["prompt_token_ids"]
    tokenize = {"model": MODEL, "add_special_tokens": endpoint == "completions", **ask}
    assert prompt == httpx.post(f"{server}/tokenize", json=tokenize).json()["tokens"]
    assert len(tokens) == whole["usage"]["completion_tokens"] and len(prompt) == whole["usage"]["prompt_tokens"]
    with httpx.stream("POST", f"{server}/v1/{endpoint}", json={**body, "stream": True}) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    first = chunks[0] if endpoint == "chat/completions" else chunks[0]["choices"][0]
    assert first["prompt_token_ids"] == prompt
    assert [token for chunk in chunks for token in chunk["choices"][0].get("token_ids", [])] == tokens
    plain = httpx.post(f"{server}/v1/{endpoint}", json={**ask, "max_tokens": 2}).json()
    assert plain["choices"][0]["token_ids"] is None
    assert (plain["choices"][0] if endpoint == "completions" else plain)["prompt_token_ids"] is None


def test_a_streamed_completions_choice_writes_every_field_of_vllms_null_where_unasked():
    """vLLM's stream choice (CompletionResponseStreamChoice, written exclude_unset with each field set) has
    prompt_token_ids and token_ids in every chunk, null unless return_token_ids fills them: the prompt's in its first."""
    from specbuild_runtime.decode import Stats
    from specbuild_runtime.serve import protocol

    fields = ["index", "text", "logprobs", "finish_reason", "stop_reason", "prompt_token_ids", "token_ids"]
    plain = protocol.Reply(protocol.COMPLETIONS, MODEL)
    for chunk in (plain.chunk("a"), plain.chunk(stats=Stats(finish_reason="eos"))):
        [choice] = plain.traced(chunk)["choices"]
        assert list(choice) == fields and choice["prompt_token_ids"] is choice["token_ids"] is None
    traced = protocol.Reply(protocol.COMPLETIONS, MODEL, token_ids=True)
    [first] = traced.traced(traced.chunk("a"), [5], [1, 2])["choices"]
    [later] = traced.traced(traced.chunk("b"), [6])["choices"]
    assert (first["prompt_token_ids"], first["token_ids"], later["prompt_token_ids"], later["token_ids"]) == \
        ([1, 2], [5], None, [6])
    assert list(first) == list(later) == fields


def test_a_streamed_chats_chunks_write_the_fields_vllms_set_stop_reason_in_the_last_alone():
    """vLLM's chat chunks are written exclude_unset: the first (the role's) has prompt_token_ids at its top and no
    token_ids, the others token_ids, null unless return_token_ids fills them; stop_reason is set in the closing chunk
    alone."""
    from specbuild_runtime.decode import Stats
    from specbuild_runtime.serve import protocol

    fields = ["index", "delta", "logprobs", "finish_reason"]
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    for asked in (False, True):
        reply = protocol.Reply(protocol.CHAT, MODEL, token_ids=asked)
        first = reply.traced(reply.chunk(first=True), prompt_ids=[1, 2])
        later = [reply.traced(reply.chunk("a"), [5]), reply.traced(reply.tool_calls_chunk([call]), [6])]
        last = reply.traced(reply.chunk(stats=Stats(finish_reason="stop", stop_reason="x")), [7])
        assert (first["prompt_token_ids"], list(first["choices"][0])) == ([1, 2] if asked else None, fields)
        assert [(list(chunk["choices"][0]), chunk["choices"][0]["token_ids"], "prompt_token_ids" in chunk)
                for chunk in later] == [([*fields, "token_ids"], [token] if asked else None, False) for token in (5, 6)]
        [closing] = last["choices"]
        assert (list(closing), closing["stop_reason"]) == ([*fields, "stop_reason", "token_ids"], "x")


def test_a_streamed_echos_prompt_chunk_carries_none_of_the_replys_tokens_in_every_choice(server):
    """The echoed prompt's chunk has no token of the reply: its ids and usage come with the chunk of its text, in the
    choice that scored the prompt (echo's logprobs) as in those that share its scores."""
    body = {"prompt": PROMPTS[3], "echo": True, "logprobs": 1, "max_tokens": 4, "n": 2, "temperature": 0,
            "return_token_ids": True, "stream": True, "stream_options": {"continuous_usage_stats": True}}
    with httpx.stream("POST", f"{server}/v1/completions", json=body) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    choices = {}
    for chunk in chunks[:-1]:
        [choice] = chunk["choices"]
        choices.setdefault(choice["index"], []).append((choice["text"], choice["token_ids"], chunk["usage"]["completion_tokens"]))
    assert choices[0] == choices[1]
    (echoed, ids, tokens), (text, text_ids, text_tokens), *_ = choices[0]
    # its text left out under return_token_ids, as vLLM's
    assert (echoed, ids, tokens) == ("", [], 0) and text and len(text_ids) == text_tokens >= 1


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_prompt_logprobs_are_vllms_each_prompt_tokens_logprob_rank_and_text_then_the_n_most_probable(server, reference,
                                                                                                       endpoint):
    """null for the first prompt token, then the prompt's token and the N most probable, each by its id, with its
    logprob, its rank and its text; a completion's in each choice (n 2: the same), a chat's at the top."""
    ask = {"prompt": PROMPTS[3]} if endpoint == "completions" else {"messages": [{"role": "user", "content": PROMPTS[3]}]}
    whole = httpx.post(f"{server}/v1/{endpoint}", json={**ask, "max_tokens": 2, "temperature": 0, "n": 2,
                                                        "prompt_logprobs": 2, "return_token_ids": True}).json()
    choices = whole["choices"]
    scores = choices[0]["prompt_logprobs"] if endpoint == "completions" else whole["prompt_logprobs"]
    ids = choices[0]["prompt_token_ids"] if endpoint == "completions" else whole["prompt_token_ids"]
    if endpoint == "completions":
        assert choices[1]["prompt_logprobs"] == scores
    expected = reference.generate(ids, 0, prompt_logprobs=2).prompt_logprobs
    assert scores[0] is None and len(scores) == len(expected) == len(ids)
    for entry, record in zip(scores[1:], expected[1:]):
        wanted = {record.token_id: (record.logprob, record.rank), **{token: (logprob, rank) for rank, (token, logprob)
                                                                     in enumerate(record.top, 1)}}
        assert list(entry) == [str(token) for token in wanted]
        for token, (logprob, rank) in wanted.items():
            assert entry[str(token)] == {"logprob": pytest.approx(max(logprob, -9999.0)), "rank": rank,
                                         "decoded_token": reference.tokenizer.decode([token], skip_special_tokens=False)}


def test_echo_shows_its_prompts_scores_as_prompt_logprobs_too_and_takes_prompt_logprobs_n_as_vllms(server):
    """vLLM scores an echoed prompt with prompt_logprobs N where sent, else with logprobs N, and a whole response shows
    that scoring as each choice's prompt_logprobs; the text's logprobs keep their own N alternatives at most."""
    ask = {"prompt": PROMPTS[2], "max_tokens": 2, "n": 2, **GREEDY}

    def choices(**body) -> list[dict]:
        reply = httpx.post(f"{server}/v1/completions", json={**ask, **body})
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"]

    def prompt_logprobs(n: int) -> list:
        return choices(prompt_logprobs=n)[0]["prompt_logprobs"]

    echoed = choices(echo=True, logprobs=1)
    assert len(prompt_logprobs(1)) > 10
    assert [choice["prompt_logprobs"] for choice in echoed] == [prompt_logprobs(1)] * 2
    both = choices(echo=True, logprobs=1, prompt_logprobs=3)
    assert [choice["prompt_logprobs"] for choice in both] == [prompt_logprobs(3)] * 2
    assert [choice["logprobs"] for choice in both] == [choice["logprobs"] for choice in echoed]
    alone = choices(echo=True, prompt_logprobs=2)
    assert [(choice["logprobs"], choice["prompt_logprobs"]) for choice in alone] == [(None, prompt_logprobs(2))] * 2
    assert choices(echo=True, max_tokens=0)[0]["prompt_logprobs"] is None


def test_echos_text_logprobs_keep_the_first_logprobs_plus_one_of_its_prompt_logprobs_entries_as_vllms(server):
    """vLLM's text logprobs keep the first logprobs + 1 entries of each prompt token's prompt_logprobs (the token, then
    the most probable others): a token among the most probable shows one more alternative than logprobs N alone."""
    made = httpx.post(f"{server}/v1/completions", json={"prompt": PROMPTS[2], "max_tokens": 8, "return_token_ids": True,
                                                       **GREEDY}).json()["choices"][0]
    ids = made["prompt_token_ids"] + made["token_ids"]  # the reply's tokens, greedy: each the most probable
    body = {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1, "prompt_logprobs": 3, **GREEDY}
    [choice] = httpx.post(f"{server}/v1/completions", json=body).json()["choices"]
    entries = choice["prompt_logprobs"][1:]
    assert sum(entry[str(token)]["rank"] == 1 for entry, token in zip(entries, ids[1:])) >= len(made["token_ids"])
    assert choice["logprobs"]["top_logprobs"][1:] == [
        dict((each["decoded_token"], each["logprob"]) for each in list(entry.values())[:2]) for entry in entries]


def test_a_streamed_echo_scores_its_prompt_with_a_prompt_logprobs_0_sent_as_an_unstreamed_one(server):
    """vLLM scores an echoed prompt with prompt_logprobs 0 where sent (a stream takes 0), not with logprobs N: the
    prompt's tokens show no alternative, streamed or not; the reply's token its N."""
    body = {"prompt": PROMPTS[2], "max_tokens": 1, "echo": True, "logprobs": 2, "prompt_logprobs": 0, **GREEDY}
    whole = httpx.post(f"{server}/v1/completions", json=body).json()["choices"][0]["logprobs"]["top_logprobs"]
    streamed = [top for chunk in stream_events(server, "completions", body) if chunk["logprobs"]
                for top in chunk["logprobs"]["top_logprobs"]]
    assert streamed == whole and [len(top) for top in whole[1:-1]] == [1] * (len(whole) - 2) and len(whole[-1]) >= 2


def test_tokenize_gives_the_ids_a_completion_decodes_and_detokenize_their_text_as_vllms(server, bundle):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(bundle / "tokenizer")
    prompt = PROMPTS[1]
    reply = httpx.post(f"{server}/tokenize", json={"model": MODEL, "prompt": prompt, "return_token_strs": True}).json()
    ids = hf(prompt)["input_ids"]
    assert reply == {"count": len(ids), "max_model_len": MAX_SEQ_LEN, "tokens": ids,
                     "token_strs": hf.convert_ids_to_tokens(ids)}
    completion = httpx.post(f"{server}/v1/completions", json={"prompt": prompt, "max_tokens": 1, **GREEDY}).json()
    assert completion["usage"]["prompt_tokens"] == reply["count"]
    # lm-evaluation-harness's remote tokenizer: no special tokens, then its ids back to text
    bare = httpx.post(f"{server}/tokenize", json={"prompt": "test", "add_special_tokens": False}).json()
    assert bare["tokens"] == hf("test", add_special_tokens=False)["input_ids"] and bare["token_strs"] is None
    with_eos = ids + [hf.eos_token_id]
    assert httpx.post(f"{server}/detokenize", json={"tokens": with_eos}).json() == {
        "prompt": hf.decode(with_eos, skip_special_tokens=False)}


def test_tokenize_renders_messages_as_a_chat_completion_does(server, bundle):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(bundle / "tokenizer")
    messages = [{"role": "user", "content": "def add(a, b):"}]
    reply = httpx.post(f"{server}/tokenize", json={"messages": messages}).json()
    assert reply["tokens"] == hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                     return_dict=False)
    chat = httpx.post(f"{server}/v1/chat/completions", json={"messages": messages, "max_tokens": 1, **GREEDY}).json()
    assert chat["usage"]["prompt_tokens"] == reply["count"]
    prefill = httpx.post(f"{server}/tokenize", json={"messages": messages, "add_generation_prompt": False,
                                                     "continue_final_message": True}).json()
    assert hf.decode(prefill["tokens"], skip_special_tokens=False).endswith("def add(a, b):")


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "prompt"),
    ("/tokenize", {"prompt": ["x"]}, "prompt"),
    ("/tokenize", b'{"prompt": "x\\ud800"}', "prompt"),  # half a surrogate pair, which no tokenizer takes
    ("/tokenize", {"prompt": "x", "add_generation_prompt": True}, "add_generation_prompt"),
    ("/tokenize", {"messages": None}, "messages"),  # neither a prompt nor messages: once encoded as a prompt (a 500)
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ x }}"}, "chat_template"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": True,
                   "continue_final_message": True}, "continue_final_message"),
    ("/detokenize", {"tokens": [1, 10 ** 9]}, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, "tokens"),
    ("/detokenize", {"tokens": [1], "model": "other"}, "model"),
])
def test_tokenize_and_detokenize_refuse_what_they_cannot_read_with_a_400_naming_it(server, path, body, param):
    reply = httpx.post(f"{server}{path}", **({"content": body} if isinstance(body, bytes) else {"json": body}))
    assert reply.status_code == (404 if param == "model" else 400) and reply.json()["error"]["param"] == param


def test_tokenizer_info_answers_only_when_enabled_and_lm_evals_remote_tokenizer_finds_what_it_reads(bundle):
    """lm-evaluation-harness 0.4.13's local-completions (tokenizer_backend auto) uses the server's tokenizer where
    /tokenizer_info has an eos_token and /tokenize answers tokens; it reads bos/eos/pad tokens and the chat template."""
    with in_process(bundle) as (url, decoder, _):
        off = httpx.get(f"{url}/tokenizer_info")
        assert off.status_code == 404 and "--enable-tokenizer-info-endpoint" in off.json()["error"]["message"]
    with in_process(bundle, tokenizer_info=True, api_key="s3cret") as (url, decoder, _):
        for path in ("/tokenizer_info", "/tokenize", "/detokenize"):  # the key guards them, as the /v1 routes
            assert httpx.request("GET" if path == "/tokenizer_info" else "POST", f"{url}{path}").status_code == 401
        key = {"Authorization": "Bearer s3cret"}
        info = httpx.get(f"{url}/tokenizer_info", headers=key).json()
        assert info["eos_token"] == info["bos_token"] == "<|endoftext|>" and info["chat_template"] == CHAT_TEMPLATE
        assert info["tokenizer_class"] == "PreTrainedTokenizerFast"
        tokens = httpx.post(f"{url}/tokenize", json={"prompt": "test", "add_special_tokens": False}, headers=key).json()
        assert isinstance(tokens["tokens"], list) and tokens["tokens"]


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_n_choices_are_each_the_request_alone_with_seed_plus_index_streamed_interleaved_or_not(server, endpoint):
    """vLLM's n: choice i of a seeded request is that request with seed + i (vLLM seeds its child i so); the usage
    counts the prompt once, as vLLM's."""
    ask = {"prompt": PROMPTS[2]} if endpoint == "completions" else {"messages": [{"role": "user", "content": "fib"}]}
    body = {**ask, "max_tokens": 12, "temperature": 0.9, "seed": 40, "stop": ["\n\n"]}
    alone = [httpx.post(f"{server}/v1/{endpoint}", json={**body, "seed": 40 + i}).json() for i in range(3)]
    whole = httpx.post(f"{server}/v1/{endpoint}", json={**body, "n": 3}).json()
    assert whole["choices"] == [{**a["choices"][0], "index": i} for i, a in enumerate(alone)]
    assert len({json.dumps(a["choices"][0]) for a in alone}) > 1  # the case is what it claims: choices differ
    assert whole["usage"]["prompt_tokens"] == alone[0]["usage"]["prompt_tokens"]
    assert whole["usage"]["completion_tokens"] == sum(a["usage"]["completion_tokens"] for a in alone)
    with httpx.stream("POST", f"{server}/v1/{endpoint}",
                      json={**body, "n": 3, "stream": True, "stream_options": {"include_usage": True}}) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    assert events[-1]["usage"] == whole["usage"] and len({e["id"] for e in events}) == 1
    for i, a in enumerate(alone):
        chunks = [c for e in events[:-1] for c in e["choices"] if c["index"] == i]
        text = "".join(c["text"] if endpoint == "completions" else c["delta"].get("content") or "" for c in chunks)
        expected = a["choices"][0]
        assert text == (expected["text"] if endpoint == "completions" else expected["message"]["content"])
        assert [c["finish_reason"] for c in chunks][-1] == expected["finish_reason"]
    greedy = httpx.post(f"{server}/v1/{endpoint}", json={**body, **GREEDY, "n": 2}).json()["choices"]
    assert {**greedy[0], "index": 1} == greedy[1]  # as vLLM: greedy choices are the same


@pytest.mark.parametrize("seed", ["7", True, 1.5, [1]], ids=["string", "bool", "float", "list"])
def test_n_choices_refuse_a_seed_that_is_no_whole_number_as_one_choice_does(server, seed):
    body = {"prompt": "a", "max_tokens": 1, "temperature": 1, "seed": seed}
    one, several = (httpx.post(f"{server}/v1/completions", json={**body, "n": n}) for n in (1, 2))
    assert one.status_code == several.status_code == 400, several.text
    assert one.json()["error"] == several.json()["error"] and several.json()["error"]["param"] == "seed"


def test_a_requests_seed_minus_one_samples_every_choice_with_a_random_seed_as_llama_cpps_server(bundle):
    """llama.cpp's server takes "seed": -1 (its default) for a random seed; here it was a fixed seed, and with n its
    choice i was seeded -1 + i: choice 0 fixed at -1, choice 1 at 0, and so on."""
    class Seeds(CheckCounter):
        def __init__(self, decoder):
            super().__init__(decoder)
            self.seeds: list[int | None] = []

        def request(self, *args, **kwargs):
            checked = super().request(*args, **kwargs)
            self.seeds.append(checked.sampling.seed)
            return checked

    with in_process(bundle, Seeds) as (url, decoder, _):
        for seed, n, seeds in ((-1, 1, [None]), (-1, 3, [None] * 3), (5, 2, [5, 6])):
            decoder.seeds.clear()
            body = {"prompt": "a", "max_tokens": 2, "temperature": 1, "seed": seed, "n": n}
            assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
            assert decoder.seeds == seeds, (seed, n)


@pytest.mark.parametrize("n", [1, 2])
def test_a_seed_below_minus_one_is_a_400_naming_seed_and_what_minus_one_means(server, n):
    reply = httpx.post(f"{server}/v1/completions", json={"prompt": "a", "max_tokens": 1, "temperature": 1, "seed": -2,
                                                        "n": n})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "seed", reply.text
    assert "-1: a random seed" in reply.json()["error"]["message"]


def test_n_beyond_what_the_server_takes_at_once_is_refused_naming_n(server):
    reply = httpx.post(f"{server}/v1/completions", json={"prompt": ["a", "b"], "n": 20})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "n"
    assert "asks for 40 choices (n 20 for each of 2 prompts)" in reply.json()["error"]["message"]
    # refused before a request is built for each choice: building a million took the event loop over 5 s (2 CPU cores)
    reply = httpx.post(f"{server}/v1/completions", json={"prompt": "a", "n": 10 ** 6}, timeout=2)
    assert reply.status_code == 400 and "asks for 1000000 choices" in reply.json()["error"]["message"]


def test_a_batch_is_refused_whole_naming_the_prompt_that_is_wrong_and_frees_what_it_queued(server):
    for prompts, message in (([PROMPTS[0], [10 ** 6]], "prompt 2 of 2 (index 1): prompt token id 1000000"),
                             ([PROMPTS[0], "def f(x):\n" * 200], "prompt 2 of 2 (index 1): the prompt has"),
                             (["x"] * 37, "prompt holds 37 prompts, more than this server takes at once "
                                          "(--parallel + --max-queue: 36); send fewer a request")):
        body = {"prompt": prompts, "max_tokens": 200}
        reply = httpx.post(f"{server}/v1/completions", json=body)
        assert reply.status_code == 400 and message in reply.json()["error"]["message"], reply.text
        assert reply.json()["error"]["param"] == "prompt"
    wait_until(lambda: metric_values(server)[("specbuild_slots_busy", ())] == 0, "the batch's first prompt to stop")
    assert len(httpx.post(f"{server}/v1/completions", json={"prompt": ["x"] * 36, "max_tokens": 1}).json()["choices"]) == 36


@pytest.mark.parametrize("prompt", [PROMPTS[2], "ids"], ids=["text", "token ids"])
def test_completions_echo_begins_with_the_prompt_and_its_logprobs_streamed_or_not(prompt, server, reference):
    ids = reference.encode(PROMPTS[2])
    sent = ids if prompt == "ids" else prompt
    text = reference.tokenizer.decode(ids, skip_special_tokens=False) if prompt == "ids" else prompt
    for max_tokens in (0, 5):
        expected = reference.generate(ids, max_tokens, logprobs=2, prompt_logprobs=2)
        body = {"prompt": sent, "max_tokens": max_tokens, "logprobs": 2, "echo": True, **GREEDY}
        first = legacy_logprobs(reference, [])
        first.update(tokens=[reference.tokenizer.decode(ids[:1], skip_special_tokens=False)], token_logprobs=[None],
                     top_logprobs=[None], text_offset=[0])
        rest = legacy_logprobs(reference, expected.prompt_logprobs[1:] + expected.logprobs, len(first["tokens"][0]))
        logprobs = {key: first[key] + rest[key] for key in first}
        whole = httpx.post(f"{server}/v1/completions", json=body).json()
        assert whole["choices"][0]["text"] == text + expected.text and whole["choices"][0]["logprobs"] == logprobs
        assert whole["usage"]["prompt_tokens"] == len(ids) and whole["usage"]["completion_tokens"] == max_tokens
        assert whole["choices"][0]["finish_reason"] == "length"
        chunks = stream_events(server, "completions", body)
        assert chunks[0]["text"] == text  # the prompt in a chunk of its own, as soon as it is scored
        assert "".join(c["text"] for c in chunks) == text + expected.text
        for key in ("tokens", "token_logprobs", "top_logprobs"):
            assert [x for c in chunks for x in c["logprobs"][key]] == logprobs[key]
        plain = httpx.post(f"{server}/v1/completions", json={**body, "logprobs": None}).json()["choices"][0]
        assert plain["text"] == text + expected.text and plain["logprobs"] is None
        assert "".join(c["text"] for c in stream_events(server, "completions", {**body, "logprobs": None})) == plain["text"]


def test_echo_under_return_token_ids_leaves_the_prompts_text_out_keeping_its_logprobs_streamed_or_not_as_vllms(server):
    """vLLM blanks the echoed text where return_token_ids gives the prompt's ids; its tokens' logprobs stay."""
    body = {"prompt": PROMPTS[2], "max_tokens": 5, "echo": True, "logprobs": 1, "return_token_ids": True, **GREEDY}
    reply = httpx.post(f"{server}/v1/completions", json={**body, "echo": False}).json()["choices"][0]["text"]
    [whole] = httpx.post(f"{server}/v1/completions", json=body).json()["choices"]
    assert whole["text"] == reply
    assert len(whole["logprobs"]["tokens"]) == len(whole["prompt_token_ids"]) + len(whole["token_ids"])
    chunks = stream_events(server, "completions", body)
    assert "".join(chunk["text"] for chunk in chunks) == reply
    assert [token for chunk in chunks if chunk["logprobs"] for token in chunk["logprobs"]["tokens"]] == \
        whole["logprobs"]["tokens"]


def test_streams_ask_a_proxy_in_front_not_to_buffer_their_events(server):
    """nginx buffers a proxied response unless it says otherwise: each event would wait for kilobytes more."""
    body = {"prompt": PROMPTS[0], "max_tokens": 4, "stream": True, **GREEDY}
    with httpx.stream("POST", f"{server}/v1/completions", json=body) as response:
        assert response.headers["x-accel-buffering"] == "no"


def test_stop_strings_cut_the_text_and_finish_with_stop(client, reference):
    full = reference.generate(PROMPTS[0], max_new_tokens=40).text
    stop = full[10:13]
    expected = reference.generate(PROMPTS[0], max_new_tokens=40, stop=[stop])
    assert expected.stats.finish_reason == "stop" and stop not in expected.text  # the case is what it claims
    whole = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=40, stop=stop, temperature=0)
    assert whole.choices[0].text == expected.text and whole.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=40, stop=[stop, "\x00"], stream=True,
                                         temperature=0)
    assert "".join(c.choices[0].text for c in streamed) == expected.text


def test_stop_reason_is_the_stop_string_or_stop_token_id_that_ended_the_reply_else_null_as_vllms(server, reference):
    free = reference.generate(PROMPTS[0], max_new_tokens=30, temperature=0)
    stop = free.text[10:13]
    for endpoint, prompt in (("completions", {"prompt": PROMPTS[0]}),
                             ("chat/completions", {"messages": [{"role": "user", "content": "def add(a, b):"}]})):
        if endpoint != "completions":  # the chat's own reply, for its stop string and token
            free = reference.generate(httpx.post(f"{server}/tokenize", json=prompt).json()["tokens"], 30, temperature=0)
            stop = free.text[10:13]
        for options, reason in (({"stop": ["\x00", stop]}, stop), ({"stop_token_ids": [free.token_ids[9], free.token_ids[6]]},
                                                                  free.token_ids[6]), ({}, None)):
            body = {**prompt, "max_tokens": 30, "temperature": 0, **options}
            whole = httpx.post(f"{server}/v1/{endpoint}", json=body).json()["choices"][0]
            assert (whole["finish_reason"], whole["stop_reason"]) == ("length" if reason is None else "stop", reason)
            chunks = stream_events(server, endpoint, body)
            # vLLM's chat chunks leave it out but for the last; a completion's write it null
            before = None if endpoint == "completions" else "left out"
            assert [c.get("stop_reason", "left out") for c in chunks] == [before] * (len(chunks) - 1) + [reason]


def sixteen_clients_at_once(url: str, reference, timeout: float | None = None) -> tuple[list[str], list[str]]:
    """(what 16 concurrent clients got, what each would get decoding alone): greedy and sampled, streamed or not.
    timeout: seconds for each request (the openai client's own default: 600)."""
    jobs = [(PROMPTS[i % len(PROMPTS)], [GREEDY, *SAMPLED][i % 3], i % 2 == 1) for i in range(16)]
    expected = [reference.generate(prompt, max_new_tokens=32, **settings).text for prompt, settings, _ in jobs]

    async def one(client, prompt, settings, stream):
        reply = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, stream=stream,
                                                **api_settings(settings))
        if not stream:
            return reply.choices[0].text
        return "".join([chunk.choices[0].text async for chunk in reply])

    async def all_at_once():
        options = {"timeout": timeout} if timeout else {}
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, **options) as client:
            return await asyncio.gather(*(one(client, *job) for job in jobs))

    return asyncio.run(all_at_once()), expected


def test_sixteen_concurrent_clients_get_their_sequential_outputs(server, reference):
    got, expected = sixteen_clients_at_once(server, reference)
    assert got == expected


BAD_REQUESTS = [
    ("completions", b"{not json", "not valid JSON"),
    ("completions", b"[1, 2]", "must be a JSON object"),
    ("completions", {}, "prompt must be"),
    ("completions", {"prompt": "x", "temperature": "hot"}, "temperature must be a number"),
    ("completions", b'{"prompt": "x", "temperature": NaN}', "temperature must be a finite number"),
    ("completions", b'{"prompt": "x", "temperature": 1' + b"0" * 400 + b"}", "temperature must be a finite number"),
    ("completions", b'{"prompt": "x", "max_tokens": ' + b"1" * 5000 + b"}", "a number of more than 4300 digits"),
    ("completions", {"prompt": "x", "top_p": 2}, "top_p must be in (0, 1]"),
    ("completions", {"prompt": "x", "max_tokens": 0}, "max_tokens must be >= 1, or 0 with echo: true"),
    # the runtime's own bounds would name its Python API's prompt_logprobs, which allows no 0 here, or say ">= 0"
    ("completions", {"prompt": "x", "max_tokens": -1},
     "max_tokens must be >= 1, or 0 with echo: true (the prompt alone, with logprobs scored), not -1"),
    ("completions", {"prompt": "x", "max_tokens": -1, "echo": True, "logprobs": 1},
     "max_tokens must be >= 1, or 0 with echo"),
    ("completions", {"prompt": "x", "max_tokens": 1.5}, "max_tokens must be a whole number, not 1.5 (float)"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
     "max_completion_tokens must be >= 1"),
    ("completions", {"prompt": "x", "seed": 1.5}, "seed must be a whole number"),
    ("completions", {"prompt": "x", "gamma": 99}, "gamma must be from 0 to"),
    ("completions", {"prompt": "x", "gamma": "fast"}, "gamma must be 'auto'"),
    ("completions", {"prompt": [1, 2.5]}, "whole numbers"),
    ("completions", {"prompt": [10**6]}, "outside this bundle's vocabulary"),
    ("completions", {"prompt": "x", "stop": list("abcdefghijklmnopq")}, "at most 16 strings"),
    ("completions", {"prompt": "x", "n": 0}, "n must be a whole number of choices, 1 or more, not 0"),
    ("completions", {"prompt": "x", "n": True}, "n must be a whole number of choices, 1 or more, not true"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 1.0}, "n must be a whole number of choices"),
    ("completions", {"prompt": "x", "stream": True, "stream_options": {"include_usage": True, "inclde": 1}},
     "unrecognized stream_options argument: 'inclde'"),
    ("completions", {"prompt": "x", "logprobs": 21}, "logprobs must be from 0 to 20"),
    ("completions", {"prompt": "x", "logprobs": True}, "logprobs must be a whole number"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "echo": True},
     "'echo' is not supported by this server; send the rendered prompt to /v1/completions with \"echo\": true"),
    ("completions", {"prompt": "x", "echo": 1}, "echo must be true or false"),
    ("completions", {"prompt": "x", "top_logprobs": 2},
     "unrecognized request argument: 'top_logprobs'; completions ask for the N most probable tokens with \"logprobs\": N"),
    ("completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True},
     "prompt_logprobs are not available with stream: true (as in vLLM)"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 1, "stream": True},
     "prompt_logprobs are not available with stream: true (as in vLLM)"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "return_token_ids": "yes"},
     "return_token_ids must be true or false"),
    ("completions", {"prompt": ["a", [1, "b"]]}, "prompt must be a string or a list of token ids, or a list of those"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     "top_logprobs needs logprobs: send \"logprobs\": true with it"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs must be from 0 to 20"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": 2},
     "chat's logprobs is true or false, not 2: send \"logprobs\": true, \"top_logprobs\": 2 for the 2 most probable"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": "yes"}, "logprobs must be true or false"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"},
     "tool_choice \"auto\" needs tools"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json"}},
     'response_format must be {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": '),
    ("completions", {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"name": "a",
                                                                                               "schema": {"type": 3}}}},
     "response_format is not a grammar llguidance compiles:"),
    ("completions", {"prompt": "x", "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "response_format and structured_outputs both ask for a format: send one of them"),
    ("completions", {"prompt": "x", "structured_outputs": {"regex": "("}}, "structured_outputs is not a grammar"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "guided_json": {}},
     "unrecognized request argument: 'guided_json'; send \"structured_outputs\": {\"json\": ...}, as vLLM does now"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 3, "max_tokens": "x"},
     "max_tokens must be a whole number"),
    ("completions", {"prompt": "x", "top_k": -2}, "top_k must be >= -1 (0 or -1 = no limit)"),
    ("completions", {"prompt": "x", "presence_penalty": False}, "presence_penalty must be a number, not False (bool)"),
    ("completions", {"prompt": "x", "frequency_penalty": 2.5}, "frequency_penalty must be in [-2, 2] (0 = none), not 2.5"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "repetition_penalty": 0},
     "repetition_penalty must be above 0 (1 = none), not 0.0"),
    ("completions", {"prompt": "x", "frobnicate": 1}, "unrecognized request argument: 'frobnicate'"),
    ("completions", b'{"prompt": "x", "fr\\ud800b": 1}', "unrecognized request argument: 'fr\\ud800b'"),
    ("completions", b'{"prompt": "x", "stream": true, "stream_options": {"\\udfff": 1}}',
     "unrecognized stream_options argument: '\\udfff'"),
    ("completions", {"prompt": "x", "stream": "yes"}, "stream must be true or false"),
    # chat reads it (false: the first call alone): a wrong value was "not supported by this server"
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "parallel_tool_calls": "no"},
     "parallel_tool_calls must be true or false"),
    ("completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "only with stream: true"),
    ("completions", {"prompt": "def f(x):\n" * 200}, f"this bundle's context is {MAX_SEQ_LEN}"),
    # max_tokens is checked before serve tokenizes the prompt for the room it needs
    ("completions", {"prompt": "def f(x):\n" * 200, "max_tokens": "8"}, "max_tokens must be a whole number, not '8'"),
    ("chat/completions", {"messages": []}, "non-empty list"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "only text parts"),
    ("chat/completions", {"messages": [{"role": "assistant", "content": "hi"}]}, "roles must alternate"),
    ("chat/completions", {"messages": [{"role": "user"}]}, "messages[0] has no 'content'"),
    ("completions", b'{"prompt": "x\\ud800", "add_special_tokens": false}', "prompt is not valid UTF-8"),  # tokenized by serve
    ("chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content is not valid UTF-8"),
    ("chat/completions", b'{"messages": [{"role": "user", "content": "x"}, {"role": "\\ud800", "content": "y"}]}',
     "messages[1].role is not valid UTF-8"),
    ("completions", b'{"prompt": ' + b"[" * 30_000 + b"]" * 30_000 + b"}", "nests JSON too deeply"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": ["enable_thinking"]},
     "chat_template_kwargs must be an object"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": "false"},
     "add_generation_prompt must be true or false"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "continue_final_message": 1},
     "continue_final_message must be true or false"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True},
     "cannot both be true"),  # add_generation_prompt is true unless sent false
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"chat_template": "x"}},
     "may not set 'chat_template'"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"messages": []}},
     "may not set 'messages'"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"max_length": 4}},
     "may not set 'max_length'"),
    # transformers 5 (through vLLM, which passes apply_chat_template's arguments on) would then tokenize control
    # tokens in the messages as text: ignored, the prompt was not the one asked for
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}],
                          "chat_template_kwargs": {"sanitize_control_tokens": True}},
     "may not set 'sanitize_control_tokens'"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}],
                          "chat_template_kwargs": {"add_generation_prompt": False}}, "the request's add_generation_prompt"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"tools": [{}]}},
     "send the tools as the request's 'tools' field"),
    # This server runs without --tool-call-parser: tool_choice "auto", the default where tools are sent, names it
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER]},
     "start it with --tool-call-parser hermes"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER], "tool_choice": "auto"},
     "start it with --tool-call-parser hermes"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER],
                          "tool_choice": {"type": "function", "function": {"name": "add"}}},
     "tool_choice names the function \"add\", which is not among the tools (get_weather): name one of them"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required",
                          "tools": [WEATHER, {"type": "function",
                                              "function": {"name": "f", "parameters": {"type": "nope"}}}]},
     "tools[1].function.parameters is not a grammar llguidance compiles"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER], "tool_choice": "required",
                          "response_format": {"type": "json_object"}},
     "tool_choice \"required\" forces the reply's format, and response_format asks for another: send one of them"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": name, "parameters": {"$defs": {"Place": {"type": kind}}}}}
        for name, kind in (("f", "string"), ("g", "integer"))]},
     "tools[0] and tools[1] define $defs.Place differently"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER], "tool_choice": "always"},
     "tool_choice must be \"none\", \"auto\", \"required\""),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": WEATHER}, "tools must be a list"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "custom", "custom": {}}]},
     "tools[0].type must be \"function\""),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {}}]},
     "tools[0].function must be an object with a non-empty string 'name'"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}],
                          "tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
     "tools[0].function.parameters must be a JSON Schema object"),
    ("completions", {"prompt": "x", "tools": [WEATHER]},  # chat alone calls tools
     "'tools' is not supported by this server; send tools to /v1/chat/completions"),
    ("completions", {"prompt": "x", "ignore_eos": 1}, "ignore_eos must be true or false"),
    ("completions", {"prompt": "x", "stop_token_ids": [0, 10 ** 6]}, "stop_token_ids must be from 0 to"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "stop_token_ids": "0"},
     "stop_token_ids must be a list"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "skip_special_tokens": "no"},
     "skip_special_tokens must be true or false"),
    ("completions", {"prompt": "x", "min_tokens": -1}, "min_tokens must be from 0 to 16"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "min_tokens": 1.5},
     "min_tokens must be a whole number"),
    ("completions", {"prompt": "x", "max_tokens": 4, "min_tokens": 5}, "min_tokens must be from 0 to 4"),
    ("completions", {"prompt": "x", "logit_bias": {"the": 1}}, "logit_bias must be a whole number (a key"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": 101}},
     "logit_bias must hold biases in [-100, 100], as OpenAI's, not 101.0 (token 5)"),
    ("completions", {"prompt": "x", "logit_bias": [5]}, "logit_bias must map token ids to biases"),
    ("completions", {"prompt": "x", "suffix": "y"}, "'suffix' is not supported by this server"),
    ("completions", {"prompt": "x", "spaces_between_special_tokens": False},
     "spaces_between_special_tokens false is not supported"),
]


@pytest.mark.parametrize("endpoint, body, message", BAD_REQUESTS, ids=[m for _, _, m in BAD_REQUESTS])
def test_bad_requests_get_400_with_a_message(server, endpoint, body, message):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    for stream in (False, True):  # a bad streamed request is refused before any event is sent
        if stream and isinstance(body, dict) and "stream" not in body and "stream_options" not in body:
            content = json.dumps({**body, "stream": True}).encode()
        reply = httpx.post(f"{server}/v1/{endpoint}", content=content, headers={"Content-Type": "application/json"})
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert message in error["message"] and error["type"] == "BadRequestError"


PARAMS = [
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": [{"role": "assistant", "content": "hi"}]}, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": "def f(x):\n" * 200}]}, "messages"),  # no "prompt" here
    ("completions", {"prompt": "def f(x):\n" * 200}, "prompt"),
    ("completions", {"prompt": "x", "stop": ["a", ""]}, "stop"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True},
     "continue_final_message"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": 0},
     "add_generation_prompt"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"tokenize": False}},
     "chat_template_kwargs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER]}, "tools"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER], "tool_choice": "auto"},
     "tool_choice"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": -1}, "top_logprobs"),
    ("completions", {"prompt": "x", "logprobs": -1}, "logprobs"),
    ("completions", {"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids"),  # not "stop", which it begins with
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "include_stop_str_in_output": 0},
     "include_stop_str_in_output"),
    ("completions", {"prompt": "x", "min_tokens": -2}, "min_tokens"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}],
                          "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "objec"}}}},
     "response_format"),
    ("completions", {"prompt": "x", "structured_outputs": {"json": 3}}, "structured_outputs"),
    ("completions", {"prompt": "x", "structured_outputs": {"json_object": True}, "ignore_eos": True},
     "structured_outputs"),
]


@pytest.mark.parametrize("endpoint, body, param", PARAMS, ids=[f"{e}-{p}-{i}" for i, (e, _, p) in enumerate(PARAMS)])
def test_a_400_names_the_field_at_fault_as_its_param(server, endpoint, body, param):
    """OpenAI's error body names the request field in `param`; errors about the messages named none, or the
    prompt, which a chat request does not send."""
    reply = httpx.post(f"{server}/v1/{endpoint}", json=body)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text


def test_logit_bias_as_openai_sends_it_biases_the_tokens_it_names(client, reference):
    """Token ids as JSON strings (the openai client's dict[str, int]) on both endpoints."""
    greedy = reference.generate(PROMPTS[0], max_new_tokens=12, temperature=0).token_ids
    bias = {greedy[1]: -100, greedy[4]: 3}
    expected = reference.generate(PROMPTS[0], max_new_tokens=12, temperature=0, logit_bias=bias)
    assert expected.token_ids != greedy  # it bites
    sent = {str(token): value for token, value in bias.items()}
    whole = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0, logit_bias=sent)
    assert whole.choices[0].text == expected.text


def with_extra(settings: dict, **extra) -> dict:
    """api_settings with more fields in extra_body (the openai client's completions take no response_format)."""
    arguments = api_settings(settings)
    return {**arguments, "extra_body": {**arguments.get("extra_body", {}), **extra}}


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                          "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.mark.parametrize("settings", [GREEDY, SAMPLED[0]], ids=["greedy", "sampled"])
def test_response_format_decodes_what_generate_does_with_structured_outputs_on_both_endpoints_streamed_or_not(
        client, reference, bundle, settings):
    """OpenAI's response_format (json_schema, json_object) and vLLM's structured_outputs extra answer the reply
    generate gives with the same grammar."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(bundle / "tokenizer")
    messages = [{"role": "user", "content": "Who is Ada?"}]
    ids = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    for response_format, structured in (
            ({"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}, {"json": PERSON}),
            ({"type": "json_object"}, {"json_object": True})):
        expected = reference.generate(ids, max_new_tokens=24, structured_outputs=structured, **settings)
        assert expected.text.startswith("{")  # it bites: the free reply is no JSON
        whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24,
                                               response_format=response_format, **api_settings(settings))
        assert whole.choices[0].message.content == expected.text
        chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, stream=True,
                                                     response_format=response_format, **api_settings(settings)))
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
        expected = reference.generate(PROMPTS[0], max_new_tokens=24, structured_outputs=structured, **settings)
        for stream in (False, True):
            reply = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, stream=stream,
                                              **with_extra(settings, response_format=response_format))
            text = "".join(c.choices[0].text for c in reply) if stream else reply.choices[0].text
            assert text == expected.text
    expected = reference.generate(PROMPTS[0], max_new_tokens=24, structured_outputs={"choice": ["yes", "no"]}, **settings)
    reply = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24,
                                      **with_extra(settings, structured_outputs={"choice": ["yes", "no"]}))
    assert reply.choices[0].text == expected.text in ("yes", "no") and reply.choices[0].finish_reason == "stop"


def test_response_format_is_compiled_by_the_requests_check_not_on_the_event_loop_and_its_errors_name_it(reference):
    """protocol.parse runs on the server's event loop, where llguidance's ~0.1 s a MB of schema stalled every stream;
    the runtime's check (the checking thread) compiles it, as it does structured_outputs."""
    from specbuild_runtime import RequestError
    from specbuild_runtime.serve import protocol

    body = {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": 3}}}}
    request = protocol.parse(protocol.COMPLETIONS, json.dumps(body).encode(), MODEL,
                             protocol.sampling_defaults(None, "greedy"))
    with pytest.raises(RequestError, match=r"^response_format is not a grammar llguidance compiles: ") as refused:
        reference.request("x", 8, **request.decoding)
    assert protocol.invalid(refused.value).param == "response_format"


@pytest.mark.parametrize("gamma", [0, 1])
def test_a_grammar_past_llguidances_limits_mid_decoding_is_a_400_naming_it_or_a_streams_error_event_not_a_500(server,
                                                                                                          gamma):
    """llguidance stops a grammar that grows past its limits at the token that takes it there, which its mask allowed:
    the request's fault, as a bad grammar is (vLLM's 400, streamed as an error event before [DONE], counted as invalid),
    not the server's: it was a 500 with llguidance's parser state and the whole grammar in its message, or a reply cut
    at an eos."""
    from test_structured import PAST_LIMITS

    body = {"prompt": PROMPTS[0], "max_tokens": 16, "gamma": gamma, "structured_outputs": {"grammar": PAST_LIMITS},
            **GREEDY}
    invalid = ("specbuild_requests_total", (("endpoint", "completions"), ("outcome", "invalid")))
    counted = metric_values(server).get(invalid, 0)
    reply = httpx.post(f"{server}/v1/completions", json=body, timeout=60)
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == "structured_outputs", reply.text[:300]
    assert re.fullmatch(r"structured_outputs stopped llguidance mid-decoding \(Parser Error: Current row has 21\d\d "
                        r"items; max is 2000;[^<\n]*\): simplify .*", error["message"]), error
    with httpx.stream("POST", f"{server}/v1/completions", json={**body, "stream": True}, timeout=60) as streamed:
        events = [line for line in streamed.iter_lines() if line.startswith("data: ")]
    assert streamed.status_code == 200 and events[-1] == "data: [DONE]"
    assert error_of(events[-2]) == error
    assert metric_values(server)[invalid] == counted + 2  # the stream's too, not among the server's errors (500)
    assert httpx.post(f"{server}/v1/completions", json={**body, "structured_outputs": {"regex": "[ab]+"}},
                      timeout=60).status_code == 200


def test_a_grammar_is_compiled_once_for_all_the_choices_of_a_prompt_and_the_requests_that_send_it_again(bundle,
                                                                                                       monkeypatch):
    """n choices share the first's compiled grammar, as they share its prompt ids, and a later request with the same
    grammar, however it asks for it, shares it too (the decoder keeps it): each compile takes the checking thread
    ~0.1 s a MB of schema."""
    compiled = counted_compiles(monkeypatch)
    with in_process(bundle) as (url, decoder, _):
        decoder.go.set()
        chat = {"messages": [{"role": "user", "content": PROMPTS[0]}], "tools": [WEATHER, NOW]}
        for endpoint, structured in (("completions", {"prompt": PROMPTS[0], "structured_outputs": {"regex": "(yes|no)!"}}),
                                     ("completions", {"prompt": PROMPTS[0], "response_format": {"type": "json_object"}}),
                                     ("chat/completions", {**chat, "tool_choice": "required"})):
            body = {"max_tokens": 8, "n": 3, "temperature": 1, "seed": 1, **structured}
            reply = httpx.post(f"{url}/v1/{endpoint}", json=body, timeout=60).json()
            assert len(reply["choices"]) == 3 and compiled == ["LLMatcher"], (reply, compiled)
            compiled.clear()
        again = {"prompt": PROMPTS[1], "max_tokens": 8, "structured_outputs": {"json_object": True}}
        assert httpx.post(f"{url}/v1/completions", json=again, timeout=60).status_code == 200 and compiled == []


# Tools a forced call of the tiny model's fits in a few tokens: a short string, and a function without parameters
CITY = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 4}}, "required": ["city"],
    "additionalProperties": False}}}
NOW = {"type": "function", "function": {"name": "now", "description": "The time."}}


@pytest.mark.parametrize("settings", [GREEDY, SAMPLED[1]], ids=["greedy", "sampled"])
def test_tool_choice_required_or_named_decodes_what_generate_does_with_vllms_schema_and_answers_calls_streamed_or_not(
        client, reference, bundle, settings):
    """tool_choice "required" decodes what generate does with vLLM's schema (a list of {"name", "parameters"}, anyOf
    the tools, a function without parameters taking {} alone), a named function with its parameters' schema; the openai
    client reads calls with ids, null content, finish_reason "tool_calls" for "required" and the reply's own for a
    named function (vLLM's and OpenAI's "stop"), streamed or not, with no --tool-call-parser."""
    from transformers import AutoTokenizer

    from specbuild_runtime.serve.tools import NO_PARAMETERS, required_schema

    hf = AutoTokenizer.from_pretrained(bundle / "tokenizer")
    messages = [{"role": "user", "content": "Weather in Zürich?"}]
    ids = hf.apply_chat_template(messages, tools=[CITY, NOW], add_generation_prompt=True, tokenize=True,
                                 return_dict=False)
    # the JSON's whitespace, which the grammar allows anywhere, biased away: a random model writes it to the end
    spaces = {token: -100 for token in range(len(hf)) if hf.decode([token]).isspace()}
    settings = {**settings, "logit_bias": spaces}
    if "seed" in settings:  # one whose replies close their JSON in max_tokens: the schema allows keys on and on
        settings["seed"] = 4  # (half of seeds 3-8 do not, with γ 3's rounds proposing the forced tokens free)
    ask = dict(model=MODEL, messages=messages, tools=[CITY, NOW], max_tokens=64, **api_settings(settings))
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, schema in (("required", required_schema([CITY, NOW])), (named, CITY["function"]["parameters"]),
                           ({"type": "function", "function": {"name": "now"}}, NO_PARAMETERS)):
        expected = reference.generate(ids, max_new_tokens=64, structured_outputs={"json": schema}, **settings)
        if choice == "required":
            wanted = [(call["name"], call["parameters"]) for call in json.loads(expected.text)]
            finish = "tool_calls"
        else:
            wanted = [(choice["function"]["name"], json.loads(expected.text))]
            finish = FINISH[expected.stats.finish_reason]
        reply = client.chat.completions.create(**ask, tool_choice=choice)
        [answer] = reply.choices
        assert (answer.message.content, answer.finish_reason) == (None, finish)
        assert reply.usage.completion_tokens == len(expected.token_ids)
        assert call_list(call.model_dump() for call in answer.message.tool_calls) == wanted
        assert all(call.id.startswith("call_") and call.type == "function" for call in answer.message.tool_calls)
        if choice != "required":  # the arguments as the model wrote them, as vLLM answers them
            assert answer.message.tool_calls[0].function.arguments == expected.text
        content, calls, streamed_finish = streamed_tool_calls(client, {**ask, "tool_choice": choice})
        assert (content, streamed_finish) == ("", finish)
        assert call_list(calls[index] for index in sorted(calls)) == wanted


def test_a_required_reply_is_read_as_vllm_reads_it_and_parallel_tool_calls_false_keeps_its_first_call():
    """Each element of the list is a call, its parameters the arguments; a reply cut short is content, with the
    finish reason it ended with; tools [] makes "required" "none", as vLLM and OpenAI take it."""
    from specbuild_runtime.decode import Stats
    from specbuild_runtime.serve import protocol
    from specbuild_runtime.serve.tools import REQUIRED

    text = ('[{"name": "get_weather", "parameters": {"city": "Zürich"}}, '
            '{"name": "add", "parameters": {"a": 2, "b": 2}}]')
    stats = Stats(finish_reason="eos")
    for parallel, wanted in ((True, CALLED), (False, CALLED[:1])):
        message = protocol.Reply(protocol.CHAT, MODEL, REQUIRED, parallel).whole(text, stats)["choices"][0]
        assert (message["message"]["content"], message["finish_reason"]) == (None, "tool_calls")
        assert call_list(message["message"]["tool_calls"]) == wanted
    cut = protocol.Reply(protocol.CHAT, MODEL, REQUIRED).whole(text[:30], Stats(finish_reason="max_new_tokens"))
    assert cut["choices"][0]["message"] == {"role": "assistant", "content": text[:30]}
    assert cut["choices"][0]["finish_reason"] == "length"
    streams_as_whole(text, REQUIRED.parse, REQUIRED.stream)
    streams_as_whole(text[:30], REQUIRED.parse, REQUIRED.stream)
    body = {"messages": ASK, "tools": [], "tool_choice": "required"}
    greedy = protocol.sampling_defaults(None, "greedy")
    request = protocol.parse(protocol.CHAT, json.dumps(body).encode(), MODEL, greedy)
    assert request.forced_calls is None and "structured_outputs" not in request.decoding


def test_a_message_without_tool_calls_has_no_tool_calls_tools_or_not_as_vllms_and_the_openai_client_reads_none():
    """vLLM's "tool_calls": [] (before vllm-project/vllm#44105, which omits it) sent the openai client's callers
    (`while message.tool_calls is not None: message.tool_calls[0]`) into a tool-call path that failed."""
    from openai.types.chat import ChatCompletion

    from specbuild_runtime.decode import Stats
    from specbuild_runtime.serve import protocol
    from specbuild_runtime.serve.tools import PARSERS

    for parser in (None, PARSERS["hermes"]):
        reply = protocol.Reply(protocol.CHAT, MODEL, parser).whole("Hello.", Stats(finish_reason="eos"))
        assert reply["choices"][0]["message"] == {"role": "assistant", "content": "Hello."}
        assert ChatCompletion.model_validate(reply).choices[0].message.tool_calls is None


def test_a_named_functions_call_streams_with_its_name_then_its_arguments_as_they_come_as_vllms():
    """The first delta is the call (index, id, type, name, the reply's first text as its arguments), each later one
    more of its arguments under the same index; finish_reason is the reply's, as unstreamed."""
    from specbuild_runtime.decode import Stats
    from specbuild_runtime.serve import protocol
    from specbuild_runtime.serve.tools import named_parser

    reply = protocol.Reply(protocol.CHAT, MODEL, named_parser("get_weather"))
    pieces = ['{"city"', ': "Zü', 'rich"}']
    deltas = []
    for piece in pieces:
        content, calls = reply.tool_stream.feed(piece)
        assert content == ""
        deltas.append(reply.tool_calls_chunk(calls)["choices"][0]["delta"]["tool_calls"])
    assert reply.tool_stream.end() == ("", [])
    [first], *rest = deltas
    assert re.fullmatch(r"call_[0-9a-f]{24}", first.pop("id"))
    assert first == {"index": 0, "type": "function", "function": {"name": "get_weather", "arguments": pieces[0]}}
    assert rest == [[{"index": 0, "function": {"arguments": piece}}] for piece in pieces[1:]]
    assert reply.chunk(stats=Stats(finish_reason="eos"), called=True)["choices"][0]["finish_reason"] == "stop"
    _, [empty] = named_parser("now").stream().end()  # a reply without text calls it all the same, as unstreamed
    assert empty["function"] == {"name": "now", "arguments": ""}


def test_a_named_functions_streamed_arguments_carry_their_tokens_logprobs_beside_their_ids(server):
    """Each chunk of the call's arguments has the logprobs of the tokens whose ids it carries, as vLLM's chunks do,
    not the closing chunk all of them: they join to the unstreamed ones."""
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER], "max_tokens": 12,
           "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "logprobs": True, **GREEDY}
    chunks = stream_events(server, "chat/completions", {**ask, "return_token_ids": True})
    whole = httpx.post(f"{server}/v1/chat/completions", json=ask).json()["choices"][0]
    calls = [chunk for chunk in chunks if chunk["delta"].get("tool_calls")]
    assert len(calls) > 1 and all(len(chunk["logprobs"]["content"]) == len(chunk["token_ids"]) for chunk in calls)
    assert [entry for chunk in chunks if chunk["logprobs"] for entry in chunk["logprobs"]["content"]] == \
        whole["logprobs"]["content"]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "f"}}], ids=["required", "named"])
def test_a_forced_tool_calls_schema_is_compiled_by_the_requests_check_not_on_the_event_loop_and_its_errors_name_the_tool(
        reference, choice):
    """tool_choice "required" or a named function: as response_format's, the schema made from the tools is compiled on
    the checking thread, and a tool's parameters llguidance refuses are named in the 400, its param "tools"."""
    from specbuild_runtime import RequestError
    from specbuild_runtime.serve import protocol

    tools = [WEATHER, {"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]
    body = {"messages": [{"role": "user", "content": "x"}], "tools": tools, "tool_choice": choice}
    request = protocol.parse(protocol.CHAT, json.dumps(body).encode(), MODEL, protocol.sampling_defaults(None, "greedy"))
    with pytest.raises(RequestError, match=r"^tools\[1\]\.function\.parameters is not a grammar llguidance compiles: ") \
            as refused:
        reference.request("x", 8, **request.decoding)
    assert protocol.invalid(refused.value).param == "tools"


def test_what_clients_send_by_default_asking_for_plain_text_is_accepted_as_if_absent(server, reference):
    """tool_choice "none", a text response_format, text modalities, parallel_tool_calls, vLLM's top_k -1, top_p 1."""
    chat = {"messages": [{"role": "user", "content": "def f(x):"}], "max_tokens": 8, "temperature": 0}
    plain = httpx.post(f"{server}/v1/chat/completions", json=chat).json()["choices"][0]["message"]["content"]
    for extra in ({"tool_choice": "none"}, {"response_format": {"type": "text"}}, {"modalities": ["text"]},
                  {"parallel_tool_calls": True}, {"parallel_tool_calls": False}, {"top_k": -1}, {"top_k": 0},
                  {"top_p": 1}, {"top_p": 1.0, "temperature": 0},
                  {"tools": [WEATHER], "tool_choice": "none"},  # shown (not by this template), answered as text
                  {"min_tokens": 0}, {"spaces_between_special_tokens": True}, {"skip_special_tokens": True},
                  {"logit_bias": {}}, {"logit_bias": None}, {"presence_penalty": 0}, {"frequency_penalty": 0.0}):
        reply = httpx.post(f"{server}/v1/chat/completions", json={**chat, **extra})
        assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == plain, (extra, reply.text)


def test_the_fields_the_openai_client_sends_for_user_are_accepted_as_user_is(client):
    """The client deprecates `user` for safety_identifier and prompt_cache_key: those were refused (400) as unknown."""
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "def f(x):"}], max_tokens=8, temperature=0)
    plain = client.chat.completions.create(**chat).choices[0].message.content
    tagged = client.chat.completions.create(**chat, user="u1", safety_identifier="u1", prompt_cache_key="fib")
    assert tagged.choices[0].message.content == plain


def test_a_chat_prompt_too_long_names_a_context_that_fits_it(server):
    """Without max_tokens a chat decodes until the context is full: any context longer than the prompt fits."""
    # 400 tokens, in too few bytes to be refused before tokenizing (as "def f(x):\n" * 200 is: at least 888 by byte)
    reply = httpx.post(f"{server}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x y " * 100}]})
    message = reply.json()["error"]["message"]
    prompt_tokens = int(message.split("the prompt has ")[1].split()[0])
    assert reply.status_code == 400 and f"({prompt_tokens + 1} would fit this request;" in message, message


@pytest.mark.parametrize("endpoint, prompt", [("completions", {"prompt": PROMPTS[2]}),
                                              ("chat/completions", {"messages": [{"role": "user", "content": PROMPTS[2]}]})])
def test_max_tokens_past_the_contexts_room_is_a_400_in_vllms_words_and_the_most_that_fits_decodes(server, endpoint, prompt):
    """vLLM's server refuses max_tokens the context has no room for (its TokenizeParams' messages) where serve decoded to
    the context and answered "length". The room: the context and the last token, which needs no place in the cache."""
    url = f"{server}/v1/{endpoint}"
    prompt_tokens = httpx.post(url, json={**prompt, "max_tokens": 1, **GREEDY}).json()["usage"]["prompt_tokens"]
    room = MAX_SEQ_LEN + 1 - prompt_tokens
    over = httpx.post(url, json={**prompt, "max_tokens": room + 1, **GREEDY})
    assert over.status_code == 400 and over.json()["error"] == {
        "message": f"You passed {prompt_tokens} input tokens and requested {room + 1} output tokens. However, the model's "
                   f"context length is only {MAX_SEQ_LEN} tokens, resulting in a maximum input length of "
                   f"{prompt_tokens - 1} tokens. Please reduce the length of the input prompt.",
        "type": "BadRequestError", "param": "input_tokens", "code": 400}, over.text
    beyond = httpx.post(url, json={**prompt, "max_completion_tokens" if "messages" in prompt else "max_tokens": 10**6})
    assert beyond.status_code == 400 and beyond.json()["error"]["message"] == (
        f"max_tokens=1000000 cannot be greater than max_model_len={MAX_SEQ_LEN}. Please request fewer output tokens.")
    assert httpx.post(url, json={**prompt, "max_tokens": room, **GREEDY}).status_code == 200


@pytest.mark.parametrize("endpoint, param", [("completions", "prompt"), ("chat/completions", "messages")])
def test_a_prompt_longer_than_any_tokenization_fits_is_refused_as_a_tokenized_one_is(server, endpoint, param):
    """A prompt too long for the context by its length alone (text.token_span: more than the context's tokens, each
    standing for at most so much of it) is refused before it is tokenized, as one refused once tokenized is: 400, the same param,
    its count "at least" (tokenizing a 128K context's 8 MB prompt held serve's checks for half a minute)."""
    def refusal(text: str) -> dict:
        body = {"prompt": text} if endpoint == "completions" else {"messages": [{"role": "user", "content": text}]}
        reply = httpx.post(f"{server}/v1/{endpoint}", json={**body, "max_tokens": 5})
        assert reply.status_code == 400
        return reply.json()["error"]

    tokenized, early = refusal("x y " * 100), refusal("x" * 60_000)  # 400 tokens, at least 119 by byte
    assert {**early, "message": ""} == {**tokenized, "message": ""} and early["param"] == param
    assert re.fullmatch(r"the prompt has at least (\d+) tokens but this bundle's context is 256, and no context of these "
                        r"models can hold it \(compile takes --max-seq-len 512 at most\); shorten the prompt to 256 "
                        r"tokens or fewer to fit this bundle, or to 512 or fewer after recompiling with --max-seq-len 512",
                        early["message"]), early["message"]
    assert tokenized["message"].startswith("the prompt has ") and "would fit this request" in tokenized["message"]


def test_another_model_name_is_404_and_models_lists_ours(server):
    reply = httpx.post(f"{server}/v1/completions", json={"model": "gpt-4", "prompt": "x"})
    assert reply.status_code == 404 and MODEL in reply.json()["error"]["message"]
    listed = httpx.get(f"{server}/v1/models").json()["data"]
    assert [m["id"] for m in listed] == [MODEL] and listed[0]["max_model_len"] == MAX_SEQ_LEN
    assert httpx.get(f"{server}/v1/models/{MODEL}").json() == listed[0]
    assert httpx.get(f"{server}/v1/models/gpt-4").status_code == 404


def test_models_lists_ours_as_created_when_the_server_started_not_in_1970(server):
    """created was 0; vLLM's is a timestamp."""
    created = httpx.get(f"{server}/v1/models").json()["data"][0]["created"]
    assert time.time() - 24 * 3600 < created <= time.time()
    assert httpx.get(f"{server}/v1/models").json()["data"][0]["created"] == created  # the same each time


def test_every_errors_type_names_the_exception_the_openai_client_raises_for_its_status(server, bundle):
    """One convention, as vLLM's serving names its own (BadRequestError, NotFoundError): a path served nowhere was
    "Not Found" beside "NotFoundError" for another model, a missing key "Unauthorized", a 503 "Service Unavailable";
    code the status."""
    def raised(client: openai.OpenAI, method: str, path: str, **body) -> tuple:
        with pytest.raises(openai.APIStatusError) as error:
            getattr(client, method)(path, cast_to=object, **({"body": body} if method == "post" else {}))
        return error.value.status_code, type(error.value).__name__, error.value.body["type"], error.value.body["code"]

    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    for method, path, body, status in (("post", "/completions", {"prompt": "x", "n": 0}, 400),
                                       ("post", "/completions", {"model": "gpt-4", "prompt": "x"}, 404),
                                       ("post", "/embeddings", {"input": "x"}, 404),
                                       ("get", "/completions", {}, 405),
                                       ("post", "/completions", {"prompt": "x" * 1_000_000}, 413)):
        code, exception, given, coded = raised(client, method, path, **body)
        assert code == coded == status and given == exception, (path, body, given, exception)
    with in_process(bundle, api_key="s3cret") as (url, decoder, _):
        decoder.go.set()
        assert raised(openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0), "get", "/models") == (
            401, "AuthenticationError", "AuthenticationError", 401)
    from specbuild_runtime.serve.protocol import ApiError

    assert [ApiError(status, "").type for status in (429, 503, 504, 499)] == [
        "RateLimitError", "InternalServerError", "InternalServerError", "APIStatusError"]


def test_a_client_whose_base_url_lacks_v1_is_told_where_the_api_is(server):
    """Starlette's 404 said "Not Found" whatever the path, and its 405 "Method Not Allowed": a client configured
    without /v1 (the usual slip) could not tell a wrong address from a wrong server."""
    with pytest.raises(openai.NotFoundError, match=r"POST /completions is not served here; the API is under /v1"):
        openai.OpenAI(base_url=server, api_key="unused", max_retries=0).completions.create(model=MODEL, prompt="x")
    elsewhere = httpx.post(f"{server}/v1/embeddings", json={"input": "x"}).json()["error"]
    assert elsewhere["message"].startswith("POST /v1/embeddings is not served here; this server serves POST /v1/completions")
    wrong_method = httpx.get(f"{server}/v1/completions").json()["error"]
    assert wrong_method["message"] == "GET is not allowed on /v1/completions: send POST"


def metric_values(url: str, http=httpx) -> dict:
    text = http.get(f"{url}/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_a_wrong_method_is_405_naming_the_allowed_one(server):
    """Starlette's 405 carries an Allow header (which HTTP requires); the OpenAI-shaped error body dropped it."""
    reply = httpx.get(f"{server}/v1/chat/completions")
    assert reply.status_code == 405 and reply.headers.get("Allow") == "POST" and "error" in reply.json()


def exchange(url: str, request: bytes) -> tuple[str, dict, bytes]:
    """Bytes written on a bare socket, and the reply read until the server closes: (status line, headers, body)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as connection:
        connection.sendall(request)
        reply = b"".join(iter(lambda: connection.recv(65536), b""))
    head, _, body = reply.partition(b"\r\n\r\n")
    status, *lines = head.decode("latin-1").split("\r\n")
    return status, {name.lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}, body


@pytest.mark.parametrize("request_bytes", [
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\nNo colon here\r\n\r\n",
], ids=["content-length", "chunk", "header"])
def test_a_request_the_http_parser_cannot_read_is_an_openai_shaped_400(server, request_bytes):
    """uvicorn's parser (h11, or httptools where installed) answers these before the app, in text/plain: an OpenAI
    client could not read the error."""
    status, headers, body = exchange(server, request_bytes)
    assert status.startswith("HTTP/1.1 400") and headers["content-type"] == "application/json"
    error = json.loads(body)["error"]
    assert error["type"] == "BadRequestError" and "not valid HTTP/1.1" in error["message"]


def test_a_malformed_body_arriving_after_its_response_logs_no_traceback(bundle, caplog):
    """The 404 goes out before the body is read; its bad chunk then came after a whole response, where uvicorn's h11
    protocol raised answering it (asyncio logged "Fatal error: protocol.data_received() call failed" and the
    traceback), a line any client could add to the log."""
    with in_process(bundle) as (url, _, _):
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=60) as connection:
            connection.sendall(b"POST /v1/nope HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
            assert connection.recv(65536).startswith(b"HTTP/1.1 404")  # the response has begun
            connection.sendall(b"zz\r\n{}\r\n0\r\n\r\n")
            b"".join(iter(lambda: connection.recv(65536), b""))  # until the server closes the connection
    assert not [record for record in caplog.records if record.exc_info], caplog.text


def test_metrics_count_requests_tokens_and_acceptance(server, client):
    before = metric_values(server)
    ok = ("specbuild_requests_total", (("endpoint", "completions"), ("outcome", "ok")))
    invalid = ("specbuild_requests_total", (("endpoint", "completions"), ("outcome", "invalid")))
    reply = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=0,
                                      extra_body={"gamma": 2})  # greedy: a sample may end at its first token
    httpx.post(f"{server}/v1/completions", json={"prompt": "x", "top_p": 0})
    after = metric_values(server)
    assert after[ok] == before.get(ok, 0) + 1 and after[invalid] == before.get(invalid, 0) + 1
    tokens = ("specbuild_generation_tokens_total", ())
    assert after[tokens] - before.get(tokens, 0) == reply.usage.completion_tokens
    assert after[("specbuild_slots", ())] == 4 and after[("specbuild_slots_busy", ())] == 0
    assert after[("specbuild_queue_depth", ())] == 0
    assert 0 <= after[("specbuild_acceptance_rate", ())] <= 1 and after[("specbuild_mean_accepted_tokens", ())] >= 1
    assert after[("specbuild_time_to_first_token_seconds_count", ())] > before.get(("specbuild_time_to_first_token_seconds_count", ()), 0)


def test_the_acceptance_gauge_is_nan_until_a_draft_is_proposed_as_a_float_prometheus_reads():
    """0 read as every draft rejected (requests at γ 0, or auto at γ 0 throughout, propose none). A gauge is a float:
    prometheus_client writes NaN, which Prometheus stores, as vLLM's spec_decode_draft_acceptance_rate gauge was."""
    from specbuild_runtime import Stats
    from specbuild_runtime.serve.metrics import Metrics

    def alpha(metrics: Metrics) -> float:
        return next(s.value for family in text_string_to_metric_families(metrics.render().decode())
                    for s in family.samples if s.name == "specbuild_acceptance_rate")

    metrics = Metrics(1)
    metrics.decoded(Stats(prompt_tokens=3, generated_tokens=5, rounds=4))  # target-only: nothing proposed
    assert math.isnan(alpha(metrics))
    metrics.decoded(Stats(prompt_tokens=3, generated_tokens=5, rounds=2, drafted=4, accepted=3))
    assert alpha(metrics) == 0.75


def test_metrics_count_the_prompt_tokens_taken_from_the_cache(server, client):
    hits = ("specbuild_prefix_cache_hits_total", ())
    before = metric_values(server).get(hits, 0)
    replies = [client.completions.create(model=MODEL, prompt=PROMPTS[4] + " again", max_tokens=4, temperature=0)
               for _ in range(2)]
    cached = [reply.usage.prompt_tokens_details.cached_tokens for reply in replies]
    assert cached[1] == replies[1].usage.prompt_tokens - 1  # all but the last token, whose logits give the first
    assert metric_values(server)[hits] - before == sum(cached)


def test_sigterm_ends_in_flight_streams_cleanly_and_exits(bundle, tmp_path):
    """Cut at once (--shutdown-timeout 0): a stream still decoding ends with an error event and [DONE];
    one that finished first ends normally. Either way the client reads a complete stream."""
    log = tmp_path / "server.log"
    with specbuild_serve(bundle, log, "--shutdown-timeout", 0) as (process, url):
        body = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": MAX_SEQ_LEN - 64, "stream": True, "temperature": 0}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as reply:
            lines = reply.iter_lines()
            first = next(line for line in lines if line)
            process.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert process.wait(60) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once it has shut down
    events = [first, *rest]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
    last = json.loads(events[-2][len("data: "):])
    assert last.get("error", {}).get("type") == "InternalServerError" or last["choices"][0]["finish_reason"]
    assert "Traceback" not in log.read_text()


SERVE_COMMANDS = pytest.mark.parametrize("command", [
    [sys.executable, "-m", "specbuild", "serve"],
    [sys.executable, "-c", "import sys; from specbuild_runtime.serve.command import main; sys.argv[0] = 'specbuild-serve'; main()"],
], ids=["specbuild serve", "specbuild-serve"])


@SERVE_COMMANDS
def test_a_missing_bundle_is_a_one_line_error(command, tmp_path):
    result = subprocess.run([*command, str(tmp_path / "nothing"), "--port", str(free_port())], capture_output=True, text=True)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: ") and "nothing" in lines[0]


@SERVE_COMMANDS
def test_ctrl_c_ends_the_server_with_one_line_and_status_130(command, bundle, tmp_path):
    """specbuild-serve printed click's Abort with its traceback and exited 1 where `specbuild serve` says
    `error: interrupted` and exits 130 (README: the exit statuses)."""
    port, log = free_port(), tmp_path / "server.log"
    with log.open("w") as out:  # a runner that ignores SIGINT does not pass that on: conftest puts its handler back
        process = subprocess.Popen([*command, str(bundle), "--port", str(port)], stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: healthy(f"http://127.0.0.1:{port}"), "/health answered", process=process, log=log)
        process.send_signal(signal.SIGINT)
        assert process.wait(60) == 130, log.read_text()
    finally:
        if process.poll() is None:
            process.kill()
    assert "Traceback" not in log.read_text() and log.read_text().splitlines()[-1] == "error: interrupted"


@SERVE_COMMANDS
def test_dash_h_shows_the_help_as_on_every_specbuild_command(command):
    """specbuild-serve took --help alone: its `-h`, which `specbuild serve` takes from the group, was "No such option"."""
    result = subprocess.run([*command, "-h"], capture_output=True, text=True)
    assert result.returncode == 0 and "--max-queue" in result.stdout and not result.stderr, result.stderr


def test_specbuild_serves_usage_errors_are_one_line_as_specbuilds(tmp_path):
    """The standalone command a torch-free service runs printed click's three lines (usage, hint, error)."""
    command = [sys.executable, "-c", "import sys; from specbuild_runtime.serve.command import main; main()"]
    result = subprocess.run([*command, str(tmp_path), "--model-name", ""], capture_output=True, text=True)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "model-name" in lines[0], \
        result.stderr


def test_specbuild_serve_says_its_version_as_specbuild_does():
    """A service that installs the runtime alone has only specbuild-serve to ask which version it runs."""
    from specbuild_runtime import __version__

    command = [sys.executable, "-c", "import sys; from specbuild_runtime.serve.command import main; main()"]
    result = subprocess.run([*command, "--version"], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout == f"specbuild-serve, version {__version__}\n", result.stderr


def test_a_taken_port_is_a_one_line_error_before_the_bundle_loads(bundle):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        result = subprocess.run([sys.executable, "-m", "specbuild", "serve", str(bundle), "--port",
                                 str(taken.getsockname()[1])], capture_output=True, text=True)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and lines == [lines[0]] and "Address already in use" in lines[0], result.stderr


def open_files_limit(limit: int):
    """A preexec_fn: the child may open `limit` files (soft and hard), as under `ulimit -n`."""
    import resource

    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))


def test_max_connections_the_open_files_limit_cannot_hold_is_a_one_line_error(bundle):
    """Under `ulimit -n 1024` (systemd's soft limit for a service) 1024 connections and the server's own files did
    not fit: accept failed before the limit was reached, thousands of tracebacks a second, and clients hung."""
    result = subprocess.run([sys.executable, "-m", "specbuild", "serve", str(bundle), "--port", str(free_port()),
                             "--max-connections", "1024"],
                            capture_output=True, text=True, preexec_fn=open_files_limit(1024),
                            timeout=120)  # a guard: a server that starts would serve until killed
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1 and "--max-connections 768 or less" in lines[0], result.stderr


def test_an_open_files_limit_no_max_connections_fits_asks_only_for_a_higher_limit(bundle):
    """Under a hard limit of OWN_FILES or fewer, the error advised "--max-connections 1 or less", which it then
    refused in the same words."""
    for given in ([], ["--max-connections", "1"]):
        result = subprocess.run([sys.executable, "-m", "specbuild", "serve", str(bundle), "--port", str(free_port()),
                                 *given], capture_output=True, text=True, preexec_fn=open_files_limit(200), timeout=120)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 1 and len(lines) == 1, result.stderr
        assert "--max-connections 1 or less" not in lines[0] and "raise the limit to 257 or more" in lines[0]


def system_capping_open_files(monkeypatch, cap: int) -> list:
    """macOS's defaults: soft 256, hard unlimited, and setrlimit refusing above the system's cap
    (kern.maxfilesperproc). The limits set, in order."""
    import resource

    set_to = []

    def capped(kind, limits):
        if limits[0] > cap:
            raise ValueError("current limit exceeds maximum limit")
        set_to.append(limits[0])

    monkeypatch.setattr(resource, "getrlimit", lambda kind: (256, resource.RLIM_INFINITY))
    monkeypatch.setattr(resource, "setrlimit", capped)
    return set_to


@pytest.mark.parametrize("cap, advice", [(10240, "give --max-connections 9984 or less, or raise the limit"),
                                         (256, "raise the limit to 257 or more")])
def test_an_open_files_cap_below_the_hard_limit_asked_beyond_is_one_line_with_what_fits(monkeypatch, cap, advice):
    """setrlimit's ValueError was a traceback; then the advice came from the soft limit ("--max-connections 1 or
    less" where 9984 fit)."""
    from specbuild_runtime import SpecbuildError
    from specbuild_runtime.serve import cli

    system_capping_open_files(monkeypatch, cap)
    with pytest.raises(SpecbuildError, match=rf"may open {cap} \(the system's cap\): {advice}$"):
        cli._open_files_for(20000, explicit=True)


def test_the_default_max_connections_shrinks_to_a_system_cap_below_what_it_needs(monkeypatch, capsys):
    from specbuild_runtime.serve import cli

    set_to = system_capping_open_files(monkeypatch, 1000)
    assert cli._open_files_for(1024, explicit=False) == 744 and set_to[-1] == 1000
    assert "note: --max-connections 744 (not 1024)" in capsys.readouterr().err


@pytest.mark.parametrize("hard_limit", ["as it is", 1024])
def test_a_soft_open_files_limit_below_what_max_connections_needs_is_raised(bundle, tmp_path, hard_limit):
    """Raised to the default --max-connections + 256; where the hard limit is lower, the default shrinks to fit."""
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1] if hard_limit == "as it is" else hard_limit
    if hard != resource.RLIM_INFINITY and hard < 1024 + 256 and hard_limit == "as it is":
        pytest.skip(f"this process may open {hard} files, too few to raise a limit to 1280")
    port, log = free_port(), tmp_path / "server.log"
    with log.open("w") as out:
        process = subprocess.Popen([sys.executable, "-m", "specbuild", "serve", str(bundle), "--port", str(port)],
                                   stdout=out, stderr=subprocess.STDOUT,
                                   preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard)))
    try:
        wait_until(lambda: healthy(f"http://127.0.0.1:{port}"), "/health answered", process=process, log=log)
        limits = Path(f"/proc/{process.pid}/limits").read_text()
    finally:
        process.terminate()
        process.wait(60)
    if hard_limit == "as it is":
        assert int(re.search(r"Max open files\s+(\d+)", limits).group(1)) >= 1024 + 256, limits
    else:
        assert int(re.search(r"Max open files\s+(\d+)", limits).group(1)) == 1024, limits
        assert "note: --max-connections 768 (not 1024)" in log.read_text()


def test_a_body_longer_than_any_request_that_fits_is_413_and_the_server_goes_on(server, reference):
    for declared in (True, False):  # with a Content-Length, or chunked without one
        content = json.dumps({"prompt": "x" * 1_000_000}).encode()
        reply = httpx.post(f"{server}/v1/completions", content=content if declared else iter([content]))
        assert reply.status_code == 413 and "context" in reply.json()["error"]["message"]
    after = httpx.post(f"{server}/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}, timeout=60)
    assert after.json()["choices"][0]["text"] == reference.generate(PROMPTS[0], max_new_tokens=8).text


def test_a_chat_turn_with_null_content_renders_as_empty_text(bundle):
    from specbuild_runtime.manifest import TOKENIZER_DIR
    from specbuild_runtime.serve.chat import load_chat_template

    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}, {"role": "user", "content": "x"}]
    empty = [*turns[:1], {"role": "assistant", "content": ""}, *turns[2:]]
    template = load_chat_template(bundle / TOKENIZER_DIR)
    assert template.render(turns) == template.render(empty) and "None" not in template.render(turns)


def test_a_lone_surrogate_in_any_field_a_template_renders_is_a_request_error():
    """JSON carries lone surrogates ("\\ud800"), which no tokenizer takes (a TypeError, answered 500)."""
    from specbuild_runtime import RequestError
    from specbuild_runtime.serve.chat import ChatTemplate

    template = ChatTemplate("{% for m in messages %}{{ m['name'] }}: {{ m['content'] }}\n{% endfor %}", {})
    with pytest.raises(RequestError, match="not valid UTF-8"):
        template.render([{"role": "user", "content": "x", "name": "\ud800"}])


def random_words(characters: int, seed: int = 0) -> str:
    """Text of made-up words, which a tokenizer's cache of words seen does not speed up."""
    import random

    rng = random.Random(seed)
    words = ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 9))) for _ in range(5000)]
    return " ".join(rng.choices(words, k=characters // 3))[:characters]


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_tokenizing_a_long_prompt_leaves_the_event_loop_running(reference, bundle, endpoint):
    """serve tokenizes a request in a thread so that the event loop goes on moving the other requests' text, but
    tokenizers' encode held the GIL throughout: a 300 KB prompt (which a 4096-token context's body limit admits) froze
    every stream for a second, a 128K context's 8 MB one for half a minute. With no forced switch between threads,
    the main thread can run while the tokenizing thread is inside encode only if encode lets go of the GIL. (Tokenized
    here as a request's check tokenizes a prompt its length does not refuse: this one is longer than this context.)"""
    from specbuild_runtime.manifest import TOKENIZER_DIR
    from specbuild_runtime.serve.chat import load_chat_template

    text = random_words(300_000)
    template = load_chat_template(bundle / TOKENIZER_DIR)
    tokenize = {"completions": lambda: reference.encode(text),
                "chat/completions": lambda: template.prompt_ids(reference.tokenizer, [{"role": "user", "content": text}])}
    entering, done = threading.Event(), threading.Event()

    def check():
        entering.set()
        tokenize[endpoint]()
        done.set()

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1000)  # the main thread runs only when the other thread lets go of the GIL
    try:
        thread = threading.Thread(target=check)
        thread.start()
        entering.wait()
        ran_while_tokenizing = not done.is_set()
        thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert ran_while_tokenizing


# --- A busy server, in-process -------------------------------------------------------------------------------


class PausingDecoder:
    """The real decoder, except that each stream pauses after its first delta until `go` is set.

    `paused` is released each time a stream pauses; `deltas` counts what each stream produced."""

    def __init__(self, decoder):
        self._decoder = decoder
        self.paused = threading.Semaphore(0)
        self.go = threading.Event()
        self.deltas: list[int] = []
        # Each check (request(): tokenizing) releases `checking`, then waits for `checks`, set unless a test clears it.
        self.checking = threading.Semaphore(0)
        self.checks = threading.Event()
        self.checks.set()
        self.checks_begun = 0

    def __getattr__(self, name):
        return getattr(self._decoder, name)

    def request(self, *args, **kwargs):
        self.checks_begun += 1
        self.checking.release()
        self.checks.wait()
        return self._decoder.request(*args, **kwargs)

    def stream_request(self, request, stats, every_token=False, halt=None, token_ids=None):
        index = len(self.deltas)
        self.deltas.append(0)
        for delta in self._decoder.stream_request(request, stats, every_token, halt, token_ids):
            self.deltas[index] += 1
            yield delta
            if self.deltas[index] == 1:
                self.paused.release()
                self.go.wait()


class ScriptedDecoder(PausingDecoder):
    """A PausingDecoder whose streams, once the real one has decoded (so their stats are a real request's), answer
    `pieces` in place of its text: a tiny bundle's model writes no tool calls."""

    pieces: list[str] = []

    def stream_request(self, request, stats, every_token=False, halt=None, token_ids=None):
        for _ in super().stream_request(request, stats, every_token, halt, token_ids):
            pass
        yield from self.pieces


@pytest.mark.parametrize("no_color", ["1", ""])
def test_no_color_set_keeps_the_servers_log_plain_on_a_terminal(no_color, bundle, monkeypatch):
    """https://no-color.org, as the specbuild CLI reads it: uvicorn coloured its log levels wherever stdout is a
    terminal (`INFO:` in green), NO_COLOR or not."""
    import io
    import logging

    from uvicorn.config import LOGGING_CONFIG

    from specbuild_runtime import SpeculativeDecoder
    from specbuild_runtime.serve.app import Server, Settings

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setenv("NO_COLOR", no_color)
    monkeypatch.setattr(sys, "stdout", Terminal())
    for formatter in ("default", "access"):  # uvicorn writes use_colors into its module's own config, for good
        monkeypatch.setitem(LOGGING_CONFIG["formatters"][formatter], "use_colors", None)
    Server(SpeculativeDecoder(bundle), Settings(model=MODEL)).http_server("127.0.0.1", 0)
    handler = logging.getLogger("uvicorn").handlers[0]
    line = handler.format(logging.LogRecord("uvicorn.error", logging.INFO, __file__, 1, "started", None, None))
    assert ("\x1b[" in line) == (not no_color), line


@contextmanager
def in_process(bundle: Path, wrapper: type = PausingDecoder, routes: tuple = (), **settings):
    """The app on a PausingDecoder (or `wrapper`) with one slot, and `routes` beside its own, served by uvicorn in a
    thread on a free loopback port."""
    from specbuild_runtime import SpeculativeDecoder
    from specbuild_runtime.serve.app import Server, Settings

    decoder = wrapper(SpeculativeDecoder(bundle, parallel=1))
    server = Server(decoder, Settings(model=MODEL, **settings))
    server.app.router.routes.extend(routes)
    uvicorn = server.http_server("127.0.0.1", 0, log_level="warning")
    thread = threading.Thread(target=uvicorn.run)
    thread.start()
    try:
        wait_until(lambda: uvicorn.started, "uvicorn started")
        yield f"http://127.0.0.1:{uvicorn.servers[0].sockets[0].getsockname()[1]}", decoder, uvicorn
    finally:
        decoder.go.set()
        decoder.checks.set()
        uvicorn.should_exit = True
        thread.join(60)


@contextmanager
def streaming(url: str, prompt: str = PROMPTS[2], max_tokens: int = 200):
    """A streamed completion, read up to its first event; yields (first event, iterator over the other events)."""
    with httpx.Client(timeout=60) as http:
        body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0}
        with http.stream("POST", f"{url}/v1/completions", json=body) as response:
            events = (line for line in response.iter_lines() if line)
            yield next(events), events


class CheckCounter(PausingDecoder):
    """A PausingDecoder that records each check's prompt and prompt_logprobs."""

    def __init__(self, decoder):
        super().__init__(decoder)
        self.checked: list[tuple] = []
        self.go.set()

    def request(self, prompt, *args, **kwargs):
        self.checked.append((prompt, kwargs.get("prompt_logprobs")))
        return super().request(prompt, *args, **kwargs)


def test_a_prompts_n_choices_render_tokenize_and_score_it_once_yet_each_is_the_request_alone(bundle, monkeypatch):
    """A 500-token prompt's echo and logprobs cost 8 choices 5.0 s where one takes 0.6 s (a 152k vocabulary, this
    machine): each choice after a prompt's first takes its token ids and its prompt's logprobs from the first."""
    from specbuild_runtime.serve.chat import ChatTemplate

    from specbuild_runtime.serve import app

    renders, encodes = [], []
    render, encode = ChatTemplate.render, app.encode_ids
    monkeypatch.setattr(ChatTemplate, "render", lambda self, *a, **k: renders.append(1) or render(self, *a, **k))
    monkeypatch.setattr(app, "encode_ids", lambda *a, **k: encodes.append(1) or encode(*a, **k))
    with in_process(bundle, CheckCounter) as (url, decoder, _):
        body = {"prompt": [PROMPTS[2], PROMPTS[0]], "max_tokens": 5, "temperature": 0.9, "seed": 40, "echo": True,
                "logprobs": 2}
        alone = [httpx.post(f"{url}/v1/completions", json={**body, "prompt": prompt, "seed": 40 + i}).json()["choices"][0]
                 for prompt in body["prompt"] for i in range(3)]
        decoder.checked.clear()
        encodes.clear()
        whole = httpx.post(f"{url}/v1/completions", json={**body, "n": 3}).json()["choices"]
        assert whole == [{**a, "index": i} for i, a in enumerate(alone)]
        assert [scored for _, scored in decoder.checked] == [2, None, None] * 2 and len(encodes) == 2
        chunks = stream_events(url, "completions", {**body, "n": 3})
        for i, a in enumerate(alone):
            mine = [c for c in chunks if c["index"] == i]
            assert "".join(c["text"] for c in mine) == a["text"]
            assert [t for c in mine for t in c["logprobs"]["token_logprobs"]] == a["logprobs"]["token_logprobs"]
        chat = {"messages": [{"role": "user", "content": "fib"}], "max_tokens": 5, "temperature": 0.9, "seed": 40}
        renders.clear()
        assert len(httpx.post(f"{url}/v1/chat/completions", json={**chat, "n": 3}).json()["choices"]) == 3
        assert len(renders) == 1


class TokenizerOnLoop:
    """A tokenizer that counts its decodes on an event loop's thread."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.decoded_on_loop = 0

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def decode(self, *args, **kwargs):
        self.decoded_on_loop += on_loop()
        return self._tokenizer.decode(*args, **kwargs)

    def id_to_token(self, token: int) -> str:
        self.decoded_on_loop += on_loop()
        return self._tokenizer.id_to_token(token)


class DecodingOnLoop(PausingDecoder):
    """A PausingDecoder that goes on at once, whose tokenizer (serve's, not its streams') is a TokenizerOnLoop."""

    def __init__(self, decoder):
        super().__init__(decoder)
        self.go.set()
        self.tokenizer = TokenizerOnLoop(decoder.tokenizer)


def on_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


@pytest.fixture
def encoded_on_loop(monkeypatch) -> list[int]:
    """The lengths of the JSON texts json encodes on the event loop (0 first, for max)."""
    lengths, encode = [0], json.JSONEncoder.encode

    def encoding(self, value):
        text = encode(self, value)
        if on_loop():
            lengths.append(len(text))
        return text

    monkeypatch.setattr(json.JSONEncoder, "encode", encoding)
    return lengths


def test_a_prompts_logprobs_are_decoded_and_encoded_off_the_event_loop(bundle, encoded_on_loop):
    """A prompt's logprobs are a token text decoded for each of its tokens and its N most probable, then megabytes of
    JSON: 0.5-1.0 s for 4000 tokens at prompt_logprobs 20 (a 152k vocabulary, this 2-core machine under load), in which
    the event loop moved no other stream. Both run in a thread of the server's, and its JSON is encoded a piece at a
    time, json's C encoder holding the GIL through a call: the loop decodes no token text, and encodes JSON no bigger
    than a stream's closing chunk."""
    prompt = " ".join(PROMPTS[:7])  # ~200 tokens
    chat = {"messages": [{"role": "user", "content": prompt}], "prompt_logprobs": 5, "max_tokens": 1}
    with in_process(bundle, DecodingOnLoop) as (url, decoder, _):
        for endpoint, body in (("completions", {"prompt": prompt, "prompt_logprobs": 5, "max_tokens": 1}),
                               ("chat/completions", chat),
                               ("completions", {"prompt": prompt, "echo": True, "logprobs": 5, "max_tokens": 1}),
                               ("completions", {"prompt": prompt, "echo": True, "logprobs": 5, "max_tokens": 0,
                                                "stream": True})):
            reply = httpx.post(f"{url}/v1/{endpoint}", json={**body, **GREEDY}, timeout=60)
            assert reply.status_code == 200 and len(reply.content) > 20_000, reply.text
            assert (decoder.tokenizer.decoded_on_loop, max(encoded_on_loop) < 1000) == (0, True), (endpoint, sorted(body))


def test_tokenizes_token_strs_and_json_are_built_off_the_event_loop(bundle, encoded_on_loop):
    """A 1M-character prompt's token_strs and JSON (291k tokens at the demo's vocabulary) stalled every stream 0.6-1.0
    s, its ids alone 80-130 ms (this 2-core machine, loaded): both are built in the server's thread, its JSON a piece at
    a time, as a response's."""
    body = {"model": MODEL, "prompt": PROMPTS[2] * 40, "return_token_strs": True}
    with in_process(bundle, DecodingOnLoop) as (url, decoder, _):
        reply = httpx.post(f"{url}/tokenize", json=body, timeout=60)
    assert reply.status_code == 200 and len(reply.json()["token_strs"]) == reply.json()["count"] > 1000
    assert (decoder.tokenizer.decoded_on_loop, max(encoded_on_loop) < 1000) == (0, True)


def test_a_streams_token_chunks_are_each_encoded_on_the_event_loop_by_one_json_call(bundle, monkeypatch):
    """A token's chunk is built and encoded on the event loop: encoded a piece at a time (protocol.dumps, which pays off
    only off the loop) a chunk with logprobs 5 took 9 times as long there (115 µs vs 12.5), for every token of every
    stream."""
    encoded_on_loop, encode = [], json.JSONEncoder.encode

    def encoding(self, value):
        if on_loop():
            encoded_on_loop.append(value)
        return encode(self, value)

    monkeypatch.setattr(json.JSONEncoder, "encode", encoding)
    body = {"prompt": PROMPTS[0], "max_tokens": 8, "logprobs": 5, "stream": True, **GREEDY}
    with in_process(bundle, DecodingOnLoop) as (url, _, _):
        events = httpx.post(f"{url}/v1/completions", json=body, timeout=60).text.split("\n\n")
    chunks = [json.loads(event.removeprefix("data: ")) for event in events if event not in ("", "data: [DONE]")]
    assert len(chunks) > 2 and encoded_on_loop == chunks


def test_serves_json_is_json_dumps_a_long_lists_item_a_call(monkeypatch):
    """protocol.dumps writes what json.dumps writes, with Starlette's options or sse's, in calls of json.dumps no longer
    than an item of a long list (a prompt token's logprobs) or SCALARS_A_CALL of a long list's numbers or strings (a
    prompt's token ids): json's C encoder holds the GIL through a call, so a response's JSON encoded whole in a thread
    stalled the event loop all the same."""
    from specbuild_runtime.serve import protocol

    entry = {"11": {"logprob": -0.5, "rank": 1, "decoded_token": "\u00e9\u2028"}, "7": None}
    long = [None, *[entry] * protocol.LONG_LIST]
    scalars = ["a", 1, None, -2.5] * protocol.SCALARS_A_CALL
    value = {"id": "x", "choices": [{"index": 0, "prompt_logprobs": long, "logprobs": {"tokens": scalars,
             "top_logprobs": [{"a": -1.0}] * 3}, "text": "\u00e9\u2028"}], "usage": {}, "empty": [], "n": [1, 2.5]}
    calls, encode = [], json.JSONEncoder.encode
    monkeypatch.setattr(json.JSONEncoder, "encode", lambda self, o: calls.append(len(encode(self, o))) or encode(self, o))
    for options in ({"ensure_ascii": False}, {"ensure_ascii": False, "allow_nan": False, "separators": (",", ":")}):
        calls.clear()
        written = protocol.dumps(value, **options)
        slice_ = max(len(json.dumps(scalars[start:start + protocol.SCALARS_A_CALL], **options)) for start in range(4))
        assert max(calls) <= max(len(json.dumps(entry, **options)), slice_) < len(written) // 3
        assert written == json.dumps(value, **options)


def test_serves_json_writes_a_long_list_of_numbers_or_strings_of_any_length_as_json_dumps_does():
    """The slices of SCALARS_A_CALL join to json.dumps's text whatever the length (one short of a slice, a slice, one
    over), nested or not, infinities written or refused as json.dumps writes or refuses them."""
    from specbuild_runtime.serve import protocol

    for length in (protocol.LONG_LIST - 1, protocol.LONG_LIST, protocol.SCALARS_A_CALL - 1, protocol.SCALARS_A_CALL,
                   protocol.SCALARS_A_CALL + 1, 2 * protocol.SCALARS_A_CALL + 1):
        items = [[i, -9999.0, "\u00e9", None, True][i % 5] for i in range(length)]
        for value in (items, {"a": [items, items[:3]]}):
            for options in ({"ensure_ascii": False}, {"ensure_ascii": False, "allow_nan": False, "separators": (",", ":")}):
                assert protocol.dumps(value, **options) == json.dumps(value, **options), (length, options)
        infinite = [*items, float("-inf")]
        assert protocol.dumps(infinite) == json.dumps(infinite)
        with pytest.raises(ValueError):
            protocol.dumps(infinite, allow_nan=False)


def test_serves_json_writes_a_number_true_false_or_null_key_as_json_dumps_does_a_string():
    """A key that is no string is written as json.dumps writes it ({"1": ...}), not as its JSON ({1: ...}, which no
    client parses); one json.dumps refuses is refused with its TypeError."""
    from specbuild_runtime.serve import protocol

    value = {1: "a", 2.5: {True: None, False: [1]}, None: -1, "s": {0: 1}}
    for options in ({"ensure_ascii": False}, {"ensure_ascii": False, "allow_nan": False, "separators": (",", ":")}):
        assert protocol.dumps(value, **options) == json.dumps(value, **options)
    with pytest.raises(TypeError, match="keys must be str, int, float, bool or None, not tuple"):
        protocol.dumps({(1, 2): 0})


def with_bos(bundle: Path, folder: Path) -> Path:
    """A copy of `bundle` whose tokenizer begins a text with its special token (a BOS, as Llama's adds), its manifest's
    digest of the tokenizer made anew."""
    from tokenizers import Tokenizer, processors

    shutil.copytree(bundle, folder)
    path = folder / "tokenizer" / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", tokenizer.token_to_id("<|endoftext|>"))])
    tokenizer.save(str(path))
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"]["tokenizer/tokenizer.json"] = hashlib.sha256(path.read_bytes()).hexdigest()
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def test_add_special_tokens_adds_the_tokenizers_to_a_prompt_as_vllm_by_default_a_completions_not_a_chats(bundle, tmp_path):
    with in_process(with_bos(bundle, tmp_path / "bos"), CheckCounter) as (url, _, _):
        for endpoint, ask, default in (("completions", {"prompt": PROMPTS[1]}, True),
                                       ("chat/completions", {"messages": [{"role": "user", "content": "fib"}]}, False)):
            counts = []
            for add in (True, False):
                tokens = httpx.post(f"{url}/tokenize", json={**ask, "add_special_tokens": add}).json()["tokens"]
                body = {**ask, "max_tokens": 1, **GREEDY, **({} if add == default else {"add_special_tokens": add})}
                reply = httpx.post(f"{url}/v1/{endpoint}", json=body).json()
                assert reply["usage"]["prompt_tokens"] == len(tokens), (endpoint, add, reply)
                counts.append(len(tokens))
            assert counts[0] == counts[1] + 1  # the case is what it claims: the BOS
        reply = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "add_special_tokens": "no"})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "add_special_tokens"


def error_of(event: str) -> dict:
    return json.loads(event.removeprefix("data: "))["error"]


def test_full_queue_answers_429_with_retry_after_naming_the_limits_it_hit(bundle, reference):
    expected = reference.generate(PROMPTS[0], max_new_tokens=16).text
    results = []
    with in_process(bundle, max_queue=1) as (url, decoder, _), streaming(url) as (_, events):
        assert decoder.paused.acquire(timeout=60)  # the only slot is busy until `go`
        queued = threading.Thread(target=lambda: results.append(
            httpx.post(f"{url}/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0}, timeout=60)))
        queued.start()
        wait_until(lambda: metric_values(url)[("specbuild_queue_depth", ())] == 1, "the second request queued")
        full = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 16})
        assert full.status_code == 429 and full.headers["Retry-After"] == "1"
        assert full.json()["error"]["message"] == (
            "the server is busy: its places (--parallel 1, --max-queue 1) are all taken, 1 decoding and 1 waiting for "
            "a slot or for their check; retry shortly")
        decoder.go.set()
        assert list(events)[-1] == "data: [DONE]"
        queued.join(60)
    assert results[0].status_code == 200 and results[0].json()["choices"][0]["text"] == expected


def posting(url: str, body: dict, results: list, count: int) -> list[threading.Thread]:
    """Threads (not started) that each post body to /v1/completions and append the response to results."""
    return [threading.Thread(target=lambda: results.append(httpx.post(f"{url}/v1/completions", json=body, timeout=60)))
            for _ in range(count)]


def test_requests_waiting_for_their_check_take_places_in_the_queue_and_show_in_its_depth(bundle, reference):
    """Requests are checked (tokenized) on one thread, one at a time; those waiting for it were in no queue the
    server bounds: beyond --max-queue they waited (about a second per long prompt ahead, its body held) instead of
    getting 429, and the queue depth showed none. Checks held here: one request in its check, one waiting for it."""
    expected = reference.generate(PROMPTS[0], max_new_tokens=16).text
    body = {"prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0}
    results = []
    with in_process(bundle, max_queue=1) as (url, decoder, _):
        decoder.checks.clear()
        posts = posting(url, body, results, 2)
        for post in posts:
            post.start()
        assert decoder.checking.acquire(timeout=60)
        wait_until(lambda: metric_values(url)[("specbuild_queue_depth", ())] == 2, "both requests counted as waiting",
                   deadline=10)
        full = httpx.post(f"{url}/v1/completions", json=body, timeout=10)  # one slot and one place in the queue taken
        assert full.status_code == 429 and full.headers["Retry-After"] == "1"
        decoder.checks.set()
        decoder.go.set()
        for post in posts:
            post.join(60)
        assert metric_values(url)[("specbuild_queue_depth", ())] == 0
    assert [r.status_code for r in results] == [200, 200]
    assert all(r.json()["choices"][0]["text"] == expected for r in results)


def test_a_request_waiting_for_its_check_gets_503_at_its_timeout(bundle):
    """--timeout began only once a request was checked: one behind long prompts waited for the checking thread
    however long that took. Its check held here past a 1 s timeout."""
    with in_process(bundle, timeout=1.0) as (url, decoder, _):
        decoder.checks.clear()
        for echo in (False, True):  # an echo's prompt text was read from the request its check never made: a 500
            body = {"prompt": PROMPTS[0], "max_tokens": 4, "echo": echo}
            reply = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
            assert reply.status_code == 503 and "timeout" in reply.json()["error"]["message"], (echo, reply.text)
            assert reply.headers["Retry-After"] == "1"


def test_a_request_waiting_for_its_check_is_answered_503_when_the_grace_period_ends(bundle, caplog):
    """SIGTERM's drain stopped queued and decoding requests, not one waiting for the checking thread: it waited
    until uvicorn's backstop (--shutdown-timeout + 5 s) cancelled it, a 500 logged with a traceback."""
    results = []
    with in_process(bundle, shutdown_timeout=0.0) as (url, decoder, uvicorn):
        decoder.checks.clear()
        post = threading.Thread(target=lambda: results.append(httpx.post(
            f"{url}/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 4}, timeout=30)))
        post.start()
        assert decoder.checking.acquire(timeout=60)
        uvicorn.should_exit = True
        post.join(60)
    assert results[0].status_code == 503 and "shutting down" in results[0].json()["error"]["message"]
    assert "Exception" not in caplog.text


@contextmanager
def raw_post(url: str, path: str, body: dict):
    """A POST written on a bare socket, which leaving the block closes without reading the reply."""
    host, port = url.removeprefix("http://").split(":")
    content = json.dumps(body).encode()
    with socket.create_connection((host, int(port))) as connection:
        connection.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                           f"Content-Length: {len(content)}\r\n\r\n".encode() + content)
        yield


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_a_client_that_leaves_while_its_request_waits_for_its_check_gives_its_place_up_unchecked(bundle, stream):
    """A queued request whose client leaves gives its place up at once; one waiting for the checking thread kept it
    until its turn came, and was checked all the same (about a second for a long prompt, every request behind it
    waiting). Checks held here: the first request in its check, the second waiting for it until its client leaves."""
    cancelled = ("specbuild_requests_total", (("endpoint", "completions"), ("outcome", "cancelled")))
    depth = ("specbuild_queue_depth", ())
    body = {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}
    results = []
    with in_process(bundle, max_queue=1) as (url, decoder, _):
        decoder.checks.clear()
        posts = posting(url, body, results, 2)
        posts[0].start()
        assert decoder.checking.acquire(timeout=60)
        with raw_post(url, "/v1/completions", {**body, "stream": stream}):
            wait_until(lambda: metric_values(url)[depth] == 2, "the second request waits for its check")
        wait_until(lambda: metric_values(url).get(cancelled) == 1, "the server saw the client leave", deadline=10)
        posts[1].start()  # while the one that left held the last place, a 429
        wait_until(lambda: metric_values(url)[depth] == 2, "the third request waits for its check")
        decoder.checks.set()
        decoder.go.set()
        for post in posts:
            post.join(60)
    assert [r.status_code for r in results] == [200, 200] and decoder.checks_begun == 2


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_a_client_that_leaves_frees_its_slot_for_the_next_request(bundle, reference, stream):
    expected = reference.generate(PROMPTS[1], max_new_tokens=24).text
    cancelled = ("specbuild_requests_total", (("endpoint", "completions"), ("outcome", "cancelled")))
    with in_process(bundle) as (url, decoder, _):
        with raw_post(url, "/v1/completions", {"prompt": PROMPTS[2], "max_tokens": 200, "stream": stream, "temperature": 0}):
            assert decoder.paused.acquire(timeout=60)  # decoding, and holding the only slot
        wait_until(lambda: metric_values(url).get(cancelled) == 1, "the server saw the client leave")
        decoder.go.set()
        wait_until(lambda: metric_values(url)[("specbuild_slots_busy", ())] == 0, "the slot was freed")
        assert decoder.deltas[0] <= 2  # stopped right after the pause, not decoded to its 200 tokens
        after = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 24, "temperature": 0},
                           timeout=60)
        assert after.json()["choices"][0]["text"] == expected


@pytest.mark.parametrize("n", [1, 2])
def test_a_client_that_leaves_before_its_whole_response_logs_no_traceback(bundle, caplog, n):
    """A whole response waits for its choices' jobs together (asyncio.gather); the client leaving cancelled that
    gather, which ends with a CancelledError as its exception, read by nobody: asyncio logged it with a traceback
    ("_GatheringFuture exception was never retrieved") for every client that gave up waiting."""
    cancelled = ("specbuild_requests_total", (("endpoint", "completions"), ("outcome", "cancelled")))
    with in_process(bundle) as (url, decoder, _):
        with raw_post(url, "/v1/completions", {"prompt": PROMPTS[2], "max_tokens": 200, "n": n, "temperature": 0}):
            assert decoder.paused.acquire(timeout=60)
        wait_until(lambda: metric_values(url).get(cancelled) == 1, "the server saw the client leave")
        decoder.go.set()
        wait_until(lambda: metric_values(url)[("specbuild_slots_busy", ())] == 0, "the slot was freed")
    gc.collect()  # asyncio reports an exception never retrieved when its future is collected
    assert not [record for record in caplog.records if record.exc_info], caplog.text


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_a_client_that_leaves_while_its_response_is_built_stops_the_build_at_its_next_piece(bundle, monkeypatch, stream):
    """A response's logprobs are built and encoded in the server's one builder thread (~0.1 s for a 1000-token prompt's
    echo at logprobs 20): one whose client had left ran to its end, every response after it waiting. Here the build
    pauses at its first piece of JSON until the server has seen the client leave; the next response, built after it
    in the same thread, is whole."""
    from specbuild_runtime.serve import protocol

    cancelled = ("specbuild_requests_total", (("endpoint", "completions"), ("outcome", "cancelled")))
    building, resume = threading.Semaphore(0), threading.Event()
    documents: list[int] = []  # the calls of dumps in the builder thread, a response's (or echo chunk's) each
    depth = threading.local()
    dumps = protocol.dumps

    def pausing(value, *args, **options):
        if not _building():
            return dumps(value, *args, **options)
        if getattr(depth, "now", 0) == 0:
            documents.append(0)
            if len(documents) == 1:
                building.release()
                resume.wait(60)
        documents[-1] += 1
        depth.now = getattr(depth, "now", 0) + 1
        try:
            return dumps(value, *args, **options)
        finally:
            depth.now -= 1

    monkeypatch.setattr(protocol, "dumps", pausing)
    body = {"prompt": " ".join(PROMPTS[:7]), "max_tokens": 1, "echo": True, "logprobs": 5, "stream": stream, **GREEDY}
    with in_process(bundle) as (url, decoder, _):
        decoder.go.set()
        with raw_post(url, "/v1/completions", body):
            assert building.acquire(timeout=60)
        wait_until(lambda: metric_values(url).get(cancelled) == 1, "the server saw the client leave")
        resume.set()
        after = httpx.post(f"{url}/v1/completions", json={**body, "stream": False}, timeout=60)
    assert after.status_code == 200 and len(after.json()["choices"][0]["logprobs"]["tokens"]) > 100
    assert len(documents) == 2 and documents[0] == 1 < documents[1]


def _building() -> bool:
    return threading.current_thread().name.startswith("specbuild-respond")


def encoded_in_the_builder(monkeypatch) -> list:
    """What protocol.dumps encodes in the response builder's thread from now on."""
    from specbuild_runtime.serve import protocol

    documents, dumps = [], protocol.dumps

    def recorded(value, *args, **options):
        if _building():
            documents.append(value)
        return dumps(value, *args, **options)
    monkeypatch.setattr(protocol, "dumps", recorded)
    return documents


class PausingInTheBuilder:
    """A tokenizer whose `method`, first called in the response builder's thread, waits there until `resume` is set
    (releasing `reached`); its later calls there are recorded in `after` (their first argument)."""

    def __init__(self, tokenizer, method: str):
        self._tokenizer, self._method = tokenizer, method
        self.reached, self.resume, self.after = threading.Semaphore(0), threading.Event(), []

    def __getattr__(self, name):
        inner = getattr(self._tokenizer, name)
        if name != self._method:
            return inner

        def paused(*args, **kwargs):
            if _building() and not self.resume.is_set():
                self.reached.release()
                self.resume.wait(60)
            elif _building():
                self.after.append(args[0])
            return inner(*args, **kwargs)
        return paused


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_a_client_that_leaves_while_its_logprobs_texts_are_decoded_stops_the_build_before_its_json(bundle, monkeypatch,
                                                                                                  stream):
    """A response's logprobs' token texts, decoded before any of its JSON, take about as long as the JSON (a chat's 4000
    tokens at top_logprobs 20, Qwen's 152k vocabulary: 0.65 s and 0.95 s on a loaded 2-core machine): one whose client
    had left decoded them all, every response after it waiting, until its JSON's first piece stopped it. Here the first
    text decoded in the builder thread waits until the server has seen the client leave: a token's texts at most are
    decoded after it, and no JSON."""
    cancelled = ("specbuild_requests_total", (("endpoint", "completions"), ("outcome", "cancelled")))
    documents = encoded_in_the_builder(monkeypatch)
    body = {"prompt": " ".join(PROMPTS[:7]), "max_tokens": 1, "echo": True, "logprobs": 5, "stream": stream, **GREEDY}
    with in_process(bundle) as (url, decoder, _):
        decoder.go.set()
        decoder.tokenizer = pausing = PausingInTheBuilder(decoder.tokenizer, "decode")  # the texts', not its streams'
        with raw_post(url, "/v1/completions", body):
            assert pausing.reached.acquire(timeout=60)
        wait_until(lambda: metric_values(url).get(cancelled) == 1, "the server saw the client leave")
        pausing.resume.set()
        # built after it in the same thread, without texts of its own to decode
        after = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 1, **GREEDY}, timeout=60)
    assert after.status_code == 200 and after.json()["choices"][0]["text"]
    assert len(pausing.after) <= 1 + 5, pausing.after
    assert {document["id"] for document in documents if isinstance(document, dict) and "id" in document} == \
        {after.json()["id"]}


def test_a_client_that_leaves_while_its_token_strs_are_looked_up_stops_the_build_before_its_json(bundle, monkeypatch):
    """/tokenize's token_strs, looked up before any of its JSON, take twice as long as the JSON (291k tokens, Qwen's
    152k vocabulary: 0.48 s and 0.23 s on a loaded 2-core machine): one whose client had left looked them all up,
    every response after it waiting. Here the first looked up in the builder thread waits until the server has seen
    the client leave: one more at most is looked up after it, and no JSON."""
    cancelled = ("specbuild_requests_total", (("endpoint", "tokenize"), ("outcome", "cancelled")))
    documents = encoded_in_the_builder(monkeypatch)
    with in_process(bundle) as (url, decoder, _):
        decoder.tokenizer = pausing = PausingInTheBuilder(decoder.tokenizer, "id_to_token")
        with raw_post(url, "/tokenize", {"prompt": " ".join(PROMPTS[:7]), "return_token_strs": True}):
            assert pausing.reached.acquire(timeout=60)
        wait_until(lambda: metric_values(url).get(cancelled) == 1, "the server saw the client leave")
        pausing.resume.set()
        after = httpx.post(f"{url}/tokenize", json={"prompt": PROMPTS[0]}, timeout=60)  # built after it, no token_strs
    assert after.status_code == 200 and after.json()["tokens"]
    assert len(pausing.after) <= 1, pausing.after
    assert [document["tokens"] for document in documents if isinstance(document, dict) and "tokens" in document] == \
        [after.json()["tokens"]]


@pytest.mark.parametrize("path", ["/v1/completions", "/tokenize"])
def test_a_response_whose_build_fails_is_a_500_counted_as_an_error_its_connection_kept(bundle, monkeypatch, caplog, path):
    """A whole response is built off the loop (a tool parser reads the reply there): a bug there left the request
    uncounted (its endpoint's outcomes no longer added up to its requests), and reached Starlette's last handler:
    uvicorn logged its traceback a second time and closed the connection."""
    from specbuild_runtime.serve import app

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(app, "Json", broken)
    endpoint = "completions" if path == "/v1/completions" else "tokenize"
    body = json.dumps({"prompt": PROMPTS[1], "max_tokens": 2, **GREEDY} if endpoint == "completions"
                      else {"prompt": PROMPTS[1]}).encode()
    with in_process(bundle) as (url, decoder, _):
        decoder.go.set()
        # and a second request on the same connection
        status, _, rest = exchange(url, b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                                        b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
                                   % (path.encode(), len(body), body))
        outcomes = {labels: value for (name, labels), value in metric_values(url).items()
                    if name == "specbuild_requests_total" and ("endpoint", endpoint) in labels}
    assert status.startswith("HTTP/1.1 500") and b"internal error: RuntimeError: a bug" in rest
    assert b"HTTP/1.1 200" in rest, rest
    assert outcomes == {(("endpoint", endpoint), ("outcome", "error")): 1}, outcomes
    assert len([record for record in caplog.records if record.exc_info]) == 1, caplog.text


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_a_client_that_leaves_while_its_long_prompt_is_scored_stops_it_before_the_next_call(bundle, tokenizer, stream,
                                                                                           monkeypatch):
    """echo with logprobs scores the prompt in calls of up to 64 tokens, all before the first token: the server's stop
    came only after the last of them."""
    from specbuild_runtime.slot import EngineSlot

    calls, scoring, go_on, step = [], threading.Semaphore(0), threading.Event(), EngineSlot.step

    def held_first_call(slot, *args, **kwargs):
        calls.append(args)
        if len(calls) == 1:
            scoring.release()
            go_on.wait(60)
        return step(slot, *args, **kwargs)

    ids = tokenizer("\n".join(PROMPTS * 20))["input_ids"][:MAX_SEQ_LEN - 1]  # 4 calls' worth
    cancelled = ("specbuild_requests_total", (("endpoint", "completions"), ("outcome", "cancelled")))
    with in_process(bundle) as (url, decoder, _):
        monkeypatch.setattr(EngineSlot, "step", held_first_call)
        with raw_post(url, "/v1/completions", {"prompt": ids, "max_tokens": 1, "echo": True, "logprobs": 1,
                                               "stream": stream, **GREEDY}):
            assert scoring.acquire(timeout=60)
        wait_until(lambda: metric_values(url).get(cancelled) == 1, "the server saw the client leave")
        go_on.set()
        wait_until(lambda: metric_values(url)[("specbuild_slots_busy", ())] == 0, "the slot was freed")
        assert len(calls) == 1
        monkeypatch.undo()
        decoder.go.set()
        after = httpx.post(f"{url}/v1/completions", json={"prompt": ids, "max_tokens": 1, "echo": True, "logprobs": 1,
                                                          **GREEDY}, timeout=60)
        assert after.status_code == 200 and len(after.json()["choices"][0]["logprobs"]["tokens"]) == len(ids) + 1


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_a_client_that_leaves_while_its_long_prompt_is_read_frees_the_slot_before_the_next_chunk(bundle, tokenizer,
                                                                                                 reference, stream,
                                                                                                 monkeypatch):
    """A long prompt is read (CPU) in chunks, all before its first token: the server's stop came only after the last
    of them, its slot held meanwhile (docs/serving.md's *Under load*: a 1388-token prompt of a 66M target)."""
    from specbuild_runtime import slot as slot_module
    from specbuild_runtime.slot import EngineSlot

    calls, reading, go_on, run = [], threading.Semaphore(0), threading.Event(), EngineSlot._compute_rows

    def held_first_chunk(slot, first, total_len, *args):
        if slot.engine.info.role == "target":
            calls.append((first, total_len))
            if len(calls) == 1:
                reading.release()
                go_on.wait(60)
        return run(slot, first, total_len, *args)

    monkeypatch.setattr(slot_module, "PREFILL_CHUNK", 16)  # before the decoder: its slots read it
    ids = tokenizer("\n".join(PROMPTS * 20))["input_ids"][:MAX_SEQ_LEN - 1]
    expected = reference.generate(ids, max_new_tokens=1).text
    cancelled = ("specbuild_requests_total", (("endpoint", "completions"), ("outcome", "cancelled")))
    with in_process(bundle) as (url, decoder, _):
        monkeypatch.setattr(EngineSlot, "_compute_rows", held_first_chunk)
        with raw_post(url, "/v1/completions", {"prompt": ids, "max_tokens": 1, "stream": stream, **GREEDY}):
            assert reading.acquire(timeout=60)
        wait_until(lambda: metric_values(url).get(cancelled) == 1, "the server saw the client leave")
        go_on.set()
        wait_until(lambda: metric_values(url)[("specbuild_slots_busy", ())] == 0, "the slot was freed")
        assert calls == [(0, 16)]
        monkeypatch.undo()
        decoder.go.set()
        after = httpx.post(f"{url}/v1/completions", json={"prompt": ids, "max_tokens": 1, **GREEDY}, timeout=60)
        assert after.status_code == 200 and after.json()["choices"][0]["text"] == expected


def test_a_client_that_leaves_a_stream_of_n_choices_stops_each_decoding_or_queued(bundle, reference):
    expected = reference.generate(PROMPTS[1], max_new_tokens=24).text
    cancelled = ("specbuild_requests_total", (("endpoint", "completions"), ("outcome", "cancelled")))
    with in_process(bundle) as (url, decoder, _):  # one slot: the first choice decodes, the second waits for it
        with raw_post(url, "/v1/completions", {"prompt": PROMPTS[2], "max_tokens": 200, "stream": True, "n": 2,
                                               "temperature": 0}):
            assert decoder.paused.acquire(timeout=60)
        wait_until(lambda: metric_values(url).get(cancelled) == 1, "the server saw the client leave")
        decoder.go.set()
        wait_until(lambda: metric_values(url)[("specbuild_slots_busy", ())] == 0, "the slot was freed")
        assert decoder.deltas[0] <= 2 and len(decoder.deltas) == 1  # the first stopped, the second never began
        assert metric_values(url)[("specbuild_queue_depth", ())] == 0
        after = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 24, "temperature": 0},
                           timeout=60)
        assert after.json()["choices"][0]["text"] == expected


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_a_client_that_leaves_a_batch_stops_every_prompt_of_it_decoding_or_queued(bundle, reference, stream):
    expected = reference.generate(PROMPTS[1], max_new_tokens=24).text
    cancelled = ("specbuild_requests_total", (("endpoint", "completions"), ("outcome", "cancelled")))
    with in_process(bundle) as (url, decoder, _):
        with raw_post(url, "/v1/completions", {"prompt": PROMPTS[2:5], "max_tokens": 200, "temperature": 0,
                                               "stream": stream}):
            assert decoder.paused.acquire(timeout=60)  # the first prompt decoding in the only slot, two queued
            wait_until(lambda: metric_values(url)[("specbuild_queue_depth", ())] == 2, "the batch's others queued")
        wait_until(lambda: metric_values(url).get(cancelled) == 1, "the server saw the client leave")
        assert metric_values(url)[("specbuild_queue_depth", ())] == 0
        decoder.go.set()
        wait_until(lambda: metric_values(url)[("specbuild_slots_busy", ())] == 0, "the slot was freed")
        assert decoder.deltas == [decoder.deltas[0]] and decoder.deltas[0] <= 2  # the queued ones never decoded
        after = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 24, "temperature": 0},
                           timeout=60)
        assert after.json()["choices"][0]["text"] == expected


def asgi_post(path: str, content_length: int, spec_version: str = "2.3") -> dict:
    """The scope of a JSON POST as an ASGI server passes it to the app."""
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": spec_version}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
            "root_path": "", "headers": [(b"content-type", b"application/json"),
                                         (b"content-length", str(content_length).encode())],
            "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}


def outcomes(server) -> dict:
    return {s.labels["outcome"]: s.value for family in text_string_to_metric_families(server.metrics.render().decode())
            for s in family.samples if s.name == "specbuild_requests_total"}


def test_a_client_that_leaves_while_sending_its_body_is_cancelled_not_a_server_error(bundle, caplog):
    """The connection closes mid-body (Starlette raises ClientDisconnect): counted as cancelled, not as an error
    (500, logged with a traceback as a bug). Driven through the ASGI interface, so the disconnect comes exactly there."""
    from specbuild_runtime import SpeculativeDecoder
    from specbuild_runtime.serve.app import Server, Settings

    server = Server(SpeculativeDecoder(bundle), Settings(model=MODEL))
    messages = [{"type": "http.request", "body": b'{"prompt": "def', "more_body": True}, {"type": "http.disconnect"}]

    async def receive():
        return messages.pop(0)

    async def send(message):
        pass

    async def run():
        await server.app(asgi_post("/v1/completions", 1000), receive, send)
        await server.scheduler.close()

    asyncio.run(run())
    assert outcomes(server) == {"cancelled": 1.0}
    assert "request failed" not in caplog.text


def test_a_request_whose_body_is_still_arriving_when_the_grace_period_ends_is_answered_503(bundle, caplog):
    """SIGTERM while a client is still sending its body (a slow upload): the drain stopped only jobs, so the request
    waited for the rest of its body until uvicorn's backstop (--shutdown-timeout + 5 s) cancelled it, a 500 logged
    with a traceback. Once the grace period ends it is answered 503, as a queued request is. Driven through the ASGI
    interface: the body's rest never comes."""
    from specbuild_runtime import SpeculativeDecoder
    from specbuild_runtime.serve.app import Server, Settings

    server = Server(SpeculativeDecoder(bundle), Settings(model=MODEL))
    sent = []

    async def run():
        reading = asyncio.Event()

        async def receive():
            if reading.is_set():
                await asyncio.Event().wait()
            reading.set()
            return {"type": "http.request", "body": b'{"prompt": "def', "more_body": True}

        async def send(message):
            sent.append(message)

        request = asyncio.ensure_future(server.app(asgi_post("/v1/completions", 1000), receive, send))
        await reading.wait()
        server.scheduler.drain(0)
        await asyncio.wait_for(request, 60)
        await server.scheduler.close()

    asyncio.run(run())
    assert sent[0]["status"] == 503 and b"shutting down" in sent[1]["body"]
    assert outcomes(server) == {"shutdown": 1.0} and "request failed" not in caplog.text


def test_a_server_run_on_a_second_event_loop_reads_a_body_in_parts(bundle):
    """Waiting for the end of the shutdown grace period while a body arrives bound the server to the first loop it
    ran on (an asyncio.Event binds to the loop that first waits): on the next, the wait failed at once, and every
    request whose body came in more than one part was answered 503, "the server is shutting down"."""
    from specbuild_runtime import SpeculativeDecoder
    from specbuild_runtime.serve.app import Server, Settings

    server = Server(SpeculativeDecoder(bundle), Settings(model=MODEL))
    body = json.dumps({"prompt": "def", "max_tokens": 2}).encode()

    async def run():
        parts = [body[:5], body[5:]]
        sent = []

        async def receive():
            if not parts:
                await asyncio.Event().wait()  # no disconnect: the client waits for its answer
            await asyncio.sleep(0.01)  # the next part is not there yet
            part = parts.pop(0)
            return {"type": "http.request", "body": part, "more_body": bool(parts)}

        async def send(message):
            sent.append(message)

        await server.app(asgi_post("/v1/completions", len(body)), receive, send)
        await server.scheduler.close()
        return sent[0]["status"]

    assert [asyncio.run(run()) for _ in range(2)] == [200, 200]


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_a_client_gone_while_its_request_waits_for_its_check_is_cancelled_under_asgi_2_4(bundle, caplog, stream):
    """Under an ASGI 2.4 server, whose send raises OSError on a closed connection, the reply nobody reads (499) is no
    error either. The disconnect comes while the check is held."""
    from specbuild_runtime import SpeculativeDecoder
    from specbuild_runtime.serve.app import Server, Settings

    decoder = PausingDecoder(SpeculativeDecoder(bundle))
    decoder.checks.clear()
    server = Server(decoder, Settings(model=MODEL))
    body = json.dumps({"prompt": PROMPTS[0], "max_tokens": 4, "stream": stream}).encode()
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        if messages:
            return messages.pop(0)
        await asyncio.get_running_loop().run_in_executor(None, decoder.checking.acquire)
        return {"type": "http.disconnect"}

    async def send(message):
        raise OSError("the connection is closed")

    async def run():
        try:  # a guard: without a watch for the client leaving, the request waited for its check for ever
            await asyncio.wait_for(server.app(asgi_post("/v1/completions", len(body), spec_version="2.4"), receive,
                                              send), 30)
        finally:
            decoder.checks.set()
            await server.scheduler.close()

    asyncio.run(run())
    assert outcomes(server) == {"cancelled": 1.0} and decoder.deltas == []
    assert "request failed" not in caplog.text


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_a_stream_whose_client_left_before_its_first_send_stops_its_job(bundle, caplog, endpoint):
    """Under an ASGI 2.4 server, whose send raises OSError on a closed connection, the response's first send fails
    before the events begin: the job still stops after its first token (it held the slot for all of its 200), and
    counts as cancelled, not as an error."""
    from specbuild_runtime import SpeculativeDecoder
    from specbuild_runtime.serve.app import Server, Settings

    decoder = PausingDecoder(SpeculativeDecoder(bundle))
    server = Server(decoder, Settings(model=MODEL))
    fields = {"messages": [{"role": "user", "content": "x"}]} if endpoint == "chat/completions" else {"prompt": PROMPTS[2]}
    body = json.dumps({**fields, "max_tokens": 200, "stream": True, "temperature": 0}).encode()
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():  # the body, then nothing: the client was there while its request was checked
        if messages:
            return messages.pop(0)
        await asyncio.Event().wait()

    async def send(message):
        raise OSError("the connection is closed")

    async def run():
        await server.app(asgi_post(f"/v1/{endpoint}", len(body), spec_version="2.4"), receive, send)
        decoder.go.set()
        await asyncio.wait({job.relay.worker for job in server.scheduler._running})
        await server.scheduler.close()

    asyncio.run(run())
    assert decoder.deltas[0] <= 2
    assert outcomes(server) == {"cancelled": 1.0}
    assert "request failed" not in caplog.text


def test_timeout_ends_a_decoding_stream_and_a_queued_request(bundle):
    """The paused stream holds the only slot past the deadline, whether or not its first text came first."""
    with in_process(bundle, timeout=1.0) as (url, decoder, _), streaming(url) as (first, rest):
        queued = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 4}, timeout=60)
        assert queued.status_code == 503 and "timeout" in queued.json()["error"]["message"]
        with streaming(url, PROMPTS[0], 4) as (queued_first, queued_rest):  # streamed: the same 503, as an event
            queued_events = [queued_first, *queued_rest]
        assert queued_events[-1] == "data: [DONE]" and error_of(queued_events[-2])["code"] == 503
        events = [first, *rest]
        assert events[-1] == "data: [DONE]" and error_of(events[-2])["type"] == "InternalServerError"


def test_a_request_that_decoded_past_the_timeout_is_not_resent_by_the_openai_client(bundle):
    """The openai client resends a 5xx twice by default: a 504 came back three times the work, each resend
    holding a slot (or a place in the queue) until the deadline passed again."""
    timeouts = ("specbuild_requests_total", (("endpoint", "completions"), ("outcome", "timeout")))
    with in_process(bundle, timeout=1.0) as (url, decoder, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=2)
        with pytest.raises(openai.InternalServerError) as raised:
            client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=200, temperature=0)
        assert raised.value.status_code == 504 and raised.value.response.headers["x-should-retry"] == "false"
        assert len(decoder.deltas) == 1 and metric_values(url)[timeouts] == 1


def test_an_engine_call_the_device_fails_is_a_500_saying_so_and_the_server_goes_on(bundle, reference, monkeypatch,
                                                                                      caplog):
    """An engine call onnxruntime fails (out of memory, say; here its terminate flag) is the device's failure, not
    a bug: a 500 (as vLLM answers an engine error) whose message is the runtime's DeviceError line, logged in one
    line without a traceback to report; a stream it cuts mid-way ends with that error event and [DONE]; the slot
    goes back and the next request decodes as before."""
    import onnxruntime as ort
    from specbuild_runtime.slot import EngineSlot

    expected = reference.generate(PROMPTS[1], max_new_tokens=8).text
    graph, calls = EngineSlot._graph, []

    def failing_after(n: int):
        def options(self, *args):
            calls.append(1)
            if len(calls) <= n:
                return graph(self, *args)
            terminate = ort.RunOptions()
            terminate.terminate = True
            return terminate
        return options

    body = {"prompt": PROMPTS[1], "max_tokens": 8, **GREEDY}
    with in_process(bundle) as (url, decoder, _):
        decoder.go.set()
        monkeypatch.setattr(EngineSlot, "_graph", failing_after(0))
        whole = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        calls.clear()
        monkeypatch.setattr(EngineSlot, "_graph", failing_after(6))  # the prompt's calls and a few rounds
        with streaming(url) as (first, rest):
            events = [first, *rest]
        monkeypatch.setattr(EngineSlot, "_graph", graph)
        after = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    error = whole.json()["error"]
    assert whole.status_code == 500 and error["code"] == 500, whole.text
    assert error["message"].startswith("onnxruntime failed running") and "terminate" in error["message"], error
    assert "choices" in json.loads(first.removeprefix("data: "))  # text came before the failure
    assert events[-1] == "data: [DONE]" and error_of(events[-2])["message"].startswith("onnxruntime failed running")
    assert after.status_code == 200 and after.json()["choices"][0]["text"] == expected
    failures = [record for record in caplog.records if record.name == "specbuild.serve"]
    assert len(failures) == 2 and not any(record.exc_info for record in failures), caplog.text


def test_a_target_whose_fp16_logits_overflow_is_a_500_saying_so_not_a_bug(overflowing, caplog):
    """Logits that overflow fp16 are the bundle's failure (compile it in bf16), not specbuild's: the runtime's one
    line, logged without a traceback, not "internal error"."""
    body = {"prompt": PROMPTS[1], "max_tokens": 8, **GREEDY}
    with in_process(overflowing("target")) as (url, decoder, _):
        decoder.go.set()
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 500 and "logits hold NaN or an infinity" in reply.json()["error"]["message"], reply.text
    failures = [record for record in caplog.records if record.name == "specbuild.serve"]
    assert len(failures) == 1 and not failures[0].exc_info, caplog.text


def strict_json(text: str):
    """text read as JSON by a strict parser: NaN and Infinity, which Python's json reads, refused."""
    return json.loads(text, parse_constant=lambda constant: pytest.fail(f"{constant} is not JSON: {text[:300]}"))


def test_a_prompt_scored_on_logits_that_overflow_writes_its_nan_logprobs_as_the_floor_streamed_or_not(overflowing):
    """A prompt is scored whatever its rows hold (a generated token alone stops where the logits stop being finite),
    so an fp16 target that overflows gives NaN logprobs. Written as -9999.0, as -inf is, the reply is valid JSON both
    ways: a whole one was a 500 (allow_nan=False) and a stream's chunk held the token NaN."""
    body = {"prompt": PROMPTS[1], "max_tokens": 0, "echo": True, "logprobs": 1, **GREEDY}  # lm-eval's scoring
    with in_process(overflowing("target")) as (url, decoder, _):
        decoder.go.set()
        scored = decoder.generate(PROMPTS[1], 0, prompt_logprobs=1).prompt_logprobs[1:]
        whole = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as response:
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert scored and all(math.isnan(r.logprob) for r in scored)  # the case is what it claims
    assert whole.status_code == 200, whole.text
    logprobs = strict_json(whole.text)["choices"][0]["logprobs"]
    assert logprobs["token_logprobs"] == [None] + [-9999.0] * len(scored)
    assert all(value == -9999.0 for top in logprobs["top_logprobs"][1:] for value in top.values())
    chunks = [strict_json(event)["choices"][0] for event in events[:-1]]
    assert [x for c in chunks for x in c["logprobs"]["token_logprobs"]] == logprobs["token_logprobs"]


def test_each_logprobs_shape_writes_nan_as_the_floor():
    """Chat's and prompt_logprobs' shapes too, whose NaN no tiny bundle reaches through serve: an overflowing target
    fails the request at its first generated token (above)."""
    from types import SimpleNamespace

    from specbuild_runtime import TokenLogprobs
    from specbuild_runtime.serve.protocol import CHAT, COMPLETIONS, Logprobs

    tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens: f"<{ids[0]}>")
    records = [TokenLogprobs(5, math.nan, ((3, math.nan), (5, math.nan)), 2)]
    chat, completions = Logprobs(CHAT, tokenizer), Logprobs(COMPLETIONS, tokenizer)
    written = strict_json(json.dumps([chat.of(records), completions.of(records), completions.prompt(records)]))
    [chosen] = written[0]["content"]
    assert [entry["logprob"] for entry in (chosen, *chosen["top_logprobs"])] == [-9999.0] * 3
    assert written[1]["token_logprobs"] == [-9999.0] and set(written[1]["top_logprobs"][0].values()) == {-9999.0}
    assert {entry["logprob"] for entry in written[2][1].values()} == {-9999.0}


def test_connections_beyond_max_connections_get_503(bundle):
    with in_process(bundle, max_connections=1) as (url, decoder, _):
        decoder.go.set()
        assert httpx.get(f"{url}/health").status_code == 200
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))):  # an idle client holds the only connection
            # once the server has taken it (no sleep: polled)
            wait_until(lambda: httpx.get(f"{url}/health").status_code == 503, "the idle connection was counted")
        wait_until(lambda: httpx.get(f"{url}/health").status_code == 200, "the connection was released")


def test_an_idle_connection_beyond_max_connections_is_answered_503_at_once_and_closed(bundle):
    """uvicorn answered a connection beyond the limit only once it sent a request, and held an idle one open: each
    kept one of the process's files until it had none, and then every new client hung. Now such a connection gets
    its 503 (OpenAI-shaped, with Retry-After) as soon as it opens, then the end of the stream."""
    with in_process(bundle, max_connections=1) as (url, decoder, _):
        decoder.go.set()
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))), socket.create_connection((host, int(port))) as beyond:
            beyond.settimeout(30)  # a guard: held open, it would never send a byte
            reply = b""
            while chunk := beyond.recv(65536):
                reply += chunk
    head, body = reply.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in head.lower()
    assert json.loads(body)["error"]["type"] == "InternalServerError"


def test_a_connection_refused_beyond_max_connections_is_counted_in_the_metrics(bundle):
    """Such a connection is answered by the HTTP protocol, before the app: its client counted a 503 that the metrics
    showed nowhere (1200 clients at once on the default limit: 176 of them). The metrics are read on the one connection
    served: a new one, opened before the server saw the others close, would be refused and counted too."""
    with in_process(bundle, max_connections=1) as (url, decoder, _), httpx.Client(timeout=30) as served:
        decoder.go.set()
        assert metric_values(url, served)[("specbuild_refused_connections_total", ())] == 0  # kept alive
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as beyond:
            beyond.settimeout(30)  # a guard
            assert beyond.recv(65536).startswith(b"HTTP/1.1 503")
        assert metric_values(url, served)[("specbuild_refused_connections_total", ())] == 1


def test_a_refused_connection_its_client_holds_open_leaves_the_place_of_a_served_one_that_left_to_a_newcomer(
        bundle, monkeypatch):
    """A refused connection stays open until its client closes it or REFUSED_LINGER passes (held past the test here).
    Counted among the open ones meanwhile, it would hold a place of the limit: the served client gone, a newcomer
    would be refused with no connection served. (Under uvicorn's limit_concurrency, set then, it also had the served
    connection's requests refused.)"""
    from specbuild_runtime.serve import app

    monkeypatch.setattr(app, "REFUSED_LINGER", 600.0)
    with in_process(bundle, max_connections=1) as (url, decoder, uvicorn):
        decoder.go.set()
        host, port = url.removeprefix("http://").split(":")
        with ExitStack() as held:
            with httpx.Client(timeout=30) as served:
                assert served.get(f"{url}/health").status_code == 200  # the one connection allowed, kept alive
                beyond = held.enter_context(socket.create_connection((host, int(port))))
                beyond.settimeout(30)  # a guard
                assert beyond.recv(65536).startswith(b"HTTP/1.1 503")  # refused, and held open by its client
                assert served.get(f"{url}/health").status_code == 200
            wait_until(lambda: all(each.refused for each in uvicorn.server_state.connections),
                       "the server saw the served client leave")
            assert httpx.get(f"{url}/health", timeout=30).status_code == 200


def test_handlers_still_running_after_their_clients_left_never_get_a_new_client_uvicorns_text_503(bundle):
    """serve gave uvicorn limit_concurrency (--max-connections + 1), which counts the tasks of requests as well as the
    connections: while handlers whose clients had left still ran, a new client's request got uvicorn's own 503,
    text/plain "Service Unavailable", which no metric counted and an OpenAI client cannot read. Only the connections
    are bounded now (refused in JSON and counted, tests above), and a handler left running refuses nobody."""
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    gate = threading.Event()

    async def hold(request):  # a handler that does not look whether its client is still there
        await asyncio.get_running_loop().run_in_executor(None, gate.wait)
        return JSONResponse({})

    with in_process(bundle, routes=(Route("/hold", hold),), max_connections=1) as (url, decoder, uvicorn):
        decoder.go.set()
        host, port = url.removeprefix("http://").split(":")
        try:
            for running in (1, 2):  # past what uvicorn's limit allowed: 2
                with socket.create_connection((host, int(port))) as client:
                    client.sendall(b"GET /hold HTTP/1.1\r\nhost: localhost\r\n\r\n")
                    wait_until(lambda: len(uvicorn.server_state.tasks) == running, "the handler started")
                wait_until(lambda: not uvicorn.server_state.connections, "the server saw its client leave")
            reply = httpx.get(f"{url}/health")
            assert reply.status_code == 200 and reply.json() == {"status": "ok"}, reply.text
        finally:
            gate.set()


class CountingTokenizer:
    """A tokenizer that records the name of each call of `counted` (its other attributes are the tokenizer's)."""

    def __init__(self, tokenizer, counted: tuple[str, ...]):
        self.tokenizer, self.counted, self.calls = tokenizer, counted, []

    def __getattr__(self, name):
        method = getattr(self.tokenizer, name)
        return (lambda *args, **kwargs: self.calls.append(name) or method(*args, **kwargs)) if name in self.counted \
            else method


@pytest.mark.parametrize("path, body, work", [("/tokenize", {"prompt": PROMPTS[0]}, "encode_batch"),
                                              ("/detokenize", {"tokens": [5, 6, 7]}, "decode")])
def test_a_tokenize_whose_client_leaves_while_it_waits_for_the_checking_thread_gives_its_turn_up(bundle, monkeypatch,
                                                                                                   path, body, work):
    """/tokenize and /detokenize take turns with requests' checks on the checking thread. One whose client had left
    waited for its turn all the same, and then tokenized (every request behind it waiting); now it is counted
    cancelled at once and its work never runs."""
    from specbuild_runtime.serve.scheduler import Scheduler

    waiting = []
    run_check = Scheduler.run_check

    async def recorded(self, call):
        waiting.append(call)
        return await run_check(self, call)

    monkeypatch.setattr(Scheduler, "run_check", recorded)
    cancelled = ("specbuild_requests_total", (("endpoint", path[1:]), ("outcome", "cancelled")))
    with in_process(bundle) as (url, decoder, uvicorn):
        decoder.go.set()
        decoder.checks.clear()
        # the server's own calls (/tokenize's encode, /detokenize's decode); a completion's check tokenizes in the
        # decoder's
        decoder.tokenizer = CountingTokenizer(decoder.tokenizer, ("encode_batch", "decode"))
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as holder:  # its check holds the checking thread
            completion = json.dumps({"prompt": [5, 6, 7], "max_tokens": 1}).encode()
            holder.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n"
                           b"content-length: %d\r\n\r\n%s" % (len(completion), completion))
            assert decoder.checking.acquire(timeout=60)
        wait_until(lambda: not uvicorn.server_state.tasks, "its handler saw its client leave")  # its check runs on
        payload = json.dumps(body).encode()
        with socket.create_connection((host, int(port))) as leaving:
            leaving.sendall(b"POST %s HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n"
                            b"content-length: %d\r\n\r\n%s" % (path.encode(), len(payload), payload))
            wait_until(lambda: len(waiting) == 1, "the request waited for the checking thread")
        wait_until(lambda: metric_values(url).get(cancelled) == 1, "the request was counted cancelled")
        decoder.checks.set()
        assert httpx.post(f"{url}{path}", json=body, timeout=60).status_code == 200  # after the checking thread's queue
        assert decoder.tokenizer.calls == [work]  # this one's alone


TOKENIZER_WORK = [("/tokenize", {"prompt": PROMPTS[0]}), ("/detokenize", {"tokens": [5, 6, 7]})]


@pytest.mark.parametrize("path, body", TOKENIZER_WORK)
def test_a_tokenize_waiting_for_the_checking_thread_takes_a_place_in_the_queue_and_shows_in_its_depth(bundle, path,
                                                                                                       body):
    """/tokenize and /detokenize waited for the checking thread in no queue the server bounds: a flood of them on open
    connections (up to --max-connections) waited unseen, every request's check behind them. Now each takes a place as
    a request waiting for its check does: beyond them a 429, of either kind. A completion's check holds the thread."""
    depth = ("specbuild_queue_depth", ())
    rejected = ("specbuild_requests_total", (("endpoint", path[1:]), ("outcome", "rejected")))
    with in_process(bundle, max_queue=1) as (url, decoder, _), ThreadPoolExecutor(2) as client:
        decoder.checks.clear()
        completing = client.submit(httpx.post, f"{url}/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 4},
                                   timeout=60)
        assert decoder.checking.acquire(timeout=60)
        waiting = client.submit(httpx.post, f"{url}{path}", json=body, timeout=60)
        wait_until(lambda: metric_values(url)[depth] == 2, f"{path} counted as waiting")
        for refused in (path, "/v1/completions"):  # one slot and one place in the queue taken
            full = httpx.post(f"{url}{refused}", json=body if refused == path else {"prompt": PROMPTS[0]}, timeout=10)
            assert full.status_code == 429 and full.headers["Retry-After"] == "1", full.text
            assert "--max-queue 1" in full.json()["error"]["message"]
        assert metric_values(url)[rejected] == 1
        decoder.checks.set()
        decoder.go.set()
        assert [completing.result().status_code, waiting.result().status_code] == [200, 200]
        assert metric_values(url)[depth] == 0


@pytest.mark.parametrize("path, body", TOKENIZER_WORK)
def test_a_tokenize_waiting_for_the_checking_thread_gets_503_at_its_timeout(bundle, path, body):
    """--timeout did not bound /tokenize and /detokenize: one behind long prompts' checks waited however long they
    took. A completion's check holds the thread here past a 1 s timeout (the completion's own answer: 503 too)."""
    timeout = ("specbuild_requests_total", (("endpoint", path[1:]), ("outcome", "timeout")))
    with in_process(bundle, timeout=1.0) as (url, decoder, _), ThreadPoolExecutor(1) as client:
        decoder.checks.clear()
        completing = client.submit(httpx.post, f"{url}/v1/completions", json={"prompt": PROMPTS[0]}, timeout=60)
        assert decoder.checking.acquire(timeout=60)
        reply = httpx.post(f"{url}{path}", json=body, timeout=30)
        assert reply.status_code == 503 and "--timeout" in reply.json()["error"]["message"], reply.text
        assert reply.headers["Retry-After"] == "1" and metric_values(url)[timeout] == 1
        assert completing.result().status_code == 503


def checks_only_scheduler(timeout: float | None = None):
    """A Scheduler with one place (--parallel 1, --max-queue 0), for run_check alone: no decoder behind it."""
    from types import SimpleNamespace

    from specbuild_runtime.serve.metrics import Metrics
    from specbuild_runtime.serve.scheduler import Scheduler

    return Scheduler(SimpleNamespace(slots=SimpleNamespace(size=1)), 0, timeout, Metrics(1))


def test_run_check_answers_a_work_that_returns_none_with_none():
    """run_check took a result of None for its job stopped while it waited, and then waited for a Stopped that never
    came: until its --timeout (a 503 for work done) or, without one, for ever."""
    async def run():
        return await asyncio.wait_for(checks_only_scheduler().run_check(lambda: None), 60)

    assert asyncio.run(run()) is None


@pytest.mark.parametrize("end", ["refused", "timeout", "cancelled"])
def test_run_check_gives_its_place_back_however_it_ends(end):
    """A /tokenize holds one of the --parallel + --max-queue places while it waits for the checking thread and
    tokenizes: one kept after its work raised, its --timeout or its client leaving would shrink the server for good.
    With one place, the next run_check gets it rather than Overloaded."""
    from specbuild_runtime.serve.scheduler import Stopped

    begun, release = threading.Event(), threading.Event()

    def work() -> str:
        begun.set()
        release.wait()
        if end == "refused":
            raise ValueError("refused")
        return "first"

    async def run() -> str:
        scheduler = checks_only_scheduler(0.05 if end == "timeout" else None)
        first = asyncio.ensure_future(scheduler.run_check(work))
        await asyncio.get_running_loop().run_in_executor(None, begun.wait)
        scheduler.timeout = None  # the next call's: it waits for `work` to return
        if end == "cancelled":
            first.cancel()
        if end == "refused":
            release.set()
        with pytest.raises({"refused": ValueError, "timeout": Stopped, "cancelled": asyncio.CancelledError}[end]):
            await first
        release.set()
        return await scheduler.run_check(lambda: "next")

    assert asyncio.run(run()) == "next"


def test_shutdown_cuts_a_stream_after_the_grace_period_with_a_clean_end(bundle):
    with in_process(bundle, shutdown_timeout=0.0) as (url, decoder, uvicorn), streaming(url) as (_, rest):
        assert decoder.paused.acquire(timeout=60)
        uvicorn.should_exit = True
        events = list(rest)
        assert events[-1] == "data: [DONE]" and "shutting down" in error_of(events[-2])["message"]


@pytest.mark.parametrize("second", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_second_signal_while_draining_cuts_open_streams_at_once_with_a_clean_end(bundle, second):
    """uvicorn quit at a second Ctrl-C without waiting: a stream still open was cut mid-body, no error event, no
    [DONE] (httpx: "incomplete chunked read"); a second SIGTERM it ignored. Either now ends the grace period at once,
    and a third is uvicorn's quit without waiting. The handler uvicorn installs for both signals is called here as the
    signal would call it."""
    with in_process(bundle, shutdown_timeout=600.0) as (url, decoder, uvicorn), streaming(url) as (_, rest):
        assert decoder.paused.acquire(timeout=60)
        uvicorn.handle_exit(signal.SIGINT, None)
        wait_until(lambda: uvicorn.scheduler.draining, "the drain began")
        uvicorn.handle_exit(second, None)
        events = list(rest)
        assert events[-1] == "data: [DONE]" and "shutting down" in error_of(events[-2])["message"]
        assert not uvicorn.force_exit
        uvicorn.handle_exit(second, None)
        assert uvicorn.force_exit


# `specbuild serve` whose engine calls, while the file named by its first argument exists, hang until their run options
# say terminate, then run: onnxruntime's own terminate check fails them (a stuck device, or a call of minutes).
HANGING_SERVE = """
import os, sys, time
import onnxruntime
from specbuild_runtime.serve.command import main

run, hang = onnxruntime.InferenceSession.run_with_iobinding, sys.argv.pop(1)

def run_with_iobinding(self, binding, options=None):
    if os.path.exists(hang):
        open(hang + ".reached", "w").close()
    while os.path.exists(hang) and not (options is not None and options.terminate):
        time.sleep(0.01)
    return run(self, binding, options)

onnxruntime.InferenceSession.run_with_iobinding = run_with_iobinding
sys.argv[0] = "specbuild-serve"
main()
"""


def test_the_end_of_the_grace_period_stops_an_engine_call_that_hangs_and_the_server_exits(bundle, tmp_path):
    """A stopped request frees its slot after the engine call in progress: one that never returned (a stuck device, or
    a very long prompt on a big model) held the shutdown for ever, through a second and a third signal, until SIGKILL.
    The cut now terminates the calls in flight (onnxruntime's RunOptions.terminate): the stream ends cleanly, counted
    as `shutdown`, and the process exits."""
    log, hang = tmp_path / "server.log", tmp_path / "hang"
    with specbuild_serve(bundle, log, "--shutdown-timeout", 0,
                         command=(sys.executable, "-c", HANGING_SERVE, str(hang))) as (process, url):
        hang.touch()
        with streaming_request(url) as events:
            wait_until(lambda: hang.with_suffix(".reached").exists(), "an engine call hung", process=process, log=log)
            process.send_signal(signal.SIGTERM)
            lines = list(events)
        assert process.wait(60) in (0, -signal.SIGTERM), log.read_text()
    assert lines[-1] == "data: [DONE]" and "shutting down" in error_of(lines[-2])["message"]
    assert "Traceback" not in log.read_text()


@contextmanager
def streaming_request(url: str):
    """A streamed completion's events, for a client that sends it before the server has decoded anything."""
    body = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 20, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as reply:
        yield (line for line in reply.iter_lines() if line)


def test_the_end_of_the_grace_period_closes_a_connection_whose_client_does_not_read(bundle, tmp_path):
    """A client that stops reading (its socket's buffers full) left the stream's send waiting on it: the server held
    its shutdown until uvicorn's backstop, --shutdown-timeout + 5 s, which a second signal did not shorten (here 605 s
    for a 600 s grace period). The cut now closes such a connection. The stream: a prompt's 64 choices, each 200
    tokens with logprobs 20, ~8 MB, more than the buffers on both sides hold (4 MB at most on Linux, by default)."""
    log, n = tmp_path / "server.log", 64
    with specbuild_serve(bundle, log, "--shutdown-timeout", 600, "--parallel", 4, "--max-queue", n) as (process, url):
        body = json.dumps({"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 200, "n": n, "stream": True,
                           "temperature": 0, "logprobs": 20}).encode()
        with socket.socket() as client:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
            host, port = url.removeprefix("http://").split(":")
            client.connect((host, int(port)))
            client.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"
                           b"content-length: %d\r\n\r\n%s" % (len(body), body))
            first_tokens = ("specbuild_time_to_first_token_seconds_count", ())
            wait_until(lambda: metric_values(url).get(first_tokens) == n, "every choice decoded", process=process, log=log)
            process.send_signal(signal.SIGTERM)
            wait_until(lambda: "Waiting for connections to close" in log.read_text(), "the drain began", process=process)
            process.send_signal(signal.SIGTERM)  # the grace period ends now
            assert process.wait(60) in (0, -signal.SIGTERM), log.read_text()
    assert "Traceback" not in log.read_text() and "timeout graceful shutdown exceeded" not in log.read_text()


def test_a_stream_the_end_of_the_grace_period_closes_counts_as_shutdown(bundle, monkeypatch):
    """A client that does not read holds a stream whose jobs had all finished; the cut closes its connection
    (Uvicorn._close_unread). The server ended it, as it ends the requests it stops then: it counted as `ok` (uvicorn's
    send dropped the events after the close without a word) or `cancelled`, by the race. The server's send buffer is
    made small, so that a stream of 16 choices of 100 tokens, ~250 KB, fills it and uvicorn's."""
    from specbuild_runtime.serve import app

    monkeypatch.setattr(app, "UNREAD_LOOK", 0.05)
    n = 16
    body = json.dumps({"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 100, "ignore_eos": True, "n": n,
                       "stream": True, "temperature": 0}).encode()
    with in_process(bundle, shutdown_timeout=0.0, max_queue=n) as (url, decoder, uvicorn), socket.socket() as client:
        decoder.go.set()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        host, port = url.removeprefix("http://").split(":")
        client.connect((host, int(port)))
        wait_until(lambda: uvicorn.server_state.connections, "the server took the connection")
        for connection in uvicorn.server_state.connections:
            connection.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"
                       b"content-length: %d\r\n\r\n%s" % (len(body), body))
        first_tokens = ("specbuild_time_to_first_token_seconds_count", ())
        wait_until(lambda: metric_values(url).get(first_tokens) == n, "every choice decoded")
        uvicorn.should_exit = True
        wait_until(lambda: not uvicorn.server_state.connections, "the connection was closed", deadline=30)
    counted = {s.labels["outcome"]: s.value
               for family in text_string_to_metric_families(uvicorn.scheduler.metrics.render().decode())
               for s in family.samples if s.name == "specbuild_requests_total" and s.labels["endpoint"] == "completions"}
    assert counted == {"shutdown": 1}


def test_the_end_of_the_grace_period_keeps_a_connection_whose_client_reads_more_slowly_than_it_is_written(bundle,
                                                                                                      monkeypatch):
    """A client that reads more slowly than its response is written has unsent bytes at any instant, as one that does
    not read has: closed at the cut, it lost the rest of a response it was reading (a raw client, SO_RCVBUF 4 KB,
    reading ~400 KB/s of a 64-choice stream with logprobs 20, 8 MB, two SIGTERMs after its first MB at
    --shutdown-timeout 600: 3.2 MB, and no error event or [DONE]). Only a connection whose unsent bytes stand still
    from one look to the next is closed."""
    import itertools

    import uvicorn as uvicorn_module

    from specbuild_runtime import SpeculativeDecoder
    from specbuild_runtime.serve import app
    from specbuild_runtime.serve.app import Server, Settings

    monkeypatch.setattr(app, "UNREAD_LOOK", 0.05)
    uvicorn = Server(SpeculativeDecoder(bundle), Settings(model=MODEL, shutdown_timeout=0)).http_server("127.0.0.1", 0)

    class Connection:  # uvicorn's protocol and its transport, as the shutdown sees them
        def __init__(self, unsent):
            self.transport, self.unsent = self, unsent

        def get_write_buffer_size(self) -> int:
            return next(self.unsent)

        def get_extra_info(self, name: str):
            return None

        def abort(self) -> None:
            uvicorn.server_state.connections.discard(self)

    reading, stuck = Connection(itertools.count(4 << 20, -4096)), Connection(itertools.repeat(1 << 20))

    async def wait_for_connections(self, sockets=None) -> None:  # uvicorn's shutdown, 2 s of it
        await asyncio.sleep(2)

    monkeypatch.setattr(uvicorn_module.Server, "shutdown", wait_for_connections)
    uvicorn.server_state.connections.update({reading, stuck})
    asyncio.run(uvicorn.shutdown())
    assert uvicorn.server_state.connections == {reading}


def test_uvicorns_shutdown_lines_say_what_a_second_and_a_third_signal_do(bundle):
    """uvicorn's "Waiting for connections to close. (CTRL+C to force quit)": here a second Ctrl-C ends the grace period,
    and only a third quits without waiting."""
    import logging

    from specbuild_runtime import SpeculativeDecoder
    from specbuild_runtime.serve.app import Server, Settings

    uvicorn = Server(SpeculativeDecoder(bundle), Settings(model=MODEL, shutdown_timeout=30)).http_server("127.0.0.1", 0)

    def said(message: str) -> str:
        record = logging.LogRecord("uvicorn.error", logging.INFO, __file__, 0, message, None, None)
        assert uvicorn._say_what_signals_do(record)
        return record.getMessage()

    assert said("Waiting for connections to close. (CTRL+C to force quit)") == (
        "Waiting for connections to close (requests get --shutdown-timeout, 30 s, to finish; a second Ctrl-C or SIGTERM "
        "stops them now, a third quits without waiting)")
    uvicorn.scheduler.cut = True
    assert said("Waiting for background tasks to complete. (CTRL+C to force quit)") == (
        "Waiting for background tasks to complete (requests are stopped; a third Ctrl-C or SIGTERM quits without waiting)")
    assert said("Shutting down") == "Shutting down"


@pytest.mark.parametrize("path, body", [
    ("/tokenize", {"prompt": " ".join(PROMPTS[:7]), "return_token_strs": True}),
    ("/v1/completions", {"prompt": " ".join(PROMPTS[:7]), "max_tokens": 1, "echo": True, "logprobs": 5, **GREEDY}),
    ("/v1/completions", {"prompt": " ".join(PROMPTS[:7]), "max_tokens": 1, "echo": True, "logprobs": 5, "stream": True,
                         **GREEDY}),
], ids=["tokenize", "whole", "streamed"])
def test_the_end_of_the_grace_period_stops_a_response_still_being_built(bundle, monkeypatch, path, body):
    """A response built (its logprobs' texts, its JSON) past --shutdown-timeout + 5 s met uvicorn's backstop, which
    cancelled it: a text/plain 500 (a stream: cut mid-body), counted under no outcome. The drain's cut now stops it
    at its next token text or piece of JSON, as its client leaving does. Here the build's first token text waits
    until the test has the answer."""
    method = "id_to_token" if path == "/tokenize" else "decode"
    with in_process(bundle, shutdown_timeout=0.0) as (url, decoder, uvicorn), ThreadPoolExecutor(1) as client:
        decoder.go.set()
        decoder.tokenizer = pausing = PausingInTheBuilder(decoder.tokenizer, method)
        replying = client.submit(httpx.post, f"{url}{path}", json=body, timeout=60)
        assert pausing.reached.acquire(timeout=60)
        uvicorn.should_exit = True
        try:
            reply = replying.result()
        finally:
            pausing.resume.set()
    if body.get("stream"):
        events = [line for line in reply.text.splitlines() if line]
        assert events[-1] == "data: [DONE]" and "shutting down" in error_of(events[-2])["message"]
    else:
        assert reply.status_code == 503 and "shutting down" in reply.json()["error"]["message"]
    assert outcomes(uvicorn.scheduler) == {"shutdown": 1.0}


def test_the_end_of_the_grace_period_answers_a_tokenize_still_waiting_for_the_checking_thread(bundle):
    """/tokenize and /detokenize take their turn on the checking thread behind requests' checks (seconds each for the
    longest prompts). The drain's cut stopped queued requests, not them: one still waiting at uvicorn's backstop
    (--shutdown-timeout + 5 s) was cancelled there, a text/plain 500 counted under no outcome. Here a completion's
    check holds the thread until the test has the answer."""
    with in_process(bundle, shutdown_timeout=0.0) as (url, decoder, uvicorn), ThreadPoolExecutor(2) as client:
        decoder.checks.clear()
        completing = client.submit(httpx.post, f"{url}/v1/completions", json={"prompt": PROMPTS[0]}, timeout=60)
        assert decoder.checking.acquire(timeout=60)
        tokenizing = client.submit(httpx.post, f"{url}/tokenize", json={"prompt": PROMPTS[1]}, timeout=60)
        wait_until(lambda: len(uvicorn.server_state.tasks) == 2, "the /tokenize request arrived")
        uvicorn.should_exit = True
        try:
            replies = completing.result(), tokenizing.result()
        finally:
            decoder.checks.set()
    assert [reply.status_code for reply in replies] == [503, 503]
    assert all("shutting down" in reply.json()["error"]["message"] for reply in replies)
    counted = {(s.labels["endpoint"], s.labels["outcome"]): s.value
               for family in text_string_to_metric_families(uvicorn.scheduler.metrics.render().decode())
               for s in family.samples if s.name == "specbuild_requests_total"}
    assert counted == {("completions", "shutdown"): 1, ("tokenize", "shutdown"): 1}


def test_chat_without_a_template_is_a_clear_400(bundles):
    with in_process(bundles("llama", 1)) as (url, decoder, _):
        decoder.go.set()
        reply = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert reply.status_code == 400 and "no chat template" in reply.json()["error"]["message"]


def transformers_chat_ids(bundle: Path, messages: list[dict], template: str | None = None) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(bundle / "tokenizer").apply_chat_template(
        messages, chat_template=template, add_generation_prompt=True, tokenize=True, return_dict=False)


@pytest.mark.parametrize("given", ["file", "inline"])
def test_chat_template_option_gives_a_bundle_without_one_chat_as_transformers_renders_it(given, bundles, tmp_path, cli):
    """A bundle whose tokenizer has no template (a base model's) answered every chat request 400. --chat-template,
    as vLLM's, is a file or else the template itself, rendered with the bundle's special tokens; the start-up line
    names it, and generate --chat takes it the same way."""
    from specbuild_runtime import SpeculativeDecoder

    plain = bundles("llama", 1)
    (tmp_path / "other.jinja").write_text(OTHER_TEMPLATE)
    value = str(tmp_path / "other.jinja") if given == "file" else OTHER_TEMPLATE
    messages = [{"role": "user", "content": "Write fib"}]
    ids = transformers_chat_ids(plain, messages, OTHER_TEMPLATE)
    expected = SpeculativeDecoder(plain).generate(ids, max_new_tokens=8)
    with specbuild_serve(plain, tmp_path / "server.log", "--chat-template", value) as (_, url):
        reply = httpx.post(f"{url}/v1/chat/completions", json={"messages": messages, "max_tokens": 8, **GREEDY}).json()
    assert reply["choices"][0]["message"]["content"] == expected.text and reply["usage"]["prompt_tokens"] == len(ids)
    origin = f"--chat-template {value}" if given == "file" else "--chat-template (inline)"
    assert f"chat template from {origin}" in (tmp_path / "server.log").read_text()
    [generated] = cli.run([["generate", str(plain), "-p", "Write fib", "--chat", "--chat-template", value, "-n", "8",
                            "--json"]])
    assert generated["status"] == 0, generated["stderr"]
    assert json.loads(generated["stdout"])["prompt_token_ids"] == ids
    assert json.loads(generated["stdout"])["token_ids"] == expected.token_ids


def test_chat_template_option_replaces_the_bundles_own(bundle, reference):
    """A template that ships wrong is mended at start-up, not by recompiling: chats render the operator's."""
    from specbuild_runtime.serve.chat import supplied_chat_template

    messages = [{"role": "user", "content": "Write fib"}]
    ids = transformers_chat_ids(bundle, messages, OTHER_TEMPLATE)
    assert ids != transformers_chat_ids(bundle, messages)  # the bundle's own renders another prompt
    with in_process(bundle, chat_template=supplied_chat_template(OTHER_TEMPLATE)) as (url, decoder, _):
        decoder.go.set()
        reply = httpx.post(f"{url}/v1/chat/completions", json={"messages": messages, "max_tokens": 8, **GREEDY}).json()
    assert reply["choices"][0]["message"]["content"] == reference.generate(ids, max_new_tokens=8).text
    assert reply["usage"]["prompt_tokens"] == len(ids)


# Qwen3's markup, cut down: its enable_thinking variable (sent in chat_template_kwargs) closes an empty think block.
THINKING_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
ASK = [{"role": "user", "content": "Write fib"}]
PREFILLED = [*ASK, {"role": "assistant", "content": "def fib(n): "}]  # its trailing space: CHAT_TEMPLATE trims it
CHAT_FIELDS = [
    (ASK, {}),
    (ASK, {"chat_template_kwargs": {"enable_thinking": False}}),
    (ASK, {"chat_template_kwargs": {"enable_thinking": True, "add_generation_prompt": True}}),  # agrees: as if absent
    (ASK, {"add_generation_prompt": False, "chat_template_kwargs": {"bos_token": ""}}),  # over the special token
    (PREFILLED, {"add_generation_prompt": False, "continue_final_message": True}),
    (PREFILLED, {"add_generation_prompt": False, "continue_final_message": True,
                 "chat_template_kwargs": {"enable_thinking": False}}),
]


@pytest.mark.parametrize("template", [THINKING_TEMPLATE, CHAT_TEMPLATE], ids=["qwen3-like", "trimming"])
def test_vllms_chat_template_fields_render_as_transformers_renders_with_them(template, bundle, reference):
    """chat_template_kwargs (Qwen3 users' {"enable_thinking": false}), add_generation_prompt and
    continue_final_message, which vLLM takes, were refused as unrecognized. The prompt is apply_chat_template's
    with the same arguments, token for token: a continued final message is cut where transformers cuts it."""
    from transformers import AutoTokenizer

    from specbuild_runtime.serve import protocol
    from specbuild_runtime.serve.chat import load_chat_template, supplied_chat_template

    hf = AutoTokenizer.from_pretrained(bundle / "tokenizer")
    supplied = supplied_chat_template(template)
    ours = load_chat_template(bundle / "tokenizer", supplied)
    with in_process(bundle, chat_template=supplied) as (url, decoder, _):
        decoder.go.set()
        for messages, fields in CHAT_FIELDS:
            arguments = {"add_generation_prompt": True, **fields.get("chat_template_kwargs", {}),
                         **{name: value for name, value in fields.items() if name != "chat_template_kwargs"}}
            ids = hf.apply_chat_template(messages, chat_template=template, tokenize=True, return_dict=False, **arguments)
            body = {"messages": messages, "max_tokens": 8, **GREEDY, **fields}
            request = protocol.parse(protocol.CHAT, json.dumps(body).encode(), MODEL, protocol.sampling_defaults(None, "greedy"))
            assert ours.prompt_ids(reference.tokenizer, request.messages, **request.chat) == ids, fields
            reply = httpx.post(f"{url}/v1/chat/completions", json=body).json()
            assert reply["usage"]["prompt_tokens"] == len(ids), (fields, reply)
            assert reply["choices"][0]["message"]["content"] == reference.generate(ids, max_new_tokens=8).text


@pytest.mark.parametrize("source, message", [
    ("{% for m in messages %}<{{ m['role'] }}>{% endfor %}", "never shows a message's 'content'"),
    ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'][:3] }}{% endfor %}", "does not appear in the prompt"),
], ids=["unread", "cut"])
def test_continuing_a_final_message_the_template_does_not_show_whole_is_a_400(source, message, bundle):
    """transformers refuses it (there is no place to cut): a 400 that names continue_final_message."""
    from specbuild_runtime.serve.chat import supplied_chat_template

    with in_process(bundle, chat_template=supplied_chat_template(source)) as (url, _, _):
        reply = httpx.post(f"{url}/v1/chat/completions", json={"messages": PREFILLED, "add_generation_prompt": False,
                                                               "continue_final_message": True})
    assert reply.status_code == 400 and message in reply.json()["error"]["message"], reply.text
    assert reply.json()["error"]["param"] == "continue_final_message"


def test_a_bundle_template_that_does_not_compile_gives_way_to_chat_template_option(bundle, tmp_path):
    """The bundle's template is not compiled when one is supplied: a broken one is what an operator replaces."""
    from specbuild_runtime import BundleError
    from specbuild_runtime.serve.chat import load_chat_template, supplied_chat_template

    tokenizer = shutil.copytree(bundle / "tokenizer", tmp_path / "tokenizer")
    (tokenizer / "chat_template.jinja").write_text("{% for message in messages %}")
    with pytest.raises(BundleError, match=r"chat_template.jinja\) does not compile .*--chat-template"):
        load_chat_template(tokenizer)
    assert load_chat_template(tokenizer, supplied_chat_template(OTHER_TEMPLATE)).source == OTHER_TEMPLATE


def test_chat_template_option_is_a_file_where_one_opens_else_text_unless_it_looks_like_a_path(tmp_path, monkeypatch):
    """vLLM's rules: a file is tried first (even one whose name holds braces); a value that opens none is the
    template itself if it holds '{', '}' or a newline, and otherwise a path that was mistyped."""
    from specbuild_runtime.serve.chat import supplied_chat_template

    monkeypatch.chdir(tmp_path)
    Path("{x}.jinja").write_text("{{ bos_token }}")
    assert supplied_chat_template("{x}.jinja").source == "{{ bos_token }}"
    assert supplied_chat_template("{{ eos_token }}").origin == "--chat-template (inline)"
    with pytest.raises(ValueError, match="'chatml.jinja' looks like a file path .*No such file"):
        supplied_chat_template("chatml.jinja")


def test_inspect_says_where_the_chat_template_is_or_that_there_is_none(bundle, bundles, cli):
    with_one, without = cli.run([["inspect", str(bundle)], ["inspect", str(bundles("llama", 1))]])
    assert "chat       template in tokenizer/chat_template.jinja" in with_one["stdout"]  # where transformers saves it
    assert "chat       no template (serve and generate --chat need --chat-template)" in without["stdout"]


@pytest.mark.parametrize("form", ["tokenizer_config.json", "chat_template.jinja"])
def test_compile_keeps_the_chat_template_in_either_form(form, tmp_path, tokenizer, checkpoints, bundle):
    from specbuild_runtime.serve.chat import load_chat_template

    if form == "tokenizer_config.json":  # the module's bundle was compiled from this form
        compiled = bundle
    else:
        target = with_template(make_checkpoint(tmp_path / "target", "llama", tokenizer, seed=0), form)
        compiled = compile_pair(target, checkpoints("llama", 1), tmp_path / "bundle")
    assert load_chat_template(compiled / "tokenizer").source == CHAT_TEMPLATE


# --- Sampling defaults (serve --generation-config) -----------------------------------------------------------------

# As instruct checkpoints ship it: sampling recommended, with a repetition penalty. Values that bite on
# the test pair (a temperature of 1 or top_k of all would decode other text: test_the_bundles_... checks it).
GENERATION_CONFIG = {"do_sample": True, "temperature": 1.5, "top_k": 3, "repetition_penalty": 1.3}


@pytest.fixture(scope="module")
def sampling_bundle(tmp_path_factory, checkpoints):
    root = tmp_path_factory.mktemp("sampling")
    target = Path(shutil.copytree(checkpoints("llama", 0), root / "target"))
    config = json.loads((target / "generation_config.json").read_text())
    (target / "generation_config.json").write_text(json.dumps({**config, **GENERATION_CONFIG}))
    return compile_pair(target, checkpoints("llama", 1), root / "bundle")


def seeded(url: str, **fields) -> str:
    body = {"prompt": PROMPTS[0], "max_tokens": 16, "seed": 3, **fields}
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


def test_compile_records_the_sampling_fields_the_targets_generation_config_sets(sampling_bundle, bundle):
    from specbuild_runtime.manifest import load_manifest

    assert load_manifest(sampling_bundle).generation_config == GENERATION_CONFIG
    assert load_manifest(bundle).generation_config == {}  # eos and bos ids only: no sampling field


def test_inspect_says_what_serve_gives_requests_that_omit_sampling_fields(sampling_bundle, bundle, cli):
    """The manifest's generation_config decides serve's defaults; inspect showed nothing of it (serve's start-up line
    alone did), nor that a bundle compiled before manifests recorded it gets OpenAI's."""
    old = sampling_bundle.parent / "old"
    shutil.copytree(sampling_bundle, old)
    manifest = json.loads((old / "manifest.json").read_text())
    del manifest["generation_config"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    sampled, plain, before = cli.run([["inspect", str(sampling_bundle)], ["inspect", str(bundle)], ["inspect", str(old)]])
    assert all(r["status"] == 0 for r in (sampled, plain, before)), (sampled["stderr"], before["stderr"])
    assert ("serve      by default (--generation-config auto), requests without temperature/top_p/top_k/min_p/"
            "repetition_penalty get temperature 1.5, top_k 3, repetition_penalty 1.3 (from the bundle's generation_config)"
            "\n") in sampled["stdout"]
    assert "get temperature 1 (OpenAI's defaults; the bundle's generation_config sets none" in plain["stdout"]
    assert "compiled before manifests recorded the generation_config: recompile it" in before["stdout"]


def test_inspect_names_the_generation_configs_min_p_not_applied_by_a_bundle_compiled_before_min_p(sampling_bundle, cli,
                                                                                                 tmp_path):
    """What serve's start-up line says (app.Server reads the engines' min_p input): inspect said such a bundle's
    requests get the generation_config's min_p, which its engines cannot apply."""
    old = compiled_before_min_p(Path(shutil.copytree(sampling_bundle, tmp_path / "old")))
    manifest = json.loads((old / "manifest.json").read_text())
    manifest["generation_config"]["min_p"] = 0.05
    (old / "manifest.json").write_text(json.dumps(manifest))
    inspected = cli.run([["inspect", str(old)]])[0]
    assert inspected["status"] == 0, inspected["stderr"]
    assert ("get temperature 1.5, top_k 3, repetition_penalty 1.3 (from the bundle's generation_config); generation_config "
            "fields not applied: min_p 0.05 (this bundle was compiled before min_p: recompile it to apply it)"
            ) in inspected["stdout"], inspected["stdout"]


def test_a_bundle_compiled_before_penalties_names_its_generation_configs_repetition_penalty_not_applied(
        sampling_bundle, cli, tmp_path):
    """inspect, as serve's start-up line (app.Server reads the engines' inputs), and serve's defaults."""
    from specbuild_runtime.serve.protocol import sampling_defaults

    old = compiled_before_penalties(Path(shutil.copytree(sampling_bundle, tmp_path / "old")))
    inspected = cli.run([["inspect", str(old)]])[0]
    assert inspected["status"] == 0, inspected["stderr"]
    assert ("get temperature 1.5, top_k 3 (from the bundle's generation_config); generation_config fields not applied: "
            "repetition_penalty 1.3 (this bundle was compiled before sampling penalties: recompile it to apply it)"
            ) in inspected["stdout"], inspected["stdout"]
    defaults = sampling_defaults({"temperature": 0.7, "repetition_penalty": 1.1}, "auto", penalties=False)
    assert defaults.values == {"temperature": 0.7} and len(defaults.ignored) == 1


def test_requests_that_omit_sampling_fields_get_the_bundles_generation_config_and_theirs_win(sampling_bundle):
    """As vLLM's server (--generation-config auto, its default): field by field, the request's value, else the
    generation_config's, else OpenAI's."""
    from specbuild_runtime import SpeculativeDecoder

    reference = SpeculativeDecoder(sampling_bundle)

    def expected(repetition_penalty=1.3, **settings) -> str:
        return reference.generate(PROMPTS[0], max_new_tokens=16, seed=3, repetition_penalty=repetition_penalty,
                                  **settings).text

    from_config = expected(temperature=1.5, top_k=3)
    # 0.5, not 1.0: drawn by the same random numbers from the same top 3, T 1.0 picked T 1.5's 16 tokens where auto
    # did not draft (its draft is as large as its target)
    assert len({from_config, expected(), expected(temperature=1.5), expected(temperature=0.5, top_k=3)}) == 4
    assert expected() != expected(1.0)  # the repetition penalty bites (greedy: sampled, top_k 3 rarely repeats a token)
    with in_process(sampling_bundle) as (url, decoder, _):
        decoder.go.set()
        assert seeded(url) == seeded(url, temperature=None, top_k=None, repetition_penalty=None) == from_config
        assert seeded(url, temperature=0) == expected()
        assert seeded(url, top_k=0) == expected(temperature=1.5)
        assert seeded(url, temperature=0.5) == expected(temperature=0.5, top_k=3)
        assert seeded(url, top_p=0.5) == expected(temperature=1.5, top_k=3, top_p=0.5)  # top_p alone: sampled
        assert seeded(url, temperature=0, repetition_penalty=1) == expected(1.0)


@pytest.mark.parametrize("mode", ["vllm", "greedy"])
def test_generation_config_vllm_or_greedy_sets_the_bundles_defaults_aside(sampling_bundle, mode):
    """vllm: OpenAI's defaults, as vLLM's --generation-config vllm; greedy: this server's earlier default, under
    which a top_p or top_k without a temperature would be ignored, so it is refused."""
    from specbuild_runtime import SpeculativeDecoder

    reference = SpeculativeDecoder(sampling_bundle)
    with in_process(sampling_bundle, generation_config=mode) as (url, decoder, _):
        decoder.go.set()
        temperature = {"vllm": 1.0, "greedy": 0.0}[mode]
        assert seeded(url) == reference.generate(PROMPTS[0], max_new_tokens=16, seed=3, temperature=temperature).text
        shaped = [httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2, name: value})
                  for name, value in (("top_p", 0.9), ("top_k", 5), ("min_p", 0.1))]
        assert [reply.status_code for reply in shaped] == [{"vllm": 200, "greedy": 400}[mode]] * 3
        if mode == "greedy":
            assert "top_p shapes sampling, and without a temperature" in shaped[0].json()["error"]["message"]
            assert "(as --generation-config greedy asks" in shaped[0].json()["error"]["message"]
            assert "send a temperature too" in shaped[1].json()["error"]["message"]
            assert "min_p shapes sampling, and without a temperature" in shaped[2].json()["error"]["message"]


def test_the_start_up_line_names_the_defaults_and_what_of_the_generation_config_is_not_applied(sampling_bundle, tmp_path):
    log = tmp_path / "server.log"
    with specbuild_serve(sampling_bundle, log) as (_, url):
        assert healthy(url)
    line = next(line for line in log.read_text().splitlines() if line.startswith("serving "))
    assert "; no chat template (/v1/chat/completions answers 400; --chat-template gives one); " in line, line
    assert line.endswith("requests without temperature/top_p/top_k/min_p/repetition_penalty get temperature 1.5, top_k 3, "
                         "repetition_penalty 1.3 (from the bundle's generation_config)"), line


def test_a_bundle_compiled_before_manifests_recorded_the_generation_config_serves_with_openais_defaults(bundle, tmp_path):
    from specbuild_runtime import SpeculativeDecoder
    from specbuild_runtime.serve.app import Server, Settings

    old = Path(shutil.copytree(bundle, tmp_path / "bundle"))
    manifest = json.loads((old / "manifest.json").read_text())
    del manifest["generation_config"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    server = Server(SpeculativeDecoder(old), Settings(model=MODEL))
    assert server.defaults.values == {"temperature": 1} and "recompile it" in str(server.defaults)
    asyncio.run(server.scheduler.close())


def test_the_generation_configs_min_p_applies_to_requests_that_omit_it_as_in_vllm(sampling_bundle, tmp_path):
    from specbuild_runtime import SpeculativeDecoder
    from specbuild_runtime.serve.protocol import sampling_defaults

    bundle = Path(shutil.copytree(sampling_bundle, tmp_path / "bundle"))
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["generation_config"]["min_p"] = 0.9
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    reference = SpeculativeDecoder(bundle)

    def expected(**settings) -> str:
        return reference.generate(PROMPTS[0], max_new_tokens=16, seed=3, temperature=1.5, top_k=3, repetition_penalty=1.3,
                                  **settings).text

    assert expected(min_p=0.9) != expected()  # it bites
    said = str(sampling_defaults(reference.manifest.generation_config, "auto", reference.has_min_p))
    assert "get temperature 1.5, top_k 3, min_p 0.9, repetition_penalty 1.3 (from the bundle's generation_config)" in said
    with in_process(bundle) as (url, decoder, _):
        decoder.go.set()
        assert seeded(url) == seeded(url, min_p=None) == expected(min_p=0.9)
        assert seeded(url, min_p=0) == expected()


def test_a_bundle_compiled_before_min_p_names_its_generation_configs_min_p_not_applied():
    from specbuild_runtime.serve.protocol import sampling_defaults

    defaults = sampling_defaults({"temperature": 0.7, "min_p": 0.05}, "auto", min_p=False)
    assert defaults.values == {"temperature": 0.7}
    assert defaults.ignored == ("min_p 0.05 (this bundle was compiled before min_p: recompile it to apply it)",)
    assert sampling_defaults({"temperature": 0.7, "min_p": 0.05}, "auto").values == {"temperature": 0.7, "min_p": 0.05}


def test_generation_config_values_this_server_cannot_apply_are_named_not_applied():
    """A value the runtime refuses (as it would a request's), fields vLLM applies and this server lacks, and
    do_sample false, which vLLM does not read either; values that change nothing go unnamed."""
    from specbuild_runtime.serve.protocol import sampling_defaults

    defaults = sampling_defaults({"temperature": -1, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0,
                                  "max_new_tokens": 512, "do_sample": False}, "auto")
    assert defaults.values == {"temperature": 1, "top_k": -1} and not defaults.greedy  # -1: vLLM's no limit
    assert defaults.ignored == ("temperature -1 (temperature must be 0 (greedy) or more, not -1.0)", "max_new_tokens 512",
                                "do_sample false")


# --- README ------------------------------------------------------------------------------------------------------


def readme_serving_snippets() -> tuple[list[str], str]:
    """The Serving section's curl commands and its openai example."""
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    section = readme.split("\n## Serving", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(\w+)\n(.*?)```", section, re.S)
    curls = [cmd for lang, block in blocks if lang == "bash" for cmd in re.split(r"\n(?=curl )", block)
             if cmd.startswith("curl ")]
    python = next(block for lang, block in blocks if lang == "python" and "openai" in block)
    return curls, python


def test_readme_serving_examples_run_against_a_server(server):
    curls, python = readme_serving_snippets()
    assert curls and python
    for command in curls:
        result = subprocess.run(["bash", "-c", command.replace("http://localhost:8000", server)],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        assert '"error"' not in result.stdout and ("choices" in result.stdout or "specbuild_" in result.stdout)
    result = subprocess.run([sys.executable, "-c", python.replace("http://localhost:8000", server)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip(), result.stderr


def test_the_serving_docs_examples_run_against_a_server(server):
    """docs/serving.md's tool call and structured output examples (marked `<!-- served example -->`): their requests
    are answered, not refused, in the format they force (this tiny random model's replies may be cut short by
    max_tokens: their first character then tells, "required"'s list of calls or the schema's object)."""
    page = (Path(__file__).parents[1] / "docs" / "serving.md").read_text()
    blocks = re.findall(r"<!-- served example -->\n```(\w+)\n(.*?)```", page, re.S)
    assert [language for language, _ in blocks] == ["bash", "python"]
    for language, block in blocks:
        command = ["bash", "-c"] if language == "bash" else [sys.executable, "-c"]
        result = subprocess.run([*command, block.replace("http://localhost:8000", server)], capture_output=True,
                                text=True, timeout=60)
        assert result.returncode == 0 and result.stdout.strip() and '"error"' not in result.stdout, result
        if language == "python":
            assert result.stdout.lstrip().startswith("{"), result.stdout
            continue
        choice = json.loads(result.stdout)["choices"][0]
        # the call, or (the random model writing JSON's whitespace on and on) cut short
        assert choice["finish_reason"] in ("tool_calls", "length"), result.stdout
        assert choice["message"].get("tool_calls") or choice["message"]["content"].lstrip().startswith("["), choice


def test_start_up_warms_every_worker_thread_up_in_a_slot_of_its_own(bundle):
    """CUDA graphs are kept per thread and per slot: serve's warm-up runs once on each worker thread,
    each in its own slot, which the thread then keeps (pool.SlotPool)."""
    from test_slot import forced_captures

    one = forced_captures(bundle).warm_up()
    decoder = forced_captures(bundle, parallel=2)
    assert decoder.warm_up_workers() == decoder.graphs_captured == 2 * one
    threads = {thread.ident: thread.name for thread in threading.enumerate()}
    assert len(set(decoder.slots._last.values())) == 2
    assert all(threads[ident].startswith("specbuild-slot") for ident in decoder.slots._last.values())


def test_a_deadline_that_passes_after_the_last_token_but_before_the_job_is_finished_stops_nothing(bundle):
    """The worker has posted every delta; the loop has yet to run _finished when the timer fires."""
    from specbuild_runtime import SpeculativeDecoder
    from specbuild_runtime.serve.metrics import Metrics
    from specbuild_runtime.serve.scheduler import Scheduler

    decoder = SpeculativeDecoder(bundle)
    request = decoder.request(PROMPTS[0], 12, 2)

    async def run() -> str:
        scheduler = Scheduler(decoder, 0, None, Metrics(1))
        finish, pending = scheduler._finished, []
        scheduler._finished = lambda job: pending.append(job)
        job = await scheduler.submit(lambda: request)
        while not pending:
            await asyncio.sleep(0.01)
        scheduler.stop(job, "timeout")
        finish(pending[0])
        text = "".join([delta async for delta in job])
        await scheduler.close()
        return text

    assert asyncio.run(run()) == decoder.generate(PROMPTS[0], 12, 2).text


def test_the_digest_check_at_start_can_be_skipped_for_a_bundle_checked_where_it_was_deployed(bundle, tmp_path):
    copy = tmp_path / "bundle"
    shutil.copytree(bundle, copy)
    config = copy / "tokenizer" / "tokenizer_config.json"
    config.write_text(config.read_text() + "\n")  # a byte changed: its digest no longer matches
    result = subprocess.run([sys.executable, "-m", "specbuild", "serve", str(copy), "--port", str(free_port())],
                            capture_output=True, text=True)
    assert result.returncode == 1 and "tokenizer_config.json" in result.stderr, result.stderr
    with specbuild_serve(copy, tmp_path / "server.log", "--no-check-digests") as (_, url):
        assert healthy(url)


def test_serve_threads_beyond_what_a_machine_starts_is_a_usage_error(tmp_path):
    """onnxruntime crashes (SIGSEGV, no message) when it cannot start the pool's threads: --threads 100000
    is refused while the command line is read (parsed only here: nothing loads or serves)."""
    import click

    from specbuild_runtime.serve.cli import serve_command

    with pytest.raises(click.BadParameter, match="1<=x<=1024"):
        serve_command.make_context("serve", [str(tmp_path), "--threads", "100000"])
    serve_command.make_context("serve", [str(tmp_path), "--threads", "64"])


@pytest.mark.parametrize("name", ["", "  "])
def test_an_empty_model_name_is_a_usage_error_not_the_folders_name(name, tmp_path):
    """An empty --model-name (a template's unset variable) served under the folder's name, which the
    clients configured with the variable were never told (parsed only here: nothing loads or serves)."""
    import click

    from specbuild_runtime.serve.cli import serve_command

    with pytest.raises(click.BadParameter, match="must not be empty"):
        serve_command.make_context("serve", [str(tmp_path), "--model-name", name])
    serve_command.make_context("serve", [str(tmp_path), "--model-name", "demo"])


def test_a_streamed_event_holding_a_unicode_line_separator_reads_as_one_line():
    """httpx's iter_lines (and httpx-sse over it) break lines where str.splitlines does, U+2028 among them,
    which JSON leaves raw: such an event was cut in two."""
    from specbuild_runtime.serve.protocol import sse

    text = "a\u2028b\u2029c\x85d é"
    lines = list(httpx.Response(200, content=sse({"text": text})).iter_lines())
    assert lines == [lines[0], ""] and json.loads(lines[0][len("data: "):]) == {"text": text}


def test_a_chat_template_failing_on_the_messages_sent_is_a_request_error():
    """A template's expression over what the request sent (here arithmetic on a message field) raised a
    TypeError, answered 500 as a server bug."""
    from specbuild_runtime import RequestError
    from specbuild_runtime.serve.chat import ChatTemplate

    template = ChatTemplate("{% for m in messages %}{{ m['content'] + 1 }}{% endfor %}", {})
    with pytest.raises(RequestError, match=r"the chat template failed on these messages \(TypeError"):
        template.render([{"role": "user", "content": "x"}])


def test_a_chat_template_recursing_past_the_limit_is_a_request_error():
    """A macro that recurses (here over a nested field, without end) raised a RecursionError, answered 500 as a
    server bug and, in generate --chat --chat-template, an internal error (exit 3)."""
    from specbuild_runtime import RequestError
    from specbuild_runtime.serve.chat import ChatTemplate

    template = ChatTemplate("{% macro show(x) %}{{ show(x) }}{% endmacro %}{{ show(messages[0]['content']) }}", {})
    with pytest.raises(RequestError, match=r"the chat template failed on these messages \(RecursionError"):
        template.render([{"role": "user", "content": "x"}])


def test_a_template_gathering_messages_by_adding_strings_is_stopped_before_its_cost_squares():
    """DeepSeek-R1's template adds each system message to the system prompt it shows first, a render costing the
    square of their number while it holds the GIL: 60,000 system messages of 100 characters (an 8 MB body) held the
    whole server for 8 s. Past MAX_ADDED characters built by `+` the render is refused; a few render as before."""
    import math

    from specbuild_runtime import RequestError
    from specbuild_runtime.serve.chat import MAX_ADDED, ChatTemplate

    template = ChatTemplate((CHAT_TEMPLATES / "deepseek-r1.jinja").read_text(), {"bos_token": "<s>"})
    few = [{"role": "system", "content": "Be brief."}, {"role": "system", "content": "Be kind."},
           {"role": "user", "content": "Hi"}]
    assert template.render(few).startswith("<s>Be brief.\n\nBe kind.<\uff5cUser\uff5c>Hi")
    many = [{"role": "system", "content": "x" * 1000}] * (math.isqrt(2 * MAX_ADDED // 1000) + 1) + few[2:]  # n²/2 × 1000
    with pytest.raises(RequestError, match=f"^the chat template built over {MAX_ADDED} characters by adding text"):
        template.render(many)


def test_a_template_gathering_messages_by_adding_strings_renders_a_prompt_that_fits_the_context():
    """1,700 system messages of 100 characters fit a 128K context (173K characters: the README's prose in such pieces
    is 75K tokens with a 4,096-token byte-level BPE), but DeepSeek-R1's template builds 2^28 characters rendering them
    (in 0.02 s): MAX_ADDED must not refuse them, as 2^27 did."""
    from specbuild_runtime.serve.chat import ChatTemplate

    template = ChatTemplate((CHAT_TEMPLATES / "deepseek-r1.jinja").read_text(), {"bos_token": "<s>"})
    documents = [{"role": "system", "content": f"Document {i} of 1700: " + "x" * 78} for i in range(1700)]
    assert len(template.render([*documents, {"role": "user", "content": "Which says what?"}])) > 170_000


PARTS = "{% for m in messages %}<{{ m['role'] }}>{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endfor %}"


@pytest.mark.parametrize("source, last", [
    ("{% for m in messages %}<{{ m['role'] }}>{% endfor %}", "def f"),
    ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'][:3] }}{% endfor %}", "def f"),
    (PARTS, []),
], ids=["unread", "cut", "no-text"])
def test_a_final_message_that_cannot_be_continued_is_an_error_naming_continue_final_message(source, last):
    """The server's 400 takes its param from the error (it told this one from a messages error by its text)."""
    from specbuild_runtime.serve.chat import ChatRequestError, ChatTemplate

    messages = [{"role": "user", "content": "x" if isinstance(last, str) else [{"type": "text", "text": "x"}]},
                {"role": "assistant", "content": last}]
    with pytest.raises(ChatRequestError, match="^continue_final_message: ") as raised:
        ChatTemplate(source, {}).render(messages, add_generation_prompt=False, continue_final_message=True)
    assert raised.value.param == "continue_final_message"


def test_a_final_message_that_cannot_be_continued_beside_tool_call_arguments_sent_as_text_is_named_so():
    """DeepSeek-R1's template fails on a call's arguments parsed to an object and renders them as sent, which then
    could not be continued (the template drops the final message's reasoning): the error was the parsed form's
    TypeError, a 400 naming the messages, which the client's messages never met."""
    from specbuild_runtime.serve.chat import ChatRequestError, ChatTemplate

    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 2}'}}
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "4"}, {"role": "user", "content": "3+3?"},
                {"role": "assistant", "content": "<think>add them</think>It is"}]
    template = ChatTemplate((CHAT_TEMPLATES / "deepseek-r1.jinja").read_text(), {"bos_token": "<s>"})
    with pytest.raises(ChatRequestError, match="^continue_final_message: ") as raised:
        template.render(messages, add_generation_prompt=False, continue_final_message=True)
    assert raised.value.param == "continue_final_message"


def test_a_template_marking_assistant_turns_for_training_renders_as_transformers_renders_it(tokenizer):
    """`{% generation %}` (transformers' AssistantTracker tag) made the template fail to compile, and serve
    refused to start on the bundle."""
    from specbuild_runtime.serve.chat import ChatTemplate

    source = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}A: {{ m['content'] }}"
              "{{ eos_token }}{% endgeneration %}{% else %}U: {{ m['content'] }}\n{% endif %}{% endfor %}"
              "{% if add_generation_prompt %}A:{% endif %}")
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}, {"role": "user", "content": "x"}]
    expected = tokenizer.apply_chat_template(turns, chat_template=source, tokenize=False, add_generation_prompt=True)
    assert ChatTemplate(source, {"eos_token": tokenizer.eos_token}).render(turns) == expected


def test_a_template_that_loops_over_content_parts_gets_them_as_transformers_passes_them(tokenizer):
    """Text parts were always joined with newlines, so a template made for parts (this is Gemma 3's way with them)
    rendered "Sum:\nthis" where transformers, and vLLM (which passes such a template the parts), render "Sum:this"."""
    from specbuild_runtime.serve.chat import ChatTemplate

    source = ("{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{{ messages[0]['content'] }}\n"
              "{% else %}{% set loop_messages = messages %}{% endif %}{% for message in loop_messages %}"
              "{{ message['role'] }}: {% if message['content'] is string %}{{ message['content'] | trim }}{% else %}"
              "{% for item in message['content'] %}{% if item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}"
              "{% endfor %}{% endif %}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
    turns = [{"role": "system", "content": "Be brief."},
             {"role": "user", "content": [{"type": "text", "text": "Sum:"}, {"type": "text", "text": " this"}]},
             {"role": "assistant", "content": "ok"}, {"role": "user", "content": [{"type": "text", "text": "and"}]}]
    expected = tokenizer.apply_chat_template(turns, chat_template=source, tokenize=False, add_generation_prompt=True)
    assert ChatTemplate(source, {}).render(turns) == expected


# Released models' chat templates (Qwen3's, Llama 3.1's), as their tokenizer_config.json ship them.
CHAT_TEMPLATES = Path(__file__).parent / "chat_templates"


def transformers_and_ours(tokenizer, template: str, messages: list[dict], **options) -> tuple[list[int], list[int]]:
    """The prompt's ids as transformers' apply_chat_template gives them, and as serve's rendering does."""
    from specbuild_runtime.serve.chat import ChatTemplate

    source = (CHAT_TEMPLATES / template).read_text()
    expected = tokenizer.apply_chat_template(messages, chat_template=source, tokenize=True, return_dict=False, **options)
    ours = ChatTemplate(source, tokenizer.special_tokens_map).prompt_ids(tokenizer.backend_tokenizer, messages, **options)
    return expected, ours


def test_fields_sent_null_reach_the_template_as_absent_as_transformers_passes_them(tokenizer):
    """A client replaying the assistant turn it was answered sends "tool_calls": null; Llama 3.1's template tests
    `'tool_calls' in message`, took the turn for a tool call, and the request got a 400 (NoneType has no len())."""
    turns = [{"role": "user", "content": "Write fib", "name": None},
             {"role": "assistant", "content": "def fib(n):", "tool_calls": None, "refusal": None},
             {"role": "user", "content": "Faster"}]
    expected, ours = transformers_and_ours(tokenizer, "llama3.1.jinja", turns, add_generation_prompt=True)
    assert ours == expected


def test_an_empty_tool_calls_list_renders_as_a_turn_without_calls_as_vllm_passes_it(tokenizer):
    """vLLM answers every turn with "tool_calls": [], which clients replay; Llama 3.1's template took such a turn
    for a tool call and refused it ("only supports single tool-calls"): vLLM leaves the empty list out."""
    from specbuild_runtime.serve.chat import ChatTemplate

    turns = [{"role": "user", "content": "Write fib"}, {"role": "assistant", "content": "def fib(n):"},
             {"role": "user", "content": "Faster"}]
    expected, _ = transformers_and_ours(tokenizer, "llama3.1.jinja", turns, add_generation_prompt=True)
    replayed = [turns[0], {**turns[1], "tool_calls": []}, turns[2]]
    ours = ChatTemplate((CHAT_TEMPLATES / "llama3.1.jinja").read_text(), tokenizer.special_tokens_map)
    assert ours.prompt_ids(tokenizer.backend_tokenizer, replayed) == expected


@pytest.mark.parametrize("field", ["reasoning", "thinking"])
def test_a_turns_reasoning_under_another_name_renders_as_transformers_renders_it(field, tokenizer):
    """vLLM answers a turn's reasoning as "reasoning", which clients send back; Qwen3's template reads
    "reasoning_content" and showed an empty think block where transformers (which copies it there) shows it."""
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}
    turns = [{"role": "user", "content": "2+2?"},
             {"role": "assistant", "content": "", field: "Add them.", "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "call_1", "content": "4"}]
    expected, ours = transformers_and_ours(tokenizer, "qwen3.jinja", turns, add_generation_prompt=True)
    assert ours == expected and "Add them." in tokenizer.decode(expected)


def test_an_assistant_turn_without_content_renders_as_transformers_renders_it(tokenizer):
    """OpenAI's assistant messages may leave out 'content' (a turn that only called tools), as vLLM takes them;
    such a conversation got a 400 ("has no 'content'")."""
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}
    turns = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "call_1", "content": "4"}]
    for template in ("qwen3.jinja", "llama3.1.jinja"):
        expected, ours = transformers_and_ours(tokenizer, template, turns, add_generation_prompt=True)
        assert ours == expected, template


def test_tool_call_arguments_sent_as_json_text_render_as_the_object_they_spell(tokenizer):
    """OpenAI clients send a call's arguments as JSON text; Llama 3.1's template (`arguments | tojson`) showed them
    as a quoted string, "parameters": "{\\"a\\": 2}", where vLLM parses them first and the model was trained on
    the object: the prompt is transformers' for the conversation with the arguments as objects."""
    def turns(arguments):
        call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": arguments}}
        return [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "4"}]

    expected, _ = transformers_and_ours(tokenizer, "llama3.1.jinja", turns({"a": 2, "b": 2}), add_generation_prompt=True)
    _, ours = transformers_and_ours(tokenizer, "llama3.1.jinja", turns('{"a": 2, "b": 2}'), add_generation_prompt=True)
    assert ours == expected
    # DeepSeek-R1's joins them to its text as the model writes them, and fails on the object: it gets them as sent
    expected, ours = transformers_and_ours(tokenizer, "deepseek-r1.jinja", turns('{"a": 2, "b": 2}'),
                                           add_generation_prompt=True)
    assert ours == expected


# --- Tool calling ----------------------------------------------------------------------------------------------

ADD = {"function": {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "number"}}}},
       "type": "function"}  # "type" last: the template shows keys in the order sent
# What a Qwen3 model answers when it calls tools: some text, then one block per call
CALLING = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>\n'
           '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 2}}\n</tool_call>')
CALLED = [("get_weather", {"city": "Zürich"}), ("add", {"a": 2, "b": 2})]
# Qwen3's shows the tools in hundreds of tokens, past the tiny bundles' context: this one names them
NAMING_TOOLS = ("{% if tools %}<tools>{% for tool in tools %}{{ tool['function']['name'] }};{% endfor %}</tools>\n{% endif %}"
                "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@pytest.mark.parametrize("tool_choice", [None, "auto", "none"])
def test_tools_reach_the_chat_template_as_transformers_passes_them(tool_choice, tokenizer):
    """Qwen3's template shows the tools in its system turn; the prompt is apply_chat_template's with tools=, token
    for token, whether the reply's calls are parsed ("auto", the default) or not ("none", which vLLM renders
    them for too)."""
    from specbuild_runtime.serve import protocol
    from specbuild_runtime.serve.chat import ChatTemplate

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Zürich?"}]
    body = {"messages": messages, "tools": [WEATHER, ADD], **({"tool_choice": tool_choice} if tool_choice else {})}
    request = protocol.parse(protocol.CHAT, json.dumps(body).encode(), MODEL, protocol.sampling_defaults(None, "greedy"),
                             "hermes")
    assert request.parse_tools == (tool_choice != "none")
    source = (CHAT_TEMPLATES / "qwen3.jinja").read_text()
    expected = tokenizer.apply_chat_template(messages, tools=[WEATHER, ADD], chat_template=source, tokenize=True,
                                             add_generation_prompt=True, return_dict=False)
    ours = ChatTemplate(source, tokenizer.special_tokens_map).prompt_ids(tokenizer.backend_tokenizer, request.messages,
                                                                         **request.chat)
    assert ours == expected and '"name": "add"' in tokenizer.decode(expected)


def streamed(stream, pieces) -> tuple[str, list[dict]]:
    """The content and the calls a parser's stream sends for these pieces of a reply, to its end."""
    content, calls = "", []
    for piece in pieces:
        sent, made = stream.feed(piece)
        content, calls = content + sent, calls + made
    rest, made = stream.end()
    return content + rest, calls + made


def streams_as_whole(reply: str, parse, stream_class) -> None:
    """The reply fed to a parser's stream in pieces of 1, 2, 5 characters and whole: the content and the calls it
    sends are what the parser makes of the whole reply."""
    content, calls = parse(reply)
    for size in (1, 2, 5, len(reply)):
        sent, made = streamed(stream_class(), [reply[i:i + size] for i in range(0, len(reply), size)])
        written = [call["function"] for call in made], [call["function"] for call in calls]  # ids differ
        assert (sent, written[0]) == (content or "", written[1]), size


def streamed_tool_calls(client, ask: dict) -> tuple[str, dict, str | None]:
    """(content, index -> call, finish reason) of a streamed chat, as the openai client's accumulators join them."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(**ask, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:  # a delta with the index of a call sent before adds to its arguments
            if call.index in calls:
                calls[call.index]["function"]["arguments"] += call.function.arguments
            else:
                calls[call.index] = call.model_dump()
        finish = chunk.choices[0].finish_reason or finish
    return content, calls, finish


def call_list(calls) -> list[tuple[str, dict]]:
    return [(call["function"]["name"], json.loads(call["function"]["arguments"])) for call in calls]


def test_a_reply_is_parsed_into_tool_calls_as_vllms_hermes_parser_parses_it():
    from specbuild_runtime.serve.tools import parse_hermes

    content, calls = parse_hermes(CALLING)
    assert content == "Let me look.\n" and call_list(calls) == CALLED
    assert all(call["type"] == "function" and re.fullmatch(r"call_[0-9a-f]{24}", call["id"]) for call in calls)
    assert calls[0]["function"]["arguments"] == '{"city": "Zürich"}'  # as vLLM writes it: not ASCII-escaped
    assert parse_hermes(CALLING[CALLING.index("<tool_call>"):])[0] is None  # no text before the calls: null content
    assert parse_hermes("def f(x):") == ("def f(x):", [])
    # a reply ending inside its block (the end-of-turn token came first) is a call where its JSON is whole
    assert call_list(parse_hermes('<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n')[1]) == [("add", {"a": 1})]
    # a block that is no call (cut short by max_tokens, or without "arguments") makes the whole reply text
    for broken in (CALLING[:-30], CALLING + '<tool_call>{"name": "add"}</tool_call>', '<tool_call>["add"]</tool_call>'):
        assert parse_hermes(broken) == (broken, [])


@pytest.mark.parametrize("reply", [CALLING, CALLING[:-30], "No call: x < y and <tool", "<tool_call>"],
                         ids=["calls", "cut-short", "tag-like-text", "bare-tag"])
def test_a_streamed_reply_gives_the_content_and_calls_of_the_whole_reply_wherever_its_deltas_break(reply):
    """The stream holds back text that may begin a <tool_call> tag, and from a tag on parses the rest whole at the
    end: its content and calls are the unstreamed reply's however the text came in pieces."""
    from specbuild_runtime.serve.tools import PARSERS

    streams_as_whole(reply, *PARSERS["hermes"][:2])


def test_a_reply_calling_tools_is_answered_with_tool_calls_streamed_or_not(bundle):
    """With --tool-call-parser hermes, the openai client reads the calls as ChatCompletionMessageToolCall (streamed:
    its deltas, by index), the text before them as content, and finish_reason "tool_calls" (parallel_tool_calls
    false: the first call alone); tool_choice "none" answers the same text as content. The prompt shows the tools
    (its length is transformers')."""
    from openai.types.chat import ChatCompletionMessageToolCall
    from transformers import AutoTokenizer

    from specbuild_runtime.serve.chat import supplied_chat_template

    prompt = AutoTokenizer.from_pretrained(bundle / "tokenizer").apply_chat_template(
        ASK, tools=[WEATHER, ADD], chat_template=NAMING_TOOLS, tokenize=True, add_generation_prompt=True,
        return_dict=False)
    with in_process(bundle, ScriptedDecoder, chat_template=supplied_chat_template(NAMING_TOOLS),
                    tool_call_parser="hermes") as (url, decoder, _):
        decoder.go.set()
        decoder.pieces = [CALLING[i:i + 3] for i in range(0, len(CALLING), 3)]  # tags broken across deltas
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        ask = dict(model=MODEL, messages=ASK, tools=[WEATHER, ADD], max_tokens=4, **GREEDY)
        reply = client.chat.completions.create(**ask)
        [choice] = reply.choices
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look.\n"
        assert all(isinstance(call, ChatCompletionMessageToolCall) for call in choice.message.tool_calls)
        assert call_list(call.model_dump() for call in choice.message.tool_calls) == CALLED
        assert reply.usage.prompt_tokens == len(prompt)

        content, calls, finish = streamed_tool_calls(client, ask)
        assert (content, finish) == ("Let me look.\n", "tool_calls")
        assert call_list(calls[index] for index in sorted(calls)) == CALLED
        assert all(call["id"].startswith("call_") and call["type"] == "function" for call in calls.values())

        first = client.chat.completions.create(**ask, parallel_tool_calls=False).choices[0]  # vLLM keeps the first
        assert call_list(call.model_dump() for call in first.message.tool_calls) == CALLED[:1]
        streamed = [call.function.name for chunk in client.chat.completions.create(**ask, parallel_tool_calls=False,
                                                                                   stream=True)
                    for call in chunk.choices[0].delta.tool_calls or []]
        assert streamed == ["get_weather"]

        untouched = client.chat.completions.create(**ask, tool_choice="none").choices[0]
        assert untouched.message.content == CALLING and not untouched.message.tool_calls
        assert untouched.finish_reason != "tool_calls"


class ScriptedLogprobsDecoder(ScriptedDecoder):
    """A ScriptedDecoder whose streams, for a request with logprobs, pair each piece with a record of its own (token
    id: the piece's index), as the runtime pairs each token's text with its record."""

    def stream_request(self, request, stats, every_token=False, halt=None, token_ids=None):
        from specbuild_runtime import TokenLogprobs

        for index, piece in enumerate(super().stream_request(request, stats, every_token, halt, token_ids)):
            yield piece, (TokenLogprobs(index, -1.0 - index, (), 1),)


def test_a_streamed_reply_calling_tools_sends_each_tokens_logprobs_once_those_of_the_calls_with_the_calls(bundle):
    from specbuild_runtime.serve.chat import supplied_chat_template

    with in_process(bundle, ScriptedLogprobsDecoder, chat_template=supplied_chat_template(NAMING_TOOLS),
                    tool_call_parser="hermes") as (url, decoder, _):
        decoder.go.set()
        decoder.pieces = [CALLING[i:i + 3] for i in range(0, len(CALLING), 3)]
        ask = {"model": MODEL, "messages": ASK, "tools": [WEATHER, ADD], "max_tokens": 4, "logprobs": True, **GREEDY}
        chunks = stream_events(url, "chat/completions", ask)
        whole = httpx.post(f"{url}/v1/chat/completions", json=ask).json()["choices"][0]
    logprobs = [[entry["logprob"] for entry in c["logprobs"]["content"]] for c in chunks if c["logprobs"]]
    assert sum(logprobs, []) == [-1.0 - index for index in range(len(decoder.pieces))]
    assert [e["logprob"] for e in whole["logprobs"]["content"]] == sum(logprobs, [])
    content = [c for c in chunks if c["delta"].get("content")]  # "Let me look.\n" as it came, its pieces' records beside
    assert "".join(c["delta"]["content"] for c in content) == "Let me look.\n"
    [calls] = [c for c in chunks if c["delta"].get("tool_calls")]  # held to the reply's end, their tokens' records too
    assert len(calls["logprobs"]["content"]) > len(decoder.pieces) // 2 and chunks[-1]["finish_reason"] == "tool_calls"


# What a Llama 3.1 model answers when it calls tools (its python tag, a special token, is not in the runtime's text)
LLAMA_CALLING = ('{"name": "get_weather", "parameters": {"city": "Zürich"}}; '
                 '{"name": "add", "arguments": {"a": 2, "b": 2}}')


@pytest.mark.parametrize("tools_in_user_message", [None, False])
def test_tools_reach_llamas_chat_template_as_transformers_passes_them(tools_in_user_message, tokenizer):
    """Llama 3.1's template shows the tools in the first user message (or, told so, in the system turn); the
    prompt is apply_chat_template's with tools=, token for token."""
    from specbuild_runtime.serve import protocol
    from specbuild_runtime.serve.chat import ChatTemplate

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Zürich?"}]
    variables = {} if tools_in_user_message is None else {"tools_in_user_message": tools_in_user_message}
    body = {"messages": messages, "tools": [WEATHER, ADD], "chat_template_kwargs": variables}
    defaults = protocol.sampling_defaults(None, "greedy")
    request = protocol.parse(protocol.CHAT, json.dumps(body).encode(), MODEL, defaults, "llama3_json")
    source = (CHAT_TEMPLATES / "llama3.1.jinja").read_text()
    expected = tokenizer.apply_chat_template(messages, tools=[WEATHER, ADD], chat_template=source, tokenize=True,
                                             add_generation_prompt=True, return_dict=False, **variables)
    ours = ChatTemplate(source, tokenizer.special_tokens_map).prompt_ids(tokenizer.backend_tokenizer, request.messages,
                                                                         **request.chat)
    assert request.parse_tools and ours == expected
    assert '"name": "add"' in tokenizer.decode(expected) and "Environment: ipython" in tokenizer.decode(expected)


def test_a_reply_is_parsed_into_tool_calls_as_vllms_llama3_json_parser_parses_it():
    from specbuild_runtime.serve.tools import parse_llama3_json

    content, calls = parse_llama3_json(LLAMA_CALLING)  # "parameters" (Llama's) or "arguments", joined by "; "
    assert content is None and call_list(calls) == CALLED
    assert all(call["type"] == "function" and re.fullmatch(r"call_[0-9a-f]{24}", call["id"]) for call in calls)
    assert calls[0]["function"]["arguments"] == '{"city": "Zürich"}'  # as vLLM writes it: not ASCII-escaped
    # a text that kept the python tag, and text around the calls, which vLLM drops
    for around in ("<|python_tag|>" + LLAMA_CALLING, "Let me look: " + LLAMA_CALLING + " Done."):
        assert parse_llama3_json(around)[0] is None and call_list(parse_llama3_json(around)[1]) == CALLED
    for text in ("No call.", "<|python_tag|>", "def f(x):\n    return {x}", "{}", '{"name": "add"}',
                 '{"name": 2, "parameters": {}}', '["add", {}]', '{"call": {"name": "add", "parameters": {}}}'):
        assert parse_llama3_json(text) == (text, []), text
    # a brace that begins no call anywhere (cut short by max_tokens, code after the call) makes the whole reply text
    for broken in (LLAMA_CALLING[:-10], LLAMA_CALLING + " {x}"):
        assert parse_llama3_json(broken) == (broken, [])


@pytest.mark.parametrize("reply", [LLAMA_CALLING, " <|python_tag|>" + LLAMA_CALLING, LLAMA_CALLING[:-10],
                                   LLAMA_CALLING + " {x}", "No call.", "if x {\n  y();\n}", '{"a": 1} is JSON', "{"],
                         ids=["calls", "tagged-calls", "cut-short", "code-after", "text", "code", "json", "bare-brace"])
def test_a_streamed_llama_reply_gives_the_content_and_calls_of_the_whole_reply_wherever_its_deltas_break(reply):
    """From its first "{" the stream holds the text until it can tell whether that begins a call, and a call to the
    end: a reply that is text, or that begins with its calls, gets the unstreamed reply's content and calls however
    the text came in pieces."""
    from specbuild_runtime.serve.tools import Llama3JsonStream, parse_llama3_json

    streams_as_whole(reply, parse_llama3_json, Llama3JsonStream)


def test_a_llama_reply_with_text_before_its_calls_streams_that_text_and_then_the_same_calls():
    """The text went out before the calls began (vLLM's whole reply drops it; its stream answers text alone)."""
    from specbuild_runtime.serve.tools import Llama3JsonStream

    stream = Llama3JsonStream()
    sent = [stream.feed(piece) for piece in ("Let me ", "look: ", LLAMA_CALLING[:9], LLAMA_CALLING[9:])]
    rest, calls = stream.end()
    assert (sent, rest, call_list(calls)) == ([("Let me ", []), ("look: ", []), ("", []), ("", [])], "", CALLED)


def test_a_llama_reply_whose_braces_begin_no_call_streams_as_it_comes():
    """Code's braces are followed by no JSON key: the text is released there, not held to the end."""
    from specbuild_runtime.serve.tools import Llama3JsonStream

    stream = Llama3JsonStream()
    assert [stream.feed(piece)[0] for piece in ("  if x {", "\n  y();", "\n}")] == ["  if x ", "{\n  y();", "\n}"]
    assert stream.end() == ("", [])


def test_a_forced_reply_is_read_as_json_by_a_server_that_parses_another_format_streamed_or_not(bundle):
    """With --tool-call-parser hermes, a tool_choice "required" reply is read as its JSON list, not for <tool_call>
    blocks, as vLLM reads it."""
    from specbuild_runtime.serve.chat import supplied_chat_template

    listed = ('[{"name": "get_weather", "parameters": {"city": "Zürich"}}, '
              '{"name": "add", "parameters": {"a": 2, "b": 2}}]')
    with in_process(bundle, ScriptedDecoder, chat_template=supplied_chat_template(NAMING_TOOLS),
                    tool_call_parser="hermes") as (url, decoder, _):
        decoder.go.set()
        decoder.pieces = [listed[i:i + 3] for i in range(0, len(listed), 3)]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        ask = dict(model=MODEL, messages=ASK, tools=[WEATHER, ADD], tool_choice="required", max_tokens=4, **GREEDY)
        [choice] = client.chat.completions.create(**ask).choices
        assert (choice.message.content, choice.finish_reason) == (None, "tool_calls")
        assert call_list(call.model_dump() for call in choice.message.tool_calls) == CALLED
        content, calls, finish = streamed_tool_calls(client, ask)
        assert (content, finish) == ("", "tool_calls") and call_list(calls[i] for i in sorted(calls)) == CALLED


def test_a_llama_reply_calling_tools_is_answered_with_tool_calls_streamed_or_not(bundle):
    """With --tool-call-parser llama3_json, the openai client reads the calls as ChatCompletionMessageToolCall
    (streamed: its deltas, by index), null content, and finish_reason "tool_calls"; tool_choice "none" answers
    the same text as content."""
    from openai.types.chat import ChatCompletionMessageToolCall

    from specbuild_runtime.serve.chat import supplied_chat_template

    with in_process(bundle, ScriptedDecoder, chat_template=supplied_chat_template(NAMING_TOOLS),
                    tool_call_parser="llama3_json") as (url, decoder, _):
        decoder.go.set()
        decoder.pieces = [LLAMA_CALLING[i:i + 3] for i in range(0, len(LLAMA_CALLING), 3)]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        ask = dict(model=MODEL, messages=ASK, tools=[WEATHER, ADD], max_tokens=4, **GREEDY)
        [choice] = client.chat.completions.create(**ask).choices
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert all(isinstance(call, ChatCompletionMessageToolCall) for call in choice.message.tool_calls)
        assert call_list(call.model_dump() for call in choice.message.tool_calls) == CALLED

        content, calls, finish = streamed_tool_calls(client, ask)
        assert (content, finish) == ("", "tool_calls")
        assert call_list(calls[index] for index in sorted(calls)) == CALLED

        untouched = client.chat.completions.create(**ask, tool_choice="none").choices[0]
        assert untouched.message.content == LLAMA_CALLING and not untouched.message.tool_calls


# What Mistral models answer when they call tools: a tokenizer with an [ARGS] token (Mistral's v11 on)
# writes each call after its own [TOOL_CALLS], older ones (Mistral 7B Instruct v0.3) a JSON list after one
MISTRAL_CALLING = 'Let me look.[TOOL_CALLS]get_weather[ARGS]{"city": "Zürich"}[TOOL_CALLS]add[ARGS]{"a": 2, "b": 2}'
MISTRAL_LISTING = ('Let me look. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Zürich"}}, '
                   '{"name": "add", "arguments": {"a": 2, "b": 2}}]')
# What Llama 3.2 or 4 answers with the pythonic format, and Llama 4 at times between its code markers (special
# tokens: in the text where a tokenizer lacks them)
PYTHONIC_CALLING = '[get_weather(city="Zürich"), add(a=2, b=2)]'
LLAMA4_CALLING = f"<|python_start|>{PYTHONIC_CALLING}<|python_end|>"


def test_a_mistral_reply_is_parsed_into_tool_calls_as_vllms_mistral_parser_parses_it():
    """Each [TOOL_CALLS] is a call: its name up to "{", its arguments the text from there, sent as written even
    where they are no JSON, as vLLM keeps them; the ids are 9 letters and digits, as Mistral's templates ask of
    a replayed call."""
    from specbuild_runtime.serve.tools import parse_mistral

    content, calls = parse_mistral(MISTRAL_CALLING)
    assert content == "Let me look." and call_list(calls) == CALLED
    assert all(call["type"] == "function" and re.fullmatch(r"[0-9a-zA-Z]{9}", call["id"]) for call in calls)
    assert calls[1]["function"]["arguments"] == '{"a": 2, "b": 2}'  # as written: spacing, order, not re-encoded
    assert parse_mistral(MISTRAL_CALLING[MISTRAL_CALLING.index("[TOOL_CALLS]"):])[0] is None
    assert parse_mistral('[TOOL_CALLS]add{"a": 1}')[1][0]["function"]["name"] == "add"  # [ARGS] may be missing
    cut = parse_mistral('[TOOL_CALLS]add[ARGS]{"a": ')[1][0]["function"]  # cut short by max_tokens: still a call
    assert (cut["name"], cut["arguments"]) == ("add", '{"a": ')
    assert call_list(parse_mistral(MISTRAL_CALLING + "[TOOL_CALLS]get_wea")[1]) == CALLED  # a part with no "{"
    for text in ("No call.", "[TOOL_CALLS]get_wea", "Use {x}."):
        assert parse_mistral(text) == (text, []), text


def test_an_older_mistral_reply_is_parsed_from_its_json_list_as_vllms_mistral_parser_parses_it():
    from specbuild_runtime.serve.tools import parse_mistral_list

    content, calls = parse_mistral_list(MISTRAL_LISTING)
    assert content == "Let me look. " and call_list(calls) == CALLED
    assert all(re.fullmatch(r"[0-9a-zA-Z]{9}", call["id"]) for call in calls)
    assert calls[0]["function"]["arguments"] == '{"city": "Zürich"}'  # as vLLM writes it: not ASCII-escaped
    listed = MISTRAL_LISTING[MISTRAL_LISTING.index("[TOOL_CALLS]"):]
    assert parse_mistral_list(listed)[0] is None
    # text after the list is left out, and before it skipped (vLLM's second try: from the first "[{" to the last "}]")
    for around in (listed + " Done.", listed.replace("] [", "] Calling: [")):
        assert call_list(parse_mistral_list(around)[1]) == CALLED, around
    assert call_list(parse_mistral_list('[TOOL_CALLS] [{"name": "add"}]')[1]) == [("add", {})]  # no arguments: {}
    for text in ("No call.", MISTRAL_LISTING[:-20], listed + listed, '[TOOL_CALLS] [{"arguments": {}}]',
                 '[TOOL_CALLS] {"name": "add", "arguments": {}}', '[TOOL_CALLS] ["add"]', "[TOOL_CALLS] []"):
        assert parse_mistral_list(text) == (text, []), text


def test_mistrals_format_is_the_one_its_tokenizers_vocabulary_tells_as_vllm_tells_it():
    """A tokenizer with an [ARGS] token (v11 on) writes name[ARGS]{...}, an older one a JSON list."""
    from tokenizers import Tokenizer, models

    from specbuild_runtime.serve.tools import PARSERS, parse_mistral, parse_mistral_list, tool_parser

    older = Tokenizer(models.WordLevel({"[TOOL_CALLS]": 0, "[UNK]": 1}, unk_token="[UNK]"))
    newer = Tokenizer(models.WordLevel({"[TOOL_CALLS]": 0, "[ARGS]": 1, "[UNK]": 2}, unk_token="[UNK]"))
    assert tool_parser("mistral", older).parse is parse_mistral_list
    assert tool_parser("mistral", newer).parse is parse_mistral
    assert tool_parser("mistral", newer).special_tokens and not tool_parser("hermes", newer).special_tokens
    assert tool_parser("hermes", older) is PARSERS["hermes"]


def test_a_pythonic_reply_is_parsed_into_tool_calls_as_vllms_pythonic_parser_parses_it():
    """The reply is a Python list of calls from its first character, read with ast (never run); the arguments are
    literals: a call with any other value (-1 is an expression to ast) makes the whole reply text, as in vLLM."""
    from specbuild_runtime.serve.tools import parse_pythonic

    content, calls = parse_pythonic(PYTHONIC_CALLING)
    assert content is None and call_list(calls) == CALLED
    assert calls[0]["function"]["arguments"] == '{"city": "Zürich"}'  # as vLLM writes it: not ASCII-escaped
    nested = "[f(a={'k': [1, None, True]}, b='x', c=2.5), g()]"
    assert call_list(parse_pythonic(nested)[1]) == [("f", {"a": {"k": [1, None, True]}, "b": "x", "c": 2.5}), ("g", {})]
    # vLLM leaves positional arguments out where its regex lets them by (not in the first call)
    assert call_list(parse_pythonic("[f(a=1), g(2, b=3)]")[1]) == [("f", {"a": 1}), ("g", {"b": 3})]
    assert call_list(parse_pythonic(PYTHONIC_CALLING + "\nx = 1")[1]) == CALLED  # a later statement left out
    for text in ("No call.", " " + PYTHONIC_CALLING, PYTHONIC_CALLING + " Done.", PYTHONIC_CALLING[:-5], "[f(a=-1)]",
                 "[f(a=g())]", "[f(a=x)]", "[f(a=(1, 2))]", "[f(a=b'x')]", "[m.f(a=1)]", "[f(a=1), 2]", "[1, 2]",
                 "[f(a = 1)]", "[_f(a=1)]", "[f(a=1),]", "[f(1, a=2)]", "[f(**{'a': 1}), g(a=x)]", "[f(a=1)"):
        assert parse_pythonic(text) == (text, []), text


def test_a_pythonic_reply_passes_vllms_regex_exactly_where_it_passes_ours():
    """vLLM's regex tests a reply before ast reads it; Python's re backtracks on it for minutes (vLLM's regex module
    times out), so ours is rewritten to match the same strings: every short string of the characters that matter;
    and replies that keep re busy with vLLM's (a list of calls with a trailing comma, a call cut short) are read at
    once."""
    import itertools

    from specbuild_runtime.serve.tools import PYTHONIC, parse_pythonic

    vllms = re.compile(r"\[([a-zA-Z]+\w*\(([a-zA-Z]+\w*=.*,\s*)*([a-zA-Z]+\w*=.*\s)?\),\s*)*"
                       r"([a-zA-Z]+\w*\(([a-zA-Z]+\w*=.*,\s*)*([a-zA-Z]+\w*=.*\s*)?\)\s*)+\]", re.DOTALL)
    for length in range(1, 6):
        for characters in itertools.product("[](),=f ", repeat=length):
            text = "".join(characters)
            assert bool(vllms.match(text)) == bool(PYTHONIC.match(text)), text
    for slow in ("[" + "add(a=1, b=2), " * 30 + "]", "[add(" + "a=1, " * 30 + ")"):  # vLLM's: 9 s at 22 calls
        assert parse_pythonic(slow) == (slow, [])


@pytest.mark.parametrize("reply", [MISTRAL_CALLING, MISTRAL_CALLING[:-5], "No call: [TOOL", "[TOOL_CALLS]", "x [TOOL_CALLS]y"],
                         ids=["calls", "cut-short", "tag-like-text", "bare-tag", "no-call"])
def test_a_streamed_mistral_reply_gives_the_content_and_calls_of_the_whole_reply_wherever_its_deltas_break(reply):
    from specbuild_runtime.serve.tools import PARSERS, MISTRAL_LIST

    streams_as_whole(reply, *PARSERS["mistral"][:2])
    streams_as_whole(reply.replace(MISTRAL_CALLING, MISTRAL_LISTING), *MISTRAL_LIST[:2])


@pytest.mark.parametrize("reply", [PYTHONIC_CALLING, PYTHONIC_CALLING[:-5], "[f(a=-1)]", "[1, 2] is a list",
                                   "[link](https://x)", "[f", "No call.", "["],
                         ids=["calls", "cut-short", "no-literal", "list", "markdown", "bare-name", "text", "bracket"])
def test_a_streamed_pythonic_reply_gives_the_content_and_calls_of_the_whole_reply_wherever_its_deltas_break(reply):
    """The reply is held while its start may begin a call ("[", a name, "("), then to its end; else it streams."""
    from specbuild_runtime.serve.tools import PARSERS

    streams_as_whole(reply, *PARSERS["pythonic"][:2])


def test_a_llama4_pythonic_reply_is_parsed_into_tool_calls_as_vllms_llama4_pythonic_parser_parses_it():
    """As pythonic's, where a reply that opens with <|python_start|> is read without it and without every
    <|python_end|>: its calls, or else that text as content, as vLLM answers it."""
    from specbuild_runtime.serve.tools import parse_llama4_pythonic, parse_pythonic

    for text in (PYTHONIC_CALLING, LLAMA4_CALLING, "<|python_start|>" + PYTHONIC_CALLING,
                 "<|python_start|>[get_weather(city=\"Zürich\"),<|python_end|> add(a=2, b=2)]"):
        content, calls = parse_llama4_pythonic(text)
        assert content is None and call_list(calls) == CALLED, text
    assert parse_llama4_pythonic("<|python_start|>print(1)<|python_end|> Done.") == ("print(1) Done.", [])
    for text in ("No call.", " " + LLAMA4_CALLING, PYTHONIC_CALLING + "<|python_end|>", "[f(a=-1)]"):
        assert parse_llama4_pythonic(text) == parse_pythonic(text) == (text, []), text


@pytest.mark.parametrize("reply", [LLAMA4_CALLING, PYTHONIC_CALLING, LLAMA4_CALLING[:-20],
                                   "<|python_start|>print(1)<|python_end|> x", "<|python_start|>[f(a='<|python_end')]",
                                   "<|python_start|>[f(a=1)]<|python_e", "<|python_st", "<|python_start|>",
                                   "<|python_start|><|python_end|>[f(a=1)]", "<|x|>[f(a=1)]", "No call."],
                         ids=["calls", "bare-calls", "cut-short", "code", "marker-like-text", "cut-in-marker",
                              "cut-in-start", "bare-start", "empty-code", "other-marker", "text"])
def test_a_streamed_llama4_pythonic_reply_gives_the_content_and_calls_of_the_whole_reply_wherever_its_deltas_break(
        reply):
    """Text that may be the start of a marker is held until a delta tells; the rest streams as pythonic's."""
    from specbuild_runtime.serve.tools import PARSERS

    streams_as_whole(reply, *PARSERS["llama4_pythonic"][:2])


def test_a_streamed_mistral_reply_sends_each_call_once_the_next_tool_calls_tag_closes_it():
    """vLLM streams each call as it forms; here each goes out whole once nothing later in the reply can change it:
    a closed call's name and arguments end at the next tag, and a reply with a call has the content before its first
    tag. The last one, which more arguments may follow, at the end."""
    from specbuild_runtime.serve.tools import PARSERS

    stream = PARSERS["mistral"].stream()
    second = MISTRAL_CALLING.rindex("[TOOL_CALLS]")
    assert stream.feed(MISTRAL_CALLING[:second]) == ("Let me look.", [])
    assert stream.feed("[TOOL_") == ("", [])
    content, calls = stream.feed("CALLS]ad")
    assert content == "" and call_list(calls) == CALLED[:1]
    assert stream.feed(MISTRAL_CALLING[second + len("[TOOL_CALLS]ad"):]) == ("", [])
    rest, calls = stream.end()
    assert rest == "" and call_list(calls) == CALLED[1:]


@pytest.mark.parametrize("parallel", [True, False])
def test_a_streams_calls_are_indexed_over_the_stream_and_without_parallel_tool_calls_the_first_alone(parallel):
    """Calls sent in several chunks: each chunk's indexes go on from the last, and parallel_tool_calls false sends the
    first call of the stream alone, as the reply unstreamed answers it."""
    from specbuild_runtime.serve import protocol
    from specbuild_runtime.serve.tools import PARSERS, parse_mistral

    reply = protocol.Reply(protocol.CHAT, MODEL, PARSERS["mistral"], parallel_tool_calls=parallel)
    calls = parse_mistral(MISTRAL_CALLING)[1]
    chunks = [reply.tool_calls_chunk(calls[:1]), reply.tool_calls_chunk([]), reply.tool_calls_chunk(calls[1:])]
    sent = [[call["index"] for call in chunk["choices"][0]["delta"]["tool_calls"]] if chunk else None
            for chunk in chunks]
    assert sent == ([[0], None, [1]] if parallel else [[0], None, None]) and reply.calls_sent == 2


def test_a_pythonic_reply_that_begins_no_call_streams_as_it_comes():
    from specbuild_runtime.serve.tools import PythonicStream

    stream = PythonicStream()
    assert [stream.feed(piece)[0] for piece in ("", "[", "1, 2", "] x")] == ["", "", "[1, 2", "] x"]
    assert stream.end() == ("", [])


class HaltingDecoder(ScriptedDecoder):
    """A ScriptedDecoder whose streams, once they have sent piece `halt_after`, wait for `resume` (`resumed` after)."""

    halt_after = 0
    resume = threading.Event()
    resumed = False

    def stream_request(self, request, stats, every_token=False, halt=None, token_ids=None):
        for index, piece in enumerate(super().stream_request(request, stats, every_token, halt, token_ids)):
            yield piece
            if index == self.halt_after:
                self.resume.wait(60)
                self.resumed = True


def test_a_streamed_mistral_reply_sends_a_closed_call_while_the_model_still_writes(bundle, monkeypatch):
    """The first call reaches the openai client while the reply is still being decoded (the decoder halted just after
    the tag that closes it), then the second at the end: the calls, content and finish reason unstreamed."""
    from specbuild_runtime.serve import app
    from specbuild_runtime.serve.chat import supplied_chat_template
    from specbuild_runtime.serve.tools import PARSERS

    monkeypatch.setattr(app, "tool_parser", lambda name, tokenizer: PARSERS[name])  # the [ARGS] form: no such token here
    with in_process(bundle, HaltingDecoder, chat_template=supplied_chat_template(NAMING_TOOLS),
                    tool_call_parser="mistral") as (url, decoder, _):
        decoder.go.set()
        decoder.pieces = [MISTRAL_CALLING[i:i + 3] for i in range(0, len(MISTRAL_CALLING), 3)]
        decoder.halt_after = (MISTRAL_CALLING.rindex("[TOOL_CALLS]") + len("[TOOL_CALLS]") - 1) // 3
        decoder.resume = threading.Event()
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        chunks = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, ADD], max_tokens=4,
                                                stream=True, **GREEDY)
        content = ""
        for chunk in chunks:
            delta = chunk.choices[0].delta
            content += delta.content or ""
            if delta.tool_calls:
                break
        assert not decoder.resumed and content == "Let me look."
        assert [call.index for call in delta.tool_calls] == [0]
        assert call_list(call.model_dump() for call in delta.tool_calls) == CALLED[:1]
        decoder.resume.set()
        rest = [chunk.choices[0] for chunk in chunks]
    later = [call for choice in rest for call in choice.delta.tool_calls or []]
    assert [call.index for call in later] == [1] and call_list(call.model_dump() for call in later) == CALLED[1:]
    assert [choice.finish_reason for choice in rest if choice.finish_reason] == ["tool_calls"]


class RecordingDecoder(ScriptedDecoder):
    """A ScriptedDecoder that keeps the checked requests it streams."""

    streamed: list = []

    def stream_request(self, request, stats, every_token=False, halt=None, token_ids=None):
        self.streamed.append(request)
        yield from super().stream_request(request, stats, every_token, halt, token_ids)


@pytest.mark.parametrize("parser, reply, content", [("mistral", MISTRAL_LISTING, "Let me look. "),
                                                    ("pythonic", PYTHONIC_CALLING, None),
                                                    ("llama4_pythonic", LLAMA4_CALLING, None)])
def test_mistral_and_pythonic_replies_calling_tools_are_answered_with_tool_calls_streamed_or_not(bundle, parser, reply,
                                                                                               content):
    """With --tool-call-parser mistral (this bundle's tokenizer has no [ARGS]: the JSON list), pythonic or
    llama4_pythonic (its code markers: in the text, as this tokenizer has no such tokens), the openai
    client reads the calls, the content and finish_reason "tool_calls"; the mistral parser's requests are decoded
    keeping special tokens ([TOOL_CALLS] is one), as vLLM decodes them, and a tool_choice "none" request is not."""
    from openai.types.chat import ChatCompletionMessageToolCall

    from specbuild_runtime.serve.chat import supplied_chat_template

    with in_process(bundle, RecordingDecoder, chat_template=supplied_chat_template(NAMING_TOOLS),
                    tool_call_parser=parser) as (url, decoder, _):
        decoder.go.set()
        decoder.pieces, decoder.streamed = [reply[i:i + 3] for i in range(0, len(reply), 3)], []
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        ask = dict(model=MODEL, messages=ASK, tools=[WEATHER, ADD], max_tokens=4, **GREEDY)
        [choice] = client.chat.completions.create(**ask).choices
        assert choice.finish_reason == "tool_calls" and choice.message.content == content
        assert all(isinstance(call, ChatCompletionMessageToolCall) for call in choice.message.tool_calls)
        assert call_list(call.model_dump() for call in choice.message.tool_calls) == CALLED

        streamed_content, calls, finish = streamed_tool_calls(client, ask)
        assert (streamed_content, finish) == (content or "", "tool_calls")
        assert call_list(calls[index] for index in sorted(calls)) == CALLED

        untouched = client.chat.completions.create(**ask, tool_choice="none").choices[0]
        assert untouched.message.content == reply and not untouched.message.tool_calls
        assert [request.special_tokens for request in decoder.streamed] == [parser == "mistral"] * 2 + [False]


def test_enable_auto_tool_choice_is_vllms_spelling_and_needs_a_parser_as_in_vllm(tmp_path):
    """vLLM's command line (--enable-auto-tool-choice --tool-call-parser hermes) runs unchanged; the switch alone
    would turn on nothing, and vLLM refuses it too: one line, before the bundle loads."""
    from specbuild_runtime.serve.cli import serve_command

    for parser in ("hermes", "llama3_json", "llama4_pythonic", "mistral", "pythonic"):
        context = serve_command.make_context("serve", [str(tmp_path), "--enable-auto-tool-choice", "--tool-call-parser",
                                                       parser])
        assert context.params["tool_call_parser"] == parser
    run = subprocess.run([sys.executable, "-m", "specbuild", "serve", str(tmp_path / "missing"), "--enable-auto-tool-choice"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "needs --tool-call-parser" in run.stderr, run.stderr


def test_a_tool_call_parser_vllm_has_and_this_server_lacks_is_one_line_naming_the_ones_it_has(tmp_path):
    """vLLM's names were a generic click error: a vLLM command line moved here is told which formats there are."""
    run = subprocess.run([sys.executable, "-m", "specbuild", "serve", str(tmp_path), "--tool-call-parser", "xlam"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
    assert ("xlam is a vLLM parser this server does not have; it reads hermes, llama3_json, llama4_pythonic, mistral, "
            "pythonic") in run.stderr, run.stderr


def test_a_tool_call_parser_whose_marking_tokens_the_tokenizer_lacks_is_refused_at_start_as_in_vllm(bundle):
    """vLLM's hermes and mistral parsers refuse to start on a tokenizer without <tool_call> and </tool_call>, or
    [TOOL_CALLS] (this bundle's has none): such a model does not write the format, and the server answered every
    reply as text without a word."""
    for parser, token in (("hermes", "<tool_call> and </tool_call>"), ("mistral", "[TOOL_CALLS]")):
        run = subprocess.run([sys.executable, "-m", "specbuild", "serve", str(bundle), "--port", str(free_port()),
                              "--tool-call-parser", parser], capture_output=True, text=True, timeout=60)
        assert run.returncode == 1 and run.stderr.count("\n") == 1, run.stderr
        assert f"marked by {token}, which this bundle's tokenizer has no token for" in run.stderr, run.stderr


def test_an_api_key_guards_the_v1_routes_and_leaves_health_version_and_metrics_open(bundle):
    with in_process(bundle, api_key="s3cret") as (url, decoder, _):
        decoder.go.set()
        assert httpx.get(f"{url}/v1/models").status_code == 401
        wrong = httpx.post(f"{url}/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer s3cre"})
        assert wrong.status_code == 401 and "a valid API key is required" in wrong.json()["error"]["message"]
        assert httpx.get(f"{url}/v1/models", headers={"Authorization": "Basic s3cret"}).status_code == 401
        assert httpx.get(f"{url}/v1/models", headers={"Authorization": "bearer s3cret"}).status_code == 200  # RFC 6750
        assert httpx.get(f"{url}/health").status_code == 200 and httpx.get(f"{url}/metrics").status_code == 200
        assert httpx.get(f"{url}/version").json() == {"version": runtime_version()}  # vLLM's, open as /health is
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0)
        reply = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=4, temperature=0)
        assert reply.choices[0].finish_reason == "length"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0).models.list()


def test_generate_chat_sends_the_prompt_as_serve_chat_renders_it(server, bundle, bundles):
    """`specbuild generate --chat`: one user message in the bundle's template, the reply alone, the tokens of the
    server's chat completion for the same message."""
    served = httpx.post(f"{server}/v1/chat/completions",
                        json={"messages": [{"role": "user", "content": "Write fib"}], "max_tokens": 8, "temperature": 0}).json()
    run = subprocess.run([sys.executable, "-m", "specbuild", "generate", str(bundle), "-p", "Write fib", "--chat", "-n", "8",
                          "--json"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["text"] == served["choices"][0]["message"]["content"]
    plain = subprocess.run([sys.executable, "-m", "specbuild", "generate", str(bundles("llama", 1)), "-p", "x", "--chat"],
                           capture_output=True, text=True)
    assert plain.returncode == 1 and "has no chat template" in plain.stderr


@pytest.mark.parametrize("chat", [[], ["--chat"]], ids=["text", "chat"])
def test_generate_refuses_a_prompt_from_stdin_longer_than_any_tokenization_fits_as_the_api_does(bundle, chat):
    """`generate -p -` (a file's prompt), plain or --chat, is refused before it is tokenized, as serve refuses it."""
    run = subprocess.run([sys.executable, "-m", "specbuild", "generate", str(bundle), "-p", "-", "-n", "4", *chat],
                         input="x" * 60_000, capture_output=True, text=True)
    assert run.returncode == 1 and "has at least" in run.stderr and f"context is {MAX_SEQ_LEN}" in run.stderr, run.stderr
    assert ("no context of these models can hold it (compile takes --max-seq-len 512 at most); shorten the prompt to "
            f"{MAX_SEQ_LEN} tokens or fewer to fit this bundle, or to 512 or fewer after recompiling with --max-seq-len "
            "512") in run.stderr


def test_an_empty_api_key_variable_is_refused_not_taken_for_no_key(bundle):
    """click reads an empty SPECBUILD_API_KEY as unset: a deploy whose secret came out empty served openly."""
    import os

    run = subprocess.run([sys.executable, "-m", "specbuild", "serve", str(bundle), "--port", str(free_port())],
                         env={**os.environ, "SPECBUILD_API_KEY": ""}, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "SPECBUILD_API_KEY is set but empty" in run.stderr, run.stderr


def test_the_start_up_line_says_a_server_beyond_loopback_without_an_api_key_is_open_to_the_network(bundle, tmp_path):
    """--host 0.0.0.0 without --api-key served anyone who reached the port; the start-up line read as on loopback."""
    from specbuild_runtime.serve.cli import exposure

    log = tmp_path / "server.log"
    with specbuild_serve(bundle, log, "--host", "0.0.0.0") as (_, url):
        assert healthy(url)
    line = next(line for line in log.read_text().splitlines() if line.startswith("serving "))
    assert ":" + url.rsplit(":", 1)[1] + " (open to the network without --api-key: anyone who reaches it may use it; " \
        "give --api-key KEY, or --host 127.0.0.1): 1 slot(s)" in line, line
    assert exposure("::", None) == exposure("192.168.1.5", None) == exposure("0.0.0.0", None)
    assert exposure("127.0.0.1", None) == exposure("127.0.0.2", None) == exposure("::1", None) == ""
    assert exposure("::ffff:127.0.0.1", None) == "" and exposure("::ffff:192.168.1.5", None) == exposure("::", None)
    assert exposure("0.0.0.0", "s3cret") == ""


PREFLIGHT = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization, content-type"}


def test_a_browser_preflight_from_an_allowed_origin_gets_cors_headers_and_another_does_not(bundle):
    """--allowed-origins: a page's preflight (a JSON POST with a key sends one, without the key) is answered before
    the key is checked; a page from another origin gets no CORS headers, so its browser refuses the call."""
    page = "http://localhost:3000"
    with in_process(bundle, allowed_origins=(page,), api_key="s3cret") as (url, decoder, _):
        decoder.go.set()
        allowed = httpx.options(f"{url}/v1/chat/completions", headers={"Origin": page, **PREFLIGHT})
        assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == page
        assert "POST" in allowed.headers["access-control-allow-methods"]
        assert "authorization" in allowed.headers["access-control-allow-headers"]
        other = httpx.options(f"{url}/v1/chat/completions", headers={"Origin": "https://elsewhere.example", **PREFLIGHT})
        assert "access-control-allow-origin" not in other.headers
        refused = httpx.post(f"{url}/v1/completions", json={"prompt": "x"}, headers={"Origin": page})
        assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == page  # the page reads why
        assert "x-should-retry" in refused.headers["access-control-expose-headers"]  # its openai client obeys a 504's


def test_a_refused_browser_preflight_is_an_openai_shaped_400_naming_what_is_not_allowed(bundle):
    """Starlette's CORS refuses a preflight in text/plain ("Disallowed CORS origin")."""
    page = "http://localhost:3000"
    with in_process(bundle, allowed_origins=(page,)) as (url, decoder, _):
        decoder.go.set()
        for origin, method, refused in [("https://elsewhere.example", "POST", "origin"), (page, "PUT", "method")]:
            reply = httpx.options(f"{url}/v1/completions", headers={"Origin": origin, "Access-Control-Request-Method": method})
            assert reply.status_code == 400 and reply.headers["content-type"] == "application/json"
            error = reply.json()["error"]
            assert error["type"] == "BadRequestError" and f"refused ({refused} not allowed)" in error["message"]


def test_without_allowed_origins_no_web_page_may_call_the_api(server):
    """The default: a loopback server without a key is guarded by its address alone, which a page in a browser on
    the same machine passes."""
    preflight = httpx.options(f"{server}/v1/chat/completions", headers={"Origin": "https://elsewhere.example", **PREFLIGHT})
    assert "access-control-allow-origin" not in preflight.headers


@pytest.mark.parametrize("ours, vllms, value", [("--model-name", "--served-model-name", "demo"),
                                                ("--parallel", "--max-num-seqs", "4")])
def test_vllms_spellings_of_serve_options_are_read_as_ours_and_shown_in_the_help(ours, vllms, value, tmp_path):
    """An operator's vLLM command line (--served-model-name, --max-num-seqs) was a usage error (parsed only here)."""
    from specbuild_runtime.serve.cli import serve_command

    context = serve_command.make_context("serve", [str(tmp_path), vllms, value])
    assert context.params == serve_command.make_context("serve", [str(tmp_path), ours, value]).params
    assert f"{ours}, {vllms}" in serve_command.get_help(context)


@pytest.mark.parametrize("given", [["http://localhost:3000", "*"], ['["http://localhost:3000", "*"]']],
                         ids=["repeated", "vllm-json-list"])
def test_allowed_origins_are_read_repeated_or_as_vllms_json_list(given, tmp_path):
    from specbuild_runtime.serve.cli import serve_command

    options = [arg for value in given for arg in ("--allowed-origins", value)]
    assert serve_command.make_context("serve", [str(tmp_path), *options]).params["allowed_origins"] == (
        "http://localhost:3000", "*")


@pytest.mark.parametrize("origin", ["http://localhost:3000/", "localhost:3000", "http://LocalHost:3000", '["http://a.example", 1]'])
def test_an_allowed_origin_no_browser_sends_is_a_usage_error(origin, tmp_path):
    """A browser's Origin is scheme://host[:port] in lower case: one written otherwise would match no page, silently
    (parsed only here: nothing loads or serves)."""
    import click

    from specbuild_runtime.serve.cli import serve_command

    with pytest.raises(click.BadParameter, match="is not (an origin|a JSON list of origins)"):
        serve_command.make_context("serve", [str(tmp_path), "--allowed-origins", origin])
