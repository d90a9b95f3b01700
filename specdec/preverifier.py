"""PACER's learned blockwise pre-verifier (ALGORITHMS.md §4.4; docs/pacer.md).

The draft drafts in blocks of B tokens. After each block the pre-verifier estimates
    s_k = P(every token of block k is accepted by the target | the earlier blocks of this round were),
and the stop rule (`specdec.stop.PreverifierStop`) stops drafting when s_k < θ. The pre-verifier only chooses the
draft length, so it can never change the output distribution.

Model (cheap on purpose: it runs after every block, on the draft's critical path):
- per drafted token t: the draft's last hidden state h_t (the state that produced q_t; LayerNorm + linear),
  a hashed embedding of the drafted token x_t (h_t does not know x_t yet), and scalar uncertainty features
  (log q(x_t), entropy of q_t, q(x_t), position in the round, the previous token's log q / entropy, the running
  sum of log q before t);
- a 2-layer MLP gives a per-token logit a_t = logit P(x_t accepted | x_<t accepted) (trained on per-token
  conditional labels: greedy `x == argmax p`, sampled `min(1, p/q)` as a soft label);
- the block probability is the product of the per-token sigmoids over the block (mode "block"), or over every
  token drafted so far (mode "prefix": P(the whole round so far is accepted)).

Files (`save_preverifier` / `load_preverifier`): `config.json` (architecture, threshold, block size, score mode,
the draft's fingerprint), `model.safetensors`, `card.json` and `README.md` (the model card).
"""
from __future__ import annotations

import hashlib
import json
import math
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from specdec.stop import DraftFeatures

DEFAULT_PREVERIFIER_DIR = Path(__file__).resolve().parent / "assets" / "default_preverifier"
N_SCALARS = 8
N_HEAD = 4  # statistics of the draft's own temperature-1 distribution (when the draft head is attached)
_HASH_MULT = 2654435761
_SQRT1_2 = 1.0 / math.sqrt(2.0)


class PreverifierMismatchError(ValueError):
    """The pre-verifier was trained for another draft model (its hidden states mean something else)."""


def token_scalars(logq: torch.Tensor, entropy: torch.Tensor, margin: torch.Tensor | None = None) -> torch.Tensor:
    """[n] log q, [n] entropy (, [n] margin) → [n, N_SCALARS (+1)] per-token scalar features (all tokens of the
    round so far); the draft's top-1 − top-2 margin is the last column when given."""
    logq = logq.float().clamp_min(-30.0)
    entropy = entropy.float()
    n = logq.shape[0]
    pos = torch.arange(n, dtype=torch.float32)
    prev_logq = torch.cat([logq.new_zeros(1), logq[:-1]])
    prev_ent = torch.cat([entropy.new_zeros(1), entropy[:-1]])
    cum_before = torch.cumsum(logq, 0) - logq
    cols = [logq, entropy, logq.exp(), pos / 8.0, prev_logq, prev_ent, cum_before / 4.0, (pos == 0).float()]
    if margin is not None:
        cols.append(margin.float().clamp_max(30.0) / 4.0)
    return torch.stack(cols, dim=-1)


