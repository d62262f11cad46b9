"""Side by side with onnxsim, onnxslim and Polygraphy: what their users expect, run on the same models.

Each expectation is a run, not a claim: every tool is called through its own command line (or its
Python API where the expectation is about the API) on zoo models, and what came back is checked:

- shape overrides: the full override (batch and sequence fixed), a partial one (batch fixed, the
  sequence left dynamic, in each tool's grammar), and four bad overrides (an unknown input, a wrong
  rank, a changed static dim, one symbol given two values): the exit code and how many lines the
  error took; a good result's input/output dims, node count and whether onnxruntime's outputs agree
  with the original's at the fixed shape (``python -m onnxopt verify``, default tolerances);
- exactness: whether the tool's default output is bit-identical to the original on onnxruntime CPU
  (1 and 2 threads; onnxopt also with ``--exact``);
- metadata: on the GPT-2 dynamo export, the share of nodes keeping ``pkg.torch.onnx.stack_trace``,
  producer_name, metadata entries added;
- graphsurgeon: whether the Python face takes a ``gs.Graph``;
- colour: escape codes in the output when piped, and colour on a terminal with NO_COLOR=1;
- models over 2 GB (``--big MODEL.onnx``, e.g. from scripts/oracles/big_model.py): exit code, seconds and
  peak resident memory of each tool on it.

    python -m scripts.bench.peer_features [--out scripts/results/peer-features.json] [--big big/model.onnx]

Prints a markdown table per expectation; the JSON holds every run's facts.
"""

from __future__ import annotations

import argparse
import json
import os
import pty
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scripts import RESULTS, ROOT

BIN = Path(sys.executable).parent
ANSI = re.compile(rb"\x1b\[")
SGR = re.compile(rb"\x1b\[([0-9;]*)m")
TOOLS = ("onnxopt", "onnxsim", "onnxslim", "polygraphy")
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "onnxopt" / "models"


def zoo(name: str) -> str:
    path = CACHE / f"{name}.onnx"
    if not path.exists():
        subprocess.run([sys.executable, "-m", "onnxopt.models", "build", name], check=True, cwd=ROOT)
    return str(path)


def command(tool: str, src: str, dst: str, shapes: dict | None = None, exact: bool = False) -> list[str]:
    """The tool's command line for optimizing ``src`` into ``dst``, with the shape override in its
    own grammar (dims are ints, or str symbols: onnxsim and onnxslim take -1 for a dim left dynamic)."""
    shapes = shapes or {}
    if tool == "onnxopt":
        return [sys.executable, "-m", "onnxopt", src, "-o", dst, *(["--exact"] if exact else []),
                *[w for n, d in shapes.items() for w in ("--input-shape", f"{n}={','.join(map(str, d))}")]]
    free = lambda d: ",".join(str(x) if isinstance(x, int) else "-1" for x in d)  # noqa: E731
    if tool == "onnxsim":
        return [str(BIN / "onnxsim"), src, dst,
                *(["--overwrite-input-shape", *[f"{n}:{free(d)}" for n, d in shapes.items()]] if shapes else [])]
    if tool == "onnxslim":
        return [str(BIN / "onnxslim"), src, dst,
                *(["--input-shapes", *[f"{n}:{free(d)}" for n, d in shapes.items()]] if shapes else [])]
    if tool == "polygraphy":
        return [str(BIN / "polygraphy"), "surgeon", "sanitize", src, "-o", dst, "--fold-constants",
                *(["--override-input-shapes", *[f"{n}:[{','.join(map(str, d))}]" for n, d in shapes.items()]]
                  if shapes else [])]
    raise KeyError(tool)


def run(cmd: list[str], timeout: float = 1800, env: dict | None = None) -> dict:
    """Exit code, seconds, peak resident memory (the process's own, from wait4) and stderr's lines."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env={**os.environ, **(env or {})})
        deadline = t0 + timeout
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                proc.kill()
                pid, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.05)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    lines = [l for l in stderr.decode(errors="replace").splitlines() if l.strip()]
    return {"rc": proc.returncode, "seconds": round(time.perf_counter() - t0, 2),
            "peak_rss_mib": round(usage.ru_maxrss / 1024), "stderr_lines": len(lines),
            "last_line": lines[-1][:200] if lines else "", "ansi": bool(ANSI.search(stdout + stderr))}


def dims(path: str) -> dict:
    import onnx

    m = onnx.load(path, load_external_data=False)
    show = lambda vs: {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]  # noqa: E731
                       for v in vs}
    return {"inputs": show(m.graph.input), "outputs": show(m.graph.output), "nodes": len(m.graph.node),
            "value_info": len(m.graph.value_info)}


def agree(src: str, dst: str, shapes: dict, exact: bool = False, threads: int = 1) -> dict:
    """``onnxopt verify`` of the tool's output against the original at the given (static) shapes."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp, "r.json")
        cmd = [sys.executable, "-m", "onnxopt", "verify", src, dst, "--runs", "0", "--json", str(report),
               "--threads", str(threads), "-q",
               *[w for n, d in shapes.items() for w in ("--input-shape", f"{n}={'x'.join(map(str, d))}")],
               *(["--rtol", "0", "--atol", "0"] if exact else [])]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if not report.exists():
            return {"ok": None, "error": (r.stderr.strip().splitlines() or ["?"])[-1][:200]}
        rep = json.loads(report.read_text())
    return {"ok": rep["ok"]}


