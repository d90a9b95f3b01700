"""`specdec batch`: run a file of OpenAI Batch API requests (vLLM's `run_batch`), through the embedded stack or a
running server's HTTP API, and write one result line per request.

    specdec batch -i requests.jsonl -o results.jsonl [--concurrency 16] [--url http://host:8000] [model flags]

Each input line is `{"custom_id": ..., "method": "POST", "url": "/v1/chat/completions" | "/v1/completions" |
"/v1/responses", "body": {...}}`; each output line is OpenAI's batch output,
`{"id": "batch_req_...", "custom_id": ..., "response": {"status_code", "request_id", "body"}, "error": null}`, in
the input's order. A request the server refuses keeps its status and error body in `response`; a line that is not
a request (bad JSON, another url, a streamed body, a repeated custom_id) gets `error` and no `response`, and the
batch goes on. At most `--concurrency` requests are in flight (they batch on the target as concurrent clients do).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from pathlib import Path

import httpx
from tqdm import tqdm

from coordinator.config import CoordinatorSettings
from specdec.scheduling.request import MODES
from specdec_cli.options import add_model_options, apply_speculative_config, default_preverifier, resolve_models, \
    settings_option

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
MAX_LINE_BYTES = 1 << 24


def parse_line(text: str, seen: set[str]) -> dict:
    """One input line → the request, or raises ValueError saying what is wrong with it."""
    if len(text) > MAX_LINE_BYTES:
        raise ValueError(f"the line has {len(text)} bytes; at most {MAX_LINE_BYTES}")
    try:
        req = json.loads(text)
    except ValueError as e:
        raise ValueError(f"not JSON: {e}") from None
    if not isinstance(req, dict) or not isinstance(req.get("custom_id"), str) or not req["custom_id"]:
        raise ValueError("each line needs a custom_id (a non-empty string)")
    if req["custom_id"] in seen:
        raise ValueError(f"custom_id {req['custom_id']!r} is used by an earlier line; custom_ids must be unique")
    seen.add(req["custom_id"])
    if req.get("method", "POST") != "POST":
        raise ValueError(f"method {req.get('method')!r}: only POST")
    if req.get("url") not in URLS:
        raise ValueError(f"url {req.get('url')!r}: one of {', '.join(URLS)}")
    if not isinstance(req.get("body"), dict):
        raise ValueError("body: the request body, an object")
    if req["body"].get("stream"):
        raise ValueError("body.stream: a batch request is answered whole; leave stream out")
    return req


def result_line(custom_id: str | None, status: int | None = None, body=None, request_id: str = "",
                error: str | None = None) -> dict:
    out = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None, "error": None}
    if error is not None:
        out["error"] = {"code": "invalid_request" if status is None else "request_failed", "message": error}
    else:
        out["response"] = {"status_code": status, "request_id": request_id, "body": body}
    return out


async def run_batch(lines: list[str], post, concurrency: int, write, progress=None) -> dict:
    """Answer every line: `post(url, body)` → (status, body, request id) sends one request; `write(result)` gets
    the results in the input's order. → counts: ok, failed (HTTP status >= 400), invalid (not a request)."""
    seen: set[str] = set()
    results: list[dict | None] = [None] * len(lines)
    done = asyncio.Event()
    counts = {"ok": 0, "failed": 0, "invalid": 0}
    gate = asyncio.Semaphore(concurrency)
    flushed = 0

    def finish(i: int, result: dict) -> None:
        nonlocal flushed
        results[i] = result
        while flushed < len(results) and results[flushed] is not None:
            write(results[flushed])
            results[flushed] = {}  # written: keep the slot filled, drop the body
            flushed += 1
        if progress is not None:
            progress(1)
        if flushed == len(results):
            done.set()

    async def one(i: int, req: dict) -> None:
        async with gate:
            try:
                status, body, rid = await post(req["url"], req["body"])
            except Exception as e:  # noqa: BLE001 - a transport failure fails this line, not the batch
                counts["failed"] += 1
                return finish(i, result_line(req["custom_id"], 0, error=f"{type(e).__name__}: {e}"))
        counts["ok" if status < 400 else "failed"] += 1
        finish(i, result_line(req["custom_id"], status, body, rid))

    tasks = []
    for i, text in enumerate(lines):
        try:
            req = parse_line(text, seen)
        except ValueError as e:
            counts["invalid"] += 1
            custom_id = None
            try:
                custom_id = json.loads(text).get("custom_id")
            except (ValueError, AttributeError):
                pass
            finish(i, result_line(custom_id if isinstance(custom_id, str) else None, error=str(e)))
            continue
        tasks.append(asyncio.ensure_future(one(i, req)))
    if lines:
        await asyncio.gather(*tasks)
        await done.wait()
    return counts


