"""vLLM's min_p, min_tokens, allowed_token_ids and bad_words, exact under speculation: min_p is part of the one
logits→probabilities transform draft and target share (specdec/decoding/sampling.py); min_tokens masks EOS and stop
token ids in the target's rows that decide the first min_tokens output tokens, allowed_token_ids every other token in
every row, and bad_words the last token of a word whose other tokens end the row's context
(specdec/decoding/penalties.py)."""
import contextlib
import itertools
import os

import pytest
import torch

from coordinator.grpc_api.text_output import TextAssembler
from specdec.common.errors import InvalidRequestError
from specdec.decoding.preverifier import build_random_preverifier
from specdec.decoding.sampling import SamplingParams, logits_to_probs
from specdec.engine import Engine
from specdec.scheduling.field_rules import check_sampling
from specdec.scheduling.request import MODES, GenerationRequest
from tests.helpers_models import TOKENIZER_CHARS, build_tiny_model, target_greedy
from tests.table_lm import TableLM
from tests.test_exactness import PROMPT as TABLE_PROMPT, V as TABLE_V, chi_square_pvalue, run_many


def test_min_p_keeps_tokens_at_least_min_p_times_the_top_one():
    row = torch.tensor([2.0, 1.0, 0.0, -1.0, 3.0])
    for t, min_p in ((1.0, 0.2), (0.5, 0.05), (2.0, 0.6)):
        probs = logits_to_probs(row, SamplingParams(temperature=t, min_p=min_p))
        p = torch.softmax(row / t, -1)
        keep = p >= min_p * p.max()
        want = torch.where(keep, p, torch.zeros_like(p))
        torch.testing.assert_close(probs, want / want.sum())
    with pytest.raises(InvalidRequestError, match="min_p"):
        check_sampling(SamplingParams(min_p=1.5))


@pytest.mark.parametrize("method", ["token", "block"])
def test_sampling_with_min_p_matches_the_exact_distribution(method):
    target, draft = TableLM(TABLE_V, seed=21, scale=1.5), TableLM(TABLE_V, seed=22, scale=1.5)
    kw = dict(temperature=1.0, min_p=0.15)
    params = SamplingParams(**kw)
    exact = {}
    for seq in itertools.product(range(TABLE_V), repeat=3):
        prob = 1.0
        for i in range(3):
            prob *= float(logits_to_probs(target.next_logits(tuple(TABLE_PROMPT + list(seq[:i]))), params)
                          .double()[seq[i]])
        if prob > 0:
            exact[seq] = prob
    eng = Engine(target, draft, inline=True)
    n = int(os.environ.get("SPECDEC_EXACT_RUNS_TRUNC", "3000"))
    counts = run_many(eng, "sd", method, kw, n)
    eng.close()
    assert set(counts) <= set(exact)  # nothing min_p drops is ever generated
    assert chi_square_pvalue(counts, exact, n) > 0.001


PROMPT = [5, 17, 2, 8, 30, 12]


def restricted_greedy(model, prompt, n, restrict, stop=frozenset()) -> list[int]:
    """Target-only greedy decoding, full forwards, no caches: `restrict(row, k, ids)` sets the tokens the k-th output
    token may not be to -inf (ids: the context so far); a token in `stop` ends it."""
    ids = list(prompt)
    kv = model.new_kv_slots(1, len(prompt) + n + 8)
    with torch.no_grad():
        for k in range(n):
            logits, _ = model(torch.tensor([ids]), torch.arange(len(ids))[None], torch.tensor([0]), kv)
            row = logits[0, -1].float().clone()
            restrict(row, k, ids)
            ids.append(int(row.argmax()))
            if ids[-1] in stop:
                break
    return ids[len(prompt):]


def held_greedy(model, prompt, n, eos: set[int], min_tokens: int) -> list[int]:
    """Greedy decoding that never picks an EOS id among the first min_tokens tokens, stopping at EOS."""
    def hold(row, k, _ids):
        if k < min_tokens:
            row[list(eos)] = float("-inf")
    return restricted_greedy(model, prompt, n, hold, eos)


