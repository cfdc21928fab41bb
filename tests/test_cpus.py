"""A container's CPU limit (a cgroup quota, which leaves the host's cores in sight) bounds every thread count the
project chooses by default: the cgroup files here are made up, under a folder that stands for /."""

import os
import subprocess
import sys
import warnings

import onnxruntime as ort
import pytest

from specbuild_runtime import engine

HOST_CPUS = 64  # a node's cores, all in the process's affinity, as in a pod with a cpu limit


def made_up_root(tmp_path, cgroup: str, mountinfo: str, files: dict[str, str]):
    for path, text in {"proc/self/cgroup": cgroup, "proc/self/mountinfo": mountinfo, **files}.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    return tmp_path


V2_MOUNT = "30 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate\n"
V1_MOUNT = ("35 25 0:31 /docker/abc /sys/fs/cgroup/cpu,cpuacct ro,nosuid,nodev,noexec,relatime master:11 - cgroup cgroup "
            "rw,cpu,cpuacct\n")


def v2(tmp_path, cpu_max: str):
    """A container with its own cgroup namespace (docker's default on cgroup v2): its cgroup is the mount's root."""
    return made_up_root(tmp_path, "0::/\n", V2_MOUNT, {"sys/fs/cgroup/cpu.max": cpu_max + "\n"})


def v1(tmp_path, quota: str, period: str = "100000"):
    """docker on cgroup v1: the container's cgroup is /docker/<id>, mounted as the root of the cpu hierarchy."""
    return made_up_root(tmp_path, "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n1:name=systemd:/docker/abc\n",
                        V1_MOUNT, {"sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": quota + "\n",
                                   "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": period + "\n"})


@pytest.fixture
def host(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(HOST_CPUS)))
    monkeypatch.setattr(os, "cpu_count", lambda: HOST_CPUS)
    monkeypatch.delenv("ORT_INTRA_OP_NUM_THREADS", raising=False)
    return lambda root: monkeypatch.setattr(engine, "ROOT", root, raising=False)


@pytest.mark.parametrize("cpu_max, cpus", [("200000 100000", 2), ("150000 100000", 2), ("50000 100000", 1),
                                           ("max 100000", HOST_CPUS)])
def test_a_cgroup_v2_cpu_max_bounds_the_cpus_rounded_up_and_max_is_no_limit(tmp_path, host, cpu_max, cpus):
    host(v2(tmp_path, cpu_max))
    assert engine.available_cpus() == cpus


@pytest.mark.parametrize("quota, cpus", [("200000", 2), ("-1", HOST_CPUS)])
def test_a_cgroup_v1_cfs_quota_bounds_the_cpus_and_minus_one_is_no_limit(tmp_path, host, quota, cpus):
    host(v1(tmp_path, quota))
    assert engine.available_cpus() == cpus


def test_a_quota_on_an_ancestor_cgroup_bounds_its_children(tmp_path, host):
    """Kubernetes without a cgroup namespace: the pod's limit sits on the pod's cgroup, above the container's."""
    pod = "sys/fs/cgroup/kubepods.slice/kubepods-pod1.slice"
    host(made_up_root(tmp_path, "0::/kubepods.slice/kubepods-pod1.slice/cri-c1.scope\n", V2_MOUNT,
                      {f"{pod}/cpu.max": "300000 100000\n", f"{pod}/cri-c1.scope/cpu.max": "max 100000\n"}))
    assert engine.available_cpus() == 3


@pytest.mark.parametrize("files", [{}, {"proc/self/cgroup": "0::/\n", "proc/self/mountinfo": V2_MOUNT},
                                   {"proc/self/cgroup": "0::/\n", "proc/self/mountinfo": V2_MOUNT,
                                    "sys/fs/cgroup/cpu.max": "two CPUs\n"}])
def test_no_cgroup_or_an_unreadable_one_leaves_the_affinity(tmp_path, host, files):
    for path, text in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    host(tmp_path)
    assert engine.available_cpus() == HOST_CPUS


def test_onnxruntimes_default_pools_follow_a_quota_and_stay_its_own_without_one(tmp_path, host, monkeypatch):
    """The shared pool a decoder (shared_thread_pool=True) and generate/bench/verify make, and each session's own
    pool otherwise (SpeculativeDecoder's default, compile's checks): onnxruntime counts the host's cores."""
    sized = []
    monkeypatch.setattr(ort.capi._pybind_state, "set_global_thread_pool_sizes", lambda *sizes: sized.append(sizes))
    for cpu_max, threads in (("200000 100000", 2), ("max 100000", 0)):
        host(v2(tmp_path, cpu_max))
        monkeypatch.setattr(engine, "_SHARED_POOL", None)
        assert engine.session_options().intra_op_num_threads == threads
        engine.use_shared_thread_pool()
        assert sized.pop() == (threads, 1)


