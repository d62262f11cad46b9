"""The HTML report page (``onnxopt MODEL -o OUT --report R.html``, ``onnxopt.reporting.html``) and the
op-type latency it draws (``onnxopt.verify.profile``): the page from data built to the analysis and
memory contracts, the command end to end, and the page in headless Chromium."""

from __future__ import annotations

import html.parser
import json
import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

import browser
from helpers import bn_node, bn_params, init, model, tinfo
from onnxopt.reporting import html as html_report
from onnxopt import cli
from onnxopt.verify import make_inputs
from onnxopt.verify.profile import kernel_times, op_type_latency

SECTIONS = ("summary", "ops", "rules", "cost", "memory", "verification", "diff")
ODD = 'My<Op>&"q\''  # an op type / node name that must be escaped


class Page(html.parser.HTMLParser):
    """The elements of a page: (tag, attributes) in order, and the text."""

    def __init__(self, text: str):
        super().__init__()
        self.elements: list[tuple[str, dict]] = []
        self.text: list[str] = []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.elements.append((tag, dict(attrs)))

    def handle_startendtag(self, tag, attrs):
        self.elements.append((tag, dict(attrs)))

    def handle_data(self, data):
        self.text.append(data)

    def find(self, tag, **attrs):
        return [a for t, a in self.elements
                if t == tag and all(a.get(k.replace("_", "-")) == v for k, v in attrs.items())]

    def chart(self, name) -> list[dict]:
        """The bars of one SVG chart, in order."""
        out, inside = [], False
        for tag, a in self.elements:
            if tag == "svg":
                inside = a.get("data-chart") == name
            elif inside and tag == "rect" and "bar" in a.get("class", "").split():
                out.append(a)
        return out


def _stats(tried, fired):
    return {"tried": tried, "matched": fired, "refused": 0, "fired": fired, "errors": 0, "seconds": 0.001,
            "top_refusals": {}}


