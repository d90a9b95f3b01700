"""Process logging for the three services: `text` (the default, one human-readable line) or `json` (one JSON object
per line, for log pipelines: Loki, Elasticsearch, Cloud Logging).

    configure_logging("INFO", "json", service="target")  # what the three `python -m ...` entry points call

A JSON line carries `timestamp` (UTC, ISO 8601), `level`, `logger`, `message`, the process's `service` and, once it
serves, `replica` (its host:port), and whatever is known of the work the line is about:

- `request_id`, `session_id`: bound per call (`bind`) by the replicas' interceptor (specdec_rpc/interceptor.py,
  from the request's `session_id`) and per request by the coordinator's pipeline (coordinator/backends/pipeline.py);
  a replica's session id is the coordinator's request id, so the two join on it;
- `draft_replica`, `target_replica`, `timings` (seconds: wall, network per link, queueing, compute), filled in by the
  coordinator's pipeline when a request ends, so its `coordinator.requests` line carries them;
- `exception`: the traceback, for a line logged with one.

Binding is a context variable: it follows the call's asyncio task (and tasks it starts) and costs one dict per call.
"""
from __future__ import annotations

import contextvars
import json
import logging
import sys
import threading
import time

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LOG_FORMATS = ("text", "json")

_fields: contextvars.ContextVar[dict | None] = contextvars.ContextVar("specdec_log_fields", default=None)
_process: dict = {}  # service, replica: the same for every line of the process
# a record's own attributes; anything else on it came from `extra=` and goes into the JSON object
_RECORD_KEYS = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}


def bind(**fields) -> dict:
    """Add `fields` to the current context's log fields (this task and the tasks it starts from now on). → the
    context's dict: fields put into it later (a request's timings at its end) reach every line logged after."""
    d = dict(_fields.get() or ())
    d.update(fields)
    _fields.set(d)
    return d


def bound() -> dict:
    """The current context's log fields (empty: none bound)."""
    return _fields.get() or {}


def set_process(**fields) -> None:
    """Fields of every line of this process (`service`, and `replica` once its address is known)."""
    _process.update({k: v for k, v in fields.items() if v})


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (newlines in a message or traceback are escaped)."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"timestamp": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
                            + f".{int(record.msecs):03d}Z",
               "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        out.update(_process)
        out.update(bound())
        for k, v in vars(record).items():
            if k not in _RECORD_KEYS and not k.startswith("_"):
                out[k] = v
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exception"] = record.exc_text
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, default=str, ensure_ascii=False)


def adopt_loggers(*names: str) -> None:
    """Send these libraries' loggers through the root handler, in the process's format: some (Ray's) install their
    own handler, which writes plain text whatever `log_format` says."""
    for name in names:
        lg = logging.getLogger(name)
        for h in list(lg.handlers):
            lg.removeHandler(h)
        lg.propagate = True


def configure_logging(level: str = "INFO", log_format: str = "text", service: str = "", stream=None) -> None:
    """The root logger's one handler (stderr), in `log_format`; replaces handlers set before (the last call wins).
    `service`: the process's name in JSON lines (draft, target, coordinator)."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log_format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level.upper())
    set_process(service=service)
    sys.excepthook = _log_uncaught
    sys.unraisablehook = _log_unraisable
    threading.excepthook = _log_thread_exception


def _log_uncaught(exc_type, exc, tb) -> None:
    """An exception no code caught: the process's last, or one a C extension prints as it drops it (Cython's
    callbacks do, through `sys.excepthook`): one log record, in the process's format."""
    logging.getLogger("specdec.uncaught").error("uncaught %s", exc_type.__name__, exc_info=(exc_type, exc, tb))


def _log_unraisable(u) -> None:
    """An exception Python could not raise to a caller (a finalizer's; a C extension's callback's, such as gRPC's
    when a server stops under a call in flight): one log record, in the process's format, instead of a raw
    traceback on stderr."""
    where = f" in {u.object!r}" if u.object is not None else ""
    logging.getLogger("specdec.unraisable").warning(
        "%s%s", u.err_msg or "Exception ignored", where,
        exc_info=(u.exc_type, u.exc_value, u.exc_traceback) if u.exc_type is not None else None)


def _log_thread_exception(args) -> None:
    """An exception that ended a thread: one log record, in the process's format."""
    if args.exc_type is SystemExit:
        return
    name = args.thread.name if args.thread is not None else "?"
    logging.getLogger("specdec.threads").error("thread %s ended by an exception", name,
                                               exc_info=(args.exc_type, args.exc_value, args.exc_traceback))
