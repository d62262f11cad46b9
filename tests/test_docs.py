"""The README and docs/ are tested (issue 28, point 7).

- The README runs: every ```bash block's commands and every ```python block run, in document order, in one
  temporary folder (the first block's `demo.onnx` is what the later examples read). A block whose first line
  is a comment naming a file (`# onnxopt.toml`) is written there instead. What cannot run here is marked in
  the README, and skipped with the reason printed:
    - a command (or a python block's first line) ending in `# long: WHY`, `# gpu: WHY` or `# network: WHY`;
    - a command that runs the whole test suite (`python -m pytest` with no path): that is what CI runs;
    - a leading `pip install ... &&` is left out (this environment is the one it installs) and the rest runs.
- docs/architecture.md's tree names every module (.py) under onnxopt/ and rules/, and no module that does
  not exist; every `onnxopt/...`, `rules/...`, `models/...` and `tests/...` path it (or any page) names
  exists, and every dotted `onnxopt.x.y` name resolves to a module or an attribute of one.
- README.md is at most 220 lines; every relative link (and its #anchor) in README.md, BENCHMARKS.md and
  docs/*.md points to an existing file (and heading).
CPU only; the README's runnable commands take about 30 s on a 2-core machine.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, ROOT / "BENCHMARKS.md", *DOCS]

MARK = re.compile(r"\s#\s*(long|gpu|network):\s*(.*?)\s*$")
FILE_HEADER = re.compile(r"^#\s*([\w.-]+\.[A-Za-z]+)\s*$")
BUDGET_S = 240  # the whole README; each command also has its own limit
COMMAND_S = 120


def fenced_blocks(text: str):
    """(language, first line number, body) of each fenced code block, in order."""
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        m = re.match(r"^```(\S*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        start = i + 1
        j = start
        while j < len(lines) and lines[j].rstrip() != "```":
            j += 1
        yield m.group(1), start + 1, "\n".join(lines[start:j])
        i = j + 1


def shell_commands(body: str) -> list[str]:
    """The commands of a bash block: lines joined where they end in a backslash, blank and comment lines
    left out."""
    commands, current = [], ""
    for line in body.split("\n"):
        current += line
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        if current.strip() and not current.lstrip().startswith("#"):
            commands.append(current.strip())
        current = ""
    return commands


def plan(command: str) -> tuple[str | None, str | None, str | None]:
    """(the command to run or None, why it is skipped, a note on what was left out)."""
    m = MARK.search(command)
    if m:
        return None, f"{m.group(1)}: {m.group(2)}", None
    note = None
    install = re.match(r"^pip install [^&;|]*&&\s*(.*)$", command)
    if install:
        command, note = install.group(1), "its `pip install` step left out (this environment is installed)"
    if re.match(r"^python3? -m pytest(\s+-\S+)*\s*$", command):
        return None, "the whole test suite: .ci/run runs it", note
    return command, None, note


def _environment(folder: Path) -> dict:
    shim = folder / ".bin"
    shim.mkdir()
    (shim / "python").symlink_to(sys.executable)
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(shim), os.path.dirname(sys.executable), env.get("PATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("PYTHONPATH", None)
    return env


def test_plan_reads_the_markers():
    assert plan("python -m onnxopt diff a b   # long: serves until Ctrl-C") == (None, "long: serves until Ctrl-C",
                                                                                   None)
    assert plan("onnxopt x.onnx --verify cpu,cuda  # gpu: needs a CUDA device")[1] == "gpu: needs a CUDA device"
    run, why, note = plan('pip install -e ".[ort]" && python -m onnxopt a.onnx -o b.onnx')
    assert run == "python -m onnxopt a.onnx -o b.onnx" and why is None and "pip install" in note
    run, why, _ = plan('pip install -e ".[test]" && python -m pytest -q')
    assert run is None and "whole test suite" in why
    assert plan("python -m pytest -q tests/test_docs.py")[0] == "python -m pytest -q tests/test_docs.py"
    assert shell_commands("a \\\n  b\n# c\n\nd  # e") == ["a    b", "d  # e"]


def test_the_readme_runs(tmp_path):
    env = _environment(tmp_path)
    deadline = time.monotonic() + BUDGET_S
    ran, skipped = 0, []
    for lang, line, body in fenced_blocks(README.read_text()):
        first = body.split("\n", 1)[0]
        header = FILE_HEADER.match(first)
        if header:
            (tmp_path / header.group(1)).write_text(body + "\n")
            continue
        if lang == "bash":
            steps = []
            for command in shell_commands(body):
                run, why, note = plan(command)
                if note:
                    print(f"README.md:{line}: {note}: {command}")
                if why:
                    skipped.append(f"README.md:{line}: skipped ({why}): {command}")
                else:
                    steps.append((["bash", "-c", run], run))
        elif lang == "python":
            m = MARK.search(first)
            if m:
                skipped.append(f"README.md:{line}: skipped ({m.group(1)}: {m.group(2)}): python block")
                continue
            script = tmp_path / f"readme_{line}.py"
            script.write_text(body + "\n")
            steps = [([sys.executable, str(script)], f"the python block at line {line}")]
        else:
            continue
        for argv, shown in steps:
            left = deadline - time.monotonic()
            assert left > 0, f"the README's commands took over {BUDGET_S} s: mark the long ones (# long: why)"
            began = time.monotonic()
            out = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                                 timeout=min(left, COMMAND_S))
            print(f"README.md:{line}: {time.monotonic() - began:.1f} s: {shown}")
            assert out.returncode == 0, (f"README.md:{line}: `{shown}` exited {out.returncode}\n"
                                         f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
            ran += 1
    for message in skipped:
        print(message)
    assert ran >= 10, f"only {ran} README commands ran"
    assert (tmp_path / "demo.opt.onnx").is_file() and (tmp_path / "demo.int8.onnx").is_file()


# ---------------------------------------------------------------------------------------------
# docs/architecture.md


def architecture_tree() -> list[str]:
    """The paths the tree under "## The tree" names (folders end in /), from its indentation."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text[text.index("## The tree"):]
    body = next(b for lang, _, b in fenced_blocks(section))
    paths, stack = [], []
    for line in body.split("\n"):
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        assert indent % 2 == 0, f"architecture.md: odd indentation: {line!r}"
        depth = indent // 2
        name = line.split()[0]
        del stack[depth:]
        assert len(stack) == depth, f"architecture.md: {line!r} is indented under no folder"
        paths.append("".join(stack) + name)
        if name.endswith("/"):
            stack.append(name)
    return paths


