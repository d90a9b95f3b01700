"""A draft whose model vocabulary is smaller than its target's, though both read the same tokenizer.

Checkpoints pad their embedding and head to a round row count, and sizes of one family differ: Qwen2.5-0.5B,
-1.5B and -3B have 151,936 rows, Qwen2.5-7B and larger 152,064, for a tokenizer of 151,665 tokens (the classic
draft/target pair). Such a draft has no row for the target's last ids: the target may sample one of them (a padding
row's probability is tiny, not zero), a request may name one (logit_bias, allowed_token_ids), and the draft's q
must be a distribution over the target's vocabulary.

`fit_draft_vocabulary` makes the draft a compact-vocabulary draft (docs/design/distillation.md) over its own rows
within the target's vocabulary: it takes every target id (ids past its rows embed as its OOV row, so only its guess
of what follows suffers), and its logits are -inf past its rows, so q is exactly zero there and verification stays
lossless (q is what was sampled). No weight moves. A draft with *more* rows than the target could propose a token
the target has no row for, and is refused; so is one whose size is too far from the target's to be padding.
"""
from __future__ import annotations

import dataclasses

import torch

PADDING_SLACK = 1024  # the most rows two checkpoints of one tokenizer differ by (Qwen2.5: 128) before we call them two


def draft_vocabulary_error(draft_vocab: int, target_vocab: int) -> str:
    """Why a draft of `draft_vocab` rows cannot serve a target of `target_vocab` ('' when it can, with or without
    `fit_draft_vocabulary`)."""
    if draft_vocab > target_vocab:
        return (f"the draft's vocabulary ({draft_vocab} tokens) is larger than the target's ({target_vocab}): it "
                f"could propose tokens the target has no row for; use a draft of the target's tokenizer")
    if target_vocab - draft_vocab > PADDING_SLACK:
        return (f"the draft's vocabulary ({draft_vocab} tokens) differs from the target's ({target_vocab}) by more "
                f"than padding: the pair must share a tokenizer")
    return ""


def fit_draft_vocabulary(draft, target_vocab: int, preverifier=None) -> bool:
    """Fit `draft` (a `specdec.modeling.model.CausalLM`) to a target of `target_vocab` tokens, in place (module
    docstring), before a worker is built on it; a `preverifier` attached to it reads the new vocabulary too. → whether
    it changed anything. Raises ValueError where the pair cannot share a tokenizer."""
    have = draft.config.vocab_size
    if have == target_vocab:
        return False
    why = draft_vocabulary_error(have, target_vocab)
    if why:
        raise ValueError(why)
    device = draft.lm_head.weight.device
    if draft.vocab_subset is None:  # every row its own id: the subset is all of them
        draft.vocab_subset = torch.arange(have, device=device)
        to_compact = torch.arange(have, dtype=torch.long, device=device)
    else:
        to_compact = draft.to_compact
    tail = torch.full((target_vocab - have,), draft.oov_compact_id, dtype=torch.long, device=device)
    draft.to_compact = torch.cat([to_compact, tail])
    draft.config = dataclasses.replace(draft.config, vocab_size=target_vocab)
    if preverifier is not None and getattr(preverifier, "_draft", None) is draft:
        preverifier.attach_draft(draft)  # its head statistics map ids to the draft's rows
    return True


__all__ = ["PADDING_SLACK", "draft_vocabulary_error", "fit_draft_vocabulary"]
