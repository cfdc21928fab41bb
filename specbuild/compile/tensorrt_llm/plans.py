"""The plans: γ (measure_gamma), build.sh and run.sh for the checkpoints, llm-api.yaml and vLLM's serve.sh for the
source folders (write_plans), and build.sh run where trtllm-build is on PATH (run_build)."""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path
from typing import Sequence

import numpy as np

from specbuild_runtime.manifest import TOKENIZER_DIR, EngineInfo

from ...errors import ExternalToolError
from .. import gamma as gamma_stage
from ..load import Checkpoint
from .checkpoint import DTYPES, FOLDER
from .families import LLM_API, NEWER_PYTORCH_BACKEND, VLLM
from .windows import attention_windows

VLLM_PLAN = "vllm/serve.sh"

# The tokens one engine step takes unless told otherwise: trtllm-build's --max_num_tokens (builder.py BuildConfig,
# 008b2b8d) and the LLM API's max_num_tokens (llmapi/llm_args.py BaseLlmArgs, 00043967). A longer prompt goes in
# chunks: trtllm-build leaves max_num_tokens below max_input_len when context FMHA is on, as
# --use_paged_context_fmha has it (_common.py check_max_num_tokens, 0fccc5b9), and the LLM API refuses a prompt
# past max_num_tokens unless chunked prefill is on (llmapi/llm.py _check_arguments).
MAX_NUM_TOKENS = 8192


def step_parameters(ckpt: Checkpoint) -> tuple[float, int]:
    """The parameters a one-token decoding step reads, and of them a mixture's experts' all told (0 for a dense
    model), as write_checkpoint's weight_bytes and expert_bytes count bytes: all but the embedding tables it gathers a
    row from (GPT-2's positions, and an untied token table; a tied one is read whole as the head), each expert's at
    top_k / experts (the serving engines' MoE kernels compute no other)."""
    gathered = ("wpe.weight",) if ckpt.spec.tie_word_embeddings else ("embed_tokens.weight", "wte.weight", "wpe.weight")
    sizes = {name: int(np.prod(ckpt.entries[name].shape)) for name in ckpt.weights() if not name.endswith(gathered)}
    experts = sum(size for name, size in sizes.items() if ".experts." in name)  # load.MIXTURES: experts.{e}.<proj>
    dense = sum(sizes.values()) - experts
    return (dense + experts * ckpt.spec.experts_per_token / ckpt.spec.experts if experts else dense), experts


def measure_gamma(folder: Path, engines: dict[str, EngineInfo], target: Checkpoint, draft: Checkpoint,
                  steps: dict[str, tuple[float, float]], max_seq_len: int, max_gamma: int, eos: list[int]) -> dict:
    """γ for the plans: α through the ONNX engines when fp32 ones were built, otherwise with transformers on
    CPU for pairs small enough; c from the weight bytes each step reads. Not c timed on this CPU: a GPU's
    step times are not its, and a timed c moved γ between identical builds (a pipeline caches the plans).
    steps: role -> (what a one-token step reads, of it a mixture's experts all told: write_checkpoint's
    weight_bytes and expert_bytes, or step_parameters); a mixture target's call costs the experts its rows chose."""
    byte_ratio = steps["draft"][0] / steps["target"][0]
    spec = target.spec
    call_cost, calls = ((gamma_stage.expert_call_cost(*steps["target"], spec.experts_per_token, spec.experts),
                         "; target call: the experts its gamma + 1 rows choose, each row routed independently and "
                         "uniformly") if spec.experts else (gamma_stage.flat, ""))
    prompt_ids = gamma_stage.prompts(target.tokenizer)
    alpha = gamma_stage.measure_with_engines(folder, engines, prompt_ids, max_seq_len, eos) if engines else None
    how = "the ONNX engines on this CPU"
    if alpha is None and target.parameters() + draft.parameters() <= gamma_stage.TRANSFORMERS_PARAMETER_LIMIT:
        how = "transformers on CPU"
        alpha = gamma_stage.measure_with_transformers(target.path, draft.path, prompt_ids, max_seq_len, eos,
                                                      target.token_ids())
    if alpha is None:
        return gamma_stage.recommend(None, byte_ratio, max_gamma, "not measured (pair too large to decode on "
                                     "this CPU, no fp32 ONNX engines, or a context too short for the measuring "
                                     "prompts): the bundle's max gamma")
    return gamma_stage.recommend(alpha, byte_ratio, max_gamma, f"alpha: {how}, greedy, packaged code prompts; "
                                 f"c: weight bytes read per step{calls}", call_cost)


