import json
import os
import pathlib
import socket
import time

import pytest

from specdec.modeling import hub
from specdec.modeling.hub import ModelNotFoundError, resolve_model
from specdec.text.tokenizer import IncrementalDetokenizer, encode_prompt, eos_token_ids, load_tokenizer


def _fake_model_dir(d: pathlib.Path) -> pathlib.Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": [2, 7]}))
    (d / "model.safetensors").write_bytes(b"")
    return d


def test_local_dir(tmp_path):
    d = _fake_model_dir(tmp_path / "m")
    assert resolve_model(str(d), progress=False) == d.resolve()


def test_local_dir_without_config(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="config.json"):
        resolve_model(str(tmp_path / "empty"), progress=False)


def test_unreachable_hub_id(runtime_settings):
    runtime_settings(hf_hub_offline=True)
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model("someorg/some-model", progress=False)
    msg = str(e.value)
    assert "\n" not in msg and "local" in msg and ".gguf" in msg
    assert "HF_HUB_OFFLINE is set" in msg and "hf download someorg/some-model" in msg


def test_huggingface_hubs_own_offline_flag_sends_nothing(monkeypatch, runtime_settings, hub_proxy):
    """HF_HUB_OFFLINE as huggingface_hub read it (TRANSFORMERS_OFFLINE sets it too): no request, even through a
    proxy."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    runtime_settings(hf_hub_offline=False, hf_endpoint="http://hub.specdec.invalid")
    with pytest.raises(ModelNotFoundError, match="HF_HUB_OFFLINE is set"):
        resolve_model("someorg/some-model", progress=False)
    assert hub_proxy.seen == []


def test_hub_unreachable_by_network(runtime_settings):
    runtime_settings(hf_hub_offline=False, hf_endpoint="http://127.0.0.1:9")  # discard port: connection refused
    t0 = time.monotonic()
    with pytest.raises(ModelNotFoundError, match="not reachable at http://127.0.0.1:9") as e:
        resolve_model("someorg/some-model", progress=False)
    assert time.monotonic() - t0 < 5 and "\n" not in str(e.value) and "HTTPS_PROXY" in str(e.value)


def test_a_hub_that_does_not_answer_fails_within_the_etag_timeout(monkeypatch, runtime_settings):
    """A hub that takes the connection and never answers (a black-holing firewall, a stuck proxy) fails after
    HF_HUB_ETAG_TIMEOUT, not after the client's unbounded wait."""
    from huggingface_hub import constants

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # the kernel completes the handshake; nothing ever reads or answers
    try:
        monkeypatch.setattr(constants, "HF_HUB_ETAG_TIMEOUT", 0.5)
        runtime_settings(hf_hub_offline=False, hf_endpoint=f"http://127.0.0.1:{silent.getsockname()[1]}")
        t0 = time.monotonic()
        with pytest.raises(ModelNotFoundError, match="not reachable .*Timeout"):
            resolve_model("someorg/some-model", progress=False)
        assert time.monotonic() - t0 < 5
    finally:
        silent.close()


class _HubProxy:
    """An HTTP proxy in a thread that answers every request itself, as a hub would: `answer(path)` -> (status,
    JSON body, headers); `seen`: the request lines it got."""

    def __init__(self):
        import http.server
        import threading

        proxy = self
        self.seen: list[str] = []
        self.answer = lambda path: (404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                proxy.seen.append(self.requestline)
                status, body, headers = proxy.answer(self.path)
                data = json.dumps(body).encode()
                self.send_response(status)
                for k, v in {"Content-Type": "application/json", "Content-Length": str(len(data)),
                             **headers}.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}"


@pytest.fixture
def hub_proxy(monkeypatch):
    """HTTP_PROXY set to a `_HubProxy` for huggingface_hub's client (which reads the proxy variables when it is
    made: it is made again before and after the test)."""
    from huggingface_hub import close_session

    proxy = _HubProxy()
    for name in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy", "NO_PROXY",
                 "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTP_PROXY", proxy.url)
    close_session()
    yield proxy
    monkeypatch.delenv("HTTP_PROXY")
    close_session()
    proxy.server.shutdown()
    proxy.server.server_close()


