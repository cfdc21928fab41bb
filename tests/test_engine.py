"""Device choice: a clear line for every device that cannot be used, never a silent fallback to the CPU."""

import os
import subprocess
import sys

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


def test_a_bf16_bundle_on_the_cpu_is_one_line_naming_the_way_out(checkpoints, tmp_path):
    target = checkpoints("llama")
    compile_bundle(CompileSettings(target=target, draft=target, output=tmp_path / "bf16", max_seq_len=64,
                                   precision="bf16"), show_progress=False)
    with pytest.raises(BundleError, match="bf16.*device 'cuda'") as error:
        SpeculativeDecoder(tmp_path / "bf16")
    assert "\n" not in str(error.value)


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
