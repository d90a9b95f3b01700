"""The exact core: model parity with transformers, greedy equality, draft == target, determinism, bad input."""
import pytest
import torch

from specdec.engine import Engine
from specdec.scheduling.field_rules import validate_request
from specdec.common.errors import (CapacityError, ContextOverflowError, InvalidRequestError, SessionNotFoundError,
                            StalePositionError)
from specdec.decoding.sampling import SamplingParams, logits_to_probs
from specdec.scheduling.request import MODES, GenerationRequest
from specdec.workers.draft import DraftWorker
from specdec.workers.target import TargetWorker, VerifyArgs
from tests.helpers_models import build_tiny_model

PROMPT = [3, 1, 4, 1, 5]


def assert_logits_match(m, hf) -> None:
    """specdec's model gives transformers' logits: a prompt in one forward, then three tokens more (the cache)."""
    ids = torch.tensor([[1, 5, 7, 9, 3, 2, 8, 11]])
    with torch.no_grad():
        ref = hf(ids).logits
    kv = m.new_kv_slots(2, 32)
    a, _ = m(ids[:, :5], torch.arange(5)[None], torch.tensor([1]), kv)
    b, _ = m(ids[:, 5:], torch.arange(5, 8)[None], torch.tensor([1]), kv)
    torch.testing.assert_close(torch.cat([a, b], 1), ref, atol=1e-5, rtol=1e-5)


def test_model_matches_transformers_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    m = build_tiny_model(vocab_size=40, hidden_size=32, num_heads=4, num_kv_heads=2, seed=7)
    c = m.config
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=c.rms_norm_eps,
                                      rope_theta=c.rope_theta, tie_word_embeddings=False))
    hf.load_state_dict(m.state_dict(), strict=False)
    assert_logits_match(m, hf)


