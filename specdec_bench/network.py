"""The network sweep (`specdec bench --rtt-ms 0,2,10,30`, or `--rtt-t 0,1,3`): every mode through the embedded stack
with a network round trip on each link between its processes.

For each data plane (`--data-plane coordinator,direct`) and each round trip, the stack starts with
`LocalStack(emulate_rtt_ms=RTT)`: a delay relay (specdec_rpc/netem.py) on the coordinator -> target, coordinator ->
draft and draft -> target links, each delaying every byte by RTT/2 each way. Then every configuration (ar, sd at
each γ, pacer, pearl, pacer_pearl, as --modes and --gammas name them) runs every prompt, interleaved as the main
suite runs them (harness.py), streamed so the time to the first token is measured.

`--rtt-t` gives the round trips in units of T, this host's one-row target forward: T is measured first, with the
target alone in this process (a KV-cached one-row forward over a prompt-length context, one thread as each replica
runs, median), and reported. RTT = k·T asks "what does a network as slow as k target steps cost each mode", which
carries across hosts better than milliseconds do.

The rows: per data plane, RTT, temperature and configuration (all prompts together), tokens/s, time to the first
token, rounds, wall time per round, mean accepted length, the share of wall time each link's network took (the
coordinator's per-request GenerationStats: draft_network_s, target_network_s, peer_network_s), `kept` (tokens/s over
the same configuration's at RTT 0), and the ratios to the best fixed-γ sd and to ar at the same RTT. The speed ratios
are medians of paired per-request ratios (same prompt, same repeat), as in the main suite. Greedy outputs are
checked equal to ar's at the same RTT and data plane (ar always runs: it is the baseline and the lossless check).
"""
from __future__ import annotations

import asyncio
import math
import statistics
import time
from dataclasses import dataclass

import torch

from coordinator.stack import LocalStack
from specdec.modeling.model import load_model_dir
from specdec_bench.harness import BenchOptions, _drain, _median, _progress, resolve_inputs
from specdec_bench.runners import Config, Sample, StackClient, StackRunner

DATA_PLANES = ("coordinator", "direct")
AR = "ar (stack)"
LINKS = (("draft_link_share", "draft_network_s"), ("target_link_share", "target_network_s"),
         ("peer_link_share", "peer_network_s"))  # coordinator <-> draft, coordinator <-> target, draft <-> target


@dataclass
class NetworkRecord:
    config: Config
    data_plane: str
    rtt_ms: float
    temperature: float
    prompt_set: str
    key: str
    rep: int
    sample: Sample


def network_configs(opts: BenchOptions, has_preverifier: bool) -> list[Config]:
    """ar (always), sd at each γ, and the adaptive modes --modes names, each through the stack."""
    m = set(opts.modes)
    out = [Config(AR, "stack", "ar", 1, None, "stack")]
    out += [Config(f"sd g={g} (stack)", "stack", "sd", 1, g, "stack") for g in opts.gammas if "sd" in m]
    out += [Config(f"{md} (stack)", "stack", md, 1, None, "stack") for md in ("pacer", "pearl", "pacer_pearl")
            if md in m and (has_preverifier or md not in ("pacer", "pacer_pearl"))]
    return out


def measure_target_forward_s(target_dir, context: int, repeats: int = 21) -> float:
    """T: the median time of a one-row, KV-cached forward of the target over `context` cached positions, on one
    thread (each replica of the bench's stack runs one), as served (`dtype` auto, role target)."""
    model = load_model_dir(target_dir, dtype="auto", role="target")
    context = max(1, context)
    kv = model.new_kv_slots(1, context + repeats + 8)
    vocab = model.config.vocab_size
    slot = torch.tensor([0])
    gen = torch.Generator().manual_seed(0)
    model(torch.randint(0, vocab, (1, context), generator=gen), torch.arange(context)[None], slot, kv)
    times = []
    for i in range(repeats + 3):  # the first 3: warm-up
        tok = torch.randint(0, vocab, (1, 1), generator=gen)
        t0 = time.perf_counter()
        model(tok, torch.tensor([[context + i]]), slot, kv)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[3:])


