"""The config file (``onnxopt.cli.config``): ``onnxopt MODEL -o OUT -c onnxopt.toml`` and
``onnxopt quantize ... -c``: every key reaches the call it stands for, flags given win over the
file, relative paths, one-line errors, the echo in --json, and the README's example end to end."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper

import onnxopt.quantize.api as quantize_api
from onnxopt.cli import config
from onnxopt import cli
from onnxopt.cli import optimize as cli_optimize  # (the module that calls optimize())

from helpers import init, model, tinfo

ROOT = Path(__file__).resolve().parents[1]

USER_RULES = textwrap.dedent('''
    import numpy as np
    from onnxopt import Op, Rule


    def _relu_to_max(m, b):
        return b.op("Max", m["x"], b.const(np.array(0.0, dtype=np.float32), name="zero"))


    RULES = [Rule("relu_to_max", Op("Relu", "x"), _relu_to_max, doc="Relu(x) is Max(x, 0).")]
''')


def _conv_model(path: Path, x="x", y="y", size=8, chans=(3, 4)) -> Path:
    """Conv+Relu layers, ``chans`` channels from input to output (the first Conv unpadded)."""
    rng = np.random.default_rng(0)
    nodes, inits, prev = [], [], x
    for i, (ci, co) in enumerate(zip(chans, chans[1:])):
        out = y if i == len(chans) - 2 else f"r{i}"
        nodes += [helper.make_node("Conv", [prev, f"w{i}", f"b{i}"], [f"c{i}"], pads=[min(i, 1)] * 4),
                  helper.make_node("Relu", [f"c{i}"], [out])]
        inits += [init(f"w{i}", (rng.standard_normal((co, ci, 3, 3)) * (2 / ci / 9) ** 0.5).astype(np.float32)),
                  init(f"b{i}", (rng.standard_normal(co) * 0.1).astype(np.float32))]
        prev = out
    onnx.save(model(nodes, [tinfo(x, ["batch", chans[0], size, size])],
                    [tinfo(y, ["batch", chans[-1], size - 2, size - 2])], inits), path)
    return path


@pytest.fixture
def src(tmp_path) -> Path:
    return _conv_model(tmp_path / "m.onnx")


def run_main(capsys, *args) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


class _Stop(Exception):
    """Raised by the spies once they have what the command passed: the run ends there (exit 3)."""


@pytest.fixture
def seen(monkeypatch) -> dict:
    """What the main command and onnxopt quantize pass to optimize() / quantize()."""
    calls: dict = {}

    def spy(name):
        def record(*args, options=None, **kwargs):
            # the call as keywords: its options (onnxopt.options) as the shortcuts they stand for
            calls[name] = {"args": args, **(options.shortcuts() if options is not None else {}), **kwargs}
            raise _Stop()

        return record

    monkeypatch.setattr(cli_optimize, "optimize", spy("optimize"))
    monkeypatch.setattr(quantize_api, "quantize", spy("quantize"))
    return calls


def write(folder: Path, text: str, name="onnxopt.toml") -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return path


# --------------------------------------------------------------------------------------------
# Each key reaches the call

# (key, TOML text, command, check of the call's keyword arguments; ``d`` is the config's folder)
MAIN_CASES = [
    ("target", 'target = "ort-cuda"', lambda kw, d: kw["target"] == "ort-cuda"),
    ("precision", 'precision = "fp16"', lambda kw, d: kw["precision"] == "fp16"),
    ("padding", 'padding = "right"', lambda kw, d: kw["padding"] == "right"),
    ("exact", "exact = true", lambda kw, d: kw["exact"] is True),
    ("max_rewrites", "max_rewrites = 7", lambda kw, d: kw["max_rewrites"] == 7),
    ("fold_size_limit", "fold_size_limit = 4096", lambda kw, d: kw["fold_size_limit"] == 4096),
    ("strict", "strict = true", lambda kw, d: kw["strict"] is True),
    ("rules", 'rules = ["my_rules.py"]', lambda kw, d: [r.name for r in kw["extra_rules"]] == ["relu_to_max"]),
    ("disable", 'disable = ["gelu", "add_zero"]', lambda kw, d: kw["disable"] == ["gelu", "add_zero"]),
    ("no_builtin_rules", "no_builtin_rules = true", lambda kw, d: kw["rules"] == []),
    ("external_data", 'external_data = "w.bin"', lambda kw, d: kw["external_data"] == "w.bin"),
    ("external_data", "external_data = false", lambda kw, d: kw["external_data"] is False),
    ("external_data", "external_data = true", lambda kw, d: kw["external_data"] is True),
    ("genai", 'genai = "hf"', lambda kw, d: kw["genai"] == str(d / "hf")),
    ("input_shapes", "[input_shapes]\nx = [1, 3, 8, 8]", lambda kw, d: kw["input_shapes"] == {"x": (1, 3, 8, 8)}),
    ("input_shapes", '[input_shapes]\nx = "n,3,8,8"', lambda kw, d: kw["input_shapes"] == {"x": ("n", 3, 8, 8)}),
    ("layout.input", '[layout]\ninput = {x = "NHWC"}', lambda kw, d: kw["input_layout"] == {"x": "NHWC"}),
    ("layout.input", '[layout]\ninput = "NHWC"', lambda kw, d: kw["input_layout"] == "NHWC"),
    ("layout.output", '[layout.output]\ny = "NHWC"', lambda kw, d: kw["output_layout"] == {"y": "NHWC"}),
    ("layout.preprocess", '[layout.preprocess]\nx = "uint8,HWC,scale=1/255"',
     lambda kw, d: kw["input_preprocess"] == {"x": "uint8,HWC,scale=1/255"}),
    ("layout.preprocess", '[layout.preprocess.x]\nlayout = "NHWC"\nmean = [0.5, 0.5, 0.5]\nbgr = true',
     lambda kw, d: kw["input_preprocess"] == {"x": {"layout": "NHWC", "mean": [0.5, 0.5, 0.5], "bgr": True}}),
    ("verify.providers", '[verify]\nproviders = ["CPU"]', lambda kw, d: kw["verify"] == "cpu"),
    ("verify.rtol", '[verify]\nproviders = "cpu"\nrtol = 0.25', lambda kw, d: kw["verify_options"]["rtol"] == 0.25),
    ("verify.atol", '[verify]\nproviders = "cpu"\natol = 3', lambda kw, d: kw["verify_options"]["atol"] == 3),
    ("verify.runs", '[verify]\nproviders = "cpu"\nruns = 0', lambda kw, d: kw["verify_options"]["runs"] == 0),
    ("verify.warmup", '[verify]\nproviders = "cpu"\nwarmup = 2', lambda kw, d: kw["verify_options"]["warmup"] == 2),
    ("verify.threads", '[verify]\nproviders = "cpu"\nthreads = 2', lambda kw, d: kw["verify_options"]["threads"] == 2),
    ("verify.latency_budget", '[verify]\nproviders = "cpu"\nlatency_budget = 2.5',
     lambda kw, d: kw["verify_options"]["budget_s"] == 2.5),
    ("verify.seed", '[verify]\nproviders = "cpu"\nseed = 11', lambda kw, d: kw["verify_options"]["seed"] == 11),
    ("verify.decode", '[verify]\nproviders = "cpu"\ndecode = 16', lambda kw, d: kw["verify_options"]["decode"] == 16),
    ("verify.decode_prompts", '[verify]\nproviders = "cpu"\ndecode_prompts = "p.json"',
     lambda kw, d: kw["verify_options"]["decode_prompts"] == str(d / "p.json")),
    ("verify.inputs", '[verify]\nproviders = "cpu"\ninputs = "feeds.npz"',
     lambda kw, d: kw["verify_options"]["inputs"] == str(d / "feeds.npz")),
    ("verify.int_ranges", '[verify]\nproviders = "cpu"\nint_ranges = {ids = [0, 9], mask = "0:1"}',
     lambda kw, d: kw["verify_options"]["int_ranges"] == {"ids": (0, 9), "mask": (0, 1)}),
    ("verify.provider_options", '[verify]\nproviders = "cpu"\nprovider_options = {cpu = {use_arena = false}}',
     lambda kw, d: kw["verify_options"]["provider_options"] == {"cpu": {"use_arena": "0"}}),
]

QUANT_CASES = [
    ("quantize.calibration", '[quantize]\ncalibration = "calib"', lambda kw, d: kw["args"][1] == str(d / "calib")),
    ("quantize.method", '[quantize]\nmethod = "entropy"', lambda kw, d: kw["method"] == "entropy"),
    ("quantize.per_channel", "[quantize]\nper_channel = false", lambda kw, d: kw["per_channel"] is False),
    ("quantize.exclude", '[quantize]\nexclude = ["Conv", "n1"]', lambda kw, d: kw["exclude"] == ["Conv", "n1"]),
    ("quantize.fidelity", "[quantize]\nfidelity = 31.5", lambda kw, d: kw["fidelity"] == 31.5),
    ("quantize.fidelity", "[quantize]\nfidelity = false", lambda kw, d: kw["fidelity"] is None),
    ("quantize.keep_float", '[quantize]\nkeep_float = "never"', lambda kw, d: kw["keep_float"] == "never"),
    ("quantize.reduce_range", "[quantize]\nreduce_range = true", lambda kw, d: kw["reduce_range"] is True),
    ("quantize.workers", "[quantize]\nworkers = 3", lambda kw, d: kw["workers"] == 3),
    ("quantize.threads", "[quantize]\nthreads = 2", lambda kw, d: kw["threads"] == 2),
    ("quantize.latency_budget", "[quantize]\nlatency_budget = 2.5", lambda kw, d: kw["latency_budget"] == 2.5),
    ("quantize.held_out", "[quantize]\nheld_out = 5", lambda kw, d: kw["held_out"] == 5),
    ("quantize.percentile", '[quantize]\nmethod = "percentile"\npercentile = 99.9',
     lambda kw, d: kw["method_options"] == {"percentile": 99.9}),
    ("target", 'target = "portable"', lambda kw, d: kw["target"] == "portable"),
    ("input_shapes", '[input_shapes]\nx = "1x3x8x8"', lambda kw, d: kw["input_shapes"] == {"x": (1, 3, 8, 8)}),
    ("strict", "strict = true", lambda kw, d: kw["strict"] is True),
]


@pytest.mark.parametrize("key,text,ok", MAIN_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(MAIN_CASES)])
def test_each_key_reaches_optimize(key, text, ok, src, tmp_path, seen, capsys, monkeypatch):
    folder = tmp_path / "conf"
    folder.mkdir()
    (folder / "my_rules.py").write_text(USER_RULES)
    (folder / "feeds.npz").write_bytes(b"")
    (folder / "hf").mkdir()  # (a Hugging Face folder as --genai checks it: a config and a tokenizer)
    for name in ("config.json", "tokenizer.json"):
        (folder / "hf" / name).write_text("{}")
    cfg = write(folder, text)
    monkeypatch.chdir(tmp_path)  # (relative paths are the file's, not the working folder's)
    code, _, err = run_main(capsys, src, "-o", tmp_path / "out.onnx", "-c", cfg)
    assert "optimize" in seen, err
    kw = seen["optimize"]
    assert ok(kw, folder), {k: v for k, v in kw.items() if k not in ("outputs", "progress")}
    assert code == 3  # (the spy stops the run)


def _defaults(src, tmp_path, capsys, seen, *flags) -> dict:
    run_main(capsys, src, "-o", tmp_path / "out.onnx", *flags)
    return seen.pop("optimize")


def test_main_cases_change_what_optimize_gets(src, tmp_path, seen, capsys):
    """Each case's check fails without the file (so it tests the key, not a default)."""
    (tmp_path / "my_rules.py").write_text(USER_RULES)
    plain = _defaults(src, tmp_path, capsys, seen)
    verifying = _defaults(src, tmp_path, capsys, seen, "--verify", "cpu")
    for key, text, ok in MAIN_CASES:
        kw = verifying if "providers" in text and key != "verify.providers" else plain
        try:
            assert not ok(kw, tmp_path), key
        except KeyError:  # (no such argument at all without the file)
            pass


