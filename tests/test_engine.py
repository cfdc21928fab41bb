"""Device choice: a clear line for every device that cannot be used, never a silent fallback to the CPU."""

import os
import re
import subprocess
import sys
from dataclasses import replace

import onnxruntime as ort
import pytest

from specbuild.compile import compile_bundle
from specbuild.recipe import CompileSettings
from specbuild_runtime import BundleError, DeviceError, SpeculativeDecoder

HAS_CUDA = "CUDAExecutionProvider" in ort.get_available_providers()


def test_an_unknown_device_names_the_choices(bundles):
    with pytest.raises(DeviceError, match="'gpu' is not one of cpu, cuda, auto"):
        SpeculativeDecoder(bundles("llama", draft_seed=1), device="gpu")


@pytest.mark.skipif(HAS_CUDA, reason="this onnxruntime has the CUDA provider")
def test_cuda_without_the_cuda_provider_says_what_to_install(bundles):
    with pytest.raises(DeviceError, match=r"pip install '\./runtime\[gpu\]'"):
        SpeculativeDecoder(bundles("llama", draft_seed=1), device="cuda")


@pytest.mark.skipif(HAS_CUDA, reason="this onnxruntime has the CUDA provider")
def test_cuda_where_the_cpu_onnxruntime_overwrote_onnxruntime_gpu_says_how_to_undo_it(bundles, tmp_path, monkeypatch):
    """Both installed (the GPU runtime beside the bench extra's onnxruntime-genai, which requires the CPU package), the
    CPU one's files replace the GPU one's: the advice to install onnxruntime-gpu named what was already there."""
    info = tmp_path / "onnxruntime_gpu-1.31.1.dist-info"  # what pip records of an installed onnxruntime-gpu
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: onnxruntime-gpu\nVersion: 1.31.1\n")
    monkeypatch.syspath_prepend(tmp_path)
    with pytest.raises(DeviceError, match=r"pip uninstall -y onnxruntime onnxruntime-gpu, then pip install '\./runtime\[gpu"):
        SpeculativeDecoder(bundles("llama", draft_seed=1), device="cuda")


@pytest.mark.skipif(HAS_CUDA, reason="this onnxruntime has the CUDA provider")
def test_auto_runs_on_the_cpu_without_the_cuda_provider(bundles):
    decoder = SpeculativeDecoder(bundles("llama", draft_seed=1), device="auto")
    assert decoder.device == "cpu" and len(decoder.generate("x", 4).token_ids) == 4


@pytest.fixture(scope="module")
def bf16_bundle(checkpoints, tmp_path_factory):
    target, out = checkpoints("llama"), tmp_path_factory.mktemp("bf16") / "bundle"
    compile_bundle(CompileSettings(target=target, draft=target, output=out, max_seq_len=64, precision="bf16"),
                   show_progress=False)
    return out


@pytest.mark.parametrize("device", ["cpu", "auto"] if not HAS_CUDA else ["cpu"])
def test_a_bf16_bundle_on_the_cpu_is_one_line_naming_the_way_out(bf16_bundle, device):
    """onnxruntime's CPU provider (1.32) cannot load a bf16 graph (no bf16 Gemm): its own error was NOT_IMPLEMENTED."""
    with pytest.raises(BundleError, match=r"target engine is bf16, .* CPU provider cannot run .* GPU \(--device cuda; "
                                          r"device='cuda' in Python\), or compile it with --precision fp32 for a CPU"
                       ) as error:
        SpeculativeDecoder(bf16_bundle, device=device)
    assert "\n" not in str(error.value)


def test_auto_takes_a_bf16_bundle_to_cuda_where_the_cuda_provider_is(bf16_bundle, monkeypatch):
    """The CPU refusal waits for the device "auto" resolves to: with the CUDA provider, the engines load on CUDA."""
    import specbuild_runtime.engine as engine

    class Loading(Exception):
        pass

    def engines(decoder, draft_steps):
        raise Loading(decoder.device)

    monkeypatch.setattr(engine, "cuda_provider", lambda: True)
    monkeypatch.setattr(SpeculativeDecoder, "_engines", engines)
    with pytest.raises(Loading, match="cuda"):
        SpeculativeDecoder(bf16_bundle, device="auto")


def test_a_bf16_bundle_on_the_cpu_is_refused_before_its_digests_are_read(bf16_bundle, tmp_path):
    """The digests read every byte (2.2 s of CPU for 2.5 GB, load_manifest), for nothing where the CPU cannot run it."""
    import shutil

    from specbuild_runtime import load_manifest

    copy = tmp_path / "bundle"
    shutil.copytree(bf16_bundle, copy)
    data = copy / f"{load_manifest(copy).engines['target'].file}.data"
    data.write_bytes(data.read_bytes()[::-1])  # its digest no longer matches
    with pytest.raises(BundleError, match="is bf16"):
        SpeculativeDecoder(copy)


