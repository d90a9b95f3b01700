"""The benchmark run: build the configurations, load everything once, run them interleaved, aggregate.

Interleaving: for each prompt, for each repeat, for each temperature, every configuration runs once (the order
rotates each round), so machine drift hits all configurations alike. Speedups are medians of *paired* ratios
(the configuration's tokens/s over the baseline's on the same prompt in the same round).
"""
from __future__ import annotations

import asyncio
import math
import statistics
import time
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from coordinator.stack import LocalStack
from specdec.common.defaults import PROMPT_LOOKUP_MIN_NGRAM
from specdec.decoding.lookup import prompt_lookup
from specdec.decoding.preverifier import default_preverifier_dir, load_preverifier
from specdec.engine import Engine
from specdec.modeling.hub import resolve_model
from specdec.modeling.model import load_model_dir
from specdec.text.tokenizer import eos_token_ids, load_tokenizer
from specdec_bench.prompts import load_prompt_sets
from specdec_bench.runners import Config, EngineRunner, HFModels, HFRunner, Sample, StackClient, StackRunner

ALL_MODES = ("ar", "hf", "sd", "pacer", "pearl", "pacer_pearl")
AR_BASE = "ar (2 threads)"
HF_BASE = "hf assisted (2 threads)"


@dataclass
class BenchOptions:
    target: str = "default-target"
    draft: str = "default-draft"
    preverifier: str | None = None
    prompt_sets: tuple[str, ...] = ("humaneval", "chat")
    prompts_file: str | None = None
    n_per_set: int | None = 8
    modes: tuple[str, ...] = ALL_MODES
    gammas: tuple[int, ...] = (2, 3, 4, 6)
    temperatures: tuple[float, ...] = (0.0, 1.0)
    max_new_tokens: int = 128
    repeats: int = 3
    concurrency: tuple[int, ...] = (1, 2, 4, 8)
    concurrency_mode: str = "pacer_pearl"
    concurrency_repeats: int = 2
    prompt_lookup_min_ngram: int = PROMPT_LOOKUP_MIN_NGRAM  # in-process engines and the stack's draft replica
    use_ray: bool = True
    # off: every request prefills its whole prompt (the HF baseline has no prefix cache, and with one the mode that
    # runs a prompt first would pay the prefill the others skip)
    prefix_cache: bool = False
    warmup_tokens: int = 8
    progress: bool = True
    seed: int = 0


@dataclass
class Record:
    config: Config
    temperature: float
    prompt_set: str
    key: str
    rep: int
    sample: Sample
    concurrency: int = 1


@dataclass
class ConcurrencyRecord:
    concurrency: int
    rep: int
    makespan_s: float
    samples: list[Sample] = field(default_factory=list)


def resolve_inputs(o: BenchOptions):
    """What a run reads, resolved once: (target dir, draft dir or None, pre-verifier dir or None, prompts, the target's
    EOS ids). No prompts is an error."""
    target_dir = resolve_model(o.target)
    draft_dir = resolve_model(o.draft) if o.draft else None
    pv_path = o.preverifier or default_preverifier_dir(o.draft)
    prompts = load_prompt_sets(load_tokenizer(target_dir), list(o.prompt_sets), o.n_per_set, o.prompts_file)
    if not prompts:
        raise ValueError("no prompts to run")
    return target_dir, draft_dir, pv_path, prompts, tuple(sorted(eos_token_ids(target_dir)))


def build_configs(opts: BenchOptions, has_preverifier: bool) -> list[Config]:
    m = set(opts.modes)
    out: list[Config] = []
    if "ar" in m:
        out += [Config("ar (1 thread)", "engine", "ar", 1), Config(AR_BASE, "engine", "ar", 2)]
    if "hf" in m:
        out += [Config("hf assisted (1 thread)", "hf", "hf_assisted", 1), Config(HF_BASE, "hf", "hf_assisted", 2)]
    spec = [(md, g) for md in ("sd",) if md in m for g in opts.gammas]
    spec += [(md, None) for md in ("pacer", "pearl", "pacer_pearl") if md in m
             and (has_preverifier or md not in ("pacer", "pacer_pearl"))]
    for md, g in spec:  # the same schedule in one process (1 thread per model) and through the stack
        label = f"{md} g={g}" if g else md
        out.append(Config(f"{label} (in-process)", "engine", md, 1, g, "in-process"))
        out.append(Config(f"{label} (stack)", "stack", md, 1, g, "stack"))
    return out