# ------------------------------------------------------------------------------------------------


TEXT = ("input_ids", "attention_mask", "token_type_ids")


def shape_overrides(tmp: Path) -> dict:
    bert, det = zoo("bert-legacy"), zoo("ppocrv4-det")
    full = {n: [1, 128] for n in TEXT}
    cases = {
        "full (bert-legacy, batch 1, sequence 128)": (bert, full),
        "partial (bert-legacy, batch 1, sequence left dynamic)": (bert, {n: [1, "sequence"] for n in TEXT}),
        "error: unknown input": (bert, {"nosuch": [1, 128]}),
        "error: wrong rank": (bert, {**full, "input_ids": [1, 128, 1]}),
        "error: changed static dim (ppocrv4-det x: 3 channels given as 4)": (det, {"x": [1, 4, 640, 640]}),
        "error: one symbol two values (batch 1 and 2)": (bert, {**full, "attention_mask": [2, 128]}),
    }
    results = {}
    for case, (src, shapes) in cases.items():
        for tool in TOOLS:
            dst = str(tmp / f"{tool}-override.onnx")
            Path(dst).unlink(missing_ok=True)
            r = run(command(tool, src, dst, shapes))
            if r["rc"] == 0 and Path(dst).exists():
                r.update(dims(dst))
                if case.startswith("full"):
                    r["outputs_agree"] = agree(src, dst, shapes)["ok"]
            results[f"{case}: {tool}"] = r
            print(f"{case}: {tool}: rc {r['rc']}, {r['stderr_lines']} stderr lines", file=sys.stderr)
    return results


def exactness(tmp: Path, models=("ppocrv4-det", "mobilenet_v2-dynamo", "bert-legacy")) -> dict:
    results = {}
    for name in models:
        src = zoo(name)
        shapes = {n: [1, 128] for n in TEXT} if "bert" in name else (
            {"x": [1, 3, 640, 640]} if name == "ppocrv4-det" else {})
        variants = [(t, False) for t in TOOLS] + [("onnxopt", True)]
        for tool, exact in variants:
            dst = str(tmp / f"{tool}-{name}.onnx")
            r = run(command(tool, src, dst, exact=exact))
            key = f"{name}: {tool}{' --exact' if exact else ''}"
            if r["rc"] == 0:
                r["bit_identical"] = all(agree(src, dst, shapes, exact=True, threads=t)["ok"] for t in (1, 2))
                r["within_tolerance"] = agree(src, dst, shapes)["ok"]
            results[key] = r
            print(f"{key}: {r.get('bit_identical')}", file=sys.stderr)
    return results


def metadata(tmp: Path) -> dict:
    import onnx

    src = zoo("gpt2-dynamo")
    key = "pkg.torch.onnx.stack_trace"

    def facts(path):
        m = onnx.load(path, load_external_data=False)
        kept = sum(any(p.key == key for p in n.metadata_props) for n in m.graph.node)
        return {"nodes": len(m.graph.node), "with_stack_trace": kept, "producer_name": m.producer_name,
                "model_metadata": sorted({p.key for p in m.metadata_props})}

    results = {"original": facts(src)}
    for tool in TOOLS:
        dst = str(tmp / f"{tool}-meta.onnx")
        r = run(command(tool, src, dst))
        if r["rc"] == 0:
            r.update(facts(dst))
            # run it again on its own output: does a second run add duplicate model metadata?
            again = str(tmp / f"{tool}-meta2.onnx")
            if run(command(tool, dst, again))["rc"] == 0:
                keys = [p.key for p in onnx.load(again, load_external_data=False).metadata_props]
                r["second_run_duplicates"] = len(keys) - len(set(keys))
        results[tool] = r
    return results


