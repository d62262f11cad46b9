"""onnxopt 0.1's import paths keep working after its modules were grouped by concern (onnxopt._compat):
each old path imports, is the moved module itself, and warns DeprecationWarning naming the new path;
a rules file written against 0.1 loads and runs through the API, ``--rules`` and a config file's
``rules`` key.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import onnxopt
from onnxopt import _compat

# Every module of onnxopt at 959530a (the last commit before the move), from
# `git ls-tree -r --name-only 959530a onnxopt/` (the flat modules, and the two subpackages of then),
# with the module each is now. None: the same path today (a module then, maybe a package now).
OLD_PATHS = {
    "onnxopt": None,
    "onnxopt.__main__": None,
    "onnxopt.advice": "onnxopt.targets.advice",
    "onnxopt.analysis": "onnxopt.inspect.analysis",
    "onnxopt.api": None,
    "onnxopt.benefit": "onnxopt.targets.benefit",
    "onnxopt.bisect": "onnxopt.verify.bisect",
    "onnxopt.cli": None,
    "onnxopt.config": "onnxopt.cli.config",
    "onnxopt.console": "onnxopt.reporting.console",
    "onnxopt.diff": None,
    "onnxopt.diff_live": "onnxopt.diff.live",
    "onnxopt.driver": "onnxopt.core.driver",
    "onnxopt.errors": None,
    "onnxopt.evaluate": "onnxopt.ir.evaluate",
    "onnxopt.html_report": "onnxopt.reporting.html",
    "onnxopt.input_shapes": "onnxopt.ir.input_shapes",
    "onnxopt.io": "onnxopt.ir.io",
    "onnxopt.irutil": "onnxopt.ir.util",
    "onnxopt.kernels": "onnxopt.ir.kernels",
    "onnxopt.layout": "onnxopt.transforms.edges",
    "onnxopt.layout_pass": "onnxopt.transforms.transposes",
    "onnxopt.liveness": "onnxopt.transforms.liveness",
    "onnxopt.memory": "onnxopt.transforms.memory",
    "onnxopt.onnxscript_rules": "onnxopt.library.onnxscript_rules",
    "onnxopt.optypes": "onnxopt.ir.optypes",
    "onnxopt.passes": "onnxopt.library.passes",
    "onnxopt.pattern": "onnxopt.core.pattern",
    "onnxopt.pipeline": "onnxopt.core.pipeline",
    "onnxopt.precision": "onnxopt.transforms.precision",
    "onnxopt.purity": "onnxopt.core.purity",
    "onnxopt.quantize": None,
    "onnxopt.quantize.api": None,
    "onnxopt.quantize.calibrate": None,
    "onnxopt.quantize.coverage": None,
    "onnxopt.quantize.data": None,
    "onnxopt.quantize.fidelity": None,
    "onnxopt.quantize.plan": None,
    "onnxopt.readers": None,
    "onnxopt.recompute": "onnxopt.transforms.recompute",
    "onnxopt.registry": "onnxopt.library.registry",
    "onnxopt.report": "onnxopt.reporting.text",
    "onnxopt.shapes": "onnxopt.ir.shapes",
    "onnxopt.stats": "onnxopt.core.stats",
    "onnxopt.targets": None,
    "onnxopt.verify": None,
    "onnxopt.verify.compare": None,
    "onnxopt.verify.culprit": None,
    "onnxopt.verify.fp16": None,
    "onnxopt.verify.inputs": None,
    "onnxopt.verify.profile": None,
    "onnxopt.verify.runtime": None,
}
MOVED = {old: new for old, new in OLD_PATHS.items() if new is not None}
# 0.1 names whose module's new home may not import their new home (a layer above): old path -> name -> home
MOVED_NAMES = {"onnxopt.precision": {"convert_fp16_checked": "onnxopt.verify.fp16_fallback",
                                     "MAX_CANDIDATES": "onnxopt.verify.fp16_fallback"}}


def _moved_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning) and "moved to" in str(w.message)]


def test_the_list_is_the_alias_table():
    """Every moved 0.1 path is an alias, and the alias table holds no path that was not onnxopt's."""
    assert _compat.MOVED == MOVED
    assert _compat.MOVED_NAMES == MOVED_NAMES


