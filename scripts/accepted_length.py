"""Mean accepted length of greedy `sd` per fixed γ on a benchmark prompt set, in process (deterministic: greedy
outputs and counts do not depend on timing, so this may run on a busy machine).

    python scripts/accepted_length.py --prompt-set humaneval --n-prompts 8 --gammas 1 2 3 4 6 --max-new-tokens 128

Mean accepted length = generated tokens / target forwards, pooled over the prompts (the bonus or recovered token
counts), as in `specdec.schedule.GenerationStats`.
"""
from __future__ import annotations

import argparse

from specdec_bench.prompts import load_prompt_sets
from specdec.engine import Engine
from specdec.hub import resolve_model
from specdec.model import load_model_dir
from specdec.schedule import GenerationRequest
from specdec.tokenizer import eos_token_ids, load_tokenizer


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target-model", default="default-target")
    ap.add_argument("--draft-model", default="default-draft")
    ap.add_argument("--prompt-set", default="humaneval")
    ap.add_argument("--n-prompts", type=int, default=8)
    ap.add_argument("--gammas", nargs="+", type=int, default=[1, 2, 3, 4, 6])
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args(argv)
    tdir, ddir = resolve_model(args.target_model), resolve_model(args.draft_model)
    tok = load_tokenizer(tdir)
    prompts = load_prompt_sets(tok, [args.prompt_set], args.n_prompts)
    eos = tuple(sorted(eos_token_ids(tdir)))
    engine = Engine(load_model_dir(tdir, dtype="auto", role="target"),
                    load_model_dir(ddir, dtype="auto", role="draft"), threads_per_model=1, max_sessions=2)
    print(f"{len(prompts)} {args.prompt_set} prompts, greedy, {args.max_new_tokens} new tokens\n")
    print("| γ | generated tokens | target forwards | mean accepted length | accepted / drafted |")
    print("|---|---|---|---|---|")
    for g in args.gammas:
        gen = fwd = acc = drafted = 0
        for p in prompts:
            req = GenerationRequest(prompt_ids=list(p.ids), max_new_tokens=args.max_new_tokens, mode="sd",
                                    gamma=g, eos_token_ids=eos)
            res = engine.generate(req)
            gen += len(res.token_ids)
            fwd += res.stats.target_forwards
            acc += res.stats.accepted_tokens
            drafted += res.stats.draft_tokens
        print(f"| {g} | {gen} | {fwd} | {gen / fwd:.3f} | {acc / max(drafted, 1):.3f} |", flush=True)


if __name__ == "__main__":
    main()
