"""More simultaneous requests than the target replica has sessions, through the embedded stack (Ray): every request
should finish with its greedy output, the ones beyond capacity after waiting in the coordinator's queue.

    python scripts/admission_probe.py --requests 12 --max-sessions 4 --max-new-tokens 64

Prints, per request: its queue time (`stats.queued_s`), latency and tokens; then the medians. Set
COORDINATOR_MAX_WAITING=0 to see the old behaviour (requests beyond capacity fail with RESOURCE_EXHAUSTED).

    python scripts/admission_probe.py --urgent 2 --max-sessions 2 --max-new-tokens 192

Preemption by priority: `--max-sessions` batch requests (priority 5, --max-new-tokens each) fill the target, then,
once every one of them has streamed a token, `--urgent` requests (priority -1, 32 tokens) arrive. Prints each
request's latency and `stats.preemptions`, and checks every greedy answer against the same request run alone
first; a preempted one also against a fresh `ar` request whose prompt is the prompt plus the tokens it had before
the preemption (found as the longest pause of its stream). A rebuilt target session feeds its output in
verify-sized blocks (session 26), so in bf16 too it holds the K/V its verifies wrote and its greedy answer equals
the uninterrupted one; the fresh `ar` request prefills those tokens as its prompt, which rounds differently in bf16,
and may part from it at a near-tie.
COORDINATOR_PREEMPT=0 shows the urgent requests waiting for the batch instead.
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
    from specdec_train.preverifier.bench import benchmark_prompts, encode
    from specdec_rpc.pb import generation_pb2 as g, generation_pb2_grpc as gg
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


async def run_urgent(args) -> None:
    from coordinator.stack import LocalStack
    from specdec.defaults import DEFAULT_DRAFT, DEFAULT_TARGET
    from specdec.hub import resolve_model
    from specdec_train.preverifier.bench import benchmark_prompts, encode
    from specdec_rpc.pb import generation_pb2 as g, generation_pb2_grpc as gg
    from specdec.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model(DEFAULT_TARGET))
    n_batch = args.max_sessions
    prompts = [encode(tok, item) for _, item in benchmark_prompts(n_batch + args.urgent, n_batch + args.urgent)]
    batch = [g.GenerateRequest(prompt_token_ids=prompts[i], mode="sd", max_new_tokens=args.max_new_tokens,
                               priority=5, ignore_eos=True) for i in range(n_batch)]
    urgent = [g.GenerateRequest(prompt_token_ids=prompts[n_batch + i], mode="sd", max_new_tokens=32, priority=-1,
                                ignore_eos=True) for i in range(args.urgent)]
    async with LocalStack(DEFAULT_TARGET, DEFAULT_DRAFT, None, threads=1, max_sessions=args.max_sessions,
                          dtype=args.dtype) as stack:
        channel = grpc.aio.insecure_channel(stack.address)
        stub = gg.GenerationServiceStub(channel)
        alone = [list((await stub.Generate(r)).token_ids) for r in batch + urgent]
        started = [asyncio.Event() for _ in batch]

        async def one(kind: str, i: int, r):
            t0, ids, last, gap, at, prev = time.perf_counter(), [], None, 0.0, 0, time.perf_counter()
            async for part in stub.GenerateStream(r):
                now = time.perf_counter()
                if ids and now - prev > gap:
                    gap, at = now - prev, len(ids)  # the longest pause: a preemption's wait and rebuild
                prev = now
                ids.extend(part.token_ids)
                last = part
                if kind == "batch":
                    started[i].set()
            return kind, i, time.perf_counter() - t0, last.stats.preemptions, ids, at

        t0 = time.perf_counter()
        tasks = [asyncio.ensure_future(one("batch", i, r)) for i, r in enumerate(batch)]
        await asyncio.gather(*(e.wait() for e in started))
        tasks += [asyncio.ensure_future(one("urgent", i, r)) for i, r in enumerate(urgent)]
        rows = await asyncio.gather(*tasks)
        makespan = time.perf_counter() - t0
        resumed = {}
        for kind, i, _, pre, ids, at in rows:
            if pre:
                r = g.GenerateRequest()
                r.CopyFrom(batch[i] if kind == "batch" else urgent[i])
                del r.prompt_token_ids[:]
                r.prompt_token_ids.extend(list((batch[i] if kind == "batch" else urgent[i]).prompt_token_ids)
                                          + ids[:at])
                r.max_new_tokens, r.mode = len(ids) - at, "ar"
                resumed[(kind, i)] = list((await stub.Generate(r)).token_ids) == ids[at:]
        await channel.close()
    print("| request | priority | latency s | preemptions | tokens | = alone | resumed at | = ar from there |\n"
          "|---|---|---|---|---|---|---|---|")
    for kind, i, lat, pre, ids, at in rows:
        ref = alone[i if kind == "batch" else n_batch + i]
        print(f"| {kind} {i} | {5 if kind == 'batch' else -1} | {lat:.2f} | {pre} | {len(ids)} | {ids == ref} | "
              f"{at if pre else '-'} | {resumed.get((kind, i), '-')} |")
    for kind in ("batch", "urgent"):
        lats = [r[2] for r in rows if r[0] == kind]
        print(f"{kind}: latency median {statistics.median(lats):.2f} s, max {max(lats):.2f} s")
    print(f"makespan {makespan:.1f} s; answers equal to the requests run alone: "
          f"{sum(ids == alone[i if k == 'batch' else n_batch + i] for k, i, _, _, ids, _ in rows)} of {len(rows)}; "
          f"preempted ones equal to ar from where they resumed: {sum(resumed.values())} of {len(resumed)}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--max-sessions", type=int, default=4, help="the replicas' session slots")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"], help="--urgent's replicas")
    ap.add_argument("--urgent", type=int, default=0, help="preemption probe: this many priority -1 requests arrive "
                    "while batch requests of priority 5 fill the target (0: the admission probe)")
    args = ap.parse_args(argv)
    asyncio.run(run_urgent(args) if args.urgent else run(args))


if __name__ == "__main__":
    main()
