"""Where concurrency goes: aggregate tok/s of c simultaneous requests through the embedded stack, per mode,
with the replicas' busy time and the target's batch sizes (from its Prometheus metrics).

    python scripts/concurrency_probe.py --modes sd pacer_pearl --levels 1 2 4 8 --max-new-tokens 64
    python scripts/concurrency_probe.py --modes pacer_pearl --pearl-first default 0 --levels 1 8 --repeats 2

Greedy, HumanEval + chat prompts (different prompt per request), default pair, 1 torch thread per replica.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
import urllib.request

from coordinator.stack import LocalStack
from specdec.common.defaults import DEFAULT_DRAFT, DEFAULT_TARGET
from specdec.decoding.preverifier import default_preverifier_dir
from specdec.modeling.hub import resolve_model
from specdec.text.tokenizer import load_tokenizer
from specdec_bench.prompts import load_prompt_sets
from specdec_bench.runners import StackClient


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def scrape(port: int, name: str) -> dict[str, float]:
    """{label-less sample name: value} for metric family `name` from a Prometheus text endpoint."""
    out = {}
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name) and not line.startswith("#"):
                key, val = line.rsplit(" ", 1)
                out[key] = float(val)
    return out


async def main(args) -> None:
    tdir = resolve_model(DEFAULT_TARGET)
    prompts = load_prompt_sets(load_tokenizer(tdir), ["humaneval", "chat"], args.n_prompts)
    stack = LocalStack(str(tdir), str(resolve_model(DEFAULT_DRAFT)), default_preverifier_dir(DEFAULT_DRAFT), threads=1,
                       ray_cpus=2, pipelines=2, use_ray=not args.no_ray, max_sessions=max(8, max(args.levels)),
                       metrics=True)
    await stack.start()
    client = StackClient(stack.address)
    rows = []
    try:
        await client.generate(prompts[0].ids, "sd", None, 0.0, 0, 8)  # warm up
        sweep = [(m, g, f, o) for _ in range(args.repeats) for m in args.modes for g in args.gammas
                 for f in args.pearl_first for o in args.spec_off_batch]
        for mode, gamma, first, off in sweep:
            fields = {} if first is None or "pearl" not in mode else {"pearl_first_block": first}
            if off is not None:
                fields["spec_off_batch"] = off
            if args.ignore_eos:
                fields["ignore_eos"] = True
            for c in args.levels:
                picks = [prompts[i % len(prompts)] for i in range(c)]
                pids = {"coordinator+client": os.getpid(), **{p.args[2]: p.pid for p in stack.procs}}
                cpu0 = {k: cpu_s(v) for k, v in pids.items()}
                before = {k: scrape(p, "specdec_batch_size") for k, p in stack.metrics_ports.items()}
                t0 = time.perf_counter()
                samples = await asyncio.gather(*(client.generate(p.ids, mode, gamma, 0.0, 0, args.max_new_tokens,
                                                                 **fields) for p in picks))
                wall = time.perf_counter() - t0
                toks = sum(s.tokens for s in samples)
                st = [s.stats for s in samples]
                row = {"mode": mode, "gamma": gamma, "pearl_first_block": first, "spec_off_batch": off, "c": c,
                       "agg_tok_s": round(toks / wall, 2),
                       "wall_s": round(wall, 2),
                       "draft_busy_s": round(sum(x["draft_busy_s"] for x in st), 2),
                       "target_busy_s": round(sum(x["target_busy_s"] for x in st), 2),
                       "target_forwards": sum(x["target_forwards"] for x in st),
                       "accepted_len": round(statistics.mean(x["mean_accepted_length"] for x in st), 2),
                       "target_only_rounds": sum(x["target_only_rounds"] for x in st)}
                row["cpu_s"] = {k: round(cpu_s(v) - cpu0[k], 1) for k, v in pids.items()}
                for k, p in stack.metrics_ports.items():  # mean sessions per batched forward during this run
                    after = scrape(p, "specdec_batch_size")
                    d = {n: after.get(n, 0) - before[k].get(n, 0)
                         for n in ("specdec_batch_size_sum", "specdec_batch_size_count")}
                    row[f"{k}_forwards"] = int(d["specdec_batch_size_count"])
                    row[f"{k}_batch"] = round(d["specdec_batch_size_sum"] / max(1, d["specdec_batch_size_count"]), 2)
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        await client.close()
        await stack.stop()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", nargs="+", default=["sd", "pacer_pearl"])
    ap.add_argument("--levels", nargs="+", type=int, default=[1, 2, 4, 8])
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--n-prompts", type=int, default=4)
    ap.add_argument("--gammas", nargs="+", type=lambda v: None if v == "default" else int(v), default=[None],
                    help="request gamma (draft window); 'default' = the mode's default")
    ap.add_argument("--pearl-first", nargs="+", type=lambda v: None if v == "default" else int(v), default=[None],
                    help="PEARL modes: pearl_first_block values to sweep (0: pre-verify); 'default' = unset")
    ap.add_argument("--spec-off-batch", nargs="+", type=lambda v: None if v == "default" else int(v),
                    default=[None], help="load-adaptive speculation thresholds to sweep (0: always speculate)")
    ap.add_argument("--repeats", type=int, default=1, help="repeat the whole mode x gamma sweep (interleaved)")
    ap.add_argument("--no-ray", action="store_true")
    ap.add_argument("--ignore-eos", action="store_true", help="every request runs max_new_tokens (A/B runs whose "
                    "outputs may differ: kernels that round otherwise)")
    ap.add_argument("--json")
    asyncio.run(main(ap.parse_args()))
