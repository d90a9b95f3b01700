"""Draft and target workers: one model each, per-session KV slots, the absolute-position protocol.

- base.py: `Worker`, what both share: the session table, KV slots, prefill, the position protocol;
- draft.py: `DraftWorker`, the draft model, drafting step-wise so that sessions share forwards (the drafting step
  itself: specdec/workers/drafting.py; the sources it drafts from, one module each: proposers/);
- target.py: `TargetWorker`, the target model, verifying draft blocks in batched forwards.

Pure core (torch only); the gRPC servicers and the in-process engine both drive these. A worker is not
thread-safe: its owner runs every call on one thread (only `cancel` may be called from elsewhere).

Protocol (docs/design/architecture.md): every mutating call names `base_position` — "truncate what you have fed to this
many tokens, then feed these". Truncation is free (the KV cache is written by position), a retry of the same call
replays exactly (keyed randomness), and a `base_position` beyond what the session holds is refused.
"""