def tiny_engine():
    """(target, an Engine over the tiny pair with a random pre-verifier): every mode runs."""
    target = build_tiny_model(vocab_size=32, seed=1, logit_scale=2.0)
    draft = build_tiny_model(vocab_size=32, seed=2, logit_scale=2.0)
    pv = build_random_preverifier(draft.config.hidden_size, seed=5, block_size=2, threshold=0.5)
    return target, Engine(target, draft, preverifier=pv)


def assert_both_gammas(eng, prompt, n, mode, want, **kw):
    for gamma in (1, 4):
        res = eng.generate(GenerationRequest(prompt, n, mode=mode, gamma=gamma, **kw))
        assert res.token_ids == want, (mode, gamma)


@contextlib.asynccontextmanager
async def wire(target, draft, **coordinator_kw):
    """A coordinator (no Ray) over one target and one draft replica of the given models → its GenerationService
    stub; `coordinator_kw` go to build_coordinator (tokenizer, eos_token_ids)."""
    import grpc

    from coordinator.config import CoordinatorSettings
    from coordinator.server import build_coordinator
    from specdec_rpc.pb import generation_pb2_grpc as gg
    from tests.helpers_models import start_replica

    t, d = await start_replica("target", target), await start_replica("draft", draft)
    app, _ = await build_coordinator(CoordinatorSettings(
        host="127.0.0.1", port=0, metrics_port=0, ray=False, tokenizer="", grace_s=0, log_level="WARNING",
        draft_endpoints=d.endpoint, target_endpoints=t.endpoint), **coordinator_kw)
    await app.start()
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{app.port}")
    try:
        yield gg.GenerationServiceStub(ch)
    finally:
        await ch.close()
        for a in (app, t, d):
            await a.shutdown(0)


@pytest.mark.parametrize("mode", MODES)
def test_min_tokens_holds_back_eos_in_every_mode(mode):
    target, eng = tiny_engine()
    prompt = PROMPT
    free = target_greedy(target, prompt, 24)  # 27 23 7 11 4 5 28 27 ...
    eos = {free[2], free[5]}  # greedy would end at its third token
    want = held_greedy(target, prompt, 24, eos, 8)
    assert len(want) > 8 and not eos & set(want[:8]), want
    assert_both_gammas(eng, prompt, 24, mode, want, eos_token_ids=tuple(sorted(eos)),
                       params=SamplingParams(min_tokens=8, stop_ids=tuple(sorted(eos))))
    plain = eng.generate(GenerationRequest(prompt, 24, mode=mode, eos_token_ids=tuple(sorted(eos))))
    assert plain.token_ids == free[:3]
    same = Engine(target, target)  # draft == target holds the same tokens back: every draft token accepted
    res = same.generate(GenerationRequest(prompt, 24, mode="sd", gamma=4, eos_token_ids=tuple(sorted(eos)),
                                          params=SamplingParams(min_tokens=8, stop_ids=tuple(sorted(eos)))))
    assert res.token_ids == want and res.stats.accepted_tokens >= res.stats.draft_tokens - 4
    eng.close()
    same.close()


def test_stop_strings_count_only_from_the_min_tokens_th_token():
    from specdec.text.tokenizer import load_tokenizer
    from tests.helpers_models import save_tiny_tokenizer
    import tempfile
    import pathlib

    tok = load_tokenizer(save_tiny_tokenizer(pathlib.Path(tempfile.mkdtemp())))
    ids = [TOKENIZER_CHARS.index(c) for c in "ab.cd.ef.gh"]
    for min_tokens, want in ((0, "ab"), (2, "ab"), (3, "ab"), (4, "ab.cd"), (6, "ab.cd"), (7, "ab.cd.ef")):
        asm = TextAssembler(tok, [1], ["."], min_tokens)
        text = "".join(asm.push([t])[0] for t in ids) + asm.finish()
        assert text == want, (min_tokens, text)


