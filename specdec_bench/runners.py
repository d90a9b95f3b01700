"""What one benchmark configuration runs: the in-process engine, Hugging Face assisted generation, or the
embedded gRPC/Ray stack. Every runner is `async run(ids, temperature, seed, max_new_tokens) -> Sample`.

Threads are set in the thread that computes: the engine's worker threads (`threads_per_model`), a dedicated
executor thread per thread count for Hugging Face, and `--threads` of each model server process for the stack.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch
from safetensors.torch import load_file

from specdec.common.threads import set_thread_count
from specdec.decoding.sampling import SamplingParams
from specdec.modeling.dtypes import auto_dtype
from specdec.scheduling.request import GenerationRequest
from specdec_rpc.pb import generation_pb2, generation_pb2_grpc

STACK_STAT_FIELDS = ("rounds", "target_forwards", "draft_tokens", "accepted_tokens", "mean_accepted_length",
                     "draft_busy_s", "target_busy_s", "network_s", "wall_s", "wasted_draft_tokens",
                     "target_only_rounds")
# a request's network time per link: coordinator <-> draft, coordinator <-> target, and draft <-> target (the
# direct data plane); a field the coordinator's GenerationStats lacks reads as 0
LINK_STAT_FIELDS = ("draft_network_s", "target_network_s", "peer_network_s")


def stack_stats(stats) -> dict:
    """A GenerationStats message → the bench's stats dict (STACK_STAT_FIELDS and LINK_STAT_FIELDS)."""
    known = stats.DESCRIPTOR.fields_by_name
    return {f: getattr(stats, f) if f in known else 0.0 for f in STACK_STAT_FIELDS + LINK_STAT_FIELDS}


@dataclass(frozen=True)
class Config:
    name: str  # unique label, e.g. "sd g=3 (stack)"
    kind: str  # engine | hf | stack
    mode: str  # ar | hf_assisted | sd | pacer | pearl | pacer_pearl
    threads: int  # torch threads (ar/hf: of the process; disaggregated: per model)
    gamma: int | None = None
    placement: str = "in-process"  # in-process | stack


@dataclass
class Sample:
    tokens: int
    wall_s: float  # measured by the bench (client side for the stack)
    stats: dict = field(default_factory=dict)  # the schedule's GenerationStats (empty for Hugging Face)
    token_ids: list[int] = field(default_factory=list)
    ttft_s: float | None = None  # time to the first token (streamed requests only)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0


# ---- in-process engine ----------------------------------------------------------------------------------------
class EngineRunner:
    def __init__(self, engine, cfg: Config, eos: tuple[int, ...]):
        self.engine, self.cfg, self.eos = engine, cfg, eos

    async def run(self, ids: list[int], temperature: float, seed: int, max_new_tokens: int) -> Sample:
        kw = {"gamma": self.cfg.gamma} if self.cfg.gamma else {}
        req = GenerationRequest(prompt_ids=list(ids), max_new_tokens=max_new_tokens, mode=self.cfg.mode,
                                eos_token_ids=self.eos, params=SamplingParams(temperature=temperature, seed=seed), **kw)
        t0 = time.perf_counter()
        res = await self.engine.agenerate(req)
        wall = time.perf_counter() - t0
        return Sample(len(res.token_ids), wall, res.stats.to_dict(), list(res.token_ids))


