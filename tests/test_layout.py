"""The layout keeps its promises: the compiler never imports training, the runtime never imports torch."""

import subprocess
import sys


def imported_after(statement: str) -> set[str]:
    code = f"import sys\n{statement}\nprint('\\n'.join(sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(result.stdout.split())


def test_the_compiler_never_imports_training():
    modules = imported_after("import specbuild.compile, specbuild.cli")
    assert not {m for m in modules if m.startswith("specbuild.train")}


# The compiler's modules in the order its stages run (pipeline.STAGES), each after what it uses: reference runs a
# checkpoint as transformers does (what verify, the peers, distill and gamma compare with); graphs/ emits nodes whose
# weights precision and quantize make as the engine is written; gamma measures α for quality and the TensorRT-LLM
# export; bundle names the export's folder; pipeline runs them all.
COMPILE_ORDER = ("load", "reference", "precision", "quantize", "graphs", "export", "gamma", "quality", "check",
                 "tensorrt_llm", "bundle", "pipeline")
# What the compiler serves, which it never imports (the layout's promise, README Layout)
ABOVE_THE_COMPILER = ("specbuild.train", "specbuild.bench", "specbuild.cli", "specbuild.command", "specbuild.demo",
                      "specbuild.verify")


def specbuild_imports(path) -> set[str]:
    """The specbuild modules a file imports anywhere in it, a function's own imports too (which sys.modules
    after an import does not show)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    package = path.relative_to(root).with_suffix("").parts[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1]) if node.level else ""
            module = ".".join(filter(None, [base, node.module]))
            found |= {module} | {f"{module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return {name for name in found if name.split(".")[0] == "specbuild"}


def test_each_compile_stage_imports_only_the_stages_before_it():
    """A new engineer reads compile/ top down; load.py reached up into graphs/ for transformers' rotary module."""
    from pathlib import Path

    compile_dir = Path(__file__).resolve().parents[1] / "specbuild" / "compile"
    modules = {path: path.relative_to(compile_dir).with_suffix("").parts[0] for path in compile_dir.rglob("*.py")
               if path.name != "__init__.py" or path.parent != compile_dir}
    assert set(modules.values()) == set(COMPILE_ORDER)
    for path, stage in modules.items():
        imported = specbuild_imports(path)
        later = {name.split(".")[2] for name in imported if name.startswith("specbuild.compile.")} - set(
            COMPILE_ORDER[:COMPILE_ORDER.index(stage) + 1])
        assert not later, f"{path.name} imports {sorted(later)}"
        assert not [name for name in imported if name.startswith(ABOVE_THE_COMPILER)], path.name


# compile/tensorrt_llm/'s modules in its docstring's order, each after what it uses; the package runs them.
TENSORRT_LLM_ORDER = ("families", "layout", "windows", "llama", "gpt2", "gemma", "phi3", "support", "checkpoint",
                      "plans", "reference", "__init__")


def test_each_tensorrt_llm_module_imports_only_the_modules_before_it():
    """The export was one module of five jobs; split, it reads top down only while no module reaches below it (a
    family's writer importing the checks that call it would be a cycle)."""
    from pathlib import Path

    package = Path(__file__).resolve().parents[1] / "specbuild" / "compile" / "tensorrt_llm"
    assert sorted(path.stem for path in package.glob("*.py")) == sorted(TENSORRT_LLM_ORDER)
    for stem in TENSORRT_LLM_ORDER:
        used = {name.split(".")[3] for name in specbuild_imports(package / f"{stem}.py")
                if name.startswith("specbuild.compile.tensorrt_llm.")}
        assert used <= set(TENSORRT_LLM_ORDER[:TENSORRT_LLM_ORDER.index(stem)]), f"{stem}.py imports {sorted(used)}"


