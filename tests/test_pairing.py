"""A draft and a target are a pair when their tokenizers map the same strings to the same ids (specdec/text/pairing.py),
not when their vocabularies have the same size. Checked both ways: in process (`check_pair`, `Engine`) and by the
coordinator's pools from the replicas' tokenizer fingerprints, where a draft of another tokenizer is refused with an
ERROR naming both models and requests that need it fail FAILED_PRECONDITION instead of going target-only."""
from __future__ import annotations

import json
import logging

import grpc
import pytest

from coordinator.routing.discovery import StaticSource
from coordinator.routing.pool import DraftPairError, PoolManager
from specdec.decoding.sampling import SamplingParams
from specdec.engine import Engine
from specdec.scheduling.request import GenerationRequest
from specdec.text.pairing import PairError, TokenizerFingerprint, TokenizerVocab, check_pair, pair_error
from specdec_rpc.pb import generation_pb2 as g, generation_pb2_grpc as gg
from tests.helpers_models import (TOKENIZER_CHARS, build_tiny_model, start_coordinator, start_replica,
                                  target_greedy, tiny_tokenizer)

OTHER_CHARS = TOKENIZER_CHARS[0] + TOKENIZER_CHARS[1:][::-1]  # the same 32 symbols, other ids: another tokenizer


def save_tokenizer(path, chars: str = TOKENIZER_CHARS, eos: str | None = ".", bos: str | None = None):
    """A model directory's tokenizer files: the character-level tokenizer over `chars`, `eos` its eos token (and
    `bos` its bos token)."""
    path.mkdir(parents=True, exist_ok=True)
    tiny_tokenizer(chars).save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>"}
    if eos is not None:
        config["eos_token"] = eos
    if bos is not None:
        config["bos_token"] = bos
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


# ---------------------------------------------------------------- in process: two tokenizers side by side

def test_the_same_tokenizer_is_a_pair(tmp_path):
    t, d = save_tokenizer(tmp_path / "target"), save_tokenizer(tmp_path / "draft")
    check_pair(d, t)
    assert pair_error(d, t) == ""
    assert TokenizerVocab.from_dir(d).fingerprint() == TokenizerVocab.from_dir(t).fingerprint()


def test_a_draft_tokenizer_that_is_a_prefix_of_the_targets_is_a_pair(tmp_path):
    """Compared on the ids both have: a tokenizer with tokens appended past the other's last id still agrees."""
    t = save_tokenizer(tmp_path / "target", TOKENIZER_CHARS + "0123")
    d = save_tokenizer(tmp_path / "draft")
    check_pair(d, t)
    check_pair(t, d)


def test_another_tokenizer_of_the_same_size_is_refused_in_one_line_naming_both(tmp_path):
    t = save_tokenizer(tmp_path / "smol-target")
    d = save_tokenizer(tmp_path / "other-draft", OTHER_CHARS)
    assert len(TokenizerVocab.from_dir(t)) == len(TokenizerVocab.from_dir(d)) == 32  # the sizes cannot tell
    with pytest.raises(PairError) as e:
        check_pair(d, t)
    msg = str(e.value)
    assert "\n" not in msg
    assert str(d) in msg and str(t) in msg
    assert "id 1 is '?' in the draft's tokenizer and 'a' in the target's" in msg


def test_the_same_vocabulary_with_another_bos_is_refused_another_eos_is_not(tmp_path):
    """A base draft and an instruct target of one tokenizer name different eos tokens (Llama 3.2 1B and Llama 3.1
    8B Instruct): a pair. A prompt's bos must be the same id on both sides."""
    t, d = save_tokenizer(tmp_path / "target", eos="."), save_tokenizer(tmp_path / "draft", eos="!")
    check_pair(d, t, "draft-x", "target-y")
    t, d = save_tokenizer(tmp_path / "target-b", bos="."), save_tokenizer(tmp_path / "draft-b", bos="!")
    with pytest.raises(PairError, match=r"bos is id 30 in the draft's tokenizer and 28 in the target's"):
        check_pair(d, t, "draft-x", "target-y")
    check_pair(save_tokenizer(tmp_path / "no-bos", bos=None), t)  # a special only one side defines: not compared


