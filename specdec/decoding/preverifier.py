"""PACER's learned blockwise pre-verifier (docs/design/pacer.md).

The draft drafts in blocks of B tokens. After each block the pre-verifier estimates
    s_k = P(every token of block k is accepted by the target | the earlier blocks of this round were),
and the stop rule (`specdec.decoding.stop.PreverifierStop`) stops drafting when s_k < θ. The pre-verifier only chooses
the draft length, so it can never change the output distribution.

Model (cheap on purpose: it runs after every block, on the draft's critical path):
- per drafted token t: the draft's last hidden state h_t (the state that produced q_t; LayerNorm + linear),
  a hashed embedding of the drafted token x_t (h_t does not know x_t yet), and scalar uncertainty features
  (log q(x_t), entropy of q_t, q(x_t), position in the round, the previous token's log q / entropy, the running
  sum of log q before t);
- a 2-layer MLP gives a per-token logit a_t = logit P(x_t accepted | x_<t accepted) (trained on per-token
  conditional labels: greedy `x == argmax p`, sampled `min(1, p/q)` as a soft label);
- the block probability is the product of the per-token sigmoids over the block (mode "block"), or over every
  token drafted so far (mode "prefix": P(the whole round so far is accepted)).

Where it runs: on the host, whatever the draft's device. Its network is small (a 64-wide MLP) and runs after every
block, where a GPU would cost a kernel launch per op; the round scorer runs it in NumPy
(specdec/decoding/round_scorer.py). A GPU draft keeps a block's features (hidden rows, log q, entropy, margin) on its
device while it drafts, and the drafting loop copies them to the host in one transfer when the block ends
(specdec/workers/drafting.py, `CallFeatures.block`): one host synchronisation per scored block, none per drafted token.
The pre-verifier reads `DraftFeatures` as host tensors (`DraftFeatures.on_host` brings a caller's device tensors over).
The one part that runs on the draft's device is the exact output head of a head-reading pre-verifier (`use_head`,
`head_rank` 0): the block's new hidden rows go back to the device through the draft's `lm_head`, and their [m, 4]
statistics come to the host (a second copy per block); the low-rank head runs on the host.

Files (`save_preverifier` / `load_preverifier`): `config.json` (architecture, threshold, block size, score mode,
the draft's fingerprint), `model.safetensors`, `card.json` and `README.md` (the model card).
"""
from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from specdec.common.defaults import DEFAULT_DRAFT
from specdec.decoding.round_scorer import HASH_MULT, Folded, RoundScorer
from specdec.decoding.stop import DraftFeatures
from specdec.modeling.model import draft_fingerprint

DEFAULT_PREVERIFIER_DIR = Path(__file__).resolve().parents[1] / "assets" / "default_preverifier"
N_SCALARS = 8
N_HEAD = 4  # statistics of the draft's own temperature-1 distribution (when the draft head is attached)


