"""Label collection: run real speculative-decoding rounds with the project's workers and record, per drafted token,
the draft's features and whether the target accepts it given the earlier drafted tokens were accepted.

Per round (draft `gamma_max` tokens with `FixedLength`, then one target verify of all of them):
- greedy: label_i = 1 if x_i == argmax p_i (p_i is the target's row after x_<i, so this is exactly
  "accepted | x_<i accepted"), else 0;
- sampled: label_i = min(1, p_i(x_i) / q_i(x_i)) (the token-verification acceptance probability), a soft label.
The target's rows are read once from the same forward that verifies the round, so labelling costs nothing extra.
The trajectory then advances exactly as `mode=sd` does (accepted tokens + the recovered/bonus token).
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

import torch

from specdec.decoding.preverifier import head_stats
from specdec.decoding.sampling import SamplingParams, logits_to_probs
from specdec.decoding.stop import FixedLength
from specdec.workers.draft import DraftWorker
from specdec.workers.target import TargetWorker


class _LabelTarget(TargetWorker):
    """A TargetWorker that keeps the logits of its last forward (the rows that check the draft)."""

    last_rows: torch.Tensor | None = None

    def _finish(self, a, s, logits):
        nf = len(a.feed)
        self.last_rows = None if logits is None else logits[max(nf - 1, 0):]
        return super()._finish(a, s, logits)


@dataclass
class Round:
    hidden: torch.Tensor  # [g, D] fp16
    tokens: torch.Tensor  # [g] int32
    logq: torch.Tensor  # [g] fp32
    entropy: torch.Tensor  # [g] fp32
    label: torch.Tensor  # [g] fp32 in [0, 1]: P(x_i accepted | x_<i accepted)
    aux: torch.Tensor  # [g, N_HEAD] statistics of the draft's temperature-1 distribution (preverifier.head_stats)
    temperature: float
    prompt: int  # index of the prompt (for splits)
    num_accepted: int  # what the real verification accepted this round
    draft_ns: int
    forward_ns: int

    def to_dict(self) -> dict:
        return dict(self.__dict__)


class _Recorder(FixedLength):
    needs_features = True

    def __init__(self):
        self.features = None

    def should_stop(self, features) -> bool:
        self.features = features
        return False


@dataclass
class CollectStats:
    rounds: int = 0
    tokens: int = 0
    prompts: int = 0
    seconds: float = 0.0
    per_temperature: dict = field(default_factory=dict)


def collect(draft_model, target_model, prompts: list[list[int]], gamma_max: int = 12,
            temperatures: tuple[float, ...] = (0.0,), max_new_tokens: int = 128, seed: int = 0,
            time_budget_s: float | None = None, eos_token_ids: tuple[int, ...] = (), q_top_k: int = 64,
            prompt_offset: int = 0, progress=None) -> tuple[list[Round], CollectStats]:
    """Run SD rounds over `prompts` (each at every temperature) and return per-round features + labels."""
    ctx = max(len(p) for p in prompts) + max_new_tokens + gamma_max + 2
    ctx = min(ctx, draft_model.config.max_position_embeddings, target_model.config.max_position_embeddings)
    dw = DraftWorker(draft_model, q_top_k=q_top_k, max_sessions=1, max_context=ctx)
    tw = _LabelTarget(target_model, max_sessions=1, max_context=ctx)
    rounds: list[Round] = []
    st = CollectStats()
    t_start = time.perf_counter()
    for pi, prompt in enumerate(prompts):
        for temp in temperatures:
            if time_budget_s is not None and time.perf_counter() - t_start > time_budget_s:
                st.seconds = time.perf_counter() - t_start
                return rounds, st
            params = SamplingParams(temperature=temp, seed=seed * 1_000_003 + pi * 7 + int(temp * 10))
            n = _run_prompt(dw, tw, prompt, params, gamma_max, max_new_tokens, eos_token_ids, rounds,
                            prompt_offset + pi)
            st.tokens += n
            st.per_temperature[str(temp)] = st.per_temperature.get(str(temp), 0) + n
        st.prompts += 1
        if progress is not None:
            progress(pi + 1, len(prompts), len(rounds), time.perf_counter() - t_start)
    st.rounds = len(rounds)
    st.seconds = time.perf_counter() - t_start
    return rounds, st


def _run_prompt(dw: DraftWorker, tw: _LabelTarget, prompt: list[int], params: SamplingParams, gamma_max: int,
                max_new_tokens: int, eos: tuple[int, ...], out: list[Round], prompt_index: int) -> int:
    sid = uuid.uuid4().hex
    f0 = tw.start_session(sid, prompt, params, want_features=dw.reads_features)  # a feature draft reads them
    dw.start_session(sid, prompt, params, features=[f0] if f0 is not None else None)
    fresh = []  # target features the draft has not been sent yet
    history = list(prompt)
    n_prompt = len(prompt)
    draft_fed = target_fed = n_prompt - 1
    method = "greedy" if params.greedy else "token"
    rec = _Recorder()
    try:
        while len(history) - n_prompt < max_new_tokens:
            base_d = min(draft_fed, len(history) - 1)
            append = history[base_d:]
            g = gamma_max
            t0 = time.perf_counter_ns()
            # The stop rule is asked after every token (block_size=1) but never after the last one, so draft one
            # token more than we verify: the rule then sees the features of all g verified tokens.
            blocks = list(dw.draft_blocks(sid, base_d, append, g + 1, rec, block_size=1, features=fresh or None))
            fresh = []
            draft_ns = (time.perf_counter_ns() - t0) * g // (g + 1)
            toks = [t for b in blocks for t in b.tokens][:g]
            qs = [d for b in blocks for d in b.q][:g]
            feats = rec.features
            hidden, logq, ent = feats.hidden[:g], feats.logq[:g], feats.entropy[:g]
            draft_fed = base_d + len(append) + g - 1
            base_t = target_fed if target_fed < len(history) else len(history)
            feed = history[base_t:]
            res = tw.verify(sid, base_t, feed, toks, qs, method)
            if res.features is not None:
                fresh.append(res.features)
            rows = tw.last_rows[: len(toks)]
            p = logits_to_probs(rows, params)
            x = torch.tensor(toks)
            px = p.gather(1, x[:, None])[:, 0]
            if params.greedy:
                label = (p.argmax(-1) == x).float()
            else:
                label = (px / logq.exp().clamp_min(1e-30)).clamp(max=1.0)
            with torch.inference_mode():
                aux = head_stats(dw.model.full_logits(hidden.to(dw.model.dtype)), x)
            out.append(Round(hidden=hidden.half(), tokens=x.int(), logq=logq.float(), entropy=ent.float(),
                             label=label.float(), aux=aux.float(), temperature=params.temperature, prompt=prompt_index,
                             num_accepted=res.num_accepted, draft_ns=draft_ns, forward_ns=res.forward_ns))
            target_fed = base_t + len(feed) + res.num_accepted
            new = toks[:res.num_accepted] + [res.next_token]
            stop = False
            for t in new:
                history.append(t)
                if t in eos or len(history) - n_prompt >= max_new_tokens:
                    stop = True
                    break
            if stop:
                break
    finally:
        dw.end_session(sid)
        tw.end_session(sid)
    return len(history) - n_prompt