def _modules(top: str) -> set[str]:
    return {p.relative_to(ROOT).as_posix() for p in (ROOT / top).rglob("*.py") if "__pycache__" not in p.parts}


def test_architecture_names_every_module():
    named = set(architecture_tree())
    missing = sorted((_modules("onnxopt") | _modules("rules")) - named)
    assert not missing, f"docs/architecture.md's tree misses these modules: {missing}"


def test_architecture_names_no_module_that_does_not_exist():
    scripts_package = (ROOT / "scripts" / "bench").is_dir()  # issue 28, point 6
    ghosts = [p for p in architecture_tree() if not (ROOT / p).exists()
              and (scripts_package or not p.startswith("scripts/") or p == "scripts/results/")]
    assert not ghosts, f"docs/architecture.md's tree names what does not exist: {ghosts}"


def test_the_tree_parser():
    assert architecture_tree()[:2] == ["onnxopt/", "onnxopt/__init__.py"]
    assert "onnxopt/core/driver.py" in architecture_tree() and "rules/conv.py" in architecture_tree()


_PATH = re.compile(r"(?<![\w./-])((?:onnxopt|rules|models|tests|scripts)/[^\s`'\"),;:|\]]*)")


def test_paths_named_in_the_docs_exist():
    """`onnxopt/...`, `rules/...`, `models/...`, `tests/...` in the README and docs/ exist (scripts/ too once
    it is the package of issue 28, point 6: scripts/bench/)."""
    check_scripts = (ROOT / "scripts" / "bench").is_dir()
    ghosts = []
    for page in [README, *DOCS]:
        for n, line in enumerate(page.read_text().split("\n"), 1):
            for path in _PATH.findall(line):
                if path.startswith("scripts/") and not check_scripts:
                    continue
                path = path.rstrip(".")
                if any(c in path for c in "<*{$"):
                    continue  # a pattern (tests/rules/test_<family>.py, cuda-*.json), not a path
                if not (ROOT / path).exists():
                    ghosts.append(f"{page.relative_to(ROOT)}:{n}: {path}")
    assert not ghosts, "paths that do not exist:\n" + "\n".join(ghosts)


