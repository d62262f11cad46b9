"""The live diff: one local HTTP server, one origin, with both models side by side in Netron.

``python -m onnxopt diff BEFORE AFTER`` (without ``--html``) calls :func:`run`. The server serves, under a per-run secret path prefix ``/<secret>/`` (``secrets.token_urlsafe``; the
URL it prints carries it, and every address below is relative to it)

- ``/``                      the diff page (``onnxopt/data/diff/live.html``, ``live.js``, ``live.css``);
- ``/mapping.json``          the mapping below, with a ``summary`` filled in where the caller gave none;
- ``/models/before/<file>``  and ``/models/after/<file>``: the two model files, as they are on disk, and
                             the external data files each names (``onnxopt.ir.io.files_read``), at their
                             relative locations, so Netron shows weights held outside the model file;
- ``/netron/...``            Netron's own web app, the static files of the installed ``netron`` package
                             (``pip install "onnxopt[diff]"``); its ``index.html`` is served with the
                             telemetry off (version ``0.0.0``), no build date (Netron refuses to run
                             180 days after its build) and a ``consent`` cookie (no cookie prompt, no
                             request to ipinfo.io: the page works offline).

The page puts two iframes (``netron/index.html?url=/<secret>/models/before/<file>`` and the same for after) side by
side. Same origin, so the page reaches into each iframe's ``window.__view__`` (Netron's ``View``): it
marks nodes by adding a class to Netron's SVG node group (``id="node-name-<name>"``) and brings a node
into view with the view's own ``select`` and ``scrollTo`` (what Netron's find sidebar does).

The mapping (what ``onnxopt.diff`` fills; every name is an ONNX ``NodeProto.name``)::

    {
      "created": [{"after": "fused_conv_3", "rule": "conv_bn", "replaced": ["conv_3", "bn_3"]}, ...],
      "removed": ["Identity_7", ...],            # BEFORE nodes with no counterpart in AFTER
      "changed": [{"before": "n", "after": "n"}, ...],   # same node, other attributes/inputs
      "pairs":   {"after_name": ["before_name", ...], ...},  # optional: every AFTER node's origin
      "summary": {                               # optional: computed from the two models when absent
        "ops_before": {"Conv": 53, ...}, "ops_after": {...},
        "rules": {"conv_bn": 53, ...},           # rules fired (counted from "created" when absent)
        "verify": [{"provider": "cpu", "kernels_before": 120, "kernels_after": 70,
                    "latency_ms_before": 4.1, "latency_ms_after": 3.2}]   # from --verify-report
      }
    }

Marks: in AFTER a created node is ``created``, or ``fused`` when it replaced two nodes or more; a changed
node ``changed``. In BEFORE a removed node is ``removed``, a node a created node replaced ``replaced``
(``fused`` when that node fused many into one), a changed node ``changed``. A created node that replaced
nothing (an inserted node) is ``created``.

The server binds 127.0.0.1 only, and answers only requests a page it served can make: a request target
in origin form (an absolute-form target such as ``GET http://evil.example/ HTTP/1.1`` is a 400), a
``Host`` header naming a loopback host with its port (``127.0.0.1``, ``localhost`` or ``[::1]``; any
other, as a DNS-rebinding page sends, is a 403) and the secret prefix (without it, a 404). A web page of
another site can neither read the models through a rebound name nor guess the address. Without ``port`` it takes the first free port from 8090 upward; with
``port`` a port in use is a one-line :class:`~onnxopt.errors.UsageError`. :func:`run` blocks until
Ctrl-C (or ``duration`` seconds) and stops the server on the way out; :func:`serve` returns a running
:class:`DiffServer` for tests and ``with`` blocks.
"""

from __future__ import annotations

import collections
import copy
import errno
import hmac
import json
import mimetypes
import os
import re
import secrets
import shutil
import threading
import time
import webbrowser
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit

from onnxopt.errors import UsageError

DEFAULT_PORT = 8090
PORT_TRIES = 50
ASSETS = Path(__file__).resolve().parents[1] / "data" / "diff"
INSTALL_HINT = 'the live view needs Netron: pip install "onnxopt[diff]" (or pip install netron)'


def netron_dir() -> Path | None:
    """The folder of the installed netron package's web app, or None when netron is absent."""
    from onnxopt.ir.io import package_dir

    folder = package_dir("netron")
    return folder if folder is not None and (folder / "index.html").is_file() and (folder / "view.js").is_file() \
        else None


def _op_counts(path: str | os.PathLike) -> dict[str, int]:
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return dict(collections.Counter(n.op_type for n in model.graph.node).most_common())


