"""PEARL's window and overlap against sd through the embedded stack (replica subprocesses, no Ray), interleaved per
prompt: where `scripts/overlap_ab.py` runs one process (one GIL for both models), this runs the replicas apart.

    python scripts/stack_window_ab.py --n-prompts 3
    python scripts/stack_window_ab.py --configs ar sd:3 pearl:3:always pearl:8:auto

A configuration is MODE[:GAMMA[:OVERLAP[:FIRST]]] (GAMMA: sd's length, the PEARL modes' window; FIRST: the PEARL
modes' pearl_first_block, 0 = pre-verify; '' the default). Greedy,
128 new tokens, HumanEval + chat prompts of the default pair, 1 thread per replica; the configurations' order
rotates per prompt. Prints median tokens/s, paired ratios against the first configuration, and the summed wall,
target and draft busy time, target forwards and wasted draft tokens: the target's idle share of the wall is
1 - target busy / wall.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics

DEFAULT_CONFIGS = ["ar", "sd:3", "pearl:3:always", "pearl:4:always", "pearl::always", "pearl:4:auto", "pearl::auto"]


def parse(config: str) -> tuple[str, int | None, dict]:
    mode, gamma, overlap, first = (config.split(":") + ["", "", ""])[:4]
    fields = {"pearl_overlap": overlap} if overlap else {}
    if first:
        fields["pearl_first_block"] = int(first)
    return mode, int(gamma) if gamma else None, fields


async def main(args) -> None:
    from coordinator.stack import LocalStack
    from specdec_bench.harness import _default_preverifier
    from specdec_bench.prompts import load_prompt_sets
    from specdec_bench.runners import StackClient
    from specdec.defaults import DEFAULT_DRAFT, DEFAULT_TARGET
    from specdec.hub import resolve_model
    from specdec.tokenizer import load_tokenizer

    tdir = resolve_model(DEFAULT_TARGET)
    prompts = load_prompt_sets(load_tokenizer(tdir), ["humaneval", "chat"], args.n_prompts)
    stack = LocalStack(str(tdir), str(resolve_model(DEFAULT_DRAFT)), _default_preverifier(DEFAULT_DRAFT), threads=1,
                       use_ray=False, max_sessions=4)
    await stack.start()
    client = StackClient(stack.address)
    configs = [parse(c) for c in args.configs]
    res: dict[int, list] = {i: [] for i in range(len(configs))}
    try:
        await client.generate(prompts[0].ids, "sd", None, 0.0, 0, 8)  # warm-up
        for pi, p in enumerate(prompts):
            k = pi % len(configs)
            for i in list(range(len(configs)))[k:] + list(range(len(configs)))[:k]:
                mode, gamma, kw = configs[i]
                s = await client.generate(p.ids, mode, gamma, 0.0, 0, args.max_new_tokens, **kw)
                res[i].append((s.tokens / s.wall_s, s.stats))
            print(f"prompt {pi + 1}/{len(prompts)} done", flush=True)
    finally:
        await client.close()
        await stack.stop()
    ar = [r[0] for r in res[0]]
    print("\n| config | tok/s | × first (paired) | wall s | target busy s | draft busy s | target forwards | "
          "wasted draft |\n|---|---|---|---|---|---|---|---|")
    for i, config in enumerate(args.configs):
        tps, st = [r[0] for r in res[i]], [r[1] for r in res[i]]
        total = {f: sum(s.get(f, 0) for s in st) for f in ("wall_s", "target_busy_s", "draft_busy_s",
                                                           "target_forwards", "wasted_draft_tokens")}
        print(f"| {config} | {statistics.median(tps):.1f} | {statistics.median([a / b for a, b in zip(tps, ar)]):.2f} "
              f"| {total['wall_s']:.2f} | {total['target_busy_s']:.2f} | {total['draft_busy_s']:.2f} | "
              f"{total['target_forwards']} | {total['wasted_draft_tokens']} |")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS,
                    help="MODE[:GAMMA[:OVERLAP[:FIRST]]]; the first is the baseline of the paired ratios")
    ap.add_argument("--n-prompts", type=int, default=3, help="prompts per set (HumanEval, chat)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    asyncio.run(main(ap.parse_args()))
