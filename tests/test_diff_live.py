"""The live diff page (onnxopt/diff_live.py) in headless Chromium: both graphs render, the marked nodes are
the ones the mapping lists, choosing a created node brings it into view in both graphs.

Needs Debian's chromium and chromium-driver, selenium and netron (``.ci/run`` installs them); skips with
the reason otherwise. The mapping here is a minimal stand-in built from onnxopt's provenance (the real one
is onnxopt.diff's, on the d-core branch)."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from onnxopt import diff_live, optimize
from onnxopt.errors import UsageError
from onnxopt.irutil import REPLACED_KEY, RULE_KEY
from tests.helpers import model, tinfo


def _chromedriver() -> str | None:
    return shutil.which("chromedriver") or (shutil.which("chromium.chromedriver"))


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def _skip_reason() -> str | None:
    if diff_live.netron_dir() is None:
        return "netron is not installed (pip install 'onnxopt[diff]')"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install 'onnxopt[test]')"
    if _chromium() is None or _chromedriver() is None:
        return "Chromium is absent (Debian: apt-get install chromium chromium-driver)"
    return None


def _small(tmp_path):
    """Identity -> Conv -> BatchNormalization -> Relu -> Flatten -> MatMul -> Add, and its optimized form
    (Identity removed, Conv+BN folded, MatMul+Add a Gemm)."""
    rng = np.random.default_rng(0)

    def init(name, *shape, positive=False):
        a = rng.standard_normal(shape).astype(np.float32)
        return numpy_helper.from_array(np.abs(a) + 0.5 if positive else a, name)

    nodes = [
        helper.make_node("Identity", ["x"], ["x1"], name="ident0"),
        helper.make_node("Conv", ["x1", "w", "b"], ["c"], name="conv0", pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c", "s", "bb", "m", "v"], ["bn"], name="bn0"),
        helper.make_node("Relu", ["bn"], ["r"], name="relu0"),
        helper.make_node("Flatten", ["r"], ["f"], name="flat0"),
        helper.make_node("MatMul", ["f", "wm"], ["mm"], name="mm0"),
        helper.make_node("Add", ["mm", "bm"], ["y"], name="add0"),
    ]
    inits = [init("w", 4, 3, 3, 3), init("b", 4), init("s", 4), init("bb", 4), init("m", 4),
             init("v", 4, positive=True), init("wm", 256, 10), init("bm", 10)]
    before = tmp_path / "before.onnx"
    after = tmp_path / "after.onnx"
    onnx.save(model(nodes, [tinfo("x", [1, 3, 8, 8])], [tinfo("y", [1, 10])], inits), before)
    optimize(str(before), output=str(after))
    return before, after


def stand_in_mapping(before, after) -> dict:
    """The mapping diff_live takes, from provenance only (what onnxopt.diff does properly)."""
    b = onnx.load(str(before)).graph.node
    a = onnx.load(str(after)).graph.node
    created, replaced_all, pairs = [], set(), {}
    for n in a:
        props = {p.key: p.value for p in n.metadata_props}
        if RULE_KEY in props:
            replaced = json.loads(props.get(REPLACED_KEY, "[]"))
            created.append({"after": n.name, "rule": props[RULE_KEY], "replaced": replaced})
            replaced_all.update(replaced)
            pairs[n.name] = replaced
        else:
            pairs[n.name] = [n.name]
    after_names = {n.name for n in a}
    removed = [n.name for n in b if n.name not in after_names and n.name not in replaced_all]
    return {"created": created, "removed": removed, "changed": [], "pairs": pairs}


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    tmp = tmp_path_factory.mktemp("difflive")
    before, after = _small(tmp)
    mapping = stand_in_mapping(before, after)
    # Nothing in this model is changed in place; one entry checks how the page marks a changed node.
    mapping["changed"] = [{"before": "relu0", "after": "relu0"}]
    server = diff_live.serve(before, after, mapping)
    options = webdriver.ChromeOptions()
    options.binary_location = _chromium()
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1600,1000"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=Service(_chromedriver()))
    try:
        driver.get(server.url)
        deadline = time.monotonic() + 30
        ready = None
        while time.monotonic() < deadline:
            ready = driver.execute_script("return window.onnxoptDiff && window.onnxoptDiff.ready")
            if ready and ready["before"] and ready["after"]:
                break
            time.sleep(0.2)
        assert ready and ready["before"] and ready["after"], f"Netron did not render both graphs: {ready}"
        yield driver, mapping, tmp
    finally:
        driver.quit()
        server.close()


def _frame_eval(driver, side, script):
    return driver.execute_script(
        f"const w = document.getElementById('{side}').contentWindow; const doc = w.document; {script}")


def test_both_graphs_render(page):
    driver, mapping, tmp = page
    for side, ops in (("before", {"Identity", "Conv", "BatchNormalization", "MatMul", "Add"}),
                      ("after", {"Conv", "Relu", "Gemm"})):
        ids = _frame_eval(driver, side, "return Array.from(doc.querySelectorAll('#nodes g.node[id^=node-name-]')).map(g => g.id)")
        text = _frame_eval(driver, side, "return doc.getElementById('nodes').textContent")
        assert len(ids) >= 4, (side, ids)
        for op in ops:
            assert op in text, (side, op, text[:300])
    shot = tmp / "live.png"
    driver.save_screenshot(str(shot))
    png = driver.get_screenshot_as_png()
    assert len(png) > 10_000
    # Not blank: the screenshot has many distinct colours (graph nodes, marks, text).
    try:
        from PIL import Image
        import io

        img = Image.open(io.BytesIO(png)).convert("RGB").resize((400, 250))
        assert len(set(img.tobytes()[i:i + 3] for i in range(0, 400 * 250 * 3, 3))) > 50
    except ImportError:  # pillow absent: the size check above stands
        pass


def test_marks_are_the_mapping(page):
    driver, mapping, _ = page
    assert {c["rule"] for c in mapping["created"]} == {"conv_bn_fold", "matmul_add_to_gemm"}
    assert mapping["removed"] == ["ident0"]
    marked = {}
    for side in ("before", "after"):
        marked[side] = dict(_frame_eval(
            driver, side,
            "return Array.from(doc.querySelectorAll('g[data-onnxopt]')).map(g => [g.id.slice(10), g.getAttribute('data-onnxopt')])"))
    expect_after = {c["after"]: ("fused" if len(c["replaced"]) > 1 else "created") for c in mapping["created"]}
    expect_before = {r: "fused" for c in mapping["created"] for r in c["replaced"]}
    expect_before.update({r: "removed" for r in mapping["removed"]})
    expect_after["relu0"] = expect_before["relu0"] = "changed"
    assert marked["after"] == expect_after
    assert marked["before"] == expect_before
    # The table lists each created node with its rule and replaced nodes.
    rows = driver.execute_script(
        "return Array.from(document.querySelectorAll('#created tbody tr')).map(tr => Array.from(tr.cells).map(c => c.textContent))")
    assert rows == [[c["after"], c["rule"], ", ".join(c["replaced"])] for c in mapping["created"]]
    # The summary: op-type counts that changed, rules fired.
    summary = driver.find_element("id", "summary").text
    assert "Gemm" in summary and "conv_bn_fold" in summary


def _in_view(driver, side, name):
    return _frame_eval(driver, side, f"""
        const g = doc.getElementById({json.dumps('node-name-' + name)});
        const c = doc.getElementById('target').getBoundingClientRect();
        const r = g.getBoundingClientRect();
        return r.width > 0 && r.left >= c.left && r.right <= c.right && r.top >= c.top && r.bottom <= c.bottom
            && g.classList.contains('select');""")


def test_choosing_a_created_node_brings_it_into_view(page):
    driver, mapping, _ = page
    # Zoom in and scroll both views to their top-left corner so that the chosen nodes start out of view.
    for side in ("before", "after"):
        _frame_eval(driver, side, """
            for (let i = 0; i < 8; i++) w.__view__.target && w.__view__.zoomIn && w.__view__.zoomIn();
            const t = doc.getElementById('target'); t.scrollTo(0, 0);""")
    time.sleep(0.5)
    created = mapping["created"][-1]  # the Gemm: the last node, far from the top once zoomed
    assert not _in_view(driver, "after", created["after"])
    rows = driver.find_elements("css selector", "#created tbody tr")
    rows[len(mapping["created"]) - 1].click()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not _in_view(driver, "after", created["after"]):
        time.sleep(0.1)
    assert _in_view(driver, "after", created["after"])
    assert any(_in_view(driver, "before", r) for r in created["replaced"])
    chosen = driver.execute_script("return window.onnxoptDiff.chosen")
    assert chosen["after"] == [created["after"]] and sorted(chosen["before"]) == sorted(created["replaced"])


def test_port_in_use(tmp_path):
    if diff_live.netron_dir() is None:
        pytest.skip("netron is not installed (pip install 'onnxopt[diff]')")
    before, after = _small(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        with pytest.raises(UsageError, match=f"port {busy} is not available"):
            diff_live.serve(before, after, {}, port=busy)
        with diff_live.serve(before, after, {}) as one, diff_live.serve(before, after, {}) as two:
            assert one.port != two.port  # the next free one
            import urllib.request

            body = urllib.request.urlopen(two.url + "netron/index.html").read().decode()
            assert 'content="0.0.0"' in body and 'name="date"' not in body
            data = json.loads(urllib.request.urlopen(two.url + "mapping.json").read())
            assert data["summary"]["ops_before"]["Conv"] == 1 and data["created"] == []
            assert urllib.request.urlopen(two.url + "models/after.onnx").read() == after.read_bytes()


def test_without_netron(monkeypatch, tmp_path):
    monkeypatch.setattr(diff_live, "netron_dir", lambda: None)
    with pytest.raises(UsageError, match="pip install"):
        diff_live.serve(tmp_path / "a.onnx", tmp_path / "b.onnx", {})


def test_run_stops(tmp_path):
    if diff_live.netron_dir() is None:
        pytest.skip("netron is not installed (pip install 'onnxopt[diff]')")
    before, after = _small(tmp_path)
    lines = []
    assert diff_live.run(before, after, {}, open_browser=False, duration=0.3, echo=lines.append) == 0
    port = int(lines[0].split(":")[3].split("/")[0])
    with socket.socket() as s:  # the port is free again: the server stopped
        s.bind(("127.0.0.1", port))


def test_provenance_shows_in_netron_node_properties(page):
    """Netron (9.x) lists an ONNX node's metadata_props under "Metadata" in its node properties: the rule
    and the replaced nodes show there for every created node (the key is a label element's value, not
    text: hence innerHTML)."""
    driver, mapping, _ = page
    for created in mapping["created"]:
        text = _frame_eval(driver, "after", f"""
            const t = w.__view__.target;
            let value = null;
            for (const [k, o] of t._table.entries()) if (o && o.id === {json.dumps('node-name-' + created['after'])}) value = k;
            w.__view__.showNodeProperties(value);
            const h = doc.getElementById('sidebar').innerHTML; return h.slice(h.indexOf('Metadata'));""")
        assert "onnxopt.rule" in text and created["rule"] in text, text[:500]
        assert "onnxopt.replaced" in text and all(r in text for r in created["replaced"]), text[:500]


def test_ctrl_c_stops_the_server(tmp_path):
    if diff_live.netron_dir() is None:
        pytest.skip("netron is not installed (pip install 'onnxopt[diff]')")
    before, after = _small(tmp_path)
    code = ("import sys; from onnxopt import diff_live; "
            f"sys.exit(diff_live.run({str(before)!r}, {str(after)!r}, {{}}, open_browser=False, "
            "echo=lambda s: print(s, flush=True)))")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("onnxopt diff: http://127.0.0.1:"), line
        port = int(line.split(":")[3].split("/")[0])
        proc.send_signal(signal.SIGINT)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
