"""Logging of the server processes: one handler on stderr, text or JSON lines, quiet HTTP libraries.

A line about one request carries its transfer id both in the text and, for the JSON format, as a field:
log it with ``extra=transfer_extra(tid)``.
"""

from __future__ import annotations

import enum
import json
import logging
import math
import sys
import time
from collections.abc import Callable
from typing import Any


class LogFormat(enum.Enum):
    TEXT = "text"
    JSON = "json"


LOG_LEVELS = ("debug", "info", "warning", "error")

# Loggers that print a line per connection or per request at debug/info: an operator asks for them.
_HTTP_LOGGERS = ("httpx", "httpcore", "aiohttp", "uvicorn.access", "uvicorn.error", "hpack")
_TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def transfer_extra(transfer_id: str | None) -> dict[str, Any]:
    return {"transfer_id": transfer_id}


class JsonFormatter(logging.Formatter):
    """One JSON object a line: ts (UTC, ISO 8601), level, logger, msg, transfer_id when known, exc."""

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        out: dict[str, Any] = {
            "ts": f"{ts}.{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        tid = getattr(record, "transfer_id", None)
        if tid is not None:
            out["transfer_id"] = tid
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, separators=(",", ":"))


def configure(level: str, fmt: LogFormat, http: bool = False) -> None:
    """The root logger at ``level`` on stderr; the HTTP libraries at warning unless ``http``."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt is LogFormat.JSON else logging.Formatter(_TEXT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in _HTTP_LOGGERS:
        logger = logging.getLogger(name)
        logger.setLevel(level.upper() if http else logging.WARNING)
        # uvicorn installs its own handlers; one handler (ours, on the root) keeps one format.
        logger.handlers.clear()
        logger.propagate = True


class Throttle:
    """At most one log line per ``interval_s`` for a message a peer can repeat at will (a dropped
    notification, a refused connection): the first occurrence is logged at once, later ones are counted
    and their number rides on the next line allowed. The counters in /metrics keep every occurrence."""

    def __init__(self, interval_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._next = -math.inf
        self.suppressed = 0

    def log(self, logger: logging.Logger, level: int, fmt: str, *args: object) -> bool:
        """Log unless a line went out less than ``interval_s`` ago; True when it was logged."""
        now = self._clock()
        if now < self._next:
            self.suppressed += 1
            return False
        self._next = now + self.interval_s
        if self.suppressed:
            fmt += " (and %d more like it not logged)"
            args = (*args, self.suppressed)
            self.suppressed = 0
        logger.log(level, fmt, *args)
        return True
