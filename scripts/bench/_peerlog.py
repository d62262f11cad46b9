"""What a peer logs while it runs (``PeerLog``), for scripts/bench/_peers.py and for optimum's process
(scripts/bench/_optimum.py, which runs in another environment). Standard library only."""

from __future__ import annotations


class PeerLog:
    """Context manager: every Python log record at WARNING and above (whichever logger, whatever level
    a peer set on its own loggers, propagating or not) and every ``warnings.warn`` while a peer runs,
    as lines ``"LEVEL logger: message"``."""

    def __init__(self, level: int | None = None):
        import logging

        self.level = logging.WARNING if level is None else level
        self.lines: list[str] = []

    def _add(self, record) -> None:
        try:
            msg = record.getMessage()
        except Exception:  # noqa: BLE001 - a badly formatted record is still a line
            msg = str(record.msg)
        self.lines.append(f"{record.levelname} {record.name}: {msg}")

    def __enter__(self):
        import logging
        import warnings

        level, add = self.level, self._add
        self._is_enabled, self._call_handlers = logging.Logger.isEnabledFor, logging.Logger.callHandlers

        def is_enabled(logger, lvl, _orig=self._is_enabled):
            # a peer may raise its loggers to ERROR (as this file's adapters once did): its warnings
            # are still made, and seen here
            return lvl >= level or _orig(logger, lvl)

        def call_handlers(logger, record, _orig=self._call_handlers):
            if record.levelno >= level:
                add(record)
                if record.levelno < logger.getEffectiveLevel():
                    return None  # below the peer's own level: seen here, shown nowhere else
            return _orig(logger, record)

        logging.Logger.isEnabledFor = is_enabled
        logging.Logger.callHandlers = call_handlers
        self._warn = warnings.catch_warnings(record=True)
        self._records = self._warn.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(self, *exc):
        import logging

        logging.Logger.isEnabledFor = self._is_enabled
        logging.Logger.callHandlers = self._call_handlers
        self._warn.__exit__(*exc)
        for w in self._records:
            self.lines.append(f"{w.category.__name__}: {w.message}")
        return False
