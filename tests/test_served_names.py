"""The model ids the HTTP API answers to: a hub id as given and its short name both answer (as vLLM serves a model
under the id it was started with); `served_model_name` may name several, the first listed and answered with."""
from __future__ import annotations

import httpx
import pytest

from coordinator.config import CoordinatorSettings, served_names
from coordinator.server import build_coordinator
from coordinator.stack import free_port
from tests.helpers_models import start_replica, tiny_pair


def test_a_hub_id_is_served_as_given_and_by_its_short_name():
    assert served_names("meta-llama/Llama-3.1-8B-Instruct") == "meta-llama/Llama-3.1-8B-Instruct,Llama-3.1-8B-Instruct"
    assert served_names("/models/llama-8b/") == "llama-8b"  # a local directory: its name, as before
    assert served_names("./qwen.gguf") == "qwen"
    assert served_names("default-target") == "SmolLM2-135M-Instruct"
    s = CoordinatorSettings(ray=False, served_model_name=" org/m , m ,org/m")
    assert s.model_names() == ("org/m", "m") and s.model_name() == "org/m"
    assert CoordinatorSettings(ray=False, tokenizer="/x/tok-dir").model_names() == ("tok-dir",)


@pytest.mark.asyncio
async def test_every_served_name_answers_and_the_first_is_listed(tmp_path):
    from specdec.text.tokenizer import load_tokenizer
    from tests.helpers_models import save_tiny_tokenizer

    tok = load_tokenizer(save_tiny_tokenizer(tmp_path / "tok"))
    target, draft = tiny_pair()
    t, d = await start_replica("target", target), await start_replica("draft", draft)
    s = CoordinatorSettings(host="127.0.0.1", port=0, metrics_port=0, ray=False, tokenizer="", grace_s=0,
                            draft_endpoints=d.endpoint, target_endpoints=t.endpoint, log_level="WARNING",
                            http_port=free_port(), served_model_name="org/tiny-target,tiny-target")
    app, _ = await build_coordinator(s, tokenizer=tok, eos_token_ids=set())
    await app.start()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{app.http_port}", timeout=60) as c:
            listed = (await c.get("/v1/models")).json()["data"]
            assert [m["id"] for m in listed] == ["org/tiny-target"]
            for name in ("org/tiny-target", "tiny-target"):
                r = await c.post("/v1/completions", json={"model": name, "prompt": "abc", "max_tokens": 4,
                                                          "temperature": 0})
                assert r.status_code == 200 and r.json()["model"] == "org/tiny-target", r.text
                assert (await c.get(f"/v1/models/{name}")).status_code == 200
            r = await c.post("/v1/completions", json={"model": "other", "prompt": "abc", "max_tokens": 4})
            assert r.status_code == 404
            assert "'org/tiny-target' or 'tiny-target'" in r.json()["error"]["message"]
    finally:
        for a in (app, t, d):
            await a.shutdown(0)