class NetworkBench:
    """Runs the sweep: `rtts_ms` (or `rtts_t`, in units of T, measured at setup) × `data_planes` × the configs."""

    def __init__(self, opts: BenchOptions, rtts_ms: tuple[float, ...] = (), rtts_t: tuple[float, ...] = (),
                 data_planes: tuple[str, ...] = ("coordinator",), log=print):
        if bool(rtts_ms) == bool(rtts_t):
            raise ValueError("name the round trips one way: --rtt-ms or --rtt-t")
        bad = [x for x in (*rtts_ms, *rtts_t) if not (x >= 0 and math.isfinite(x))]
        if bad:
            raise ValueError(f"round trips must be 0 or more: {bad}")
        unknown = [d for d in data_planes if d not in DATA_PLANES]
        if unknown or not data_planes:
            raise ValueError(f"--data-plane {','.join(data_planes)}: use {' and/or '.join(DATA_PLANES)}")
        self.opts, self.log = opts, log
        self.rtts_ms, self.rtts_t, self.data_planes = tuple(rtts_ms), tuple(rtts_t), tuple(dict.fromkeys(data_planes))
        self.target_forward_s: float | None = None  # T, with --rtt-t
        self.loop = asyncio.new_event_loop()
        self.notes: list[str] = []
        self.records: list[NetworkRecord] = []

    def setup(self) -> None:
        o = self.opts
        torch.set_num_threads(1)  # this thread only orchestrates (and measures T on one thread, as a replica runs)
        self.target_dir, self.draft_dir, self.pv_path, self.prompts, self.eos = resolve_inputs(o)
        self.configs = network_configs(o, self.pv_path is not None)
        if self.pv_path is None and {"pacer", "pacer_pearl"} & set(o.modes):
            self.notes.append("no pre-verifier found: pacer and pacer_pearl were not run (pass --preverifier)")
        if "hf" in o.modes:
            self.notes.append("hf (assisted generation in one process) has no network between models: not in the "
                              "network sweep")
        if "ar" not in o.modes:
            self.notes.append("ar runs at every round trip anyway: the baseline of × ar and of the greedy check")
        if not o.prefix_cache:
            self.notes.append("prefix cache off (every request prefills its whole prompt; --prefix-cache)")
        self.max_ctx = max(len(p.ids) for p in self.prompts) + o.max_new_tokens + 64
        if self.rtts_t:
            context = int(statistics.median(len(p.ids) for p in self.prompts))
            self.log(f"measuring T (one-row target forward, {context} cached positions, 1 thread)")
            self.target_forward_s = measure_target_forward_s(self.target_dir, context)
            self.rtts_ms = tuple(k * self.target_forward_s * 1e3 for k in self.rtts_t)
            self.log(f"T = {self.target_forward_s * 1e3:.2f} ms: round trips "
                     + ", ".join(f"{k:g}T = {ms:.1f} ms" for k, ms in zip(self.rtts_t, self.rtts_ms)))
        if 0.0 not in self.rtts_ms:
            self.notes.append("no round trip 0 in the sweep: `kept` needs one")

    def run(self) -> list[NetworkRecord]:
        o = self.opts
        per_stack = len(self.configs) * (1 + len(self.prompts) * o.repeats * len(o.temperatures))
        bar = _progress(per_stack * len(self.rtts_ms) * len(self.data_planes), o.progress)
        for plane in self.data_planes:
            for rtt in self.rtts_ms:
                self.loop.run_until_complete(self._one_stack(plane, rtt, bar))
        bar.close()
        return self.records

    async def _one_stack(self, plane: str, rtt_ms: float, bar) -> None:
        o = self.opts
        bar.set_postfix_str(f"starting the stack: {plane} data plane, RTT {rtt_ms:g} ms")
        stack = LocalStack(str(self.target_dir), str(self.draft_dir), self.pv_path, threads=1, ray_cpus=2,
                           pipelines=2, use_ray=o.use_ray, max_sessions=8, max_context=self.max_ctx,
                           prompt_lookup_min_ngram=o.prompt_lookup_min_ngram, prefix_cache=o.prefix_cache,
                           emulate_rtt_ms=rtt_ms, coordinator_options={"data_plane": plane},
                           # the relays carry gRPC only: at every RTT the rounds take the gRPC streams, so that the
                           # sweep compares round trips, not transports (frames: `specdec bench --round-trip`)
                           draft_options={"data_port": -1}, target_options={"data_port": -1})
        client = None
        try:
            await stack.start()
            client = StackClient(stack.address)
            runners = {c.name: StackRunner(client, c, stream=True) for c in self.configs}
            for c in self.configs:  # warm up every path (connections, sessions, lazy imports)
                bar.set_postfix_str(f"{plane} RTT {rtt_ms:g} ms warmup {c.name}")
                await runners[c.name].run(self.prompts[0].ids, 0.0, 0, o.warmup_tokens)
                bar.update(1)
            rnd = 0
            for pi, p in enumerate(self.prompts):
                for rep in range(o.repeats):
                    for temperature in o.temperatures:
                        seed = o.seed + 1000 * rep + pi
                        k = rnd % len(self.configs)
                        rnd += 1
                        for c in self.configs[k:] + self.configs[:k]:  # the order rotates each round
                            bar.set_postfix_str(f"{plane} RTT {rtt_ms:g} ms {p.key} r{rep} T={temperature:g} {c.name}")
                            s = await runners[c.name].run(p.ids, temperature, seed, o.max_new_tokens)
                            self.records.append(NetworkRecord(c, plane, rtt_ms, temperature, p.prompt_set, p.key,
                                                              rep, s))
                            bar.update(1)
        finally:
            if client is not None:
                await client.close()
            await stack.stop()

    def close(self) -> None:
        pending = [t for t in asyncio.all_tasks(self.loop) if not t.done()]  # e.g. a --no-ray pool's health loop
        for t in pending:
            t.cancel()
        if pending:
            self.loop.run_until_complete(_drain(pending))
        self.loop.close()


