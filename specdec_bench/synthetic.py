"""Synthetic acceptance (`specdec bench --synthetic-acceptance 0.6,0.7,0.8,0.9`): what a draft/target pair of real
shapes gains through specdec over the target alone, at a known acceptance rate.

A pair with random weights (the only pair of Llama-3.1-8B / Llama-3.2-1B shapes a machine without their
checkpoints has) accepts no draft token, so speculation cannot be timed on it. The synthetic pair keeps the real
models and every cost they have, and only steers what the draft proposes:

- the target is the target, untouched;
- the draft (`SyntheticDraftWorker`) runs the real draft model's forward at every drafted position (eager or a
  CUDA graph replay, as any draft), then rewrites that position's logits row so that its argmax is the target's own
  next greedy token with probability α, else another token (the target's + 1). The target's next token comes from
  a reference continuation: each prompt's `ar` output, computed first by the benchmark. The rewrite costs a few
  element-wise operations on the row (microseconds on a GPU), beside the draft's forward;
- the coin is a hash of (seed, the session's prompt, the absolute position): re-drafting a position (PEARL's
  discarded speculation, a retry) proposes the same token. Off the reference path (once a wrong proposal was fed,
  every later position of that draft is rejected whatever it proposes) the draft model's own argmax stands.

The target verifies every proposal as always, so the output is the target's greedy output whatever the draft
proposes: every run is checked against `ar`'s. The first drafted token of each verified block is accepted with
probability α; a block of γ tokens with independent coins has α + α² + … + α^γ tokens accepted on average,
so the accepted fraction of drafted tokens is α(1 − α^γ) / (γ(1 − α)), not α. Greedy requests only (a sampled
request is refused). Every result it produces is labelled "synthetic acceptance": its speedups are those of a draft
that is right α of the time, not of any trained draft.

Where it runs:

- in process: `synthetic_engine` builds a `specdec.engine.Engine` whose draft worker is the synthetic one;
- through the services: the draft replica builds its worker with `--worker-factory
  specdec_bench.synthetic:replica_worker` (draft_service/config.py), which reads the references and α from
  `synthetic_acceptance.json` in the replica's model directory, again at each session start after the file changed
  (one replica serves a whole sweep of α).

`run_synthetic` is the benchmark: it builds the pair (`--shapes tiny`, or `llama-8b/1b` with random weights for a
GPU), computes the references with `ar`, then times `ar`, `sd` at each γ, `pearl`, `pacer` and `pacer_pearl` (with
an untrained, random pre-verifier: its stop decisions are arbitrary, so these rows time the modes' machinery, not
what a trained pre-verifier gains) at each α, in process and through the embedded stack.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import math
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specdec.common.errors import InvalidRequestError
from specdec.decoding.penalties import adjusts
from specdec.decoding.sampling import SamplingParams
from specdec.workers.base import Session
from specdec.workers.draft import DraftWorker
from specdec.workers.drafting import row_index

LABEL = "synthetic acceptance"
SPEC_FILE = "synthetic_acceptance.json"  # in the draft replica's model directory (`replica_worker`)
FACTORY = "specdec_bench.synthetic:replica_worker"  # the draft replica's --worker-factory
PLACEMENTS = ("in-process", "stack")
REFERENCE_MARGIN = 16  # reference tokens past max_new_tokens: a draft looking past the end still has them

# the preset shapes: (target, draft) as Hugging Face configs (those of meta-llama/Llama-3.1-8B-Instruct and
# Llama-3.2-1B-Instruct; tests/data/configs holds the full files), or "tiny" (specdec_bench/tiny.py)
_LLAMA_COMMON = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
                 "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
                 "vocab_size": 128256, "num_attention_heads": 32, "num_key_value_heads": 8, "bos_token_id": 128000,
                 "eos_token_id": [128001, 128008, 128009]}
LLAMA_8B = {**_LLAMA_COMMON, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
            "tie_word_embeddings": False,
            "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192, "rope_type": "llama3"}}
LLAMA_1B = {**_LLAMA_COMMON, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
            "head_dim": 64, "tie_word_embeddings": True,
            "rope_scaling": {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192, "rope_type": "llama3"}}
SHAPES = {"tiny": "tiny random pair: target 2 layers × 64, draft 1 layer × 32, 256 tokens, fp32 (CPU)",
          "llama-8b/1b": "random weights of Llama-3.1-8B (target) and Llama-3.2-1B (draft) shapes, bf16 on a GPU"}


# ---- the references and the coin ----------------------------------------------------------------------------------
def prompt_digest(prompt: list[int] | tuple[int, ...]) -> bytes:
    return hashlib.blake2b(",".join(map(str, prompt)).encode(), digest_size=16).digest()


def coin(seed: int, digest: bytes, position: int) -> float:
    """A uniform draw in [0, 1) fixed by (seed, the prompt's digest, the absolute position)."""
    h = hashlib.blake2b(digest + f"|{seed}|{position}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") / 2.0 ** 64


@dataclass
class Reference:
    continuation: list[int]  # the target's greedy output after the prompt (`ar`'s)
    digest: bytes  # prompt_digest of the prompt: keys its coins


@dataclass
class SyntheticSpec:
    """What the synthetic draft proposes: the target's next token with probability `alpha` (coins keyed by
    `seed`), on the path of each prompt's reference continuation (`references`: prompt ids → `ar`'s output)."""
    alpha: float
    references: dict[tuple[int, ...], list[int]] = field(default_factory=dict)
    seed: int = 0

    def __post_init__(self):
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"the synthetic acceptance rate must be in [0, 1], got {self.alpha}")
        self.references = {tuple(p): list(c) for p, c in self.references.items()}

    def to_json(self) -> dict:
        return {"label": LABEL, "alpha": self.alpha, "seed": self.seed,
                "references": [{"prompt": list(p), "continuation": c} for p, c in self.references.items()]}

    @classmethod
    def from_json(cls, d: dict) -> SyntheticSpec:
        return cls(float(d["alpha"]), {tuple(r["prompt"]): r["continuation"] for r in d.get("references", ())},
                   int(d.get("seed", 0)))

    def save(self, path: str | Path) -> Path:
        """Written whole, then moved into place: a replica never reads half a file."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_json()))
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> SyntheticSpec:
        return cls.from_json(json.loads(Path(path).read_text()))


# ---- the synthetic draft --------------------------------------------------------------------------------------------
class SyntheticDraftWorker(DraftWorker):
    """A DraftWorker whose greedy proposals are steered to a known acceptance rate (the module docstring).

    The draft model runs as in any DraftWorker; after each forward, the logits row of the position being drafted
    is rewritten (its chosen entry raised above the row's maximum) before the usual drafting step reads it, so
    every later step (the argmax, a pre-verifier's features) sees the steered row. `steered` counts, per drafted
    position: "hit" (the target's token proposed), "miss" (another proposed), "off_path" (the context already left
    the reference), "unlisted" (a prompt without a reference), "unreachable" (the draft's head lacks the token)."""

    def __init__(self, model, spec: SyntheticSpec | None = None, spec_path: str | Path | None = None, **kw):
        kw["lookup"] = None  # prompt lookup would propose without the model: every proposal is steered here
        super().__init__(model, **kw)
        self.spec_path = Path(spec_path) if spec_path is not None else None
        self._stamp: tuple | None = None
        self._refs: dict[tuple[int, ...], Reference] = {}
        self._paths: dict[str, tuple[Session, Reference | None]] = {}  # session id -> (its Session, reference)
        self.steered = dict.fromkeys(("hit", "miss", "off_path", "unlisted", "unreachable"), 0)
        self.spec = SyntheticSpec(0.0)
        if spec is not None:
            self.set_spec(spec)
        self._reload()

    def set_spec(self, spec: SyntheticSpec) -> None:
        """α, the seed and the references from now on (sessions started before keep their reference lookups
        only until they end)."""
        self.spec = spec
        self._refs = {p: Reference(c, prompt_digest(p)) for p, c in spec.references.items()}
        self._paths.clear()

    def _reload(self) -> None:
        """Re-read `spec_path` where it changed since the last read (one stat per session start)."""
        if self.spec_path is None:
            return
        st = os.stat(self.spec_path)
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        if stamp != self._stamp:
            self.set_spec(SyntheticSpec.load(self.spec_path))
            self._stamp = stamp

    def open_session(self, session_id: str, prompt_ids: list[int], params: SamplingParams, reuse: bool = True,
                     output_start: int = 0) -> Session:
        if not params.greedy:
            raise InvalidRequestError("temperature", "this draft replica serves a synthetic acceptance rate (a "
                                                     "benchmark's timing pair) and drafts greedy requests only: "
                                                     "send temperature 0")
        if adjusts(params) or params.grammar:
            raise InvalidRequestError("params", "this draft replica serves a synthetic acceptance rate (a "
                                                "benchmark's timing pair): send requests without penalties, logit "
                                                "bias, allowed or banned tokens, or structured output")
        self._reload()
        return super().open_session(session_id, prompt_ids, params, reuse=reuse, output_start=output_start)

    def _release(self, s: Session) -> None:
        entry = self._paths.get(s.sid)
        if entry is not None and entry[0] is s:
            del self._paths[s.sid]
        super()._release(s)

    def _draft_token(self, c, row, row_hidden, looked):
        if row is not None:
            self._steer(c.s, row)
        return super()._draft_token(c, row, row_hidden, looked)

    def _reference(self, s: Session) -> Reference | None:
        entry = self._paths.get(s.sid)
        if entry is None or entry[0] is not s:
            entry = self._paths[s.sid] = (s, self._refs.get(tuple(s.tokens[:s.output_start])))
        return entry[1]

    def _steer(self, s: Session, row: torch.Tensor) -> None:
        """Raise the steered token's entry of `row` (the logits predicting position len(s.tokens)) above the rest."""
        ref = self._reference(s)
        if ref is None:
            self.steered["unlisted"] += 1
            return
        position = len(s.tokens)
        k = position - s.output_start
        if not 0 <= k < len(ref.continuation) or s.tokens[s.output_start:] != ref.continuation[:k]:
            self.steered["off_path"] += 1  # rejected whatever it proposes: the draft's own argmax stands
            return
        want = ref.continuation[k]
        hit = coin(self.spec.seed, ref.digest, position) < self.spec.alpha
        at = self._row_slot(want, hit, row.shape[-1])
        if at is None:
            self.steered["unreachable"] += 1
            return
        self.steered["hit" if hit else "miss"] += 1
        with torch.inference_mode():  # the forward's logits are inference tensors
            top = row.max()
            row[at] = top + top.abs() + 1.0  # above every entry of the row: the argmax, with no tie

    def _row_slot(self, want: int, hit: bool, n_rows: int) -> int | None:
        """The row entry to raise: the target's token `want` (hit) or another one (miss); None where the draft's
        head has no entry for `want` (a compact head lacking it, a vocabulary with fewer rows)."""
        subset = self._subset
        at = (want if want < n_rows else None) if subset is None else row_index(want, subset)
        if hit:
            return at
        return 0 if at is None else (at + 1) % n_rows  # any token but the target's


def replica_worker(model, **kw) -> SyntheticDraftWorker:
    """The draft replica's worker factory (`--worker-factory specdec_bench.synthetic:replica_worker`): a
    SyntheticDraftWorker reading `synthetic_acceptance.json` from the model's directory."""
    src = getattr(model, "source_dir", None)
    path = Path(src) / SPEC_FILE if src else None
    if path is None or not path.is_file():
        raise FileNotFoundError(f"the synthetic-acceptance draft reads {SPEC_FILE} from its model directory "
                                f"({src or 'none: the model was not loaded from a directory'}); write one with "
                                "specdec_bench.synthetic.SyntheticSpec.save")
    return SyntheticDraftWorker(model, spec_path=path, **kw)


def synthetic_engine(target, draft, spec: SyntheticSpec, preverifier=None, max_sessions: int = 2,
                     max_context: int | None = None, threads_per_model: int | None = 1, inline: bool | None = None,
                     prefix_cache: bool = False):
    """An in-process `Engine` over the pair whose draft worker is a SyntheticDraftWorker (the engine's own draft
    worker, built the same way, with the synthetic one in its place). → the engine; `engine.draft_worker` is the
    synthetic worker (`set_spec` changes α between runs)."""
    from specdec.engine import Engine, LocalDraft
    from specdec.text.pairing import check_pair
    from specdec.text.vocab import fit_draft_vocabulary

    eng = Engine(target, None, max_sessions=max_sessions, max_context=max_context,
                 threads_per_model=threads_per_model, inline=inline, prefix_cache=prefix_cache)
    check_pair(draft, target)
    fit_draft_vocabulary(draft, target.config.vocab_size, preverifier)
    eng.draft_worker = SyntheticDraftWorker(draft, spec=spec, preverifier=preverifier, max_sessions=max_sessions,
                                            max_context=max_context, prefix_cache=prefix_cache)
    eng.draft = LocalDraft(eng.draft_worker, threads_per_model, bool(inline))
    return eng


def expected_acceptance(alpha: float, gamma: int) -> float:
    """The expected accepted fraction of the drafted tokens of fixed blocks of `gamma` (sd): α(1 − α^γ)/(γ(1 − α))."""
    if alpha >= 1.0:
        return 1.0
    return alpha * (1.0 - alpha ** gamma) / (gamma * (1.0 - alpha))


# ---- the pair --------------------------------------------------------------------------------------------------------
def random_model(config: dict, device: str, dtype: torch.dtype):
    """A random-weight CausalLM of a Hugging Face config's shapes, built on the device directly, q/k/v and gate/up
    fused as a load fuses them."""
    from specdec.modeling.model import ModelConfig

    model = random_model_of(ModelConfig.from_hf(dict(config)), device, dtype)
    model.hf_config = dict(config)
    return model


def random_model_of(cfg, device, dtype: torch.dtype):
    """A random-weight CausalLM of a `ModelConfig`, built on the device directly (no fp32 copy on the host), q/k/v
    and gate/up fused as a load fuses them."""
    from specdec.modeling.fusion import fuse_projections_
    from specdec.modeling.model import CausalLM

    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = CausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    fuse_projections_(model)
    return model.eval()


def save_random(model, path: Path) -> Path:
    """A random_model as a model directory a replica loads (config.json + model.safetensors)."""
    from safetensors.torch import save_file

    from specdec.modeling.fusion import unfused_state

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(model.hf_config))
    state = {k: v.detach().to("cpu").contiguous() for k, v in unfused_state(model).items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(path / "model.safetensors"))
    return path


class Pair:
    """The target and draft models (in process) and, once asked, their directories (for the replicas)."""

    def __init__(self, shapes: str, device: str, root: Path):
        from specdec.modeling.model import load_model_dir

        self.shapes, self.device, self.root = shapes, device, root
        if shapes == "tiny":
            from specdec_bench.tiny import build_tiny_model, save_model

            target = build_tiny_model(vocab_size=256, hidden_size=64, seed=1, logit_scale=2.0,
                                      max_position_embeddings=2048)
            draft = build_tiny_model(vocab_size=256, hidden_size=32, num_layers=1, seed=2, logit_scale=2.0,
                                     max_position_embeddings=2048)
            self.dirs = (save_model(target, root / "target"), save_model(draft, root / "draft"))
            # loaded as the replicas load them (fp32: tiny models time the machinery, not a dtype's kernels): the
            # same kernels and bits in process and through the services
            self.dtype = "float32"
            self.target = load_model_dir(self.dirs[0], device=device, dtype=self.dtype, role="target")
            self.draft = load_model_dir(self.dirs[1], device=device, dtype=self.dtype, role="draft")
        elif shapes == "llama-8b/1b":
            dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
            self.dtype = str(dtype).replace("torch.", "")
            self.target = random_model(LLAMA_8B, device, dtype)
            self.draft = random_model(LLAMA_1B, device, dtype)
            self.dirs = None
        else:
            raise ValueError(f"unknown shapes {shapes!r}: use {', '.join(SHAPES)}")

    def directories(self) -> tuple[Path, Path]:
        if self.dirs is None:
            self.dirs = (save_random(self.target, self.root / "target"), save_random(self.draft, self.root / "draft"))
        return self.dirs

    @property
    def vocab_size(self) -> int:
        return self.target.config.vocab_size

    def describe(self) -> dict:
        def one(m):
            c = m.config
            return {"layers": c.num_hidden_layers, "hidden": c.hidden_size, "vocab": c.vocab_size,
                    "dtype": str(m.dtype).replace("torch.", ""),
                    "params_m": round(sum(p.numel() for p in m.parameters()) / 1e6, 1)}
        return {"shapes": self.shapes, "device": self.device, "target": one(self.target), "draft": one(self.draft)}


# ---- the benchmark --------------------------------------------------------------------------------------------------
@dataclass
class SyntheticOptions:
    alphas: tuple[float, ...] = (0.6, 0.7, 0.8, 0.9)
    shapes: str = "tiny"
    device: str = "cpu"
    modes: tuple[str, ...] = ("ar", "sd", "pearl", "pacer", "pacer_pearl")
    gammas: tuple[int, ...] = (2, 4, 6)  # sd's
    placements: tuple[str, ...] = PLACEMENTS
    n_prompts: int = 4
    prompt_len: int = 32
    max_new_tokens: int = 128
    repeats: int = 1
    seed: int = 0
    ray: bool = False  # the stack's coordinator pipelines on Ray (else in this process)
    stack_min_s: float = 0.0  # with a deadline: the stack runs only where this much time is left for it
    keep_going: bool = False  # a stack that fails (to start, or in a run) is a note; the in-process rows stand


@dataclass(frozen=True)
class Cfg:
    mode: str
    gamma: int | None = None

    @property
    def label(self) -> str:
        return f"{self.mode} γ={self.gamma}" if self.gamma else self.mode


@dataclass
class Run:
    placement: str
    alpha: float
    cfg: Cfg
    prompt: int
    rep: int
    tokens: int
    wall_s: float
    exact: bool
    stats: dict


def configs(opts: SyntheticOptions) -> list[Cfg]:
    out = [Cfg("ar")] if "ar" in opts.modes else []
    out += [Cfg("sd", g) for g in opts.gammas if "sd" in opts.modes]
    out += [Cfg(m) for m in ("pearl", "pacer", "pacer_pearl") if m in opts.modes]
    return out


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (length,), generator=gen).tolist() for _ in range(n)]


