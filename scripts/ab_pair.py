"""The default pair in process, for the A/B scripts (`lookup_ab.py`, `overlap_ab.py`, `switch_ab.py`): the
benchmark's own prompts (specdec_bench: HumanEval raw, the chat set chat-templated) and one engine, 1 thread per
model. `kernel_ab.py` takes the pair only (`load_default_pair`)."""
from __future__ import annotations

from pathlib import Path

import torch

from specdec_bench.prompts import load_prompt_sets
from specdec.engine import Engine
from specdec.hub import resolve_model
from specdec.lookup import PromptLookup
from specdec.model import load_model_dir
from specdec.preverifier import load_preverifier
from specdec.tokenizer import eos_token_ids, load_tokenizer


def load_default_pair():
    """→ (target, draft, the shipped pre-verifier, tokenizer), as served on this host (bf16, int8 draft), with this
    thread at 1 torch thread."""
    torch.set_num_threads(1)
    tdir, ddir = Path(resolve_model("default-target")), Path(resolve_model("default-draft"))
    target = load_model_dir(tdir, dtype="auto", role="target")
    draft = load_model_dir(ddir, dtype="auto", role="draft", quant="auto")
    return target, draft, load_preverifier(None, draft_model=draft, strict=False), load_tokenizer(tdir)


def default_pair_engine(humaneval: int, chat: int, max_new_tokens: int, lookup: PromptLookup | None = None
                        ) -> tuple[Engine, list[list[int]], tuple[int, ...]]:
    """→ (engine with the shipped pre-verifier, prompt ids: `humaneval` HumanEval then `chat` chat prompts, EOS ids)."""
    target, draft, pv, tok = load_default_pair()
    prompts = [p.ids for name, n in (("humaneval", humaneval), ("chat", chat)) if n
               for p in load_prompt_sets(tok, [name], n)]
    engine = Engine(target, draft, preverifier=pv, max_sessions=2, threads_per_model=1, lookup=lookup,
                    max_context=max(map(len, prompts)) + max_new_tokens + 16)
    return engine, prompts, tuple(eos_token_ids(tok))
