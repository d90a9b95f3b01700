"""`specdec` command line: `serve` (the whole stack on one machine) and `generate` (one request).

    specdec serve [TARGET] [--draft P] [--device D] [...]   (specdec_cli.serve: `specdec serve --help`)
    specdec generate "PROMPT" [--mode M] [--json] [--coordinator ADDR | --in-process]
    specdec bench [...]              (specdec_bench)
    specdec batch -i IN -o OUT       (specdec_cli.batch: a file of OpenAI Batch API requests)
    specdec distill-draft [...]      (specdec_train.distill: rebuild the default draft)
    specdec train-preverifier [...]  (specdec_train.preverifier: rebuild the PACER pre-verifier)

Without `--coordinator`, `generate` starts the embedded stack (draft and target replicas on loopback with
`--threads` torch threads each, a local Ray instance, the coordinator), generates, and stops it. The shells
(grpc, ray, coordinator) are imported lazily so `specdec --help` stays fast.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from specdec import __version__

from specdec.common import settings
from coordinator.config import CoordinatorSettings
from specdec.common.defaults import DEFAULT_TARGET
from specdec.common.errors import SpecDecError
from specdec.scheduling.request import MODES
from specdec.text.tokenizer import IncrementalDetokenizer, decode, encode_prompt, eos_token_ids, load_tokenizer
from specdec_cli.options import add_config_option, add_model_options, apply_speculative_config, config_argv, \
    default_preverifier, resolve_models, settings_option



def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="specdec", description="Disaggregated speculative decoding.")
    ap.add_argument("--version", action="version", version=f"specdec {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("serve", help="serve TARGET with a draft on this machine: gRPC and an OpenAI-compatible HTTP "
                                 "API (`specdec serve --help`)", add_help=False)
    sub.add_parser("bench", help="run the benchmark suite (`specdec bench --help`)", add_help=False)
    sub.add_parser("batch", help="answer a file of OpenAI Batch API requests (`specdec batch --help`)",
                   add_help=False)
    sub.add_parser("distill-draft", help="distill a draft from the target (`specdec distill-draft --help`)",
                   add_help=False)
    sub.add_parser("train-preverifier", help="train the PACER pre-verifier (`specdec train-preverifier --help`)",
                   add_help=False)
    g = sub.add_parser("generate", help="generate a continuation of PROMPT (with TARGET, or the default pair)",
                       usage="specdec generate [options] [TARGET] PROMPT")
    g.add_argument("words", nargs="+", metavar="[TARGET] PROMPT",
                   help="the target model (as `specdec serve` takes it; default: the default pair) and the prompt "
                        "text (wrapped in the chat template when the model has one)")
    g.add_argument("--mode", choices=MODES, default=None,
                   help="default: sd with a draft, ar without one")
    g.add_argument("--gamma", type=int, default=None,
                   help="sd: draft length (default 4); pacer: max draft length (default 8); "
                        "pearl modes: the window (default 8)")
    g.add_argument("--block-size", type=int, default=None,
                   help="PACER block size (default: the pre-verifier's trained B)")
    g.add_argument("--pacer-threshold", type=float, default=None)
    g.add_argument("--verify-method", choices=("token", "block"), default="block")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--logprobs", type=int, default=None, metavar="K",
                   help="with --json: each token's logprob under the target, with K top alternatives (0-20)")
    so = g.add_mutually_exclusive_group()  # structured output (specdec/text/grammar.py)
    so.add_argument("--json-schema", default=None, metavar="SCHEMA",
                    help="the answer is JSON following this schema (JSON text, or @file)")
    so.add_argument("--json-object", action="store_true", help="the answer is a JSON object")
    so.add_argument("--regex", default=None, help="the answer matches this regex")
    so.add_argument("--choice", action="append", default=None, help="the answer is one of these (repeatable)")
    so.add_argument("--grammar", default=None, metavar="LARK", help="the answer follows this Lark grammar (or @file)")
    g.add_argument("--json", action="store_true", help="print one JSON object (text, token_ids, finish_reason, "
                                                       "stats, and logprobs with --logprobs)")
    g.add_argument("--coordinator", default=None, help="host:port of a running coordinator")
    g.add_argument("--api-key", default=settings.get().api_key,
                   help="with --coordinator: its COORDINATOR_API_KEY (default: $SPECDEC_API_KEY)")
    g.add_argument("--in-process", action="store_true", help="run specdec.engine.Engine in this process")
    g.add_argument("--timeout", type=float, default=None, help="request deadline in seconds")
    add_model_options(g, positional=False)
    settings_option(g, CoordinatorSettings, "ray_num_cpus", "--ray-cpus")
    add_config_option(g)
    return ap


def parse_generate(argv: list[str]) -> argparse.Namespace:
    """`generate`'s command line, with its --config file and --speculative-config applied, the positional words
    split into TARGET and PROMPT, and the models resolved as `serve` resolves them (specdec_cli/options.py)."""
    ap = build_parser()
    g = ap._subparsers._group_actions[0].choices["generate"]
    argv = ["generate", *config_argv(g, argv[1:])]
    args = ap.parse_args(argv)
    apply_speculative_config(args, g, argv, rename={"default_mode": "mode"})
    if len(args.words) > 2:
        g.error(f"{len(args.words)} words where [TARGET] PROMPT was expected: quote the prompt")
    args.model, args.prompt = (None, *args.words) if len(args.words) == 1 else args.words
    args.target, args.draft, args.devices, args.threads = resolve_models(args)
    if args.mode is None:
        args.mode = "sd" if args.draft else "ar"
    elif args.mode != "ar" and args.draft is None:
        raise ValueError(f"--mode {args.mode} needs a draft of {args.target}: name one with --draft (the default "
                         f"draft pairs with {DEFAULT_TARGET} only), or use --mode ar")
    return args


# ---- output ---------------------------------------------------------------------------------------------------
def stats_line(st: dict, n_tokens: int) -> str:
    wall = st.get("wall_s") or 0.0
    busy = (st.get("draft_busy_s") or 0.0) + (st.get("target_busy_s") or 0.0)
    parts = [f"[{st.get('mode', '')}] {n_tokens} tokens in {wall:.2f}s"
             + (f" ({n_tokens / wall:.1f} tok/s)" if wall else ""),
             f"{st.get('rounds', 0)} rounds"
             + (f" ({st['sequential_rounds']} sequential)" if st.get("sequential_rounds") else "")
             + f", {st.get('target_forwards', 0)} target forwards, "
             f"{st.get('mean_accepted_length', 0.0):.2f} tokens/forward",
             f"busy: draft {st.get('draft_busy_s', 0.0):.2f}s + target {st.get('target_busy_s', 0.0):.2f}s"
             + (f" = {busy:.2f}s (wall {100 * wall / busy:.0f}% of it)" if busy else ""),
             f"network {st.get('network_s', 0.0):.2f}s"]
    if (st.get("queued_s") or 0.0) >= 0.01:  # waited for free replica sessions (a pool at capacity)
        parts.append(f"queued {st['queued_s']:.2f}s")
    return " | ".join(parts)


def _emit(out: dict, args, streamed: bool) -> None:
    if args.json:
        print(json.dumps(out, ensure_ascii=False))
        return
    if not streamed:
        sys.stdout.write(out["text"])
    sys.stdout.write("\n")
    print(stats_line(out["stats"], len(out["token_ids"])), flush=True)


# ---- generate -------------------------------------------------------------------------------------------------
def _request(args):
    # lazy: the gRPC client's stubs load only for a request
    from specdec.scheduling.request import mode_pair
    from specdec_rpc.pb import common_pb2, generation_pb2

    spec = common_pb2.Speculation(verify_method=f"VERIFY_METHOD_{args.verify_method.upper()}")
    if args.mode:  # unset: the coordinator's default mode
        stop, overlap = mode_pair(args.mode)
        spec.draft_stop, spec.overlap = f"DRAFT_STOP_{stop.name}", f"OVERLAP_{overlap.name}"
    sampling = common_pb2.SamplingParams(temperature=args.temperature, top_k=args.top_k, seed=args.seed)
    for part, names in ((spec, ("gamma", "block_size", "pacer_threshold")), (sampling, ("top_p", "logprobs"))):
        for name in names:
            if getattr(args, name) is not None:
                setattr(part, name, getattr(args, name))
    r = generation_pb2.GenerateRequest(prompt=args.prompt, max_new_tokens=args.max_new_tokens, stop=args.stop,
                                       sampling=sampling, speculation=spec)
    form = _structured(args)
    if form is not None:
        if form.kind == "choice":  # the proto's fields are named as the kinds
            r.structured_output.choice.choices.extend(args.choice)
        else:
            setattr(r.structured_output, form.kind, True if form.kind == "json_object" else form.value)
    return r


def _structured(args):
    """The --json-schema / --json-object / --regex / --choice / --grammar form, or None."""
    from specdec.text.grammar import StructuredOutput  # lazy: imports torch (~1.5 s)

    def text(v: str) -> str:
        if not v.startswith("@"):
            return v
        try:
            return Path(v[1:]).read_text()
        except OSError as e:
            raise FileNotFoundError(f"{v}: cannot read {v[1:]!r} ({e.strerror or e}); name a readable file after "
                                    f"@, or pass the text itself") from None

    if args.json_schema is not None:
        return StructuredOutput("json_schema", text(args.json_schema))
    if args.json_object:
        return StructuredOutput("json_object")
    if args.regex is not None:
        return StructuredOutput("regex", args.regex)
    if args.choice:
        return StructuredOutput("choice", json.dumps(args.choice))
    if args.grammar is not None:
        return StructuredOutput("grammar", text(args.grammar))
    return None


def _stats_dict(st) -> dict:
    """GenerationStats as JSON-ready values (repeated fields as lists)."""
    return {f.name: list(getattr(st, f.name)) if f.is_repeated else getattr(st, f.name)
            for f in st.DESCRIPTOR.fields}


async def _call(address: str, args) -> dict:
    # lazy: grpc, the stubs and the coordinator's servicer load only for a request
    import grpc

    from specdec_rpc.pb import generation_pb2_grpc
    from coordinator.grpc_api.service import FINISH_NAME

    async with grpc.aio.insecure_channel(address) as ch:
        stub = generation_pb2_grpc.GenerationServiceStub(ch)
        text, ids, out, lps = [], [], {}, []
        metadata = (("authorization", f"Bearer {args.api_key}"),) if args.api_key else None
        async for resp in stub.GenerateStream(_request(args), timeout=args.timeout, metadata=metadata):
            text.append(resp.text_delta)
            ids.extend(resp.token_ids)
            lps += [(lp, list(top.ids), list(top.logprobs)) for lp, top in zip(resp.logprobs.logprobs,
                                                                              resp.logprobs.top)]
            if not args.json and resp.text_delta:
                sys.stdout.write(resp.text_delta)
                sys.stdout.flush()
            if resp.finish_reason:
                out = {"finish_reason": FINISH_NAME.get(resp.finish_reason, "length"),
                       "stats": _stats_dict(resp.stats)}
        if args.logprobs is not None:
            out["logprobs"] = _logprobs_json(lps)
        return {"text": "".join(text), "token_ids": ids, **out}


def _logprobs_json(entries) -> list[dict]:
    return [{"logprob": lp, "top": [{"id": i, "logprob": v} for i, v in zip(ids, vals)]} for lp, ids, vals in entries]


async def _generate_remote(args) -> dict:
    if args.coordinator:
        return await _call(args.coordinator, args)
    from coordinator.stack import LocalStack  # lazy: the embedded stack imports torch and the coordinator

    draft = None if args.mode == "ar" else args.draft  # a target-only request starts no draft replica
    async with LocalStack(args.target, draft, default_preverifier(args) if draft else None, threads=args.threads,
                          ray_cpus=args.ray_num_cpus, max_sessions=args.max_sessions,
                          max_context=args.max_context, dtype=args.dtype,
                          prompt_lookup_min_ngram=args.prompt_lookup_min_ngram,
                          target_options={"device": args.devices["target"]},
                          draft_options={"device": args.devices["draft"]}) as stack:
        return await _call(stack.address, args)


def _generate_in_process(args) -> dict:
    # lazy: torch and the model code load only for --in-process
    from specdec.common.threads import orchestrator_threads
    from specdec.decoding.lookup import prompt_lookup
    from specdec.decoding.sampling import SamplingParams
    from specdec.engine import Engine
    from specdec.modeling.hub import resolve_model
    from specdec.modeling.model import load_model_dir
    from specdec.scheduling.request import GenerationRequest

    orchestrator_threads()  # 1 torch thread here: a sequential mode's worker calls run on this thread (engine.py)
    tdir = resolve_model(args.target)
    tok = load_tokenizer(tdir)
    if tok is None:
        raise SystemExit(f"error: {args.target} has no tokenizer; the CLI needs one for text prompts")
    draft = None
    pv = None
    if args.mode != "ar":
        draft = load_model_dir(resolve_model(args.draft), device=args.devices["draft"], dtype=args.dtype,
                               role="draft")
        pv_path = default_preverifier(args)
        if pv_path:
            from specdec.decoding.preverifier import load_preverifier

            pv = load_preverifier(pv_path, draft_model=draft)
    engine = Engine(load_model_dir(tdir, device=args.devices["target"], dtype=args.dtype, role="target"), draft,
                    preverifier=pv,
                    threads_per_model=args.threads, max_sessions=1, max_context=args.max_context,
                    lookup=prompt_lookup(args.prompt_lookup_min_ngram))
    ids = encode_prompt(tok, prompt=args.prompt)
    kw = {k: getattr(args, k) for k in ("gamma", "block_size", "pacer_threshold") if getattr(args, k) is not None}
    form = _structured(args)
    req = GenerationRequest(prompt_ids=ids, max_new_tokens=args.max_new_tokens, mode=args.mode,
                            verify_method=args.verify_method, eos_token_ids=tuple(sorted(eos_token_ids(tdir))),
                            params=SamplingParams(temperature=args.temperature, top_k=args.top_k,
                                                  top_p=args.top_p if args.top_p is not None else 1.0,
                                                  seed=args.seed, grammar=form.grammar() if form else "",
                                                  logprobs=args.logprobs if args.logprobs is not None else -1), **kw)
    detok = IncrementalDetokenizer(tok, prefix_ids=ids)

    def on_tokens(new, _logprobs=None):
        piece = detok.push(new)
        if piece and not args.json:
            sys.stdout.write(piece)
            sys.stdout.flush()
        return False

    try:
        res = engine.generate(req, on_tokens)
    finally:
        engine.close()
    tail = detok.flush()
    if tail and not args.json:
        sys.stdout.write(tail)

    out = {"text": decode(tok, res.token_ids), "token_ids": res.token_ids, "finish_reason": res.finish_reason,
           "stats": res.stats.to_dict()}
    if res.logprobs is not None:
        out["logprobs"] = _logprobs_json(res.logprobs)
    return out


def cmd_generate(args) -> int:
    _structured(args)  # a structured-output file that cannot be read is an error before any model or server starts
    if args.in_process:
        out = _generate_in_process(args)
    else:
        import grpc  # lazy: `specdec --help` loads no gRPC

        try:
            out = asyncio.run(_generate_remote(args))
        except grpc.aio.AioRpcError as e:
            print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    _emit(out, args, streamed=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # lazy: a subcommand's package (torch, transformers) loads only when that subcommand runs
    if argv[:1] == ["bench"]:  # its own parser: specdec_bench/cli.py
        from specdec_bench import main as bench_main

        return bench_main(argv[1:])
    if argv[:1] == ["serve"]:  # its own parser, built from the services' settings: specdec_cli/serve.py
        from specdec_cli.serve import main as serve_main

        return _reporting_errors(serve_main, argv[1:])
    if argv[:1] == ["batch"]:  # its own parser: specdec_cli/batch.py
        from specdec_cli.batch import main as batch_main

        return batch_main(argv[1:])
    if argv[:1] == ["distill-draft"]:  # pipelines with their own parsers
        from specdec_train.distill.__main__ import main as distill_main

        return distill_main(argv[1:]) or 0
    if argv[:1] == ["train-preverifier"]:
        from specdec_train.preverifier.__main__ import main as pacer_main

        return pacer_main(argv[1:]) or 0
    if argv[:1] != ["generate"]:  # --help, --version, or a usage error
        build_parser().parse_args(argv)
    return _reporting_errors(lambda: cmd_generate(parse_generate(argv)))


def _reporting_errors(command, *args) -> int:
    """Run a command; what the user can fix (a model that cannot load, a port in use, a bad value) is one line on
    stderr and exit status 1, not a traceback."""
    try:
        return command(*args)
    except KeyboardInterrupt:
        return 130
    except (SpecDecError, FileNotFoundError, TimeoutError, RuntimeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