def test_a_truncated_weights_file_is_refused_in_the_digest_checks_words_though_it_loads_meanwhile(bundles, tmp_path):
    """The weights are hashed while onnxruntime loads them (manifest.digests_checked), and onnxruntime fails first on
    a file cut short: the digest check's line names the file, not onnxruntime's message about an offset."""
    import shutil

    copy = tmp_path / "bundle"
    shutil.copytree(bundles("llama", draft_seed=1), copy)
    data = copy / "target.onnx.data"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with pytest.raises(BundleError, match=r"target\.onnx\.data is corrupted \(sha256 differs"):
        SpeculativeDecoder(copy)


@pytest.mark.parametrize("damaged", ["tokenizer/tokenizer.json", "target.onnx"])
def test_a_damaged_file_that_loading_parses_is_refused_by_its_digest_before_it_is_parsed(bundles, tmp_path, monkeypatch,
                                                                                       damaged):
    """Only the weights are hashed while the rest loads: the tokenizer and the graphs are checked before anything
    parses them (the refusal alone held where the tokenizer was hashed in the thread: its parse failed as a BundleError
    and the digest's line replaced it)."""
    import shutil

    from specbuild_runtime import decode

    def parsed(*args, **kwargs):
        raise AssertionError("parsed before its digest was checked")

    copy = tmp_path / "bundle"
    shutil.copytree(bundles("llama", draft_seed=1), copy)
    (copy / damaged).write_bytes(b"{")
    monkeypatch.setattr(decode, "load_tokenizer", parsed)
    monkeypatch.setattr(decode.SpeculativeDecoder, "_engines", parsed)
    with pytest.raises(BundleError, match=rf"{re.escape(damaged)} is corrupted"):
        SpeculativeDecoder(copy)


@pytest.mark.parametrize("interruption", [KeyboardInterrupt(), DeviceError("the CUDA provider could not start")])
def test_the_weights_hashing_ends_with_a_load_that_failed_otherwise(bundles, monkeypatch, interruption):
    """Ctrl-C or a DeviceError while the sessions load stops the digest thread and joins it: it read on, 1.7 s of CPU
    for Qwen3-0.6B fp32's weights after the constructor had raised."""
    import threading

    from specbuild_runtime import decode, manifest

    hashing, stopped = threading.Event(), []
    real = manifest.sha256_file

    def held(path, stop=None):
        if stop is not None:  # the weights, in the digest thread: held there until the load fails
            hashing.set()
            stop.wait(timeout=60)
            try:
                return real(path, stop)
            except manifest.HashingStopped:
                stopped.append(path)
                raise
        return real(path, stop)

    def engines(self, draft_steps):
        assert hashing.wait(timeout=60)
        raise interruption

    monkeypatch.setattr(manifest, "sha256_file", held)
    monkeypatch.setattr(decode.SpeculativeDecoder, "_engines", engines)
    with pytest.raises(type(interruption)):
        SpeculativeDecoder(bundles("llama", draft_seed=1))
    assert not [thread for thread in threading.enumerate() if thread.name == "specbuild-digests"]
    assert len(stopped) == 1


def test_a_bf16_engine_made_alone_on_the_cpu_is_the_same_line(bf16_bundle):
    """An Engine made directly, or under "auto" once the CUDA provider failed to start, meets the CPU after the
    manifest's check."""
    from specbuild_runtime import load_manifest
    from specbuild_runtime.engine import Engine

    info = load_manifest(bf16_bundle).engines["target"]
    with pytest.raises(BundleError, match="is bf16, which onnxruntime's CPU provider cannot run"):
        Engine(bf16_bundle / info.file, info, 64)


@pytest.mark.parametrize("command", [["generate", "-p", "x", "-n", "4"], ["bench", "-n", "4", "--gamma", "1"],
                                     ["serve"], ["verify", "-n", "4"]])
def test_every_command_that_decodes_refuses_a_bf16_bundle_on_the_cpu_in_one_line(bf16_bundle, command, tmp_path):
    """Each in a process of its own, as a user runs it (where serve sizes onnxruntime's thread pool first)."""
    from test_cli import specbuild

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "x"}\n')
    given = ["--prompts", prompts] if command[0] in ("bench", "verify") else []
    result = specbuild(command[0], bf16_bundle, *command[1:], *given)
    assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr
    assert "is bf16" in result.stderr and "--device cuda" in result.stderr and "--precision fp32" in result.stderr


