"""What asking for logprobs costs, side by side in one process (specdec.engine, default pair).

    python scripts/logprobs_cost.py --repeats 3 [--modes ar sd pacer_pearl] [--top 5]

Per mode, the bench's first chat and HumanEval prompts, 128 greedy tokens, each request once without logprobs and
once with `--top` alternatives, alternating which goes first. Prints the median wall time of each and their ratio,
and checks that both return the same tokens.
"""
from __future__ import annotations

import argparse
import statistics
import time


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modes", nargs="+", default=["ar", "sd", "pacer_pearl"])
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args(argv)

    import torch

    from specdec_bench.default_pair import load_default_pair
    from specdec_bench.prompts import load_prompt_sets
    from specdec.engine import Engine
    from specdec.request import GenerationRequest
    from specdec.sampling import SamplingParams
    from specdec.tokenizer import load_tokenizer

    torch.set_num_threads(1)
    target, draft, pv, tdir = load_default_pair()
    eng = Engine(target, draft, preverifier=pv)
    prompts = [p.ids for p in load_prompt_sets(load_tokenizer(tdir), ["chat", "humaneval"], 1)]
    print(f"{len(prompts)} prompts x {args.repeats} repeats, {args.max_new_tokens} greedy tokens, top {args.top}\n")
    print("| mode | without logprobs | with | with / without |\n|---|---|---|---|")
    for mode in args.modes:
        times = {False: [], True: []}
        for rep in range(args.repeats):
            for ids in prompts:
                outs = {}
                for want in ((False, True) if rep % 2 == 0 else (True, False)):
                    req = GenerationRequest(ids, args.max_new_tokens, mode=mode,
                                            params=SamplingParams(logprobs=args.top if want else -1))
                    t0 = time.perf_counter()
                    outs[want] = eng.generate(req).token_ids
                    times[want].append(time.perf_counter() - t0)
                assert outs[False] == outs[True], "logprobs changed the tokens"
        a, b = statistics.median(times[False]), statistics.median(times[True])
        print(f"| {mode} | {a * 1e3:.0f} ms | {b * 1e3:.0f} ms | {b / a:.3f}× |")
    eng.close()


if __name__ == "__main__":
    main()
