"""`--log-format json` (specdec_rpc/logs.py): every process, run as `python -m draft_service | target_service |
coordinator`, writes one JSON object per line, and a request's lines carry its request id, session id, replica and
timings. Checked on the real entry points (subprocesses), through one request, up to their shutdown."""
from __future__ import annotations

import gc
import io
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from specdec_rpc.logs import bind, configure_logging
from tests.helpers_models import save_tiny_pair

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(module: str, args: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", module, *args, "--log-format", "json", "--host", "127.0.0.1",
                             "--metrics-port", "0", "--exit-with-parent", str(os.getpid()), "--grace-s", "0"],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log.open("w"))


def json_lines(path: Path) -> list[dict]:
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    assert lines, f"{path.name}: no log lines"
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            pytest.fail(f"{path.name}: a line that is not JSON: {line!r}")
    for o in out:
        assert {"timestamp", "level", "logger", "message"} <= o.keys(), o
    return out


@pytest.mark.timeout(240)
def test_every_process_logs_one_json_object_per_line(tmp_path):
    from specdec_rpc.pb import generation_pb2 as g, generation_pb2_grpc as gg

    tdir, ddir = save_tiny_pair(tmp_path / "models", with_tokenizer=False)
    ports = {k: free_port() for k in ("target", "draft", "coordinator")}
    logs = {k: tmp_path / f"{k}.log" for k in ports}
    procs = {
        "target": launch("target_service", ["--model", str(tdir), "--port", str(ports["target"]), "--log-level",
                                            "DEBUG"], logs["target"]),
        "draft": launch("draft_service", ["--model", str(ddir), "--port", str(ports["draft"]), "--log-level",
                                          "DEBUG"], logs["draft"]),
        "coordinator": launch("coordinator", ["--no-ray", "--tokenizer", "none", "--port", str(ports["coordinator"]),
                                              "--target-endpoints", f"127.0.0.1:{ports['target']}",
                                              "--draft-endpoints", f"127.0.0.1:{ports['draft']}",
                                              "--dns-refresh-s", "0.2"], logs["coordinator"]),
    }
    try:
        stub = gg.GenerationServiceStub(grpc.insecure_channel(f"127.0.0.1:{ports['coordinator']}"))
        deadline, resp = time.monotonic() + 180, None
        while resp is None:
            try:
                resp = stub.Generate(g.GenerateRequest(prompt_token_ids=[1, 2, 3], max_new_tokens=8, mode="sd",
                                                       request_id="json-logs"), timeout=20)
            except grpc.RpcError:
                if time.monotonic() > deadline or any(p.poll() is not None for p in procs.values()):
                    raise
                time.sleep(0.5)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
    rid = resp.stats.request_id
    by = {k: json_lines(v) for k, v in logs.items()}
    for kind, lines in by.items():
        assert all(o["service"] == kind for o in lines), kind
        assert any(o.get("replica") == f"127.0.0.1:{ports[kind]}" for o in lines), kind  # once it serves
    (done,) = [o for o in by["coordinator"] if o["logger"] == "coordinator.requests"]
    assert done["request_id"] == done["session_id"] == rid
    assert done["target_replica"] == f"127.0.0.1:{ports['target']}"
    assert done["draft_replica"] == f"127.0.0.1:{ports['draft']}"
    assert done["timings"]["wall_s"] > 0 and "target_network_s" in done["timings"]
    for kind in ("target", "draft"):  # the replica's session line: the same request, with its prefill time
        (started,) = [o for o in by[kind] if o["message"].startswith(f"session {rid} started")]
        assert started["session_id"] == started["request_id"] == rid, kind
        assert started["timings"]["prefill_s"] >= 0


def test_the_formatter_escapes_what_would_break_a_line_and_keeps_extras():
    from specdec_rpc import logs

    stream, root = io.StringIO(), logging.getLogger()
    saved = (list(root.handlers), root.level, dict(logs._process), sys.unraisablehook, threading.excepthook,
             sys.excepthook)
    configure_logging("INFO", "json", service="test", stream=stream)
    try:
        log = logging.getLogger("specdec.test")
        bind(request_id="r-1")
        log.info("two\nlines \"quoted\"", extra={"timings": {"wall_s": 0.5}})
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("failed")
    finally:
        _restore(saved)
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["message"] == "two\nlines \"quoted\"" and first["timings"] == {"wall_s": 0.5}
    assert first["request_id"] == "r-1" and first["service"] == "test" and first["level"] == "INFO"
    assert second["level"] == "ERROR" and "ValueError: boom" in second["exception"]
    with pytest.raises(ValueError):
        configure_logging("INFO", "yaml")


def _restore(saved) -> None:
    from specdec_rpc import logs

    root = logging.getLogger()
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])
    logs._process.clear()
    logs._process.update(saved[2])
    logs._fields.set(None)
    sys.unraisablehook, threading.excepthook, sys.excepthook = saved[3], saved[4], saved[5]


def test_exceptions_no_caller_can_catch_are_json_lines_too():
    """What Python reports itself (an exception in a finalizer or a C extension's callback, one that ends a thread)
    goes through the process's logging: a JSON line, not a raw traceback between them."""
    from specdec_rpc import logs

    stream, root = io.StringIO(), logging.getLogger()
    saved = (list(root.handlers), root.level, dict(logs._process), sys.unraisablehook, threading.excepthook,
             sys.excepthook)
    configure_logging("INFO", "json", service="test", stream=stream)
    try:
        class Finalizer:
            def __del__(self):
                raise RuntimeError("in a finalizer")

        Finalizer()
        gc.collect()

        def fail():
            raise ValueError("in a thread")

        t = threading.Thread(target=fail, name="worker-x")
        t.start()
        t.join()
        try:
            raise KeyError("uncaught")
        except KeyError:
            sys.excepthook(*sys.exc_info())  # what an uncaught exception, or a C extension printing one, calls
    finally:
        _restore(saved)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [o["logger"] for o in lines] == ["specdec.unraisable", "specdec.threads", "specdec.uncaught"], lines
    assert "RuntimeError: in a finalizer" in lines[0]["exception"] and "Finalizer" in lines[0]["message"]
    assert lines[1]["message"] == "thread worker-x ended by an exception"
    assert "ValueError: in a thread" in lines[1]["exception"]
    assert lines[2]["message"] == "uncaught KeyError" and "KeyError: 'uncaught'" in lines[2]["exception"]
