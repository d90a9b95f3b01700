"""CUDA graphs for the decode hot paths: the draft's one-token step and the target's verify block, on CUDA only.

A small draft in eager PyTorch is launch-bound on a GPU (one token of a 1B model is ~300 kernel launches); a CUDA
graph replays them with one launch. A graph fixes every shape and address, so this module runs the model through
`static_forward`, a forward with no host synchronisation and no data-dependent shapes:
- the KV cache is written by `index_copy_` at flat (slot, position) indices, read back as `[B, ctx, kv, hd]` by
  `index_select` over the batch's slots, and masked by position (key j visible to a query at position p iff
  j <= p). `ctx` is a static bucket (a power of two >= the longest row's length, CTX_MIN at least), chosen on the
  host from lengths the caller already knows: no `int(tensor)` on the hot path;
- a batch is padded to a bucket (BATCH_BUCKETS); padded rows write position 0 of a scratch slot that no session
  uses, and their outputs are dropped;
- RoPE reads tables precomputed to the cache's length.

`GraphRunner` captures one graph per (batch bucket, rows per sequence, ctx bucket), lazily on first use, all in
one memory pool, and replays it after copying the inputs into the graph's static buffers. Shapes without a graph
(more rows than the largest bucket, a width that is not a verify width, a feature draft, a CPU model) take
`static_forward` eagerly, or the caller's own path (`GraphRunner.supports`). The replay and the eager
`static_forward` run the same kernels on the same inputs, so they agree bitwise (tests/test_gpu_graphs.py checks
it on a GPU; scripts/gpu_check.py reports it). `static_forward` and `CausalLM.forward` compute the same function up
to summation order (attention over `ctx` keys, the masked ones contributing zero).

The switch: `specdec.common.settings` `cuda_graphs` (SPECDEC_CUDA_GRAPHS=0 turns graphs off;
`GraphRunner(enabled=False)` too). Nothing here runs on a CPU model: the CPU path is untouched.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from specdec.common import settings

BATCH_BUCKETS = (1, 2, 4, 8)  # sessions per draft step / verify batch that get a graph
VERIFY_WIDTHS = (1, 2, 3, 4, 5, 6, 7, 8, 9)  # rows per sequence that get a graph: a decode step (1) and γ+1 ≤ 9
CTX_MIN = 128  # the smallest key-count bucket
MAX_GRAPHS = 64  # captures kept per runner (each holds its activations in the shared pool)


def graphs_enabled() -> bool:
    """The `cuda_graphs` switch of `specdec.common.settings` (SPECDEC_CUDA_GRAPHS)."""
    return settings.get().cuda_graphs


def batch_bucket(rows: int, buckets: tuple[int, ...] = BATCH_BUCKETS) -> int | None:
    """The smallest bucket >= rows, or None above the largest."""
    return next((b for b in buckets if b >= rows), None)


def ctx_bucket(kv_len: int, max_len: int) -> int | None:
    """The key count a forward whose longest row holds `kv_len` positions attends over: the next power of two from
    CTX_MIN, capped at the cache's `max_len`; None when kv_len exceeds the cache."""
    if kv_len < 1 or kv_len > max_len:
        return None
    return min(max(CTX_MIN, 1 << math.ceil(math.log2(kv_len))), max_len)


def graph_key(batch: int, width: int, kv_len: int, max_len: int, batch_buckets=BATCH_BUCKETS,
              widths=VERIFY_WIDTHS) -> tuple[int, int, int] | None:
    """(batch bucket, width, ctx bucket) of a forward that a graph can serve, or None (eager)."""
    b, c = batch_bucket(batch, batch_buckets), ctx_bucket(kv_len, max_len)
    if b is None or c is None or width not in widths:
        return None
    return b, width, c


