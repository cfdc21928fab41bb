"""Peers for `specbuild bench`, on the checkpoints the bundle was built from (the `bench` extra).

Each peer's decode speed is (tokens − 1) / (time of N tokens − time of 1 token), so prompt processing is
excluded the same way as for specbuild, and each peer's output is checked against the target's.
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from specbuild_runtime.errors import SpecbuildError

KNOWN = ("transformers", "onnxruntime-genai")


def run_peers(peers: list[str], decoder, prompts: list[list[int]], max_new_tokens: int, gammas: list[int], baseline) -> list[dict]:
    """peers: names from KNOWN (the CLI checks them)."""
    rows = []
    if "transformers" in peers:
        rows += _transformers(decoder, prompts, max_new_tokens, gammas)
    if "onnxruntime-genai" in peers:
        rows += _onnxruntime_genai(decoder, prompts, max_new_tokens, gammas)
    for row in rows:
        outputs = row.pop("outputs", None)
        if outputs is not None:
            row["matches_target"] = outputs == baseline.outputs
            if row.get("tokens_per_second"):
                row["speedup"] = round(row["tokens_per_second"] / baseline.tokens_per_second, 3)
    return rows


def _timed_decode(generate, prompts, max_new_tokens):
    """Decode tokens/s with the prompt excluded, and the outputs."""
    tokens, seconds, outputs = 0, 0.0, []
    generate(prompts[0], 4)  # warm-up
    for ids in prompts:
        start = time.perf_counter()
        generate(ids, 1)
        first = time.perf_counter() - start
        start = time.perf_counter()
        out = generate(ids, max_new_tokens)
        seconds += time.perf_counter() - start - first
        tokens += len(out) - 1
        outputs.append(out)
    return tokens / max(seconds, 1e-9), outputs


def peer_precision(decoder) -> str:
    """The float type peers run in: the bundle's on a GPU; fp32 on the CPU, where the bundle's half-precision
    engines compute in fp32 too and half precision is not how anyone runs transformers."""
    return decoder.manifest.engines["target"].precision if decoder.device == "cuda" else "fp32"


def _transformers(decoder, prompts, max_new_tokens, gammas) -> list[dict]:
    """Eager transformers on the bench's device and, on a GPU, also with a static cache, which transformers'
    generate then compiles (torch.compile, mode reduce-overhead: CUDA graphs); it does so on GPUs only."""
    from transformers import StaticCache

    from ..reference import load_reference, recorded_source, transformers_greedy

    engines, device, precision = decoder.manifest.engines, decoder.device, peer_precision(decoder)
    target, draft = (load_reference(recorded_source(engines[role], role), role, device, precision) for role in ("target", "draft"))
    eos = sorted(decoder.eos_token_ids)
    speed, outputs = _timed_decode(lambda ids, n: transformers_greedy(target, ids, n, eos), prompts, max_new_tokens)
    rows = [{"system": "transformers", "gamma": 0, "tokens_per_second": round(speed, 2), "outputs": outputs}]
    if device == "cuda":
        length = max(map(len, prompts)) + max_new_tokens  # one cache shape for every call: compiled once

        def static(ids, n):
            return transformers_greedy(target, ids, n, eos, past_key_values=StaticCache(config=target.config, max_cache_len=length))

        speed, outputs = _timed_decode(static, prompts, max_new_tokens)
        rows.append({"system": "transformers static+compile", "gamma": 0, "tokens_per_second": round(speed, 2), "outputs": outputs})
    for gamma in gammas:
        fixed_gamma(draft, gamma)
        speed, outputs = _timed_decode(lambda ids, n: transformers_greedy(target, ids, n, eos, assistant_model=draft),
                                       prompts, max_new_tokens)
        rows.append({"system": "transformers assisted", "gamma": gamma, "tokens_per_second": round(speed, 2), "outputs": outputs})
    return rows


def fixed_gamma(draft, gamma: int) -> None:
    """Make transformers' assisted generation draft exactly gamma tokens a round, like the other rows:
    a constant schedule, and no confidence threshold (transformers' default 0.4 stops drafting early)."""
    config = draft.generation_config
    config.num_assistant_tokens_schedule = "constant"
    config.num_assistant_tokens = gamma
    config.assistant_confidence_threshold = 0.0  # 0 turns it off; None would mean the default


def _onnxruntime_genai(decoder, prompts, max_new_tokens, gammas) -> list[dict]:
    """onnxruntime-genai on the bench's device, in peer_precision: its model builder on the source
    checkpoints, then target-only and its draft-model speculative decoding with max_draft_tokens = γ. (On a
    GPU this needs onnxruntime-genai's CUDA build, onnxruntime-genai-cuda.)"""
    try:
        import onnxruntime_genai as og
    except ImportError:
        raise SpecbuildError("the onnxruntime-genai peer needs `pip install onnxruntime-genai`") from None
    from ..reference import recorded_source

    engines, precision = decoder.manifest.engines, peer_precision(decoder)
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        for role in ("target", "draft"):
            source = recorded_source(engines[role], role)  # safetensors: its builder would fall back to unpickling *.bin
            built = subprocess.run(
                [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(source),
                 "-o", str(work / role), "-p", precision, "-e", decoder.device], capture_output=True, text=True)
            if built.returncode:
                raise SpecbuildError(f"onnxruntime-genai's model builder failed on the {role}: {built.stderr.strip()[-300:]}")
        # Its builder takes the checkpoint's eos ids; the bundle's add the tokenizer's (compile.load.eos_token_ids),
        # and a peer that ran past one would decode other lengths than the rows it is timed beside.
        genai_config = work / "target" / "genai_config.json"
        config = json.loads(genai_config.read_bytes())
        config["model"]["eos_token_id"] = sorted(decoder.eos_token_ids)
        genai_config.write_text(json.dumps(config, indent=1))

        def generator_for(folder: Path):
            model = og.Model(str(folder))

            def generate(ids, n):
                params = og.GeneratorParams(model)
                params.set_search_options(max_length=len(ids) + n, do_sample=False)
                generator = og.Generator(model, params)
                generator.append_tokens(ids)
                while not generator.is_done():
                    generator.generate_next_token()
                return [int(t) for t in generator.get_sequence(0)[len(ids):]]

            return generate

        speed, outputs = _timed_decode(generator_for(work / "target"), prompts, max_new_tokens)
        rows = [{"system": "onnxruntime-genai", "gamma": 0, "tokens_per_second": round(speed, 2), "outputs": outputs}]
        # Its speculative config: the target's, typed "speculative", with the draft's decoder block;
        # every model file must sit inside the config's folder.
        speculative = work / "speculative"
        shutil.copytree(work / "target", speculative)
        shutil.copytree(work / "draft", speculative / "draft")
        draft_decoder = json.loads((work / "draft" / "genai_config.json").read_bytes())["model"]["decoder"]
        for gamma in gammas:
            spec = copy.deepcopy(config)
            spec["model"]["type"] = "speculative"
            spec["model"]["draft"] = {**draft_decoder, "filename": "draft/" + draft_decoder["filename"]}
            spec["speculative"] = {"max_draft_tokens": gamma}
            (speculative / "genai_config.json").write_text(json.dumps(spec, indent=1))
            speed, outputs = _timed_decode(generator_for(speculative), prompts, max_new_tokens)
            rows.append({"system": "onnxruntime-genai speculative", "gamma": gamma,
                         "tokens_per_second": round(speed, 2), "outputs": outputs})
    return rows
