"""How much huge prompts stall an unrelated stream: a greedy GenerateStream's largest gap between messages, alone
and while `--huge` prompts of `--huge-bytes` each arrive at the same coordinator (gRPC, `specdec serve` or any
stack). A prompt that large is refused (OUT_OF_RANGE: longer than the context); what matters is whether the work
of refusing it holds up the other stream. With `--truncate N` the prompts are tokenized whole, then cut to their
last N tokens, and generate.

    python scripts/prompt_stall.py --target 127.0.0.1:50051 [--rounds 3]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import string
import time

import grpc

from specdec_rpc.pb import generation_pb2 as g, generation_pb2_grpc as gg

PROMPT = "Explain how a hash map works, with an example in Python."


async def stream_gaps(stub, max_new_tokens: int, started: asyncio.Event | None = None) -> dict:
    """One greedy stream: (largest gap between messages after the first, messages, tokens)."""
    req = g.GenerateRequest(prompt=PROMPT, max_new_tokens=max_new_tokens, temperature=0.0, mode="ar",
                            ignore_eos=True)
    last, gaps, n, tokens = None, [], 0, 0
    async for resp in stub.GenerateStream(req):
        now = time.perf_counter()
        if last is not None:
            gaps.append(now - last)
        last, n, tokens = now, n + 1, tokens + len(resp.token_ids)
        if started is not None and n == 2:
            started.set()
    return {"max_gap_s": max(gaps) if gaps else 0.0, "messages": n, "tokens": tokens,
            "median_gap_s": sorted(gaps)[len(gaps) // 2] if gaps else 0.0}


def huge_prompt(size: int, seed: int) -> str:
    rng = random.Random(seed)
    words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9))) for _ in range(2000)]
    out, n = [], 0
    while n < size:
        w = rng.choice(words)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)[:size]


async def huge(stub, prompt: str, truncate: int = 0) -> tuple[str, float]:
    t0 = time.perf_counter()
    req = g.GenerateRequest(prompt=prompt, max_new_tokens=8)
    if truncate:
        req.truncate_prompt_tokens = truncate
    try:
        await stub.Generate(req, timeout=120)
        code = "OK"
    except grpc.aio.AioRpcError as e:
        code = e.code().name
    return code, time.perf_counter() - t0


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="127.0.0.1:50051")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--huge", type=int, default=3)
    ap.add_argument("--huge-bytes", type=int, default=1 << 20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--truncate", type=int, default=0,
                    help="send the huge prompts with truncate_prompt_tokens (they are tokenized, then generate)")
    a = ap.parse_args()
    opts = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
    prompts = [huge_prompt(a.huge_bytes, k) for k in range(a.huge)]
    async with grpc.aio.insecure_channel(a.target, options=opts) as ch:
        stub = gg.GenerationServiceStub(ch)
        await stream_gaps(stub, 8)  # warm
        out = {"alone": [], "with_huge": [], "huge": []}
        for _ in range(a.rounds):
            out["alone"].append(await stream_gaps(stub, a.max_new_tokens))
            started = asyncio.Event()
            s = asyncio.ensure_future(stream_gaps(stub, a.max_new_tokens, started))
            await started.wait()
            hs = await asyncio.gather(*(huge(stub, p, a.truncate) for p in prompts))
            out["with_huge"].append(await s)
            out["huge"].append(hs)
        alone = max(r["max_gap_s"] for r in out["alone"])
        loaded = max(r["max_gap_s"] for r in out["with_huge"])
        out["summary"] = {"largest_gap_alone_s": round(alone, 3), "largest_gap_with_huge_s": round(loaded, 3),
                          "bound_s": round(max(0.6, 2 * alone), 3), "within_bound": loaded <= max(0.6, 2 * alone)}
        print(json.dumps(out, indent=1))


if __name__ == "__main__":
    asyncio.run(main())
