"""More simultaneous requests than the target replica has sessions, through the embedded stack (Ray): every request
should finish with its greedy output, the ones beyond capacity after waiting in the coordinator's queue.

    python scripts/admission_probe.py --requests 12 --max-sessions 4 --max-new-tokens 64

Prints, per request: its queue time (`stats.queued_s`), latency and tokens; then the medians. Set
COORDINATOR_MAX_WAITING=0 to see the old behaviour (requests beyond capacity fail with RESOURCE_EXHAUSTED).
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import grpc


async def run(args) -> None:
    from coordinator.stack import LocalStack
    from specdec.defaults import DEFAULT_DRAFT, DEFAULT_TARGET
    from specdec.hub import resolve_model
    from specdec.pacer_train.bench import benchmark_prompts, encode
    from specdec.pb import generation_pb2 as g, generation_pb2_grpc as gg
    from specdec.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model(DEFAULT_TARGET))
    prompts = [encode(tok, item) for _, item in benchmark_prompts(args.requests, args.requests)]
    async with LocalStack(DEFAULT_TARGET, DEFAULT_DRAFT, None, threads=1, max_sessions=args.max_sessions) as stack:
        channel = grpc.aio.insecure_channel(stack.address)
        stub = gg.GenerationServiceStub(channel)
        await stub.Generate(g.GenerateRequest(prompt_token_ids=prompts[0][:16], max_new_tokens=4, mode="sd"))

        async def one(i: int):
            t0 = time.perf_counter()
            try:
                r = await stub.Generate(g.GenerateRequest(prompt_token_ids=prompts[i % len(prompts)], mode="sd",
                                                          max_new_tokens=args.max_new_tokens, gamma=2))
                return i, time.perf_counter() - t0, r.stats.queued_s, len(r.token_ids), ""
            except grpc.aio.AioRpcError as e:
                return i, time.perf_counter() - t0, 0.0, 0, f"{e.code().name}: {e.details()}"

        t0 = time.perf_counter()
        rows = await asyncio.gather(*(one(i) for i in range(args.requests)))
        makespan = time.perf_counter() - t0
        await channel.close()
    print("| request | latency s | queued s | tokens | error |\n|---|---|---|---|---|")
    for i, lat, queued, n, err in rows:
        print(f"| {i} | {lat:.2f} | {queued:.2f} | {n} | {err[:100]} |")
    ok = [r for r in rows if not r[4]]
    print(f"\n{len(ok)}/{len(rows)} finished; makespan {makespan:.1f} s; "
          f"latency median {statistics.median(r[1] for r in rows):.2f} s, max {max(r[1] for r in rows):.2f} s; "
          f"queued median {statistics.median(r[2] for r in rows):.2f} s, max {max(r[2] for r in rows):.2f} s; "
          f"{sum(r[3] for r in rows) / makespan:.1f} tok/s aggregate")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--max-sessions", type=int, default=4, help="the replicas' session slots")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args(argv)
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
