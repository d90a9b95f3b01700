"""Sampling parameters, the logits→probabilities transform shared by draft (q) and target (p), and keyed RNG.

One transform for both models (temperature, then top-k, then top-p, all in fp32): the speculative-sampling proof
needs q to be exactly the distribution the draft token was drawn from and p the target's under the *same*
processing. Temperature 0 is the argmax path everywhere (one-hot distributions).

Randomness is keyed, not streamed: every draw uses a fresh `torch.Generator` seeded from
(request seed, absolute position, purpose). A retried call replays the same draws, a rolled-back position draws
again with the same key but a new context, and the draft's sample and the acceptance uniform of one position
are independent streams (vLLM keys its Philox state on position for the same reason).

Position alone is not enough where a verify's outcome depends on draws past the tokens it keeps. Block
verification tests every η_i and reads every draft token of its block to choose how many to keep, so the η's and
draft samples at the positions after the kept prefix are conditioned on that choice; the next round drafts and
tests those positions again, and must not redraw the same numbers. Block verification keys its draws by the
block's start position too, and the draft its samples by its call's start (a new call after each verify that
rejects). Token verification stops at its first rejection and never reads later positions, so its keys stay
per-position (the draft's extra key is harmless there). A retried call has the same starts: it still replays.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

import torch


class Purpose(IntEnum):
    DRAFT = 1  # the draft's sample at a position
    ACCEPT = 2  # the acceptance uniform(s) of a position
    RESAMPLE = 3  # the recovered (residual) or bonus token of a position
    TARGET = 4  # the target's own sample in autoregressive decoding


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def keyed_generator(seed: int, position: int, purpose: Purpose, device: str | torch.device = "cpu",
                    stream: int = 0) -> torch.Generator:
    """`stream` (non-zero) keys the draw by more than its position: block verification keys its uniforms by the
    block's start, and the draft its samples by its call's start (module docstring)."""
    key = _splitmix64(_splitmix64(_splitmix64(seed & _MASK64) ^ position) ^ int(purpose))
    if stream:
        key = _splitmix64(key ^ (stream & _MASK64))
    return torch.Generator(device=device).manual_seed(key & ((1 << 63) - 1))


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 → greedy
    top_k: int = 0  # 0 → off
    top_p: float = 1.0  # 1 → off
    seed: int = 0
    # committed tokens' log-probabilities (target_logprobs) with this many top alternatives each; -1: none
    logprobs: int = -1
    # the same for the prompt's tokens after the first (the target's prefill); -1: none
    prompt_logprobs: int = -1
    # prefix caching: reuse cached prompt prefixes only of sessions with the same salt (specdec/state/prefix_cache.py)
    cache_salt: str = ""
    # the target's logits adjustments (specdec/decoding/penalties.py), before temperature: OpenAI's and vLLM's
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    # structured output (specdec/text/grammar.py): an llguidance grammar the output must match; "": none
    grammar: str = ""
    # vLLM's min_p: after temperature, drop tokens less likely than min_p times the most likely one; 0: off
    min_p: float = 0.0
    # vLLM's min_tokens: the first min_tokens output tokens are never one of stop_ids (EOS, stop token ids), which
    # the coordinator fills (specdec/decoding/penalties.py)
    min_tokens: int = 0
    stop_ids: tuple[int, ...] = ()
    # vLLM's allowed_token_ids: the output only ever holds these tokens (specdec/decoding/penalties.py); (): any
    allowed_token_ids: tuple[int, ...] = ()
    # vLLM's bad_words, as token id sequences: no output ends with one of them (specdec/decoding/penalties.py)
    bad_words: tuple[tuple[int, ...], ...] = ()
    # the message these were read from (specdec_rpc.decode.sampling_from_proto), which transports forward as it
    # came rather than writing a new one; None: built in process. Not a setting: equality and copies ignore it
    source: object = field(default=None, init=False, repr=False, compare=False)

    def __getstate__(self) -> dict:
        """Pickled (a Ray actor's request) without its source message: that belongs to the process that read it."""
        return {**self.__dict__, "source": None}

    @property
    def greedy(self) -> bool:
        """Temperature 0, or one so small (< SAMPLING_EPS) that dividing by it would overflow: its limit, greedy,
        as vLLM's."""
        return self.temperature < SAMPLING_EPS


MAX_TOP_LOGPROBS = 20
MAX_CACHE_SALT = 256
MAX_LOGIT_BIAS = 300  # OpenAI's limit
MAX_ALLOWED_TOKEN_IDS = 4096
MAX_BAD_WORDS = 256  # token sequences (a word becomes two: as is and after a space)
SAMPLING_EPS = 1e-5  # temperatures below it sample greedily (vLLM's _SAMPLING_EPS)
MAX_STOP_IDS = 256  # EOS ids and a request's stop_token_ids (the coordinator allows 64)
MAX_GRAMMAR_CHARS = 512 * 1024  # a compiled grammar (a schema's, with the choices or Lark text inside)


@dataclass
class TokenLogprobs:
    """log p(token) under the target's raw distribution (its logits' softmax: temperature 1, no top-k / top-p, as
    OpenAI's and vLLM's logprobs) for tokens at consecutive positions from `position`, with each position's `top`
    most likely tokens. Speculative decoding commits exactly the target's tokens, so these are the target's
    logprobs of the output whatever drafted it."""

    position: int
    token_ids: list[int]
    logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


def concat_logprobs(parts: list[TokenLogprobs]) -> TokenLogprobs:
    """Consecutive runs of positions → one."""
    return TokenLogprobs(parts[0].position, [t for p in parts for t in p.token_ids],
                         [v for p in parts for v in p.logprobs], [i for p in parts for i in p.top_ids],
                         [v for p in parts for v in p.top_logprobs])


def target_logprobs(rows: torch.Tensor, token_ids: list[int], position: int, top: int) -> TokenLogprobs:
    """rows[i]: the target's logits that decided token_ids[i] (at position + i)."""
    lp = torch.log_softmax(rows[:len(token_ids)].float(), dim=-1)
    chosen = lp.gather(-1, torch.tensor(token_ids, dtype=torch.long)[:, None])[:, 0]
    vals, ids = lp.topk(top, dim=-1) if top > 0 else (lp[:, :0], lp[:, :0].long())
    return TokenLogprobs(position, list(token_ids), chosen.tolist(), ids.tolist(), vals.tolist())


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., V] logits → [..., V] fp32 probabilities under `params` (one-hot argmax at temperature 0)."""
    logits = logits.float()
    if params.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = logits / params.temperature
    if params.min_p > 0.0:  # vLLM's order: after temperature, before top-k / top-p
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < params.min_p * probs.amax(-1, keepdim=True), float("-inf"))
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        remove = cum - sorted_logits.softmax(-1) >= params.top_p  # keep the smallest prefix reaching top_p
        logits = logits.masked_fill(remove.scatter(-1, idx, remove), float("-inf"))
    return logits.softmax(-1)


def truncate_top_k(probs: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k most likely entries of each row and renormalise (the draft's proposal truncation)."""
    if k <= 0 or k >= probs.shape[-1]:
        return probs
    vals, idx = torch.topk(probs, k, dim=-1)
    out = torch.zeros_like(probs).scatter_(-1, idx, vals)
    return out / out.sum(-1, keepdim=True)


def sample(probs: torch.Tensor, gen: torch.Generator | None) -> int:
    """One draw from a 1-D probability vector (argmax when it is one-hot or no generator is given).

    On a CPU by the inverse CDF: one uniform and a binary search over the float64 cumulative sum. torch.multinomial
    draws the same distribution but costs ~0.9 ms for a 49,152-entry row there, once per sampled draft token and
    per verify. Entry i is drawn iff cdf[i-1] <= v < cdf[i], so a zero-probability entry never is."""
    if gen is None:
        return int(probs.argmax())
    if probs.device.type != "cpu":
        return int(torch.multinomial(probs, 1, generator=gen))
    cdf = torch.cumsum(probs.to(torch.float64), 0)
    i = int(torch.searchsorted(cdf, uniform(gen) * cdf[-1], right=True))
    if i >= probs.shape[0]:  # u * total rounded up to total: the last entry that has mass
        i = int(torch.nonzero(probs)[-1])
    return i


def uniform(gen: torch.Generator, n: int = 1) -> torch.Tensor:
    """n uniforms in (0, 1): never exactly 0, so `u <= 0` can never pass a zero-probability test."""
    return torch.rand(n, generator=gen, dtype=torch.float64).clamp_min(1e-300)
