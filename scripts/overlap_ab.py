"""Adaptive overlap (`pearl_overlap` auto) against PEARL's overlap throughout (always), in process, beside pacer
and sd, interleaved per prompt.

    python scripts/overlap_ab.py --humaneval 6 --chat 6 --max-new-tokens 128
    python scripts/overlap_ab.py --temperature 1.0   # sampled (seed = the prompt's index)

Greedy by default, 1 thread per model, prompt lookup on (the served default; greedy only); every configuration runs
on every prompt, in
an order that rotates per prompt. Prints median tokens/s, tokens per target forward, the share of rounds run
sequentially, and medians of paired ratios against `ar` and against `always`.
"""
from __future__ import annotations

import argparse
import statistics

from ab_pair import default_pair_engine  # scripts/ab_pair.py
from specdec.lookup import PromptLookup
from specdec.sampling import SamplingParams
from specdec.schedule import GenerationRequest

CONFIGS = [("ar", {}), ("sd", {"gamma": 2}), ("pacer", {}),
           ("pearl", {"pearl_overlap": "always"}), ("pearl", {"pearl_overlap": "auto"}),
           ("pacer_pearl", {"pearl_overlap": "always"}), ("pacer_pearl", {"pearl_overlap": "auto"})]


def name(mode: str, kw: dict) -> str:
    return " ".join([mode] + [f"{k}={v}" for k, v in kw.items()])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--humaneval", type=int, default=4)
    ap.add_argument("--chat", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    args = ap.parse_args()
    engine, prompts, eos = default_pair_engine(args.humaneval, args.chat, args.max_new_tokens, PromptLookup())
    res: dict[str, list] = {}
    for mode, kw in CONFIGS:  # warm-up
        engine.generate(GenerationRequest(prompt_ids=prompts[0][:20], max_new_tokens=8, mode=mode, **kw))
    for i, ids in enumerate(prompts):
        order = CONFIGS[i % len(CONFIGS):] + CONFIGS[:i % len(CONFIGS)]
        for mode, kw in order:
            params = SamplingParams(temperature=args.temperature, seed=i)
            r = engine.generate(GenerationRequest(prompt_ids=list(ids), max_new_tokens=args.max_new_tokens,
                                                  mode=mode, eos_token_ids=eos, params=params, **kw))
            st = r.stats
            res.setdefault(name(mode, kw), []).append(
                (len(r.token_ids) / st.wall_s, st.mean_accepted_length, st.sequential_rounds / max(st.rounds, 1)))
        print(f"prompt {i + 1}/{len(prompts)} done", flush=True)
    med = statistics.median
    ar = [x[0] for x in res["ar"]]
    print(f"\n{len(prompts)} prompts, T = {args.temperature}, {args.max_new_tokens} new tokens, prompt lookup on\n")
    print("| config | tok/s | tokens / forward | sequential rounds | × ar (paired) | × always (paired) |\n"
          "|---|---|---|---|---|---|")
    for mode, kw in CONFIGS:
        rows = res[name(mode, kw)]
        tps = [x[0] for x in rows]
        vs = ""
        if kw.get("pearl_overlap") == "auto":
            base = [x[0] for x in res[name(mode, {"pearl_overlap": "always"})]]
            vs = f"{med([a / b for a, b in zip(tps, base)]):.2f}"
        print(f"| {name(mode, kw)} | {med(tps):.1f} | {med(x[1] for x in rows):.2f} | "
              f"{med(x[2] for x in rows):.0%} | {med([a / b for a, b in zip(tps, ar)]):.2f} | {vs} |")


if __name__ == "__main__":
    main()
