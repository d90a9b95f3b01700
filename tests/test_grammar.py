"""Structured output (specdec/text/grammar.py) restricts the target's p to a grammar: every mode reproduces target-only
decoding under the same grammar (greedy), sampling follows the exact masked target distribution, a draft equal to
the target has every token accepted, and bad grammars are refused with the field named."""
import json
import os
import re
from collections import Counter

import pytest
import torch
from llguidance import LLMatcher

from specdec.common.errors import InvalidRequestError
from specdec.decoding.preverifier import build_random_preverifier
from specdec.decoding.sampling import SamplingParams, logits_to_probs
from specdec.engine import Engine
from specdec.scheduling.request import MODES, GenerationRequest
from specdec.text.grammar import GrammarVocab, StructuredOutput
from specdec.workers.proposers import ForcedTokens, LookupTokens
from specdec.workers.target import TargetWorker
from tests.helpers_models import TOKENIZER_CHARS, build_tiny_model, tiny_tokenizer
from tests.table_lm import TableLM
from tests.test_exactness import chi_square_pvalue

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
EOS = 0  # the tiny tokenizer's <unk> serves as EOS
SENTENCE = r"(hello|hi)( [a-z]{2,5}){2,6}[.!?]"


def tiny_vocab(chars: str = TOKENIZER_CHARS) -> GrammarVocab:
    return GrammarVocab(tiny_tokenizer(chars).to_str(), len(chars), [EOS])


def grammar_of(kind: str, value: str = "") -> str:
    return StructuredOutput(kind, value).grammar()


def engine(target, draft, vocab, **kw) -> Engine:
    eng = Engine(target, draft, **kw)
    eng.target_worker.grammar_vocab = vocab
    if eng.draft_worker is not None:
        eng.draft_worker.grammar_vocab = vocab
    return eng