@pytest.mark.parametrize("old", sorted(MOVED))
def test_a_moved_path_is_the_module_and_warns(old, monkeypatch):
    new = MOVED[old]
    module = importlib.import_module(new)
    monkeypatch.delitem(sys.modules, old, raising=False)  # a fresh import of the old path (it warns once)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        aliased = importlib.import_module(old)
    assert _moved_warnings(caught) == [f"{old} moved to {new}; import it from there (the old path will be removed)"]
    if old in MOVED_NAMES:  # a stand-in: the new module's names through it
        assert aliased is not module and aliased.__name__ == old
        public = [n for n in vars(module) if not n.startswith("_")]
        assert public and all(getattr(aliased, n) is getattr(module, n) for n in public)
    else:
        assert aliased is module
        assert module.__spec__.name == new  # importing the old path leaves the module's own spec alone


@pytest.mark.parametrize("old", sorted(MOVED))
def test_from_onnxopt_import_old_name(old, monkeypatch):
    """``from onnxopt import pattern`` (the other 0.1 spelling) gives the same module, with the warning."""
    short = old.rpartition(".")[2]
    monkeypatch.delitem(sys.modules, old, raising=False)
    monkeypatch.delattr(onnxopt, short, raising=False)
    namespace: dict = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(compile(f"from onnxopt import {short}", "users_code.py", "exec"), namespace)
    assert any(MOVED[old] in m for m in _moved_warnings(caught))
    assert caught[0].filename == "users_code.py"  # the warning points at the user's import, not at importlib
    assert namespace[short] is sys.modules[old]


@pytest.mark.parametrize("old", sorted(p for p, new in OLD_PATHS.items() if new is None and p != "onnxopt.__main__"))
def test_a_kept_path_imports_without_warning(old):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    assert module.__name__ == old
    assert _moved_warnings(caught) == []


def test_a_name_moved_up_a_layer_comes_from_its_new_home(monkeypatch):
    """onnxopt.precision's measured conversion went to onnxopt.verify.fp16_fallback (transforms may not
    import verify): ``from onnxopt.precision import convert_fp16_checked`` still works, and says where."""
    from onnxopt.verify import fp16_fallback
    from onnxopt.transforms import precision

    monkeypatch.delitem(sys.modules, "onnxopt.precision", raising=False)
    namespace: dict = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(compile("from onnxopt.precision import convert_fp16, convert_fp16_checked, MAX_CANDIDATES",
                     "users_code.py", "exec"), namespace)
    assert namespace["convert_fp16"] is precision.convert_fp16
    assert namespace["convert_fp16_checked"] is fp16_fallback.convert_fp16_checked
    assert namespace["MAX_CANDIDATES"] == fp16_fallback.MAX_CANDIDATES
    assert _moved_warnings(caught) == [
        "onnxopt.precision moved to onnxopt.transforms.precision; import it from there (the old path will be removed)",
        "onnxopt.precision.convert_fp16_checked moved to onnxopt.verify.fp16_fallback.convert_fp16_checked; "
        "import it from there (the old path will be removed)",
        "onnxopt.precision.MAX_CANDIDATES moved to onnxopt.verify.fp16_fallback.MAX_CANDIDATES; "
        "import it from there (the old path will be removed)"]
    assert {w.filename for w in caught} == {"users_code.py"}
    with pytest.raises(AttributeError):
        sys.modules["onnxopt.precision"].no_such_name


# --- a users' rules file written against 0.1 ---------------------------------------------------------

