"""`specdec serve TARGET [--draft DRAFT]`: the whole stack on one machine, started as operators start vLLM or TGI.

One target replica and one draft replica (subprocesses, each on its own device), a local Ray instance and the
coordinator with its gRPC and OpenAI-compatible HTTP front doors. Every option's default and help come from the
settings class of the process it configures (coordinator/config.py, draft_service/config.py,
target_service/config.py, specdec_rpc/settings.py): `serve` and the services started on their own read the same
fields, so a value documented for one is the value of the other. The few defaults that differ are the ones a
one-machine server needs, and the help says so: the HTTP API is on (port 8000), and torch's threads are split
between the two replicas.

    specdec serve                                   the embedded default pair on this CPU
    specdec serve ./Llama-3.1-8B-Instruct --draft ./Llama-3.2-1B-Instruct --target-device cuda:0 --draft-device cuda:1
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import typing

from coordinator.config import CoordinatorSettings
from draft_service.config import DraftSettings
from specdec.defaults import COORDINATOR_HTTP_PORT, COORDINATOR_METRICS_PORT, DEFAULT_DRAFT, DEFAULT_TARGET, \
    DRAFT_METRICS_PORT, TARGET_METRICS_PORT
from specdec.request import MODES
from specdec_rpc.logs import configure_logging
from specdec_rpc.settings import DEVICE, DTYPES, ServerSettings
from target_service.config import TargetSettings

log = logging.getLogger("specdec.serve")


def _opt(group, cls, field: str, *flags: str, default=None, note: str = "", text: str | None = None, **kw) -> None:
    """An option whose default and help are the settings field's (`default`, `note`, `text`: serve's own)."""
    info = cls.model_fields[field]
    value = info.default if default is None else default
    if "choices" not in kw and typing.get_origin(info.annotation) is typing.Literal:
        kw["choices"] = list(typing.get_args(info.annotation))
    if "type" not in kw and "choices" not in kw and value is not None and not isinstance(value, bool):
        kw["type"] = type(value)
    if "choices" not in kw:
        kw.setdefault("metavar", flags[0].lstrip("-").replace("-", "_").upper())
    text = ((info.description or "") if text is None else text).replace("%", "%%")
    text = f"{text}{'; ' if text and note else ''}{note}".strip()
    group.add_argument(*flags, dest=kw.pop("dest", field), default=value,
                       help=f"{text} (default: %(default)s)" if text else "(default: %(default)s)", **kw)


assert (DRAFT_METRICS_PORT, TARGET_METRICS_PORT) == (COORDINATOR_METRICS_PORT + 1, COORDINATOR_METRICS_PORT + 2)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="specdec serve", description="Serve a target model, sped up by a draft model, on this machine: "
        "gRPC (specdec.v1.GenerationService) and an OpenAI-compatible HTTP API.")
    ap.add_argument("model", nargs="?", default=None, metavar="TARGET",
                    help=f"the target model: a local Hugging Face directory, a .gguf file, a hub id (from the local "
                         f"cache) or {DEFAULT_TARGET} (default: {DEFAULT_TARGET})")
    ap.add_argument("--target-model", dest="target_option", default=None, metavar="TARGET",
                    help="the target model, as an option (the same as TARGET)")

    m = ap.add_argument_group("models and devices")
    m.add_argument("--draft", "--draft-model", dest="draft", default=None,
                   help=f"the draft model, of the target's tokenizer (default: {DEFAULT_DRAFT} with "
                        f"{DEFAULT_TARGET}; with any other target, none: name one, or the server is target-only)")
    m.add_argument("--no-draft", action="store_true", help="serve target-only (every request runs as `ar`)")
    m.add_argument("--preverifier", default=None,
                   help="PACER pre-verifier directory of the draft (default: the shipped one with the shipped draft)")
    _opt(m, ServerSettings, "device", "--device", note="both models, unless --target-device / --draft-device")
    m.add_argument("--target-device", default=None, help="the target's device (default: --device)")
    m.add_argument("--draft-device", default=None, help="the draft's device (default: --device)")
    _opt(m, ServerSettings, "dtype", "--dtype", choices=list(DTYPES))
    _opt(m, TargetSettings, "max_context", "--max-model-len", "--max-context")
    _opt(m, ServerSettings, "threads", "--threads",
         text="torch intra-op threads of each replica (0: the CPU's cores split between the replicas on the CPU)")
    _opt(m, DraftSettings, "prompt_lookup_min_ngram", "--prompt-lookup-min-ngram")

    sp = ap.add_argument_group("speculation (server-wide; a request's own fields override them)")
    _opt(sp, CoordinatorSettings, "default_mode", "--speculative-mode", "--default-mode", choices=list(MODES),
         note="ar without a draft")
    _opt(sp, CoordinatorSettings, "gamma", "--num-speculative-tokens", "--gamma")
    _opt(sp, CoordinatorSettings, "verify_method", "--verify-method")
    _opt(sp, CoordinatorSettings, "pacer_threshold", "--pacer-threshold", type=float)
    _opt(sp, CoordinatorSettings, "pacer_post_threshold", "--pacer-post-threshold")
    _opt(sp, CoordinatorSettings, "spec_off_batch", "--spec-off-batch")
    _opt(sp, CoordinatorSettings, "data_plane", "--data-plane")

    lim = ap.add_argument_group("limits")
    _opt(lim, ServerSettings, "max_sessions", "--max-num-seqs", "--max-sessions",
         note="per replica; KV memory for all of them (and max-model-len positions each) is allocated at start")
    _opt(lim, CoordinatorSettings, "max_new_tokens_cap", "--max-new-tokens-cap")
    _opt(lim, CoordinatorSettings, "queue_wait_s", "--queue-wait-s")
    _opt(lim, CoordinatorSettings, "max_waiting", "--max-waiting")
    _opt(lim, CoordinatorSettings, "http_max_in_flight", "--http-max-in-flight")

    net = ap.add_argument_group("front doors and operations")
    _opt(net, CoordinatorSettings, "host", "--host")
    _opt(net, CoordinatorSettings, "port", "--port")
    _opt(net, CoordinatorSettings, "http_port", "--http-port", default=COORDINATOR_HTTP_PORT,
         note="serve's default: on")
    _opt(net, CoordinatorSettings, "metrics_port", "--metrics-port",
         note="the coordinator's; the draft replica serves its own on the next port and the target replica on "
              "the one after (0: none)")
    _opt(net, CoordinatorSettings, "api_key", "--api-key", note="unset: SPECDEC_API_KEY")
    _opt(net, CoordinatorSettings, "served_model_name", "--served-model-name")
    _opt(net, CoordinatorSettings, "grace_s", "--grace-s", note="the replicas' drain too")
    _opt(net, CoordinatorSettings, "log_level", "--log-level", type=str.upper,
         choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    _opt(net, CoordinatorSettings, "log_format", "--log-format", note="every process's")
    _opt(net, CoordinatorSettings, "otlp_traces_endpoint", "--otlp-traces-endpoint",
         text="export OpenTelemetry traces of every process (the coordinator's request spans, the replicas' prefill, "
              "draft, verify and batching spans) to this OTLP/gRPC endpoint, e.g. http://otel-collector:4317 ('': "
              "no tracing)")
    _opt(net, CoordinatorSettings, "tool_call_parser", "--tool-call-parser")
    _opt(net, CoordinatorSettings, "reasoning_parser", "--reasoning-parser")
    _opt(net, CoordinatorSettings, "ray_num_cpus", "--ray-cpus")
    _opt(net, CoordinatorSettings, "pipelines", "--pipelines")
    net.add_argument("--emulate-rtt-ms", type=float, default=0.0, metavar="MS",
                     help="a test and planning aid: delay every link between the three processes (coordinator to "
                          "target, coordinator to draft, draft to target) by a network round trip of MS "
                          "milliseconds, through a delay relay process per link (specdec_rpc/netem.py), as if the "
                          "pools ran on separate machines; never for production traffic (default: %(default)s, "
                          "no relays)")
    return ap


def _env_api_key() -> str:
    from specdec import settings  # SPECDEC_API_KEY, read once with the core's other switches

    return settings.get().api_key


class ServePlan(typing.NamedTuple):
    """What `serve` starts: the models and LocalStack's arguments."""

    target: str
    draft: str | None
    stack: dict


