"""A generation's text as its tokens are verified: streaming detokenization, stop strings and stop tokens, as vLLM's
output processing does them. Pure: a tokenizer, no grpc.

- A stop string ends the text where it starts (`include_stop_str_in_output`: where it ends). Text that could still
  become one is held back until it cannot.
- A stop token (the model's EOS, or a `stop_token_ids` entry) ends the output: its id is among the token ids, its
  text is not (`include_stop_str_in_output`: it is).
- `stop_reason` says which stop string or `stop_token_ids` entry ended it (None: the model's EOS, or no stop), as
  vLLM's choices carry it.
"""
from __future__ import annotations

from collections.abc import Iterable


class TextAssembler:
    """Incremental text for a growing token list."""

    def __init__(self, tok, prompt_ids: list[int], stop: list[str], min_tokens: int = 0, *,
                 stop_token_ids: Iterable[int] = (), user_stop_token_ids: Iterable[int] = (),
                 include_stop: bool = False, skip_special_tokens: bool = True):
        """`min_tokens`: a stop string must end in the text of the min_tokens-th token or later (vLLM's).
        `stop_token_ids`: every id that ends the output (EOS ids and the request's); `user_stop_token_ids`: the
        request's own, which become a `stop_reason`."""
        from specdec.text.tokenizer import IncrementalDetokenizer

        self.detok = (IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens, prefix_ids=prompt_ids)
                      if tok is not None else None)
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.stop_ids, self.user_stop_ids = frozenset(stop_token_ids), frozenset(user_stop_token_ids)
        self.include_stop = include_stop
        self.text, self.sent = "", 0
        self.token_ids: list[int] = []
        self.stopped = False  # by a stop string
        self.stop_reason: str | int | None = None
        self.min_tokens = min_tokens
        self.armed_at = 0 if min_tokens <= 1 else None  # text length before the min_tokens-th token

    def _find_stop(self) -> tuple[int, str] | None:
        """The earliest stop string in the unsent text (at one place, the first listed), or None."""
        if self.armed_at is None:
            return None
        start = max(0, self.sent - self.hold)
        hits = [(i, k) for k, s in enumerate(self.stop)
                if (i := self.text.find(s, max(start, self.armed_at - len(s) + 1))) >= 0]
        if not hits:
            return None
        i, k = min(hits)
        return i, self.stop[k]

    def _cut(self) -> bool:
        """End the text at a stop string if one is in it."""
        if not self.stop or (hit := self._find_stop()) is None:
            return False
        at, s = hit
        self.stopped, self.stop_reason = True, s
        self.text = self.text[:at + len(s) if self.include_stop else at]
        return True

    def push(self, ids: list[int]) -> tuple[str, list[int]]:
        """New verified ids → (text to send now, ids to send now). After a stop string, nothing more."""
        if self.stopped:
            return "", []
        if self.detok is None:
            self.token_ids.extend(ids)
            return "", list(ids)
        taken = self._detokenize(ids)
        self.token_ids.extend(taken)
        return self._release(), taken

    def _detokenize(self, ids: list[int]) -> list[int]:
        """Add `ids`' text (a stop token's only with `include_stop`), ending it at a stop string → the ids taken: all
        of them, or those up to the one that completed a stop string."""
        taken: list[int] = []
        per_token = bool(self.stop) or bool(self.stop_ids.intersection(ids))
        for chunk in ([[t] for t in ids] if per_token else [list(ids)]):  # a stop may end the text mid-chunk
            taken.extend(chunk)
            if self.armed_at is None and len(self.token_ids) + len(taken) >= self.min_tokens:
                self.armed_at = len(self.text)
            if len(chunk) == 1 and chunk[0] in self.stop_ids:  # it ends the output (the pipeline stops at it)
                if chunk[0] in self.user_stop_ids and self.stop_reason is None:
                    self.stop_reason = chunk[0]
                if not self.include_stop:
                    continue
            self.text += self.detok.push(chunk)
            if self._cut():
                break
        return taken

    def _release(self) -> str:
        """The text not sent yet, less what could still become a stop string → the text to send now."""
        upto = len(self.text) if (self.stopped or not self.stop) else len(self.text) - self.hold
        delta = self.text[self.sent:upto] if upto > self.sent else ""
        self.sent += len(delta)
        return delta

    def finish(self) -> str:
        if self.detok is not None and not self.stopped:
            self.text += self.detok.flush()
            self._cut()
        delta = self.text[self.sent:]
        self.sent = len(self.text)
        return delta
