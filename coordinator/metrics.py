"""Coordinator metrics, every name in one place, registered next to the shared server metrics on the same /metrics
port."""
from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# a whole request: up to the token cap (4096 by default) at 0.05-0.1 s a token under load
_REQUEST_SECONDS = _SECONDS[:-1] + (60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0)
FINISH_REASONS = ("stop", "length", "abort")  # vLLM's finish_reason label values; "abort": the client went away
MODES = ("ar", "sd", "pacer", "pearl", "pacer_pearl")


class CoordinatorMetrics:
    def __init__(self, registry):
        r = registry
        # set_function'ed by the server: requests in flight less those waiting for sessions
        self.running = Gauge("specdec_num_requests_running", "Requests being generated (holding replica sessions)",
                             registry=r)
        self.requests = Counter("specdec_request_success", "Finished requests: generated to a stop or the length "
                                "limit, or given up when the client went away (abort)", ["finish_reason"],
                                registry=r)
        # every failed request, from either door, by gRPC status name (a fixed set): INVALID_ARGUMENT and the other
        # client mistakes apart from UNAVAILABLE / INTERNAL / DEADLINE_EXCEEDED, which the alerts watch
        self.errors = Counter("specdec_request_errors", "Requests that failed, by status", ["code"], registry=r)
        self.tokens = Counter("specdec_generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram("specdec_time_to_first_token_seconds", "Time to the first verified token",
                              buckets=_SECONDS, registry=r)
        # rounds by kind: `speculative` (draft + verify) or `target_only` (load-adaptive speculation switched off)
        self.rounds = Counter("specdec_rounds", "Decoding rounds of finished requests", ["kind"], registry=r)
        self.waiting = Gauge("specdec_num_requests_waiting", "Requests waiting for free replica sessions",
                             registry=r)
        # time a request waited for free replica sessions (pools at capacity; coordinator/routing/pool.py, "Admission")
        self.queue_time = Histogram("specdec_request_queue_time_seconds", "Time waiting for free replica sessions",
                                    buckets=(0.001,) + _SECONDS, registry=r)
        self.e2e = Histogram("specdec_e2e_request_latency_seconds", "Request latency (finished and aborted "
                             "requests)", buckets=_REQUEST_SECONDS, registry=r)
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
        # sessions given up to requests of higher priority (COORDINATOR_PREEMPT; coordinator/routing/preemption.py)
        self.preemptions = Counter("specdec_preemptions", "Replica sessions requests gave up to requests of higher "
                                   "priority, to resume later", registry=r)
        # vLLM's spec_decode_num_draft_tokens / _num_accepted_tokens / _num_emitted_tokens, by decoding mode, from
        # each finished request's stats; emitted / target forwards is the mode's mean accepted length
        self.spec_draft_tokens = Counter("specdec_spec_decode_num_draft_tokens", "Draft tokens proposed, by mode",
                                         ["mode"], registry=r)
        self.spec_accepted_tokens = Counter("specdec_spec_decode_num_accepted_tokens", "Draft tokens accepted, by "
                                            "mode", ["mode"], registry=r)
        self.spec_emitted_tokens = Counter("specdec_spec_decode_num_emitted_tokens", "Tokens generated, by mode",
                                           ["mode"], registry=r)
        self.spec_target_forwards = Counter("specdec_spec_decode_num_target_forwards", "Target forwards, by mode",
                                            ["mode"], registry=r)
        for reason in FINISH_REASONS:  # every known series from the start, as vLLM does: no "No data" panels
            self.requests.labels(reason)
        for mode in MODES:
            for c in (self.spec_draft_tokens, self.spec_accepted_tokens, self.spec_emitted_tokens,
                      self.spec_target_forwards):
                c.labels(mode)
        for kind in ("speculative", "target_only"):
            self.rounds.labels(kind)

    def finished(self, stats: dict, finish: str, n_tokens: int, e2e: float, ttft: float | None) -> None:
        """A request that generated to its end (`finish`: stop, length, ...)."""
        self.requests.labels(finish).inc()
        self.tokens.inc(n_tokens)
        self.e2e.observe(e2e)
        if ttft is not None and n_tokens > 1:
            self.tpot.observe((e2e - ttft) / (n_tokens - 1))
        self.prompt_tokens.inc(stats.get("prompt_tokens", 0))
        self.cached_prompt_tokens.inc(stats.get("cached_prompt_tokens", 0))
        self.queue_time.observe(stats.get("queued_s", 0.0))
        if stats.get("draft_unavailable"):
            self.draft_unavailable.labels(stats.get("draft_fallback") or "unreachable").inc()
        self.preemptions.inc(stats.get("preemptions", 0))
        off = stats.get("target_only_rounds", 0)
        self.rounds.labels("target_only").inc(off)
        mode = stats.get("mode")
        if mode != "ar":
            self.rounds.labels("speculative").inc(max(0, stats.get("rounds", 0) - off))
        if mode in MODES:
            self.spec_draft_tokens.labels(mode).inc(stats.get("draft_tokens", 0))
            self.spec_accepted_tokens.labels(mode).inc(stats.get("accepted_tokens", 0))
            self.spec_emitted_tokens.labels(mode).inc(n_tokens)
            self.spec_target_forwards.labels(mode).inc(stats.get("target_forwards", 0))