_DOTTED = re.compile(r"(?<![\w.])(onnxopt(?:\.[A-Za-z_]\w*)+)")


def _resolves(name: str) -> bool:
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        module = ".".join(parts[:k])
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                obj = importlib.import_module(module)
        except ImportError:
            continue
        for attr in parts[k:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def _metadata_keys() -> set[str]:
    """The `onnxopt.*` strings the code writes (metadata keys such as onnxopt.rule, onnxopt.io_layout)."""
    keys = set()
    for top in ("onnxopt", "rules"):
        for path in (ROOT / top).rglob("*.py"):
            keys.update(re.findall(r"[\"'](onnxopt\.[\w.]+)[\"']", path.read_text()))
    return keys


def test_dotted_names_in_the_docs_resolve():
    """Every `onnxopt.x.y` the README and docs/ name is a module, or an attribute of one (0.1's aliases
    count: they still import), or a metadata key the code writes."""
    ghosts, keys = [], _metadata_keys()
    for page in [README, *DOCS]:
        for n, line in enumerate(page.read_text().split("\n"), 1):
            for name in _DOTTED.findall(line):
                name = name.rstrip(".")
                if name.endswith((".onnx", ".toml", ".json", ".html", ".md", ".py")):
                    continue  # a file name (onnxopt.toml), not a module
                if name not in keys and not _resolves(name):
                    ghosts.append(f"{page.relative_to(ROOT)}:{n}: {name}")
    assert not ghosts, "names that resolve to nothing:\n" + "\n".join(ghosts)


# ---------------------------------------------------------------------------------------------
# Size and links


def test_readme_is_short():
    lines = README.read_text().count("\n")
    assert lines <= 220, f"README.md has {lines} lines: the manual belongs in docs/"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    anchors, seen = set(), {}
    text = page.read_text()
    outside = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    for m in re.finditer(r"^#{1,6}\s+(.*)$", outside, flags=re.M):
        slug = _slug(m.group(1))
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def test_the_slugs_are_githubs():
    assert _slug("The terminal, `--list-rules` and exit codes") == "the-terminal---list-rules-and-exit-codes"
    assert _slug("INT8 quantization (onnxruntime CPU): onnxopt, onnxruntime's quantize_static, AMD Quark") == \
        "int8-quantization-onnxruntime-cpu-onnxopt-onnxruntimes-quantize_static-amd-quark"


def test_relative_links_point_to_existing_files():
    broken = []
    for page in PAGES:
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^[a-z]+:", target):
                continue  # https:, mailto:
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_ci_reads_the_readmes_test_command():
    """.ci/run takes line 3 of the README's first bash block (its second line of commands)."""
    block = next(body for lang, _, body in fenced_blocks(README.read_text()) if lang == "bash")
    assert block.split("\n")[1] == 'pip install -e ".[test,export,bench]" && python -m pytest -q'
    ci = (ROOT / ".ci" / "run").read_text()
    command = subprocess.run(["bash", "-c", "sed -n '/^```bash$/,/^```$/p' README.md | sed -n '3p'"],
                             cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert "sed -n '3p'" in ci and command == block.split("\n")[1]


@pytest.mark.parametrize("page", DOCS, ids=[p.name for p in DOCS])
def test_each_page_is_listed_in_the_index(page):
    if page.name != "index.md":
        assert f"]({page.name})" in (ROOT / "docs" / "index.md").read_text(), f"docs/index.md omits {page.name}"
