"""What the pre-verifier adds to a draft token, measured in the draft worker's own loop (docs/pacer.md,
"Pre-verifier cost").

    python scripts/preverifier_cost.py --tokens 8 --repeats 30

Drafts `--tokens` greedy tokens per round with the shipped draft, three ways interleaved per repeat: no stop rule
(`FixedLength`), the shipped pre-verifier through the round scorer (what `PreverifierStop` runs), and through the
full `block_accept_prob` per block (the path before the scorer). θ = 0, so every way drafts the same tokens.
Prints the median ms per drafted token of each and the overhead over no stop rule. 1 thread.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdec.model import load_model
from specdec.preverifier import load_preverifier
from specdec.sampling import SamplingParams
from specdec.stop import FixedLength, PreverifierStop
from specdec.workers import DraftWorker


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draft", default="default-draft")
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--context", type=int, default=200)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    draft = load_model(args.draft, dtype="auto", role="draft", quant="auto")
    pv = load_preverifier(None, draft_model=draft)
    worker = DraftWorker(draft, preverifier=pv, max_sessions=2, max_context=args.context + 4 * args.tokens + 8)
    prompt = torch.randint(0, 1000, (args.context,), generator=torch.Generator().manual_seed(0)).tolist()
    worker.start_session("s", prompt, SamplingParams(temperature=0.0))

    def full_path_rule():
        rule = PreverifierStop(pv, 0.0)
        rule._scorer = None  # every block through block_accept_prob
        return rule

    ways = {"no stop rule": FixedLength, "pre-verifier (round scorer)": lambda: PreverifierStop(pv, 0.0),
            "pre-verifier (full call per block)": full_path_rule}
    times: dict[str, list[float]] = {k: [] for k in ways}
    for rep in range(args.repeats + 2):
        for name, make in ways.items():
            t = time.perf_counter()
            blk = worker.draft("s", len(prompt) - 1, [prompt[-1]], args.tokens, make(), block_size=1)
            dt = (time.perf_counter() - t) / len(blk.tokens)
            if rep >= 2:  # warm-up rounds
                times[name].append(dt)
    base = statistics.median(times["no stop rule"])
    print(f"| way | ms per drafted token | overhead |  ({args.tokens} tokens per round, B = 1, median of "
          f"{args.repeats})\n|---|---|---|")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"| {name} | {m * 1e3:.2f} | {'–' if name == 'no stop rule' else f'+{(m - base) * 1e3:.2f} ms'} |")


if __name__ == "__main__":
    main()
