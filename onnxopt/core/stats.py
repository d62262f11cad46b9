"""What an optimization run records: each rule's (and graph pass's) statistics, and the run's
result (rewrites, cycles, rule bugs met, the log for bisecting)."""

from __future__ import annotations

import collections
import dataclasses

from onnxopt.errors import RuleBug


@dataclasses.dataclass
class RuleStats:
    """One rule's (or graph pass's) record: nodes it was tried at, where its pattern matched, where
    its condition or replacement refused (with the reasons, pattern mismatches' among them), where
    it fired, where it raised (a bug: ``errors``), and the time it took."""

    tried: int = 0
    matched: int = 0
    refused: int = 0
    fired: int = 0
    errors: int = 0
    seconds: float = 0.0
    reasons: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def as_dict(self, top: int = 5) -> dict:
        return {
            "tried": self.tried,
            "matched": self.matched,
            "refused": self.refused,
            "fired": self.fired,
            "errors": self.errors,
            "seconds": round(self.seconds, 6),
            "top_refusals": dict(self.reasons.most_common(top)),
        }


@dataclasses.dataclass
class DriverResult:
    """One run: rewrites made (graph passes' changes among them), the driver's work, per-rule
    statistics, cycles stopped, rule bugs met, and with ``keep_log`` the rewrites in order."""

    rewrites: int = 0
    visited: int = 0
    pushes: int = 0  # nodes put on the worklist (counting those already on it): the driver's work
    removed_dead: int = 0
    rules: dict[str, RuleStats] = dataclasses.field(default_factory=dict)
    cycles: list[dict] = dataclasses.field(default_factory=list)
    errors: list[RuleBug] = dataclasses.field(default_factory=list)  # rule bugs met (without strict)
    hit_limit: bool = False
    log: list[dict] = dataclasses.field(default_factory=list)
    # what the passes' requirements recorded of the input before the first pass (onnxopt.core.passes.Requirement),
    # by requirement name: "memory_before", the input's peak activation memory, where memory_recomputation runs
    records: dict = dataclasses.field(default_factory=dict)

    @property
    def memory_before(self) -> dict | None:
        """The input's peak activation memory (``onnxopt.transforms.memory.report_peak``) where it was recorded."""
        return self.records.get("memory_before")
