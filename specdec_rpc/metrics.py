"""Prometheus metrics of a draft/target replica: every name in one place.

Each server gets its own CollectorRegistry (several servers can live in one test process) and serves
it on a separate HTTP port. Labels stay low-cardinality: `method` only, never a session id.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


class ServiceMetrics:
    """A replica's metrics; `replica=False` (the coordinator's server): the RPC metrics alone, so that its /metrics
    carries no replica series stuck at 0 for queries that do not name a component to sum."""

    def __init__(self, registry: CollectorRegistry | None = None, replica: bool = True):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.rpc_latency = Histogram("specdec_rpc_latency_seconds", "Server-side RPC latency", ["method"],
                                     buckets=_LATENCY_BUCKETS, registry=r)
        # calls that ended with a status other than OK, by its name ("INVALID_ARGUMENT", ...: a fixed set)
        self.rpc_errors = Counter("specdec_rpc_errors", "RPCs that ended with an error status", ["method", "code"],
                                  registry=r)
        if replica:
            self._replica_metrics(r)

    def _replica_metrics(self, r) -> None:
        self.sessions_active = Gauge("specdec_sessions_active", "Sessions held by this replica", registry=r)
        self.queue_depth = Gauge("specdec_queue_depth", "Calls waiting for the model thread", registry=r)
        self.num_drafts = Counter("specdec_num_drafts", "Draft blocks proposed or verified", registry=r)
        self.num_draft_tokens = Counter("specdec_num_draft_tokens", "Draft tokens proposed or verified",
                                        registry=r)
        self.num_lookup_tokens = Counter("specdec_num_lookup_tokens", "Draft tokens proposed by prompt lookup "
                                         "(draft replicas; of specdec_num_draft_tokens)", registry=r)
        self.num_accepted_tokens = Counter("specdec_num_accepted_tokens", "Draft tokens accepted by the target",
                                           registry=r)
        # vLLM's prefix_cache_queries / _hits: prompt positions a prefill would feed, and those reused instead
        self.prefix_cache_queries = Counter("specdec_prefix_cache_queries", "Prompt positions looked up in the prefix "
                                            "cache (each session's prompt but its last token)", registry=r)
        self.prefix_cache_hits = Counter("specdec_prefix_cache_hits", "Prompt positions reused from the prefix "
                                         "cache instead of prefilled (of specdec_prefix_cache_queries)", registry=r)
        self.batch_size = Histogram("specdec_batch_size", "Sessions per batched forward (target: verify; draft: step)",
                                    buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)

    def serve(self, port: int, addr: str = "0.0.0.0"):
        """Start /metrics on `port` (0: disabled). Returns the (server, thread) pair or None."""
        if port:
            return start_http_server(port, addr=addr, registry=self.registry)
        return None

    def value(self, name: str, labels: dict | None = None) -> float | None:
        """Current sample value (tests)."""
        return self.registry.get_sample_value(name, labels or {})