def default_preverifier_dir(draft: str | None) -> str | None:
    """The pre-verifier a command uses when it names none: the shipped one where `draft` is the shipped draft's
    spec and the pre-verifier is present (its config.json), else None."""
    if draft == DEFAULT_DRAFT and (DEFAULT_PREVERIFIER_DIR / "config.json").is_file():
        return str(DEFAULT_PREVERIFIER_DIR)
    return None


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
        """The draft head's logits of `hidden` and the tokens' indices into them, on the device the head runs on:
        the host for the low-rank head (its factors are host tensors), the draft's device for the exact head."""
        d = self._draft
        if self._lowrank is not None:
            logits = (hidden.float() @ self._lowrank[0]) @ self._lowrank[1]
        else:
            logits = d.lm_head(hidden.to(d.device, d.dtype)).float()
        idx = self._to_compact[tokens.long()] if self._to_compact is not None else tokens
        return logits, idx.to(logits.device)

    def margin_of(self, features: DraftFeatures) -> torch.Tensor | None:
        """The margin column this pre-verifier reads (None when it reads none); refuses features without it."""
        if not self.use_margin:
            return None
        if features.margin is None:
            raise ValueError("this pre-verifier reads the draft's top-1 − top-2 margin: the features carry none "
                             "(a stop rule built on it sets needs_margin)")
        return features.margin

    def scalars(self, features: DraftFeatures, start: int = 0) -> torch.Tensor:
        """The scalar features of tokens start.. (host features in, host tensor out)."""
        scal = token_scalars(features.logq, features.entropy, self.margin_of(features))[start:]
        if not self.use_head:
            return scal
        if self._draft is None:
            raise RuntimeError("this pre-verifier reads the draft's output head: load it with "
                               "load_preverifier(path, draft_model=draft) (or call attach_draft(draft))")
        with torch.inference_mode():
            logits, idx = self._head_logits(features.hidden[start:], features.tokens[start:])
            stats = head_stats(logits, idx).to(scal.device)  # from the draft's device: one [m, 4] copy
        return torch.cat([scal, stats], dim=-1)

    def bucket(self, tokens: torch.Tensor) -> torch.Tensor:
        return (tokens.long() * HASH_MULT) % self.hash_buckets

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
        features = features.on_host()
        start = 0 if self.score_mode == "prefix" else int(features.block_start)
        scal = self.scalars(features, start)
        logits = self.token_logits(features.hidden[start:], features.tokens[start:], scal)
        return float(F.logsigmoid(logits).sum().exp())

    def round_scorer(self) -> RoundScorer:
        """A scorer for one drafting round: `block_accept_prob` computing each drafted token once."""
        return RoundScorer(self)

    def folded(self) -> Folded:
        """The folded input layer of the round scorer, rebuilt when a parameter changed (training, `.to()`)."""
        key = tuple((p.data_ptr(), p._version) for p in self.parameters())
        if getattr(self, "_folded_cache", (None,))[0] != key:
            self._folded_cache = (key, Folded(self))
        return self._folded_cache[1]


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
    path = Path(path) if path is not None else DEFAULT_PREVERIFIER_DIR
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no pre-verifier at {path} (expected config.json + model.safetensors); train one "
                                f"with `python -m specdec_train.preverifier`")
    cfg = json.loads((path / "config.json").read_text())
    if draft_model is not None:
        d = draft_model.config.hidden_size
        if d != cfg["hidden_size"]:
            raise PreverifierMismatchError(f"pre-verifier {path} expects draft hidden size {cfg['hidden_size']}, this "
                                           f"draft has {d}: it was trained for another draft model")
        want = cfg.get("draft_fingerprint")
        if want and draft_fingerprint(draft_model) != want:
            _mismatch(f"pre-verifier {path} was trained for another draft (parameter fingerprint differs); "
                      f"retrain it with `python -m specdec_train.preverifier` for this draft", strict)
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
    """θ from the cost model in docs/design/pacer.md: continue after a block while
    s · a · B · v > B · (T_draft + slope), with v = (T_target + γ̄ T_draft) / τ the time per generated token at the
    current speed, a the mean per-token acceptance and slope the target's extra verify cost per drafted row;
    so θ = τ (1 + slope/T_draft) / (a · (c + γ̄)), c = T_target / T_draft (clipped to [0, 0.99])."""
    c = max(float(cost_ratio), 1e-6)
    theta = mean_accepted * (1.0 + verify_slope_ratio) / (max(accept_rate, 1e-3) * (c + gamma))
    return float(min(max(theta, 0.0), 0.99))


__all__ = ["Preverifier", "head_stats", "N_HEAD", "PreverifierMismatchError", "build_random_preverifier", "load_preverifier",
           "save_preverifier", "draft_dir_sha256", "derive_threshold", "token_scalars",
           "DEFAULT_PREVERIFIER_DIR", "default_preverifier_dir"]
