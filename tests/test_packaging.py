"""Packaging promises: the rules install with the engine; GPU users get one onnxruntime."""

from __future__ import annotations

import configparser
import re
import subprocess
import sys
from pathlib import Path

import onnxopt

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


def test_source_checkout_finds_rules_and_models_without_an_install(tmp_path):
    """The README's first command runs `python -m onnxopt...` from the repository root after a
    non-editable install: the source onnxopt/ shadows the installed one there, and must still
    find rules/ and models/ beside it."""
    code = (
        "import sys\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]\n"
        "import onnxopt, onnxopt.rules, onnxopt.models.synthetic\n"
        f"assert onnxopt.__file__.startswith({str(ROOT)!r}), onnxopt.__file__\n"
        "print(len(onnxopt.default_rules()))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip()) == len(onnxopt.default_rules())