def write_plans(folder: Path, gamma: int, tp: int, max_seq_len: int, precision: str,
                target: Checkpoint, draft: Checkpoint, eos: list[int], quantized: str = "",
                measured: bool = True, kinds: Sequence[str] = ("build", "run", LLM_API, VLLM)
                ) -> dict[str, str]:
    """kinds: the plans to write (build and run need the checkpoints; source_plans says which others serve the
    pair). quantized: the bundle's quantization ("the target int4 and ..."; "" for none), which the checkpoints
    ask trtllm-build for, or without checkpoints (--backend all) the ONNX engines hold; the plans that serve the
    source folders (LLM API, vLLM) do not get it. measured: whether α was measured, so that gamma is the pair's
    own rather than the bundle's max gamma."""
    origin = ("the gamma specbuild measured for this pair" if measured else
              "the bundle's max gamma: specbuild could not measure this pair's acceptance, see specbuild inspect")
    held = (f"this bundle's TensorRT-LLM checkpoints ask for {quantized} (trtllm-build\n# quantizes them)"
            if "build" in kinds else f"this bundle's ONNX engines hold {quantized}, and no TensorRT-LLM\n# checkpoints")
    unquantized = (f"# Not quantized: {held}, but this plan serves the source folders' float weights.\n"
                   if quantized else "")
    paths = {"build": f"{FOLDER}/build.sh", "run": f"{FOLDER}/run.sh", LLM_API: f"{FOLDER}/llm-api.yaml",
             VLLM: VLLM_PLAN}
    plans = {key: path for key, path in paths.items() if key in kinds}
    newer = sorted({NEWER_PYTORCH_BACKEND[c.spec.architecture] for c in (target, draft)
                    if c.spec.architecture in NEWER_PYTORCH_BACKEND})
    release = (f"# {' and '.join(newer)} needs a TensorRT-LLM release after 1.0.x, whose PyTorch backend has no "
               "model for it.\n") if newer else ""
    write = {
        "build": lambda: build_script(gamma, max_seq_len, precision, origin),
        "run": lambda: run_script(gamma, tp, max_seq_len, eos, target.tokenizer.eos_token_id,
                                  attention_windows(target, draft, max_seq_len)),
        LLM_API: lambda: llm_api_yaml(gamma, tp, max_seq_len, target.path.resolve(), draft.path.resolve(),
                                      release + unquantized),
        VLLM: lambda: vllm_script(gamma, tp, max_seq_len, DTYPES[precision][0], target, draft, unquantized, origin),
    }
    texts = {key: write[key]() for key in plans}
    for key, text in texts.items():
        path = folder / plans[key]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        if path.suffix == ".sh":
            path.chmod(0o755)
    return plans


