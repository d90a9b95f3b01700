"""`specdec` CLI: --in-process, --coordinator ADDR, and the embedded stack (replicas + local Ray + coordinator)."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specdec_cli import main as cli
from tests.helpers_models import TOKENIZER_CHARS, save_tiny_pair, target_greedy, tiny_pair

PROMPT = "hello world"


def prompt_ids() -> list[int]:
    return [TOKENIZER_CHARS.index(c) for c in PROMPT]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    tdir, ddir = save_tiny_pair(tmp_path_factory.mktemp("models"))
    return str(tdir), str(ddir), target_greedy(tiny_pair()[0], prompt_ids(), 12)


def test_parser_and_stats_line():
    a = cli.parse_generate(["generate", "x", "--mode", "pacer_pearl", "--json", "--gamma", "3", "--threads", "1"])
    assert (a.mode, a.json, a.gamma, a.coordinator, a.threads, a.prompt) == ("pacer_pearl", True, 3, None, 1, "x")
    line = cli.stats_line({"mode": "pearl", "wall_s": 2.0, "draft_busy_s": 1.5, "target_busy_s": 1.5,
                           "rounds": 3, "target_forwards": 4, "mean_accepted_length": 2.5}, 10)
    assert "[pearl] 10 tokens in 2.00s" in line and "wall 67% of it" in line and "queued" not in line
    assert cli.stats_line({"mode": "sd", "wall_s": 1.0, "queued_s": 0.25}, 4).endswith("| queued 0.25s")


def test_a_structured_output_file_that_cannot_be_read_stops_generate_before_anything_starts(tmp_path, capsys,
                                                                                           monkeypatch):
    """One line naming the file, exit 1, and no model loaded nor server started; the README's example is shipped."""
    started = []
    monkeypatch.setattr(cli, "_generate_in_process", lambda args: started.append("engine"))
    monkeypatch.setattr(cli, "_generate_remote", lambda args: started.append("stack"))
    missing = tmp_path / "nope.schema.json"
    assert cli.main(["generate", "x", "--json-schema", f"@{missing}"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: @") and str(missing) in err and started == []
    root = Path(__file__).resolve().parents[1]
    assert "@docs/examples/person.schema.json" in (root / "README.md").read_text()
    schema = json.loads((root / "docs" / "examples" / "person.schema.json").read_text())
    assert schema["type"] == "object" and set(schema["required"]) <= set(schema["properties"])


def test_structured_output_flags_become_the_request_field(tmp_path):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    (tmp_path / "s.json").write_text(json.dumps(schema))
    parse = cli.parse_generate
    r = cli._request(parse(["generate", "x", "--json-schema", f"@{tmp_path / 's.json'}"]))
    assert json.loads(r.structured_output.json_schema) == schema
    assert cli._request(parse(["generate", "x", "--json-object"])).structured_output.json_object
    assert cli._request(parse(["generate", "x", "--regex", "[ab]+"])).structured_output.regex == "[ab]+"
    r = cli._request(parse(["generate", "x", "--choice", "yes", "--choice", "no"]))
    assert list(r.structured_output.choice.choices) == ["yes", "no"]
    assert cli._request(parse(["generate", "x", "--grammar", 'start: "a"'])).structured_output.grammar == 'start: "a"'
    assert not cli._request(parse(["generate", "x"])).HasField("structured_output")
    with pytest.raises(SystemExit):  # one form at a time
        parse(["generate", "x", "--regex", "a", "--json-object"])


def test_generate_in_process_json(pair, capsys):
    tdir, ddir, ref = pair
    for mode in ("ar", "sd"):
        rc = cli.main(["generate", PROMPT, "--in-process", "--mode", mode, "--target-model", tdir, "--draft-model",
                       ddir, "--max-new-tokens", "12", "--json", "--dtype", "float32"])
        assert rc == 0
        out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert out["token_ids"] == ref and out["finish_reason"] == "length"
        assert out["text"] == "".join(TOKENIZER_CHARS[i] if i else "" for i in ref)
        assert out["stats"]["mode"] == mode and "logprobs" not in out
    cli.main(["generate", PROMPT, "--in-process", "--mode", "sd", "--target-model", tdir, "--draft-model", ddir,
              "--max-new-tokens", "12", "--json", "--dtype", "float32", "--logprobs", "2"])
    lps = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["logprobs"]
    assert len(lps) == 12 and all(len(e["top"]) == 2 and e["top"][0]["logprob"] >= e["logprob"] - 1e-6 for e in lps)
    # greedy: the chosen token is the most likely one
    assert all(e["top"][0]["logprob"] == pytest.approx(e["logprob"], abs=1e-5) for e in lps)


async def test_generate_against_running_coordinator(pair):
    from coordinator.config import CoordinatorSettings
    from coordinator.server import build_coordinator
    from tests.helpers_models import start_replica

    tdir, ddir, ref = pair
    target, draft = tiny_pair()
    t, d = await start_replica("target", target), await start_replica("draft", draft)
    s = CoordinatorSettings(host="127.0.0.1", port=0, metrics_port=0, ray=False, tokenizer=tdir, grace_s=0,
                            draft_endpoints=d.endpoint, target_endpoints=t.endpoint, log_level="WARNING")
    app, _ = await build_coordinator(s)
    await app.start()
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "specdec_cli.main", "generate", PROMPT, "--coordinator", f"127.0.0.1:{app.port}",
            "--mode", "pearl", "--max-new-tokens", "12", "--json", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 120)
        assert proc.returncode == 0, err.decode()
        res = json.loads(out.decode().strip().splitlines()[-1])
        assert res["token_ids"] == ref and res["stats"]["mode"] == "pearl"
        assert set(res) == {"text", "token_ids", "finish_reason", "stats"}
        for k in ("rounds", "target_forwards", "draft_tokens", "accepted_tokens", "mean_accepted_length",
                  "draft_busy_s", "target_busy_s", "network_s", "wall_s"):
            assert k in res["stats"]
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "specdec_cli.main", "generate", PROMPT, "--coordinator", f"127.0.0.1:{app.port}",
            "--mode", "pearl", "--max-new-tokens", "12", "--json", "--logprobs", "0", stdout=subprocess.PIPE,
            stderr=subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 120)
        res = json.loads(out.decode().strip().splitlines()[-1])
        assert res["token_ids"] == ref and len(res["logprobs"]) == 12
        assert all(e["logprob"] <= 0 and e["top"] == [] for e in res["logprobs"])
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "specdec_cli.main", "generate", PROMPT, "--coordinator", f"127.0.0.1:{app.port}",
            "--mode", "sd", "--max-new-tokens", "0", stdout=subprocess.PIPE,
            stderr=subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 120)
        assert proc.returncode == 1 and "INVALID_ARGUMENT" in err.decode() and "max_new_tokens" in err.decode()
    finally:
        for a in (app, t, d):
            await a.shutdown(0)


