"""What a diff writes besides the page: the summary (op-type counts, rules fired, the verification a
report holds), our JSON, Model Explorer's sync-navigation mapping (``model_explorer_mapping``, checked by
``validate_model_explorer_mapping`` against ``ME_SCHEMA``), the mapping as the live view reads it
(``live_mapping``), and ``run``: the map, the summary and each file asked for.

May import: ``onnxopt.diff.node_map``, ``onnxopt.diff.page``, ``onnxopt.ir``, ``onnxopt.readers``,
``onnxopt.errors``, and ``onnxopt.verify`` for the latency verdict's text; not the live server.
"""

from __future__ import annotations

import collections
import json
import os
from pathlib import Path

from onnxopt.diff.node_map import Graph, align, from_provenance, has_provenance, load
from onnxopt.diff.page import html_page
from onnxopt.errors import UsageError

ME_SCHEMA = ("google-ai-edge/model-explorer src/ui/src/components/visualizer/common/sync_navigation.ts "
             "(SyncNavigationData: mappingEntries), ai-edge-model-explorer 0.1.34, model-explorer-onnx 0.4.2")


def rule_firings(before: Graph, after: Graph, m: dict) -> collections.Counter:
    """How many times each rule fired in the optimization that made AFTER of BEFORE, as its
    provenance records it: a count of rewrites, not of nodes.

    A rewrite's nodes share its rule and ``replaced`` list (bn_to_mul_add's Mul and Add are one
    rewrite). A node a rewrite made and a later rewrite replaced is no longer in AFTER, but its name
    is in that later node's ``replaced``: "<original root>::<rule>", with "_<k>" for a rewrite's
    further nodes (``onnxopt.core.pattern.Builder``), so conv_mul_fold's Conv that conv_add_fold took
    still counts. (Counted once per rule and original root; a rewrite whose every trace a third one
    removed, or one that made no node, such as a fold into an initializer, is not seen.)"""
    seen: dict[tuple, str] = {}
    created = [c for c in m["created"] if c.get("rule")]
    names_after = {n.key for n in after.nodes}
    known = {c["rule"] for c in created}  # (no built-in rule's name ends in "_<digits>")
    for c in created:
        seen.setdefault(("made", c["rule"], tuple(c["replaced"])), c["rule"])
    for c in created:
        for name in c["replaced"]:
            if name in before.by_key or name in names_after or "::" not in name:
                continue  # an original node, or one still there
            root, tail = name.rsplit("::", 1)
            rule = tail
            if tail not in known:
                head, _, k = tail.rpartition("_")
                rule = head if head and k.isdigit() else tail
            seen.setdefault(("gone", root, rule), rule)
    return collections.Counter(seen.values())


def summary(before, after, m: dict, verify_report: dict | None = None) -> dict:
    b, a = (x if isinstance(x, Graph) else Graph(load(x)) for x in (before, after))
    rules = rule_firings(b, a, m)
    cb, ca = b.op_counts(), a.op_counts()
    out = {"nodes_before": len(b.nodes), "nodes_after": len(a.nodes),
           "op_types": {op: [cb.get(op, 0), ca.get(op, 0)] for op in sorted(set(cb) | set(ca))},
           "rules": dict(rules.most_common()), "method": m["method"],
           "counts": {k: len(m[k]) for k in ("created", "fused", "removed", "changed", "kept")}}
    if verify_report:
        out["verification"] = verify_summary(verify_report)
    return out