def test_a_stop_string_straddling_the_min_tokens_boundary_stops():
    """A stop string only has to END in the min_tokens-th token's text or later (vLLM's rule); it may start before.
    A mutation audit found that searching only from the min_tokens-th token's text (missing a stop
    string that straddles the boundary) passed every test."""
    from specdec.text.tokenizer import load_tokenizer
    from tests.helpers_models import save_tiny_tokenizer
    import tempfile
    import pathlib

    tok = load_tokenizer(save_tiny_tokenizer(pathlib.Path(tempfile.mkdtemp())))
    for stop, min_tokens, chars, want in (("ab", 2, "abcab", ""),  # "ab" ends in token 2: it stops there
                                          ("ab", 3, "abcab", "abc"),  # "ab" ends before token 3: the later one
                                          ("abc", 3, "abcd", ""), ("abc", 4, "abcdabc", "abcd")):
        asm = TextAssembler(tok, [1], [stop], min_tokens)
        text = "".join(asm.push([TOKENIZER_CHARS.index(c)])[0] for c in chars) + asm.finish()
        assert (text, asm.stopped, asm.stop_reason) == (want, True, stop), (stop, min_tokens, text)


async def test_over_the_wire_and_in_the_http_body():
    import grpc

    from coordinator.http_api.schema import CompletionRequest
    from specdec_rpc.pb import generation_pb2 as g
    from tests.helpers_models import tiny_pair

    target, draft = tiny_pair()
    prompt = PROMPT
    free = target_greedy(target, prompt, 24)
    eos = {free[2], free[5]}
    want = held_greedy(target, prompt, 24, eos, 8)
    async with wire(target, draft, eos_token_ids=eos) as stub:
        for mode in ("sd", "pearl"):
            r = g.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=24, mode=mode, min_tokens=8)
            assert list((await stub.Generate(r)).token_ids) == want
        r = g.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=24, mode="sd", temperature=1.0, seed=3,
                              min_p=0.3, min_tokens=24)
        assert len((await stub.Generate(r)).token_ids) == 24
        r = g.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=12, mode="pearl", allowed_token_ids=[3, 7, 11])
        assert set((await stub.Generate(r)).token_ids) <= {3, 7, 11}
        for bad, field in ((dict(min_tokens=30, max_new_tokens=24), "min_tokens"), (dict(min_p=1.5), "min_p"),
                           (dict(allowed_token_ids=[3, 500]), "allowed_token_ids")):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Generate(g.GenerateRequest(prompt_token_ids=prompt, **bad))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details()
    body = CompletionRequest(prompt=[1, 2], min_tokens=5, min_p=0.1, max_tokens=8).to_proto()
    assert body.sampling.min_tokens == 5 and body.sampling.min_p == pytest.approx(0.1)


@pytest.mark.parametrize("mode", MODES)
def test_allowed_token_ids_restrict_every_mode_exactly(mode):
    target, eng = tiny_engine()
    prompt = PROMPT
    allowed = (3, 7, 11, 19, 23, 29)

    def only_allowed(row, _k, _ids):  # greedy decoding over the allowed tokens
        keep = row[list(allowed)].clone()
        row.fill_(float("-inf"))
        row[list(allowed)] = keep
    want = restricted_greedy(target, prompt, 20, only_allowed)
    assert set(want) <= set(allowed) and want != target_greedy(target, prompt, 20)
    assert_both_gammas(eng, prompt, 20, mode, want, params=SamplingParams(allowed_token_ids=allowed))
    eng.close()
    same = Engine(target, target)
    res = same.generate(GenerationRequest(prompt, 20, mode="sd", gamma=4,
                                          params=SamplingParams(temperature=1.0, allowed_token_ids=allowed)))
    assert set(res.token_ids) <= set(allowed) and res.stats.accepted_tokens == res.stats.draft_tokens
    same.close()


def test_vllm_guided_fields_and_allowed_token_ids_in_the_http_body():
    from coordinator.http_api.schema import ChatCompletionRequest

    msgs = [{"role": "user", "content": "x"}]
    assert ChatCompletionRequest(messages=msgs, guided_regex="[ab]+").to_proto().structured_output.regex == "[ab]+"
    r = ChatCompletionRequest(messages=msgs, guided_choice=["yes", "no"]).to_proto()
    assert list(r.structured_output.choice.choices) == ["yes", "no"]
    assert ChatCompletionRequest(messages=msgs, guided_json={"type": "object"}).to_proto().structured_output.json_schema
    with pytest.raises(ValueError, match="not both"):
        ChatCompletionRequest(messages=msgs, guided_regex="a", structured_outputs={"regex": "b"})
    r = ChatCompletionRequest(messages=msgs, allowed_token_ids=[4, 5]).to_proto()
    assert list(r.sampling.allowed_token_ids) == [4, 5]