def _stats(st) -> dict:
    """A GenerationStats (dataclass or proto) → the counts this benchmark reads."""
    app = list(getattr(st, "accepted_per_position", ()) or ())
    return {"rounds": int(st.rounds), "target_forwards": int(st.target_forwards), "drafts": int(st.drafts),
            "draft_tokens": int(st.draft_tokens), "verified_draft_tokens": int(st.verified_draft_tokens),
            "accepted_tokens": int(st.accepted_tokens), "first_accepted": int(app[0]) if app else 0,
            "wasted_draft_tokens": int(st.wasted_draft_tokens)}


class _InProcess:
    name = "in-process"

    def __init__(self, pair: Pair, spec: SyntheticSpec, pv, max_context: int):
        self.engine = synthetic_engine(pair.target, pair.draft, spec, preverifier=pv, max_sessions=2,
                                       max_context=max_context)

    def set_spec(self, spec: SyntheticSpec) -> None:
        self.engine.draft_worker.set_spec(spec)

    async def run(self, prompt: list[int], cfg: Cfg, n: int) -> tuple[list[int], float, dict]:
        from specdec.scheduling.request import GenerationRequest

        req = GenerationRequest(prompt_ids=list(prompt), max_new_tokens=n, params=SamplingParams(temperature=0.0),
                                mode=cfg.mode, gamma=cfg.gamma)
        t0 = time.perf_counter()
        res = await self.engine.agenerate(req)
        _sync(self.engine.target_worker.model.device)
        return list(res.token_ids), time.perf_counter() - t0, _stats(res.stats)

    async def close(self) -> None:
        self.engine.close()


