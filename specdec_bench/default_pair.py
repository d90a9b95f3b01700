"""The default pair loaded as the in-process measurement scripts use it (scripts/*_cost.py, *_bench.py)."""
from __future__ import annotations


def load_default_pair():
    """→ (target, draft, pre-verifier, target directory): dtype `auto` (bf16 where the host computes it natively),
    the shipped pre-verifier, on the calling thread's torch settings."""
    from specdec_bench.harness import _default_preverifier
    from specdec.hub import resolve_model
    from specdec.model import load_model_dir
    from specdec.preverifier import load_preverifier

    tdir = resolve_model("default-target")
    target = load_model_dir(tdir, dtype="auto", role="target")
    draft = load_model_dir(resolve_model("default-draft"), dtype="auto", role="draft")
    return target, draft, load_preverifier(_default_preverifier("default-draft"), draft_model=draft), tdir
