"""Does the target's greedy output depend on the load? Each prompt decoded alone (one row per forward) against the
same prompts decoded as one batch (a row each, one forward for all), under several kernel choices for the target's
bf16 linears.

    python experiments/row_invariance.py --humaneval 4 --chat 4 --tokens 48

Configurations: row-invariant (the default: no one-row oneDNN call, torch.mv only where the
load-time check passes), and with it off: the plan tuning picked, one-row calls on torch.mv, one-row calls on
oneDNN unpadded. Prints, per
configuration, the prompts whose batched text differs from their text alone and at which token.
"""
from __future__ import annotations

import argparse

import torch

from specdec.common.threads import set_thread_count
from specdec.decoding.sampling import SamplingParams
from specdec.modeling.linear import Linear, check_row_invariance
from specdec.modeling.model import load_model
from specdec.workers.target import TargetWorker, VerifyArgs
from specdec_bench.prompts import default_target_prompts


def greedy(model, prompts, group: list[int], n: int) -> dict[int, list[int]]:
    w = TargetWorker(model, max_sessions=len(group) + 1, max_context=2048)
    out = {}
    for k in group:
        w.start_session(f"s{k}", prompts[k], SamplingParams())
        out[k] = [prompts[k][-1]]
    pos = {k: len(prompts[k]) - 1 for k in group}
    for _ in range(n):
        res = w.verify_batch([VerifyArgs(f"s{k}", pos[k], [out[k][-1]], [], None, "greedy") for k in group])
        for k, r in zip(group, res):
            if isinstance(r, Exception):
                raise r
            pos[k] += 1
            out[k].append(r.next_token)
    return {k: v[1:] for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--humaneval", type=int, default=4)
    ap.add_argument("--chat", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args()

    set_thread_count(1)
    tdir, chosen = default_target_prompts(args.humaneval, args.chat)
    prompts = [p.ids for p in chosen]
    model = load_model(str(tdir), "cpu", torch.bfloat16, role="target")
    lins = [m for m in model.modules() if isinstance(m, Linear)]
    tuned = [(m.plan, m.pad_to) for m in lins]
    configs = {"row-invariant (default)": (True, None), "off, as tuned": (False, None),
               "off, one row on torch.mv": (False, ("gemv", "packed", "packed", "packed")),
               "off, one row on oneDNN unpadded": (False, ("packed",) * 4)}
    print(f"{len(prompts)} prompts, {args.tokens} greedy tokens; tuned plans: {sorted({p for p, _ in tuned}, key=str)}")
    for name, (invariant, plan) in configs.items():
        for m, (p, pad) in zip(lins, tuned):
            m.row_invariant = invariant
            m.plan, m.pad_to = (p, pad) if plan is None else (plan, None)
        alone = {k: greedy(model, prompts, [k], args.tokens)[k] for k in range(len(prompts))}
        batched = greedy(model, prompts, list(range(len(prompts))), args.tokens)
        diff = {chosen[k].key: next(i for i, (a, b) in enumerate(zip(alone[k], batched[k])) if a != b)
                for k in alone if alone[k] != batched[k]}
        print(f"- {name}: load-time check fails on {check_row_invariance(model) if invariant else '(off)'}; "
              f"batched differs from alone: {diff or 'none'}")


if __name__ == "__main__":
    main()
