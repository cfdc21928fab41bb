"""The stage "checking each engine" (pipeline.STAGES): load, and where the CPU can, run every graph the
compile wrote, and the sampler, before the bundle is published."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from specbuild_runtime.engine import ort, session_options
from specbuild_runtime.errors import SpecbuildError, first_line
from specbuild_runtime.manifest import EngineInfo, cache_names

from ..errors import CheckpointError
from ..progress import steps
from .graphs import unprocessed
from .graphs.verification import NOT_FINITE


def check_engines(folder: Path, engines: dict[str, EngineInfo], sampler: str, max_seq_len: int) -> None:
    """check_engine for every graph of every engine in folder, then check_sampler for the sampler (if written)."""
    graphs = [(file, info) for info in engines.values() for file in (info.file, info.greedy_file, info.steps_file) if file]
    # each one loaded and, fp32, run (a quantized engine's engine graph alone: check_engine): at 7B, seconds to a
    # minute apiece
    for file, info in steps(graphs, "checking the engines' graphs", "graph"):
        check_engine(folder / file, info, max_seq_len, run=info.quantization == "none" or file == info.file)
    if sampler:
        check_sampler(folder / sampler, engines["target"].shape.vocab_size)


def check_engine(path: Path, info: EngineInfo, max_seq_len: int, run: bool = True) -> None:
    """Prove the engine loads, and runs, before the bundle is published: onnxruntime's CPU provider loads
    an fp32 or fp16 engine graph (a kernel for every node, every weight where the file says), and (run) runs an
    fp32 one (quantized or not) for a one-token prefill fed as specbuild_runtime.manifest's I/O contract
    says (the greedy-only graph: the inputs it has).
    A bf16 engine passed the ONNX checker when it was written; the CPU provider cannot even load it.

    A quantized engine runs its engine graph alone (run False for the others); its greedy-only and steps graphs, the
    same layers over the same weights with another head or a loop around them, are loaded. Without prepacking (below),
    each MatMulNBits call dequantizes its whole weight to fp32 for an fp32 Gemm, so a run costs a dequantization of
    the model: 1.8-3 s for a Qwen3-0.6B-shaped int8 or int4 target on this 2-core machine at load 2, 5 s at load 5,
    where an fp32 run reads the mapped weights in place (2 s for all five graphs); skipping the two roughly halved
    the check (docs/compile-at-scale.md). Their runs proved the weights and kernels again, but not what only they
    hold: the greedy-only graph's argmax tail and the steps graph's later steps, each fed the token before. The same
    code builds them for an unquantized engine, whose graphs every fp32 compile runs, and
    test_a_quantized_pairs_greedy_only_and_steps_graphs_decode_as_its_engine_graphs runs them quantized; a fault only
    a quantized bundle's run of them shows ships, to a GPU, where the draft's steps graph is the default. Prepacking
    made a quantized run faster (a 0.6B target's greedy-only graph: int8 2.75 -> 2.05 s, int4 3.27 -> 1.93 s, medians
    of 3 interleaved, load 10-17; peak +0.06 GB) but keeps a packed copy of every weight at once (docs/performance.md:
    1.0x the weights when decoding), not measured at 7B, so it stays off. The largest of the fp32 copies, the LM
    head's (0.6 GB at 0.6B, 2.2 GB at 7B), is the check's peak memory, as before.

    fp16 engines are loaded, not run. The CPU provider has no fp16 (or bf16) Gemm: it casts
    each weight to fp32 on its way through, and onnxruntime keeps most of those casts alive at once
    (measured: a 1.2 GB fp16 engine peaked at 3.6 GB, 2.2 GB in priority order), beyond the compile's
    memory bound. They are for GPUs; the test suite decodes small fp16 bundles end to end. Graph
    optimizations are off, so loading maps the weights without reading them (and does not fold an fp32
    copy of every fp16 weight), and so is prepacking, which copies every weight into the kernels' own
    layout: worth it for the thousands of calls of decoding, not for one.
    """
    if info.precision == "bf16":
        return
    options = session_options()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.add_session_config_entry("session.disable_prepacking", "1")
    shape, vocab = info.shape, info.shape.vocab_size
    try:
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        if info.precision != "fp32" or not run:
            return
        cache = np.zeros((1, shape.num_kv_heads, max_seq_len, shape.head_dim), np.float32)
        feeds = {
            "input_ids": np.zeros((1, 1), np.int64), "seqlens_k": np.zeros(1, np.int32), "total_len": np.array(1, np.int32),
            "num_drafts": np.array(0, np.int64), "temperature": np.array(0, np.float32), "top_k": np.array(0, np.int64),
            "top_p": np.array(1, np.float32), "min_p": np.array(0, np.float32),
            "draft_probs": np.zeros((0, vocab), np.float32), "uniforms": np.zeros(1, np.float32),
            "long_rope": np.array(0, np.int64), **unprocessed(vocab),
            **{past: cache for past, _ in cache_names(shape.num_layers)},
        }
        feeds.update({i.name: np.array(1 + int(i.name.split(".")[1]), np.int32) for i in session.get_inputs()
                      if i.name.startswith("total_len.")})  # a steps graph's later steps
        steps = any(o.name == "drafts" for o in session.get_outputs())
        outputs = session.run(["drafts"] if steps else ["accepted", "next_token"],
                              {i.name: feeds[i.name] for i in session.get_inputs()})
    except Exception as exc:  # onnxruntime raises its own untyped errors
        raise SpecbuildError(f"the {info.role} engine {path.name} was written but fails to load or run ({first_line(exc)}); "
                             "this is a specbuild bug, please report it") from None
    tokens = outputs[0].tolist() if steps else [int(outputs[1])]
    if NOT_FINITE in tokens:
        raise CheckpointError(f"the {info.role} engine {path.name} computes logits that are NaN or infinite for a one-token "
                              f"prompt: the {info.role} checkpoint's numbers overflow {info.precision}; check it with "
                              "transformers")
    if (not steps and outputs[0] != 0) or not all(0 <= token < vocab for token in tokens):
        said = f"drafts={tokens}" if steps else f"accepted={outputs[0]}, next_token={outputs[1]}"
        raise SpecbuildError(f"the {info.role} engine {path.name} returned {said} for a one-token prefill; this is a "
                             "specbuild bug, please report it")


def check_sampler(path: Path, vocab: int) -> None:
    """Prove the sampler runs before the bundle is published: one call judging a draft of token 0 that the
    target gives no mass (rejected), then drawing from the rest."""
    logits = np.zeros((2, vocab), np.float32)
    logits[:, 0] = -np.inf
    feeds = {"logits": logits, "input_ids": np.zeros((1, 2), np.int64), "num_drafts": np.array(1, np.int64),
             "temperature": np.array(1, np.float32), "top_k": np.array(0, np.int64), "top_p": np.array(1, np.float32),
             "min_p": np.array(0, np.float32), "draft_probs": np.eye(1, vocab, dtype=np.float32),
             "uniforms": np.full(2, 0.5, np.float32), **unprocessed(vocab)}
    try:
        session = ort.InferenceSession(str(path), session_options(), providers=["CPUExecutionProvider"])
        accepted, next_token = session.run(["accepted", "next_token"], feeds)
    except Exception as exc:  # onnxruntime raises its own untyped errors
        raise SpecbuildError(f"the sampler {path.name} was written but fails to load or run ({first_line(exc)}); "
                             "this is a specbuild bug, please report it") from None
    if accepted != 0 or not 0 < next_token < vocab:
        raise SpecbuildError(f"the sampler {path.name} returned accepted={accepted}, next_token={next_token} for a "
                             "draft without mass; this is a specbuild bug, please report it")
