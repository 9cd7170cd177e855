"""`--log.level` and `--log.format`, as the Prometheus exporter-toolkit spells them: logfmt (the default) or JSON.

One line per record on stderr, with the time (RFC 3339, UTC, milliseconds), the level, the logger and the message,
so the exporter's logs read like node_exporter's beside it and parse with the same tools.
"""

from __future__ import annotations

import json
import logging
import sys
import time

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warn": logging.WARNING, "error": logging.ERROR}
FORMATS = ("logfmt", "json")
_LEVEL_NAMES = {logging.DEBUG: "debug", logging.INFO: "info", logging.WARNING: "warn", logging.ERROR: "error"}


def _timestamp(record: logging.LogRecord) -> str:
    seconds = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
    return f"{seconds}.{int(record.msecs):03d}Z"


def _fields(record: logging.LogRecord) -> dict[str, str]:
    fields = {
        "ts": _timestamp(record),
        "level": _LEVEL_NAMES.get(record.levelno, record.levelname.lower()),
        "logger": record.name,
        "msg": record.getMessage(),
    }
    if record.exc_info:
        fields["err"] = logging.Formatter().formatException(record.exc_info)
    return fields


class LogfmtFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return " ".join(f"{key}={_logfmt_value(value)}" for key, value in _fields(record).items())


def _logfmt_value(value: str) -> str:
    if value and not any(c in value for c in ' ="\\') and value.isprintable():
        return value
    return json.dumps(value, ensure_ascii=False)  # quoted, with \n, \" and \\ escaped as logfmt readers expect


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(_fields(record), ensure_ascii=False)


def setup_logging(level: str, log_format: str) -> None:
    """Configure the process's logging, unless something already has (as logging.basicConfig, e.g. under pytest)."""
    root = logging.getLogger()
    if root.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else LogfmtFormatter())
    root.addHandler(handler)
    root.setLevel(LEVELS[level])
