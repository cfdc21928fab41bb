"""The stage "measuring quantized engines" (pipeline.STAGES): what quantization cost each quantized engine,
measured against an fp32 engine of the same checkpoint; the pipeline puts each report in the manifest."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx

from specbuild_runtime.engine import Engine
from specbuild_runtime.slot import AS_FED, NEVER_ALONE, EngineSlot
from specbuild_runtime.manifest import EngineInfo, can_run

from ..acceptance import rounds, until_eos
from ..progress import bar
from ..texts import corpus_files, measuring_prompts, read_source
from .export import export_engine
from .gamma import draft_agreement
from .precision import Numerics

QUALITY_HELDOUT_TOKENS = 4096
HELDOUT_WINDOW = 512  # tokens per teacher-forced window, each from an empty cache
# Positions per call when scoring a text: each row of a call cost ~6 MB of peak memory at a 152k vocabulary (about
# ten [V] fp32 rows, across the two engines), so 512-token windows scored whole took a compile's peak from 1.9 to
# 4.4 GB; in calls of 64 rows the report stays under the engine check's peak (a Qwen3-0.6B-shaped pair, 2026-11-27).
SCORED_ROWS = 64
# The report runs an fp32 engine of the same checkpoint beside the quantized one (written to the
# compile's scratch folder) and decodes a few hundred tokens with each on the CPU: up to this size, that
# takes a minute or so within the compile's memory bound; larger models get {"skipped": why} instead.
QUALITY_MAX_REFERENCE_BYTES = 256 << 20
QualityTexts = tuple[list[list[int]], list[int]]  # code prompts, held-out token ids


def measure_quality(folder: Path, scratch: Path, engines: dict[str, EngineInfo], checkpoints: dict,
                    max_seq_len: int, texts: QualityTexts, eos_token_ids: list[int]) -> dict[str, dict]:
    """Each quantized engine's quality report by role (see quality_report), against an fp32 engine of the
    same checkpoint written to scratch; with it, if the whole pair is small enough to decode here, the
    pair's acceptance with and without quantization under "alpha" (acceptance_change)."""
    prompts, heldout = texts
    reports, references = {}, {}
    for role, info in engines.items():
        if info.quantization == "none":
            continue
        too_large = _too_large_to_measure(info)
        if too_large:
            reports[role] = {"skipped": too_large}
            continue
        # the rows the engine has, reading the target's ids past them as it does
        references[role] = export_engine(checkpoints[role], role, scratch, max_seq_len, Numerics(),
                                         vocab_size=engines["target"].shape.vocab_size, tokens=info.shape.vocab_size,
                                         rope_switch=info.rope_switch_length)
        reports[role] = quality_report(scratch, references[role], folder, info, prompts, heldout)
    if not references:
        return reports
    too_large = next(filter(None, map(_too_large_to_measure, engines.values())), None)
    if too_large:  # measuring α decodes with both engines: a large target would take hours on the CPU
        alphas = {role: {"skipped": f"the pair's other engine: {too_large}"} for role in references}
    else:
        alphas = acceptance_change(folder, engines, scratch, references, prompts, eos_token_ids)
    for role, alpha in alphas.items():
        reports[role]["alpha"] = alpha
    return reports


def _too_large_to_measure(info: EngineInfo) -> str | None:
    """Why an engine is not decoded for a report, if it is not."""
    if not can_run(info):
        return f"a {info.precision} engine does not run on this runtime's CPU provider"
    if 4 * info.parameters > QUALITY_MAX_REFERENCE_BYTES:
        return (f"its fp32 reference would be {4 * info.parameters / 1e9:.2f} GB; reports are measured up to "
                f"{QUALITY_MAX_REFERENCE_BYTES / 1e9:.2f} GB")
    return None


def acceptance_change(folder: Path, engines: dict[str, EngineInfo], reference: Path, fp32: dict[str, EngineInfo],
                      prompts: list[list[int]], eos_token_ids: list[int]) -> dict[str, dict]:
    """For each measured role, the pair's greedy acceptance α with and without quantization of that role's
    engine (the other engine as built): what quantization did to the speed-up. fp32: the measured roles'
    fp32 engines, in the folder `reference`; eos_token_ids: the bundle's, where its requests end."""
    built = pair_acceptance(folder, engines["target"], folder, engines["draft"], prompts, eos_token_ids,
                            desc="measuring the pair's α as built")
    change = {}
    for role in fp32:
        other = "draft" if role == "target" else "target"
        places = {role: (reference, fp32[role]), other: (folder, engines[other])}
        before = pair_acceptance(*places["target"], *places["draft"], prompts, eos_token_ids,
                                 desc=f"measuring the pair's α with an fp32 {role}")
        change[role] = {"gamma": ALPHA_GAMMA, "fp32": before, "quant": built}
    return change


