"""The README's examples, then those of docs/, run in order against tiny checkpoints made here.

A fenced block right after `<!-- example -->` is run: `bash` blocks line by line as `specbuild` command
lines (through its entry point, in one process: tests/cli_driver.py; shell syntax is refused, so
what runs is what a shell would run), `python` blocks with exec. `<!-- example: FILE -->` writes the
block to FILE first. They run in a folder holding `checkpoints/target` and `checkpoints/draft`.
"""

import re
import shlex
from pathlib import Path

import pytest

from conftest import make_checkpoint

README = Path(__file__).resolve().parent.parent / "README.md"
# The README first: its first example compiles the bundle the others use.
PAGES = [README] + sorted((README.parent / "docs").glob("*.md"))
EXAMPLE = re.compile(r"<!-- example(?:: (?P<file>\S+))? -->\s*\n```(?P<language>\w+)\n(?P<body>.*?)\n```", re.S)


def examples() -> list[dict]:
    found = [m.groupdict() | {"line": (page.relative_to(README.parent).as_posix(), text[: m.start()].count("\n") + 1)}
             for page in PAGES for text in [page.read_text()] for m in EXAMPLE.finditer(text)]
    assert found, "the README marks no examples"
    return found


def commands(body: str) -> list[list[str]]:
    lines = [line for line in body.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    for line in lines:
        assert not set(line.split("#")[0]) & set("|&;<>$`\\"), f"shell syntax in a README example: {line}"
    argvs = [shlex.split(line, comments=True) for line in lines]
    assert all(argv[0] == "specbuild" for argv in argvs), body
    return [argv[1:] for argv in argvs]


@pytest.fixture(scope="module")
def ran(tmp_path_factory, tokenizer, cli):
    """Every example's entries run in one process in a fresh folder: {(page, line): [results]}."""
    folder = tmp_path_factory.mktemp("readme")
    # 2048 positions: the README's recipe asks for max_seq_len 1024.
    make_checkpoint(folder / "checkpoints" / "target", "llama", tokenizer, 0, max_position_embeddings=2048)
    make_checkpoint(folder / "checkpoints" / "draft", "llama", tokenizer, 1, max_position_embeddings=2048)
    entries, owners = [], []
    for example in examples():
        if example["file"]:
            (folder / example["file"]).write_text(example["body"] + "\n")
            continue
        batch = commands(example["body"]) if example["language"] == "bash" else [{"python": example["body"]}]
        entries += batch
        owners += [example["line"]] * len(batch)
    results = cli.run(entries, cwd=folder)
    by_example = {}
    for line, result in zip(owners, results):
        by_example.setdefault(line, []).append(result)
    return by_example


@pytest.mark.parametrize("example", [pytest.param(e, id=f"{e['line'][0]}-line-{e['line'][1]}-{e['language']}")
                                     for e in examples() if not e["file"]])
def test_readme_example_runs(example, ran):
    for result in ran[example["line"]]:
        assert result["status"] == 0, result["stderr"][-3000:]


def test_readme_examples_do_what_they_say(ran):
    """The first example compiles, generates and inspects; the recipe example's option wins over the recipe."""
    compile_, generate, inspect = ran[min(ran)][:3]
    assert compile_["stdout"].startswith("wrote bundle: ") and "target LlamaForCausalLM" in compile_["stdout"]
    assert generate["stdout"].startswith("def fib(n):") and "tokens" in generate["stderr"]
    assert "max-seq-len 256" in inspect["stdout"]
    recipe = next(results[0] for results in ran.values() if "bundles/demo" in results[0]["stdout"])
    assert "max gamma 4, max-seq-len 1024" in recipe["stdout"]


def test_readme_python_examples_pass_mypy_as_a_service_checking_its_code_runs_it(tmp_path, mypy_check):
    """The runtime ships py.typed, so a service's mypy reads its hints: the examples, copied, must pass it."""
    files = []
    for example in examples():
        if example["language"] == "python" and not example["file"]:
            files.append(tmp_path / f"{Path(example['line'][0]).stem.replace('-', '_')}_line_{example['line'][1]}.py")
            files[-1].write_text(example["body"] + "\n")
    assert files, "the README marks no Python examples"
    status, report = mypy_check(*files)
    assert status == 0, report


def test_python_version_is_stated_alike_in_the_readme_and_both_packages():
    root = README.parent
    stated = re.search(r"Python (\d+\.\d+)\+", README.read_text())[1]
    for pyproject in (root / "pyproject.toml", root / "runtime" / "pyproject.toml"):
        assert f'requires-python = ">={stated}"' in pyproject.read_text(), pyproject
    assert stated == "3.11"  # tomllib and contextlib.chdir, used by the compiler, are new in 3.11


def test_every_extra_the_readme_and_the_makefile_install_is_one_the_package_declares():
    """pip only warns of an extra a package lacks and installs the rest: a GPU line naming a `gpu` extra the compiler
    lacked would install without onnxruntime-gpu."""
    import tomllib

    root = README.parent
    declared = {}
    for folder, names in ((root, (".", "specbuild")), (root / "runtime", ("./runtime", "specbuild-runtime"))):
        extras = set(tomllib.loads((folder / "pyproject.toml").read_text())["project"]["optional-dependencies"])
        declared |= dict.fromkeys(names, extras)
    installs = re.findall(r"""['"](\.|\./runtime|specbuild|specbuild-runtime)\[([\w,-]+)\]['"]""",
                          "".join(page.read_text() for page in PAGES) + (root / "Makefile").read_text())
    assert ("./runtime", "gpu,serve") in installs and (".", "gpu") in installs and (".", "cpu,test") in installs
    assert [f"{package}[{extra}]" for package, extras in installs for extra in extras.split(",")
            if extra not in declared[package]] == []


def test_the_command_line_synopsis_names_only_real_options_with_their_defaults():
    """Every option the synopsis in "The command line" shows is its command's (the comments' too: on verify,
    bench, serve), and a default shown as `[--option VALUE]` is the one the command applies."""
    from specbuild.cli import cli

    synopsis = README.read_text().split("## The command line")[1].split("```bash")[1].split("```")[0]
    command = None
    for line in filter(str.strip, synopsis.splitlines()):
        if started := re.match(r"\s*specbuild (\w+)", line):
            command = cli.commands[started[1]]
        code, _, comment = line.partition("   #")
        commands = [command] + ([cli.commands[name] for name in ("verify", "bench", "serve")] if "on verify" in comment else [])
        for each in commands:
            names = {name for p in each.params for name in (*p.opts, *p.secondary_opts)}
            flags = re.findall(r"(?<![\w-])(--[a-z][a-z-]*|-[a-z])\b", code if each is command else comment)
            assert set(flags) <= names, (each.name, sorted(set(flags) - names))
        for flag, value in re.findall(r"\[(--[a-z-]+) ([0-9][0-9.,]*)\]", code):
            param = next(p for p in command.params if flag in p.opts)
            default = (str(param.default) if isinstance(param.default, (int, float, str)) else
                       re.search(r"\[default: ([^\]]+)\]", param.help)[1])
            assert default in (value, f"{value}.0"), (command.name, flag, value, default)


def test_the_command_line_synopsis_shows_every_option_of_every_command():
    """The synopsis is where a reader looks for what a command takes: verify's --max-new-tokens, --gamma and --json,
    bench's --max-new-tokens and serve's --allowed-origins were missing from it. An option counts as shown in any of
    its spellings (-n, --no-overwrite); --help and --version are on every command."""
    import click

    from specbuild.cli import cli

    synopsis = README.read_text().split("## The command line")[1].split("```bash")[1].split("```")[0]
    shown, command = {}, None
    for line in filter(str.strip, synopsis.splitlines()):
        if started := re.match(r"\s*specbuild (\w+)", line):
            command = started[1]
        code, _, comment = line.partition("   #")
        flags = set(re.findall(r"(?<![\w-])(--[a-z][a-z-]*|-[a-z])\b", code))
        shown.setdefault(command, set()).update(flags)
        if "on verify" in comment:
            for name in ("verify", "bench", "serve"):
                shown.setdefault(name, set()).update(re.findall(r"(?<![\w-])(--[a-z][a-z-]*)\b", comment))
    missing = {name: [p.opts[0] for p in each.params if isinstance(p, click.Option) and not p.is_eager
                      and not set(p.opts + p.secondary_opts) & shown.get(name, set())]
               for name, each in cli.commands.items()}
    assert not any(missing.values()), missing


def test_the_command_line_synopsis_lists_each_options_choices_as_its_command_takes_them():
    """A choice list (`--tool-call-parser hermes|...`) is the command's own: the synopsis lacked llama4_pythonic when
    serve took it."""
    import click

    from specbuild.cli import cli

    synopsis = README.read_text().split("## The command line")[1].split("```bash")[1].split("```")[0]
    command, listed = None, 0
    for line in filter(str.strip, synopsis.splitlines()):
        if started := re.match(r"\s*specbuild (\w+)", line):
            command = cli.commands[started[1]]
        for flag, choices in re.findall(r"(--[a-z-]+) ([a-z0-9_-]+(?:\|[a-z0-9_-]+)+)(?![\w|])", line.partition("   #")[0]):
            param = next(p for p in command.params if flag in p.opts)
            assert isinstance(param.type, click.Choice), (command.name, flag)
            assert set(choices.split("|")) == set(param.type.choices), (command.name, flag, choices)
            listed += 1
    assert listed >= 7  # --quantize, --precision, --backend, --device, --loss, --generation-config, --tool-call-parser


def test_every_measured_table_says_when_it_was_measured():
    """A figure without its date cannot be told from one the code has since moved: five tables (an earlier bench of
    the demo pair, quantization, the 1.1B layer pair, compile at scale, the other families) said neither. The date
    goes in the paragraph that introduces the table; the troubleshooting table is generated, not measured."""
    undated = []
    for page in PAGES:
        lines = page.read_text().split("\n")
        for number, line in enumerate(lines):
            if not line.startswith("|") or lines[number - 1].startswith("|"):
                continue
            above = number - 1
            while not lines[above].strip():
                above -= 1
            paragraph = []
            while lines[above].strip() and not lines[above].startswith("#"):
                paragraph.append(lines[above])
                above -= 1
            if "troubleshooting: generated" not in " ".join(paragraph) and not re.search(r"\b20\d\d-\d\d-\d\d\b", " ".join(paragraph)):
                undated.append(f"{page.name} line {number + 1}: {line[:60]}")
    assert undated == []


def test_every_section_the_readme_points_to_in_italics_exists():
    """`see *Name*` names a heading or a bold lead-in (`**Name.**`) of the README or of docs/: "*on an H200*" named
    none, and the quick start's list of where to read next is only as good as its names."""
    text = "\n".join(page.read_text() for page in PAGES)
    names = {name.rstrip(".") for name in re.findall(r"(?<![*\w])\*(?!\*)([^*\n]+?)(?<!\s)\*(?![*\w])", text)}
    targets = [h.strip() for h in re.findall(r"^#+ (.+)$", text, re.M)]
    targets += [b.strip().rstrip(".") for b in re.findall(r"\*\*([^*\n]+)\*\*", text)]
    assert {"Adaptive γ", "GPU", "Troubleshooting"} <= names
    assert sorted(name for name in names if not any(target.startswith(name) for target in targets)) == []


def test_every_link_between_the_readme_and_docs_reaches_its_file_and_heading():
    """The README's long sections moved to docs/: a link to a page or heading that moves again must not dangle.
    Anchors are GitHub's: the heading lower-cased, punctuation dropped, spaces as hyphens."""
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            anchors = ([re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
                        for h in re.findall(r"^#+ (.+)$", linked.read_text(), re.M)]
                       if linked.suffix == ".md" and linked.is_file() else [])
            if not linked.exists() or (anchor and anchor not in anchors):
                broken.append(f"{page.name}: {target}")
    assert broken == []


def test_the_readme_names_every_mode_of_the_gpu_session_script():
    """A GPU session is 15 minutes, planned from the list (docs/not-tested.md) of what `benchmarks/gpu_session.sh` runs: `splits`
    was missing from it, and the list said "four calls" of ten modes."""
    script = (README.parent / "benchmarks" / "gpu_session.sh").read_text()
    modes = re.findall(r"^([a-z]+)\)$", script.split('case "${1:-}" in', 1)[1], re.M)
    listed = (README.parent / "docs" / "not-tested.md").read_text()
    assert len(modes) >= 10 and [mode for mode in modes if f"`{mode}" not in listed] == []
    assert not [page.name for page in PAGES if "four calls" in page.read_text()]
