"""`specbuild verify`: decode greedily with the bundle and with transformers; report the first divergence."""

from __future__ import annotations

from pathlib import Path

from .errors import CheckpointError
from .texts import read_prompts


def transformers_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_token_ids: list[int], **options) -> list[int]:
    """transformers' greedy generate (options: e.g. assistant_model for assisted generation)."""
    import torch

    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
            eos_token_id=eos_token_ids or None, pad_token_id=eos_token_ids[0] if eos_token_ids else 0, **options,
        )
    return out[0, len(prompt_ids):].tolist()


def load_reference(path: Path, role: str = "target"):
    """A checkpoint as transformers runs it, fp32: safetensors only (never unpickled), local files only,
    no remote code."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()  # a bar per load on stderr, where a pipeline reads one-line errors
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, use_safetensors=True,
                                                     local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{role} checkpoint {path} cannot be loaded from safetensors ({reason}); specbuild "
                              "never unpickles weights: re-save it with `save_pretrained(dir, safe_serialization=True)`") from None
    return model.eval()


def verify_bundle(bundle: Path, target: Path, prompts_file: Path, max_new_tokens: int, gamma: int | str,
                  device: str = "cpu") -> dict:
    """device: where the bundle runs; transformers runs on the CPU in fp32."""
    from specbuild_runtime import SpeculativeDecoder

    prompts = read_prompts(prompts_file)
    decoder = SpeculativeDecoder(bundle, device=device, shared_thread_pool=True)
    model = load_reference(target)
    eos = sorted(decoder.eos_token_ids)
    tokens = 0
    for index, prompt in enumerate(prompts):
        prompt_ids = decoder.encode(prompt)
        ours = decoder.generate(prompt_ids, max_new_tokens, gamma).token_ids
        theirs = transformers_greedy(model, prompt_ids, max_new_tokens, eos)
        if ours != theirs:
            position = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
            return {
                "identical": False, "prompts": len(prompts), "tokens": tokens,
                "divergence": {
                    "prompt_index": index, "prompt": prompt, "position": position,
                    "bundle_token": ours[position] if position < len(ours) else None,
                    "transformers_token": theirs[position] if position < len(theirs) else None,
                },
            }
        tokens += len(ours)
    return {"identical": True, "prompts": len(prompts), "tokens": tokens}
