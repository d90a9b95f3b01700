"""python -m specdec_train.preverifier {collect,train,eval,run,ablate} ... (see --help and docs/design/pacer.md)."""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

import torch

from specdec.decoding.preverifier import Preverifier, derive_threshold, draft_dir_sha256, save_preverifier
from specdec.modeling.hub import resolve_model
from specdec.modeling.model import load_model_dir
from specdec.modeling.model import draft_fingerprint
from specdec.text.tokenizer import eos_token_ids, load_tokenizer
from specdec_train.distill.__main__ import main as distill_main
from specdec_train.distill.data import require_samples
from specdec_train.preverifier import data as D, train as T
from specdec_train.preverifier.bench import add_args, run_ablation
from specdec_train.preverifier.collect import collect
from specdec_train.preverifier.collect_tf import collect_tf, measure_costs
from specdec_train.preverifier.evaluate import benchmark_rows, cmd_eval, time_preverifier_call


def _load_pair(args):
    tdir, ddir = Path(resolve_model(args.target)), Path(resolve_model(args.draft))
    # the dtypes the services pick (`auto`), so labels and measured costs are those of the served pair
    return (load_model_dir(tdir, dtype="auto", role="target"), load_model_dir(ddir, dtype="auto", role="draft"),
            tdir, ddir)


def cmd_collect(args) -> Path:
    if args.prompts != "benchmark":
        require_samples([args.prompts], "--prompts")

    torch.set_num_threads(args.threads)
    target, draft, tdir, ddir = _load_pair(args)
    tok = load_tokenizer(tdir)
    exclude = D.benchmark_prompt_ids(tok) if tok is not None else set()
    temps = tuple(float(t) for t in args.temperatures.split(","))
    t_start = time.time()

    def progress(i, n, r, s):
        if i % 20 == 0 or i == n:
            print(f"  {i}/{n}: {r} rounds, {s:.0f}s", flush=True)

    if args.method == "tf" and draft.config.feature_size:
        raise SystemExit("--method tf cannot label a feature draft (inside a round its inputs depend on which target "
                         "features are known, which one teacher-forced pass cannot reproduce); use --method workers")
    if args.method == "tf":
        if args.prompts == "benchmark":  # diagnosis only: `train` refuses these files
            rows = benchmark_rows(target, draft, tok, args.benchmark_prompts, args.max_new_tokens)
            exclude = set()
        else:
            rows = D.training_rows(Path(args.prompts), exclude, temps, args.num_prompts, args.seed, args.skip)
        print(f"teacher-forced collection on {len(rows)} continuations (excluded {len(exclude)} benchmark prompts), "
              f"temperatures {temps}, gamma_max {args.gamma_max}", flush=True)
        out = collect_tf(draft, rows, gamma_max=args.gamma_max, target_model=target, seed=args.seed,
                         walk_gamma=args.walk_gamma,
                         time_budget_s=args.time_budget, greedy_labels_from=args.greedy_labels, progress=progress)
        costs = measure_costs(draft, target, args.gamma_max)
        n_tokens = sum(len(r["completion_ids"]) for r in rows)
    else:
        prompts = D.training_prompts(Path(args.prompts), exclude)
        g = torch.Generator().manual_seed(args.seed)
        order = torch.randperm(len(prompts), generator=g).tolist()
        prompts = [prompts[i] for i in order][args.skip:args.skip + args.num_prompts]
        eos = tuple(sorted(eos_token_ids(tok))) if tok is not None else ()
        print(f"worker collection on {len(prompts)} prompts (excluded {len(exclude)} benchmark prompts), "
              f"temperatures {temps}, gamma_max {args.gamma_max}, budget {args.time_budget}s", flush=True)
        rounds, st = collect(draft, target, prompts, gamma_max=args.gamma_max, temperatures=temps,
                             max_new_tokens=args.max_new_tokens, seed=args.seed, time_budget_s=args.time_budget,
                             eos_token_ids=eos, progress=progress)
        out = [dict(r.to_dict(), split=D.split_of(prompts[r.prompt])) for r in rounds]
        costs = None
        n_tokens = st.tokens
    src = Path(args.draft_source) if args.draft_source else ddir
    meta = {"method": args.method, "draft": str(src), "draft_sha256": draft_dir_sha256(src), "target": str(tdir),
            "draft_loaded_from": str(ddir), "draft_fingerprint": draft_fingerprint(draft),
            "gamma_max": args.gamma_max, "temperatures": temps,
            "walk_gamma": args.gamma_max if args.walk_gamma is None else args.walk_gamma,
            "max_new_tokens": args.max_new_tokens,
            "num_prompts": args.num_prompts, "prompt_source": str(args.prompts), "skip": args.skip,
            "seed": args.seed, "excluded_benchmark_prompts": len(exclude), "seconds": time.time() - t_start,
            "greedy_labels": args.greedy_labels, "diagnostic_only": args.prompts == "benchmark",
            "tokens": n_tokens, "threads": args.threads, "costs": costs}
    path = Path(args.out)
    D.save_rounds(out, path, meta)
    print(f"wrote {len(out)} rounds ({n_tokens} tokens, {meta['seconds']:.0f}s) to {path}; costs {costs}", flush=True)
    return path