# ---- aggregation ----------------------------------------------------------------------------------------------
def _paired_ratio(recs: list[NetworkRecord], base: list[NetworkRecord]) -> float | None:
    """Median over requests of tokens/s ÷ the base's tokens/s on the same prompt, repeat and temperature."""
    by = {(r.key, r.rep, r.temperature): r.sample for r in base}
    return _median([r.sample.tokens_per_s / by[(r.key, r.rep, r.temperature)].tokens_per_s for r in recs
                    if (r.key, r.rep, r.temperature) in by and by[(r.key, r.rep, r.temperature)].tokens_per_s > 0])


def aggregate_network(records: list[NetworkRecord], configs: list[Config],
                      target_forward_s: float | None = None) -> list[dict]:
    """One row per (data plane, RTT, temperature, configuration), over all prompts (the module docstring)."""
    rows: list[dict] = []
    planes = list(dict.fromkeys(r.data_plane for r in records))
    rtts = sorted({r.rtt_ms for r in records})
    temps = sorted({r.temperature for r in records})
    sel = lambda plane, rtt, t, name: [r for r in records if r.data_plane == plane and r.rtt_ms == rtt  # noqa: E731
                                       and r.temperature == t and r.config.name == name]
    for plane in planes:
        for rtt in rtts:
            for t in temps:
                ar = sel(plane, rtt, t, AR)
                ar_ids = {(r.key, r.rep): r.sample.token_ids for r in ar}
                sds = [c.name for c in configs if c.mode == "sd" and sel(plane, rtt, t, c.name)]
                best_sd = max(sds, key=lambda n: _median([r.sample.tokens_per_s for r in sel(plane, rtt, t, n)]),
                              default=None)
                for c in configs:
                    rs = sel(plane, rtt, t, c.name)
                    if not rs:
                        continue
                    st = [r.sample.stats for r in rs]
                    toks = sum(r.sample.tokens for r in rs)
                    fwd = sum(s.get("target_forwards", 0) for s in st)
                    base = sel(plane, 0.0, t, c.name)
                    row = {
                        "section": "network", "config": c.name, "mode": c.mode, "gamma": c.gamma,
                        "data_plane": plane, "rtt_ms": rtt,
                        "rtt_t": rtt / (target_forward_s * 1e3) if target_forward_s else None,
                        "temperature": t, "prompt_set": "all", "n": len(rs),
                        "tokens_per_s": _median([r.sample.tokens_per_s for r in rs]),
                        "ttft_ms": _median([r.sample.ttft_s * 1e3 for r in rs if r.sample.ttft_s is not None]),
                        "rounds": _median([s.get("rounds") for s in st]),
                        "wall_ms_per_round": _median([r.sample.wall_s * 1e3 / r.sample.stats["rounds"] for r in rs
                                                      if r.sample.stats.get("rounds")]),
                        "mean_accepted_length": toks / fwd if fwd else None,
                        **{share: _median([r.sample.stats.get(field, 0.0) / r.sample.wall_s for r in rs
                                           if r.sample.wall_s > 0]) for share, field in LINKS},
                        # the share of the request's wall time its draft and its target computed (sizing the
                        # pools: a request keeps this much of one draft replica's model thread busy)
                        **{share: _median([r.sample.stats.get(field, 0.0) / r.sample.wall_s for r in rs
                                           if r.sample.wall_s > 0])
                           for share, field in (("draft_busy_share", "draft_busy_s"),
                                                ("target_busy_share", "target_busy_s"))},
                        "kept": _paired_ratio(rs, base) if base else None,
                        "vs_best_sd": _paired_ratio(rs, sel(plane, rtt, t, best_sd)) if best_sd else None,
                        "best_sd": best_sd,
                        "vs_ar": _paired_ratio(rs, ar) if ar else None,
                        "tokens_generated": toks,
                        # lossless check: greedy outputs equal ar's at the same RTT and data plane
                        "greedy_match_ar": (statistics.fmean([float(r.sample.token_ids == ar_ids[(r.key, r.rep)])
                                                              for r in rs if (r.key, r.rep) in ar_ids] or [math.nan])
                                            if t == 0.0 and ar_ids else None),
                    }
                    rows.append(row)
    return rows
