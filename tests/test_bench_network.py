"""The benchmark's network sweep (`specdec bench --rtt-ms`) end to end on tiny random models: the embedded stack at
round trips 0 and 20 ms (a delay relay on every link), ar and sd, the report's network rows and tables."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.helpers_models import save_tiny_pair

ROOT = Path(__file__).resolve().parents[1]
NETWORK_KEYS = {"section", "config", "mode", "data_plane", "rtt_ms", "temperature", "n", "tokens_per_s", "ttft_ms",
                "rounds", "wall_ms_per_round", "mean_accepted_length", "draft_link_share", "target_link_share",
                "peer_link_share", "kept", "vs_best_sd", "vs_ar", "greedy_match_ar"}


def test_network_sweep_end_to_end(tmp_path):
    tdir, ddir = save_tiny_pair(tmp_path)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "hello there, how are you"}) + "\n"
                       + json.dumps({"prompt": "tell me a story"}) + "\n")
    out = tmp_path / "net"
    cmd = [sys.executable, "-m", "specdec_bench", "--target-model", str(tdir), "--draft-model", str(ddir),
           "--prompts", str(prompts), "--modes", "ar", "sd", "--gammas", "2", "--temperatures", "0",
           "--max-new-tokens", "8", "--repeats", "1", "--no-ray", "--no-progress", "--rtt-ms", "0,20",
           "--json", f"{out}.json", "--markdown", f"{out}.md"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = json.loads(Path(f"{out}.json").read_text())
    assert {(r["config"], r["rtt_ms"]) for r in rows} == {(c, rtt) for c in ("ar (stack)", "sd g=2 (stack)")
                                                        for rtt in (0.0, 20.0)}
    for r in rows:
        assert NETWORK_KEYS <= set(r), NETWORK_KEYS - set(r)
        assert r["section"] == "network" and r["data_plane"] == "coordinator" and r["n"] == 2
        assert r["tokens_per_s"] > 0 and r["ttft_ms"] > 0 and r["rounds"] >= 1
        assert r["greedy_match_ar"] == 1.0, r["config"]  # lossless at every round trip
    by = {(r["config"], r["rtt_ms"]): r for r in rows}
    ar0, ar20, sd20 = by["ar (stack)", 0.0], by["ar (stack)", 20.0], by["sd g=2 (stack)", 20.0]
    assert ar0["kept"] == 1.0 and ar20["kept"] <= 1.05  # ar pays a round trip per token
    assert ar20["vs_ar"] == 1.0 and sd20["vs_best_sd"] == 1.0 and sd20["vs_ar"] > 0
    assert ar20["wall_ms_per_round"] >= 20  # every round crosses the coordinator -> target link
    assert ar20["target_link_share"] > ar0["target_link_share"] and sd20["draft_link_share"] > 0
    md = Path(f"{out}.md").read_text()
    assert "### Network" in md and "| data plane | RTT ms |" in md and "Command:" in md


def test_network_flags_are_checked_before_the_run(tmp_path):
    def run(*flags):
        return subprocess.run([sys.executable, "-m", "specdec_bench", *flags], capture_output=True, text=True,
                              timeout=60, cwd=ROOT)

    assert "one way" in run("--rtt-ms", "0,10", "--rtt-t", "1").stderr
    assert "0 or more" in run("--rtt-ms", "0,-5").stderr
    assert "use coordinator, direct" in run("--rtt-ms", "0", "--data-plane", "sideways").stderr
    assert "--rtt-ms or --rtt-t" in run("--data-plane", "direct").stderr
    page = tmp_path / "benchmarks.md"
    page.write_text("<!-- specdec bench: generated tables begin -->\n<!-- specdec bench: generated tables end -->\n")
    assert "network tables begin" in run("--rtt-ms", "0", "--markdown", str(page)).stderr