def head_stats(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[m, V] draft logits (−inf allowed), [m] drafted ids → [m, N_HEAD]: max log-prob, entropy, top-1 − top-2
    margin and log-prob of the drafted token, all of the temperature-1 softmax (the draft's confidence, which the
    greedy DraftFeatures do not carry: there q is one-hot)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    top = lp.topk(2, dim=-1).values
    ent = torch.special.entr(lp.exp()).sum(-1)
    lpx = lp.gather(-1, tokens.long()[:, None])[:, 0].clamp_min(-30.0)
    return torch.stack([top[:, 0], ent, (top[:, 0] - top[:, 1]).clamp_max(30.0), lpx], dim=-1)


class Preverifier(nn.Module):
    """Predicts P(block accepted) from the draft's features of the tokens drafted this round."""

    def __init__(self, hidden_size: int, dim: int = 64, hash_buckets: int = 4096, block_size: int = 2,
                 threshold: float = 0.5, score_mode: str = "block", dropout: float = 0.1, use_head: bool = False,
                 head_rank: int = 0, use_hidden: bool = True, use_margin: bool = False):
        super().__init__()
        if score_mode not in ("block", "prefix"):
            raise ValueError(f"score_mode must be 'block' or 'prefix', got {score_mode!r}")
        self.hidden_size, self.dim, self.hash_buckets = hidden_size, dim, hash_buckets
        self.block_size = int(block_size)
        self.threshold = float(threshold)
        self.score_mode = score_mode
        self.use_head = bool(use_head)
        self.head_rank = int(head_rank)  # >0: the draft head through its rank-r SVD (cheap); 0: the exact head
        # use_hidden=False: no hidden-state projection (token + scalars only: a fraction of the cost per call);
        # use_margin: the draft's top-1 − top-2 margin as one more scalar (DraftFeatures.margin, from its logits)
        self.use_hidden, self.use_margin = bool(use_hidden), bool(use_margin)
        # the draft whose head gives the N_HEAD statistics (attach_draft): kept out of the module tree (not saved)
        object.__setattr__(self, "_draft", None)
        self._to_compact = None
        n_scal = N_SCALARS + (1 if use_margin else 0) + (N_HEAD if use_head else 0)
        self.h_norm = nn.LayerNorm(hidden_size) if use_hidden else None
        self.h_proj = nn.Linear(hidden_size, dim) if use_hidden else None
        self.tok_emb = nn.Embedding(hash_buckets, dim)
        self.s_norm = nn.LayerNorm(n_scal)
        self.s_proj = nn.Linear(n_scal, dim)
        self.drop = nn.Dropout(dropout)  # training only
        self.mlp = nn.Sequential(nn.GELU(), nn.Dropout(dropout), nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, 1))
        nn.init.normal_(self.tok_emb.weight, std=0.02)

    def config(self) -> dict:
        return {"hidden_size": self.hidden_size, "dim": self.dim, "hash_buckets": self.hash_buckets,
                "block_size": self.block_size, "threshold": self.threshold, "score_mode": self.score_mode,
                "use_head": self.use_head, "head_rank": self.head_rank, "use_hidden": self.use_hidden,
                "use_margin": self.use_margin}

    def attach_draft(self, draft_model) -> "Preverifier":
        """Give a head-using pre-verifier the draft model (its output head turns h_t into the draft's logits)."""
        object.__setattr__(self, "_draft", draft_model)
        subset = getattr(draft_model, "vocab_subset", None)
        self._to_compact = None
        if subset is not None:  # compact head: the statistics are the same on the subset (−inf elsewhere)
            m = torch.zeros(draft_model.config.vocab_size, dtype=torch.long)
            m[subset.long().cpu()] = torch.arange(len(subset))
            self._to_compact = m
        self._lowrank = None
        if self.head_rank > 0:  # W ≈ U_r S_r V_r^T: logits ≈ (h V_r) (U_r S_r)^T, deterministic
            w = draft_model.lm_head.weight.detach().float().cpu()
            U, S, Vh = torch.linalg.svd(w, full_matrices=False)
            r = min(self.head_rank, S.shape[0])
            self._lowrank = (Vh[:r].T.contiguous(), (U[:, :r] * S[:r]).T.contiguous())
        return self

    def _head_logits(self, hidden: torch.Tensor, tokens: torch.Tensor):
        d = self._draft
        if self._lowrank is not None:
            logits = (hidden.float() @ self._lowrank[0]) @ self._lowrank[1]
        else:
            logits = d.lm_head(hidden.to(d.dtype)).float()
        if self._to_compact is not None:
            return logits, self._to_compact[tokens.long()]
        return logits, tokens

    def scalars(self, features: DraftFeatures, start: int = 0) -> torch.Tensor:
        if self.use_margin and features.margin is None:
            raise ValueError("this pre-verifier reads the draft's top-1 − top-2 margin: the features carry none "
                             "(a stop rule built on it sets needs_margin)")
        scal = token_scalars(features.logq, features.entropy, features.margin if self.use_margin else None)[start:]
        if not self.use_head:
            return scal
        if self._draft is None:
            raise RuntimeError("this pre-verifier reads the draft's output head: load it with "
                               "load_preverifier(path, draft_model=draft) (or call attach_draft(draft))")
        with torch.inference_mode():
            logits, idx = self._head_logits(features.hidden[start:], features.tokens[start:])
        return torch.cat([scal, head_stats(logits, idx)], dim=-1)

    def bucket(self, tokens: torch.Tensor) -> torch.Tensor:
        return (tokens.long() * _HASH_MULT) % self.hash_buckets

    def token_logits(self, hidden: torch.Tensor, tokens: torch.Tensor, scalars: torch.Tensor) -> torch.Tensor:
        """[m, D], [m], [m, N_SCALARS] → [m] logits of P(token accepted | earlier tokens accepted)."""
        x = self.drop(self.tok_emb(self.bucket(tokens)))
        if self.use_hidden:  # (hidden + token) + scalars: the order the shipped weights were evaluated in
            x = self.h_proj(self.drop(self.h_norm(hidden.float()))) + x
        return self.mlp(x + self.s_proj(self.s_norm(scalars.float()))).squeeze(-1)

    def forward(self, hidden, tokens, scalars):
        return self.token_logits(hidden, tokens, scalars)

    @torch.inference_mode()
    def block_accept_prob(self, features: DraftFeatures) -> float:
        """P(every token of the block that starts at `features.block_start` is accepted | earlier ones were).

        In score mode "prefix" the product runs over every token drafted this round instead."""
        start = 0 if self.score_mode == "prefix" else int(features.block_start)
        scal = self.scalars(features, start)
        logits = self.token_logits(features.hidden[start:], features.tokens[start:], scal)
        return float(F.logsigmoid(logits).sum().exp())

    def round_scorer(self) -> "RoundScorer":
        """A scorer for one drafting round: `block_accept_prob` computing each drafted token once."""
        return RoundScorer(self)

    def folded(self) -> "_Folded":
        """The folded input layer of the round scorer, rebuilt when a parameter changed (training, `.to()`)."""
        key = tuple((p.data_ptr(), p._version) for p in self.parameters())
        if getattr(self, "_folded_cache", (None,))[0] != key:
            self._folded_cache = (key, _Folded(self))
        return self._folded_cache[1]


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