class _Stack:
    """The embedded stack (coordinator, draft and target replicas on loopback): the draft replica's worker is the
    synthetic one (`--worker-factory`), its spec the file in its model directory."""
    name = "stack"

    def __init__(self, pair: Pair, spec: SyntheticSpec, pv_dir: Path | None, opts: SyntheticOptions,
                 max_context: int, timeout_s: float):
        from coordinator.stack import LocalStack

        self.dirs = pair.directories()
        self.spec_path = self.dirs[1] / SPEC_FILE
        spec.save(self.spec_path)
        replica = {"device": opts.device} if opts.device != "cpu" else {}
        self.stack = LocalStack(str(self.dirs[0]), str(self.dirs[1]), str(pv_dir) if pv_dir else None, threads=1,
                                dtype=pair.dtype,
                                use_ray=opts.ray, max_sessions=4, max_context=max_context, prefix_cache=False,
                                prompt_lookup_min_ngram=0, start_timeout_s=timeout_s,
                                draft_options={**replica, "worker_factory": FACTORY}, target_options=dict(replica))
        self.channel = self.stub = None

    async def start(self) -> None:
        import grpc

        from specdec_rpc.pb import generation_pb2_grpc

        await self.stack.start()
        self.channel = grpc.aio.insecure_channel(self.stack.address)
        self.stub = generation_pb2_grpc.GenerationServiceStub(self.channel)

    def set_spec(self, spec: SyntheticSpec) -> None:
        spec.save(self.spec_path)  # the replica re-reads it at its next session start

    async def run(self, prompt: list[int], cfg: Cfg, n: int) -> tuple[list[int], float, dict]:
        from specdec_rpc.pb import generation_pb2

        r = generation_pb2.GenerateRequest(prompt_token_ids=list(prompt), max_new_tokens=n, temperature=0.0,
                                           mode=cfg.mode, ignore_eos=True)
        if cfg.gamma:
            r.gamma = cfg.gamma
        t0 = time.perf_counter()
        resp = await self.stub.Generate(r, timeout=600)
        return list(resp.token_ids), time.perf_counter() - t0, _stats(resp.stats)

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close()
        await self.stack.stop()


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _random_preverifier(pair: Pair, root: Path):
    """An untrained pre-verifier with seeded random weights (its stops are arbitrary: it may only change speed),
    and its directory for the draft replica."""
    from specdec.decoding.preverifier import build_random_preverifier, save_preverifier

    pv = build_random_preverifier(pair.draft.config.hidden_size, seed=7, block_size=2, threshold=0.5)
    path = save_preverifier(pv, root / "preverifier", {"note": f"untrained, random weights ({LABEL} timing only)"})
    return pv, path


