"""Peers for `specbuild bench`, on the checkpoints the bundle was built from (the `bench` extra).

Each peer's decode speed is (tokens − 1) / (time of N tokens − time of 1 token), so prompt processing is
excluded the same way as for specbuild, and each peer's output is checked against the target's.
"""

from __future__ import annotations

import time

from specbuild_runtime.errors import SpecbuildError

KNOWN = ("transformers", "onnxruntime-genai")


def run_peers(peers: list[str], decoder, prompts: list[list[int]], max_new_tokens: int, gammas: list[int], baseline) -> list[dict]:
    unknown = set(peers) - set(KNOWN)
    if unknown:
        raise SpecbuildError(f"unknown peers {sorted(unknown)}; known: {', '.join(KNOWN)}")
    rows = []
    if "transformers" in peers:
        rows += _transformers(decoder, prompts, max_new_tokens, gammas)
    if "onnxruntime-genai" in peers:
        rows.append({"system": "onnxruntime-genai", "gamma": "-", "note": "not built yet in specbuild bench"})
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


def _transformers(decoder, prompts, max_new_tokens, gammas) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM

    engines = decoder.manifest.engines
    load = lambda role: AutoModelForCausalLM.from_pretrained(  # noqa: E731
        engines[role].source["path"], dtype=torch.float32, local_files_only=True
    ).eval()
    try:
        target, draft = load("target"), load("draft")
    except OSError as exc:
        raise SpecbuildError(f"transformers peer needs the bundle's source checkpoints: {exc}") from None
    eos = sorted(decoder.eos_token_ids)

    def generate(ids, n, **extra):
        x = torch.tensor([ids])
        with torch.no_grad():
            out = target.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n,
                                  eos_token_id=eos or None, pad_token_id=eos[0] if eos else 0, **extra)
        return out[0, len(ids):].tolist()

    speed, outputs = _timed_decode(generate, prompts, max_new_tokens)
    rows = [{"system": "transformers", "gamma": 0, "tokens_per_second": round(speed, 2), "outputs": outputs}]
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    for gamma in gammas:
        draft.generation_config.num_assistant_tokens = gamma
        speed, outputs = _timed_decode(lambda ids, n: generate(ids, n, assistant_model=draft), prompts, max_new_tokens)
        rows.append({"system": "transformers assisted", "gamma": gamma, "tokens_per_second": round(speed, 2), "outputs": outputs})
    return rows