RULES_0_1 = textwrap.dedent('''
    """A rules file as 0.1's README taught: the rule language from onnxopt.pattern, helpers from
    onnxopt.irutil and onnxopt.shapes."""
    from onnxopt.pattern import Op, Rule
    from onnxopt.irutil import use_count
    from onnxopt.shapes import infer  # noqa: F401  (imported as 0.1's rules did)


    def _once(m):
        return None if use_count(m.node("inner").outputs[0]) == 1 else "the inner Neg has other readers"


    RULES = [Rule("neg_neg_0_1", Op("Neg", Op("Neg", "x", name="inner"), name="outer"), lambda m, b: m["x"],
                  condition=_once, exact=True, doc="Neg(Neg(x)) is x.")]
''')


def _neg_neg_model() -> onnx.ModelProto:
    nodes = [helper.make_node("Neg", ["x"], ["n1"], name="n1"), helper.make_node("Neg", ["n1"], ["n2"], name="n2"),
             helper.make_node("Relu", ["n2"], ["y"], name="relu")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture
def rules_0_1(tmp_path):
    path = tmp_path / "my_rules.py"
    path.write_text(RULES_0_1)
    return path


def test_a_0_1_rules_file_runs_through_the_api(rules_0_1, monkeypatch):
    for old in ("onnxopt.pattern", "onnxopt.irutil", "onnxopt.shapes", "onnxopt.registry"):
        monkeypatch.delitem(sys.modules, old, raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from onnxopt.registry import load_rules_file  # 0.1's path to it

        rules = load_rules_file(rules_0_1)
    assert [r.name for r in rules] == ["neg_neg_0_1"]
    # each 0.1 import of the file warns, pointing at the file's own line
    assert {(str(w.message).split(" moved")[0], w.filename) for w in caught if "moved to" in str(w.message)} >= {
        ("onnxopt.pattern", str(rules_0_1)), ("onnxopt.irutil", str(rules_0_1)), ("onnxopt.shapes", str(rules_0_1))}
    out, report = onnxopt.optimize(_neg_neg_model(), rules=rules, return_report=True)
    assert [n.op_type for n in out.graph.node] == ["Relu"]
    assert report.rules["neg_neg_0_1"].fired == 1
    x = np.array([[-1, 2, -3], [4, -5, 6]], np.float32)
    from onnx.reference import ReferenceEvaluator

    assert np.array_equal(ReferenceEvaluator(out).run(None, {"x": x})[0], np.maximum(x, 0))


def _run_cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "onnxopt", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=120)


def test_a_0_1_rules_file_runs_through_the_command_line(rules_0_1, tmp_path):
    src = tmp_path / "model.onnx"
    onnx.save(_neg_neg_model(), src)
    out = tmp_path / "out.onnx"
    proc = _run_cli(src, "-o", out, "--rules", rules_0_1, "--no-builtin-rules", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert [n.op_type for n in onnx.load(out).graph.node] == ["Relu"]
    # the config file's key, as 0.1 named it
    (tmp_path / "onnxopt.toml").write_text('rules = ["my_rules.py"]\nno_builtin_rules = true\n')
    out2 = tmp_path / "out2.onnx"
    proc = _run_cli(src, "-o", out2, "-c", tmp_path / "onnxopt.toml", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert [n.op_type for n in onnx.load(out2).graph.node] == ["Relu"]


def test_onnxopt_itself_uses_no_old_path():
    """The 0.1 paths are for users: onnxopt, its rules, model builders and scripts import the new ones
    (an old path would warn in every user's run)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    shorts = {old.rpartition(".")[2] for old in MOVED}
    found = []
    for folder in ("onnxopt", "rules", "models", "scripts"):
        for path in sorted((root / folder).rglob("*.py")):
            if path.name == "_compat.py":
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module] + ([f"onnxopt.{a.name}" for a in node.names if a.name in shorts]
                                             if node.module == "onnxopt" else [])
                elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
                      and getattr(node.func, "attr", None) == "import_module"):
                    names = [str(node.args[0].value)]
                found += [f"{path.relative_to(root)}:{node.lineno}: {n}" for n in names
                          if any(n == old or n.startswith(old + ".") for old in MOVED)]
    assert found == []