async def _placement(place, opts: SyntheticOptions, prompts, cfgs: list[Cfg], deadline, log, notes: list[str],
                     runs: list[Run]) -> None:
    """References with `ar`, a warm-up run of each configuration, then every α × repeat × prompt × configuration
    (the configurations' order rotating) into `runs`, stopping at the deadline."""
    n, ref_n = opts.max_new_tokens, opts.max_new_tokens + REFERENCE_MARGIN
    refs = {}
    for p in prompts:
        refs[tuple(p)] = (await place.run(p, Cfg("ar"), ref_n))[0]
    spec = SyntheticSpec(opts.alphas[0], refs, opts.seed)
    place.set_spec(spec)
    for cfg in cfgs:  # warm-up: CUDA graphs captured, lazy initialisation done, before anything is timed
        await place.run(prompts[0], cfg, n)
    for alpha in opts.alphas:
        spec = SyntheticSpec(alpha, refs, opts.seed)
        place.set_spec(spec)
        k = 0
        for rep in range(opts.repeats):
            for i, p in enumerate(prompts):
                k += 1
                for cfg in cfgs[k % len(cfgs):] + cfgs[:k % len(cfgs)]:
                    if deadline is not None and time.monotonic() > deadline:
                        notes.append(f"{place.name}: cut at α={alpha} by the deadline")
                        return
                    ids, wall, st = await place.run(p, cfg, n)
                    runs.append(Run(place.name, alpha, cfg, i, rep, len(ids), wall, ids == refs[tuple(p)][:n], st))
        log(f"{LABEL}: {place.name} α={alpha} done")


