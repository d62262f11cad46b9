"""The live diff page (onnxopt/diff/live.py) in headless Chromium: both graphs render, the marked nodes are
the ones the mapping lists, choosing a created node brings it into view in both graphs.

Needs Debian's chromium and chromium-driver, selenium and netron (``.ci/run`` installs them); skips with
the reason otherwise. The mapping is onnxopt.diff's, as ``python -m onnxopt diff`` serves it."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from onnxopt.diff import live as diff_live
from onnxopt import diff, optimize, verify
from onnxopt.errors import UsageError
from tests import browser
from tests.helpers import model, tinfo


def _skip_reason() -> str | None:
    if diff_live.netron_dir() is None:
        return "netron is not installed (pip install 'onnxopt[diff]')"
    return browser.missing()


def _small(tmp_path):
    """Identity -> Conv -> BatchNormalization -> Relu (twice) -> Mul -> Flatten -> MatMul -> Add, and its
    optimized form (Identity removed, Conv+BN folded, the twin Relu merged, MatMul+Add a Gemm)."""
    rng = np.random.default_rng(0)

    def init(name, *shape, positive=False):
        a = rng.standard_normal(shape).astype(np.float32)
        return numpy_helper.from_array(np.abs(a) + 0.5 if positive else a, name)

    nodes = [
        helper.make_node("Identity", ["x"], ["x1"], name="ident0"),
        helper.make_node("Conv", ["x1", "w", "b"], ["c"], name="conv0", pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c", "s", "bb", "m", "v"], ["bn"], name="bn0"),
        helper.make_node("Relu", ["bn"], ["r"], name="relu0"),
        helper.make_node("Relu", ["bn"], ["r2"], name="relu0_twin"),  # CSE merges it into relu0
        helper.make_node("Mul", ["r", "r2"], ["rr"], name="mul0"),
        helper.make_node("Flatten", ["rr"], ["f"], name="flat0"),
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


def real_mapping(before, after, verify_report=None) -> dict:
    """The mapping ``python -m onnxopt diff`` serves: onnxopt.diff's, from the provenance."""
    return diff.live_mapping(*diff.run(before, after, verify_report=verify_report))


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("difflive")
    before, after = _small(tmp)
    mapping = real_mapping(before, after, verify.verify(before, after, runs=5, warmup=1))
    # Nothing in this model is changed in place; one entry checks how the page marks a changed node.
    mapping["changed"] = [{"before": "relu0", "after": "relu0"}]
    with diff_live.serve(before, after, mapping) as server, browser.headless() as driver:
        driver.get(server.url)
        browser.wait_for_diff(driver)
        yield driver, mapping, tmp


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
    # kernels and latency from the verify report, as the report has them
    shown = driver.execute_script(
        "return Array.from(document.querySelectorAll('#verify tr')).slice(1).map(tr => Array.from(tr.cells).map(c => c.textContent))")
    (row,) = mapping["summary"]["verify"]
    assert shown == [["cpu", str(row["kernels_before"]), str(row["kernels_after"]),
                      str(round(row["latency_ms_before"], 3)).rstrip("0").rstrip("."),
                      str(round(row["latency_ms_after"], 3)).rstrip("0").rstrip("."), row["latency_verdict"] or ""]]
    assert row["latency_verdict"]  # (the verdict of the ratio's interval, onnxopt.verify.latency_text)
    assert row["kernels_before"] > 0 and row["kernels_after"] > 0 and row["latency_ms_after"] > 0


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
        for bad in (99999, -1, 0):
            with pytest.raises(UsageError, match="not a TCP port"):
                diff_live.serve(before, after, {}, port=bad)
        with diff_live.serve(before, after, {}) as one, diff_live.serve(before, after, {}) as two:
            assert one.port != two.port  # the next free one
            import urllib.request

            body = urllib.request.urlopen(two.url + "netron/index.html").read().decode()
            assert 'content="0.0.0"' in body and 'name="date"' not in body
            data = json.loads(urllib.request.urlopen(two.url + "mapping.json").read())
            assert data["summary"]["ops_before"]["Conv"] == 1 and data["created"] == []
            assert urllib.request.urlopen(two.url + "models/after/after.onnx").read() == after.read_bytes()


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
    assert _nothing_listens(port)  # the server stopped


def _metadata_shown(driver, side, name) -> str:
    """What Netron's node properties show under "Metadata" for the node (the key is a label element's
    value, not text: hence innerHTML)."""
    return _frame_eval(driver, side, f"""
        const t = w.__view__.target;
        let value = null;
        for (const [k, o] of t._table.entries()) if (o && o.id === {json.dumps('node-name-' + name)}) value = k;
        w.__view__.showNodeProperties(value);
        const h = doc.getElementById('sidebar').innerHTML; return h.slice(h.indexOf('Metadata'));""")


