"""What a person at a terminal sees, and what a script reading a pipe gets: rich tables and colour
on a terminal (none with NO_COLOR), plain text without escape codes elsewhere; progress on stderr
for a step over a second, on a terminal only and never with -q; --list-rules by family; help that
names each command; one line that says what to do when the output is missing."""

from __future__ import annotations

import concurrent.futures
import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import textwrap
import threading
from pathlib import Path

import onnx
import pytest

import onnxopt
from onnxopt.targets import TARGETS
import onnxopt.library.passes
import onnxopt.rules
from onnxopt import optimize, verify
from onnxopt.models import synthetic

from test_cli import listed_rules, run_cli

ESC = "\x1b"
COLOUR = re.compile(r"\x1b\[(?:[0-9;]*;)?(?:3[0-7]|9[0-7]|38;[25])[;m]")  # a foreground colour (SGR 30-37, 90-97, 38)
BOX = set("─━│┃┏┓┗┛╇╈┡┩")
# rich's switches, cleared so that what decides is whether the stream is a terminal
RICH_ENV = ("NO_COLOR", "FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "COLUMNS", "LINES")

SLOW_RULES = textwrap.dedent('''
    import time
    from onnxopt import Op, Rule


    def _slow(m):
        time.sleep(1.5)  # one Relu in the model: the rewriting step takes over a second
        return "slow on purpose"


    RULES = [Rule("slow_relu", Op("Relu", "x"), lambda m, b: m["x"], condition=_slow, doc="Sleeps, then refuses.")]
''')


def terminal_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in RICH_ENV}
    return {**env, "TERM": "xterm-256color", **extra}


def run_on_terminal(*args, stdout_tty: bool = True, stderr_tty: bool = True, env: dict | None = None,
                    module: str = "onnxopt") -> tuple[int, str, str]:
    """``python -m onnxopt ARGS`` with stdout and/or stderr on a pseudo-terminal (160 columns),
    the other on a pipe: (exit code, stdout, stderr)."""
    ends, masters = {}, []
    for name, tty in (("stdout", stdout_tty), ("stderr", stderr_tty)):
        if tty:
            master, slave = pty.openpty()
            fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 160, 0, 0))
            ends[name] = slave
            masters.append((name, master))
        else:
            ends[name] = subprocess.PIPE
    proc = subprocess.Popen([sys.executable, "-m", module, *map(str, args)], stdin=subprocess.DEVNULL,
                            env=env or terminal_env(), **ends)
    for fd in ends.values():
        if fd != subprocess.PIPE:
            os.close(fd)
    got = {"stdout": b"", "stderr": b""}

    def drain(name, read):
        while True:
            try:
                chunk = read()
            except OSError:  # (a terminal whose other end closed)
                return
            if not chunk:
                return
            got[name] += chunk

    readers = [threading.Thread(target=drain, args=(name, lambda m=m: os.read(m, 65536))) for name, m in masters]
    readers += [threading.Thread(target=drain, args=(name, lambda s=getattr(proc, name): s.read1(65536)))
                for name, tty in (("stdout", stdout_tty), ("stderr", stderr_tty)) if not tty]
    for t in readers:
        t.start()
    code = proc.wait(timeout=120)
    for t in readers:
        t.join(timeout=10)
    for _, m in masters:
        os.close(m)
    return code, got["stdout"].decode(), got["stderr"].decode()


@pytest.fixture
def model(tmp_path) -> Path:
    path = tmp_path / "model.onnx"
    onnx.save(synthetic.build(100), str(path))
    return path


@pytest.fixture
def small(tmp_path) -> Path:
    path = tmp_path / "small.onnx"
    onnx.save(synthetic.build(5), str(path))
    return path


@pytest.fixture
def slow_rules(tmp_path) -> Path:
    path = tmp_path / "slow_rules.py"
    path.write_text(SLOW_RULES)
    return path


