"""`python -m draft_service` / `python -m target_service` entry-point helper."""
from __future__ import annotations

import asyncio
import logging
import os

from specdec.common.errors import SpecDecError
from specdec.common.threads import orchestrator_threads
from specdec_rpc.logs import configure_logging
from specdec_rpc.settings import startup_warnings

log = logging.getLogger("specdec_rpc")


async def _exit_with_parent(app, parent_pid: int, every_s: float = 1.0) -> None:
    """Shut `app` down once `parent_pid` is no longer our parent (it died: we were re-parented)."""
    while os.getppid() == parent_pid:
        await asyncio.sleep(every_s)
    log.warning("parent process %d is gone: shutting down", parent_pid)
    await app.shutdown()


def service_name(settings) -> str:
    """draft, target or coordinator: the process's settings prefix, as JSON log lines name it."""
    return settings.model_config.get("env_prefix", "").rstrip("_").lower()


def run_service(build_app, settings) -> None:
    """settings: a parsed ServerSettings; build_app(settings) -> ServerApp (async, inside the loop)."""
    configure_logging(settings.log_level, settings.log_format, service_name(settings))
    orchestrator_threads()  # the event loop only translates; the model thread computes with settings.threads

    for warning in startup_warnings(settings):
        log.warning("%s", warning)

    async def _main():
        try:
            app = await build_app(settings)
            await app.start()
        except (SpecDecError, ValueError, FileNotFoundError, RuntimeError) as e:
            # what the operator can fix (a model config it cannot serve, a missing file, a port in use): one line
            log.error("cannot start: %s", e)
            raise SystemExit(1) from None
        watch = (asyncio.ensure_future(_exit_with_parent(app, settings.exit_with_parent))
                 if settings.exit_with_parent else None)
        try:
            await app.run_until_signal()
        finally:
            if watch is not None:
                watch.cancel()

    asyncio.run(_main())
