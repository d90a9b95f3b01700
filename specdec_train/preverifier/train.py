"""Training and evaluation of the pre-verifier on collected rounds (see collect.py), and θ tuning by simulation."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdec.decoding.preverifier import Preverifier, head_stats, token_scalars


@dataclass
class TokenSet:
    hidden: torch.Tensor  # [N, D] fp16 (cast per batch)
    tokens: torch.Tensor  # [N]
    scalars: torch.Tensor  # [N, S]
    label: torch.Tensor  # [N] in [0, 1]
    round_id: torch.Tensor  # [N]
    pos: torch.Tensor  # [N] position in its round
    greedy: torch.Tensor  # [N] bool

    def __len__(self):
        return self.label.shape[0]


def to_tokenset(rounds, use_head: bool = True, head=None, use_margin: bool = False) -> TokenSet:
    """head: a Preverifier with the draft attached; its head statistics replace the stored exact ones (so training
    sees exactly what the runtime computes, e.g. through the low-rank head). use_margin: the draft's top-1 − top-2
    margin (the stored head statistics' third column, what `DraftFeatures.margin` carries) as one more scalar."""
    if not rounds:
        return TokenSet(torch.zeros(0, 1, dtype=torch.half), torch.zeros(0, dtype=torch.long),
                        torch.zeros(0, 8 + (4 if use_head else 0) + (1 if use_margin else 0)),
                        torch.zeros(0), torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long),
                        torch.zeros(0, dtype=torch.bool))
    hs, ts, ss, ls, rs, ps, gs = [], [], [], [], [], [], []
    for i, r in enumerate(rounds):
        g = r["tokens"].shape[0]
        hs.append(r["hidden"].half())
        ts.append(r["tokens"].long())
        sc = token_scalars(r["logq"], r["entropy"], r["aux"][:, 2] if use_margin else None)
        if use_head and head is not None:
            with torch.inference_mode():
                logits, idx = head._head_logits(r["hidden"].float(), r["tokens"])
                aux = head_stats(logits, idx)
        else:
            aux = r["aux"].float() if use_head else None
        ss.append(torch.cat([sc, aux], -1) if use_head else sc)
        ls.append(r["label"].float())
        rs.append(torch.full((g,), i))
        ps.append(torch.arange(g))
        gs.append(torch.full((g,), r["temperature"] == 0.0))
    return TokenSet(torch.cat(hs), torch.cat(ts), torch.cat(ss), torch.cat(ls), torch.cat(rs), torch.cat(ps),
                    torch.cat(gs))


