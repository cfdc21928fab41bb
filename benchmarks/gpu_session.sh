#!/usr/bin/env bash
# Issue 12's GPU checks in four device calls (each under the 10-minute limit of one call), for a session
# that is lent the GPU machine. It expects onnxruntime-gpu unpacked in /tmp/site and the wheels installed,
# as ../shared/gpu/README.md describes (its 4th command); $OUT gets summary.txt and gpu-session.tgz. The call that runs
# `check` also carries .gpu/extra: the project's onnx-ir (the machine's predates ir.save(alignment=...), which
# compile needs) and the serve extra with the openai client (for the GPU server test), made here with
#   python3 -m pip download -q --no-deps -d .gpu/extra onnx-ir
#   python3 -m pip download -q -d .gpu/extra --python-version 3.12 --only-binary=:all: --platform manylinux2014_x86_64 \
#       --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 starlette uvicorn prometheus-client openai httpx
#   python3 -m pip download -q --no-deps -d .gpu/extra --python-version 3.12 --only-binary=:all: \
#       --platform manylinux_2_31_x86_64 llguidance==1.9.1   # the runtime's structured outputs import it
#
# A session now gets ~15 minutes of the machine in all (setup ~60-100 s of it): check, pairs and graphs
# fit; peers only if a session has more. The machine goes back after ~30 s without a call, and a fresh one
# needs the four setup calls again: read results between calls quickly, or queue the next call first.
# Times below were measured on the H100 (2026-11-24) where given as ~N s. On an H200 (2026-11-26) setup took
# ~40 s and `quick` 247 s (check 122, pairs 66, graphs 49), before the GPU tests, `graphs` (one-shot generate,
# kernels) and bench's warm-up (three passes with CUDA graphs) grew. On an H100 (2026-11-26) the setup calls
# 1-3 took under a second each and call 4 (unpacking, installs, `check`) 274 s, its GPU tests 170 s.
#
#   bash benchmarks/gpu_session.sh check   # versions; GroupQueryAttention alone (each kernel switch too,
#                                          # if it fails); pytest -m gpu (exactness, copies, threads,
#                                          # CUDA graphs, the draft's steps graph)                  ~150 s
#   bash benchmarks/gpu_session.sh pairs   # a TinyLlama-shape fp16 layer pair (benchmarks/layer_pair.py):
#                                          # bench --device cuda at agreement scale 0.1 (SCALES=0.1,0.2,0.4
#                                          # for three: ~350 s); verify it against transformers      ~150 s
#   bash benchmarks/gpu_session.sh graphs  # on that pair, one call, most telling first: bench with CUDA
#                                          # graphs, with and without the draft's steps graph; one-shot
#                                          # generate with and without them; sampling (temperature 0.8,
#                                          # γ 2, 4) with and without them; auto against target-only and
#                                          # forced rounds (as in quick); the target's MatMuls alone
#                                          # (benchmarks/gpu_matmuls.py); its kernels (gpu_kernels.py);
#                                          # bench and verify uncaptured                           ~5-8 min
#   bash benchmarks/gpu_session.sh options # on that pair: the MatMuls under TunableOp, the kernels with
#                                          # cuDNN's attention (off by default), the pair in int4 (uncaptured
#                                          # and with CUDA graphs)                                  ~4 min
#   bash benchmarks/gpu_session.sh splits  # on that pair: calls over a cache fed total_len = the bucket that
#                                          # holds them (SPECBUILD_GPU_TOTAL_LEN=bucket: 256, 512, 1024 or 2048)
#                                          # against max_seq_len (the default): GroupQueryAttention alone, the
#                                          # kernels, bench at contexts 64 and 1024 (at 64 one flash split
#                                          # instead of 4: no memsets or combine), then GPU tests fed so
#                                          #                                           ~2 min + ~3 min
#   bash benchmarks/gpu_session.sh serve   # on that pair: `specbuild serve --device cuda`, 1 and 4 slots, with and
#                                          # without CUDA graphs (captured calls take turns across slots; the
#                                          # first requests pay each thread's captures), 16 streaming clients,
#                                          # every answer checked (benchmarks/serve_load.py)       ~2-3 min
#   bash benchmarks/gpu_session.sh big     # the 70% goal at the size users run: a Llama-3.1-8B-shape fp16 layer
#                                          # pair (16 GB target; ~38 GB of disk) benched with CUDA graphs on 4
#                                          # prompts, and its kernels (after `check`: its onnx-ir)  ~4-6 min
#   bash benchmarks/gpu_session.sh peers   # on that pair: transformers (eager, static cache + compile,
#                                          # assisted), onnxruntime-genai's CUDA build               ~235 s
#   bash benchmarks/gpu_session.sh quick   # check, pairs and graphs' first half (bench with CUDA graphs and
#                                          # the steps graph, one-shot generate, sampled with CUDA graphs,
#                                          # the sampler alone: benchmarks/gpu_sampler.py; auto against
#                                          # target-only greedy and at T 0.8: auto_ab.py, ~50 s; a grammar's
#                                          # forced rounds and their q push: gpu_forced.py, ~20 s) in
#                                          # one call (timeout_s 600; whatever it wrote comes back if cut)  ~6-7 min
#
# For a 15-minute session: the setup, `quick` (~6-7 min), then on the same warm machine `splits` (~5 min) and
# `peers` or `graphs` with what is left (timeout_s: the budget left minus ~30 s; a call cut at its limit brings
# back the steps it finished). On the H100 (2026-11-27) setup + `quick` took 329 s of the call, `big` 187 s,
# `serve` 65 s and `options` 107 s (benchmarks/h100-2026-11-27): those four are measured; `splits` ran once, fed
# rows + 1, in 178 s (since replaced by buckets; benchmarks/h100-2026-11-27-2); `peers` and `graphs`' second half (the 1.1B kernels with
# cuDNN's attention off, the default) are not measured on the H100.
#
# A failing step is logged and the next one still runs: one call must bring back as much as it can.
set -uo pipefail
cd "$(dirname "$0")/.."
# Results gather in $out, and after every step $OUT gets summary.txt and all of $out as gpu-session.tgz: a
# call brings back only a few files from $OUT, and a call cut at its time limit keeps what it had.
dest=${OUT:-/tmp/gpu-session}
work=${GPU_SESSION_WORK:-/tmp/gpu-session-work}
out=$work/${1:-none}
mkdir -p "$dest" "$out"
export PYTHONPATH=/tmp/site:$PWD/runtime:$PWD
pairs=/tmp/pairs  # outlives a call while the machine is kept; $OUT starts empty in every call
# `pairs`' 1.1B target checkpoint (TinyLlama's shape, later layers x0.1, logits of std 8: layer_pair.py) and its bundle
target="$pairs/tinyllama-1.1b-x0.1-logits8"
bundle="$pairs/tinyllama-1.1b-x0.1-logits8-first2-fp16"
prompts8="$out/prompts8.jsonl"
head -n 8 specbuild/prompts/code.jsonl > "$prompts8"
step() {  # step NAME SECONDS COMMAND...: run it for at most SECONDS, log to $out/NAME.log, one summary line
    local name=$1 limit=$2 started=$SECONDS status
    shift 2
    # SIGINT at the limit, not timeout's SIGTERM: pytest then prints which tests failed and writes its junit
    # report (killed by SIGTERM it leaves neither: a hang in the last GPU test lost every result before it),
    # Python commands unwind (compile cleans up); SIGKILL 20 s later if the command still runs
    timeout -s INT -k 20 "$limit" "$@" > "$out/$name.log" 2>&1
    status=$?
    echo "$name: exit $status in $((SECONDS - started)) s: $(tail -n 1 "$out/$name.log")" | tee -a "$dest/summary.txt"
    tar czf "$dest/.gpu-session.tgz" -C "$work" . && mv "$dest/.gpu-session.tgz" "$dest/gpu-session.tgz"
}