def test_generate_embedded_stack(pair):
    """No --coordinator: replicas in subprocesses, a local Ray instance, the coordinator; then all stopped."""
    tdir, ddir, ref = pair
    p = subprocess.run([sys.executable, "-m", "specdec_cli.main", "generate", PROMPT, "--target-model", tdir,
                        "--draft-model", ddir, "--mode", "pearl", "--max-new-tokens", "12", "--dtype", "float32"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.split("\n")
    assert lines[0] == "".join(TOKENIZER_CHARS[i] if i else "" for i in ref)
    assert lines[1].startswith("[pearl] 12 tokens in "), p.stdout


def _default_pair_ready() -> bool:
    from specdec.decoding.preverifier import DEFAULT_PREVERIFIER_DIR
    from specdec.modeling.hub import DEFAULT_DRAFT_DIR

    return (DEFAULT_DRAFT_DIR / "config.json").is_file() and DEFAULT_PREVERIFIER_DIR.is_dir()


@pytest.mark.slow
@pytest.mark.skipif(not _default_pair_ready(), reason="the shipped draft / pre-verifier are not in specdec/assets")
@pytest.mark.skipif(os.environ.get("SPECDEC_TIMING_TESTS") != "1",
                    reason="a wall-clock measurement on the real pair: run with SPECDEC_TIMING_TESTS=1 on an idle machine")
def test_default_pair_pacer_pearl_overlap_is_real():
    """`make demo`'s request: draft and target really compute at the same time (wall ≤ 75% of their busy sum)."""
    p = subprocess.run([sys.executable, "-m", "specdec_cli.main", "generate",
                        "Explain how a hash map works, with an example in Python.", "--mode", "pacer_pearl",
                        "--max-new-tokens", "128", "--json"], capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    st = json.loads(p.stdout.strip().splitlines()[-1])["stats"]
    assert st["completion_tokens"] == 128, st  # the prompt runs the full length (no early EOS)
    assert st["wall_s"] <= 0.75 * (st["draft_busy_s"] + st["target_busy_s"]), st


def test_every_makefile_command_parses():
    """Each `specdec ...` line of the Makefile names subcommands and flags that exist (`--help` appended: argparse
    checks everything before it, prints help and exits 0). `make distill-draft` once called a missing subcommand."""
    import pathlib
    import shlex

    makefile = pathlib.Path(__file__).resolve().parents[1] / "Makefile"
    lines = [ln.split("bin/specdec", 1)[1] for ln in makefile.read_text().splitlines() if "bin/specdec " in ln]
    assert len(lines) >= 5
    for ln in lines:
        argv = shlex.split(ln.replace('"$(PROMPT)"', "hello"))
        with pytest.raises(SystemExit) as e:
            cli.main(argv + ["--help"])
        assert e.value.code in (0, None), ln


def test_limits_table_states_the_defaults():
    """The limits table (docs/operations/limits.md) quotes default values; they must be the settings' defaults."""
    import re
    from pathlib import Path

    from coordinator.config import CoordinatorSettings
    from draft_service.config import DraftSettings
    from target_service.config import TargetSettings

    text = (Path(__file__).resolve().parents[1] / "docs" / "operations" / "limits.md").read_text()
    table = text[text.index("## The limits"):text.index("## Status codes")]
    quoted = re.findall(r"`([a-z_]+)` \(([0-9.]+)( MiB)?", table)
    assert len(quoted) >= 10
    for name, value, mib in quoted:
        value = float(value) * (1 << 20 if mib else 1)
        owners = [c for c in (DraftSettings, TargetSettings, CoordinatorSettings) if name in c.model_fields]
        assert owners, f"the limits table names a setting that does not exist: {name}"
        defaults = {float(c.model_fields[name].default) for c in owners}
        assert value in defaults, (name, value, defaults)


def test_serve_drains_and_exits_cleanly_on_sigterm(tmp_path):
    """Kubernetes and systemd stop with SIGTERM. `specdec serve` used to install its handler before Ray's
    ray.init installed abseil's failure handler over it: SIGTERM then killed the process (or crashed the drain
    with a SIGSEGV) instead of draining."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from coordinator.stack import free_port
    from tests.helpers_models import save_tiny_pair

    tdir, ddir = save_tiny_pair(tmp_path)
    p = subprocess.Popen([sys.executable, "-m", "specdec_cli.main", "serve", "--target-model", str(tdir), "--draft-model",
                          str(ddir), "--grpc-port", str(free_port()), "--port", str(free_port()),
                          "--max-num-seqs", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        deadline = time.time() + 180
        while "serving" not in p.stdout.readline():
            assert time.time() < deadline and p.poll() is None, "specdec serve did not start"
        p.send_signal(signal.SIGTERM)
        rc = p.wait(90)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    err = p.stderr.read()
    assert rc == 0 and "draining" in err and "SIGTERM received" not in err and "SIGSEGV" not in err, err[-2000:]


def test_serve_options_come_from_the_settings_classes():
    """`specdec serve`'s defaults are the services' settings defaults; serve's own (HTTP on, threads split) are
    the ones its help names."""
    from coordinator.config import CoordinatorSettings
    from specdec_cli import serve
    from target_service.config import TargetSettings

    a = serve.build_parser().parse_args([])
    assert (a.max_sessions, a.max_context, a.grace_s, a.default_mode, a.gamma, a.verify_method) == (
        TargetSettings().max_sessions, TargetSettings().max_context, CoordinatorSettings().grace_s, "sd", 0, "block")
    p = serve.plan(a)
    assert (p.target, p.draft) == ("default-target", "default-draft")
    assert p.stack["grace_s"] == CoordinatorSettings().grace_s and p.stack["http_port"] == 8000
    assert p.stack["draft_options"]["metrics_port"] == 9401 and p.stack["target_options"]["metrics_port"] == 9402
    a = serve.build_parser().parse_args(["./some-llama", "--draft", "./small", "--target-device", "cuda:0",
                                         "--draft-device", "cuda:1", "--num-speculative-tokens", "3",
                                         "--max-model-len", "8192", "--metrics-port", "0"])
    p = serve.plan(a)
    assert (p.target, p.draft, p.stack["max_context"]) == ("./some-llama", "./small", 8192)
    assert p.stack["target_options"] == {"device": "cuda:0", "metrics_port": 0, "log_format": "text",
                                         "otlp_traces_endpoint": ""}
    assert p.stack["draft_options"]["device"] == "cuda:1"
    assert p.stack["coordinator_options"]["gamma"] == 3
    p = serve.plan(serve.build_parser().parse_args(["./some-llama"]))  # another target: no draft unless named
    assert p.draft is None and p.stack["default_mode"] == "ar"
    with pytest.raises(SystemExit):
        serve.build_parser().parse_args(["--verify-method", "both"])
    with pytest.raises(ValueError, match="--draft-device tpu: use cpu, cuda or cuda:N"):
        serve.plan(serve.build_parser().parse_args(["--draft-device", "tpu"]))
    with pytest.raises(ValueError, match="two targets"):
        serve.plan(serve.build_parser().parse_args(["a", "--target-model", "b"]))


def _free_port_run(n: int) -> int:
    """A port p with p, p+1, ..., p+n-1 all free on loopback."""
    import socket

    from coordinator.stack import free_port

    for _ in range(50):
        base = free_port()
        try:
            socks = []
            for i in range(n):
                s = socket.socket()
                socks.append(s)
                s.bind(("0.0.0.0", base + i))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no run of free ports")


def test_serve_applies_grace_sessions_and_speculation_settings(tmp_path):
    """`specdec serve TARGET --draft DRAFT` with non-default grace, sessions and speculation settings: each one
    is observed taking effect (the drain's grace, requests queued for the one session slot, requests that set no
    mode or γ running with the server's, the served model id, every process's /metrics)."""
    import signal
    import time
    import urllib.request

    import grpc

    from coordinator.stack import free_port
    from specdec_rpc.pb import generation_pb2 as g, generation_pb2_grpc as gg
    from tests.helpers_models import save_tiny_pair

    tdir, ddir = save_tiny_pair(tmp_path)
    port, http, metrics = free_port(), free_port(), _free_port_run(3)
    p = subprocess.Popen([sys.executable, "-m", "specdec_cli.main", "serve", str(tdir), "--draft", str(ddir),
                          "--grpc-port", str(port), "--port", str(http), "--metrics-port", str(metrics),
                          "--max-num-seqs", "1", "--grace-s", "7.5", "--speculative-mode", "sd",
                          "--num-speculative-tokens", "2", "--served-model-name", "tiny-llm", "--dtype", "float32",
                          "--threads", "1", "--ray-cpus", "1", "--pipelines", "1", "--log-format", "json"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.time() + 180
        while "serving" not in (line := p.stdout.readline()):
            assert time.time() < deadline and p.poll() is None, f"specdec serve did not start: {p.stderr.read()}"
        assert "model id tiny-llm" in line
        models = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{http}/v1/models", timeout=10).read())
        assert [m["id"] for m in models["data"]] == ["tiny-llm"]

        async def two_requests():
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = gg.GenerationServiceStub(ch)
                return await asyncio.gather(*(stub.Generate(g.GenerateRequest(
                    prompt_token_ids=prompt_ids() + [i + 1], max_new_tokens=48, ignore_eos=True)) for i in range(2)))

        outs = asyncio.run(two_requests())
        for out in outs:  # no mode and no gamma in the request: the server's sd with γ = 2
            st = out.stats
            assert st.mode == "sd" and st.rounds > 0 and st.rounds < st.draft_tokens <= 2 * st.rounds, st
        assert max(out.stats.queued_s for out in outs) > 0.01, "two requests ran at once in one session slot"
        for i, kind in enumerate(("coordinator", "draft", "target")):
            body = urllib.request.urlopen(f"http://127.0.0.1:{metrics + i}/metrics", timeout=10).read().decode()
            assert "specdec_" in body, kind
        p.send_signal(signal.SIGTERM)
        rc = p.wait(90)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    err = p.stderr.read()
    assert rc == 0 and "grace 7.5s" in err, err[-2000:]
    not_json = [line for line in err.splitlines() if line.strip() and not line.startswith("{")]
    assert not not_json, not_json[:10]
    lines = [json.loads(line) for line in err.splitlines() if line.strip()]  # --log-format json: every process's
    assert {line.get("service") for line in lines} >= {"coordinator", "draft", "target"}, lines[:5]
    done = [line for line in lines if line["logger"] == "coordinator.requests"]  # the driver's, under Ray
    assert sorted(d["request_id"] for d in done) == sorted(out.stats.request_id for out in outs), done
    assert all(d["timings"]["wall_s"] > 0 for d in done)


def test_serve_refuses_a_draft_of_another_tokenizer_and_a_config_it_cannot_serve_in_one_line(tmp_path, capsys):
    """Before any replica starts: a draft whose tokenizer maps ids to other strings (same vocabulary size), and a
    config.json with a RoPE type that does not exist, each end `specdec serve` with one line and exit status 1."""
    from tests.helpers_models import save_tiny_pair
    from tests.test_pairing import save_tokenizer

    tdir, ddir = save_tiny_pair(tmp_path)
    save_tokenizer(ddir, TOKENIZER_CHARS[0] + TOKENIZER_CHARS[1:][::-1])  # the same 32 symbols, other ids
    assert cli.main(["serve", str(tdir), "--draft", str(ddir), "--grpc-port", "0", "--port", "0"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(ddir) in err and str(tdir) in err and "tokenizer" in err, err

    cfg = json.loads((tdir / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "spiral", "factor": 2.0}
    (tdir / "config.json").write_text(json.dumps(cfg))
    assert cli.main(["serve", str(tdir), "--no-draft", "--grpc-port", "0", "--port", "0"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "spiral" in err and "Traceback" not in err, err
