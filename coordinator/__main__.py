"""python -m coordinator [--draft-dns H:P | --draft-endpoints A,B] [--target-dns ... ] [--host H --port N]"""
from __future__ import annotations

import sys

from coordinator.server import build_coordinator
from specdec_rpc.main import run_service

from coordinator.config import CoordinatorSettings


async def _build(settings):
    app, _ = await build_coordinator(settings)
    return app


def main(argv: list[str] | None = None) -> None:
    run_service(_build, CoordinatorSettings.from_cli(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