def plan(args: argparse.Namespace) -> ServePlan:
    """The parsed options → the models and LocalStack's keyword arguments (no process started)."""
    from specdec.preverifier import default_preverifier_dir  # lazy: imports torch only when serving

    if args.model and args.target_option and args.model != args.target_option:
        raise ValueError(f"two targets named: {args.model} and --target-model {args.target_option}; name one")
    target = args.model or args.target_option or DEFAULT_TARGET
    if args.no_draft and args.draft:
        raise ValueError("--no-draft and --draft both given; name a draft or none")
    draft = None if args.no_draft else args.draft or (DEFAULT_DRAFT if target == DEFAULT_TARGET else None)
    mode = args.default_mode
    if draft is None and mode != "ar":
        mode = "ar"
    devices = {"target": args.target_device or args.device, "draft": args.draft_device or args.device}
    for flag, value in (("--device", args.device), ("--target-device", args.target_device),
                        ("--draft-device", args.draft_device)):
        if value is not None and not DEVICE.match(value):
            raise ValueError(f"{flag} {value}: use cpu, cuda or cuda:N")
    if not args.emulate_rtt_ms >= 0:
        raise ValueError(f"--emulate-rtt-ms {args.emulate_rtt_ms}: must be 0 (no emulated network) or more")
    threads = args.threads
    if threads == 0:  # replicas on the CPU share its cores
        on_cpu = [k for k in (("target", "draft") if draft else ("target",)) if devices[k] == "cpu"]
        threads = max(1, (os.cpu_count() or 2) // max(1, len(on_cpu)))
    metrics = args.metrics_port
    every = {"log_format": args.log_format, "otlp_traces_endpoint": args.otlp_traces_endpoint}  # all 3 processes
    stack = dict(
        preverifier=(args.preverifier or default_preverifier_dir(draft)) if draft else None,
        host=args.host, port=args.port, threads=threads, ray_cpus=args.ray_num_cpus, pipelines=args.pipelines,
        quiet=False, max_sessions=args.max_sessions, max_context=args.max_context, dtype=args.dtype,
        prompt_lookup_min_ngram=args.prompt_lookup_min_ngram, http_port=args.http_port or None,
        default_mode=mode, tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
        max_new_tokens_cap=args.max_new_tokens_cap, grace_s=args.grace_s, log_level=args.log_level,
        emulate_rtt_ms=args.emulate_rtt_ms,
        coordinator_options=dict(
            metrics_port=metrics, api_key=args.api_key or _env_api_key(), gamma=args.gamma, verify_method=args.verify_method,
            pacer_threshold=args.pacer_threshold, pacer_post_threshold=args.pacer_post_threshold,
            spec_off_batch=args.spec_off_batch, data_plane=args.data_plane, queue_wait_s=args.queue_wait_s,
            max_waiting=args.max_waiting,
            http_max_in_flight=args.http_max_in_flight, **every,
            **({"served_model_name": args.served_model_name} if args.served_model_name else {})),
        # the ports of the processes' own defaults (9400, 9401, 9402) follow the same rule
        target_options={"device": devices["target"], "metrics_port": metrics + 2 if metrics else 0, **every},
        draft_options={"device": devices["draft"], "metrics_port": metrics + 1 if metrics else 0, **every})
    return ServePlan(target, draft, stack)


def main(argv: list[str]) -> int:
    from coordinator.stack import LocalStack  # lazy: the embedded stack imports the coordinator and Ray

    args = build_parser().parse_args(argv)
    p = plan(args)
    configure_logging(args.log_level, args.log_format, service="coordinator")  # the coordinator runs here
    if p.draft is None and not args.no_draft:
        log.warning("no draft model: serving %s target-only (every request runs as ar); name one with --draft",
                    p.target)

    async def run():
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        async with LocalStack(p.target, p.draft, **p.stack) as stack:
            # after the stack's ray.init: Ray installs abseil's failure handler for SIGTERM, which then ran before
            # ours, armed a 3 s abort and crashed the drain (SIGSEGV); ours replaces it
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
            http = f", OpenAI-compatible HTTP on {args.host}:{stack.app.http_port}" if stack.app.http_port else ""
            draft = f"draft {p.draft}" if p.draft else "no draft"
            print(f"specdec serving specdec.v1.GenerationService on {args.host}:{stack.app.port}{http} "
                  f"(target {p.target}, {draft}; model id {stack.settings.model_name()}); Ctrl-C stops", flush=True)
            await stop.wait()
            log.info("stopping: draining requests in flight (grace %.1fs)", args.grace_s)

    asyncio.run(run())
    return 0
