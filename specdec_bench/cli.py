"""`specdec bench` / `python -m specdec_bench`: every mode against ar and Hugging Face assisted generation.

    python -m specdec_bench --quick --json out.json --markdown out.md --plot out.png
    python -m specdec_bench --quick --rtt-ms 0,2,10,30 --data-plane coordinator,direct --json net.json
    python -m specdec_bench --synthetic-acceptance 0.6,0.7,0.8,0.9 --shapes llama-8b/1b --device cuda

With --rtt-ms or --rtt-t the run is the network sweep instead (specdec_bench/network.py): every mode through the
embedded stack with a network round trip emulated on each link between its processes. With --synthetic-acceptance
it is the synthetic-acceptance run (specdec_bench/synthetic.py): a pair whose draft is right α of the time, timed.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

from specdec.common.defaults import PROMPT_LOOKUP_MIN_NGRAM
from specdec_bench.harness import ALL_MODES, Bench, BenchOptions, acceptance, aggregate
from specdec_bench.report import machine_info, markdown, markdown_target_error, network_markdown, plot, \
    write_markdown
from specdec_bench.synthetic import SHAPES

QUICK = dict(n_per_set=2, repeats=1, gammas=(2, 4), temperatures=(0.0,), concurrency=(1, 2, 4, 8), concurrency_repeats=1)


def _csv(kind):
    return lambda s: tuple(kind(x) for x in s.replace(",", " ").split())


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="specdec bench", description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", default=None, help="JSONL of {\"prompt\": ...} or {\"messages\": [...]} lines "
                                                    "(default: HumanEval + the repo's chat set)")
    ap.add_argument("--prompt-sets", type=_csv(str), default=("humaneval", "chat"), help="default: humaneval,chat")
    ap.add_argument("--n-prompts", type=int, default=None, help="prompts per set (default 8; --quick 2)")
    ap.add_argument("--modes", nargs="+", default=list(ALL_MODES), choices=ALL_MODES,
                    help="ar, hf (assisted generation), sd, pacer, pearl, pacer_pearl (default: all)")
    ap.add_argument("--gammas", type=_csv(int), default=None, help="sd draft lengths (default 2,3,4,6; --quick 2,4)")
    ap.add_argument("--temperatures", type=_csv(float), default=None, help="default: 0,1 (--quick: 0)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=None, help="rounds per prompt (default 3; --quick 1)")
    ap.add_argument("--concurrency", type=_csv(int), default=None, help="sweep levels (default 1,2,4,8; '' = off)")
    ap.add_argument("--concurrency-repeats", type=int, default=None, help="default 2; --quick 1")
    ap.add_argument("--quick", action="store_true",
                    help="2 prompts per set, 1 repeat, greedy only, sd γ∈{2,4}, one concurrency sweep")
    ap.add_argument("--target-model", default="default-target")
    ap.add_argument("--draft-model", default="default-draft")
    ap.add_argument("--preverifier", default=None, help="PACER pre-verifier dir (default: the shipped one)")
    ap.add_argument("--prompt-lookup-min-ngram", type=int, default=PROMPT_LOOKUP_MIN_NGRAM,
                    help="prompt lookup beside the draft model (specdec/decoding/lookup.py); 0: off (default: "
                         "%(default)s)")
    ap.add_argument("--prefix-cache", action="store_true",
                    help="let requests reuse prompt prefixes (off by default: every request prefills its whole "
                         "prompt, as the HF baseline does, so the suite compares generation)")
    ap.add_argument("--no-ray", action="store_true", help="coordinator pipelines in the driver (tests)")
    ap.add_argument("--json", default=None, help="write the rows (a JSON list) here")
    ap.add_argument("--markdown", default=None, help="write the tables here")
    ap.add_argument("--plot", default=None, help="write the plot (PNG) here")
    ap.add_argument("--no-progress", action="store_true")
    net = ap.add_argument_group("network sweep (instead of the suite above; docs/operations/network.md)")
    net.add_argument("--rtt-ms", type=_csv(float), default=None, metavar="MS,...",
                     help="network round trips to emulate on every link of the embedded stack, in milliseconds "
                          "(e.g. 0,2,10,30): each mode runs through the stack at each")
    net.add_argument("--rtt-t", type=_csv(float), default=None, metavar="K,...",
                     help="the round trips in units of T, this host's one-row target forward, measured first and "
                          "reported (e.g. 0,1,3)")
    net.add_argument("--data-plane", type=_csv(str), default=None, metavar="PLANE,...",
                     help="the network sweep's data planes (COORDINATOR_DATA_PLANE), each configuration runs under "
                          "each: coordinator, direct (default: coordinator)")
    rt = ap.add_argument_group("round trip (instead of the suite above; specdec_bench/round_trip.py)")
    rt.add_argument("--round-trip", action="store_true",
                    help="tiny models in process and through the services, for each data path: what a round costs "
                         "through the stack beyond the same round in one process, and the threads it wakes")
    rt.add_argument("--paths", type=_csv(str), default=None, metavar="PATH,...",
                    help="the round trip's data paths: unary, streams, direct (default: all)")
    rt.add_argument("--device", default="cpu", help="the round trip's and the synthetic-acceptance run's device, for "
                                                    "the engine and both replicas")
    syn = ap.add_argument_group("synthetic acceptance (instead of the suite above; specdec_bench/synthetic.py)")
    syn.add_argument("--synthetic-acceptance", type=_csv(float), default=None, metavar="ALPHA,...",
                     help="a timing pair whose draft proposes the target's next greedy token with probability α "
                          "(e.g. 0.6,0.7,0.8,0.9): ar, sd at each --gammas (default 2,4,6), pearl, pacer and "
                          "pacer_pearl at each α, in process and through the stack, every output checked against ar's; "
                          "--n-prompts random token-id prompts (default 4), --repeats each (default 1)")
    syn.add_argument("--shapes", default="tiny", choices=tuple(SHAPES),
                     help="the synthetic pair's models: tiny (CPU), or random weights of Llama-3.1-8B / "
                          "Llama-3.2-1B shapes (a GPU: --device cuda) (default: %(default)s)")
    syn.add_argument("--placements", type=_csv(str), default=None, metavar="PLACEMENT,...",
                     help="the synthetic run's placements: in-process, stack (default: both)")
    return ap


def synthetic_args(args) -> bool:
    """Whether the run is the synthetic-acceptance one; its flags checked against the others."""
    synthetic = args.synthetic_acceptance is not None
    if synthetic and (args.round_trip or args.rtt_ms is not None or args.rtt_t is not None or args.markdown
                      or args.plot):
        raise SystemExit("--synthetic-acceptance runs alone: leave out --round-trip, --rtt-ms/--rtt-t, --markdown "
                         "and --plot (it prints its table; --json writes its rows)")
    if not synthetic and (args.shapes != "tiny" or args.placements is not None):
        raise SystemExit("--shapes and --placements apply to the synthetic-acceptance run: add "
                         "--synthetic-acceptance")
    return synthetic


def synthetic_main(args, meta: dict, log) -> int:
    """The synthetic-acceptance run: --n-prompts random token-id prompts (default 4), --repeats (default 1)."""
    from specdec_bench.synthetic import PLACEMENTS, SyntheticOptions, markdown as syn_markdown, run_synthetic

    placements = args.placements or PLACEMENTS
    unknown = [p for p in placements if p not in PLACEMENTS]
    if unknown:
        raise SystemExit(f"--placements {','.join(unknown)}: use {', '.join(PLACEMENTS)}")
    alphas = args.synthetic_acceptance
    if not alphas or any(not 0.0 <= a <= 1.0 for a in alphas):
        raise SystemExit(f"--synthetic-acceptance: rates in [0, 1], e.g. 0.6,0.7,0.8,0.9: got {alphas}")
    modes = tuple(m for m in args.modes if m != "hf")  # assisted generation has no synthetic draft
    opts = SyntheticOptions(alphas=tuple(alphas), shapes=args.shapes, device=args.device, modes=modes,
                            gammas=tuple(args.gammas or (2, 4, 6)), placements=tuple(placements),
                            n_prompts=args.n_prompts or 4, max_new_tokens=args.max_new_tokens,
                            repeats=args.repeats or 1, ray=not args.no_ray)
    result = run_synthetic(opts, log=log)
    run = {"command": meta["command"], "shapes": args.shapes, "device": args.device, **meta["machine"]}
    for r in result["rows"]:
        r["run"] = run
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result["rows"], f, indent=1)
    print(syn_markdown(result, meta))
    return 0


def round_trip_main(args, meta: dict, log) -> int:
    """The round trip: greedy sd at the first --gammas (default 4), --repeats requests (default 10) per path."""
    import asyncio

    from specdec_bench.round_trip import PATHS, markdown as rt_markdown, run_round_trip  # lazy: starts stacks

    gamma = args.gammas[0] if args.gammas else 4
    rows = asyncio.run(run_round_trip(args.paths or tuple(PATHS), device=args.device, repeats=args.repeats or 10,
                                      max_new_tokens=args.max_new_tokens, gamma=gamma,
                                      prompt_lookup_min_ngram=args.prompt_lookup_min_ngram, ray=not args.no_ray,
                                      log=log))
    for r in rows:
        r["run"] = {"command": meta["command"], "gamma": gamma, "device": args.device, **meta["machine"]}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(rt_markdown(rows, meta))
    return 0


def network_args(args) -> tuple[tuple[float, ...], tuple[float, ...], tuple[str, ...]] | None:
    """(round trips in ms, round trips in T, data planes) of a network sweep; None: the main suite runs."""
    if args.rtt_ms is None and args.rtt_t is None:
        if args.data_plane is not None:
            raise SystemExit("--data-plane applies to the network sweep: add --rtt-ms or --rtt-t")
        return None
    if args.rtt_ms is not None and args.rtt_t is not None:
        raise SystemExit("--rtt-ms and --rtt-t both given: name the round trips one way")
    rtts = args.rtt_ms if args.rtt_ms is not None else args.rtt_t
    if not rtts or any(not x >= 0 for x in rtts):
        raise SystemExit(f"round trips must be a list of values of 0 or more, e.g. 0,2,10,30: got {rtts}")
    planes = args.data_plane or ("coordinator",)
    from specdec_bench.network import DATA_PLANES  # lazy: imports the stack

    unknown = [p for p in planes if p not in DATA_PLANES]
    if unknown:
        raise SystemExit(f"--data-plane {','.join(unknown)}: use {', '.join(DATA_PLANES)}")
    return tuple(args.rtt_ms or ()), tuple(args.rtt_t or ()), tuple(planes)


def options(args) -> BenchOptions:
    q = QUICK if args.quick else {}
    pick = lambda name, default: getattr(args, name) if getattr(args, name) is not None else q.get(name, default)  # noqa: E731
    n = args.n_prompts if args.n_prompts is not None else q.get("n_per_set", 8)
    return BenchOptions(
        target=args.target_model, draft=args.draft_model, preverifier=args.preverifier,
        prompt_sets=tuple(args.prompt_sets), prompts_file=args.prompts, n_per_set=n or None, modes=tuple(args.modes),
        gammas=pick("gammas", (2, 3, 4, 6)), temperatures=tuple(pick("temperatures", (0.0, 1.0))),
        max_new_tokens=args.max_new_tokens, repeats=pick("repeats", 3),
        concurrency=pick("concurrency", (1, 2, 4, 8)), concurrency_repeats=pick("concurrency_repeats", 2),
        prompt_lookup_min_ngram=args.prompt_lookup_min_ngram, use_ray=not args.no_ray, prefix_cache=args.prefix_cache,
        progress=not args.no_progress)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.round_trip and (args.rtt_ms is not None or args.rtt_t is not None or args.markdown or args.plot):
        raise SystemExit("--round-trip runs alone: leave out --rtt-ms/--rtt-t, --markdown and --plot (it prints its "
                         "table; --json writes its rows)")
    synthetic = synthetic_args(args)
    network = None if args.round_trip or synthetic else network_args(args)
    for out in (args.json, args.markdown, args.plot):  # before the run: a missing folder must not lose its results
        if out:
            try:
                Path(out).resolve().parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise SystemExit(f"cannot write {out}: {e}") from None
    if args.markdown and (why := markdown_target_error(args.markdown, network is not None)):
        raise SystemExit(why)
    opts = options(args)
    meta = {"machine": machine_info(), "command": "python -m specdec_bench " + shlex.join(argv)}
    t0 = time.time()
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    if args.round_trip:
        return round_trip_main(args, meta, log)
    if synthetic:
        return synthetic_main(args, meta, log)
    if network is not None:
        return network_main(args, opts, network, meta, t0, log)
    bench = Bench(opts, log=log)
    try:
        bench.setup()
        records, crecs = bench.run()
    finally:
        bench.close()
    rows = aggregate(records, crecs, bench.configs, opts.concurrency_mode)
    goals = acceptance(records, rows, opts.concurrency_mode)
    run = _stamp_rows(rows, meta, opts, bench, t0)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
        with open(args.json + ".goals.json" if not args.json.endswith(".json") else args.json[:-5] + ".goals.json",
                  "w") as f:
            json.dump({"goals": goals, "notes": bench.notes, **run}, f, indent=1)
    md = markdown(rows, goals, meta)
    if args.markdown:
        write_markdown(args.markdown, md)  # into docs/benchmarks.md's generated section, between its markers
    if args.plot:
        plot(rows, args.plot, title=f"specdec bench ({meta['machine']['git_commit']})")
    print(md)
    return 0


def _stamp_rows(rows: list[dict], meta: dict, opts: BenchOptions, bench, t0: float, more: tuple[str, ...] = (),
                **extra) -> dict:
    """Complete `meta` at the run's end (`extra` too) and give every row the run's description (the command, its
    time, load and prompts, the machine; and the `more` keys of meta). → that description."""
    meta.update(load_avg_end=list(os.getloadavg()), elapsed_s=time.time() - t0, notes=bench.notes,
                max_new_tokens=opts.max_new_tokens, repeats=opts.repeats, **extra,
                prompts=", ".join(f"{s} ×{sum(p.prompt_set == s for p in bench.prompts)}"
                                  for s in dict.fromkeys(p.prompt_set for p in bench.prompts)))
    run = {k: meta[k] for k in ("command", "elapsed_s", "load_avg_end", "max_new_tokens", "repeats", "prompts", *more)}
    run.update(meta["machine"])
    for r in rows:
        r["run"] = run
    return run


def network_main(args, opts: BenchOptions, network, meta: dict, t0: float, log) -> int:
    """The network sweep: run it, then write its rows (JSON, each with "section": "network") and its tables."""
    from specdec_bench.network import NetworkBench, aggregate_network  # lazy: the main suite does not need it

    rtts_ms, rtts_t, planes = network
    if args.plot:
        log("--plot: the network sweep has no plot; its tables and JSON rows are written")
    bench = NetworkBench(opts, rtts_ms, rtts_t, planes, log=log)
    try:
        bench.setup()
        records = bench.run()
    finally:
        bench.close()
    T = bench.target_forward_s
    rows = aggregate_network(records, bench.configs, T)
    _stamp_rows(rows, meta, opts, bench, t0, ("target_forward_ms", "notes"), target_forward_ms=T * 1e3 if T else None)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    md = network_markdown(rows, meta)
    if args.markdown:
        write_markdown(args.markdown, md, network=True)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
