"""The pre-verifier on the draft's critical path: one drafting round's blocks scored incrementally, each new token
through the network with its LayerNorms folded into NumPy matrices (docs/design/pacer.md, "Pre-verifier cost").

`specdec.decoding.preverifier.Preverifier.round_scorer()` builds a `RoundScorer`; its scores equal `block_accept_prob`
up to float rounding (tested). Kept apart from the module definition, training and I/O in
`specdec.decoding.preverifier`.

It runs on the host and reads host features: the drafting loop hands it a GPU draft's block in one device-to-host
copy (specdec/workers/drafting.py, `CallFeatures.block`; where the pre-verifier runs: `specdec.decoding.preverifier`).
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from specdec.decoding.stop import DraftFeatures

HASH_MULT = 2654435761  # the token hash of the pre-verifier's embedding buckets
_SQRT1_2 = 1.0 / math.sqrt(2.0)


def scalar_row(logq: list[float], entropy: list[float], t: int, margin: list[float] | None = None) -> list[float]:
    """Token t's row of `token_scalars(logq, entropy, margin)`, from plain floats (the draft loop's per-token
    path)."""
    lq = [max(v, -30.0) for v in logq[:t + 1]]
    first = t == 0
    row = [lq[t], entropy[t], math.exp(lq[t]), t / 8.0, 0.0 if first else lq[t - 1],
           0.0 if first else entropy[t - 1], math.fsum(lq[:t]) / 4.0, 1.0 if first else 0.0]
    if margin is not None:
        row.append(min(margin[t], 30.0) / 4.0)
    return row


class Folded:
    """The pre-verifier's per-token network for the draft loop, in NumPy, with the LayerNorms' affine parameters
    folded into the projections: W_h (γ_h ⊙ n_h + β_h) + b_h + W_s (γ_s ⊙ n_s + β_s) + b_s + E[x]
    = [W_h γ_h | W_s γ_s] [n_h; n_s] + bias[x], with bias[x] = E[x] + W_h β_h + b_h + W_s β_s + b_s.

    Why NumPy: right after a draft forward has streamed the draft's weights through the caches, every small
    torch op costs ~5× what it costs warm (~25 µs for a GELU of 64 numbers), and the network is ~35 of them per
    token; NumPy's calls are lighter (docs/design/pacer.md, "Pre-verifier cost"). float64 after the hidden-state
    GEMM."""

    def __init__(self, pv: nn.Module):
        with torch.no_grad():
            hn, sn = pv.h_norm, pv.s_norm
            w_s = pv.s_proj.weight.double() * sn.weight.double()[None]
            b = pv.s_proj.bias.double() + pv.s_proj.weight.double() @ sn.bias.double()
            self.w_h = None  # [D, dim], float32: the largest matrix by far (none without the hidden state)
            if pv.use_hidden:
                b = b + pv.h_proj.bias.double() + pv.h_proj.weight.double() @ hn.bias.double()
                self.w_h = (pv.h_proj.weight.double() * hn.weight.double()[None]).T.float().contiguous().numpy()
            self.w_s = w_s.T.contiguous().numpy()  # [n_scal, dim]
            self.bias = (pv.tok_emb.weight.double() + b[None]).numpy()  # [buckets, dim]
            (l2, l4) = pv.mlp[2], pv.mlp[4]
            self.w2, self.b2 = l2.weight.double().T.contiguous().numpy(), l2.bias.double().numpy()
            self.w4, self.b4 = l4.weight.double()[0].numpy(), float(l4.bias.double()[0])
        self.h_eps, self.s_eps = (hn.eps if hn is not None else 0.0), sn.eps
        self.buckets = pv.hash_buckets

    @staticmethod
    def _gelu(x: np.ndarray) -> np.ndarray:  # the exact (erf) GELU of nn.GELU()
        return np.array([0.5 * v * (1.0 + math.erf(v * _SQRT1_2)) for v in x.tolist()])

    def token_logit(self, hidden: torch.Tensor, token: int, scalars: list[float]) -> float:
        """One token: [D] host hidden row, its id, its scalar floats → its logit (`Preverifier.token_logits`)."""
        mean = sum(scalars) / len(scalars)
        inv = 1.0 / math.sqrt(sum((v - mean) ** 2 for v in scalars) / len(scalars) + self.s_eps)
        s = np.array([(v - mean) * inv for v in scalars])
        x = s @ self.w_s
        if self.w_h is not None:
            h = hidden.detach().float().numpy()
            h = (h - h.mean()) / math.sqrt(float(h.var()) + self.h_eps)
            x = (h @ self.w_h).astype(np.float64) + x
        x = x + self.bias[(token * HASH_MULT) % self.buckets]
        x = self._gelu(self._gelu(x) @ self.w2 + self.b2)
        return float(x @ self.w4) + self.b4


def _logsigmoid(z: float) -> float:
    return -math.log1p(math.exp(-z)) if z >= 0 else z - math.log1p(math.exp(z))


class RoundScorer:
    """`Preverifier.block_accept_prob` for the blocks of one drafting round, at a fraction of its cost.

    A token's logit depends only on its own features and the earlier tokens' (fixed once drafted), so each
    drafted token is scored once, when its block ends, and a block's score is a sum of cached log-sigmoids. The
    new rows run through `Folded` (NumPy, the LayerNorms folded into the projections). Equal to
    `block_accept_prob` up to float rounding (tested)."""

    def __init__(self, pv: nn.Module):
        self.pv = pv
        self.logsig: list[float] = []  # log P(token t accepted | earlier accepted), t = 0.. of this round
        self._folded: Folded | None = None

    def reset(self) -> None:
        self.logsig.clear()
        self._folded = None  # and re-check the weights

    @torch.inference_mode()
    def score(self, features: DraftFeatures) -> float:
        features = features.on_host()  # the drafting loop's are already
        pv, n = self.pv, int(features.tokens.shape[0])
        if features.block_start == 0 or n < len(self.logsig):  # a round's first block: start over
            self.reset()
        done = len(self.logsig)
        if n > done:
            if pv.use_head:  # the head statistics need the draft: the full per-token path for the new tokens
                logits = pv.token_logits(features.hidden[done:], features.tokens[done:], pv.scalars(features, done))
                self.logsig.extend(F.logsigmoid(logits.float()).tolist())
            else:
                lq, ent, toks = features.logq.tolist(), features.entropy.tolist(), features.tokens.tolist()
                margin = pv.margin_of(features)
                mg = None if margin is None else margin.tolist()
                self._folded = self._folded or pv.folded()
                self.logsig.extend(_logsigmoid(self._folded.token_logit(features.hidden[t], toks[t],
                                                                        scalar_row(lq, ent, t, mg)))
                                   for t in range(done, n))
        start = 0 if pv.score_mode == "prefix" else int(features.block_start)
        return math.exp(sum(self.logsig[start:n]))