class Bench:
    def __init__(self, opts: BenchOptions, log=print):
        self.opts, self.log = opts, log
        self.loop = asyncio.new_event_loop()
        self.stack = self.client = self.hf = None
        self.engines: list = []
        self.runners: dict[str, object] = {}
        self.notes: list[str] = [] if opts.prefix_cache else [
            "prefix cache off (every request prefills its whole prompt, as the HF baseline does; --prefix-cache)"]

    # ---- setup ------------------------------------------------------------------------------------------------
    def setup(self) -> None:
        o = self.opts
        torch.set_num_threads(1)  # this thread only orchestrates; compute threads set their own counts
        self.target_dir, self.draft_dir, self.pv_path, self.prompts, self.eos = resolve_inputs(o)
        self.configs = build_configs(o, self.pv_path is not None)
        if self.pv_path is None and {"pacer", "pacer_pearl"} & set(o.modes):
            self.notes.append("no pre-verifier found: pacer and pacer_pearl were not run (pass --preverifier)")
        kinds = {c.kind for c in self.configs}
        max_ctx = max(len(p.ids) for p in self.prompts) + o.max_new_tokens + 64
        self.log(f"loading models (target {self.target_dir}, draft {self.draft_dir})")
        target = load_model_dir(self.target_dir, dtype="auto", role="target")
        draft = load_model_dir(self.draft_dir, dtype="auto", role="draft") if self.draft_dir else None
        pv = None
        if self.pv_path and draft is not None:
            pv = load_preverifier(self.pv_path, draft_model=draft)
        engines: dict[int | str, Engine] = {}
        for c in self.configs:
            if c.kind != "engine":
                continue
            key = c.threads if c.mode == "ar" else "spec"
            if key not in engines:
                engines[key] = Engine(target, None if c.mode == "ar" else draft, preverifier=pv, max_sessions=2,
                                      lookup=prompt_lookup(o.prompt_lookup_min_ngram),
                                      max_context=max_ctx, threads_per_model=c.threads,
                                      prefix_cache=o.prefix_cache)
            self.runners[c.name] = EngineRunner(engines[key], c, self.eos)
        self.engines = list(engines.values())
        if "hf" in kinds:
            self.hf = HFModels(self.target_dir, self.draft_dir, self.eos)
            if self.hf.compact_draft:
                self.notes.append("HF baseline draft: the draft stores a compact vocabulary subset that transformers "
                                  "cannot load as a standard LlamaForCausalLM; the same weights run as a "
                                  "LlamaForCausalLM with full-vocabulary input embeddings and the compact output head "
                                  "(same cost as specdec's), logits -inf outside the subset")
            for c in self.configs:
                if c.kind == "hf":  # 2 threads: on the 2-thread `ar` engine's thread, one OpenMP team (threads.py)
                    shared = engines.get(c.threads) if c.threads > 1 else None
                    self.runners[c.name] = HFRunner(self.hf, c, pool=shared.target.thread.executor if shared else None)
        if "stack" in kinds or o.concurrency:
            self.log("starting the embedded stack (draft + target servers, 1 thread each; coordinator)")
            self.stack = LocalStack(str(self.target_dir), str(self.draft_dir), self.pv_path, threads=1,
                                    ray_cpus=2, pipelines=2, use_ray=o.use_ray,
                                    max_sessions=max(8, max(o.concurrency or (1,))), max_context=max_ctx,
                                    prompt_lookup_min_ngram=o.prompt_lookup_min_ngram, prefix_cache=o.prefix_cache)
            self.loop.run_until_complete(self.stack.start())
            self.client = self.loop.run_until_complete(_client(self.stack.address))  # channel bound to this loop
            for c in self.configs:
                if c.kind == "stack":
                    self.runners[c.name] = StackRunner(self.client, c)

    def close(self) -> None:
        if self.client is not None:
            self.loop.run_until_complete(self.client.close())
        if self.stack is not None:
            self.loop.run_until_complete(self.stack.stop())
        for r in self.runners.values():
            if isinstance(r, HFRunner):
                r.close()
        for e in self.engines:
            e.close()
        pending = [t for t in asyncio.all_tasks(self.loop) if not t.done()]  # e.g. a --no-ray pool's health loop
        for t in pending:
            t.cancel()
        if pending:
            self.loop.run_until_complete(_drain(pending))
        self.loop.close()

    # ---- runs -------------------------------------------------------------------------------------------------
    def _run(self, cfg: Config, ids, temperature, seed, n) -> Sample:
        return self.loop.run_until_complete(self.runners[cfg.name].run(ids, temperature, seed, n))

    def _conc_cfg(self) -> Config:
        return Config(f"{self.opts.concurrency_mode} (stack)", "stack", self.opts.concurrency_mode, 1)

    def run(self) -> tuple[list[Record], list[ConcurrencyRecord]]:
        o = self.opts
        conc = list(o.concurrency) if self.client is not None else []
        if o.concurrency_mode in ("pacer", "pacer_pearl") and self.pv_path is None:
            conc = []
        n_main = len(self.prompts) * o.repeats * len(o.temperatures) * len(self.configs)
        n_conc = len(conc) * max(conc, default=0) * o.concurrency_repeats
        bar = _progress(n_main + n_conc + len(self.configs), o.progress)
        first = self.prompts[0].ids
        for cfg in self.configs:  # warm up every path (allocations, connections, lazy imports)
            bar.set_postfix_str(f"warmup {cfg.name}")
            self._run(cfg, first, 0.0, 0, o.warmup_tokens)
            bar.update(1)
        records: list[Record] = []
        rnd = 0
        for pi, p in enumerate(self.prompts):
            for rep in range(o.repeats):
                for temperature in o.temperatures:
                    seed = o.seed + 1000 * rep + pi
                    order = self.configs[rnd % len(self.configs):] + self.configs[:rnd % len(self.configs)]
                    rnd += 1
                    for cfg in order:
                        bar.set_postfix_str(f"{p.key} r{rep} T={temperature:g} {cfg.name}")
                        s = self._run(cfg, p.ids, temperature, seed, o.max_new_tokens)
                        records.append(Record(cfg, temperature, p.prompt_set, p.key, rep, s))
                        bar.update(1)
        crecs: list[ConcurrencyRecord] = []
        cfg = self._conc_cfg()
        for rep in range(o.concurrency_repeats):
            # every level serves the same requests (the largest level's), c at a time in waves: the ratio between
            # levels compares one workload, not whichever prompts a level happened to draw
            picks = [self.prompts[(rep * 7 + i) % len(self.prompts)] for i in range(max(conc, default=0))]
            for c in conc:
                bar.set_postfix_str(f"concurrency {c} r{rep}")
                crecs.append(self.loop.run_until_complete(self._concurrent(cfg, picks, c, rep)))
                bar.update(len(picks))
        bar.close()
        return records, crecs

    async def _concurrent(self, cfg: Config, picks, c: int, rep: int) -> ConcurrencyRecord:
        """`picks` in waves of `c` simultaneous requests; the makespan is the waves' total."""
        makespan, samples = 0.0, []
        for i in range(0, len(picks), c):
            t0 = time.perf_counter()
            samples += await asyncio.gather(*(self.client.generate(p.ids, cfg.mode, cfg.gamma, 0.0, rep,
                                                                   self.opts.max_new_tokens) for p in picks[i:i + c]))
            makespan += time.perf_counter() - t0
        return ConcurrencyRecord(c, rep, makespan, list(samples))