def train_preverifier(train: TokenSet, dev: TokenSet | None, hidden_size: int, dim: int = 64,
                      hash_buckets: int = 4096, epochs: int = 30, lr: float = 2e-3, weight_decay: float = 0.05,
                      batch_size: int = 2048, seed: int = 0, log=print, use_head: bool = True,
                      dropout: float = 0.1, head_rank: int = 0, use_hidden: bool = True,
                      use_margin: bool = False) -> tuple[Preverifier, dict]:
    """Per-token BCE on P(x_t accepted | x_<t accepted) (soft labels allowed); early stopping on dev loss."""
    torch.manual_seed(seed)
    model = Preverifier(hidden_size, dim=dim, hash_buckets=hash_buckets, use_head=use_head, dropout=dropout,
                        head_rank=head_rank, use_hidden=use_hidden, use_margin=use_margin)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    n = len(train)
    steps = max(1, epochs * math.ceil(n / batch_size))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    best, best_state, history = float("inf"), None, []
    t0 = time.time()
    for ep in range(epochs):
        model.train()
        perm = torch.randperm(n)
        tot = 0.0
        for b in range(0, n, batch_size):
            idx = perm[b:b + batch_size]
            logit = model.token_logits(train.hidden[idx].float(), train.tokens[idx], train.scalars[idx])
            loss = F.binary_cross_entropy_with_logits(logit, train.label[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            tot += loss.item() * len(idx)
        dev_loss = token_loss(model, dev) if dev is not None and len(dev) else tot / n
        history.append((ep, tot / n, dev_loss))
        if dev_loss < best:
            best, best_state = dev_loss, {k: v.clone() for k, v in model.state_dict().items()}
        log(f"epoch {ep:2d}  train bce {tot / n:.4f}  dev bce {dev_loss:.4f}  ({time.time() - t0:.0f}s)")
    model.load_state_dict(best_state)
    return model.eval(), {"epochs": epochs, "best_dev_bce": best, "history": history}


@torch.no_grad()
def token_loss(model: Preverifier, ds: TokenSet) -> float:
    model.eval()
    logit = predict_tokens(model, ds)
    return float(F.binary_cross_entropy_with_logits(logit, ds.label))


@torch.no_grad()
def predict_tokens(model: Preverifier, ds: TokenSet, chunk: int = 8192) -> torch.Tensor:
    model.eval()
    out = [model.token_logits(ds.hidden[i:i + chunk].float(), ds.tokens[i:i + chunk], ds.scalars[i:i + chunk])
           for i in range(0, len(ds), chunk)]
    return torch.cat(out) if out else torch.empty(0)


# ----------------------------------------------------------------------------------------------------------------
@dataclass
class RoundTable:
    """Per round: per-token log P(accept) predictions and labels, padded to gamma_max."""

    logp: torch.Tensor  # [R, G] predicted log P(x_t accepted | x_<t accepted)
    label: torch.Tensor  # [R, G] label (hard or soft)
    greedy: torch.Tensor  # [R]
    starts: list | None = None  # [(text, start)] per round when there is a round at every position (`replay`)

    @property
    def exact(self) -> bool:
        """Greedy rounds at every position of their texts: `replay` can walk the decoder exactly."""
        return self.starts is not None and None not in self.starts and bool(self.greedy.all())

    def subset(self, rows: torch.Tensor) -> "RoundTable":
        starts = None if self.starts is None else [st for st, keep in zip(self.starts, rows.tolist()) if keep]
        return RoundTable(self.logp[rows], self.label[rows], self.greedy[rows], starts)


def attach_starts(tab: RoundTable, rounds: list[dict]) -> RoundTable:
    """Give `tab` its rounds' (text, start) when every text has a round at every position from 0 (label files
    from `collect --walk-gamma 0`): then `simulate` replays the decoder exactly on a table of such rounds."""
    keys = [(r.get("source_file"), r["prompt"], r["temperature"]) for r in rounds]
    per: dict = {}
    for k, r in zip(keys, rounds):
        per.setdefault(k, set()).add(int(r.get("start", -1)))  # -1: a file from before starts were recorded
    dense = {k for k, st in per.items() if st == set(range(max(st) + 1))}
    if dense:  # None for the rounds of other texts (e.g. a subsampled T=1 file beside dense greedy ones)
        tab.starts = [(k, int(r["start"])) if k in dense else None for k, r in zip(keys, rounds)]
    return tab


def round_table(model: Preverifier, ds: TokenSet) -> RoundTable:
    lp = F.logsigmoid(predict_tokens(model, ds))
    R = int(ds.round_id.max()) + 1 if len(ds) else 0
    G = int(ds.pos.max()) + 1 if len(ds) else 0
    logp = torch.zeros(R, G)
    label = torch.zeros(R, G)
    greedy = torch.zeros(R, dtype=torch.bool)
    logp[ds.round_id, ds.pos] = lp
    label[ds.round_id, ds.pos] = ds.label
    greedy[ds.round_id] = ds.greedy
    return RoundTable(logp, label, greedy)


def block_scores(tab: RoundTable, B: int, mode: str = "block"):
    """→ scores [R, K], labels [R, K] (P(block k all accepted | earlier accepted)), reached [R, K] (soft weight
    that the earlier blocks were accepted, i.e. that the block is reached with an accepted prefix)."""
    R, G = tab.logp.shape
    K = G // B
    lp = tab.logp[:, :K * B].reshape(R, K, B).sum(-1)
    lab = tab.label[:, :K * B].clamp(0, 1).reshape(R, K, B).prod(-1)
    cum = torch.cumsum(lp, 1)
    score = (cum if mode == "prefix" else lp).exp()
    reached = torch.cat([torch.ones(R, 1), torch.cumprod(lab, 1)[:, :-1]], 1)
    return score, lab, reached


def weighted_auc(score: torch.Tensor, label: torch.Tensor, weight: torch.Tensor | None = None) -> float:
    """AUC with soft labels: each item is a positive of weight w·y and a negative of weight w·(1-y)."""
    s, y = score.flatten().double(), label.flatten().double()
    w = torch.ones_like(s) if weight is None else weight.flatten().double()
    pos, neg = w * y, w * (1 - y)
    uniq, inv = torch.unique(s, return_inverse=True)
    P = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inv, pos)
    N = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inv, neg)
    neg_below = torch.cumsum(N, 0) - N
    tot = float((P * (neg_below + 0.5 * N)).sum())
    denom = float(P.sum() * N.sum())
    return tot / denom if denom > 0 else float("nan")


