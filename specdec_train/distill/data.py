"""Training data: target continuations (JSONL rows {prompt_ids, completion_ids, temperature}) and the split."""
from __future__ import annotations

import gzip
import hashlib
import json
import pathlib


def read_jsonl(path) -> list[dict]:
    path = pathlib.Path(path)
    op = gzip.open if path.suffix == ".gz" else open
    with op(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def require_samples(paths, flag: str = "--samples") -> list[str]:
    """The sample files a command was given: at least one, each an existing file (there is no default data set);
    else a SystemExit that names the flag."""
    if not paths:
        raise SystemExit(f"no training data: pass {flag} FILE (JSONL(.gz) of target continuations; repeatable)")
    missing = [str(p) for p in paths if not pathlib.Path(p).is_file()]
    if missing:
        raise SystemExit(f"{flag}: no such file: {', '.join(missing)}")
    return [str(p) for p in paths]


def load_samples(paths) -> list[dict]:
    rows = []
    for p in paths:
        rows.extend(read_jsonl(p))
    return rows


def prompt_key(row: dict) -> str:
    return hashlib.sha256(json.dumps(row["prompt_ids"]).encode()).hexdigest()


def is_heldout(row: dict, frac: float = 0.05) -> bool:
    """Deterministic split by prompt: every sample of one prompt lands on the same side."""
    h = int(prompt_key(row)[:8], 16)
    return (h % 10_000) < frac * 10_000


def split(rows: list[dict], frac: float = 0.05):
    train = [r for r in rows if not is_heldout(r, frac)]
    held = [r for r in rows if is_heldout(r, frac)]
    return train, held
