"""The arrows between onnxopt's concerns hold: import-linter's contracts (setup.cfg, ``[importlinter]``)
are kept, and no module imports itself back through others, at module level or inside a function.

Both look at the package as it is installed: rules/ and models/ become onnxopt.rules and
onnxopt.models only through setup.cfg's ``package_dir``, so a tool walking the onnxopt/ folder would
not see them. :func:`installed_tree` builds that tree (package_dir read from setup.cfg) in a
temporary folder; import-linter runs there in a child process whose PYTHONPATH points at it.
"""

from __future__ import annotations

import ast
import configparser
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SETUP_CFG = ROOT / "setup.cfg"


def package_dirs(setup_cfg: Path = SETUP_CFG) -> dict[str, str]:
    """setup.cfg's ``[options] package_dir``: dotted package name -> folder of the checkout."""
    cfg = configparser.ConfigParser()
    cfg.read(setup_cfg)
    out = {}
    for line in cfg["options"]["package_dir"].strip().splitlines():
        name, _, folder = line.partition("=")
        out[name.strip()] = folder.strip()
    return out


def installed_tree(dest: Path, root: Path = ROOT) -> Path:
    """The package tree as setup.cfg installs it, copied under ``dest`` (``dest/onnxopt/rules`` is the
    checkout's rules/, ...); parents before children, so a mapped child lands inside its parent."""
    for name, folder in sorted(package_dirs(root / "setup.cfg").items(), key=lambda kv: kv[0].count(".")):
        shutil.copytree(root / folder, dest.joinpath(*name.split(".")),
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"), dirs_exist_ok=True)
    return dest


def module_files(tree: Path, package: str) -> dict[str, tuple[Path, bool]]:
    """Every module of ``package`` under ``tree``: dotted name -> (file, is a package's __init__)."""
    out = {}
    base = tree / package
    for path in sorted(base.rglob("*.py")):
        rel = path.relative_to(tree).with_suffix("")
        if "__pycache__" in rel.parts:
            continue
        # a folder without __init__.py is no package of it (data, say)
        if not all((tree.joinpath(*rel.parts[:i]) / "__init__.py").exists() for i in range(1, len(rel.parts))):
            continue
        is_pkg = rel.name == "__init__"
        parts = rel.parts[:-1] if is_pkg else rel.parts
        out[".".join(parts)] = (path, is_pkg)
    return out


def _imported_names(node: ast.AST, package_of_module: str) -> list[str]:
    """The dotted names one node imports: ``import a.b``, ``from a import b`` (as ``a.b``; reduced
    to ``a`` later where ``a.b`` is no module), relative forms, and ``importlib.import_module`` of a
    string literal."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.level:
            parts = package_of_module.split(".")
            base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        return [f"{base}.{alias.name}" for alias in node.names] + [base]
    if (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and (getattr(node.func, "attr", None) or getattr(node.func, "id", None)) == "import_module"):
        return [node.args[0].value]
    return []


def import_graph(tree: Path, package: str = "onnxopt") -> dict[str, dict[str, int]]:
    """module -> {module it imports: line}, for every import anywhere in the module (module level,
    functions, classes). Importing ``a.b.c`` runs ``a`` and ``a.b`` first, so it counts as importing
    them too; a module's own enclosing packages are left out (they are always imported before it, so
    a submodule reading a name its package's __init__ re-exports is no cycle)."""
    files = module_files(tree, package)

    def known(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {m: {} for m in files}
    for module, (path, is_pkg) in files.items():
        pkg = module if is_pkg else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            names = _imported_names(node, pkg)
            if isinstance(node, ast.ImportFrom) and names:
                base = names.pop()  # `from a import b`: a.b where that is a module, else a
                names = [n if n in files else base for n in names]
            for name in names:
                target = known(name)
                while target:
                    if target != module and not module.startswith(target + "."):
                        graph[module].setdefault(target, node.lineno)
                    target = target.rpartition(".")[0]
    return graph


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) per strongly connected group of modules (Tarjan's algorithm,
    iterative); empty when the graph has none."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    group = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        group.append(w)
                        if w == v:
                            break
                    if len(group) > 1:
                        groups.append(group)
    return [_cycle_in(graph, set(g)) for g in groups]


def _cycle_in(graph: dict[str, dict[str, int]], group: set[str]) -> list[str]:
    """A shortest cycle through the group's first module (breadth-first back to it)."""
    start = min(group)
    came_from = {start: None}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w == start:
                    path = [v]
                    while came_from[path[-1]] is not None:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if w in group and w not in came_from:
                    came_from[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start}")


def cycle_text(graph: dict[str, dict[str, int]], cycle: list[str]) -> str:
    return " -> ".join(f"{a} (l.{graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"


# --- no import cycles ---------------------------------------------------------------------------

def test_no_import_cycle_between_modules(tmp_path):
    """onnxopt with its rules/ and models/ as installed: no module reaches itself through the modules
    it imports, counting imports inside functions."""
    graph = import_graph(installed_tree(tmp_path))
    assert "onnxopt.rules.qdq" in graph and "onnxopt.models.zoo" in graph  # the mapped packages are seen
    cycles = find_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(cycle_text(graph, c) for c in cycles)


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def test_cycle_finder_sees_an_import_inside_a_function(tmp_path):
    """A cycle whose closing import sits in a function body (the lazy import that hides it at load
    time) is found and listed, with the line of each import."""
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/low.py": "X = 1\n\ndef f():\n    from pkg.high import Y\n    return Y\n",
        "pkg/high.py": "from pkg.low import X\nY = X\n",
        "pkg/other.py": "import pkg.low\n",
    })
    graph = import_graph(tmp_path, "pkg")
    cycles = find_cycles(graph)
    assert cycles == [["pkg.high", "pkg.low", "pkg.high"]]
    assert cycle_text(graph, cycles[0]) == "pkg.high (l.1) -> pkg.low (l.4) -> pkg.high"


