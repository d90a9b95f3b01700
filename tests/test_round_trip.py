"""`specdec bench --round-trip` (specdec_bench/round_trip.py): the same requests in process and through replica
processes give the same tokens on every path, and each row splits its time as the replicas report it."""
from __future__ import annotations

import asyncio
import math
import os

import pytest

from specdec_bench.round_trip import PATHS, markdown, process_tree, run_round_trip, voluntary_switches


def test_wakeups_are_counted_over_this_process_and_its_children():
    """A child that sleeps 200 times, then waits: at least 200 voluntary switches, and it is in this process's tree."""
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "import sys, time; [time.sleep(0.001) for _ in range(200)]; "
                              "print('slept', flush=True); sys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "slept"
        assert child.pid in process_tree(os.getpid())
        assert voluntary_switches([child.pid]) >= 200
    finally:
        child.stdin.close()
        child.wait(30)
    assert voluntary_switches([child.pid]) == 0  # gone: nothing to count


@pytest.mark.slow
def test_every_path_gives_the_engines_tokens_and_a_complete_row():
    rows = asyncio.run(run_round_trip(("unary", "frames", "direct"), repeats=1, max_new_tokens=12, ray=False,
                                      log=lambda m: None))
    assert [r["path"] for r in rows] == ["unary", "frames", "direct"]
    for r in rows:  # run_round_trip raises where a path's tokens or rounds differ from the engine's
        assert r["rounds_per_request"] > 0 and r["repeats"] == 1
        assert all(math.isfinite(v) for k, v in r.items() if k.endswith("_per_round"))
        assert r["stack_ms_per_round"] > 0 and r["wakeups_per_round"] > 0
        assert r["draft_busy_ms_per_round"] > 0 and r["target_busy_ms_per_round"] > 0
    assert sum(r["stack_cpu_ms_per_round"] for r in rows) > 0  # the processes' CPU time (kernel clock ticks)
    # the direct plane's round makes one call (draft replica -> target), the coordinator's two
    by = {r["path"]: r for r in rows}
    assert by["direct"]["wakeups_per_round"] < by["unary"]["wakeups_per_round"]
    assert "| direct |" in markdown(rows, {})
    with pytest.raises(ValueError, match="unknown data path"):
        asyncio.run(run_round_trip(("carrier-pigeon",)))
    assert set(PATHS) >= {"unary", "streams", "frames", "direct", "direct-spin", "default"}