class _Folded:
    """The pre-verifier's per-token network for the draft loop, in NumPy, with the LayerNorms' affine parameters
    folded into the projections: W_h (γ_h ⊙ n_h + β_h) + b_h + W_s (γ_s ⊙ n_s + β_s) + b_s + E[x]
    = [W_h γ_h | W_s γ_s] [n_h; n_s] + bias[x], with bias[x] = E[x] + W_h β_h + b_h + W_s β_s + b_s.

    Why NumPy: right after a draft forward has streamed the draft's weights through the caches, every small
    torch op costs ~5× what it costs warm (~25 µs for a GELU of 64 numbers), and the network is ~35 of them per
    token; NumPy's calls are lighter (docs/pacer.md, "Pre-verifier cost"). float64 after the hidden-state GEMM."""

    def __init__(self, pv: "Preverifier"):
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
        """One token: [D] hidden row, its id, its scalar floats → its logit (`Preverifier.token_logits`)."""
        mean = sum(scalars) / len(scalars)
        inv = 1.0 / math.sqrt(sum((v - mean) ** 2 for v in scalars) / len(scalars) + self.s_eps)
        s = np.array([(v - mean) * inv for v in scalars])
        x = s @ self.w_s
        if self.w_h is not None:
            h = hidden.detach().float().numpy()
            h = (h - h.mean()) / math.sqrt(float(h.var()) + self.h_eps)
            x = (h @ self.w_h).astype(np.float64) + x
        x = x + self.bias[(token * _HASH_MULT) % self.buckets]
        x = self._gelu(self._gelu(x) @ self.w2 + self.b2)
        return float(x @ self.w4) + self.b4


def _logsigmoid(z: float) -> float:
    return -math.log1p(math.exp(-z)) if z >= 0 else z - math.log1p(math.exp(z))