def masked_greedy(model, vocab: GrammarVocab, grammar: str, prompt: list[int], n: int) -> list[int]:
    """Target-only greedy decoding under the grammar: full forwards, no caches, a fresh matcher fed token by
    token, the mask read off its bitmask bytes."""
    m = LLMatcher(vocab.tokenizer, grammar, log_level=0)
    ids = list(prompt)
    kv = model.new_kv_slots(1, len(prompt) + n + 8)
    with torch.no_grad():
        for _ in range(n):
            logits, _ = model(torch.tensor([ids]), torch.arange(len(ids))[None], torch.tensor([0]), kv)
            bits = m.compute_bitmask()
            allowed = [t for t in range(model.config.vocab_size) if bits[t // 8] >> (t % 8) & 1]
            row = logits[0, -1].float()
            tok = max(allowed, key=lambda t: (float(row[t]), -t))
            ids.append(tok)
            if tok == EOS:
                break
            assert m.consume_token(tok)
    return ids[len(prompt):]


def text(ids: list[int]) -> str:
    return "".join(TOKENIZER_CHARS[t] for t in ids if t != EOS)


@pytest.fixture(scope="module")
def tiny():
    target = build_tiny_model(vocab_size=32, seed=1, logit_scale=2.0)
    draft = build_tiny_model(vocab_size=32, seed=2, logit_scale=2.0)
    return target, draft, tiny_vocab()


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_equals_masked_target_only_greedy(tiny, mode):
    target, draft, vocab = tiny
    pv = build_random_preverifier(draft.config.hidden_size, seed=5, block_size=2, threshold=0.5)
    eng = engine(target, draft, vocab, preverifier=pv)
    grammar = grammar_of("regex", SENTENCE)
    want = masked_greedy(target, vocab, grammar, PROMPT, 40)
    assert re.fullmatch(SENTENCE, text(want)) and want[-1] == EOS, text(want)
    for gamma in (1, 4):
        res = eng.generate(GenerationRequest(PROMPT, 40, mode=mode, gamma=gamma, eos_token_ids=(EOS,),
                                             params=SamplingParams(grammar=grammar)))
        assert res.token_ids == want, (mode, gamma, text(res.token_ids))
        assert res.finish_reason == "stop"
    eng.close()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_draft_equal_to_target_has_every_token_accepted(tiny, temperature):
    target, _, vocab = tiny
    eng = engine(target, target, vocab)
    for seed in range(3):
        # EOS does not end these requests: past the sentence, the grammar allows EOS alone, so no round is cut
        res = eng.generate(GenerationRequest(PROMPT, 40, mode="sd", gamma=4,
                                             params=SamplingParams(temperature=temperature, seed=seed,
                                                                   grammar=grammar_of("regex", SENTENCE))))
        assert re.fullmatch(SENTENCE, text(res.token_ids)) and res.token_ids[-1] == EOS, text(res.token_ids)
        assert res.stats.accepted_tokens == res.stats.draft_tokens > 0, res.stats
    eng.close()


CHOICES = ["ab", "a", "abc", "ba", "b.", "c!d", "cd"]  # over the 8 symbols of TableLM's vocabulary
TABLE_CHARS = "<abcd.! "


@pytest.mark.parametrize("method", ["token", "block"])
def test_sampling_follows_the_exact_masked_target(method):
    """vocabulary 8, choices as the grammar: P(choice) = the product of the masked, renormalized target
    conditionals (EOS included where the choice ends inside 3 tokens), from an independent reading of what a
    choice allows next; 3000 seeded sd runs pass a chi-square against it."""
    target, draft = TableLM(8, seed=21, scale=1.5), TableLM(8, seed=22, scale=1.5)
    prompt = [1, 5, 2]
    ids = {c: [TABLE_CHARS.index(ch) for ch in c] for c in CHOICES}

    def allowed(out: list[int]) -> list[int]:
        nxt = {v[len(out)] for v in ids.values() if v[:len(out)] == out and len(v) > len(out)}
        return sorted(nxt | ({EOS} if out in ids.values() else set()))

    exact = {}
    for c, toks in ids.items():
        seq = (toks + [EOS])[:3]
        prob = 1.0
        for i, t in enumerate(seq):
            row = target.next_logits(tuple(prompt + seq[:i])).double()
            ok = allowed(seq[:i])
            prob *= float(torch.softmax(row[ok], 0)[ok.index(t)])
        exact[tuple(seq + [EOS] * (3 - len(seq)))] = prob
    assert abs(sum(exact.values()) - 1) < 1e-9
    eng = engine(target, draft, GrammarVocab(tiny_tokenizer(TABLE_CHARS).to_str(), 8, [EOS]), inline=True)
    grammar = grammar_of("choice", json.dumps(CHOICES))
    n = int(os.environ.get("SPECDEC_EXACT_RUNS_TRUNC", "3000"))
    counts = Counter()
    for seed in range(n):
        req = GenerationRequest(prompt, 3, verify_method=method, gamma=3, mode="sd", eos_token_ids=(EOS,),
                                params=SamplingParams(temperature=1.0, seed=seed, grammar=grammar))
        out = eng.generate(req).token_ids
        counts[tuple(out + [EOS] * (3 - len(out)))] += 1
    eng.close()
    assert set(counts) <= set(exact), set(counts) - set(exact)
    assert chi_square_pvalue(counts, exact, n) > 0.001
    plain = {}  # guard: the unmasked target restricted to the same outcomes is told apart with as many runs
    for seq in exact:
        prob = 1.0
        for i in range(3):
            row = target.next_logits(tuple(prompt + list(seq[:i])))
            prob *= float(logits_to_probs(row, SamplingParams(temperature=1.0)).double()[seq[i]])
        plain[seq] = prob
    total = sum(plain.values())
    assert chi_square_pvalue(counts, {k: v / total for k, v in plain.items()}, n) < 1e-6


def test_mask_rows_masks_each_row_by_its_own_history(tiny):
    _, _, vocab = tiny
    state = vocab.state(grammar_of("choice", json.dumps(["abc", "abd", "b"])))
    a, b, c, d = (TOKENIZER_CHARS.index(ch) for ch in "abcd")
    rows = state.mask_rows(torch.zeros(4, 32), [], [a, b, c])  # rows after "", "a", "ab", "abc"
    allowed = [sorted(torch.isfinite(r).nonzero()[:, 0].tolist()) for r in rows]
    assert allowed == [[a, b], [b], [c, d], [EOS]]
    rows = state.mask_rows(torch.zeros(4, 32), [], [a, c, d])  # "ac" leaves the grammar: row 1 rejects c
    allowed = [sorted(torch.isfinite(r).nonzero()[:, 0].tolist()) for r in rows]
    assert allowed[:2] == [[a, b], [b]]
    assert state.consumed == [] and not state.matcher.is_error()
    assert state.sync([a, b]) and state.consumed == [a, b]  # forwards, then back: rollback
    assert state.sync([b]) and state.consumed == [b]
    assert not state.sync([c])
    with pytest.raises(InvalidRequestError, match="structured_output"):
        state.mask_rows(torch.zeros(1, 32), [c], [])


def test_forced_tokens(tiny):
    _, _, vocab = tiny
    state = vocab.state(grammar_of("regex", r"hello (world|there)\."))
    idx = [TOKENIZER_CHARS.index(ch) for ch in "hello t"]
    assert state.forced([], 10) == idx[:6]  # "hello " is forced; the next letter is a choice
    assert state.forced(idx, 3) == [TOKENIZER_CHARS.index(ch) for ch in "her"]
    assert state.forced([idx[1]], 3) == []  # "e" leaves the grammar


@pytest.mark.parametrize("kind, value, match", [
    ("json_schema", "{not json", "not valid JSON"), ("json_schema", "[1]", "JSON object"),
    ("choice", "[]", "non-empty"), ("choice", '["a", 3]', "non-empty"), ("regex", "", "empty"),
    ("yaml", "x", "unknown kind")])
def test_bad_forms_are_refused_with_the_field_named(kind, value, match):
    with pytest.raises(InvalidRequestError, match=match) as e:
        grammar_of(kind, value)
    assert e.value.field.startswith("structured_output")


def test_a_grammar_that_does_not_compile_is_refused(tiny):
    _, _, vocab = tiny
    for bad in (grammar_of("regex", "(unclosed"), grammar_of("grammar", "start: undefined_rule")):
        with pytest.raises(InvalidRequestError, match="does not compile"):
            vocab.check(bad)
        w = TargetWorker(tiny[0])
        w.grammar_vocab = vocab
        with pytest.raises(InvalidRequestError, match="does not compile"):
            w.start_session("s", PROMPT, SamplingParams(grammar=bad))
        assert not w.sessions


def test_a_model_without_a_tokenizer_refuses_structured_output(tiny):
    w = TargetWorker(tiny[0])  # built in-process: no source directory, no tokenizer.json
    with pytest.raises(InvalidRequestError, match="tokenizer.json"):
        w.start_session("s", PROMPT, SamplingParams(grammar=grammar_of("json_object")))
    assert not w.sessions and len(w.free_slots) == w.max_sessions


def test_a_model_directory_with_a_tokenizer_serves_structured_output(tmp_path):
    """The worker reads tokenizer.json and the EOS id from the model directory; a draft without a tokenizer
    drafts unmasked (its proposals are only proposals), and the output still follows the grammar."""
    from specdec.modeling.model import load_model_dir
    from tests.helpers_models import save_tiny_pair

    tdir, ddir = save_tiny_pair(tmp_path)
    (tdir / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS}))
    target, draft = load_model_dir(tdir), load_model_dir(ddir)
    eng = Engine(target, draft)
    assert eng.target_worker.grammar_vocab is not None and eng.draft_worker.grammar_vocab is None
    grammar = grammar_of("regex", SENTENCE)
    want = masked_greedy(target, eng.target_worker.grammar_vocab, grammar, PROMPT, 40)
    res = eng.generate(GenerationRequest(PROMPT, 40, mode="sd", eos_token_ids=(EOS,),
                                         params=SamplingParams(grammar=grammar)))
    assert res.token_ids == want and re.fullmatch(SENTENCE, text(res.token_ids))
    eng.close()


