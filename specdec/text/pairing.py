"""Whether a draft can serve a target: their tokenizers must map the same strings to the same ids.

Speculative decoding hands the draft's token ids to the target as they are. A draft whose tokenizer spells id 1234
differently from the target's proposes tokens the target reads as others: the output stays exact (verification
rejects them) but every draft is wasted, silently. Comparing vocabulary *sizes* does not catch it (two tokenizers of
49,152 tokens are as likely as not two different ones), so a pair is checked on what matters:

- the token → id maps, on the ids both tokenizers have (a tokenizer that is the other's plus tokens appended past
  its last id still agrees on every id the draft and the target share), and
- the special tokens both define that a prompt carries: bos and pad (the same ids). eos is not compared: a base
  draft and an instruct target of one tokenizer name different end tokens (Llama 3.2 1B's `<|end_of_text|>`,
  Llama 3.1 8B Instruct's `<|eot_id|>`), both ids mean the same strings on either side, and a request stops on the
  target's eos ids whatever the draft's.

How many *rows* the models' embeddings have is another matter: a draft checkpoint padded to fewer rows than its
target's, of the same tokenizer (Qwen2.5-0.5B for -7B), is fitted by `specdec.text.vocab.fit_draft_vocabulary`.

The check reads each tokenizer once (`TokenizerVocab`, from a model directory's tokenizer.json and
tokenizer_config.json, or from a loaded tokenizer) and compares them directly (`check_pair`, `pair_error`). Where
the two live in different processes, each side reports a `TokenizerFingerprint` instead: its size, a digest of its
token → id map and its special ids (a replica's `ModelInfo.tokenizer_fingerprint`); fingerprints of different
sizes compare on the ids both have by asking the larger side for the digest of its first ids
(`TokenizerVocab.fingerprint(prefix)`). A model without a tokenizer (token-id-only models) cannot be checked.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import re

from specdec.common.errors import SpecDecError

SPECIALS = ("bos", "eos", "pad")
COMPARED_SPECIALS = ("bos", "pad")  # eos: see the module docstring
_FORMAT = "tokfp1"  # the fingerprint's text form and digest recipe; a new recipe gets a new tag


class PairError(SpecDecError, ValueError):
    """A draft and a target that do not share a tokenizer (→ FAILED_PRECONDITION on a request; a CLI error)."""


@dataclasses.dataclass(frozen=True)
class TokenizerFingerprint:
    """What a process reports of its tokenizer so that another can compare it without the tokenizer itself."""
    size: int  # the ids [0, size) the digest covers: the tokenizer's largest id + 1, or a prefix of them
    digest: str  # sha256 (hex, 32 digits) of the id → token table over those ids
    specials: tuple[int, ...]  # bos, eos, pad ids (-1: not defined)
    full_size: int = 0  # the tokenizer's own size when `size` is a prefix of it (0: the same as size)

    def __str__(self) -> str:
        sp = " ".join(f"{k}={v}" for k, v in zip(SPECIALS, self.specials))
        full = f" of={self.full_size}" if self.full_size and self.full_size != self.size else ""
        return f"{_FORMAT} n={self.size}{full} sha={self.digest} {sp}"

    @property
    def tokens(self) -> int:
        """The tokenizer's size (not the prefix's)."""
        return self.full_size or self.size

    @classmethod
    def parse(cls, text: str) -> TokenizerFingerprint | None:
        """The fingerprint `str()` wrote; None for '' (a replica without a tokenizer) or another format."""
        m = re.fullmatch(rf"{_FORMAT} n=(\d+)(?: of=(\d+))? sha=([0-9a-f]+) bos=(-?\d+) eos=(-?\d+) pad=(-?\d+)",
                         text.strip())
        if m is None:
            return None
        return cls(int(m[1]), m[3], (int(m[4]), int(m[5]), int(m[6])), int(m[2] or 0))


class TokenizerVocab:
    """A tokenizer's id → token table and special ids, read once; fingerprints computed from it are cached."""

    def __init__(self, tokens: list[str | None], specials: dict[str, int], name: str = ""):
        self.tokens = tokens  # index: id; None where the tokenizer defines no token for that id
        self.specials = {k: int(specials.get(k, -1)) for k in SPECIALS}
        self.name = name
        self._fingerprints: dict[int, TokenizerFingerprint] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def from_vocab(cls, vocab: dict[str, int], specials: dict[str, int | None], name: str = "") -> TokenizerVocab:
        tokens: list[str | None] = [None] * (max(vocab.values(), default=-1) + 1)
        for tok, i in vocab.items():
            tokens[i] = tok
        return cls(tokens, {k: -1 if v is None else v for k, v in specials.items()}, name)

    @classmethod
    def from_dir(cls, model_dir: os.PathLike | str, name: str = "") -> TokenizerVocab | None:
        """The tokenizer of a model directory (tokenizer.json, special tokens from tokenizer_config.json); None when
        it has no tokenizer.json. Reads with the `tokenizers` library only (a replica never loads transformers)."""
        d = pathlib.Path(model_dir)
        if not (d / "tokenizer.json").is_file():
            return None
        from tokenizers import Tokenizer  # lazy: only where a pair is checked

        vocab = Tokenizer.from_file(str(d / "tokenizer.json")).get_vocab(with_added_tokens=True)
        try:
            config = json.loads((d / "tokenizer_config.json").read_text())
        except (OSError, ValueError):
            config = {}

        def special(key: str) -> int | None:
            tok = config.get(f"{key}_token")
            if isinstance(tok, dict):  # {"content": "<s>", ...} (AddedToken)
                tok = tok.get("content")
            return vocab.get(tok) if isinstance(tok, str) else None

        return cls.from_vocab(vocab, {k: special(k) for k in SPECIALS}, name or str(model_dir))

    @classmethod
    def from_tokenizer(cls, tok, name: str = "") -> TokenizerVocab:
        """A loaded Hugging Face tokenizer (`get_vocab()`, `bos_token_id`, ...)."""
        return cls.from_vocab(tok.get_vocab(), {k: getattr(tok, f"{k}_token_id", None) for k in SPECIALS},
                              name or getattr(tok, "name_or_path", ""))

    @classmethod
    def of(cls, thing, name: str = "") -> TokenizerVocab | None:
        """A TokenizerVocab from a model directory, a loaded tokenizer, a model loaded from a directory (its
        `source_dir`), or one already built; None when there is no tokenizer to read."""
        if thing is None or isinstance(thing, TokenizerVocab):
            return thing
        if isinstance(thing, (str, os.PathLike)):
            return cls.from_dir(thing, name)
        if hasattr(thing, "get_vocab"):
            return cls.from_tokenizer(thing, name)
        src = getattr(thing, "source_dir", None)  # a specdec.modeling.model.CausalLM
        return cls.from_dir(src, name) if src else None

    def fingerprint(self, prefix: int | None = None) -> TokenizerFingerprint:
        """The fingerprint of the whole table, or of its first `prefix` ids (capped at its size)."""
        n = len(self.tokens) if prefix is None or prefix <= 0 else min(prefix, len(self.tokens))
        if n not in self._fingerprints:
            h = hashlib.sha256(_FORMAT.encode())
            for tok in self.tokens[:n]:
                if tok is None:
                    h.update(b"\xff\xff\xff\xff")
                else:
                    b = tok.encode("utf-8", "surrogatepass")
                    h.update(len(b).to_bytes(4, "little") + b)
            specials = tuple(self.specials[k] for k in SPECIALS)
            self._fingerprints[n] = TokenizerFingerprint(n, h.hexdigest()[:32], specials,
                                                         len(self.tokens) if n != len(self.tokens) else 0)
        return self._fingerprints[n]


