"""Why prefills run in aligned chunks, and what the chunks cost (default target, as served, one thread).

    python scripts/prefill_chunks.py [--repeats 5]

1. Rounding: a prompt prefilled in one forward against the same prompt prefilled in two (a cut, then the rest),
   on random token ids. Prints the first position whose K/V differs in any bit. A prefix cache that reused a
   prefix computed by one prefill under a prompt whose cold prefill is a single forward would change those bits
   (and, at greedy near-ties, the output); with aligned chunks a warm prefill is the tail of a cold one.
2. Cost: the median time of a prefill of 150, 500 and 1000 positions in one forward and in chunks of 32-256.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)

    import torch

    from specdec.hub import resolve_model
    from specdec.model import load_model_dir
    from specdec.sampling import SamplingParams
    from specdec.workers import TargetWorker

    torch.set_num_threads(1)
    model = load_model_dir(resolve_model("default-target"), dtype="auto", role="target")
    w = TargetWorker(model, max_sessions=3, max_context=2048, prefix_cache=False, prefill_chunk=0)
    params, rng = SamplingParams(), random.Random(0)

    def prefill(sid, toks, cuts):
        s = w.open_session(sid, toks + [1], params, reuse=False)
        t0 = time.perf_counter()
        for a, b in zip([0] + cuts, cuts + [len(toks)]):
            w._feed(s, a, toks[a:b], logits_rows=slice(-1, None))
        return s, time.perf_counter() - t0

    print(f"dtype {model.dtype}\n\n| prompt | cut | first position whose K/V differs |\n|---|---|---|")
    for n, cut in [(52, 32), (100, 64), (150, 128), (300, 256), (40, 32), (70, 64)]:
        toks = [rng.randrange(1000, 40000) for _ in range(n)]
        a, _ = prefill("a", toks, [])
        b, _ = prefill("b", toks, [cut])
        first = None
        for t in w.kv.k + w.kv.v:
            diff = (t[a.slot, :n].float() - t[b.slot, :n].float()).abs().amax(dim=(1, 2)).nonzero().flatten()
            if len(diff):
                first = int(diff[0]) if first is None else min(first, int(diff[0]))
        print(f"| {n} | {cut} | {'none' if first is None else first} |")
        w.end_session("a")
        w.end_session("b")

    sizes = [0, 32, 64, 128, 256]
    print("\n| positions | " + " | ".join("one forward" if c == 0 else f"chunks of {c}" for c in sizes) + " |")
    print("|---|" + "---|" * len(sizes))
    for n in (150, 500, 1000):
        toks = [rng.randrange(1000, 40000) for _ in range(n)]
        times = {c: [] for c in sizes}
        for _ in range(args.repeats):  # interleaved: drift hits every chunk size alike
            for c in sizes:
                times[c].append(prefill("a", toks, list(range(c, n, c)) if c else [])[1])
                w.end_session("a")
        base = statistics.median(times[0])
        print(f"| {n} | " + " | ".join(f"{statistics.median(v) * 1e3:.0f} ms ({statistics.median(v) / base:.2f}x)"
                                      for v in times.values()) + " |")


if __name__ == "__main__":
    main()
