"""Per-round streams on and off through the embedded stack, against the same schedule in one process, greedy.

    python scripts/round_streams_ab.py --modes sd pacer pacer_pearl --humaneval 8 --chat 8 --repeats 1

One stack (draft and target servers, 1 thread each; the coordinator's pipeline in this process, `--no-ray`, so the
switch `Pipeline.replica_streams` can flip between requests). For each prompt, every (mode, streams on / off,
in-process) configuration runs once, in an order that rotates per prompt. Prints median tokens/s, the paired
ratio streams on / off, each stack configuration's slowdown against its in-process twin (1 - paired median of
stack ÷ in-process, as `specdec_bench` reports it), and the network time per round the coordinator reports
(wall time inside replica calls minus the compute the replicas report; `GenerationStats.network_s`).
"""
from __future__ import annotations

import argparse
import asyncio
import statistics

import torch


async def run(args) -> None:
    from coordinator.stack import LocalStack
    from specdec_bench.runners import Config, EngineRunner, StackClient
    from specdec.defaults import DEFAULT_DRAFT, DEFAULT_TARGET
    from specdec.engine import Engine
    from specdec.hub import resolve_model
    from specdec.model import load_model_dir
    from specdec_train.preverifier.bench import benchmark_prompts, encode
    from specdec.preverifier import DEFAULT_PREVERIFIER_DIR, load_preverifier
    from specdec.tokenizer import eos_token_ids, load_tokenizer

    target_dir, draft_dir = resolve_model(DEFAULT_TARGET), resolve_model(DEFAULT_DRAFT)
    tok = load_tokenizer(target_dir)
    eos = tuple(sorted(eos_token_ids(target_dir)))
    prompts = [encode(tok, item) for _, item in benchmark_prompts(args.humaneval, args.chat)]
    draft = load_model_dir(draft_dir, dtype="auto", role="draft")
    engine = Engine(load_model_dir(target_dir, dtype="auto", role="target"), draft,
                    preverifier=load_preverifier(DEFAULT_PREVERIFIER_DIR, draft_model=draft), max_sessions=2,
                    max_context=max(map(len, prompts)) + args.max_new_tokens + 64, threads_per_model=1)
    configs = [(m, p) for m in args.modes for p in ("streams", "unary", "in-process")]
    tps: dict[tuple[str, str], list[float]] = {c: [] for c in configs}
    net: dict[tuple[str, str], list[float]] = {c: [] for c in configs}  # network ms per round
    async with LocalStack(str(target_dir), str(draft_dir), str(DEFAULT_PREVERIFIER_DIR), threads=1,
                          use_ray=False) as stack:
        client = StackClient(stack.address)
        pipeline = stack.router.pipeline
        runners = {m: EngineRunner(engine, Config(m, "engine", m, 1, args.gamma if m == "sd" else None), eos)
                   for m in args.modes}
        for m in args.modes:  # warm-up, every path
            for streams in (True, False):
                pipeline.replica_streams = streams
                await client.generate(prompts[0][:20], m, args.gamma if m == "sd" else None, 0.0, 0, 8)
            await runners[m].run(prompts[0][:20], 0.0, 0, 8)
        for rep in range(args.repeats):
            for i, ids in enumerate(prompts):
                k = (i + rep) % len(configs)
                for mode, place in configs[k:] + configs[:k]:
                    if place == "in-process":
                        s = await runners[mode].run(ids, 0.0, rep, args.max_new_tokens)
                    else:
                        pipeline.replica_streams = place == "streams"
                        s = await client.generate(ids, mode, args.gamma if mode == "sd" else None, 0.0, rep,
                                                  args.max_new_tokens)
                    tps[mode, place].append(s.tokens_per_s)
                    if place != "in-process":
                        net[mode, place].append(1e3 * s.stats["network_s"] / max(1, s.stats["rounds"]))
                print(f"prompt {i + 1}/{len(prompts)} of repeat {rep + 1} done", flush=True)
        await client.close()
    engine.close()

    def paired(a, b):
        return statistics.median(x / y for x, y in zip(tps[a], tps[b]))

    n = len(tps[configs[0]])
    print("\n| mode | streams tok/s | unary tok/s | in-process tok/s | streams ÷ unary (paired) | "
          "stack slowdown, streams | stack slowdown, unary | network ms / round, streams | unary |\n"
          "|---|---|---|---|---|---|---|---|---|")
    for m in args.modes:
        med = {p: statistics.median(tps[m, p]) for p in ("streams", "unary", "in-process")}
        label = f"sd γ={args.gamma}" if m == "sd" else m
        print(f"| {label} | {med['streams']:.1f} | {med['unary']:.1f} | {med['in-process']:.1f} | "
              f"{paired((m, 'streams'), (m, 'unary')):.3f} | "
              f"{100 * (1 - paired((m, 'streams'), (m, 'in-process'))):+.1f} % | "
              f"{100 * (1 - paired((m, 'unary'), (m, 'in-process'))):+.1f} % | "
              f"{statistics.median(net[m, 'streams']):.2f} | {statistics.median(net[m, 'unary']):.2f} |")
    print(f"\n{n} requests per configuration, {args.max_new_tokens} new tokens, greedy")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", nargs="+", default=["sd", "pacer", "pacer_pearl"])
    ap.add_argument("--gamma", type=int, default=2, help="sd's draft length")
    ap.add_argument("--humaneval", type=int, default=8)
    ap.add_argument("--chat", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