def classification_report(score, label, theta: float, weight=None) -> dict:
    """'block accepted' as the positive class; predicted positive = continue (score >= θ)."""
    s, y = score.flatten().double(), label.flatten().double()
    w = torch.ones_like(s) if weight is None else weight.flatten().double()
    pred = (s >= theta).double()
    tp = float((w * y * pred).sum())
    fp = float((w * (1 - y) * pred).sum())
    fn = float((w * y * (1 - pred)).sum())
    tn = float((w * (1 - y) * (1 - pred)).sum())
    return {"auc": weighted_auc(s, y, w), "precision": tp / max(tp + fp, 1e-12), "recall": tp / max(tp + fn, 1e-12),
            "false_stop_rate": fn / max(tp + fn, 1e-12), "false_continue_rate": fp / max(fp + tn, 1e-12),
            "positive_rate": (tp + fn) / max(tp + fp + fn + tn, 1e-12), "n": int(s.numel()), "theta": theta}


# ----------------------------------------------------------------------------------------------------------------
@dataclass
class Costs:
    """Measured costs (seconds): a draft token, a pre-verifier call, a target verify forward of n+1 tokens."""

    draft_token_s: float
    target_base_s: float
    target_per_token_s: float
    preverifier_s: float = 0.0

    def target_s(self, n):
        return self.target_base_s + self.target_per_token_s * n

    @property
    def ratio(self) -> float:
        return (self.target_base_s + self.target_per_token_s) / max(self.draft_token_s, 1e-12)


