"""Greedy token-tree speculative decoding (specdec/tree.py): exact greedy output, K/V bookkeeping, bad input."""
import pytest
import torch

from specdec.errors import InvalidRequestError
from specdec.sampling import SamplingParams
from specdec.tree import (DraftTree, ancestor_mask, draft_tree, generate_tree, parse_shape, tree_attention_mask,
                          tree_size, verify_tree, walk_greedy)
from specdec.drafting import DraftWorker
from specdec.workers import TargetWorker
from tests.helpers_models import build_tiny_model, target_greedy, tiny_pair


def test_masks_and_walk():
    parents = [-1, -1, 0, 0, 1, 2]
    m = ancestor_mask(parents)
    assert m[5].tolist() == [True, False, True, False, False, True]
    full = tree_attention_mask(3, parents, lead=2)
    assert full.shape == (8, 11)
    assert full[1, :5].tolist() == [True] * 5 and not full[0, 4]  # lead rows are causal
    assert full[7].tolist() == [True] * 5 + [True, False, True, False, False, True]
    tree = DraftTree(tokens=[7, 8, 9, 10, 11, 12], parents=parents, depths=[0, 0, 1, 1, 1, 2])
    # root -> 7 (node 0) -> 10 (node 3) -> argmax after node 3 is 5: bonus
    argmax = [7, 10, 0, 0, 5, 0, 0]
    assert walk_greedy(tree, argmax) == ([0, 3], 5)
    assert walk_greedy(tree, [4] + [0] * 6) == ([], 4)
    assert tree_size((4, 2, 1)) == 20 and parse_shape("4,2,1") == (4, 2, 1)
    with pytest.raises(InvalidRequestError, match="top-k per depth"):
        parse_shape("2,0")


def noisy_copy(model, scale: float, seed: int = 0):
    """A draft that agrees with the target often but not always: the target's weights plus noise."""
    g = torch.Generator().manual_seed(seed)
    draft = build_tiny_model(vocab_size=model.config.vocab_size, seed=1)
    draft.load_state_dict(model.state_dict())
    with torch.no_grad():
        for w in draft.parameters():
            w.add_(torch.randn(w.shape, generator=g) * scale * w.std().clamp_min(1e-3))
    return draft


@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 1, 1), (3, 2, 1), (2, 2, 2, 1)])
def test_tree_output_is_target_greedy(shape):
    target = build_tiny_model(vocab_size=32, seed=1)
    for draft in (tiny_pair()[1], noisy_copy(target, 0.5)):
        tw, dw = TargetWorker(target, max_sessions=2), DraftWorker(draft, max_sessions=2)
        accepted = 0
        for prompt in ([1, 5, 9], [3], [2, 7, 7, 4, 11, 30]):
            out, st = generate_tree(dw, tw, prompt, 24, shape)
            assert out == target_greedy(target, prompt, 24)
            assert st.drafted == st.rounds * tree_size(shape)
            accepted += st.accepted
        assert not tw.sessions and not dw.sessions
    assert 0 < accepted < 72  # the noisy draft exercises partial paths (and their K/V moves)


def test_draft_equal_target_accepts_every_depth():
    target = build_tiny_model(vocab_size=32, seed=1)
    tw, dw = TargetWorker(target), DraftWorker(build_tiny_model(vocab_size=32, seed=1))
    out, st = generate_tree(dw, tw, [1, 2, 3], 20, (2, 2, 1))
    assert out == target_greedy(target, [1, 2, 3], 20)
    assert st.accepted == 3 * st.rounds - (st.rounds * 4 - 20)  # every round takes 3 + bonus, but the last is cut
    assert st.mean_accepted_length == 4.0


def test_accepted_path_kv_matches_a_plain_feed():
    """After a tree verify, the session's cache holds exactly the K/V a plain forward of the committed text writes."""
    target, draft = tiny_pair()
    tw, dw = TargetWorker(target), DraftWorker(build_tiny_model(vocab_size=32, seed=1))  # draft == target
    p = SamplingParams(temperature=0.0)
    prompt = [1, 5, 9, 2]
    tw.start_session("a", prompt, p)
    dw.start_session("a", prompt, p)
    tree = draft_tree(dw, "a", 3, [2], (2, 2))
    accepted, bonus = verify_tree(tw, "a", 3, [2], tree)
    tokens = tw.sessions["a"].tokens
    assert tokens == prompt + accepted
    ref = TargetWorker(target)
    ref.start_session("b", tokens + [bonus], p)
    n = len(tokens)
    sa, sb = tw.sessions["a"].slot, ref.sessions["b"].slot
    for layer in range(target.config.num_hidden_layers):
        torch.testing.assert_close(tw.kv.k[layer][sa, :n], ref.kv.k[layer][sb, :n])
        torch.testing.assert_close(tw.kv.v[layer][sa, :n], ref.kv.v[layer][sb, :n])


def test_sampling_and_bad_input_are_refused():
    target, draft = tiny_pair()
    tw, dw = TargetWorker(target), DraftWorker(draft)
    dw.start_session("s", [1, 2], SamplingParams(temperature=1.0))
    with pytest.raises(InvalidRequestError, match="greedily"):
        draft_tree(dw, "s", 1, [2], (2,))
    tw.start_session("g", [1, 2], SamplingParams(temperature=0.0))
    with pytest.raises(InvalidRequestError, match="pending token"):
        verify_tree(tw, "g", 1, [], DraftTree([3], [-1], [0]))
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        verify_tree(tw, "g", 1, [2], DraftTree([99], [-1], [0]))


def test_every_branch_is_the_drafts_top_k_after_its_path():
    """Each node's children are the draft's top-k after the plain sequence prefix + path to the node: sibling
    subtrees do not see each other."""
    draft = build_tiny_model(vocab_size=32, seed=2)
    dw = DraftWorker(draft)
    p = SamplingParams(temperature=0.0)
    prompt = [1, 5, 9, 2]
    dw.start_session("a", prompt, p)
    shape = (3, 2, 2)
    tree = draft_tree(dw, "a", 3, [2], shape)
    ref = DraftWorker(draft)

    def path(i):
        return [] if i < 0 else path(tree.parents[i]) + [tree.tokens[i]]

    for i in range(len(tree.tokens)):
        kids = [tree.tokens[j] for j, par in enumerate(tree.parents) if par == i]
        if tree.depths[i] == len(shape) - 1:
            assert not kids
            continue
        seq = prompt + path(i)
        ref.start_session("r", seq, p)
        logits, _ = ref._feed(ref.sessions["r"], len(seq) - 1, seq[-1:])
        assert kids == logits[-1].topk(shape[tree.depths[i] + 1]).indices.tolist()
