"""Prompt lookup beside the draft model (on) against the draft model alone (off), in process, interleaved per prompt.

    python scripts/lookup_ab.py --humaneval 8 --chat 8 --max-new-tokens 128
    python scripts/lookup_ab.py --humaneval 4 --chat 4 --temperature 1.0     # sampled (still lossless)
    python scripts/lookup_ab.py --min-ngram 2 --max-ngram 4                  # another lookup

Each mode runs with and without lookup on the same prompts (one engine, 1 thread per model), the order of the
two alternating per prompt; prints median tokens/s, tokens per target forward and the paired on/off ratio per
mode, and checks that greedy outputs with lookup equal those without (lookup changes proposals, never outputs).
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from ab_pair import default_pair_engine  # scripts/ab_pair.py
from specdec.lookup import PromptLookup
from specdec.sampling import SamplingParams
from specdec.schedule import GenerationRequest

MODES = [("ar", 4), ("sd", 2), ("sd", 3), ("sd", 4), ("sd", 6), ("pacer", 8), ("pearl", 8), ("pacer_pearl", 8)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--humaneval", type=int, default=4)
    ap.add_argument("--chat", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--min-ngram", type=int, default=PromptLookup.min_ngram)
    ap.add_argument("--max-ngram", type=int, default=PromptLookup.max_ngram)
    ap.add_argument("--modes", nargs="+", help="e.g. sd:2 pacer:8 (default: all)")
    ap.add_argument("--json", help="write every request's numbers here")
    args = ap.parse_args()
    modes = [(m.split(":")[0], int(m.split(":")[1])) for m in args.modes] if args.modes else MODES
    if ("ar", 4) not in modes:
        modes = [("ar", 4)] + modes
    engine, prompts, eos = default_pair_engine(args.humaneval, args.chat, args.max_new_tokens)
    lookup = PromptLookup(args.min_ngram, args.max_ngram)

    def run(mode: str, gamma: int, ids: list[int], n: int):
        r = engine.generate(GenerationRequest(prompt_ids=list(ids), max_new_tokens=n, mode=mode, gamma=gamma,
                                              params=SamplingParams(temperature=args.temperature, seed=len(ids)),
                                              eos_token_ids=eos))
        return len(r.token_ids) / r.stats.wall_s, r.stats.mean_accepted_length, r.token_ids

    for mode, gamma in modes:  # warm-up
        run(mode, gamma, prompts[0][:20], 8)
    tps: dict[tuple, list[float]] = {}
    acc: dict[tuple, list[float]] = {}
    differ = 0
    rows = []
    for i, ids in enumerate(prompts):
        outs = {}
        for on in (True, False) if i % 2 == 0 else (False, True):
            engine.draft_worker.lookup = lookup if on else None
            for mode, gamma in modes:
                t, a, out = run(mode, gamma, ids, args.max_new_tokens)
                rows.append({"prompt": i, "mode": mode, "gamma": gamma, "lookup": on, "tokens_per_s": t,
                             "tokens_per_forward": a, "looked_up": engine.draft_worker.looked_up_tokens})
                tps.setdefault((mode, gamma, on), []).append(t)
                acc.setdefault((mode, gamma, on), []).append(a)
                outs[(mode, gamma, on)] = out
        if args.temperature == 0:
            differ += sum(outs[(m, g, True)] != outs[(m, g, False)] for m, g in modes)
        print(f"prompt {i + 1}/{len(prompts)} done", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    med = statistics.median
    print(f"\nlookup: min_ngram {args.min_ngram}, max_ngram {args.max_ngram}; T = {args.temperature}; "
          f"{len(prompts)} prompts, {args.max_new_tokens} new tokens")
    print("| mode | tok/s on | tok/s off | on / off (paired) | tokens/forward on | off | × ar, on | × ar, off |\n"
          "|---|---|---|---|---|---|---|---|")
    for mode, gamma in modes:
        a, b = tps[(mode, gamma, True)], tps[(mode, gamma, False)]
        ra = med([x / y for x, y in zip(a, tps[("ar", 4, True)])])
        rb = med([x / y for x, y in zip(b, tps[("ar", 4, False)])])
        name = mode if mode in ("ar", "pacer", "pearl", "pacer_pearl") else f"{mode} γ={gamma}"
        print(f"| {name} | {med(a):.1f} | {med(b):.1f} | {med([x / y for x, y in zip(a, b)]):.3f} | "
              f"{med(acc[(mode, gamma, True)]):.2f} | {med(acc[(mode, gamma, False)]):.2f} | {ra:.2f} | {rb:.2f} |")
    if args.temperature == 0:
        print(f"greedy outputs that differ with lookup: {differ} (bf16 near-ties can flip between schedules)")


if __name__ == "__main__":
    main()