async def _drain(tasks) -> None:
    await asyncio.gather(*tasks, return_exceptions=True)


async def _client(address: str) -> StackClient:
    return StackClient(address)


def _progress(total: int, enabled: bool):
    return tqdm(total=total, disable=not enabled, unit="req", dynamic_ncols=True, desc="bench")


# ---- aggregation ----------------------------------------------------------------------------------------------
def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _paired(recs: list[Record], base: list[Record], fn) -> float | None:
    by = {(r.key, r.rep): r.sample for r in base}
    return _median([fn(r.sample, by[(r.key, r.rep)]) for r in recs if (r.key, r.rep) in by
                    and by[(r.key, r.rep)].tokens_per_s > 0])


def _pct(xs, q):
    xs = sorted(xs)
    if not xs:
        return None
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def aggregate(records: list[Record], crecs: list[ConcurrencyRecord], configs: list[Config],
              conc_mode: str = "pacer_pearl") -> list[dict]:
    rows: list[dict] = []
    sets = sorted({r.prompt_set for r in records})
    groups = [(t, s) for t in sorted({r.temperature for r in records}) for s in (sets + ["all"] if len(sets) > 1 else sets)]
    ratio = lambda a, b: a.tokens_per_s / b.tokens_per_s  # noqa: E731
    for temperature, pset in groups:
        sel = [r for r in records if r.temperature == temperature and (pset == "all" or r.prompt_set == pset)]
        by_cfg = {c.name: [r for r in sel if r.config.name == c.name] for c in configs}
        ar_ids = {(r.key, r.rep): r.sample.token_ids for r in by_cfg.get(AR_BASE, [])}
        for c in configs:
            rs = by_cfg[c.name]
            if not rs:
                continue
            st = [r.sample.stats for r in rs if r.sample.stats]
            toks = sum(r.sample.tokens for r in rs)
            fwd = sum(s.get("target_forwards", 0) for s in st)
            twin = None
            if c.placement == "stack":
                twin = next((d for d in configs if d.placement == "in-process" and d.kind == "engine"
                             and d.mode == c.mode and d.gamma == c.gamma), None)
            row = {
                "config": c.name, "mode": c.mode, "placement": c.placement, "gamma": c.gamma, "threads": c.threads,
                "temperature": temperature, "prompt_set": pset, "concurrency": 1, "n": len(rs),
                "tokens_per_s": _median([r.sample.tokens_per_s for r in rs]),
                "speedup_vs_ar": _paired(rs, by_cfg.get(AR_BASE, []), ratio),
                "speedup_vs_hf": _paired(rs, by_cfg.get(HF_BASE, []), ratio),
                "mean_accepted_length": (toks / fwd) if fwd else None,
                "target_forwards_per_token": (fwd / toks) if (fwd and toks) else None,
                "wasted_draft_tokens": _median([s.get("wasted_draft_tokens") for s in st]) if st else None,
                "wasted_draft_per_token": (sum(s.get("wasted_draft_tokens", 0) for s in st) / toks) if st and toks else None,
                "overlap_efficiency": _median([s["target_busy_s"] / r.sample.wall_s for r, s in
                                               ((r, r.sample.stats) for r in rs) if s and r.sample.wall_s > 0]),
                "network_share": (_median([s["network_s"] / r.sample.wall_s for r, s in
                                           ((r, r.sample.stats) for r in rs) if s and r.sample.wall_s > 0])
                                  if c.placement == "stack" else None),
                "stack_slowdown_vs_in_process": (1.0 - _paired(rs, by_cfg[twin.name], ratio)
                                                 if twin and by_cfg.get(twin.name) else None),
                "tokens_generated": toks,
                # lossless check: greedy outputs equal ar (2 threads) on the same prompt (fraction of requests)
                "greedy_match_ar": (statistics.fmean([float(r.sample.token_ids == ar_ids[(r.key, r.rep)]) for r in rs
                                                if (r.key, r.rep) in ar_ids] or [math.nan])
                                    if temperature == 0.0 and ar_ids else None),
            }
            rows.append(row)
    if crecs:
        ar = [r for r in records if r.temperature == 0.0 and r.config.name == AR_BASE]
        hf = [r for r in records if r.temperature == 0.0 and r.config.name == HF_BASE]
        ar_tps = _median([r.sample.tokens_per_s for r in ar])
        hf_tps = _median([r.sample.tokens_per_s for r in hf])
        for c in sorted({cr.concurrency for cr in crecs}):
            cs = [cr for cr in crecs if cr.concurrency == c]
            agg = _median([sum(s.tokens for s in cr.samples) / cr.makespan_s for cr in cs])
            lat = [s.wall_s for cr in cs for s in cr.samples]
            st = [s.stats for cr in cs for s in cr.samples]
            toks = sum(s.tokens for cr in cs for s in cr.samples)
            fwd = sum(s.get("target_forwards", 0) for s in st)
            rows.append({
                "config": f"concurrency sweep ({c})", "mode": conc_mode, "placement": "stack", "gamma": None,
                "threads": 1, "temperature": 0.0, "prompt_set": "all", "concurrency": c, "n": len(lat), "sweep": True,
                "tokens_per_s": agg, "speedup_vs_ar": agg / ar_tps if agg and ar_tps else None,
                "speedup_vs_hf": agg / hf_tps if agg and hf_tps else None,
                "mean_accepted_length": toks / fwd if fwd else None,
                "latency_p50_s": _pct(lat, 0.5), "latency_p99_s": _pct(lat, 0.99),
                "per_request_tokens_per_s": _median([s.tokens_per_s for cr in cs for s in cr.samples]),
                "tokens_generated": toks,
            })
    return rows