def test_what_the_compiler_imports_never_imports_the_compiler():
    """The compiler stands on specbuild's shared modules (errors, progress, staging, recipe, texts, acceptance),
    none of which imports it back: reference.py, transformers' side of every comparison, read checkpoints with
    compile/load.py while compile/gamma.py imported it, a cycle between the package and the module."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "specbuild"
    used = {name for path in (root / "compile").rglob("*.py") for name in specbuild_imports(path)
            if not name.startswith("specbuild.compile")}
    beneath = [path for path in root.glob("*.py") if f"specbuild.{path.stem}" in used]
    assert beneath and not [path.name for path in beneath
                            if any(name.startswith("specbuild.compile") for name in specbuild_imports(path))]


def test_the_compile_stages_take_settings_checked_where_they_enter():
    """recipe.py checks each setting once, by its rule in RULES: a recipe's value, a command-line option, a
    CompileSettings built through the API. Numerics checked four of them again as the pipeline built it from
    those checked settings: a second place to keep, raising another error than the first."""
    from pathlib import Path

    compile_dir = Path(__file__).resolve().parents[1] / "specbuild" / "compile"
    rules = {"specbuild.recipe.setting_problem", "specbuild.recipe.RULES"}
    assert not [path.name for path in compile_dir.rglob("*.py") if rules & specbuild_imports(path)]


def test_only_the_compile_package_imports_its_pipeline():
    """pipeline.py is the line of stages, not a place to borrow from: training saved its tokenizer with the
    pipeline's helper, which belongs with the bundle it writes."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "specbuild"
    borrowing = [str(path.relative_to(root)) for path in root.rglob("*.py") if path != root / "compile" / "__init__.py"
                 and "specbuild.compile.pipeline" in specbuild_imports(path)]
    assert borrowing == []


def test_no_package_hides_a_module_of_its_own():
    """`import specbuild.bench.bench as m` gave the function bench, which the package had bound over its module's
    name, so tests reached the module through importlib; graphs/ did the same with its function verification."""
    import importlib
    import pkgutil

    import specbuild

    for found in pkgutil.walk_packages(specbuild.__path__, "specbuild."):
        if found.name.endswith(".__main__"):  # runs the command
            continue
        module = importlib.import_module(found.name)
        package, _, name = found.name.rpartition(".")
        assert getattr(importlib.import_module(package), name) is module, found.name


def test_the_runtime_never_imports_torch():
    modules = imported_after("from specbuild_runtime import SpeculativeDecoder")
    assert "torch" not in modules and "transformers" not in modules


def test_the_server_never_imports_torch():
    modules = imported_after("import specbuild_runtime.serve.app, specbuild_runtime.serve.cli")
    assert "torch" not in modules and "transformers" not in modules


def test_each_package_takes_onnxruntime_or_onnxruntime_gpu_only_through_its_cpu_or_gpu_extra():
    """The two install the same module and break each other (microsoft/onnxruntime#26996): while the compiler
    required onnxruntime, `pip install -e './runtime[gpu]' -e .` installed both, the CPU package's files over the GPU
    one's, and onnxruntime had no CUDA provider."""
    import tomllib
    from pathlib import Path

    from packaging.requirements import Requirement

    root = Path(__file__).resolve().parents[1]
    runtime = tomllib.loads((root / "runtime" / "pyproject.toml").read_text())["project"]

    def onnxruntimes(requirements: list[str]) -> set[str]:
        """The onnxruntime packages these install, through the runtime's extras too."""
        names = set()
        for requirement in map(Requirement, requirements):
            if requirement.name == runtime["name"]:
                extras = runtime["optional-dependencies"]
                names |= onnxruntimes([each for extra in requirement.extras for each in extras[extra]])
            names |= {requirement.name} & {"onnxruntime", "onnxruntime-gpu"}
        return names

    for project in (tomllib.loads((root / "pyproject.toml").read_text())["project"], runtime):
        extras = project["optional-dependencies"]
        assert onnxruntimes(project["dependencies"]) == set(), project["name"]
        assert (onnxruntimes(extras["cpu"]), onnxruntimes(extras["gpu"])) == ({"onnxruntime"}, {"onnxruntime-gpu"})