class RoundScorer:
    """`Preverifier.block_accept_prob` for the blocks of one drafting round, at a fraction of its cost.

    A token's logit depends only on its own features and the earlier tokens' (fixed once drafted), so each
    drafted token is scored once, when its block ends, and a block's score is a sum of cached log-sigmoids. The
    new rows run through `_Folded` (NumPy, the LayerNorms folded into the projections). Equal to
    `block_accept_prob` up to float rounding (tested)."""

    def __init__(self, pv: Preverifier):
        self.pv = pv
        self.logsig: list[float] = []  # log P(token t accepted | earlier accepted), t = 0.. of this round
        self._folded: _Folded | None = None

    @torch.inference_mode()
    def score(self, features: DraftFeatures) -> float:
        pv, n = self.pv, int(features.tokens.shape[0])
        if features.block_start == 0 or n < len(self.logsig):  # a round's first block: start over
            self.logsig.clear()
            self._folded = None  # and re-check the weights
        done = len(self.logsig)
        if n > done:
            if pv.use_head:  # the head statistics need the draft: the full per-token path for the new tokens
                logits = pv.token_logits(features.hidden[done:], features.tokens[done:], pv.scalars(features, done))
                self.logsig.extend(F.logsigmoid(logits.float()).tolist())
            else:
                lq, ent, toks = features.logq.tolist(), features.entropy.tolist(), features.tokens.tolist()
                mg = None
                if pv.use_margin:
                    if features.margin is None:
                        pv.scalars(features)  # raises the explanation
                    mg = features.margin.tolist()
                self._folded = self._folded or pv.folded()
                self.logsig.extend(_logsigmoid(self._folded.token_logit(features.hidden[t], toks[t],
                                                                        scalar_row(lq, ent, t, mg)))
                                   for t in range(done, n))
        start = 0 if pv.score_mode == "prefix" else int(features.block_start)
        return math.exp(sum(self.logsig[start:n]))


# ----------------------------------------------------------------------------------------------------------------
def build_random_preverifier(hidden_size: int, seed: int = 0, block_size: int = 2, threshold: float = 0.5,
                             dim: int = 32, hash_buckets: int = 256, draft_model=None, use_hidden: bool = True,
                             use_margin: bool = False) -> Preverifier:
    """An untrained pre-verifier with seeded random weights (tests: it may only change speed, never output).
    With `draft_model` it also reads the draft's output head (use_head)."""
    g = torch.Generator().manual_seed(seed)
    pv = Preverifier(hidden_size, dim=dim, hash_buckets=hash_buckets, block_size=block_size, threshold=threshold,
                     use_head=draft_model is not None, use_hidden=use_hidden, use_margin=use_margin)
    if draft_model is not None:
        pv.attach_draft(draft_model)
    with torch.no_grad():
        for p in pv.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return pv.eval()


def draft_fingerprint(draft_model: nn.Module) -> str:
    """sha256 over the draft's decoder layers and final norm (names, shapes, bf16-rounded bytes): identifies the
    space of its hidden states, independently of how a loader lays out a compact vocabulary (embeddings / head) and
    of the dtype it was loaded in (fp32, fp16 or bf16 copies of the same stored weights hash alike). A model
    quantized at load time (specdec.quant) carries the fingerprint of the weights it was loaded from."""
    if getattr(draft_model, "weights_fingerprint", None):
        return draft_model.weights_fingerprint
    from specdec.fusion import unfused_state

    h = hashlib.sha256()
    state = unfused_state(draft_model) if hasattr(draft_model, "config") else draft_model.state_dict()
    for name, p in sorted(state.items()):
        if not torch.is_tensor(p) or not (".layers." in name or name.endswith("norm.weight")):
            continue
        h.update(name.encode())
        h.update(str(tuple(p.shape)).encode())
        h.update(p.detach().to("cpu", torch.float32).to(torch.bfloat16).contiguous().view(torch.int16).numpy()
                 .tobytes())
    return h.hexdigest()