def test_model_matches_transformers_qwen3(tmp_path):
    """Qwen3 (per-head RMSNorm of q and k before RoPE, no q/k/v bias, its own head_dim): a checkpoint saved by
    transformers loads (fused projections, kernels as served) and gives its logits."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from specdec.modeling.model import load_model_dir

    torch.manual_seed(3)
    hf = Qwen3ForCausalLM(Qwen3Config(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                                      rope_theta=1e6, tie_word_embeddings=True, max_position_embeddings=64)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:  # they start at ones: make the test see which weight goes where
                p.uniform_(0.5, 1.5)
    hf.save_pretrained(tmp_path)
    m = load_model_dir(tmp_path, dtype="float32")
    assert m.config.qk_norm and not m.config.attention_bias
    assert_logits_match(m, hf)


@pytest.mark.parametrize("mode,first_block", [("sd", None), ("pearl", None), ("pearl", 0), ("pearl", 1)])
@pytest.mark.parametrize("gamma", [1, 2, 4, 7])
@pytest.mark.parametrize("draft_seed", [2, 3, 4])
def test_greedy_equals_target_only(mode, first_block, gamma, draft_seed):
    """pearl's PRE round both ways: draft first (the default, and k = 1) and PEARL's pre-verify (0)."""
    target = build_tiny_model(vocab_size=32, seed=1, logit_scale=2.0)
    draft = build_tiny_model(vocab_size=32, seed=draft_seed, logit_scale=2.0)
    eng = Engine(target, draft)
    ref = eng.generate(GenerationRequest(PROMPT, 30, mode="ar")).token_ids
    for method in ("greedy", "token", "block"):  # at temperature 0 every method is exact matching
        out = eng.generate(GenerationRequest(PROMPT, 30, mode=mode, gamma=gamma, verify_method=method,
                                             pearl_first_block=first_block))
        assert out.token_ids == ref, (mode, gamma, method)
    eng.close()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_draft_identical_to_target_accepts_everything(temperature):
    target = build_tiny_model(vocab_size=32, seed=1)
    eng = Engine(target, target)
    for method in ("token", "block"):
        req = GenerationRequest(PROMPT, 24, mode="sd", gamma=4, verify_method=method,
                                params=SamplingParams(temperature=temperature, seed=5))
        out = eng.generate(req)
        assert out.stats.accepted_tokens == out.stats.draft_tokens, method
        assert out.stats.target_forwards == 24 // 5 + 1  # 4 accepted + 1 bonus per forward
    eng.close()


def test_same_seed_same_tokens_and_seed_matters(tiny_pair):
    target, draft = tiny_pair
    eng = Engine(target, draft)
    outs = {}
    for mode in ("ar", "sd", "pearl"):
        p = SamplingParams(temperature=1.0, seed=11)
        a = eng.generate(GenerationRequest(PROMPT, 20, params=p, mode=mode)).token_ids
        b = eng.generate(GenerationRequest(PROMPT, 20, params=p, mode=mode)).token_ids
        assert a == b
        outs[mode] = a
    c = eng.generate(GenerationRequest(PROMPT, 20, params=SamplingParams(temperature=1.0, seed=12), mode="sd"))
    assert c.token_ids != outs["sd"]
    eng.close()


def test_temperature_zero_is_argmax():
    logits = torch.tensor([[0.1, 3.0, 2.9, -1.0]])
    probs = logits_to_probs(logits, SamplingParams(temperature=0.0, top_k=2, top_p=0.5))
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0]]


def test_top_k_top_p_transform():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=3))
    torch.testing.assert_close(p, torch.tensor([[0.5, 0.3, 0.15, 0.0]]) / 0.95)
    p = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))  # smallest set with mass >= 0.7
    torch.testing.assert_close(p, torch.tensor([[0.5, 0.3, 0.0, 0.0]]) / 0.8)


def test_batched_verify_equals_separate(tiny_pair):
    target, draft = tiny_pair
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11]]
    drafts = [[5, 6, 7], [1], [2, 3, 4, 5], []]
    for temp in (0.0, 1.0):
        params = SamplingParams(temperature=temp, seed=3)
        dw = DraftWorker(draft, max_sessions=4)
        results = []
        for batched in (False, True):
            tw = TargetWorker(target, max_sessions=4)
            args = []
            for i, (pr, dr) in enumerate(zip(prompts, drafts)):
                tw.start_session(f"s{i}", pr, params)
                dw.start_session(f"s{i}", pr, params)
                blk = dw.draft(f"s{i}", len(pr) - 1, pr[-1:], max(len(dr), 1)) if dr else None
                toks = blk.tokens if blk else []
                args.append(VerifyArgs(f"s{i}", len(pr) - 1, pr[-1:], toks, blk.q if blk else None,
                                       "greedy" if temp == 0 else "block"))
            outs = tw.verify_batch(args) if batched else [tw.verify_batch([a])[0] for a in args]
            results.append([(o.num_accepted, o.next_token, tw.sessions[a.session_id].tokens) for o, a in
                            zip(outs, args)])
        assert results[0] == results[1]


def draft_all(dw: DraftWorker, args: list[tuple], batched: bool) -> list[list]:
    """Each call's blocks: drafted together in shared forwards (`begin` / `advance`), or one call at a time."""
    if not batched:
        return [list(dw.draft_blocks(*a)) for a in args]
    calls = [dw.begin(*a) for a in args]
    blocks = [[] for _ in calls]
    while not all(c.done for c in calls):
        for i, bs in enumerate(dw.advance(calls)):
            blocks[i].extend(bs)
    return blocks


