"""`specdec serve` and `specdec generate` take the flags a vLLM user types: `--port` is the HTTP port, `--grpc-port`
the gRPC one, `--speculative-config` vLLM's JSON, `--config` a YAML of the same flags; one set of model options and
defaults for both commands; the old names still work for one release, with a warning."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from specdec_cli import main as cli
from specdec_cli import serve
from specdec_cli.options import resolve_models


def _serve(argv):
    return serve.plan(serve.parse_args(argv))


def test_port_is_http_and_grpc_port_is_grpc():
    p = _serve(["--port", "8080", "--grpc-port", "50055"])
    assert (p.stack["http_port"], p.stack["port"]) == (8080, 50055)
    p = _serve([])
    assert (p.stack["http_port"], p.stack["port"]) == (8000, 50051)
    assert _serve(["--port", "0"]).stack["http_port"] is None  # 0: no HTTP API


def test_old_flags_still_work_and_warn(capsys):
    p = _serve(["--http-port", "8081", "--max-sessions", "3", "--max-context", "1024"])
    assert (p.stack["http_port"], p.stack["max_sessions"], p.stack["max_context"]) == (8081, 3, 1024)
    err = capsys.readouterr().err
    for old, new in (("--http-port", "--port"), ("--max-sessions", "--max-num-seqs"),
                     ("--max-context", "--max-model-len")):
        assert f"warning: {old} is deprecated" in err and f"use {new}" in err, err
    _serve(["--port", "8081", "--max-num-seqs", "3"])
    assert "deprecated" not in capsys.readouterr().err


def test_speculative_config_maps_onto_our_settings():
    p = _serve(["./some-llama", "--speculative-config",
                '{"method": "draft_model", "model": "./small", "num_speculative_tokens": 3, '
                '"prompt_lookup_min": 2, "disable_by_batch_size": 6, "draft_tensor_parallel_size": 1}'])
    assert p.draft == "./small" and p.stack["default_mode"] == "sd"
    assert p.stack["coordinator_options"]["gamma"] == 3 and p.stack["coordinator_options"]["spec_off_batch"] == 6
    assert p.stack["prompt_lookup_min_ngram"] == 2
    p = _serve(["--speculative-config", '{"num_speculative_tokens": 5, "mode": "pacer"}'])
    assert p.stack["coordinator_options"]["gamma"] == 5 and p.stack["default_mode"] == "pacer"


@pytest.mark.parametrize("spec, message", [
    ('{"model": "d", "num_lookahead_slots": 2, "quantization": "fp8"}',
     "unknown keys num_lookahead_slots, quantization; known: "),
    ('{"method": "eagle3", "model": "d"}', "method 'eagle3' is not served"),
    ('{"draft_tensor_parallel_size": 2}', "draft_tensor_parallel_size 2 is not served"),
    ('{"num_speculative_tokens": "many"}', "num_speculative_tokens 'many': not a valid"),
    ('{"mode": "fast"}', "mode 'fast': choose one of ar, sd"),
    ('[3]', "must be a JSON object"),
    ('{"model": ', "not JSON"),
])
def test_a_speculative_config_we_cannot_serve_is_one_clear_error(spec, message):
    with pytest.raises(ValueError, match="--speculative-config") as e:
        _serve(["--speculative-config", spec])
    assert message in str(e.value), str(e.value)


def test_a_speculative_config_that_disagrees_with_a_flag_is_refused():
    with pytest.raises(ValueError, match="num_speculative_tokens 3 and --num-speculative-tokens 4 disagree"):
        _serve(["--num-speculative-tokens", "4", "--speculative-config", '{"num_speculative_tokens": 3}'])
    assert _serve(["--num-speculative-tokens", "3", "--speculative-config",
                   '{"num_speculative_tokens": 3}']).stack["coordinator_options"]["gamma"] == 3


def test_config_file_yaml_and_json_with_the_command_line_winning(tmp_path):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("model: ./some-llama\ndraft: ./small\nport: 8090\ngrpc_port: 50060\nmax-num-seqs: 4\n"
                   "no-draft: false\nspeculative-config: {num_speculative_tokens: 2}\n")
    p = _serve(["--config", str(cfg)])
    assert (p.target, p.draft, p.stack["http_port"], p.stack["port"], p.stack["max_sessions"]) == (
        "./some-llama", "./small", 8090, 50060, 4)
    assert p.stack["coordinator_options"]["gamma"] == 2
    p = _serve(["--config", str(cfg), "--port", "9000"])
    assert p.stack["http_port"] == 9000
    j = tmp_path / "serve.json"
    j.write_text(json.dumps({"port": 8091, "threads": 1}))
    assert _serve(["--config", str(j)]).stack["http_port"] == 8091
    (tmp_path / "bad.yaml").write_text("port: 1\nlisten: 2\ngpus: 3\n")
    with pytest.raises(ValueError, match="unknown options listen, gpus"):
        _serve(["--config", str(tmp_path / "bad.yaml")])
    with pytest.raises(FileNotFoundError, match="--config .*missing.yaml: cannot read it"):
        _serve(["--config", str(tmp_path / "missing.yaml")])


def test_generate_and_serve_share_names_defaults_and_the_pairing_rule():
    g = cli.parse_generate(["generate", "hello"])
    s = serve.parse_args([])
    for field in ("max_sessions", "max_context", "dtype", "device", "prompt_lookup_min_ngram", "ray_num_cpus"):
        assert getattr(g, field) == getattr(s, field), field
    assert g.threads == resolve_models(s).threads  # 0: the cores split between the two models, in both
    assert (g.target, g.draft, g.mode, g.prompt) == ("default-target", "default-draft", "sd", "hello")
    g = cli.parse_generate(["generate", "./some-llama", "hello there"])  # [TARGET] PROMPT, as serve's TARGET
    assert (g.target, g.draft, g.mode, g.prompt) == ("./some-llama", None, "ar", "hello there")
    assert (s2 := serve.parse_args(["./some-llama"])) and resolve_models(s2).draft is None
    with pytest.raises(ValueError, match="--mode sd needs a draft of ./some-llama"):
        cli.parse_generate(["generate", "./some-llama", "hi", "--mode", "sd"])
    g = cli.parse_generate(["generate", "hi", "--model", "./t", "--speculative-config",
                            '{"model": "./d", "num_speculative_tokens": 3}', "--max-num-seqs", "2"])
    assert (g.target, g.draft, g.gamma, g.max_sessions, g.mode) == ("./t", "./d", 3, 2, "sd")
    with pytest.raises(ValueError, match="disable_by_batch_size is a server setting"):
        cli.parse_generate(["generate", "hi", "--speculative-config", '{"disable_by_batch_size": 4}'])


def test_generate_reports_flag_errors_in_one_line(capsys):
    assert cli.main(["generate", "./some-llama", "hi", "--mode", "pearl"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "needs a draft" in err, err


def _hub_cache(root, repo: str, model_dir) -> None:
    """`repo` in a Hugging Face cache at `root`, holding the files of `model_dir`."""
    org, name = repo.split("/")
    snap = root / f"models--{org}--{name}" / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    for f in model_dir.iterdir():
        (snap / f.name).write_bytes(f.read_bytes())
    (root / f"models--{org}--{name}" / "refs").mkdir()
    (root / f"models--{org}--{name}" / "refs" / "main").write_text("a" * 40)


def test_serve_as_a_vllm_user_starts_it(tmp_path):
    """`serve org/model --port P --config FILE --speculative-config JSON` plus an old flag: the OpenAI API is on P
    under both the full and the short model id, γ from the speculative config is the requests' γ (their stats),
    the file's options take effect, and the old flag warns."""
    import grpc

    from coordinator.stack import free_port
    from specdec_rpc.pb import generation_pb2 as g, generation_pb2_grpc as gg
    from tests.helpers_models import save_tiny_pair
    from tests.test_cli import prompt_ids

    tdir, ddir = save_tiny_pair(tmp_path)
    cache = tmp_path / "hub"
    _hub_cache(cache, "org/tiny-target", tdir)
    http, grpc_port = free_port(), free_port()
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"grpc-port: {grpc_port}\ndtype: float32\nthreads: 1\nray-cpus: 1\npipelines: 1\n"
                   f"metrics-port: 0\n")
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    p = subprocess.Popen([sys.executable, "-m", "specdec_cli.main", "serve", "org/tiny-target", "--port", str(http),
                          "--config", str(cfg), "--max-sessions", "2", "--speculative-config",
                          json.dumps({"method": "draft_model", "model": str(ddir), "num_speculative_tokens": 3})],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, env=env)
    try:
        deadline = time.time() + 180
        while "serving" not in (line := p.stdout.readline()):
            assert time.time() < deadline and p.poll() is None, f"specdec serve did not start: {p.stderr.read()}"
        assert f":{http}" in line and f":{grpc_port}" in line, line
        base = f"http://127.0.0.1:{http}/v1"
        listed = json.loads(urllib.request.urlopen(f"{base}/models", timeout=10).read())
        assert [m["id"] for m in listed["data"]] == ["org/tiny-target"]
        for name in ("org/tiny-target", "tiny-target"):
            req = urllib.request.Request(f"{base}/completions", method="POST", headers={"Content-Type":
                                                                                        "application/json"},
                                         data=json.dumps({"model": name, "prompt": "abc", "max_tokens": 4,
                                                          "temperature": 0}).encode())
            body = json.loads(urllib.request.urlopen(req, timeout=60).read())
            assert body["model"] == "org/tiny-target" and body["usage"]["completion_tokens"] == 4, body

        async def one():
            async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as ch:
                return await gg.GenerationServiceStub(ch).Generate(g.GenerateRequest(
                    prompt_token_ids=prompt_ids(), max_new_tokens=48, ignore_eos=True))

        st = asyncio.run(one()).stats  # no mode, no γ in the request: the server's sd with γ = 3
        assert st.mode == "sd" and 2 * st.rounds < st.draft_tokens <= 3 * st.rounds, st
        p.send_signal(signal.SIGTERM)
        assert p.wait(90) == 0
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    err = p.stderr.read()
    assert "warning: --max-sessions is deprecated" in err and "use --max-num-seqs" in err, err[-2000:]
