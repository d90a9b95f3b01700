"""Reasoning models' thinking, kept apart from their answer (vLLM's `--reasoning-parser`). Pure: no grpc.

A reasoning model writes `<think>…</think>` before its answer. With a parser set (`COORDINATOR_REASONING_PARSER`),
a request that asks for it (`GenerateRequest.separate_reasoning`; the chat routes always do) gets the thinking as
`reasoning_delta` and the answer alone as `text_delta`:

- `deepseek_r1` (DeepSeek-R1 and its distills, QwQ, Qwen3 Thinking-2507): the answer starts in reasoning, since
  their templates open `<think>` in the prompt; a `<think>` the model writes itself is dropped, `</think>` ends the
  reasoning, and an answer that never closes it is all reasoning.
- `qwen3` (Qwen3's hybrid models): reasoning only when the answer opens with `<think>`; otherwise all content.

Both read the end of the prompt first: a prompt that ends in `<think>` (whitespace aside) starts the answer in
reasoning, and one that ends in `</think>` (Qwen3's template with `enable_thinking: false` closes an empty block)
starts it in content.

Structured output applies to the answer after the reasoning, as vLLM's does: `gate_grammar` wraps the request's
grammar so that any tokens but EOS may come before `</think>` and the grammar after it. It is one llguidance
grammar, so the verification that makes structured output exact (specdec/text/grammar.py) covers it unchanged. Unlike
vLLM, EOS is refused inside the reasoning: the answer that follows always has the requested form, unless
max_tokens cuts it short.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from coordinator.grpc_api.tool_parsers import split_tail
from specdec.common.errors import InvalidRequestError

START, END = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")
REASONING, CONTENT = "reasoning", "content"
TAIL_TOKENS = 16  # prompt tokens read for a trailing tag


@dataclass(frozen=True)
class ThinkTags:
    """The tags' token ids where each is one token of the vocabulary (None: it is not)."""
    start_id: int | None
    end_id: int | None

    @classmethod
    def of(cls, tok) -> ThinkTags:
        def one(tag: str) -> int | None:
            ids = tok.encode(tag, add_special_tokens=False)
            return ids[0] if len(ids) == 1 else None

        return cls(one(START), one(END)) if tok is not None else cls(None, None)


@dataclass(frozen=True)
class ReasoningStart:
    """Where an answer starts: `opening` (it may open with `<think>`, which is dropped), then `otherwise` (REASONING
    or CONTENT) when it does not."""
    opening: bool
    otherwise: str

    @property
    def reasons(self) -> bool:
        """Whether the answer may hold reasoning at all."""
        return self.opening or self.otherwise == REASONING


def answer_start(parser: str, prompt_ids: Sequence[int], decode: Callable[[list[int]], str]) -> ReasoningStart:
    """How `parser` reads an answer to this prompt (`decode`: token ids → text)."""
    tail = decode(list(prompt_ids[-TAIL_TOKENS:])).rstrip()
    if tail.endswith(END):
        return ReasoningStart(False, CONTENT)
    if tail.endswith(START) or parser == "deepseek_r1":
        return ReasoningStart(True, REASONING)
    return ReasoningStart(True, CONTENT)


class ReasoningSplitter:
    """One answer's text as it grows → (reasoning, content) pieces. Text that may still become a tag is held back
    until it cannot; `end()` gives back what was held."""

    def __init__(self, start: ReasoningStart):
        self.opening, self.state, self.pending = start.opening, start.otherwise, ""

    def feed(self, text: str) -> tuple[str, str]:
        self.pending += text
        reasoning, content = [], []
        while self.pending:
            if self.opening:
                head = self.pending.lstrip()
                if head.startswith(START):
                    self.pending, self.opening, self.state = head[len(START):], False, REASONING
                    continue
                if START.startswith(head):  # it may still open (or it is only whitespace so far)
                    break
                self.opening = False
            if self.state == CONTENT:
                content.append(self.pending)
                self.pending = ""
                break
            at = self.pending.find(END)
            if at >= 0:
                reasoning.append(self.pending[:at])
                self.pending, self.state = self.pending[at + len(END):], CONTENT
                continue
            shown, self.pending = split_tail(self.pending, END)
            reasoning.append(shown)
            break
        return "".join(reasoning), "".join(content)

    def end(self) -> tuple[str, str]:
        """The held-back text, where it belongs now that nothing follows."""
        rest, self.pending, self.opening = self.pending, "", False
        return ("", rest) if self.state == CONTENT else (rest, "")


def reasoning_tokens(start: ReasoningStart, output_ids: Sequence[int], tags: ThinkTags) -> int:
    """How many of the output's tokens are reasoning (`</think>` counted with them); 0 where the tags are not
    single tokens."""
    if not start.reasons or tags.end_id is None:
        return 0
    ids = list(output_ids)
    if start.otherwise == CONTENT and not (ids and ids[0] == tags.start_id):
        return 0
    return ids.index(tags.end_id) + 1 if tags.end_id in ids else len(ids)


def gate_grammar(grammar: str, start: ReasoningStart, tags: ThinkTags, eos_ids: Sequence[int]) -> str:
    """`grammar` (llguidance's: lark text or a JSON TopLevelGrammar) applied after the reasoning: before `</think>`
    any token but EOS, after it the grammar. Raises InvalidRequestError where the tags are not single tokens."""
    if not start.reasons:
        return grammar
    if tags.end_id is None or (start.otherwise == CONTENT and tags.start_id is None):
        raise InvalidRequestError("structured_output", f"applies after the reasoning, but this model's vocabulary "
                                                       f"has no single {END} token to find its end by; leave "
                                                       f"structured output out, or serve this model without a "
                                                       f"reasoning parser (gRPC: separate_reasoning false)")
    grammars = json.loads(grammar)["grammars"] if grammar.lstrip().startswith("{") else [{"lark_grammar": grammar}]
    names = {g.get("name") for g in grammars}
    answer = grammars[0].get("name") or next(f"answer{k}" for k in range(len(names) + 1) if f"answer{k}" not in names)
    grammars[0] = {**grammars[0], "name": answer}
    free = ",".join(str(t) for t in sorted({tags.end_id, *eos_ids}))
    thinking = f"<[^{free}]>* <[{tags.end_id}]>"
    if start.otherwise == CONTENT:  # it thinks only if it opens with <think>
        thinking = f"(<[{tags.start_id}]> {thinking})?"
    gate = {"name": "reasoning_gate", "lark_grammar": f"start: {thinking} @{answer}\n"}
    return json.dumps({"grammars": [gate, *grammars]})
