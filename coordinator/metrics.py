"""Coordinator metrics (STYLE B4), registered next to the shared server metrics on the same /metrics port."""
from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class CoordinatorMetrics:
    def __init__(self, registry):
        r = registry
        self.running = Gauge("specdec_num_requests_running", "Requests being generated", registry=r)
        self.requests = Counter("specdec_request_success", "Finished requests", ["finish_reason"], registry=r)
        self.tokens = Counter("specdec_generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram("specdec_time_to_first_token_seconds", "Time to the first verified token",
                              buckets=_SECONDS, registry=r)
        # rounds by kind: `speculative` (draft + verify) or `target_only` (load-adaptive speculation switched off)
        self.rounds = Counter("specdec_rounds", "Decoding rounds of finished requests", ["kind"], registry=r)
        self.waiting = Gauge("specdec_num_requests_waiting", "Requests waiting for free replica sessions",
                             registry=r)
        # time a request waited for free replica sessions (pools at capacity; coordinator/pool.py, "Admission")
        self.queue_time = Histogram("specdec_request_queue_time_seconds", "Time waiting for free replica sessions",
                                    buckets=(0.001,) + _SECONDS, registry=r)
        self.e2e = Histogram("specdec_e2e_request_latency_seconds", "Request latency", buckets=_SECONDS,
                             registry=r)
        self.prompt_tokens = Counter("specdec_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.cached_prompt_tokens = Counter("specdec_cached_prompt_tokens", "Of the prompt tokens, those the target "
                                            "replica reused from its prefix cache", registry=r)
        # vLLM's time_per_output_token: a streamed request's (e2e - TTFT) / (tokens - 1); speculation delivers
        # tokens in bursts, so this is the rate a reader sees, not the gap between two deliveries
        self.tpot = Histogram("specdec_time_per_output_token_seconds", "Time per generated token after the first "
                              "(streamed requests of 2+ tokens)",
                              buckets=(0.005, 0.01, 0.02, 0.03, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0),
                              registry=r)
        # requests that ran target-only, wholly or from some point on, because no draft replica was reachable
        # (reason "unreachable": alert on it, deploy/monitoring/prometheus-rules.yaml) or the request is past the
        # draft replicas' context ("context"; COORDINATOR_DRAFT_FALLBACK): exact but slower
        self.draft_unavailable = Counter("specdec_draft_unavailable", "Requests that fell back to target-only "
                                         "decoding: no draft replica reachable, or past the draft's context",
                                         ["reason"], registry=r)
        # sessions given up to requests of higher priority (COORDINATOR_PREEMPT; coordinator/preemption.py)
        self.preemptions = Counter("specdec_preemptions", "Replica sessions requests gave up to requests of higher "
                                   "priority, to resume later", registry=r)