def test_bad_words_mask_the_last_token_after_the_rest():
    from specdec.decoding.penalties import adjust_logits

    words = ((4,), (1, 2), (7, 8, 9))
    p = SamplingParams(bad_words=words)
    history = [5, 7, 8]
    rows = adjust_logits(torch.zeros(4, 12), history, 2, [9, 1, 7], p)  # contexts end ...8 / 9 / 1 / 7
    banned = [set(torch.isinf(r).nonzero()[:, 0].tolist()) for r in rows]
    assert banned == [{4, 9}, {4}, {4, 2}, {4}]
    with pytest.raises(InvalidRequestError, match="bad_words"):
        check_sampling(SamplingParams(bad_words=((),)))


@pytest.mark.parametrize("mode", MODES)
def test_bad_words_in_every_mode(mode):
    target, eng = tiny_engine()
    prompt = PROMPT
    free = target_greedy(target, prompt, 20)
    words = ((free[3], free[4]), (free[9],))

    def no_bad_word(row, _k, ids):  # greedy decoding that never ends with a bad word
        for w in words:
            if tuple(ids[len(ids) - len(w) + 1:]) == w[:-1] or len(w) == 1:
                row[w[-1]] = float("-inf")
    want = restricted_greedy(target, prompt, 20, no_bad_word)
    assert want != free
    assert_both_gammas(eng, prompt, 20, mode, want, params=SamplingParams(bad_words=words))
    eng.close()


async def test_bad_words_over_the_wire_are_tokenized_by_the_coordinator(tmp_path):
    import grpc

    from specdec.text.tokenizer import load_tokenizer
    from specdec_rpc.pb import generation_pb2 as g
    from tests.helpers_models import save_tiny_tokenizer, tiny_pair

    target, draft = tiny_pair()
    prompt = PROMPT
    free = "".join(TOKENIZER_CHARS[t] for t in target_greedy(target, prompt, 20))
    word = next(free[i:i + 2] for i in range(len(free) - 1) if " " not in free[i:i + 2])
    tok = load_tokenizer(save_tiny_tokenizer(tmp_path))
    async with wire(target, draft, tokenizer=tok, eos_token_ids=set()) as stub:
        got = await stub.Generate(g.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=20, mode="sd",
                                                    bad_words=[word]))
        assert word not in got.text and got.text != free, (word, got.text, free)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Generate(g.GenerateRequest(prompt_token_ids=prompt, bad_words=[" "]))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "bad_words" in e.value.details()

def test_constraints_that_leave_no_token_are_refused_not_sampled():
    """allowed_token_ids (3, 7) and a one-token bad word for each leave nothing: INVALID_ARGUMENT saying so, in
    every mode, greedy and sampled, rather than argmax picking token 0 of an all -inf row or NaN probabilities."""
    target = build_tiny_model(vocab_size=32, seed=1, logit_scale=2.0)
    draft = build_tiny_model(vocab_size=32, seed=2, logit_scale=2.0)
    eng = Engine(target, draft)
    params = dict(allowed_token_ids=(3, 7), bad_words=((3,), (7,)))
    for mode in ("ar", "sd", "pearl"):
        for t in (0.0, 1.0):
            with pytest.raises(InvalidRequestError, match="leave no token for output token 0"):
                eng.generate(GenerationRequest([5, 17, 2], 8, mode=mode,
                                               params=SamplingParams(temperature=t, **params)))
    ok = eng.generate(GenerationRequest([5, 17, 2], 8, mode="sd", params=SamplingParams(
        allowed_token_ids=(3, 7), bad_words=((3, 3), (7, 7)))))  # one-token repeats forbidden: it alternates
    assert all(a != b for a, b in zip(ok.token_ids, ok.token_ids[1:])) and set(ok.token_ids) <= {3, 7}
    eng.close()