def fit_costs(rounds, gamma_max: int) -> Costs:
    """Draft cost per token from the rounds; target cost assumed flat in the draft length over the collected
    range (one measured point: gamma_max+1 rows), refined by the ablation's measured forwards if given."""
    d = sorted(r["draft_ns"] / r["tokens"].shape[0] for r in rounds)
    t = sorted(r["forward_ns"] for r in rounds if r["forward_ns"] > 0)
    med = lambda xs: xs[len(xs) // 2] / 1e9 if xs else 0.0  # noqa: E731
    return Costs(draft_token_s=med(d), target_base_s=med(t), target_per_token_s=0.0)


def draft_lengths(tab: RoundTable, B: int | None, theta: float | None, gamma: int, mode: str = "block",
                  oracle: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per round: how many tokens fixed γ (B=None) or a pacer (block B, threshold θ) drafts, and how many times
    the pacer asks its pre-verifier (it stops after the first block whose score < θ, or at γ, unasked). oracle:
    the perfect stop rule, free: exactly up to the first rejected token (hard labels), or γ."""
    R, G = tab.logp.shape
    if oracle:
        lead = torch.cumprod((tab.label.clamp(0, 1) >= 0.5).float(), 1).sum(1)
        return torch.clamp(lead + 1, max=min(gamma, G)), torch.zeros(R)
    if B is None:
        return torch.full((R,), min(gamma, G)), torch.zeros(R)
    score, _, _ = block_scores(tab, B, mode)
    K = min(score.shape[1], gamma // B)
    n = torch.full((R,), K * B)
    calls = torch.full((R,), float(max(K - 1, 0)))
    stopped = torch.zeros(R, dtype=torch.bool)
    for k in range(K - 1):  # the rule is not asked after the last block (gamma reached)
        stop_now = (~stopped) & (score[:, k] < theta)
        n = torch.where(stop_now, torch.full_like(n, (k + 1) * B), n)
        calls = torch.where(stop_now, torch.full_like(calls, float(k + 1)), calls)
        stopped |= stop_now
    return n, calls


def simulate(tab: RoundTable, costs: Costs, B: int | None, theta: float | None, gamma: int,
             mode: str = "block", hard: bool = True, oracle: bool = False) -> dict:
    """Expected tokens/s of rounds drawn from `tab` for fixed γ (B=None) or pacer (block B, threshold θ).

    Per round: the draft proposes n tokens (pacer: stops after the first block whose score < θ, or at γ);
    the expected number of accepted tokens is Σ_{i<n} Π_{j≤i} label_j, plus one recovered/bonus token.
    With `tab.starts` (rounds at every position, `collect --walk-gamma 0`) it replays the decoder exactly instead
    (`replay`): the rounds are the ones this policy would make, not ones laid out by another walk."""
    if tab.exact:
        return replay(tab, costs, B, theta, gamma, mode, oracle)
    R, G = tab.logp.shape
    lab = tab.label.clamp(0, 1)
    if hard:
        lab = (lab >= 0.5).float() if tab.greedy.all() else lab
    surv = torch.cumprod(lab, 1)  # P(first i+1 tokens accepted)
    n, calls = draft_lengths(tab, B, theta, gamma, mode, oracle)
    idx = torch.arange(G)[None, :]
    acc = (surv * (idx < n[:, None])).sum(1)
    tokens = acc + 1
    time_s = n * costs.draft_token_s + calls * costs.preverifier_s + costs.target_s(n)
    return {"tokens_per_s": float(tokens.sum() / time_s.sum()), "mean_accepted_length": float(tokens.mean()),
            "mean_draft_len": float(n.float().mean()), "wasted_per_round": float((n - acc).mean())}


def replay(tab: RoundTable, costs: Costs, B: int | None, theta: float | None, gamma: int, mode: str = "block",
           oracle: bool = False, max_tokens: int | None = None) -> dict:
    """Greedy decoding walked exactly over each text: from the text's first round, the policy drafts n tokens,
    the target accepts min(n, leading matches) plus one of its own, and the next round starts there. Needs a
    round at every position (`tab.starts`: (text, start) per round; greedy rows only). oracle: draft exactly up
    to the first rejected token (the perfect stop rule). max_tokens: stop a text there (max_new_tokens)."""
    lead = torch.cumprod((tab.label.clamp(0, 1) >= 0.5).float(), 1).sum(1).long().tolist()
    n, calls = draft_lengths(tab, B, theta, gamma, mode, oracle)
    n_t, calls_t = n.long().tolist(), calls.tolist()
    at = {(t, s): i for i, (t, s) in enumerate(tab.starts)}
    first: dict = {}
    for t, s in tab.starts:
        first[t] = min(first.get(t, s), s)
    rounds = tokens = drafted = wasted = 0
    time_s = 0.0
    for t, s in first.items():
        i, s0 = at.get((t, s)), s
        while i is not None and (max_tokens is None or s - s0 < max_tokens):
            n = n_t[i]
            acc = min(lead[i], n)
            rounds, tokens, drafted, wasted = rounds + 1, tokens + acc + 1, drafted + n, wasted + n - acc
            time_s += n * costs.draft_token_s + calls_t[i] * costs.preverifier_s + costs.target_s(n)
            s += acc + 1
            i = at.get((t, s))
    return {"tokens_per_s": tokens / max(time_s, 1e-12), "mean_accepted_length": tokens / max(rounds, 1),
            "mean_draft_len": drafted / max(rounds, 1), "wasted_per_round": wasted / max(rounds, 1),
            "rounds": rounds}


def tune_threshold(tab: RoundTable, costs: Costs, B: int, gamma: int, mode: str = "block",
                   grid=None) -> tuple[float, dict]:
    grid = grid if grid is not None else [i / 100 for i in range(2, 96, 2)]
    best = (None, {"tokens_per_s": -1})
    for th in grid:
        r = simulate(tab, costs, B, th, gamma, mode)
        if r["tokens_per_s"] > best[1]["tokens_per_s"]:
            best = (th, r)
    return best