def cmd_train(args) -> dict:
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    for f in [*args.hash_split, *args.tune_data]:
        if f not in args.data:
            sys.exit(f"--hash-split/--tune-data {f}: not one of the --data files")
    rounds, metas = D.load_rounds(args.data, args.hash_split)
    if any(m.get("diagnostic_only") for m in metas):
        sys.exit("a --data file holds benchmark-prompt rounds (collect --prompts benchmark): never train on them")
    shas = {m["draft_sha256"] for m in metas}
    if len(shas) != 1:
        sys.exit(f"the label files come from different drafts ({len(shas)} sha256s); train on one draft's data")
    gamma_max = min(m["gamma_max"] for m in metas)
    for r in rounds:
        for k in ("hidden", "tokens", "logq", "entropy", "label"):
            r[k] = r[k][:gamma_max]
    parts = {s: [r for r in rounds if r["split"] == s] for s in ("train", "dev", "test")}
    if not parts["dev"]:  # tiny collections: carve a dev split out of train by prompt
        parts["dev"] = [r for r in parts["train"] if r["prompt"] % 8 == 0]
        parts["train"] = [r for r in parts["train"] if r["prompt"] % 8 != 0]
    print({k: len(v) for k, v in parts.items()}, "rounds", flush=True)
    use_head = not args.no_head
    ddir_loaded = Path(metas[0].get("draft_loaded_from") or metas[0]["draft"])
    head = None
    if use_head:
        draft_model = load_model_dir(ddir_loaded)
        if args.head_rank > 0:
            head = Preverifier(draft_model.config.hidden_size, use_head=True, head_rank=args.head_rank)
            head.attach_draft(draft_model)
    sets = {k: T.to_tokenset(v, use_head, head, args.margin) for k, v in parts.items()}
    hidden_size = sets["train"].hidden.shape[1]
    model, info = T.train_preverifier(sets["train"], sets["dev"], hidden_size, dim=args.dim,
                                      hash_buckets=args.hash_buckets, epochs=args.epochs, lr=args.lr,
                                      seed=args.seed, use_head=use_head, dropout=args.dropout,
                                      weight_decay=args.weight_decay, head_rank=args.head_rank,
                                      use_hidden=not args.no_hidden, use_margin=args.margin)
    mc = next((m["costs"] for m in metas if m.get("costs")), None)
    if args.measure_costs:  # the pair as served now (e.g. the draft's int8 weights), not as it was at collection
        served_draft = load_model_dir(resolve_model(args.draft), dtype="auto", role="draft")
        if use_head:
            model.attach_draft(served_draft)
        # the draft's costs in the worker's own loop, this pre-verifier's calls included
        mc = measure_costs(served_draft, load_model_dir(resolve_model(args.target), dtype="auto", role="target"),
                           gamma_max, preverifier=model.eval())
        print(f"measured costs of the served pair: {mc}", flush=True)
    if mc:
        costs = T.Costs(mc["draft_token_s"], mc["target_base_s"], mc["target_per_token_s"])
    else:
        costs = T.fit_costs(parts["train"], gamma_max)
    if use_head:
        model.attach_draft(draft_model)
    costs.preverifier_s = (mc or {}).get("preverifier_s") or time_preverifier_call(model, hidden_size,
                                                                                   args.block_sizes[0])
    tabs = {k: T.attach_starts(T.round_table(model, v), parts[k]) for k, v in sets.items() if len(v)}
    if tabs["dev"].subset(tabs["dev"].greedy).exact:
        print("greedy dev rounds at every position: θ is tuned by replaying the decoder exactly", flush=True)
    # acceptance statistics for the θ derivation
    dev = tabs["dev"]
    if args.tune_data:  # choose on the text most like what will be served (e.g. not code the draft trained on)
        tune = {str(f) for f in args.tune_data}
        dev = dev.subset(torch.tensor([r["source_file"] in tune for r in parts["dev"]]))
    greedy_rows = dev.greedy
    mean_acc = float(dev.label[greedy_rows].mean()) if greedy_rows.any() else float(dev.label.mean())
    # choose B, score mode and θ on dev by simulated throughput (measured costs)
    results, best = [], None
    for B in args.block_sizes:
        for mode in ("block", "prefix"):
            for sub, rows in (("greedy", dev.greedy), ("all", torch.ones_like(dev.greedy))):
                if not rows.any():
                    continue
                t = dev.subset(rows)
                th, sim = T.tune_threshold(t, costs, B, args.gamma_max_runtime, mode)
                fixed = max((T.simulate(t, costs, None, None, g) | {"gamma": g} for g in (1, 2, 3, 4, 6, 8)),
                            key=lambda r: r["tokens_per_s"])
                rec = {"block_size": B, "mode": mode, "subset": sub, "theta": th, **sim,
                       "best_fixed": fixed, "gain_vs_best_fixed": sim["tokens_per_s"] / fixed["tokens_per_s"]}
                results.append(rec)
                print(f"dev sim B={B} {mode:6s} {sub:6s}: θ={th:.2f} {sim['tokens_per_s']:.2f} tok/s "
                      f"τ={sim['mean_accepted_length']:.2f} len={sim['mean_draft_len']:.2f} | best fixed "
                      f"γ={fixed['gamma']} {fixed['tokens_per_s']:.2f} tok/s → ×{rec['gain_vs_best_fixed']:.3f}",
                      flush=True)
                if sub == "greedy" and (best is None or rec["tokens_per_s"] > best["tokens_per_s"]):
                    best = rec
    if args.block_size:
        best = max((r for r in results if r["block_size"] == args.block_size and r["subset"] == "greedy"),
                   key=lambda r: r["tokens_per_s"])
    if args.score_mode:
        best = max((r for r in results if r["block_size"] == best["block_size"] and r["mode"] == args.score_mode
                    and r["subset"] == "greedy"), key=lambda r: r["tokens_per_s"])
    B, mode, theta = best["block_size"], best["mode"], best["theta"]
    tau_fixed = best["best_fixed"]["mean_accepted_length"]
    theta_derived = derive_threshold(costs.ratio, tau_fixed, best["best_fixed"]["gamma"], mean_acc,
                                     costs.target_per_token_s / max(costs.draft_token_s, 1e-12))
    model.block_size, model.score_mode, model.threshold = B, mode, float(theta)
    # held-out (test) report, per temperature
    report = {}
    if "test" not in tabs:
        print("no held-out test rounds (too few prompts): the report is left out; collect more for one", flush=True)
    test_rounds = tabs.get("test")
    for name, rows in (() if test_rounds is None else (("greedy", test_rounds.greedy),
                                                        ("sampled_T1", ~test_rounds.greedy))):
        if not rows.any():
            continue
        t = test_rounds.subset(rows)
        report[name] = {}
        for bs in sorted(set(args.block_sizes)):
            sc, lab, reached = T.block_scores(t, bs, "block")
            sc_m, _, _ = T.block_scores(t, bs, mode)
            report[name][f"B={bs}"] = {
                "all_blocks": T.classification_report(sc, lab, theta if bs == B else 0.5),
                "reached_blocks": T.classification_report(sc, lab, theta if bs == B else 0.5, reached),
                "auc_score_mode": T.weighted_auc(sc_m, lab),
            }
        print(name, json.dumps(report[name][f"B={B}"]), flush=True)
    ddir = Path(metas[0]["draft"])
    card = {
        "what": "PACER pre-verifier: P(every token of a drafted block is accepted | earlier blocks were)",
        "draft": str(ddir), "draft_sha256": metas[0]["draft_sha256"],
        "draft_fingerprint": metas[0].get("draft_fingerprint") or _fingerprint(ddir),
        "target": metas[0]["target"],
        "trained_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "training_data": {"files": [str(p) for p in args.data], "collection": metas,
                          "split_by_prompt_hash": [str(p) for p in args.hash_split],
                          "tuned_on": [str(p) for p in args.tune_data] or "all",
                          "rounds": {k: len(v) for k, v in parts.items()},
                          "tokens": {k: len(v) for k, v in sets.items()},
                          "benchmark_prompts_excluded": True},
        "labels": "greedy: x == argmax p; T=1: min(1, p/q) soft; per token, conditional on the earlier tokens",
        "training": {k: v for k, v in info.items() if k != "history"} | {"lr": args.lr, "dim": args.dim,
                                                                          "hash_buckets": args.hash_buckets,
                                                                          "dropout": args.dropout,
                                                                          "head_rank": args.head_rank,
                                                                          "weight_decay": args.weight_decay},
        "block_size": B, "score_mode": mode, "threshold": theta,
        "threshold_derived_from_cost_ratio": theta_derived,
        "costs": {"draft_token_ms": costs.draft_token_s * 1e3, "target_verify_ms": costs.target_base_s * 1e3,
                  "preverifier_call_ms": costs.preverifier_s * 1e3, "cost_ratio_c": costs.ratio,
                  "threads": metas[0].get("threads")},
        "gamma_max": args.gamma_max_runtime,
        "dev_simulation": results,
        "heldout_test": report,
        "host": platform.platform(),
    }
    out = save_preverifier(model, args.out, card)
    print(f"wrote {out}: B={B} mode={mode} theta={theta:.2f} (derived {theta_derived:.2f}), "
          f"test AUC greedy {report.get('greedy', {}).get(f'B={B}', {}).get('all_blocks', {}).get('auc')}",
          flush=True)
    return card