def test_batched_drafting_equals_separate(tiny_pair):
    """Sessions drafting in shared forwards (different appends, lengths, block sizes, joining and leaving at
    different steps) draft what each would alone, and leave the same KV state behind."""
    _, draft = tiny_pair
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11, 12, 13]]
    plan = [(5, 0), (2, 1), (7, 3), (1, 0)]  # (gamma_max, block_size) per session
    adjust = dict(presence_penalty=0.5, repetition_penalty=1.5, logit_bias=((3, 1.0),))  # the target's, drafted too
    for temp, extra in ((0.0, {}), (1.0, {}), (0.0, adjust), (1.0, adjust)):
        runs = []
        for batched in (False, True):
            dw = DraftWorker(draft, max_sessions=4)
            for i, pr in enumerate(prompts):
                dw.start_session(f"s{i}", pr, SamplingParams(temperature=temp, seed=11 + i, **extra))
            for rnd in range(2):  # the second round truncates the first one's drafts, feeds 1-4 tokens (padding)
                args = [(f"s{i}", len(pr) - 1, [pr[-1]] + [7, 8, 9][:rnd * i], g, None, b)
                        for i, (pr, (g, b)) in enumerate(zip(prompts, plan))]
                blocks = draft_all(dw, args, batched)
                runs.append([[(b.tokens, b.final, b.stop_reason, [d.ids.tolist() for d in b.q]) for b in bs]
                             for bs in blocks] + [dw.sessions[f"s{i}"].tokens for i in range(4)])
        assert runs[0] == runs[2] and runs[1] == runs[3], temp
        assert [len(bs) for bs in runs[0][:4]] == [1, 2, 3, 1]


def test_kv_rollback_never_keeps_rejected_positions(tiny_pair):
    target, draft = tiny_pair
    tw = TargetWorker(target, max_sessions=1)
    tw.start_session("s", PROMPT, SamplingParams())
    ref = TargetWorker(target, max_sessions=1)
    ref.start_session("s", PROMPT, SamplingParams())
    # feed a wrong draft; whatever is rejected must not influence the next verify
    out = tw.verify("s", 4, [5], [31, 30, 29, 28], None, "greedy")
    assert tw.session_length("s") == 5 + out.num_accepted
    nxt = out.next_token
    a = tw.verify("s", 5 + out.num_accepted, [nxt], [], None, "greedy")
    ref_out = ref.verify("s", 4, [5] + [31, 30, 29, 28][:out.num_accepted] + [nxt], [], None, "greedy")
    assert a.next_token == ref_out.next_token


def test_the_next_token_alone_comes_from_the_stored_row(tiny_pair):
    """A verify that feeds nothing and checks nothing returns the token after the last fed one, read off the row
    the previous call stored (no forward); without such a row it asks for the pending token."""
    target, _ = tiny_pair
    tw, ref = TargetWorker(target, max_sessions=1), TargetWorker(target, max_sessions=1)
    tw.start_session("s", PROMPT, SamplingParams())
    ref.start_session("s", PROMPT, SamplingParams())
    with pytest.raises(StalePositionError, match="send the pending token"):
        tw.verify("s", len(PROMPT) - 1, [], [], None, "greedy")  # the prefill stored no row
    greedy = [ref.verify("s", len(PROMPT) - 1, [PROMPT[-1]], [], None, "greedy").next_token]
    for i in range(3):
        greedy.append(ref.verify("s", len(PROMPT) + i, [greedy[-1]], [], None, "greedy").next_token)
    out = tw.verify("s", len(PROMPT) - 1, [PROMPT[-1]], greedy[:3], None, "greedy", sample_bonus=False)
    assert out.num_accepted == 3 and out.next_token is None
    nxt = tw.verify("s", len(PROMPT) + 3, [], [], None, "greedy")
    assert nxt.next_token == greedy[3] and not nxt.forwarded
    with pytest.raises(InvalidRequestError, match="nothing to verify"):
        tw.verify("s", len(PROMPT) + 3, [], [], None, "greedy", sample_bonus=False)