def acceptance(records: list[Record], rows: list[dict], conc_mode: str = "pacer_pearl") -> list[dict]:
    """The issue's acceptance goals, greedy, all prompt sets: [{goal, want, measured, met}]."""
    greedy = [r for r in records if r.temperature == 0.0]
    by = lambda name: [r for r in greedy if r.config.name == name]  # noqa: E731
    row = lambda name, c=1: next((x for x in rows if x["config"] == name and x["temperature"] == 0.0  # noqa: E731
                                  and x["prompt_set"] == "all" and x["concurrency"] == c), None) or next(
        (x for x in rows if x["config"] == name and x["temperature"] == 0.0 and x["concurrency"] == c), None)
    out = []

    def goal(text, want, measured):
        out.append({"goal": text, "want": want, "measured": measured,
                    "met": None if measured is None else measured >= want})

    pp = row("pacer_pearl (stack)")
    goal("pacer_pearl (stack) vs ar (2 threads)", 2.0, pp and pp["speedup_vs_ar"])
    goal("pacer_pearl (stack) vs HF assisted (2 threads)", 1.4, pp and pp["speedup_vs_hf"])
    sds = sorted({r.config.name for r in greedy if r.config.mode == "sd" and r.config.placement == "stack"})
    pearl = by("pearl (stack)")
    ratios = [_paired(pearl, by(n), lambda a, b: a.tokens_per_s / b.tokens_per_s) for n in sds]
    ratios = [x for x in ratios if x is not None]
    goal("pearl (stack) vs best fixed-gamma sd (stack)", 1.3, min(ratios) if ratios and pearl else None)
    twin = row(f"{conc_mode} (stack)")
    slow = twin and twin.get("stack_slowdown_vs_in_process")
    out.append({"goal": f"gRPC stack slowdown vs the same schedule in one process ({conc_mode})", "want": 0.10,
                "measured": slow, "met": None if slow is None else slow <= 0.10})
    c1, c8 = row("concurrency sweep (1)", 1), row("concurrency sweep (8)", 8)
    goal("aggregate tokens/s at 8 concurrent requests vs 1", 3.0,
         c1 and c8 and c1["tokens_per_s"] and c8["tokens_per_s"] / c1["tokens_per_s"])
    return out