def fake_analysis(ops: dict[str, tuple[int, float, int]]) -> dict:
    """onnxopt.inspect.analysis.analyze's dict (the contract) for {op: (nodes, flops, bytes)}."""
    by = {op: {"nodes": n, "flops": f, "bytes_read": b, "bytes_written": b // 2} for op, (n, f, b) in ops.items()}
    return {"op_types": {op: v["nodes"] for op, v in by.items()}, "flops": sum(v["flops"] for v in by.values()),
            "bytes_read": sum(v["bytes_read"] for v in by.values()),
            "bytes_written": sum(v["bytes_written"] for v in by.values()), "by_op_type": by,
            "params": {"count": 1000, "bytes": 4000, "by_dtype": {"float32": 4000}},
            "flops_convention": "a multiply-add counts as 2 FLOPs"}


def fake_memory(curve: list[int]) -> dict:
    """onnxopt.transforms.memory.peak's dict (the contract) for a curve."""
    i = int(np.argmax(curve))
    return {"peak_bytes": curve[i], "peak_at": {"index": i, "name": f"node{i}<&>"}, "curve": curve,
            "alive_at_peak": [["t<1>", curve[i] // 2], ["t2", curve[i] // 4]], "weights_bytes": 1234,
            "unknown": []}


def fake_data(**over) -> dict:
    before = {"Conv": 4, "BatchNormalization": 4, "Relu": 4, ODD: 1}
    after = {"Conv": 4, "Relu": 4, ODD: 1}
    report = {"nodes_before": 13, "nodes_after": 9, "op_types_before": before, "op_types_after": after,
              "rewrites": 4, "rules": {"conv_bn_fold": _stats(4, 4), "add_zero": _stats(3, 0)},
              "seconds": {"load": 0.1, "rewrite": 0.2, "save": 0.1, "total": 0.4}, "cycles": [], "hit_limit": False,
              "warnings": ["a <warning> & more"], "errors": [], "settings": {"target": "portable"}, "skipped": []}
    data = {"input": "in<put>.onnx", "output": "out&.onnx", "report": report,
            "analysis": {"before": fake_analysis({"Conv": (4, 8e9, 4000), "BatchNormalization": (4, 2e6, 4000),
                                                  "Relu": (4, 1e6, 2000), ODD: (1, 5e5, 100)}),
                         "after": fake_analysis({"Conv": (4, 8.1e9, 4000), "Relu": (4, 1e6, 2000),
                                                 ODD: (1, 5e5, 100)})},
            "memory": {"before": fake_memory([100, 400, 300, 900, 200]),
                       "after": fake_memory([100, 300, 600, 200]), "reordered": False},
            "profile": {"before": {"Conv": 2.0, "BatchNormalization": 0.5, ODD: 0.25},
                        "after": {"Conv": 1.5, ODD: 0.25}, "provider": "cpu", "runs": 10, "warmup": 2,
                        "optimization": "ORT_ENABLE_ALL"},
            "diff_page": "../diffs/my diff#1.html", "sizes": {"before": 5000, "after": 4000}}
    data.update(over)
    return data


def test_every_section_and_bars_proportional_to_the_values():
    data = fake_data()
    page = Page(html_report.render(data))
    for sid in SECTIONS:
        assert page.find("section", id=sid), sid
    for name, key in (("flops", "flops"), ("latency", None)):
        bars = {side: page.chart(f"{name}-{side}") for side in ("before", "after")}
        if key:
            values = {side: {op: v[key] for op, v in data["analysis"][side]["by_op_type"].items()}
                      for side in ("before", "after")}
        else:
            values = {side: data["profile"][side] for side in ("before", "after")}
        # one bar per op type with a value on either side, the same rows in the same order on both sides
        ops = set(values["before"]) | set(values["after"])
        assert [b["data-op"] for b in bars["before"]] == [b["data-op"] for b in bars["after"]]
        assert sorted(b["data-op"] for b in bars["before"]) == sorted(ops)
        # widths proportional to the values, one scale for before and after; the largest fills the area
        widest = max(float(b["width"]) for side in bars.values() for b in side)
        top = max(v for side in values.values() for v in side.values())
        for side in ("before", "after"):
            for b in bars[side]:
                want = values[side].get(b["data-op"], 0)
                assert float(b["data-value"]) == pytest.approx(want)
                assert float(b["width"]) == pytest.approx(widest * want / top, abs=0.02)
    # bars sorted by the larger side: Conv first
    assert page.chart("flops-before")[0]["data-op"] == "Conv"
    # memory: a line per side, with every point, and the peak marked
    svgs = {a["data-chart"]: a for a in page.find("svg") if a.get("data-chart", "").startswith("memory-")}
    assert svgs["memory-before"]["data-points"] == "5" and svgs["memory-after"]["data-points"] == "4"
    assert len(page.find("circle", **{"class": "peak"})) == 2
    # the diff link: relative, URL-encoded
    link = page.find("a", id="diff-link")[0]
    assert link["href"] == "../diffs/my%20diff%231.html"


def test_names_are_escaped():
    text = html_report.render(fake_data())
    page = Page(text)
    assert "<Op>" not in text and "in<put>" not in text and "<warning>" not in text
    assert any(b["data-op"] == ODD for b in page.chart("flops-before"))  # round-trips through the parser
    body = "".join(page.text)
    assert ODD in body and "in<put>.onnx" in body and "a <warning> & more" in body and "node3<&>" in body
    assert not page.find("script")


def test_many_op_types_end_in_an_other_bar():
    ops = {f"Op{i:02d}": (1, float(100 - i), 10) for i in range(20)}
    data = fake_data(analysis={"before": fake_analysis(ops), "after": fake_analysis(ops)})
    bars = Page(html_report.render(data)).chart("flops-before")
    assert len(bars) == html_report.BAR_ROWS
    assert bars[-1]["data-op"] == f"other ({20 - html_report.BAR_ROWS + 1})"
    assert float(bars[-1]["data-value"]) == pytest.approx(sum(100 - i for i in range(html_report.BAR_ROWS - 1, 20)))


def test_missing_sections_say_so():
    data = fake_data(analysis=None, memory=None, profile={"unavailable": "profiling failed: boom"}, diff_page=None)
    text = html_report.render(data)
    page = Page(text)
    for sid in SECTIONS:
        assert page.find("section", id=sid)
    assert not page.find("svg")
    assert "static cost analysis: not available" in text and "the memory curve: not available" in text
    assert "profiling failed: boom" in text and "no diff page was written" in text
    # no timing of the optimizer itself on the page: the same input gives the same bytes
    assert html_report.render(data) == text
    other = fake_data(analysis=None, memory=None, profile={"unavailable": "profiling failed: boom"}, diff_page=None)
    other["report"]["seconds"] = {"load": 9.0, "rewrite": 9.0, "save": 9.0, "total": 27.0}
    other["report"]["rules"]["conv_bn_fold"]["seconds"] = 7.0
    assert html_report.render(other) == text


def test_long_memory_curves_keep_their_peak():
    curve = [i % 97 for i in range(10_000)]
    curve[5003] = 10_000
    pts = html_report._points(curve)
    assert len(pts) == html_report.CURVE_POINTS and (5003, 10_000.0) in pts


def test_kernel_times_skip_the_warm_up_runs():
    def run(ts):
        return {"cat": "Session", "name": "model_run", "ts": ts, "dur": 100}

    def kernel(ts, op, dur):
        return {"cat": "Node", "name": f"n{ts}_kernel_time", "ts": ts, "dur": dur, "args": {"op_name": op}}

    events = [run(0), kernel(10, "Conv", 1000), run(200), kernel(210, "Conv", 40), kernel(220, "Relu", 6),
              run(400), kernel(410, "Conv", 60), kernel(420, "Relu", 4),
              {"cat": "Node", "name": "n_fence_before", "ts": 415, "dur": 500, "args": {"op_name": "Conv"}}]
    total, runs = kernel_times(events, skip_runs=1)
    assert runs == 2 and total == {"Conv": 100.0, "Relu": 10.0}


def conv_bn_model(path: Path) -> Path:
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], name='conv<1>&"q"', pads=[1, 1, 1, 1]),
             bn_node("c1", "b1", "bn1"), helper.make_node("Relu", ["b1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "w2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
             bn_node("c2", "b2", "bn2"), helper.make_node("Add", ["b2", "r1"], ["y"], name="add")]
    inits = [init("w1", rng.standard_normal((8, 3, 3, 3)).astype(np.float32)),
             init("w2", rng.standard_normal((8, 8, 3, 3)).astype(np.float32)), *bn_params("bn1", 8, rng),
             *bn_params("bn2", 8, rng)]
    onnx.save(model(nodes, [tinfo("x", [1, 3, 32, 32])], [tinfo("y", [1, 8, 32, 32])], inits), path)
    return path


def test_op_type_latency_from_the_profiler(tmp_path):
    src = conv_bn_model(tmp_path / "m.onnx")
    ms = op_type_latency(str(src), make_inputs(str(src))[0], runs=3)
    assert list(ms) == sorted(ms) and "Conv" in ms and ms["Conv"] > 0
    assert all(v >= 0 for v in ms.values())


def test_report_without_verify_is_byte_identical(tmp_path, capsys):
    src = conv_bn_model(tmp_path / "m.onnx")
    pages = []
    for i in range(2):
        out, page = tmp_path / f"o{i}.onnx", tmp_path / "R.html"
        assert cli.main([str(src), "-o", str(out), "--report", str(page), "-q"]) == 0
        pages.append(page.read_bytes())
        page.unlink()
    # (the output's name differs: its row is the only difference)
    assert pages[0].replace(b"o0.onnx", b"o1.onnx") == pages[1]
    text = pages[0].decode()
    assert "not verified" in text and "measured only with --verify" in text
    capsys.readouterr()


@pytest.mark.parametrize("clash", ["input", "output", "diff"])
def test_report_path_clashes_are_one_line(tmp_path, capsys, clash):
    src = conv_bn_model(tmp_path / "m.onnx")
    out = tmp_path / "o.onnx"
    page = {"input": src, "output": out, "diff": tmp_path / "D.html"}[clash]
    code = cli.main([str(src), "-o", str(out), "--diff", str(tmp_path / "D.html"), "--report", str(page), "-q"])
    err = capsys.readouterr().err
    assert code == 2 and "--report" in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_end_to_end_in_chromium(tmp_path, capsys):
    src = conv_bn_model(tmp_path / "m.onnx")
    (tmp_path / "pages").mkdir()
    out, page, diff = tmp_path / "o.onnx", tmp_path / "pages" / "R.html", tmp_path / "D.html"
    code = cli.main([str(src), "-o", str(out), "--report", str(page), "--verify", "cpu", "--runs", "3",
                     "--diff", str(diff), "-q"])
    assert code == 0, capsys.readouterr().err
    text = page.read_text()
    parsed = Page(text)
    for sid in SECTIONS:
        assert parsed.find("section", id=sid), sid
    # the profile's chart: one bar per op type onnxruntime ran, on both sides
    lat = [parsed.chart(f"latency-{side}") for side in ("before", "after")]
    assert lat[0] and len(lat[0]) == len(lat[1]) and any(b["data-op"] == "Conv" for b in lat[0])
    assert "outputs agree on cpu" in text and "conv_bn_fold" in text
    href = parsed.find("a", id="diff-link")[0]["href"]
    assert href == "../D.html" and (page.parent / href).resolve() == diff.resolve()
    why = browser.missing()
    if why:
        pytest.skip(why)
    with browser.headless(1400, 1800) as driver:
        driver.get(page.as_uri())
        state = driver.execute_script("""
            const bars = {};
            for (const s of document.querySelectorAll('svg[data-chart]'))
                bars[s.dataset.chart] = s.querySelectorAll('rect.bar').length;
            return {sections: [...document.querySelectorAll('section')].filter(s => s.offsetHeight > 40).map(s => s.id),
                    bars, widths: [...document.querySelectorAll('svg[data-chart] rect.bar')].map(
                        r => r.getBoundingClientRect().width),
                    link: document.getElementById('diff-link').href};""")
        try:
            logs = driver.get_log("browser")
        except Exception:  # noqa: BLE001 - a driver without the log: the page has no script to fail
            logs = []
        assert [entry for entry in logs if entry.get("level") == "SEVERE"] == []
        assert state["sections"] == list(SECTIONS)
        assert state["bars"]["latency-before"] == len(lat[0]) and state["bars"]["latency-after"] == len(lat[1])
        assert max(state["widths"]) > 50  # drawn, not collapsed
        assert state["link"] == diff.as_uri()
        driver.get(state["link"])  # the diff page it links to loads
        assert "onnxopt" in driver.page_source
        driver.get(page.as_uri())
        png = driver.get_screenshot_as_png()
    from io import BytesIO

    from PIL import Image

    img = Image.open(BytesIO(png)).convert("RGB")
    assert len(img.getcolors(1 << 20) or ()) > 20  # not blank: text, tables, coloured bars


def test_build_gathers_to_the_contracts(tmp_path, monkeypatch):
    """build() calls onnxopt.inspect.analysis.analyze and onnxopt.transforms.memory.peak on both models (fakes built to the
    contracts here), keeps the report's "reordered", and links the diff page relative to the page."""
    calls = []

    def analyze(model, input_shapes=None):
        calls.append(("analyze", model, input_shapes))
        return fake_analysis({"Conv": (2, 1e6, 100)} if model.endswith("m.onnx") else {"Conv": (2, 9e5, 100)})

    def peak(model, input_shapes=None):
        calls.append(("peak", model, input_shapes))
        return fake_memory([1, 5, 2] if model.endswith("m.onnx") else [1, 3])

    src = conv_bn_model(tmp_path / "m.onnx")
    out = tmp_path / "o.onnx"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    from onnxopt import optimize

    _, report = optimize(str(src), output=str(out), return_report=True)  # (before the fakes: it may use memory)
    monkeypatch.setattr(html_report, "analyze", analyze)
    monkeypatch.setattr(html_report, "peak", peak)
    d = report.as_dict()
    d["memory"] = {"before": {"peak_bytes": 5}, "after": {"peak_bytes": 3}, "reordered": True}  # (no curves)
    d["settings"]["input_shapes"] = {"x": [1, 3, 32, 32]}
    data = html_report.build(src, out, d, page=tmp_path / "a" / "R.html", diff_page=tmp_path / "b" / "D.html")
    want = [(f, str(p), {"x": [1, 3, 32, 32]}) for f in ("analyze", "peak") for p in (src, out)]
    assert sorted(calls) == sorted(want)
    assert data["analysis"]["after"]["flops"] == 9e5 and data["memory"]["after"]["curve"] == [1, 3]
    assert data["memory"]["reordered"] is True and data["profile"] is None  # (no verification: nothing measured)
    assert data["diff_page"] == os.path.join("..", "b", "D.html")
    assert data["sizes"]["before"] == src.stat().st_size
    page = Page(html_report.render(data))
    assert len(page.chart("flops-before")) == 1 and page.find("svg", data_chart="memory-after")
    # a section without its data says so
    assert "memory curve: not available (no model)" in html_report.render({**data, "memory": {"unavailable": "no model"}})


def test_inspect_page(tmp_path, capsys):
    """``onnxopt inspect MODEL --html PAGE`` (and bare ``onnxopt MODEL --html PAGE``): one page with the model's
    tables, a bar per op type with FLOPs (widths proportional), the top nodes, the memory curve; never over
    the model; loads in Chromium without errors."""
    src = conv_bn_model(tmp_path / "m.onnx")
    page, js = tmp_path / "i.html", tmp_path / "i.json"
    assert cli.main(["inspect", str(src), "--html", str(page), "--json", str(js), "--top", "3", "-q"]) == 0
    data = json.loads(js.read_text())
    text = page.read_text()
    parsed = Page(text)
    for sid in ("model", "cost", "memory"):
        assert parsed.find("section", id=sid), sid
    bars = parsed.chart("flops-model")
    with_flops = {op for op, v in data["by_op_type"].items() if v["flops"]}
    assert {b["data-op"] for b in bars} == with_flops
    values = [float(b["data-value"]) for b in bars]
    widths = [float(b["width"]) for b in bars]
    assert values == sorted(values, reverse=True) and widths[0] > 0
    for v, w in zip(values, widths):
        assert abs(w - widths[0] * v / values[0]) < 0.02
    top = max(data["nodes"], key=lambda n: n["flops"])
    assert top["name"] in text
    assert cli.main([str(src), "--html", str(tmp_path / "j.html"), "--top", "3", "-q"]) == 0  # bare MODEL
    assert (tmp_path / "j.html").read_text() == text  # (same model, same page: nothing measured on it)
    kept = src.read_bytes()
    assert cli.main(["inspect", str(src), "--html", str(src)]) == 2
    assert "never overwrites what it reads" in capsys.readouterr().err and src.read_bytes() == kept
    why = browser.missing()
    if why:
        pytest.skip(why)
    with browser.headless(1200, 1400) as driver:
        driver.get(page.as_uri())
        shown = driver.execute_script(
            "return [...document.querySelectorAll('section')].filter(s => s.offsetHeight > 40).map(s => s.id)")
        try:
            logs = driver.get_log("browser")
        except Exception:  # noqa: BLE001
            logs = []
        assert shown == ["model", "cost", "memory"] and [e for e in logs if e.get("level") == "SEVERE"] == []


def test_report_of_a_dynamic_model_says_at_which_shapes(tmp_path):
    """Symbolic inputs: the page's FLOPs, bytes and memory are taken at the verifier's shapes, and it says
    so; the inspect page shows an input of unknown shape as '?', not as a scalar."""
    from onnxopt import optimize
    from onnxopt.reporting.html import build, render, render_inspect

    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", 8])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["batch", 8])
    src = tmp_path / "d.onnx"
    onnx.save(model([helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Identity", ["r"], ["y"])], [x], [y]), src)
    out = tmp_path / "o.onnx"
    _, report = optimize(str(src), output=str(out), return_report=True)
    data = build(src, out, report)
    assert data["at"] == {"x": [1, 8]}
    assert "at the verifier&#x27;s shapes: x 1x8" in render(data)
    page = render_inspect("m", {"inputs": [{"name": "a", "dtype": "float32", "shape": None},
                                           {"name": "s", "dtype": "float32", "shape": []}], "outputs": []})
    assert ">?<" in page and ">scalar<" in page
