"""What the distillation subcommands share: the run log, the samples' train / held-out split, a new draft built
from the target."""
from __future__ import annotations

import torch

from specdec_train.distill.data import load_samples, require_samples, split
from specdec_train.distill.draft_model import build_from_target, frequency_subset, full_to_compact_map, special_ids


def log_line(msg, path=None):
    """Print `msg` and append it to the file `path` (a run's log), if given."""
    print(msg, flush=True)
    if path:
        with open(path, "a") as f:
            f.write(msg + "\n")


def load_split(args):
    """(train rows, held-out rows) of `--samples`, split by prompt (`--heldout-frac`)."""
    rows = load_samples(require_samples(args.samples, "--samples"))
    return split(rows, args.heldout_frac)


def setup_draft(args, train_rows, target):
    """A new draft from `target`: its vocabulary subset (the most frequent tokens of the training rows), its
    layers (`--init-layers`, copied unless `--no-copy-layers`) -> (draft, subset, oov id, full-to-compact map)."""
    if getattr(args, "subset_samples", None):  # e.g. the data a warm-start checkpoint was trained on
        train_rows = split(load_samples(args.subset_samples), args.heldout_frac)[0]
    subset = frequency_subset(train_rows, args.vocab_subset, always=special_ids(target.config),
                              vocab_size=target.config.vocab_size)
    oov = int((subset == 0).nonzero()[0, 0])
    to_compact = full_to_compact_map(subset, target.config.vocab_size, oov)
    layers = tuple(int(x) for x in args.init_layers.split(","))
    torch.manual_seed(args.seed)
    draft = build_from_target(target, subset, layers, copy_layers=not args.no_copy_layers)
    if args.random_init:
        draft.init_weights() if hasattr(draft, "init_weights") else None
        for mod in draft.modules():
            if isinstance(mod, (torch.nn.Linear, torch.nn.Embedding)):
                torch.nn.init.normal_(mod.weight, std=0.02)
    if getattr(args, "final_norm_scale", 1.0) != 1.0:
        # the target's final norm is tuned for its 30-layer residual stream; in a 2-layer draft the residual is
        # still mostly the input embedding, so the tied head would predict "repeat the current token" with huge
        # logits (initial loss ~16). Scaling the final norm calibrates the start (loss ~8).
        with torch.no_grad():
            draft.model.norm.weight.mul_(args.final_norm_scale)
    return draft, subset, oov, to_compact