@pytest.mark.parametrize("key,text,ok", QUANT_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(QUANT_CASES)])
def test_each_quantize_key_reaches_quantize(key, text, ok, src, tmp_path, seen, capsys):
    folder = tmp_path / "conf"
    folder.mkdir()
    (folder / "calib").mkdir()
    (tmp_path / "other").mkdir()
    if "calibration" not in text:
        text += "\n" + ("" if text.startswith("[quantize]") else "[quantize]\n") + 'calibration = "calib"'
    cfg = write(folder, text)
    code, _, err = run_main(capsys, "quantize", src, "-o", tmp_path / "q.onnx", "-c", cfg)
    assert "quantize" in seen, err
    assert ok(seen["quantize"], folder)
    # without the file's key (the calibration given as a flag) the check fails
    run_main(capsys, "quantize", src, "-o", tmp_path / "q.onnx", "--calib", tmp_path / "other")
    assert not ok(seen["quantize"], folder)


def test_every_key_is_tested():
    report = {"report.json", "report.quiet", "report.diff", "report.html"}  # below, by what they do
    assert {c[0] for c in MAIN_CASES} | {c[0] for c in QUANT_CASES} | report == set(config.KEYS)


def test_report_keys(src, tmp_path, capsys):
    cfg = write(tmp_path, '[report]\njson = "out/r.json"\nquiet = true\ndiff = "out/d.html"\n')
    (tmp_path / "out").mkdir()
    code, out, err = run_main(capsys, src, "-o", tmp_path / "o.onnx", "-c", cfg)
    assert code == 0, err
    assert out == "" and err == ""  # quiet
    assert json.loads((tmp_path / "out/r.json").read_text())["output"] == str(tmp_path / "o.onnx")
    assert "<html" in (tmp_path / "out/d.html").read_text()[:500].lower()