def test_choice_escapes_punctuation():
    vocab = tiny_vocab()
    state = vocab.state(grammar_of("choice", json.dumps(["a.b", "a?!", "(x)"])))
    dot = TOKENIZER_CHARS.index(".")
    assert state.sync([TOKENIZER_CHARS.index("a"), dot])
    assert not state.sync([TOKENIZER_CHARS.index("a"), TOKENIZER_CHARS.index("z")])  # "." is not "any character"


def test_the_draft_proposes_forced_tokens_without_a_forward(tiny):
    """Where the grammar admits one continuation, the draft proposes its tokens as it does prompt lookup's (q
    one-hot, no forward): the target accepts them, and the output is unchanged."""
    target, draft, vocab = tiny
    grammar = grammar_of("regex", r"hello (world|there)\. bye now\.")
    want = masked_greedy(target, vocab, grammar, PROMPT, 30)
    counts = {}
    for forced in (True, False):
        eng = engine(target, draft, vocab)
        dw, forwards = eng.draft_worker, []
        if not forced:  # the grammar's forced tokens are drafted from the model's logits, as any other
            dw.proposers = [p for p in dw.proposers if not isinstance(p, ForcedTokens)]
        feed = dw._feed_many
        dw._feed_many = lambda *a, **kw: forwards.append(1) or feed(*a, **kw)
        res = eng.generate(GenerationRequest(PROMPT, 30, mode="sd", gamma=4, eos_token_ids=(EOS,),
                                             params=SamplingParams(grammar=grammar)))
        assert res.token_ids == want
        counts[forced] = (dw.looked_up_tokens, len(forwards), res.stats.accepted_tokens)
        eng.close()
    assert counts[True][0] >= 6 + 10 and counts[False][0] == 0  # "hello ", ". bye now." and the word's tail
    assert counts[True][1] < counts[False][1] / 2, counts  # a run of forced tokens costs the draft no forward
    assert counts[True][2] >= counts[False][2], counts