def build_script(gamma: int, max_seq_len: int, precision: str,
                 origin: str = "the gamma specbuild measured for this pair") -> str:
    """Both trtllm-build commands (examples/draft_target_model/README.md): the target built to verify
    `gamma` external draft tokens per step. --gather_generation_logits on both: run.py's draft-target loop asserts
    that both engines were built with it when logits decide acceptance (examples/ngram/run_dtm_ngram.py, 77bcb5a5:
    the True that run.sh's --draft_target_model_config takes instead of False), reading it from the engine's own
    config (ModelRunnerCpp.gather_generation_logits, runtime/model_runner_cpp.py 03832911), not from a runtime
    option; examples/prompt_lookup/run_dtm_pld.py at c3a2348d asserted it when tokens decide (46ea5256 turned the
    test round). trtllm-build calls the option deprecated in favour of the runtime's --output_generation_logits
    on every build, given or not (commands/build.py 008b2b8d tests hasattr on an option parsed with a default),
    and still builds it into the engine (BuildConfig gather_generation_logits)."""
    note = ("# These checkpoints are float32: TensorRT-LLM's fused attention kernels take fp16 or bf16, so if\n"
            "# trtllm-build refuses them, compile again with --precision fp16 or bf16.\n") if precision == "fp32" else ""
    common = (f"--gemm_plugin auto --use_paged_context_fmha enable --gather_generation_logits "
              f'--max_batch_size "$MAX_BATCH_SIZE" --max_input_len {max_seq_len} --max_seq_len {max_seq_len}')
    return f"""#!/usr/bin/env bash
# Builds this bundle's TensorRT-LLM engines for draft-target speculative decoding (written by specbuild).
# Needs TensorRT-LLM (trtllm-build) and an NVIDIA GPU. Engines go to engines/draft and engines/target here;
# the target verifies up to {gamma} draft tokens a step ({origin}).
# trtllm-build warns that --gather_generation_logits is deprecated on every build, given or not; run.py's
# draft-target loop reads it from both engines when logits decide acceptance (run.sh's False set to True).
{note}set -euo pipefail
cd "$(dirname "$0")"
MAX_BATCH_SIZE="${{MAX_BATCH_SIZE:-1}}"
trtllm-build --checkpoint_dir draft --output_dir engines/draft {common}
trtllm-build --checkpoint_dir target --output_dir engines/target {common} \\
  --speculative_decoding_mode draft_tokens_external --max_draft_len {gamma}
"""