def unstyled(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", text)


def assert_plain(text: str) -> None:
    assert ESC not in text and not BOX & set(text), text


# --------------------------------------------------------------------------------------------
# tables and colour


def test_a_pipe_gets_plain_text(model, tmp_path):
    """Every report and error read through a pipe: no escape codes, no box drawing, even with
    TERM set; the optimize summary is aligned columns under a dashed rule."""
    env = terminal_env()
    runs = [run_cli(model, "-o", tmp_path / "out.onnx", env=env),
            run_cli("verify", model, tmp_path / "out.onnx", "--runs", "2", env=env),
            run_cli("--list-rules", env=env),
            run_cli(model, "--verify", "cpu", env=env),
            run_cli(model, "--device", "h100-sxm", env=env)]  # (a bare MODEL: onnxopt inspect)
    for proc in runs:
        assert_plain(proc.stdout + proc.stderr)
    lines = runs[0].stdout.splitlines()
    header = lines.index("op type             before  after  change")
    assert set(lines[header + 1].replace(" ", "")) == {"-"}
    assert "BatchNormalization      20      0     -20" in lines
    assert runs[3].returncode == 2 and runs[3].stderr.startswith("onnxopt: error: no output given")
    assert runs[4].returncode == 0 and "FLOPs:" in runs[4].stdout
    assert "node  op  FLOPs  read  written  FLOPs/byte  bound".split() == runs[4].stdout.splitlines()[
        runs[4].stdout.splitlines().index("top 10 nodes by FLOPs") + 1].split()


def test_a_terminal_gets_tables_and_colour(model, tmp_path):
    code, out, err = run_on_terminal(model, "-o", tmp_path / "out.onnx")
    assert code == 0, err
    assert COLOUR.search(out), out  # removed nodes in green
    assert "─" in out  # rich's rule under the header
    plain = unstyled(out)
    assert re.search(r"BatchNormalization\s+20\s+0\s+-20", plain)
    assert "nodes 100 -> 60 (-40, -40.0%); 40 rewrites by 2 rules" in plain
    # errors, too, are coloured on a terminal and stay one line
    code, _, err = run_on_terminal(model, "--verify", "cpu")
    assert code == 2 and COLOUR.search(err) and len(err.strip().splitlines()) == 1


def test_no_color_takes_the_colour_out_on_a_terminal(model, tmp_path):
    code, out, err = run_on_terminal(model, "-o", tmp_path / "out.onnx", env=terminal_env(NO_COLOR="1"))
    assert code == 0, err
    assert "─" in out and "BatchNormalization" in out  # still a terminal's table
    assert not COLOUR.search(out), out
    code, out, err = run_on_terminal("verify", model, tmp_path / "out.onnx", "--runs", "2",
                                     env=terminal_env(NO_COLOR="1"))
    assert code == 0 and "outputs agree" in out and not COLOUR.search(out + err)
    code, _, err = run_on_terminal(model, "--verify", "cpu", env=terminal_env(NO_COLOR="1"))
    assert code == 2 and "onnxopt: error: no output given" in unstyled(err) and not COLOUR.search(err)


# --------------------------------------------------------------------------------------------
# progress


def test_progress_on_a_terminal_for_a_step_over_a_second(small, slow_rules, tmp_path):
    """stderr a terminal, stdout a pipe: the rewriting step (over a second) shows on stderr and
    is cleared; stdout gets the plain report only."""
    code, out, err = run_on_terminal(small, "-o", tmp_path / "out.onnx", "--rules", slow_rules, stdout_tty=False)
    assert code == 0, err
    assert re.search(r"rewriting: \d+ rules, round 1", err), err
    assert "\x1b[2K" in err  # the line is cleared when the step ends (rich's transient display)
    assert_plain(out)
    assert "rewriting" not in out and out.startswith(f"onnxopt {small} -> ")


def test_no_progress_with_quiet_or_in_a_pipe_or_for_a_quick_command(small, slow_rules, tmp_path):
    # the two slow runs (over a second each, asleep most of it) side by side; the quick one alone after them,
    # so that no other run can push it past the second
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        quiet = pool.submit(run_on_terminal, small, "-o", tmp_path / "q.onnx", "--rules", slow_rules, "-q")
        piped = pool.submit(run_cli, small, "-o", tmp_path / "p.onnx", "--rules", slow_rules, env=terminal_env())
        code, out, err = quiet.result()
        proc = piped.result()
    assert (code, out, err) == (0, "", "")
    assert proc.returncode == 0 and proc.stderr == ""
    code, out, err = run_on_terminal(small, "-o", tmp_path / "fast.onnx", stdout_tty=False)
    assert code == 0 and err == ""  # done within the second: nothing drawn


def test_bisect_shows_its_steps_on_a_terminal(small, tmp_path):
    rules = tmp_path / "wrong_rules.py"
    rules.write_text(SLOW_RULES.replace("return \"slow on purpose\"", "return None"))  # slow, and drops a Relu
    code, out, err = run_on_terminal("bisect", small, "--rules", rules, stdout_tty=False)
    assert code == 1, err
    assert "full optimization" in err or "bisecting" in err, err
    assert_plain(out)
    assert out.strip().endswith("culprit: slow_relu")


def test_optimize_and_verify_report_their_steps_to_the_hook(model, tmp_path):
    steps = []

    class Recorder(verify.Progress):
        def __call__(self, step, done=0, total=0):
            steps.append(step)

    hook = Recorder()
    optimize(str(model), output=str(tmp_path / "out.onnx"), progress=hook, verify="cpu",
             verify_options={"runs": 2, "progress": hook})
    assert steps[0] == f"loading {model}" and steps[-1] == f"saving {tmp_path / 'out.onnx'}"
    assert any(s.startswith("rewriting: ") and "round 1" in s for s in steps)
    assert "cpu: running the optimized model" in steps
    assert steps.index("cpu: running the original model") > max(i for i, s in enumerate(steps) if "round" in s)


# --------------------------------------------------------------------------------------------
# --list-rules


def test_list_rules_by_family_with_targets_and_exactness(tmp_path, capsys):
    cuda_rules = tmp_path / "cuda_rules.py"
    cuda_rules.write_text("from onnxopt import Op, Rule\n"
                          "RULES = [Rule('relu_on_cuda', Op('Relu', 'x'), lambda m, b: m['x'], targets={'ort-cuda'},"
                          " doc='Only where the model runs on CUDA.')]\n")
    proc = run_cli("--list-rules", "--rules", cuda_rules, "--target", "ort-cuda")
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    rules = [r for r in onnxopt.default_rules() if "ort-cuda" in r.targets]  # (group_query_attention: ort-cpu only)
    families = _default_families("ort-cuda")
    assert text.splitlines()[0] == (f"{len(rules) + 1} rules in {len(families) + 1} families and {len(onnxopt.library.passes.NAMES)} graph passes, "
                                    "for target ort-cuda (--target portable|ort-cpu|ort-cuda)")
    blocks = {b.splitlines()[0]: b.splitlines()[1:] for b in text.split("\n\n")}
    for family in families:
        module = __import__(f"onnxopt.rules.{family}", fromlist=["RULES"])
        title = f"{family} (rules/{family}.py): {len(module.RULES)} rule{'s' * (len(module.RULES) != 1)}"
        header, rule, *rows = blocks[title]
        assert header.split() == ["rule", "matches", "priority", "targets", "exactness", "does"]
        assert set(rule.replace(" ", "")) == {"-"}
        assert [row.split()[0] for row in rows] == [r.name for r in module.RULES]
        for r, row in zip(module.RULES, rows):
            exact = getattr(r, "exact", None)
            where = "all" if set(r.targets) == set(TARGETS) else ",".join(t for t in TARGETS if t in r.targets)
            assert row.split()[1:5] == [r.pattern.op_type, str(r.priority), where,
                                        "?" if exact is None else "exact" if exact else "tolerance"]
    header, _, row = blocks[f"{cuda_rules}: 1 rule"]
    assert row.split()[:5] == ["relu_on_cuda", "Relu", "0", "ort-cuda", "?"]
    assert " ".join(row.split()[5:]) == "Only where the model runs on CUDA."
    passes = blocks["graph passes (onnxopt/library/passes.py)"]
    assert passes[0].split() == ["pass", "runs", "exactness", "does"]
    assert [r.split()[0] for r in passes[2:]] == list(onnxopt.library.passes.NAMES)
    # not valid for the default target (portable): not listed there
    proc = run_cli("--list-rules", "--rules", cuda_rules)
    assert "relu_on_cuda" not in listed_rules(proc.stdout) and f"{cuda_rules}" not in proc.stdout


def _default_families(target: str | None = None) -> list[str]:
    """The rule families in the default library: every rules/ file whose RULES is not empty (the
    qdq family exports none there: its rules run only under onnxopt quantize); with ``target``,
    those with a rule valid there (the onnxruntime fusions are not listed for portable)."""
    stems = sorted(p.stem for p in Path(onnxopt.rules.__file__).parent.glob("[!_]*.py"))
    return [s for s in stems
            if any(target is None or target in r.targets for r in __import__(f"onnxopt.rules.{s}", fromlist=["RULES"]).RULES)]


def test_list_rules_on_a_terminal_is_a_table_per_family():
    code, out, err = run_on_terminal("--list-rules")
    assert code == 0, err
    plain = unstyled(out)
    families = _default_families("portable")
    assert "cast (rules/cast.py): 3 rules" in plain
    assert len(re.findall(r"^rule\s+matches\s+priority\s+targets\s+exactness\s+does", plain, re.M)) == len(families)
    assert COLOUR.search(out) and "─" in out


# --------------------------------------------------------------------------------------------
# help, and what to do


@pytest.mark.parametrize("module,args,usage", [
    ("onnxopt.models.synthetic", [], "python -m onnxopt.models.synthetic"),
    ("onnxopt.models", [], "python -m onnxopt.models"),
    ("onnxopt.models", ["build"], "python -m onnxopt.models build"),
    ("onnxopt.models.pypi_models", [], "python -m onnxopt.models.pypi_models"),
    ("onnxopt.models.torchvision_models", [], "python -m onnxopt.models.torchvision_models"),
    ("onnxopt.models.transformers_models", [], "python -m onnxopt.models.transformers_models"),
    ("onnxopt.models.decoder_models", [], "python -m onnxopt.models.decoder_models"),
    ("onnxopt", [], "onnxopt MODEL -o OUTPUT [options]"),
    ("onnxopt", ["verify"], "onnxopt verify"),
    ("onnxopt", ["bisect"], "onnxopt bisect"),
])
def test_help_names_the_command(module, args, usage):
    proc = subprocess.run([sys.executable, "-m", module, *args, "--help"], capture_output=True, text=True,
                          env=terminal_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"usage: {usage}"), proc.stdout[:200]
    assert not re.search(r"\.py\b", proc.stdout.splitlines()[0])  # (not argparse's guess: __main__.py)


def test_help_lists_the_commands_examples_and_exit_codes():
    out = run_cli("--help").stdout
    assert "onnxopt verify ORIGINAL OPTIMIZED [options]" in out and "onnxopt bisect MODEL [options]" in out
    assert "examples:" in out and "onnxopt model.onnx -o model.opt.onnx" in out
    assert "exit codes: 0 ok, 1 outputs differ" in " ".join(out.split())
    for command in ("verify", "bisect"):
        assert "exit codes: 0" in run_cli(command, "--help").stdout


def test_a_model_without_o_says_what_to_do(model, tmp_path):
    """(A bare MODEL is inspected: tests/test_analysis.py; an optimize option without -o is this error.)"""
    proc = run_cli(model, "--verify", "cpu")
    assert proc.returncode == 2 and proc.stdout == ""
    (line,) = proc.stderr.splitlines()
    assert line.startswith("onnxopt: error: no output given: add -o OUTPUT")
    assert f"onnxopt {model} -o {tmp_path / 'model.opt.onnx'}" in line
    assert "onnxopt verify ORIGINAL OPTIMIZED" in line and "onnxopt bisect MODEL" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]


def test_no_model_and_a_mistyped_command_say_what_to_do():
    proc = run_cli()
    assert proc.returncode == 2
    (line,) = proc.stderr.splitlines()
    assert line.startswith("onnxopt: error: no model given: onnxopt MODEL -o OUTPUT") and "onnxopt verify" in line
    proc = run_cli("verfy", "a.onnx", "b.onnx")
    assert proc.returncode == 2
    assert proc.stderr == "onnxopt: error: no model or command 'verfy': did you mean 'onnxopt verify'?\n"
