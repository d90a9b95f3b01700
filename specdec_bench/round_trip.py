"""The round trip (`specdec bench --round-trip`): what a speculative round costs through the services beyond the same
round in one process, for each data path the coordinator offers.

    specdec bench --round-trip [--paths unary,streams,direct] [--device cuda:0] [--json out.json]

Tiny random models (`specdec_bench/tiny.py`) make the models' own cost small, so the difference is the stack's:
gRPC, serialisation, the replicas' batchers and session bookkeeping, and the threads woken on the way. The same
models, loaded from the same directory by the same loader (so the same kernels and bits), run

- in process: `specdec.engine.Engine`, every call on the calling thread (one torch thread);
- through the stack: a draft and a target replica (separate processes, one torch thread each, `LocalStack`) behind
  a coordinator in this process (on Ray unless `--no-ray`), one configuration per data path: `unary` (the
  coordinator's rounds as unary Draft/Verify calls), `streams` (as messages on one open gRPC stream per replica),
  `frames` (as messages on the replicas' frame ports, specdec_rpc/frames.py), `direct-streams` and `direct` (the
  draft replica runs the rounds and verifies on the target replica, on its gRPC stream or its frame port),
  `direct-spin` (`direct` with the replicas' frame connections waiting awake up to 2 ms for their next message,
  `frame_spin_us`), and `default` (the settings a stack gets when none are given).

Both sides run the same drafting (prompt lookup on or off in both, `--prompt-lookup-min-ngram`), the same requests
(greedy, `--mode` at `--gamma`, distinct token-id prompts, `--max-new-tokens`), interleaved in-process / stack per
repeat; each pair must give the same tokens in the same number of rounds, or the run fails. Reported per path
(medians over the repeats after the first, which warms up): ms per round in process and through the stack, the
overhead (the median of the paired differences), and the thread wake-ups per round: voluntary context switches of
every thread of every process involved (this one and the replicas; Linux's /proc), a thread that sleeps being a
thread that must be woken (every process descended from this one counts: the replicas, Ray's). A round that
crosses no thread would count none. Per round it also splits the stack's time as the replicas report it: the
draft's and the target's compute (beside the same in process) and the links' time (calls' wall time less that
compute: GenerationStats' draft/target/peer network), and the CPU time per round of every process involved, in
process and through the stack (means: the kernel counts in clock ticks): on a host whose cores other work also
uses, wall times stretch with the load while CPU time stays, so the CPU column is the one to compare across runs.
"""
from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

SPIN = {"frame_spin_us": 2000}  # the replicas' frame connections wait awake for up to 2 ms (specdec_rpc/frames.py)
PATHS = {  # path -> (coordinator settings, draft replica settings, target replica settings) that select it
    "unary": ({"data_plane": "coordinator", "replica_streams": False, "replica_frames": False}, {}, {}),
    "streams": ({"data_plane": "coordinator", "replica_streams": True, "replica_frames": False}, {}, {}),
    "frames": ({"data_plane": "coordinator", "replica_streams": True, "replica_frames": True}, {}, {}),
    "direct-streams": ({"data_plane": "direct"}, {"peer_frames": False}, {}),
    "direct": ({"data_plane": "direct"}, {"peer_frames": True}, {}),
    "direct-spin": ({"data_plane": "direct"}, {"peer_frames": True, **SPIN}, SPIN),
    "default": ({}, {}, {}),  # what a stack started with no settings does
}