def test_report_html_sets_the_report_page(src, tmp_path):
    """``report.html`` stands for the main command's --report (the HTML report page)."""
    cfg = write(tmp_path, '[report]\nhtml = "page.html"\n')
    argv = [str(src), "-o", str(tmp_path / "o.onnx"), "-c", str(cfg)]
    args = cli_optimize.parser().parse_args(argv)
    assert config.merge(args, argv, cli_optimize.parser).report == str(tmp_path / "page.html")


# --------------------------------------------------------------------------------------------
# Precedence and paths


def test_flags_given_override_the_file(src, tmp_path, seen, capsys):
    cfg = write(tmp_path, '''
        target = "ort-cpu"
        precision = "fp16"
        disable = ["gelu"]
        max_rewrites = 5
        external_data = false
        [verify]
        providers = "cpu"
        runs = 3
        seed = 4
    ''')
    run_main(capsys, src, "-o", tmp_path / "o.onnx", "-c", cfg, "--target", "portable", "--precision", "fp32",
             "--disable", "add_zero", "--seed", "0", "--external-data")
    kw = seen["optimize"]
    assert kw["target"] == "portable"
    assert kw["precision"] == "fp32"  # given at its default value: still given
    assert kw["disable"] == ["add_zero"]  # a list given replaces the file's
    assert kw["verify_options"]["seed"] == 0
    assert kw["external_data"] is True  # --external-data over the file's false (--single-file)
    assert kw["max_rewrites"] == 5 and kw["verify_options"]["runs"] == 3  # not given: the file's


