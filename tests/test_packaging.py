"""Packaging promises: the rules install with the engine; GPU users get one onnxruntime."""

from __future__ import annotations

import configparser
import os
import re
import subprocess
import sys
from pathlib import Path

import onnx
import onnxopt
import pytest

ROOT = Path(__file__).resolve().parent.parent


def _cfg():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    return cfg


def _reqs(text: str) -> list[str]:
    return [re.split(r"[<>=!~\[ ;]", line.strip())[0].lower() for line in text.splitlines()
            if line.strip() and not line.strip().startswith("#")]


def test_core_does_not_require_an_onnxruntime_build():
    """Both onnxruntime and onnxruntime-gpu provide the module: the core must name neither."""
    core = _reqs(_cfg()["options"]["install_requires"])
    assert not any(r.startswith("onnxruntime") for r in core)
    extras = _cfg()["options.extras_require"]
    assert _reqs(extras["gpu"]) == ["onnxruntime-gpu"]
    assert "onnxruntime" in _reqs(extras["ort"]) and "onnxruntime-gpu" not in _reqs(extras["ort"])


def test_rules_directory_installs_as_onnxopt_rules():
    opts = _cfg()["options"]
    assert "onnxopt.rules = rules" in opts["package_dir"]
    assert "onnxopt.rules" in opts["packages"]
    import onnxopt.rules

    assert Path(onnxopt.rules.__file__).resolve().parent.name == "rules"
    import importlib

    families = sorted(p.stem for p in (ROOT / "rules").glob("*.py") if not p.stem.startswith("_"))
    assert families, "the rules directory has rule families"
    # every family file is discovered: the built-in set is exactly the union of their RULES
    declared = [r.name for f in families for r in importlib.import_module(f"onnxopt.rules.{f}").RULES]
    assert sorted(declared) == sorted(r.name for r in onnxopt.default_rules())