def test_a_loaded_tokenizer_compares_like_its_directory(tmp_path):
    from transformers import AutoTokenizer

    t = save_tokenizer(tmp_path / "target")
    loaded = AutoTokenizer.from_pretrained(str(t))
    assert TokenizerVocab.of(loaded).fingerprint() == TokenizerVocab.of(t).fingerprint()
    with pytest.raises(PairError):
        check_pair(save_tokenizer(tmp_path / "draft", OTHER_CHARS), loaded)


def test_fingerprints_round_trip_and_a_prefix_names_the_full_size(tmp_path):
    v = TokenizerVocab.from_dir(save_tokenizer(tmp_path / "t", TOKENIZER_CHARS + "0123"))
    full, head = v.fingerprint(), v.fingerprint(32)
    assert TokenizerFingerprint.parse(str(full)) == full and TokenizerFingerprint.parse(str(head)) == head
    assert (full.size, head.size, head.tokens) == (36, 32, 36)
    assert head.digest == TokenizerVocab.from_dir(save_tokenizer(tmp_path / "d")).fingerprint().digest
    assert TokenizerFingerprint.parse("") is None and TokenizerFingerprint.parse("tokfp9 n=1") is None


def _model(root, name, chars=TOKENIZER_CHARS, vocab=32, seed=1):
    m = build_tiny_model(vocab_size=vocab, seed=seed, hidden_size=16 if seed == 2 else 32,
                         num_layers=1 if seed == 2 else 2)
    m.source_dir = save_tokenizer(root / name, chars)  # as load_model_dir sets it
    return m


def test_engine_accepts_a_draft_of_the_same_tokenizer_with_fewer_rows(tmp_path):
    target = _model(tmp_path, "target", vocab=40)
    draft = _model(tmp_path, "draft", vocab=32, seed=2)  # fewer rows, the same tokenizer (specdec/text/vocab.py)
    eng = Engine(target, draft, inline=True)
    try:
        res = eng.generate(GenerationRequest([3, 5, 7], 8, params=SamplingParams(temperature=0.0), mode="sd"))
    finally:
        eng.close()
    assert res.token_ids == target_greedy(target, [3, 5, 7], 8)


def test_engine_refuses_a_draft_of_another_tokenizer_at_start(tmp_path):
    target = _model(tmp_path, "target")
    draft = _model(tmp_path, "draft", OTHER_CHARS, seed=2)
    with pytest.raises(PairError, match=r"^draft .*draft and target .*target do not share a tokenizer: id 1"):
        Engine(target, draft)


# ---------------------------------------------------------------- the coordinator's pools: fingerprints

def _fp(chars=TOKENIZER_CHARS, eos=".", prefix=None, tmp=None):
    return str(TokenizerVocab.from_dir(save_tokenizer(tmp, chars, eos)).fingerprint(prefix))


def _pool(infos: dict, prefixes: dict | None = None) -> PoolManager:
    """A draft pool D and a target pool T whose GetInfo answers `infos[kind]` (a ReplicaInfo tuple)."""
    async def health(endpoint, service):
        return True, ""

    async def capacity(kind, endpoint):
        return infos[kind]

    async def prefix(kind, endpoint, n):
        return prefixes[kind, n]

    return PoolManager({"draft": StaticSource(["D:1"]), "target": StaticSource(["T:1"])}, refresh_s=60,
                       health_check=health, capacity_check=capacity, prefix_check=prefix)


async def test_the_pool_refuses_a_draft_of_another_tokenizer_and_says_so(tmp_path, caplog):
    caplog.set_level(logging.ERROR, logger="coordinator.routing.pool")
    target = _fp(tmp=tmp_path / "t")
    draft = _fp(OTHER_CHARS, tmp=tmp_path / "d")
    pm = _pool({"draft": (4, 256, 32, "other-draft", draft), "target": (4, 256, 32, "smol-target", target)})
    await pm.refresh()
    assert pm.members() == {"draft": [], "target": ["T:1"]}
    (line,) = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert "draft other-draft and target smol-target do not share a tokenizer" in line and "\n" not in line
    with pytest.raises(DraftPairError, match="other-draft and target smol-target"):
        await pm.acquire("draft")
    await pm.refresh()  # it stays refused, and is logged once
    assert pm.members()["draft"] == [] and len([r for r in caplog.records if r.levelno == logging.ERROR]) == 1