def _show(tok: str | None) -> str:
    return "no token" if tok is None else repr(tok if len(tok) <= 40 else tok[:37] + "...")


def specials_difference(draft: tuple[int, ...], target: tuple[int, ...]) -> str:
    """The first special token of COMPARED_SPECIALS both define with different ids ('' when none)."""
    for key, d, t in zip(SPECIALS, draft, target):
        if key in COMPARED_SPECIALS and d >= 0 and t >= 0 and d != t:
            return f"{key} is id {d} in the draft's tokenizer and {t} in the target's"
    return ""


def vocab_difference(draft: TokenizerVocab, target: TokenizerVocab) -> str:
    """The first difference between two tokenizers on the ids both have, then in their special tokens ('' when
    they are a pair)."""
    n = min(len(draft), len(target))
    if draft.fingerprint(n).digest != target.fingerprint(n).digest:
        i = next(i for i in range(n) if draft.tokens[i] != target.tokens[i])
        return f"id {i} is {_show(draft.tokens[i])} in the draft's tokenizer and {_show(target.tokens[i])} in the target's"
    return specials_difference(tuple(draft.specials[k] for k in SPECIALS), tuple(target.specials[k] for k in SPECIALS))


def fingerprint_difference(draft: TokenizerFingerprint, target: TokenizerFingerprint) -> str | None:
    """The difference two fingerprints show ('' when they are a pair); None when they cover different numbers of
    ids, so that the larger side's fingerprint of the smaller's size is needed (`TokenizerVocab.fingerprint`)."""
    if draft.size != target.size:
        return None
    if draft.digest != target.digest:
        sizes = (f" ({draft.tokens} and {target.tokens} tokens)" if draft.tokens != target.tokens
                 else f" ({draft.tokens} tokens each)")
        return f"their token → id maps differ on the first {draft.size} ids{sizes}"
    return specials_difference(draft.specials, target.specials)


def mismatch_message(draft_name: str, target_name: str, difference: str) -> str:
    """The one-line error naming both models and their first difference."""
    return (f"draft {draft_name} and target {target_name} do not share a tokenizer: {difference}; the draft's "
            f"proposals would mean other tokens to the target. Serve a draft of the target's tokenizer")


def pair_error(draft, target, draft_name: str = "", target_name: str = "") -> str:
    """Why `draft` cannot serve `target` ('' when it can, or when either has no tokenizer to compare). Each is a
    model directory, a loaded tokenizer, a model loaded from a directory, or a `TokenizerVocab`."""
    d, t = TokenizerVocab.of(draft, draft_name), TokenizerVocab.of(target, target_name)
    if d is None or t is None:
        return ""
    why = vocab_difference(d, t)
    return mismatch_message(draft_name or d.name, target_name or t.name, why) if why else ""


def check_pair(draft, target, draft_name: str = "", target_name: str = "") -> None:
    """Raise `PairError` (one line naming both models and the first difference) unless `draft` and `target` share a
    tokenizer on the ids both have, special tokens included. Accepts what `pair_error` does; a side without a
    tokenizer passes (nothing to compare)."""
    why = pair_error(draft, target, draft_name, target_name)
    if why:
        raise PairError(why)


__all__ = ["PairError", "TokenizerFingerprint", "TokenizerVocab", "check_pair", "fingerprint_difference",
           "mismatch_message", "pair_error", "specials_difference", "vocab_difference"]