def test_every_subpackage_of_onnxopt_is_installed():
    """setup.cfg names its packages one by one: a subpackage it lacks (onnxopt.verify) would be
    missing from the wheel while every test run from the checkout passes."""
    listed = _cfg()["options"]["packages"].split()
    found = sorted(".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "onnxopt").rglob("__init__.py"))
    assert found and "onnxopt.verify" in found
    assert [p for p in found if p not in listed] == []


def test_every_data_file_ships():
    """Files under onnxopt/data (the benefit table, the live diff's page) are read at run time: each is
    matched by setup.cfg's package_data, or an installed onnxopt lacks it while the checkout works."""
    import fnmatch
    import re

    patterns = [p for p in re.split(r"[,\s]+", _cfg()["options.package_data"]["onnxopt"]) if p]
    files = [f.relative_to(ROOT / "onnxopt").as_posix() for f in (ROOT / "onnxopt" / "data").rglob("*") if f.is_file()]
    assert "data/diff/live.js" in files
    assert [f for f in files if not any(fnmatch.fnmatchcase(f, p) for p in patterns)] == []


def test_python_dash_m_and_version():
    out = subprocess.run([sys.executable, "-m", "onnxopt", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == f"onnxopt {onnxopt.__version__}"


def test_readme_starts_with_two_setup_commands_and_ci_runs_the_second():
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S)
    assert block and text.index("```bash") < text.index("\n## ")
    commands = [line for line in block.group(1).splitlines() if line.strip()]
    assert len(commands) == 2
    assert "python -m onnxopt" in commands[0] and "pytest" in commands[1]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "sed -n '3p'" in ci  # the second command of the first block, verbatim


def test_readme_first_command_runs_from_the_repository_root(tmp_path):
    """The README's first command, past its `pip install -e`: from the repository root, the
    checkout's onnxopt finds rules/ and models/ through the install's mapping (setup.cfg's
    package_dir), not through an import-time path edit."""
    first = (ROOT / "README.md").read_text().split("```bash\n", 1)[1].splitlines()[0]
    assert first.startswith('pip install -e ".[ort]" && ')
    demo, out = tmp_path / "demo.onnx", tmp_path / "demo.opt.onnx"
    cmd = first.split(" && ", 1)[1].replace("demo.opt.onnx", str(out)).replace("demo.onnx", str(demo))
    cmd = cmd.replace("python -m", f"{sys.executable} -m")  # this interpreter (a virtual environment's too)
    res = subprocess.run(cmd, shell=True, capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": ""})
    assert res.returncode == 0, res.stderr
    assert onnx.load(str(out)).graph.node and "rewrites" in res.stdout + res.stderr


def test_a_checkout_without_the_install_says_so_in_one_line(tmp_path):
    """Without the install's mapping (an uninstalled checkout on sys.path), the rule library is
    missing: one line naming the fix, exit 2; no path edit hides it."""
    code = (
        "import sys\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]\n"
        "import onnxopt\n"
        f"assert onnxopt.__file__.startswith({str(ROOT)!r}), onnxopt.__file__\n"
        "from onnxopt import cli\n"
        "sys.exit(cli.main(['--list-rules']))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "pip install -e ." in out.stderr


def _readme_table(header: str) -> dict[str, str]:
    """The README table under ``header``: each name in backticks in its second column -> the
    first column's (backticked) entry."""
    import re

    text = (ROOT / "docs" / "optimize.md").read_text()  # the README's manual moved there (issue 28, point 7)
    rows = text[text.index(header):].split("\n\n", 1)[0].splitlines()[2:]
    table = {}
    for row in rows:
        first, second = row.strip("|").split("|", 1)
        key = re.findall(r"`([^`]+)`", first)
        for name in re.findall(r"`([a-z0-9_]+)`", second):
            table.setdefault(name, key[0] if key else "")
    return table


def test_readme_rules_table_lists_every_rule_in_its_family_file():
    """Every rule --list-rules prints stands in the README's rules table, in the row of the file
    that defines it; every graph pass stands in the passes table."""
    import importlib
    import pkgutil

    from onnxopt.library import passes
    from onnxopt.library import registry
    from onnxopt import rules

    family_of = {}
    for info in pkgutil.iter_modules(rules.__path__):
        for rule in getattr(importlib.import_module(f"onnxopt.rules.{info.name}"), "RULES", ()):
            family_of[rule.name] = f"{info.name}.py"
    listed, graph_passes = registry.resolve()
    table = _readme_table("| family (`rules/`) | rules |")
    assert {r.name: table.get(r.name) for r in listed} == {r.name: family_of[r.name] for r in listed}
    assert set(table) <= set(family_of), "the README names rules that do not exist"
    pass_table = {row.split("|")[1].strip(" `") for row in
                  (ROOT / "docs" / "optimize.md").read_text().split("| pass | does |")[1].split("\n\n")[0].splitlines()[2:]}
    assert pass_table == set(graph_passes) == set(passes.NAMES)


def test_the_rule_language_loads_light():
    """``import onnxopt.core.pattern`` (what a rules file needs) loads neither onnxruntime, nor onnx's
    reference evaluator, nor the verifier, nor the rule library; ``from onnxopt import optimize,
    Rule`` still works."""
    code = ("import sys, onnxopt.core.pattern\n"
            "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in ('onnxopt', 'onnxruntime')"
            " or m.startswith('onnx.reference'))))\n"
            "from onnxopt import optimize, Rule\n"
            "print(optimize.__module__, Rule.__module__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=ROOT).stdout.splitlines()
    loaded = set(out[0].split())
    # (onnxopt.core and onnxopt.ir: their __init__ files, docstrings only; _compat: the 0.1 import paths)
    assert loaded == {"onnxopt", "onnxopt._compat", "onnxopt._version", "onnxopt.errors", "onnxopt.core",
                      "onnxopt.core.pattern", "onnxopt.ir", "onnxopt.ir.util", "onnxopt.ir.shapes",
                      "onnxopt.targets"}, loaded
    assert out[1] == "onnxopt.api onnxopt.core.pattern"


def _imports(package: str) -> dict[str, set[str]]:
    """module -> the modules of ``package`` it imports (at module level or inside functions)."""
    import ast

    folder = ROOT / {"onnxopt": "onnxopt", "onnxopt.models": "models", "onnxopt.rules": "rules"}[package]
    graph = {}
    for path in folder.rglob("*.py"):
        parts = path.relative_to(folder).with_suffix("").parts
        name = ".".join((package, *parts)).removesuffix(".__init__")
        pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(pkg.split(".")[: len(pkg.split(".")) - node.level + 1] + ([base] if base else []))
                found.add(base)
                found.update(f"{base}.{alias.name}" for alias in node.names)  # (a submodule, or a name in base)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
        # (a module's own enclosing packages are imported before it: reading their names is no circle)
        graph[name] = {m for m in found if (m.startswith(package + ".") or m == package)
                       and not (m == name or name.startswith(m + "."))}
    return graph


@pytest.mark.parametrize("package", ["onnxopt", "onnxopt.models"])
def test_no_import_circles(package):
    """Arrows point one way: no module of the package reaches itself through its imports (those
    inside functions too), the package's own __init__ aside (it hands names on)."""
    graph = _imports(package)
    modules = set(graph)

    def reach(start: str) -> set[str]:
        seen, stack = set(), [start]
        while stack:
            for nxt in graph.get(stack.pop(), ()):
                nxt = nxt if nxt in modules else nxt.rsplit(".", 1)[0]
                if nxt in modules and nxt != package and nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        return seen

    circles = sorted(m for m in modules if m != package and m in reach(m))
    assert not circles, f"modules in an import circle: {circles}"


def test_no_module_uses_another_modules_private_names():
    """onnxopt/, rules/ and scripts/ use only each other's public names: a private name (``io._x``,
    ``from onnxopt.ir.evaluate import _y``) is its module's own business."""
    import ast

    used = []
    for folder in ("onnxopt", "rules", "scripts"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text())
            modules = set()  # local names bound to onnxopt's (or rules') modules
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom):
                    ours = node.level > 0 or (node.module or "").split(".")[0] in ("onnxopt", "rules")
                    own = node.level == 1 and not node.module and path.name == "__init__.py"  # its own submodule
                    for alias in node.names if ours else ():
                        if alias.name.startswith("_") and not alias.name.startswith("__") and not own:
                            used.append(f"{path.relative_to(ROOT)}: from {node.module or '.'} import {alias.name}")
                        modules.add(alias.asname or alias.name)
                elif isinstance(node, ast.Import):
                    modules.update(a.asname or a.name.split(".")[0] for a in node.names
                                   if a.name.split(".")[0] in ("onnxopt", "rules"))
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                    base = node.value
                    while isinstance(base, ast.Attribute):  # onnxopt.ir.evaluate._x
                        base = base.value
                    if isinstance(base, ast.Name) and base.id in modules:
                        used.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert used == []
