"""A request's per-session backends: the gRPC clients of one pinned draft and target session (calls, round streams,
retries, moves between replicas) and the pipeline that runs `specdec.scheduling.schedule.generate` against them.
"""