async def test_the_pool_compares_tokenizers_of_different_sizes_on_the_ids_both_have(tmp_path):
    long = TokenizerVocab.from_dir(save_tokenizer(tmp_path / "t", TOKENIZER_CHARS + "0123"))
    draft = _fp(tmp=tmp_path / "d")
    pm = _pool({"draft": (4, 256, 32, "draft", draft), "target": (4, 256, 40, "target", str(long.fingerprint()))},
               {("target", 32): str(long.fingerprint(32))})
    await pm.refresh()
    assert pm.members() == {"draft": ["D:1"], "target": ["T:1"]}
    assert await pm.acquire("draft") == "D:1"


async def test_a_draft_without_a_tokenizer_is_not_compared(tmp_path):
    pm = _pool({"draft": (4, 256, 32, "draft", ""), "target": (4, 256, 32, "target", _fp(tmp=tmp_path / "t"))})
    await pm.refresh()
    assert pm.members()["draft"] == ["D:1"]


# ---------------------------------------------------------------- end to end: replicas report fingerprints

async def test_served_stack_refuses_the_mismatched_draft_and_fails_speculative_requests(tmp_path, caplog):
    """Real replicas (their GetInfo reports the fingerprint) behind a coordinator: the draft of another tokenizer of
    the same size gets no request; a speculative request fails FAILED_PRECONDITION naming both models (no silent
    target-only run); an `ar` request is served."""
    caplog.set_level(logging.ERROR, logger="coordinator.routing.pool")
    target = _model(tmp_path, "target")
    draft = _model(tmp_path, "draft", OTHER_CHARS, seed=2)
    rt = await start_replica("target", target)
    rd = await start_replica("draft", draft)
    coord = await start_coordinator(rt.endpoint, rd.endpoint)
    try:
        assert rd.host.info.tokenizer_fingerprint.startswith("tokfp1 n=32 ")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{coord.port}") as ch:
            stub = gg.GenerationServiceStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Generate(g.GenerateRequest(prompt_token_ids=[3, 5, 7], mode="sd", max_new_tokens=4))
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            names = f"draft {rd.host.info.model} and target {rt.host.info.model} do not share a tokenizer"
            assert names in e.value.details()
            ar = await stub.Generate(g.GenerateRequest(prompt_token_ids=[3, 5, 7], mode="ar", max_new_tokens=4))
            assert list(ar.token_ids) == target_greedy(target, [3, 5, 7], 4)
    finally:
        await coord.shutdown(0)
        await rd.shutdown(0)
        await rt.shutdown(0)
    assert any("do not share a tokenizer" in r.getMessage() for r in caplog.records)


async def test_served_stack_pairs_a_draft_with_fewer_rows_and_a_shorter_tokenizer(tmp_path):
    """The same tokenizer less its last tokens, a model with fewer rows: the pool asks the target for the
    fingerprint of the ids both have (GetInfo's tokenizer_prefix) and serves speculative requests."""
    target = _model(tmp_path, "target", TOKENIZER_CHARS + "0123", vocab=40)
    draft = _model(tmp_path, "draft", seed=2)
    rt = await start_replica("target", target)
    rd = await start_replica("draft", draft, target_vocab_size=40)
    coord = await start_coordinator(rt.endpoint, rd.endpoint)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{coord.port}") as ch:
            res = await gg.GenerationServiceStub(ch).Generate(
                g.GenerateRequest(prompt_token_ids=[3, 5, 7], mode="sd", max_new_tokens=8))
        assert list(res.token_ids) == target_greedy(target, [3, 5, 7], 8)
        assert res.stats.mode == "sd" and not res.stats.draft_unavailable
    finally:
        await coord.shutdown(0)
        await rd.shutdown(0)
        await rt.shutdown(0)