# ---- Hugging Face assisted generation (the peer baseline) -----------------------------------------------------
def _read_state(d: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        if f.name.startswith("vocab_subset"):
            continue
        state.update(load_file(str(f)))
    return state


class SubsetHead(torch.nn.Module):
    """The compact output head: logits for the subset rows only (the same cost as specdec's draft head),
    scattered into a full-vocabulary tensor filled with -inf."""

    def __init__(self, weight: torch.Tensor, subset: torch.Tensor, full_vocab: int):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.register_buffer("subset", subset, persistent=False)
        self.full_vocab = full_vocab

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        compact = torch.nn.functional.linear(h, self.weight)
        full = compact.new_full((*compact.shape[:-1], self.full_vocab), -math.inf)
        full[..., self.subset] = compact
        return full


def load_hf(model_dir: str | Path, dtype: torch.dtype = torch.float32):
    """`AutoModelForCausalLM.from_pretrained`; a config without `model_type` (tiny test models) is read as Llama."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM  # lazy: ~1 s, the HF baseline only

    raw = json.loads((Path(model_dir) / "config.json").read_text())
    if "model_type" not in raw:
        return LlamaForCausalLM.from_pretrained(str(model_dir), config=LlamaConfig(**raw), dtype=dtype).eval()
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()


def load_hf_draft(draft_dir: str | Path):
    """The draft as a Hugging Face model over the full vocabulary.

    A plain Llama directory loads as is. The shipped draft stores a compact vocabulary subset
    (docs/design/distillation.md: `specdec_vocab_subset` in config.json, or a `specdec.vocab_subset` tensor):
    Hugging Face cannot load that as a standard LlamaForCausalLM with the target's vocabulary, so the same weights
    are expanded in memory: input embeddings gathered to full ids (ids outside the subset -> the OOV row) and the
    compact output head kept (`SubsetHead`: the same head cost as specdec's draft) with logits -inf outside the
    subset, exactly the distribution `specdec` drafts from.
    """
    from transformers import LlamaConfig, LlamaForCausalLM  # lazy: ~1 s, the HF baseline only

    d = Path(draft_dir)
    raw = json.loads((d / "config.json").read_text())
    state = _read_state(d)
    subset = state.pop("specdec.vocab_subset", None)
    if subset is None and raw.get("specdec_vocab_subset"):
        subset = load_file(str(d / raw["specdec_vocab_subset"]))["vocab_subset"]
    if subset is None:
        return load_hf(d)
    subset = subset.long()
    full_v = int(raw.get("specdec_full_vocab_size") or raw["vocab_size"])
    emb = state["model.embed_tokens.weight"].float()
    if emb.shape[0] == len(subset):  # compact input ids too: full id -> compact row (OOV row elsewhere)
        oov = int(raw.get("specdec_oov_compact_id", 0))
        to_compact = torch.full((full_v,), oov, dtype=torch.long)
        to_compact[subset] = torch.arange(len(subset))
        state["model.embed_tokens.weight"] = emb[to_compact]
    head = state.pop("lm_head.weight", None)
    if head is None:  # tied compact head
        head = emb
    cfg_kw = {k: v for k, v in raw.items() if not k.startswith("specdec_")}
    cfg_kw.update(vocab_size=full_v, tie_word_embeddings=False)
    model = LlamaForCausalLM(LlamaConfig(**cfg_kw))
    model.lm_head = SubsetHead(head.float(), subset, full_v)
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    missing = [m for m in missing if "rotary" not in m and not m.startswith("lm_head.")]
    if missing or [u for u in unexpected if "rotary" not in u]:
        raise ValueError(f"cannot build a Hugging Face draft from {d}: missing={missing[:4]} unexpected={unexpected[:4]}")
    return model.eval()


class HFModels:
    """Target + draft as transformers models, shared by the 1- and 2-thread HF runners."""

    def __init__(self, target_dir: str | Path, draft_dir: str | Path, eos: tuple[int, ...]):
        # the same dtypes our servers pick (`auto`), so both sides run the same arithmetic
        self.target = load_hf(target_dir, auto_dtype("cpu", "target"))
        self.draft = load_hf_draft(draft_dir)
        self.eos = list(eos)
        self.compact_draft = isinstance(self.draft.lm_head, SubsetHead)


class HFRunner:
    def __init__(self, models: HFModels, cfg: Config, pool: concurrent.futures.ThreadPoolExecutor | None = None):
        """`pool`: a one-thread executor already set to cfg.threads to run on (shared, not shut down here)."""
        self.m, self.cfg = models, cfg
        self.owns_pool = pool is None
        self.pool = pool or concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix=f"hf{cfg.threads}", initializer=set_thread_count, initargs=(cfg.threads,))

    def _generate(self, ids, temperature, seed, max_new_tokens) -> Sample:
        x = torch.tensor([ids])
        kw = dict(do_sample=False)
        if temperature > 0:
            kw = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
        torch.manual_seed(seed)
        pad = self.m.eos[0] if self.m.eos else 0
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.m.target.generate(x, attention_mask=torch.ones_like(x), assistant_model=self.m.draft,
                                         max_new_tokens=max_new_tokens, eos_token_id=self.m.eos or None,
                                         pad_token_id=pad, **kw)
        wall = time.perf_counter() - t0
        new = out[0, len(ids):].tolist()
        return Sample(len(new), wall, {}, new)

    async def run(self, ids, temperature, seed, max_new_tokens) -> Sample:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.pool, self._generate, ids, temperature, seed, max_new_tokens)

    def close(self) -> None:
        if self.owns_pool:
            self.pool.shutdown(wait=False)


# ---- the embedded gRPC / Ray stack ----------------------------------------------------------------------------
class StackClient:
    """One grpc.aio channel to the coordinator; a runner per configuration shares it."""

    def __init__(self, address: str):
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = generation_pb2_grpc.GenerationServiceStub(self.channel)

    async def generate(self, ids, mode, gamma, temperature, seed, max_new_tokens, **fields) -> Sample:
        """`fields`: any other GenerateRequest fields (e.g. pearl_first_block)."""
        r = generation_pb2.GenerateRequest(prompt_token_ids=list(ids), max_new_tokens=max_new_tokens,
                                           temperature=temperature, top_k=0, seed=seed, mode=mode, **fields)
        if gamma:
            r.gamma = gamma
        t0 = time.perf_counter()
        resp = await self.stub.Generate(r, timeout=600)
        wall = time.perf_counter() - t0
        return Sample(len(resp.token_ids), wall, stack_stats(resp.stats), list(resp.token_ids))

    async def stream(self, ids, mode, gamma, temperature, seed, max_new_tokens) -> Sample:
        """As `generate`, through GenerateStream: the Sample also carries the time to the first token."""
        r = generation_pb2.GenerateRequest(prompt_token_ids=list(ids), max_new_tokens=max_new_tokens,
                                           temperature=temperature, top_k=0, seed=seed, mode=mode)
        if gamma:
            r.gamma = gamma
        token_ids: list[int] = []
        ttft = stats = None
        t0 = time.perf_counter()
        async for part in self.stub.GenerateStream(r, timeout=600):
            if part.token_ids and ttft is None:
                ttft = time.perf_counter() - t0
            token_ids += part.token_ids
            if part.HasField("stats"):
                stats = part.stats
        wall = time.perf_counter() - t0
        return Sample(len(token_ids), wall, stack_stats(stats) if stats is not None else {}, token_ids, ttft)

    async def close(self) -> None:
        await self.channel.close()


class StackRunner:
    def __init__(self, client: StackClient, cfg: Config, stream: bool = False):
        """`stream`: through GenerateStream (the time to the first token measured), else Generate."""
        self.client, self.cfg, self.stream = client, cfg, stream

    async def run(self, ids, temperature, seed, max_new_tokens) -> Sample:
        call = self.client.stream if self.stream else self.client.generate
        return await call(ids, self.cfg.mode, self.cfg.gamma, temperature, seed, max_new_tokens)
