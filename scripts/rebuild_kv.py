"""Does a rebuilt target session (its history re-sent after a failover or a preemption) hold the K/V its verifies
wrote, and does its greedy answer go on as it would have? The default target, bf16 as served.

    python scripts/rebuild_kv.py --humaneval 4 --chat 4 --tokens 96 --more 48

Per prompt: the greedy continuation is written into a session by verify-sized blocks (random 1-8 rows, as sd's and
PEARL's verifies write it), then the same history is rebuilt in a second session two ways: its output fed in
blocks of `--rows` (`TargetWorker.rebuild_rows`) or prefilled with the prompt (rebuild_rows 0, the behaviour
before session 26). Prints the positions whose K/V differ from the original session's in any layer, and
whether `--more` greedy tokens decoded from each rebuilt session equal those from the original.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch


def decode(worker, sid: str, position: int, token: int, n: int) -> list[int]:
    """n greedy tokens of session `sid`, one row per forward, `token` fed first at `position`."""
    from specdec.workers import VerifyArgs

    out = []
    for _ in range(n):
        (r,) = worker.verify_batch([VerifyArgs(sid, position, [token], [], None, "greedy")])
        if isinstance(r, Exception):
            raise r
        position, token = position + 1, r.next_token
        out.append(token)
    return out


def differing_positions(worker, a: str, b: str, n: int) -> int:
    sa, sb = worker.sessions[a].slot, worker.sessions[b].slot
    bad = torch.zeros(n, dtype=torch.bool)
    for cache in (*worker.kv.k, *worker.kv.v):
        bad |= (cache[sa, :n] != cache[sb, :n]).flatten(1).any(1)
    return int(bad.sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--humaneval", type=int, default=4)
    ap.add_argument("--chat", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=96, help="output tokens before the rebuild")
    ap.add_argument("--more", type=int, default=48, help="greedy tokens decoded after it")
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 8, 0], help="rebuild_rows to compare (0: prefill)")
    args = ap.parse_args()

    from specdec_bench.prompts import default_target_prompts
    from specdec.model import load_model
    from specdec.sampling import SamplingParams
    from specdec.threads import set_thread_count
    from specdec.workers import TargetWorker

    set_thread_count(1)
    tdir, chosen = default_target_prompts(args.humaneval, args.chat)
    model = load_model(str(tdir), "cpu", torch.bfloat16, role="target")
    worker = TargetWorker(model, max_sessions=4, max_context=2048)
    params, rng = SamplingParams(), random.Random(0)
    totals = {r: [0, 0] for r in args.rows}  # rebuild_rows → [prompts whose K/V differ, whose continuation differs]
    rebuild_s = {r: [] for r in args.rows}
    for p in chosen:
        prompt = p.ids
        worker.start_session("alone", prompt, params)
        output = decode(worker, "alone", len(prompt) - 1, prompt[-1], args.tokens)
        worker.end_session("alone")
        worker.start_session("first", prompt, params)
        s, fed, at = worker.sessions["first"], [prompt[-1]] + output[:-1], 0
        while at < len(fed):  # verify blocks of 1 + γ rows
            size = rng.randint(1, 8)
            worker._feed(s, len(prompt) - 1 + at, fed[at:at + size])
            at += size
        base = len(prompt) + len(output) - 1
        want = decode(worker, "first", base, output[-1], args.more)
        line = [f"{p.key}:"]
        for rows in args.rows:
            worker.rebuild_rows = rows
            t0 = time.perf_counter()
            worker.start_session(f"rebuilt{rows}", prompt + output, params, output_start=len(prompt))
            rebuild_s[rows].append(time.perf_counter() - t0)
            kv_diff = differing_positions(worker, "first", f"rebuilt{rows}", base)
            got = decode(worker, f"rebuilt{rows}", base, output[-1], args.more)
            first = next((i for i, (x, y) in enumerate(zip(want, got)) if x != y), None)
            totals[rows][0] += kv_diff > 0
            totals[rows][1] += first is not None
            line.append(f"rows {rows}: {kv_diff} of {base} positions' K/V differ, continuation "
                        f"{'equal' if first is None else f'differs at token {first}'};")
            worker.end_session(f"rebuilt{rows}")
        worker.end_session("first")
        print(" ".join(line), flush=True)
    for rows, (kv, cont) in totals.items():
        print(f"rebuild_rows {rows}: K/V differ on {kv} of {len(chosen)} prompts, continuation on {cont}; "
              f"a rebuild took {statistics.median(rebuild_s[rows]) * 1e3:.0f} ms (median)")


if __name__ == "__main__":
    main()
