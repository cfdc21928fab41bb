"""`specbuild verify`: decode greedily with the bundle and with transformers; report the first divergence."""

from __future__ import annotations

from pathlib import Path

from .compile.load import checkpoint_digest
from .compile.reference import load_reference, recorded_source, transformers_greedy
from .errors import CheckpointError
from .progress import note, steps
from .texts import read_prompts


def first_difference(ours: list[int], theirs: list[int]) -> int | None:
    """The first position where two outputs differ (one ending early counts), None if equal."""
    if ours == theirs:
        return None
    return next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))


def verify_bundle(bundle: Path, target: Path | None, prompts_file: Path, max_new_tokens: int, gamma: int | str,
                  device: str = "cpu", cuda_graphs: bool | None = None, draft_steps: bool | None = None) -> dict:
    """The bundle against transformers on the same device, in the target engine's float type (a quantized
    engine's too), on every prompt; target None: the checkpoint the manifest records, if unchanged
    (reference.recorded_source). `divergences` lists each prompt that differs (`divergence` is the
    first). In half precision each also says where, on that prompt, the bundle and transformers in that
    precision each leave transformers fp32's output: rounding noise diverges late and alike, a bug early."""
    from specbuild_runtime import SpeculativeDecoder

    prompts = read_prompts(prompts_file)
    with note(f"loading the bundle {bundle}"):  # every file's digest checked, every engine's session made
        decoder = SpeculativeDecoder(bundle, device=device, shared_thread_pool=True, cuda_graphs=cuda_graphs,
                                     draft_steps=draft_steps)
    encoded = [decoder.encode(prompt) for prompt in prompts]
    for index, prompt_ids in enumerate(encoded):  # all checked before loading the model and decoding
        if len(prompt_ids) > decoder.max_seq_len:
            raise CheckpointError(f"prompt {index + 1} of {prompts_file} has {len(prompt_ids)} tokens, more than the "
                                  f"bundle's context of {decoder.max_seq_len}; shorten it")
    decoder.request(encoded[0], 1, gamma)  # and --gamma (at most the bundle's maximum), not after the model loaded
    engine = decoder.manifest.engines["target"]
    recorded = target is None
    if recorded:  # gone or changed: said before decoding
        with note(f"reading the checkpoint {engine.source['path']} (sha256)"):
            target = recorded_source(engine, "target", "--target")
    # The bundle decodes every prompt first and is let go before transformers loads: the two at once held both
    # models (16.5 GB resident verifying a Llama-3.2-1B-shaped fp32 bundle, 8.8 GB one after the other).
    new_tokens, ours = [], []
    for prompt_ids in steps(encoded, "decoding with the bundle", "prompt"):
        # The bundle stops where its context is full, its last token needing no place in the cache (a prompt
        # that fills the context still gets one, as generate gives it); transformers is held to the same length.
        new_tokens.append(min(max_new_tokens, decoder.max_seq_len - len(prompt_ids) + 1))
        ours.append(decoder.generate(prompt_ids, new_tokens[-1], gamma).token_ids)
    device, eos = decoder.device, sorted(decoder.eos_token_ids)
    del decoder
    with note(f"loading the target checkpoint in transformers ({engine.precision})"):
        model = load_reference(target, device=device, precision=engine.precision)
    precision = engine.precision
    rows = model.get_input_embeddings().num_embeddings
    if rows < engine.shape.vocab_size:
        raise CheckpointError(f"target checkpoint {target} has {rows} embedding rows but the bundle's vocabulary has "
                              f"{engine.shape.vocab_size} tokens: it is not the model this bundle was compiled from; "
                              f"pass --target {engine.source['path']}")
    tokens, divergences, theirs_by_prompt = 0, [], {}  # transformers' tokens where they diverge, by prompt index
    for index, (prompt, prompt_ids) in steps(list(enumerate(zip(prompts, encoded))), "decoding with transformers",
                                             "prompt"):
        theirs = transformers_greedy(model, prompt_ids, new_tokens[index], eos)
        position = first_difference(ours[index], theirs)
        if position is None:
            tokens += len(ours[index])
            continue
        divergences.append({
            "prompt_index": index, "prompt": prompt, "position": position,
            "bundle_token": ours[index][position] if position < len(ours[index]) else None,
            "transformers_token": theirs[position] if position < len(theirs) else None,
        })
        theirs_by_prompt[index] = theirs
    if divergences and precision != "fp32":
        del model  # its memory, before the fp32 copy loads
        with note("loading the target checkpoint in transformers (fp32)"):
            fp32 = load_reference(target, device=device)
        for d in steps(divergences, "decoding the diverging prompts with transformers in fp32", "prompt"):
            # Held to the bundle's context as the other two are: past it a GPT-2 runs out of positions, and
            # any model's longer output would count as one leaving the shorter ones at their end.
            index = d["prompt_index"]
            reference = transformers_greedy(fp32, encoded[index], new_tokens[index], eos)
            d.update(transformers_vs_fp32=first_difference(theirs_by_prompt[index], reference),
                     bundle_vs_fp32=first_difference(ours[index], reference))
    # recorded_source compared the digest already: reading every weight again (seconds a GB) would say the same
    same_source = recorded
    if not recorded:
        with note(f"reading the checkpoint {target} (sha256)"):
            same_source = checkpoint_digest(target, "target") == engine.source["sha256"]
    report = {"identical": not divergences, "prompts": len(prompts), "tokens": tokens, "device": device,
              "precision": precision, "quantization": engine.quantization, "same_source": same_source}
    if divergences:
        report.update(divergence=divergences[0], divergences=divergences)
    return report