def test_bad_input_errors(tiny_pair):
    from specdec_rpc.decode import read_sampling
    from specdec_rpc.pb import common_pb2

    target, draft = tiny_pair
    tw = TargetWorker(target, max_sessions=1, max_context=16)
    with pytest.raises(InvalidRequestError, match="prompt_ids"):
        tw.start_session("s", [], SamplingParams())
    with pytest.raises(InvalidRequestError, match="prompt_ids"):
        tw.start_session("s", [1, 99], SamplingParams())
    # sampling ranges are the doors' to check (a replica's read of its request, the engine's), not the worker's
    with pytest.raises(InvalidRequestError, match="temperature"):
        read_sampling(common_pb2.SamplingParams(temperature=-1))
    with pytest.raises(InvalidRequestError, match="top_p"):
        read_sampling(common_pb2.SamplingParams(temperature=1, top_p=1.5))
    with pytest.raises(ContextOverflowError, match="context"):
        tw.start_session("s", list(range(20)), SamplingParams())
    tw.start_session("s", [1, 2], SamplingParams())
    with pytest.raises(CapacityError, match="slots"):
        tw.start_session("t", [1, 2], SamplingParams())
    with pytest.raises(SessionNotFoundError, match="unknown"):
        tw.verify("nope", 1, [2], [], None, "greedy")
    with pytest.raises(StalePositionError, match="base_position"):
        tw.verify("s", 5, [2], [], None, "greedy")
    with pytest.raises(InvalidRequestError, match="draft_tokens"):
        tw.verify("s", 1, [2], [40], None, "greedy")
    with pytest.raises(ContextOverflowError):
        tw.verify("s", 1, [2], [3] * 20, None, "greedy")
    for field, req in [("max_new_tokens", GenerationRequest([1], 0)), ("mode", GenerationRequest([1], 4, mode="x")),
                       ("prompt", GenerationRequest([], 4))]:
        with pytest.raises(InvalidRequestError, match=field):
            validate_request(req)
    assert set(MODES) == {"ar", "sd", "pacer", "pearl", "pacer_pearl"}


def test_gamma_defaults_per_mode():
    from specdec.scheduling.request import DEFAULT_GAMMA

    for mode, g in (("sd", 4), ("pacer", 8), ("pearl", 8), ("pacer_pearl", 8)):
        assert validate_request(GenerationRequest([1, 2], 4, mode=mode)).gamma == g == DEFAULT_GAMMA[mode]
    assert validate_request(GenerationRequest([1, 2], 4, mode="pearl", gamma=3)).gamma == 3


@pytest.mark.parametrize("batched", [False, True])
def test_pearl_picks_its_pre_round_by_the_last_verifys_batch(tiny_pair, batched):
    """pearl_first_block unset: draft first while verifies run alone, PEARL pre-verify (a one-row forward, then a
    check-only verify) while they are batched; the output is the target's greedy output either way."""
    target, draft = tiny_pair
    eng = Engine(target, draft)
    ref = eng.generate(GenerationRequest(PROMPT, 30, mode="ar")).token_ids
    calls = []
    verify = eng.target.verify

    async def spy(*args, **kw):
        out = await verify(*args, **kw)
        calls.append(kw.get("feed_draft", True))
        if batched:
            out.batch_size = 2  # as a target replica reports when other sessions shared the forward
        return out

    eng.target.verify = spy
    out = eng.generate(GenerationRequest(PROMPT, 30, mode="pearl", gamma=4))
    assert out.token_ids == ref
    assert (False in calls) == batched  # check-only verifies happen in pre-verify rounds only
    eng.close()


def test_sample_draws_the_distribution_and_never_a_zero_probability_entry():
    from scipy.stats import chisquare

    from specdec.decoding.sampling import sample

    probs = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.25, 0.05, 0.0])
    gen = torch.Generator().manual_seed(0)
    n = 20_000
    counts = torch.bincount(torch.tensor([sample(probs, gen) for _ in range(n)]), minlength=len(probs))
    assert counts[probs == 0].sum() == 0
    nz = probs > 0
    assert chisquare(counts[nz].numpy(), (probs[nz] * n).numpy()).pvalue > 1e-4
    # one-hot rows, an unnormalised row, float32 rows of the real vocabulary's size, and no generator (argmax)
    assert all(sample(torch.nn.functional.one_hot(torch.tensor(i), 9).float(), gen) == i for i in range(9))
    assert sample(torch.tensor([0.0, 3.0, 0.0]), gen) == 1
    big = torch.zeros(49_152)
    big[[7, 40_000, 49_151]] = torch.tensor([0.2, 0.3, 0.5])
    assert {sample(big, gen) for _ in range(200)} == {7, 40_000, 49_151}
    assert sample(probs, None) == 1


