"""Greedy token-tree speculative decoding (in process): the draft proposes a tree, the target verifies every
branch in one forward.

A tree of shape (k_0, k_1, ...) holds, at depth d, the draft's top-k_d tokens after each depth-(d-1) node. Nodes
are numbered breadth first; `parents[i]` is node i's parent (-1: the pending token, the root). Verification is
greedy and exact: starting at the root, the target's argmax after the current node is accepted when it is one of
the node's children, and the walk goes on from there; the first argmax that is not a child is the bonus token. So
the output is the target's greedy output, as with a chain (a chain is the shape (1, 1, ..., 1)).

Why trees: on a CPU with native bf16 GEMMs, a verify forward of 20 rows costs about what 4 rows do
(docs/benchmarks.md, "Target dtype"), and the draft's top-2..4 hold the target's token far more often than its
top-1 (`experiments/tree_headroom.py`). Sampling (T > 0) needs multi-draft rejection sampling and is not supported:
use sd there.

K/V of tree rows go to scratch cache indices right after the committed prefix (`CausalLM.forward(cache_at=...,
attn_mask=...)`: RoPE positions are the nodes' depths, attention sees the prefix and the node's ancestors). After
the verify, the accepted path's K/V are moved into place (`KVSlots.move`); the draft simply re-feeds the accepted
tokens with its next call.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from specdec.errors import InvalidRequestError
from specdec.penalties import adjusts
from specdec.run_state import _Run
from specdec.schedule import GenerationRequest
from specdec.worker_base import Worker, feature_size


def parse_shape(spec: str | tuple[int, ...]) -> tuple[int, ...]:
    shape = tuple(int(x) for x in spec.split(",")) if isinstance(spec, str) else tuple(spec)
    if not shape or any(k < 1 for k in shape):
        raise InvalidRequestError("tree", f"a tree shape is top-k per depth, each >= 1 (e.g. 4,2,1); got {spec!r}")
    return shape


def tree_size(shape: tuple[int, ...]) -> int:
    return sum(math.prod(shape[:d + 1]) for d in range(len(shape)))


@dataclass
class DraftTree:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)  # -1: child of the root (the pending token)
    depths: list[int] = field(default_factory=list)


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """[N, N] bool: node i sees node j iff j is i or one of its ancestors (parents precede children)."""
    n = len(parents)
    m = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            if p >= i:
                raise ValueError("parents must precede their children")
            m[i] |= m[p]
    return m


def tree_attention_mask(prefix: int, parents: list[int], lead: int = 0) -> torch.Tensor:
    """Mask for `lead` ordinary rows (causal, after `prefix` cached tokens) followed by the tree's nodes, which see
    the prefix, every lead row and their own ancestors: [lead + N, prefix + lead + N] bool."""
    n = len(parents)
    S = lead + n
    m = torch.zeros((S, prefix + S), dtype=torch.bool)
    m[:, :prefix] = True
    m[:lead, prefix:prefix + lead] = torch.ones((lead, lead), dtype=torch.bool).tril()
    m[lead:, prefix:prefix + lead] = True
    m[lead:, prefix + lead:] = ancestor_mask(parents)
    return m


def walk_greedy(tree: DraftTree, argmax: list[int]) -> tuple[list[int], int]:
    """argmax[0]: the target's greedy token after the root; argmax[1 + i]: after node i.
    → (accepted node indices, root to leaf; the bonus token)."""
    children: dict[int, dict[int, int]] = {}
    for i, (t, p) in enumerate(zip(tree.tokens, tree.parents)):
        children.setdefault(p, {}).setdefault(t, i)  # duplicate siblings: the first wins
    path, node = [], -1
    while True:
        want = argmax[node + 1]
        nxt = children.get(node, {}).get(want)
        if nxt is None:
            return path, want
        path.append(nxt)
        node = nxt


def _require_greedy(worker: Worker, session_id: str):
    s = worker._get(session_id)
    if not s.params.greedy:
        raise InvalidRequestError("mode", "tree drafting verifies greedily; use sd/pacer for temperature > 0")
    if feature_size(worker.model):
        raise InvalidRequestError("mode", "tree drafting does not feed a feature draft's features; use sd")
    if adjusts(s.params) or s.params.grammar:
        raise InvalidRequestError("mode", "tree drafting verifies raw argmaxes: no penalties, logit_bias, "
                                          "min_tokens, allowed_token_ids or structured output; use sd")
    return s


@torch.inference_mode()
def draft_tree(worker: Worker, session_id: str, base_position: int, append: list[int],
               shape: tuple[int, ...]) -> DraftTree:
    """Feed `append` at base_position (it ends with the pending token), then grow the tree depth by depth: one
    forward per depth over the previous depth's nodes, written to scratch cache indices past the session's end."""
    s = _require_greedy(worker, session_id)
    if not append:
        raise InvalidRequestError("append", "send at least the pending token to draft from")
    worker._check_tokens("append", append)
    worker._check_context(base_position + len(append) + tree_size(shape), "this tree")
    worker._truncate(s, base_position)
    logits, _ = worker._feed(s, base_position, append)
    L = len(s.tokens)  # the tree's scratch starts here; s.tokens is untouched, so the next call overwrites it
    tree = DraftTree()
    rows, parents_of_rows = logits[-1:], [-1]
    dev, slot = worker.model.device, torch.tensor([s.slot], device=worker.model.device)
    for d, k in enumerate(shape):
        start = len(tree.tokens)
        top = rows.topk(k, dim=-1).indices.tolist()
        for r, par in enumerate(parents_of_rows):
            for t in top[r]:
                tree.tokens.append(t)
                tree.parents.append(par)
                tree.depths.append(d)
        if d == len(shape) - 1:
            break
        new = list(range(start, len(tree.tokens)))  # this depth's nodes: forward them to get their children
        mask = tree_attention_mask(L, tree.parents)[start:, :L + len(tree.tokens)].to(dev)
        toks = torch.tensor([[tree.tokens[i] for i in new]], device=dev)
        pos = torch.full((1, len(new)), L + d, device=dev)
        rows, _ = worker.model(toks, pos, slot, worker.kv, cache_at=L + start, attn_mask=mask)
        rows, parents_of_rows = rows[0], new
    return tree


@torch.inference_mode()
def verify_tree(worker: Worker, session_id: str, base_position: int, feed: list[int],
                tree: DraftTree) -> tuple[list[int], int]:
    """Forward `feed` (ending with the pending token) and every tree node in one forward; walk the tree greedily;
    keep the accepted path's K/V. → (accepted tokens, the bonus token)."""
    s = _require_greedy(worker, session_id)
    if not feed:
        raise InvalidRequestError("feed", "send the pending token in feed")
    worker._check_tokens("feed", feed)
    worker._check_tokens("draft_tokens", tree.tokens)
    worker._check_context(base_position + len(feed) + len(tree.tokens) + 1, "this verify")
    worker._truncate(s, base_position)
    dev, F = worker.model.device, len(feed)
    toks = torch.tensor([feed + tree.tokens], device=dev)
    pos = torch.tensor([list(range(base_position, base_position + F))
                        + [base_position + F + d for d in tree.depths]], device=dev)
    mask = tree_attention_mask(base_position, tree.parents, lead=F).to(dev)
    logits, _ = worker.model(toks, pos, torch.tensor([s.slot], device=dev), worker.kv, cache_at=base_position,
                             attn_mask=mask)
    argmax = logits[0, F - 1:].argmax(-1).tolist()
    path, bonus = walk_greedy(tree, argmax)
    at = base_position + F
    worker.kv.move(s.slot, [at + i for i in path], list(range(at, at + len(path))))
    accepted = [tree.tokens[i] for i in path]
    s.tokens.extend(feed + accepted)
    s.last_row = logits[0, F + path[-1] if path else F - 1]
    return accepted, bonus