def _check(opts: SyntheticOptions) -> None:
    unknown = [p for p in opts.placements if p not in PLACEMENTS]
    if unknown:
        raise ValueError(f"unknown placement(s) {', '.join(unknown)}: use {', '.join(PLACEMENTS)}")
    if not opts.alphas or any(not 0.0 <= a <= 1.0 for a in opts.alphas):
        raise ValueError(f"synthetic acceptance rates must be in [0, 1], e.g. 0.6,0.7,0.8,0.9: got {opts.alphas}")


def _skip_reason(name: str, opts: SyntheticOptions, left: float | None) -> str | None:
    """Why a placement does not start with `left` seconds to the deadline (None: it starts)."""
    if left is not None and left <= 0:
        return f"{name}: not run (the deadline passed)"
    if name == "stack" and left is not None and left < opts.stack_min_s:
        return (f"stack: not run ({left:.0f} s left, under the {opts.stack_min_s:.0f} s its replicas need to load "
                f"the {opts.shapes} pair)")
    return None


async def _run_placement(name: str, pair: Pair, pv, pv_dir, opts: SyntheticOptions, prompts, deadline, log,
                         notes: list[str], runs: list[Run]) -> None:
    left = None if deadline is None else deadline - time.monotonic()
    if (why := _skip_reason(name, opts, left)) is not None:
        notes.append(why)
        return
    max_context = opts.prompt_len + opts.max_new_tokens + REFERENCE_MARGIN + 64
    t0, place = time.monotonic(), None
    try:
        if name == "in-process":
            place = _InProcess(pair, SyntheticSpec(0.0), pv, max_context)
        else:  # the pair saved for the replicas first (random weights: written once, on first use)
            place = _Stack(pair, SyntheticSpec(0.0), pv_dir, opts, max_context, min(600.0, left or 600.0))
            await place.start()
        log(f"{LABEL}: {name} ready in {time.monotonic() - t0:.1f} s")
        await _placement(place, opts, prompts, configs(opts), deadline, log, notes, runs)
    except Exception as e:  # noqa: BLE001 - the other placement's rows still stand; the note says why
        if name == "in-process" or not opts.keep_going:
            raise
        notes.append(f"stack: failed ({type(e).__name__}: {str(e)[:300]})")
    finally:
        if place is not None:
            await place.close()
        del place
        if opts.device.startswith("cuda"):  # the in-process engine's KV and graph pools, before the replicas
            torch.cuda.empty_cache()