def test_the_hub_is_asked_through_the_proxy(tmp_path, monkeypatch, runtime_settings, hub_proxy):
    """HF_ENDPOINT's host does not resolve here: only the proxy reaches it. Its answers are the hub's: no such model
    is said so; a model's commit is what is downloaded."""
    import huggingface_hub

    runtime_settings(hf_hub_offline=False, hf_endpoint="http://hub.specdec.invalid")
    with pytest.raises(ModelNotFoundError, match="http://hub.specdec.invalid has no such model") as e:
        resolve_model("someorg/missing", progress=False)
    assert "\n" not in str(e.value)
    assert hub_proxy.seen == ["GET http://hub.specdec.invalid/api/models/someorg/missing HTTP/1.1"]

    sha = "b" * 40
    hub_proxy.answer = lambda path: (200, {"id": "someorg/model", "sha": sha, "siblings": []}, {})
    downloads = []

    def fake_download(repo_id, allow_patterns, local_files_only=False, **kw):
        if local_files_only:
            raise FileNotFoundError(repo_id)  # a cold cache
        downloads.append((repo_id, kw))
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    assert resolve_model("someorg/model", progress=False) == tmp_path
    assert downloads == [("someorg/model", {"revision": sha, "endpoint": "http://hub.specdec.invalid"})]

    hub_proxy.answer = lambda path: (403, {"error": "gated"}, {"X-Error-Code": "GatedRepo"})
    with pytest.raises(ModelNotFoundError, match="gated on http://hub.specdec.invalid: accept its terms"):
        resolve_model("someorg/gated", progress=False)


def test_a_hub_id_in_the_local_cache_needs_no_hub(tmp_path, monkeypatch, runtime_settings):
    """A pod whose init container filled the cache starts with the hub unreachable, or HF_HUB_OFFLINE set (it
    failed "not reachable" before, whatever the cache held)."""
    from huggingface_hub import constants

    repo = tmp_path / "models--someorg--cached-model"
    snap = repo / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    runtime_settings(hf_endpoint="http://127.0.0.1:9")  # discard port: connection refused
    assert resolve_model("someorg/cached-model", progress=False) == snap
    with pytest.raises(ModelNotFoundError, match="not in the local Hugging Face cache"):
        resolve_model("someorg/other-model", progress=False)


def test_a_hub_tokenizer_is_fetched_without_the_weights(tmp_path, monkeypatch):
    """The coordinator needs a hub target's tokenizer, not its weights (16 GB for Llama-3.1-8B)."""
    import huggingface_hub

    asked = []

    def fake_download(repo_id, allow_patterns, local_files_only=False, revision=None, endpoint=None):
        asked.append((tuple(allow_patterns), local_files_only))
        if local_files_only:
            raise FileNotFoundError(repo_id)  # a cold cache
        (tmp_path / "config.json").write_text("{}")
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    monkeypatch.setattr(hub, "_hub_revision", lambda spec: "a" * 40)
    assert hub.resolve_tokenizer("someorg/big-model") == tmp_path
    assert all("*.safetensors" not in patterns for patterns, _ in asked) and asked[-1][1] is False
    asked.clear()
    assert resolve_model("someorg/big-model", progress=False) == tmp_path
    assert "*.safetensors" in asked[-1][0]


def test_missing_path():
    with pytest.raises(ModelNotFoundError):
        resolve_model("./does/not/exist.gguf", progress=False)


def test_gguf_cache_key_and_atomicity(tmp_path, monkeypatch, runtime_settings):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # read by platformdirs
    runtime_settings(cache=None)
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"not really a gguf")
    calls = []

    def boom(src, out):
        calls.append(src)
        (pathlib.Path(out) / "partial.bin").write_bytes(b"x")
        raise KeyboardInterrupt  # simulated interruption mid-conversion

    monkeypatch.setattr(hub, "convert_gguf", boom)
    with pytest.raises(KeyboardInterrupt):
        resolve_model(str(gguf), progress=False)
    root = hub.cache_root()
    assert str(root).startswith(str(tmp_path / "xdg"))
    # nothing half-written is left behind
    assert not any(p.name.endswith("partial.bin") for p in root.rglob("*"))
    assert not any((root / "gguf").iterdir())

    def ok(src, out):
        calls.append(src)
        _fake_model_dir(pathlib.Path(out))

    monkeypatch.setattr(hub, "convert_gguf", ok)
    d = resolve_model(str(gguf), progress=False)
    assert (d / "config.json").is_file() and (d / hub.MARKER).is_file()
    assert d.name == hub.sha256_file(gguf)[:32]
    n = len(calls)
    assert resolve_model(str(gguf), progress=False) == d  # cached: no second conversion
    assert len(calls) == n
    # same bytes under another name share the cache entry
    other = tmp_path / "copy.gguf"
    other.write_bytes(gguf.read_bytes())
    assert resolve_model(str(other), progress=False) == d and len(calls) == n


def test_incomplete_cache_is_rebuilt(tmp_path, monkeypatch, runtime_settings):
    runtime_settings(cache=tmp_path / "c")
    gguf = tmp_path / "a.gguf"
    gguf.write_bytes(b"abc")
    stale = tmp_path / "c" / "gguf" / hub.sha256_file(gguf)[:32]
    _fake_model_dir(stale)  # no marker: must not be trusted
    monkeypatch.setattr(hub, "convert_gguf", lambda s, o: _fake_model_dir(pathlib.Path(o)))
    d = resolve_model(str(gguf), progress=False)
    assert d == stale and (d / hub.MARKER).is_file()


