"""Soak the embedded stack with a random mix of requests, cancels and deadlines; check every answer and the
replicas' state afterwards.

    python scripts/soak.py --seconds 600 --clients 6

Each client loops: a random prompt (HumanEval + chat), mode (ar, sd, pacer, pearl, pacer_pearl), temperature (0 or
1 with one of two seeds), length, gamma, spec_off_batch and pearl_overlap, as a unary `Generate` or a
`GenerateStream`; some requests get a short deadline, some streams are dropped by the client after a few messages.
A share of the requests (`--http-share`) goes to the OpenAI-compatible HTTP API instead (/v1/completions with the
prompt's token ids, whole or streamed; a deadline is the client giving up, a drop is the client hanging up).
Checked:
- every greedy answer equals the prefix of target-only greedy decoding (`ar`, alone) of that prompt (lossless); a
  share of them (`--penalty-share`) carries penalties and is checked against `ar` with the same penalties, and
  another (`--json-share`) asks for a JSON object (structured output) and is checked against `ar` asking the same.
  With `--dtype float32` a difference is a failure. In bf16 (`auto`) a logit depends slightly on how many rows
  its forward has, so under concurrent load a greedy near-tie may resolve differently than alone, in every mode
  including `ar` (docs/guide/features.md, "Precision, weights and kernels"): differences are counted, with the
  position of the first;
- sampled answers with the same prompt, mode, seed and request fields are compared on their common prefix and
  the pairs that differ are counted (reported, not a failure: a seed fixes each draw by position and purpose, but
  which positions get a draft token depends on load and timing; see docs/api/grpc.md, "Seeds and reproducibility");
- a stream's concatenated deltas equal its token ids; a fifth of the requests ask for logprobs (one per token); over HTTP, greedy text equals the decoded `ar` prefix of the
  answer's length, streamed or whole; a share of the unary greedy HTTP requests (`--batch-share`) sends two
  prompts in one request and both answers are checked; every unary HTTP request sends an X-Request-Id and checks
  it comes back in the header and the answer's id;
- no status but OK, DEADLINE_EXCEEDED and CANCELLED (RESOURCE_EXHAUSTED is counted apart: a full queue);
- every prompt is also sent behind one shared ~380-token prefix (`--no-shared-prefix`: not), so sessions reuse
  prompt chunks from the prefix cache, live and ended sessions' alike; their greedy answers are checked the same way;
- afterwards, both replicas hold no session (`specdec_sessions_active`) and report no queued call; replica memory
  (RSS) at the start, every `--rss-every` seconds, and at the end.
Exits 1 when a check fails.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import sys
import time

import grpc
import httpx
from concurrency_probe import scrape

from coordinator.stack import LocalStack
from specdec.common.defaults import DEFAULT_DRAFT, DEFAULT_TARGET
from specdec.decoding.preverifier import default_preverifier_dir
from specdec.modeling.hub import resolve_model
from specdec.text.tokenizer import load_tokenizer
from specdec_bench.prompts import Prompt, load_prompt_sets
from specdec_rpc.pb import generation_pb2, generation_pb2_grpc

MODES = ["ar", "sd", "pacer", "pearl", "pacer_pearl"]
# a share of the greedy requests carry these (specdec/decoding/penalties.py); checked against `ar` with the same
PENALTIES = {"presence_penalty": 0.5, "frequency_penalty": 0.25, "repetition_penalty": 1.25}
# a long system prompt every prompt is also sent behind (the prefix cache's hits; `--no-shared-prefix`: not)
SHARED_PREFIX = (
    "You are the support assistant of Northwind Outfitters, an online shop for hiking, camping and climbing gear. "
    "Follow these rules in every answer. Be friendly and brief: at most four sentences unless the customer asks "
    "for detail. Never invent order numbers, tracking codes, prices or stock levels; if the customer needs one, "
    "tell them where to find it in their account. Returns: unused items can be returned within 60 days with the "
    "receipt, used items within 30 days if they failed in normal use; the customer prints a free label from the "
    "Orders page. Refunds go back to the original payment method within 5 business days of the item arriving at "
    "our warehouse. Exchanges for another size are free and ship as soon as the return is scanned by the carrier. "
    "Shipping: standard delivery takes 3 to 5 business days and is free above 50 dollars; express takes 1 to 2 "
    "business days and costs 15 dollars; we ship to the United States and Canada only. Warranty: tents, packs and "
    "sleeping bags carry a lifetime warranty against defects in materials and workmanship; footwear and apparel "
    "carry one year. Damage from accidents, animals or fire is not covered, but our repair service can often fix "
    "it for a flat fee. Safety: for questions about climbing protection, ropes, harnesses or avalanche gear, give "
    "general information only and always recommend instruction from a certified guide; never tell a customer that "
    "a piece of gear is safe for a specific route or condition. Sizing: point customers to the size chart on each "
    "product page and mention that boots run half a size small. If the customer is upset, apologise once, then "
    "focus on what we can do. If a question is outside these topics, say that you can only help with Northwind "
    "orders and gear, and suggest contacting the team at the help center for anything else.")


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def variant(r) -> str:
    """Which `ar` reference a greedy request must equal: "penalties", "json" (structured output) or "" (plain)."""
    return "penalties" if r.presence_penalty else "json" if r.HasField("structured_output") else ""


class Soak:
    def __init__(self, stub, prompts, refs, args, http=None, tok=None):
        self.stub, self.prompts, self.refs, self.args = stub, prompts, refs, args
        # `ar` answers per prompt, by variant: "" plain, "penalties" with PENALTIES, "json" as a JSON object
        # (structured output); main sets them
        self.refs_by = {"": refs, "penalties": refs, "json": refs}
        self.http, self.tok = http, tok
        self.codes = collections.Counter()
        self.kinds = collections.Counter()
        self.failures: list[str] = []
        self.sampled: dict[tuple, list[int]] = {}
        self.greedy_diff = collections.Counter()  # (prompt, first differing token) -> answers
        self.http_greedy_diff = collections.Counter()  # prompt -> HTTP greedy texts unlike ar's
        self.same_seed = collections.Counter()  # True: a same-seed pair agreed on its common prefix
        self.tokens = 0
        self.preemptions = collections.Counter()  # by priority: sessions given up to higher priorities

    def request(self, rng: random.Random):
        p = rng.randrange(len(self.prompts))
        mode = rng.choice(MODES)
        greedy = rng.random() < self.args.greedy_share
        r = generation_pb2.GenerateRequest(prompt_token_ids=self.prompts[p].ids, mode=mode,
                                           max_new_tokens=rng.randint(4, self.args.max_new_tokens),
                                           temperature=0.0 if greedy else 1.0, top_k=0,
                                           seed=0 if greedy else rng.choice([11, 12]))
        if mode != "ar" and rng.random() < 0.5:
            r.gamma = rng.randint(1, 8)
        if rng.random() < 0.3:
            r.spec_off_batch = rng.choice([0, 2, 4])
        if "pearl" in mode and rng.random() < 0.3:
            r.pearl_overlap = "always"
        if rng.random() < 0.2:
            r.logprobs = rng.randint(0, 3)
        if rng.random() < self.args.priority_share:  # full pools: the urgent ones preempt the batch ones
            r.priority = rng.choice([-1, 5])
        if greedy and rng.random() < self.args.penalty_share:
            for name, value in PENALTIES.items():
                setattr(r, name, value)
        elif greedy and rng.random() < self.args.json_share:
            r.structured_output.json_object = True
        key = (p, mode, r.seed, r.gamma if r.HasField("gamma") else None, r.pearl_overlap,
               r.spec_off_batch if r.HasField("spec_off_batch") else None)
        return p, r, key

    def check(self, p: int, r, key, ids: list[int], what: str) -> None:
        self.tokens += len(ids)
        if r.temperature == 0:
            ref = self.refs_by[variant(r)][p][:len(ids)]
            if ids != ref:
                first = next(i for i, (a, b) in enumerate(zip(ids + [-1], ref + [-2])) if a != b)
                self.greedy_diff[(p, first)] += 1
                if self.args.dtype == "float32":
                    self.failures.append(f"{what} {r.mode} greedy prompt {p}: differs from ar at token {first}")
            return
        seen = self.sampled.setdefault(key, ids)
        n = min(len(seen), len(ids))
        if seen is not ids:
            self.same_seed[seen[:n] == ids[:n]] += 1
        if len(ids) > len(seen):
            self.sampled[key] = ids

    async def one(self, rng: random.Random) -> None:
        p, r, key = self.request(rng)
        stream = rng.random() < 0.5
        deadline = rng.uniform(0.2, 3.0) if rng.random() < self.args.deadline_share else None
        drop_after = rng.randint(1, 4) if stream and rng.random() < self.args.drop_share else None
        kind = (f"{'stream' if stream else 'unary'}{'+deadline' if deadline else ''}{'+drop' if drop_after else ''}"
                f"{'+' + variant(r) if variant(r) else ''}")
        if self.http is not None and rng.random() < self.args.http_share:
            # a share of the unary greedy ones carry a second prompt (a list of prompts: two choices to check)
            other = (rng.randrange(len(self.prompts)) if r.temperature == 0 and not stream
                     and rng.random() < self.args.batch_share else None)
            kind = "http " + kind + ("+2 prompts" if other is not None else "")
            self.kinds[kind] += 1
            return await self.one_http(p, r, stream, deadline, drop_after, kind, other, f"soak-{rng.getrandbits(32)}")
        self.kinds[kind] += 1
        try:
            if not stream:
                resp = await self.stub.Generate(r, timeout=deadline or 600)
                self.check(p, r, key, list(resp.token_ids), kind)
                self.preemptions[r.priority] += resp.stats.preemptions
                if r.HasField("logprobs") and not (len(resp.logprobs.logprobs) == len(resp.logprobs.top)
                                                   == len(resp.token_ids)):
                    self.failures.append(f"{kind} {r.mode}: {len(resp.logprobs.logprobs)} logprobs for "
                                         f"{len(resp.token_ids)} tokens")
            else:
                call = self.stub.GenerateStream(r, timeout=deadline or 600)
                ids, n = [], 0
                async for m in call:
                    ids += list(m.token_ids)
                    n += 1
                    self.preemptions[r.priority] += m.stats.preemptions
                    if drop_after is not None and n >= drop_after:
                        call.cancel()
                        self.codes["CANCELLED (client)"] += 1
                        return
                self.check(p, r, key, ids, kind)
            self.codes["OK"] += 1
        except grpc.aio.AioRpcError as e:
            code = e.code().name
            self.codes[code] += 1
            if e.code() not in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
                                grpc.StatusCode.RESOURCE_EXHAUSTED):
                self.failures.append(f"{kind} {r.mode}: {code} {e.details()}")
        except asyncio.CancelledError:
            self.codes["CANCELLED (client)"] += 1

    async def one_http(self, p: int, r, stream: bool, deadline, drop_after, kind: str, other: int | None = None,
                       request_id: str = "") -> None:
        """`other`: a second prompt sent in the same request; `request_id`: sent as X-Request-Id, checked echoed."""
        body = {"prompt": list(r.prompt_token_ids), "max_tokens": r.max_new_tokens, "temperature": r.temperature,
                "seed": r.seed, "mode": r.mode, "stream": stream}
        if other is not None:
            body["prompt"] = [body["prompt"], list(self.prompts[other].ids)]
        if r.HasField("logprobs"):
            body["logprobs"] = r.logprobs
        if r.presence_penalty:
            body.update(PENALTIES)
        if variant(r) == "json":
            body["structured_outputs"] = {"json_object": True}
        for f in ("gamma", "spec_off_batch"):
            if r.HasField(f):
                body[f] = getattr(r, f)
        if r.pearl_overlap:
            body["pearl_overlap"] = r.pearl_overlap
        if stream:
            body["stream_options"] = {"include_usage": True}
        text, n = "", None
        try:
            async with asyncio.timeout(deadline or 600):
                if not stream:
                    resp = await self.http.post("/v1/completions", json=body, headers={"X-Request-Id": request_id})
                    if not self._http_ok(resp, kind):
                        return
                    js = resp.json()
                    if resp.headers.get("x-request-id") != request_id or js["id"] != f"cmpl-{request_id}":
                        self.failures.append(f"{kind}: request id {request_id} came back as "
                                             f"{resp.headers.get('x-request-id')} / {js['id']}")
                    text, n = js["choices"][0]["text"], js["choices"][0]["stats"]["completion_tokens"]
                    if other is not None:
                        second = js["choices"][1]
                        self._check_text(other, r, second["text"], second["stats"]["completion_tokens"], kind)
                else:
                    async with self.http.stream("POST", "/v1/completions", json=body) as resp:
                        if not self._http_ok(resp, kind, await resp.aread() if resp.status_code != 200 else b""):
                            return
                        chunks = 0
                        async for line in resp.aiter_lines():
                            if not line.startswith("data: {"):
                                continue
                            ev = json.loads(line[6:])
                            if "error" in ev:
                                self.failures.append(f"{kind} {r.mode}: error event {ev['error']}")
                                return
                            if ev.get("usage"):
                                n = ev["usage"]["completion_tokens"]
                            if ev["choices"]:
                                text += ev["choices"][0]["text"]
                                chunks += 1
                            if drop_after is not None and chunks >= drop_after:
                                self.codes["http hung up (client)"] += 1
                                return
        except TimeoutError:
            self.codes["http deadline (client)"] += 1
            return
        self.codes["http 200"] += 1
        if n is None:
            self.failures.append(f"{kind} {r.mode}: no usage in the answer")
        else:
            self._check_text(p, r, text, n, kind)

    def _check_text(self, p: int, r, text: str, n: int, kind: str) -> None:
        self.tokens += n
        if r.temperature == 0:
            ref = self.tok.decode(self.refs_by[variant(r)][p][:n], skip_special_tokens=True)
            if text != ref:
                self.http_greedy_diff[p] += 1
                if self.args.dtype == "float32":
                    self.failures.append(f"{kind} {r.mode} greedy prompt {p}: text differs from ar's")

    def _http_ok(self, resp, kind: str, body: bytes = b"") -> bool:
        if resp.status_code == 200:
            return True
        self.codes[f"http {resp.status_code}"] += 1
        if resp.status_code != 429:
            self.failures.append(f"{kind}: HTTP {resp.status_code} {body[:300] or resp.text[:300]}")
        return False

    async def client(self, seed: int, until: float) -> None:
        rng = random.Random(seed)
        while time.monotonic() < until:
            await self.one(rng)


async def main(args) -> int:
    tdir = resolve_model(DEFAULT_TARGET)
    tok = load_tokenizer(tdir)
    prompts = load_prompt_sets(tok, ["humaneval", "chat"], args.n_prompts)
    if not args.no_shared_prefix:  # each prompt again behind one long shared prefix: the prefix cache's hits
        shared = [int(t) for t in tok(SHARED_PREFIX + "\n\n")["input_ids"]]
        prompts += [Prompt(p.prompt_set, p.key + "+shared", shared + p.ids) for p in prompts]
    stack = LocalStack(str(tdir), str(resolve_model(DEFAULT_DRAFT)), default_preverifier_dir(DEFAULT_DRAFT), threads=1,
                       ray_cpus=2, pipelines=2, max_sessions=args.max_sessions, metrics=True,
                       dtype=args.dtype, http_port=0 if args.http_share > 0 else None)
    await stack.start()

    http = (httpx.AsyncClient(base_url=stack.http_address, timeout=600,
                              limits=httpx.Limits(max_connections=4 * args.clients))
            if stack.http_address else None)
    channel = grpc.aio.insecure_channel(stack.address)
    stub = generation_pb2_grpc.GenerationServiceStub(channel)
    pids = {p.args[2]: p.pid for p in stack.procs}
    failures: list[str] = []
    try:
        refs = []
        for pr in prompts:  # target-only greedy references (also warms both replicas up)
            resp = await stub.Generate(generation_pb2.GenerateRequest(
                prompt_token_ids=pr.ids, mode="ar", max_new_tokens=args.max_new_tokens, temperature=0.0))
            refs.append(list(resp.token_ids))
        refs_by = {"": refs, "penalties": [], "json": []}
        for pr in prompts:  # the same with the penalties, and as JSON objects
            for name, kw in (("penalties", PENALTIES),
                             ("json", {"structured_output": generation_pb2.StructuredOutput(json_object=True)})):
                resp = await stub.Generate(generation_pb2.GenerateRequest(
                    prompt_token_ids=pr.ids, mode="ar", max_new_tokens=args.max_new_tokens, temperature=0.0, **kw))
                refs_by[name].append(list(resp.token_ids))
        rss0 = {k: rss_mb(v) for k, v in pids.items()}
        soak = Soak(stub, prompts, refs, args, http, load_tokenizer(tdir))
        soak.refs_by = refs_by
        t0 = time.monotonic()
        series = {k: [] for k in pids}  # RSS every --rss-every seconds: growth that goes on is a leak

        async def sample_rss():
            while True:
                for k, v in pids.items():
                    series[k].append(round(rss_mb(v)))
                await asyncio.sleep(args.rss_every)

        sampler = asyncio.ensure_future(sample_rss())
        await asyncio.gather(*(soak.client(args.seed + i, t0 + args.seconds) for i in range(args.clients)))
        sampler.cancel()
        wall = time.monotonic() - t0
        await asyncio.sleep(args.settle_s)  # cancelled sessions end; idle ones are reaped by then at the latest
        state = {}
        for kind, port in stack.metrics_ports.items():
            for name in ("specdec_sessions_active", "specdec_queue_depth", "specdec_prefix_cache_hits_total",
                         "specdec_prefix_cache_queries_total"):
                for sample, v in scrape(port, name).items():
                    state[f"{kind} {sample}"] = v
                    if v != 0 and "prefix_cache" not in name:  # counters, reported
                        failures.append(f"{kind} replica: {sample} = {v} after the soak")
        rss1 = {k: rss_mb(v) for k, v in pids.items()}
        failures = soak.failures + failures
        report = {"seconds": round(wall, 1), "clients": args.clients, "requests": sum(soak.codes.values()),
                  "tokens": soak.tokens, "codes": dict(soak.codes), "kinds": dict(soak.kinds),
                  "greedy_differs_from_ar": {f"prompt {p} at token {i}": n
                                             for (p, i), n in sorted(soak.greedy_diff.items())},
                  "http_greedy_text_differs_from_ar": {f"prompt {p}": n
                                                       for p, n in sorted(soak.http_greedy_diff.items())},
                  "same_seed_pairs": {"agreed": soak.same_seed[True], "differed": soak.same_seed[False]},
                  "preemptions_by_priority": dict(soak.preemptions),
                  "replica_state": state,
                  "rss_mb_start": {k: round(v) for k, v in rss0.items()},
                  "rss_mb_end": {k: round(v) for k, v in rss1.items()}, "rss_mb_series": series,
                  "failures": failures[:50]}
        print(json.dumps(report, indent=1))
    finally:
        if http is not None:
            await http.aclose()
        await channel.close()
        await stack.stop()
    return 1 if failures else 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=300)
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--max-sessions", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--n-prompts", type=int, default=4, help="per prompt set")
    ap.add_argument("--no-shared-prefix", action="store_true",
                    help="without the copies of every prompt behind one shared ~380-token prefix (prefix cache hits)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                    help="the replicas' dtype; float32 makes a greedy difference from ar a failure")
    ap.add_argument("--greedy-share", type=float, default=0.7)
    ap.add_argument("--deadline-share", type=float, default=0.15)
    ap.add_argument("--drop-share", type=float, default=0.2, help="of streams: dropped after 1-4 messages")
    ap.add_argument("--http-share", type=float, default=0.3, help="of requests: sent to the HTTP API")
    ap.add_argument("--penalty-share", type=float, default=0.2,
                    help="of greedy requests: with presence, frequency and repetition penalties")
    ap.add_argument("--batch-share", type=float, default=0.3,
                    help="of the unary greedy HTTP requests: a list of two prompts, both answers checked")
    ap.add_argument("--priority-share", type=float, default=0.3,
                    help="of requests: priority -1 or 5 (the rest 0), so that waiting ones preempt running ones")
    ap.add_argument("--json-share", type=float, default=0.15,
                    help="of greedy requests without penalties: structured output, a JSON object")
    ap.add_argument("--settle-s", type=float, default=3.0)
    ap.add_argument("--rss-every", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=0)
    sys.exit(asyncio.run(main(ap.parse_args())))