def quality_texts(tokenizer) -> QualityTexts:
    """Code prompts shipped with specbuild, and held-out Python source (the demo pair never trains on it)."""
    prompts = [tokenizer(p)["input_ids"] for p in measuring_prompts()]
    heldout: list[int] = []
    for path in corpus_files()[1]:
        heldout += tokenizer(read_source(path))["input_ids"]
        if len(heldout) >= QUALITY_HELDOUT_TOKENS:
            break
    return prompts, heldout[:QUALITY_HELDOUT_TOKENS]


def quality_report(
    fp32_folder: Path,
    fp32_info: EngineInfo,
    quant_folder: Path,
    quant_info: EngineInfo,
    prompts_ids: list[list[int]],
    heldout_ids: list[int],
    new_tokens: int = 64,
) -> dict:
    """Size, held-out perplexity, greedy agreement and decode speed of `quant` next to `fp32`.

    perplexity: teacher-forced over heldout_ids in windows of HELDOUT_WINDOW tokens (or max_seq_len if
        shorter; each window from an empty cache, SCORED_ROWS positions per call; its first token is context only).
    heldout_top1_agreement: share of held-out positions where both engines' argmax agree.
    greedy_agreement: per prompt, the first `new_tokens` greedy tokens of each engine compared position
        by position (free running: after the first divergence the two continue from different text),
        averaged over prompts; greedy_identical_prompts counts prompts with identical continuations.
    teacher_forced_agreement: the quantized engine's argmax along the fp32 engine's continuation
        (does not compound divergences).
    tokens_per_second: greedy decode of `new_tokens` tokens, prompt excluded, median over prompts.
    """
    ref, max_seq_len = logits_engine(Path(fp32_folder), fp32_info)
    quant, _ = logits_engine(Path(quant_folder), quant_info)

    report = {"new_tokens": new_tokens, "prompts": len(prompts_ids), "heldout_tokens": len(heldout_ids)}
    nll = {"fp32": [], "quant": []}
    same_top1 = []
    window = min(max_seq_len, HELDOUT_WINDOW)
    windows = range(0, max(len(heldout_ids) - 1, 0), window)
    # most of a compile that measures: the engines against fp32 took 50 s of 81 (the whole report 74) for a
    # 54M-parameter target on 2 cores (2026-11-26)
    progress = bar(len(windows) + len(prompts_ids), f"measuring the {quant_info.role} engine against fp32", "text")
    with progress:
        for start in windows:
            chunk = heldout_ids[start:start + window]
            if len(chunk) < 2:
                break
            argmaxes = []
            for key, engine in (("fp32", ref), ("quant", quant)):
                argmax = []
                for first, logits in every_logit(engine, chunk):
                    logits = logits[:len(chunk) - 1 - first]  # predictions of chunk[1:]: the last token is context only
                    nll[key].extend(_nll(logits, chunk[first + 1:first + 1 + len(logits)]))
                    argmax.append(logits.argmax(-1))
                argmaxes.append(np.concatenate(argmax))
            same_top1.extend(argmaxes[0] == argmaxes[1])
            progress.update()

        agreement, identical, teacher_forced, speeds = [], 0, [], {"fp32": [], "quant": []}
        for prompt in prompts_ids:
            budget = min(new_tokens, max_seq_len - len(prompt) + 1)
            if budget < 1:  # a prompt longer than the context: the report counts only the prompts it decoded
                report["prompts"] -= 1
                progress.update()
                continue
            ref_tokens, ref_speed = _greedy(ref, prompt, budget)
            quant_tokens, quant_speed = _greedy(quant, prompt, budget)
            speeds["fp32"].append(ref_speed)
            speeds["quant"].append(quant_speed)
            agreement.append(float(np.mean(np.asarray(ref_tokens) == np.asarray(quant_tokens))))
            identical += ref_tokens == quant_tokens
            if len(prompt) + budget - 1 <= max_seq_len:
                along = np.concatenate([logits.argmax(-1) for _, logits in every_logit(quant, prompt + ref_tokens[:-1])])
                teacher_forced.extend(along[len(prompt) - 1:] == np.asarray(ref_tokens))
            progress.update()  # after the prompt's work: before it, the bar read 100% while the last one decoded

    for key, folder, info in (("fp32", fp32_folder, fp32_info), ("quant", quant_folder, quant_info)):
        folder = Path(folder)
        report[key] = {
            "precision": info.precision,
            "quantization": info.quantization,
            "bytes_on_disk": sum((folder / name).stat().st_size for name in (info.file, f"{info.file}.data")
                                 if (folder / name).exists()),
            "perplexity": float(np.exp(np.mean(nll[key]))) if nll[key] else None,
            "tokens_per_second": float(np.median(speeds[key])) if speeds[key] else None,
        }
    report["size_ratio"] = report["quant"]["bytes_on_disk"] / report["fp32"]["bytes_on_disk"]
    report["heldout_top1_agreement"] = float(np.mean(same_top1)) if same_top1 else None
    report["greedy_agreement"] = float(np.mean(agreement)) if agreement else None
    report["greedy_identical_prompts"] = int(identical)
    report["teacher_forced_agreement"] = float(np.mean(teacher_forced)) if teacher_forced else None
    return report


