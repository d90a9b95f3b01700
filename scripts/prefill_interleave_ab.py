"""What a long prompt's prefill does to a stream already running, with and without interleaved prefill.

    python scripts/prefill_interleave_ab.py [--trials 6] [--long-tokens 1500] [--mode sd]

Two embedded stacks (default pair, in-process pipelines, prefix cache off so every long prompt is prefilled in
full), one with `--no-interleave-prefill` replicas. A trial, on each stack in turn (which first alternates): a
stream of 128 greedy tokens from a short chat prompt; once it has 16 tokens, a second request arrives with a
prompt of `--long-tokens` tokens (distinct per trial) and 8 new tokens. Prints the medians over trials of the
running stream's longest gap between two tokens while the long request was in flight, of its wall time, and of the
long request's time to first token, and checks both stacks returned the same tokens.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time


async def trial(stub, g, short_ids, long_ids, mode):
    gaps, first_long, t_long = [], None, None
    long_task = None
    t0 = time.perf_counter()
    last = t0
    toks = []

    async def long_request():
        nonlocal first_long
        t = time.perf_counter()
        ids = []
        async for r in stub.GenerateStream(g.GenerateRequest(prompt_token_ids=long_ids, max_new_tokens=8, mode=mode,
                                                             temperature=0.0)):
            if r.token_ids and first_long is None:
                first_long = time.perf_counter() - t
            ids += r.token_ids
        return ids, time.perf_counter()

    async for r in stub.GenerateStream(g.GenerateRequest(prompt_token_ids=short_ids, max_new_tokens=128, mode=mode,
                                                         temperature=0.0)):
        now = time.perf_counter()
        if r.token_ids:
            if long_task is not None and (t_long is None or now <= t_long):
                gaps.append(now - last)
            last = now
            toks += r.token_ids
            if long_task is None and len(toks) >= 16:
                long_task = asyncio.ensure_future(long_request())
        if long_task is not None and long_task.done() and t_long is None:
            t_long = long_task.result()[1]
    long_ids_out, _ = await long_task
    return {"stall": max(gaps) if gaps else 0.0, "wall": time.perf_counter() - t0, "ttft_long": first_long,
            "tokens": (toks, long_ids_out)}


async def run(args) -> None:
    import grpc

    from coordinator.stack import LocalStack
    from specdec_bench.harness import _default_preverifier
    from specdec.hub import resolve_model
    from specdec_rpc.pb import generation_pb2 as g, generation_pb2_grpc as gg
    from specdec.tokenizer import encode_prompt, load_tokenizer

    from prefix_cache_ab import QUESTIONS, SYSTEM

    tok = load_tokenizer(resolve_model("default-target"))
    short = encode_prompt(tok, messages=[{"role": "user", "content": "Write a short poem about a mountain lake."}])
    base = [int(t) for t in tok((SYSTEM + " ") * 8)["input_ids"]]
    pv = _default_preverifier("default-draft")
    stacks = {"interleaved": LocalStack("default-target", "default-draft", pv, use_ray=False, prefix_cache=False),
              "one call": LocalStack("default-target", "default-draft", pv, use_ray=False, prefix_cache=False,
                                     replica_args=("--no-interleave-prefill",))}
    for s in stacks.values():
        await s.start()
    rows = {n: [] for n in stacks}
    try:
        stubs = {n: gg.GenerationServiceStub(grpc.aio.insecure_channel(s.address)) for n, s in stacks.items()}
        for n in stubs:  # warm-up
            await trial(stubs[n], g, short, base[:200] + short, args.mode)
        for i in range(args.trials):
            q = [int(t) for t in tok(QUESTIONS[i % len(QUESTIONS)] + f" ({i})")["input_ids"]]
            long_ids = q + base[:args.long_tokens - len(q)]
            order = list(stubs) if i % 2 == 0 else list(stubs)[::-1]
            out = {n: await trial(stubs[n], g, short, long_ids, args.mode) for n in order}
            if len({str(o["tokens"]) for o in out.values()}) != 1:
                raise SystemExit("the stacks returned different tokens")
            for n, o in out.items():
                rows[n].append(o)
    finally:
        for s in stacks.values():
            await s.stop()
    print(f"mode {args.mode}, greedy; a 128-token stream, and a {args.long_tokens}-token prompt arriving after its "
          f"16th token; {args.trials} trials, medians; both stacks returned the same tokens\n")
    print("| replicas | longest gap of the running stream (ms) | its wall time (s) | long prompt's TTFT (s) |")
    print("|---|---|---|---|")
    for n, rs in rows.items():
        med = lambda k: statistics.median(r[k] for r in rs)  # noqa: E731
        print(f"| {n} | {med('stall') * 1e3:.0f} | {med('wall'):.2f} | {med('ttft_long'):.2f} |")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=6)
    ap.add_argument("--long-tokens", type=int, default=1500)
    ap.add_argument("--mode", default="sd")
    asyncio.run(run(ap.parse_args(argv)))


if __name__ == "__main__":
    main()
