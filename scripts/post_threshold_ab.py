"""pacer_pearl through the embedded gRPC/Ray stack at several θ_post (the pre-verifier's threshold for drafting in
a verify's shadow), interleaved per prompt, greedy: which default suits a host where draft and target share cores.

    python scripts/post_threshold_ab.py --thetas 0.3 0.6 0.9 --humaneval 4 --chat 4 --repeats 2

Each request sets `pacer_post_threshold`; the order of the θ values rotates per prompt. Prints median tokens/s per
θ and the medians of the paired ratios against the first θ.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics

import torch


async def run(args) -> None:
    from coordinator.stack import LocalStack
    from specdec_bench.runners import StackClient
    from specdec.defaults import DEFAULT_DRAFT, DEFAULT_TARGET
    from specdec.hub import resolve_model
    from specdec_train.preverifier.bench import benchmark_prompts, encode
    from specdec.preverifier import DEFAULT_PREVERIFIER_DIR
    from specdec.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model(DEFAULT_TARGET))
    prompts = [encode(tok, item) for _, item in benchmark_prompts(args.humaneval, args.chat)]
    async with LocalStack(DEFAULT_TARGET, DEFAULT_DRAFT, str(DEFAULT_PREVERIFIER_DIR), threads=1) as stack:
        client = StackClient(stack.address)
        await client.generate(prompts[0][:20], "pacer_pearl", None, 0.0, 0, 8)  # warm-up
        tps: dict[float, list[float]] = {t: [] for t in args.thetas}
        for rep in range(args.repeats):
            for i, ids in enumerate(prompts):
                k = (i + rep) % len(args.thetas)
                for theta in args.thetas[k:] + args.thetas[:k]:
                    s = await client.generate(ids, "pacer_pearl", None, 0.0, rep, args.max_new_tokens,
                                              pacer_post_threshold=theta)
                    tps[theta].append(s.tokens_per_s)
            print(f"repeat {rep + 1}/{args.repeats} done", flush=True)
        await client.close()
    base = args.thetas[0]
    print(f"| θ_post | tok/s (median of {len(tps[base])}) | paired ratio vs {base} |\n|---|---|---|")
    for t in args.thetas:
        ratio = statistics.median(a / b for a, b in zip(tps[t], tps[base]))
        print(f"| {t} | {statistics.median(tps[t]):.1f} | {ratio:.2f} |")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--thetas", type=float, nargs="+", default=[0.3, 0.6, 0.9])
    ap.add_argument("--humaneval", type=int, default=4)
    ap.add_argument("--chat", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
