"""Shared gRPC server skeleton for draft_service and target_service (a shell: it may import grpc).

- `settings`: pydantic-settings base (`DRAFT_*` / `TARGET_*` env, CLI flags override), device/dtype parsing.
- `tls`: optional TLS/mTLS credentials from PEM files.
- `interceptor`: the one place exceptions become status codes (+ per-method latency).
- `metrics`: Prometheus metric names, one registry per server, `/metrics` on a separate port.
- `convert`: proto <-> tensor helpers (Tensor, sparse q msgpack, sampling params).
- `host`: one worker on its model thread (specdec/common/threads.py) behind the session table
  (specdec/state/sessions.py).
- `aio`: asyncio helpers (a timeout that never loses a cancel, the stop of a background task).
- `app`: build/start a `grpc.aio` server with health, reflection, limits, keepalive, graceful shutdown.
"""
