"""End-to-end effect of one bf16 kernel of specdec/linear.py, in process, kernel on/off interleaved per prompt.

    python scripts/kernel_ab.py --kernel gemv --humaneval 2 --chat 2 --max-new-tokens 96    # GEMV_ONE_ROW
    python scripts/kernel_ab.py --kernel packed --humaneval 3 --chat 3 --max-new-tokens 96  # PACKED_MULTI_ROW

Every mode runs with the kernel's switch on and off on the same prompts (one engine, 1 thread per model, greedy);
prints median tokens/s per mode and setting, and medians of the paired ratios.
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

import specdec.linear
from specdec.engine import Engine
from specdec.hub import resolve_model
from specdec.model import load_model_dir
from specdec.pacer_train.bench import benchmark_prompts, encode
from specdec.preverifier import load_preverifier
from specdec.sampling import SamplingParams
from specdec.schedule import GenerationRequest
from specdec.tokenizer import eos_token_ids, load_tokenizer

MODES = [("ar", 4), ("sd", 3), ("pacer", 8), ("pearl", 8), ("pacer_pearl", 8)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernel", choices=["gemv", "packed"], default="packed")
    ap.add_argument("--humaneval", type=int, default=2)
    ap.add_argument("--chat", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tdir, ddir = Path(resolve_model("default-target")), Path(resolve_model("default-draft"))
    target = load_model_dir(tdir, dtype="auto", role="target")
    draft = load_model_dir(ddir, dtype="auto", role="draft", quant="auto")
    pv = load_preverifier(None, draft_model=draft, strict=False)
    tok = load_tokenizer(tdir)
    eos = tuple(eos_token_ids(tok))
    prompts = [encode(tok, item) for _, item in benchmark_prompts(args.humaneval, args.chat)]
    engine = Engine(target, draft, preverifier=pv, max_sessions=2,
                    max_context=max(map(len, prompts)) + args.max_new_tokens + 16, threads_per_model=1)

    def tps(mode: str, gamma: int, ids: list[int], n: int) -> float:
        r = engine.generate(GenerationRequest(prompt_ids=list(ids), max_new_tokens=n, mode=mode, gamma=gamma,
                                              params=SamplingParams(temperature=0.0), eos_token_ids=eos))
        return len(r.token_ids) / r.stats.wall_s

    for mode, gamma in MODES:  # warm-up
        tps(mode, gamma, prompts[0][:20], 8)
    res: dict[tuple[str, bool], list[float]] = {}
    switch = {"gemv": "GEMV_ONE_ROW", "packed": "PACKED_MULTI_ROW"}[args.kernel]
    for i, ids in enumerate(prompts):
        for gemv in (True, False) if i % 2 == 0 else (False, True):
            setattr(specdec.linear, switch, gemv)
            for mode, gamma in MODES:
                res.setdefault((mode, gemv), []).append(tps(mode, gamma, ids, args.max_new_tokens))
        print(f"prompt {i + 1}/{len(prompts)} done", flush=True)
    setattr(specdec.linear, switch, True)
    med = statistics.median
    print(f"| mode | tok/s {args.kernel} | tok/s off | on / off | × ar ({args.kernel}) | × ar (off) |\n"
          "|---|---|---|---|---|---|")
    for mode, _ in MODES:
        a, b = res[(mode, True)], res[(mode, False)]
        ra = med([x / y for x, y in zip(a, res[("ar", True)])])
        rb = med([x / y for x, y in zip(b, res[("ar", False)])])
        print(f"| {mode} | {med(a):.1f} | {med(b):.1f} | {med([x / y for x, y in zip(a, b)]):.2f} | {ra:.2f} | "
              f"{rb:.2f} |")


if __name__ == "__main__":
    main()