def voluntary_switches(pids: list[int]) -> int:
    """Voluntary context switches of every thread of `pids` so far (0 where /proc is not there)."""
    total = 0
    for pid in pids:
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{pid}/task/{tid}/status") as f:
                    for line in f:
                        if line.startswith("voluntary_ctxt_switches"):
                            total += int(line.split()[1])
                            break
            except OSError:  # the thread ended meanwhile
                continue
    return total


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of every thread of `pids` so far, in seconds (0 where /proc is not there)."""
    tick, total = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100, 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (clock ticks)
        except (OSError, IndexError, ValueError):  # the process ended meanwhile
            continue
    return total / tick


def process_tree(root: int) -> list[int]:
    """`root` and every process descended from it (the replicas, Ray's workers), from /proc (Linux; else [root])."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    tree, grew = {root}, True
    while grew:
        more = {pid for pid, ppid in parent.items() if ppid in tree and pid not in tree}
        tree |= more
        grew = bool(more)
    return sorted(tree)


def tiny_pair_dirs(root: Path) -> tuple[Path, Path]:
    """A target (2 layers, width 64) and a draft (1 layer, width 32) over 64 tokens, saved under `root`."""
    from specdec_bench.tiny import build_tiny_model, save_model

    target = build_tiny_model(vocab_size=64, hidden_size=64, seed=1, logit_scale=2.0, max_position_embeddings=1024)
    draft = build_tiny_model(vocab_size=64, hidden_size=32, num_layers=1, seed=2, logit_scale=2.0,
                             max_position_embeddings=1024)
    return save_model(target, root / "target"), save_model(draft, root / "draft")


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


async def _measure_path(path: str, engine, dirs: tuple[Path, Path], opts: dict, log) -> dict:
    """One data path: a stack over the pair, `repeats` requests each way, interleaved."""
    import grpc

    from coordinator.stack import LocalStack
    from specdec.decoding.sampling import SamplingParams
    from specdec.scheduling.request import GenerationRequest
    from specdec_rpc.pb import generation_pb2 as g, generation_pb2_grpc as gg

    device, lookup = opts["device"], opts["prompt_lookup_min_ngram"]
    replica = {"device": device} if device != "cpu" else {}
    coordinator, draft, target = PATHS[path]
    stack = LocalStack(str(dirs[0]), str(dirs[1]), use_ray=opts["ray"], max_context=1024, prefix_cache=False,
                       prompt_lookup_min_ngram=lookup, coordinator_options=coordinator,
                       draft_options={**replica, **draft}, target_options={**replica, **target})
    local, remote, over, wake, wake_local, rounds = [], [], [], [], [], 0
    cpu_local, cpu_stack = [], []
    parts: dict[str, list[float]] = {"draft_busy": [], "target_busy": [], "network": [], "local_draft_busy": [],
                                     "local_target_busy": []}
    async with stack:
        pids = process_tree(os.getpid())  # this process, the replicas and (on Ray) the pipelines' workers
        async with grpc.aio.insecure_channel(stack.address) as ch:
            stub = gg.GenerationServiceStub(ch)
            for i in range(opts["repeats"] + 1):
                prompt = [1 + i % 7, 2, 3 + i % 5, 4, 5 + i]
                req = GenerationRequest(prompt_ids=prompt, max_new_tokens=opts["max_new_tokens"],
                                        params=SamplingParams(temperature=0.0), mode=opts["mode"],
                                        gamma=opts["gamma"])
                w0, c0, t0 = voluntary_switches([os.getpid()]), cpu_seconds(pids), time.perf_counter()
                a = await engine.agenerate(req)
                _sync(device)
                t_local, w_local = time.perf_counter() - t0, voluntary_switches([os.getpid()]) - w0
                c_local = cpu_seconds(pids) - c0
                w0, c0, t0 = voluntary_switches(pids), cpu_seconds(pids), time.perf_counter()
                b = await stub.Generate(g.GenerateRequest(
                    prompt_token_ids=prompt, max_new_tokens=opts["max_new_tokens"], temperature=0.0,
                    mode=opts["mode"], gamma=opts["gamma"], ignore_eos=True), timeout=300)
                _sync(device)
                t_stack, w_stack = time.perf_counter() - t0, voluntary_switches(pids) - w0
                c_stack = cpu_seconds(pids) - c0
                if list(b.token_ids) != a.token_ids or b.stats.rounds != a.stats.rounds:
                    raise AssertionError(f"{path}: the stack and the engine disagree on prompt {prompt}: "
                                         f"{list(b.token_ids)} in {b.stats.rounds} rounds against {a.token_ids} in "
                                         f"{a.stats.rounds}")
                rounds = a.stats.rounds
                if i:  # the first pair warms up
                    local.append(t_local * 1e3 / rounds)
                    remote.append(t_stack * 1e3 / rounds)
                    over.append(remote[-1] - local[-1])
                    wake.append(w_stack / rounds)
                    wake_local.append(w_local / rounds)
                    cpu_local.append(c_local * 1e3 / rounds)
                    cpu_stack.append(c_stack * 1e3 / rounds)
                    st = b.stats
                    for name, value in (("draft_busy", st.draft_busy_s), ("target_busy", st.target_busy_s),
                                        ("network", st.draft_network_s + st.target_network_s + st.peer_network_s),
                                        ("local_draft_busy", a.stats.draft_busy_s),
                                        ("local_target_busy", a.stats.target_busy_s)):
                        parts[name].append(value * 1e3 / rounds)
    row = {"path": path, "rounds_per_request": rounds, "repeats": len(local),
           "in_process_ms_per_round": statistics.median(local), "stack_ms_per_round": statistics.median(remote),
           "overhead_ms_per_round": statistics.median(over), "wakeups_per_round": statistics.median(wake),
           "in_process_wakeups_per_round": statistics.median(wake_local),
           "in_process_cpu_ms_per_round": sum(cpu_local) / len(cpu_local),
           "stack_cpu_ms_per_round": sum(cpu_stack) / len(cpu_stack),
           **{f"{k}_ms_per_round": statistics.median(v) for k, v in parts.items()}}
    log(f"{path}: {row['overhead_ms_per_round']:.3f} ms per round over in process "
        f"({row['stack_ms_per_round']:.3f} against {row['in_process_ms_per_round']:.3f}), "
        f"{row['wakeups_per_round']:.1f} wake-ups per round; CPU {row['stack_cpu_ms_per_round']:.3f} ms per round "
        f"against {row['in_process_cpu_ms_per_round']:.3f}")
    return row


async def run_round_trip(paths=tuple(PATHS), device: str = "cpu", repeats: int = 10, max_new_tokens: int = 64,
                         mode: str = "sd", gamma: int = 4, prompt_lookup_min_ngram: int = 0, ray: bool = False,
                         log=print, deadline: float | None = None) -> list[dict]:
    """Each path's row (the module docstring); raises where the stack's output differs from the engine's.
    `deadline` (time.monotonic()): no path starts after it."""
    from specdec.common.threads import set_thread_count
    from specdec.decoding.lookup import prompt_lookup
    from specdec.engine import Engine
    from specdec.modeling.model import load_model_dir

    unknown = [p for p in paths if p not in PATHS]
    if unknown:
        raise ValueError(f"unknown data path(s) {', '.join(unknown)}: use {', '.join(PATHS)}")
    set_thread_count(1)  # the engine's calls run on this thread, as each replica's run on its one thread
    opts = dict(device=device, repeats=repeats, max_new_tokens=max_new_tokens, mode=mode, gamma=gamma,
                prompt_lookup_min_ngram=prompt_lookup_min_ngram, ray=ray)
    with tempfile.TemporaryDirectory(prefix="specdec-round-trip-") as tmp:
        dirs = tiny_pair_dirs(Path(tmp))
        engine = Engine(load_model_dir(dirs[0], device=device, dtype="auto", role="target"),
                        load_model_dir(dirs[1], device=device, dtype="auto", role="draft"), inline=True,
                        max_sessions=2, max_context=1024, prefix_cache=False,
                        lookup=prompt_lookup(prompt_lookup_min_ngram))
        try:
            return [await _measure_path(p, engine, dirs, opts, log) for p in paths
                    if deadline is None or time.monotonic() < deadline]
        finally:
            engine.close()


def markdown(rows: list[dict], meta: dict) -> str:
    """The table (ms per round, medians), then the run's machine and command where `meta` has them."""
    lines = ["| data path | in process | through the stack | **overhead** | draft compute (in process) | "
             "target compute (in process) | links | wake-ups (in process) | CPU (in process) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['path']} | {r['in_process_ms_per_round']:.3f} | {r['stack_ms_per_round']:.3f} | "
              f"**{r['overhead_ms_per_round']:.3f}** | {r['draft_busy_ms_per_round']:.3f} "
              f"({r['local_draft_busy_ms_per_round']:.3f}) | {r['target_busy_ms_per_round']:.3f} "
              f"({r['local_target_busy_ms_per_round']:.3f}) | {r['network_ms_per_round']:.3f} | "
              f"{r['wakeups_per_round']:.1f} ({r['in_process_wakeups_per_round']:.1f}) | "
              f"{r['stack_cpu_ms_per_round']:.3f} ({r['in_process_cpu_ms_per_round']:.3f}) |" for r in rows]
    m = meta.get("machine")
    if m:
        lines += ["", f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores, torch {m.get('torch', '?')}, "
                      f"{m.get('date_utc', '')}; {rows[0]['rounds_per_request'] if rows else '?'} rounds per request; "
                      f"`{meta.get('command', '')}`"]
    return "\n".join(lines)