@dataclass
class TreeStats:
    new_tokens: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_s: float = 0.0
    target_s: float = 0.0

    @property
    def mean_accepted_length(self) -> float:  # tokens per target forward, bonus included
        return (self.accepted + self.rounds) / max(self.rounds, 1)


def generate_tree(draft_worker: Worker, target_worker: Worker, prompt_ids: list[int], max_new_tokens: int,
                  shape: tuple[int, ...], eos_token_ids: tuple[int, ...] = ()) -> tuple[list[int], TreeStats]:
    """Greedy tree speculative decoding of one request on two workers (sequential rounds). → (new tokens, stats)."""
    run = _Run(GenerationRequest(list(prompt_ids), max_new_tokens, eos_token_ids=tuple(eos_token_ids)).validate(),
               None)  # the schedules' history and commit rule (max_new_tokens, EOS)
    sid, st = run.req.session_id, TreeStats()
    target_worker.start_session(sid, prompt_ids, run.req.params)
    draft_worker.start_session(sid, prompt_ids, run.req.params)
    draft_len = len(prompt_ids) - 1  # tokens whose K/V the draft holds
    try:
        while run.finish is None:
            seq = run.history
            t0 = time.perf_counter()
            tree = draft_tree(draft_worker, sid, draft_len, seq[draft_len:], shape)
            draft_len = len(seq)
            t1 = time.perf_counter()
            accepted, bonus = verify_tree(target_worker, sid, len(seq) - 1, [seq[-1]], tree)
            st.draft_s += t1 - t0
            st.target_s += time.perf_counter() - t1
            st.rounds += 1
            st.drafted += len(tree.tokens)
            st.accepted += len(accepted)
            run.commit(accepted + [bonus])
    finally:
        target_worker.end_session(sid)
        draft_worker.end_session(sid)
    st.new_tokens = len(run.generated)
    return run.generated, st
