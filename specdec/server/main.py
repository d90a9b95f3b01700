"""`python -m draft_service` / `python -m target_service` entry-point helper."""
from __future__ import annotations

import asyncio
import logging


def run_service(build_app, settings) -> None:
    """settings: a parsed ServerSettings; build_app(settings) -> ServerApp (async, inside the loop)."""
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    async def _main():
        app = await build_app(settings)
        await app.start()
        await app.run_until_signal()

    asyncio.run(_main())