needs_cuda() {  # every mode runs on the setup's onnxruntime-gpu: without it (a fresh machine, the setup not run),
    # check's GPU tests all skip (and the attention tests' three switches rerun them) and pairs writes and compiles a
    # 1.1B pair before bench refuses --device cuda: minutes of the machine for nothing
    if ! python3 -c "import onnxruntime as o, sys; sys.exit('CUDAExecutionProvider' not in o.get_available_providers())" 2>/dev/null; then
        echo "$1: no CUDA provider in onnxruntime: a fresh machine? run the setup of ../shared/gpu/README.md first" | tee -a "$dest/summary.txt"
        exit 3
    fi
}

needs_pairs() {  # graphs, options and peers build on the setup and `pairs` of the same machine
    needs_cuda "$1"
    if [ ! -f "$bundle/manifest.json" ]; then
        echo "$1: a fresh machine or no pairs yet: run the setup and \`pairs\` (or \`quick\`) first" | tee -a "$dest/summary.txt"
        exit 3
    fi
}

case "${1:-}" in
check)
    needs_cuda check
    if [ ! -d .gpu/extra ]; then  # without the project's onnx-ir every compile fails: nothing below would tell
        echo "no .gpu/extra: carry it with this call (see the top of this file)" | tee -a "$dest/summary.txt"
        exit 3
    fi
    python3 -m pip install -q --upgrade --no-deps --no-index --find-links .gpu/extra onnx-ir
    python3 -m pip install -q --no-index --find-links .gpu/extra starlette uvicorn prometheus-client openai httpx
    python3 -m pip install -q --no-deps --no-index --find-links .gpu/extra llguidance
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
    step versions 60 python3 -c "import onnxruntime as o, torch, transformers; o.preload_dlls(); print(o.__version__, o.get_available_providers(), 'torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
    # onnxruntime-gpu lists TensorrtExecutionProvider: are TensorRT's libraries there to back it (a route to
    # faster GEMMs than cuBLAS picks)? Not yet looked at.
    step tensorrt 30 bash -c 'ldconfig -p | grep -E "libnvinfer|libnvonnxparser" || echo "no TensorRT libraries in ldconfig"; \
        python3 -c "import tensorrt; print(\"tensorrt\", tensorrt.__version__)" 2>&1 | tail -n 1'
    # The kernel first: which attention implementations get multi-row calls over a cache right.
    step attention 60 python3 -m pytest -m gpu tests/test_attention.py
    # The kernel switches only when the default fails: each costs ~17 s of the machine.
    if ! grep -q " passed" "$out/attention.log" || grep -qE "[0-9]+ (failed|error)" "$out/attention.log"; then
        # (cuDNN's SDPA is off already: engine.choose_attention_kernels)
        for switch in ORT_DISABLE_FLASH_ATTENTION=1 ORT_DISABLE_MEMORY_EFFICIENT_ATTENTION=1 ORT_DISABLE_FLASH_DECODE=1; do
            step "attention-${switch%%=*}" 60 env "$switch" ORT_ENABLE_ATTENTION_KERNEL_DEBUG_INFO=1 python3 -m pytest -m gpu tests/test_attention.py
        done
    fi
    # Some of these failed only at times on the H100 (2026-11-26, cuDNN's SDPA then on): a failure rerun alone
    # that passes is not a pass.
    step gpu-tests 300 python3 -m pytest -m gpu tests/test_gpu.py --junitxml="$out/gpu-tests.xml"
    ;;