def test_a_files_true_switches_can_be_turned_off_by_flags(src, tmp_path, seen, capsys):
    cfg = write(tmp_path, """
        exact = true
        strict = true
        no_builtin_rules = true
        rules = ["r.py"]
        [report]
        quiet = true
    """)
    (tmp_path / "r.py").write_text("from onnxopt.rules.cleanup import RULES\n")
    run_main(capsys, src, "-o", tmp_path / "o.onnx", "-c", cfg)
    kw = seen.pop("optimize")
    assert kw["exact"] is True and kw["strict"] is True and kw["rules"] == []
    run_main(capsys, src, "-o", tmp_path / "o.onnx", "-c", cfg, "--no-exact", "--no-strict", "--builtin-rules",
             "--no-quiet")
    kw = seen["optimize"]
    assert kw["exact"] is False and kw["strict"] is False and kw["rules"] is None


def test_mistakes_found_against_the_model_name_the_file_and_key(src, tmp_path, capsys):
    # an input the model lacks, a rule that does not exist: found only once the model is read, and
    # still named by file and key (and by the flag's own message); a flag given overrides the file's
    for text, key in (('[input_shapes]\nnosuch = "1x3"', "input_shapes"), ('disable = ["nosuch"]', "disable"),
                      ('[layout]\ninput = { nosuch = "NHWC" }', "layout.input")):
        cfg = write(tmp_path, text)
        code, _, err = run_main(capsys, src, "-o", tmp_path / "o.onnx", "-c", cfg)
        line = one_line(err)
        assert code == 2 and f"{cfg}: {key}: " in line and "nosuch" in line, line
        assert not (tmp_path / "o.onnx").exists()
    cfg = write(tmp_path, '[input_shapes]\nnosuch = "1x3"')
    code, _, err = run_main(capsys, src, "-o", tmp_path / "o.onnx", "-c", cfg, "--input-shape", "nope=1x3x8x8")
    assert code == 2 and str(cfg) not in one_line(err) and "nope" in err  # the flag's mistake: no file named