# ---------------------------------------------------------------- tokenizer


@pytest.fixture(scope="module")
def byte_bpe(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["hello world", "héllo wörld ünïcode", "日本語のテキスト", "emoji 🙂 and 🚀 rockets", "plain ascii text"] * 5
    t.train_from_iterator(corpus, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=t, eos_token="</s>", bos_token="<s>", unk_token="<unk>")
    d = tmp_path_factory.mktemp("tok")
    tok.save_pretrained(str(d))
    return d


def test_load_tokenizer_none(tmp_path):
    assert load_tokenizer(_fake_model_dir(tmp_path / "m")) is None


def test_detokenizer_multibyte(byte_bpe):
    tok = load_tokenizer(byte_bpe)
    text = "héllo 日本語 🙂 rockets 🚀!"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    # a byte-level tokenizer with few merges splits multi-byte characters across tokens
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    det = IncrementalDetokenizer(tok)
    pieces = [det.push(i) for i in ids]
    pieces.append(det.flush())
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text
    # pushing several tokens at once gives the same text
    det2 = IncrementalDetokenizer(tok)
    assert det2.push(ids[:5]) + det2.push(ids[5:]) + det2.flush() == text


def test_encode_prompt_and_eos(byte_bpe, tmp_path):
    tok = load_tokenizer(byte_bpe)
    assert encode_prompt(tok, prompt="hello world") == tok("hello world")["input_ids"]
    with pytest.raises(ValueError):
        encode_prompt(tok, messages=[{"role": "user", "content": "hi"}])  # no chat template
    tok.chat_template = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}{% if add_generation_prompt %}<s>{% endif %}"
    ids = encode_prompt(tok, prompt="hello")
    assert ids == encode_prompt(tok, messages=[{"role": "user", "content": "hello"}])
    assert ids[0] == tok.convert_tokens_to_ids("<s>") and ids[-1] == tok.convert_tokens_to_ids("<s>")
    assert encode_prompt(tok, prompt="hello", raw=True) == tok("hello")["input_ids"]
    assert eos_token_ids(tok) == {tok.convert_tokens_to_ids("</s>")}
    assert eos_token_ids({"eos_token_id": [2, 7]}) == {2, 7}
    assert eos_token_ids(_fake_model_dir(tmp_path / "m")) == {2, 7}


@pytest.mark.slow
def test_default_target_if_cached():
    final = hub.cache_root() / "gguf" / hub.DEFAULT_TARGET_SHA256[:32]
    if not (final / hub.MARKER).is_file():
        pytest.skip("default target not cached")
    d = resolve_model("default-target", progress=False)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["vocab_size"], cfg["tie_word_embeddings"]) == (30, 576, 9, 3, 49152, True)
    tok = load_tokenizer(d)
    ids = encode_prompt(tok, prompt="What is the capital of France?")
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    out = m.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, len(ids):])
    assert 2 in eos_token_ids(d)


def test_a_gguf_with_rope_frequency_factors_is_refused_before_conversion(tmp_path):
    """transformers' GGUF loader drops llama.cpp's rope_freqs tensor (Llama 3.1+ RoPE scaling): converting would
    serve plain RoPE. The refusal names the tensor; a GGUF without it is not refused."""
    import numpy as np
    from gguf import GGUFWriter

    from specdec.modeling.hub import refuse_lossy_gguf

    def write(name: str, tensors: dict):
        path = tmp_path / name
        w = GGUFWriter(str(path), "llama")
        for tname, value in tensors.items():
            w.add_tensor(tname, value)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path

    emb = np.zeros((4, 8), dtype=np.float32)
    scaled = write("scaled.gguf", {"token_embd.weight": emb, "rope_freqs.weight": np.ones(4, dtype=np.float32)})
    with pytest.raises(ValueError, match=r"scaled.gguf: its RoPE frequency factors \(rope_freqs.weight"):
        refuse_lossy_gguf(scaled)
    refuse_lossy_gguf(write("plain.gguf", {"token_embd.weight": emb}))


def test_an_unresolvable_model_is_the_core_error_the_servers_map_to_not_found():
    """One ModelNotFoundError: the one hub raises is the SpecDecError the error interceptor maps to NOT_FOUND (not
    INTERNAL)."""
    import grpc

    from specdec.common import errors
    from specdec_rpc.interceptor import status_for

    with pytest.raises(errors.ModelNotFoundError) as e:
        resolve_model("/no/such/model/dir")
    assert status_for(e.value)[0] == grpc.StatusCode.NOT_FOUND
