"""Machine description, the markdown tables and the plot of a benchmark run."""
from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import time
from pathlib import Path

import torch


def machine_info() -> dict:
    model, cores = platform.processor() or "unknown", os.cpu_count()
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                                cwd=Path(__file__).resolve().parents[1]).stdout.strip() or None
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "specdec", "coordinator",
                                     "draft_service", "target_service"], capture_output=True, text=True, timeout=10,
                                    cwd=Path(__file__).resolve().parents[1]).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        commit, dirty = None, None
    return {"cpu": model, "cores": cores, "usable_cores": len(os.sched_getaffinity(0)),
            "load_avg_start": list(os.getloadavg()), "git_commit": commit, "git_dirty": dirty, "python": platform.python_version(),
            "torch": torch.__version__, "transformers": importlib.metadata.version("transformers"),
            "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}


def _f(x, fmt="{:.2f}", dash="–"):
    return dash if x is None else fmt.format(x)


MAIN_COLS = ("config", "tok/s", "× ar (2t)", "× HF (2t)", "accepted len", "target fwd/token", "wasted draft/req",
             "overlap eff.", "network share", "stack slowdown", "output = ar")


def _main_row(r: dict) -> str:
    cells = [r["config"], _f(r["tokens_per_s"], "{:.1f}"), _f(r["speedup_vs_ar"]), _f(r["speedup_vs_hf"]),
             _f(r.get("mean_accepted_length")), _f(r.get("target_forwards_per_token")),
             _f(r.get("wasted_draft_tokens"), "{:.0f}"), _f(r.get("overlap_efficiency"), "{:.0%}"),
             _f(r.get("network_share"), "{:.1%}"), _f(r.get("stack_slowdown_vs_in_process"), "{:+.1%}"),
             _f(r.get("greedy_match_ar"), "{:.0%}")]
    return "| " + " | ".join(cells) + " |"


def _header(meta: dict) -> list[str]:
    """The machine, the command and the prompts of a run: the first lines of every report."""
    L = [f"Machine: {meta['machine']['cpu']}, {meta['machine']['usable_cores']} usable cores; load average at start "
         f"{', '.join(f'{x:.2f}' for x in meta['machine']['load_avg_start'])}, at end "
         f"{', '.join(f'{x:.2f}' for x in meta.get('load_avg_end', []))}; commit `{meta['machine']['git_commit']}`"
         f"{' (+ uncommitted changes)' if meta['machine'].get('git_dirty') else ''}; "
         f"torch {meta['machine']['torch']}, transformers {meta['machine']['transformers']}; "
         f"{meta['machine']['date_utc']} UTC; run took {meta.get('elapsed_s', 0) / 60:.1f} min.",
         "",
         f"Command: `{meta['command']}`",
         "",
         f"Prompts: {meta['prompts']}; {meta['max_new_tokens']} new tokens; {meta['repeats']} repeat(s); medians "
         f"over requests, speedups are medians of paired per-request ratios (same prompt, same round).", ""]
    for n in meta.get("notes", []):
        L += [f"- Note: {n}"]
    if meta.get("notes"):
        L.append("")
    return L


def markdown(rows: list[dict], goals: list[dict], meta: dict) -> str:
    L = _header(meta)
    if goals:
        L += ["### Acceptance goals (greedy, all prompt sets)", "", "| goal | want | measured | met |",
              "|---|---|---|---|"]
        for g in goals:
            want = f"≤ {g['want']:.0%}" if "slowdown" in g["goal"] else f"≥ {g['want']:.2f}×"
            meas = (_f(g["measured"], "{:+.1%}") if "slowdown" in g["goal"] else _f(g["measured"], "{:.2f}×"))
            L.append(f"| {g['goal']} | {want} | {meas} | {'n/a' if g['met'] is None else ('yes' if g['met'] else 'NO')} |")
        L.append("")
    single = [r for r in rows if not r.get("sweep")]
    temps = sorted({r["temperature"] for r in single})
    sets = list(dict.fromkeys(r["prompt_set"] for r in single))
    for t in temps:
        for s in sets:
            sel = [r for r in single if r["temperature"] == t and r["prompt_set"] == s]
            if not sel:
                continue
            L += [f"### {'greedy' if t == 0 else f'temperature {t:g}'}, prompt set: {s}", "",
                  "| " + " | ".join(MAIN_COLS) + " |", "|" + "---|" * len(MAIN_COLS)]
            L += [_main_row(r) for r in sel]
            L.append("")
    conc = [r for r in rows if r.get("sweep")]
    if conc:
        L += [f"### Concurrency sweep ({conc[0]['mode']} through the stack, greedy)", "",
              "| simultaneous requests | aggregate tok/s | × 1 request | per-request tok/s | p50 latency s | "
              "p99 latency s | × ar (2t) |", "|---|---|---|---|---|---|---|"]
        base = conc[0]["tokens_per_s"]
        for r in conc:
            L.append(f"| {r['concurrency']} | {_f(r['tokens_per_s'], '{:.1f}')} | "
                     f"{_f(r['tokens_per_s'] / base if base else None)} | {_f(r['per_request_tokens_per_s'], '{:.1f}')}"
                     f" | {_f(r['latency_p50_s'])} | {_f(r['latency_p99_s'])} | {_f(r['speedup_vs_ar'])} |")
        L.append("")
    L += ["Columns: tok/s = generated tokens / wall time per request (client side for the stack); accepted len = "
          "generated tokens per target forward (counts the bonus/recovered token); wasted draft/req = drafted "
          "tokens never verified or discarded (median per request); overlap eff. = target busy time / wall time; "
          "network share = (time in replica calls − compute the replicas report) / wall time; stack slowdown = "
          "1 − (stack tok/s ÷ the same schedule in one process), paired per request; output = ar: share of greedy "
          "requests whose tokens equal ar (2 threads) exactly (lossless check).", ""]
    return "\n".join(L)


NETWORK_COLS = ("data plane", "RTT ms", "config", "tok/s", "TTFT ms", "rounds", "ms/round", "accepted len",
                "wait c↔d", "wait c↔t", "wait d↔t", "kept", "× sd", "× ar", "output = ar")


def network_markdown(rows: list[dict], meta: dict) -> str:
    """The network sweep's report (specdec_bench/network.py): the run's header and one table per temperature."""
    L = _header(meta)
    t_ms = meta.get("target_forward_ms")
    if t_ms:
        L += [f"T (one-row target forward on this host, 1 thread, median) = {t_ms:.2f} ms; RTT in units of T in "
              f"brackets.", ""]
    for temp in sorted({r["temperature"] for r in rows}):
        sel = [r for r in rows if r["temperature"] == temp]
        L += [f"### Network: a round trip on every link ({'greedy' if temp == 0 else f'temperature {temp:g}'})", "",
              "| " + " | ".join(NETWORK_COLS) + " |", "|" + "---|" * len(NETWORK_COLS)]
        for r in sel:
            rtt = f"{r['rtt_ms']:g}" if r.get("rtt_t") is None else f"{r['rtt_ms']:.1f} ({r['rtt_t']:g}T)"
            cells = [r["data_plane"], rtt, r["config"], _f(r["tokens_per_s"], "{:.1f}"), _f(r.get("ttft_ms"), "{:.1f}"),
                     _f(r.get("rounds"), "{:.0f}"), _f(r.get("wall_ms_per_round"), "{:.1f}"),
                     _f(r.get("mean_accepted_length")), _f(r.get("draft_link_share"), "{:.0%}"),
                     _f(r.get("target_link_share"), "{:.0%}"), _f(r.get("peer_link_share"), "{:.0%}"),
                     _f(r.get("kept")), _f(r.get("vs_best_sd")), _f(r.get("vs_ar")),
                     _f(r.get("greedy_match_ar"), "{:.0%}")]
            L.append("| " + " | ".join(cells) + " |")
        L.append("")
    L += ["Columns: each link delays every byte by RTT/2 each way (a delay relay per link, specdec_rpc/netem.py); "
          "tok/s = generated tokens / wall time per request (client side, streamed), median; TTFT = time to the "
          "first streamed token, median; rounds = the schedule's rounds per request, median; ms/round = wall time / "
          "rounds, median; accepted len = generated tokens per target forward; wait c↔d, c↔t, d↔t = the share of "
          "wall time in the network of the coordinator ↔ draft, coordinator ↔ target and draft ↔ target links (the "
          "last: the direct data plane), median; kept = tok/s ÷ the same configuration's at RTT 0; × sd = ÷ the best "
          "fixed-γ sd at the same RTT; × ar = ÷ ar at the same RTT (all three: medians of paired per-request "
          "ratios); output = ar: share of greedy requests whose tokens equal ar's at the same RTT exactly.", ""]
    return "\n".join(L)


BEGIN = "<!-- specdec bench: generated tables begin -->"
END = "<!-- specdec bench: generated tables end -->"
NETWORK_BEGIN = "<!-- specdec bench: network tables begin -->"
NETWORK_END = "<!-- specdec bench: network tables end -->"


def markdown_target_error(path: str | Path, network: bool) -> str:
    """Why the report cannot go to `path` ('' if it can): a page with the main suite's markers but not the network
    sweep's must not lose its tables to a network report (checked before a run, so none is lost)."""
    path = Path(path)
    if not network or not path.is_file():
        return ""
    text = path.read_text()
    if (BEGIN in text or END in text) and not (NETWORK_BEGIN in text and NETWORK_END in text):
        return (f"{path} holds the main suite's tables: add the lines {NETWORK_BEGIN} and {NETWORK_END} where the "
                f"network tables go, or write them to another file")
    return ""


def write_markdown(path: str | Path, md: str, network: bool = False) -> None:
    """Write the tables to `path`. A file that holds the BEGIN and END markers (docs/benchmarks.md; the network
    sweep's: NETWORK_BEGIN and NETWORK_END) keeps what lies outside them, and the tables replace what lies between;
    any other file is overwritten."""
    begin, end = (NETWORK_BEGIN, NETWORK_END) if network else (BEGIN, END)
    path = Path(path)
    old = path.read_text() if path.exists() else ""
    i, j = old.find(begin), old.find(end)
    if 0 <= i < j:
        text = old[:i + len(begin)] + "\n\n" + md.strip("\n") + "\n\n" + old[j:]
    else:
        text = md + "\n"
    path.write_text(text)


def plot(rows: list[dict], path: str | Path, title: str = "") -> None:
    import matplotlib  # lazy: matplotlib is a dev extra, needed only for --plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    single = [r for r in rows if not r.get("sweep") and r["prompt_set"] == "all"] or \
        [r for r in rows if not r.get("sweep")]
    configs = list(dict.fromkeys(r["config"] for r in single))
    temps = sorted({r["temperature"] for r in single})
    conc = [r for r in rows if r.get("sweep")]
    fig, axes = plt.subplots(1, 2 if conc else 1, figsize=(14 if conc else 10, 6),
                             gridspec_kw={"width_ratios": [3, 1]} if conc else None)
    ax = axes[0] if conc else axes
    w = 0.8 / max(1, len(temps))
    for i, t in enumerate(temps):
        vals = []
        for c in configs:
            r = next((x for x in single if x["config"] == c and x["temperature"] == t), None)
            vals.append((r and r["speedup_vs_ar"]) or 0.0)
        ax.barh([k + i * w for k in range(len(configs))], vals, height=w,
                label="greedy" if t == 0 else f"T={t:g}")
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_yticks([k + w * (len(temps) - 1) / 2 for k in range(len(configs))], configs, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("speedup vs ar (2 threads), median of paired ratios")
    ax.legend()
    ax.set_title(title or "specdec bench")
    if conc:
        ax2 = axes[1]
        ax2.plot([r["concurrency"] for r in conc], [r["tokens_per_s"] for r in conc], "o-")
        ax2.set_xscale("log", base=2)
        ax2.set_xlabel("simultaneous requests")
        ax2.set_ylabel("aggregate tokens/s")
        ax2.set_title(f"{conc[0]['mode']} (stack)")
    fig.tight_layout()
    fig.savefig(str(path), dpi=110)
    plt.close(fig)
