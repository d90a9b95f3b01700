"""Verification rules: greedy, token-level speculative sampling, and block verification.

Notation (gpt-fast / Leviathan): the draft proposed x_1..x_g; `q[i]` is the draft distribution x_{i+1} was sampled
from, `p[i]` the target's distribution for the same position (row i of the target's verify forward). `p` has
g+1 rows when a bonus token may be drawn (row g follows the whole draft), else g rows.

Output vocabulary (vLLM's): **accepted** draft tokens, then one **recovered** token (sampled from the residual at
the first rejection) or one **bonus** token (sampled from p[g] when every draft token was accepted).

All ratios are computed in fp64/log space from fp32 probabilities. Draws are keyed by absolute position:
the uniform(s) for x_{i+1} use (seed, pos0 + i, ACCEPT); the recovered/bonus token at position pos0 + j uses
(seed, pos0 + j, RESAMPLE).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specdec.common.errors import InvalidRequestError
from specdec.decoding.sampling import Purpose, SamplingParams, keyed_generator, sample, uniform

METHODS = ("greedy", "token", "block")


@dataclass
class SparseDist:
    """An exact, possibly truncated distribution over the vocabulary: probs[j] = P(ids[j]); zero elsewhere."""

    ids: torch.Tensor  # [k] int64
    probs: torch.Tensor  # [k] float32

    @classmethod
    def from_dense(cls, probs: torch.Tensor) -> "SparseDist":
        ids = torch.nonzero(probs > 0).flatten()
        return cls(ids=ids, probs=probs[ids].float())

    def to_dense(self, vocab_size: int) -> torch.Tensor:
        if self.ids.numel() and (int(self.ids.max()) >= vocab_size or int(self.ids.min()) < 0):
            raise InvalidRequestError("draft_q", f"ids must lie in [0, {vocab_size})")
        return torch.zeros(vocab_size, dtype=torch.float32).index_put_((self.ids.long(),), self.probs.float())


@dataclass
class VerifyResult:
    num_accepted: int  # accepted draft tokens (a prefix of the draft)
    next_token: int | None  # recovered token on rejection, bonus token if all accepted (None: no bonus asked)

    @property
    def output(self) -> list[int]:  # convenience for tests: accepted tokens are the caller's draft[:num_accepted]
        return [] if self.next_token is None else [self.next_token]


def _check(draft: list[int], q: torch.Tensor | None, p: torch.Tensor, sample_bonus: bool):
    g = len(draft)
    need = g + 1 if sample_bonus else g
    if p.shape[0] < need:
        raise ValueError(f"verify needs {need} target rows for {g} draft tokens, got {p.shape[0]}")
    if q is not None and q.shape[0] < g:
        raise ValueError(f"verify needs {g} draft distributions, got {q.shape[0]}")


def _residual_token(p_row: torch.Tensor, q_row: torch.Tensor, scale: float, gen: torch.Generator) -> int:
    """Sample from norm(max(scale·p − q, 0)); falls back to p when that mass is zero (a measure-zero event)."""
    res = (scale * p_row.double() - q_row.double()).clamp_min(0.0)
    total = float(res.sum())
    if not total > 0.0:
        return sample(p_row, gen)
    return sample((res / total).float(), gen)


def verify_greedy(draft: list[int], p: torch.Tensor, sample_bonus: bool = True) -> VerifyResult:
    """Accept while x_i == argmax p; then emit argmax of the first mismatching row (or of row g)."""
    _check(draft, None, p, sample_bonus)
    target_top = p.argmax(-1).tolist()
    for i, x in enumerate(draft):
        if x != target_top[i]:
            return VerifyResult(i, target_top[i])
    return VerifyResult(len(draft), target_top[len(draft)] if sample_bonus else None)


def verify_token(draft: list[int], q: torch.Tensor, p: torch.Tensor, seed: int, pos0: int,
                 sample_bonus: bool = True) -> VerifyResult:
    """Standard speculative sampling: accept x_i iff u_i · q_i(x_i) <= p_i(x_i); resample the residual on reject."""
    _check(draft, q, p, sample_bonus)
    for i, x in enumerate(draft):
        qx, px = float(q[i, x]), float(p[i, x])
        if qx <= 0.0:
            raise InvalidRequestError("draft_q", f"draft token {x} at offset {i} has zero draft probability")
        u = float(uniform(keyed_generator(seed, pos0 + i, Purpose.ACCEPT)))
        if u * qx > px:
            return VerifyResult(i, _residual_token(p[i], q[i], 1.0, keyed_generator(seed, pos0 + i, Purpose.RESAMPLE)))
    g = len(draft)
    bonus = sample(p[g], keyed_generator(seed, pos0 + g, Purpose.RESAMPLE)) if sample_bonus else None
    return VerifyResult(g, bonus)


def block_acceptance_weights(draft: list[int], q: torch.Tensor, p: torch.Tensor):
    """Block verification's running capped ratios P_0..P_g and acceptance weights h_1..h_g
    (docs/design/algorithms.md, "Block verification")."""
    g = len(draft)
    log_run = [0.0]
    for i, x in enumerate(draft):
        qx, px = float(q[i, x]), float(p[i, x])
        if qx <= 0.0:
            raise InvalidRequestError("draft_q", f"draft token {x} at offset {i} has zero draft probability")
        step = (math.log(px) if px > 0.0 else -math.inf) - math.log(qx)
        log_run.append(min(0.0, log_run[-1] + step))
    run = [math.exp(v) for v in log_run]  # P_0..P_g, P_0 = 1
    h = [0.0] * (g + 1)  # h[0] unused
    for i in range(1, g + 1):
        if i < g:
            z = float((run[i] * p[i].double() - q[i].double()).clamp_min(0.0).sum())
            denom = z + 1.0 - run[i]
            h[i] = 1.0 if denom <= 0.0 else z / denom
        else:
            h[i] = run[g]
    return run, h


def verify_block(draft: list[int], q: torch.Tensor, p: torch.Tensor, seed: int, pos0: int,
                 sample_bonus: bool = True) -> VerifyResult:
    """Block verification (Sun et al.): keep the LARGEST i with η_i <= h_i, then sample from the scaled residual."""
    _check(draft, q, p, sample_bonus)
    g = len(draft)
    run, h = block_acceptance_weights(draft, q, p)
    tau = 0
    for i in range(g, 0, -1):  # scanning down and stopping at the first pass = taking the largest passing index
        if float(uniform(keyed_generator(seed, pos0 + i - 1, Purpose.ACCEPT, stream=pos0 + 1))) <= h[i]:
            tau = i
            break
    if tau == g:
        bonus = sample(p[g], keyed_generator(seed, pos0 + g, Purpose.RESAMPLE, stream=pos0 + 1)) if sample_bonus else None
        return VerifyResult(g, bonus)
    gen = keyed_generator(seed, pos0 + tau, Purpose.RESAMPLE, stream=pos0 + 1)
    return VerifyResult(tau, _residual_token(p[tau], q[tau], run[tau], gen))


def verify(method: str, draft: list[int], q: torch.Tensor | None, p: torch.Tensor, params: SamplingParams,
           pos0: int, sample_bonus: bool = True) -> VerifyResult:
    """Dispatch on `method`. At temperature 0 every method takes the greedy path (BV degenerates to matching)."""
    if method not in METHODS:
        raise InvalidRequestError("verify_method", f"unknown method {method!r}; use one of {', '.join(METHODS)}")
    if params.greedy or method == "greedy":
        if not params.greedy:
            raise InvalidRequestError("verify_method", "greedy verification needs temperature 0; use token or block")
        return verify_greedy(draft, p, sample_bonus)
    if q is None and not draft:
        q = torch.empty(0, p.shape[-1])
    if q is None:
        raise InvalidRequestError("draft_q", "sampled verification needs the draft distributions q")
    fn = verify_token if method == "token" else verify_block
    return fn(draft, q, p, params.seed, pos0, sample_bonus)