def test_prefill_runs_the_head_on_the_last_row_only():
    """A prefill's logits are never read: both workers' heads see one row of a 20-token prompt, and the next
    verify still checks drafts against the right rows (greedy output as target-only decoding)."""
    target, draft = build_tiny_model(seed=1), build_tiny_model(hidden_size=16, num_layers=1, seed=2)
    rows = {"target": [], "draft": []}
    target.lm_head.register_forward_hook(lambda m, args, out: rows["target"].append(args[0].shape[-2]))
    draft.lm_head.register_forward_hook(lambda m, args, out: rows["draft"].append(args[0].shape[-2]))
    prompt = list(range(1, 21))
    TargetWorker(target, max_sessions=1).start_session("t", prompt, SamplingParams())
    DraftWorker(draft, max_sessions=1).start_session("d", prompt, SamplingParams())
    assert rows == {"target": [1], "draft": [1]}
    eng = Engine(target, draft)
    spec = eng.generate(GenerationRequest(prompt_ids=prompt, max_new_tokens=12, mode="sd", gamma=3))
    ar = eng.generate(GenerationRequest(prompt_ids=prompt, max_new_tokens=12, mode="ar"))
    assert spec.token_ids == ar.token_ids


@pytest.mark.parametrize("mode", MODES)
def test_engine_fills_the_context_exactly_and_refuses_one_more(mode):
    """prompt + max_new_tokens == max_context runs in every mode (PEARL's shadow drafts stop at the request's end);
    one more is ContextOverflowError before any forward."""
    from specdec.decoding.preverifier import build_random_preverifier

    target = build_tiny_model(vocab_size=32, seed=1, logit_scale=2.0)
    draft = build_tiny_model(vocab_size=32, seed=2, logit_scale=2.0)
    pv = build_random_preverifier(draft.config.hidden_size, seed=5, block_size=2, threshold=0.5)
    eng = Engine(target, draft, preverifier=pv, max_context=40)
    n = 40 - len(PROMPT)
    ref = eng.generate(GenerationRequest(PROMPT, n, mode="ar")).token_ids
    for gamma in (1, 4, 8):
        for temperature in (0.0, 1.0):
            out = eng.generate(GenerationRequest(PROMPT, n, mode=mode, gamma=gamma,
                                                 params=SamplingParams(temperature=temperature, seed=3)))
            assert len(out.token_ids) == n, (gamma, temperature)
            if temperature == 0:
                assert out.token_ids == ref, gamma
    with pytest.raises(ContextOverflowError, match="needs up to 41 positions"):
        eng.generate(GenerationRequest(PROMPT, n + 1, mode=mode))
    assert not eng.target_worker.sessions and not eng.draft_worker.sessions
    eng.close()


def test_a_failed_start_leaves_no_session_behind():
    """The target's start fails while the draft's still waits for room: the draft's start is cancelled before
    generate ends the sessions, so no session starts after its request ended (asyncio.gather alone left it
    running: a replica session left behind, found by scripts/soak.py)."""
    import asyncio

    from specdec.scheduling.schedule import generate

    class Target:
        chain_window = 1

        async def start(self, *a, **k):
            raise CapacityError("the target pool is full")

        async def end(self, sid):
            pass

    class Draft:
        reads_features = False
        started = ended = False

        async def start(self, *a, **k):
            await asyncio.sleep(0.05)  # waiting for room in the draft pool
            self.started = True

        async def end(self, sid):
            self.ended = self.started

    async def run():
        draft = Draft()
        with pytest.raises(CapacityError):
            await generate(GenerationRequest(PROMPT, 8, mode="sd"), draft, Target())
        await asyncio.sleep(0.1)  # long enough for a start left running to finish
        return draft

    draft = asyncio.run(run())
    assert not draft.started or draft.ended
