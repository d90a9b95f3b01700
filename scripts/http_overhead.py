"""What the OpenAI-compatible HTTP API costs over the gRPC one, side by side on the embedded stack.

    python scripts/http_overhead.py --repeats 5 [--mode sd] [--max-tokens 128] [--concurrency 8]

Starts the embedded stack (default pair, Ray, one thread per replica) with the HTTP API on, then sends the same
greedy requests (the bench's chat and HumanEval prompts, as the bench's token ids) through four doors, interleaved
round-robin: gRPC Generate, gRPC GenerateStream, HTTP whole (/v1/completions) and HTTP streamed (SSE). It
checks that all four return the same text, and prints per door the median wall time per request, its ratio to
gRPC Generate, and for the streamed doors the median time to the first text.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time


async def run(args) -> None:
    import grpc
    import httpx

    from coordinator.stack import LocalStack
    from specdec_bench.prompts import load_prompt_sets
    from specdec.hub import resolve_model
    from specdec_rpc.pb import generation_pb2 as g, generation_pb2_grpc as gg
    from specdec.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model("default-target"))
    prompts = [p.ids for p in load_prompt_sets(tok, ["chat", "humaneval"], args.prompts)]
    from specdec_bench.harness import _default_preverifier

    async with LocalStack("default-target", "default-draft", _default_preverifier("default-draft"),
                          http_port=0) as stack:
        stub = gg.GenerationServiceStub(ch := grpc.aio.insecure_channel(stack.address))
        http = httpx.AsyncClient(base_url=stack.http_address, timeout=600)

        def grpc_req(ids):
            return g.GenerateRequest(prompt_token_ids=ids, max_new_tokens=args.max_tokens, mode=args.mode)

        def body(ids, stream):
            return {"prompt": ids, "max_tokens": args.max_tokens, "temperature": 0, "mode": args.mode,
                    "stream": stream}

        async def grpc_whole(msgs):
            return (await stub.Generate(grpc_req(msgs))).text, None

        async def grpc_stream(msgs):
            t0, first, parts = time.perf_counter(), None, []
            async for r in stub.GenerateStream(grpc_req(msgs)):
                if r.text_delta and first is None:
                    first = time.perf_counter() - t0
                parts.append(r.text_delta)
            return "".join(parts), first

        async def http_whole(msgs):
            r = await http.post("/v1/completions", json=body(msgs, False))
            return r.json()["choices"][0]["text"], None

        async def http_stream(msgs):
            t0, first, parts = time.perf_counter(), None, []
            async with http.stream("POST", "/v1/completions", json=body(msgs, True)) as r:
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    text = json.loads(line[6:])["choices"][0]["text"]
                    if text and first is None:
                        first = time.perf_counter() - t0
                    parts.append(text or "")
            return "".join(parts), first

        doors = {"gRPC Generate": grpc_whole, "gRPC GenerateStream": grpc_stream,
                 "HTTP /v1/completions": http_whole, "HTTP /v1/completions, stream": http_stream}
        wall = {d: [] for d in doors}
        ttft = {d: [] for d in doors}
        for msgs in prompts:  # warm-up
            await grpc_whole(msgs)
        c = args.concurrency  # requests at once: prompts cycled
        batches = ([[i] for i in range(len(prompts))] if c == 1 else
                   [[(b * c + j) % len(prompts) for j in range(c)] for b in range(max(1, len(prompts) // c))])
        for rep in range(args.repeats):
            for batch in batches:
                texts = []
                order = list(doors.items())
                order = order[rep % 4:] + order[:rep % 4]  # rotate who goes first
                for name, fn in order:
                    t0 = time.perf_counter()
                    outs = await asyncio.gather(*(fn(prompts[i]) for i in batch))
                    wall[name].append(time.perf_counter() - t0)
                    ttft[name] += [first for _, first in outs if first is not None]
                    texts.append([text for text, _ in outs])
                assert all(t == texts[0] for t in texts), "the doors disagree"
        await http.aclose()
        await ch.close()
    base = statistics.median(wall["gRPC Generate"])
    print(f"{len(prompts)} prompts x {args.repeats} repeats, {args.concurrency} at once, mode {args.mode}, "
          f"{args.max_tokens} new tokens, greedy; every door returned the same text\n")
    what = "wall per request" if args.concurrency == 1 else f"wall per {args.concurrency} concurrent requests"
    print(f"| door | {what}, median | vs gRPC Generate | first text, median |\n|---|---|---|---|")
    for d in doors:
        w = statistics.median(wall[d])
        f = f"{statistics.median(ttft[d]) * 1e3:.0f} ms" if ttft[d] else "-"
        print(f"| {d} | {w * 1e3:.0f} ms | {w / base:.3f}× | {f} |")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=2, help="prompts per set (chat, HumanEval)")
    ap.add_argument("--mode", default="sd")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=1, help="requests sent at once (prompts cycled)")
    asyncio.run(run(ap.parse_args(argv)))


if __name__ == "__main__":
    main()