def test_a_rebuilt_session_continues_the_grammar(tiny):
    """A session rebuilt after a failover holds its output in the prompt (output_start): the grammar resumes
    from there."""
    target, _, vocab = tiny
    grammar = grammar_of("regex", SENTENCE)
    want = masked_greedy(target, vocab, grammar, PROMPT, 40)
    w = TargetWorker(target)
    w.grammar_vocab = vocab
    history = PROMPT + want[:5]
    w.start_session("rebuilt", history, SamplingParams(grammar=grammar), output_start=len(PROMPT))
    out = w.verify("rebuilt", len(history) - 1, [history[-1]], [])
    assert out.next_token == want[5]


def test_compiled_grammars_are_cached_and_each_session_gets_its_own_matcher(tiny):
    _, _, vocab = tiny
    grammar = grammar_of("choice", json.dumps(["ab", "ba"]))
    a, b = vocab.state(grammar), vocab.state(grammar)
    assert grammar in vocab._compiled and a.matcher is not b.matcher
    assert a.sync([TOKENIZER_CHARS.index("a")]) and b.sync([TOKENIZER_CHARS.index("b")])
    assert a.forced(a.consumed, 5) == [TOKENIZER_CHARS.index("b")]
    assert b.forced(b.consumed, 5) == [TOKENIZER_CHARS.index("a")]
    assert vocab.state(grammar).consumed == []  # the cached matcher is never advanced


def test_prompt_lookup_proposes_only_what_the_grammar_allows(tiny):
    """Prompt lookup stays on for grammar requests; its proposals the grammar forbids are dropped (the draft model
    drafts there), so every looked-up token the target sees is one it may accept."""
    from specdec.decoding.lookup import PromptLookup

    target, draft, vocab = tiny
    grammar = grammar_of("regex", r"(ab|ba)( (ab|ba)){3,8}\.")
    want = masked_greedy(target, vocab, grammar, PROMPT, 40)
    class Recording:  # the lookup, recording every context it is asked about
        def __init__(self, inner):
            self.inner, self.calls = inner, []

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def propose(self, ctx):
            self.calls.append(list(ctx))
            return self.inner.propose(ctx)

    eng = engine(target, draft, vocab)
    rec = Recording(PromptLookup(min_ngram=1))
    eng.draft_worker.proposers = [LookupTokens(rec)]  # every token from lookup or the model (no forced tokens)
    eng.draft_worker.certain_accept_prob = rec.accept_prob
    proposed, propose = rec.calls, rec.inner.propose
    res = eng.generate(GenerationRequest(PROMPT, 40, mode="sd", gamma=4, eos_token_ids=(EOS,),
                                         params=SamplingParams(grammar=grammar)))
    assert res.token_ids == want and eng.draft_worker.looked_up_tokens > 0
    state = vocab.state(grammar)
    offered = [(ctx[len(PROMPT):], propose(ctx)) for ctx in proposed]
    kept = [(out, p[0]) for out, p in offered if p is not None and state.allows(out, p[0])]
    dropped = [(out, p[0]) for out, p in offered if p is not None and not state.allows(out, p[0])]
    assert kept and dropped, "lookup proposed tokens the grammar allows and tokens it forbids"
    assert eng.draft_worker.looked_up_tokens <= len(kept)
    eng.close()
