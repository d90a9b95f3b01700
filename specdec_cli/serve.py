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
from specdec.common.defaults import COORDINATOR_HTTP_PORT, COORDINATOR_METRICS_PORT, DRAFT_METRICS_PORT, \
    TARGET_METRICS_PORT
from specdec.scheduling.request import MODES
from specdec_cli.options import add_config_option, add_model_options, apply_speculative_config, config_argv, \
    deprecated, resolve_models, settings_option
from specdec_rpc.logs import configure_logging

log = logging.getLogger("specdec.serve")


assert (DRAFT_METRICS_PORT, TARGET_METRICS_PORT) == (COORDINATOR_METRICS_PORT + 1, COORDINATOR_METRICS_PORT + 2)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="specdec serve", description="Serve a target model, sped up by a draft model, on this machine: "
        "gRPC (specdec.v1.GenerationService) and an OpenAI-compatible HTTP API.")
    add_model_options(ap)
    add_config_option(ap)

    sp = ap.add_argument_group("speculation (server-wide; a request's own fields override them)")
    settings_option(sp, CoordinatorSettings, "default_mode", "--speculative-mode", "--default-mode", choices=list(MODES),
         note="ar without a draft")
    settings_option(sp, CoordinatorSettings, "gamma", "--num-speculative-tokens", "--gamma")
    settings_option(sp, CoordinatorSettings, "verify_method", "--verify-method")
    settings_option(sp, CoordinatorSettings, "pacer_threshold", "--pacer-threshold", type=float)
    settings_option(sp, CoordinatorSettings, "pacer_post_threshold", "--pacer-post-threshold")
    settings_option(sp, CoordinatorSettings, "spec_off_batch", "--spec-off-batch")
    settings_option(sp, CoordinatorSettings, "data_plane", "--data-plane")

    lim = ap.add_argument_group("limits")
    settings_option(lim, CoordinatorSettings, "max_new_tokens_cap", "--max-new-tokens-cap")
    settings_option(lim, CoordinatorSettings, "queue_wait_s", "--queue-wait-s")
    settings_option(lim, CoordinatorSettings, "max_waiting", "--max-waiting")
    settings_option(lim, CoordinatorSettings, "http_max_in_flight", "--http-max-in-flight")

    net = ap.add_argument_group("front doors and operations")
    settings_option(net, CoordinatorSettings, "host", "--host")
    settings_option(net, CoordinatorSettings, "http_port", "--port", default=COORDINATOR_HTTP_PORT,
         text="the OpenAI-compatible HTTP API's port (0: no HTTP API)")
    settings_option(net, CoordinatorSettings, "port", "--grpc-port", text="the gRPC port of specdec.v1.GenerationService")
    deprecated(net, "--http-port", "--port", "http_port", type=int)
    settings_option(net, CoordinatorSettings, "metrics_port", "--metrics-port",
         note="the coordinator's; the draft replica serves its own on the next port and the target replica on "
              "the one after (0: none)")
    settings_option(net, CoordinatorSettings, "api_key", "--api-key", note="unset: SPECDEC_API_KEY")
    settings_option(net, CoordinatorSettings, "served_model_name", "--served-model-name")
    settings_option(net, CoordinatorSettings, "grace_s", "--grace-s", note="the replicas' drain too")
    settings_option(net, CoordinatorSettings, "log_level", "--log-level", type=str.upper,
         choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    settings_option(net, CoordinatorSettings, "log_format", "--log-format", note="every process's")
    settings_option(net, CoordinatorSettings, "otlp_traces_endpoint", "--otlp-traces-endpoint",
         text="export OpenTelemetry traces of every process (the coordinator's request spans, the replicas' prefill, "
              "draft, verify and batching spans) to this OTLP/gRPC endpoint, e.g. http://otel-collector:4317 ('': "
              "no tracing)")
    settings_option(net, CoordinatorSettings, "tool_call_parser", "--tool-call-parser")
    settings_option(net, CoordinatorSettings, "reasoning_parser", "--reasoning-parser")
    settings_option(net, CoordinatorSettings, "ray_num_cpus", "--ray-cpus")
    settings_option(net, CoordinatorSettings, "pipelines", "--pipelines")
    net.add_argument("--emulate-rtt-ms", type=float, default=0.0, metavar="MS",
                     help="a test and planning aid: delay every link between the three processes (coordinator to "
                          "target, coordinator to draft, draft to target) by a network round trip of MS "
                          "milliseconds, through a delay relay process per link (specdec_rpc/netem.py), as if the "
                          "pools ran on separate machines; never for production traffic (default: %(default)s, "
                          "no relays)")
    return ap


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line, after the options of its --config file and with --speculative-config applied."""
    parser = build_parser()
    argv = config_argv(parser, argv)
    args = parser.parse_args(argv)
    apply_speculative_config(args, parser, argv)
    return args


def _env_api_key() -> str:
    from specdec.common import settings  # SPECDEC_API_KEY, read once with the core's other switches

    return settings.get().api_key


class ServePlan(typing.NamedTuple):
    """What `serve` starts: the models and LocalStack's arguments."""

    target: str
    draft: str | None
    stack: dict


def plan(args: argparse.Namespace) -> ServePlan:
    """The parsed options → the models and LocalStack's keyword arguments (no process started)."""
    from specdec.decoding.preverifier import default_preverifier_dir  # lazy: imports torch only when serving

    target, draft, devices, threads = resolve_models(args)
    mode = args.default_mode
    if draft is None and mode != "ar":
        mode = "ar"
    if not args.emulate_rtt_ms >= 0:
        raise ValueError(f"--emulate-rtt-ms {args.emulate_rtt_ms}: must be 0 (no emulated network) or more")
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

    args = parse_args(argv)
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