def test_compile_and_inspect_say_where_a_bundle_runs(bf16_bundle, bundles, cli):
    from specbuild_runtime import load_manifest
    from specbuild_runtime.manifest import where_it_runs

    fp32 = load_manifest(bundles("llama", draft_seed=1))
    engines = {role: replace(info, precision="fp16") for role, info in fp32.engines.items()}
    assert where_it_runs(fp32) == "a CPU or a CUDA GPU"
    assert where_it_runs(replace(fp32, engines=engines)).startswith("a CUDA GPU, or a CPU (fp16")
    assert where_it_runs(load_manifest(bf16_bundle)).startswith("a CUDA GPU only: bf16")
    inspected, = cli.run([["inspect", str(bf16_bundle)]])
    assert "runs on    a CUDA GPU only: bf16" in inspected["stdout"]


def test_cuda_sessions_are_made_with_cudnns_attention_off_unless_the_user_chose(bundles, monkeypatch):
    """GroupQueryAttention through cuDNN's SDPA decoded token 0 at times on an H100 (docs/gpu.md: the attention
    kernel); the GPU tests that caught it run only on a GPU machine, so this holds the switch in CI."""
    from specbuild_runtime import load_manifest
    from specbuild_runtime.engine import _session

    folder = bundles("llama", draft_seed=1)
    path = folder / load_manifest(folder).engines["target"].file
    for chosen, expected in ((None, "0"), ("1", "1")):
        if chosen is None:
            monkeypatch.delenv("ORT_ENABLE_CUDNN_FLASH_ATTENTION", raising=False)
        else:
            monkeypatch.setenv("ORT_ENABLE_CUDNN_FLASH_ATTENTION", chosen)
        try:
            _session(path, "cuda", False)
        except (BundleError, DeviceError):  # no CUDA provider here: the variable is set before the session is made
            pass
        assert os.environ["ORT_ENABLE_CUDNN_FLASH_ATTENTION"] == expected


# A decoder loaded, then the process forks (gunicorn --preload): the child decodes and exits as a gunicorn worker
# does, through sys.exit, which destroys the decoder. SIGALRM's default action ends a child that hangs instead.
FORKED_CHILD_EXITS = """
import os, signal, sys
from specbuild_runtime import SpeculativeDecoder
decoder = SpeculativeDecoder(sys.argv[1])
expected = decoder.generate("def add(a, b):", max_new_tokens=8, gamma=3).token_ids
pid = os.fork()
if pid == 0:
    signal.alarm(60)
    sys.exit(0 if decoder.generate("def add(a, b):", max_new_tokens=8, gamma=3).token_ids == expected else 1)
print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""


def test_a_process_forked_after_a_decoder_loaded_decodes_and_exits(bundles):
    result = subprocess.run([sys.executable, "-c", FORKED_CHILD_EXITS, str(bundles("llama", draft_seed=1))],
                            capture_output=True, text=True)
    assert result.stdout.strip() == "0", result.stdout + result.stderr  # -14: SIGALRM ended a child hung at exit


# Each module given imported first in a fresh set of specbuild modules, without onnxruntime: what it raised, if anything.
IMPORTED_FIRST = """
import importlib, sys
sys.modules["onnxruntime"] = None
for name in sys.argv[1:]:
    for loaded in [module for module in sys.modules if module.split(".")[0] in ("specbuild", "specbuild_runtime")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:
        print(name, exc, sep=": ")
"""


def test_any_module_imported_first_without_onnxruntime_says_in_one_line_which_to_install():
    """slot.py imported onnxruntime itself, before engine.py's check: imported first (as the compiler's quality and
    gamma stages import it), a missing onnxruntime was Python's bare "import of onnxruntime halted"."""
    import pkgutil

    import specbuild_runtime

    modules = [found.name for found in pkgutil.walk_packages(specbuild_runtime.__path__, "specbuild_runtime.")]
    modules += ["specbuild.compile.check", "specbuild.compile.quantize", "specbuild.bench.bench"]
    result = subprocess.run([sys.executable, "-c", IMPORTED_FIRST, *modules], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    refused = dict(line.split(": ", 1) for line in result.stdout.splitlines())
    assert "specbuild_runtime.slot" in refused and "specbuild.compile.check" in refused, refused
    for name, said in refused.items():
        assert said.startswith("specbuild-runtime needs onnxruntime: pip install './runtime[cpu]'"), (name, said)