async def _run_async(opts: SyntheticOptions, log, deadline: float | None) -> dict:
    from specdec.common.threads import set_thread_count

    _check(opts)
    set_thread_count(1)  # the engine's calls run on this thread, as each replica's on its one thread
    pacer = bool({"pacer", "pacer_pearl"} & set(opts.modes))
    notes = [f"{LABEL}: the draft proposes the target's next greedy token with probability α (module docstring of "
             "specdec_bench/synthetic.py); outputs are checked against ar's"]
    if pacer:
        notes.append("pacer, pacer_pearl: an untrained pre-verifier with random weights (its stops are arbitrary: "
                     "these rows time the modes' machinery, not a trained pre-verifier's gains)")
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="specdec-synthetic-") as tmp:
        root = Path(tmp)
        t0 = time.monotonic()
        pair = Pair(opts.shapes, opts.device, root)
        log(f"{LABEL}: pair built in {time.monotonic() - t0:.1f} s: {pair.describe()}")
        prompts = random_prompts(opts.n_prompts, opts.prompt_len, pair.vocab_size, opts.seed)
        pv, pv_dir = _random_preverifier(pair, root) if pacer else (None, None)
        for name in opts.placements:
            await _run_placement(name, pair, pv, pv_dir, opts, prompts, deadline, log, notes, runs)
        described = pair.describe()
    return {"pair": described, "notes": notes, "rows": aggregate(runs, opts)}