def verify_summary(report: dict) -> dict:
    """By provider, what a verify report (``onnxopt verify --json``, or an optimize report holding one) says:
    outputs ok, kernels and median latency before and after, the ratio and its verdict; a report that is
    not one is a one-line UsageError naming ``--verify-report``."""
    def obj(x, where: str) -> dict:
        if x is None:
            return {}
        if not isinstance(x, dict):
            raise UsageError(f"--verify-report: {where} is not an object, as a verify report's is")
        return x

    def number(x):
        return x if isinstance(x, (int, float)) and not isinstance(x, bool) else None

    if "verification" in report and report["verification"] is None:
        raise UsageError("--verify-report: the report holds no verification (its run had no --verify)")
    report = obj(report.get("verification", report), "verification")  # (an optimize --json report holds one)
    if "providers" not in report:
        raise UsageError("--verify-report: not a verify report (no providers): give the --json of onnxopt verify "
                         "or of onnxopt MODEL --verify ...")
    found = {}
    for p, entry in obj(report.get("providers"), "providers").items():
        entry = obj(entry, f"providers.{p}")
        row = {"ok": entry.get("ok") if isinstance(entry.get("ok"), bool) else None}
        kernels, latency = obj(entry.get("kernels"), f"providers.{p}.kernels"), obj(entry.get("latency"), f"providers.{p}.latency")
        for label in ("before", "after"):
            k = obj(kernels.get(label), f"providers.{p}.kernels.{label}")
            total = number(k.get("kernels", k.get("total")))
            if total is None:
                nums = [v for key, v in k.items() if number(v) is not None and key != "session_init_s"]
                total = nums[0] if nums else None
            row[f"kernels_{label}"] = total
            row[f"median_ms_{label}"] = number(obj(latency.get(label), f"providers.{p}.latency.{label}").get("median_ms"))
        row["latency_ratio"] = number(latency.get("ratio_median"))
        if isinstance(latency.get("verdict"), str):  # (with its interval: onnxopt.verify.latency_text)
            from onnxopt.verify import latency_text

            try:
                row["latency_verdict"] = latency_text(latency)
            except (TypeError, ValueError, IndexError):
                raise UsageError(f"--verify-report: providers.{p}.latency: a malformed interval") from None
        found[str(p)] = row
    return found


def model_explorer_ids(graph: Graph) -> dict[str, str]:
    """The node ids model-explorer-onnx gives the main graph's nodes, by this module's keys: their
    names, and for nodes without one (or with a name met twice) the names onnx-ir's NameFixPass gives
    them, which the adapter runs before anything else (so that pass, run on a copy here, agrees).
    Subgraph nodes are left out (Model Explorer shows those graphs apart)."""
    ids = {n.key: n.key for n in graph.main if n.named}
    if len(ids) < len(graph.main):
        try:
            import onnx_ir as ir
            from onnx_ir.passes.common import NameFixPass
        except ImportError:  # (an onnx-ir without the pass: those nodes are left out of the mapping)
            return ids
        copy = ir.serde.deserialize_model(graph.model)
        NameFixPass()(copy)
        ids.update({n.key: fixed.name for n, fixed in zip(graph.main, copy.graph) if not n.named})
    return ids


def model_explorer_mapping(m: dict, ids: tuple[dict, dict] | None = None) -> dict:
    """Model Explorer's sync-navigation mapping (see the module docstring): one entry per group of
    AFTER nodes standing for the same BEFORE nodes; node ids as ``ids`` (BEFORE's, AFTER's:
    :func:`model_explorer_ids`) give them; nodes without an id are left out. Without ``ids``: keys as ids,
    position keys (``#``) left out."""
    def me(key: str, side: dict | None) -> str | None:
        return side.get(key) if side is not None else (None if "#" in key else key)

    ids = ids or (None, None)

    groups: dict[tuple, list[str]] = {}
    for a, bs in m["pairs"].items():
        right = me(a, ids[1])
        left = tuple(sorted(x for x in (me(b, ids[0]) for b in bs) if x))
        if right and left:
            groups.setdefault(left, []).append(right)
    entries = [{"leftNodeIds": list(bs), "rightNodeIds": sorted(as_)} for bs, as_ in sorted(groups.items())]
    return {"mappingEntries": entries, "disableMappingFallback": True, "showDiffHighlights": True}