def test_the_wheel_carries_the_files_the_commands_read(tmp_path):
    """`specbuild demo` reads its recipe, bench and distill the packaged prompts: from a wheel too."""
    import shutil
    import zipfile
    from pathlib import Path

    from specbuild.demo import DEMO_RECIPE

    root = Path(__file__).resolve().parent.parent
    source = tmp_path / "source"  # a copy: setuptools builds in the source tree
    # Links kept as links: a package file that links outside the package would dangle in the copy and be left out,
    # as from an sdist unpacked elsewhere.
    shutil.copytree(root / "specbuild", source / "specbuild", symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(root / name, source)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path),
                    str(source)], check=True, capture_output=True)
    names = set(zipfile.ZipFile(next(tmp_path.glob("specbuild-*.whl"))).namelist())
    assert DEMO_RECIPE.relative_to(root).as_posix() in names and "specbuild/prompts/code.jsonl" in names


def test_the_runtime_wheel_says_it_is_typed(tmp_path):
    """PEP 561: without py.typed in the installed package, mypy skips the runtime ("module is installed, but
    missing library stubs or py.typed marker") and a service's calls go unchecked."""
    import shutil
    import zipfile
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    source = tmp_path / "runtime"  # a copy: setuptools builds in the source tree
    shutil.copytree(root / "runtime", source, ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path),
                    str(source)], check=True, capture_output=True)
    names = set(zipfile.ZipFile(next(tmp_path.glob("specbuild_runtime-*.whl"))).namelist())
    assert "specbuild_runtime/py.typed" in names


def test_the_runtime_passes_mypy_with_the_projects_config(mypy_check):
    """The runtime ships py.typed, so a service's mypy reads its hints: they must say what the code does. They once
    held 103 errors, among them a slot's default prompt of (), which as a NumPy index marked every token the prompt's."""
    from pathlib import Path

    runtime = Path(__file__).resolve().parent.parent / "runtime" / "specbuild_runtime"
    status, report = mypy_check(*sorted(runtime.rglob("*.py")))
    assert status == 0, report


def test_every_tracked_path_reads_as_a_file():
    """The GPU machine's packing script (shared/gpu) sizes the checkout with `git ls-files | xargs cat` under
    pipefail: a tracked link to a folder made it exit silently, and no GPU session could set up."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, text=True)
    if listed.returncode:
        import pytest

        pytest.skip("not a git checkout")
    assert [path for path in listed.stdout.split("\0") if path and (root / path).is_dir()] == []


def test_the_readme_layout_names_every_module_and_benchmark():
    """The Layout section is the map of the repository: the runtime's errors.py and a GPU session's reports
    (benchmarks/h100-2026-11-26/) were missing from it. Each folder's entries are looked for in its own part of
    the map (specbuild/ has an errors.py too), and a module the map names must exist there."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    layout = (root / "README.md").read_text().split("## Layout")[1].split("\n## ")[0]
    compiler, rest = layout.split("- `runtime/specbuild_runtime/`")
    runtime, benchmarks = rest.split("- `benchmarks/`")
    parts = {"specbuild": compiler, "runtime/specbuild_runtime": runtime, "benchmarks": benchmarks}
    for folder, text in parts.items():
        entries = [path for path in (root / folder).rglob("*.py") if path.name not in ("__init__.py", "__main__.py")]
        if folder == "benchmarks":
            entries = [path for path in (root / folder).iterdir() if path.suffix in (".py", ".sh") or path.is_dir()]
        unnamed = [str(path.relative_to(root)) for path in entries if not re.search(rf"[`/]{re.escape(path.name)}\b", text)]
        assert unnamed == [], folder
        named = set(re.findall(r"`([\w.-]+\.py)`", text)) - {path.name for path in entries}
        assert named == set(), folder


def test_every_package_of_specbuild_is_listed_for_setuptools():
    """pyproject.toml names its packages one by one, so a new subpackage left out is missing from a wheel (`pip
    install .`) while an editable install, which reads the source folder, still imports it."""
    import pkgutil
    import tomllib
    from pathlib import Path

    import specbuild

    root = Path(__file__).resolve().parents[1]
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {"specbuild"} | {m.name for m in pkgutil.walk_packages(specbuild.__path__, "specbuild.") if m.ispkg}
    assert found <= listed  # listed also: prompts/ and recipes/, folders of package data