def test_a_size_asked_of_the_shared_pool_once_it_exists_is_a_warning_and_no_size_shares_it(monkeypatch):
    """onnxruntime makes the shared pool once per process: a later call's size was dropped without a word (it returned
    a bool no caller read). A decoder's shared_thread_pool=True asks no size, and shares whichever pool exists."""
    made = []
    monkeypatch.setattr(ort.capi._pybind_state, "set_global_thread_pool_sizes", lambda *sizes: made.append(sizes))
    monkeypatch.setattr(engine, "_SHARED_POOL", None)
    engine.use_shared_thread_pool(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine.use_shared_thread_pool()
        engine.use_shared_thread_pool(2)
    with pytest.warns(RuntimeWarning, match=r"exists already \(2 threads\) and cannot be resized, so it does not get the 4"):
        engine.use_shared_thread_pool(4)
    assert made == [(2, 1)] and not engine.session_options().use_per_session_threads


def test_a_pool_made_at_a_quotas_size_takes_that_size_asked_later_without_a_warning(tmp_path, host, monkeypatch):
    """A decoder's shared_thread_pool=True makes the pool at a binding quota's CPUs (quota_threads), then serve or
    --threads asks for as many: the pool was recorded as "the default size", so that size was warned about as one it
    "does not get", though the pool has it."""
    made = []
    monkeypatch.setattr(ort.capi._pybind_state, "set_global_thread_pool_sizes", lambda *sizes: made.append(sizes))
    monkeypatch.setattr(engine, "_SHARED_POOL", None)
    host(v2(tmp_path, "200000 100000"))
    engine.use_shared_thread_pool()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine.use_shared_thread_pool(2)
    with pytest.warns(RuntimeWarning, match=r"exists already \(2 threads\) and cannot be resized, so it does not get the 3"):
        engine.use_shared_thread_pool(3)
    assert made == [(2, 1)]


# Other code in the process makes onnxruntime's shared pool, then decoders load.
OTHER_CODES_POOL = """
import sys, warnings
import onnxruntime as ort
from specbuild_runtime import DeviceError, SpeculativeDecoder
from specbuild_runtime.engine import use_shared_thread_pool
ort.set_global_thread_pool_sizes(1, 1)
try:
    SpeculativeDecoder(sys.argv[1])
except DeviceError as exc:
    print("refused:", exc)
print("shared:", SpeculativeDecoder(sys.argv[1], shared_thread_pool=True).generate("def", max_new_tokens=4).token_ids)
with warnings.catch_warnings(record=True) as said:
    warnings.simplefilter("always")
    use_shared_thread_pool(2)
print("warned:", *[warning.message for warning in said])
"""


def test_a_pool_other_code_made_is_shared_by_a_decoder_that_asks_and_refused_in_one_line_by_one_that_does_not(bundles):
    """onnxruntime (1.32) lets a process make its shared pool once, then refuses every session with a pool of its own: a
    decoder loaded after other code made it failed, shared_thread_pool=True or not, as "cannot load target.onnx:
    <pybind11's signature> use_per_session_threads must be false when using a global thread pool; rebuild the bundle".
    (A session made before it does not matter: it keeps its own pool, and the shared one is made after it.)"""
    result = subprocess.run([sys.executable, "-c", OTHER_CODES_POOL, str(bundles("llama"))], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    refused, shared, warned = result.stdout.splitlines()
    assert refused.startswith("refused: onnxruntime's shared thread pool was made in this process"), refused
    assert refused.endswith("load the decoder with shared_thread_pool=True (or call "
                            "specbuild_runtime.engine.use_shared_thread_pool() first)"), refused
    assert shared.startswith("shared: [") and len(shared.split(",")) == 4, shared
    assert "(sized by other code) and cannot be resized, so it does not get the 2 threads asked" in warned, warned


def test_serves_default_threads_are_a_quotas_cpus_over_the_slots(tmp_path, host, monkeypatch):
    """cores / --parallel counted the host's 64 cores in a 2-CPU pod: 64 threads a call, throttled."""
    from specbuild_runtime.serve.cli import serve_command

    class Sized(Exception):
        pass

    def sized(threads):
        raise Sized(threads)

    monkeypatch.setattr(engine, "use_shared_thread_pool", sized)
    host(v2(tmp_path, "400000 100000"))
    for parallel, threads in (("1", 4), ("2", 2), ("8", 1)):
        with pytest.raises(Sized) as pool:
            serve_command.main([str(tmp_path), "--port", "0", "--parallel", parallel], standalone_mode=False)
        assert pool.value.args == (threads,)
    with pytest.raises(Sized) as pool:
        serve_command.main([str(tmp_path), "--port", "0", "--threads", "16"], standalone_mode=False)
    assert pool.value.args == (16,)  # --threads overrides


def test_torch_takes_no_more_threads_than_a_quota_grants(tmp_path, host):
    """verify, bench's transformers peer, distill and compile's transformers run torch, which counts the host's
    cores too."""
    torch = pytest.importorskip("torch")
    from specbuild.cli import use_threads

    host(v2(tmp_path, "100000 100000"))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(4)  # as torch sizes itself on a host's cores (the tests' conftest holds it to 1)
        use_threads(None, torch_too=True)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("command", ["generate", "verify", "bench", "serve"])
def test_the_threads_help_says_a_containers_cpu_limit_bounds_the_default(command):
    """The defaults follow a CPU quota; --help still said one per core (the host's: 64 in a 2-CPU pod)."""
    from click.testing import CliRunner

    from specbuild.cli import cli

    shown = " ".join(CliRunner().invoke(cli, [command, "--help"]).output.split())  # click wraps the help
    assert "a container's CPU limit grants" in shown, shown


def test_a_malformed_proc_cgroup_line_leaves_the_machines_memory_not_a_traceback(tmp_path, host):
    """The memory check read /proc/self/cgroup with its own parser, which raised on a line without two colons (a
    traceback from SpeculativeDecoder()); it now walks the cgroups as the CPU quota does."""
    from specbuild_runtime import pool

    host(made_up_root(tmp_path, "garbage\n0::/\n", V2_MOUNT, {"sys/fs/cgroup/memory.max": "4096\n"}))
    assert pool.memory_limit() == (4096, "this container may use")
    host(made_up_root(tmp_path, "garbage\n", V2_MOUNT, {}))
    assert pool.memory_limit()[1] == "this machine has"
