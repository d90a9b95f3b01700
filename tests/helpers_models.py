"""Tiny random model pairs for coordinator/CLI tests, and loopback draft/target servers built around them."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from specdec.modeling.model import CausalLM
from specdec_bench.tiny import build_tiny_model, save_model  # noqa: F401 - the tests import them from here

VOCAB = 32


def tiny_pair(vocab: int = VOCAB, logit_scale: float = 1.0):
    """(target, draft): different random weights, same vocabulary, so drafts are sometimes rejected."""
    target = build_tiny_model(vocab_size=vocab, seed=1, logit_scale=logit_scale)
    draft = build_tiny_model(vocab_size=vocab, hidden_size=16, num_layers=1, seed=2, logit_scale=logit_scale)
    return target, draft


def target_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Target-only greedy decode without caches (the reference every mode must reproduce)."""
    ids = list(prompt)
    kv = model.new_kv_slots(1, len(prompt) + n + 8)
    with torch.no_grad():
        for _ in range(n):
            toks = torch.tensor([ids])
            logits, _ = model(toks, torch.arange(len(ids))[None], torch.tensor([0]), kv)
            ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt):]


async def start_replica(kind: str, model, host: str = "127.0.0.1", port: int = 0, **kw):
    """A real DraftService/TargetService on loopback (in this process). Returns the started ServerApp."""
    common = dict(host=host, port=port, metrics_port=kw.pop("metrics_port", 0),
                  max_sessions=kw.pop("max_sessions", 32),
                  grace_s=kw.pop("grace_s", 0.5), log_level="WARNING")
    if kind == "draft":
        from draft_service.config import DraftSettings
        from draft_service.server import build_app

        pv = kw.pop("preverifier", None)
        if pv == "random":  # an untrained pre-verifier: changes draft lengths, never the output
            from specdec.decoding.preverifier import build_random_preverifier

            pv = build_random_preverifier(model.config.hidden_size, seed=5, block_size=2, threshold=0.5)
        app = await build_app(DraftSettings(**common, **kw), model=model, preverifier=pv, warmup=False)
    else:
        from target_service.config import TargetSettings
        from target_service.server import build_app

        app = await build_app(TargetSettings(**common, **kw), model=model, warmup=False)
    await app.start()
    app.endpoint = f"{host}:{app.port}"
    return app


async def start_coordinator(target_endpoint: str, draft_endpoint: str = "", **settings):
    """A started coordinator without Ray or a tokenizer (token-id prompts) over the given replicas, in this process;
    `settings` are CoordinatorSettings fields (grace_s 0 unless given)."""
    from coordinator.config import CoordinatorSettings
    from coordinator.server import build_coordinator

    s = CoordinatorSettings(**{"host": "127.0.0.1", "port": 0, "metrics_port": 0, "ray": False, "tokenizer": "",
                               "grace_s": 0, "log_level": "WARNING", "draft_endpoints": draft_endpoint,
                               "target_endpoints": target_endpoint, **settings})
    app, _ = await build_coordinator(s, tokenizer=None, eos_token_ids=set())
    await app.start()
    return app


TOKENIZER_CHARS = "<abcdefghijklmnopqrstuvwxyz .,!?"  # 32 symbols: id i is TOKENIZER_CHARS[i]; 0 is <unk>


def tiny_tokenizer(chars: str = TOKENIZER_CHARS):
    """A character-level fast tokenizer: id i is chars[i], and id 0 is <unk>."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(chars) if i}
    vocab["<unk>"] = 0
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    return tk


def save_tiny_tokenizer(path: Path) -> Path:
    """The character-level tokenizer over TOKENIZER_CHARS, so text prompts work with tiny models."""
    path.mkdir(parents=True, exist_ok=True)
    tiny_tokenizer().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                            "unk_token": "<unk>"}))
    return path


def save_tiny_pair(root: Path, with_tokenizer: bool = True) -> tuple[Path, Path]:
    """(target_dir, draft_dir) of `tiny_pair()` on disk; the target also gets the tiny tokenizer."""
    target, draft = tiny_pair()
    tdir, ddir = save_model(target, root / "target"), save_model(draft, root / "draft")
    if with_tokenizer:
        save_tiny_tokenizer(tdir)
    return tdir, ddir


async def stream_killing_the_pinned_target(stub, request, r1, r2, after: int):
    """GenerateStream `request`, shutting down whichever of the target replicas r1, r2 holds its session once
    `after` tokens have arrived. → (token ids, the last response)."""
    ids, last = [], None
    async for part in stub.GenerateStream(request):
        ids.extend(part.token_ids)
        last = part
        if len(ids) >= after and not r1.draining and not r2.draining:
            await (r1 if len(r1.host.table) else r2).shutdown(0)  # the pinned replica dies mid-request
    return ids, last


def sessions_then_block(model: CausalLM, rows: int):
    """Prefill three sessions of different lengths (slots 2, 0, 3; 9, 17, 12 tokens), then one batched forward of
    `rows` rows each and the middle session's block alone. → (batched logits, alone logits, the KV slots)."""
    gen = torch.Generator().manual_seed(3)
    kv = model.new_kv_slots(4, 64)
    slots, lengths = torch.tensor([2, 0, 3]), [9, 17, 12]
    for slot, n in zip(slots.tolist(), lengths):
        model(torch.randint(0, 97, (1, n), generator=gen), torch.arange(n)[None], torch.tensor([slot]), kv)
    tokens = torch.randint(0, 97, (3, rows), generator=gen)
    positions = torch.stack([torch.arange(n, n + rows) for n in lengths])
    batched, _ = model(tokens, positions, slots, kv)
    single, _ = model(tokens[1:2], positions[1:2], slots[1:2], kv)
    return batched, single, kv
