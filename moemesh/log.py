"""Structured, quiet-by-default logging: one line per event on stderr, `key=value` pairs by default or
a JSON object (`--log-format json`, for a log shipper), the libraries' records (aiohttp, asyncio,
Python warnings) in the same format, at warning and above. (Ray's logger keeps a handler and format
of its own.)"""

from __future__ import annotations

import json
import logging
import sys
import time

FORMATS = ("text", "json")


def _timestamp(record: logging.LogRecord) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"


class KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = f"ts={_timestamp(record)} level={record.levelname.lower()} logger={record.name} " \
               f"msg={record.getMessage()!r}"
        for key, value in getattr(record, "fields", {}).items():
            line += f" {key}={value!r}" if isinstance(value, str) else f" {key}={value}"
        if record.exc_info and record.exc_info[1] is not None:  # (on the same line: one line an event)
            exc = record.exc_info[1]
            line += f" exception={f'{type(exc).__name__}: {exc}'!r} traceback={self.formatException(record.exc_info)!r}"
        return line


class JsonFormatter(logging.Formatter):
    """The same event as one JSON object a line: ts, level, logger, msg, the event's fields (a field
    never replaces those four), and exception and traceback where there is one. A value strict JSON
    cannot hold (an object, NaN, a mapping with keys other than strings) is written as its str()."""

    def format(self, record: logging.LogRecord) -> str:
        event = {"ts": _timestamp(record), "level": record.levelname.lower(), "logger": record.name,
                 "msg": record.getMessage()}
        for key, value in getattr(record, "fields", {}).items():
            event.setdefault(key, value)
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            event["exception"] = f"{type(exc).__name__}: {exc}"
            event["traceback"] = self.formatException(record.exc_info)
        try:
            return json.dumps(event, default=str, ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError):  # (NaN or infinity somewhere, a key JSON cannot name)
            return json.dumps({k: v if isinstance(v, (str, int, bool)) or v is None else str(v)
                               for k, v in event.items()}, ensure_ascii=False)


class _ClientsMalformedRequests(logging.Filter):
    """aiohttp's server logs every malformed HTTP request a client sends (bad framing, a bad header) as
    an error with its traceback: the client's fault, which any client could make fill the log. Kept
    for --log-level debug."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None and type(exc).__module__ == "aiohttp.http_exceptions":
            return logging.getLogger("moemesh").isEnabledFor(logging.DEBUG)
        return True


def setup_logging(level: str = "warning", fmt: str = "text") -> None:
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r} is not one of {', '.join(FORMATS)}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else KeyValueFormatter())
    handler.addFilter(_ClientsMalformedRequests())
    handler.moemesh = True  # (the one to replace when called again; others' handlers, a test's, stay)
    ours = logging.getLogger("moemesh")
    ours.handlers[:] = [handler]
    ours.setLevel(level.upper())
    ours.propagate = False
    root = logging.getLogger()  # every other logger: warnings and errors, in the same format
    root.handlers[:] = [h for h in root.handlers if not getattr(h, "moemesh", False)] + [handler]
    root.setLevel(logging.WARNING)
    logging.captureWarnings(True)


def current_format() -> str:
    """The format setup_logging last gave moemesh's records (for processes started otherwise than
    through the environment: Ray's actors)."""
    for handler in logging.getLogger("moemesh").handlers:
        if getattr(handler, "moemesh", False):
            return "json" if isinstance(handler.formatter, JsonFormatter) else "text"
    return "text"


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(f"moemesh.{name}")