def _sha256_dir_weights(path: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(Path(path).glob("*.safetensors")):
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def draft_dir_sha256(path: str | Path) -> str:
    """sha256 of a draft directory's safetensors bytes (in name order)."""
    return _sha256_dir_weights(Path(path))


def save_preverifier(model: Preverifier, path: str | Path, card: dict) -> Path:
    """Write `config.json`, `model.safetensors`, `card.json` and a readable `README.md` into `path`."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = model.config()
    for k in ("draft_fingerprint", "draft_sha256"):
        if k in card:
            cfg[k] = card[k]
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items() if not k.startswith("_draft.")}
    save_file(state, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (path / "card.json").write_text(json.dumps(card, indent=2, default=str) + "\n")
    (path / "README.md").write_text(_card_markdown(cfg, card))
    return path


def _card_markdown(cfg: dict, card: dict) -> str:
    lines = ["# PACER pre-verifier", "",
             "Predicts P(every token of a drafted block is accepted by the target | earlier blocks were). "
             "Used by `mode=pacer` to choose the draft length; it never changes the output distribution.", "",
             "## Configuration", ""]
    lines += [f"- `{k}`: {v}" for k, v in cfg.items()]
    lines += ["", "## Card", ""]
    for k, v in card.items():
        lines.append(f"- `{k}`: {json.dumps(v, default=str) if isinstance(v, (dict, list)) else v}")
    return "\n".join(lines) + "\n"


def load_preverifier(path: str | Path | None = None, draft_model: nn.Module | None = None,
                     draft_dir: str | Path | None = None, strict: bool = False) -> Preverifier:
    """Load a saved pre-verifier. With `draft_model` (or `draft_dir`) the draft it was trained for is checked:
    a different hidden size is refused (`PreverifierMismatchError`); different weights warn (`strict`: refuse)."""
    from safetensors.torch import load_file

    path = Path(path) if path is not None else DEFAULT_PREVERIFIER_DIR
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no pre-verifier at {path} (expected config.json + model.safetensors); train one "
                                f"with `python -m specdec.pacer_train`")
    cfg = json.loads((path / "config.json").read_text())
    if draft_model is not None:
        d = draft_model.config.hidden_size
        if d != cfg["hidden_size"]:
            raise PreverifierMismatchError(f"pre-verifier {path} expects draft hidden size {cfg['hidden_size']}, this "
                                           f"draft has {d}: it was trained for another draft model")
        want = cfg.get("draft_fingerprint")
        if want and draft_fingerprint(draft_model) != want:
            _mismatch(f"pre-verifier {path} was trained for another draft (parameter fingerprint differs); "
                      f"retrain it with `python -m specdec.pacer_train` for this draft", strict)
    if draft_dir is not None and cfg.get("draft_sha256"):
        if draft_dir_sha256(draft_dir) != cfg["draft_sha256"]:
            _mismatch(f"pre-verifier {path} was trained for another draft (sha256 of {draft_dir} differs)", strict)
    pv = Preverifier(cfg["hidden_size"], dim=cfg["dim"], hash_buckets=cfg["hash_buckets"],
                     block_size=cfg["block_size"], threshold=cfg["threshold"], score_mode=cfg.get("score_mode", "block"),
                     use_head=cfg.get("use_head", False), head_rank=cfg.get("head_rank", 0),
                     use_hidden=cfg.get("use_hidden", True), use_margin=cfg.get("use_margin", False))
    pv.load_state_dict({k: v for k, v in load_file(str(path / "model.safetensors")).items()
                        if not k.startswith("_draft.")})
    if draft_model is not None:
        pv.attach_draft(draft_model)
    pv.card = json.loads((path / "card.json").read_text()) if (path / "card.json").is_file() else {}
    return pv.eval()


def _mismatch(msg: str, strict: bool) -> None:
    if strict:
        raise PreverifierMismatchError(msg)
    warnings.warn(msg, RuntimeWarning, stacklevel=3)


def derive_threshold(cost_ratio: float, mean_accepted: float, gamma: float, accept_rate: float = 0.8,
                     verify_slope_ratio: float = 0.0) -> float:
    """θ from the cost model in docs/pacer.md: continue after a block while
    s · a · B · v > B · (T_draft + slope), with v = (T_target + γ̄ T_draft) / τ the time per generated token at the
    current speed, a the mean per-token acceptance and slope the target's extra verify cost per drafted row;
    so θ = τ (1 + slope/T_draft) / (a · (c + γ̄)), c = T_target / T_draft (clipped to [0, 0.99])."""
    c = max(float(cost_ratio), 1e-6)
    theta = mean_accepted * (1.0 + verify_slope_ratio) / (max(accept_rate, 1e-3) * (c + gamma))
    return float(min(max(theta, 0.0), 0.99))


__all__ = ["Preverifier", "head_stats", "N_HEAD", "PreverifierMismatchError", "build_random_preverifier", "load_preverifier",
           "save_preverifier", "draft_fingerprint", "draft_dir_sha256", "derive_threshold", "token_scalars",
           "DEFAULT_PREVERIFIER_DIR"]