def complete_mapping(before, after, mapping: dict) -> dict:
    """The mapping with every key present and a summary (op-type counts, rules fired) filled in."""
    out = copy.deepcopy(mapping or {})
    for key in ("created", "removed", "changed"):
        out.setdefault(key, [])
    out.setdefault("pairs", {})
    summary = out.setdefault("summary", {})
    if "ops_before" not in summary:
        summary["ops_before"] = _op_counts(before)
    if "ops_after" not in summary:
        summary["ops_after"] = _op_counts(after)
    if "rules" not in summary:
        summary["rules"] = dict(collections.Counter(c.get("rule") or "?" for c in out["created"]).most_common())
    out["files"] = {"before": os.path.basename(str(before)), "after": os.path.basename(str(after))}
    return out


def _netron_index(folder: Path) -> bytes:
    text = (folder / "index.html").read_text(encoding="utf-8")
    # Telemetry off (Netron reports only when its version is not 0.0.0), and no build date:
    # Netron blocks itself with "Please update" 180 days after it.
    text = re.sub(r'<meta name="version" content="[^"]*">', '<meta name="version" content="0.0.0">', text)
    text = re.sub(r'<meta name="date" content="[^"]*">\s*', "", text)
    return text.encode("utf-8")


class _Handler(BaseHTTPRequestHandler):
    server: "_Server"

    def log_message(self, format, *args):  # noqa: A002 - quiet: the command prints its own line
        pass

    def _refused(self) -> bool:
        """Answer (and return True) a request that is not one the served page makes: an absolute-form or
        authority-form target, a Host that is not this server's loopback name and port (DNS rebinding), a
        path without the run's secret prefix. Nothing is served before these checks."""
        srv = self.server
        target = self.path
        if not target.startswith("/") or target.startswith("//"):
            self._send(b"bad request: only origin-form request targets are served", "text/plain", 400)
            return True
        host = (self.headers.get("Host") or "").strip().lower()
        if len(self.headers.get_all("Host") or []) != 1 or host not in srv.hosts:
            self._send(b"forbidden: this server answers only to a loopback host name with its port",
                       "text/plain", 403)
            return True
        raw = urlsplit(target).path
        prefix = f"/{srv.secret}"
        head, sep, _ = raw[1:].partition("/")
        if not hmac.compare_digest(head.encode("utf-8", "replace"), srv.secret.encode("ascii")):
            self._send(b"not found", "text/plain", 404)
            return True
        if not sep:  # "/<secret>": the page's relative addresses need the trailing slash
            self.send_response(301)
            self.send_header("Location", prefix + "/")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return True
        return False

    def do_GET(self):  # noqa: N802
        if self._refused():
            return
        srv = self.server
        path = unquote(urlsplit(self.path).path)[len(srv.secret) + 1:]
        if path in ("/", "/index.html"):
            page = (ASSETS / "live.html").read_text(encoding="utf-8")
            for side, files in srv.models.items():
                # Netron decodes the url parameter, then fetches it: the path is encoded, then encoded again
                # as a query value (a '#', '?' or '%' in a file name survives both)
                path = f"/{srv.secret}/models/{side}/{quote(files[0][0])}"
                page = page.replace(f"__{side.upper()}_URL__", quote(path, safe=""))
                page = page.replace(f"__{side.upper()}_FILE__", quote(files[0][0], safe=""))
            return self._send(page.encode("utf-8"), "text/html; charset=utf-8")
        if path in ("/live.js", "/live.css"):
            kind = "text/javascript" if path.endswith(".js") else "text/css"
            return self._send((ASSETS / path[1:]).read_bytes(), kind + "; charset=utf-8")
        if path == "/mapping.json":
            return self._send(json.dumps(srv.mapping).encode("utf-8"), "application/json")
        side, _, name = path[len("/models/"):].partition("/")
        if path.startswith("/models/") and side in srv.models:
            file = dict(srv.models[side]).get(name)
            if file is not None:
                return self._send_file(file)
        if path.startswith("/netron/") and srv.netron is not None:
            name = path[len("/netron/"):] or "index.html"
            if "/" in name or name.startswith("."):
                return self._send(b"not found", "text/plain", 404)
            if name == "index.html":
                return self._send(srv.netron_index, "text/html; charset=utf-8")
            file = srv.netron / name
            if file.is_file():
                kind = mimetypes.guess_type(name)[0] or "application/octet-stream"
                if name.endswith(".js"):
                    kind = "text/javascript"
                return self._send(file.read_bytes(), kind)
        return self._send(b"not found", "text/plain", 404)

    def _head(self, kind: str, length: int, status: int = 200):
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(length))
        self.send_header("Cache-Control", "no-store")
        # The secret is in every URL: never sent on to another site as a Referer.
        self.send_header("Referrer-Policy", "no-referrer")
        self.send_header("X-Content-Type-Options", "nosniff")
        # Netron asks for consent (and looks the country up on ipinfo.io) unless this cookie is set.
        self.send_header("Set-Cookie", f"consent={int(time.time() * 1000)}; Path=/; SameSite=Strict")
        self.end_headers()

    def _send(self, body: bytes, kind: str, status: int = 200):
        self._head(kind, len(body), status)
        self.wfile.write(body)

    def _send_file(self, path: Path):
        """A model or weights file, streamed (a model of several GB is not read into memory)."""
        try:
            f = open(path, "rb")
        except OSError:
            return self._send(b"not found", "text/plain", 404)
        with f:
            self._head("application/octet-stream", os.fstat(f.fileno()).st_size)
            shutil.copyfileobj(f, self.wfile, 1 << 20)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # A restart on the same port works while the last run's connections linger in TIME_WAIT; on Linux and
    # macOS this never lets two servers listen on one port (on Windows it would: there, left off).
    allow_reuse_address = os.name != "nt"


