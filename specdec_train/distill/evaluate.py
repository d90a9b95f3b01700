"""Held-out metrics: greedy agreement of the draft's top-1 with the target's greedy continuation."""
from __future__ import annotations

import torch


@torch.no_grad()
def greedy_agreement(draft, rows, subset: torch.Tensor | None, to_compact: torch.Tensor | None,
                     batch_size: int = 8) -> dict:
    """Fraction of completion positions of greedy (temperature 0) rows where argmax draft == target's token.

    ``draft`` speaks compact ids when ``subset`` is given (the raw HF model); otherwise full ids.
    """
    rows = [r for r in rows if r["temperature"] == 0]
    dev = next(draft.parameters()).device
    hit = n = 0
    rows = sorted(rows, key=lambda r: len(r["prompt_ids"]) + len(r["completion_ids"]))
    for b in range(0, len(rows), batch_size):
        chunk = rows[b:b + batch_size]
        seqs = [torch.tensor(r["prompt_ids"] + r["completion_ids"]) for r in chunk]
        L = max(len(s) for s in seqs)
        x = torch.zeros(len(seqs), L, dtype=torch.long)
        for j, s in enumerate(seqs):
            x[j, :len(s)] = to_compact[s] if to_compact is not None else s
        lg = draft(input_ids=x.to(dev)).logits.cpu()
        for j, r in enumerate(chunk):
            P, C = len(r["prompt_ids"]), len(r["completion_ids"])
            pred = lg[j, P - 1:P - 1 + C].argmax(-1)
            if subset is not None:
                pred = subset.cpu()[pred]
            hit += int((pred == torch.tensor(r["completion_ids"])).sum())
            n += C
    return {"agreement": hit / max(n, 1), "positions": n, "rows": len(rows)}
