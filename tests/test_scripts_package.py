"""scripts/ is a package run from the repository root with ``python -m scripts.<purpose>.<name>``: every
module imports that way with no path set-up, none edits ``sys.path``, every runnable one answers
``--help``, the commands and paths the sources and documents name exist, and onnxopt never imports
scripts."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"
# the roots of this checkout's own imports: a module missing under them is a broken import, not an
# optional dependency
OURS = ("scripts", "onnxopt", "tests", "rules", "models")


def _python_files() -> list[Path]:
    return sorted(p for p in SCRIPTS.rglob("*.py") if "results" not in p.relative_to(SCRIPTS).parts)


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runnable(path: Path) -> bool:
    return re.search(r"^if __name__\s*==\s*['\"]__main__['\"]\s*:", path.read_text(), re.M) is not None


MODULES = [_module(p) for p in _python_files()]
RUNNABLE = [_module(p) for p in _python_files() if _runnable(p)]

# One interpreter, started as `python -m` starts one from the root (the working folder first on the
# path, no PYTHONPATH): import every module, then run each runnable one as __main__ with --help.
_PROBE = r"""
import contextlib, importlib, io, json, runpy, sys, time, traceback
modules, runnable, ours = json.loads(sys.argv[1])
out = {"imports": {}, "help": {}}
for name in modules:
    try:
        importlib.import_module(name)
        out["imports"][name] = {"ok": True}
    except ModuleNotFoundError as exc:
        optional = (exc.name or "").split(".")[0] not in ours
        out["imports"][name] = {"ok": False, "optional": optional, "missing": exc.name,
                                "error": traceback.format_exc(limit=-3)}
    except BaseException:
        out["imports"][name] = {"ok": False, "optional": False, "error": traceback.format_exc(limit=-3)}
for name in runnable:
    if not out["imports"][name]["ok"]:
        continue
    sys.argv = [name, "--help"]
    text, t0, code = io.StringIO(), time.perf_counter(), "returned"
    try:
        with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
            runpy.run_module(name, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code
    except BaseException:
        code = traceback.format_exc(limit=-3)
    out["help"][name] = {"code": code, "seconds": time.perf_counter() - t0, "text": text.getvalue()[:2000]}
print(json.dumps(out))
"""


def _root_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


@pytest.fixture(scope="module")
def probe():
    run = subprocess.run([sys.executable, "-c", _PROBE, json.dumps([MODULES, RUNNABLE, OURS])], cwd=ROOT,
                         env=_root_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_the_layout_is_the_documented_one():
    """The folders other documents name: bench/, data/, oracles/, gpu/, docs/ (results/ is data)."""
    for name in ("scripts.bench.peers", "scripts.bench.engine", "scripts.data.benefit", "scripts.data.quant_costs",
                 "scripts.oracles.fold", "scripts.oracles.zoo_hashes", "scripts.docs.screenshots"):
        assert name in RUNNABLE, name
    assert sorted(p.name for p in (SCRIPTS / "gpu").glob("*.sh")) == [
        "bench.sh", "benefit.sh", "decoders.sh", "env.sh", "layout.sh", "layout_verify.sh", "targets.sh", "transformers.sh",
        "verify.sh"]
    assert [p.name for p in SCRIPTS.glob("*.py")] == ["__init__.py"]  # nothing loose at the top


@pytest.mark.parametrize("name", MODULES)
def test_module_imports_from_the_root_without_path_setup(probe, name):
    got = probe["imports"][name]
    if not got["ok"] and got["optional"]:
        pytest.skip(f"{name} needs {got['missing']}, which is not installed")
    assert got["ok"], got["error"]


@pytest.mark.parametrize("name", RUNNABLE)
def test_help_exits_0_quickly(probe, name):
    got = probe["imports"][name]
    if not got["ok"] and got["optional"]:
        pytest.skip(f"{name} needs {got['missing']}, which is not installed")
    h = probe["help"][name]
    assert h["code"] in (0, None), h
    assert "usage:" in h["text"], h["text"]
    assert h["seconds"] < 20, h["seconds"]  # --help parses arguments; it measures nothing


def test_python_m_from_the_root_runs_a_script():
    """The real command line, not the probe's emulation: `python -m scripts.bench.peers --help`."""
    run = subprocess.run([sys.executable, "-m", "scripts.bench.peers", "--help"], cwd=ROOT, env=_root_env(),
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith("usage: python -m scripts.bench.peers")


def _edits_sys_path(tree: ast.AST) -> list[int]:
    """Lines that change sys.path: its insert/append/extend/remove/clear, an assignment to it or to a
    slice of it, ``+=``; or site.addsitedir."""

    def is_sys_path(node) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
                and node.value.id == "sys")

    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if is_sys_path(node.func.value) or node.func.attr == "addsitedir":
                if node.func.attr in ("insert", "append", "extend", "remove", "clear", "pop", "addsitedir"):
                    lines.append(node.lineno)
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:
            if is_sys_path(t) or (isinstance(t, ast.Subscript) and is_sys_path(t.value)):
                lines.append(node.lineno)
    return sorted(lines)


def test_no_file_under_scripts_edits_sys_path():
    edits = [f"{p.relative_to(ROOT)}:{n}" for p in _python_files() for n in _edits_sys_path(ast.parse(p.read_text()))]
    assert edits == []


def test_the_sys_path_check_sees_an_edit():
    assert _edits_sys_path(ast.parse("import sys\nsys.path.insert(0, 'x')\nsys.path[:0] = ['y']\n")) == [2, 3]
    assert _edits_sys_path(ast.parse("import sys\nprint(sys.path)\n")) == []


def test_onnxopt_never_imports_scripts():
    found = []
    for folder in ("onnxopt", "rules", "models"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            text = path.read_text()
            if "scripts" not in text:  # (parse only what may import it)
                continue
            for node in ast.walk(ast.parse(text)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
                found += [f"{path.relative_to(ROOT)}:{node.lineno}" for n in names if n.split(".")[0] == "scripts"]
    assert found == []


# The sources and documents that name scripts (scripts/results/ holds
# the commands as they were run).
_NAMING = ["scripts", "tests", "docs", "onnxopt", "models", "rules", "README.md", "BENCHMARKS.md", ".ci"]


def _texts():
    for top in _NAMING:
        base = ROOT / top
        files = [base] if base.is_file() else sorted(
            p for p in base.rglob("*") if p.is_file() and p.suffix in (".py", ".sh", ".md", ".txt", "")
            and "results" not in p.relative_to(ROOT).parts and "__pycache__" not in p.parts)
        for path in files:
            yield path, path.read_text(errors="replace")


def test_commands_and_paths_named_exist():
    """Every `python -m scripts...` named in the sources and documents is a runnable module, and every
    scripts/... file they name exists (the flat layout's names are gone)."""
    bad, seen = [], 0
    for path, text in _texts():
        for n, line in enumerate(text.splitlines(), 1):
            for m in re.finditer(r"python3? -m (scripts(?:\.\w+)+)", line):
                seen += 1
                if m.group(1) not in RUNNABLE:
                    bad.append(f"{path.relative_to(ROOT)}:{n}: {m.group(1)} is not a runnable script")
            for m in re.finditer(r"(?<![\w/.-])scripts/[\w/.-]+\.(?:py|sh|txt)\b", line):
                seen += 1
                if not (ROOT / m.group(0)).exists():
                    bad.append(f"{path.relative_to(ROOT)}:{n}: {m.group(0)} does not exist")
    assert seen > 50 and bad == [], "\n".join(bad)