def test_provenance_shows_in_netron_node_properties(page):
    """Netron (9.x) lists an ONNX node's metadata_props under "Metadata" in its node properties: the rule
    and the nodes it replaced show there for every created node, the merged twins for the node CSE kept."""
    driver, mapping, _ = page
    for created in mapping["created"]:
        text = _metadata_shown(driver, "after", created["after"])
        assert "onnxopt.rule" in text and created["rule"] in text, text[:500]
        assert "onnxopt.replaced" in text and all(r in text for r in created["recorded"]), text[:500]
    text = _metadata_shown(driver, "after", "relu0")
    assert "onnxopt.merged" in text and "relu0_twin" in text, text[:500]


def test_ctrl_c_stops_the_server(tmp_path):
    if diff_live.netron_dir() is None:
        pytest.skip("netron is not installed (pip install 'onnxopt[diff]')")
    before, after = _small(tmp_path)
    code = ("import sys; from onnxopt.diff import live as diff_live; "
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
    assert _nothing_listens(port)


def _nothing_listens(port: int) -> bool:
    """True when no server listens on the port (connections lingering in TIME_WAIT do not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
        except OSError:
            return False
    return True


def _serving(proc) -> str:
    """The URL a diff process serves, from the line it prints."""
    for line in proc.stdout:
        if "http://127.0.0.1:" in line:
            return line[line.index("http://"):].split()[0]
    raise AssertionError(f"no URL printed; exit {proc.wait(10)}")


def test_cli_serves_the_live_view(tmp_path):
    """python -m onnxopt diff BEFORE AFTER (no --html): the live view, with onnxopt.diff's mapping; Ctrl-C
    stops it with status 0 and frees the port."""
    if diff_live.netron_dir() is None:
        pytest.skip("netron is not installed (pip install 'onnxopt[diff]')")
    import urllib.request

    before, after = _small(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "onnxopt", "diff", str(before), str(after), "--no-browser"],
                            stdout=subprocess.PIPE, text=True)
    try:
        url = _serving(proc)
        served = json.loads(urllib.request.urlopen(url + "mapping.json").read())
        expected = real_mapping(before, after)
        assert [(c["after"], c["rule"], c["replaced"]) for c in served["created"]] == \
            [(c["after"], c["rule"], c["replaced"]) for c in expected["created"]]
        assert served["removed"] == expected["removed"] == ["ident0"]
        page = urllib.request.urlopen(url).read().decode()
        secret = url.rstrip("/").rsplit("/", 1)[1]
        assert f"url=%2F{secret}%2Fmodels%2Fbefore%2Fbefore.onnx" in page
        assert f"url=%2F{secret}%2Fmodels%2Fafter%2Fafter.onnx" in page
        proc.send_signal(signal.SIGINT)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    port = int(url.split(":")[2].split("/")[0])
    # the same port again at once (the connections above linger in TIME_WAIT): a new server starts
    with diff_live.serve(before, after, {}, port=port) as again:
        assert again.port == port
    assert _nothing_listens(port)


def test_external_data_is_served(tmp_path):
    """A model with its weights in a file beside it: Netron asks for that file relative to the model's
    URL; the server gives the files the model names and nothing else."""
    if diff_live.netron_dir() is None:
        pytest.skip("netron is not installed (pip install 'onnxopt[diff]')")
    import urllib.error
    import urllib.request

    before, after = _small(tmp_path)
    (tmp_path / "ext" / "weights").mkdir(parents=True)
    big = tmp_path / "ext" / "after big.onnx"
    onnx.save(onnx.load(str(after)), big, save_as_external_data=True, all_tensors_to_one_file=True,
              location="weights/after.data", size_threshold=0)
    (tmp_path / "ext" / "secret.txt").write_text("not served")
    with diff_live.serve(before, big, real_mapping(before, after)) as server:
        page = urllib.request.urlopen(server.url).read().decode()
        assert f"url=%2F{server.secret}%2Fmodels%2Fafter%2Fafter%2520big.onnx" in page
        get = lambda p: urllib.request.urlopen(server.url + p).read()  # noqa: E731
        assert get("models/after/after%20big.onnx") == big.read_bytes()
        assert get("models/after/weights/after.data") == (tmp_path / "ext" / "weights" / "after.data").read_bytes()
        for path in ("models/after/secret.txt", "models/after/../before.onnx", "models/before/after.onnx",
                     "models/after/%2e%2e/before.onnx"):
            with pytest.raises(urllib.error.HTTPError):
                get(path)
        if browser.missing() is None:
            with browser.headless() as driver:
                driver.get(server.url)
                state = browser.wait_for_diff(driver)
                assert state["applied"]["after"], state


@pytest.mark.parametrize("name", ["b#x", "a%41", "q?r&s", "üñí côdé"])
def test_file_names_netron_fetches_as_given(name, tmp_path):
    """A model file named with '#', '?', '&', '%' or non-ASCII letters: Netron decodes the url parameter
    before fetching it, so the page encodes the path twice; both graphs load."""
    if _skip_reason():
        pytest.skip(_skip_reason())
    before, after = _small(tmp_path)
    b2, a2 = tmp_path / f"{name}.before.onnx", tmp_path / f"{name}.onnx"
    b2.write_bytes(before.read_bytes())
    a2.write_bytes(after.read_bytes())
    with diff_live.serve(b2, a2, real_mapping(b2, a2)) as server, browser.headless() as driver:
        driver.get(server.url)
        state = browser.wait_for_diff(driver, timeout=20)
        assert state["applied"]["before"] and state["applied"]["after"]


def _raw(port: int, request: bytes) -> tuple[int, bytes]:
    """Send a raw HTTP request; the status code and the body."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def test_only_loopback_hosts_with_the_secret_are_served(tmp_path):
    """DNS rebinding: a page of another site whose name now resolves to 127.0.0.1 sends its own Host. The
    server answers only a loopback host name with its port, an origin-form target and the run's secret
    prefix; the models, their weights and the mapping are never in a refusal."""
    if diff_live.netron_dir() is None:
        pytest.skip("netron is not installed (pip install 'onnxopt[diff]')")
    import http.client

    before, after = _small(tmp_path)
    model_bytes = after.read_bytes()
    with diff_live.serve(before, after, real_mapping(before, after)) as server:
        port, secret = server.port, server.secret
        assert len(secret) >= 32 and server.url == f"http://127.0.0.1:{port}/{secret}/"
        assert server._httpd.server_address[0] == "127.0.0.1"
        with diff_live.serve(before, after, {}) as other:
            assert other.secret != secret  # one per run
        paths = ["", "mapping.json", "models/after/after.onnx", "netron/index.html", "live.js"]

        def get(path, host, target=None):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.putrequest("GET", target or path, skip_host=True)
            if host is not None:
                conn.putheader("Host", host)
            conn.endheaders()
            r = conn.getresponse()
            body = r.read()
            conn.close()
            return r.status, body

        for p in paths:
            good = f"/{secret}/{p}"
            for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"LOCALHOST:{port}", f"[::1]:{port}"):
                assert get(good, host)[0] == 200, (p, host)
            for host in ("evil.example", f"evil.example:{port}", "127.0.0.1", f"127.0.0.1:{port + 1}",
                         f"localhost.evil.example:{port}", f"127.0.0.1.nip.io:{port}", "", None):
                status, body = get(good, host)
                assert status == 403 and b"mapping" not in body and body != model_bytes, (p, host, status)
            for bad in (f"/{p}", f"/{secret[:-1]}/{p}", f"/{secret}x/{p}", f"/x{secret}/{p}",
                        f"/{p}?{secret}"):
                status, body = get(bad, f"127.0.0.1:{port}")
                assert status == 404 and body == b"not found", (bad, status)
            # absolute-form and authority-form targets, even naming this very server
            for target in (f"http://evil.example{good}", f"http://127.0.0.1:{port}{good}", f"127.0.0.1:{port}"):
                status, body = get(None, f"127.0.0.1:{port}", target)
                assert status == 400 and body != model_bytes, (target, status)
            # (http.server reads a leading '//' as '/': not the secret prefix)
            assert get(None, f"127.0.0.1:{port}", f"//evil.example{good}")[0] == 404
        # the same with raw sockets: a rebinding page's request, and one with two Host headers
        assert _raw(port, f"GET /{secret}/mapping.json HTTP/1.1\r\nHost: attacker.test:{port}\r\n"
                          "Connection: close\r\n\r\n".encode())[0] == 403
        assert _raw(port, f"GET /{secret}/mapping.json HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                          f"Host: attacker.test:{port}\r\nConnection: close\r\n\r\n".encode())[0] == 403
        assert _raw(port, f"GET http://attacker.test/{secret}/mapping.json HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                          "Connection: close\r\n\r\n".encode())[0] == 400
        status, body = _raw(port, f"GET /{secret}/mapping.json HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                                  "Connection: close\r\n\r\n".encode())
        assert status == 200 and json.loads(body)["removed"] == ["ident0"]
        # "/<secret>" without the slash: sent to "/<secret>/", where the page's relative addresses resolve
        status, _ = get(f"/{secret}", f"127.0.0.1:{port}")
        assert status == 301
        # the page's own addresses all carry the secret
        page = get(f"/{secret}/", f"127.0.0.1:{port}")[1].decode()
        assert 'src="netron/index.html?url=%2F' + secret in page and 'src="/' not in page
        assert "fetch('mapping.json')" in (diff_live.ASSETS / "live.js").read_text()
