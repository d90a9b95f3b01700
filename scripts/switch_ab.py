"""One serving switch on against off, in process, on the benchmark's prompts, every mode interleaved per prompt.

    python scripts/switch_ab.py --switch lookup-forward --humaneval 4 --chat 4  # looked-up: no forward / one each
    python scripts/switch_ab.py --switch row-padding --humaneval 4 --chat 4     # tuned row padding / none
    python scripts/switch_ab.py --switch native-kernels --humaneval 4 --chat 4  # C kernels / torch

- `lookup-forward`: the draft drafts a looked-up token without a forward, the next forward feeding the run
  (`DraftWorker.lookup_without_forward`, on) against a forward per drafted token (off). Prompt lookup is on in
  both arms.
- `row-padding`: every linear's tuned `pad_to` (specdec/linear.py, on) against none (off), target and draft.
- `native-kernels`: specdec/native.py's C kernels (decode attention, RMSNorm with its residual add; on) against
  the torch path (off), target and draft. bf16 rounding differs between the two, so a prompt's greedy output (and
  its length) may differ between the arms at near-ties.

Greedy, 1 thread per model, prompt lookup on (the served default). Every (mode, arm) runs on every prompt, in an
order that rotates per prompt. Prints median tokens/s per arm, tokens per target forward, the draft's share of
wall time, medians of paired ratios on ÷ off, and of each arm against `ar` (on).
"""
from __future__ import annotations

import argparse
import statistics

from ab_pair import default_pair_engine  # scripts/ab_pair.py
from specdec import native
from specdec.linear import Linear
from specdec.lookup import PromptLookup
from specdec.schedule import GenerationRequest

MODES = [("ar", {}), ("sd", {"gamma": 3}), ("sd", {"gamma": 4}), ("pacer", {}), ("pacer_pearl", {})]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--switch", choices=("lookup-forward", "row-padding", "native-kernels"), required=True)
    ap.add_argument("--humaneval", type=int, default=4)
    ap.add_argument("--chat", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()
    engine, prompts, eos = default_pair_engine(args.humaneval, args.chat, args.max_new_tokens, PromptLookup())
    linears = [m for w in (engine.target_worker, engine.draft_worker) for m in w.model.modules()
               if isinstance(m, Linear)]
    tuned = {id(m): m.pad_to for m in linears}

    def switch(on: bool) -> None:
        if args.switch == "lookup-forward":
            engine.draft_worker.lookup_without_forward = on
        elif args.switch == "native-kernels":
            native.ENABLED = on
        else:
            for m in linears:
                m.pad_to = tuned[id(m)] if on else None

    runs = [(mode, kw, on) for mode, kw in MODES for on in (True, False)]
    for mode, kw, on in runs:  # warm-up
        switch(on)
        engine.generate(GenerationRequest(prompt_ids=prompts[0][:20], max_new_tokens=8, mode=mode, **kw))
    res: dict[tuple, list] = {}
    for i, ids in enumerate(prompts):
        for mode, kw, on in runs[i % len(runs):] + runs[:i % len(runs)]:
            switch(on)
            r = engine.generate(GenerationRequest(prompt_ids=list(ids), max_new_tokens=args.max_new_tokens,
                                                  mode=mode, eos_token_ids=eos, **kw))
            st = r.stats
            res.setdefault((mode, str(kw), on), []).append(
                (len(r.token_ids) / st.wall_s, st.mean_accepted_length, st.draft_busy_s / st.wall_s))
        print(f"prompt {i + 1}/{len(prompts)} done", flush=True)
    med = statistics.median
    ar = [x[0] for x in res[("ar", "{}", True)]]
    print(f"\n{args.switch}: {len(prompts)} prompts, greedy, {args.max_new_tokens} new tokens, prompt lookup on\n")
    print("| mode | tok/s on / off | on ÷ off (paired) | × ar, on / off | tokens per forward | draft share of wall "
          "| on ÷ off per prompt |\n|---|---|---|---|---|---|---|")
    for mode, kw in MODES:
        on, off = res[(mode, str(kw), True)], res[(mode, str(kw), False)]
        name = " ".join([mode] + [f"{k}={v}" for k, v in kw.items()])
        print(f"| {name} | {med(x[0] for x in on):.1f} / {med(x[0] for x in off):.1f} | "
              f"{med(a[0] / b[0] for a, b in zip(on, off)):.3f} | "
              f"{med(a[0] / b for a, b in zip(on, ar)):.2f} / {med(a[0] / b for a, b in zip(off, ar)):.2f} | "
              f"{med(x[1] for x in on):.2f} / {med(x[1] for x in off):.2f} | "
              f"{med(x[2] for x in on):.2f} / {med(x[2] for x in off):.2f} | "
              + " ".join(f"{a[0] / b[0]:.2f}" for a, b in zip(on, off)) + " |")


if __name__ == "__main__":
    main()