def test_config_given_twice_is_one_line(src, tmp_path, capsys):
    a, b = write(tmp_path, 'target = "ort-cpu"', "a.toml"), write(tmp_path, 'target = "ort-cuda"', "b.toml")
    with pytest.raises(SystemExit) as exc:
        cli.main([str(src), "-o", str(tmp_path / "o.onnx"), "-c", str(a), "-c", str(b)])
    assert exc.value.code == 2 and "-c given twice" in one_line(capsys.readouterr().err)
    assert not (tmp_path / "o.onnx").exists()


def test_quantize_flags_override_the_file(src, tmp_path, seen, capsys):
    (tmp_path / "calib").mkdir()
    (tmp_path / "c2").mkdir()
    cfg = write(tmp_path, '[quantize]\ncalibration = "calib"\nper_channel = false\nmethod = "mse"\n')
    run_main(capsys, "quantize", src, "-o", tmp_path / "q.onnx", "-c", cfg, "--per-channel", "--calib",
             tmp_path / "c2")
    kw = seen["quantize"]
    assert kw["per_channel"] is True and kw["args"][1] == str(tmp_path / "c2") and kw["method"] == "mse"


def test_relative_paths_are_the_files(src, tmp_path, capsys, monkeypatch):
    conf = tmp_path / "project" / "conf"
    conf.mkdir(parents=True)
    (conf / "rules.py").write_text(USER_RULES)
    cfg = write(conf, 'rules = ["rules.py"]\nno_builtin_rules = true\n[report]\njson = "../report.json"\n')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    code, _, err = run_main(capsys, src, "-o", tmp_path / "o.onnx", "-c", cfg)
    assert code == 0, err
    report = json.loads((tmp_path / "project" / "report.json").read_text())
    assert report["rules"]["relu_to_max"]["fired"] == 1
    assert [n.op_type for n in onnx.load(tmp_path / "o.onnx").graph.node] == ["Conv", "Max"]  # Relu: the rule's
    assert report["config"]["settings"]["rules"] == [str(conf / "rules.py")]
    assert not (elsewhere / "report.json").exists()


# --------------------------------------------------------------------------------------------
# Errors: one line, exit 2, naming the key


