"""What penalties cost speculation: tokens per target forward and wall time, with and without (in process).

    python scripts/penalties_cost.py [--modes sd pacer] [--repeats 3]

Default pair, the bench's first two chat and HumanEval prompts, 128 greedy tokens; each request without and with
presence 0.5, frequency 0.25 and repetition 1.25 (scripts/soak.py's), alternating which goes first. Both the
target and the draft apply them (specdec/penalties.py); what is left of their cost is acceptance where the draft
still guesses wrong, and the adjustments' own time. Prints per mode the medians of tokens per target forward and
of wall time.
"""
from __future__ import annotations

import argparse
import statistics
import time


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", nargs="+", default=["sd", "pacer"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--n-prompts", type=int, default=2, help="per prompt set")
    ap.add_argument("--lookup", type=int, default=0, help="prompt lookup's min n-gram (0: off; the draft replica's "
                                                          "default is 3)")
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
    from specdec.lookup import prompt_lookup

    eng = Engine(target, draft, preverifier=pv, threads_per_model=1, prefix_cache=False,
                 lookup=prompt_lookup(args.lookup))
    prompts = load_prompt_sets(load_tokenizer(tdir), ["chat", "humaneval"], args.n_prompts)
    kinds = {"plain": SamplingParams(), "penalties": SamplingParams(presence_penalty=0.5, frequency_penalty=0.25,
                                                                     repetition_penalty=1.25)}
    print("| mode | tokens per target forward: plain / penalties | wall (s): plain / penalties | ratio |")
    print("|---|---|---|---|")
    for mode in args.modes:
        rows = {k: {"tpf": [], "wall": []} for k in kinds}
        for rep in range(args.repeats):
            for i, p in enumerate(prompts):
                order = list(kinds) if (rep + i) % 2 == 0 else list(kinds)[::-1]
                for k in order:
                    t0 = time.perf_counter()
                    res = eng.generate(GenerationRequest(p.ids, 128, mode=mode, params=kinds[k]))
                    rows[k]["wall"].append(time.perf_counter() - t0)
                    rows[k]["tpf"].append(len(res.token_ids) / max(res.stats.target_forwards, 1))
        med = {k: {m: statistics.median(v) for m, v in r.items()} for k, r in rows.items()}
        print(f"| {mode} | {med['plain']['tpf']:.2f} / {med['penalties']['tpf']:.2f} | "
              f"{med['plain']['wall']:.2f} / {med['penalties']['wall']:.2f} | "
              f"{med['penalties']['wall'] / med['plain']['wall']:.2f}x |")
    eng.close()


if __name__ == "__main__":
    main()
