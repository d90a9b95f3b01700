"""Training prompts (never benchmark prompts), splits and the label cache."""
from __future__ import annotations

import gzip
import hashlib
import json
import random
from pathlib import Path

import torch

from specdec_train.distill.data import is_heldout
from specdec_train.preverifier.bench import FALLBACK_CHAT, benchmark_prompts, encode

CACHE_DIR = Path(__file__).resolve().parents[2] / ".cache-pacer"


def split_of(prompt_ids: list[int], dev: float = 0.1, test: float = 0.05) -> str:
    """Deterministic split by prompt: train / dev (θ tuning, early stopping) / test (reported metrics).

    test = the draft distillation's held-out prompts (`specdec_train.distill.data.is_heldout`, so the reported AUC is on
    prompts the draft never trained on either) plus another `test` fraction by an independent hash."""
    if is_heldout({"prompt_ids": list(prompt_ids)}):
        return "test"
    return hash_split(json.dumps(list(prompt_ids)), dev, test)


def hash_split(key: str, dev: float = 0.1, test: float = 0.05) -> str:
    """train / dev / test by a hash of `key` alone (one key per prompt)."""
    h = int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % 10_000
    if h < test * 10_000:
        return "test"
    if h < (test + dev) * 10_000:
        return "dev"
    return "train"


def resplit_by_hash(rounds: list[dict], file_key: str) -> None:
    """Split a label file's rounds by prompt hash alone, its draft-held-out prompts too (`train --hash-split`):
    for labels collected on prompts that are all new to the draft, e.g. its own held-out set, which `split_of`
    would put entirely in test."""
    for r in rounds:
        r["split"] = hash_split(f"{file_key}:{r['prompt']}")


def benchmark_prompt_ids(tok) -> set[tuple[int, ...]]:
    """Token ids of every benchmark prompt we know (HumanEval + the repository chat set): excluded from training."""
    out = set()
    for _, item in benchmark_prompts(None, None) + [("chat", t) for t in FALLBACK_CHAT]:
        out.add(tuple(encode(tok, item)))
    return out


def training_prompts(path: Path, exclude: set | None = None, max_len: int = 384) -> list[list[int]]:
    """Unique prompts of the target-continuation file (prompts built from non-benchmark templates x topics)."""
    op = gzip.open if str(path).endswith(".gz") else open
    seen, out = set(), []
    with op(path, "rt") as f:
        for line in f:
            if not line.strip():
                continue
            ids = tuple(json.loads(line)["prompt_ids"])
            if ids in seen or (exclude and ids in exclude) or len(ids) > max_len:
                continue
            seen.add(ids)
            out.append(list(ids))
    return out


def training_rows(path: Path, exclude: set | None, temperatures, num: int, seed: int = 0, skip: int = 0,
                  max_len: int = 1024) -> list[dict]:
    """Continuation rows {prompt_ids, completion_ids, temperature, prompt, split} at the given temperatures: `num`
    of each temperature, in a seeded order; benchmark prompts excluded."""
    op = gzip.open if str(path).endswith(".gz") else open
    by_t: dict[float, list[dict]] = {float(t): [] for t in temperatures}
    keys: dict[tuple, int] = {}
    with op(path, "rt") as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            t = float(row.get("temperature", 0.0))
            ids = tuple(row["prompt_ids"])
            if t not in by_t or (exclude and ids in exclude) or len(ids) + len(row["completion_ids"]) > max_len:
                continue
            row["prompt"] = keys.setdefault(ids, len(keys))
            row["split"] = split_of(list(ids))
            by_t[t].append(row)
    out = []
    for t, rows in by_t.items():
        random.Random(seed).shuffle(rows)
        out.extend(rows[skip:skip + num])
    return out


def save_rounds(rounds, path: Path, meta: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"meta": meta, "rounds": [r.to_dict() if hasattr(r, "to_dict") else r for r in rounds]}, tmp)
    tmp.replace(path)


def load_rounds(paths, hash_split_files=()) -> tuple[list[dict], list[dict]]:
    """Rounds and metadata of label files; the files in `hash_split_files` are re-split by prompt hash."""
    rounds, metas = [], []
    resplit = {Path(p).resolve() for p in hash_split_files}
    for p in paths:
        d = torch.load(p, weights_only=False)
        metas.append(d["meta"])
        if Path(p).resolve() in resplit:
            resplit_by_hash(d["rounds"], Path(p).name)
        for r in d["rounds"]:
            r["source_file"] = str(p)  # prompt indices are per file
        rounds.extend(d["rounds"])
    return rounds, metas
