"""`python -m specdec_train.preverifier eval`: a trained pre-verifier on any label files, against fixed γ and a perfect
stop rule, in the same simulation `train` tunes θ with (docs/design/pacer.md, "Evaluating on another domain").

Training reports its metrics on its own test split; a pre-verifier is served on other text (the benchmark's code
and chat turns). This scores a saved pre-verifier, unchanged, on rounds from elsewhere (e.g. a domain it did not
train on), so that how its AUC and its simulated gain over the best fixed γ transfer can be read before a timed
ablation. The θ that would have been best on these rounds is reported too, as a diagnosis of calibration drift,
never as a choice (choose θ on the dev split).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from specdec.decoding.preverifier import load_preverifier
from specdec.decoding.stop import DraftFeatures
from specdec.engine import Engine
from specdec.modeling.model import load_model
from specdec.scheduling.request import GenerationRequest
from specdec_train.preverifier import data as D, train as T
from specdec_train.preverifier.bench import benchmark_prompts, encode
from specdec_train.preverifier.collect_tf import measure_costs


def evaluate(pv, rounds: list[dict], costs: T.Costs, gamma_max: int = 12,
             gammas=(1, 2, 3, 4, 6, 8)) -> dict:
    """Greedy rounds only (hard labels): AUC of the block score at the pre-verifier's B, the simulated
    tokens/s at its own B / score mode / θ, the best fixed γ, the perfect stop rule, and the best θ here."""
    rounds = [r for r in rounds if r["temperature"] == 0.0]
    if not rounds:
        raise ValueError("no greedy rounds in these files (eval simulates greedy decoding)")
    head = pv if pv.use_head else None
    tab = T.attach_starts(T.round_table(pv, T.to_tokenset(rounds, pv.use_head, head, pv.use_margin)), rounds)
    B, mode = pv.block_size, pv.score_mode
    score, lab, reached = T.block_scores(tab, B, "block")
    fixed = max((T.simulate(tab, costs, None, None, g) | {"gamma": g} for g in gammas),
                key=lambda r: r["tokens_per_s"])
    own = T.simulate(tab, costs, B, pv.threshold, gamma_max, mode)
    best_theta, best = T.tune_threshold(tab, costs, B, gamma_max, mode)
    oracle = T.simulate(tab, costs, None, None, gamma_max, oracle=True)
    ft = fixed["tokens_per_s"]
    return {
        "exact_replay": tab.exact, "rounds": len(rounds), "tokens": int(sum(r["tokens"].shape[0] for r in rounds)),
        "mean_token_label": float(tab.label.mean()),
        "block_size": B, "score_mode": mode, "threshold": pv.threshold,
        "auc_all_blocks": T.weighted_auc(score, lab), "auc_reached_blocks": T.weighted_auc(score, lab, reached),
        "at_threshold": T.classification_report(score, lab, pv.threshold, reached),
        "preverifier": own | {"gain_vs_best_fixed": own["tokens_per_s"] / ft},
        "best_fixed": fixed,
        "oracle_stop": oracle | {"gain_vs_best_fixed": oracle["tokens_per_s"] / ft},
        "best_threshold_here": {"theta": best_theta, "gain_vs_best_fixed": best["tokens_per_s"] / ft},
    }


def costs_of(metas: list[dict], measured: dict | None, preverifier_s: float) -> T.Costs:
    mc = measured or next((m["costs"] for m in metas if m.get("costs")), None)
    if not mc:
        raise ValueError("the label files record no costs; pass --measure-costs")
    c = T.Costs(mc["draft_token_s"], mc["target_base_s"], mc["target_per_token_s"])
    c.preverifier_s = mc.get("preverifier_s", preverifier_s)
    return c


def format_report(name: str, r: dict) -> str:
    p, f, o, b = r["preverifier"], r["best_fixed"], r["oracle_stop"], r["best_threshold_here"]
    return (f"{name}: {r['rounds']} greedy rounds ({'exact replay' if r['exact_replay'] else 'round average'}), "
            f"mean token label {r['mean_token_label']:.3f} | AUC (B={r['block_size']}) all "
            f"{r['auc_all_blocks']:.3f} reached {r['auc_reached_blocks']:.3f} | best fixed γ={f['gamma']} "
            f"τ={f['mean_accepted_length']:.2f}; pre-verifier θ={r['threshold']:.2f} "
            f"τ={p['mean_accepted_length']:.2f} len={p['mean_draft_len']:.2f} ×{p['gain_vs_best_fixed']:.3f}; "
            f"oracle ×{o['gain_vs_best_fixed']:.3f}; best θ here {b['theta']:.2f} ×{b['gain_vs_best_fixed']:.3f}")


def benchmark_rows(target, draft, tok, counts=(8, 8), max_new_tokens: int = 128) -> list[dict]:
    """The ablation's prompts (`counts` = HumanEval, chat) with the target's greedy continuation, as `collect`
    rows, for diagnosis only: how a saved pre-verifier and the replay fare on the benchmark's own text."""
    prompts = [encode(tok, item) for _, item in benchmark_prompts(*counts)]
    engine = Engine(target, draft, max_sessions=1, max_context=max(map(len, prompts)) + max_new_tokens + 8)
    try:
        return [{"prompt_ids": ids, "prompt": i, "split": "test", "temperature": 0.0,
                 "completion_ids": engine.generate(GenerationRequest(ids, max_new_tokens=max_new_tokens,
                                                                     mode="ar")).token_ids}
                for i, ids in enumerate(prompts)]
    finally:
        engine.close()


def time_preverifier_call(model, hidden_size: int, B: int, gamma: int = 12, reps: int = 200) -> float:
    """Seconds per `block_accept_prob` call in isolation (a lower bound: the drafting loop's is 2-4x)."""
    f = DraftFeatures(hidden=torch.randn(gamma, hidden_size), tokens=torch.randint(0, 1000, (gamma,)),
                      logq=-torch.rand(gamma), entropy=torch.rand(gamma), block_start=gamma - B,
                      margin=torch.rand(gamma))
    for _ in range(10):
        model.block_accept_prob(f)
    t0 = time.perf_counter()
    for _ in range(reps):
        model.block_accept_prob(f)
    return (time.perf_counter() - t0) / reps


def cmd_eval(args) -> None:
    """`python -m specdec_train.preverifier eval` (the parser is in __main__)."""
    torch.set_num_threads(args.threads)
    rounds, metas = D.load_rounds(args.data)
    rounds = [r for r in rounds if args.split == "all" or r["split"] == args.split]
    draft = load_model(args.draft, dtype="auto", role="draft")
    if not args.measure_costs:
        print("costs: the label files' (measured at collection, with an isolated pre-verifier call); "
              "--measure-costs times the drafting loop with each pre-verifier, which the replay needs to match "
              "measured runs", flush=True)
    out = {}
    for path in args.preverifier:
        pv = load_preverifier(path, draft_model=draft)
        measured = None
        if args.measure_costs:
            measured = measure_costs(draft, load_model(args.target, dtype="auto", role="target"), 12, preverifier=pv)
        costs = costs_of(metas, measured, time_preverifier_call(pv, pv.hidden_size, pv.block_size))
        name = str(path or "shipped")
        out[name] = evaluate(pv, rounds, costs) | {"costs": vars(costs)}
        print(format_report(name, out[name]), flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"data": [str(p) for p in args.data], "split": args.split,
                                               "results": out}, indent=2) + "\n")
