"""What the prefix cache saves, side by side: two embedded stacks (default pair), one with it and one without.

    python scripts/prefix_cache_ab.py [--mode sd] [--questions 8] [--conversations 3] [--turns 4]

Two chat workloads, each request sent to both stacks in turn (which goes first alternates), greedy, streamed
(GenerateStream), so the time to the first token is measured as a client sees it:
- shared system prompt: one long system prompt (~390 tokens) with `--questions` different user questions;
- multi-turn: `--conversations` conversations of `--turns` turns, each turn's prompt the whole conversation so
  far (the answers the stack gave, then a new question).
Prints, per workload, the median time to first token and wall time per request of each stack, their ratios, the
median prompt length and reused positions, and checks that both stacks return the same text. The first request
of each workload warms the cache and is left out of the medians (both stacks).
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time

SYSTEM = (
    "You are the support assistant of Northwind Outfitters, an online shop for hiking, camping and climbing gear. "
    "Follow these rules in every answer. Be friendly and brief: at most four sentences unless the customer asks "
    "for detail. Never invent order numbers, tracking codes, prices or stock levels; if the customer needs one, "
    "tell them where to find it in their account. Returns: unused items can be returned within 60 days with the "
    "receipt, used items within 30 days if they failed in normal use; the customer prints a free label from the "
    "Orders page. Refunds go back to the original payment method within 5 business days of the item arriving at "
    "our warehouse. Exchanges for another size are free and ship as soon as the return is scanned by the carrier. "
    "Shipping: standard delivery takes 3 to 5 business days and is free above 50 dollars; express takes 1 to 2 "
    "business days and costs 15 dollars; we ship to the United States and Canada only. Warranty: tents, packs and "
    "sleeping bags carry a lifetime warranty against defects in materials and workmanship; footwear and apparel "
    "carry one year. Damage from accidents, animals or fire is not covered, but our repair service can often fix "
    "it for a flat fee. Safety: for questions about climbing protection, ropes, harnesses or avalanche gear, give "
    "general information only and always recommend instruction from a certified guide; never tell a customer that "
    "a piece of gear is safe for a specific route or condition. Sizing: point customers to the size chart on each "
    "product page and mention that boots run half a size small. If the customer is upset, apologise once, then "
    "focus on what we can do. If a question is outside these topics, say that you can only help with Northwind "
    "orders and gear, and suggest contacting the team at the help center for anything else.")
QUESTIONS = [
    "Can I return a tent I used on one trip?", "How long does express shipping take to Canada?",
    "My boots feel tight, what size should I exchange them for?", "Is the warranty on my backpack still valid "
    "after five years?", "A bear chewed my sleeping bag. Is that covered?", "Do you ship to Mexico?",
    "When will I get my refund after sending a jacket back?", "Which harness is safe for ice climbing?",
    "How do I print a return label?", "Is shipping free for a 40 dollar order?"]
FOLLOW_UPS = ["Thanks. And what if I lost the receipt?", "Could you say that more briefly?",
              "What would you recommend as a next step?", "Does that apply to sale items too?"]


async def one(stub, g, ids, mode, max_new):
    t0, first, text, stats = time.perf_counter(), None, [], None
    async for r in stub.GenerateStream(g.GenerateRequest(prompt_token_ids=ids, max_new_tokens=max_new,
                                                         mode=mode, temperature=0.0)):
        if r.token_ids and first is None:
            first = time.perf_counter() - t0
        text.append(r.text_delta)
        if r.HasField("stats"):
            stats = r.stats
    return "".join(text), first, time.perf_counter() - t0, stats.cached_prompt_tokens


async def run(args) -> None:
    import grpc

    from coordinator.stack import LocalStack
    from specdec_bench.harness import _default_preverifier
    from specdec.hub import resolve_model
    from specdec_rpc.pb import generation_pb2 as g, generation_pb2_grpc as gg
    from specdec.tokenizer import encode_prompt, load_tokenizer

    tok = load_tokenizer(resolve_model("default-target"))
    pv = _default_preverifier("default-draft")
    stacks = {name: LocalStack("default-target", "default-draft", pv, use_ray=False, prefix_cache=cache)
              for name, cache in (("cache", True), ("no cache", False))}
    for s in stacks.values():
        await s.start()
    try:
        stubs = {n: gg.GenerationServiceStub(grpc.aio.insecure_channel(s.address)) for n, s in stacks.items()}
        rows = {}
        k = 0

        async def both(messages, workload):
            nonlocal k
            ids = encode_prompt(tok, messages=messages)
            order = list(stubs) if k % 2 == 0 else list(stubs)[::-1]
            k += 1
            out = {n: await one(stubs[n], g, ids, args.mode, args.max_new_tokens) for n in order}
            texts = {o[0] for o in out.values()}
            if len(texts) != 1:
                raise SystemExit(f"the stacks answered differently: {texts}")
            rows.setdefault(workload, []).append((len(ids), out))
            return out["cache"][0]

        system = {"role": "system", "content": SYSTEM}
        for q in QUESTIONS[:args.questions]:
            await both([system, {"role": "user", "content": q}], "shared system prompt")
        for c in range(args.conversations):
            msgs = [system, {"role": "user", "content": QUESTIONS[-1 - c]}]
            for t in range(args.turns):
                answer = await both(msgs, "multi-turn, turns 2+" if t else "multi-turn, turn 1")
                msgs = msgs + [{"role": "assistant", "content": answer},
                               {"role": "user", "content": FOLLOW_UPS[t % len(FOLLOW_UPS)]}]
    finally:
        for s in stacks.values():
            await s.stop()
    print(f"mode {args.mode}, greedy, {args.max_new_tokens} new tokens; every answer equal on both stacks\n")
    print("| workload | requests | prompt tokens (median) | reused (median) | TTFT cache / no cache (ms) | ratio "
          "| wall cache / no cache (s) | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for workload, rs in rows.items():
        rs = rs[1:] if workload == "shared system prompt" else rs  # its first request fills the cache
        med = lambda n, i: statistics.median(o[n][i] for _, o in rs)  # noqa: E731
        plen = statistics.median(p for p, _ in rs)
        print(f"| {workload} | {len(rs)} | {plen:.0f} | {med('cache', 3):.0f} | {med('cache', 1) * 1e3:.0f} / "
              f"{med('no cache', 1) * 1e3:.0f} | {med('no cache', 1) / med('cache', 1):.2f}x | "
              f"{med('cache', 2):.2f} / {med('no cache', 2):.2f} | {med('no cache', 2) / med('cache', 2):.2f}x |")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", default="sd")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--conversations", type=int, default=3)
    ap.add_argument("--turns", type=int, default=4)
    asyncio.run(run(ap.parse_args(argv)))


if __name__ == "__main__":
    main()