def rope_cache_tables(model, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin with rotate_half's sign folded in) for positions 0..n-1, as `CausalLM._rope` builds them."""
    model._rope(torch.tensor([[n - 1]], device=model.device))  # fills the model's cache to at least n
    cos, sin_signed = model._rope_cache
    return cos[:n], sin_signed[:n]


def _attention(attn, x, cos, sin, kc, vc, flat_idx, slots, mask, ctx: int):
    """One layer's attention with no host sync: q/k/v, RoPE, the K/V written at `flat_idx` (slot * max_len +
    position, [B * S]), attention over the first `ctx` positions of each row's slot under `mask`."""
    B, S, _ = x.shape
    cfg = attn.cfg
    h, kvh, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    if attn.qkv_proj is not None:
        qkv = attn.qkv_proj(x)
        qk, v = qkv[..., :(h + kvh) * hd], qkv[..., (h + kvh) * hd:]
    else:
        qk, v = torch.cat((attn.q_proj(x), attn.k_proj(x)), dim=-1), attn.v_proj(x)
    qk, v = qk.view(B, S, h + kvh, hd), v.view(B, S, kvh, hd)
    if cfg.qk_norm:
        qk = torch.cat((attn.q_norm(qk[:, :, :h].contiguous()), attn.k_norm(qk[:, :, h:].contiguous())), dim=2)
    qk = qk * cos.unsqueeze(2) + qk.roll(hd // 2, dims=-1) * sin.unsqueeze(2)
    q, k = qk.split((h, kvh), dim=2)
    n_slots, max_len = kc.shape[0], kc.shape[1]
    kc.view(n_slots * max_len, kvh, hd).index_copy_(0, flat_idx, k.reshape(B * S, kvh, hd).to(kc.dtype))
    vc.view(n_slots * max_len, kvh, hd).index_copy_(0, flat_idx, v.reshape(B * S, kvh, hd).to(vc.dtype))
    keys = kc[:, :ctx].index_select(0, slots).transpose(1, 2)  # [B, kvh, ctx, hd]
    values = vc[:, :ctx].index_select(0, slots).transpose(1, 2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask, enable_gqa=kvh != h)
    return attn.o_proj(out.transpose(1, 2).reshape(B, S, -1))


def supports_model(model) -> bool:
    """Whether `static_forward` serves this model: no feature-draft input (its features are per call)."""
    return getattr(model, "fc", None) is None


@torch.inference_mode()
def static_forward(model, kv, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, ctx: int,
                   cos_tab: torch.Tensor, sin_tab: torch.Tensor,
                   compact_logits: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`CausalLM.forward` for a decode step or verify block without host syncs: tokens/positions [B, S] long,
    slots [B] long, all on the model's device; every position < ctx <= kv.max_len; cos/sin tables from
    `rope_cache_tables`; `compact_logits` as `CausalLM.forward`'s. → (logits fp32 [B, S, V], hidden [B, S, D])."""
    B, S = tokens.shape
    cos, sin = cos_tab[positions], sin_tab[positions]
    key_pos = torch.arange(ctx, device=tokens.device)
    mask = (key_pos[None, None, :] <= positions[:, :, None]).unsqueeze(1)  # [B, 1, S, ctx]
    flat_idx = (slots[:, None] * kv.max_len + positions).reshape(B * S)
    x = model.model.embed_tokens(tokens if model.to_compact is None else model.to_compact[tokens])
    for i, layer in enumerate(model.model.layers):
        a = _attention(layer.self_attn, layer.input_layernorm(x), cos, sin, kv.k[i], kv.v[i], flat_idx, slots,
                       mask, ctx)
        x, hn = layer.post_attention_layernorm(x, a)
        x = x + layer.mlp(hn)
    hidden = model.model.norm(x)
    if compact_logits:
        return model.lm_head(hidden).float(), hidden
    return model.full_logits(hidden), hidden


class _Graph:
    def __init__(self, runner: "GraphRunner", key: tuple[int, int, int, bool]):
        b, s, ctx, compact = key
        dev = runner.model.device
        self.tokens = torch.zeros((b, s), dtype=torch.long, device=dev)
        self.positions = torch.zeros((b, s), dtype=torch.long, device=dev)
        self.slots = torch.full((b,), runner.scratch_slot, dtype=torch.long, device=dev)
        self.ctx = ctx
        self.graph = torch.cuda.CUDAGraph()

        def run():
            return static_forward(runner.model, runner.kv, self.tokens, self.positions, self.slots, ctx, runner.cos,
                                  runner.sin, compact)

        with torch.cuda.device(dev):  # the model's GPU, whichever is current on this thread
            stream = torch.cuda.Stream(device=dev)
            stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(stream):  # warm-up off the capture: lazy inits, cuBLAS handles, workspace
                for _ in range(2):
                    run()
            torch.cuda.current_stream(dev).wait_stream(stream)
            # thread_local: another thread's CUDA work meanwhile (a second worker in this process) is no error
            with torch.inference_mode(), torch.cuda.graph(self.graph, pool=runner.pool,
                                                          capture_error_mode="thread_local"):
                self.logits, self.hidden = run()
        self.device = dev

    def replay(self, tokens, positions, slots, scratch_slot: int):
        B, S = tokens.shape
        self.tokens[:B].copy_(tokens, non_blocking=True)
        self.positions[:B].copy_(positions, non_blocking=True)
        self.slots[:B].copy_(slots, non_blocking=True)
        if B < self.tokens.shape[0]:  # padded rows: position 0 of the scratch slot
            self.tokens[B:].zero_()
            self.positions[B:].zero_()
            self.slots[B:].fill_(scratch_slot)
        with torch.cuda.device(self.device):
            self.graph.replay()
        return self.logits[:B], self.hidden[:B]


class GraphRunner:
    """Captured decode/verify forwards of one CUDA model over its KV slots (module docstring).

    `scratch_slot`: a KV slot no session uses (padded rows write there). `forward(tokens, positions, slots,
    kv_len)` takes device tensors and the longest row's length (host-known: the workers track it) and returns
    (logits, hidden) of the real rows, from a graph where one serves the shape, else from `static_forward` run
    eagerly. The returned tensors of a replay are the graph's own buffers: valid until the next replay of that
    graph, so copy or consume them first."""

    def __init__(self, model, kv, scratch_slot: int, batch_buckets=BATCH_BUCKETS, widths=VERIFY_WIDTHS,
                 enabled: bool | None = None):
        if not 0 <= scratch_slot < kv.num_slots:
            raise ValueError(f"scratch_slot {scratch_slot} is not a slot of the cache ({kv.num_slots} slots)")
        self.model, self.kv, self.scratch_slot = model, kv, scratch_slot
        self.batch_buckets, self.widths = tuple(batch_buckets), tuple(widths)
        on = graphs_enabled() if enabled is None else enabled
        self.enabled = bool(on and model.device.type == "cuda" and supports_model(model))
        self.graphs: dict[tuple[int, int, int, bool], _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.enabled else None
        self.cos, self.sin = rope_cache_tables(model, kv.max_len) if supports_model(model) else (None, None)
        self.replays = self.eager_calls = 0  # counters (the check reports them; tests read them)

    def key(self, batch: int, width: int, kv_len: int, compact: bool = False) -> tuple[int, int, int, bool] | None:
        """The graph that would serve this shape, or None (eager)."""
        if not self.enabled:
            return None
        k = graph_key(batch, width, kv_len, self.kv.max_len, self.batch_buckets, self.widths)
        return None if k is None else (*k, bool(compact))

    def capture(self, key: tuple[int, int, int, bool]) -> None:
        """Capture the graph of `key` now (ahead of traffic: a capture costs a few forwards)."""
        if key not in self.graphs:
            if len(self.graphs) >= MAX_GRAPHS:
                raise RuntimeError(f"more than {MAX_GRAPHS} CUDA graphs requested; narrow the buckets")
            self.graphs[key] = _Graph(self, key)

    def try_forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, kv_len: int,
                    compact: bool = False):
        """A graph replay where one serves (or can still be captured for) this shape; else None, and the caller
        runs its own eager path (the workers: `CausalLM.forward`)."""
        B, S = tokens.shape
        key = self.key(B, S, kv_len, compact)
        if key is None or (key not in self.graphs and len(self.graphs) >= MAX_GRAPHS):
            return None
        self.capture(key)
        self.replays += 1
        return self.graphs[key].replay(tokens, positions, slots, self.scratch_slot)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, kv_len: int,
                compact: bool = False):
        """`try_forward`, else `static_forward` run eagerly (the same function: what the check compares)."""
        out = self.try_forward(tokens, positions, slots, kv_len, compact)
        if out is not None:
            return out
        self.eager_calls += 1
        ctx = ctx_bucket(kv_len, self.kv.max_len)
        if ctx is None:
            raise ValueError(f"kv_len {kv_len} is beyond the KV cache ({self.kv.max_len} positions)")
        return static_forward(self.model, self.kv, tokens, positions, slots, ctx, self.cos, self.sin, compact)