@pytest.mark.parametrize("text,words", [
    ('presicion = "fp16"', ["unknown key 'presicion'", "did you mean 'precision'"]),
    ("[verify]\nrtoll = 1e-3", ["unknown key 'verify.rtoll'", "did you mean 'verify.rtol'"]),
    ("rtol = 1e-3", ["unknown key 'rtol'", "did you mean 'verify.rtol'"]),
    ("[verfy]\nrtol = 1e-3", ["unknown key 'verfy.rtol'", "did you mean 'verify.rtol'"]),
    ("bogus_setting_xyz = 1", ["unknown key 'bogus_setting_xyz'", "keys: target"]),
    ('[verify]\nrtol = "tight"', ["verify.rtol: expected a number, got a string ('tight')"]),
    ("max_rewrites = 2.5", ["max_rewrites: expected an integer, got a number (2.5)"]),
    ("max_rewrites = -1", ["max_rewrites: -1 is below 0"]),
    ("exact = 1", ["exact: expected true or false, got an integer (1)"]),
    ('disable = [1, 2]', ["disable: expected a list of strings"]),
    ('target = "gpu"', ["target: 'gpu' is not one of portable, ort-cpu", "did you mean"]),
    ('precision = "fp8"', ["precision: 'fp8' is not one of fp32, fp16"]),
    ("verify = 3", ["verify is a table ([verify])"]),
    ('[input_shapes]\nx = "1x3x-8"', ["input_shapes", "'x'"]),
    ("[input_shapes]\nx = {a = 1}", ["input_shapes['x']", "{'a': 1} is not a list of dimensions"]),  # (was ['a'])
    ('[layout]\ninput = {x = "NHWQ"}', ["layout.input", "unknown layout 'NHWQ'"]),
    ('[layout.preprocess]\nx = "uint8,HWQ"', ["layout.preprocess x", "'HWQ'"]),
    ('[layout.preprocess.x]\nlayout = "HWC"\nbgr = "false"', ["layout.preprocess x bgr: expected true or false"]),
    ('[layout.preprocess.x]\nlayout = "HWC"\nmean = nan', ["layout.preprocess x mean: nan is not a finite number"]),
    ('[layout.preprocess.x]\nlayout = "HWC"\nstd = [1, true, 1]', ["layout.preprocess x std: True is not a finite"]),
    ('[verify]\nproviders = "tpu"', ["verify.providers", "unknown provider 'tpu'"]),
    ('[verify]\nint_ranges = {ids = "9:1"}', ["verify.int_ranges", "LOW:HIGH"]),
    ('[verify]\nprovider_options = {cuda = 1}', ["verify.provider_options", "expected a mapping"]),
    ('[quantize]\nmethod = "entropi"', ["quantize.method: 'entropi' is not one of", "did you mean 'entropy'"]),
    ("[quantize]\nfidelity = true", ["quantize.fidelity: expected a number or false"]),
    ("[verify]\nrtol = nan", ["verify.rtol: expected a finite number, got nan"]),
    ("[verify]\natol = -1.0", ["verify.atol: -1.0 is below 0"]),
    ('external_data = ""', ["external_data: empty"]),
    ('rules = [""]', ["rules: an empty entry"]),
    ("target = ", ["not valid TOML", "line 1"]),
    ('target = "a"\n[verify\nrtol = 1', ["not valid TOML", "line 2"]),
])
def test_bad_file_is_one_line_exit_2(text, words, src, tmp_path, capsys):
    cfg = write(tmp_path, text + "\n")
    code, out, err = run_main(capsys, src, "-o", tmp_path / "o.onnx", "-c", cfg)
    assert code == 2
    line = one_line(err)
    assert line.startswith(f"onnxopt: error: {cfg}: ")
    for w in words:
        assert w in line, line
    assert not (tmp_path / "o.onnx").exists()


def test_missing_or_unreadable_file(src, tmp_path, capsys):
    for path, words in ((tmp_path / "nope.toml", "no such config file"), (tmp_path, "a folder")):
        code, _, err = run_main(capsys, src, "-o", tmp_path / "o.onnx", "--config", path)
        assert code == 2 and f"{path}: {words}" in one_line(err)
    cfg = write(tmp_path, "\xff\xfe = 1", name="binary.toml")
    cfg.write_bytes(b"\xff\xfe\x00 = 1")
    code, _, err = run_main(capsys, src, "-o", tmp_path / "o.onnx", "-c", cfg)
    assert code == 2 and "not valid TOML" in one_line(err)


def test_quantize_without_calibration_anywhere(src, tmp_path, capsys):
    cfg = write(tmp_path, 'target = "ort-cpu"\n')
    code, _, err = run_main(capsys, "quantize", src, "-o", tmp_path / "q.onnx", "-c", cfg)
    assert code == 2 and "no calibration data" in one_line(err)


# --------------------------------------------------------------------------------------------
# The echo in --json