ALPHA_GAMMA = 4  # drafts per round at which a quality report measures acceptance


def pair_acceptance(target_folder: Path, target: EngineInfo, draft_folder: Path, draft: EngineInfo,
                    prompts_ids: list[list[int]], eos_token_ids: list[int], gamma: int = ALPHA_GAMMA,
                    new_tokens: int = 64, desc: str = "measuring the pair's α") -> float | None:
    """Greedy speculative acceptance α (accepted / drafted) of this pair at a fixed γ, exactly as decoding
    would see it: the rounds of γ drafts along the target's own greedy continuation (gamma.draft_agreement),
    up to the round whose tokens reach one of eos_token_ids. None when no prompt leaves room to draft."""
    target_engine, _ = logits_engine(Path(target_folder), target)
    draft_engine, _ = logits_engine(Path(draft_folder), draft)
    stops = set(eos_token_ids)
    accepted = drafted = 0
    agreements, continuations = draft_agreement(target_engine, draft_engine, prompts_ids, new_tokens, desc)
    for agree, tokens in zip(agreements, continuations):
        # The runtime ends a request at its first eos: counting the rounds after it measured text no request
        # decodes (the agreement past it still counts, as the round that emits the eos drafts past it).
        a, d = rounds(agree, gamma, end=len(until_eos(tokens, stops)))
        accepted, drafted = accepted + a, drafted + d
    # Nothing drafted is no measurement: an α of 0 would say the draft is useless (as gamma.py's α, None).
    return accepted / drafted if drafted else None


def logits_engine(folder: Path, info: EngineInfo) -> tuple[EngineSlot, int]:
    """An engine file run as the runtime decodes with it (a target's rows never alone), its calls leaving the
    fp32 logits [D+1, V] they decide on (read after a step with .logits()), and its max_seq_len."""
    path = folder / info.file
    model = onnx.load(str(path), load_external_data=False)
    max_seq_len = next(i for i in model.graph.input if i.name.startswith("past_key.")).type.tensor_type.shape.dim[2].dim_value
    engine = EngineSlot(Engine(path, info, max_seq_len), NEVER_ALONE if info.role == "target" else AS_FED)
    engine.read_logits(True)
    return engine, max_seq_len


def _nll(logits: np.ndarray, targets: list[int]) -> list[float]:
    """-log softmax(logits)[target] per row, in float64 (logits: one call's, at most SCORED_ROWS rows: see every_logit)."""
    block = logits.astype(np.float64)
    block -= block.max(axis=-1, keepdims=True)
    log_z = np.log(np.exp(block).sum(axis=-1))
    return list(log_z - block[np.arange(len(block)), targets])


def every_logit(engine: EngineSlot, ids: list[int]) -> Iterator[tuple[int, np.ndarray]]:
    """(first, the fp32 logits [rows, V] at positions first, first + 1, ...) covering every position of ids from an
    empty cache, SCORED_ROWS positions per call over the cache the calls before wrote: the memory of one call,
    whatever len(ids). Grouped as decode's _score groups a prompt's calls (EngineSlot.scoring_calls), so each row
    has the bits the runtime decodes and scores it with."""
    for first, end in engine.scoring_calls(0, len(ids), SCORED_ROWS):
        engine.step(ids[first:end], total_len=end, num_drafts=end - first - 1)
        yield first, engine.logits()


def _greedy(engine: EngineSlot, prompt: list[int], count: int) -> tuple[list[int], float]:
    """count greedy tokens after prompt, and the decode speed (tokens/s after the first token)."""
    tokens = [engine.step(prompt, total_len=len(prompt))[1]]
    first = time.perf_counter()
    while len(tokens) < count:
        tokens.append(engine.step([tokens[-1]], total_len=len(prompt) + len(tokens))[1])
    elapsed = time.perf_counter() - first
    return tokens, (len(tokens) - 1) / elapsed if len(tokens) > 1 else 0.0
