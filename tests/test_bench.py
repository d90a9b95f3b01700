"""Benchmark harness end to end on tiny random models (never the default pair here): JSON rows, markdown, plot,
and the Hugging Face draft built from a compact-vocabulary draft."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers_models import save_model, save_tiny_pair

ROW_KEYS = {"mode", "threads", "temperature", "prompt_set", "concurrency", "tokens_per_s", "speedup_vs_ar",
            "speedup_vs_hf", "mean_accepted_length"}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from specdec.decoding.preverifier import build_random_preverifier, save_preverifier

    root = tmp_path_factory.mktemp("bench")
    tdir, ddir = save_tiny_pair(root)
    save_preverifier(build_random_preverifier(16, seed=0), root / "pv", {})
    prompts = root / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "hello there, how are you"}) + "\n"
                       + json.dumps({"messages": [{"role": "user", "content": "tell me a story"}]}) + "\n")
    return root, tdir, ddir


def test_bench_end_to_end(models):
    root, tdir, ddir = models
    out = root / "not" / "yet" / "out"  # the bench makes the folders (before the run, so results are never lost)
    cmd = [sys.executable, "-m", "specdec_bench", "--target-model", str(tdir), "--draft-model", str(ddir),
           "--preverifier", str(root / "pv"), "--prompts", str(root / "prompts.jsonl"), "--max-new-tokens", "12",
           "--repeats", "1", "--gammas", "2", "--concurrency", "1,2", "--no-ray", "--no-progress",
           "--json", f"{out}.json", "--markdown", f"{out}.md", "--plot", f"{out}.png"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert p.returncode == 0, p.stderr[-3000:]
    rows = json.loads(Path(f"{out}.json").read_text())
    assert isinstance(rows, list) and rows
    for r in rows:
        assert ROW_KEYS <= set(r), ROW_KEYS - set(r)
    single = [r for r in rows if not r.get("sweep")]
    modes = {r["mode"] for r in single}
    assert modes == {"ar", "hf_assisted", "sd", "pacer", "pearl", "pacer_pearl"}
    assert {r["temperature"] for r in single} == {0.0, 1.0}
    assert {r["threads"] for r in single if r["mode"] in ("ar", "hf_assisted")} == {1, 2}
    assert {r["placement"] for r in single if r["mode"] == "pearl"} == {"in-process", "stack"}
    assert all(r["tokens_per_s"] > 0 for r in rows)
    ar2 = next(r for r in single if r["config"] == "ar (2 threads)" and r["temperature"] == 0.0)
    assert math.isclose(ar2["speedup_vs_ar"], 1.0)
    # greedy decoding is lossless: every specdec configuration reproduces ar's tokens
    for r in single:
        if r["temperature"] == 0.0 and r["mode"] != "hf_assisted":
            assert r["greedy_match_ar"] == 1.0, r["config"]
    stack = [r for r in single if r["placement"] == "stack"]
    assert all(r["stack_slowdown_vs_in_process"] is not None and r["network_share"] is not None for r in stack)
    sweep = [r for r in rows if r.get("sweep")]
    assert [r["concurrency"] for r in sweep] == [1, 2]
    assert len({r["n"] for r in sweep}) == 1, "every level serves the same requests (in waves)"
    assert all(r["latency_p50_s"] > 0 and r["latency_p99_s"] >= r["latency_p50_s"] for r in sweep)
    assert rows[0]["run"]["git_commit"] is not None and rows[0]["run"]["cores"] >= 1
    md = Path(f"{out}.md").read_text()
    assert "| config |" in md and "Concurrency sweep" in md and "Acceptance goals" in md and "Command:" in md
    assert Path(f"{out}.png").stat().st_size > 1000


def test_hf_draft_from_compact_vocabulary(tmp_path):
    """A draft storing a vocabulary subset (docs/design/distillation.md format) becomes a full-vocabulary HF model
    with the same distribution as specdec's loader gives (logits -inf outside the subset)."""
    from safetensors.torch import load_file, save_file

    from specdec.modeling.model import load_model_dir
    from specdec_bench.runners import SubsetHead, load_hf_draft
    from tests.helpers_models import build_tiny_model

    base = build_tiny_model(vocab_size=32, hidden_size=16, num_layers=1, seed=3)
    subset = torch.tensor([0, 2, 3, 5, 8, 13, 21, 30])
    save_model(base, tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    for k in ("lm_head.weight", "model.embed_tokens.weight"):
        state[k] = state[k][subset].contiguous()
    save_file(state, str(tmp_path / "model.safetensors"))
    save_file({"vocab_subset": subset}, str(tmp_path / "vocab_subset.safetensors"))
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(vocab_size=len(subset), specdec_vocab_subset="vocab_subset.safetensors", specdec_full_vocab_size=32,
               specdec_oov_compact_id=0)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ours = load_model_dir(tmp_path)
    hf = load_hf_draft(tmp_path)
    assert isinstance(hf.lm_head, SubsetHead)
    ids = torch.tensor([[1, 4, 9, 16, 25, 7, 2, 30]])  # mostly outside the subset: the OOV row
    kv = ours.new_kv_slots(1, 16)
    ref, _ = ours(ids, torch.arange(ids.shape[1])[None], torch.tensor([0]), kv)
    got = hf(ids).logits
    assert got.shape == ref.shape == (1, ids.shape[1], 32)
    finite = torch.isfinite(ref)
    assert torch.equal(finite, torch.isfinite(got)) and int(finite[0, 0].sum()) == len(subset)
    assert torch.allclose(ref[finite], got[finite], atol=1e-4)