def validate_model_explorer_mapping(data: dict) -> list[str]:
    """Problems with ``data`` as a SyncNavigationData mapping (sync_navigation.ts); [] when none."""
    problems = []
    allowed = {"mapping", "mappingEntries", "disableMappingFallback", "relatedNodesBorderColor",
               "relatedNodesBorderWidth", "showDiffHighlights", "deletedNodesBorderColor", "deletedNodesBorderWidth",
               "newNodesBorderColor", "newNodesBorderWidth"}
    if not isinstance(data, dict):
        return ["not an object"]
    problems += [f"unknown field {k}" for k in data if k not in allowed]
    if "mapping" in data and not (isinstance(data["mapping"], dict) and
                                  all(isinstance(k, str) and isinstance(v, str) for k, v in data["mapping"].items())):
        problems.append("mapping: not Record<string, string>")
    seen_l, seen_r = set(), set()
    for i, e in enumerate(data.get("mappingEntries", [])):
        if not isinstance(e, dict) or set(e) != {"leftNodeIds", "rightNodeIds"}:
            problems.append(f"mappingEntries[{i}]: not {{leftNodeIds, rightNodeIds}}")
            continue
        for side, seen in (("leftNodeIds", seen_l), ("rightNodeIds", seen_r)):
            ids = e[side]
            if not isinstance(ids, list) or not all(isinstance(x, str) for x in ids):
                problems.append(f"mappingEntries[{i}].{side}: not string[]")
                continue
            if seen & set(ids):  # "a node id ... will only appear in one SyncNavigationMappingEntry"
                problems.append(f"mappingEntries[{i}].{side}: ids in another entry: {sorted(seen & set(ids))[:3]}")
            seen |= set(ids)
    for k in ("disableMappingFallback", "showDiffHighlights"):
        if k in data and not isinstance(data[k], bool):
            problems.append(f"{k}: not boolean")
    for k in ("relatedNodesBorderWidth", "deletedNodesBorderWidth", "newNodesBorderWidth"):
        if k in data and not isinstance(data[k], (int, float)):
            problems.append(f"{k}: not number")
    return problems


def live_mapping(m: dict, summ: dict) -> dict:
    """The mapping with the summary as onnxopt.diff.live's page reads it (its module docstring)."""
    out = dict(m)
    # the page marks BEFORE nodes by the names in "replaced": those it stands for in BEFORE (what a rule
    # recorded may name nodes earlier rewrites made, which BEFORE does not hold), the record beside them
    out["created"] = [{**c, "replaced": m["pairs"].get(c["after"], []), "recorded": c["replaced"]}
                      for c in m["created"]]
    ops = summ["op_types"]
    live = {"ops_before": {k: v[0] for k, v in ops.items() if v[0]},
            "ops_after": {k: v[1] for k, v in ops.items() if v[1]}, "rules": summ["rules"]}
    verification = summ.get("verification") or {}
    if verification:
        live["verify"] = [{"provider": p, "kernels_before": r.get("kernels_before"),
                           "kernels_after": r.get("kernels_after"), "latency_ms_before": r.get("median_ms_before"),
                           "latency_ms_after": r.get("median_ms_after"),
                           "latency_verdict": r.get("latency_verdict")} for p, r in verification.items()]
    out["summary"] = live
    return out


def run(before, after, *, html_out: str | None = None, json_out: str | None = None,
        me_out: str | None = None, verify_report: str | dict | None = None,
        names: tuple[str, str] | None = None) -> tuple[dict, dict]:
    """Compute the mapping and summary; write what is asked. Returns (mapping, summary).
    ``before``/``after``: paths or ModelProtos (``names``: what the page calls them)."""
    if names is None:
        names = tuple(os.fspath(x) if isinstance(x, (str, os.PathLike)) else label
                      for x, label in ((before, "BEFORE"), (after, "AFTER")))
    b, a = Graph(load(before)), Graph(load(after))
    m = from_provenance(b, a) if has_provenance(a) else align(b, a)
    report = verify_report
    if isinstance(report, (str, os.PathLike)):
        from onnxopt.readers import load_json

        try:  # (bounded in size and nesting: a 100,000-deep array was a RecursionError, exit 3)
            report = load_json(report, "verify report")
        except UsageError as exc:
            raise UsageError(f"--verify-report {exc}") from None
        if not isinstance(report, dict):
            raise UsageError(f"--verify-report {os.fspath(verify_report)}: not a verify report (an object)")
    summ = summary(b, a, m, report)
    if json_out:
        Path(json_out).write_text(json.dumps({"before": names[0], "after": names[1], "summary": summ,
                                              "mapping": m}, indent=1) + "\n")
    if me_out:
        me_ids = (model_explorer_ids(b), model_explorer_ids(a))
        Path(me_out).write_text(json.dumps(model_explorer_mapping(m, me_ids), indent=1) + "\n")
    if html_out:
        on_disk = tuple(isinstance(x, (str, os.PathLike)) for x in (before, after))
        Path(html_out).write_text(html_page(names[0], names[1], m, summ, on_disk))
    return m, summ
