"""The native streaming linear's multiply-add rate per row count, weights streamed from memory and from L2.

    python scripts/stream_linear_rate.py                       # this host's build
    SPECDEC_ISA=avx2 python scripts/stream_linear_rate.py      # as built for an AVX2-only host

From memory: 160 different 1536 x 576 bf16 weights (283 MB) per pass, as a forward streams its layers. From L2: one
576 x 576 weight (663 KB), 426 passes (the same multiply-adds). Compare with one core's FMA peak
(scripts/fma_peak.c); docs/benchmarks.md, "AVX2-only hosts: the streaming linear"."""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdec.modeling import native


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 4, 8, 16])
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    if not native.stream_linear_supported():
        raise SystemExit("the streaming linear does not run here (no AVX2 + FMA, no C compiler, or SPECDEC_NATIVE=0)")
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    streamed = [torch.randn(1536, 576, generator=gen).to(torch.bfloat16) for _ in range(160)]
    cached = [torch.randn(576, 576, generator=gen).to(torch.bfloat16)] * 426
    packs = {id(w): native.stream_pack(w) for w in streamed + cached[:1]}  # the layout the kernel reads, made once
    print("| rows | from memory: ms | G multiply-adds/s | from L2: ms | G multiply-adds/s |")
    print("|---|---|---|---|---|")
    for rows in args.rows:
        x = torch.randn(rows, 576, generator=gen).to(torch.bfloat16)
        times: dict[str, list[float]] = {"memory": [], "l2": []}
        for _ in range(args.repeats):  # interleaved, so drift hits both alike
            for name, weights in (("memory", streamed), ("l2", cached)):
                t = time.perf_counter()
                for w in weights:
                    native.stream_linear(x, w, packed=packs[id(w)])
                times[name].append(time.perf_counter() - t)
        macs = {name: rows * 576 * sum(w.shape[0] for w in ws) for name, ws in (("memory", streamed), ("l2", cached))}
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"| {rows} | {med['memory'] * 1e3:.1f} | {macs['memory'] / med['memory'] / 1e9:.1f} | "
              f"{med['l2'] * 1e3:.1f} | {macs['l2'] / med['l2'] / 1e9:.1f} |")


if __name__ == "__main__":
    main()