def test_json_echoes_the_merged_settings(src, tmp_path, capsys):
    cfg = write(tmp_path, '''
        target = "ort-cpu"
        max_rewrites = 50
        [input_shapes]
        x = [1, 3, 8, 8]
        [verify]
        providers = "cpu"
        runs = 1
        warmup = 1
        [quantize]
        method = "entropy"
    ''')
    report = tmp_path / "r.json"
    code, _, err = run_main(capsys, src, "-o", tmp_path / "o.onnx", "-c", cfg, "--json", report, "--runs", "2")
    assert code == 0, err
    data = json.loads(report.read_text())
    assert data["config"] == {
        "file": str(cfg),
        "settings": {"target": "ort-cpu", "max_rewrites": 50, "input_shapes": ["x=1x3x8x8"],
                     "verify.providers": "cpu", "verify.runs": 2, "verify.warmup": 1, "report.json": str(report)},
        "from_command_line": ["verify.runs", "report.json"],
        "ignored": ["quantize.method"],
    }
    assert data["settings"]["input_shapes"] == {"x": [1, 3, 8, 8]}
    assert data["verification"]["ok"] is True
    # without -c: no entry
    code, _, err = run_main(capsys, src, "-o", tmp_path / "o2.onnx", "--json", tmp_path / "r2.json")
    assert code == 0 and "config" not in json.loads((tmp_path / "r2.json").read_text())


# --------------------------------------------------------------------------------------------
# The README


def _readme_section() -> str:
    """The config file's page of the manual (the README's section moved there: issue 28, point 7)."""
    return (ROOT / "docs" / "config.md").read_text()


def test_readme_table_lists_exactly_the_schema_keys():
    section = _readme_section()
    listed = re.findall(r"^\| `([a-z_.]+)` \|", section, flags=re.M)
    assert listed == list(config.KEYS)
    assert config.markdown_table() in section  # generated from the schema, as it is now


def test_readme_example_runs_end_to_end(tmp_path, capsys):
    example = re.search(r"```toml\n(.*?)```", _readme_section(), flags=re.S).group(1)
    cfg = tmp_path / "onnxopt.toml"
    cfg.write_text(example)
    src = _conv_model(tmp_path / "model.onnx", x="input", y="output", size=32, chans=(3, 16, 32, 32))
    calib = tmp_path / "calib"
    calib.mkdir()
    rng = np.random.default_rng(1)
    for i in range(6):
        np.savez(calib / f"{i}.npz", input=rng.random((1, 3, 32, 32), dtype=np.float32))
    keys = set(config.read(cfg))
    assert {k.split(".")[0] for k in keys} >= {"target", "input_shapes", "layout", "verify", "report", "quantize"}

    code, out, err = run_main(capsys, src, "-o", tmp_path / "model.opt.onnx", "-c", cfg)
    assert code == 0, err
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["verification"]["ok"] is True
    assert sorted(report["config"]["ignored"]) == sorted(k for k in keys if k.startswith("quantize."))
    assert report["config"]["from_command_line"] == []
    opt = tmp_path / "model.opt.onnx"
    sess = ort.InferenceSession(str(opt), providers=["CPUExecutionProvider"])
    (inp,), (_,) = sess.get_inputs(), sess.get_outputs()
    assert inp.type == "tensor(uint8)" and inp.shape[1:] == [32, 32, 3]  # raw NHWC pixels
    pixels = rng.integers(0, 256, (2, 32, 32, 3), dtype=np.uint8)
    (y,) = sess.run(None, {"input": pixels})
    assert y.shape == (2, 30, 30, 32)  # the output channels-last
    assert not list(tmp_path.glob("*.data"))  # external_data = false

    code, out, err = run_main(capsys, "quantize", src, "-o", tmp_path / "model.int8.onnx", "-c", cfg)
    assert code == 0, err
    q = onnx.load(tmp_path / "model.int8.onnx")
    assert "QuantizeLinear" in {n.op_type for n in q.graph.node}
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["config"]["settings"]["quantize.calibration"] == str(calib)
    assert "layout.preprocess" in report["config"]["ignored"]