def graphsurgeon() -> dict:
    import onnx
    import onnx_graphsurgeon as gs

    src = zoo("mobilenet_v2-dynamo")

    def call(tool, graph):
        if tool == "onnxopt":
            from onnxopt import optimize
            return optimize(graph)
        if tool == "onnxsim":
            import onnxsim
            return onnxsim.simplify(graph)[0]
        if tool == "onnxslim":
            import onnxslim
            return onnxslim.slim(graph)
        from polygraphy.backend.onnx import fold_constants
        return fold_constants(graph)

    results = {}
    for tool in TOOLS:
        graph = gs.import_onnx(onnx.load(src))
        try:
            out = call(tool, graph)
            results[tool] = {"accepted": True, "returns": type(out).__module__ + "." + type(out).__name__}
        except Exception as exc:  # noqa: BLE001 - what the tool says is the fact recorded
            results[tool] = {"accepted": False, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:150]}"}
    return results


def colour(tmp: Path) -> dict:
    """Escape codes in a pipe, and colour on a terminal with NO_COLOR=1."""
    src = zoo("mobilenet_v2-dynamo")
    results = {}
    for tool in TOOLS:
        dst = str(tmp / f"{tool}-colour.onnx")
        cmd = command(tool, src, dst)
        piped = run(cmd)
        results[tool] = {"escapes_in_pipe": piped["ansi"], "colour_on_terminal_with_NO_COLOR": _pty_colour(cmd)}
    return results


def _pty_colour(cmd: list[str]) -> bool:
    """Whether the output on a terminal holds a colour (an SGR code 30-49 or 90-107; bold and the like
    are not colour, which is all NO_COLOR asks to leave out)."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: a terminal for stdout and stderr
        os.environ["NO_COLOR"] = "1"
        os.environ["TERM"] = "xterm-256color"
        os.execv(cmd[0], cmd)
    data = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            break
        if not chunk:
            break
        data += chunk
    os.waitpid(pid, 0)
    codes = [int(c) for m in SGR.finditer(data) for c in m.group(1).split(b";") if c]
    return any(30 <= c <= 49 or 90 <= c <= 107 for c in codes)


def big(tmp: Path, path: str) -> dict:
    results = {}
    for tool in TOOLS:
        dst = str(tmp / f"{tool}-big.onnx")
        r = run(command(tool, path, dst), timeout=900)
        results[tool] = r
        for f in tmp.glob(f"{tool}-big*"):
            f.unlink()
        print(f"big | {tool}: rc {r['rc']}, {r['seconds']} s, {r['peak_rss_mib']} MiB", file=sys.stderr)
    return results


def table(title: str, rows: dict, cols: list[str]) -> str:
    out = [f"### {title}", "", "| | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for key, facts in rows.items():
        out.append(f"| {key} | " + " | ".join(str(facts.get(c, "")) for c in cols) + " |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.peer_features", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(RESULTS / "peer-features.json"))
    parser.add_argument("--big", help="a model over 2 GB (python -m scripts.oracles.big_model makes one)")
    parser.add_argument("--only", nargs="*", help="shapes exact metadata gs colour big")
    args = parser.parse_args(argv)
    import onnxruntime

    want = set(args.only or ["shapes", "exact", "metadata", "gs", "colour", "big"])
    out = Path(args.out)
    facts: dict = json.loads(out.read_text()) if args.only and out.exists() else {}  # --only: update the rest
    facts["onnxruntime"] = onnxruntime.__version__
    from importlib.metadata import version
    facts["versions"] = {t: version(t) for t in ("onnxsim", "onnxslim", "polygraphy")}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if "shapes" in want:
            facts["shape_overrides"] = shape_overrides(tmp)
            print(table("Shape overrides", facts["shape_overrides"],
                        ["rc", "stderr_lines", "last_line", "inputs", "outputs", "nodes", "outputs_agree"]))
        if "exact" in want:
            facts["exactness"] = exactness(tmp)
            print(table("Outputs bit-identical to the original (onnxruntime CPU, 1 and 2 threads)",
                        facts["exactness"], ["rc", "bit_identical", "within_tolerance", "nodes"]))
        if "metadata" in want:
            facts["metadata"] = metadata(tmp)
            print(table("Metadata (gpt2-dynamo)", facts["metadata"],
                        ["nodes", "with_stack_trace", "producer_name", "model_metadata", "second_run_duplicates"]))
        if "gs" in want:
            facts["graphsurgeon"] = graphsurgeon()
            print(table("A gs.Graph given to the Python face", facts["graphsurgeon"], ["accepted", "returns", "error"]))
        if "colour" in want:
            facts["colour"] = colour(tmp)
            print(table("Colour", facts["colour"], ["escapes_in_pipe", "colour_on_terminal_with_NO_COLOR"]))
        if "big" in want and args.big:
            facts["big"] = big(tmp, args.big)
            print(table(f"Model over 2 GB ({args.big})", facts["big"], ["rc", "seconds", "peak_rss_mib", "last_line"]))
    out.write_text(json.dumps(facts, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