def test_cycle_finder_counts_a_package_init_and_dynamic_imports(tmp_path):
    """Importing a submodule runs its package's __init__: an __init__ that imports back is a cycle;
    so is one closed by ``importlib.import_module("...")``. A package re-exporting its own submodules,
    read back by them (``from pkg import name``), is not."""
    _write(tmp_path, {
        "pkg/__init__.py": "from pkg.a import A\n",
        "pkg/a.py": "A = 1\nfrom pkg import A as again\n",  # reads its own package: no cycle
        "pkg/sub/__init__.py": "from pkg.b import B\n",
        "pkg/sub/c.py": "C = 1\n",
        "pkg/b.py": "import importlib\nB = 1\ndef f():\n    return importlib.import_module('pkg.sub.c')\n",
    })
    graph = import_graph(tmp_path, "pkg")
    assert "pkg" not in graph["pkg.a"]
    assert find_cycles(graph) == [["pkg.b", "pkg.sub", "pkg.b"]]  # pkg.b -> pkg.sub.c runs pkg.sub's __init__


# --- import-linter's contracts --------------------------------------------------------------------

def _lint_imports(tree: Path) -> subprocess.CompletedProcess:
    """lint-imports on the installed tree, with setup.cfg's contracts, in a child process that finds
    onnxopt in ``tree`` (PYTHONPATH first on sys.path, before the editable install's finder)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run([sys.executable, "-c", code, "--no-cache", "--no-logo", str(SETUP_CFG)], cwd=tree,
                          env=env, capture_output=True, text=True, timeout=300)


def _require_import_linter():
    pytest.importorskip("importlinter", reason="import-linter is not installed (it is in setup.cfg's test extra: "
                                               "pip install -e .[test])")


def test_import_contracts_are_kept(tmp_path):
    _require_import_linter()
    out = _lint_imports(installed_tree(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout, out.stdout


def test_import_contracts_see_the_installed_rules(tmp_path):
    """The check reads onnxopt.rules, not only the onnxopt/ folder: a rule importing quantize inside a
    function, planted in the copy, breaks the rules contract (and the layers)."""
    _require_import_linter()
    tree = installed_tree(tmp_path)
    (tree / "onnxopt" / "rules" / "planted.py").write_text(
        "def condition(m):\n    from onnxopt.quantize import plan\n    return plan\n")
    out = _lint_imports(tree)
    assert out.returncode != 0, out.stdout
    text = out.stdout
    assert "Rules import only the rule language and the helpers they use" in text
    assert "onnxopt.rules.planted -> onnxopt.quantize.plan" in text, text
    assert "0 broken" not in text


def test_import_contracts_see_a_low_layer_importing_the_front_door(tmp_path):
    """A module of ir importing the API (below it everything may not) breaks the layers and the
    front-doors contract."""
    _require_import_linter()
    tree = installed_tree(tmp_path)
    (tree / "onnxopt" / "ir" / "planted.py").write_text("import onnxopt.api\n")
    out = _lint_imports(tree)
    assert out.returncode != 0
    assert "onnxopt.ir.planted -> onnxopt.api" in out.stdout, out.stdout


def test_no_contract_ignores_an_import():
    """No contract holds an exception: every arrow of the code is the contracts' (the pipeline's
    interim imports of the passes went with the pass contract, onnxopt.core.passes)."""
    cfg = configparser.ConfigParser()
    cfg.read(SETUP_CFG)
    for section in cfg.sections():
        if not section.startswith("importlinter:contract:"):
            continue
        ignored = [line.strip() for line in cfg[section].get("ignore_imports", "").splitlines()
                   if line.strip() and not line.strip().startswith("#")]
        assert ignored == [], (section, ignored)


def test_every_part_of_onnxopt_is_in_the_layers(tmp_path):
    """A new subpackage or top-level module has its place in the layers contract (or is named here as
    outside it, with the reason), so no concern escapes the arrows."""
    outside = {
        "onnxopt": "the package root: re-exports the rule language and the API",
        "onnxopt.__main__": "python -m onnxopt: calls the command line",
        "onnxopt._compat": "the 0.1 import paths, imported only when asked for",
        "onnxopt.models": "the zoo's model builders (tests and benchmarks); the model-builders contract",
    }
    cfg = configparser.ConfigParser()
    cfg.read(SETUP_CFG)
    layered = {m.strip() for line in cfg["importlinter:contract:layers"]["layers"].splitlines()
               for m in line.replace(":", "|").split("|") if m.strip()}
    tops = {".".join(m.split(".")[:2]) for m in module_files(installed_tree(tmp_path), "onnxopt")}
    assert sorted(tops - layered - set(outside)) == []
    assert sorted(layered - tops) == []  # (and the contract names nothing that is not there)