pairs)
    needs_cuda pairs
    # 1.1B target (TinyLlama's shape), draft = its first 2 layers; scale 0.1 (α ~0.6) unless SCALES says more.
    # Benched uncaptured (the baseline of what CUDA graphs save: `graphs` benches them); verify as a user runs
    # it, with CUDA graphs (the default on CUDA for fp16 Llama bundles since 2026-11-26).
    step pairs 420 python3 benchmarks/layer_pair.py --scratch "$pairs" --scales "${SCALES:-0.1}" --precision fp16 --device cuda \
        --gamma 1,2,4,8 -n 128 --json "$out/pairs.json" --no-cuda-graphs
    cp "$pairs"/*.log "$out/" 2>/dev/null
    # fp16 against transformers fp16 on the same GPU; a divergence line says where each leaves fp32 (quick:
    # left out, the H100 run has it).
    [ -z "${QUICK:-}" ] && step verify 150 python3 -m specbuild verify "$bundle" --target "$target" \
        --prompts "$prompts8" -n 64 --device cuda
    ;;
graphs)
    needs_pairs graphs
    # Needs `pairs` first on the same machine (see peers). Under CUDA graphs, the draft's steps graph against
    # a call per draft token (issue 12: γ draft steps in one call; quick: steps only, the H200 measured both),
    # then the rest.
    unless_quick() { [ -n "${QUICK:-}" ] || echo "$@"; }
    for steps in --draft-steps $(unless_quick --no-draft-steps); do
        step "bench-cuda-graphs$steps" 150 python3 -m specbuild bench "$bundle" --device cuda -n 128 --gamma 1,2,4,8 \
            --prompts "$prompts8" --json "$out/bench-cuda-graphs$steps.json" --cuda-graphs $steps
    done
    # One request in a fresh process, as `generate` runs: what its captures cost it (CUDA graphs are the
    # default since 2026-11-26; a shape is captured at its third call), against --no-cuda-graphs.
    for graphs in --cuda-graphs --no-cuda-graphs; do
        step "generate$graphs" 60 python3 -m specbuild generate "$bundle" --device cuda -n 128 --json $graphs \
            --prompt "$(head -n 1 "$prompts8" | python3 -c 'import json, sys; print(json.load(sys.stdin)["prompt"])')"
    done
    # Sampling: under CUDA graphs the bundle's sampler runs after each captured call, uncaptured. The pair's
    # logits are peaked since 2026-11-26 (layer_pair.py --logit-std), so its sampled α says something now.
    for graphs in --cuda-graphs $(unless_quick --no-cuda-graphs); do
        step "sampled$graphs" 100 python3 -m specbuild bench "$bundle" --device cuda \
            -n 64 --gamma 2,4 --temperature 0.8 --prompts "$prompts8" --json "$out/sampled$graphs.json" $graphs
    done
    # The sampler alone at 32k and 152k vocabularies: blocked running sums against onnxruntime's quadratic
    # CUDA CumSum, top-p's 1024 candidates (2026-11-26, not yet run on a GPU; its placement: pytest -m gpu)
    step sampler 60 python3 benchmarks/gpu_sampler.py --device cuda --json "$out/sampler.json"
    # Auto against target-only, greedy and at temperature 0.8 (benchmarks/auto_ab.py: a decoder a mode, whole requests
    # taking turns; target-only twice, the A/A whose spread is the noise; the summary line is auto's): auto's "never
    # below target-only" since its catch-up pricing (policy.Costs.draft_call) and its probes waiting for a request's
    # start (2026-11-28, measured on the CPU only). ~25 s each, not yet run.
    for t in 0 0.8; do
        step "auto-ab-t$t" 90 python3 benchmarks/auto_ab.py --bundle "$bundle" --device cuda --modes 0,0,auto --runs 3 \
            --max-new-tokens 64 --temperature "$t" --json "$out/auto-ab.json"
    done
    # A grammar's forced runs then drafts, sampled at γ 3: ms a round, each forced round's push of the whole q buffer
    # (slot.Slot.propose_certain: max γ x V floats, 1 MB at this pair's 32k vocabulary) timed apart, and the push
    # alone at a 152k vocabulary (4.9 MB): what pushing the forced rows alone would save (docs/not-tested.md). ~20 s,
    # not yet run.
    step forced 60 python3 benchmarks/gpu_forced.py "$bundle" --device cuda --runs 2 -n 48 --json "$out/forced.json"
    [ -n "${QUICK:-}" ] && exit 0  # quick: the rest another time
    # Where a CUDA-graph target call's time goes: its MatMuls alone against the copy rate.
    step matmuls 120 python3 benchmarks/gpu_matmuls.py --shape tinyllama-1.1b --rows 1,5,9 --json "$out/matmuls.json"
    # The target call kernel by kernel (GEMMs, attention, norms, elementwise, idle between kernels).
    step kernels 90 python3 benchmarks/gpu_kernels.py "$bundle" -n 64 --json "$out/kernels.json"
    step bench-plain 150 python3 -m specbuild bench "$bundle" --device cuda -n 128 --gamma 1,2,4 --prompts "$prompts8" \
        --json "$out/bench-plain.json" --no-cuda-graphs
    step verify-uncaptured 100 python3 -m specbuild verify "$bundle" --target "$target" \
        --prompts "$prompts8" -n 64 --device cuda --no-cuda-graphs
    ;;
options)
    needs_pairs options
    # Needs `pairs` first on the same machine. What might make a target call faster than the H200's 1.64 ms
    # (GEMMs 0.84 of it at 64% of the copy rate): none of it run yet.
    # Whether onnxruntime's TunableOp finds faster GEMMs at these shapes (not yet run).
    step matmuls-tunable 120 python3 benchmarks/gpu_matmuls.py --shape tinyllama-1.1b --rows 9 --json "$out/matmuls-tunable.json" \
        --cuda-option tunable_op_enable=1 --cuda-option tunable_op_tuning_enable=1
    # What switching cuDNN's SDPA off (engine.choose_attention_kernels, 2026-11-26: token 0 at times on an H100)
    # cost: the kernels with it on (GroupQueryAttention took 0.22 ms a call in 5 kernels a layer on the H200 with it).
    step kernels-cudnn 90 env ORT_ENABLE_CUDNN_FLASH_ATTENTION=1 python3 benchmarks/gpu_kernels.py "$bundle" -n 64 \
        --json "$out/kernels-cudnn.json"
    # Fewer bytes than the fp16 GEMMs read: the same pair with int4 weights (MatMulNBits), compiled there
    # (layer_pair benches it uncaptured), then with CUDA graphs. Not yet run.
    step int4-pair 300 python3 benchmarks/layer_pair.py --scratch "$pairs" --scales 0.1 --precision fp16 --quantize int4 \
        --device cuda --gamma 4 -n 128 --prompts "$prompts8" --json "$out/int4-pair.json"
    cp "$pairs"/*int4*.log "$out/" 2>/dev/null  # its compile and bench logs: the step's own says only where they are
    step int4-cuda-graphs 120 python3 -m specbuild bench "$bundle-int4" --device cuda -n 128 \
        --gamma 4 --prompts "$prompts8" --json "$out/int4-cuda-graphs.json" --cuda-graphs
    # On the H100 (2026-11-27) int4 ran at 9% of the bandwidth, slower than fp16 (2.62 against 1.80 ms a call):
    # MatMulNBits' default kernels at 9 rows. onnxruntime 1.31.1's CUDA library also carries TensorRT-LLM's
    # weight-only GEMM/GEMV for it (fpA_intB: fp16/bf16, 4 or 8 bits, block 32-128, zero points allowed, SM 75+),
    # off unless ORT_FPA_INTB_GEMM is set (read in the library's strings and onnxruntime's source). Not yet run.
    step int4-fpa-intb 150 env ORT_FPA_INTB_GEMM=1 python3 -m specbuild bench "$bundle-int4" --device cuda -n 128 \
        --gamma 4 --prompts "$prompts8" --json "$out/int4-fpa-intb.json" --cuda-graphs
    ;;
splits)
    needs_pairs splits
    # Needs `pairs` first on the same machine. onnxruntime sizes flash attention's split-KV launch by the total_len
    # it reads on the host: at max_seq_len 2048 it splits each layer 4 ways (2 memsets and a combine kernel a layer).
    # Fed the call's rows + 1 (H100, 2026-11-27) it did not split and a target-only call took 1.729 ms instead of
    # 1.827, but decoded wrong: no less than the real length will do (slot.fed_total_len). Fed the bucket that
    # holds the call (slot.GPU_TOTAL_LEN), it should not split up to 256 keys. Correct first (the kernel alone,
    # captured too, a graph per bucket), then each way on the same machine: the kernels, and bench (its target
    # step at context 64 should lose the split, at 1024 keep 4). Bucket not yet run.
    step attention-bucket 60 python3 -m pytest -m gpu tests/test_attention.py -k "bucket"
    for fed in max bucket; do
        step "kernels-fed-$fed" 90 env SPECBUILD_GPU_TOTAL_LEN=$fed python3 benchmarks/gpu_kernels.py "$bundle" -n 64 \
            --json "$out/kernels-fed-$fed.json"
        step "bench-fed-$fed" 120 env SPECBUILD_GPU_TOTAL_LEN=$fed python3 -m specbuild bench "$bundle" --device cuda \
            -n 128 --gamma 4 --prompts "$prompts8" --json "$out/bench-fed-$fed.json" --cuda-graphs
    done
    # Last (a call cut at its limit keeps the steps above): the GPU tests that hold tokens to transformers' and
    # replays to uncaptured calls, every call over a cache fed its bucket (their bundles' max_seq_len 256: buckets of
    # 32, 64, 128 and 256).
    step gpu-tests-bucket 240 env SPECBUILD_GPU_TOTAL_LEN=bucket python3 -m pytest -m gpu tests/test_gpu.py \
        -k "verify_on_cuda or decode_the_tokens_of_uncaptured or replay_the_tokens or steps_graph_drafts" \
        --junitxml="$out/gpu-tests-bucket.xml"
    ;;
serve)
    needs_pairs serve
    # Each setting asks for CUDA graphs or not (the server's default now depends on --parallel). On the H100
    # (2026-11-27: h100-2026-11-27/3-serve-*) their lock across 4 slots cost more than the replays saved.
    step serve-load 300 python3 benchmarks/serve_load.py throughput "$bundle" --device cuda --parallel 1,4 --cuda-graphs on,off \
        --clients 16 --prompts 24 --requests 48 --max-tokens 64 --rounds 1 --json "$out/serve-load.json"
    ;;
big)
    needs_cuda big
    if ! python3 -c "import inspect, onnx_ir; assert 'alignment' in inspect.signature(onnx_ir.save).parameters" 2>/dev/null; then
        echo "big: compile needs the project's onnx-ir: run \`check\` first on this machine" | tee -a "$dest/summary.txt"
        exit 3
    fi
    # ~38 GB: the 8B checkpoints (19 GB, kept by layer_pair for a next run) and the bundle (19 GB).
    free_gb=$(df --output=avail -BG /tmp | tail -n 1 | tr -dc 0-9)
    echo "big: ${free_gb} GB free in /tmp" | tee -a "$dest/summary.txt"
    if [ "$free_gb" -lt 42 ]; then
        rm -rf "$target" "$pairs"/tinyllama-1.1b-first2-logits* "$bundle-int4"  # the 1.1B checkpoints (verify's), its int4 bundle
        free_gb=$(df --output=avail -BG /tmp | tail -n 1 | tr -dc 0-9)
        [ "$free_gb" -lt 42 ] && { echo "big: only ${free_gb} GB free in /tmp: not started" | tee -a "$dest/summary.txt"; exit 3; }
    fi
    # Does the target's share of the copy rate grow with size (fixed costs a call: ~0.3 ms of gaps between 347
    # kernels, attention, norms; the H200's 1.1B GEMMs ran at 64%, the gate/up ones at 86%)? Not yet run. Here
    # the 8B's checkpoints took 73 s to write and its compile 53 s (2 cores, 1.6 GB peak).
    big=/tmp/big
    head -n 4 "$prompts8" > "$out/prompts4.jsonl"
    step big-pair 360 python3 benchmarks/layer_pair.py --scratch "$big" --shape llama-3.1-8b --scales 0.1 --precision fp16 \
        --device cuda --gamma 4 -n 64 --prompts "$out/prompts4.jsonl" --json "$out/big-pair.json"
    cp "$big"/*.log "$out/" 2>/dev/null
    # Kernel by kernel (GEMMs by kind among them: gpu_matmuls.py would repeat that at this size).
    step big-kernels 140 python3 benchmarks/gpu_kernels.py "$big/llama-3.1-8b-x0.1-logits8-first2-fp16" -n 32 --json "$out/big-kernels.json"
    ;;
peers)
    needs_pairs peers
    # Needs `pairs` first on the same machine (it is kept ~30 s between calls; a fresh one needs the setup
    # and `pairs` again). transformers eager decodes ~30 tok/s at this size: 8 prompts.
    step transformers 280 python3 -m specbuild bench "$bundle" --device cuda -n 64 \
        --gamma 2,4 --peers transformers --prompts "$prompts8" --json "$out/transformers.json"
    step genai 280 python3 -m specbuild bench "$bundle" --device cuda -n 128 --gamma 2,4 \
        --peers onnxruntime-genai --json "$out/genai.json"
    ;;
step)
    # One command as the modes run theirs (a log, a summary line, the tarball in $OUT), e.g. one of issue 12's:
    #   bash benchmarks/gpu_session.sh step NAME SECONDS python3 -m specbuild bench ...
    [ $# -ge 4 ] || { echo "usage: $0 step NAME SECONDS COMMAND..." >&2; exit 2; }
    step "$2" "$3" "${@:4}"
    ;;
quick)
    export QUICK=1
    bash "$PWD/benchmarks/gpu_session.sh" check  # cd'ed to the repository root above
    # check refused (no setup, no .gpu/extra): pairs would fail too, after writing and compiling the 1.1B pair
    [ $? -eq 3 ] && exit 3
    bash "$PWD/benchmarks/gpu_session.sh" pairs
    bash "$PWD/benchmarks/gpu_session.sh" graphs
    ;;
*)
    echo "usage: $0 check|pairs|graphs|options|splits|serve|big|peers|quick|step   (see the top of this file)" >&2
    exit 2
    ;;
esac
