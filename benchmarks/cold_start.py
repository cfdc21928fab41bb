"""Cold start as an edge box sees it: from a process's start to its first token, in fresh processes of the venvs given
(each with only `pip install './runtime[cpu]'`, or a peer's package), interleaved run by run, medians printed.

    python benchmarks/cold_start.py --bundle /path/bundle --run A=specbuild:/venv-a/bin/python \\
        --run B=specbuild:/venv-b/bin/python --runs 7 [--cold]
    python benchmarks/cold_start.py --bundle /path/bundle --run genai=genai:/venv-g/bin/python:/path/genai-model

Stdlib only, so that any venv's python runs it. Each run is one process of the variant's python that imports its
package, loads the model (specbuild: SpeculativeDecoder(bundle), every digest checked; onnxruntime-genai: og.Model
and og.Tokenizer; llama.cpp: xllamacpp.Server) and decodes one token after a short prompt, greedily; times are its wall
clock from just before the parent spawned it (interpreter start-up included). cpu: the process's CPU seconds (all its
threads') to the first token, which a busy machine inflates less than the wall clock; peak memory: its VmHWM.
--cold drops the page cache's pages of the bundle's (or model's) files and the venv's site-packages before each run
(posix_fadvise DONTNEED on each file: no root, no other process's files), as after a reboot; without it every run
after the first finds them cached, as a restarted service does. The load average (uptime's) is printed before and
after: the figures are only comparable within one run of this script.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

PROMPT = "def fibonacci(n):\n    "

# Each child prints one JSON line: the wall clock (time.time()) after its imports, after loading, after the first token.
CHILDREN = {
    "specbuild": """
import json, sys, time
from specbuild_runtime import SpeculativeDecoder
imported = time.time()
decoder = SpeculativeDecoder(sys.argv[1])
loaded = time.time()
next(decoder.stream(sys.argv[2], max_new_tokens=1))
first = time.time()
""",
    "genai": """
import json, sys, time
import onnxruntime_genai as og
imported = time.time()
model = og.Model(sys.argv[1])
tokenizer = og.Tokenizer(model)
loaded = time.time()
params = og.GeneratorParams(model)
params.set_search_options(max_length=64, do_sample=False)
generator = og.Generator(model, params)
generator.append_tokens(tokenizer.encode(sys.argv[2]))
generator.generate_next_token()
first = time.time()
""",
    # llama.cpp as PyPI has it prebuilt (xllamacpp: its server in this process; llama-cpp-python builds from source)
    "llamacpp": """
import json, sys, time, urllib.request
import xllamacpp as xlc
imported = time.time()
params = xlc.CommonParams()
params.model.path, params.n_ctx, params.n_parallel, params.verbosity = sys.argv[1], 2048, 1, -1
server = xlc.Server(params)
loaded = time.time()
body = {"prompt": sys.argv[2], "n_predict": 1, "temperature": 0.0}
request = urllib.request.Request(server.listening_address + "/completion", data=json.dumps(body).encode())
urllib.request.build_opener(urllib.request.ProxyHandler({})).open(request).read()
first = time.time()
""",
}
REPORT = """
import os
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print(json.dumps({"imported": imported, "loaded": loaded, "first": first, "cpu": sum(os.times()[:2]),
                  "peak_rss_bytes": int(status["VmHWM"].split()[0]) * 1024}))
"""


def evict(folder: Path) -> None:
    """Drop the page cache's pages of every file under folder (those no process has locked or dirtied)."""
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def site_packages(python: str) -> Path:
    return Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())


def once(kind: str, python: str, model: str, cold: bool) -> dict:
    if cold:
        evict(Path(model))
        evict(site_packages(python))
    started = time.time()
    result = subprocess.run([python, "-c", CHILDREN[kind] + REPORT, model, PROMPT], capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"{kind} {python} failed:\n{result.stderr}")
    times = json.loads(result.stdout.strip().splitlines()[-1])
    return {"start_and_import": times["imported"] - started, "load": times["loaded"] - times["imported"],
            "first_token": times["first"] - times["loaded"], "total": times["first"] - started,
            "cpu": times["cpu"], "peak_rss_gib": times["peak_rss_bytes"] / 2**30}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundle", type=Path, help="the specbuild bundle the specbuild variants load")
    parser.add_argument("--run", action="append", required=True, metavar="NAME=KIND:PYTHON[:MODEL]",
                        help=f"a variant: KIND one of {', '.join(CHILDREN)}; MODEL: the peer's model (its folder, or "
                             "llama.cpp's .gguf), the bundle for specbuild")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--cold", action="store_true", help="evict the model's and the venv's files before each run")
    parser.add_argument("--json", type=Path, help="also write every run's figures here")
    args = parser.parse_args()

    variants = []
    for spec in args.run:
        name, _, rest = spec.partition("=")
        kind, python, *model = rest.split(":", 2)
        if kind not in CHILDREN:
            parser.error(f"--run {spec}: the kind must be one of {', '.join(CHILDREN)}")
        if not model and args.bundle is None:  # it loaded "None" and failed in the child, one run later
            parser.error(f"--run {spec}: give the model (NAME=KIND:PYTHON:MODEL) or --bundle")
        variants.append((name, kind, python, model[0] if model else str(args.bundle)))
    load_before = os.getloadavg()
    runs: dict[str, list[dict]] = {name: [] for name, *_ in variants}
    for i in range(args.runs):
        # Interleaved, each round in another order, so that a change in the machine's load falls on every variant
        for name, kind, python, model in variants[i % len(variants):] + variants[:i % len(variants)]:
            runs[name].append(once(kind, python, model, args.cold))
    load_after = os.getloadavg()
    print(f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after; {args.runs} runs each, "
          f"{'cold' if args.cold else 'warm'} page cache; medians (min-max), seconds and GiB")
    for name, figures in runs.items():
        print(f"{name:>12}: " + "  ".join(
            f"{key} {statistics.median(f[key] for f in figures):.3f} "
            f"({min(f[key] for f in figures):.2f}-{max(f[key] for f in figures):.2f})" for key in figures[0]))
    if args.json:
        args.json.write_text(json.dumps({"load_average": [load_before, load_after], "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
