"""The default pair loaded in process, for measurements outside the benchmark's own runs."""
from __future__ import annotations

from specdec.defaults import DEFAULT_DRAFT, DEFAULT_TARGET
from specdec.hub import resolve_model
from specdec.model import load_model_dir
from specdec.preverifier import load_preverifier


def load_default_pair():
    """→ (target, draft, pre-verifier, target directory): dtype `auto` (bf16 where the host computes it natively),
    the shipped pre-verifier, on the calling thread's torch settings."""
    tdir = resolve_model(DEFAULT_TARGET)
    target = load_model_dir(tdir, dtype="auto", role="target")
    draft = load_model_dir(resolve_model(DEFAULT_DRAFT), dtype="auto", role="draft")
    return target, draft, load_preverifier(None, draft_model=draft), tdir
