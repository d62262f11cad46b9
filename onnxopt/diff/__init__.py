"""What an optimizer did to a model, node by node: the mapping between BEFORE and AFTER, a summary,
and its exports (our JSON, Model Explorer's node-mapping JSON, a self-contained static page, the live
view in Netron).

The mapping comes from onnxopt's provenance where AFTER carries it (``onnxopt.rule``,
``onnxopt.replaced``, ``onnxopt.sources``, ``onnxopt.merged``: onnxopt.ir.util), else from an
alignment (``align``): node names, initializer contents (hashes), op types and neighbourhoods. It is
a plain dict, the interface the exports and the live view take::

    {"method": "provenance" | "alignment",
     "created": [{"after": name, "rule": rule or None, "replaced": [before names]}],
     "fused":   [after names: one node made from two or more BEFORE nodes],
     "removed": [before names: nodes no AFTER node stands for],
     "changed": [{"before": name, "after": name}: same node, other op, attributes or constant inputs],
     "kept":    [after names: the same node in both],
     "pairs":   {after name: [before names it stands for]}}

A node without a name is named ``#<index>`` (its position in its graph's node list, subgraphs as
``<node>/<attr>#<index>``); such keys are matched by structure only, never by name.

Model Explorer: ``model_explorer_mapping`` writes the sync-navigation JSON its split view uploads
("Upload mapping from computer"): ``{"mappingEntries": [{"leftNodeIds": [...], "rightNodeIds": [...]}],
"disableMappingFallback": true, "showDiffHighlights": true}``, the ``SyncNavigationData`` interface of
google-ai-edge/model-explorer src/ui/src/components/visualizer/common/sync_navigation.ts (as in
ai-edge-model-explorer 0.1.34); node ids are ONNX node names, as model-explorer-onnx 0.4.2's adapter
makes them (``id=onnx_node.name``, after onnx-ir's NameFixPass names the unnamed ones:
``model_explorer_ids``).

Where things live (each imports only those before it, and the package re-exports their public
names, so ``onnxopt.diff.X`` is the same as in 0.1):

- ``node_map``: the models as the map sees them (``Graph``, ``load``), the map from provenance
  (``from_provenance``) or alignment (``align``), ``mapping``, ``strip_provenance``, ``agreement``.
- ``page``: the static page (``html_page``); reads the map and the summary as dicts, imports nothing of
  onnxopt.
- ``export``: the summary (``summary``, ``rule_firings``, ``verify_summary``), Model Explorer's mapping,
  the live view's (``live_mapping``), and ``run`` (the map, the summary and each file asked for).
- ``live``: the live view's local server with both models in Netron (``python -m onnxopt diff``); it
  takes a mapping dict and imports no other module of this package.

May import: onnx, numpy, ``onnxopt.ir``, ``onnxopt.readers``, ``onnxopt.errors``, and ``onnxopt.verify``
(the latency verdict's text); no onnxruntime of its own, never the API nor the command line.
"""

from onnxopt.diff.node_map import (Graph, agreement, align, from_provenance, has_provenance, load, mapping,
                                   strip_provenance)
from onnxopt.diff.page import html_page
from onnxopt.diff.export import (ME_SCHEMA, live_mapping, model_explorer_ids, model_explorer_mapping, rule_firings,
                                 run, summary, validate_model_explorer_mapping, verify_summary)

__all__ = [
    "ME_SCHEMA", "Graph", "agreement", "align", "from_provenance", "has_provenance", "html_page", "live_mapping",
    "load", "mapping", "model_explorer_ids", "model_explorer_mapping", "rule_firings", "run", "strip_provenance",
    "summary", "validate_model_explorer_mapping", "verify_summary",
]