def run_script(gamma: int, tp: int, max_seq_len: int, eos: list[int], tokenizer_eos: int | None,
               windows: list[int] | None = None) -> str:
    """examples/run.py's draft-target mode (examples/draft_target_model/README.md): [draft_len, draft GPUs,
    target GPUs, use_logits]; each device list is as long as that engine's tp. run.py starts both engines
    itself (ModelRunnerCpp in orchestrator mode, examples/run_dtm_pld.py), so no mpirun. Its draft-target loop
    (examples/ngram/run_dtm_ngram.py) hands ModelRunnerCpp.from_dir a max_input_len of prompt + max_output_len,
    to which from_dir adds max_output_len again and asserts the sum fits the engine's max_seq_len
    (tensorrt_llm/runtime/model_runner_cpp.py), and each target call asks for γ + 1 tokens after up to
    prompt + max_output_len - 1 (ModelRunnerCpp._check_inputs): the output must be at least γ, and prompt + twice
    the output at most max_seq_len. The default output, a quarter of max_seq_len (at least γ, at most 128),
    leaves the prompt half of it; --max_input_length says so to run.py, which otherwise keeps the first 923
    tokens of a prompt (examples/run.py parse_input) however many fit. --no_prompt_template: run.py otherwise wraps
    the text of some families (Qwen2ForCausalLM: examples/utils.py DEFAULT_PROMPT_TEMPLATES) in a chat
    template, so the engines would continue another prompt than the one given, as specbuild does not.

    eos: the bundle's eos ids. run.py ends a request at one id, --end_id (default: the tokenizer's eos, read
    from tokenizer/): its draft-target loop (examples/ngram/run_dtm_ngram.py, run_dtm_pld.py before) stops a
    request only at that id or its length, and checks --stop_words within each target call, not between
    rounds ("TODO: Check bad words and stop words criteria"), so no flag stops it at a second id (Llama 3.1
    Instruct's generation_config lists 128001, 128008 and 128009): the script says which id ends it and
    which others it runs past. (run.py reads `if args.end_id`, so an END_ID of 0 falls back to the tokenizer's.)

    Past MAX_NUM_TOKENS, --enable_chunked_context: the engines take that many tokens a step, and run.py hands the
    flag to both runners (examples/ngram/run_dtm_ngram.py, 77bcb5a5).

    windows: the per-layer attention windows (attention_windows), as --max_attention_window_size, which run.py
    hands both runners alike (run_dtm_ngram.py's common_runner_kwargs and common_generaion_kwargs)."""
    devices = "[" + ",".join(map(str, range(tp))) + "]"
    window_flag = "" if windows is None else f"  --max_attention_window_size {' '.join(map(str, windows))} \\\n"
    chunked = " --enable_chunked_context" if max_seq_len > MAX_NUM_TOKENS else ""
    output = min(128, max(gamma, max_seq_len // 4))
    end_id = tokenizer_eos if tokenizer_eos in eos else eos[0] if eos else None
    others = [e for e in eos if e != end_id]
    which = "the tokenizer's eos" if end_id == tokenizer_eos else "generation_config.json's first eos"
    stops = "" if end_id is None else (
        f"# run.py ends the output at one token id, END_ID (default {end_id}, {which}).\n" + (
            f"# The target also ends at {', '.join(map(str, others))} (its generation_config.json), which run.py's "
            "draft-target\n# loop does not stop at (its --stop_words cut one target call short, and the next round "
            "goes on):\n# the output runs on past the first of them until END_ID or --max_output_len; cut it "
            "there.\n" if others else ""))
    return f"""#!/usr/bin/env bash
# Runs the engines build.sh made with TensorRT-LLM's examples/run.py in draft-target mode (written by
# specbuild): the draft proposes {gamma} tokens, the target accepts those equal to its own greedy tokens.
# Usage: TRTLLM_DIR=/path/to/TensorRT-LLM ./run.sh "def fibonacci(n):"
# run.py's draft-target loop needs prompt + 2 x MAX_OUTPUT_LEN <= {max_seq_len} (the engines' max_seq_len) and
# MAX_OUTPUT_LEN >= {gamma}; it keeps the first --max_input_length tokens of a prompt, which this script sets
# to what fits: {max_seq_len - 2 * output} with the default MAX_OUTPUT_LEN, {output}.
{stops}set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
: "${{TRTLLM_DIR:?set TRTLLM_DIR to a TensorRT-LLM source checkout (for examples/run.py)}}"
output="${{MAX_OUTPUT_LEN:-{output}}}"
if (( output < {gamma} || 2 * output >= {max_seq_len} )); then
  echo "run.sh: MAX_OUTPUT_LEN $output leaves run.py no room; give one from {gamma} to {(max_seq_len - 1) // 2}" >&2
  exit 2
fi
python3 "$TRTLLM_DIR/examples/run.py" \\
  --engine_dir "$here/engines/target" --draft_engine_dir "$here/engines/draft" \\
  --tokenizer_dir "$here/../{TOKENIZER_DIR}" \\
  --draft_target_model_config "[{gamma},{devices},{devices},False]" \\
  --kv_cache_enable_block_reuse --kv_cache_free_gpu_memory_fraction 0.4 --no_prompt_template{chunked} \\
  --max_output_len "$output" --max_input_length "$(({max_seq_len} - 2 * output))" \\
{window_flag}  --input_text "${{1:-def fibonacci(n):}}"{
  "" if end_id is None else f' --end_id "${{END_ID:-{end_id}}}"'}
"""


def llm_api_yaml(gamma: int, tp: int, max_seq_len: int, target: Path, draft: Path, note: str = "") -> str:
    """TensorRT-LLM 1.x's LLM API / trtllm-serve on the PyTorch backend, which runs draft-target from the
    Hugging Face folders (docs/source/features/speculative-decoding.md), to the bundle's context as the other
    plans are. On main, speculative_config is a pydantic union told apart by decoding_type, whose tag for
    draft-target is "Draft_Target" (llmapi/llm_args.py DraftTargetDecodingConfig and SpeculativeConfig, 00043967;
    the docs site's latest build, from 69de4a6, the same); llm_args.py maps no other spelling to it (it declares a
    _decoding_type_alias that nothing in it sets). Releases up to 1.2.1 read the YAML through
    update_llm_args_with_extra_dict, which hands speculative_config to DecodingBaseConfig.from_dict, whose table
    names the class "DraftTarget" and refuses any other name (the docs site's 1.0.0/, 1.2.0/ and
    1.2.1/_modules/tensorrt_llm/llmapi/llm_args.html, built from ae8270b, dbdb13b and 376f7e1); 1.0.0's
    DecodingBaseConfig has speculative_model_dir and no speculative_model. The YAML takes the releases' spelling:
    pip installs the latest release, not a pre-release."""
    chunked = "enable_chunked_prefill: true\n" if max_seq_len > MAX_NUM_TOKENS else ""
    return f"""# TensorRT-LLM LLM API options for draft-target speculative decoding (written by specbuild).
# The PyTorch backend reads the source Hugging Face folders, not this bundle's checkpoints:
#   trtllm-serve {shlex.quote(str(target))} --backend pytorch --extra_llm_api_options llm-api.yaml
# (newer releases also call the option --config), or in Python: LLM(model=..., **yaml.safe_load(...)).
# decoding_type DraftTarget is the spelling of the releases up to 1.2.1 (DecodingBaseConfig.from_dict);
# TensorRT-LLM's main branch (and pre-releases built from it) knows only Draft_Target: with it, write
# decoding_type: Draft_Target. With 1.0.x write speculative_model_dir for speculative_model.
{note}tensor_parallel_size: {tp}
max_seq_len: {max_seq_len}
{chunked}disable_overlap_scheduler: true
speculative_config:
  decoding_type: DraftTarget
  max_draft_len: {gamma}
  speculative_model: {json.dumps(str(draft))}
"""


def vllm_script(gamma: int, tp: int, max_seq_len: int, dtype: str, target: Checkpoint, draft: Checkpoint,
                note: str = "", origin: str = "the gamma specbuild measured for this pair") -> str:
    """vLLM's draft-model speculation (vllm/config/speculative.py SpeculativeConfig: method "draft_model",
    num_speculative_tokens; docs features/speculative_decoding/draft_model.md). V1 gained it with
    vllm-project/vllm#24322, after v0.13.0 (which still refused draft models).

    A model whose layers mix sliding-window and full attention (Gemma 2 and 3, OLMo 3) gets a KV cache group per
    kind from vLLM's hybrid KV cache manager (v1/core/kv_cache_utils.py), and its draft path asserts "All drafting
    layers should belong to the same kv cache group" (SpecDecodeBaseProposer; vllm-project/vllm#33133, #49112:
    gemma-3-1b with gemma-3-270m fails so; #33318, which lifted it, was closed unmerged). With the manager
    disabled, unify_hybrid_kv_cache_specs keeps every layer's cache whole in one group (its test in
    tests/v1/core/test_kv_cache_utils.py, "full + sliding, but disable_hybrid_kv_cache_manager"); the sliding
    layers still attend within their windows. Such a pair's script disables it."""
    config = json.dumps({"model": str(draft.path.resolve()), "num_speculative_tokens": gamma, "method": "draft_model"})
    warning = note
    if target.spec.shape.vocab_size != draft.spec.shape.vocab_size:
        warning += (f"# The pair's embedding tables differ ({target.spec.shape.vocab_size} vs "
                   f"{draft.spec.shape.vocab_size} rows): vLLM's draft_model method\n# requires equal sizes "
                   "(SpeculativeConfig.verify_equal_vocab_size_if_draft_model) and will refuse them.\n")
    hybrid = ""
    if any(len({window is None for window in c.spec.sliding_windows}) > 1 for c in (target, draft)):
        warning += ("# The pair mixes sliding-window and full-attention layers: vLLM's draft path takes a model's "
                    "layers in one KV\n# cache group, which --disable-hybrid-kv-cache-manager makes (each layer's "
                    "cache kept whole; the\n# sliding layers still attend within their windows).\n")
        hybrid = " --disable-hybrid-kv-cache-manager"
    return f"""#!/usr/bin/env bash
# Serves the pair with vLLM's draft-model speculative decoding (written by specbuild): {gamma} speculative
# tokens ({origin}), tensor parallelism {tp}, on the source Hugging Face folders.
# Needs a vLLM release whose --speculative-config takes "method": "draft_model" (after v0.13.0).
{warning}set -euo pipefail
exec vllm serve {shlex.quote(str(target.path.resolve()))} --tensor-parallel-size {tp} --dtype {dtype} \\
  --max-model-len {max_seq_len}{hybrid} --speculative-config {shlex.quote(config)} "$@"
"""


def run_build(script: Path) -> str:
    """Runs build.sh (trtllm-build is on PATH); the engines land in the bundle, beside the checkpoints."""
    result = subprocess.run(["bash", str(script)], capture_output=True, text=True)
    if result.returncode:
        last = (result.stderr.strip() or result.stdout.strip() or "no output").splitlines()[-1]
        raise ExternalToolError(f"trtllm-build failed (exit {result.returncode}) running {script.name}: {last}; "
                                "compile again with --backend onnx, or fix TensorRT-LLM and rerun")
    return f"{FOLDER}/engines"
