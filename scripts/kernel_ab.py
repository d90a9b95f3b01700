"""End-to-end effect of this host's tuned bf16 kernels (specdec/linear.py) against one fixed plan, in process,
interleaved per prompt.

    python scripts/kernel_ab.py --plan gemv+packed --humaneval 3 --chat 3 --max-new-tokens 96  # the untuned default
    python scripts/kernel_ab.py --plan gemm --humaneval 2 --chat 2 --max-new-tokens 96         # F.linear everywhere
    python scripts/kernel_ab.py --attention --humaneval 3 --chat 3    # decode attention vs fused SDPA instead
    python scripts/kernel_ab.py --sampler --humaneval 3 --chat 3      # T=1: inverse-CDF sampling vs torch.multinomial
    python scripts/kernel_ab.py --inline --humaneval 4 --chat 4       # sequential modes inline vs on worker threads
    python scripts/kernel_ab.py --block-attention --humaneval 4 --chat 4  # verify blocks: two matmuls vs SDPA

Every mode runs with the tuned plans ("on") and the fixed plan ("off") on the same prompts (one engine, 1 thread
per model, greedy); prints median tokens/s per mode and setting, and medians of the paired ratios.
"""
from __future__ import annotations

import argparse
import statistics

import torch

import specdec.attention
import specdec.drafting
import specdec.sampling
import specdec.verify
from ab_pair import load_default_pair  # scripts/ab_pair.py
from specdec.engine import Engine
from specdec.linear import Linear, set_plan
from specdec_train.preverifier.bench import benchmark_prompts, encode
from specdec.sampling import SamplingParams
from specdec.schedule import GenerationRequest
from specdec.tokenizer import eos_token_ids

PLANS = {"gemm": ("gemm",) * 4, "gemv+packed": ("gemv", "packed", "packed", "packed"), "packed": ("packed",) * 4}
MODES = [("ar", 4), ("sd", 3), ("pacer", 8), ("pearl", 8), ("pacer_pearl", 8)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", choices=list(PLANS), default="gemv+packed")
    ap.add_argument("--attention", action="store_true",
                    help="A/B specdec.attention.DECODE_ATTENTION (on vs off) instead of the kernel plans")
    ap.add_argument("--sampler", action="store_true",
                    help="A/B specdec.sampling.sample (inverse CDF) against torch.multinomial instead, at T=1")
    ap.add_argument("--block-attention", action="store_true",
                    help="A/B the two-matmul attention for verify blocks (on) against SDPA for them (off; decode "
                         "steps keep the two-matmul path either way)")
    ap.add_argument("--inline", action="store_true",
                    help="A/B the engine's inline calls for sequential modes (on) against its worker threads (off)")
    ap.add_argument("--humaneval", type=int, default=2)
    ap.add_argument("--chat", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    args = ap.parse_args()
    target, draft, pv, tok = load_default_pair()
    eos = tuple(eos_token_ids(tok))
    prompts = [encode(tok, item) for _, item in benchmark_prompts(args.humaneval, args.chat)]
    engine = Engine(target, draft, preverifier=pv, max_sessions=2,
                    max_context=max(map(len, prompts)) + args.max_new_tokens + 16, threads_per_model=1)

    def tps(mode: str, gamma: int, ids: list[int], n: int) -> float:
        r = engine.generate(GenerationRequest(prompt_ids=list(ids), max_new_tokens=n, mode=mode, gamma=gamma,
                                              params=SamplingParams(temperature=1.0 if args.sampler else 0.0,
                                                                    seed=len(ids)), eos_token_ids=eos))
        return len(r.token_ids) / r.stats.wall_s

    for mode, gamma in MODES:  # warm-up
        tps(mode, gamma, prompts[0][:20], 8)
    res: dict[tuple[str, bool], list[float]] = {}
    tuned = {m: m.plan for model in (target, draft) for m in model.modules() if isinstance(m, Linear)}

    def multinomial(probs, gen):
        return int(probs.argmax()) if gen is None else int(torch.multinomial(probs, 1, generator=gen))

    def use(on: bool) -> None:
        if args.block_attention:
            specdec.attention.SMALL_BLOCK_ROWS = 16 if on else 1
            return
        if args.inline:
            engine.auto_inline = on
            return
        if args.sampler:
            specdec.drafting.sample = specdec.verify.sample = specdec.sampling.sample if on else multinomial
            return
        if args.attention:
            specdec.attention.DECODE_ATTENTION = on
            return
        for m, plan in tuned.items():
            m.plan = plan
        if not on:
            set_plan(target, PLANS[args.plan])  # the draft's int8 layers keep theirs: the A/B is the target's
    for i, ids in enumerate(prompts):
        for gemv in (True, False) if i % 2 == 0 else (False, True):
            use(gemv)
            for mode, gamma in MODES:
                res.setdefault((mode, gemv), []).append(tps(mode, gamma, ids, args.max_new_tokens))
        print(f"prompt {i + 1}/{len(prompts)} done", flush=True)
    use(True)
    med = statistics.median
    off = "SDPA blocks" if args.block_attention else "threads" if args.inline else "multinomial" if args.sampler else "SDPA" if args.attention else args.plan
    print(f"| mode | tok/s on | tok/s {off} | on / {off} | × ar (on) | × ar ({off}) |\n"
          "|---|---|---|---|---|---|")
    for mode, _ in MODES:
        a, b = res[(mode, True)], res[(mode, False)]
        ra = med([x / y for x, y in zip(a, res[("ar", True)])])
        rb = med([x / y for x, y in zip(b, res[("ar", False)])])
        print(f"| {mode} | {med(a):.1f} | {med(b):.1f} | {med([x / y for x, y in zip(a, b)]):.2f} | {ra:.2f} | "
              f"{rb:.2f} |")


if __name__ == "__main__":
    main()