def http_poster(client):
    """post(url, body) over an httpx.AsyncClient."""
    async def post(url: str, body: dict):
        resp = await client.post(url, json=body)
        try:
            payload = resp.json()
        except ValueError:
            payload = {"error": {"message": resp.text[:1000]}}
        return resp.status_code, payload, resp.headers.get("x-request-id", "")
    return post


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="specdec batch", description=__doc__.split("\n\n")[0])
    ap.add_argument("-i", "--input", required=True, help="requests, one JSON object per line ('-': stdin)")
    ap.add_argument("-o", "--output", required=True, help="results, one JSON object per line ('-': stdout)")
    ap.add_argument("--concurrency", type=int, default=16, help="requests in flight at once (default: 16)")
    ap.add_argument("--url", default="", help="a running server's HTTP API (e.g. http://127.0.0.1:8000); "
                                              "default: start the embedded stack with the model flags below")
    ap.add_argument("--api-key", default="", help="the server's API key (COORDINATOR_HTTP_API_KEY), with --url")
    settings_option(ap, CoordinatorSettings, "default_mode", "--default-mode", choices=list(MODES),
                    text="the embedded stack's mode for requests that name none; ar without a draft")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default: 600)")
    add_model_options(ap, positional=False)
    settings_option(ap, CoordinatorSettings, "ray_num_cpus", "--ray-cpus")
    return ap


async def _main(args) -> int:
    text = sys.stdin.read() if args.input == "-" else Path(args.input).read_text()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    out = sys.stdout if args.output == "-" else Path(args.output).open("w")
    t0 = time.perf_counter()

    async def run(url: str) -> dict:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        async with httpx.AsyncClient(base_url=url, timeout=args.timeout, headers=headers,
                                     limits=httpx.Limits(max_connections=args.concurrency)) as client:
            with tqdm(total=len(lines), unit="req", file=sys.stderr, disable=None) as bar:
                return await run_batch(lines, http_poster(client), args.concurrency,
                                       lambda r: (out.write(json.dumps(r) + "\n"), out.flush()), bar.update)

    try:
        if args.url:
            counts = await run(args.url.rstrip("/"))
        else:
            from coordinator.stack import LocalStack  # lazy: the embedded stack loads torch (~2 s); --url needs none

            async with LocalStack(args.target, args.draft, default_preverifier(args) if args.draft else None,
                                  threads=args.threads, ray_cpus=args.ray_num_cpus, max_sessions=args.max_sessions,
                                  max_context=args.max_context, dtype=args.dtype, http_port=0,
                                  prompt_lookup_min_ngram=args.prompt_lookup_min_ngram,
                                  default_mode=args.default_mode if args.draft else "ar",
                                  target_options={"device": args.devices["target"]},
                                  draft_options={"device": args.devices["draft"]}) as stack:
                counts = await run(stack.http_address)
    finally:
        if out is not sys.stdout:
            out.close()
    print(f"{len(lines)} requests in {time.perf_counter() - t0:.1f} s: {counts['ok']} answered, "
          f"{counts['failed']} failed, {counts['invalid']} not requests", file=sys.stderr)
    return 0 if counts["failed"] == counts["invalid"] == 0 else 2


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.concurrency < 1:
        print("error: --concurrency must be >= 1", file=sys.stderr)
        return 1
    try:
        apply_speculative_config(args, ap, list(argv or sys.argv[1:]))
        args.model = None
        args.target, args.draft, args.devices, args.threads = resolve_models(args)
        return asyncio.run(_main(args))
    except KeyboardInterrupt:
        return 130
    except (OSError, TimeoutError, RuntimeError, ValueError) as e:  # a missing file, a server that is not there
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
