"""The coordinator: the front door for gRPC and OpenAI-compatible clients, replica pools and routing, and the
per-request pipelines that drive a pinned draft and target replica.

Layout: `config` (settings), `routing/` (pool membership, discovery, health, least-loaded and prefix-aware routing,
preemption, the router that hands requests to pipelines), `backends/` (a request's gRPC draft and target sessions:
calls, round streams, retries, moves; the pipeline running `specdec.scheduling.schedule` against them), `grpc_api/`
(GenerationService), `http_api/` (the OpenAI-compatible API), `actor` (Ray hosts), `server` (assembly), `stack`
(the embedded one-machine stack of the CLI), `metrics`, `tracing`.
"""