def run_synthetic(opts: SyntheticOptions, log=print, deadline: float | None = None) -> dict:
    """The benchmark (the module docstring): {"pair": ..., "notes": [...], "rows": [...]}, a row per (placement,
    α, configuration). `deadline` (time.monotonic()): nothing starts after it."""
    return asyncio.run(_run_async(opts, log, deadline))


def _first_tolerance(alpha: float, n: int) -> float:
    """Three standard deviations of a first-token acceptance measured over n blocks, plus 0.02."""
    return 3.0 * math.sqrt(alpha * (1.0 - alpha) / n) + 0.02 if n else float("inf")


def aggregate(runs: list[Run], opts: SyntheticOptions) -> list[dict]:
    """A row per (placement, α, configuration): tokens/s (median), ×ar (median of the ratios to `ar` on the same
    prompt, repeat and α), acceptance measured next to what α implies, and whether every output equalled ar's."""
    rows = []
    order = {c: i for i, c in enumerate(configs(opts))}
    keys = sorted(dict.fromkeys((r.placement, r.alpha, r.cfg) for r in runs),
                  key=lambda k: (PLACEMENTS.index(k[0]), k[1], order.get(k[2], len(order))))
    base = {(r.placement, r.alpha, r.prompt, r.rep): r for r in runs if r.cfg.mode == "ar"}
    for place, alpha, cfg in keys:
        rs = [r for r in runs if (r.placement, r.alpha, r.cfg) == (place, alpha, cfg)]
        tps = [r.tokens / r.wall_s for r in rs if r.wall_s > 0]
        ratios = [(r.tokens / r.wall_s) / (b.tokens / b.wall_s) for r in rs
                  if (b := base.get((r.placement, r.alpha, r.prompt, r.rep))) is not None and r.wall_s > 0
                  and b.wall_s > 0]
        tot = {k: sum(r.stats.get(k, 0) for r in rs) for k in rs[0].stats}
        row = {"section": LABEL, "placement": place, "alpha": alpha, "mode": cfg.mode, "gamma": cfg.gamma,
               "config": cfg.label, "requests": len(rs), "tokens": sum(r.tokens for r in rs),
               "tokens_per_s": statistics.median(tps) if tps else 0.0,
               "x_ar": statistics.median(ratios) if ratios else None,
               "exact": all(r.exact for r in rs), "mismatches": sum(not r.exact for r in rs),
               "tokens_per_target_forward": (sum(r.tokens for r in rs) / tot["target_forwards"]
                                             if tot.get("target_forwards") else None), **tot}
        if cfg.mode != "ar":
            v, d = tot.get("verified_draft_tokens", 0), tot.get("drafts", 0)
            row["acceptance"] = tot["accepted_tokens"] / v if v else None
            row["first_token_acceptance"] = tot["first_accepted"] / d if d else None
            row["expected_first_token_acceptance"] = alpha
            row["first_token_tolerance"] = _first_tolerance(alpha, d)
            row["expected_acceptance"] = expected_acceptance(alpha, cfg.gamma) if cfg.mode == "sd" else None
        rows.append(row)
    return rows


