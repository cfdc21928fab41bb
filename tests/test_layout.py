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


def test_the_runtime_never_imports_torch():
    modules = imported_after("import specbuild_runtime")
    assert "torch" not in modules and "transformers" not in modules


def test_the_server_never_imports_torch():
    modules = imported_after("import specbuild_runtime.serve.app, specbuild_runtime.serve.cli")
    assert "torch" not in modules and "transformers" not in modules