class DiffServer:
    """A running diff server; ``close()`` (or leaving a ``with`` block) stops it."""

    def __init__(self, httpd: _Server):
        self._httpd = httpd
        self.port = httpd.server_address[1]
        self.secret = httpd.secret
        self.url = f"http://127.0.0.1:{self.port}/{self.secret}/"
        self._thread = threading.Thread(target=httpd.serve_forever, name="onnxopt-diff", daemon=True)
        self._thread.start()

    def close(self):
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
            self._thread.join(5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _bind(port: int | None) -> _Server:
    if port is not None:
        if not 0 < int(port) < 65536:
            raise UsageError(f"port {port} is not a TCP port (1-65535)")
        try:
            return _Server(("127.0.0.1", int(port)), _Handler)
        except OSError as exc:
            reason = "in use" if exc.errno == errno.EADDRINUSE else exc.strerror or str(exc)
            raise UsageError(f"port {port} is not available ({reason}): pick another --port or leave it out") from None
    last = None
    for candidate in range(DEFAULT_PORT, DEFAULT_PORT + PORT_TRIES):
        try:
            return _Server(("127.0.0.1", candidate), _Handler)
        except OSError as exc:
            last = exc
    raise UsageError(f"no free port in {DEFAULT_PORT}-{DEFAULT_PORT + PORT_TRIES - 1} ({last}): give one with --port")


def _served(model) -> list[tuple[str, Path]]:
    """``(name in the URL, file)`` for a model file (first) and each external data file it names:
    names relative to the model's folder, as the model's ``location`` entries give them."""
    from onnxopt.ir.io import files_read

    model = Path(model)
    files = files_read(model)
    return [(model.name, model)] + [(f.relative_to(model.parent).as_posix(), f) for f in files[1:]]


def serve(before, after, mapping: dict, *, port: int | None = None) -> DiffServer:
    """Start the server in a background thread and return it (the caller closes it)."""
    folder = netron_dir()
    if folder is None:
        raise UsageError(INSTALL_HINT)
    for p in (before, after):
        if not Path(p).is_file():
            raise UsageError(f"{p}: no such model file")
    httpd = _bind(port)
    httpd.secret = secrets.token_urlsafe(24)
    bound = httpd.server_address[1]
    httpd.hosts = {f"127.0.0.1:{bound}", f"localhost:{bound}", f"[::1]:{bound}"}
    httpd.netron = folder
    httpd.netron_index = _netron_index(folder)
    httpd.models = {"before": _served(before), "after": _served(after)}
    httpd.mapping = complete_mapping(before, after, mapping)
    return DiffServer(httpd)


def run(before, after, mapping: dict, *, port: int | None = None, open_browser: bool = True,
        duration: float | None = None, echo=print) -> int:
    """Serve the diff until Ctrl-C (or ``duration`` seconds), opening a browser unless told not to."""
    server = serve(before, after, mapping, port=port)
    try:
        echo(f"onnxopt diff: {server.url}  (Ctrl-C stops the server)")
        if open_browser:
            webbrowser.open(server.url)
        deadline = None if duration is None else time.monotonic() + duration
        while deadline is None or time.monotonic() < deadline:
            time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
    return 0