def acceptance_matches(rows: list[dict]) -> bool:
    """Every speculative row's first-token acceptance within its tolerance of α (three standard deviations)."""
    spec = [r for r in rows if r["mode"] != "ar" and r.get("first_token_acceptance") is not None]
    return bool(spec) and all(abs(r["first_token_acceptance"] - r["alpha"]) <= r["first_token_tolerance"]
                              for r in spec)


def _f(v, fmt: str) -> str:
    return "–" if v is None else format(v, fmt)


def markdown(result: dict, meta: dict | None = None) -> str:
    """The table, labelled synthetic acceptance: per placement and α, each configuration's tokens/s and ×ar, the
    acceptance measured (per drafted token, and of each block's first token) next to what α implies."""
    rows = result["rows"]
    pair = result.get("pair", {})
    lines = [f"**{LABEL.capitalize()}** ({pair.get('shapes', '?')} pair on {pair.get('device', '?')}): the draft "
             "proposes the target's next greedy token with probability α; not a trained draft's acceptance.", "",
             "| placement | α | mode | tokens/s | ×ar | accepted / drafted (expected) | first token accepted "
             "(α) | tokens per target forward | output = ar |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        acc = "" if r["mode"] == "ar" else (f"{_f(r.get('acceptance'), '.3f')} "
                                            f"({_f(r.get('expected_acceptance'), '.3f')})")
        first = "" if r["mode"] == "ar" else f"{_f(r.get('first_token_acceptance'), '.3f')} ({r['alpha']:g})"
        lines.append(f"| {r['placement']} | {r['alpha']:g} | {r['config']} | {r['tokens_per_s']:.1f} | "
                     f"{_f(r['x_ar'], '.2f')} | {acc} | {first} | {_f(r['tokens_per_target_forward'], '.2f')} | "
                     f"{'yes' if r['exact'] else 'NO (%d)' % r['mismatches']} |")
    lines += [""] + [f"- {n}" for n in result.get("notes", ())]
    m = (meta or {}).get("machine")
    if m:
        lines += ["", f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores, torch {m.get('torch', '?')}, "
                      f"{m.get('date_utc', '')}; `{(meta or {}).get('command', '')}`"]
    return "\n".join(lines)