def test_json_echo_when_verification_fails(src, tmp_path, capsys):
    """A failed --verify (exit 1, no model) still writes the report, with the config entry."""
    (tmp_path / "wrong.py").write_text(textwrap.dedent('''
        from onnxopt import Op, Rule

        RULES = [Rule("relu_dropped", Op("Relu", "x"), lambda m, b: b.op("Neg", m["x"]), doc="wrong on purpose")]
    '''))
    cfg = write(tmp_path, 'rules = ["wrong.py"]\n[verify]\nproviders = "cpu"\nruns = 0\n[report]\njson = "r.json"\n'
                          "quiet = true\n")
    code, _, err = run_main(capsys, src, "-o", tmp_path / "o.onnx", "-c", cfg)
    assert code == 1, err
    assert not (tmp_path / "o.onnx").exists()
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["verification"]["ok"] is False
    assert data["config"]["settings"]["rules"] == [str(tmp_path / "wrong.py")]


def test_an_output_never_replaces_the_config_file(src, tmp_path, capsys):
    cfg = write(tmp_path, 'target = "ort-cpu"\n')
    before = cfg.read_bytes()
    for flags in (["-o", cfg], ["-o", tmp_path / "o.onnx", "--json", cfg]):
        code, _, err = run_main(capsys, src, *flags, "-c", cfg)
        assert code == 2 and "the config file" in one_line(err)
        assert cfg.read_bytes() == before


# --------------------------------------------------------------------------------------------
# Bounded reading (issue 27): nesting, size, a byte order mark


@pytest.mark.parametrize("text", [
    "target = " + "[" * 5000 + "]" * 5000,                      # nested arrays: tomllib recursed
    "input_shapes = " + "{a = " * 3000 + "1" + "}" * 3000,      # nested inline tables
    "a = " + "[" * 65 + "]" * 65,                               # one level past the limit
    "input_shapes." + ".".join(f"k{i}" for i in range(80)) + " = 1",  # dotted keys nest tables too
], ids=["arrays-5000", "inline-tables-3000", "arrays-65", "dotted-keys-80"])
def test_deep_nesting_is_one_line_exit_2(text, src, tmp_path, capsys):
    cfg = write(tmp_path, text + "\n")
    code, _, err = run_main(capsys, src, "-o", tmp_path / "o.onnx", "-c", cfg)
    assert code == 2, err[-300:]
    line = one_line(err)
    assert line.startswith(f"onnxopt: error: {cfg}: nested") and "64" in line, line
    assert not (tmp_path / "o.onnx").exists()


def test_nesting_within_the_limit_and_brackets_in_strings(tmp_path):
    from onnxopt import readers

    # brackets inside strings and comments are not nesting
    text = ('disable = ["[[[[", \'{{{{\', """]]\n[[""", \'\'\'{{{\'\'\']  # [[[[[[\n'
            'target = "ort-cpu"\n')
    assert readers.nesting(text) == (1, 1)
    assert config.read(write(tmp_path, text))["disable"] == ["[[[[", "{{{{", "]]\n[[", "{{{"]
    assert readers.nesting("a = " + "[" * 64 + "]" * 64) == (64, 1)


def test_size_is_bounded(src, tmp_path, capsys):
    big = write(tmp_path, "# " + "x" * (1 << 20) + "\n", name="big.toml")
    for path in (big, "/dev/zero"):
        code, _, err = run_main(capsys, src, "-o", tmp_path / "o.onnx", "-c", path)
        assert code == 2 and f"{path}: larger than 1 MiB" in one_line(err), err
    # just under the limit is read
    ok = write(tmp_path, "# " + "x" * ((1 << 20) - 40) + '\ntarget = "ort-cpu"\n', name="ok.toml")
    assert config.read(ok) == {"target": "ort-cpu"}


def test_byte_order_mark_is_accepted(src, tmp_path, capsys):
    cfg = tmp_path / "bom.toml"
    cfg.write_bytes(b"\xef\xbb\xbf" + b'target = "ort-cpu"\nmax_rewrites = 3\n')
    assert config.read(cfg) == {"target": "ort-cpu", "max_rewrites": 3}
    code, _, err = run_main(capsys, src, "-o", tmp_path / "o.onnx", "-c", cfg)
    assert code == 0, err
    onnx.checker.check_model(onnx.load(str(tmp_path / "o.onnx")), full_check=True)