def _fingerprint(ddir: Path) -> str:
    return draft_fingerprint(load_model_dir(ddir))


def cmd_run(args) -> None:
    """docs/design/pacer.md's recipe as one command: each step is the documented subcommand; existing outputs are
    kept."""
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    common = ["--target", args.target, "--draft", args.draft, "--threads", str(args.threads), "--seed", str(args.seed)]
    excl = [x for f in require_samples(args.exclude_samples, "--exclude-samples") for x in ("--exclude-samples", f)]
    data = []
    for name, temp, seed in (("g", "0", 101), ("s", "1", 202)):
        dense = args.exact_replay and temp == "0"  # greedy rounds at every position: θ tuned by exact replay
        text, rounds = work / f"fresh_{name}.jsonl", work / f"rounds_{name}{'_w0' if dense else ''}.pt"
        if not text.exists():
            # self-instructed prompts: new to the draft, whose data covers most of the template x topic space
            distill_main(["--target", args.target, "--threads", str(args.threads), "--seed", str(seed), "generate",
                          "--style", "self", "--out", str(text), "--seconds", str(args.gen_seconds),
                          "--temperatures", temp, *excl])
        if not rounds.exists():
            main(["collect", *common, "--prompts", str(text), "--num-prompts", "2000", "--time-budget",
                  str(args.collect_seconds), "--temperatures", temp, "--out", str(rounds),
                  *(["--walk-gamma", "0"] if dense else [])])
        data.append(str(rounds))
    main(["train", "--data", *data, "--out", args.out, "--no-head", "--epochs", "4", "--dropout", "0.3",
          "--weight-decay", "0.1", "--hash-buckets", "1024", "--block-sizes", "1", "2", "3", "4",
          "--threads", str(args.threads), "--seed", str(args.seed)])


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m specdec_train.preverifier", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    def pair(sp):
        sp.add_argument("--target", default="default-target")
        sp.add_argument("--draft", default="default-draft")
        sp.add_argument("--threads", type=int, default=1)
        sp.add_argument("--seed", type=int, default=0)

    c = sub.add_parser("collect", help="run draft+target on training prompts, save features + labels")
    pair(c)
    c.add_argument("--method", choices=["tf", "workers"], default="tf",
                   help="tf: teacher-forced (fast, exact for greedy); workers: real SD rounds with the workers")
    c.add_argument("--prompts", required=True,
                   help="JSONL(.gz) with prompt_ids rows (e.g. the draft's training samples), or `benchmark`: the ablation's prompts with the target's "
                        "greedy continuation, for diagnosis only (`eval`; `train` refuses the file)")
    c.add_argument("--benchmark-prompts", type=int, nargs=2, default=[8, 8], metavar=("HUMANEVAL", "CHAT"))
    c.add_argument("--draft-source", default=None,
                   help="the draft directory as shipped, when --draft is a converted copy (its sha256 goes in the card)")
    c.add_argument("--num-prompts", type=int, default=400)
    c.add_argument("--skip", type=int, default=0, help="skip the first N prompts of the seeded order")
    c.add_argument("--gamma-max", type=int, default=12)
    c.add_argument("--walk-gamma", type=int, default=None,
                   help="tf: lay rounds out as sd with this γ walks the text (default: --gamma-max); each round "
                        "still records --gamma-max tokens")
    c.add_argument("--temperatures", default="0,1")
    c.add_argument("--max-new-tokens", type=int, default=128)
    c.add_argument("--time-budget", type=float, default=None, help="seconds")
    c.add_argument("--greedy-labels", choices=["file", "target"], default="file",
                   help="tf, greedy rows: label against the file's continuation (exact when the served target wrote "
                        "it greedily) or against the served target's argmax in one teacher-forced pass (text from "
                        "elsewhere, e.g. another device's numerics)")
    c.add_argument("--out", default=str(D.CACHE_DIR / "rounds.pt"))

    t = sub.add_parser("train", help="train on collected rounds, report held-out metrics, write weights + card")
    t.add_argument("--data", nargs="+", type=Path, default=[D.CACHE_DIR / "rounds.pt"])
    t.add_argument("--hash-split", nargs="*", type=Path, default=[], metavar="FILE",
                   help="--data files to split by prompt hash alone (test 5 %%, dev 10 %%), their draft-held-out "
                        "prompts too: for labels collected on prompts all new to the draft, such as its held-out set "
                        "(specdec_train/data/distill_heldout.jsonl.gz), which the default split puts entirely in test")
    t.add_argument("--tune-data", nargs="*", type=Path, default=[], metavar="FILE",
                   help="choose B, score mode and θ on the dev rounds of these --data files only (default: all)")
    t.add_argument("--out", default=str(D.CACHE_DIR / "preverifier"))
    t.add_argument("--block-sizes", type=int, nargs="+", default=[1, 2, 3, 4])
    t.add_argument("--block-size", type=int, default=0, help="force B (default: best simulated on dev)")
    t.add_argument("--score-mode", choices=["block", "prefix"], default=None)
    t.add_argument("--gamma-max-runtime", type=int, default=12)
    t.add_argument("--epochs", type=int, default=8)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--dim", type=int, default=64)
    t.add_argument("--hash-buckets", type=int, default=4096)
    t.add_argument("--dropout", type=float, default=0.1)
    t.add_argument("--weight-decay", type=float, default=0.05)
    t.add_argument("--no-head", action="store_true", help="do not read the draft's output head (cheaper, weaker)")
    t.add_argument("--head-rank", type=int, default=64, help="read the head through its rank-r SVD (0: exact)")
    t.add_argument("--no-hidden", action="store_true",
                   help="no hidden-state projection: the token and the scalars only (a fraction of the cost per call)")
    t.add_argument("--margin", action="store_true", help="the draft's top-1 - top-2 margin as one more scalar")
    t.add_argument("--threads", type=int, default=1)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--measure-costs", action="store_true",
                   help="tune θ with costs measured now on the served pair (--draft/--target), not the collection's")
    t.add_argument("--draft", default="default-draft", help="with --measure-costs")
    t.add_argument("--target", default="default-target", help="with --measure-costs")

    r = sub.add_parser("run", help="the whole recipe of the shipped pre-verifier (docs/design/pacer.md): fresh text, "
                                   "labels, training")
    pair(r)
    r.add_argument("--work", default=str(D.CACHE_DIR / "run"))
    r.add_argument("--gen-seconds", type=float, default=360, help="per fresh set (greedy, T=1)")
    r.add_argument("--collect-seconds", type=float, default=400, help="per label collection")
    r.add_argument("--exclude-samples", action="append", default=None,
                   help="the draft's training data (repeatable; required): its prompts are kept out of the fresh "
                        "text")
    r.add_argument("--out", default=str(D.CACHE_DIR / "preverifier"), help="e.g. specdec/assets/default_preverifier")
    r.add_argument("--exact-replay", action="store_true",
                   help="collect the greedy rounds at every position, so θ is tuned by replaying the decoder exactly "
                        "(docs/design/pacer.md, 'Evaluating on another domain'; the shipped weights were tuned "
                        "without it)")

    e = sub.add_parser("eval", help="score saved pre-verifiers on label files (any domain): AUC, simulated gain "
                                    "over the best fixed γ, a perfect stop rule's")
    pair(e)
    e.add_argument("--preverifier", nargs="+", default=[None], help="pre-verifier dirs (default: the shipped one)")
    e.add_argument("--data", nargs="+", type=Path, required=True, help="label files from `collect`")
    e.add_argument("--split", choices=["all", "train", "dev", "test"], default="all")
    e.add_argument("--measure-costs", action="store_true",
                   help="simulate with costs measured now (the drafting loop with each pre-verifier), not the files'")
    e.add_argument("--json", default=None)

    a = sub.add_parser("ablate", help="fixed γ vs pacer, in-process, side by side")
    pair(a)
    add_args(a)

    args = p.parse_args(argv)
    if args.cmd == "collect":
        cmd_collect(args)
    elif args.cmd == "train":
        cmd_train(args)
    elif args.cmd == "eval":
        cmd_eval(args)
    elif args.cmd == "run":
        cmd_run(args)
    elif args.cmd == "ablate":
        run_ablation(args)


if __name__ == "__main__":
    main()
